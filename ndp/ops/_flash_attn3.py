"""``flash_attn3`` engine: FlashAttention-3 on Hopper (``flash_attn_interface``), the blocks of ``_flash_attn``'s
rules run through its version-3 entry points. The interface of an engine module: see ``ndp/ops/_triton.py``.
"""
from __future__ import annotations

import functools

import torch

from . import _flash_attn

SOFTCAP = False


def available(device) -> tuple[bool, str]:
    if torch.device(device).type != "cuda":
        return False, "FlashAttention-3 needs a CUDA device"
    return _flash_attn.available3()


capable = _flash_attn.capable
fwd = functools.partial(_flash_attn.fwd, version=3)
bwd = functools.partial(_flash_attn.bwd, version=3)
