"""``ndp.parallel.draws``: spans of a forward on shared random streams, nested, ended by depth in any order; a
group's first rank's streams on every rank of it (``share_states``), the first rank drawing on as alone. On a CUDA
device the device's generator is shared and restored with the CPU's (marked ``gpu``)."""
import pytest
import torch
import torch.distributed as dist

from ndp.parallel.draws import Draws
from dist import spawn


def _states(device):
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _spans_nest(device):
    torch.manual_seed(5)
    draws = Draws()
    outer = draws.share_seed([], device)
    inside = [torch.rand(3, device=device)]
    inner = draws.share_seed([], device)
    torch.rand(3, device=device)
    draws.unwind(inner)  # the inner span ends: the outer span's streams, where its draws left them
    inside.append(torch.rand(3, device=device))
    draws.unwind(outer)
    draws.unwind(inner)  # ended already: a no-op, whichever hook runs last
    after = _states(device)
    torch.manual_seed(5)
    seed = int(torch.randint(2 ** 62, (1,), dtype=torch.int64))  # the outer span's seed, from the rank's stream
    # the rank's own streams again, past the one draw of the seed
    assert all(torch.equal(a, b) for a, b in zip(after, _states(device)))
    torch.manual_seed(seed)  # the CPU's and every CUDA device's
    first = torch.rand(3, device=device)
    torch.randint(2 ** 62, (1,), dtype=torch.int64)  # the inner span's seed, from the outer span's CPU stream
    assert torch.equal(inside[0], first) and torch.equal(inside[1], torch.rand(3, device=device))


def test_spans_nest_and_end_by_depth_in_any_order():
    _spans_nest(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_spans_share_and_restore_the_cuda_generator():
    _spans_nest(torch.device("cuda", torch.cuda.current_device()))


def _states_body(rank, world):
    torch.manual_seed(100 + rank)
    own = torch.get_rng_state()
    draws = Draws()
    depth = draws.share_states(dist.group.WORLD, torch.device("cpu"))
    drawn = torch.rand(4)
    everyone = [torch.empty(4) for _ in range(world)]
    dist.all_gather(everyone, drawn)
    assert all(torch.equal(x, everyone[0]) for x in everyone)  # rank 0's stream on every rank
    draws.unwind(depth)
    after = torch.get_rng_state()
    torch.manual_seed(100)
    assert torch.equal(everyone[0], torch.rand(4))  # as rank 0 alone draws
    # rank 0 draws on from there (the next span starts where this one left); the others' streams are their own
    assert torch.equal(after, torch.get_rng_state() if rank == 0 else own)


@pytest.mark.distributed
def test_share_states_runs_every_rank_on_the_first_ranks_streams(tmp_path):
    spawn(_states_body, 2, tmp_path, timeout_s=60)
