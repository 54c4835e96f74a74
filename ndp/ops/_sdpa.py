"""``sdpa`` backend: attention blocks on torch's fused SDPA kernels that return the log-sum-exp.

On CPU this is ``aten::_scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``: a tiled
flash kernel (no S x S matrix), fp16/bf16/fp32/fp64, GQA without expanding K/V, and an additive mask
for the pieces that need one. A segment table is cut into full, causal and masked pieces
(``_pieces.py``); each piece is one kernel call, and pieces that share query rows merge by LSE into
fp32 accumulators with the compiled merge op, so a block costs what the fused kernel costs and keeps
the precision of the Triton path.

Backward of a piece uses the rows' FINAL out and lse (flash-style recomputation: ``P = exp(S - lse)``,
``delta = rowsum(dO * O)``), so pieces and ring steps add their gradients independently. A row that
sees no key anywhere has ``lse = -inf``; it is passed as ``+inf`` so its probabilities are exactly 0
(``exp(S - inf)``) instead of NaN.

CUDA: torch's CUDA SDPA ops (cuDNN, flash, efficient) need the forward's RNG state and sequence
metadata in their backwards and are not wired here yet (they have not been run on a GPU by this
project); on CUDA the backend reports itself unavailable and ``auto`` uses the other engines.
"""
from __future__ import annotations

import torch

from ndp import _ops
from ndp_kernels import reference
from ndp_kernels._segments import acc_dtype

from ._pieces import plan_pieces

__all__ = ["available", "fwd", "bwd", "pieces_of"]

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def available(device) -> tuple[bool, str]:
    """(usable on `device`, reason when not)."""
    device = torch.device(device)
    if device.type == "cpu":
        return True, ""
    return False, (f"the sdpa backend runs on CPU in this release (torch's CUDA SDPA ops are not wired yet); "
                   f"on {device.type} use 'triton' or 'flash_attn'")


def pieces_of(segs, sq: int, sk: int):
    """The piece plan of a Segments table for a block of sq x sk rows (cached on the table)."""
    memo = segs.memo
    key = ("sdpa_pieces", sq, sk)
    hit = memo.get(key)
    if hit is None:
        hit = memo[key] = plan_pieces(segs.table.tolist(), sq, sk)
    return hit


def _heads_first(x):
    return x.transpose(1, 2)  # [B, S, H, D] view -> [B, H, S, D] view, no copy


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
    q = _heads_first(q4[:, piece.q0:piece.q1])
    k = _heads_first(k4[:, piece.k0:piece.k1])
    v = _heads_first(v4[:, piece.k0:piece.k1])
    mask = _mask(piece, q4.dtype, q4.device) if piece.kind == "mask" else None
    return q, k, v, piece.kind == "causal", mask


def _merge(out_acc, lse_acc, piece, o, lse):
    """Merges a piece result (o [B, H, n, D] view, lse [B, H, n]) into the rows of the accumulators."""
    oa = out_acc[:, piece.q0:piece.q1]
    la = lse_acc[:, :, piece.q0:piece.q1]
    blk = o.transpose(1, 2)
    if out_acc.dtype == torch.float32 and _ops.available():
        torch.ops.ndp.merge_attn_states_(oa, la, blk, lse.float())
    else:
        reference.merge_attn_states_ref(oa, la, blk, lse.to(lse_acc.dtype))


def fwd(q4, k4, v4, segs, *, softmax_scale, out_acc=None, lse_acc=None):
    """Segment-level forward (see ``ndp.ops.attention_fwd``).

    Returns:
        (out ``[B, Sq, H, D]`` in q's dtype, lse fp32 ``[B, H, Sq]``), or (out_acc, lse_acc) merged in place.
    """
    b, sq, h, d = q4.shape
    dtype = q4.dtype
    q4, k4, v4 = (_kernel_dtype(x, out_acc is not None) for x in (q4, k4, v4))
    pieces = pieces_of(segs, sq, k4.shape[1])
    if out_acc is None and len(pieces) == 1 and pieces[0].q0 == 0 and pieces[0].q1 == sq:
        q, k, v, causal, mask = _piece_args(pieces[0], q4, k4, v4)
        o, lse = _FWD(q, k, v, 0.0, causal, attn_mask=mask, scale=softmax_scale)
        # The kernel writes its output in the memory order of q: for [B, S, H, D] inputs the transpose is
        # already contiguous, for heads-first inputs (HF) a copy here would only be repeated by the caller.
        return o.transpose(1, 2).to(dtype), lse.to(acc_dtype(dtype))
    own = out_acc is None
    if own:
        adt = acc_dtype(dtype)
        out_acc = torch.zeros(q4.shape, dtype=adt, device=q4.device)
        lse_acc = torch.full((b, h, sq), float("-inf"), dtype=adt, device=q4.device)
    for piece in pieces:
        q, k, v, causal, mask = _piece_args(piece, q4, k4, v4)
        o, lse = _FWD(q, k, v, 0.0, causal, attn_mask=mask, scale=softmax_scale)
        _merge(out_acc, lse_acc, piece, o, lse)
    if own:
        return out_acc.to(dtype), lse_acc
    return out_acc, lse_acc


def bwd(dout4, q4, k4, v4, out4, lse3, segs, *, softmax_scale, dq_acc=None, dk_acc=None, dv_acc=None):
    """Segment-level backward given the rows' final out and lse (see ``ndp.ops.attention_bwd``).

    Returns:
        (dq, dk, dv) in the input dtypes, or the accumulators with this block's gradients added.
    """
    sq, sk = q4.shape[1], k4.shape[1]
    dtype = q4.dtype
    dout4, q4, k4, v4, out4 = (_kernel_dtype(x, dq_acc is not None) for x in (dout4, q4, k4, v4, out4))
    pieces = pieces_of(segs, sq, sk)
    # lse = -inf marks a row with no key at all: +inf turns its probabilities into exact zeros.
    lse_safe = torch.where(lse3 == float("-inf"), torch.full_like(lse3, float("inf")), lse3)
    if q4.dtype == torch.float64:
        lse_safe = lse_safe.double()
    own = dq_acc is None
    if own and len(pieces) == 1:
        p = pieces[0]
        if p.q0 == 0 and p.q1 == sq and p.k0 == 0 and p.k1 == sk:
            q, k, v, causal, mask = _piece_args(p, q4, k4, v4)
            dq, dk, dv = _BWD(_heads_first(dout4), q, k, v, _heads_first(out4), lse_safe.contiguous(), 0.0, causal,
                              attn_mask=mask, scale=softmax_scale)
            return tuple(g.transpose(1, 2).to(dtype) for g in (dq, dk, dv))
    if own:
        adt = acc_dtype(dtype)
        dq_acc, dk_acc, dv_acc = (torch.zeros(x.shape, dtype=adt, device=x.device) for x in (q4, k4, v4))
    for p in pieces:
        q, k, v, causal, mask = _piece_args(p, q4, k4, v4)
        do = _heads_first(dout4[:, p.q0:p.q1])
        o = _heads_first(out4[:, p.q0:p.q1])
        lse = lse_safe[:, :, p.q0:p.q1].contiguous()
        dq, dk, dv = _BWD(do, q, k, v, o, lse, 0.0, causal, attn_mask=mask, scale=softmax_scale)
        dq_acc[:, p.q0:p.q1] += dq.transpose(1, 2)
        dk_acc[:, p.k0:p.k1] += dk.transpose(1, 2)
        dv_acc[:, p.k0:p.k1] += dv.transpose(1, 2)
    if own:
        return dq_acc.to(dtype), dk_acc.to(dtype), dv_acc.to(dtype)
    return dq_acc, dk_acc, dv_acc
