"""The fused cross-entropy's row kernels (ndp_kernels.cross_entropy) under the Triton interpreter against the torch
path they replace, and ndp.ops.linear_cross_entropy run through them against cross_entropy on the full logits."""
import pytest
import torch
import torch.nn.functional as F

import ndp.ops.linear_ce as linear_ce
from ndp_kernels.cross_entropy import ce_grad_, ce_stats


def _z(rows=7, vocab=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, vocab, generator=g) * 3
    target = torch.randint(0, vocab, (rows,), generator=g)
    target[2] = -1  # ignored, or in another rank's shard
    return z, target


def test_stats_equal_torch():
    z, target = _z()
    m, s, tg, zs = ce_stats(z, target)
    torch.testing.assert_close(m, z.amax(-1), rtol=0, atol=0)
    torch.testing.assert_close(s, torch.exp(z - z.amax(-1, keepdim=True)).sum(-1), rtol=1e-6, atol=0)
    want_tg = z.gather(1, target.clamp(min=0)[:, None])[:, 0] * (target >= 0)
    torch.testing.assert_close(tg, want_tg, rtol=0, atol=0)
    torch.testing.assert_close(zs, z.sum(-1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("smoothing, z_loss, softcap, scale", [(0.0, 0.0, 0.0, 1.0), (0.1, 1e-3, 5.0, 0.5)])
def test_grad_equals_torch(smoothing, z_loss, softcap, scale):
    z, target = _z(seed=1)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    lse = torch.logsumexp(z, -1)
    coef = 1 + 2 * z_loss * lse
    row_scale = torch.rand(z.shape[0], generator=torch.Generator().manual_seed(2))
    want = torch.exp(z - lse[:, None]) * coef[:, None]
    here = target >= 0
    want.scatter_add_(1, target.clamp(min=0)[:, None], here[:, None].float() * (smoothing - 1))
    want = (want - smoothing / 300) * row_scale[:, None]
    if softcap:
        want = want * (1 - (z / softcap) ** 2)
    want = want * scale
    got = ce_grad_(z.clone(), target, lse, coef, row_scale, smoothing=smoothing, softcap=softcap, scale=scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_linear_cross_entropy_through_the_kernels(monkeypatch):
    monkeypatch.setattr(linear_ce, "_use_kernels", lambda z: True)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(40, 16, generator=g, requires_grad=True)
    weight = torch.randn(300, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 300, (40,), generator=g)
    labels[::7] = -100
    got = linear_ce.linear_cross_entropy(hidden, weight, labels, softcap=4.0, label_smoothing=0.1, z_loss=1e-3,
                                         chunk_bytes=9 * 4 * 300)
    z = 4.0 * torch.tanh(hidden @ weight.T / 4.0)
    want = F.cross_entropy(z, labels, reduction="sum", label_smoothing=0.1)
    want = want + 1e-3 * (torch.logsumexp(z, -1)[labels != -100] ** 2).sum()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for a, b in zip(torch.autograd.grad(got, (hidden, weight)), torch.autograd.grad(want, (hidden, weight))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_bad_input_is_refused_by_name():
    z, target = _z()
    with pytest.raises(ValueError, match="fp32 \\[rows, V\\] logits"):
        ce_stats(z.double(), target)
    with pytest.raises(ValueError, match="int64 targets \\[rows\\]"):
        ce_stats(z, target[:3])
