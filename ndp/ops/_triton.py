"""``triton`` engine: ndp's Triton kernels (``ndp_kernels``) on CUDA, or on CPU under the Triton interpreter.

An engine module exposes ``available``, ``capable``, ``fwd`` and ``bwd`` (``ndp.ops.engines.ENGINE_MODULES``);
``SOFTCAP`` says whether it soft-caps logits.
"""
from __future__ import annotations

import functools
import inspect

import torch

import ndp_kernels

SOFTCAP = True


def available(device) -> tuple[bool, str]:
    ok, why = ndp_kernels.triton_available()
    if ok and torch.device(device).type != "cuda" and not ndp_kernels.interpreter_active():
        return False, "triton kernels need a CUDA device (or TRITON_INTERPRET=1 to interpret them on CPU)"
    return ok, why


@functools.lru_cache(maxsize=None)
def _has_deterministic() -> bool:
    try:
        return "deterministic" in inspect.signature(ndp_kernels.attn_bwd_segments).parameters
    except Exception:  # triton missing: availability reports why
        return False


def capable(segs, q4, k4, *, deterministic=False) -> tuple[bool, str]:
    if q4.dtype == torch.float64:
        return False, "triton has no float64 kernels"
    why = ndp_kernels.interpreter_refuses(q4.dtype)
    if why:
        return False, why
    if deterministic and not _has_deterministic():
        return False, "this build's Triton backward has no deterministic mode"
    return True, ""


def fwd(q4, k4, v4, segs, **kw):
    return ndp_kernels.attn_fwd_segments(q4, k4, v4, segs, **kw)


def bwd(dout4, q4, k4, v4, out4, lse3, segs, *, deterministic=False, **kw):
    if deterministic:
        kw["deterministic"] = True
    return ndp_kernels.attn_bwd_segments(dout4, q4, k4, v4, out4, lse3, segs, **kw)
