"""The forward and the split backward's dQ kernel with K/V read through TMA tensor descriptors
(``KernelConfig(tma=True)``, sm_90+, fp16/bf16) under the interpreter, against the reference: every shape case,
fused accumulators, and key rows outside every segment holding NaN (a TMA box reads them; they must not reach the
output or the gradients). Where the descriptor rules do not hold (fp32, strides that are not 16-byte multiples)
the pointer loads run instead. The sm_90 compiles (TMA instructions, no spills) are in the AOT report
(``fwd_tma``, ``bwd_dq_tma``)."""
import pytest
import torch

from ndp_kernels import configs, flash, reference
from ndp_kernels.segments import NO_LIMIT, Segments
from ndp_kernels.configs import KernelConfig, override
from _kernel_cases import CASES, qkv
from ndp.testing import assert_close

TMA = KernelConfig(32, 32, 4, 1, tma=True)


@pytest.fixture
def descriptors(monkeypatch):
    """Counts the descriptor pairs the launcher builds (proof that the TMA path ran)."""
    made = []
    real = flash._kv_descriptors

    def counting(*a, **k):
        made.append(a[2:])
        return real(*a, **k)
    monkeypatch.setattr(flash, "_kv_descriptors", counting)
    return made


def _assert_fwd(out, lse, ref_out, ref_lse, dtype):
    assert not torch.isnan(out.float()).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert_close(out.float(), ref_out.float(), dtype)
    assert_close(lse[fin], ref_lse[fin], dtype)


@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal,window", CASES)
def test_tma_forward_matches_reference(descriptors, b, sq, sk, h, hk, d, causal, window):
    q, k, v, _ = qkv(b, sq, sk, h, hk, d, torch.float16)
    with override("fwd", TMA):
        out, lse = flash.flash_attn_fwd(q, k, v, causal=causal, window_size=window)
    ref_out, ref_lse = reference.flash_attn_fwd_ref(q.float(), k.float(), v.float(), causal=causal,
                                                    window_size=window)
    _assert_fwd(out, lse, ref_out, ref_lse, torch.float16)
    assert descriptors == [(32, 128 if d > 64 else 64)]


def _nan_outside_segments(seed):
    """Two documents whose keys leave gaps; the gap rows (and the rows past the last document) hold NaN.
    Query rows 0-29 see keys 0-29 (causal), rows 30-69 see keys 40-79 (band): key rows 30-39 and 80-95 belong
    to no segment but sit inside the 32-row boxes TMA reads. Returns segs, q, k, v, dout, clean k, clean v."""
    segs = Segments.from_rows([(0, 30, 0, 30, -NO_LIMIT, 0), (30, 40, 40, 40, -5, NO_LIMIT)])
    q, k, v, dout = qkv(1, 70, 96, 4, 2, 64, torch.float16, seed=seed)
    clean_k, clean_v = k.clone(), v.clone()
    for x in (k, v):
        x[:, 30:40] = float("nan")
        x[:, 80:] = float("nan")
    return segs, q, k, v, dout, clean_k, clean_v


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
def test_key_rows_outside_every_segment_never_reach_the_output(descriptors, tma):
    segs, q, k, v, _, clean_k, clean_v = _nan_outside_segments(seed=3)
    cfg = TMA if tma else KernelConfig(32, 32, 4, 1)
    with override("fwd", cfg):
        out, lse = flash.attn_fwd_segments(q, k, v, segs, softmax_scale=0.125)
        oa = torch.zeros(q.shape)
        la = torch.full((1, 4, 70), float("-inf"))
        flash.attn_fwd_segments(q, k, v, segs, softmax_scale=0.125, out_acc=oa, lse_acc=la)
    ref_out, ref_lse = reference.attn_fwd_segments_ref(q.float(), clean_k.float(), clean_v.float(), segs,
                                                       softmax_scale=0.125)
    _assert_fwd(out, lse, ref_out, ref_lse, torch.float16)
    _assert_fwd(oa, la, ref_out, ref_lse, torch.float16)
    assert len(descriptors) == (2 if tma else 0)


def test_descriptor_rules_fall_back_to_pointer_loads(descriptors):
    q, k, v, _ = qkv(1, 40, 40, 2, 2, 64, torch.float32)
    with override("fwd", TMA):
        out, _ = flash.flash_attn_fwd(q, k, v, causal=True)                     # fp32: no TMA
        assert descriptors == []
        q16, k16, v16 = (x.half() for x in (q, k, v))
        kv = torch.cat([k16, v16], dim=-1)[..., 4:68]                           # base not 16-byte aligned
        out16, _ = flash.flash_attn_fwd(q16, kv, kv, causal=True)
        assert descriptors == []
        out16b, _ = flash.flash_attn_fwd(q16, k16, v16, causal=True)
        assert len(descriptors) == 1
    assert not flash._tma_aligned(torch.zeros(1, 8, 1, 60, dtype=torch.float16))  # 120-byte row stride
    assert flash._tma_aligned(torch.zeros(1, 8, 1, 64, dtype=torch.bfloat16))
    assert not flash._tma_aligned(torch.zeros(1, 0, 1, 64, dtype=torch.bfloat16))  # no key rows
    assert not flash._tma_aligned(torch.zeros(1, 8, 1, 64, dtype=torch.bfloat16).expand(2, 8, 1, 64))  # stride 0
    made = len(descriptors)
    with override("fwd", TMA):  # no key at all: every row sees nothing (a TMA descriptor of it would assert)
        q0 = torch.randn(1, 8, 2, 64).half()
        k0 = torch.zeros(1, 0, 2, 64, dtype=torch.float16)
        out0, lse0 = flash.flash_attn_fwd(q0, k0, k0, causal=False)
    assert len(descriptors) == made and torch.equal(out0, torch.zeros_like(out0)) and torch.isneginf(lse0).all()
    ref = reference.flash_attn_fwd_ref(q, kv.float(), kv.float(), causal=True)[0]
    assert_close(out16.float(), ref, torch.float16)
    assert_close(out16b.float(), reference.flash_attn_fwd_ref(q16.float(), k16.float(), v16.float(),
                                                              causal=True)[0], torch.float16)
    assert_close(out, reference.flash_attn_fwd_ref(q, k, v, causal=True)[0], torch.float32)


def test_tma_config_reads_back_from_a_tuned_row():
    assert KernelConfig(*TMA.as_row()) == TMA and str(TMA) == "M32/N32/w4/s1/tma"
    plain = KernelConfig(128, 64, 8, 3)
    assert plain.as_row() == [128, 64, 8, 3] and KernelConfig(*plain.as_row()) == plain


@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal,window", CASES)
def test_tma_dq_kernel_matches_reference(descriptors, b, sq, sk, h, hk, d, causal, window):
    q, k, v, dout = qkv(b, sq, sk, h, hk, d, torch.float16, seed=2)
    kw = dict(causal=causal, window_size=window)
    out, lse = reference.flash_attn_fwd_ref(q.float(), k.float(), v.float(), **kw)
    with override("bwd_dq", TMA):
        grads = flash.flash_attn_bwd(dout, q, k, v, out.half(), lse, deterministic=True, **kw)
    want = reference.flash_attn_bwd_ref(dout.float(), q.float(), k.float(), v.float(), out.half().float(), lse,
                                        **kw)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        assert not torch.isnan(g.float()).any(), name
        assert_close(g, w, torch.float16, "grad", msg=name)
    # One dQ launch with descriptors (the dK/dV kernel keeps its pointer loads); none for sq = 0 rows.
    assert descriptors == [(32, 128 if d > 64 else 64)]


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
def test_dq_ignores_key_rows_outside_every_segment(descriptors, tma):
    segs, q, k, v, dout, clean_k, clean_v = _nan_outside_segments(seed=4)
    out, lse = reference.attn_fwd_segments_ref(q.float(), clean_k.float(), clean_v.float(), segs,
                                               softmax_scale=0.125)
    with override("bwd_dq", TMA if tma else KernelConfig(32, 32, 4, 1)):
        dq, _, _ = flash.attn_bwd_segments(dout, q, k, v, out.half(), lse, segs, softmax_scale=0.125,
                                           deterministic=True)
    want = reference.attn_bwd_segments_ref(dout.float(), q.float(), clean_k.float(), clean_v.float(),
                                           out.half().float(), lse, segs, softmax_scale=0.125)[0]
    assert not torch.isnan(dq.float()).any()
    assert_close(dq, want, torch.float16, "grad")
    assert len(descriptors) == (1 if tma else 0)


def test_dq_kernel_keeps_pointer_loads_above_head_dim_128(descriptors):
    q, k, v, dout = qkv(1, 33, 33, 2, 1, 256, torch.float16, seed=5)
    out, lse = reference.flash_attn_fwd_ref(q.float(), k.float(), v.float(), causal=True)
    with override("bwd_dq", TMA):
        grads = flash.flash_attn_bwd(dout, q, k, v, out.half(), lse, causal=True, deterministic=True)
    assert descriptors == [] and configs.TMA_DQ_MAX_HEAD_DIM == 128
    want = reference.flash_attn_bwd_ref(dout.float(), q.float(), k.float(), v.float(), out.half().float(), lse,
                                        causal=True)
    assert_close(grads[0], want[0], torch.float16, "grad")
