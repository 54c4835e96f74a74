"""ndp.shutdown(): a barrier then destroy_process_group; a no-op without a process group (issue 11)."""
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ndp


def test_shutdown_without_process_group_is_a_no_op():
    assert not dist.is_initialized()
    assert ndp.shutdown() is False
    assert ndp.shutdown(barrier=False) is False


def test_shutdown_of_a_one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert ndp.shutdown() is True
    assert not dist.is_initialized()


def _script(rank, world, tmp_path, round_):
    # What a user script does: CP attention forward and backward, then ndp.shutdown() as its last line
    # (no test-harness teardown around it). The process must exit 0: mp.spawn reports a SIGABRT.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv{round_}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8 * world, 4, 16, generator=g, dtype=torch.float64) for _ in range(3))
    ql, kl, vl = (ndp.shard_sequence(x, dim=1).requires_grad_() for x in (q, k, v))
    ndp.ring_attention(ql, kl, vl, causal=True).sum().backward()
    ndp.ulysses_attention(ql, kl, vl, causal=True).sum().backward()
    if rank == 0:
        time.sleep(0.5)  # ranks reach the end at different times, as when rank 0 writes the results
    assert ndp.shutdown() is True
    assert not dist.is_initialized()


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_script_ending_with_shutdown_exits_cleanly(tmp_path):
    for round_ in range(3):
        mp.spawn(_script, args=(2, str(tmp_path), round_), nprocs=2, join=True)
