"""flash-attn backend (GPU only; no machine of this project has a GPU, so no test reaches this file).

Kept deliberately small: segment tables that flash-attn's varlen API can express (query and key ranges
laid out back to back from row 0, every segment bottom-right aligned with one shared (causal, window))
go to flash-attn; anything else goes to the Triton kernels. The fused accumulator is emulated with the
compiled merge op, since flash-attn has no accumulator epilogue.
"""
from __future__ import annotations

import logging

import torch

from ndp_kernels import NO_LIMIT

log = logging.getLogger(__name__)


def available() -> tuple[bool, str]:
    try:
        import flash_attn  # noqa: F401
    except Exception as e:
        return False, f"flash-attn does not import ({e}); install it with `pip install ndp[flash]` on a CUDA machine"
    if not torch.cuda.is_available():
        return False, "flash-attn needs a CUDA device"
    return True, ""


def _varlen_args(q4, k4, segs):
    """(cu_q, cu_k, max_q, max_k, causal, (left, right)) when segs is flash-attn expressible, else None."""
    # Only packed-style calls ([1, T, H, D]) map onto the varlen API; others use the Triton kernels.
    if q4.dtype not in (torch.float16, torch.bfloat16) or q4.shape[0] != 1:
        return None
    rows = segs.table.tolist()
    cu_q, cu_k, mode = [0], [0], None
    for qs, ql, ks, kl, lo, hi in rows:
        if qs != cu_q[-1] or ks != cu_k[-1]:
            return None
        d = kl - ql
        left = -1 if lo <= -NO_LIMIT else d - lo
        right = -1 if hi >= NO_LIMIT else hi - d
        if left < -1 or right < -1 or (mode is not None and mode != (left, right)):
            return None
        mode = (left, right)
        cu_q.append(qs + ql)
        cu_k.append(ks + kl)
    if mode is None or cu_q[-1] != q4.shape[1] or cu_k[-1] != k4.shape[1]:
        return None
    dev = q4.device
    return (torch.tensor(cu_q, dtype=torch.int32, device=dev), torch.tensor(cu_k, dtype=torch.int32, device=dev),
            segs.max_q_len, segs.max_k_len, mode[1] == 0, mode)


def _flat(x):
    return x.reshape(-1, *x.shape[2:])


def fwd(q4, k4, v4, segs, *, softmax_scale, out_acc=None, lse_acc=None, fallback):
    args = _varlen_args(q4, k4, segs)
    if args is None:
        log.debug("segment table not expressible in flash-attn varlen form; using the Triton kernels")
        return fallback(q4, k4, v4, segs, softmax_scale=softmax_scale, out_acc=out_acc, lse_acc=lse_acc)
    from flash_attn import flash_attn_varlen_func
    cu_q, cu_k, mq, mk, causal, (left, right) = args
    out, lse, _ = flash_attn_varlen_func(_flat(q4), _flat(k4), _flat(v4), cu_q, cu_k, mq, mk,
                                         softmax_scale=softmax_scale, causal=causal,
                                         window_size=(left, right), return_attn_probs=True)
    out, lse = out.unsqueeze(0), lse.unsqueeze(0)  # [1, T, H, D], [1, H, T]
    if out_acc is None:
        return out, lse
    torch.ops.ndp.merge_attn_states_(out_acc, lse_acc, out, lse)
    return out_acc, lse_acc


def bwd(dout4, q4, k4, v4, out4, lse3, segs, *, softmax_scale, dq_acc=None, dk_acc=None, dv_acc=None,
        fallback):
    args = _varlen_args(q4, k4, segs)
    if args is None:
        return fallback(dout4, q4, k4, v4, out4, lse3, segs, softmax_scale=softmax_scale, dq_acc=dq_acc,
                        dk_acc=dk_acc, dv_acc=dv_acc)
    from flash_attn.flash_attn_interface import _flash_attn_varlen_backward
    cu_q, cu_k, mq, mk, causal, (left, right) = args
    dq, dk, dv = (torch.empty_like(_flat(x)) for x in (q4, k4, v4))
    _flash_attn_varlen_backward(
        _flat(dout4), _flat(q4), _flat(k4), _flat(v4), _flat(out4), lse3[0].contiguous(), dq, dk, dv,
        cu_q, cu_k, mq, mk, dropout_p=0.0, softmax_scale=softmax_scale, causal=causal,
        window_size_left=left, window_size_right=right, softcap=0.0, alibi_slopes=None,
        deterministic=False, rng_state=None)
    dq, dk, dv = dq.unsqueeze(0), dk.unsqueeze(0), dv.unsqueeze(0)
    if dq_acc is None:
        return dq, dk, dv
    dq_acc.add_(dq)
    dk_acc.add_(dk)
    dv_acc.add_(dv)
    return dq_acc, dk_acc, dv_acc
