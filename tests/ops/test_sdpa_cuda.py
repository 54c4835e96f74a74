"""The ``sdpa`` engine's CUDA half (``ndp/ops/_sdpa_cuda.py``) on a machine without a GPU, two ways:

1. Semantics: torch's cuDNN, flash and memory-efficient ATen ops are replaced by CPU stand-ins that do what
   those kernels do (their layouts: cuDNN heads-first with lse ``[B, H, S, 1]``, flash ``[B, S, H, D]`` or
   varlen ``[T, H, D]`` with bottom-right windows, GQA and +inf lse for rows without keys, efficient lse padded
   to 32 rows; backwards that recompute from the given out and lse), and check the RNG tensors and lse layout
   the forward returned come back to the backward. Every block table of test_engines runs through every kernel
   order against the float64 reference, with and without fp32 accumulators, and the first-use check rejects a
   kernel whose results are wrong.
2. Calling convention: the same code calls the installed torch's real ops on ``meta`` tensors (their meta
   kernels give the CUDA kernels' output layouts) and every call is bound to the op's schema.
The real kernels run where a CUDA GPU is (skipped here)."""
import math

import pytest
import torch

import ndp
from ndp.ops import _sdpa_cuda, engines
from ndp.ops._pieces import run_pieces_bwd, run_pieces_fwd
from ndp_kernels import Segments
from _engine_cases import TABLES, _assert_matches, _inputs, _ref, attend_bwd, attend_fwd, varlen_bwd, varlen_fwd, \
    window_mask

ORDERS = [("cudnn", "flash", "efficient"), ("flash",), ("cudnn", "efficient"), ("efficient",)]


# --------------------------------------------------------------------------------------------- stand-ins

class FakeAten:
    """CPU stand-ins with the real ops' signatures and layouts; records what the backwards were given."""

    def __init__(self, wrong=None):
        self.wrong = wrong          # a kernel whose forward is made wrong (for the first-use check)
        self.calls = []

    # flash (torch's FlashAttention-2)
    def _flash_attention_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
                                 *, scale=None, window_size_left=None, window_size_right=None, seqused_k=None,
                                 alibi_slopes=None, block_table=None, num_splits=None):
        assert dropout_p == 0.0 and not return_debug_mask and q.stride(-1) == 1
        self.calls.append("flash")
        left, right = window_size_left or -1, 0 if is_causal else (window_size_right or -1)
        if cu_q is None:
            out, lse = attend_fwd(q, k, v, window_mask(q.shape[1], k.shape[1], left, right), scale)
        else:
            out, lse = varlen_fwd(q, k, v, cu_q, cu_k, left, right, scale)
        if self.wrong == "flash":
            out = out * 1.1
        return out, lse, torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64), torch.empty(0)

    def _flash_attention_backward(self, do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal,
                                  seed, offset, *, scale=None, window_size_left=None, window_size_right=None):
        assert seed.dtype == torch.uint64 and seed.shape == (2,) and offset.dtype == torch.uint64
        left, right = window_size_left or -1, 0 if is_causal else (window_size_right or -1)
        if cu_q is None:
            assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
            return attend_bwd(do, q, k, v, out, lse, window_mask(q.shape[1], k.shape[1], left, right), scale)
        assert lse.shape == (q.shape[1], q.shape[0])
        return varlen_bwd(do, q, k, v, out, lse, cu_q, cu_k, left, right, scale)

    # cuDNN: heads-first, top-left causal, lse [B, H, S, 1], int64 RNG scalars
    def _scaled_dot_product_cudnn_attention(self, q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0,
                                            is_causal=False, return_debug_mask=False, *, scale=None):
        assert attn_bias is None and compute_log_sumexp and q.shape[1] == k.shape[1]
        self.calls.append("cudnn")
        qs, ks, vs = (x.transpose(1, 2) for x in (q, k, v))
        out, lse = attend_fwd(qs, ks, vs, window_mask(q.shape[2], k.shape[2], -1, 0 if is_causal else -1, True), scale)
        if self.wrong == "cudnn":
            out = out * 1.1
        seed = torch.zeros((), dtype=torch.int64)
        return (out.transpose(1, 2), lse.unsqueeze(-1), None, None, q.shape[2], k.shape[2], seed, seed.clone(), None)

    def _scaled_dot_product_cudnn_attention_backward(self, do, q, k, v, out, lse, seed, offset, attn_bias, cum_q,
                                                     cum_k, max_q, max_k, dropout_p, is_causal, *, scale=None):
        assert lse.shape == (*q.shape[:3], 1) and seed.dtype == torch.int64 and attn_bias is None
        assert torch.isfinite(lse).all(), "a cuDNN piece holds only rows that see a key"
        assert do.stride() == out.stride(), "cuDNN's backward needs dO laid out like O"
        vis = window_mask(q.shape[2], k.shape[2], -1, 0 if is_causal else -1, True)
        g = attend_bwd(*(x.transpose(1, 2) for x in (do, q, k, v, out)), lse[..., 0], vis, scale)
        return tuple(x.transpose(1, 2) for x in g)

    # memory-efficient: [B, S, H, D], custom_mask_type 1 = top-left causal, lse rows padded to 32
    def _efficient_attention_forward(self, q, k, v, bias, cu_q, cu_k, max_q, max_k, dropout_p, custom_mask_type,
                                     compute_log_sumexp=False, *, scale=None, seqlen_k=None, window_size=None):
        assert bias is None and cu_q is None and compute_log_sumexp and q.shape[2] == k.shape[2]
        self.calls.append("efficient")
        out, lse = attend_fwd(q, k, v, window_mask(q.shape[1], k.shape[1], -1, 0 if custom_mask_type == 1 else -1,
                                               True), scale)
        if self.wrong == "efficient":
            out = out * 1.1
        n = q.shape[1]
        padded = torch.full((*lse.shape[:2], -(-n // 32) * 32), math.nan)
        padded[..., :n] = lse
        seed = torch.zeros((), dtype=torch.int64)
        return out, padded, seed, seed.clone(), n, k.shape[1]

    def _efficient_attention_backward(self, do, q, k, v, bias, out, cu_q, cu_k, max_q, max_k, lse, dropout_p,
                                      seed, offset, custom_mask_type, bias_requires_grad, *, scale=None,
                                      num_splits_key=None, window_size=None, shared_storage_dqdkdv=False):
        n = q.shape[1]
        assert lse.shape == (q.shape[0], q.shape[2], -(-n // 32) * 32) and max_q == n and max_k == k.shape[1]
        assert torch.isfinite(lse[..., :n]).all(), "a memory-efficient piece holds only rows that see a key"
        vis = window_mask(n, k.shape[1], -1, 0 if custom_mask_type == 1 else -1, True)
        return attend_bwd(do, q, k, v, out, lse[..., :n], vis, scale) + (None,)


@pytest.fixture
def fake(monkeypatch):
    """The stand-ins in place of torch.ops.aten, every kernel built and enabled on an sm_90 GPU."""
    aten = FakeAten()
    monkeypatch.setattr(_sdpa_cuda, "ATEN", aten)
    monkeypatch.setattr(_sdpa_cuda, "facts", lambda device: {"capability": (9, 0), "cudnn": True, "flash": True,
                                                             "efficient": True})
    _sdpa_cuda._forward_layout.cache_clear()
    monkeypatch.setattr(_sdpa_cuda, "_VERIFIED", {})
    yield aten
    _sdpa_cuda._forward_layout.cache_clear()


def _plan(segs, q, k, order, monkeypatch, deterministic=False):
    monkeypatch.setattr(_sdpa_cuda, "_ORDER", None)
    ndp.ops.set_sdpa_cuda_kernels(order)
    return _sdpa_cuda.plan(segs, q, k, deterministic=deterministic)


# --------------------------------------------------------------------------------------------- semantics

@pytest.mark.parametrize("order", ORDERS, ids=lambda o: "-".join(o))
@pytest.mark.parametrize("name", sorted(TABLES))
def test_every_table_matches_reference(fake, monkeypatch, name, order):
    rows, sq, sk = TABLES[name]
    segs = Segments.from_rows(rows)
    dtype = torch.float32 if order == ("efficient",) else torch.float16
    h, hk = (4, 4) if "flash" not in order else (4, 2)
    q, k, v, dout = _inputs(2, sq, sk, h, hk, 16, dtype, seed=len(name))
    calls, why = _plan(segs, q, k, order, monkeypatch)
    if "flash" not in order and any(p.kind == "mask" for p in ndp.ops._pieces.pieces_of(segs, sq, sk)):
        assert calls is None and "full and top-left causal pieces only" in why   # windows need flash
        return
    assert calls is not None, why
    scale = 0.37
    out, lse = run_pieces_fwd(calls, q, k, v, scale)
    grads = run_pieces_bwd(calls, dout, q, k, v, out, lse, scale)
    want = _ref(dout, q, k, v, segs, scale)
    lowp = _ref(dout, q, k, v, segs, scale, upcast=False) if dtype == torch.float16 else None
    _assert_matches((out, lse) + tuple(grads), dtype, want, lowp)
    assert set(fake.calls) <= set(order)


@pytest.mark.parametrize("order", [("cudnn", "flash"), ("flash", "cudnn")], ids=lambda o: "-".join(o))
@pytest.mark.parametrize("name", ["zigzag_diagonal", "packed_docs", "causal_q_lt_k", "window_both"])
def test_accumulators_across_key_blocks(fake, monkeypatch, name, order):
    """A ring step's use: two key blocks merged into fp32 accumulators give the whole block's result."""
    rows, sq, sk = TABLES[name]
    segs = Segments.from_rows(rows)
    q, k, v, dout = _inputs(1, sq, sk, 4, 4, 32, torch.bfloat16, seed=5)
    want = _ref(dout, q, k, v, segs, 0.2)
    oa, la = torch.zeros(q.shape), torch.full((1, 4, sq), -math.inf)
    dq, dk, dv = (torch.zeros(x.shape) for x in (q, k, v))
    cut = sk // 3
    parts = []
    for a, b in ((0, cut), (cut, sk)):
        m = segs.mask(sq, sk)[:, a:b]
        part = Segments.from_rows([(i, 1, 0, b - a, int(m[i].nonzero().min()), int(m[i].nonzero().max()))
                                   for i in range(sq) if m[i].any()])
        calls, why = _plan(part, q, k[:, a:b], order, monkeypatch)
        assert calls is not None, why
        run_pieces_fwd(calls, q, k[:, a:b], v[:, a:b], 0.2, oa, la)
        parts.append((a, b, calls))
    out = oa.to(q.dtype)
    for a, b, calls in parts:
        run_pieces_bwd(calls, dout, q, k[:, a:b], v[:, a:b], out, la, 0.2, dq, dk[:, a:b], dv[:, a:b])
    _assert_matches((oa, la, dq, dk, dv), torch.bfloat16, want)


def test_the_kernel_choice_follows_the_order_and_the_block(fake, monkeypatch):
    q, k = torch.zeros(1, 64, 4, 64, dtype=torch.bfloat16), torch.zeros(1, 64, 4, 64, dtype=torch.bfloat16)
    dense = Segments.dense(64, 64, causal=True)
    calls, _ = _plan(dense, q, k, ("cudnn", "flash"), monkeypatch)
    assert [c.kernel for c in calls] == ["cudnn"]
    calls, _ = _plan(dense, q, k, ("flash", "cudnn"), monkeypatch)
    assert [c.kernel for c in calls] == ["flash"]
    # Packed documents: one varlen flash call for the whole block whatever ranks first (not one cuDNN call, and
    # one cuDNN graph, per document); cuDNN per document only where flash is not in the order.
    docs = Segments.from_cu_seqlens([0, 20, 64], [0, 20, 64], causal=True)
    for order in (("flash", "cudnn"), ("cudnn", "flash")):
        calls, _ = _plan(docs, q, k, order, monkeypatch)
        assert [c.kernel for c in calls] == ["flash"] and calls[0].piece.q1 == 64
    calls, _ = _plan(docs, q, k, ("cudnn",), monkeypatch)
    assert [c.kernel for c in calls] == ["cudnn", "cudnn"]
    # A sliding window needs flash: the whole block is one flash call whatever ranks first.
    window = Segments.dense(64, 64, causal=True, window_size=(8, 0))
    calls, _ = _plan(window, q, k, ("cudnn", "flash"), monkeypatch)
    assert [c.kernel for c in calls] == ["flash"]
    # GQA: cuDNN and efficient need as many K/V heads; flash takes it.
    calls, why = _plan(dense, q, k[:, :, :2], ("cudnn", "efficient"), monkeypatch)
    assert calls is None and "K/V heads" in why
    calls, _ = _plan(dense, q, k[:, :, :2], ("cudnn", "flash"), monkeypatch)
    assert [c.kernel for c in calls] == ["flash"]
    # fp32: only the efficient kernel.
    calls, why = _plan(dense, q.float(), k.float(), ("cudnn", "flash"), monkeypatch)
    assert calls is None and "fp16/bf16" in why
    calls, _ = _plan(dense, q.float(), k.float(), ("cudnn", "flash", "efficient"), monkeypatch)
    assert [c.kernel for c in calls] == ["efficient"]


def test_switches_deterministic_and_bad_order(fake, monkeypatch):
    q = torch.zeros(1, 64, 4, 64, dtype=torch.bfloat16)
    dense = Segments.dense(64, 64, causal=True)
    monkeypatch.setattr(_sdpa_cuda, "facts", lambda device: {"capability": (9, 0), "cudnn": False, "flash": True,
                                                             "efficient": True})
    calls, _ = _plan(dense, q, q, ("cudnn", "flash"), monkeypatch)
    assert [c.kernel for c in calls] == ["flash"]          # torch.backends.cuda.enable_cudnn_sdp(False) obeyed
    calls, why = _plan(dense, q, q, ("cudnn",), monkeypatch)
    assert calls is None and "enable_cudnn_sdp" in why
    calls, why = _plan(dense, q, q, ("flash", "cudnn"), monkeypatch, deterministic=True)
    assert calls is None and "use_deterministic_algorithms" in why
    with pytest.raises(ValueError, match="unknown kernels.*fast"):
        ndp.ops.set_sdpa_cuda_kernels(("cudnn", "fast"))
    assert _sdpa_cuda.kernel_order("cuda") == ("flash", "cudnn")   # unchanged by the refused call
    ndp.ops.set_sdpa_cuda_kernels(None)
    assert _sdpa_cuda.kernel_order("cuda") == ("cudnn", "flash", "efficient")   # sm_90 default


@pytest.mark.parametrize("kernel", ["cudnn", "flash", "efficient"])
def test_first_use_check_refuses_a_wrong_kernel(fake, monkeypatch, kernel):
    fake.wrong = kernel
    dtype = torch.float32 if kernel == "efficient" else torch.bfloat16
    q = torch.zeros(1, 64, 4, 64, dtype=dtype)
    calls, why = _plan(Segments.dense(64, 64, causal=True), q, q, (kernel,), monkeypatch)
    assert calls is None and "differs from the float64 reference" in why and kernel in why
    fake.wrong = None
    assert _sdpa_cuda.verified("flash" if kernel != "flash" else "cudnn", torch.bfloat16, 64, "cpu") == ""


def test_first_use_check_refuses_a_kernel_that_raises(fake, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("Expected softmax_lse to have 4 dims")
    monkeypatch.setattr(fake, "_scaled_dot_product_cudnn_attention_backward", broken)
    q = torch.zeros(1, 64, 4, 64, dtype=torch.float16)
    calls, why = _plan(Segments.dense(64, 64, causal=True), q, q, ("cudnn",), monkeypatch)
    assert calls is None and "raised on a check block" in why and "softmax_lse" in why
    calls, _ = _plan(Segments.dense(64, 64, causal=True), q, q, ("cudnn", "flash"), monkeypatch)
    assert [c.kernel for c in calls] == ["flash"]           # auto and forced sdpa fall back to the next kernel


def test_engines_report_sdpa_capability_on_cuda_from_the_plan(fake, monkeypatch):
    """engines.capable asks the CUDA plan for a non-CPU tensor (a meta tensor stands in for a CUDA one)."""
    monkeypatch.setattr(_sdpa_cuda, "_ORDER", ("cudnn",))
    q = torch.empty(1, 64, 4, 64, dtype=torch.bfloat16, device="meta")
    ok, why = engines.capable("sdpa", Segments.dense(64, 64, causal=True), q, q[:, :, :2])
    assert not ok and "K/V heads" in why


# ------------------------------------------------------------------------------------- calling convention

class SchemaBound:
    """torch.ops.aten, where every call is first bound to the op's schema (count, names, None only where the
    schema takes a Tensor) and then run on meta tensors by the op's meta kernel."""

    def __init__(self):
        self.seen = set()

    def __getattr__(self, name):
        op = getattr(torch.ops.aten, name)

        def call(*args, **kwargs):
            schema = op.default._schema
            positional = [a for a in schema.arguments if not a.kwarg_only]
            assert len(args) <= len(positional), f"{name}: {len(args)} positional args for {len(positional)}"
            for a, value in zip(positional, args):
                # None: an optional argument, or a Tensor the op takes undefined (what autograd passes there)
                assert value is not None or str(a.type).startswith("Optional") or str(a.type) == "Tensor", \
                    f"{name}: None for {a.name}: {a.type}"
            names = {a.name for a in schema.arguments if a.kwarg_only}
            assert set(kwargs) <= names, f"{name}: keywords {set(kwargs) - names} not in the schema"
            self.seen.add(name)
            if name == "_efficient_attention_backward":
                # torch's meta kernel for this op does not take its own keyword arguments (a torch bug):
                # shapes as the CUDA kernel returns them.
                return torch.empty_like(args[1]), torch.empty_like(args[2]), torch.empty_like(args[3]), None
            return op(*args, **kwargs)
        return call


@pytest.mark.parametrize("order,dtype,hk,table", [
    (("cudnn",), torch.bfloat16, 4, "zigzag_diagonal"),
    (("flash",), torch.float16, 2, "zigzag_diagonal"),
    (("flash",), torch.bfloat16, 2, "packed_docs"),
    (("flash",), torch.bfloat16, 2, "window_both"),
    (("efficient",), torch.float32, 4, "causal_q_lt_k"),
])
def test_calls_bind_to_the_installed_torch_ops(monkeypatch, order, dtype, hk, table):
    bound = SchemaBound()
    monkeypatch.setattr(_sdpa_cuda, "ATEN", bound)
    monkeypatch.setattr(_sdpa_cuda, "facts", lambda device: {"capability": (9, 0), "cudnn": True, "flash": True,
                                                             "efficient": True})
    monkeypatch.setattr(_sdpa_cuda, "VERIFY", False)
    _sdpa_cuda._forward_layout.cache_clear()
    try:
        rows, sq, sk = TABLES[table]
        segs = Segments.from_rows(rows)
        m = dict(device="meta", dtype=dtype)
        q, k, v, do = (torch.empty(2 if table != "packed_docs" else 1, n, hh, 64, **m)
                       for n, hh in ((sq, 4), (sk, hk), (sk, hk), (sq, 4)))
        calls, why = _plan(segs, q, k, order, monkeypatch)
        assert calls is not None, why
        out, lse = run_pieces_fwd(calls, q, k, v, 0.125)
        assert out.shape == q.shape and lse.shape == (q.shape[0], 4, sq)
        grads = run_pieces_bwd(calls, do, q, k, v, out, lse, 0.125)
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
        oa, la = torch.empty(q.shape, device="meta"), torch.empty(q.shape[0], 4, sq, device="meta")
        run_pieces_fwd(calls, q, k, v, 0.125, oa, la)
    finally:
        _sdpa_cuda._forward_layout.cache_clear()
    kernel = order[0]
    want = {"cudnn": {"_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"},
            "flash": {"_flash_attention_forward", "_flash_attention_backward"},
            "efficient": {"_efficient_attention_forward", "_efficient_attention_backward"}}[kernel]
    assert want <= bound.seen


# ---------------------------------------------------------------------------------------------- real GPU

def _cuda():
    return torch.cuda.is_available(), "no CUDA device"


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda()[0], reason="needs a CUDA GPU (the stand-in tests above run everywhere)")
@pytest.mark.parametrize("kernel,dtype,hk", [("cudnn", torch.bfloat16, 8), ("flash", torch.bfloat16, 2),
                                             ("flash", torch.float16, 8), ("efficient", torch.float32, 8)])
@pytest.mark.parametrize("name", ["causal", "zigzag_diagonal", "packed_docs", "window_both", "causal_q_gt_k"])
def test_real_kernels_match_reference(monkeypatch, kernel, dtype, hk, name):
    rows, sq, sk = TABLES[name]
    segs = Segments.from_rows(rows)
    q, k, v, dout = (x.cuda() for x in _inputs(1, sq, sk, 8, hk, 64, dtype, seed=2))
    calls, why = _plan(segs, q, k, (kernel,), monkeypatch)
    if calls is None:
        assert "pieces only" in why or "K/V heads" in why, why
        pytest.skip(why)
    out, lse = run_pieces_fwd(calls, q, k, v, 0.125)
    grads = run_pieces_bwd(calls, dout, q, k, v, out, lse, 0.125)
    want = _ref(*(x.cpu() for x in (dout, q, k, v)), segs, 0.125)
    _assert_matches(tuple(x.cpu() for x in (out, lse) + tuple(grads)), dtype, want)


def test_no_gpu_here_says_why():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    ok, why = _sdpa_cuda.available("cuda")
    assert not ok and "no CUDA device" in why
