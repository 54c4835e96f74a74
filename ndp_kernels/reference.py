"""Plain-PyTorch attention: the reference every kernel and algorithm is tested against, and the CPU path.

Math (per head h, kv head h // (H / Hkv), visibility mask M from the segment table)::

    S   = scale * Q K^T                     (soft-capped: S = c * tanh(S / c) for softcap c > 0)
    S   = S masked to -inf outside M
    lse = logsumexp(S, -1)                  (-inf for a row that sees no key)
    P   = exp(S - lse)                      (0 on rows with lse = -inf)
    O   = P V

Backward, given the FINAL output O and lse of each row (as the ring backward passes them)::

    delta = rowsum(dO * O)
    dV = P^T dO          dP = dO V^T         dS = P * (dP - delta)
    dQ = scale * dS K    dK = scale * dS^T Q  (dK, dV summed over the query heads of each kv head)

With a soft-cap, dS is taken through the tanh: dS *= 1 - (S / c)^2 with S the capped score.

Computation is fp32 (fp64 stays fp64); ``upcast=False`` computes in the input dtype, which gives the
low-precision baseline of the fp16/bf16 error bound in docs/design.md. Dense masks make this O(S^2) in memory:
it is for checking and for small CPU runs, not for speed.
"""
from __future__ import annotations

import torch

from .segments import acc_dtype, check_merge_args, check_softcap, run_bwd, run_fwd

__all__ = ["attn_fwd_segments_ref", "attn_bwd_segments_ref", "flash_attn_fwd_ref", "flash_attn_bwd_ref",
           "merge_attn_states_ref"]


def _compute_dtype(dtype, upcast):
    if not upcast:
        return dtype
    return acc_dtype(dtype)


def _scores(qf, kf, scale, softcap):
    """scale * q k^T ([B, H, Sq, D] x [B, H, Sk, D]), soft-capped when softcap > 0."""
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    return softcap * torch.tanh(s / softcap) if softcap else s


def _probs(q4, k4, segs, scale, ct, softcap=0.0):
    """P [B, H, Sq, Sk] and lse [B, H, Sq] in dtype ct."""
    b, sq, h, d = q4.shape
    sk, hk = k4.shape[1], k4.shape[2]
    qf = q4.to(ct).transpose(1, 2)                                          # B H Sq D
    kf = k4.to(ct).transpose(1, 2).repeat_interleave(h // hk, dim=1)        # B H Sk D
    s = _scores(qf, kf, scale, softcap)
    mask = segs.mask(sq, sk, device=q4.device)
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    seen = torch.isfinite(lse)
    p = torch.exp(s - torch.where(seen, lse, torch.zeros_like(lse))[..., None])
    p = torch.where(seen[..., None], p, torch.zeros_like(p))
    return p, lse


def merge_attn_states_ref(out_acc, lse_acc, block_out, block_lse):
    """Merge a block's (out, lse) into running accumulators in place, by LSE.

    ``new = logaddexp(lse_acc, lse_blk)``; ``out_acc = out_acc * exp(lse_acc - new) + blk * exp(lse_blk - new)``.
    Rows where both lse are -inf stay unchanged (never NaN).

    Args:
        out_acc: fp32 ``[B, S, H, D]`` (or packed ``[T, H, D]``), updated in place.
        lse_acc: fp32 ``[B, H, S]`` (or ``[H, T]``), updated in place.
        block_out: any float dtype, out_acc's shape.  block_lse: lse_acc's shape.
    Returns:
        (out_acc, lse_acc)
    Raises:
        TypeError / ValueError on dtype or shape mismatch.
    """
    check_merge_args(out_acc, lse_acc, block_out, block_lse)
    packed = out_acc.dim() == 3
    la = lse_acc.to(out_acc.dtype)
    lb = block_lse.to(out_acc.dtype)
    new = torch.logaddexp(la, lb)
    fin = torch.isfinite(new)
    safe = torch.where(fin, new, torch.zeros_like(new))
    wa = torch.where(fin, torch.exp(la - safe), torch.ones_like(new))
    wb = torch.where(fin, torch.exp(lb - safe), torch.zeros_like(new))
    # lse is [B, H, S] (or [H, T]); out is [B, S, H, D] (or [T, H, D]): move heads next to dim.
    wa = (wa.transpose(0, 1) if packed else wa.transpose(1, 2))[..., None]
    wb = (wb.transpose(0, 1) if packed else wb.transpose(1, 2))[..., None]
    out_acc.copy_(out_acc * wa + block_out.to(out_acc.dtype) * wb)
    lse_acc.copy_(torch.where(fin, new, lse_acc))
    return out_acc, lse_acc


def attn_fwd_segments_ref(q4, k4, v4, segs, *, softmax_scale, out_acc=None, lse_acc=None, upcast=True,
                          softcap=0.0):
    """Segment-level forward (see ``ndp_kernels.segments``).

    Args:
        q4: ``[B, Sq, H, D]``; k4, v4: ``[B, Sk, Hkv, D]``; segs: ``Segments``.
        out_acc / lse_acc: optional accumulators (fp32, fp64 for fp64 input), merged into in place.
        softcap: logit soft-cap c (0 = off): scores c * tanh(scores / c).
    Returns:
        (out ``[B, Sq, H, D]`` in q's dtype, lse ``[B, H, Sq]`` fp32), or (out_acc, lse_acc).
    """
    ct = _compute_dtype(q4.dtype, upcast)
    h, hk = q4.shape[2], k4.shape[2]
    p, lse = _probs(q4, k4, segs, softmax_scale, ct, softcap)
    vf = v4.to(ct).transpose(1, 2).repeat_interleave(h // hk, dim=1)
    out = torch.matmul(p, vf).transpose(1, 2)                                # B Sq H D
    lse = lse.to(acc_dtype(q4.dtype))
    if out_acc is not None:
        merge_attn_states_ref(out_acc, lse_acc, out, lse)
        return out_acc, lse_acc
    return out.to(q4.dtype), lse


def attn_bwd_segments_ref(dout4, q4, k4, v4, out4, lse3, segs, *, softmax_scale, dq_acc=None, dk_acc=None,
                          dv_acc=None, upcast=True, softcap=0.0):
    """Segment-level backward with the rows' final out and lse (softcap as in the forward).

    Returns:
        (dq, dk, dv) in the input dtypes, or the accumulators with the gradients added.
    """
    ct = _compute_dtype(q4.dtype, upcast)
    b, sq, h, d = q4.shape
    sk, hk = k4.shape[1], k4.shape[2]
    g = h // hk
    qf = q4.to(ct).transpose(1, 2)
    kf = k4.to(ct).transpose(1, 2).repeat_interleave(g, dim=1)
    vf = v4.to(ct).transpose(1, 2).repeat_interleave(g, dim=1)
    do = dout4.to(ct).transpose(1, 2)
    o = out4.to(ct).transpose(1, 2)
    s = _scores(qf, kf, softmax_scale, softcap)
    mask = segs.mask(sq, sk, device=q4.device)
    lse = lse3.to(ct)
    seen = torch.isfinite(lse)[..., None] & mask
    p = torch.where(seen, torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None]),
                    torch.zeros_like(s))
    delta = (do * o).sum(-1, keepdim=True)
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, vf.transpose(-1, -2))
    ds = p * (dp - delta)
    if softcap:
        ds = ds * (1 - (s / softcap) ** 2)  # through the tanh: d(c tanh(x / c)) / dx = 1 - tanh^2
    dq = torch.matmul(ds, kf) * softmax_scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * softmax_scale
    # Sum the gradients of the query heads that share a kv head (GQA/MQA).
    dk = dk.reshape(b, hk, g, sk, d).sum(2)
    dv = dv.reshape(b, hk, g, sk, d).sum(2)
    dq, dk, dv = (x.transpose(1, 2) for x in (dq, dk, dv))
    if dq_acc is not None:
        dq_acc.add_(dq.to(dq_acc.dtype))
        dk_acc.add_(dk.to(dk_acc.dtype))
        dv_acc.add_(dv.to(dv_acc.dtype))
        return dq_acc, dk_acc, dv_acc
    return dq.to(q4.dtype), dk.to(k4.dtype), dv.to(v4.dtype)


def flash_attn_fwd_ref(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), cu_seqlens_q=None,
                       cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, out_acc=None, lse_acc=None,
                       softcap=0.0, upcast=True):
    """Reference of ``ndp_kernels.flash_attn_fwd`` (same signature, plus ``upcast``).

    Args:
        q: ``[B, Sq, H, D]`` (packed ``[T, H, D]`` with cu_seqlens); k, v: ``[B, Sk, Hkv, D]``.
    Returns:
        (out, lse): out in q's dtype and shape, lse fp32 ``[B, H, Sq]`` (packed ``[H, T]``);
        with accumulators, (out_acc, lse_acc) after merging.
    Raises:
        ValueError / TypeError for malformed input (see ``segments.prepare``).
    """
    return run_fwd(attn_fwd_segments_ref, q, k, v, causal=causal, softmax_scale=softmax_scale,
                   window_size=window_size, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, out_acc=out_acc, lse_acc=lse_acc,
                   upcast=upcast, softcap=check_softcap(softcap))


def flash_attn_bwd_ref(dout, q, k, v, out, lse, causal=False, softmax_scale=None, window_size=(-1, -1),
                       cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, dq_acc=None,
                       dk_acc=None, dv_acc=None, deterministic=False, softcap=0.0, upcast=True):
    """Reference of ``ndp_kernels.flash_attn_bwd`` (same signature, plus ``upcast``). Plain PyTorch matmuls are
    reproducible run to run, so ``deterministic`` changes nothing here.

    Returns:
        (dq, dk, dv) in the input dtypes, or the fp32 accumulators with the gradients added.
    Raises:
        ValueError / TypeError for malformed input.
    """
    return run_bwd(attn_bwd_segments_ref, dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                   window_size=window_size, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dq_acc=dq_acc, dk_acc=dk_acc,
                   dv_acc=dv_acc, upcast=upcast, softcap=check_softcap(softcap))
