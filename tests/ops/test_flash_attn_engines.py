"""flash-attn engines (``flash_attn3``: FlashAttention-3, ``flash_attn``: FlashAttention-2): the real library
where it is installed on a Hopper GPU, and on every machine ndp's wiring through stand-in modules with each
version's entry-point signatures and semantics (varlen layout, bottom-right windows, lse [H, total] with +inf
for rows without keys, gradients written into dq/dk/dv), so argument mapping, lse conventions and the
accumulators are checked here too."""
import math
import sys
import types

import pytest
import torch

import ndp
from ndp.ops import _flash_attn
from ndp.ops.engines import capable, engine_available
from ndp_kernels import Segments
from ndp_kernels.reference import attn_bwd_segments_ref, attn_fwd_segments_ref
from _engine_cases import varlen_bwd, varlen_fwd
from ndp.testing import assert_close


def _fake_forward(q, k, v, k_new=None, v_new=None, qv=None, out_=None, cu_seqlens_q=None, cu_seqlens_k=None,
                  cu_seqlens_k_new=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
                  page_table=None, kv_batch_idx=None, leftpad_k=None, rotary_cos=None, rotary_sin=None,
                  seqlens_rotary=None, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                  causal=False, window_size_left=-1, window_size_right=-1, attention_chunk=0, softcap=0.0,
                  rotary_interleaved=True, scheduler_metadata=None, num_splits=1, pack_gqa=None, sm_margin=0):
    out, lse = varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, window_size_left,
                          0 if causal else window_size_right, softmax_scale)
    return out, lse, torch.empty(0), torch.empty(0)


def _fake_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None, sequed_q=None,
                   sequed_k=None, max_seqlen_q=None, max_seqlen_k=None, dq=None, dk=None, dv=None,
                   softmax_scale=None, is_causal=False, window_size_left=-1, window_size_right=-1, softcap=0.0,
                   deterministic=False, sm_margin=0):
    _fake_backward.deterministic = deterministic
    grads = varlen_bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, window_size_left,
                       0 if is_causal else window_size_right, softmax_scale)
    for buf, g in zip((dq, dk, dv), grads):
        buf.copy_(g)
    return torch.empty(0)


def _fa2_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                     softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                     deterministic=False, return_attn_probs=False, block_table=None):
    out, lse, _, _ = _fake_forward(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                   softmax_scale=softmax_scale, causal=causal, window_size_left=window_size[0],
                                   window_size_right=window_size[1])
    return (out, lse, None) if return_attn_probs else out


def _fa2_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                         alibi_slopes, deterministic, rng_state=None):
    assert dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None
    return _fake_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, dq=dq, dk=dk, dv=dv,
                          softmax_scale=softmax_scale, is_causal=causal, window_size_left=window_size_left,
                          window_size_right=window_size_right, deterministic=deterministic)


@pytest.fixture
def fake_fa3(monkeypatch):
    mod = types.ModuleType("flash_attn_interface")
    mod._flash_attn_forward, mod._flash_attn_backward = _fake_forward, _fake_backward
    monkeypatch.setitem(sys.modules, "flash_attn_interface", mod)
    return mod


@pytest.fixture
def fake_fa(monkeypatch, fake_fa3):
    pkg = types.ModuleType("flash_attn")
    iface = types.ModuleType("flash_attn.flash_attn_interface")
    pkg.flash_attn_varlen_func, pkg.flash_attn_interface = _fa2_varlen_func, iface
    iface._flash_attn_varlen_backward = _fa2_varlen_backward
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", iface)


CASES = [  # (seqlens_q, seqlens_k, causal, window): back-to-back segments, bottom-right aligned
    ([64], [64], True, (-1, -1)),
    ([48], [80], False, (-1, -1)),
    ([40], [72], True, (-1, -1)),        # sq < sk causal
    ([72], [40], True, (-1, -1)),        # sq > sk causal: the first 32 rows see no key
    ([64], [64], False, (8, 4)),         # sliding window
    ([1, 17, 30], [1, 17, 30], True, (-1, -1)),   # packed documents
]


@pytest.mark.parametrize("lq,lk,causal,window", CASES)
@pytest.mark.parametrize("acc", [False, True])
@pytest.mark.parametrize("version", [3, 2])
def test_wiring_through_flash_attn_signatures(fake_fa, lq, lk, causal, window, acc, version):
    cu_q = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32)
    segs = Segments.from_cu_seqlens(cu_q, cu_k, causal=causal, window_size=window)
    g = torch.Generator().manual_seed(1)
    h, hk, d = 4, 2, 64
    q4, k4, v4, = (torch.randn(1, n, hh, d, generator=g).half() for n, hh in ((sum(lq), h), (sum(lk), hk),
                                                                             (sum(lk), hk)))
    scale = d ** -0.5
    ok, why = capable("flash_attn3" if version == 3 else "flash_attn", segs, q4, k4)
    assert ok, why
    want_o, want_l = attn_fwd_segments_ref(q4, k4, v4, segs, softmax_scale=scale)
    if acc:
        o_acc = torch.zeros(1, sum(lq), h, d)
        l_acc = torch.full((1, h, sum(lq)), -math.inf)
        got_o, got_l = _flash_attn.fwd(q4, k4, v4, segs, softmax_scale=scale, out_acc=o_acc, lse_acc=l_acc,
                                       version=version)
        assert got_o is o_acc and got_l is l_acc
    else:
        got_o, got_l = _flash_attn.fwd(q4, k4, v4, segs, softmax_scale=scale, version=version)
    assert_close(got_o.float(), want_o.float(), torch.float16)
    assert torch.equal(torch.isneginf(got_l), torch.isneginf(want_l))   # rows without keys: -inf, as ndp's contract
    fin = torch.isfinite(want_l)
    assert_close(got_l[fin], want_l[fin], torch.float32)   # lse is fp32 either way
    dout = torch.randn(want_o.shape, generator=g).half()
    want = attn_bwd_segments_ref(dout, q4, k4, v4, want_o, want_l, segs, softmax_scale=scale)
    accs = [torch.zeros(x.shape) for x in (q4, k4, v4)] if acc else [None] * 3
    got = _flash_attn.bwd(dout, q4, k4, v4, want_o, want_l, segs, softmax_scale=scale, dq_acc=accs[0],
                          dk_acc=accs[1], dv_acc=accs[2], deterministic=True, version=version)
    assert _fake_backward.deterministic is True
    for a, b, name in zip(got, want, "qkv"):
        assert torch.isfinite(a).all(), f"d{name} not finite (an lse of -inf reached flash-attn's backward)"
        assert_close(a.float(), b.float(), torch.float16, "grad")


def test_capable_refuses_what_the_varlen_api_cannot_express(fake_fa3):
    q4 = torch.zeros(1, 32, 4, 64, dtype=torch.float16)
    k4 = torch.zeros(1, 32, 2, 64, dtype=torch.float16)
    striped = Segments.from_rows([(0, 32, 0, 32, -(1 << 30), -1)])   # band_hi -1: strictly below the diagonal
    assert not capable("flash_attn3", striped, q4, k4)[0]
    dense = Segments.dense(32, 32, causal=True)
    assert not capable("flash_attn3", dense, q4.float(), k4.float())[0]      # fp32
    assert not capable("flash_attn3", dense, q4[..., :60], k4[..., :60])[0]  # head_dim % 8


def test_available_says_why_here():
    ok, why = engine_available("flash_attn3", "cpu")
    assert not ok and "CUDA" in why
    with pytest.raises((ValueError, RuntimeError), match="flash_attn3"):
        ndp.ops.attention(torch.zeros(1, 8, 2, 64), torch.zeros(1, 8, 2, 64), torch.zeros(1, 8, 2, 64),
                          backend="flash_attn3")


def _real_fa3():
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    return _flash_attn.available3()


@pytest.mark.gpu
@pytest.mark.skipif(not _real_fa3()[0], reason=f"FlashAttention-3 not usable here: {_real_fa3()[1]}")
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (False, (128, 32))])
def test_real_fa3_matches_reference(causal, window):
    torch.manual_seed(0)
    q = torch.randn(2, 512, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 512, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 512, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = ndp.ops.attention(q, k, v, causal=causal, window_size=window, backend="flash_attn3")
    ref = ndp.ops.attention(q.double(), k.double(), v.double(), causal=causal, window_size=window, backend="torch")
    assert_close(out.double(), ref, torch.bfloat16)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout.double())
    for a, b in zip(got, want):
        assert_close(a.double(), b, torch.bfloat16, "grad")


def test_cu_seqlens_reach_the_device_once_per_segment_table():
    # Every layer's forward and backward of a step run the same packed table: its cu_seqlens are copied to the
    # device once (a copy per call would be two blocking transfers per layer and direction).
    segs = Segments.from_cu_seqlens([0, 5, 16], [0, 5, 16], causal=True)
    q = torch.zeros(1, 16, 2, 8, dtype=torch.bfloat16)
    first, again = _flash_attn._varlen_args(q, q, segs), _flash_attn._varlen_args(q, q, segs)
    assert first[0].tolist() == [0, 5, 16] and first[0] is again[0] and first[1] is again[1]
    assert _flash_attn._varlen_args(q.float(), q.float(), segs) is None           # not flash-attn's dtype
