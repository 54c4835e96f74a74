"""One correctness check of an engine's forward+backward against the float64 reference, used where ndp decides
whether to trust an engine on this machine: ``python -m ndp.ops.tune`` (before timing it) and the first use of a
torch CUDA attention kernel by the ``sdpa`` engine (``_sdpa_cuda``)."""
from __future__ import annotations

import torch

from ndp_kernels.reference import attn_bwd_segments_ref, attn_fwd_segments_ref

__all__ = ["ATOL", "compare_to_reference"]

# atol of the check per dtype (out and grads); the error must also stay within twice the error of the
# reference computed in the dtype itself (docs/design.md, "Facts the code relies on").
ATOL = {torch.float64: 1e-7, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def compare_to_reference(got, q, k, v, dout, segs, scale) -> tuple[bool, float]:
    """(within tolerance, worst abs error) of ``got = (out, lse, dq, dk, dv)`` for inputs q, k, v, dout.

    A result whose finite entries sit where the reference's are not (NaN, or a -inf lse on a row with keys)
    fails with an infinite error."""
    dtype = q.dtype
    q64, k64, v64, do64 = (x.double().cpu() for x in (q, k, v, dout))
    o, lse = attn_fwd_segments_ref(q64, k64, v64, segs, softmax_scale=scale)
    want = (o, lse) + tuple(attn_bwd_segments_ref(do64, q64, k64, v64, o, lse, segs, softmax_scale=scale))
    lo, llse = attn_fwd_segments_ref(q64.to(dtype), k64.to(dtype), v64.to(dtype), segs, softmax_scale=scale,
                                     upcast=False)
    lowp = (lo, llse) + tuple(attn_bwd_segments_ref(do64.to(dtype), q64.to(dtype), k64.to(dtype), v64.to(dtype),
                                                    lo, llse, segs, softmax_scale=scale, upcast=False))
    worst, ok = 0.0, True
    for a, w, lp in zip(got, want, lowp):
        a, w, lp = (x.double().cpu() for x in (a, w, lp))
        fin = torch.isfinite(w)
        if not torch.equal(torch.isfinite(a), fin):
            return False, float("inf")
        err = (a[fin] - w[fin]).abs().max().item() if fin.any() else 0.0
        base = (lp[fin] - w[fin]).abs().max().item() if fin.any() else 0.0
        worst = max(worst, err)
        ok &= err <= 2 * base + ATOL[dtype]
    return ok, worst
