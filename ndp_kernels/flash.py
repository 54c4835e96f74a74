"""Triton flash attention with LSE over a segment table (forward, backward, autograd wrapper).

Masking model (SPEC, ``ndp_kernels.segments``): a segment row ``(q_start, q_len, k_start,
k_len, band_lo, band_hi)`` lets query row ``q_start + i`` see key row ``k_start + j`` iff
``band_lo <= j - i <= band_hi``. Dense, causal (bottom-right), sliding windows, packed
documents and the context-parallel blocks are all tables of such rows; the kernels only
ever read the table, and skip key (or query) blocks that lie outside a segment's band. Key (or
query) blocks that a tile sees whole run a lean step without mask arithmetic; only the blocks on a
band edge or the ragged end run the masked step (forward, split backward).

Backward: ``_flash_bwd_kernel`` (one program per key block, dq by fp32 atomics) or the atomic-free
split pair ``_flash_bwd_dkdv_kernel`` + ``_flash_bwd_dq_kernel`` (bitwise reproducible; always used
for ``deterministic=True``); ``configs.bwd_impl`` chooses per arch and head_dim.

Numerics: fp32 accumulation for every dtype (fp16/bf16 dots on tensor cores, fp32 inputs with
IEEE-precision dots, no TF32), exp2-based online softmax; the returned lse is in natural log.
A row that sees no key gives ``out = 0``, ``lse = -inf`` and zero gradients, never NaN.

Launch configurations (tiles, warps, stages) come from ``ndp_kernels.configs`` per arch and
head_dim; ``python -m ndp_kernels.aot`` compiles all of them for sm_80/sm_90 and checks them.
"""
from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from . import interpreter_active, interpreter_refuses, segments
from .configs import (block_d, bwd_config, bwd_dkdv_config, bwd_dq_config, bwd_impl, current_arch,
                      fwd_config, head_splits, launch_device, measure_ahead, merge_config, tma_applies,
                      tma_here, with_softcap)
from .merge import _merge_lse, _merge_weights

__all__ = ["attn_fwd_segments", "attn_bwd_segments", "flash_attn_fwd", "flash_attn_bwd",
           "flash_attn_func", "FlashAttnFunction"]

logger = logging.getLogger(__name__)

LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _tile_program(seg_ptr, num_segments):
    """Decode the program id ``(tile, b * num_segments + seg, head)`` and read row ``seg`` of the table.

    Returns (tile, head, b, q_start, q_len, k_start, k_len, band_lo, band_hi): program ids 0 and 2 (a
    query or key tile; a query or kv head), the batch index ``b`` in int64 (it scales batch strides),
    and row ``seg`` of the int32 segment table.
    """
    pid_0 = tl.program_id(0)
    pid_bs = tl.program_id(1)
    pid_2 = tl.program_id(2)
    b = (pid_bs // num_segments).to(tl.int64)
    row_ptr = seg_ptr + (pid_bs % num_segments) * 6
    return (pid_0, pid_2, b, tl.load(row_ptr + 0), tl.load(row_ptr + 1), tl.load(row_ptr + 2),
            tl.load(row_ptr + 3), tl.load(row_ptr + 4), tl.load(row_ptr + 5))


@triton.jit
def _key_blocks(m0, q_len, k_len, band_lo, band_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key blocks of the query tile [m0, m0 + BLOCK_M): (n_begin, full_lo, full_hi, num_lo_edge, num_edge).

    The key range [n_begin, j_hi) is seen by at least one row of the tile (empty for a tile past
    q_len); n_begin is on the block grid. Key blocks [full_lo, full_hi) are seen whole by every valid
    row of the tile (the lean step): first key >= m_last + band_lo, last key <= m0 + band_hi and
    < k_len. Rows past q_len need no mask (zero-filled inputs, finite scores or P = 0, never stored),
    so the ragged query end is not an edge. The edge blocks (masked step) are the ``num_lo_edge``
    blocks from n_begin (lower band edge), then the ones from full_hi to j_hi (upper band edge,
    ragged key end): ``num_edge`` in all. A tile without rows has no blocks.
    """
    m_last = tl.minimum(m0 + BLOCK_M, q_len) - 1
    j_lo = tl.maximum(m0 + band_lo, 0)
    n_begin = (j_lo // BLOCK_N) * BLOCK_N
    j_hi = tl.minimum(m_last + band_hi + 1, k_len)
    j_hi = tl.where(m0 < q_len, tl.maximum(j_hi, n_begin), n_begin)
    full_lo = n_begin + tl.cdiv(tl.maximum(m_last + band_lo - n_begin, 0), BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(full_lo, j_hi)
    n_max = tl.minimum(m0 + band_hi, k_len - 1) - BLOCK_N + 1  # last start of a full block
    full_hi = tl.where(n_max >= full_lo,
                       full_lo + (tl.maximum(n_max - full_lo, 0) // BLOCK_N + 1) * BLOCK_N, full_lo)
    full_hi = tl.minimum(full_hi, j_hi)
    num_lo_edge = tl.cdiv(full_lo - n_begin, BLOCK_N)  # full_lo may be j_hi, off the block grid
    num_edge = num_lo_edge + tl.cdiv(j_hi - full_hi, BLOCK_N)
    return n_begin, full_lo, full_hi, num_lo_edge, num_edge


@triton.jit
def _query_range(n0, q_len, k_len, band_lo, band_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query rows of the key tile [n0, n0 + BLOCK_N): returns (n_last, i_lo, i_hi, m_begin).

    Rows [i_lo, i_hi) see at least one key of the tile, whose last key below k_len is n_last; the
    query blocks of BLOCK_M rows start at m_begin, the block of i_lo. i_hi is not clipped for a tile
    past k_len (n0 >= k_len): the caller does that.
    """
    n_last = tl.minimum(n0 + BLOCK_N, k_len) - 1
    i_lo = tl.maximum(n0 - band_hi, 0)
    i_hi = tl.minimum(n_last - band_lo + 1, q_len)
    m_begin = (i_lo // BLOCK_M) * BLOCK_M
    return n_last, i_lo, i_hi, m_begin


@triton.jit
def _group_part(pid_h, group_size, HEAD_SPLITS: tl.constexpr):
    """(kv head, first query head, query heads) of program id ``pid_h = hk * HEAD_SPLITS + part`` in the
    backward kernels that own a key block: part ``part`` of the HEAD_SPLITS equal parts of kv head hk's GQA
    group. HEAD_SPLITS == 1 folds this to (pid_h, pid_h * group_size, group_size)."""
    hk = pid_h // HEAD_SPLITS
    heads = group_size // HEAD_SPLITS
    return hk, hk * group_size + (pid_h % HEAD_SPLITS) * heads, heads


@triton.jit
def _kv_bases(k_ptr, v_ptr, b, k_start, hk, stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h,
              USE_TMA: tl.constexpr):
    """(k_base, v_base, kv_coord) of a segment's K/V for the kernels that walk key blocks: pointers to its first
    key row of kv head ``hk``, or with USE_TMA the tensor descriptors themselves (k_ptr, v_ptr) and the 32-bit
    coordinates (b, first key row, kv head) their loads start from."""
    if USE_TMA:
        k_base = k_ptr
        v_base = v_ptr
    else:
        k_base = k_ptr + b * stride_k_b + k_start.to(tl.int64) * stride_k_s + hk * stride_k_h
        v_base = v_ptr + b * stride_v_b + k_start.to(tl.int64) * stride_v_s + hk * stride_v_h
    return k_base, v_base, (b.to(tl.int32), k_start.to(tl.int32), hk.to(tl.int32))


@triton.jit
def _tma_block(desc, kv_coord, start_n, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The [BLOCK_N, BLOCK_D] key block at ``start_n`` of a segment, read by TMA through `desc` (a descriptor of
    [B, Sk, Hkv, D] with [1, BLOCK_N, 1, BLOCK_D] boxes) from the segment's coordinates (see _kv_bases)."""
    b, row0, hk = kv_coord
    return tl.reshape(desc.load([b, row0 + start_n, hk, 0]), [BLOCK_N, BLOCK_D])


@triton.jit
def _tanh(x):
    """tanh from one exp, to a few fp32 ulps (libdevice's tanh has no interpreter form). The fast division: an
    IEEE one is a subroutine with a stack frame (`python -m ndp_kernels.aot` counts it as a spill)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = tl.fdiv(1.0 - e, 1.0 + e, ieee_rounding=False)
    return tl.where(x < 0, -t, t)


@triton.jit
def _scores(s, qk_scale, cap_in, SOFTCAP: tl.constexpr):
    """Base-2 scores of the raw dots ``s = q k^T``: ``s * qk_scale`` (qk_scale = scale * log2 e), or soft-capped
    with cap c, ``tanh(s * cap_in) * qk_scale`` (the launcher passes cap_in = scale / c, qk_scale = c * log2 e)."""
    if SOFTCAP:
        return _tanh(s * cap_in) * qk_scale
    return s * qk_scale


@triton.jit
def _through_cap(ds, s2, qk_scale, SOFTCAP: tl.constexpr):
    """A gradient of the capped scores taken back to the raw ones: ``ds * (1 - tanh^2)``, tanh = s2 / qk_scale
    (linear in ds: callers apply it to P before the dP product)."""
    if SOFTCAP:
        t = s2 * (1.0 / qk_scale)  # one division per tile, not per element (see _tanh)
        return ds * (1.0 - t * t)
    return ds


@triton.jit
def _fwd_step(
    acc, m_i, l_i, q, k_base, v_base, start_n,
    offs_m, offs_n, offs_d, d_ok, k_len, band_lo, col_hi, qk_scale, cap_in,
    stride_k_s, stride_v_s, kv_coord,
    MASKED: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One online-softmax step of the forward over the key block at ``start_n``; returns (acc, m, l).

    Lean blocks (MASKED=False) are visible to every valid row of the tile and lie inside k_len:
    no mask on the loads (but the padded head-dim columns when not EVEN_D), none on the scores,
    and the running max is finite after the step, so it needs no -inf guard. Rows of the tile
    past q_len see zero-filled q (finite scores) and are never stored. Edge blocks mask the band
    and the keys past k_len; a row with no visible key so far keeps m = -inf and l = 0.

    USE_TMA: k_base/v_base are tensor descriptors of the whole [B, Sk, Hkv, D] K and V and kv_coord
    (b, first key row of the segment, kv head) locates the segment. A TMA load zero-fills past the tensor's
    ends (rows past Sk, columns past D) but reads the rows of other segments between k_len and Sk: their
    scores are masked like any key past k_len, and an edge block zeroes those V rows, which may hold
    anything (uninitialised padding included), so that p = 0 times them stays 0.
    """
    cols = start_n + offs_n
    if USE_TMA:
        k = _tma_block(k_base, kv_coord, start_n, offs_n.shape[0], offs_d.shape[0])
    else:
        k_ptrs = k_base + cols.to(tl.int64)[:, None] * stride_k_s + offs_d[None, :]
        v_ptrs = v_base + cols.to(tl.int64)[:, None] * stride_v_s + offs_d[None, :]
        if MASKED:
            kv_mask = (cols < k_len)[:, None] & d_ok[None, :]
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        elif EVEN_D:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
    s = _scores(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), qk_scale, cap_in, SOFTCAP)
    if MASKED:
        # Row i sees keys [i + band_lo, min(i + band_hi, k_len - 1)]: two compares per score.
        visible = (cols[None, :] >= (offs_m + band_lo)[:, None]) & (cols[None, :] <= col_hi[:, None])
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        # A row with no visible key so far keeps m = -inf; subtract 0 instead (exp2(-inf) = 0).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_safe = m_new
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if USE_TMA:
        v = _tma_block(v_base, kv_coord, start_n, offs_n.shape[0], offs_d.shape[0])
        if MASKED:
            v = tl.where((cols < k_len)[:, None], v, 0.0)
    elif MASKED:
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    elif EVEN_D:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _flash_fwd_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, seg_ptr,
    qk_scale, cap_in,
    num_segments, group_size,
    stride_q_b, stride_q_s, stride_q_h,
    stride_k_b, stride_k_s, stride_k_h,
    stride_v_b, stride_v_s, stride_v_h,
    stride_o_b, stride_o_s, stride_o_h,
    stride_lse_b, stride_lse_h, stride_lse_s,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ACCUMULATE: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
):
    """out = softmax(scale * q k^T + mask) v and lse = logsumexp(scale * q k^T + mask), per segment.

    Program (pid_m, b * num_segments + seg, h) owns query rows [pid_m*BLOCK_M, +BLOCK_M) of
    segment ``seg``. ``qk_scale = softmax_scale * log2(e)``: the running max ``m`` and sum ``l``
    are kept in base 2, ``lse = (m + log2 l) * ln 2``. SOFTCAP: the scores are soft-capped
    (see _scores). Only key blocks that intersect the
    band of some row of the tile are visited: first the interior blocks that every row of the
    tile sees whole (the lean step, no mask arithmetic), then the edge blocks (band edges, the
    ragged key end) with the masked step. The online softmax is order-independent:
    ``m' = max(m, rowmax s)``, ``l' = l 2^(m - m') + rowsum 2^(s - m')``, likewise for the output.
    With ACCUMULATE the tile result is merged into the fp32 accumulators (out_ptr, lse_ptr) in
    place: ``new = logaddexp(lse_acc, lse); out_acc = out_acc*exp(lse_acc-new) + out*exp(lse-new)``,
    and a row with both lse -inf is left unchanged.
    """
    pid_m, h, b, q_start, q_len, k_start, k_len, band_lo, band_hi = _tile_program(seg_ptr, num_segments)
    hk = h // group_size

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < q_len
    d_ok = offs_d < HEAD_DIM

    # Base offsets in int64 (packed inputs can exceed 2**31 elements). Row offsets inside a segment
    # are int64 as well: row * stride_s passes 2**31 in a long segment (512K rows at H * D = 4096).
    # Rows are widened per element (`rows.to(tl.int64)[:, None] * stride`) rather than by advancing
    # a scalar base pointer per block: the latter leaves loop-invariant 64-bit tile offsets live
    # across the key loop (+10..60 registers, spills; `python -m ndp_kernels.aot`).
    q_base = q_ptr + b * stride_q_b + q_start.to(tl.int64) * stride_q_s + h * stride_q_h
    k_base, v_base, kv_coord = _kv_bases(k_ptr, v_ptr, b, k_start, hk, stride_k_b, stride_k_s, stride_k_h,
                                         stride_v_b, stride_v_s, stride_v_h, USE_TMA)

    q = tl.load(q_base + offs_m.to(tl.int64)[:, None] * stride_q_s + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # Lean key blocks [full_lo, full_hi) and the masked edge blocks around them (see _key_blocks).
    n_begin, full_lo, full_hi, num_lo_edge, num_edge = _key_blocks(m0, q_len, k_len, band_lo, band_hi,
                                                                   BLOCK_M, BLOCK_N)

    col_hi = tl.minimum(offs_m + band_hi, k_len - 1)  # last key of each row (edge blocks)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(full_lo, full_hi, BLOCK_N):
        acc, m_i, l_i = _fwd_step(
            acc, m_i, l_i, q, k_base, v_base, start_n, offs_m, offs_n, offs_d, d_ok, k_len,
            band_lo, col_hi, qk_scale, cap_in, stride_k_s, stride_v_s, kv_coord,
            MASKED=False, EVEN_D=HEAD_DIM == BLOCK_D, DOT_PRECISION=DOT_PRECISION, USE_TMA=USE_TMA,
            SOFTCAP=SOFTCAP)
    for e in range(0, num_edge):
        # Edge blocks: the ones before the interior (lower band edge), then the ones after it
        # (upper band edge, ragged key end).
        start_n = tl.where(e < num_lo_edge, n_begin + e * BLOCK_N, full_hi + (e - num_lo_edge) * BLOCK_N)
        acc, m_i, l_i = _fwd_step(
            acc, m_i, l_i, q, k_base, v_base, start_n, offs_m, offs_n, offs_d, d_ok, k_len,
            band_lo, col_hi, qk_scale, cap_in, stride_k_s, stride_v_s, kv_coord,
            MASKED=True, EVEN_D=HEAD_DIM == BLOCK_D, DOT_PRECISION=DOT_PRECISION, USE_TMA=USE_TMA,
            SOFTCAP=SOFTCAP)

    has_key = l_i > 0.0
    l_safe = tl.where(has_key, l_i, 1.0)
    lse = tl.where(has_key, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    o_base = out_ptr + b * stride_o_b + q_start.to(tl.int64) * stride_o_s + h * stride_o_h
    lse_ptrs = (lse_ptr + b * stride_lse_b + h * stride_lse_h
                + (q_start + offs_m).to(tl.int64) * stride_lse_s)
    if ACCUMULATE:
        lse_old = tl.load(lse_ptrs, mask=row_ok, other=float("-inf"))
        w_old, w_blk = _merge_weights(lse_old, lse)
        # Fold 1/l of the block output into its merge weight.
        w_blk = w_blk / l_safe
        tl.store(lse_ptrs, _merge_lse(lse_old, lse), mask=row_ok)
        if BLOCK_D >= 64:
            # Merge one half of the head dim at a time: holding the old accumulator tile next to
            # the new one spills registers at head_dim 256.
            halves = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_D // 2]), (0, 2, 1)))
            offs_h = tl.arange(0, BLOCK_D // 2)
            _merge_tile(o_base, halves[0], offs_m, offs_h, row_ok, w_old, w_blk, stride_o_s, HEAD_DIM)
            _merge_tile(o_base, halves[1], offs_m, offs_h + BLOCK_D // 2, row_ok, w_old, w_blk,
                        stride_o_s, HEAD_DIM)
        else:
            _merge_tile(o_base, acc, offs_m, offs_d, row_ok, w_old, w_blk, stride_o_s, HEAD_DIM)
    else:
        o = acc / l_safe[:, None]
        o_rows = o_base + offs_m.to(tl.int64)[:, None] * stride_o_s
        if BLOCK_D >= 64:
            # Store one half of the head dim at a time, as the merge above: with 64-bit row offsets
            # the whole-tile store spills registers (fp32, head_dim 80, sm_80).
            halves = tl.split(tl.permute(tl.reshape(o, [BLOCK_M, 2, BLOCK_D // 2]), (0, 2, 1)))
            offs_h = tl.arange(0, BLOCK_D // 2)
            tl.store(o_rows + offs_h[None, :], halves[0].to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & (offs_h < HEAD_DIM)[None, :])
            tl.store(o_rows + (offs_h + BLOCK_D // 2)[None, :], halves[1].to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & (offs_h + BLOCK_D // 2 < HEAD_DIM)[None, :])
        else:
            tl.store(o_rows + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & d_ok[None, :])
        tl.store(lse_ptrs, lse, mask=row_ok)


@triton.jit
def _merge_tile(o_base, acc, offs_m, offs_d, row_ok, w_old, w_blk, stride_o_s, HEAD_DIM: tl.constexpr):
    """out_acc[rows, cols] = out_acc * w_old + acc * w_blk (per-row weights), fp32, in place."""
    ptrs = o_base + offs_m.to(tl.int64)[:, None] * stride_o_s + offs_d[None, :]  # int64 rows: see above
    mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    old = tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, old * w_old[:, None] + acc * w_blk[:, None], mask=mask)


@triton.jit
def _load_kv_block(k_ptr, v_ptr, b, k_row0, hk, stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s,
                   stride_v_h, offs_c, offs_d, kv_mask):
    """K and V of the key block whose first row is ``k_row0`` (int64), kv head ``hk``: the base pointer is
    advanced to that row and ``offs_c`` (rows inside the block) stay small int32 offsets."""
    k = tl.load(k_ptr + b * stride_k_b + k_row0 * stride_k_s + hk * stride_k_h
                + offs_c[:, None] * stride_k_s + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + b * stride_v_b + k_row0 * stride_v_s + hk * stride_v_h
                + offs_c[:, None] * stride_v_s + offs_d[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _flash_bwd_preprocess_kernel(
    out_ptr, dout_ptr, delta_ptr, seqlen,
    stride_o_b, stride_o_s, stride_o_h,
    stride_do_b, stride_do_s, stride_do_h,
    stride_delta_b, stride_delta_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """delta[b, h, i] = sum_d dout[b, i, h, d] * out[b, i, h, d] in fp32 (the softmax-backward row term)."""
    pid_m = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < seqlen)[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(out_ptr + b * stride_o_b + h * stride_o_h + offs_m[:, None].to(tl.int64) * stride_o_s
                + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    do = tl.load(dout_ptr + b * stride_do_b + h * stride_do_h
                 + offs_m[:, None].to(tl.int64) * stride_do_s + offs_d[None, :],
                 mask=mask, other=0.0).to(tl.float32)
    tl.store(delta_ptr + b * stride_delta_b + h * stride_delta_h + offs_m, tl.sum(o * do, 1),
             mask=offs_m < seqlen)


@triton.jit
def _flash_bwd_kernel(
    q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, delta_ptr, seg_ptr,
    dq_ptr, dk_ptr, dv_ptr,
    softmax_scale, qk_scale, cap_in,
    num_segments, group_size,
    stride_q_b, stride_q_s, stride_q_h,
    stride_k_b, stride_k_s, stride_k_h,
    stride_v_b, stride_v_s, stride_v_h,
    stride_do_b, stride_do_s, stride_do_h,
    stride_lse_b, stride_lse_h, stride_lse_s,
    stride_delta_b, stride_delta_h,
    stride_dq_b, stride_dq_s, stride_dq_h,
    stride_dk_b, stride_dk_s, stride_dk_h,
    stride_dv_b, stride_dv_s, stride_dv_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ATOMIC_KV: tl.constexpr, DOT_PRECISION: tl.constexpr, HEAD_SPLITS: tl.constexpr = 1,
    SOFTCAP: tl.constexpr = False,
):
    """Gradients of attention for one key block of one segment and one kv head.

    With P = exp(scale * q k^T - lse) (masked entries 0), dP = dout v^T, dS = P * (dP - delta):
    dv += P^T dout, dk += scale * dS^T q, dq += scale * dS k, all in fp32. The program
    (pid_n, b * num_segments + seg, hk * HEAD_SPLITS + split) walks the query heads of part ``split``
    of the HEAD_SPLITS equal parts of kv head ``hk``'s group (GQA sums in registers) and the query blocks
    inside the band of its key rows. dq is added with fp32 atomics (several key blocks touch a query
    row). dk/dv are added once at the end, with atomics when segments share key rows or heads are
    split (ATOMIC_KV), else with a plain read-add-write.
    lse = -inf (row sees no key) gives P = 0, hence zero gradients.
    """
    pid_n, pid_h, b, q_start, q_len, k_start, k_len, band_lo, band_hi = _tile_program(seg_ptr, num_segments)
    hk, h0, heads = _group_part(pid_h, group_size, HEAD_SPLITS)

    n0 = pid_n * BLOCK_N
    offs_c = tl.arange(0, BLOCK_N)  # key rows inside the block: the pointer offsets
    offs_n = n0 + offs_c  # key rows inside the segment: the masks
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = offs_n < k_len
    d_ok = offs_d < HEAD_DIM
    kv_mask = col_ok[:, None] & d_ok[None, :]

    # Row offsets in int64 (row * stride_s passes 2**31 in long segments): the k/v/dk/dv base is
    # advanced to the block's first row, leaving small int32 in-tile offsets; inside the query loop,
    # q/do advance a scalar base by start_m and dq/lse widen their rows per element (the forms that
    # keep registers and spills at the int32 kernel's level; `python -m ndp_kernels.aot`).
    k_row0 = (k_start + n0).to(tl.int64)
    k, v = _load_kv_block(k_ptr, v_ptr, b, k_row0, hk, stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s,
                          stride_v_h, offs_c, offs_d, kv_mask)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Query blocks from m_begin up to i_hi see at least one key of this block (see _query_range).
    n_last, i_lo, i_hi, m_begin = _query_range(n0, q_len, k_len, band_lo, band_hi, BLOCK_M, BLOCK_N)
    i_hi = tl.where(n0 < k_len, i_hi, i_lo)
    q_row0 = q_start.to(tl.int64)

    for g in range(0, heads):
        h = h0 + g
        q_base = q_ptr + b * stride_q_b + q_row0 * stride_q_s + h * stride_q_h
        do_base = dout_ptr + b * stride_do_b + q_row0 * stride_do_s + h * stride_do_h
        dq_base = dq_ptr + b * stride_dq_b + q_row0 * stride_dq_s + h * stride_dq_h
        lse_base = lse_ptr + b * stride_lse_b + h * stride_lse_h + q_row0 * stride_lse_s
        delta_base = delta_ptr + b * stride_delta_b + h * stride_delta_h + q_row0
        for start_m in range(m_begin, i_hi, BLOCK_M):
            rows = start_m + offs_m0
            row_ok = rows < q_len
            q_mask = row_ok[:, None] & d_ok[None, :]
            m64 = tl.cast(start_m, tl.int64)  # tl.cast: the interpreter's loop variable is a Python int
            q = tl.load(q_base + m64 * stride_q_s + offs_m0[:, None] * stride_q_s + offs_d[None, :],
                        mask=q_mask, other=0.0)
            do = tl.load(do_base + m64 * stride_do_s + offs_m0[:, None] * stride_do_s + offs_d[None, :],
                         mask=q_mask, other=0.0)
            lse = tl.load(lse_base + rows.to(tl.int64) * stride_lse_s, mask=row_ok, other=float("-inf"))
            delta = tl.load(delta_base + rows, mask=row_ok, other=0.0)
            # lse = -inf marks a row without keys: shift by +inf so that its P is exactly 0.
            lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
            s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # [N, M]
            diff = offs_n[:, None] - rows[None, :]
            # Always masked: a per-tile "fully visible" branch here costs registers (spills on sm_80).
            visible = col_ok[:, None] & row_ok[None, :] & (diff >= band_lo) & (diff <= band_hi)
            s_t = _scores(s_t, qk_scale, cap_in, SOFTCAP)
            p_t = tl.where(visible, tl.exp2(s_t - lse2[None, :]), 0.0)
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
            p_t = _through_cap(p_t, s_t, qk_scale, SOFTCAP)  # as in _bwd_dkdv_step
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # [N, M]
            ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
            dk = tl.dot(ds_t, q, dk, input_precision=DOT_PRECISION)
            dq = tl.dot(tl.trans(ds_t), k, input_precision=DOT_PRECISION) * softmax_scale
            tl.atomic_add(dq_base + rows.to(tl.int64)[:, None] * stride_dq_s + offs_d[None, :], dq,
                          mask=q_mask, sem="relaxed")

    dk = dk * softmax_scale
    dk_ptrs = (dk_ptr + b * stride_dk_b + k_row0 * stride_dk_s + hk * stride_dk_h
               + offs_c[:, None] * stride_dk_s + offs_d[None, :])
    dv_ptrs = (dv_ptr + b * stride_dv_b + k_row0 * stride_dv_s + hk * stride_dv_h
               + offs_c[:, None] * stride_dv_s + offs_d[None, :])
    if ATOMIC_KV:
        tl.atomic_add(dk_ptrs, dk, mask=kv_mask, sem="relaxed")
        tl.atomic_add(dv_ptrs, dv, mask=kv_mask, sem="relaxed")
    else:
        tl.store(dk_ptrs, tl.load(dk_ptrs, mask=kv_mask, other=0.0) + dk, mask=kv_mask)
        tl.store(dv_ptrs, tl.load(dv_ptrs, mask=kv_mask, other=0.0) + dv, mask=kv_mask)


# Split backward: a dK/dV kernel (program per key block) and a dQ kernel (program per query block).
# No atomics anywhere: each program owns its output rows, so results are bitwise reproducible. Both
# kernels visit the blocks that lie fully inside the band with the lean step (MASKED=False: no
# per-element mask arithmetic) and the band-edge / ragged blocks with the masked step.

@triton.jit
def _bwd_dkdv_step(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base, start_m,
    offs_m0, offs_n, offs_d, d_ok, q_len, band_lo, band_hi, qk_scale, cap_in,
    stride_q_s, stride_do_s, stride_lse_s,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """dk += dS^T q and dv += P^T dout for the query block at ``start_m`` (key block in k, v).

    Rows past q_len load q = dout = 0 and lse = -inf (P = 0): they add nothing, so only the band
    needs masking, and only on edge blocks (MASKED). Key rows past k_len are never masked here:
    they only feed their own dk/dv rows, which the caller does not store.
    """
    rows = start_m + offs_m0
    row_ok = rows < q_len
    q_mask = row_ok[:, None] & d_ok[None, :]
    m64 = tl.cast(start_m, tl.int64)  # tl.cast: under the interpreter start_m may be a Python int
    q = tl.load(q_base + m64 * stride_q_s + offs_m0[:, None] * stride_q_s + offs_d[None, :],
                mask=q_mask, other=0.0)
    do = tl.load(do_base + m64 * stride_do_s + offs_m0[:, None] * stride_do_s + offs_d[None, :],
                 mask=q_mask, other=0.0)
    lse = tl.load(lse_base + rows.to(tl.int64) * stride_lse_s, mask=row_ok, other=float("-inf"))
    delta = tl.load(delta_base + rows, mask=row_ok, other=0.0)
    # lse = -inf marks a row without keys: shift by +inf so that its P is exactly 0.
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    s_t = _scores(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION), qk_scale, cap_in, SOFTCAP)  # [N, M]
    p_t = tl.exp2(s_t - lse2[None, :])
    if MASKED:
        diff = offs_n[:, None] - rows[None, :]
        # where, not a multiply: an out-of-band exp2 may be inf.
        p_t = tl.where((diff >= band_lo) & (diff <= band_hi), p_t, 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    # P times the cap's derivative as soon as dV has P: the scores die before the dP dot (registers).
    p_t = _through_cap(p_t, s_t, qk_scale, SOFTCAP)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # [N, M]
    ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
    dk = tl.dot(ds_t, q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _flash_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, delta_ptr, seg_ptr,
    dk_ptr, dv_ptr,
    softmax_scale, qk_scale, cap_in,
    num_segments, group_size, batch,
    stride_q_b, stride_q_s, stride_q_h,
    stride_k_b, stride_k_s, stride_k_h,
    stride_v_b, stride_v_s, stride_v_h,
    stride_do_b, stride_do_s, stride_do_h,
    stride_lse_b, stride_lse_h, stride_lse_s,
    stride_delta_b, stride_delta_h,
    stride_dk_b, stride_dk_s, stride_dk_h,
    stride_dv_b, stride_dv_s, stride_dv_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HEAD_SPLITS: tl.constexpr = 1, SOFTCAP: tl.constexpr = False,
):
    """dK and dV of one key block of one segment and one kv head, without atomics.

    With P = exp(scale * q k^T - lse) (0 outside the band), dP = dout v^T, dS = P * (dP - delta):
    dv += sum_h P_h^T dout_h and dk += scale * sum_h dS_h^T q_h over the query heads h of kv head
    ``hk`` (GQA/MQA: summed in registers, heads in a fixed order). Program (pid_n, b * num_segments
    + seg, hk * HEAD_SPLITS + split) takes the query heads of part ``split`` of the HEAD_SPLITS
    equal parts of the group and walks the query blocks that see its key rows [pid_n*BLOCK_N,
    +BLOCK_N): first those fully inside the band (unmasked), then the band-edge ones (masked). The
    result is added into dk/dv (with HEAD_SPLITS > 1 the caller passes per-part buffers stacked along
    the batch and sums them in a fixed order) with a plain read-add-write: the caller launches
    only segments whose key ranges are disjoint, so no other program of the launch touches these rows.
    """
    pid_n, pid_h, b, q_start, q_len, k_start, k_len, band_lo, band_hi = _tile_program(seg_ptr, num_segments)
    hk, h0, heads = _group_part(pid_h, group_size, HEAD_SPLITS)

    n0 = pid_n * BLOCK_N
    offs_c = tl.arange(0, BLOCK_N)  # key rows inside the block: the pointer offsets
    offs_n = n0 + offs_c  # key rows inside the segment: the band mask
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    kv_mask = (offs_n < k_len)[:, None] & d_ok[None, :]

    # int64 row offsets as in _flash_bwd_kernel: k/v/dk/dv advance their base to the block's first
    # row, q/do advance a scalar base per query block (the forms that keep registers down).
    k_row0 = (k_start + n0).to(tl.int64)
    k, v = _load_kv_block(k_ptr, v_ptr, b, k_row0, hk, stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s,
                          stride_v_h, offs_c, offs_d, kv_mask)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Query rows [i_lo, i_hi) see at least one key of the block; blocks of BLOCK_M rows from m_begin.
    n_last, i_lo, i_hi, m_begin = _query_range(n0, q_len, k_len, band_lo, band_hi, BLOCK_M, BLOCK_N)
    num_blocks = tl.where((n0 < k_len) & (i_hi > m_begin), tl.cdiv(i_hi - m_begin, BLOCK_M), 0)
    # Query blocks [full_a, full_b) (indices from m_begin) have every (row, key) pair in the band:
    # first row >= n_last - band_hi and last row <= n0 - band_lo. Rows past q_len and keys past
    # k_len need no mask (see _bwd_dkdv_step), so the ragged ends do not count as edges.
    full_a = tl.minimum(tl.cdiv(tl.maximum(n_last - band_hi - m_begin, 0), BLOCK_M), num_blocks)
    m_max = n0 - band_lo - BLOCK_M + 1  # last first-row of a block under the lower band edge
    full_b = tl.where(m_max >= m_begin, (tl.maximum(m_max - m_begin, 0) // BLOCK_M) + 1, 0)
    full_b = tl.minimum(tl.maximum(full_b, full_a), num_blocks)
    num_edge = full_a + num_blocks - full_b

    q_row0 = q_start.to(tl.int64)
    for g in range(0, heads):
        h = h0 + g
        q_base = q_ptr + b * stride_q_b + q_row0 * stride_q_s + h * stride_q_h
        do_base = dout_ptr + b * stride_do_b + q_row0 * stride_do_s + h * stride_do_h
        lse_base = lse_ptr + b * stride_lse_b + h * stride_lse_h + q_row0 * stride_lse_s
        delta_base = delta_ptr + b * stride_delta_b + h * stride_delta_h + q_row0
        for i in range(full_a, full_b):
            dk, dv = _bwd_dkdv_step(
                dk, dv, k, v, q_base, do_base, lse_base, delta_base, m_begin + i * BLOCK_M,
                offs_m0, offs_n, offs_d, d_ok, q_len, band_lo, band_hi, qk_scale, cap_in,
                stride_q_s, stride_do_s, stride_lse_s, MASKED=False, DOT_PRECISION=DOT_PRECISION,
                SOFTCAP=SOFTCAP)
        for e in range(0, num_edge):
            # Edge blocks: indices [0, full_a), then [full_b, num_blocks).
            i = tl.where(e < full_a, e, e + (full_b - full_a))
            dk, dv = _bwd_dkdv_step(
                dk, dv, k, v, q_base, do_base, lse_base, delta_base, m_begin + i * BLOCK_M,
                offs_m0, offs_n, offs_d, d_ok, q_len, band_lo, band_hi, qk_scale, cap_in,
                stride_q_s, stride_do_s, stride_lse_s, MASKED=True, DOT_PRECISION=DOT_PRECISION,
                SOFTCAP=SOFTCAP)

    if HEAD_SPLITS > 1:
        # Each part adds into its own buffer: dk/dv are [HEAD_SPLITS * batch, ...] and part p owns batch rows
        # [p * batch, (p + 1) * batch). Part and kv head are read again from the program id rather than kept
        # live through the loop (registers).
        hk = tl.program_id(2) // HEAD_SPLITS
        b += (tl.program_id(2) % HEAD_SPLITS) * batch
    _add_tile(dv_ptr + b * stride_dv_b + k_row0 * stride_dv_s + hk * stride_dv_h, dv, offs_c,
              offs_n < k_len, stride_dv_s, HEAD_DIM, BLOCK_D)
    _add_tile(dk_ptr + b * stride_dk_b + k_row0 * stride_dk_s + hk * stride_dk_h, dk * softmax_scale,
              offs_c, offs_n < k_len, stride_dk_s, HEAD_DIM, BLOCK_D)


@triton.jit
def _add_tile(base_ptr, acc, offs_r, row_ok, stride_s, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """base[r, d] += acc[r, d] for rows ``offs_r`` (fp32 read-add-write, no atomics).

    A quarter (BLOCK_D >= 128) or a half (>= 64) of the head dim at a time: converting the whole
    accumulator to the store layout next to the dk and dv accumulators spills registers (sm_90,
    head_dim 128; `python -m ndp_kernels.aot`).
    """
    if BLOCK_D >= 128:
        halves = tl.split(tl.permute(tl.reshape(acc, [acc.shape[0], 2, BLOCK_D // 2]), (0, 2, 1)))
        q0 = tl.split(tl.permute(tl.reshape(halves[0], [acc.shape[0], 2, BLOCK_D // 4]), (0, 2, 1)))
        _add_cols(base_ptr, q0[0], offs_r, row_ok, 0, stride_s, HEAD_DIM, BLOCK_D // 4)
        _add_cols(base_ptr, q0[1], offs_r, row_ok, BLOCK_D // 4, stride_s, HEAD_DIM, BLOCK_D // 4)
        q1 = tl.split(tl.permute(tl.reshape(halves[1], [acc.shape[0], 2, BLOCK_D // 4]), (0, 2, 1)))
        _add_cols(base_ptr, q1[0], offs_r, row_ok, BLOCK_D // 2, stride_s, HEAD_DIM, BLOCK_D // 4)
        _add_cols(base_ptr, q1[1], offs_r, row_ok, 3 * BLOCK_D // 4, stride_s, HEAD_DIM, BLOCK_D // 4)
    elif BLOCK_D >= 64:
        halves = tl.split(tl.permute(tl.reshape(acc, [acc.shape[0], 2, BLOCK_D // 2]), (0, 2, 1)))
        _add_cols(base_ptr, halves[0], offs_r, row_ok, 0, stride_s, HEAD_DIM, BLOCK_D // 2)
        _add_cols(base_ptr, halves[1], offs_r, row_ok, BLOCK_D // 2, stride_s, HEAD_DIM, BLOCK_D // 2)
    else:
        _add_cols(base_ptr, acc, offs_r, row_ok, 0, stride_s, HEAD_DIM, BLOCK_D)


@triton.jit
def _add_cols(base_ptr, acc, offs_r, row_ok, COL0: tl.constexpr, stride_s, HEAD_DIM: tl.constexpr,
              WIDTH: tl.constexpr):
    """base[r, COL0 + c] += acc[r, c] for c < WIDTH (columns past HEAD_DIM masked)."""
    cols = COL0 + tl.arange(0, WIDTH)
    ptrs = base_ptr + offs_r[:, None] * stride_s + cols[None, :]
    mask = row_ok[:, None] & (cols < HEAD_DIM)[None, :]
    tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0) + acc, mask=mask)


@triton.jit
def _bwd_dq_step(
    dq, q, do, lse2, delta, k_base, v_base, start_n,
    offs_m, offs_n0, offs_d, d_ok, k_len, band_lo, band_hi, qk_scale, cap_in,
    stride_k_s, stride_v_s, kv_coord,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """dq += dS k (unscaled) for the key block at ``start_n``.

    Lean blocks (MASKED=False) lie inside the band and inside k_len for every row of the tile. Edge
    blocks mask the band and the keys past k_len: a zero-filled key there has score 0, and its
    exp2(-lse) may overflow, so it is masked rather than trusted to vanish.

    USE_TMA: K/V blocks by tensor descriptor, as in _fwd_step. The rows between k_len and the tensor's end
    belong to other segments and may hold anything: an edge block zeroes both K and V there (dS is 0 there,
    but 0 times a NaN in dP or in K is not).
    """
    cols = start_n + offs_n0
    if USE_TMA:
        k = _tma_block(k_base, kv_coord, start_n, offs_n0.shape[0], offs_d.shape[0])
        v = _tma_block(v_base, kv_coord, start_n, offs_n0.shape[0], offs_d.shape[0])
        if MASKED:
            key_ok = (cols < k_len)[:, None]
            k = tl.where(key_ok, k, 0.0)
            v = tl.where(key_ok, v, 0.0)
    else:
        if MASKED:
            kv_mask = (cols < k_len)[:, None] & d_ok[None, :]
        else:
            kv_mask = (offs_n0 >= 0)[:, None] & d_ok[None, :]  # every key in range: only padded head-dim columns
        k = tl.load(k_base + cols.to(tl.int64)[:, None] * stride_k_s + offs_d[None, :], mask=kv_mask,
                    other=0.0)
        v = tl.load(v_base + cols.to(tl.int64)[:, None] * stride_v_s + offs_d[None, :], mask=kv_mask,
                    other=0.0)
    s = _scores(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), qk_scale, cap_in, SOFTCAP)  # [M, N]
    p = tl.exp2(s - lse2[:, None])
    if MASKED:
        diff = cols[None, :] - offs_m[:, None]
        p = tl.where((cols < k_len)[None, :] & (diff >= band_lo) & (diff <= band_hi), p, 0.0)
    p = _through_cap(p, s, qk_scale, SOFTCAP)  # the scores die before the dP dot (registers)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # [M, N]
    ds = (p * (dp - delta[:, None])).to(k.dtype)
    return tl.dot(ds, k, dq, input_precision=DOT_PRECISION)


@triton.jit
def _flash_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, delta_ptr, seg_ptr,
    dq_ptr,
    softmax_scale, qk_scale, cap_in,
    num_segments, group_size,
    stride_q_b, stride_q_s, stride_q_h,
    stride_k_b, stride_k_s, stride_k_h,
    stride_v_b, stride_v_s, stride_v_h,
    stride_do_b, stride_do_s, stride_do_h,
    stride_lse_b, stride_lse_h, stride_lse_s,
    stride_delta_b, stride_delta_h,
    stride_dq_b, stride_dq_s, stride_dq_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
):
    """dQ of one query block of one segment and one query head, without atomics.

    With P = exp(scale * q k^T - lse) (0 outside the band) and dS = P * (dout v^T - delta):
    dq += scale * dS k, summed over the key blocks of the band in a fixed order (unmasked interior
    blocks first, then the masked edges). Program (pid_m, b * num_segments + seg, h) owns query rows
    [pid_m*BLOCK_M, +BLOCK_M) of segment ``seg``; query ranges of segments are disjoint, so the
    read-add-write into dq needs no atomics. lse = -inf (row sees no key) gives P = 0, hence dq = 0.
    """
    pid_m, h, b, q_start, q_len, k_start, k_len, band_lo, band_hi = _tile_program(seg_ptr, num_segments)
    hk = h // group_size

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < q_len
    d_ok = offs_d < HEAD_DIM
    q_mask = row_ok[:, None] & d_ok[None, :]

    q_row0 = q_start.to(tl.int64)
    rows64 = offs_m.to(tl.int64)[:, None]  # int64 rows: see _flash_fwd_kernel
    q = tl.load(q_ptr + b * stride_q_b + q_row0 * stride_q_s + h * stride_q_h + rows64 * stride_q_s
                + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(dout_ptr + b * stride_do_b + q_row0 * stride_do_s + h * stride_do_h
                 + rows64 * stride_do_s + offs_d[None, :], mask=q_mask, other=0.0)
    lse = tl.load(lse_ptr + b * stride_lse_b + h * stride_lse_h + (q_row0 + offs_m) * stride_lse_s,
                  mask=row_ok, other=float("-inf"))
    delta = tl.load(delta_ptr + b * stride_delta_b + h * stride_delta_h + q_row0 + offs_m, mask=row_ok,
                    other=0.0)
    # lse = -inf marks a row without keys (or past q_len): shift by +inf so that its P is exactly 0.
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    k_base, v_base, kv_coord = _kv_bases(k_ptr, v_ptr, b, k_start, hk, stride_k_b, stride_k_s, stride_k_h,
                                         stride_v_b, stride_v_s, stride_v_h, USE_TMA)

    # Unmasked interior key blocks [full_lo, full_hi) and the edge blocks, as in _flash_fwd_kernel.
    n_begin, full_lo, full_hi, num_lo_edge, num_edge = _key_blocks(m0, q_len, k_len, band_lo, band_hi,
                                                                   BLOCK_M, BLOCK_N)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(full_lo, full_hi, BLOCK_N):
        dq = _bwd_dq_step(dq, q, do, lse2, delta, k_base, v_base, start_n,
                          offs_m, offs_n0, offs_d, d_ok, k_len, band_lo, band_hi, qk_scale, cap_in,
                          stride_k_s, stride_v_s, kv_coord, MASKED=False, DOT_PRECISION=DOT_PRECISION,
                          USE_TMA=USE_TMA, SOFTCAP=SOFTCAP)
    for e in range(0, num_edge):
        # Edge blocks: the ones before the interior, then the ones after it.
        start_n = tl.where(e < num_lo_edge, n_begin + e * BLOCK_N, full_hi + (e - num_lo_edge) * BLOCK_N)
        dq = _bwd_dq_step(dq, q, do, lse2, delta, k_base, v_base, start_n,
                          offs_m, offs_n0, offs_d, d_ok, k_len, band_lo, band_hi, qk_scale, cap_in,
                          stride_k_s, stride_v_s, kv_coord, MASKED=True, DOT_PRECISION=DOT_PRECISION,
                          USE_TMA=USE_TMA, SOFTCAP=SOFTCAP)

    _add_tile(dq_ptr + b * stride_dq_b + (q_row0 + m0) * stride_dq_s + h * stride_dq_h, dq * softmax_scale,
              tl.arange(0, BLOCK_M), row_ok, stride_dq_s, HEAD_DIM, BLOCK_D)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------

def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: IEEE dots (no TF32) so fp32 results match the reference to 1e-5.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_runnable(t: torch.Tensor) -> None:
    if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"the Triton kernels take float16, bfloat16 or float32 inputs; got {t.dtype}. "
                        f"Use ndp_kernels.reference (ndp.ops backend='torch') for {t.dtype}.")
    why = interpreter_refuses(t.dtype)
    if why:
        raise TypeError(why + ".")
    if t.device.type != "cuda" and not interpreter_active():
        raise RuntimeError(
            f"Triton kernels need a CUDA tensor or TRITON_INTERPRET=1 set before triton is imported; "
            f"got a tensor on {t.device}. Use the reference (ndp_kernels.reference) or "
            f"ndp.ops.attention(backend='torch') on CPU.")


def _check_acc(name: str, acc: torch.Tensor, shape, device) -> None:
    segments.check_like(name, acc, shape, torch.float32, device)


def _check_last_dim(name: str, t: torch.Tensor) -> None:
    if t.dim() >= 1 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 in the last dim, got {t.stride(-1)}; call .contiguous()")


def _segment_args(segs, device):
    table = segs.on(device)
    return table, table.shape[0]


def _score_args(softmax_scale, softcap) -> tuple:
    """(qk_scale, cap_in) of the kernels' ``_scores`` for a scale and a soft-cap (0 = off)."""
    scale, cap = float(softmax_scale), float(softcap or 0.0)
    return (cap * LOG2E, scale / cap) if cap else (scale * LOG2E, 0.0)


def attn_fwd_segments(q4, k4, v4, segs, *, softmax_scale, out_acc=None, lse_acc=None, softcap=0.0):
    """Forward attention of 4-D q/k/v over a segment table.

    Args:
        q4: [B, Sq, H, D] fp16/bf16/fp32, stride 1 in the last dim.
        k4, v4: [B, Sk, Hkv, D], same dtype and device, H % Hkv == 0.
        segs: ``ndp_kernels.segments.Segments``.
        softmax_scale: float.
        out_acc, lse_acc: optional fp32 accumulators [B, Sq, H, D] and [B, H, Sq], merged in place by LSE.
        softcap: logit soft-cap c > 0 (scores c * tanh(scores / c)), 0 = off.
    Returns:
        (out [B, Sq, H, D] in q's dtype, lse fp32 [B, H, Sq]); or (out_acc, lse_acc) when given.
        Rows in no segment: out 0 and lse -inf (untouched in the accumulators).
    Raises:
        ValueError/TypeError on mismatched accumulators; RuntimeError for CPU tensors without the interpreter.
    """
    _check_runnable(q4)
    B, Sq, H, D = q4.shape
    Hkv = k4.shape[2]
    if (out_acc is None) != (lse_acc is None):
        raise ValueError("out_acc and lse_acc go together: pass both or neither")
    accumulate = out_acc is not None
    if accumulate:
        _check_acc("out_acc", out_acc, (B, Sq, H, D), q4.device)
        _check_acc("lse_acc", lse_acc, (B, H, Sq), q4.device)
        _check_last_dim("out_acc", out_acc)
        out, lse = out_acc, lse_acc
    else:
        # Rows in no segment must read out = 0, lse = -inf; skip the fill when segments cover all rows.
        if segs.covers(Sq):
            out = torch.empty((B, Sq, H, D), dtype=q4.dtype, device=q4.device)
            lse = torch.empty((B, H, Sq), dtype=torch.float32, device=q4.device)
        else:
            out = torch.zeros((B, Sq, H, D), dtype=q4.dtype, device=q4.device)
            lse = torch.full((B, H, Sq), float("-inf"), dtype=torch.float32, device=q4.device)
    if B == 0 or Sq == 0 or H == 0 or segs.table.shape[0] == 0 or segs.max_q_len == 0:
        return out, lse
    arch = current_arch(q4.device)
    measure_ahead(arch, D, q4.dtype, q4.device)  # the backward's choices too: it never measures (tuning.may_measure)
    cfg = fwd_config(arch, D, q4.device, dtype=q4.dtype)
    table, nseg = _segment_args(segs, q4.device)
    grid = (triton.cdiv(segs.max_q_len, cfg.block_m), B * nseg, H)
    k_arg, v_arg, use_tma = _kv_args("fwd", cfg, k4, v4, D)
    with launch_device(q4.device):
        _flash_fwd_kernel[grid](
            q4, k_arg, v_arg, out, lse, table,
            *_score_args(softmax_scale, softcap),
            nseg, H // Hkv,
            q4.stride(0), q4.stride(1), q4.stride(2),
            k4.stride(0), k4.stride(1), k4.stride(2),
            v4.stride(0), v4.stride(1), v4.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1), lse.stride(2),
            HEAD_DIM=D, BLOCK_D=block_d(D), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            ACCUMULATE=accumulate, DOT_PRECISION=_dot_precision(q4.dtype), USE_TMA=use_tma, SOFTCAP=bool(softcap),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return out, lse


def _kv_args(kind, cfg, k4, v4, head_dim: int):
    """(k, v, use_tma): what kernel `kind` takes for K and V: their tensor descriptors where ``cfg.tma`` asks,
    TMA runs here (``configs.tma_here``; under the interpreter wherever ``tma_applies``) and ``_tma_aligned``
    holds, else the tensors themselves (pointer loads)."""
    if interpreter_active():
        runs = tma_applies(kind, k4.dtype, head_dim)
    else:
        runs = tma_here(kind, k4.dtype, k4.device, head_dim)
    if cfg.tma and runs and _tma_aligned(k4, v4):
        return (*_kv_descriptors(k4, v4, cfg.block_n, block_d(head_dim)), True)
    return k4, v4, False


def _tma_aligned(*tensors) -> bool:
    """Whether these tensors meet the hardware's descriptor rules: no empty dim (a zero-size box asserts), positive
    strides (an expanded K/V has stride 0), contiguous last dim, 16-byte aligned base and strides; otherwise the
    pointer loads run."""
    for t in tensors:
        if t.numel() == 0 or t.stride(-1) != 1 or any(st <= 0 for st in t.stride()):
            return False
        size = t.element_size()
        if t.data_ptr() % 16 or any((st * size) % 16 for st in t.stride()[:-1]):
            return False
    return True


def _kv_descriptors(k4, v4, block_n: int, block_d_: int):
    """Host tensor descriptors of K and V ([B, Sk, Hkv, D]) with [1, block_n, 1, block_d] boxes."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return tuple(TensorDescriptor(x, list(x.shape), list(x.stride()), [1, block_n, 1, block_d_]) for x in (k4, v4))


def _delta(out4, dout4):
    B, S, H, D = out4.shape
    delta = torch.empty((B, H, S), dtype=torch.float32, device=out4.device)
    if delta.numel() == 0:
        return delta
    cfg = merge_config(current_arch(out4.device), D)
    grid = (triton.cdiv(S, cfg.block_m), B, H)
    with launch_device(out4.device):
        _flash_bwd_preprocess_kernel[grid](
            out4, dout4, delta, S,
            out4.stride(0), out4.stride(1), out4.stride(2),
            dout4.stride(0), dout4.stride(1), dout4.stride(2),
            delta.stride(0), delta.stride(1),
            HEAD_DIM=D, BLOCK_D=block_d(D), BLOCK_M=cfg.block_m, num_warps=cfg.num_warps,
        )
    return delta


def _bwd_atomic(dout4, q4, k4, v4, lse3, delta, segs, dq, dk, dv, softmax_scale, softcap):
    """Launch ``_flash_bwd_kernel``: dq by fp32 atomics, dk/dv atomically only where segments share keys."""
    B, _, H, D = q4.shape
    Hkv = k4.shape[2]
    arch = current_arch(q4.device)
    cfg = bwd_config(arch, D, q4.device, dtype=q4.dtype)
    table, nseg = _segment_args(segs, q4.device)
    programs = triton.cdiv(segs.max_k_len, cfg.block_n) * B * nseg * Hkv
    splits = head_splits(programs, H // Hkv, q4.device, q4.dtype)
    grid = (triton.cdiv(segs.max_k_len, cfg.block_n), B * nseg, Hkv * splits)
    with launch_device(q4.device):
        _flash_bwd_kernel[grid](
            q4, k4, v4, dout4, lse3, delta, table,
            dq, dk, dv,
            float(softmax_scale), *_score_args(softmax_scale, softcap),
            nseg, H // Hkv,
            q4.stride(0), q4.stride(1), q4.stride(2),
            k4.stride(0), k4.stride(1), k4.stride(2),
            v4.stride(0), v4.stride(1), v4.stride(2),
            dout4.stride(0), dout4.stride(1), dout4.stride(2),
            lse3.stride(0), lse3.stride(1), lse3.stride(2),
            delta.stride(0), delta.stride(1),
            dq.stride(0), dq.stride(1), dq.stride(2),
            dk.stride(0), dk.stride(1), dk.stride(2),
            dv.stride(0), dv.stride(1), dv.stride(2),
            HEAD_DIM=D, BLOCK_D=block_d(D), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            ATOMIC_KV=segs.keys_overlap or splits > 1, DOT_PRECISION=_dot_precision(q4.dtype), HEAD_SPLITS=splits,
            SOFTCAP=bool(softcap), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )


def _bwd_split(dout4, q4, k4, v4, lse3, delta, segs, dq, dk, dv, softmax_scale, softcap, deterministic=False):
    """Launch the atomic-free backward: one dQ launch, one dK/dV launch per key-disjoint segment group."""
    B, _, H, D = q4.shape
    Hkv = k4.shape[2]
    arch = current_arch(q4.device)
    prec = _dot_precision(q4.dtype)
    scale, (qk_scale, cap_in) = float(softmax_scale), _score_args(softmax_scale, softcap)
    common = (
        q4.stride(0), q4.stride(1), q4.stride(2),
        k4.stride(0), k4.stride(1), k4.stride(2),
        v4.stride(0), v4.stride(1), v4.stride(2),
        dout4.stride(0), dout4.stride(1), dout4.stride(2),
        lse3.stride(0), lse3.stride(1), lse3.stride(2),
        delta.stride(0), delta.stride(1),
    )
    with launch_device(q4.device):
        cfg = bwd_dkdv_config(arch, D, q4.device, dtype=q4.dtype, deterministic=deterministic)
        if softcap:
            cfg = with_softcap("bwd_dkdv", cfg, D)
        groups = [(g, *_segment_args(g, q4.device)) for g in segs.key_groups()]
        splits = [head_splits(triton.cdiv(g.max_k_len, cfg.block_n) * B * nseg * Hkv, H // Hkv, q4.device,
                              q4.dtype) for g, _, nseg in groups]
        # Query heads split over programs: each part adds into its own fp32 buffer, summed in a fixed order below.
        parts = max(splits, default=1)
        dk_out, dv_out = (dk, dv) if parts == 1 else \
            (torch.zeros((parts, *t.shape), dtype=torch.float32, device=t.device) for t in (dk, dv))
        # Launches of one stream run in order, so the groups add into dk/dv in a fixed order too.
        for (group, table, nseg), n in zip(groups, splits):
            grid = (triton.cdiv(group.max_k_len, cfg.block_n), B * nseg, Hkv * n)
            _flash_bwd_dkdv_kernel[grid](
                q4, k4, v4, dout4, lse3, delta, table, dk_out, dv_out,
                scale, qk_scale, cap_in, nseg, H // Hkv, B, *common,
                *dk_out.stride()[-4:-1], *dv_out.stride()[-4:-1],
                HEAD_DIM=D, BLOCK_D=block_d(D), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                DOT_PRECISION=prec, HEAD_SPLITS=n, SOFTCAP=bool(softcap), num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
            )
        if parts > 1:
            dk.add_(dk_out.sum(0))
            dv.add_(dv_out.sum(0))
        if segs.max_q_len:
            cfg = bwd_dq_config(arch, D, q4.device, dtype=q4.dtype, deterministic=deterministic)
            table, nseg = _segment_args(segs, q4.device)
            grid = (triton.cdiv(segs.max_q_len, cfg.block_m), B * nseg, H)
            k_arg, v_arg, use_tma = _kv_args("bwd_dq", cfg, k4, v4, D)
            _flash_bwd_dq_kernel[grid](
                q4, k_arg, v_arg, dout4, lse3, delta, table, dq,
                scale, qk_scale, cap_in, nseg, H // Hkv, *common,
                dq.stride(0), dq.stride(1), dq.stride(2),
                HEAD_DIM=D, BLOCK_D=block_d(D), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                DOT_PRECISION=prec, USE_TMA=use_tma, SOFTCAP=bool(softcap), num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
            )


def attn_bwd_segments(dout4, q4, k4, v4, out4, lse3, segs, *, softmax_scale,
                      dq_acc=None, dk_acc=None, dv_acc=None, deterministic=False, softcap=0.0):
    """Backward attention of 4-D q/k/v over a segment table.

    Args:
        dout4, out4: [B, Sq, H, D], the gradient and the FINAL output of the rows (q's dtype or fp32).
        q4: [B, Sq, H, D]; k4, v4: [B, Sk, Hkv, D].
        lse3: fp32 [B, H, Sq], the FINAL lse of the rows (natural log).
        segs: ``Segments``; softmax_scale: float.
        dq_acc, dk_acc, dv_acc: optional fp32 buffers shaped like q/k/v; gradients are added into them.
        deterministic: True gives bitwise-reproducible gradients (the atomic-free split backward);
            False lets ``configs.bwd_impl`` pick the faster backward for the arch and head_dim.
        softcap: the forward's logit soft-cap (0 = off).
    Returns:
        (dq, dk, dv): the accumulators when given, else fresh tensors in the input dtypes.
        GQA: dk/dv are summed over the query heads of each kv head.
    Raises:
        ValueError/TypeError on mismatched shapes/dtypes of out, lse or the accumulators.
    """
    _check_runnable(q4)
    B, Sq, H, D = q4.shape
    Sk = k4.shape[1]
    for name, t in (("dout", dout4), ("out", out4)):
        if tuple(t.shape) != (B, Sq, H, D):
            raise ValueError(f"{name} must have q's shape {(B, Sq, H, D)}, got {tuple(t.shape)}")
        if t.device != q4.device:
            raise ValueError(f"{name} must be on {q4.device} like q, got {t.device}")
        _check_last_dim(name, t)
    if tuple(lse3.shape) != (B, H, Sq):
        raise ValueError(f"lse must have shape (batch, heads, seqlen_q) = {(B, H, Sq)}, got {tuple(lse3.shape)}")
    if lse3.dtype != torch.float32:
        raise TypeError(f"lse must be float32, got {lse3.dtype}")
    bufs = []
    for name, acc, like in (("dq_acc", dq_acc, q4), ("dk_acc", dk_acc, k4), ("dv_acc", dv_acc, v4)):
        if acc is None:
            bufs.append(torch.zeros(like.shape, dtype=torch.float32, device=like.device))
        else:
            _check_acc(name, acc, like.shape, like.device)
            _check_last_dim(name, acc)
            bufs.append(acc)
    dq, dk, dv = bufs
    if B and Sq and H and Sk and segs.table.shape[0] and segs.max_k_len:
        delta = _delta(out4, dout4)  # from dout/out as given (fp32 when the caller has fp32)
        if dout4.dtype != q4.dtype:
            # The tensor-core dots take dout in q's dtype (a ring may hand in an fp32 gradient).
            dout4 = dout4.to(q4.dtype)
        # Soft-capped gradients take the split backward: the atomic kernel spills with the cap (ndp_kernels.aot).
        impl = "split" if softcap else bwd_impl(current_arch(q4.device), D, q4.dtype,
                                                 deterministic=bool(deterministic), device=q4.device)
        if impl == "split":
            _bwd_split(dout4, q4, k4, v4, lse3, delta, segs, dq, dk, dv, softmax_scale, softcap,
                       deterministic=bool(deterministic))
        else:
            _bwd_atomic(dout4, q4, k4, v4, lse3, delta, segs, dq, dk, dv, softmax_scale, softcap)
    return (dq if dq_acc is not None else dq.to(q4.dtype),
            dk if dk_acc is not None else dk.to(k4.dtype),
            dv if dv_acc is not None else dv.to(v4.dtype))


# ----------------------------------------------------------------------------------------------
# public API (signatures in docs/design.md, "Tensor conventions")
# ----------------------------------------------------------------------------------------------

def flash_attn_fwd(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1),
                   cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                   out_acc=None, lse_acc=None, softcap=0.0):
    """Flash attention forward (Triton) returning the output and the log-sum-exp.

    Args:
        q: [B, Sq, H, D] (or packed [Tq, H, D] with cu_seqlens_q), fp16/bf16/fp32, 16 <= D <= 256.
        k, v: [B, Sk, Hkv, D] (or packed [Tk, Hkv, D]), H % Hkv == 0.
        causal: bottom-right aligned causal mask. softmax_scale: default D ** -0.5.
        window_size: (left, right), -1 = unlimited (flash-attn semantics).
        cu_seqlens_q/k: int32 [num_seqs + 1] document offsets for packed input; max_seqlen_q/k.
        out_acc, lse_acc: optional fp32 accumulators shaped like out and lse; merged in place by LSE
            in the kernel epilogue (the block result is never rounded to q's dtype).
        softcap: logit soft-capping (flash-attn's keyword): scores ``softcap * tanh(scores / softcap)``; 0 = off.
    Returns:
        (out, lse): out like q in q's dtype, lse fp32 [B, H, Sq] (or [H, Tq] when packed);
        or (out_acc, lse_acc) when given.
    Raises:
        ValueError/TypeError for bad input (the checks of ``ndp_kernels.segments.prepare``, shared
        with the reference); RuntimeError for CPU tensors without TRITON_INTERPRET=1.
    """
    return segments.run_fwd(
        attn_fwd_segments, q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, out_acc=out_acc, lse_acc=lse_acc, softcap=segments.check_softcap(softcap))


def flash_attn_bwd(dout, q, k, v, out, lse, causal=False, softmax_scale=None, window_size=(-1, -1),
                   cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                   dq_acc=None, dk_acc=None, dv_acc=None, deterministic=False, softcap=0.0):
    """Flash attention backward (Triton).

    Args:
        dout, out: like q; lse: fp32 [B, H, Sq] (or [H, Tq] when packed), from ``flash_attn_fwd``.
        q, k, v, causal, softmax_scale, window_size, cu_seqlens_*, max_seqlen_*: as in ``flash_attn_fwd``.
        dq_acc, dk_acc, dv_acc: optional fp32 buffers shaped like q, k, v (all three or none);
            gradients are added into them.
        deterministic: True gives bitwise-reproducible gradients (the atomic-free split backward,
            flash-attn's keyword); False lets ``ndp_kernels.configs.bwd_impl`` pick the faster one.
        softcap: the forward's soft-cap (0 = off).
    Returns:
        (dq, dk, dv) in the input dtypes, or the accumulators when given.
    Raises:
        ValueError/TypeError for bad input; RuntimeError for CPU tensors without TRITON_INTERPRET=1.
    """
    return segments.run_bwd(
        attn_bwd_segments, dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
        window_size=window_size, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dq_acc=dq_acc, dk_acc=dk_acc, dv_acc=dv_acc,
        deterministic=deterministic, softcap=segments.check_softcap(softcap))


class FlashAttnFunction(torch.autograd.Function):
    """Autograd wrapper: forward ``flash_attn_fwd``, backward ``flash_attn_bwd``."""

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, window_size, deterministic=False):
        out, lse = flash_attn_fwd(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                  window_size=window_size)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.softmax_scale, ctx.window_size = causal, softmax_scale, window_size
        ctx.deterministic = deterministic
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_attn_bwd(dout.contiguous(), q, k, v, out, lse, causal=ctx.causal,
                                    softmax_scale=ctx.softmax_scale, window_size=ctx.window_size,
                                    deterministic=ctx.deterministic)
        return dq, dk, dv, None, None, None, None


def flash_attn_func(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), deterministic=False):
    """Differentiable flash attention (Triton kernels forward and backward).

    Args:
        q: [B, Sq, H, D]; k, v: [B, Sk, Hkv, D]; fp16/bf16/fp32 on CUDA (or CPU under TRITON_INTERPRET=1).
        causal, softmax_scale, window_size: as in ``flash_attn_fwd``.
        deterministic: bitwise-reproducible gradients in the backward (see ``flash_attn_bwd``).
    Returns:
        out [B, Sq, H, D] in q's dtype.
    Raises:
        ValueError/TypeError for bad input.
    """
    return FlashAttnFunction.apply(q, k, v, causal, softmax_scale, tuple(window_size), bool(deterministic))
