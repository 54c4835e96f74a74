"""``ndp.ops.attention`` on a CUDA GPU, the way a model calls it: every engine ``auto`` may pick (its first-use
measurements included), bf16 and fp16, dense, GQA, packed documents (cu_seqlens) and packed rows (position_ids),
forward and backward against the float64 reference; and the document table read to the host once for the layers
of a step. Marked ``gpu`` (``make gpu-report`` runs them); skipped without a CUDA device."""
import pytest
import torch

import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import ndp
from dense_attention import dense_reference
from ndp.testing import assert_close, assert_within_lowp_bound

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# (name, heads, kv heads, head_dim, documents of one packed row or None for a dense batch of 2 x 1024)
CASES = [("dense causal", 8, 8, 128, None), ("GQA 8:2", 8, 2, 128, None), ("head_dim 64", 4, 4, 64, None),
         ("packed documents", 8, 2, 128, [300, 1, 700, 23]), ("one document", 4, 4, 64, [512])]


def _inputs(case, dtype):
    """q, k, v, dout in float64, rounded to `dtype` (the reference sees what the GPU sees)."""
    _, h, hk, d, docs = case
    g = torch.Generator().manual_seed(0)
    shape = (sum(docs),) if docs else (2, 1024)
    xs = [torch.randn(*shape, n, d, generator=g, dtype=torch.float64) for n in (h, hk, hk, h)]
    return tuple(x.to(dtype).double() for x in xs)


def _lowp_reference(q, k, v, dout, docs, dtype, device):
    """(out, dq, dk, dv) of torch's math SDPA computed in `dtype`, document by document: the error a plain
    implementation in that dtype makes, the bound's yardstick (ndp.testing.assert_within_lowp_bound)."""
    q, k, v = (x.to(device, dtype).requires_grad_() for x in (q, k, v))
    # a packed row is one batch of one row per document
    cu = torch.tensor([0] + docs).cumsum(0).tolist() if docs else None
    rows = [tuple(x[None, a:b] for x in (q, k, v)) for a, b in zip(cu, cu[1:])] if docs else [(q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        outs = [F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in row), is_causal=True,
                                               enable_gqa=True).transpose(1, 2) for row in rows]
    out = torch.cat([o[0] for o in outs]) if docs else outs[0]
    out.backward(dout.to(device, dtype))
    return tuple(x.cpu() for x in (out, q.grad, k.grad, v.grad))


def _cu(docs, device="cuda"):
    return torch.tensor([0] + torch.tensor(docs).cumsum(0).tolist(), dtype=torch.int32, device=device)


@pytest.mark.parametrize("backend", ["auto", "triton", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_attention_on_the_gpu_matches_the_float64_reference(case, dtype, backend):
    q, k, v, dout = _inputs(case, dtype)
    docs = case[4]
    want = dense_reference(dict(causal=True, docs=docs), q, k, v, dout)
    qc, kc, vc = (x.to("cuda", dtype).requires_grad_() for x in (q, k, v))
    kw = dict(cu_seqlens_q=_cu(docs), cu_seqlens_k=_cu(docs)) if docs else {}
    out = ndp.ops.attention(qc, kc, vc, causal=True, backend=backend, **kw)
    out.backward(dout.to("cuda", dtype))
    lowp = _lowp_reference(q, k, v, dout, docs, dtype, "cuda")
    for got, ref, plain, kind in zip((out, qc.grad, kc.grad, vc.grad), (want[0],) + want[2:5], lowp,
                                     ("out", "grad", "grad", "grad")):
        # relative to the largest value: a GQA dK sums the queries of 4 heads (|dK| ~ 10, where a bf16 step is 0.06)
        s = max(1.0, ref.abs().max().item())
        assert_within_lowp_bound(got.cpu() / s, ref / s, plain / s, dtype, kind)


def test_packed_rows_by_position_ids_on_the_gpu():
    # transformers' packed rows: two rows of 512 tokens, documents where position_ids restart
    q, k, v, dout = (x.reshape(2, 512, *x.shape[1:]) for x in _inputs(("", 4, 2, 64, [1024]), torch.bfloat16))
    pos = torch.cat([torch.arange(200), torch.arange(312), torch.arange(512)]).reshape(2, 512)
    want = dense_reference(dict(causal=True, docs=[200, 312, 512]), *(x.reshape(1024, *x.shape[2:])
                                                                       for x in (q, k, v, dout)))
    qc, kc, vc = (x.to("cuda", torch.bfloat16).requires_grad_() for x in (q, k, v))
    out = ndp.ops.attention(qc, kc, vc, causal=True, position_ids=pos.cuda())
    out.backward(dout.to("cuda", torch.bfloat16))
    assert_close(out.reshape(1024, *out.shape[2:]).cpu(), want[0], torch.bfloat16)
    assert_close(kc.grad.reshape(1024, *kc.shape[2:]).cpu(), want[3], torch.bfloat16, kind="grad")


def test_the_document_table_is_read_once_for_the_layers_of_a_step(monkeypatch):
    reads, tolist = [], torch.Tensor.tolist
    cu = _cu([300, 1, 700, 23])

    def counting(self):
        if self is cu:
            reads.append(1)
        return tolist(self)
    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    q, k, v, _ = (x.to("cuda", torch.bfloat16) for x in _inputs(CASES[3], torch.bfloat16))
    q.requires_grad_()
    for _ in range(4):  # four layers, forward and backward
        ndp.ops.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu).sum().backward()
    assert len(reads) == 1
