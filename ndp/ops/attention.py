"""Local (one-device) attention backends behind one interface.

Backends: ``torch`` (plain PyTorch, ``ndp_kernels.reference``: the reference and the CPU path),
``triton`` (``ndp_kernels`` kernels; on CPU only under the Triton interpreter), ``flash_attn``
(flash-attn's CUDA kernels when importable). ``auto`` picks flash_attn, then triton on CUDA, and torch
on CPU. Every backend keeps the same conventions, including the fp32 accumulators of ring steps.
"""
from __future__ import annotations

import torch

import ndp_kernels
from ndp_kernels import reference
from ndp_kernels._segments import prepare, run_bwd

from . import _flash_attn

BACKENDS = ("auto", "triton", "flash_attn", "torch")


def available_backends(device="cpu") -> dict[str, tuple[bool, str]]:
    """Map backend name -> (usable on `device`, reason when not)."""
    device = torch.device(device)
    ok, why = ndp_kernels.triton_available()
    if ok and device.type != "cuda" and not ndp_kernels.interpreter_active():
        ok, why = False, "triton kernels need a CUDA device (or TRITON_INTERPRET=1 to interpret them on CPU)"
    fa = _flash_attn.available() if device.type == "cuda" else (False, "flash-attn needs a CUDA device")
    return {"torch": (True, ""), "triton": (ok, why), "flash_attn": fa}


def resolve_backend(backend: str, device) -> str:
    """Turn ``backend`` ("auto" | "triton" | "flash_attn" | "torch") into a usable backend for ``device``.

    Raises:
        ValueError: unknown name.  RuntimeError: the backend cannot run here (the message says why).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    device = torch.device(device)
    if backend == "auto":
        if device.type != "cuda":
            return "torch"
        avail = available_backends(device)
        return "flash_attn" if avail["flash_attn"][0] else "triton"
    ok, why = available_backends(device)[backend]
    if not ok:
        raise RuntimeError(f"attention backend {backend!r} is not available on {device}: {why}. "
                           f"Use backend='auto' or 'torch'.")
    return backend


def _triton_fwd(*args, **kwargs):
    return ndp_kernels.attn_fwd_segments(*args, **kwargs)


def _triton_bwd(*args, **kwargs):
    return ndp_kernels.attn_bwd_segments(*args, **kwargs)


def _check_triton_dtype(dtype, backend):
    if backend in ("triton", "flash_attn") and dtype == torch.float64:
        raise TypeError(f"backend {backend!r} has no float64 kernels; use backend='torch' for float64")


def attention_fwd(q4, k4, v4, segs, *, softmax_scale, out_acc=None, lse_acc=None, backend="auto"):
    """Segment-level forward of one block (what a ring step calls).

    Args:
        q4: ``[B, Sq, H, D]``; k4, v4: ``[B, Sk, Hkv, D]``; segs: ``ndp_kernels.Segments``.
        out_acc: optional fp32 ``[B, Sq, H, D]``; lse_acc: optional fp32 ``[B, H, Sq]``; merged into in place.
    Returns:
        (out, lse) or (out_acc, lse_acc).
    Raises:
        ValueError / RuntimeError for an unknown or unavailable backend.
    """
    be = resolve_backend(backend, q4.device)
    _check_triton_dtype(q4.dtype, be)
    if be == "torch":
        return reference.attn_fwd_segments_ref(q4, k4, v4, segs, softmax_scale=softmax_scale, out_acc=out_acc,
                                               lse_acc=lse_acc)
    if be == "triton":
        return _triton_fwd(q4, k4, v4, segs, softmax_scale=softmax_scale, out_acc=out_acc, lse_acc=lse_acc)
    return _flash_attn.fwd(q4, k4, v4, segs, softmax_scale=softmax_scale, out_acc=out_acc, lse_acc=lse_acc,
                           fallback=_triton_fwd)


def attention_bwd(dout4, q4, k4, v4, out4, lse3, segs, *, softmax_scale, dq_acc=None, dk_acc=None, dv_acc=None,
                  backend="auto"):
    """Segment-level backward of one block, given the rows' final out and lse.

    Returns:
        (dq, dk, dv), or the fp32 accumulators with this block's gradients added.
    """
    be = resolve_backend(backend, q4.device)
    _check_triton_dtype(q4.dtype, be)
    kw = dict(softmax_scale=softmax_scale, dq_acc=dq_acc, dk_acc=dk_acc, dv_acc=dv_acc)
    if be == "torch":
        return reference.attn_bwd_segments_ref(dout4, q4, k4, v4, out4, lse3, segs, **kw)
    if be == "triton":
        return _triton_bwd(dout4, q4, k4, v4, out4, lse3, segs, **kw)
    return _flash_attn.bwd(dout4, q4, k4, v4, out4, lse3, segs, fallback=_triton_bwd, **kw)


class _AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, segs, scale, packed, backend):
        q4, k4, v4 = (x.unsqueeze(0) if packed else x for x in (q, k, v))
        out, lse = attention_fwd(q4, k4, v4, segs, softmax_scale=scale, backend=backend)
        ctx.save_for_backward(q4, k4, v4, out, lse)
        ctx.segs, ctx.scale, ctx.packed, ctx.backend = segs, scale, packed, backend
        ctx.mark_non_differentiable(lse)
        return (out[0], lse[0]) if packed else (out, lse)

    @staticmethod
    def backward(ctx, dout, _dlse):
        q4, k4, v4, out, lse = ctx.saved_tensors
        dout4 = dout.unsqueeze(0) if ctx.packed else dout
        dq, dk, dv = attention_bwd(dout4.contiguous(), q4, k4, v4, out, lse, ctx.segs, softmax_scale=ctx.scale,
                                   backend=ctx.backend)
        if ctx.packed:
            dq, dk, dv = dq[0], dk[0], dv[0]
        return dq, dk, dv, None, None, None, None


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), cu_seqlens_q=None,
              cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, backend="auto", return_lse=False):
    """Attention on one device, differentiable with respect to q, k and v.

    Args:
        q: ``[batch, seq_q, heads, head_dim]`` (packed: ``[total_tokens, heads, head_dim]`` with cu_seqlens).
        k, v: ``[batch, seq_k, kv_heads, head_dim]`` with ``heads % kv_heads == 0``.
        causal: bottom-right aligned causal mask.  window_size: (left, right), -1 = unlimited.
        cu_seqlens_q / cu_seqlens_k: int32 ``[num_seqs + 1]`` for packed documents.
        backend: "auto" | "triton" | "flash_attn" | "torch".
        return_lse: also return the fp32 lse (``[batch, heads, seq_q]`` or ``[heads, total_tokens]``).
    Returns:
        out in q's dtype and shape (and lse when asked).
    Raises:
        ValueError / TypeError for malformed input, RuntimeError for an unavailable backend.
    """
    q4, k4, v4, segs, scale, packed = prepare(
        q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    resolve_backend(backend, q.device)
    out, lse = _AttentionFunction.apply(q, k, v, segs, scale, packed, backend)
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out, lse, **kwargs):
    """Public-signature backward (same keywords as ``flash_attn_bwd`` plus ``backend``)."""
    backend = kwargs.pop("backend", "auto")
    return run_bwd(lambda *a, **kw: attention_bwd(*a, backend=backend, **kw), dout, q, k, v, out, lse, **kwargs)
