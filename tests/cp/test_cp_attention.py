"""Ring, all-gather, Ulysses and USP attention against single-process fp64 attention on the full sequence:
out, lse, dq, dk, dv on every rank, real gloo process groups (world sizes 1, 2, 4; USP as 2x2)."""
import functools

import pytest
import torch
import torch.distributed as dist

from _cp_checks import PACKED_CASES, WINDOW_CASES, cases_dense, run_all, run_case
from dist import spawn
from ndp.cp import (allgather_attention, ring_attention, split_cp_group, ulysses_attention,
                    usp_attention)
from ndp.cp.schedule import Mask, Placement, RingSchedule

pytestmark = pytest.mark.distributed

ODD_HEADS = dict(batch=1, seqlen=32, heads=3, kv_heads=1, dim=16, causal=True, layout="zigzag")
GQA_4_1 = dict(batch=1, seqlen=32, heads=8, kv_heads=2, dim=16, causal=True, layout="striped")
# Attention sinks (gpt-oss): dense causal, sliding window, full, packed; their gradient summed over the ranks.
SINK_CASES = [
    dict(batch=2, seqlen=32, heads=4, kv_heads=2, dim=16, causal=True, layout="zigzag", sinks=True),
    dict(batch=1, seqlen=32, heads=4, kv_heads=1, dim=16, causal=True, window=(5, 0), layout="striped", sinks=True),
    dict(batch=1, seqlen=32, heads=4, kv_heads=4, dim=16, causal=False, layout="contiguous", sinks=True),
    dict(docs=[0, 9, 30, 1], heads=4, kv_heads=2, dim=16, causal=True, sinks=True),
]
# Chunked attention (Llama4): chunks that do and do not align with the shards, with a window, with sinks.
CHUNK_CASES = [
    dict(batch=2, seqlen=32, heads=4, kv_heads=2, dim=16, causal=True, layout="zigzag", chunk=8),
    dict(batch=1, seqlen=48, heads=4, kv_heads=1, dim=16, causal=True, layout="striped", chunk=5),
    dict(batch=1, seqlen=32, heads=4, kv_heads=4, dim=16, causal=True, window=(3, 0), layout="contiguous",
         chunk=12, sinks=True),
]
# Logit soft-capping (Gemma 2): dense, window + sinks, packed, chunked; a cap small enough to bend most scores.
SOFTCAP_CASES = [
    dict(batch=2, seqlen=32, heads=4, kv_heads=2, dim=16, causal=True, layout="zigzag", softcap=1.5),
    dict(batch=1, seqlen=32, heads=4, kv_heads=1, dim=16, causal=True, window=(5, 0), layout="striped", sinks=True,
         softcap=2.0),
    dict(docs=[0, 9, 30, 1], heads=4, kv_heads=2, dim=16, causal=False, softcap=1.0),
    dict(batch=1, seqlen=32, heads=4, kv_heads=4, dim=16, causal=True, layout="contiguous", chunk=12, softcap=3.0),
]
# A value head size unlike the query/key one (MLA: DeepSeek-V2/V3): smaller, larger; with sinks, window, packed.
MLA_CASES = [
    dict(batch=2, seqlen=32, heads=4, kv_heads=2, dim=24, dim_v=16, causal=True, layout="zigzag"),
    dict(batch=1, seqlen=32, heads=4, kv_heads=1, dim=16, dim_v=32, causal=True, window=(5, 0), layout="striped",
         sinks=True),
    dict(docs=[0, 9, 30, 1], heads=4, kv_heads=4, dim=32, dim_v=16, causal=True, softcap=2.0),
]
# Bidirectional spans (a VLM's image blocks, Gemma 3): across shard boundaries, next to each other, one token, with a
# window (keys before a span's start still bounded by it), sinks, soft-capping.
SPAN_CASES = [
    dict(batch=2, seqlen=32, heads=4, kv_heads=2, dim=16, causal=True, layout="zigzag",
         spans=((3, 11), (11, 15), (20, 21), (22, 31))),
    dict(batch=1, seqlen=48, heads=4, kv_heads=1, dim=16, causal=True, window=(6, 0), layout="striped", sinks=True,
         spans=((5, 25), (40, 48))),
    dict(batch=1, seqlen=32, heads=4, kv_heads=4, dim=16, causal=True, layout="contiguous", softcap=2.0,
         spans=((0, 17),)),
]
FEATURE_CASES = SINK_CASES + CHUNK_CASES + SOFTCAP_CASES + MLA_CASES + SPAN_CASES


def _flops_total(case, st):
    """Checks that the FLOPs counted on all ranks add up to the full attention's."""
    t = torch.tensor([st.fwd_flops, st.bwd_flops], dtype=torch.float64)
    dist.all_reduce(t)
    n = case["seqlen"]
    pairs = sum(RingSchedule(Placement.dense(n, 1, "contiguous"), Mask(case["causal"])).pairs_per_rank())
    full = 4 * case["batch"] * case["heads"] * case["dim"] * pairs
    assert t[0].item() == full and t[1].item() == 2.5 * full


def _ring_body(rank, world):
    run_all(ring_attention, cases_dense() + WINDOW_CASES + PACKED_CASES + FEATURE_CASES + [ODD_HEADS, GQA_4_1])
    case = dict(batch=2, seqlen=32, heads=4, kv_heads=1, dim=16, causal=True, layout="zigzag")
    _, st = run_case(ring_attention, case)
    kv = 2 * 2 * (32 // world) * 1 * 16 * 8  # K and V, fp64
    # fwd: N-1 K/V hops; bwd: N-1 K/V hops + N-1 hops of the fp64 dK/dV accumulators. GQA: kv_heads only.
    assert st.bytes_sent == st.bytes_received == 3 * (world - 1) * kv
    assert set(st.by_op) <= {"p2p"}
    _flops_total(case, st)
    dist.barrier()  # every rank done before teardown


def _allgather_body(rank, world):
    run_all(allgather_attention, cases_dense() + WINDOW_CASES + PACKED_CASES + FEATURE_CASES + [ODD_HEADS, GQA_4_1])
    case = dict(batch=2, seqlen=32, heads=4, kv_heads=2, dim=16, causal=True, layout="striped")
    _, st = run_case(allgather_attention, case)
    kv = 2 * 2 * (32 // world) * 2 * 16 * 8
    # fwd all-gather and bwd re-gather: (N-1) local K/V each; bwd reduce-scatter of fp64 dK/dV: (N-1)/N of N*local
    assert st.bytes_sent == st.bytes_received == 3 * (world - 1) * kv
    _flops_total(case, st)
    dist.barrier()


def _ulysses_body(rank, world):
    cases = cases_dense(kv_cycle=(1, 2, 4)) + WINDOW_CASES + PACKED_CASES + FEATURE_CASES + [GQA_4_1]
    run_all(ulysses_attention, cases)
    case = dict(batch=2, seqlen=32, heads=4, kv_heads=1, dim=16, causal=False, layout="zigzag")
    _, st = run_case(ulysses_attention, case)
    n, es = world, 8
    tok = 2 * (32 // n)                        # local rows (batch * seq)
    q = tok * 4 * 16 * es                      # a local q-sized tensor
    kvrep = tok * n * 16 * es                  # a local k replicated to one kv head per rank
    lse = tok * 4 * es
    frac = (n - 1) / n
    # fwd: q, k', v' in and out back (+ lse, asked for by the test); bwd: dout in, dq out, dk' dv' out (fp64 acc)
    want = frac * (q + 2 * kvrep + q + lse + q + q + 2 * kvrep)
    assert st.bytes_sent == st.bytes_received == int(want)
    _flops_total(case, st)
    dist.barrier()


def _usp_body(rank, world):
    for u in (2, 1, 4):
        ug, rg = split_cp_group(None, u)
        fn = functools.partial(usp_attention, ulysses_group=ug, ring_group=rg)
        cases = cases_dense(kv_cycle=(1, 2, 4), seqlen=32) if u == 2 else cases_dense(kv_cycle=(2,), seqlen=32)[:2]
        run_all(fn, cases + (WINDOW_CASES + PACKED_CASES + FEATURE_CASES + [GQA_4_1] if u == 2 else []))
    dist.barrier()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ring_matches_reference(tmp_path, world_size):
    spawn(_ring_body, world_size, tmp_path)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_allgather_matches_reference(tmp_path, world_size):
    spawn(_allgather_body, world_size, tmp_path)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ulysses_matches_reference(tmp_path, world_size):
    spawn(_ulysses_body, world_size, tmp_path)


def test_usp_2x2_matches_reference(tmp_path):
    spawn(_usp_body, 4, tmp_path)
