"""No hang when ranks disagree or one rank's input is bad (issues 9 and 11): every CP call agrees on
validity before its first transfer, whatever earlier calls agreed on, so *every* rank raises a clear
ValueError within seconds. The process groups run with a short timeout: a hang fails the test."""
import json
import time

import pytest
import torch
import torch.distributed as dist

from dist import spawn
from ndp.cp import allgather_attention, ring_attention, split_cp_group, ulysses_attention, usp_attention

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

TIMEOUT_S = 20  # process-group timeout in these tests: a rank left waiting fails instead of hanging
MAX_RAISE_S = 5.0  # every rank must have raised this soon after the bad call started


def _qkv(seq, heads=4, kv_heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, seq, h, 16, generator=g, dtype=torch.float64) for h in (heads, kv_heads, kv_heads))


def _fns(world):
    fns = {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention}
    if world == 4:
        ug, rg = split_cp_group(None, 2)
        fns["usp"] = lambda q, k, v, **kw: usp_attention(q, k, v, ulysses_group=ug, ring_group=rg, **kw)
    return fns


def _bad_cases(rank):
    """name -> (kwargs builder, (exception type, match) on the bad rank, match on the others).

    Rank 1 is the odd one out in every case."""
    odd = rank == 1
    scale_kw = dict(softmax_scale=float("nan")) if odd else {}
    return {
        # disagreement in a field after an agreeing call (the cached path used to skip the check)
        "causal": (lambda: (_qkv(8), dict(causal=not odd)), (ValueError, "different arguments.*causal"),
                   "different arguments.*causal: rank 0=True, rank 1=False"),
        "window": (lambda: (_qkv(8), dict(window_size=(3, 0) if odd else (-1, -1))),
                   (ValueError, "different arguments.*window"), r"different arguments.*window: rank 0=\(-1, -1\), "
                                                                 r"rank 1=\(3, 0\)"),
        "layout": (lambda: (_qkv(8), dict(layout="striped" if odd else "zigzag")),
                   (ValueError, "different arguments.*layout"), "different arguments.*layout: rank 0='zigzag', "
                                                                "rank 1='striped'"),
        "deterministic": (lambda: (_qkv(8), dict(deterministic=odd)), (ValueError, "different arguments.*deterministic"),
                          "different arguments.*deterministic: rank 0=False, rank 1=True"),
        "seqlen": (lambda: (_qkv(10 if odd else 8), {}), (ValueError, "different arguments.*q_shape"),
                   r"different arguments.*q_shape: rank 0=\(1, 8, 4, 16\), rank 1=\(1, 10, 4, 16\)"),
        # one rank's bad input: that rank gets its own error, the others a ValueError naming it
        "heads": (lambda: (_qkv(8, heads=5 if odd else 4), {}),
                  (ValueError, r"heads must be divisible by kv_heads.*heads=5, kv_heads=2"),
                  r"1 of the \d ranks of the CP group refused their input: rank 1 \(global rank 1\) raised "
                  r"ValueError: heads must be divisible by kv_heads.*got heads=5, kv_heads=2"),
        "scale": (lambda: (_qkv(8), scale_kw), (ValueError, "softmax_scale must be finite and > 0; got softmax_scale=nan"),
                  r"refused their input: rank 1 .*softmax_scale must be finite and > 0"),
        "dtype": (lambda: (tuple(x.float() if odd else x for x in _qkv(8)[:2]) + (_qkv(8)[2],), {}),
                  (TypeError, "q, k, v must share one dtype"), r"refused their input: rank 1 .*TypeError: q, k, v must"),
    }


def _disagree_body(rank, world, out_file):
    fns = _fns(world)
    times = {}
    for fname, fn in fns.items():
        for case, (build, own, others) in _bad_cases(rank).items():
            q, k, v = _qkv(8)
            ref = fn(q, k, v, causal=True)  # an agreeing call first: its signature is what the cache held
            (q2, k2, v2), kw = build()
            kw.setdefault("causal", True)
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 1:
                with pytest.raises(own[0], match=own[1]):
                    fn(q2, k2, v2, **kw)
            else:
                with pytest.raises(ValueError, match=others):
                    fn(q2, k2, v2, **kw)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            times[f"{fname}/{case}"] = dt.item()
            # the group is still usable and the earlier signature still computes the same thing
            assert torch.equal(fn(q, k, v, causal=True), ref)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(times, f)


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_raises_on_disagreement_or_one_bad_rank(tmp_path, world_size):
    out = tmp_path / "times.json"
    spawn(_disagree_body, world_size, tmp_path, str(out), timeout_s=TIMEOUT_S)
    times = json.loads(out.read_text())
    print("seconds until every rank raised:", json.dumps(times))
    assert len(times) == len(_bad_cases(0)) * (4 if world_size == 4 else 3)
    slow = {k: t for k, t in times.items() if t > MAX_RAISE_S}
    assert not slow, f"ranks took longer than {MAX_RAISE_S} s to raise: {slow}"


def _ulysses_heads_body(rank, world):
    # Ulysses' own head check (pre_check) on one rank only: 6 heads / 3 kv heads on rank 1, degree 2.
    q, k, v = _qkv(8)
    ulysses_attention(q, k, v)
    q2, k2, v2 = _qkv(8, heads=6, kv_heads=3) if rank == 1 else (q, k, v)
    if rank == 1:
        with pytest.raises(ValueError, match="kv_heads % degree == 0 when kv_heads >= degree; got kv_heads=3"):
            ulysses_attention(q2, k2, v2)
    else:
        with pytest.raises(ValueError, match=r"refused their input: rank 1 .*kv_heads % degree == 0"):
            ulysses_attention(q2, k2, v2)


def test_ulysses_head_check_on_one_rank(tmp_path):
    spawn(_ulysses_heads_body, 2, tmp_path, timeout_s=TIMEOUT_S)


def _usp_one_bad_rank_body(rank, world):
    # 2 x 2 USP: rank 3's error must reach rank 0, which shares neither its Ulysses nor its ring group.
    ug, rg = split_cp_group(None, 2)
    q, k, v = _qkv(8)
    if rank == 3:
        with pytest.raises(ValueError, match="window_size entries must be >= -1"):
            usp_attention(q, k, v, ulysses_group=ug, ring_group=rg, window_size=(-2, 0))
    else:
        with pytest.raises(ValueError, match=r"refused their input: rank 1 \(global rank 3\) raised ValueError: window_size"):
            usp_attention(q, k, v, ulysses_group=ug, ring_group=rg)


def test_usp_error_reaches_the_whole_2d_group(tmp_path):
    spawn(_usp_one_bad_rank_body, 4, tmp_path, timeout_s=TIMEOUT_S)
