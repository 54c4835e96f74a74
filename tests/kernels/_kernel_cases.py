"""Inputs and shape cases shared by the interpreter tests of the forward/backward (test_flash) and of the
split backward (test_bwd_split)."""
import pytest
import torch

from ndp_kernels.segments import NO_LIMIT, Segments

DTYPES = [torch.float32, torch.float16]   # the interpreter's bf16 dot is broken (docs/design.md): AOT covers bf16


def qkv(b, sq, sk, h, hk, d, dtype, seed=0, packed=False):
    """q, k, v, dout: [B, S, H, D] (or packed [T, H, D]), drawn in that order from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    shape_q = (sq, h, d) if packed else (b, sq, h, d)
    shape_k = (sk, hk, d) if packed else (b, sk, hk, d)
    return tuple(torch.randn(s, generator=g).to(dtype) for s in (shape_q, shape_k, shape_k, shape_q))


# (batch, seq_q, seq_k, heads, kv_heads, head_dim, causal, window)
CASES = [
    pytest.param(2, 97, 97, 2, 2, 64, True, (-1, -1), id="causal-97-d64"),
    pytest.param(1, 97, 97, 4, 1, 64, False, (-1, -1), id="full-mqa-97-d64"),
    pytest.param(1, 17, 97, 8, 2, 80, True, (-1, -1), id="causal-gqa4-q17-k97-d80"),
    pytest.param(1, 97, 17, 4, 2, 128, True, (-1, -1), id="causal-q97-k17-d128-nokeyrows"),
    pytest.param(1, 257, 257, 2, 1, 64, True, (-1, -1), id="causal-mqa-257-d64"),
    pytest.param(1, 1, 1, 2, 2, 64, False, (-1, -1), id="full-1-d64"),
    pytest.param(1, 1, 257, 2, 1, 128, True, (-1, -1), id="causal-q1-k257-d128"),
    pytest.param(1, 257, 257, 2, 2, 80, False, (16, 8), id="window16-8-257-d80"),
    pytest.param(1, 65, 130, 8, 2, 64, False, (20, 5), id="window20-5-gqa4-q65-k130"),
    pytest.param(2, 97, 97, 4, 2, 64, True, (32, -1), id="causal-window32-97"),
    # A band wider than a block: unmasked interior blocks between masked edges.
    pytest.param(1, 200, 257, 2, 1, 64, False, (100, 3), id="window100-3-q200-k257"),
]


def random_segments(rng, sq, sk):
    """A random segment table over [sq] x [sk] (rows in no segment, empty key ranges, windows)."""
    cuts = sorted(rng.sample(range(sq + 1), 4))
    rows = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        if rng.random() < 0.2:
            continue  # rows in no segment
        ks = rng.randint(0, sk - 1)
        kl = rng.randint(0, sk - ks)
        lo = rng.choice([-NO_LIMIT, rng.randint(-60, 30)])
        hi = rng.choice([NO_LIMIT, rng.randint(max(lo, -30), 80)])
        rows.append((a, b - a, ks, kl, lo, hi))
    return Segments.from_rows(rows or [(0, sq, 0, sk, -NO_LIMIT, NO_LIMIT)])
