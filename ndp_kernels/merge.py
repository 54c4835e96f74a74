"""Triton merge of partial attention states by log-sum-exp (in place, fp32 accumulators).

The forward kernel of ``ndp_kernels.flash`` fuses this merge in its epilogue; this standalone kernel merges
blocks computed elsewhere (the sdpa and flash-attn engines' pieces) on a GPU whose ``ndp._C`` has no CUDA kernel
(a build without nvcc): ``ndp._ops.merge_attn_states_``, the one merge entry point, picks it there.
Both take their weights and the new lse from ``_merge_weights`` / ``_merge_lse``, so the two
paths share one set of numerics.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreter_active, segments
from .configs import block_d, current_arch, launch_device, merge_config

__all__ = ["merge_attn_states_"]


@triton.jit
def _merge_terms(lse_old, lse_blk):
    """The LSE merge math shared by ``_merge_weights`` and ``_merge_lse``, per row, fp32.

    Returns (none, mx_safe, e_old, e_blk, tot): exponentials taken relative to
    mx = max(lse_old, lse_blk) so that no exp overflows, tot = e_old + e_blk. A row with both
    lse -inf (``none``) gets mx_safe = 0 and tot = 1 instead of 0/0, so nothing is ever NaN.
    """
    mx = tl.maximum(lse_old, lse_blk)
    none = mx == float("-inf")
    mx_safe = tl.where(none, 0.0, mx)
    e_old = tl.exp(lse_old - mx_safe)
    e_blk = tl.exp(lse_blk - mx_safe)
    tot = tl.where(none, 1.0, e_old + e_blk)
    return none, mx_safe, e_old, e_blk, tot


@triton.jit
def _merge_weights(lse_old, lse_blk):
    """(w_old, w_blk) = (exp(lse_old - new), exp(lse_blk - new)) with new = logaddexp(lse_old, lse_blk).

    A row with both lse -inf gets w_old = 1, w_blk = 0: the accumulator is left unchanged.
    """
    none, _, e_old, e_blk, tot = _merge_terms(lse_old, lse_blk)
    return tl.where(none, 1.0, e_old / tot), tl.where(none, 0.0, e_blk / tot)


@triton.jit
def _merge_lse(lse_old, lse_blk):
    """new = logaddexp(lse_old, lse_blk); lse_old (-inf) where both are -inf.

    Callers use it next to ``_merge_weights``: the compiler's CSE shares the terms of the two
    calls, and calling it after the output tile is merged keeps the log out of the tile's live
    range (computing it before the tile loads took the merge kernel from 101 to 138 registers,
    bf16 head_dim 128 on sm_80).
    """
    none, mx_safe, _, _, tot = _merge_terms(lse_old, lse_blk)
    return tl.where(none, lse_old, mx_safe + tl.log(tot))


@triton.jit
def _merge_attn_states_kernel(
    out_acc_ptr, lse_acc_ptr, blk_ptr, blk_lse_ptr, seqlen,
    stride_oa_b, stride_oa_s, stride_oa_h,
    stride_la_b, stride_la_h, stride_la_s,
    stride_ob_b, stride_ob_s, stride_ob_h,
    stride_lb_b, stride_lb_h, stride_lb_s,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """new = logaddexp(lse_acc, lse_blk); out_acc = out_acc*exp(lse_acc-new) + blk*exp(lse_blk-new).

    Rows with both lse -inf are left unchanged (weights 1 and 0 instead of 0/0). fp32 math.
    """
    pid_m = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seqlen
    mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = offs_m.to(tl.int64)
    la_ptrs = lse_acc_ptr + b * stride_la_b + h * stride_la_h + rows * stride_la_s
    lb_ptrs = blk_lse_ptr + b * stride_lb_b + h * stride_lb_h + rows * stride_lb_s
    oa_ptrs = out_acc_ptr + b * stride_oa_b + h * stride_oa_h + rows[:, None] * stride_oa_s + offs_d[None, :]
    ob_ptrs = blk_ptr + b * stride_ob_b + h * stride_ob_h + rows[:, None] * stride_ob_s + offs_d[None, :]
    lse_a = tl.load(la_ptrs, mask=row_ok, other=float("-inf"))
    lse_b = tl.load(lb_ptrs, mask=row_ok, other=float("-inf")).to(tl.float32)
    w_a, w_b = _merge_weights(lse_a, lse_b)
    o_a = tl.load(oa_ptrs, mask=mask, other=0.0)
    o_b = tl.load(ob_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(oa_ptrs, o_a * w_a[:, None] + o_b * w_b[:, None], mask=mask)
    tl.store(la_ptrs, _merge_lse(lse_a, lse_b), mask=row_ok)


def merge_attn_states_(out_acc, lse_acc, block_out, block_lse):
    """Merge a block's (out, lse) into running fp32 accumulators in place, by log-sum-exp.

    Args:
        out_acc: fp32 [B, S, H, D] (or packed [T, H, D]), updated in place; stride 1 in the last dim.
        lse_acc: fp32 [B, H, S] (or [H, T]), updated in place.
        block_out: out_acc's shape, any float dtype. block_lse: lse_acc's shape.
    Returns:
        (out_acc, lse_acc)
    Raises:
        TypeError/ValueError on dtype or shape mismatch (same checks as the reference).

    On a CPU tensor without TRITON_INTERPRET=1, and for fp64 accumulators, this runs
    ``ndp_kernels.reference.merge_attn_states_ref`` instead of the kernel.
    """
    segments.check_merge_args(out_acc, lse_acc, block_out, block_lse)
    for name, t in (("block_out", block_out), ("block_lse", block_lse), ("lse_acc", lse_acc)):
        if t.device != out_acc.device:
            raise ValueError(f"{name} must be on out_acc's device {out_acc.device}; got {t.device}")
    if (out_acc.device.type != "cuda" and not interpreter_active()) or out_acc.dtype == torch.float64:
        from .reference import merge_attn_states_ref
        return merge_attn_states_ref(out_acc, lse_acc, block_out, block_lse)
    for name, t in (("out_acc", out_acc), ("block_out", block_out)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have stride 1 in the last dim, got {t.stride(-1)}; "
                             f"call .contiguous()")
    packed = out_acc.dim() == 3
    oa, la, ob, lb = ((x.unsqueeze(0) for x in (out_acc, lse_acc, block_out, block_lse)) if packed
                      else (out_acc, lse_acc, block_out, block_lse))
    B, S, H, D = oa.shape
    if oa.numel() == 0:
        return out_acc, lse_acc
    cfg = merge_config(current_arch(oa.device), D)
    grid = (triton.cdiv(S, cfg.block_m), B, H)
    with launch_device(oa.device):
        _merge_attn_states_kernel[grid](
            oa, la, ob, lb, S,
            oa.stride(0), oa.stride(1), oa.stride(2),
            la.stride(0), la.stride(1), la.stride(2),
            ob.stride(0), ob.stride(1), ob.stride(2),
            lb.stride(0), lb.stride(1), lb.stride(2),
            HEAD_DIM=D, BLOCK_D=block_d(D), BLOCK_M=cfg.block_m, num_warps=cfg.num_warps,
        )
    return out_acc, lse_acc
