"""Block tables and helpers shared by the engine tests (test_engines, test_sdpa_cuda): every table shape the
public API and the CP schedules produce, plus adversarial ones; inputs; the float64 reference; the comparison."""
import torch

from ndp_kernels import NO_LIMIT
from ndp_kernels.reference import attn_bwd_segments_ref, attn_fwd_segments_ref
from tolerances import assert_close, assert_within_lowp_bound

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
