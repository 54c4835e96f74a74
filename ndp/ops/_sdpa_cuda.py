"""``sdpa`` on CUDA: attention blocks on the fused kernels torch ships, through the ATen ops that take and
return the log-sum-exp.

Kernels (``KERNELS``), each with what it computes exactly:

- ``cudnn``: ``_scaled_dot_product_cudnn_attention`` and its backward. Full and top-left causal dense
  pieces (see ``_pieces.py``), fp16/bf16, head_dim % 8 == 0 and <= 128, as many K/V heads as query heads.
- ``flash``: torch's built-in FlashAttention-2, ``_flash_attention_forward`` / ``_backward`` (``[B, S, H, D]``
  like ndp, GQA without expanding K/V, bottom-right causal and sliding windows, and a varlen mode with
  cumulative sequence lengths). fp16/bf16, head_dim % 8 == 0 and <= 256, sm_80+. A block flash-attn can
  express whole (the same rule as the ``flash_attn`` engine: back-to-back bottom-right segments with one
  window) is one call, packed documents included whatever kernel ranks first; otherwise every piece is one
  call (a masked piece becomes a window).
- ``efficient``: the memory-efficient kernel, ``_efficient_attention_forward`` / ``_backward``: full and
  causal pieces in fp32 (and fp16/bf16), as many K/V heads as query heads.

Per block the engine runs the first kernel of an order that can run it: ``set_kernel_order(...)``
(``ndp.ops.set_sdpa_cuda_kernels``), else cuDNN first on Hopper and newer (torch's own default there, the
fastest measured in docs/design.md, "Facts the code relies on"), FlashAttention-2 first before it. torch's switches are obeyed: a kernel
disabled with ``torch.backends.cuda.enable_{cudnn,flash,mem_efficient}_sdp(False)`` is not used. Where the
whole block needs flash anyway, it is one flash call.

Backward, as on CPU, takes the rows' final out and lse (flash-style recomputation), so pieces and ring steps
add gradients independently; a flash call over a whole block gets lse = +inf for its rows with no key (zero
probabilities; the other kernels' pieces hold only rows that see one). The backward ops also take
the forward's RNG tensors and its lse layout (cuDNN's ``[B, H, S, 1]``, the efficient kernel's rows padded to
a multiple of 32): ndp runs each kernel's forward once per process on a tiny input and passes tensors of
exactly the layout the forward returns (dropout is 0, so the RNG values are never read).

No GPU machine of this project ran this file when it was written (see the issue notes). So that a calling
convention that differs in the installed torch can never give a silent wrong answer, each kernel is checked
once per process, dtype and head_dim against the float64 reference on small blocks before its first use
(``_sdpa_cuda.verified``; ``_sdpa_cuda.VERIFY = False`` skips it); a kernel that fails or raises is not used,
and the reason is logged and given by ``engines.capable``.
"""
from __future__ import annotations

import functools
import logging
import math

import torch

from ndp_kernels import Segments, tuning

from . import _flash_attn
from ._check import compare_to_reference
from ._pieces import (Call, Piece, as_dtype, heads_first, lse_for_flash, lse_from_flash, pieces_of, rows,
                      run_pieces_bwd, run_pieces_fwd)

log = logging.getLogger(__name__)

__all__ = ["KERNELS", "available", "set_kernel_order", "kernel_order", "plan", "verified"]

ATEN = torch.ops.aten  # the CPU tests put stand-ins with the same signatures here
KERNELS = ("cudnn", "flash", "efficient")
_ORDER: tuple | None = None   # set_kernel_order's choice; None: the default per architecture
VERIFY = True                 # check each kernel against the reference before its first use
_HALF = (torch.float16, torch.bfloat16)
_SWITCH = {"cudnn": "enable_cudnn_sdp", "flash": "enable_flash_sdp", "efficient": "enable_mem_efficient_sdp"}


def facts(device) -> dict:
    """What this torch and GPU offer: compute capability and, per kernel, whether it is built and enabled (the
    switches read on every call: a user may flip them between calls)."""
    cuda = torch.backends.cuda
    props = tuning.device_properties(device)  # queried once per device: about 20 us of host time otherwise
    cudnn, flash = _built()
    return {"capability": (props.major, props.minor), "cudnn": cudnn and cuda.cudnn_sdp_enabled(),
            "flash": flash and cuda.flash_sdp_enabled(), "efficient": cuda.mem_efficient_sdp_enabled()}


@functools.cache
def _built() -> tuple:
    """(cuDNN built, FlashAttention built) into this torch: fixed for the process."""
    return torch.backends.cudnn.is_available(), torch.backends.cuda.is_flash_attention_available()


def available(device) -> tuple[bool, str]:
    """(usable on `device`, reason when not)."""
    if not torch.cuda.is_available():
        return False, "no CUDA device is visible"
    f = facts(device)
    if not any(f[k] for k in KERNELS):
        return False, ("torch's fused attention kernels (cuDNN, flash, memory-efficient) are all disabled or not "
                       "built; enable one with torch.backends.cuda.enable_flash_sdp(True) or its siblings")
    return True, ""


def set_kernel_order(order=None) -> None:
    """Sets the kernel preference order of the sdpa engine on CUDA (e.g. ``("flash", "cudnn")``); None restores
    the default (cuDNN first on Hopper and newer, flash first before). torch's switches still apply.

    Raises:
        ValueError: an unknown kernel name (before anything changes).
    """
    global _ORDER
    if order is not None:
        order = tuple(order)
        bad = [x for x in order if x not in KERNELS]
        if bad or not order:
            raise ValueError(f"sdpa CUDA kernel order {order!r} names unknown kernels {bad}; use a non-empty "
                             f"sequence of {KERNELS}")
    _ORDER = order


def kernel_order(device, f: dict | None = None) -> tuple[str, ...]:
    """The kernel preference order: set_kernel_order's, or the default for the GPU's architecture (`f`: the
    device's ``facts`` when the caller has them)."""
    if _ORDER is not None:
        return _ORDER
    if (f or facts(device))["capability"] >= (9, 0):
        return ("cudnn", "flash", "efficient")
    return ("flash", "cudnn", "efficient")


def kernel_reason(kernel: str, f: dict, dtype, head_dim: int, heads: int, kv_heads: int, kind: str) -> str:
    """Why `kernel` cannot run a piece of `kind` (full | causal | mask | varlen) here; "" when it can."""
    if not f[kernel]:
        return (f"{kernel} is not built into this torch or is switched off "
                f"(torch.backends.cuda.{_SWITCH[kernel]}(True) turns it on)")
    cap = f["capability"]
    if kernel in ("cudnn", "flash") and cap < (8, 0):
        return f"{kernel} needs compute capability >= 8.0; this GPU has {cap[0]}.{cap[1]}"
    if kernel in ("cudnn", "flash") and dtype not in _HALF:
        return f"{kernel} runs fp16/bf16 only, not {dtype}"
    if kernel == "efficient" and dtype not in _HALF + (torch.float32,):
        return f"efficient runs fp16/bf16/fp32 only, not {dtype}"
    if head_dim % 8 or head_dim > (128 if kernel == "cudnn" else 256):
        return f"{kernel} needs head_dim % 8 == 0 and <= {128 if kernel == 'cudnn' else 256}; got {head_dim}"
    if kernel != "flash" and heads != kv_heads:
        return f"{kernel} needs as many K/V heads as query heads (got {heads} and {kv_heads}); flash does GQA"
    if kernel != "flash" and kind not in ("full", "causal"):
        return f"{kernel} runs full and top-left causal pieces only (this block needs a {kind} call)"
    return ""


# ----------------------------------------------------------------------------------------------- the kernels

def _flash_fwd(window, cu, piece, q4, k4, v4, scale):
    left, right = window
    q, k, v = rows(q4, piece.q0, piece.q1), rows(k4, piece.k0, piece.k1), rows(v4, piece.k0, piece.k1)
    if cu is None:
        res = ATEN._flash_attention_forward(q, k, v, None, None, q.shape[1], k.shape[1], 0.0, right == 0, False,
                                            scale=scale, window_size_left=left, window_size_right=right)
        out, lse = res[0], res[1]
    else:
        cu_q, cu_k, mq, mk = cu
        res = ATEN._flash_attention_forward(q[0], k[0], v[0], cu_q, cu_k, mq, mk, 0.0, right == 0, False,
                                            scale=scale, window_size_left=left, window_size_right=right)
        out, lse = res[0].unsqueeze(0), res[1].unsqueeze(0)
    return out, lse_from_flash(lse)


def _flash_bwd(window, cu, piece, do4, q4, k4, v4, o4, lse3, scale):
    left, right = window
    q, k, v = rows(q4, piece.q0, piece.q1), rows(k4, piece.k0, piece.k1), rows(v4, piece.k0, piece.k1)
    do, o = rows(do4, piece.q0, piece.q1), rows(o4, piece.q0, piece.q1)
    lse = lse_for_flash(as_dtype(rows(lse3, piece.q0, piece.q1, 2), torch.float32))
    seed, offset = _forward_layout("flash", q4.device)["rng"]
    if cu is None:
        return ATEN._flash_attention_backward(do, q, k, v, o, lse.contiguous(), None, None, q.shape[1], k.shape[1],
                                              0.0, right == 0, seed, offset, scale=scale, window_size_left=left,
                                              window_size_right=right)
    cu_q, cu_k, mq, mk = cu
    grads = ATEN._flash_attention_backward(do[0], q[0], k[0], v[0], o[0], lse[0].contiguous(), cu_q, cu_k, mq, mk,
                                           0.0, right == 0, seed, offset, scale=scale, window_size_left=left,
                                           window_size_right=right)
    return tuple(g.unsqueeze(0) for g in grads)


def _cudnn_fwd(causal, piece, q4, k4, v4, scale):
    q = heads_first(rows(q4, piece.q0, piece.q1))
    k, v = (heads_first(rows(x, piece.k0, piece.k1)) for x in (k4, v4))
    res = ATEN._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    b, h, n = q.shape[:3]
    return res[0].transpose(1, 2), res[1].reshape(b, h, n)


def _cudnn_bwd(causal, piece, do4, q4, k4, v4, o4, lse3, scale):
    q = heads_first(rows(q4, piece.q0, piece.q1))
    k, v = (heads_first(rows(x, piece.k0, piece.k1)) for x in (k4, v4))
    # cuDNN's backward wants dO with exactly O's strides: where they differ, dO is copied into O's layout.
    do, o = (heads_first(rows(x, piece.q0, piece.q1)) for x in (do4, o4))
    if do.stride() != o.stride():
        o = o.contiguous()
        do = torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device).copy_(do)
    layout = _forward_layout("cudnn", q4.device)
    lse = as_dtype(rows(lse3, piece.q0, piece.q1, 2), torch.float32).contiguous()
    if layout["lse_trailing_one"]:
        lse = lse.unsqueeze(-1)
    seed, offset = layout["rng"]
    grads = ATEN._scaled_dot_product_cudnn_attention_backward(do, q, k, v, o, lse, seed, offset, None, None, None,
                                                              q.shape[2], k.shape[2], 0.0, causal, scale=scale)
    return tuple(g.transpose(1, 2) for g in grads)


def _efficient_fwd(causal, piece, q4, k4, v4, scale):
    q, k, v = rows(q4, piece.q0, piece.q1), rows(k4, piece.k0, piece.k1), rows(v4, piece.k0, piece.k1)
    res = ATEN._efficient_attention_forward(q, k, v, None, None, None, None, None, 0.0, int(causal), True,
                                            scale=scale)
    return res[0], res[1][..., :q.shape[1]]


def _efficient_bwd(causal, piece, do4, q4, k4, v4, o4, lse3, scale):
    q, k, v = rows(q4, piece.q0, piece.q1), rows(k4, piece.k0, piece.k1), rows(v4, piece.k0, piece.k1)
    do, o = rows(do4, piece.q0, piece.q1), rows(o4, piece.q0, piece.q1)
    layout = _forward_layout("efficient", q4.device)
    n, align = q.shape[1], layout["lse_align"]
    lse = torch.full((*lse3.shape[:2], -(-n // align) * align), math.inf, dtype=torch.float32, device=q.device)
    lse[..., :n] = rows(lse3, piece.q0, piece.q1, 2)
    seed, offset = layout["rng"]
    grads = ATEN._efficient_attention_backward(do, q, k, v, None, o, None, None, n, k.shape[1], lse, 0.0, seed,
                                               offset, int(causal), False, scale=scale)
    return grads[:3]


_DENSE = {"cudnn": (_cudnn_fwd, _cudnn_bwd), "efficient": (_efficient_fwd, _efficient_bwd)}


@functools.lru_cache(maxsize=None)
def _forward_layout(kernel: str, device) -> dict:
    """What `kernel`'s forward returns besides out: its RNG tensors and lse layout, from one tiny forward
    (33 query rows: not a multiple of 32, so a padded lse shows; head_dim 64, which every kernel runs)."""
    dtype = torch.float32 if kernel == "efficient" else torch.float16
    x = torch.zeros(1, 33, 1, 64, dtype=dtype, device=device)
    if kernel == "flash":
        res = ATEN._flash_attention_forward(x, x, x, None, None, 33, 33, 0.0, False, False, scale=1.0)
        return {"rng": (res[2], res[3])}
    if kernel == "cudnn":
        xt = x.transpose(1, 2)
        res = ATEN._scaled_dot_product_cudnn_attention(xt, xt, xt, None, True, 0.0, False, False, scale=1.0)
        return {"rng": (res[6], res[7]), "lse_trailing_one": res[1].dim() == 4}
    res = ATEN._efficient_attention_forward(x, x, x, None, None, None, None, None, 0.0, 0, True, scale=1.0)
    width = res[1].shape[-1]
    if width not in (33, 64):
        raise RuntimeError(f"torch's memory-efficient attention returned an lse of {width} rows for 33 queries; "
                           f"ndp knows unpadded and 32-row padded layouts. Use backend='triton'.")
    return {"rng": (res[2], res[3]), "lse_align": 32 if width == 64 else 1}


# ---------------------------------------------------------------------------------------------- the planner

def _whole_block(segs, q4, k4):
    """(window, cu) of one flash call for the whole block, or None."""
    b, sq = q4.shape[:2]
    sk = k4.shape[1]
    rows = [r for r in segs.table.tolist() if r[1] > 0]
    if len(rows) == 1 and (rows[0][0], rows[0][1], rows[0][2], rows[0][3]) == (0, sq, 0, sk):
        window = _flash_attn.window_of(sq, sk, rows[0][4], rows[0][5])
        return None if window is None else (window, None)
    if b != 1:
        return None
    args = _flash_attn._varlen_args(q4, k4, segs)
    if args is None:
        return None
    cu_q, cu_k, mq, mk, _, window = args
    return window, (cu_q, cu_k, mq, mk)


def _piece_window(p: Piece):
    """flash's window of a piece. A mask piece always has one: its last row r1 sees keys up to k_hi, at least
    r1 + lo and at most r1 + hi, so left = k_hi - r1 - lo >= 0 and right = r1 + hi - k_hi >= 0."""
    if p.kind == "full":
        return (-1, -1)
    if p.kind == "causal":
        return (-1, 0)
    window = _flash_attn.window_of(p.rows, p.k1 - p.k0, p.lo, p.hi)
    assert window is not None, p
    return window


def plan(segs, q4, k4, *, deterministic: bool = False):
    """(calls, "") to run this block, or (None, why not). Cached on the Segments table."""
    b, sq, h, d = q4.shape
    sk, hk = k4.shape[1], k4.shape[2]
    f = facts(q4.device)
    order = kernel_order(q4.device, f)
    switches = tuple(f[k] for k in KERNELS)  # torch.backends' switches may change between calls
    key = ("sdpa_cuda", b, sq, sk, h, hk, d, q4.dtype, str(q4.device), deterministic, order, switches)
    hit = segs.memo.get(key)
    if hit is not None:
        return hit
    hit = segs.memo[key] = _plan(segs, q4, k4, order, deterministic, f)
    return hit


def _plan(segs, q4, k4, order, deterministic, f, check=True):
    h, d, hk, dtype = q4.shape[2], q4.shape[3], k4.shape[2], q4.dtype
    if deterministic:
        if not torch.are_deterministic_algorithms_enabled() or torch.is_deterministic_algorithms_warn_only_enabled():
            return None, ("torch's CUDA attention backwards are bitwise reproducible only through flash under "
                          "torch.use_deterministic_algorithms(True)")
        order = tuple(k for k in order if k == "flash")
    reasons = {}

    def usable(kernel, kind):
        why = kernel_reason(kernel, f, dtype, d, h, hk, kind)
        if not why and check:
            why = verified(kernel, dtype, d, q4.device)
        if why:
            reasons.setdefault(kernel, why)
        return not why

    pieces = pieces_of(segs, q4.shape[1], k4.shape[1])
    if not pieces:
        return (), ""  # no row sees a key: nothing to run (out 0, lse -inf)
    picks = []
    for p in pieces:
        picks.append(next((k for k in order if usable(k, p.kind)), None))
    whole = _whole_block(segs, q4, k4) if "flash" in order else None
    rank = {k: i for i, k in enumerate(order)}
    # One flash call runs a block it can express whole whenever the block is several pieces (packed documents):
    # one varlen launch instead of one call per document, where cuDNN would also build a graph per new length.
    if whole is not None and usable("flash", "varlen") and (
            len(pieces) > 1 or None in picks or "flash" in picks or rank["flash"] <= min(rank[k] for k in picks)):
        window, cu = whole
        every = Piece("full", 0, q4.shape[1], 0, k4.shape[1])
        return (Call(every, "flash", functools.partial(_flash_fwd, window, cu),
                     functools.partial(_flash_bwd, window, cu)),), ""
    if None in picks:
        detail = "; ".join(f"{k}: {w}" for k, w in reasons.items()) or f"no kernel of {order} is enabled"
        return None, f"no torch CUDA attention kernel runs this block exactly ({detail})"
    calls = []
    for p, k in zip(pieces, picks):
        if k == "flash":
            window = _piece_window(p)
            calls.append(Call(p, k, functools.partial(_flash_fwd, window, None),
                              functools.partial(_flash_bwd, window, None)))
        else:
            fwd, bwd = _DENSE[k]
            causal = p.kind == "causal"
            calls.append(Call(p, k, functools.partial(fwd, causal), functools.partial(bwd, causal)))
    return tuple(calls), ""


# ---------------------------------------------------------------------------------------------- the check

_VERIFIED: dict = {}


def _check_blocks(kernel):
    """(segments, sq, sk, heads, kv_heads, batch) of the blocks a kernel is checked on before first use."""
    if kernel == "flash":
        return [(Segments.dense(80, 80, causal=True), 80, 80, 4, 2, 2),
                (Segments.dense(48, 80, causal=False, window_size=(16, 8)), 48, 80, 4, 2, 1),
                (Segments.from_cu_seqlens([0, 30, 77], [0, 30, 77], causal=True), 77, 77, 4, 2, 1)]
    return [(Segments.dense(80, 80, causal=True), 80, 80, 4, 4, 2),
            (Segments.dense(48, 80, causal=False), 48, 80, 4, 4, 1)]


def verified(kernel: str, dtype, head_dim: int, device) -> str:
    """"" when `kernel` matched the float64 reference here (checked once per process, dtype and head_dim),
    else why it is not used."""
    if not VERIFY:
        return ""
    device = torch.device(device)
    key = (kernel, dtype, head_dim, str(device))
    if key in _VERIFIED:
        return _VERIFIED[key]
    _VERIFIED[key] = why = _check(kernel, dtype, head_dim, device)
    if why:
        log.warning("sdpa engine: torch's %s attention kernel is not used for %s head_dim %d: %s",
                    kernel, dtype, head_dim, why)
    return why


def _check(kernel, dtype, head_dim, device):
    g = torch.Generator().manual_seed(7)
    scale = head_dim ** -0.5
    f = facts(device)
    for segs, sq, sk, h, hk, b in _check_blocks(kernel):
        q, k, v, do = (torch.randn(b, n, hh, head_dim, generator=g, dtype=torch.float64).to(device, dtype)
                       for n, hh in ((sq, h), (sk, hk), (sk, hk), (sq, h)))
        calls, why = _plan(segs, q, k, (kernel,), False, f, check=False)
        if calls is None:
            return why
        try:
            out, lse = run_pieces_fwd(calls, q, k, v, scale)
            grads = run_pieces_bwd(calls, do, q, k, v, out, lse, scale)
        except Exception as e:  # a calling convention this torch does not take
            return f"it raised on a check block ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        ok, err = compare_to_reference((out, lse) + tuple(grads), q, k, v, do, segs, scale)
        if not ok:
            return f"it differs from the float64 reference on a check block (max error {err:.3e})"
    return ""
