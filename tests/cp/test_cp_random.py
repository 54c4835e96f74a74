"""Seeded random CP calls (ring, all-gather, Ulysses on 2 gloo ranks): each one either matches single-process
fp64 attention on every rank, or every rank refuses it with the same error before any transfer, and the group
still works after it. The fixed cases of test_cp_attention pick one value per feature; these draw combinations
(layout x packed documents x window x soft-cap x sinks x chunks x image spans x head ratio x dtype x forced engine),
which is how a forced engine refused inside a ring step (transfers in flight, the next collective waiting forever)
was found."""
import random

import pytest
import torch
import torch.distributed as dist

from _cp_checks import run_case
from dist import spawn
from ndp.cp import CommStats, allgather_attention, ring_attention, ulysses_attention

pytestmark = pytest.mark.distributed

CASES = 40
FUNCTIONS = {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention}


def draw(seed: int, world: int):
    """(function name, case, dtype) of seed `seed`: heads that Ulysses can split over `world` ranks."""
    r = random.Random(seed)
    kv = r.choice([1, 2, 4])
    case = dict(heads=kv * r.choice([1, 2]) * (world if kv == 1 else 1), kv_heads=kv, dim=r.choice([16, 32, 48]),
                causal=r.random() < 0.6, seed=seed, backend=r.choice(["auto", "torch", "sdpa"]))
    if r.random() < 0.35:
        case["docs"] = [r.choice([0, 1, 2, 3, 7, 13, 31]) for _ in range(r.randint(1, 5))]
        case["docs"][0] += 1 if sum(case["docs"]) == 0 else 0
    else:
        case.update(batch=r.choice([1, 2]), seqlen=2 * world * r.randint(1, 8),
                    layout=r.choice(["zigzag", "contiguous", "striped"]))
        if r.random() < 0.15:
            case["chunk"] = r.choice([4, 8])
    if r.random() < 0.3:
        case["window"] = (r.choice([-1, 0, 1, 5]), 0 if case["causal"] else r.choice([-1, 0, 3]))
    if r.random() < 0.3:
        case["softcap"] = 7.0      # the sdpa engine has none: a forced sdpa is refused
    if r.random() < 0.2:
        case["sinks"] = True
    name, dtype = r.choice(sorted(FUNCTIONS)), r.choice([torch.float64, torch.float32])
    if "seqlen" in case and r.random() < 0.3:  # image blocks: refused with chunks or a mask that is not causal
        n = case["seqlen"]
        cuts = sorted(r.sample(range(n + 1), 2 * r.randint(1, min(3, n // 2))))
        case["spans"] = tuple(zip(cuts[::2], cuts[1::2]))
    return name, case, dtype


def _body(rank, world):
    outcomes = []
    for seed in range(CASES):
        name, case, dtype = draw(seed, world)
        with CommStats() as st:
            try:
                run_case(FUNCTIONS[name], case, dtype=dtype)
                outcome = "ok"
            except (ValueError, TypeError) as e:
                assert st.bytes_sent == st.bytes_received == 0, f"refused after a transfer: {name} {case} {e}"
                outcome = f"{type(e).__name__}"
        seen = [None] * world
        dist.all_gather_object(seen, outcome)  # the group still works, and every rank ended the same way
        assert len(set(seen)) == 1, (name, case, seen)
        outcomes.append(outcome)
    # The draw covers both outcomes: a refusal that never happens here would test nothing.
    assert outcomes.count("ok") >= CASES // 2 and "ValueError" in outcomes, outcomes
    dist.barrier()


def test_random_cp_calls_match_or_are_refused_on_every_rank(tmp_path):
    spawn(_body, 2, tmp_path, timeout_s=60)
