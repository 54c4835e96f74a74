"""ndp.ops: the reference checked against torch SDPA, autograd, fused accumulators, backend selection."""
import pytest
import torch
import torch.nn.functional as F

import ndp
import ndp_kernels
from ndp_kernels import Segments
from ndp_kernels.reference import flash_attn_bwd_ref, flash_attn_fwd_ref
from dense_attention import dense_reference
from ndp.testing import assert_close


def _sdpa(q, k, v, causal, window=(-1, -1)):
    """Independent reference: torch SDPA with an explicit bottom-right mask (GQA expanded)."""
    sq, sk, g = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    d = torch.arange(sk)[None, :] - torch.arange(sq)[:, None] - (sk - sq)
    m = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        m &= d <= 0
    if window[0] >= 0:
        m &= d >= -window[0]
    if window[1] >= 0:
        m &= d <= window[1]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kt, vt = kt.repeat_interleave(g, 1), vt.repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=m).transpose(1, 2)


def _qkv(b, sq, sk, h, hk, d, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    return mk(b, sq, h, d), mk(b, sk, hk, d), mk(b, sk, hk, d)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (7, 3)), (True, (16, -1))])
@pytest.mark.parametrize("sq,sk,h,hk,d", [(97, 97, 4, 1, 64), (17, 40, 4, 2, 80), (33, 33, 2, 2, 16)])
def test_reference_matches_sdpa_fwd_bwd(causal, window, sq, sk, h, hk, d):
    q, k, v = _qkv(2, sq, sk, h, hk, d)
    want = _sdpa(q, k, v, causal, window)
    got = ndp.ops.attention(q, k, v, causal=causal, window_size=window, backend="torch")
    assert_close(got, want, torch.float64)
    dout = torch.randn_like(want)
    gw = torch.autograd.grad(want, (q, k, v), dout)
    gg = torch.autograd.grad(got, (q, k, v), dout)
    for a, b in zip(gg, gw):
        assert_close(a, b, torch.float64, "grad")


def test_packed_equals_per_document():
    lens = [1, 17, 64, 30]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    q, k, v = (x[0] for x in _qkv(1, sum(lens), sum(lens), 4, 2, 32))
    out, lse = ndp.ops.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, backend="torch",
                                 return_lse=True)
    for i in range(len(lens)):
        a, b = cu[i].item(), cu[i + 1].item()
        o1, l1 = flash_attn_fwd_ref(q[None, a:b], k[None, a:b], v[None, a:b], causal=True)
        assert_close(out[a:b], o1[0], torch.float64)
        assert_close(lse[:, a:b], l1[0], torch.float64)


def test_rows_without_keys_give_zero_and_minus_inf():
    # causal with seq_q > seq_k (bottom-right): the first seq_q - seq_k queries see nothing.
    q, k, v = _qkv(1, 10, 4, 2, 2, 16)
    out, lse = ndp.ops.attention(q, k, v, causal=True, backend="torch", return_lse=True)
    assert torch.all(out[:, :6] == 0) and torch.all(lse[:, :, :6] == float("-inf"))
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.all(q.grad[:, :6] == 0)


def test_fused_accumulator_over_key_blocks_equals_whole():
    q, k, v = (x.detach().float() for x in _qkv(2, 50, 50, 4, 2, 32))
    whole, lse = flash_attn_fwd_ref(q, k, v)
    out_acc = torch.zeros(q.shape)
    lse_acc = torch.full((2, 4, 50), float("-inf"))
    for a, b in ((0, 13), (13, 40), (40, 50)):
        segs = Segments.from_rows([(0, 50, 0, b - a, -ndp_kernels.NO_LIMIT, ndp_kernels.NO_LIMIT)])
        ndp.ops.attention_fwd(q, k[:, a:b], v[:, a:b], segs, softmax_scale=32 ** -0.5, out_acc=out_acc,
                              lse_acc=lse_acc, backend="torch")
    assert_close(out_acc, whole.float(), torch.float32)
    assert_close(lse_acc, lse, torch.float32)
    dout = torch.randn_like(q)
    want = flash_attn_bwd_ref(dout, q, k, v, whole, lse)
    accs = [torch.zeros(x.shape) for x in (q, k, v)]
    for a, b in ((0, 13), (13, 50)):
        segs = Segments.from_rows([(0, 50, 0, b - a, -ndp_kernels.NO_LIMIT, ndp_kernels.NO_LIMIT)])
        dq, dk, dv = (torch.zeros(x.shape) for x in (q, k[:, a:b], v[:, a:b]))
        ndp.ops.attention_bwd(dout, q, k[:, a:b], v[:, a:b], whole, lse, segs, softmax_scale=32 ** -0.5,
                              dq_acc=dq, dk_acc=dk, dv_acc=dv, backend="torch")
        accs[0] += dq
        accs[1][:, a:b] += dk
        accs[2][:, a:b] += dv
    for a, w in zip(accs, want):
        assert_close(a, w, torch.float32, "grad")


def test_backend_selection_and_errors():
    assert ndp.ops.resolve_backend("auto", "cpu") == "auto"  # the engine is chosen per block
    with pytest.raises(ValueError, match="backend must be one of"):
        ndp.ops.resolve_backend("cudnn", "cpu")
    with pytest.raises(RuntimeError, match="flash-attn needs a CUDA device"):
        ndp.ops.resolve_backend("flash_attn", "cpu")
    q, k, v = _qkv(1, 8, 8, 4, 2, 16)
    with pytest.raises(ValueError, match="heads must be divisible by kv_heads"):
        ndp.ops.attention(q, k[:, :, :1].expand(-1, -1, 3, -1).contiguous(), v[:, :, :1].expand(-1, -1, 3, -1)
                          .contiguous(), backend="torch")
    with pytest.raises(TypeError, match="must be int32"):
        ndp.ops.attention(q[0], k[0], v[0], cu_seqlens_q=torch.tensor([0, 8]), cu_seqlens_k=torch.tensor([0, 8]))


def test_triton_backend_under_interpreter_matches_torch():
    pytest.importorskip("triton")
    if not ndp_kernels.interpreter_active():
        pytest.skip("triton backend on CPU runs only under TRITON_INTERPRET=1")
    q, k, v = (x.detach().float().requires_grad_() for x in _qkv(1, 37, 37, 4, 2, 32))
    outs, grads = [], []
    for be in ("torch", "triton"):
        out = ndp.ops.attention(q, k, v, causal=True, backend=be)
        outs.append(out)
        grads.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    assert_close(outs[1], outs[0], torch.float32)
    for a, b in zip(grads[1], grads[0]):
        assert_close(a, b, torch.float32, "grad")


def test_bf16_under_interpreter_refused_by_triton_and_routed_around(monkeypatch):
    """The interpreter multiplies bf16 bit patterns in tl.dot (outputs ~1e8 off): the triton engine refuses bf16
    there by name, and auto (softcap: triton or torch only) takes the reference instead, matching it bitwise."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = (x.detach().to(torch.bfloat16) for x in _qkv(1, 16, 16, 4, 2, 16))
    with pytest.raises(ValueError, match=r"backend 'triton' cannot run this causal attention block \(torch.bfloat16, "
                                         r"head_dim 16, softcap 30\): Triton's interpreter .* bfloat16 .*Engines "
                                         r"that can here: \['torch'\]"):
        ndp.ops.attention(q, k, v, causal=True, backend="triton", softcap=30.0)
    auto = ndp.ops.attention(q, k, v, causal=True, softcap=30.0)
    assert torch.equal(auto, ndp.ops.attention(q, k, v, causal=True, backend="torch", softcap=30.0))
    ok, why = ndp.ops.engines.capable("triton", Segments.dense(16, 16, causal=True), q, k)
    assert not ok and "interpreter" in why
    assert ndp.ops.engines.capable("triton", Segments.dense(16, 16, causal=True), q.half(), k.half()) == (True, "")


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -1.0])
def test_bad_softmax_scale_refused(scale):
    # Used to return finite, wrong output (issue 11): refused by the shared check before any backend runs.
    q, k, v = _qkv(1, 8, 8, 4, 2, 16)
    for backend in ("auto", "torch"):
        with pytest.raises(ValueError, match=r"softmax_scale must be finite and > 0; got softmax_scale="):
            ndp.ops.attention(q, k, v, causal=True, softmax_scale=scale, backend=backend)
    out = ndp.ops.attention(q, k, v, causal=True, softmax_scale=0.5, backend="torch")
    want = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k.repeat_interleave(2, 2),
                                            v.repeat_interleave(2, 2))), is_causal=True, scale=0.5).transpose(1, 2)
    assert_close(out, want, torch.float64)


@pytest.mark.parametrize("backend", ["torch", "sdpa", "triton"])
@pytest.mark.parametrize("case", [dict(causal=True), dict(causal=True, window=(4, 0)), dict(causal=False),
                                  dict(causal=True, docs=[7, 0, 12, 1])])
def test_sinks_match_definition(backend, case):
    """Attention sinks (gpt-oss) on every CPU engine: out, lse and the gradients of q, k, v and the sinks."""
    n = sum(case["docs"]) if "docs" in case else 19
    q, k, v = _qkv(1, n, n, 4, 2, 16)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(3), dtype=torch.float64, requires_grad=True)
    kw = dict(causal=case["causal"], window_size=case.get("window", (-1, -1)))
    if "docs" in case:
        cu = torch.tensor([0] + torch.tensor(case["docs"]).cumsum(0).tolist(), dtype=torch.int32)
        q, k, v = (x[0].detach().requires_grad_() for x in (q, k, v))
        kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(case["docs"]), max_seqlen_k=max(case["docs"]))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    want = dense_reference(case, q, k, v, dout, sinks)
    dt = torch.float32 if backend == "triton" else torch.float64
    qc, kc, vc, sc = (x.detach().to(dt).requires_grad_() for x in (q, k, v, sinks))
    out, lse = ndp.ops.attention(qc, kc, vc, backend=backend, return_lse=True, sinks=sc, **kw)
    grads = torch.autograd.grad(out, (qc, kc, vc, sc), dout.to(dt))
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), (out, lse) + grads, want):
        assert_close(g, w, dt, "out" if name in ("out", "lse") else "grad", msg=f"{backend} {name} {case}")


def test_sinks_rows_without_keys_and_bad_shapes():
    # Bottom-right causal with 6 queries and 4 keys: the first 2 rows see no key and give all weight to the sink.
    q, k, v = _qkv(1, 6, 4, 2, 1, 16)
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)
    out, lse = ndp.ops.attention(q, k, v, causal=True, backend="torch", return_lse=True, sinks=sinks)
    assert torch.equal(out[:, :2], torch.zeros_like(out[:, :2]))
    assert torch.equal(lse[0, :, :2], sinks[:, None].expand(2, 2))
    with pytest.raises(ValueError, match=r"sinks must have shape \[heads\] = \[2\]"):
        ndp.ops.attention(q, k, v, sinks=torch.zeros(4, dtype=torch.float64))
    with pytest.raises(TypeError, match="sinks must be a floating-point tensor"):
        ndp.ops.attention(q, k, v, sinks=torch.zeros(2, dtype=torch.int64))


def _definition_case(case, q, k, v, backend):
    """(inputs: q, k, v and the case's sinks in the backend's dtype, requiring grad; dout; the reference from the
    definition: out, lse and every gradient; the dtype)."""
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(3), dtype=torch.float64) if case.get("sinks") \
        else None
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    want = dense_reference(case, q, k, v, dout, sinks)
    dt = torch.float32 if backend == "triton" else torch.float64
    inputs = tuple(x.detach().to(dt).requires_grad_() for x in (q, k, v) + ((sinks,) if sinks is not None else ()))
    return inputs, dout, want, dt


@pytest.mark.parametrize("backend", ["torch", "triton", "auto"])
@pytest.mark.parametrize("case", [dict(causal=True), dict(causal=False, window=(4, 2)), dict(causal=False),
                                  dict(causal=True, docs=[7, 0, 12, 1]), dict(causal=True, sinks=True)])
def test_softcap_matches_definition(backend, case):
    """Logit soft-capping (Gemma 2) on the engines that have it (auto picks one of them, on CPU the reference):
    out, lse and every gradient against attention written from the definition."""
    if backend == "triton" and not ndp_kernels.interpreter_active():
        pytest.skip("triton backend on CPU runs only under TRITON_INTERPRET=1")
    case = dict(case, softcap=1.5)
    n = sum(case["docs"]) if "docs" in case else 19
    q, k, v = (x * 2 for x in _qkv(1, n, n, 4, 2, 16))
    kw = dict(causal=case["causal"], window_size=case.get("window", (-1, -1)), softcap=1.5)
    if "docs" in case:
        cu = torch.tensor([0] + torch.tensor(case["docs"]).cumsum(0).tolist(), dtype=torch.int32)
        q, k, v = (x[0] for x in (q, k, v))
        kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(case["docs"]), max_seqlen_k=max(case["docs"]))
    inputs, dout, want, dt = _definition_case(case, q, k, v, backend)
    sinks = inputs[3] if len(inputs) > 3 else None
    out, lse = ndp.ops.attention(*inputs[:3], backend=backend, return_lse=True, sinks=sinks, **kw)
    grads = torch.autograd.grad(out, inputs, dout.to(dt))
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), (out, lse) + grads, want):
        assert_close(g, w, dt, "out" if name in ("out", "lse") else "grad", msg=f"{backend} {name} {case}")
    plain = ndp.ops.attention(*(x.detach() for x in inputs[:3]), backend="torch", **{**kw, "softcap": 0.0})
    assert (plain - out).abs().max() > 0.05  # the cap bends these scores: dropping it would be seen


@pytest.mark.parametrize("backend", ["torch", "sdpa", "triton", "auto"])
@pytest.mark.parametrize("d,dv", [(32, 16), (16, 32)])
@pytest.mark.parametrize("case", [dict(causal=True), dict(causal=False, window=(4, 2), sinks=True),
                                  dict(causal=True, docs=[7, 0, 12, 1], softcap=2.0)])
def test_value_head_unlike_query_head(backend, d, dv, case):
    """MLA (DeepSeek-V2/V3): v's head size differs from q/k's; out has v's, the scale is q's; out, lse and every
    gradient against attention written from the definition."""
    if backend == "triton" and not ndp_kernels.interpreter_active():
        pytest.skip("triton backend on CPU runs only under TRITON_INTERPRET=1")
    if backend == "sdpa" and case.get("softcap"):
        pytest.skip("sdpa has no soft-capping (test_softcap_routing_and_bad_values)")
    n = sum(case["docs"]) if "docs" in case else 19
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, n, 4, d, generator=g, dtype=torch.float64), torch.randn(1, n, 2, d, generator=g,
                                                                                   dtype=torch.float64)
    v = torch.randn(1, n, 2, dv, generator=g, dtype=torch.float64)
    kw = dict(causal=case["causal"], window_size=case.get("window", (-1, -1)), softcap=case.get("softcap", 0.0))
    if "docs" in case:
        cu = torch.tensor([0] + torch.tensor(case["docs"]).cumsum(0).tolist(), dtype=torch.int32)
        q, k, v = (x[0] for x in (q, k, v))
        kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(case["docs"]), max_seqlen_k=max(case["docs"]))
    sinks = torch.randn(4, generator=g, dtype=torch.float64) if case.get("sinks") else None
    dout = torch.randn(*q.shape[:-1], dv, generator=g, dtype=torch.float64)
    want = dense_reference(case, q, k, v, dout, sinks)
    dt = torch.float32 if backend == "triton" else torch.float64
    inputs = tuple(x.detach().to(dt).requires_grad_() for x in (q, k, v) + ((sinks,) if sinks is not None else ()))
    out, lse = ndp.ops.attention(*inputs[:3], backend=backend, return_lse=True,
                                 sinks=inputs[3] if sinks is not None else None, **kw)
    assert out.shape == (*q.shape[:-1], dv) and out.is_contiguous()
    grads = torch.autograd.grad(out, inputs, dout.to(dt))
    for name, got, w in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), (out, lse) + grads, want):
        assert_close(got, w, dt, "out" if name in ("out", "lse") else "grad", msg=f"{backend} {name} {case}")


def test_softcap_routing_and_bad_values():
    q, k, v = (x.detach() for x in _qkv(1, 16, 16, 4, 2, 16))
    # An engine without soft-capping is refused by name, with the engines that have it.
    with pytest.raises(ValueError, match=r"backend 'sdpa' cannot run this causal attention block .*softcap 30\): "
                                         r"sdpa has no logit soft-capping.*Engines that can here: \[.*'torch'\]"):
        ndp.ops.attention(q, k, v, causal=True, backend="sdpa", softcap=30.0)
    # auto on CPU: the reference, bitwise.
    auto = ndp.ops.attention(q, k, v, causal=True, softcap=30.0)
    assert torch.equal(auto, ndp.ops.attention(q, k, v, causal=True, backend="torch", softcap=30.0))
    # 0 and None are "no cap": the same as leaving it out.
    plain = ndp.ops.attention(q, k, v, causal=True, backend="torch")
    for off in (0, 0.0, None):
        assert torch.equal(ndp.ops.attention(q, k, v, causal=True, backend="torch", softcap=off), plain)
    for bad, exc, match in ((-1.0, ValueError, r"softcap must be finite and >= 0 \(0 = no soft-capping\); got "
                                               r"softcap=-1.0"),
                            (float("inf"), ValueError, "softcap must be finite"),
                            ("50", TypeError, "softcap must be a real number"),
                            (True, TypeError, "softcap must be a real number")):
        with pytest.raises(exc, match=match):
            ndp.ops.attention(q, k, v, causal=True, softcap=bad)


@pytest.mark.parametrize("backend", ["torch", "sdpa", "triton", "auto"])
@pytest.mark.parametrize("case", [dict(spans=((3, 9), (9, 12), (20, 31))), dict(spans=((0, 40),)),
                                  dict(spans=((5, 25), (39, 40)), window=(6, 0), sinks=True),
                                  dict(spans=((2, 30),), window=(30, 0))])
def test_bidirectional_spans_match_definition(backend, case):
    """Image blocks (Gemma 3): causal attention with every query of a span seeing the whole span, the window (if
    any) still bounding the keys before it; out, lse and every gradient against attention written from the
    definition, on every engine, and through the op as torch.compile traces it."""
    if backend == "triton" and not ndp_kernels.interpreter_active():
        pytest.skip("triton backend on CPU runs only under TRITON_INTERPRET=1")
    case = dict(case, causal=True)
    q, k, v = _qkv(2, 40, 40, 4, 2, 16)
    inputs, dout, want, dt = _definition_case(case, q, k, v, backend)
    sinks = inputs[3] if len(inputs) > 3 else None
    kw = dict(causal=True, window_size=case.get("window", (-1, -1)), bidirectional_spans=case["spans"],
              backend=backend, return_lse=True, sinks=sinks)
    torch._dynamo.reset()  # each case compiles afresh (dynamo's recompile limit)
    for run in (ndp.ops.attention, torch.compile(ndp.ops.attention, backend="aot_eager", fullgraph=True)):
        out, lse = run(*inputs[:3], **kw)
        grads = torch.autograd.grad(out, inputs, dout.to(dt))
        for name, g, w in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), (out, lse) + grads, want):
            assert_close(g, w, dt, "out" if name in ("out", "lse") else "grad", msg=f"{backend} {name} {case}")
    causal = ndp.ops.attention(*(x.detach() for x in inputs[:3]), causal=True, window_size=kw["window_size"])
    assert (causal - out).abs().max() > 0.05  # the spans change these rows: dropping them would be seen


def test_bidirectional_spans_refused_where_they_mean_nothing_exact():
    q, k, v = (x.detach() for x in _qkv(1, 16, 16, 4, 2, 16))
    for spans, match in ((((4, 9), (8, 12)), r"disjoint \[start, end\) ranges of positions 0 \.\. 15.*fix \(4, 9\)"),
                         (((4, 17),), r"fix \(4, 17\)"), (((5, 5),), r"non-empty.*fix \(5, 5\)"),
                         (((9, 12), (2, 5)), r"in ascending order; got \[\(9, 12\), \(2, 5\)\]: fix \(9, 12\)")):
        with pytest.raises(ValueError, match=match):
            ndp.ops.attention(q, k, v, causal=True, bidirectional_spans=spans)
    with pytest.raises(TypeError, match="bidirectional_spans must be \\(start, end\\) pairs of ints; got \\[3\\]"):
        ndp.ops.attention(q, k, v, causal=True, bidirectional_spans=[3])
    with pytest.raises(ValueError, match="widen a causal mask.*Pass causal=True"):
        ndp.ops.attention(q, k, v, causal=False, bidirectional_spans=((2, 6),))
    with pytest.raises(ValueError, match=r"as many queries as keys; got 8 queries and 16 keys \(a KV cache\)"):
        ndp.ops.attention(q[:, :8], k, v, causal=True, bidirectional_spans=((2, 6),))
    cu = torch.tensor([0, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"as many queries as keys; got packed documents \(cu_seqlens"):
        ndp.ops.attention(q[0], k[0], v[0], causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                          bidirectional_spans=((2, 6),))
    restart = torch.cat([torch.arange(9), torch.arange(7)])[None]
    with pytest.raises(ValueError, match=r"got packed documents \(cu_seqlens, or position_ids that restart\)"):
        ndp.ops.attention(q, k, v, causal=True, bidirectional_spans=((2, 6),), position_ids=restart)
    # positions that continue: one document, the spans apply
    assert torch.equal(ndp.ops.attention(q, k, v, causal=True, bidirectional_spans=((2, 6),),
                                         position_ids=torch.arange(16)[None]),
                       ndp.ops.attention(q, k, v, causal=True, bidirectional_spans=((2, 6),)))
    # none, or an empty list: plain causal attention, bitwise
    plain = ndp.ops.attention(q, k, v, causal=True)
    for off in (None, (), []):
        assert torch.equal(ndp.ops.attention(q, k, v, causal=True, bidirectional_spans=off), plain)
