"""Triton row kernels of the fused linear cross-entropy (``ndp.ops.linear_cross_entropy``) on a chunk of logits.

The op computes each chunk's fp32 logits ``z [rows, V]`` with a matmul; these kernels then read them once per pass
instead of the five element-wise passes of the torch path:

- ``ce_stats(z, target)``: per row, over the chunk's vocabulary columns, the max logit ``m``, ``sum exp(z - m)``,
  the target's logit (0 where ``target`` is -1: ignored, or in another rank's vocabulary shard) and the sum of the
  logits (for label smoothing): the numbers the op reduces into the log-sum-exp.
- ``ce_grad_(z, target, lse, coef, row_scale, ...)``: the gradient of the loss with respect to the logits, written
  over ``z`` in place: ``(softmax * coef + onehot * (eps - 1) - eps / V) * row_scale``, times ``1 - (z / c)^2`` when
  soft-capped (z then holds ``c * tanh(.)``) and the constant logit scale.

One program per row walks the row in ``BLOCK_V`` tiles (an online max and sum in the forward). Checked against the
torch path under the interpreter (tests/kernels/test_cross_entropy.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreter_active

__all__ = ["ce_stats", "ce_grad_", "block_v", "BLOCK_V", "NUM_WARPS"]

BLOCK_V, NUM_WARPS = 2048, 8  # on a GPU: a 2048-column tile per step, 8 warps (the AOT report compiles these)


def block_v(vocab: int) -> int:
    """Vocabulary tile of one program step (smaller under the interpreter, where a tile is numpy work)."""
    return min(128 if interpreter_active() else BLOCK_V, triton.next_power_of_2(vocab))


@triton.jit
def _ce_stats_kernel(z_ptr, target_ptr, stats_ptr, n_rows, vocab, stride_z, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    z_row = z_ptr + row.to(tl.int64) * stride_z
    target = tl.load(target_ptr + row)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    tg = tl.zeros((), tl.float32)
    zs = tl.zeros((), tl.float32)
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        inside = cols < vocab
        z = tl.load(z_row + cols, mask=inside, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
        tg += tl.sum(tl.where(cols == target, z, 0.0), axis=0)
        zs += tl.sum(tl.where(inside, z, 0.0), axis=0)
    tl.store(stats_ptr + row, m)
    tl.store(stats_ptr + n_rows + row, s)
    tl.store(stats_ptr + 2 * n_rows + row, tg)
    tl.store(stats_ptr + 3 * n_rows + row, zs)


@triton.jit
def _ce_grad_kernel(z_ptr, target_ptr, lse_ptr, coef_ptr, scale_row_ptr, vocab, stride_z, target_coef,
                    smooth_per_col, softcap, scale, BLOCK_V: tl.constexpr, SOFTCAP: tl.constexpr):
    row = tl.program_id(0)
    z_row = z_ptr + row.to(tl.int64) * stride_z
    target = tl.load(target_ptr + row)
    lse = tl.load(lse_ptr + row)
    coef = tl.load(coef_ptr + row)
    scale_row = tl.load(scale_row_ptr + row) * scale
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        inside = cols < vocab
        z = tl.load(z_row + cols, mask=inside, other=0.0)
        d = tl.exp(z - lse) * coef + tl.where(cols == target, target_coef, 0.0) - smooth_per_col
        if SOFTCAP:
            t = z / softcap
            d = d * (1.0 - t * t)
        tl.store(z_row + cols, d * scale_row, mask=inside)


def _check(z, target):
    if z.dtype != torch.float32 or z.dim() != 2 or z.stride(1) != 1:
        raise ValueError(f"ndp_kernels.cross_entropy takes fp32 [rows, V] logits with unit column stride; got "
                         f"{z.dtype} {tuple(z.shape)} strides {z.stride()}")
    if target.shape != z.shape[:1] or target.dtype != torch.int64:
        raise ValueError(f"ndp_kernels.cross_entropy takes int64 targets [rows] (-1: none here); got "
                         f"{target.dtype} {tuple(target.shape)} for logits {tuple(z.shape)}")


def ce_stats(z: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``[4, rows]`` fp32: per row the max logit, sum of exp(z - max), the target's logit (0 for target -1) and the
    sum of the logits."""
    _check(z, target)
    rows, vocab = z.shape
    stats = torch.empty(4, rows, dtype=torch.float32, device=z.device)
    if rows:
        _ce_stats_kernel[(rows,)](z, target, stats, rows, vocab, z.stride(0), BLOCK_V=block_v(vocab),
                                  num_warps=NUM_WARPS)
    return stats


def ce_grad_(z: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, coef: torch.Tensor, row_scale: torch.Tensor,
             *, smoothing: float = 0.0, vocab: int | None = None, softcap: float = 0.0,
             scale: float = 1.0) -> torch.Tensor:
    """Overwrite ``z`` with the loss gradient with respect to it (see the module docstring) and return it.

    Args:
        z: fp32 ``[rows, V]`` logits (soft-capped ones when ``softcap``); target: int64 ``[rows]``, -1 for none here.
        lse, coef, row_scale: fp32 ``[rows]``: log-sum-exp over the whole vocabulary, the softmax's factor
            (``1 + 2 z_loss lse``), the row's weight (0 for an ignored token, else the incoming gradient).
        smoothing: label smoothing epsilon; vocab: the whole vocabulary (for eps / V; default V).
    """
    _check(z, target)
    rows, cols = z.shape
    if rows:
        _ce_grad_kernel[(rows,)](z, target, lse.float().contiguous(), coef.float().contiguous(),
                                 row_scale.float().contiguous(), cols, z.stride(0), smoothing - 1.0,
                                 smoothing / (vocab or cols), float(softcap or 1.0), float(scale),
                                 BLOCK_V=block_v(cols), SOFTCAP=bool(softcap), num_warps=NUM_WARPS)
    return z
