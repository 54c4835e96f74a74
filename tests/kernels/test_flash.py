"""Triton flash attention (under TRITON_INTERPRET=1) against the plain-PyTorch reference.

fp32 and fp16 only: the interpreter's bf16 dot is broken (docs/design.md, "Facts the code relies on"); bf16 is
covered by the AOT compile (tests/kernels/test_aot.py) and by the reference path.
"""
import random

import pytest
import torch

from ndp_kernels import configs, flash, reference
from ndp_kernels.configs import KernelConfig
from ndp_kernels.segments import NO_LIMIT, Segments
from _kernel_cases import CASES, DTYPES, qkv, random_segments
from ndp.testing import assert_close, assert_within_lowp_bound



def _assert_lse(lse, ref, dtype):
    """Same -inf pattern (rows without keys), finite values within tolerance."""
    assert not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref)), "rows without keys differ"
    fin = torch.isfinite(ref)
    assert_close(lse[fin], ref[fin], dtype, "out", msg="lse")


def _check(q, k, v, dout, dtype, **kw):
    """Kernel fwd and bwd vs the reference (fp32) and, for fp16, the low-precision bound."""
    out, lse = flash.flash_attn_fwd(q, k, v, **kw)
    ref_out, ref_lse = reference.flash_attn_fwd_ref(q, k, v, **kw)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert not torch.isnan(out.float()).any()
    # The fp32 reference output before rounding to `dtype` is the value to compare against.
    ref_out_f = reference.flash_attn_fwd_ref(q.float(), k.float(), v.float(), **kw)[0]
    assert_close(out, ref_out_f, dtype, "out", msg="out")
    _assert_lse(lse, ref_lse, dtype)
    # Backward from the same (out, lse) for both implementations.
    grads = flash.flash_attn_bwd(dout, q, k, v, ref_out, ref_lse, **kw)
    ref_grads = reference.flash_attn_bwd_ref(dout.float(), q.float(), k.float(), v.float(),
                                             ref_out.float(), ref_lse, **kw)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert g.dtype == dtype and g.shape == r.shape
        assert not torch.isnan(g.float()).any(), name
        assert_close(g, r, dtype, "grad", msg=name)
    if dtype != torch.float32:
        low_out = reference.flash_attn_fwd_ref(q, k, v, upcast=False, **kw)[0]
        assert_within_lowp_bound(out, ref_out_f, low_out, dtype, "out")
        low_grads = reference.flash_attn_bwd_ref(dout, q, k, v, ref_out, ref_lse, upcast=False, **kw)
        for g, r, lo in zip(grads, ref_grads, low_grads):
            assert_within_lowp_bound(g, r, lo, dtype, "grad")
    return out, lse, grads




@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal,window", CASES)
def test_fwd_bwd_matches_reference(b, sq, sk, h, hk, d, causal, window, dtype):
    q, k, v, dout = qkv(b, sq, sk, h, hk, d, dtype)
    _check(q, k, v, dout, dtype, causal=causal, window_size=window)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_packed_documents(dtype, causal):
    lens = [1, 17, 64, 300]
    cu = torch.tensor([0, 1, 18, 82, 382], dtype=torch.int32)
    q, k, v, dout = qkv(1, sum(lens), sum(lens), 4, 2, 64, dtype, seed=1, packed=True)
    out, lse, _ = _check(q, k, v, dout, dtype, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu,
                         max_seqlen_q=300, max_seqlen_k=300)
    assert out.shape == q.shape and lse.shape == (4, sum(lens))


def test_packed_documents_different_q_and_k_lengths():
    # Documents with fewer queries than keys (the CP "new tokens against a longer cache" shape),
    # bottom-right aligned per document, plus a document with no queries.
    cu_q = torch.tensor([0, 1, 1, 18, 50], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 10, 27, 110], dtype=torch.int32)
    q, k, v, dout = qkv(1, 50, 110, 2, 1, 64, torch.float32, seed=2, packed=True)
    _check(q, k, v, dout, torch.float32, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_bwd", "split_bwd"])
def test_rows_without_keys_give_zero_and_neg_inf(deterministic):
    # seq_q > seq_k with causal bottom-right alignment: the first 80 query rows see no key.
    q, k, v, dout = qkv(1, 97, 17, 2, 2, 64, torch.float32, seed=3)
    out, lse = flash.flash_attn_fwd(q, k, v, causal=True)
    assert torch.all(out[:, :80] == 0) and torch.all(torch.isneginf(lse[:, :, :80]))
    assert torch.isfinite(lse[:, :, 80:]).all()
    dq, dk, dv = flash.flash_attn_bwd(dout, q, k, v, out, lse, causal=True, deterministic=deterministic)
    assert torch.all(dq[:, :80] == 0)
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all()


def test_rows_in_no_segment():
    # Rows 10..19 belong to no segment: out 0, lse -inf, zero dq; with accumulators they stay untouched.
    q, k, v, dout = qkv(1, 30, 40, 2, 1, 64, torch.float32, seed=4)
    segs = Segments.from_rows([(0, 10, 0, 40, -NO_LIMIT, NO_LIMIT), (20, 10, 5, 20, -3, 2)])
    scale = 0.125
    out, lse = flash.attn_fwd_segments(q, k, v, segs, softmax_scale=scale)
    ref_out, ref_lse = reference.attn_fwd_segments_ref(q, k, v, segs, softmax_scale=scale)
    assert torch.all(out[:, 10:20] == 0) and torch.isneginf(lse[:, :, 10:20]).all()
    assert_close(out, ref_out, torch.float32)
    _assert_lse(lse, ref_lse, torch.float32)
    out_acc = torch.full(q.shape, 7.0)
    lse_acc = torch.full(lse.shape, 1.5)
    flash.attn_fwd_segments(q, k, v, segs, softmax_scale=scale, out_acc=out_acc, lse_acc=lse_acc)
    assert torch.all(out_acc[:, 10:20] == 7.0) and torch.all(lse_acc[:, :, 10:20] == 1.5)
    grads = flash.attn_bwd_segments(dout, q, k, v, ref_out, ref_lse, segs, softmax_scale=scale)
    ref_grads = reference.attn_bwd_segments_ref(dout, q, k, v, ref_out, ref_lse, segs, softmax_scale=scale)
    assert torch.all(grads[0][:, 10:20] == 0)
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, torch.float32, "grad")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_overlapping_key_ranges(dtype):
    # Segments that share key rows (allgather CP with packed documents): dk/dv are added atomically.
    q, k, v, dout = qkv(2, 40, 50, 4, 2, 64, dtype, seed=5)
    segs = Segments.from_rows([(0, 15, 0, 30, -NO_LIMIT, 15), (15, 25, 10, 40, -8, 15)])
    scale = 64 ** -0.5
    out, lse = flash.attn_fwd_segments(q, k, v, segs, softmax_scale=scale)
    ref_out, ref_lse = reference.attn_fwd_segments_ref(q.float(), k.float(), v.float(), segs,
                                                       softmax_scale=scale)
    assert_close(out, ref_out, dtype)
    _assert_lse(lse, ref_lse, dtype)
    grads = flash.attn_bwd_segments(dout, q, k, v, ref_out.to(dtype), ref_lse, segs, softmax_scale=scale)
    ref_grads = reference.attn_bwd_segments_ref(dout.float(), q.float(), k.float(), v.float(),
                                                ref_out.to(dtype).float(), ref_lse, segs,
                                                softmax_scale=scale)
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, dtype, "grad")


def _chunk_segments(sq, sk, a, b, causal):
    """Segment of the key chunk [a, b) of a bottom-right aligned dense (causal) attention."""
    hi = (sk - sq) - a if causal else NO_LIMIT
    return Segments.from_rows([(0, sq, 0, b - a, -NO_LIMIT, hi)])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_fused_accumulation_fwd_over_key_chunks(dtype, causal):
    sq, sk, bounds = 70, 150, [0, 33, 97, 150]
    q, k, v, _ = qkv(1, sq, sk, 4, 2, 64, dtype, seed=6)
    scale = 64 ** -0.5
    whole_out, whole_lse = flash.flash_attn_fwd(q, k, v, causal=causal)
    ref_out = reference.flash_attn_fwd_ref(q.float(), k.float(), v.float(), causal=causal)[0]
    out_acc = torch.zeros(q.shape, dtype=torch.float32)
    lse_acc = torch.full((1, 4, sq), float("-inf"))
    for a, b in zip(bounds[:-1], bounds[1:]):
        ret = flash.attn_fwd_segments(q, k[:, a:b], v[:, a:b], _chunk_segments(sq, sk, a, b, causal),
                                      softmax_scale=scale, out_acc=out_acc, lse_acc=lse_acc)
        assert ret[0] is out_acc and ret[1] is lse_acc
    # fp32 accumulators: compare with the fp32 reference at the dtype's tolerance, and with one call.
    assert_close(out_acc, ref_out, dtype)
    _assert_lse(lse_acc, whole_lse, dtype)
    assert_close(out_acc, whole_out.float(), dtype)


def test_fused_accumulation_fwd_public_signature():
    # Ring-style: split K/V in two, the public entry point merges into the accumulators in place.
    q, k, v, _ = qkv(2, 33, 64, 2, 2, 128, torch.float32, seed=7)
    whole_out, whole_lse = flash.flash_attn_fwd(q, k, v)
    out_acc = torch.zeros(q.shape)
    lse_acc = torch.full(whole_lse.shape, float("-inf"))
    for a, b in ((0, 40), (40, 64)):
        flash.flash_attn_fwd(q, k[:, a:b], v[:, a:b], out_acc=out_acc, lse_acc=lse_acc)
    assert_close(out_acc, whole_out, torch.float32)
    assert_close(lse_acc, whole_lse, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_fused_accumulation_bwd_over_key_chunks(dtype):
    sq, sk, bounds = 70, 150, [0, 50, 150]
    q, k, v, dout = qkv(1, sq, sk, 4, 1, 64, dtype, seed=8)
    scale = 64 ** -0.5
    out, lse = flash.flash_attn_fwd(q, k, v, causal=True)
    whole = flash.flash_attn_bwd(dout, q, k, v, out, lse, causal=True)
    ref = reference.flash_attn_bwd_ref(dout.float(), q.float(), k.float(), v.float(), out.float(), lse,
                                       causal=True)
    g = torch.Generator().manual_seed(9)
    init = [torch.randn(x.shape, generator=g) for x in (q, k, v)]
    dq_acc, dk_acc, dv_acc = (x.clone() for x in init)
    for a, b in zip(bounds[:-1], bounds[1:]):
        ret = flash.attn_bwd_segments(dout, q, k[:, a:b], v[:, a:b], out, lse,
                                      _chunk_segments(sq, sk, a, b, True), softmax_scale=scale,
                                      dq_acc=dq_acc, dk_acc=dk_acc[:, a:b], dv_acc=dv_acc[:, a:b])
        assert ret[0] is dq_acc
    for name, acc, x0, w, r in zip(("dq", "dk", "dv"), (dq_acc, dk_acc, dv_acc), init, whole, ref):
        assert_close(acc - x0, r, dtype, "grad", msg=name)
        assert_close(acc - x0, w.float(), dtype, "grad", msg=name)


def test_bwd_public_accumulators_packed():
    cu = torch.tensor([0, 17, 81], dtype=torch.int32)
    q, k, v, dout = qkv(1, 81, 81, 2, 1, 64, torch.float32, seed=10, packed=True)
    kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=64, max_seqlen_k=64)
    out, lse = flash.flash_attn_fwd(q, k, v, **kw)
    dq, dk, dv = flash.flash_attn_bwd(dout, q, k, v, out, lse, **kw)
    accs = [torch.ones(x.shape) for x in (q, k, v)]
    ret = flash.flash_attn_bwd(dout, q, k, v, out, lse, dq_acc=accs[0], dk_acc=accs[1], dv_acc=accs[2], **kw)
    for acc, r, g in zip(accs, ret, (dq, dk, dv)):
        assert r is acc
        assert_close(acc - 1.0, g, torch.float32, "grad")


def test_flash_attn_func_autograd():
    q, k, v, dout = qkv(1, 40, 40, 4, 2, 64, torch.float32, seed=11)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = flash.flash_attn_func(q, k, v, causal=True, window_size=(10, 0))
    out.backward(dout)
    ref_out, ref_lse = reference.flash_attn_fwd_ref(q.detach(), k.detach(), v.detach(), causal=True,
                                                    window_size=(10, 0))
    assert_close(out.detach(), ref_out, torch.float32)
    ref = reference.flash_attn_bwd_ref(dout, q.detach(), k.detach(), v.detach(), ref_out, ref_lse,
                                       causal=True, window_size=(10, 0))
    for x, r in zip((q, k, v), ref):
        assert_close(x.grad, r, torch.float32, "grad")


def test_bwd_segments_with_fp32_out_and_dout():
    # The ring backward passes the merged fp32 output (and may pass an fp32 gradient) with fp16 q/k/v.
    q, k, v, dout = qkv(1, 50, 50, 2, 1, 64, torch.float16, seed=12)
    segs = Segments.dense(50, 50, causal=True)
    scale = 0.125
    out32, lse = reference.attn_fwd_segments_ref(q, k, v, segs, softmax_scale=scale,
                                                 out_acc=torch.zeros(q.shape),
                                                 lse_acc=torch.full((1, 2, 50), float("-inf")))
    grads = flash.attn_bwd_segments(dout.float(), q, k, v, out32, lse, segs, softmax_scale=scale)
    ref = reference.attn_bwd_segments_ref(dout.float(), q.float(), k.float(), v.float(), out32, lse, segs,
                                          softmax_scale=scale)
    for g, r in zip(grads, ref):
        assert g.dtype == torch.float16
        assert_close(g, r, torch.float16, "grad")


@pytest.mark.parametrize("d", [16, 96, 192, 256])
def test_other_head_dims(d):
    # Non-power-of-two head dims run in a padded BLOCK_D tile with masked columns.
    q, k, v, dout = qkv(1, 33, 45, 2, 1, d, torch.float32, seed=13)
    _check(q, k, v, dout, torch.float32, causal=True)


@pytest.mark.parametrize("seed", range(6))
def test_random_segment_tables_and_tiles(seed, monkeypatch):
    # Random segment tables (gaps, shared key rows, empty key ranges, one- and two-sided bands) with
    # the GPU-like tile shapes swapped into the interpreter configuration, so the band/tile
    # arithmetic (skipped blocks, unmasked interior blocks, ragged ends) is exercised for them too.
    rng = random.Random(seed)
    fwd_tile = [(16, 32), (32, 16), (128, 64), (64, 128), (32, 32), (16, 16)][seed]
    monkeypatch.setitem(configs._FWD, ("interpreter", 64), KernelConfig(*fwd_tile, 4, 1))
    monkeypatch.setitem(configs._BWD, ("interpreter", 64), KernelConfig(*reversed(fwd_tile), 4, 1))
    hk = rng.choice([1, 2])
    h = hk * rng.choice([1, 3])
    sq, sk = rng.randint(20, 150), rng.randint(20, 150)
    segs = random_segments(rng, sq, sk)
    q, k, v, dout = qkv(2, sq, sk, h, hk, 64, torch.float32, seed=seed)
    scale = 0.125
    out, lse = flash.attn_fwd_segments(q, k, v, segs, softmax_scale=scale)
    ref_out, ref_lse = reference.attn_fwd_segments_ref(q, k, v, segs, softmax_scale=scale)
    assert_close(out, ref_out, torch.float32, msg=str(segs))
    _assert_lse(lse, ref_lse, torch.float32)
    grads = flash.attn_bwd_segments(dout, q, k, v, ref_out, ref_lse, segs, softmax_scale=scale)
    ref_grads = reference.attn_bwd_segments_ref(dout, q, k, v, ref_out, ref_lse, segs, softmax_scale=scale)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(g, r, torch.float32, "grad", msg=f"{name} {segs}")
    g = torch.Generator().manual_seed(seed)
    out_acc = torch.randn(q.shape, generator=g)
    lse_acc = torch.randn(lse.shape, generator=g)
    lse_acc[..., ::3] = float("-inf")
    ref_acc, ref_lacc = out_acc.clone(), lse_acc.clone()
    flash.attn_fwd_segments(q, k, v, segs, softmax_scale=scale, out_acc=out_acc, lse_acc=lse_acc)
    reference.attn_fwd_segments_ref(q, k, v, segs, softmax_scale=scale, out_acc=ref_acc, lse_acc=ref_lacc)
    assert_close(out_acc, ref_acc, torch.float32)
    _assert_lse(lse_acc, ref_lacc, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", [
    dict(b=2, sq=97, sk=97, h=4, hk=2, d=64, causal=True),
    dict(b=1, sq=65, sk=130, h=8, hk=2, d=80, window_size=(20, 5)),
    dict(b=1, sq=200, sk=257, h=2, hk=1, d=64, window_size=(100, 3)),
    dict(docs=[1, 17, 64, 100], h=4, hk=2, d=64, causal=True),
], ids=["causal-gqa", "window-q65-k130-d80", "wide-band", "packed"])
def test_softcap_fwd_bwd_matches_reference(case, dtype):
    """Logit soft-capping (Gemma 2) in the forward, the (split) backward and every kernel path (lean and edge
    blocks, packed documents), against the reference, whose soft-capping tests/ops checks against autograd."""
    kw = dict(causal=case.get("causal", False), window_size=case.get("window_size", (-1, -1)), softcap=2.5)
    if "docs" in case:
        n = sum(case["docs"])
        cu = torch.tensor([0] + torch.tensor(case["docs"]).cumsum(0).tolist(), dtype=torch.int32)
        q, k, v, dout = qkv(1, n, n, case["h"], case["hk"], case["d"], dtype, seed=2, packed=True)
        kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(case["docs"]), max_seqlen_k=max(case["docs"]))
    else:
        q, k, v, dout = qkv(case["b"], case["sq"], case["sk"], case["h"], case["hk"], case["d"], dtype, seed=2)
    q = q * 3  # scores of a few units: most of them bent by the cap
    _check(q, k, v, dout, dtype, **kw)
    # The cap changes the result (a kernel that dropped it would fail above against the capped reference).
    plain = reference.flash_attn_fwd_ref(q.float(), k.float(), v.float(), **{**kw, "softcap": 0.0})[0]
    capped = reference.flash_attn_fwd_ref(q.float(), k.float(), v.float(), **kw)[0]
    assert (plain - capped).abs().max() > 0.05
