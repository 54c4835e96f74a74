"""Block tables and helpers shared by the engine tests (test_engines, test_sdpa_cuda, test_flash_attn_engines):
every table shape the public API and the CP schedules produce, plus adversarial ones; inputs; the float64
reference; the comparison; and the float64 math of fused kernels that the stand-ins of flash-attn and of torch's
CUDA ops compute with."""
import math

import torch

from ndp_kernels import NO_LIMIT
from ndp_kernels.reference import attn_bwd_segments_ref, attn_fwd_segments_ref
from ndp.testing import assert_close, assert_within_lowp_bound

N = NO_LIMIT

# Tables of every shape the public API and the CP schedules produce, plus adversarial ones.
TABLES = {
    "full": ([(0, 40, 0, 40, -N, N)], 40, 40),
    "causal": ([(0, 40, 0, 40, -N, 0)], 40, 40),
    "causal_q_lt_k": ([(0, 17, 0, 40, -N, 23)], 17, 40),
    "causal_q_gt_k": ([(0, 40, 0, 17, -N, -23)], 40, 17),
    "striped_shift": ([(0, 33, 0, 33, -N, -1)], 33, 33),
    "zigzag_diagonal": ([(0, 16, 0, 16, -N, 0), (16, 16, 0, 32, -N, 16)], 32, 32),
    "window_both": ([(0, 45, 0, 45, -7, 3)], 45, 45),
    "window_left_only": ([(0, 45, 0, 45, -6, N)], 45, 45),
    "window_right_only": ([(0, 45, 0, 45, -N, 4)], 45, 45),
    "packed_docs": ([(0, 10, 0, 10, -N, 0), (10, 1, 10, 1, -N, 0), (11, 0, 11, 0, -N, 0), (11, 20, 11, 20, -5, 0)],
                    31, 31),
    "overlapping_keys": ([(0, 20, 0, 30, -N, N), (20, 20, 10, 30, -N, 0)], 40, 40),
    "partial_rows": ([(5, 10, 3, 12, -N, 2)], 30, 20),
    "band_shifted": ([(0, 30, 0, 50, 8, 15)], 30, 50),
    "empty_band": ([(0, 20, 0, 20, 5, 3)], 20, 20),
}


def _inputs(b, sq, sk, h, hk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return mk(b, sq, h, d), mk(b, sk, hk, d), mk(b, sk, hk, d), mk(b, sq, h, d)


def _ref(dout, q, k, v, segs, scale, upcast=True):
    q, k, v, dout = (x if not upcast else x.double() for x in (q, k, v, dout))
    out, lse = attn_fwd_segments_ref(q, k, v, segs, softmax_scale=scale, upcast=upcast)
    return (out, lse) + tuple(attn_bwd_segments_ref(dout, q, k, v, out, lse, segs, softmax_scale=scale,
                                                    upcast=upcast))


def _assert_matches(got, dtype, want, lowp=None):
    for name, a, w, lp in zip(("out", "lse", "dq", "dk", "dv"), got, want, lowp or (None,) * 5):
        kind = "out" if name in ("out", "lse") else "grad"
        fin = torch.isfinite(w)
        assert torch.equal(torch.isfinite(a), fin), f"{name}: -inf pattern differs"
        a, w = torch.where(fin, a.double(), 0), torch.where(fin, w.double(), 0)
        if name == "lse":  # as the kernel tests: the lse of rounded inputs, the dtype's tolerance
            assert_close(a, w, dtype, kind, msg=name)
            continue
        assert_close(a, w, dtype, kind, msg=name)
        if lp is not None:
            assert_within_lowp_bound(a, w, torch.where(fin, lp.double(), 0) if lp.shape == fin.shape else lp,
                                     dtype, kind)


def window_mask(sq, sk, left, right, top_left=False):
    """What a flash-style kernel call sees: row i, key j visible when -left <= j - i - shift <= right (-1: no
    limit), shift = sk - sq (bottom-right aligned, flash-attn's convention) or 0 (top_left: cuDNN/efficient)."""
    d = torch.arange(sk)[None, :] - torch.arange(sq)[:, None] - (0 if top_left else sk - sq)
    m = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        m &= d >= -left
    if right >= 0:
        m &= d <= right
    return m


def attend_fwd(q, k, v, vis, scale):
    """A fused kernel's forward in float64: q [B, S, H, D], k/v [B, S, Hk, D] (GQA), `vis` the [Sq, Sk] mask ->
    out [B, S, H, D] in q's dtype, lse [B, H, S] fp32 with +inf for a row without keys (flash's convention)."""
    g = q.shape[2] // k.shape[2]
    kk, vv = (x.double().repeat_interleave(g, 2) for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * scale
    s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vv).to(q.dtype)
    return out, lse.masked_fill(lse == -math.inf, math.inf).float()


def attend_bwd(do, q, k, v, o, lse, vis, scale):
    """A fused kernel's backward: P = exp(S - lse) from the given lse (+inf: P = 0), delta = rowsum(dO * O) from
    the given out; dk/dv summed over each kv head's query heads."""
    hk, g = k.shape[2], q.shape[2] // k.shape[2]
    kk, vv = (x.double().repeat_interleave(g, 2) for x in (k, v))
    s = (torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * scale).masked_fill(~vis, -math.inf)
    p = torch.exp(s - lse.double()[..., None])
    dod = do.double()
    delta = (dod * o.double()).sum(-1).transpose(1, 2)
    ds = p * (torch.einsum("bqhd,bkhd->bhqk", dod, vv) - delta[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kk) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.double()) * scale
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dod)
    b, sk = k.shape[:2]
    fold = lambda x: x.view(b, sk, hk, g, -1).sum(3)  # noqa: E731
    return dq.to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)


def cu_segments(cu_q, cu_k):
    """(i0, i1, j0, j1) of each document of a varlen call."""
    return [(int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])) for i in range(len(cu_q) - 1)]


def varlen_fwd(q, k, v, cu_q, cu_k, left, right, scale):
    """flash's varlen forward: q [T, H, D], k/v [T, Hk, D], each document bottom-right aligned with the window
    (left, right) -> out [T, H, D], lse [H, T] (+inf for rows without keys and rows in no document)."""
    out, lse = torch.zeros_like(q), torch.full((q.shape[1], q.shape[0]), math.inf)
    for i0, i1, j0, j1 in cu_segments(cu_q, cu_k):
        o, l_ = attend_fwd(q[None, i0:i1], k[None, j0:j1], v[None, j0:j1],
                           window_mask(i1 - i0, j1 - j0, left, right), scale)
        out[i0:i1], lse[:, i0:i1] = o[0], l_[0]
    return out, lse


def varlen_bwd(do, q, k, v, out, lse, cu_q, cu_k, left, right, scale):
    """flash's varlen backward (lse [H, T] as given) -> dq, dk, dv; 0 outside every document."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for i0, i1, j0, j1 in cu_segments(cu_q, cu_k):
        g = attend_bwd(do[None, i0:i1], q[None, i0:i1], k[None, j0:j1], v[None, j0:j1], out[None, i0:i1],
                       lse[None, :, i0:i1], window_mask(i1 - i0, j1 - j0, left, right), scale)
        dq[i0:i1], dk[j0:j1], dv[j0:j1] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv
