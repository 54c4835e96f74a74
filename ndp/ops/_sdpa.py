"""``sdpa`` backend: attention blocks on torch's fused SDPA kernels that return the log-sum-exp.

On CPU this is ``aten::_scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``: a tiled
flash kernel (no S x S matrix), fp16/bf16/fp32/fp64, GQA without expanding K/V, and an additive mask
for the pieces that need one. A segment table is cut into full, causal and masked pieces
(``_pieces.py``); each piece is one kernel call, and pieces that share query rows merge by LSE into
fp32 accumulators with the compiled merge op, so a block costs what the fused kernel costs and keeps
the precision of the Triton path.

Backward of a piece uses the rows' FINAL out and lse (flash-style recomputation: ``P = exp(S - lse)``,
``delta = rowsum(dO * O)``), so pieces and ring steps add their gradients independently. A row that
sees no key is in no piece (its out 0, lse -inf), so every lse a piece reads is finite.

On CUDA the same piece plan runs on torch's cuDNN, built-in FlashAttention-2 or memory-efficient kernels
(``_sdpa_cuda.py``), each checked against the float64 reference on this machine before its first use.
"""
from __future__ import annotations

import torch

from ndp_kernels.segments import acc_dtype

from . import _sdpa_cuda
from ._pieces import Call, as_dtype, heads_first, pieces_of, rows, run_pieces_bwd, run_pieces_fwd

__all__ = ["SOFTCAP", "available", "capable", "fwd", "bwd", "pieces_of"]

SOFTCAP = False

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def available(device) -> tuple[bool, str]:
    """(usable on `device`, reason when not)."""
    device = torch.device(device)
    if device.type == "cpu":
        return True, ""
    if device.type == "cuda":
        return _sdpa_cuda.available(device)
    return False, f"the sdpa backend runs on CPU and CUDA, not {device.type}"


def capable(segs, q4, k4, *, deterministic=False) -> tuple[bool, str]:
    """Whether this block runs exactly here (assumes available)."""
    if q4.device.type == "cpu":
        return True, ""
    calls, why = _sdpa_cuda.plan(segs, q4, k4, deterministic=deterministic)
    return calls is not None, why


def _mask(piece, dtype, device):
    """Additive mask (0 visible, -inf hidden) of a mask piece, in the query dtype as the kernel needs."""
    i = torch.arange(piece.rows, device=device)[:, None]
    j = torch.arange(piece.k1 - piece.k0, device=device)[None, :]
    d = j - i
    hidden = (d < piece.lo) | (d > piece.hi)
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))


def _kernel_dtype(x, accumulate: bool):
    """The dtype a CPU piece runs in. fp16 runs in fp32: the CPU kernel has no fast fp16 path (measured 3x
    slower than fp32 at S=1024 before this, `python -m ndp.ops.tune`). bf16 runs in fp32 when the block
    feeds fp32 accumulators (ring steps): the kernel would round each block's result to bf16 before the
    fp32 merge, where the Triton path merges unrounded; fp32 math only adds precision."""
    if x.device.type != "cpu":
        return x
    if x.dtype == torch.float16 or (accumulate and x.dtype == torch.bfloat16):
        return x.float()
    return x


def _piece_args(piece, q4, k4, v4):
    q = heads_first(rows(q4, piece.q0, piece.q1))
    k = heads_first(rows(k4, piece.k0, piece.k1))
    v = heads_first(rows(v4, piece.k0, piece.k1))
    mask = _mask(piece, q4.dtype, q4.device) if piece.kind == "mask" else None
    return q, k, v, piece.kind == "causal", mask


def _cpu_fwd(piece, q4, k4, v4, scale):
    q, k, v, causal, mask = _piece_args(piece, q4, k4, v4)
    o, lse = _FWD(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    # The kernel writes its output in the memory order of q: for [B, S, H, D] inputs the transpose is already
    # contiguous, for heads-first inputs (HF) a copy here would only be repeated by the caller.
    return o.transpose(1, 2), lse


def _cpu_bwd(piece, do4, q4, k4, v4, o4, lse3, scale):
    q, k, v, causal, mask = _piece_args(piece, q4, k4, v4)
    do = heads_first(rows(do4, piece.q0, piece.q1))
    o = heads_first(rows(o4, piece.q0, piece.q1))
    grads = _BWD(do, q, k, v, o, rows(lse3, piece.q0, piece.q1, 2).contiguous(), 0.0, causal, attn_mask=mask,
                 scale=scale)
    return tuple(g.transpose(1, 2) for g in grads)


def _calls(segs, q4, k4, deterministic=False):
    if q4.device.type == "cpu":
        key = ("sdpa_cpu_calls", q4.shape[1], k4.shape[1])
        hit = segs.memo.get(key)
        if hit is None:
            hit = segs.memo[key] = tuple(Call(p, "cpu", _cpu_fwd, _cpu_bwd)
                                         for p in pieces_of(segs, q4.shape[1], k4.shape[1]))
        return hit
    calls, why = _sdpa_cuda.plan(segs, q4, k4, deterministic=deterministic)
    if calls is None:
        raise RuntimeError(f"the sdpa engine cannot run this block here: {why}")  # engines.capable said so first
    return calls


def fwd(q4, k4, v4, segs, *, softmax_scale, out_acc=None, lse_acc=None):
    """Segment-level forward (see ``ndp.ops.attention_fwd``).

    Returns:
        (out ``[B, Sq, H, D]`` in q's dtype, lse fp32 ``[B, H, Sq]``), or (out_acc, lse_acc) merged in place.
    """
    dtype = q4.dtype
    q4, k4, v4 = (_kernel_dtype(x, out_acc is not None) for x in (q4, k4, v4))
    out, lse = run_pieces_fwd(_calls(segs, q4, k4), q4, k4, v4, softmax_scale, out_acc, lse_acc)
    if out_acc is None:
        return as_dtype(out, dtype), as_dtype(lse, acc_dtype(dtype))
    return out, lse


def bwd(dout4, q4, k4, v4, out4, lse3, segs, *, softmax_scale, dq_acc=None, dk_acc=None, dv_acc=None,
        deterministic=False):
    """Segment-level backward given the rows' final out and lse (see ``ndp.ops.attention_bwd``).

    Returns:
        (dq, dk, dv) in the input dtypes, or the accumulators with this block's gradients added.
    """
    dtype = q4.dtype
    dout4, q4, k4, v4, out4 = (_kernel_dtype(x, dq_acc is not None) for x in (dout4, q4, k4, v4, out4))
    if q4.device.type != "cpu":
        dout4, out4 = as_dtype(dout4, q4.dtype), as_dtype(out4, q4.dtype)
    grads = run_pieces_bwd(_calls(segs, q4, k4, deterministic), dout4, q4, k4, v4, out4, lse3, softmax_scale,
                           dq_acc, dk_acc, dv_acc)
    if dq_acc is None:
        return tuple(as_dtype(g, dtype) for g in grads)
    return grads
