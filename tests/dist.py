"""Multi-process helpers: real gloo process groups on CPU (docs/design.md, "Conventions: tests")."""
import datetime
import faulthandler
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# Ranks start from a fork server that imported these once per test session: each spawn's ranks skip the
# import of torch, transformers and ndp (seconds per rank, most of a small test's time on 2 cores).
PRELOAD = ["torch", "torch.distributed", "transformers.modeling_utils", "ndp.hf", "ndp.train", "ndp.accelerate",
           "trl"]
mp.set_forkserver_preload(PRELOAD)


def _entry(rank, fn, world_size, tmp_path, args, timeout_s, parent):
    # The fork server holds the environment, import path and directory of its own start: take the caller's.
    env, path, cwd = parent
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = path
    os.chdir(cwd)
    # A rank that dies in native code (SIGSEGV, SIGABRT) leaves only a signal name to mp.spawn: keep each
    # thread's Python stack in a file that spawn() adds to the error.
    faulthandler.enable(open(_fault_file(tmp_path, rank), "w"), all_threads=True)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    ok = False
    try:
        fn(rank, world_size, *args)
        ok = True
    finally:
        if ok:
            # All ranks reach teardown together: a rank that leaves early while peers still have gloo
            # work in flight makes them abort instead of report.
            dist.barrier()
        dist.destroy_process_group()
    # torch 2.13's gloo can still abort in its C++ static destructors at interpreter exit ("terminate
    # called without an active exception") after every rank finished and agreed: leave without running
    # them. Only reached on success; a failing rank raises above and mp.spawn reports it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _fault_file(tmp_path, rank):
    return os.path.join(tmp_path, f"fault.rank{rank}")


def _with_fault_stacks(err, tmp_path, world_size):
    """`err` (a rank killed by a signal) with the Python stacks faulthandler wrote at the crash."""
    stacks = []
    for rank in range(world_size):
        try:
            text = open(_fault_file(tmp_path, rank)).read().strip()
        except OSError:
            continue
        if text:
            stacks.append(f"--- rank {rank} ---\n{text}")
    if stacks:
        err.args = (err.args[0] + "\nfaulthandler:\n" + "\n".join(stacks),) + err.args[1:]
    return err


def spawn(fn, world_size, tmp_path, *args, timeout_s=60):
    """Run fn(rank, world_size, *args) on `world_size` gloo ranks; raises if any rank fails.

    timeout_s: the process group's timeout: a collective or transfer that waits longer fails the rank
    (tests of "no hang" pass a short one so that a hang fails fast instead of stalling the suite).
    """
    os.makedirs(tmp_path, exist_ok=True)  # the file rendezvous waits, without an error, on a missing directory
    parent = (dict(os.environ), list(sys.path), os.getcwd())
    try:
        mp.start_processes(_entry, args=(fn, world_size, str(tmp_path), args, timeout_s, parent),
                           nprocs=world_size, join=True, start_method="forkserver")
    except mp.ProcessExitedException as err:
        raise _with_fault_stacks(err, str(tmp_path), world_size) from None
