"""The atomic-free split backward (dK/dV kernel + dQ kernel) against the plain-PyTorch reference.

``deterministic=True`` always runs the split backward; these tests reach it that way (and through
``attn_bwd_segments`` for hand-built segment tables). fp32 and fp16 only: the interpreter's bf16 dot
is broken (docs/design.md, "Facts the code relies on"); bf16 is covered by the AOT compile (tests/kernels/test_aot.py).
"""
import random
import threading

import pytest
import torch

from ndp_kernels import configs, flash, reference, tuning
from ndp_kernels.segments import NO_LIMIT, Segments
from ndp_kernels.configs import KernelConfig
from _kernel_cases import CASES, DTYPES, qkv, random_segments
from ndp.testing import assert_close, assert_within_lowp_bound



def _check_bwd(q, k, v, dout, dtype, **kw):
    """Split backward (deterministic=True) vs the fp32 reference from the same (out, lse)."""
    ref_out, ref_lse = reference.flash_attn_fwd_ref(q, k, v, **kw)
    grads = flash.flash_attn_bwd(dout, q, k, v, ref_out, ref_lse, deterministic=True, **kw)
    ref_grads = reference.flash_attn_bwd_ref(dout.float(), q.float(), k.float(), v.float(),
                                             ref_out.float(), ref_lse, **kw)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert g.dtype == dtype and g.shape == r.shape, name
        assert torch.isfinite(g.float()).all(), name
        assert_close(g, r, dtype, "grad", msg=name)
    if dtype != torch.float32:
        low = reference.flash_attn_bwd_ref(dout, q, k, v, ref_out, ref_lse, upcast=False, **kw)
        for g, r, lo in zip(grads, ref_grads, low):
            assert_within_lowp_bound(g, r, lo, dtype, "grad")
    return grads


def _check_segments(q, k, v, dout, segs, dtype, scale=0.125, accs=None):
    """Split backward over a segment table vs the reference (optionally into fp32 accumulators)."""
    ref_out, ref_lse = reference.attn_fwd_segments_ref(q.float(), k.float(), v.float(), segs,
                                                       softmax_scale=scale)
    out = ref_out.to(dtype)
    ref = reference.attn_bwd_segments_ref(dout.float(), q.float(), k.float(), v.float(), out.float(),
                                          ref_lse, segs, softmax_scale=scale)
    if accs is None:
        grads = flash.attn_bwd_segments(dout, q, k, v, out, ref_lse, segs, softmax_scale=scale,
                                        deterministic=True)
    else:
        init = [a.clone() for a in accs]
        ret = flash.attn_bwd_segments(dout, q, k, v, out, ref_lse, segs, softmax_scale=scale,
                                      dq_acc=accs[0], dk_acc=accs[1], dv_acc=accs[2], deterministic=True)
        assert all(r is a for r, a in zip(ret, accs))
        grads = [a - i for a, i in zip(accs, init)]
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        assert torch.isfinite(g.float()).all(), name
        assert_close(g, r, dtype, "grad", msg=f"{name} {segs}")
    return grads


# test_flash's cases, plus a GQA group of 3 (not a power of two) in the dK/dV kernel's head loop.
SPLIT_CASES = CASES + [pytest.param(1, 65, 130, 6, 2, 64, False, (20, 5), id="window20-5-gqa3-q65-k130")]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal,window", SPLIT_CASES)
def test_split_bwd_matches_reference(b, sq, sk, h, hk, d, causal, window, dtype):
    q, k, v, dout = qkv(b, sq, sk, h, hk, d, dtype)
    _check_bwd(q, k, v, dout, dtype, causal=causal, window_size=window)


@pytest.mark.parametrize("d", [16, 96, 256])
def test_split_bwd_other_head_dims(d):
    q, k, v, dout = qkv(1, 33, 45, 2, 1, d, torch.float32, seed=13)
    _check_bwd(q, k, v, dout, torch.float32, causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_split_bwd_packed_documents(dtype, causal):
    # An empty document, 1-token documents and one longer than a tile.
    cu = torch.tensor([0, 1, 1, 18, 19, 83, 183], dtype=torch.int32)
    q, k, v, dout = qkv(1, 183, 183, 4, 2, 64, dtype, seed=1, packed=True)
    _check_bwd(q, k, v, dout, dtype, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu,
               max_seqlen_q=100, max_seqlen_k=100)


def test_split_bwd_packed_q_shorter_than_k():
    cu_q = torch.tensor([0, 1, 1, 18, 50], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 10, 27, 110], dtype=torch.int32)
    q, k, v, dout = qkv(1, 50, 110, 2, 1, 64, torch.float32, seed=2, packed=True)
    _check_bwd(q, k, v, dout, torch.float32, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def test_split_bwd_strided_inputs():
    # q, k, v as views into one interleaved qkv buffer (non-contiguous heads and sequence strides).
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 70, 3, 4, 64, generator=g)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1, :2], qkv[:, :, 2, 2:]
    dout = torch.randn(2, 70, 4, 64, generator=g)
    assert not q.is_contiguous() and not k.is_contiguous()
    _check_bwd(q, k, v, dout, torch.float32, causal=True)


def test_split_bwd_rows_in_no_segment_and_accumulators():
    # Rows 10..19 are in no segment: their dq accumulator rows stay untouched; keys 0..4 of the
    # second segment's k-range overlap the first segment's.
    q, k, v, dout = qkv(1, 30, 40, 2, 1, 64, torch.float32, seed=4)
    segs = Segments.from_rows([(0, 10, 0, 40, -NO_LIMIT, NO_LIMIT), (20, 10, 5, 20, -3, 2)])
    g = torch.Generator().manual_seed(5)
    accs = [torch.randn(x.shape, generator=g) for x in (q, k, v)]
    before = accs[0][:, 10:20].clone()
    _check_segments(q, k, v, dout, segs, torch.float32, accs=accs)
    assert torch.equal(accs[0][:, 10:20], before)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_split_bwd_overlapping_key_ranges(dtype):
    # Four segments with overlapping key ranges ([0,30), [10,50), [45,50), [30,50): the last three
    # share keys 45..49): the dK/dV kernel runs once per group of key-disjoint segments (three
    # here) and adds into dk/dv without atomics.
    segs = Segments.from_rows([(0, 15, 0, 30, -NO_LIMIT, 15), (15, 25, 10, 40, -8, 15),
                               (40, 9, 45, 5, -NO_LIMIT, NO_LIMIT), (49, 20, 30, 20, -5, NO_LIMIT)])
    assert segs.keys_overlap and len(segs.key_groups()) == 3
    q, k, v, dout = qkv(2, 69, 60, 4, 2, 64, dtype, seed=5)
    _check_segments(q, k, v, dout, segs, dtype, scale=64 ** -0.5)


def test_split_bwd_fp32_accumulators_over_key_chunks():
    # Ring-style: two key chunks of one causal attention added into the same fp32 accumulators.
    sq, sk, bounds = 70, 150, [0, 50, 150]
    q, k, v, dout = qkv(1, sq, sk, 4, 1, 64, torch.float32, seed=8)
    out, lse = reference.flash_attn_fwd_ref(q, k, v, causal=True)
    ref = reference.flash_attn_bwd_ref(dout, q, k, v, out, lse, causal=True)
    g = torch.Generator().manual_seed(9)
    init = [torch.randn(x.shape, generator=g) for x in (q, k, v)]
    dq_acc, dk_acc, dv_acc = (x.clone() for x in init)
    for a, b in zip(bounds[:-1], bounds[1:]):
        segs = Segments.from_rows([(0, sq, 0, b - a, -NO_LIMIT, (sk - sq) - a)])
        flash.attn_bwd_segments(dout, q, k[:, a:b], v[:, a:b], out, lse, segs, softmax_scale=64 ** -0.5,
                                dq_acc=dq_acc, dk_acc=dk_acc[:, a:b], dv_acc=dv_acc[:, a:b],
                                deterministic=True)
    for name, acc, x0, r in zip(("dq", "dk", "dv"), (dq_acc, dk_acc, dv_acc), init, ref):
        assert_close(acc - x0, r, torch.float32, "grad", msg=name)


def test_split_bwd_public_accumulators_packed():
    cu = torch.tensor([0, 17, 81], dtype=torch.int32)
    q, k, v, dout = qkv(1, 81, 81, 2, 1, 64, torch.float32, seed=10, packed=True)
    kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=64, max_seqlen_k=64)
    out, lse = reference.flash_attn_fwd_ref(q, k, v, **kw)
    ref = reference.flash_attn_bwd_ref(dout, q, k, v, out, lse, **kw)
    accs = [torch.ones(x.shape) for x in (q, k, v)]
    ret = flash.flash_attn_bwd(dout, q, k, v, out, lse, dq_acc=accs[0], dk_acc=accs[1], dv_acc=accs[2],
                               deterministic=True, **kw)
    for acc, r, g in zip(accs, ret, ref):
        assert r is acc
        assert_close(acc - 1.0, g, torch.float32, "grad")


@pytest.mark.parametrize("seed", range(6))
def test_split_bwd_random_segment_tables_and_tiles(seed, monkeypatch):
    # Random tables (gaps, shared key rows, empty key ranges, one- and two-sided bands) with the
    # GPU-like tile shapes swapped into the interpreter configuration: the lean/masked block split
    # (interior blocks, band edges, ragged ends) is exercised for those tiles too.
    rng = random.Random(100 + seed)
    m, n = [(16, 32), (32, 16), (128, 64), (64, 128), (32, 32), (16, 16)][seed]
    monkeypatch.setitem(configs._BWD_DKDV, ("interpreter", 64), KernelConfig(m, n, 4, 1))
    monkeypatch.setitem(configs._BWD_DQ, ("interpreter", 64), KernelConfig(n, m, 4, 1))
    hk = rng.choice([1, 2])
    h = hk * rng.choice([1, 3])
    sq, sk = rng.randint(20, 150), rng.randint(20, 150)
    segs = random_segments(rng, sq, sk)
    q, k, v, dout = qkv(2, sq, sk, h, hk, 64, torch.float32, seed=seed)
    _check_segments(q, k, v, dout, segs, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_deterministic_is_bitwise_reproducible(dtype):
    # GQA, a window, and shared key rows (two dK/dV launches adding into one accumulator).
    segs = Segments.from_rows([(0, 40, 0, 60, -20, 10), (40, 30, 30, 50, -NO_LIMIT, 25)])
    q, k, v, dout = qkv(1, 70, 80, 6, 2, 64, dtype, seed=11)
    out, lse = reference.attn_fwd_segments_ref(q.float(), k.float(), v.float(), segs, softmax_scale=0.125)
    runs = [flash.attn_bwd_segments(dout, q, k, v, out.to(dtype), lse, segs, softmax_scale=0.125,
                                    deterministic=True) for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_flash_attn_func_deterministic_autograd():
    q, k, v, dout = qkv(1, 40, 40, 4, 2, 64, torch.float32, seed=12)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = flash.flash_attn_func(q, k, v, causal=True, window_size=(10, 0), deterministic=True)
    out.backward(dout)
    ref_out, ref_lse = reference.flash_attn_fwd_ref(q.detach(), k.detach(), v.detach(), causal=True,
                                                    window_size=(10, 0))
    ref = reference.flash_attn_bwd_ref(dout, q.detach(), k.detach(), v.detach(), ref_out, ref_lse,
                                       causal=True, window_size=(10, 0))
    for x, r in zip((q, k, v), ref):
        assert_close(x.grad, r, torch.float32, "grad")


def test_override_and_no_probe_reach_other_threads():
    # autograd runs a CUDA backward on its own worker thread: a choice made around loss.backward() must reach it.
    plain = configs.bwd_impl("interpreter", 64, torch.float32)
    forced = "atomic" if plain == "split" else "split"
    seen = {}

    def worker():
        seen["impl"] = configs.bwd_impl("interpreter", 64, torch.float32)
        seen["tile"] = configs.fwd_config("interpreter", 64)
        seen["no_probe"] = tuning.measurement_off()

    tile = KernelConfig(16, 16, 4, 1)
    with configs.override("bwd_impl", forced), configs.override("fwd", tile), configs.no_probe():
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert seen == {"impl": forced, "tile": tile, "no_probe": True}
    assert configs.bwd_impl("interpreter", 64, torch.float32) == plain and not tuning.measurement_off()


@pytest.mark.cpu_only
def test_bwd_impl_selection(monkeypatch):
    # deterministic=True always takes the split backward; the default comes from the one table.
    for arch in ("sm_80", "sm_90", "interpreter"):
        for d in (64, 128, 256):
            assert configs.bwd_impl(arch, d, torch.bfloat16, deterministic=True) == "split"
            assert configs.bwd_impl(arch, d, torch.bfloat16) in ("split", "atomic")
    calls = []
    real = flash._bwd_split
    monkeypatch.setattr(flash, "_bwd_split", lambda *a, **kw: calls.append("split") or real(*a, **kw))
    q, k, v, dout = qkv(1, 20, 20, 2, 1, 64, torch.float32, seed=13)
    out, lse = reference.flash_attn_fwd_ref(q, k, v, causal=True)
    flash.flash_attn_bwd(dout, q, k, v, out, lse, causal=True)
    assert calls == ([] if configs.bwd_impl("interpreter", 64) == "atomic" else ["split"])
    flash.flash_attn_bwd(dout, q, k, v, out, lse, causal=True, deterministic=True)
    assert calls[-1:] == ["split"]
    monkeypatch.setitem(configs._BWD_IMPL, ("interpreter", 64), "split")
    calls.clear()
    flash.flash_attn_bwd(dout, q, k, v, out, lse, causal=True)
    assert calls == ["split"]


def test_key_groups_are_disjoint_and_fewest():
    segs = Segments.from_rows([(0, 5, 0, 10, -NO_LIMIT, NO_LIMIT), (5, 5, 5, 10, -NO_LIMIT, NO_LIMIT),
                               (10, 5, 10, 10, -NO_LIMIT, NO_LIMIT), (15, 0, 0, 30, 0, 0),
                               (15, 5, 30, 0, 0, 0), (20, 5, 20, 5, 0, 0)])
    groups = segs.key_groups()
    # Keys [0,10), [5,15), [10,20), [20,25): two groups suffice; segments without work are dropped.
    assert len(groups) == 2
    rows = sorted(tuple(r) for gr in groups for r in gr.table.tolist())
    assert rows == sorted(tuple(r) for r in segs.table.tolist() if r[1] > 0 and r[3] > 0)
    for gr in groups:
        assert not gr.keys_overlap
    dense = Segments.dense(10, 10, causal=True)
    assert dense.key_groups() == (dense,)
