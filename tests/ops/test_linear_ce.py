"""Fused linear cross-entropy against cross_entropy on the full logits: loss and gradients, chunked."""
import pytest
import torch
import torch.nn.functional as F

import ndp.ops.linear_ce as lce
from ndp.ops.linear_ce import tiles, linear_cross_entropy


def _case(n=37, h=16, v=53, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = -100
    return hidden, weight, labels


def _reference(hidden, weight, labels, softcap=None, bias=None, scale=1.0):
    z = (hidden @ weight.T if bias is None else hidden @ weight.T + bias) * scale
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    return F.cross_entropy(z.float() if z.dtype != torch.float64 else z, labels, ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("chunk_rows", [1, 7, 64])  # passes of 1, 7, every token
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_loss_and_grads_equal_full_logits_fp64(chunk_rows, softcap):
    hidden, weight, labels = _case()
    got = linear_cross_entropy(hidden, weight, labels, softcap=softcap, chunk_bytes=chunk_rows * 4 * 53)
    gh, gw = torch.autograd.grad(got * 0.5, (hidden, weight))
    want = _reference(hidden, weight, labels, softcap)
    rh, rw = torch.autograd.grad(want * 0.5, (hidden, weight))
    assert got.dtype == torch.float64
    for a, b in ((got, want), (gh, rh), (gw, rw)):
        assert float((a - b).detach().abs().max() / b.detach().abs().max()) <= 1e-12


@pytest.mark.parametrize("scale", [1.0, 0.0625])
def test_bias_and_scale_equal_full_logits_fp64(scale):
    hidden, weight, labels = _case()
    bias = torch.randn(53, dtype=torch.float64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    got = linear_cross_entropy(hidden, weight, labels, bias=bias, scale=scale, softcap=2.0, chunk_bytes=5 * 4 * 53)
    want = _reference(hidden, weight, labels, 2.0, bias, scale)
    for a, b in zip(torch.autograd.grad(got, (hidden, weight, bias)) + (got,),
                    torch.autograd.grad(want, (hidden, weight, bias)) + (want,)):
        assert float((a - b).detach().abs().max() / b.detach().abs().max()) <= 1e-12


@pytest.mark.parametrize("smoothing, z_loss", [(0.1, 0.0), (0.0, 1e-2), (0.2, 1e-3)])
def test_label_smoothing_and_z_loss_equal_full_logits_fp64(smoothing, z_loss):
    hidden, weight, labels = _case()
    got = linear_cross_entropy(hidden, weight, labels, softcap=3.0, label_smoothing=smoothing, z_loss=z_loss,
                               chunk_bytes=6 * 4 * 53)
    z = 3.0 * torch.tanh(hidden @ weight.T / 3.0)
    keep = labels != -100
    want = F.cross_entropy(z, labels, ignore_index=-100, reduction="sum", label_smoothing=smoothing)
    want = want + z_loss * (torch.logsumexp(z, -1)[keep] ** 2).sum()
    for a, b in zip(torch.autograd.grad(got, (hidden, weight)) + (got,),
                    torch.autograd.grad(want, (hidden, weight)) + (want,)):
        assert float((a - b).detach().abs().max() / b.detach().abs().max()) <= 1e-12


def test_batched_labels_and_no_labelled_token():
    hidden, weight, labels = _case(n=24)
    got = linear_cross_entropy(hidden.reshape(2, 12, -1), weight, labels.reshape(2, 12))
    assert torch.allclose(got, _reference(hidden, weight, labels), rtol=1e-12)
    none = linear_cross_entropy(hidden, weight, torch.full_like(labels, -100))
    assert none.item() == 0.0
    gh, gw = torch.autograd.grad(none, (hidden, weight))
    assert not gh.any() and not gw.any()


def test_bf16_within_the_error_of_the_unfused_bf16_path():
    hidden, weight, labels = _case(n=64, h=32, v=100, dtype=torch.float32, seed=1)
    exact = _reference(hidden.double(), weight.double(), labels)
    h16, w16 = hidden.detach().bfloat16().requires_grad_(), weight.detach().bfloat16().requires_grad_()
    fused = linear_cross_entropy(h16, w16, labels, chunk_bytes=8 * 4 * 100)
    unfused = _reference(h16, w16, labels)
    assert abs(fused.item() - exact.item()) <= 2 * abs(unfused.item() - exact.item()) + 1e-3 * abs(exact.item())
    assert fused.dtype == torch.float32


def test_tiles():
    # Llama-3's head at 8192 tokens (the H100 run's case): one pass over every token, blocks of 2048 vocabulary rows
    assert tiles(8192, 128256, 64 * 2 ** 20) == (8192, 2048)
    # 1M tokens: passes of 65536 tokens, blocks of MIN_BLOCK_ROWS; a small vocabulary: one block
    assert tiles(2 ** 20, 128256, 64 * 2 ** 20) == (65536, 256)
    assert tiles(37, 53, 4 * 53 * 7) == (7, 53)


@pytest.mark.parametrize("chunk_bytes", [4 * 8 * 37, 4 * 8 * 10])  # one pass of 37 tokens / 4 passes; blocks of 8
def test_vocabulary_blocks_and_passes_equal_full_logits_fp64(chunk_bytes, monkeypatch):
    monkeypatch.setattr(lce, "MIN_BLOCK_ROWS", 8)
    hidden, weight, labels = _case()
    assert tiles(37, 53, chunk_bytes)[1] == 8
    bias = torch.randn(53, dtype=torch.float64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    got = linear_cross_entropy(hidden, weight, labels, bias=bias, softcap=3.0, label_smoothing=0.1, z_loss=1e-3,
                               chunk_bytes=chunk_bytes)
    z = 3.0 * torch.tanh((hidden @ weight.T + bias) / 3.0)
    keep = labels != -100
    want = F.cross_entropy(z, labels, ignore_index=-100, reduction="sum", label_smoothing=0.1)
    want = want + 1e-3 * (torch.logsumexp(z, -1)[keep] ** 2).sum()
    for a, b in zip(torch.autograd.grad(got, (hidden, weight, bias)) + (got,),
                    torch.autograd.grad(want, (hidden, weight, bias)) + (want,)):
        assert float((a - b).detach().abs().max() / b.detach().abs().max()) <= 1e-12


@pytest.mark.parametrize("chunk_bytes", [4 * 32 * 64, 4 * 32 * 16])  # one pass / 4 passes; blocks of 32 rows
def test_bf16_gradients_within_the_error_of_the_unfused_bf16_path(chunk_bytes, monkeypatch):
    monkeypatch.setattr(lce, "MIN_BLOCK_ROWS", 32)
    hidden, weight, labels = _case(n=64, h=32, v=100, dtype=torch.float32, seed=2)
    exact = torch.autograd.grad(_reference(hidden.double(), weight.double(), labels), (hidden, weight))
    h16, w16 = hidden.detach().bfloat16().requires_grad_(), weight.detach().bfloat16().requires_grad_()
    fused = torch.autograd.grad(linear_cross_entropy(h16, w16, labels, chunk_bytes=chunk_bytes), (h16, w16))
    unfused = torch.autograd.grad(_reference(h16, w16, labels), (h16, w16))
    for f, u, e in zip(fused, unfused, exact):
        assert f.dtype == torch.bfloat16
        err_f, err_u = ((x.double() - e.double()).abs().max().item() for x in (f, u))
        assert err_f <= 2 * err_u, (err_f, err_u)


@pytest.mark.parametrize("args, match", [
    (dict(labels=torch.zeros(5, dtype=torch.long)), "leading shape"),
    (dict(weight=torch.zeros(53, 16, dtype=torch.float32)), "one dtype"),
    (dict(labels=torch.full((37,), 53)), r"labels must be in \[0, 53\)"),
    (dict(labels=torch.zeros(37)), "integer labels"),
    (dict(label_smoothing=1.5), r"label_smoothing in \[0, 1\] and z_loss >= 0; got label_smoothing=1.5"),
    (dict(z_loss=-1.0), r"z_loss >= 0; got label_smoothing=0.0, z_loss=-1.0"),
])
def test_bad_input_is_refused_by_name(args, match):
    hidden, weight, labels = _case()
    kw = dict(hidden=hidden, weight=weight, labels=labels)
    kw.update(args)
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(**kw)


def _vocab_parallel_body(rank, world):
    import torch.distributed as dist

    hidden, weight, labels = _case()
    bias = torch.randn(53, dtype=torch.float64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    kw = dict(softcap=3.0, label_smoothing=0.1, z_loss=1e-3)
    want = linear_cross_entropy(hidden, weight, labels, bias=bias, chunk_bytes=6 * 4 * 53, **kw)
    rh, rw, rb = torch.autograd.grad(want, (hidden, weight, bias))
    start, stop = (0, 27) if rank == 0 else (27, 53)  # uneven shards
    w = weight.detach()[start:stop].clone().requires_grad_()
    b = bias.detach()[start:stop].clone().requires_grad_()
    h = hidden.detach().clone().requires_grad_()
    got = linear_cross_entropy(h, w, labels, bias=b, vocab_group=dist.group.WORLD, vocab_start=start, vocab_size=53,
                               chunk_bytes=5 * 4 * 27, **kw)
    gh, gw, gb = torch.autograd.grad(got, (h, w, b))
    for a, r in ((got, want), (gh, rh), (gw, rw[start:stop]), (gb, rb[start:stop])):
        assert float((a - r).detach().abs().max() / r.detach().abs().max()) <= 1e-12


@pytest.mark.distributed
def test_vocabulary_parallel_loss_equals_the_whole_head(tmp_path):
    from dist import spawn

    spawn(_vocab_parallel_body, 2, tmp_path)
