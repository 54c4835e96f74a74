"""ndp_kernels: Triton flash attention with LSE, fused merge of partial states, and their references.

Public API (docs/design.md)::

    flash_attn_fwd(q, k, v, ...) -> (out, lse)         flash_attn_bwd(dout, q, k, v, out, lse, ...)
    flash_attn_func(q, k, v, ...) -> out (autograd)     merge_attn_states_(out_acc, lse_acc, blk, blk_lse)
    ce_stats(z, target) -> [4, rows]                    ce_grad_(z, target, lse, coef, row_scale, ...)

Triton is imported on first use of a kernel, so `ndp_kernels.reference` and the segment tables work
(and import fast) on machines without triton.
"""
import importlib
import os

import torch

from . import reference
from .segments import NO_LIMIT, Segments, acc_dtype

_LAZY = {
    "flash_attn_fwd": "flash", "flash_attn_bwd": "flash", "flash_attn_func": "flash",
    "attn_fwd_segments": "flash", "attn_bwd_segments": "flash",
    "merge_attn_states_": "merge",
    "tuned_table": "configs", "adopt_rows": "configs", "measure_first_use": "configs",
    "ce_stats": "cross_entropy", "ce_grad_": "cross_entropy",
}

__all__ = ["flash_attn_fwd", "flash_attn_bwd", "flash_attn_func", "merge_attn_states_", "ce_stats", "ce_grad_",
           "reference",
           "Segments", "NO_LIMIT", "acc_dtype", "interpreter_active", "interpreter_refuses", "triton_available"]


def interpreter_active() -> bool:
    """True when Triton kernels run on CPU tensors under its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreter_refuses(dtype) -> str:
    """Why the kernels cannot run `dtype` here ("" when they can): Triton's interpreter multiplies the raw bit
    patterns of bfloat16 operands in ``tl.dot`` (values ~1e10 out of [-2, 2] inputs), so every bf16 result would
    be garbage; on a GPU bf16 runs normally."""
    if dtype == torch.bfloat16 and interpreter_active():
        return ("Triton's interpreter (TRITON_INTERPRET=1) computes a bfloat16 tl.dot on the raw bit patterns, so "
                "the kernels would return garbage. Under the interpreter use float16 or float32 inputs, or another "
                "engine (ndp.ops backend='sdpa' or 'torch'); on a GPU bfloat16 runs normally")
    return ""


def triton_available() -> tuple[bool, str]:
    """(available, reason): whether triton imports here, and why not if it does not."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or a broken install raising something else
        return False, f"triton does not import: {e}"
    return True, ""


def __getattr__(name):
    if name in _LAZY:
        mod = importlib.import_module(f".{_LAZY[name]}", __name__)
        if _LAZY[name] in ("flash", "configs"):
            # With the launchers, the first-use measurement they call (it times through them: configs.use_tuner).
            importlib.import_module(".tune", __name__)
        value = getattr(mod, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ndp_kernels' has no attribute {name!r}")
