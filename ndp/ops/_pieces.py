"""Segment tables cut into the block shapes that fused attention libraries run exactly.

torch's SDPA ops (and flash-attn's dense API) compute either a full block or a top-left causal block
(row ``i`` sees keys ``0..i``); anything else needs an explicit mask. A segment row ``(q_start, q_len,
k_start, k_len, band_lo, band_hi)`` (see ``ndp_kernels.segments``) is cut into *pieces*:

- ``full``:   rows ``[q0, q1)`` see every key of ``[k0, k1)``;
- ``causal``: a square (``q1 - q0 == k1 - k0``) where row ``q0 + t`` sees keys ``k0 .. k0 + t``;
- ``mask``:   rows ``[q0, q1)`` against keys ``[k0, k1)`` with the band ``lo <= j - i <= hi`` in piece
  coordinates; row tiles keep each mask small (a sliding window costs O(rows * window), not O(rows^2)).

A segment whose band has no lower limit (causal, bottom-right or shifted like the striped ring's
``band_hi = -1``) becomes at most one full piece plus one causal piece over the same rows, plus one full
piece for the rows that see every key; rows that see no key get no piece. Pieces over the same rows are
merged by LSE like ring steps. A whole table that is one top-left causal block (the zigzag ring's
diagonal step: two segments) is recognised and run as one causal piece.

Every piece has at least one visible key in each of its rows, so no engine ever sees an empty row.
"""
from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import torch

from ndp import _ops
from ndp_kernels.segments import NO_LIMIT, acc_dtype

__all__ = ["Piece", "Call", "plan_pieces", "pieces_of", "run_pieces_fwd", "run_pieces_bwd", "MASK_TILE_ROWS", "rows",
           "as_dtype", "lse_from_flash", "lse_for_flash"]

# Rows per masked piece: bounds a mask to MASK_TILE_ROWS x (MASK_TILE_ROWS + window) entries.
MASK_TILE_ROWS = 1024


@dataclass(frozen=True)
class Piece:
    """One dense attention call: rows [q0, q1) against keys [k0, k1) of the block, `kind` full|causal|mask;
    lo/hi is the band (j - i, piece coordinates) of a mask piece."""
    kind: str
    q0: int
    q1: int
    k0: int
    k1: int
    lo: int = -NO_LIMIT
    hi: int = NO_LIMIT

    @property
    def rows(self) -> int:
        return self.q1 - self.q0


def _visible_rows(ql: int, kl: int, lo: int, hi: int):
    """(i0, i1) inclusive: the rows of a segment that see at least one key, or None."""
    if lo > hi or ql <= 0 or kl <= 0:
        return None
    i0 = max(0, -hi) if hi < NO_LIMIT else 0
    i1 = min(ql - 1, kl - 1 - lo) if lo > -NO_LIMIT else ql - 1
    return (i0, i1) if i0 <= i1 else None


def _segment_pieces(qs: int, ql: int, ks: int, kl: int, lo: int, hi: int, mask_rows: int) -> list[Piece]:
    rows = _visible_rows(ql, kl, lo, hi)
    if rows is None:
        return []
    i0, i1 = rows
    lo_free = lo <= -NO_LIMIT or i1 + lo <= 0          # every row's first visible key is key 0
    hi_free = hi >= NO_LIMIT or i0 + hi >= kl - 1      # every row's last visible key is the last key
    if lo_free and hi_free:
        return [Piece("full", qs + i0, qs + i1 + 1, ks, ks + kl)]
    if lo_free:
        # Row i sees keys 0 .. min(kl-1, i+hi). Rows up to iE = kl-1-hi form "keys [0, c) for all, then
        # a causal square" (c = i0 + hi, the last key of row i0); later rows see every key.
        out = []
        i_e = min(i1, kl - 1 - hi)
        c = i0 + hi
        n = i_e - i0 + 1
        if c > 0:
            out.append(Piece("full", qs + i0, qs + i_e + 1, ks, ks + c))
        out.append(Piece("causal", qs + i0, qs + i_e + 1, ks + c, ks + c + n))
        if i_e < i1:
            out.append(Piece("full", qs + i_e + 1, qs + i1 + 1, ks, ks + kl))
        return out
    # A lower limit (sliding window, or a band bounded on both sides): masked row tiles, each against
    # only the keys its rows can see.
    out = []
    for r0 in range(i0, i1 + 1, mask_rows):
        r1 = min(i1, r0 + mask_rows - 1)
        k_lo = max(0, r0 + lo)
        k_hi = min(kl - 1, r1 + hi) if hi < NO_LIMIT else kl - 1
        # Band in piece coordinates: j' = j - k_lo, i' = i - r0, so j' - i' = (j - i) - (k_lo - r0).
        shift = k_lo - r0
        p_lo = lo - shift
        p_hi = hi - shift if hi < NO_LIMIT else NO_LIMIT
        out.append(Piece("mask", qs + r0, qs + r1 + 1, ks + k_lo, ks + k_hi + 1, p_lo, p_hi))
    return out


def _whole_causal(rows, sq: int, sk: int) -> bool:
    """True when the table is exactly top-left causal over [0, sq) x [0, sk) (row x sees keys 0..x)."""
    if sq > sk:
        return False
    covered = 0
    for qs, ql, ks, kl, lo, hi in sorted(rows):
        if ql <= 0:
            continue
        # Rows qs + i must see keys 0 .. qs + i: no cut at key 0 (i + lo <= 0 for every i), the band ending
        # at the diagonal (hi == qs) and enough keys for the last row.
        if qs != covered or ks != 0 or hi != qs or kl < qs + ql or lo > -(ql - 1):
            return False
        covered = qs + ql
    return covered == sq


def plan_pieces(rows, sq: int, sk: int, mask_rows: int = MASK_TILE_ROWS) -> tuple[Piece, ...]:
    """The pieces of a segment table over a block of sq query rows and sk key rows.

    Args:
        rows: iterable of (q_start, q_len, k_start, k_len, band_lo, band_hi).
        sq, sk: the block's query and key rows.
        mask_rows: row tile of masked pieces.
    Returns:
        tuple of ``Piece``; a row of the block covered by no piece sees no key.
    """
    rows = [tuple(int(x) for x in r) for r in rows]
    if len(rows) > 1 and _whole_causal(rows, sq, sk):
        return (Piece("causal", 0, sq, 0, sq),)
    out = []
    for r in rows:
        out.extend(_segment_pieces(*r, mask_rows=mask_rows))
    return tuple(out)


def pieces_of(segs, sq: int, sk: int) -> tuple[Piece, ...]:
    """The piece plan of a Segments table for a block of sq x sk rows (cached on the table)."""
    key = ("pieces", sq, sk)
    hit = segs.memo.get(key)
    if hit is None:
        hit = segs.memo[key] = plan_pieces(segs.table.tolist(), sq, sk)
    return hit


Call = namedtuple("Call", "piece kernel fwd bwd")
# A call runs one piece on one kernel: ``fwd(piece, q4, k4, v4, scale) -> (o [B, n, H, D], lse [B, H, n])`` and
# ``bwd(piece, do4, q4, k4, v4, o4, lse3, scale) -> (dq [B, n, H, D], dk, dv [B, m, Hkv, D])``, given the whole
# block's tensors (each call slices its rows). The engines build the list: ``_sdpa`` (CPU), ``_sdpa_cuda``.

def _merge(out_acc, lse_acc, piece, o, lse):
    """Merges a piece result (o [B, n, H, D], lse [B, H, n]) into the rows of the accumulators."""
    oa = rows(out_acc, piece.q0, piece.q1)
    la = rows(lse_acc, piece.q0, piece.q1, 2)
    _ops.merge_attn_states_(oa, la, o, as_dtype(lse, lse_acc.dtype))


def _covers(piece, sq, sk=None) -> bool:
    return piece.q0 == 0 and piece.q1 == sq and (sk is None or (piece.k0 == 0 and piece.k1 == sk))


def rows(x, a: int, b: int, dim: int = 1):
    """x's rows [a, b) along `dim`: x itself where that is all of them. A piece usually covers its whole block,
    and each slice costs a few microseconds of host time per call (CPU-measured)."""
    return x if a == 0 and b == x.shape[dim] else x.narrow(dim, a, b - a)


def as_dtype(x, dtype):
    """x in `dtype`, without the call where it already is (host time, as `rows`)."""
    return x if x.dtype == dtype else x.to(dtype)


def lse_from_flash(lse):
    """A flash kernel's lse in ndp's convention: flash writes +inf for a row that sees no key, ndp (and the merge)
    has -inf there."""
    return lse.masked_fill(lse == float("inf"), float("-inf"))


def lse_for_flash(lse):
    """ndp's lse as a flash kernel's backward takes it: one flash call runs a whole block, whose rows may see no
    key (lse -inf); flash takes P = exp(s - lse), so +inf there makes their probabilities exact zeros where -inf
    would give NaN. (The other kernels run pieces, whose rows all see a key: their lse is finite.)"""
    return lse.masked_fill(lse == float("-inf"), float("inf"))


def heads_first(x):
    """[B, S, H, D] -> [B, H, S, D] view (no copy): the layout torch's SDPA kernels take."""
    return x.transpose(1, 2)


def run_pieces_fwd(calls, q4, k4, v4, scale, out_acc=None, lse_acc=None):
    """Forward of a block as `calls`. Returns (out in q4's dtype, lse in its accumulator dtype), or
    (out_acc, lse_acc) with every piece merged in; rows no piece covers see no key (0, -inf)."""
    b, sq, h, _ = q4.shape
    adt = acc_dtype(q4.dtype)
    if out_acc is None and len(calls) == 1 and _covers(calls[0].piece, sq):
        o, lse = calls[0].fwd(calls[0].piece, q4, k4, v4, scale)
        return o, as_dtype(lse, adt)
    own = out_acc is None
    if own:
        out_acc = torch.zeros(q4.shape, dtype=adt, device=q4.device)
        lse_acc = torch.full((b, h, sq), float("-inf"), dtype=adt, device=q4.device)
    for c in calls:
        o, lse = c.fwd(c.piece, q4, k4, v4, scale)
        _merge(out_acc, lse_acc, c.piece, o, lse)
    if own:
        return as_dtype(out_acc, q4.dtype), lse_acc
    return out_acc, lse_acc


def run_pieces_bwd(calls, do4, q4, k4, v4, o4, lse3, scale, dq_acc=None, dk_acc=None, dv_acc=None):
    """Backward of a block as `calls` given the rows' final out and lse. Returns (dq, dk, dv) in the inputs'
    dtype, or the accumulators with every piece's gradients added. Every row of a piece sees a key, so its lse is
    finite (a flash call over a whole block, whose rows may see none, converts it: ``lse_for_flash``)."""
    lse3 = lse3.double() if q4.dtype == torch.float64 else lse3
    own = dq_acc is None
    if own and len(calls) == 1 and _covers(calls[0].piece, q4.shape[1], k4.shape[1]):
        c = calls[0]
        return tuple(as_dtype(g, x.dtype) for g, x in zip(c.bwd(c.piece, do4, q4, k4, v4, o4, lse3, scale),
                                                           (q4, k4, v4)))
    if own:
        adt = acc_dtype(q4.dtype)
        dq_acc, dk_acc, dv_acc = (torch.zeros(x.shape, dtype=adt, device=x.device) for x in (q4, k4, v4))
    for c in calls:
        p = c.piece
        dq, dk, dv = c.bwd(p, do4, q4, k4, v4, o4, lse3, scale)
        dq_acc[:, p.q0:p.q1] += dq
        dk_acc[:, p.k0:p.k1] += dk
        dv_acc[:, p.k0:p.k1] += dv
    if own:
        return as_dtype(dq_acc, q4.dtype), as_dtype(dk_acc, k4.dtype), as_dtype(dv_acc, v4.dtype)
    return dq_acc, dk_acc, dv_acc
