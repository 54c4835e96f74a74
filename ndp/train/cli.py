"""``ndp-train`` / ``python -m ndp.train``: parse flags/YAML/env, set up the process group, train.

Launch multi-process runs with torchrun, e.g.::

    torchrun --standalone --nproc-per-node 4 -m ndp.train --model tiny-llama --dp-shard 2 --cp 2
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import sys

import torch
import torch.distributed as dist

import ndp

from .config import parse_config
from .loop import resolve_device, train

logger = logging.getLogger("ndp.train")


def _init_process_group(device_type: str) -> bool:
    """Join the torchrun job when launched by one (backend from the device). Returns True if it did."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return False
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # On GPUs NCCL carries the tensors and gloo the small CPU-side exchanges (the per-call validity check
    # of the CP functions, metrics): a CPU exchange on an NCCL-only group would wait for the GPU each call.
    backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=int(os.environ.get("NDP_PG_TIMEOUT", "600")))
    dist.init_process_group(backend, timeout=timeout)
    return True


def main(argv=None) -> int:
    """Console entry point. Returns the process exit code."""
    logging.basicConfig(level=logging.INFO if int(os.environ.get("RANK", "0")) == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = parse_config(argv)
        cfg.check(world)  # every config error surfaces here, before any process-group work
    except (ValueError, OSError) as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"ndp-train: error: {e}", file=sys.stderr)
        return 2
    device = resolve_device(cfg.device)
    if device.type == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    owned = _init_process_group(device.type)
    ok = False
    try:
        try:
            res = train(cfg.replace(device=device.type))
        except (ValueError, OSError) as e:
            # Found after start-up (the model refused by ndp, the data, ...): the same on every rank, so one line
            # per job from rank 0 and exit 2 everywhere, not a traceback per rank.
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(f"ndp-train: error: {e}", file=sys.stderr)
            if owned:
                # Leave without the process group's teardown: gloo's C++ destructors abort a rank (SIGABRT)
                # whose peer already left, which turned this exit 2 into a signal on half the runs.
                _leave(2)
            return 2
        if (not dist.is_initialized() or dist.get_rank() == 0) and res.losses:
            n = len(res.losses)
            summary = {"steps": res.start_step + n, "final_loss": res.losses[-1],
                       "mean_tokens_per_s": sum(res.tokens_per_s) / n, "wall_time_s": res.wall_time,
                       "world_size": world, "parallel": cfg.parallel.__dict__, "init": cfg.init,
                       "param_bytes_per_rank": res.param_bytes_per_rank, "param_bytes_total": res.param_bytes_total}
            print("ndp-train summary: " + json.dumps(summary), flush=True)
        ok = True
    finally:
        if owned:
            # Every rank reaches teardown together (a gloo rank that leaves first can abort its peers);
            # a rank that failed does not wait for peers that may never arrive.
            ndp.shutdown(barrier=ok)
    if owned:
        # After a clean teardown the interpreter's exit can still run gloo's static destructors, which abort a
        # rank now and then (torch 2.13: "terminate called without an active exception", SIGABRT after a
        # finished run, seen in CI): the job's work is done and written, so leave without them.
        _leave(0)
    return 0


def _leave(code: int):
    """Exit the process now, output flushed, without the interpreter's teardown (see `main`)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
