"""Ring/all-gather schedules as data: which segment tables each (query rank, key rank) step runs.

Every CP implementation describes where the global tokens live (`Placement`: the global position of
every local row of every rank, plus document boundaries for packed input), cuts each rank's rows
into *runs* (arithmetic progressions of global positions inside one document), and turns a pair of
run lists (the queries a rank holds, the keys it holds at one step) into a `Step`: the blocks with
any unmasked entry, as segment rows `(q_start, q_len, k_start, k_len, band_lo, band_hi)` in local
coordinates (see ndp_kernels.segments). Masks are expressed only through the band, computed from
global positions, so one ring Function serves every layout:

- zigzag, diagonal step: the causal diagonal block of chunk r, and one segment for the second query
  half against both key chunks (full block merged with its causal diagonal);
  k rank < q rank: one full block of all queries against the first key half;
  k rank > q rank: one full block of the second query half against all keys.
- striped: the shifted causal block (band_hi = -1 when k rank > q rank).
- windows: band_lo/band_hi from global distances; packed documents: blocks only within a document.
- bidirectional spans (image blocks): a query run is cut where spans start and end (``span_cuts``); rows inside
  a span see every key before its end that the window reaches (the key run clipped there, no upper band limit).

Blocks whose query ranges overlap cannot share one segment table (a query row belongs to at most one
segment), so a step is a tuple of *passes*, each one table; partial results of the passes merge by
LSE like ring steps. Common layouts need one pass per step.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ndp_kernels.segments import span_cuts

NO_LIMIT = 1 << 30  # same sentinel as ndp_kernels.segments.NO_LIMIT

__all__ = ["Mask", "Placement", "Run", "Step", "RingSchedule", "build_step", "LAYOUTS"]

LAYOUTS = ("contiguous", "zigzag", "striped")


@dataclass(frozen=True)
class Mask:
    """Global attention mask: causal and/or a (left, right) window, both in global token distances; `spans`:
    sorted disjoint global ``(start, end)`` ranges attended bidirectionally on top of the causal mask."""
    causal: bool
    window: tuple = (-1, -1)
    spans: tuple = ()

    def band(self) -> tuple[int, int]:
        """(lo, hi) such that query position p sees key position t iff lo <= t - p <= hi."""
        left, right = self.window
        lo = -left if left >= 0 else -NO_LIMIT
        if self.causal:
            hi = 0
        else:
            hi = right if right >= 0 else NO_LIMIT
        return lo, hi


@dataclass(frozen=True)
class Run:
    """`length` local rows from `local_start`; row i holds global position `global_start + stride*i`."""
    local_start: int
    length: int
    global_start: int
    stride: int
    doc: int


@dataclass(frozen=True)
class Step:
    """The blocks one (query rows, key rows) pair computes.

    passes: tuple of tuples of segment rows; rows of one pass have disjoint query ranges.
    pairs: number of visible (query, key) pairs, i.e. FLOPs / (4 * batch * heads * head_dim).
    """
    passes: tuple
    pairs: int

    @property
    def empty(self) -> bool:
        return not self.passes


def _positions_to_runs(pos: np.ndarray, doc: np.ndarray) -> tuple[Run, ...]:
    """Cuts a rank's position vector into arithmetic runs inside one document (fewest of stride 1 or
    of the first difference's stride, so striped shards give one run)."""
    n = len(pos)
    if n == 0:
        return ()

    def cut(stride):
        brk = np.flatnonzero((np.diff(pos) != stride) | (np.diff(doc) != 0)) + 1
        starts = np.concatenate([[0], brk])
        ends = np.concatenate([brk, [n]])
        return starts, ends

    best = cut(1)
    if n > 1 and len(best[0]) > 1:
        s = int(pos[1] - pos[0])
        if s > 1:
            alt = cut(s)
            if len(alt[0]) < len(best[0]):
                best = alt
    starts, ends = best
    runs = []
    for a, b in zip(starts.tolist(), ends.tolist()):
        stride = int(pos[a + 1] - pos[a]) if b - a > 1 else 1
        runs.append(Run(a, b - a, int(pos[a]), stride, int(doc[a])))
    return tuple(runs)


class Placement:
    """Where the global tokens of one sequence (or packed batch of documents) live on N ranks.

    positions[r] is the int64 global position of each local row of rank r, in local order.
    cu_seqlens (numpy int64) gives document boundaries; a dense sequence is one document.
    """

    def __init__(self, positions, cu_seqlens):
        self.positions = tuple(np.asarray(p, dtype=np.int64) for p in positions)
        self.cu_seqlens = np.asarray(cu_seqlens, dtype=np.int64)
        self.world_size = len(self.positions)
        self.total = int(self.cu_seqlens[-1])
        self._runs = {}

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(len(p) for p in self.positions)

    def doc_of(self, pos: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.cu_seqlens, pos, side="right") - 1

    def runs(self, rank: int) -> tuple[Run, ...]:
        if rank not in self._runs:
            pos = self.positions[rank]
            self._runs[rank] = _positions_to_runs(pos, self.doc_of(pos))
        return self._runs[rank]

    def gathered_runs(self, order: np.ndarray) -> tuple[Run, ...]:
        """Runs of a buffer whose row t holds global position order[t] (all-gather / Ulysses)."""
        return _positions_to_runs(order, self.doc_of(order))

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def dense(seqlen: int, world_size: int, layout: str) -> "Placement":
        import torch
        import ndp._ops  # noqa: F401  registers torch.ops.ndp

        pos = [torch.ops.ndp.shard_index(seqlen, world_size, r, layout).numpy() for r in range(world_size)]
        return Placement(pos, [0, seqlen])

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def chunked(seqlen: int, world_size: int, layout: str, chunk: int) -> "Placement":
        """A dense sequence whose attention stays inside chunks of `chunk` tokens (Llama4): the chunks are the
        documents, so every schedule pairs only rows of one chunk."""
        dense = Placement.dense(seqlen, world_size, layout)
        return Placement(dense.positions, list(range(0, seqlen, chunk)) + [seqlen])


def _floordiv(a: int, b: int) -> int:
    return a // b


def _ceildiv(a: int, b: int) -> int:
    return -((-a) // b)


def _pair_block(qr: Run, kr: Run, k_offset: int, band: tuple[int, int]):
    """The segment row of query run qr against key run kr, or None when no pair is visible."""
    lo_g, hi_g = band
    assert qr.length == 1 or kr.length == 1 or qr.stride == kr.stride
    s = qr.stride if qr.length > 1 else kr.stride
    delta = kr.global_start - qr.global_start
    lo = -NO_LIMIT if lo_g <= -NO_LIMIT else _ceildiv(lo_g - delta, s)
    hi = NO_LIMIT if hi_g >= NO_LIMIT else _floordiv(hi_g - delta, s)
    ql, kl = qr.length, kr.length
    if lo > hi:
        return None
    i0, i1 = max(0, -hi), min(ql - 1, kl - 1 - lo)
    if i0 > i1:
        return None
    # Blocks keep their whole run ranges (aligned starts suit kernel tiles; masked tiles are skipped by
    # the kernels anyway); only the band is normalised, to NO_LIMIT where it covers the block.
    lo = -NO_LIMIT if lo <= -(ql - 1) else lo
    hi = NO_LIMIT if hi >= kl - 1 else hi
    return [qr.local_start, ql, k_offset + kr.local_start, kl, lo, hi]


def _full(b) -> bool:
    return b[4] == -NO_LIMIT and b[5] == NO_LIMIT


def _merge(blocks: list) -> list:
    """Merges blocks that form one band: full blocks adjacent in q with equal k range, and a full block
    followed (in k) by a block with no lower limit over the same q range (zigzag's second query half)."""
    changed = True
    while changed and len(blocks) > 1:
        changed = False
        blocks.sort(key=lambda b: (b[0], b[2]))
        out = []
        for b in blocks:
            if out:
                a = out[-1]
                if a[0] == b[0] and a[1] == b[1] and a[2] + a[3] == b[2] and _full(a) \
                        and b[4] == -NO_LIMIT and b[5] >= -1:
                    hi = NO_LIMIT if b[5] >= NO_LIMIT else b[5] + a[3]
                    out[-1] = [a[0], a[1], a[2], a[3] + b[3], -NO_LIMIT, hi]
                    changed = True
                    continue
            out.append(b)
        blocks = out
        # full blocks with the same key range and adjacent query ranges
        blocks.sort(key=lambda b: (b[2], b[3], b[0]))
        out = []
        for b in blocks:
            if out:
                a = out[-1]
                if _full(a) and _full(b) and a[2] == b[2] and a[3] == b[3] and a[0] + a[1] == b[0]:
                    out[-1] = [a[0], a[1] + b[1], a[2], a[3], -NO_LIMIT, NO_LIMIT]
                    changed = True
                    continue
            out.append(b)
        blocks = out
    return blocks


def block_pairs(b) -> int:
    """Visible (query, key) pairs of one segment row."""
    _, ql, _, kl, lo, hi = b
    if lo <= -(ql - 1) and hi >= kl - 1:
        return ql * kl
    i = np.arange(ql, dtype=np.int64)
    n = np.minimum(kl - 1, i + min(hi, kl)) - np.maximum(0, i + max(lo, -ql)) + 1
    return int(np.clip(n, 0, None).sum())


def _to_passes(blocks: list) -> tuple:
    """Greedy interval partitioning of blocks by query range: fewest passes with disjoint q ranges."""
    blocks = sorted(blocks, key=lambda b: (b[0], b[2]))
    passes, ends = [], []
    for b in blocks:
        for p, end in enumerate(ends):
            if b[0] >= end:
                passes[p].append(tuple(b))
                ends[p] = b[0] + b[1]
                break
        else:
            passes.append([tuple(b)])
            ends.append(b[0] + b[1])
    return tuple(tuple(p) for p in passes)


def _clipped(kr: Run, end: int) -> Run | None:
    """The rows of key run `kr` at global positions before `end`, or None."""
    n = min(kr.length, max(0, _ceildiv(end - kr.global_start, kr.stride)))
    return Run(kr.local_start, n, kr.global_start, kr.stride, kr.doc) if n else None


def _span_blocks(u: Run, kr: Run, k_offset: int, mask: Mask, band: tuple) -> list:
    """The segment rows of query run `u` against key run `kr` (none, one, or one per piece of `u` that the mask's
    spans cut: ``span_cuts``)."""
    out = []
    for i0, i1, end in span_cuts(u.global_start, u.length, u.stride, mask.spans):
        part = Run(u.local_start + i0, i1 - i0, u.global_start + u.stride * i0, u.stride, u.doc)
        keys = kr if end is None else _clipped(kr, end)
        b = None if keys is None else _pair_block(part, keys, k_offset, band if end is None else (band[0], NO_LIMIT))
        if b is not None:
            out.append(b)
    return out


def build_step(q_runs: tuple, k_runs: tuple, mask: Mask, k_offset: int = 0) -> Step:
    """The Step computing queries `q_runs` against keys `k_runs` (keys at rows k_offset + local)."""
    band = mask.band()
    by_doc = {}
    for kr in k_runs:
        by_doc.setdefault(kr.doc, []).append(kr)
    blocks = []
    for qr in q_runs:
        for kr in by_doc.get(qr.doc, ()):
            if qr.length > 1 and kr.length > 1 and qr.stride != kr.stride:
                # No band relates runs of different strides; fall back to one segment per query row
                # (never happens for the built-in layouts and packed plans).
                units = [Run(qr.local_start + i, 1, qr.global_start + qr.stride * i, 1, qr.doc)
                         for i in range(qr.length)]
            else:
                units = [qr]
            for u in units:
                blocks.extend(_span_blocks(u, kr, k_offset, mask, band))
    blocks = _merge(blocks)
    pairs = sum(block_pairs(b) for b in blocks)
    return Step(_to_passes(blocks), pairs)


class RingSchedule:
    """Per-(query rank, key rank) Steps of a ring over a Placement; built lazily and cached."""

    def __init__(self, placement: Placement, mask: Mask):
        self.placement = placement
        self.mask = mask
        self._steps = {}

    @property
    def world_size(self) -> int:
        return self.placement.world_size

    def step(self, q_rank: int, k_rank: int) -> Step:
        key = (q_rank, k_rank)
        if key not in self._steps:
            pl = self.placement
            self._steps[key] = build_step(pl.runs(q_rank), pl.runs(k_rank), self.mask)
        return self._steps[key]

    def pairs_per_rank(self) -> list[int]:
        n = self.world_size
        return [sum(self.step(q, k).pairs for k in range(n)) for q in range(n)]
