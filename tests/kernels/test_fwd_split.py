"""The forward kernel's split of key blocks into lean (unmasked) and masked edge blocks.

``_flash_fwd_kernel`` visits, per query tile, the key blocks that every valid row sees whole with the
lean step (no mask arithmetic) and only the band-edge / ragged-end blocks with the masked step. These
tests pick shapes and small tiles (``configs.override``) so that tiles mix both kinds, and compare out
and lse with ``ndp_kernels.reference``. ``_block_split`` mirrors the kernel's range arithmetic so each
test can assert that it really reaches tiles with lean and masked blocks; its invariants are checked
exhaustively on small shapes in pure Python.

fp32 and fp16 only: the interpreter's bf16 dot is broken (docs/design.md, "Facts the code relies on"); bf16 is covered by the AOT compile.
"""
import pytest
import torch

from ndp_kernels import configs, flash, reference
from ndp_kernels.segments import NO_LIMIT, Segments, band
from ndp_kernels.configs import KernelConfig
from ndp.testing import assert_close, assert_within_lowp_bound

DTYPES = [torch.float32, torch.float16]
SCALE = 0.125


def _cdiv(a, b):
    return -(-a // b)


def _block_split(m0, q_len, k_len, band_lo, band_hi, block_m, block_n):
    """(lean block starts, edge block starts) of the query tile at m0, as ``_flash_fwd_kernel`` computes them."""
    m_last = min(m0 + block_m, q_len) - 1
    n_begin = max(m0 + band_lo, 0) // block_n * block_n
    j_hi = max(min(m_last + band_hi + 1, k_len), n_begin) if m0 < q_len else n_begin
    full_lo = min(n_begin + _cdiv(max(m_last + band_lo - n_begin, 0), block_n) * block_n, j_hi)
    n_max = min(m0 + band_hi, k_len - 1) - block_n + 1
    full_hi = full_lo + ((max(n_max - full_lo, 0) // block_n + 1) * block_n if n_max >= full_lo else 0)
    full_hi = min(full_hi, j_hi)
    lean = list(range(full_lo, full_hi, block_n))
    num_lo = _cdiv(full_lo - n_begin, block_n)
    num_edge = num_lo + _cdiv(j_hi - full_hi, block_n)
    edge = [n_begin + e * block_n if e < num_lo else full_hi + (e - num_lo) * block_n for e in range(num_edge)]
    return lean, edge


def _mixed_tiles(segs, block_m, block_n):
    """Number of (segment, query tile) pairs that run both lean and masked key blocks."""
    n = 0
    for q_start, q_len, k_start, k_len, lo, hi in segs.table.tolist():
        for m0 in range(0, q_len, block_m):
            lean, edge = _block_split(m0, q_len, k_len, lo, hi, block_m, block_n)
            n += bool(lean) and bool(edge)
    return n


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16), (16, 32), (64, 32)])
def test_block_split_invariants(block_m, block_n):
    # Pure Python: lean blocks are fully visible to every valid row and inside k_len; lean + edge
    # blocks are disjoint, on the block grid, and cover every visible (row, key) pair of the tile.
    bands = [(-NO_LIMIT, NO_LIMIT), (-NO_LIMIT, 0), (-NO_LIMIT, -1), (-NO_LIMIT, 7), (-5, 0), (-40, 3),
             (-3, 3), (0, 0), (2, 30), (-NO_LIMIT, -35), (10, NO_LIMIT), (-17, -1)]
    for q_len in (1, 5, 16, 33, 70):
        for k_len in (0, 1, 7, 32, 45, 90):
            for lo, hi in bands + [band(q_len, k_len, True), band(q_len, k_len, False, (9, 2))]:
                for m0 in range(0, q_len + block_m, block_m):
                    lean, edge = _block_split(m0, q_len, k_len, lo, hi, block_m, block_n)
                    rows = range(m0, min(m0 + block_m, q_len))
                    assert not set(lean) & set(edge) and len(set(edge)) == len(edge)
                    for n in lean + edge:
                        assert n >= 0 and n % block_n == 0 and n < max(k_len, 1)
                    for n in lean:
                        assert n + block_n <= k_len
                        assert all(lo <= j - i <= hi for i in rows for j in range(n, n + block_n))
                    seen = {j // block_n * block_n for i in rows for j in range(k_len) if lo <= j - i <= hi}
                    assert seen <= set(lean) | set(edge), (q_len, k_len, lo, hi, m0)


def _check_fwd(q, k, v, dtype, segs, accumulate=False, seed=0):
    """attn_fwd_segments vs the fp32 reference (out, lse), optionally through the fp32 accumulators."""
    qf, kf, vf = q.float(), k.float(), v.float()
    if accumulate:
        g = torch.Generator().manual_seed(seed)
        b, sq, h, _ = q.shape
        out_acc = torch.randn(q.shape, generator=g)
        lse_acc = torch.randn((b, h, sq), generator=g)
        lse_acc[..., ::3] = float("-inf")  # rows with no earlier block: out_acc ignored where lse is -inf
        out_acc[:, ::3] = 0.0
        ref_out, ref_lse = out_acc.clone(), lse_acc.clone()
        reference.attn_fwd_segments_ref(qf, kf, vf, segs, softmax_scale=SCALE, out_acc=ref_out, lse_acc=ref_lse)
        out, lse = flash.attn_fwd_segments(q, k, v, segs, softmax_scale=SCALE, out_acc=out_acc, lse_acc=lse_acc)
        assert out is out_acc and lse is lse_acc
    else:
        ref_out, ref_lse = reference.attn_fwd_segments_ref(qf, kf, vf, segs, softmax_scale=SCALE)
        out, lse = flash.attn_fwd_segments(q, k, v, segs, softmax_scale=SCALE)
        assert out.dtype == dtype
    assert not torch.isnan(out.float()).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "rows without keys differ"
    assert_close(out, ref_out, dtype, "out", msg=f"out {segs}")
    fin = torch.isfinite(ref_lse)
    assert_close(lse[fin], ref_lse[fin], dtype, "out", msg=f"lse {segs}")
    if dtype != torch.float32 and not accumulate:
        low = reference.attn_fwd_segments_ref(q, k, v, segs, softmax_scale=SCALE, upcast=False)[0]
        assert_within_lowp_bound(out, ref_out, low, dtype, "out")


def _qkv(b, sq, sk, h, hk, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(s, generator=g).to(dtype) for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d)))


# (seq_q, seq_k, (causal, window), tile, whether some tile mixes lean and masked blocks). A band
# narrower than BLOCK_M + BLOCK_N - 1 keys has no lean block at all: every block is an edge.
DENSE = [
    pytest.param(45, 83, (True, (-1, -1)), (16, 16), True, id="causal-q45-k83"),
    pytest.param(83, 45, (True, (-1, -1)), (32, 16), True, id="causal-q83-k45-nokeyrows"),
    pytest.param(77, 77, (True, (-1, -1)), (32, 16), True, id="causal-77"),
    pytest.param(61, 99, (False, (-1, -1)), (16, 32), True, id="full-q61-k99-raggedend"),
    pytest.param(70, 90, (False, (5, 2)), (32, 16), False, id="window5-2-narrower-than-tile"),
    pytest.param(70, 90, (True, (40, -1)), (16, 16), True, id="causal-window40-wider-than-tile"),
    pytest.param(66, 66, (False, (50, 20)), (16, 16), True, id="window50-20-both-edges"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("sq,sk,mask,tile,mixed", DENSE)
def test_fwd_split_dense(sq, sk, mask, tile, mixed, dtype):
    causal, window = mask
    segs = Segments.dense(sq, sk, causal=causal, window_size=window)
    assert (_mixed_tiles(segs, *tile) > 0) == mixed
    q, k, v = _qkv(2, sq, sk, 4, 2, 64, dtype, seed=sq + sk)
    with configs.override("fwd", KernelConfig(*tile, 4, 1)):
        _check_fwd(q, k, v, dtype, segs)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_fwd_split_packed_boundaries_inside_tiles(dtype, causal):
    # Document boundaries at 5, 40, 41 and 90 fall inside 16/32-row tiles; one empty document.
    cu = [0, 5, 40, 41, 41, 90, 121]
    segs = Segments.from_cu_seqlens(torch.tensor(cu, dtype=torch.int32), torch.tensor(cu, dtype=torch.int32),
                                    causal=causal)
    assert _mixed_tiles(segs, 32, 16) > 0
    q, k, v = _qkv(1, 121, 121, 2, 1, 64, dtype, seed=3)
    with configs.override("fwd", KernelConfig(32, 16, 4, 1)):
        _check_fwd(q, k, v, dtype, segs)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_fwd_split_striped_band_hi_minus_one(dtype):
    # Striped CP blocks: a rank's queries against an earlier rank's keys see keys j <= i - 1
    # (band_hi = -1), so the first query row sees nothing; plus a shifted band and a window.
    segs = Segments.from_rows([(0, 50, 0, 50, -NO_LIMIT, -1), (50, 30, 10, 60, -NO_LIMIT, 13),
                               (80, 20, 0, 70, -25, -1)])
    assert _mixed_tiles(segs, 16, 16) > 0
    q, k, v = _qkv(2, 100, 70, 4, 4, 64, dtype, seed=4)
    with configs.override("fwd", KernelConfig(16, 16, 4, 1)):
        _check_fwd(q, k, v, dtype, segs)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("tile", [(16, 16), (32, 16)], ids=["M16N16", "M32N16"])
def test_fwd_split_accumulate(dtype, tile):
    # The fused fp32 merge epilogue behind lean and masked blocks: causal chunk, window and overlapping
    # keys, into accumulators with finite and -inf rows.
    segs = Segments.from_rows([(0, 40, 0, 70, -NO_LIMIT, 30), (40, 35, 20, 50, -20, 8), (75, 5, 0, 3, 0, 0)])
    assert _mixed_tiles(segs, *tile) > 0
    q, k, v = _qkv(1, 80, 70, 4, 2, 64, dtype, seed=5)
    with configs.override("fwd", KernelConfig(*tile, 4, 1)):
        _check_fwd(q, k, v, dtype, segs, accumulate=True, seed=6)


def test_fwd_split_head_dim_not_power_of_two():
    # Lean steps with padded head-dim columns (EVEN_D false) next to masked ones.
    segs = Segments.dense(50, 70, causal=True)
    assert _mixed_tiles(segs, 16, 16) > 0
    q, k, v = _qkv(1, 50, 70, 2, 1, 80, torch.float32, seed=7)
    with configs.override("fwd", KernelConfig(16, 16, 4, 1)):
        _check_fwd(q, k, v, torch.float32, segs)
