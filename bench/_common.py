"""What the benchmark scripts share beyond bench_cp's timer: the repository on sys.path, jobs of spawned ranks
(gloo, or nccl on GPUs) that hand one JSON result back, a process's peak memory, torchrun jobs, JSON results, and
the parallel configs the plan checks measure (plan_memory.py, plan_time.py, plan_terms.py)."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import bench_cp  # noqa: E402  (end_rank: how a benchmark's rank leaves its process group)

CONFIGS = {   # name -> ParallelismConfig fields (world 2 and 4)
    "dp_shard2": dict(dp_shard_size=2),
    "tp2": dict(tp_size=2),
    "cp2_ring": dict(cp_size=2),
    "cp2_ulysses": dict(cp_size=2, cp_impl="ulysses"),
    "cp2_allgather": dict(cp_size=2, cp_impl="allgather"),
    "dp_replicate2": dict(dp_replicate_size=2),
    "dp_shard2_cp2": dict(dp_shard_size=2, cp_size=2),
    "cp2_tp2": dict(cp_size=2, tp_size=2),
}


def config_names(text: str, extra=()) -> tuple[str, ...]:
    """A comma-separated ``--configs`` value: names of CONFIGS (or of ``extra``)."""
    names = tuple(n for n in text.split(",") if n)
    bad = [n for n in names if n not in CONFIGS and n not in extra]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown configs {bad}; known: {sorted(CONFIGS) + list(extra)}")
    return names


def write_json(path, obj, indent=None) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=indent)


def write_results(out_dir, stem, result) -> None:
    """A script's results as ``<out_dir>/<stem>.json``."""
    os.makedirs(out_dir, exist_ok=True)
    write_json(os.path.join(out_dir, f"{stem}.json"), result, indent=1)


def markdown_table(header, rows) -> str:
    """A markdown table: the `header` cells, a separator, then one line per row of formatted cells."""
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def parser(doc) -> argparse.ArgumentParser:
    """The command line the plan checks share: described by ``doc``'s first line, --out (the results' directory)
    and --model (an ndp.train preset)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--model", default="small-llama")
    return ap


def spawn_json(worker, nprocs, *args):
    """Run ``worker(rank, tmp, out_file, *args)`` in ``nprocs`` spawned processes and return the JSON one of them
    wrote to ``out_file``; ``tmp`` is a fresh directory (the job's rendezvous file lives there)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(worker, args=(tmp, out) + args, nprocs=nprocs, join=True)
        with open(out) as f:
            return json.load(f)


def rank_job(rank, world, tmp, out_file, body, timeout_s=120, device_type="cpu") -> None:
    """One rank of a spawn_json job: one thread (as a rank of a CPU job runs), the process group over a file
    rendezvous in ``tmp`` (gloo; nccl on ``cuda:<rank>`` for device_type "cuda"), then ``body()``; rank 0 writes
    what it returns to ``out_file``."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"file://{tmp}/rdzv", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    ok = False
    try:
        res = body()
        if rank == 0:
            write_json(out_file, res)
        ok = True
    finally:
        bench_cp.end_rank(ok)


def peak_bytes(device) -> int:
    """Peak bytes so far: CUDA's allocator peak on a GPU, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def torchrun(nprocs, argv, cwd) -> None:
    """``python -m torch.distributed.run --standalone`` with ``argv`` on ``nprocs`` one-thread CPU ranks."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nprocs)] + argv
    subprocess.run(cmd, check=True, env=env, cwd=cwd, capture_output=True, timeout=900)
