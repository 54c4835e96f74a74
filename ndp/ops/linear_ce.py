"""Fused linear cross-entropy: the LM head and the token cross-entropy in one op, a block of logits at a time.

``linear_cross_entropy(hidden [N, H], weight [V, H], labels [N])`` returns the summed cross-entropy of
``hidden @ weight.T (+ bias)`` against `labels` without materialising the ``[N, V]`` logits. Both passes walk the
vocabulary in blocks over a pass of tokens (every token, where a block of at least ``MIN_BLOCK_ROWS`` vocabulary
rows fits ``chunk_bytes``; ``tiles``), so every matmul is wide, 16-bit on tensor cores for 16-bit inputs as the
unfused path's. The forward folds each block's row statistics (max, sum of exponentials, target logit) into the
per-token log-sum-exp, which is all it keeps; the backward recomputes each block's logits, and a block's weight
gradient is one matmul over the pass's tokens, written once (no ``[V, H]`` fp32 accumulator for a single pass).
Working memory beyond the inputs and the gradients (``ndp.plan.cost.fused_loss_bytes``): one fp32 logits block of
``chunk_bytes``, turned into its softmax in place (plus its 16-bit matmul output and 16-bit copy for 16-bit
inputs, plus tanh when soft-capped), and in the backward the pass's fp32 hidden-gradient accumulator (16-bit
inputs), plus the weight gradient's fp32 accumulator where the tokens take more than one pass.
A constant logit scale (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``) and soft-capped final logits
(Gemma 2's ``final_logit_softcapping``: ``c * tanh(logits / c)``, after the scale) are honoured.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

import ndp_kernels

__all__ = ["linear_cross_entropy", "CHUNK_BYTES"]

# Logits bytes of one block (fp32): the op's working memory, beside the saved per-token log-sum-exp.
CHUNK_BYTES = 64 * 2 ** 20


# Vocabulary blocks have at least this many rows (where the vocabulary has them): the matmuls stay wide. The first
# H100 run timed the earlier token-chunked op (130-token chunks at vocab 128256, the weight gradient summed by an
# fp32 matmul into an fp32 [V, H] buffer) at 7.6x the unfused loss's time.
MIN_BLOCK_ROWS = 256


def tiles(tokens: int, rows: int, chunk_bytes: int) -> tuple[int, int]:
    """(tokens per pass, vocabulary rows per block): a ``[pass, block]`` fp32 logits block within `chunk_bytes`,
    every token in one pass where a block of ``MIN_BLOCK_ROWS`` rows fits."""
    per_pass = max(1, min(tokens, chunk_bytes // (4 * min(rows, MIN_BLOCK_ROWS))))
    return per_pass, max(1, min(rows, chunk_bytes // (4 * per_pass)))


def _logits(h, weight, bias, scale, softcap):
    """fp32 (or fp64) logits of a block, scaled and soft-capped in place; also tanh for the backward when capped.
    Working memory: one fp32 block (plus the es-byte matmul output when the inputs are 16-bit; plus tanh when
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
    chunk_bytes: int    # fp32 logits bytes of a block
    smoothing: float    # label smoothing epsilon
    z_loss: float       # weight of lse^2
    vocab: int          # the whole vocabulary (weight holds rows [start, start + weight rows) of it)
    start: int
    group: object       # the process group the vocabulary is split over (None: whole)


def _all_reduce(x, op, group):
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


def _local_targets(y, keep, start: int, rows: int):
    """Row of each label in the vocabulary rows ``[start, start + rows)`` held here, and whether it is here."""
    here = keep & (y >= start) & (y < start + rows)
    return torch.where(here, y - start, 0), here


def _block(h, y, keep, weight, bias, c: int, block: int, o: _Options):
    """Vocabulary rows ``[c, c + block)`` for a pass of tokens `h` with labels `y`: the rows of the weight, their
    logits and tanh (``_logits``), and each token's target row in the block and whether it is there."""
    w = weight[c:c + block]
    z, t = _logits(h, w, None if bias is None else bias[c:c + block], o.scale, o.softcap)
    idx, here = _local_targets(y, keep, o.start + c, w.shape[0])
    return w, z, t, idx, here


def _add_product(acc, a, b) -> None:
    """``acc += a @ b`` in acc's dtype (a 16-bit product is rounded once, then added)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc += a @ b


def _use_kernels(z) -> bool:
    """The Triton row kernels (``ndp_kernels.cross_entropy``) for fp32 blocks on CUDA; the torch ops elsewhere."""
    return z.is_cuda and z.dtype == torch.float32


def _block_stats(z, idx, here, o: _Options):
    """``[4, rows]``: per row of the block ``z`` (consumed) its max, sum of exp(z - max), the target's logit (0 where
    the target is not in the block) and the sum of its logits (0 without label smoothing)."""
    if _use_kernels(z):
        return ndp_kernels.ce_stats(z, torch.where(here, idx, -1))
    out = z.new_zeros(4, z.shape[0])
    m, se, tg, zs = out
    tg.copy_(z.gather(1, idx[:, None])[:, 0] * here)
    if o.smoothing:
        zs.copy_(z.sum(dim=-1))
    m.copy_(z.amax(dim=-1))
    se.copy_(z.sub_(m[:, None]).exp_().sum(dim=-1))
    return out


def _add_block_stats(stats, part) -> None:
    """Folds a further vocabulary block's row statistics `part` into the running `stats` (same layout)."""
    m, se, tg, zs = stats
    pm, pse, ptg, pzs = part
    peak = torch.maximum(m, pm)
    se.mul_((m - peak).exp_()).add_(pse * (pm - peak).exp_())
    m.copy_(peak)
    tg.add_(ptg)
    zs.add_(pzs)


def _block_grad(z, t, s, idx, here, row_scale, o: _Options):
    """The loss gradient with respect to the block's logits, over ``z``: softmax (times the z-loss factor) minus
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
        # per token, over this shard: max logit, sum of exp(z - max), target logit (0 elsewhere), sum of logits;
        # a pass of tokens at a time, over the vocabulary in blocks (as the backward walks it)
        per_pass, block = tiles(n, rows, o.chunk_bytes)
        stats = torch.zeros(4, n, dtype=acc, device=hidden.device)
        for a in range(0, n, per_pass):
            h, y = hidden[a:a + per_pass], labels[a:a + per_pass]
            keep = y != o.ignore_index
            for c in range(0, rows, block):
                _, z, t, idx, here = _block(h, y, keep, weight, bias, c, block, o)
                del t
                part = _block_stats(z, idx, here, o)
                del z
                if c:
                    _add_block_stats(stats[:, a:a + per_pass], part)
                else:
                    stats[:, a:a + per_pass] = part
                del part
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
        o, (n, rows), acc = ctx.o, (hidden.shape[0], weight.shape[0]), lse.dtype
        per_pass, block = tiles(n, rows, o.chunk_bytes)
        one_pass = per_pass >= n
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        gh = torch.empty_like(hidden) if need_h else None
        # one pass: each block's weight gradient is written once, in the weight's dtype; more: summed in fp32
        gw = None if not need_w else torch.empty_like(weight) if one_pass else weight.new_zeros(weight.shape, dtype=acc)
        gb = bias.new_zeros(bias.shape, dtype=acc) if need_b else None
        for a in range(0, n, per_pass):
            h, y, s = hidden[a:a + per_pass], labels[a:a + per_pass], lse[a:a + per_pass]
            keep = y != o.ignore_index
            row_scale = keep * grad
            gh_pass = None if gh is None else gh[a:a + per_pass].zero_() if gh.dtype == acc else \
                torch.zeros(h.shape, dtype=acc, device=h.device)
            for c in range(0, rows, block):
                w, z, t, idx, here = _block(h, y, keep, weight, bias, c, block, o)
                d = _block_grad(z, t, s, idx, here, row_scale, o)
                del z, t
                d16 = d.to(weight.dtype)  # 16-bit inputs: the matmuls on tensor cores, as the unfused path's
                if gh_pass is not None:
                    _add_product(gh_pass, d16, w)
                if gw is not None and one_pass:
                    torch.mm(d16.T, h, out=gw[c:c + block])
                elif gw is not None:
                    _add_product(gw[c:c + block], d16.T, h)
                if gb is not None:
                    gb[c:c + block] += d.sum(0)
                del d, d16
            if gh_pass is not None and gh_pass.dtype != gh.dtype:
                gh[a:a + per_pass] = gh_pass
            del gh_pass  # before the next pass allocates its own
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
        chunk_bytes: fp32 logits bytes per block (the working memory).
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
    if not 0.0 <= label_smoothing <= 1.0 or z_loss < 0:
        raise ValueError(f"linear_cross_entropy needs label_smoothing in [0, 1] and z_loss >= 0; got "
                         f"label_smoothing={label_smoothing}, z_loss={z_loss}")
    o = _Options(ignore_index, float(scale), float(softcap or 0.0), int(chunk_bytes), float(label_smoothing),
                 float(z_loss), vocab, vocab_start, vocab_group)
    return _LinearCE.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias, flat, o)
