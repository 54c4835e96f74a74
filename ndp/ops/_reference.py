"""``torch`` engine: the materialising reference (``ndp_kernels.reference``): every mask, every dtype (float64
too), soft-capping; memory grows with seq_q * seq_k. ``auto`` takes it only for a block no other engine here can
run. The interface of an engine module: see ``ndp/ops/_triton.py``.
"""
from __future__ import annotations

from ndp_kernels import reference

SOFTCAP = True


def available(device) -> tuple[bool, str]:
    return True, ""


def capable(segs, q4, k4, *, deterministic=False) -> tuple[bool, str]:
    return True, ""


def fwd(q4, k4, v4, segs, **kw):
    return reference.attn_fwd_segments_ref(q4, k4, v4, segs, **kw)


def bwd(dout4, q4, k4, v4, out4, lse3, segs, *, deterministic=False, **kw):
    return reference.attn_bwd_segments_ref(dout4, q4, k4, v4, out4, lse3, segs, **kw)
