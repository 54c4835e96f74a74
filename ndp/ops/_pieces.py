"""Segment tables cut into the block shapes that fused attention libraries run exactly.

torch's SDPA ops (and flash-attn's dense API) compute either a full block or a top-left causal block
(row ``i`` sees keys ``0..i``); anything else needs an explicit mask. A segment row ``(q_start, q_len,
k_start, k_len, band_lo, band_hi)`` (see ``ndp_kernels._segments``) is cut into *pieces*:

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

from dataclasses import dataclass

from ndp_kernels._segments import NO_LIMIT

__all__ = ["Piece", "plan_pieces", "MASK_TILE_ROWS"]

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
