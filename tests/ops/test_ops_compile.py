"""ndp.ops.attention under torch.compile: one graph node (the op ``ndp::attention``), 0 graph breaks for causal,
windowed, packed and GQA inputs (with sinks and a soft-cap), and fullgraph compiles (aot_eager, inductor) whose
outputs and gradients equal eager's (fp32, 1e-5)."""
import sys

import pytest
import torch
import torch._dynamo as dynamo

import ndp.ops

CU = torch.tensor([0, 20, 23, 48], dtype=torch.int32)


def _inputs(case, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape_q, shape_kv = ((48, 4, 32), (48, 2, 32)) if case == "packed" else ((2, 40, 4, 32), (2, 40, 2, 32))
    if case == "mha":
        shape_kv = shape_q
    q, k, v = (torch.randn(s, generator=g, requires_grad=True) for s in (shape_q, shape_kv, shape_kv))
    return q, k, v


def _call(case):
    kw = dict(causal=True)
    if case == "window":
        kw.update(window_size=(7, 0))
    if case == "packed":
        kw.update(cu_seqlens_q=CU, cu_seqlens_k=CU, max_seqlen_q=25, max_seqlen_k=25)
    if case == "sinks":
        kw.update(sinks=torch.tensor([0.5, -1.0, 0.0, 2.0]))
    if case == "softcap":
        kw.update(softcap=5.0)
    return lambda q, k, v: ndp.ops.attention(q, k, v, return_lse=True, **kw)


CASES = ("mha", "causal", "window", "packed", "sinks", "softcap")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.reset()


@pytest.mark.parametrize("case", CASES)
def test_attention_traces_without_graph_breaks(case):
    q, k, v = _inputs(case)
    explain = dynamo.explain(_call(case))(q, k, v)
    assert explain.graph_break_count == 0, [str(b.reason)[:200] for b in explain.break_reasons]
    assert explain.graph_count == 1


def _grads(fn, case):
    q, k, v = _inputs(case, seed=1)
    out, lse = fn(q, k, v)
    (out.square().sum() + lse.sum()).backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", ["causal", "packed", "sinks"])
def test_fullgraph_compile_equals_eager(case, backend):
    eager = _grads(_call(case), case)
    compiled = _grads(torch.compile(_call(case), backend=backend, fullgraph=True), case)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bad_input_still_raises_under_compile():
    q, k, v = _inputs("packed")
    bad = torch.tensor([0, 20, 10, 48], dtype=torch.int32)  # read by the op: a value check, not a trace-time one
    f = torch.compile(lambda q, k, v: ndp.ops.attention(q, k, v, cu_seqlens_q=bad, cu_seqlens_k=bad),
                      backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing; got cu_seqlens_q\[1\]=20 > "
                                         r"cu_seqlens_q\[2\]=10"):
        f(q, k, v)


@pytest.mark.parametrize("case", ["causal", "packed", "sinks"])
def test_op_registration_is_consistent(case):
    # torch.library's own checks: schema, fake (meta) outputs equal the real ones in shape/dtype/strides, autograd
    q, k, v = _inputs(case)
    cu = CU if case == "packed" else None
    sinks = torch.tensor([0.5, -1.0, 0.0, 2.0], requires_grad=True) if case == "sinks" else None
    spans = [1, 3] if case == "causal" else []  # one image block: the op takes the spans as a flat int list
    args = (q, k, v, cu, cu, None, sinks, True, -1, -1, -1, -1, 32 ** -0.5, 0.0, "auto", False, spans)
    torch.library.opcheck(torch.ops.ndp.attention.default, args, test_utils=(
        "test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


def _op_events(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("ndp::attention"))


@pytest.mark.parametrize("case", CASES)
def test_eager_calls_skip_the_op_dispatch_and_equal_the_op(case, monkeypatch):
    # Eager calls run the op's body as an autograd Function (the custom-op dispatch cost ~0.25 ms of host time each
    # way); outputs and every gradient equal the op's bit for bit.
    mod = sys.modules["ndp.ops.attention"]  # the module (ndp.ops.attention is also the function's name)
    eager = _grads(_call(case), case)
    assert _op_events(lambda: _grads(_call(case), case)) == 0
    monkeypatch.setattr(mod, "_eager", lambda *t: False)
    assert _op_events(lambda: _grads(_call(case), case)) == 2  # the op and its backward
    for a, b in zip(_grads(_call(case), case), eager):
        assert torch.equal(a, b)


def test_dispatch_modes_still_get_the_op():
    # fake tensors, selective activation checkpointing and other modes see (and may save) the op's outputs
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v = _inputs("causal")
    with Record():
        _call("causal")(q, k, v)
    assert "ndp.attention.default" in seen
