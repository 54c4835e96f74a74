"""flash-attn engines: FlashAttention-2 (``flash_attn``) and, on Hopper, FlashAttention-3 (``flash_attn3``,
the ``flash_attn_interface`` module that flash-attention's hopper/ directory builds). GPU only; no machine of
this project has a GPU, so the CPU tests reach this file through a stand-in module with FA3's signatures
(tests/ops/test_flash_attn_engines.py) and the real libraries are tested where they are installed.

Kept deliberately small: segment tables that flash-attn's varlen API can express (query and key ranges laid
out back to back from row 0, every segment bottom-right aligned with one shared (causal, window)) run on
flash-attn; ``engines.capable`` refuses anything else, so ``auto`` sends those blocks to another engine and a
forced ``backend="flash_attn"`` gets a clear error. The block runs as one call of the pieces runner
(``_pieces``), whose merge emulates the fused accumulator, since flash-attn has no accumulator epilogue. Both
versions' private entry points changed signature between releases: arguments are passed by name, filled from
the signature in use.
"""
from __future__ import annotations

import functools
import inspect
import logging

import torch

from ndp_kernels import NO_LIMIT

from ._pieces import Call, Piece, lse_for_flash, lse_from_flash, run_pieces_bwd, run_pieces_fwd

log = logging.getLogger(__name__)


SOFTCAP = False


def available(device=None) -> tuple[bool, str]:
    """(usable, reason when not) for FlashAttention-2 on `device` (None: this machine's GPU)."""
    if device is not None and torch.device(device).type != "cuda":
        return False, "flash-attn needs a CUDA device"
    try:
        import flash_attn  # noqa: F401
    except Exception as e:
        return False, f"flash-attn does not import ({e}); install it with `pip install ndp[flash]` on a CUDA machine"
    if not torch.cuda.is_available():
        return False, "flash-attn needs a CUDA device"
    cap = torch.cuda.get_device_capability()
    if cap < (8, 0):
        # flash-attn 2 kernels are built for Ampere (sm_80) and newer only.
        return False, f"flash-attn 2 needs compute capability >= 8.0; this GPU has {cap[0]}.{cap[1]}"
    return True, ""


def available3() -> tuple[bool, str]:
    try:
        import flash_attn_interface  # noqa: F401
    except Exception as e:
        return False, (f"FlashAttention-3 (flash_attn_interface) does not import ({e}); build it from "
                       f"flash-attention's hopper/ directory on a Hopper machine")
    if not torch.cuda.is_available():
        return False, "FlashAttention-3 needs a CUDA device"
    cap = torch.cuda.get_device_capability()
    if cap[0] != 9:
        return False, f"FlashAttention-3 runs on Hopper (compute capability 9.x); this GPU has {cap[0]}.{cap[1]}"
    return True, ""


def capable(segs, q4, k4, *, deterministic=False) -> tuple[bool, str]:
    """Whether flash-attn (2 or 3) computes this block exactly (assumes it is available)."""
    if q4.dtype == torch.float64:
        return False, "flash-attn has no float64 kernels"
    if _varlen_args(q4, k4, segs) is None:
        return False, ("flash-attn's varlen API cannot express this block (it needs fp16/bf16, head_dim % 8 == 0 "
                       "and back-to-back bottom-right aligned segments with one shared window)")
    return True, ""


def window_of(ql: int, kl: int, lo: int, hi: int):
    """flash-attn's bottom-right (left, right) window (-1: unlimited) of a segment of ql query and kl key rows
    with the band lo <= j - i <= hi, or None when it has none."""
    d = kl - ql
    left = -1 if lo <= -NO_LIMIT else d - lo
    right = -1 if hi >= NO_LIMIT else hi - d
    # A finite bound that maps to a negative window (e.g. the striped ring's band_hi = -1 with d = 0) is not
    # expressible: flash-attn would read -1 as "unlimited".
    if (lo > -NO_LIMIT and left < 0) or (hi < NO_LIMIT and right < 0):
        return None
    return left, right


def _varlen_args(q4, k4, segs):
    """(cu_q, cu_k, max_q, max_k, causal, (left, right)) when segs is flash-attn expressible, else None. Kept on
    the segment table: every layer's forward and backward of a step reuse the device copies of cu_seqlens."""
    key = ("varlen_args", str(q4.device), q4.dtype, q4.shape[0], q4.shape[1], q4.shape[-1], k4.shape[1])
    if key not in segs.memo:
        segs.memo[key] = _build_varlen_args(q4, k4, segs)
    return segs.memo[key]


def _build_varlen_args(q4, k4, segs):
    # Only packed-style calls ([1, T, H, D]) map onto the varlen API; others use the Triton kernels.
    # flash-attn's private backward needs head_dim % 8 == 0 (only its public forward pads), so other
    # head dims take the Triton kernels in both directions.
    if q4.dtype not in (torch.float16, torch.bfloat16) or q4.shape[0] != 1 or q4.shape[-1] % 8:
        return None
    rows = segs.table.tolist()
    cu_q, cu_k, mode = [0], [0], None
    for qs, ql, ks, kl, lo, hi in rows:
        if qs != cu_q[-1] or ks != cu_k[-1]:
            return None
        window = window_of(ql, kl, lo, hi)
        if window is None or (mode is not None and mode != window):
            return None
        left, right = window
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


def _calls(q4, k4, segs, version, deterministic=False):
    """The block as one call of the pieces runner (``_pieces.run_pieces_fwd/run_pieces_bwd``: it merges into the fp32
    accumulators); its rows may see no key (``lse_for_flash``)."""
    args = _varlen_args(q4, k4, segs)
    assert args is not None, "engines.capable admits only flash-attn expressible blocks"
    every = Piece("full", 0, q4.shape[1], 0, k4.shape[1])
    return (Call(every, f"flash_attn{version}", functools.partial(_fwd, args, version),
                 functools.partial(_bwd, args, version, deterministic)),)


def _fwd(args, version, piece, q4, k4, v4, softmax_scale):
    cu_q, cu_k, mq, mk, causal, (left, right) = args
    if version == 3:
        from flash_attn_interface import _flash_attn_forward as fn
        res = _call(fn, "flash_attn_interface._flash_attn_forward", q=_flat(q4), k=_flat(k4), v=_flat(v4),
                    cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq, max_seqlen_k=mk,
                    softmax_scale=softmax_scale, causal=causal, window=(left, right))
        out, lse = res[0], res[1]
    else:
        from flash_attn import flash_attn_varlen_func
        out, lse, _ = flash_attn_varlen_func(_flat(q4), _flat(k4), _flat(v4), cu_q, cu_k, mq, mk,
                                             softmax_scale=softmax_scale, causal=causal,
                                             window_size=(left, right), return_attn_probs=True)
    return out.unsqueeze(0), lse_from_flash(lse).unsqueeze(0)  # [1, T, H, D], [1, H, T]


def _bwd(args, version, deterministic, piece, dout4, q4, k4, v4, out4, lse3, softmax_scale):
    cu_q, cu_k, mq, mk, causal, window = args
    dq, dk, dv = (torch.empty_like(_flat(x)) for x in (q4, k4, v4))
    if version == 3:
        from flash_attn_interface import _flash_attn_backward as fn
        name = "flash_attn_interface._flash_attn_backward"
    else:
        from flash_attn.flash_attn_interface import _flash_attn_varlen_backward as fn
        name = "flash_attn.flash_attn_interface._flash_attn_varlen_backward"
    _call(fn, name, dout=_flat(dout4), q=_flat(q4), k=_flat(k4), v=_flat(v4), out=_flat(out4),
          softmax_lse=lse_for_flash(lse3[0]).contiguous(), dq=dq, dk=dk, dv=dv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
          max_seqlen_q=mq, max_seqlen_k=mk, softmax_scale=softmax_scale, causal=causal, window=window,
          deterministic=deterministic)
    return dq.unsqueeze(0), dk.unsqueeze(0), dv.unsqueeze(0)


def fwd(q4, k4, v4, segs, *, softmax_scale, out_acc=None, lse_acc=None, version=2):
    """One block's forward on FlashAttention-``version`` (2 or 3); out [1, T, H, D], lse [1, H, T]."""
    return run_pieces_fwd(_calls(q4, k4, segs, version), q4, k4, v4, softmax_scale, out_acc, lse_acc)


def bwd(dout4, q4, k4, v4, out4, lse3, segs, *, softmax_scale, dq_acc=None, dk_acc=None, dv_acc=None,
        deterministic=False, version=2):
    """One block's backward on FlashAttention-``version`` (2 or 3), given the rows' final out and lse."""
    return run_pieces_bwd(_calls(q4, k4, segs, version, deterministic), dout4, q4, k4, v4, out4, lse3,
                          softmax_scale, dq_acc, dk_acc, dv_acc)


def _call(fn, name, *, window, causal, deterministic=None, **kwargs):
    """Call a flash-attn entry point with keywords filled from its signature (which changed between releases:
    ``window_size=(l, r)`` or ``window_size_left``/``_right``, ``causal`` or ``is_causal``; custom ops expose
    their Python signature as ``_init_fn``). Keywords it does not take are dropped; a required one that ndp
    cannot fill raises, naming the versions ndp supports."""
    params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
    if "window_size_left" in params and "window_size_right" in params:
        kwargs.update(window_size_left=window[0], window_size_right=window[1])
    elif "window_size" in params:
        kwargs["window_size"] = window
    kwargs["is_causal" if "is_causal" in params else "causal"] = causal
    kwargs.update(softcap=0.0, alibi_slopes=None, rng_state=None, dropout_p=0.0)
    if deterministic is not None:
        kwargs["deterministic"] = bool(deterministic)
    kwargs = {k: v for k, v in kwargs.items() if k in params}
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in kwargs]
    if missing or not any(n.startswith("window_size") for n in kwargs):
        raise RuntimeError(
            f"{name} has a signature ndp cannot fill ({missing or ['window_size']} missing); ndp supports "
            f"flash-attn 2.6-2.8 and FlashAttention-3 with window_size_left/right. Install one of those or use "
            f"backend='triton'.")
    return fn(**kwargs)
