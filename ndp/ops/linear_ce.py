"""Fused linear cross-entropy: the LM head and the token cross-entropy in one op, a chunk of logits at a time.

``linear_cross_entropy(hidden [N, H], weight [V, H], labels [N])`` returns the summed cross-entropy of
``hidden @ weight.T (+ bias)`` against `labels` without materialising the ``[N, V]`` logits: the forward walks the
tokens in chunks (logits of one chunk, their log-sum-exp and the target's logit, in fp32 at least), keeping only the
per-token log-sum-exp; the backward recomputes each chunk's logits and adds its share of the gradients of
`hidden` and `weight`. Working memory beyond the inputs and the gradients (``ndp.plan.cost.fused_loss_bytes``):
one ``[chunk, V]`` fp32 logits block, turned into its softmax in place (plus its 16-bit matmul output for 16-bit
inputs, plus tanh when soft-capped), and the weight gradient's fp32 accumulator ``[V, H]`` in the backward.
A constant logit scale (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``) and soft-capped final logits
(Gemma 2's ``final_logit_softcapping``: ``c * tanh(logits / c)``, after the scale) are honoured.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

import ndp_kernels

__all__ = ["linear_cross_entropy", "CHUNK_BYTES"]

# Logits bytes of one chunk (fp32): the op's working memory, beside the saved per-token log-sum-exp.
CHUNK_BYTES = 64 * 2 ** 20


def _chunk_rows(vocab: int, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // (4 * vocab))


def _logits(h, weight, bias, scale, softcap):
    """fp32 (or fp64) logits of a chunk, scaled and soft-capped in place; also tanh for the backward when capped.
    Working memory: one fp32 chunk (plus the es-byte matmul output when the inputs are 16-bit; plus tanh when
    capped)."""
    z = h @ weight.T if bias is None else torch.addmm(bias, h, weight.T)
    z = z.to(torch.promote_types(h.dtype, torch.float32))
    if scale != 1.0:
        z.mul_(scale)
    if not softcap:
        return z, None
    t = z.div_(softcap).tanh_()
    return t * softcap, t


@dataclass(frozen=True)
class _Options:
    ignore_index: int
    scale: float
    softcap: float
    chunk: int          # tokens per chunk
    smoothing: float    # label smoothing epsilon
    z_loss: float       # weight of lse^2
    vocab: int          # the whole vocabulary (weight holds rows [start, start + weight rows) of it)
    start: int
    group: object       # the process group the vocabulary is split over (None: whole)


def _all_reduce(x, op, group):
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


def _local_targets(y, keep, o: _Options, rows: int):
    """Row of each label in this vocabulary shard, and whether it is here."""
    here = keep & (y >= o.start) & (y < o.start + rows)
    return torch.where(here, y - o.start, 0), here


def _use_kernels(z) -> bool:
    """The Triton row kernels (``ndp_kernels.cross_entropy``) for fp32 chunks on CUDA; the torch ops elsewhere."""
    return z.is_cuda and z.dtype == torch.float32


def _chunk_stats(z, idx, here, o: _Options, out) -> None:
    """Per row of the chunk ``z`` (consumed): max, sum of exp(z - max), the target's logit, sum of the logits."""
    if _use_kernels(z):
        out.copy_(ndp_kernels.ce_stats(z, torch.where(here, idx, -1)))
        return
    m, se, tg, zs = out
    tg.copy_(z.gather(1, idx[:, None])[:, 0] * here)
    if o.smoothing:
        zs.copy_(z.sum(dim=-1))
    m.copy_(z.amax(dim=-1))
    se.copy_(z.sub_(m[:, None]).exp_().sum(dim=-1))


def _chunk_grad(z, t, s, idx, here, row_scale, o: _Options):
    """The loss gradient with respect to the chunk's logits, over ``z``: softmax (times the z-loss factor) minus
    the smoothed target, by row, through the soft-cap and the scale."""
    coef = 1 + 2 * o.z_loss * s
    if _use_kernels(z):
        return ndp_kernels.ce_grad_(z, torch.where(here, idx, -1), s, coef, row_scale, smoothing=o.smoothing,
                                    vocab=o.vocab, softcap=o.softcap, scale=o.scale)
    d = z.sub_(s[:, None]).exp_()                                          # softmax, in place
    if o.z_loss:
        d.mul_(coef[:, None])
    d.scatter_add_(1, idx[:, None], here.to(d.dtype)[:, None] * (o.smoothing - 1))
    if o.smoothing:
        d.sub_(o.smoothing / o.vocab)
    d.mul_(row_scale.to(d.dtype)[:, None])
    if t is not None:
        d.mul_(1 - t * t)                                                  # d(c tanh(z/c))/dz
    if o.scale != 1.0:
        d.mul_(o.scale)
    return d


class _LinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, o: _Options):
        n, rows = hidden.shape[0], weight.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)
        # per token, over this shard: max logit, sum of exp(z - max), target logit (0 elsewhere), sum of logits
        stats = torch.zeros(4, n, dtype=acc, device=hidden.device)
        for a in range(0, n, o.chunk):
            z, t = _logits(hidden[a:a + o.chunk], weight, bias, o.scale, o.softcap)
            del t
            y = labels[a:a + o.chunk]
            idx, here = _local_targets(y, y != o.ignore_index, o, rows)
            _chunk_stats(z, idx, here, o, stats[:, a:a + o.chunk])
            del z
        m, se, tg, zs = stats
        # one exchange per call over the vocabulary shards: the global max, then the rescaled sums
        peak = _all_reduce(m.clone(), dist.ReduceOp.MAX, o.group)
        se.mul_(torch.exp(m - peak))
        _all_reduce(stats[1:], dist.ReduceOp.SUM, o.group)
        lse = se.log_().add_(peak)
        keep = labels != o.ignore_index
        # (1 - eps) (lse - z_y) + eps (lse - mean z) + z_loss lse^2: torch's label smoothing, PaLM's z-loss
        row = lse - (1 - o.smoothing) * tg - (o.smoothing / o.vocab) * zs + o.z_loss * lse * lse
        ctx.save_for_backward(hidden, weight, bias, labels, lse.clone())
        ctx.o = o
        return (row * keep).sum()

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        o = ctx.o
        rows = weight.shape[0]
        gh = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        gw = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if ctx.needs_input_grad[1] else None
        gb = torch.zeros(bias.shape, dtype=lse.dtype, device=bias.device) if ctx.needs_input_grad[2] else None
        for a in range(0, hidden.shape[0], o.chunk):
            h = hidden[a:a + o.chunk]
            z, t = _logits(h, weight, bias, o.scale, o.softcap)
            y = labels[a:a + o.chunk]
            keep = y != o.ignore_index
            idx, here = _local_targets(y, keep, o, rows)
            d = _chunk_grad(z, t, lse[a:a + o.chunk], idx, here, keep * grad, o)
            del t
            if gh is not None:
                gh[a:a + o.chunk] = d.to(weight.dtype) @ weight
            if gw is not None:
                gw.addmm_(d.T, h.to(d.dtype))
            if gb is not None:
                gb += d.sum(0)
            del z, d
        if gh is not None:
            _all_reduce(gh, dist.ReduceOp.SUM, o.group)  # every shard's share of the hidden states' gradient
        gw = gw.to(weight.dtype) if gw is not None else None
        gb = gb.to(bias.dtype) if gb is not None else None
        return gh, gw, gb, None, None


def linear_cross_entropy(hidden, weight, labels, *, bias=None, ignore_index: int = -100, scale: float = 1.0,
                         softcap: float | None = None, label_smoothing: float = 0.0, z_loss: float = 0.0,
                         vocab_group=None, vocab_start: int = 0, vocab_size: int | None = None,
                         chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """Summed cross-entropy of ``softcap(scale * (hidden @ weight.T + bias))`` against `labels`.

    Args:
        hidden: ``[..., H]`` hidden states (the LM head's input), any float dtype.
        weight: ``[V, H]`` LM head weight, the dtype of `hidden`.
        labels: ``[...]`` integer targets (`ignore_index` for none), shaped like ``hidden`` without H.
        bias: ``[V]`` LM head bias (None: none), the dtype of `weight`.
        scale: constant factor of the logits (Cohere's logit_scale; Granite's 1 / logits_scaling).
        softcap: Gemma 2's final_logit_softcapping (None or 0: off).
        label_smoothing: as ``torch.nn.functional.cross_entropy``'s (the target mixed with the uniform
            distribution over the vocabulary).
        z_loss: weight of the squared log-sum-exp added per labelled token (PaLM's z-loss; 0: off).
        vocab_group, vocab_start, vocab_size: loss parallel: `weight` (and `bias`) hold rows ``[vocab_start,
            vocab_start + V)`` of a ``vocab_size``-row head split over the ranks of ``vocab_group`` (each with the
            same `hidden` and `labels`, global token ids). The logits are never gathered: per call, the ranks
            exchange three per-token vectors in the forward and the hidden states' gradient in the backward. The
            loss and the hidden gradient are those of the whole head, on every rank; `weight`'s is its shard's.
        chunk_bytes: fp32 logits bytes per chunk (the working memory).
    Returns:
        fp32 scalar (fp64 for fp64 inputs): the sum over labelled tokens; divide by their count for the mean.
    Raises:
        ValueError: shapes, dtypes or labels that do not fit (before any work).
    """
    if hidden.shape[:-1] != labels.shape or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy needs hidden [..., H], weight [V, H] and labels [...] of hidden's "
                         f"leading shape; got hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, labels "
                         f"{tuple(labels.shape)}")
    if hidden.dtype != weight.dtype or not hidden.is_floating_point():
        raise ValueError(f"linear_cross_entropy needs float hidden and weight of one dtype; got {hidden.dtype} and "
                         f"{weight.dtype}")
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != weight.dtype):
        raise ValueError(f"linear_cross_entropy needs a bias [V] of weight's dtype; got {tuple(bias.shape)} "
                         f"{bias.dtype} for weight {tuple(weight.shape)} {weight.dtype}")
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise ValueError(f"linear_cross_entropy needs integer labels; got {labels.dtype}")
    vocab = weight.shape[0] if vocab_size is None else vocab_size
    if not 0 <= vocab_start <= vocab - weight.shape[0] or (vocab_group is None and vocab != weight.shape[0]):
        raise ValueError(f"linear_cross_entropy: a weight of {weight.shape[0]} rows from row {vocab_start} does not "
                         f"fit a vocabulary of {vocab} (a shard of the head needs vocab_group, vocab_start and "
                         f"vocab_size)")
    flat = labels.reshape(-1).long()
    bad = (flat != ignore_index) & ((flat < 0) | (flat >= vocab))
    if bool(bad.any()):
        raise ValueError(f"linear_cross_entropy: labels must be in [0, {vocab}) or {ignore_index}; got "
                         f"{flat[bad][:4].tolist()}")
    chunk = _chunk_rows(weight.shape[0], chunk_bytes)
    if not 0.0 <= label_smoothing <= 1.0 or z_loss < 0:
        raise ValueError(f"linear_cross_entropy needs label_smoothing in [0, 1] and z_loss >= 0; got "
                         f"label_smoothing={label_smoothing}, z_loss={z_loss}")
    o = _Options(ignore_index, float(scale), float(softcap or 0.0), chunk, float(label_smoothing), float(z_loss),
                 vocab, vocab_start, vocab_group)
    return _LinearCE.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias, flat, o)
