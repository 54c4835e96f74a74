"""Segment tables: the one masking model shared by every attention implementation in ndp.

Every local attention call is a batch of *segments*. ``q`` is 4-D ``[B, Sq, H, D]`` and ``k``, ``v`` are
``[B, Sk, Hkv, D]`` (packed input ``[T, H, D]`` is viewed as ``[1, T, H, D]`` and its lse ``[H, T]`` as
``[1, H, T]``). A segment is a row of an int32 table ``[nseg, 6]``::

    q_start, q_len, k_start, k_len, band_lo, band_hi

applied to every batch element: query row ``q_start + i`` may see key row ``k_start + j`` iff
``band_lo <= j - i <= band_hi``. ``+-NO_LIMIT`` means unlimited. Query ranges of different segments are
disjoint; key ranges may overlap. A query row in no segment, or one that sees no key, gets ``out = 0``,
``lse = -inf`` and zero gradients.

The public arguments (causal, window_size, cu_seqlens) map onto segments with bottom-right alignment
(flash-attn >= 2.1): with ``d = k_len - q_len``, causal gives ``band_hi = d``; a window ``(left, right)``
gives ``band_lo = d - left`` and ``band_hi = d + right`` (``-1`` leaves that side unlimited). The context
parallel layer builds its own tables from global token positions (zigzag, striped, packed documents).
"""
from __future__ import annotations

import functools
import math
import numbers

import torch
from torch.utils.weak import WeakTensorKeyDictionary

NO_LIMIT = 1 << 30
MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulator dtype for inputs of `dtype`: float32, except float64 stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def band(q_len: int, k_len: int, causal: bool, window_size=(-1, -1)) -> tuple[int, int]:
    """(band_lo, band_hi) of a bottom-right aligned segment of q_len queries and k_len keys."""
    left, right = window_size
    if causal:
        right = 0
    d = k_len - q_len
    lo = d - left if left >= 0 else -NO_LIMIT
    hi = d + right if right >= 0 else NO_LIMIT
    return lo, hi


class Segments:
    """An int32 segment table ``[nseg, 6]`` on the CPU plus the longest query and key ranges.

    Args:
        table: int32 ``[nseg, 6]`` CPU tensor (q_start, q_len, k_start, k_len, band_lo, band_hi).
        max_q_len / max_k_len: longest q_len / k_len (computed when omitted).
    """

    __slots__ = ("table", "max_q_len", "max_k_len", "_on", "_q_rows", "_keys_overlap", "_key_groups", "memo")

    def __init__(self, table: torch.Tensor, max_q_len: int | None = None, max_k_len: int | None = None):
        table = table.to("cpu", torch.int32).reshape(-1, 6).contiguous()
        self.table = table
        self.max_q_len = int(table[:, 1].max()) if max_q_len is None and len(table) else int(max_q_len or 0)
        self.max_k_len = int(table[:, 3].max()) if max_k_len is None and len(table) else int(max_k_len or 0)
        self._on = {}
        # Facts the launchers need on every call, computed on first use: a ring step reuses its
        # Segments, and the table is never modified after construction.
        self._q_rows = None
        self._keys_overlap = None
        self._key_groups = None
        # Per-table facts of the layers above (block class, engine plans), keyed by their owner.
        self.memo = {}

    def __len__(self) -> int:
        return self.table.shape[0]

    def __repr__(self) -> str:
        return f"Segments({self.table.tolist()})"

    def on(self, device) -> torch.Tensor:
        """The table on `device` (cached, so a ring step does not copy it again)."""
        device = torch.device(device)
        key = str(device)
        if key not in self._on:
            self._on[key] = self.table if device.type == "cpu" else self.table.to(device)
        return self._on[key]

    @property
    def q_rows(self) -> int:
        """Sum of q_len over all segments (cached)."""
        if self._q_rows is None:
            self._q_rows = sum(int(r[1]) for r in self.table.tolist())
        return self._q_rows

    def covers(self, seqlen_q: int) -> bool:
        """True when the query ranges cover all ``seqlen_q`` rows (they are disjoint, so lengths add up)."""
        return self.q_rows == seqlen_q

    @property
    def keys_overlap(self) -> bool:
        """True when two segments with work (q_len > 0, k_len > 0) share key rows (cached).

        The backward kernel then adds dk/dv with atomics.
        """
        if self._keys_overlap is None:
            rows = sorted((ks, ks + kl) for _, ql, ks, kl, _, _ in self.table.tolist() if ql > 0 and kl > 0)
            self._keys_overlap = any(rows[i + 1][0] < rows[i][1] for i in range(len(rows) - 1))
        return self._keys_overlap

    def key_groups(self) -> tuple["Segments", ...]:
        """The segments with work, partitioned into groups whose key ranges are disjoint (cached).

        Greedy interval partitioning by key range (the fewest groups): sorted by k_start, each
        segment joins the first group whose last key range ends at or before its start. The
        atomic-free dK/dV kernel is launched once per group, so within one launch every key row
        belongs to at most one segment. Segments without queries or keys (no gradient) are dropped.
        Returns ``(self,)`` when every segment has work and no key rows are shared.
        """
        if self._key_groups is None:
            rows = [tuple(r) for r in self.table.tolist() if r[1] > 0 and r[3] > 0]
            if len(rows) == len(self) and not self.keys_overlap:
                self._key_groups = (self,) if rows else ()
            else:
                groups, ends = [], []
                for r in sorted(rows, key=lambda r: (r[2], r[0])):
                    for i, end in enumerate(ends):
                        if r[2] >= end:
                            groups[i].append(r)
                            ends[i] = r[2] + r[3]
                            break
                    else:
                        groups.append([r])
                        ends.append(r[2] + r[3])
                self._key_groups = tuple(Segments.from_rows(g) for g in groups)
        return self._key_groups

    @staticmethod
    def from_rows(rows, max_q_len=None, max_k_len=None) -> "Segments":
        """Table from an iterable of (q_start, q_len, k_start, k_len, band_lo, band_hi)."""
        rows = [tuple(int(x) for x in r) for r in rows]
        table = torch.tensor(rows, dtype=torch.int32).reshape(-1, 6)
        return Segments(table, max_q_len, max_k_len)

    @staticmethod
    def dense(seqlen_q: int, seqlen_k: int, *, causal: bool, window_size=(-1, -1), spans=()) -> "Segments":
        """One bottom-right aligned segment covering the whole sequences (cached: tables are immutable, so
        the per-table facts the engines memoise carry over from one call of a layer to the next). With
        `spans` (``check_spans``; causal, seqlen_q == seqlen_k): one segment per run of rows outside a span, and
        per span, whose rows see every key before its end that the window reaches."""
        return _dense(int(seqlen_q), int(seqlen_k), bool(causal), tuple(int(w) for w in window_size), tuple(spans))

    @staticmethod
    def from_cu_seqlens(cu_q, cu_k, *, causal: bool, window_size=(-1, -1)) -> "Segments":
        """One bottom-right aligned segment per packed document."""
        cq = [int(x) for x in (cu_q.tolist() if torch.is_tensor(cu_q) else cu_q)]
        ck = [int(x) for x in (cu_k.tolist() if torch.is_tensor(cu_k) else cu_k)]
        rows = []
        for i in range(len(cq) - 1):
            lq, lk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
            if lq > 0:
                rows.append((cq[i], lq, ck[i], lk, *band(lq, lk, causal, window_size)))
        return Segments.from_rows(rows)

    def mask(self, seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
        """Dense bool ``[seqlen_q, seqlen_k]`` visibility mask (reference and tests only)."""
        m = torch.zeros(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
        for qs, ql, ks, kl, lo, hi in self.table.tolist():
            if ql <= 0 or kl <= 0:
                continue
            d = torch.arange(kl, device=device)[None, :] - torch.arange(ql, device=device)[:, None]
            m[qs:qs + ql, ks:ks + kl] |= (d >= lo) & (d <= hi)
        return m


@functools.lru_cache(maxsize=256)
def _dense(seqlen_q: int, seqlen_k: int, causal: bool, window_size: tuple, spans: tuple) -> Segments:
    if not spans:
        return Segments.from_rows([(0, seqlen_q, 0, seqlen_k, *band(seqlen_q, seqlen_k, causal, window_size))])
    left = window_size[0]
    rows = []
    for i0, i1, end in span_cuts(0, seqlen_q, 1, spans):
        if end is None:  # causal rows: keys up to the last of them, bottom-right aligned
            rows.append((i0, i1 - i0, 0, i1, *band(i1 - i0, i1, True, window_size)))
        else:  # a span's rows: every key before its end, from each row's window on
            rows.append((i0, i1 - i0, 0, end, i0 - left if left >= 0 else -NO_LIMIT, NO_LIMIT))
    return Segments.from_rows(rows)


def _check_tensor(name, x):
    if not torch.is_tensor(x):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}; pass torch.as_tensor({name})")


def check_qkv(q, k, v, *, packed: bool):
    """Validate q/k/v layout, dtype, device and strides. Raises ValueError/TypeError."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
    want = 3 if packed else 4
    layout = "[total_tokens, heads, head_dim] (packed, with cu_seqlens)" if packed else \
        "[batch, seq, heads, head_dim]"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != want:
            hint = " Packed input needs cu_seqlens_q and cu_seqlens_k." if x.dim() == 3 and not packed else ""
            raise ValueError(f"{name} must be {want}-D {layout}; got shape {tuple(x.shape)}.{hint}")
    if q.dtype not in FLOAT_DTYPES:
        raise TypeError(f"q must be float16, bfloat16, float32 or float64; got {q.dtype}. Cast q, k, v with "
                        f".to(torch.bfloat16) (or another float dtype).")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype; got q={q.dtype}, k={k.dtype}, v={v.dtype}. "
                        f"Cast them with .to({q.dtype}).")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device; got q={q.device}, k={k.device}, v={v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape (the attention functions also take a different value "
                         f"head size); got k={tuple(k.shape)}, v={tuple(v.shape)}. Pass the keys and values of the "
                         f"same tokens and kv heads.")
    if not packed and k.shape[0] != q.shape[0]:
        raise ValueError(f"q and k must have the same batch size; got q={q.shape[0]}, k={k.shape[0]}. Pass k and v "
                         f"with q's batch ({q.shape[0]}).")
    hq, hk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    if k.shape[-1] != d:
        raise ValueError(f"q and k must have the same head_dim; got q={d}, k={k.shape[-1]}. Project q, k and v to one "
                         f"head_dim.")
    if hk == 0 or hq % hk:
        raise ValueError(f"heads must be divisible by kv_heads (GQA/MQA); got heads={hq}, kv_heads={hk}. "
                         f"Use a kv_heads that divides {hq}.")
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]; got head_dim={d}. "
                         f"Pad the head dimension or split heads.")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have stride 1 in the last dim (head_dim), got stride "
                             f"{x.stride(-1)}; call .contiguous() on it.")


def _check_cu_meta(name, cu, device):
    """The checks of a cu_seqlens tensor that need no value (what a compiled caller checks while tracing)."""
    _check_tensor(name, cu)
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32; got {cu.dtype}. Use {name}.to(torch.int32).")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D [num_seqs + 1] with at least 2 entries; got shape {tuple(cu.shape)}. "
                         f"Use [0, len_1, len_1 + len_2, ...] (a leading 0, then the cumulative document lengths).")
    if cu.device != device:
        raise ValueError(f"{name} must be on the device of q ({device}); got {cu.device}")


def _cu_values(name, cu, total):
    """The values of a checked cu_seqlens tensor, checked: a leading 0, non-decreasing, ending at `total`."""
    vals = read_once(cu, "values", cu.tolist)
    if vals[0] != 0:
        raise ValueError(f"{name} must start at 0; got {name}[0]={vals[0]}. Prepend the 0: "
                         f"torch.cat([torch.zeros(1), lengths.cumsum(0)]).to(torch.int32).")
    bad = [i for i in range(len(vals) - 1) if vals[i + 1] < vals[i]]
    if bad:
        i = bad[0]
        raise ValueError(f"{name} must be non-decreasing; got {name}[{i}]={vals[i]} > {name}[{i + 1}]={vals[i + 1]}. "
                         f"It is the cumulative sum of the document lengths (each >= 0).")
    if vals[-1] != total:
        raise ValueError(f"{name}[-1] must equal the number of tokens ({total}); got {vals[-1]}. "
                         f"cu_seqlens is the cumulative sum of document lengths with a leading 0.")
    return vals


def check_window(window_size):
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise TypeError(f"window_size must be a pair (left, right) of ints; got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 = unlimited); got {window_size!r}")
    return left, right


def check_scale(softmax_scale, head_dim: int) -> float:
    """The softmax scale as a float: ``head_dim ** -0.5`` when None, else a finite number > 0.

    A NaN, infinite, zero or negative scale gives finite but meaningless attention (the kernels' running
    max and the reference disagree on what it means), so it is refused instead of computed.

    Raises:
        TypeError: not a real number.  ValueError: not finite or not > 0.
    """
    if softmax_scale is None:
        return head_dim ** -0.5
    is_real = isinstance(softmax_scale, numbers.Real) and not isinstance(softmax_scale, bool)
    if not (is_real or (torch.is_tensor(softmax_scale) and softmax_scale.numel() == 1)):
        raise TypeError(f"softmax_scale must be a real number or None (= head_dim ** -0.5); got "
                        f"{softmax_scale!r} ({type(softmax_scale).__name__})")
    scale = float(softmax_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale must be finite and > 0; got softmax_scale={scale!r}. Pass None for "
                         f"the default head_dim ** -0.5 = {head_dim ** -0.5:.6g} (head_dim={head_dim}).")
    return scale


def check_softcap(softcap) -> float:
    """The logit soft-cap as a float: 0.0 (off) for None or 0, else a finite number > 0 (flash-attn's
    ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before the mask and the softmax).

    Raises:
        TypeError: not a real number.  ValueError: negative or not finite.
    """
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number (0 or None = no soft-capping); got {softcap!r} "
                        f"({type(softcap).__name__})")
    cap = float(softcap)
    if not math.isfinite(cap) or cap < 0:
        raise ValueError(f"softcap must be finite and >= 0 (0 = no soft-capping); got softcap={cap!r}. Pass the "
                         f"model's cap (Gemma 2: config.attn_logit_softcapping = 50.0) or 0.")
    return cap


def check_spans(spans, seqlen: int, causal: bool) -> tuple:
    """`bidirectional_spans` as a tuple of ``(start, end)`` int pairs in ascending order: global positions
    ``[start, end)`` inside which every query sees every key (a vision-language model's image blocks), on top of a
    causal mask. None or empty gives ``()``. (Not sorted here: torch.compile traces this and cannot sort pairs.)

    Raises:
        TypeError: not pairs of ints.  ValueError: a span empty, outside ``[0, seqlen)``, overlapping or before the
        one before it, or given with a mask that is not causal.
    """
    if spans is None:
        return ()
    try:
        out = tuple((int(a), int(b)) for a, b in spans)
    except (TypeError, ValueError):
        raise TypeError(f"bidirectional_spans must be (start, end) pairs of ints; got {spans!r}") from None
    if not out:
        return ()
    if not causal:
        raise ValueError(f"bidirectional_spans widen a causal mask (every query of a span sees the whole span); "
                         f"with causal=False every query sees every key already. Pass causal=True, or no spans.")
    for (a, b), nxt in zip(out, out[1:] + ((seqlen, seqlen),)):
        if not 0 <= a < b <= seqlen or b > nxt[0]:
            raise ValueError(f"bidirectional_spans must be non-empty, disjoint [start, end) ranges of positions "
                             f"0 .. {seqlen - 1} (the whole sequence's) in ascending order; got {list(out)}: fix "
                             f"({a}, {b}).")
    return out


def flat_spans(spans) -> list[int]:
    """Spans as the flat int list a custom op takes: ``[start0, end0, start1, ...]`` (:func:`paired_spans`)."""
    return [int(x) for span in spans or () for x in span]


def paired_spans(flat) -> tuple:
    """The ``(start, end)`` pairs of :func:`flat_spans`' list."""
    return tuple(zip(flat[::2], flat[1::2]))


def span_cuts(first: int, count: int, stride: int, spans: tuple) -> list:
    """The rows ``0 .. count - 1`` of a run at global positions ``first + stride * i`` cut where `spans` (sorted,
    disjoint) start and end: ``(i0, i1, end)`` for rows ``[i0, i1)``, `end` the end of the span holding them or
    None outside every span. Inside a span a query sees every key before `end` that its window reaches."""
    def row(pos):  # the first row at or past global position pos
        return min(count, max(0, -((first - pos) // stride)))

    cuts, at = [], 0
    for a, b in spans:
        i0, i1 = row(a), row(b)
        if i0 >= i1:
            continue
        if at < i0:
            cuts.append((at, i0, None))
        cuts.append((i0, i1, b))
        at = i1
    if at < count:
        cuts.append((at, count, None))
    return cuts


def _value_head_differs(q, k, v) -> bool:
    """q, k, v are tensors of one layout whose only difference is the value head size (MLA)."""
    if not all(torch.is_tensor(x) and x.dim() in (3, 4) for x in (q, k, v)):
        return False
    return q.dim() == k.dim() == v.dim() and k.shape[-1] == q.shape[-1] and v.shape[:-1] == k.shape[:-1] \
        and v.shape[-1] != k.shape[-1] and v.shape[-1] > 0


def any_value_head(fn):
    """Let the attention function ``fn(q, k, v, *, softmax_scale, return_lse, ...)`` take a value head size
    unlike the query/key one (MLA: DeepSeek-V2/V3, MiniCPM3, Kimi; ``v`` ``[..., head_dim_v]``), exactly: the
    scale is fixed from q's head size first, then the smaller side is padded with zero columns to one head size
    (zero value columns add zero to the output; zero query/key columns leave every score unchanged) and the
    output is cut back to ``head_dim_v``. The kernels and the CP transfers see the padded V (the same cost as
    a value head of the query/key size); gradients flow through the pad and the cut."""
    @functools.wraps(fn)
    def call(q, k, v, *args, softmax_scale=None, return_lse=False, **kwargs):
        if not _value_head_differs(q, k, v):
            return fn(q, k, v, *args, softmax_scale=softmax_scale, return_lse=return_lse, **kwargs)
        d, dv = q.shape[-1], v.shape[-1]
        if softmax_scale is None:
            softmax_scale = d ** -0.5
        if dv < d:
            v = torch.nn.functional.pad(v, (0, d - dv))
        else:
            q, k = (torch.nn.functional.pad(x, (0, dv - d)) for x in (q, k))
        res = fn(q, k, v, *args, softmax_scale=softmax_scale, return_lse=return_lse, **kwargs)
        if return_lse:
            return res[0][..., :dv].contiguous(), res[1]
        return res[..., :dv].contiguous()
    return call


def check_call(q, k, v, *, softmax_scale=None, window_size=(-1, -1), cu_seqlens_q=None, cu_seqlens_k=None):
    """The checks of public attention arguments that read no tensor's values: shapes, dtypes, devices, strides,
    the scale and the window. A compiled caller runs them while tracing (no graph break); ``segments_of`` checks
    the values.

    Returns:
        (softmax_scale, window_size, packed)
    Raises:
        TypeError / ValueError naming the broken constraint, the values and the fix.
    """
    packed = cu_seqlens_q is not None or cu_seqlens_k is not None
    if packed and (cu_seqlens_q is None or cu_seqlens_k is None):
        raise ValueError("packed input needs both cu_seqlens_q and cu_seqlens_k (pass the same tensor twice "
                         "for self-attention)")
    check_qkv(q, k, v, packed=packed)
    window_size = check_window(window_size)
    softmax_scale = check_scale(softmax_scale, q.shape[-1])
    if packed:
        _check_cu_meta("cu_seqlens_q", cu_seqlens_q, q.device)
        _check_cu_meta("cu_seqlens_k", cu_seqlens_k, q.device)
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of documents; got "
                             f"{cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}. Pass one entry per "
                             f"document in both (the same tensor for self-attention).")
    return softmax_scale, window_size, packed


def segments_of(q, k, *, causal=False, window_size=(-1, -1), cu_seqlens_q=None, cu_seqlens_k=None,
                max_seqlen_q=None, max_seqlen_k=None, spans=()) -> Segments:
    """The segment table of a call that passed ``check_call``, after the checks of the cu_seqlens' values; `spans`
    (``check_spans``): bidirectional spans of dense rows, as many queries as keys.

    Raises:
        ValueError naming the broken constraint, the values and the fix.
    """
    if spans and (cu_seqlens_q is not None or q.shape[1] != k.shape[1]):
        got = ("packed documents (cu_seqlens, or position_ids that restart)" if cu_seqlens_q is not None else
               f"{q.shape[1]} queries and {k.shape[1]} keys (a KV cache)")
        raise ValueError(f"bidirectional_spans apply to dense rows with as many queries as keys; got {got}. Attend "
                         f"such calls without spans.")
    if cu_seqlens_q is None:
        return Segments.dense(q.shape[1], k.shape[1], causal=causal, window_size=window_size, spans=spans)
    cq = _cu_values("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    ck = _cu_values("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    segs = _packed(tuple(cq), tuple(ck), bool(causal), tuple(window_size))
    for name, given, actual in (("max_seqlen_q", max_seqlen_q, segs.max_q_len),
                                ("max_seqlen_k", max_seqlen_k, segs.max_k_len)):
        if given is not None and int(given) < actual:
            raise ValueError(f"{name}={given} is smaller than the longest document ({actual}); "
                             f"pass max of the document lengths or None")
    return segs


@functools.lru_cache(maxsize=64)
def _packed(cu_q: tuple, cu_k: tuple, causal: bool, window_size: tuple) -> Segments:
    # Cached like _dense: every layer of a step has the same documents, so they share one table and its memo.
    return Segments.from_cu_seqlens(cu_q, cu_k, causal=causal, window_size=window_size)


# What was read of a device tensor's values: {tensor: (version, copy of the values read, {key: value})}.
_READ = WeakTensorKeyDictionary()
# Device types whose tensors are read every time: on CPU a read costs nothing, and a tensor sharing numpy's memory
# changes its values without its version.
_READ_EVERY_TIME = {"cpu"}
_STALE = ("ndp: a cu_seqlens / position_ids tensor changed without its version counter (written by a collective "
          "such as dist.broadcast, or through .data) after ndp read it: pass a new tensor for each batch")


def read_once(t: torch.Tensor, key, read):
    """``read()``, a function of `t`'s values, remembered while they stay the same: every layer of a step passes
    the same cu_seqlens and position_ids, and on a GPU each read of their values waits for the device. A new
    version (an in-place write) reads again; a write that skips the version counter (a collective into the same
    buffer) is caught on the device by comparing with a copy of what was read, without waiting for it, and fails
    loudly (``torch._assert_async``) instead of reusing a stale read. Not remembered on CPU nor for inference
    tensors (no version counter)."""
    if t.device.type in _READ_EVERY_TIME or t.is_inference():
        return read()
    hit = _READ.get(t)
    if hit is None or hit[0] != t._version:
        hit = _READ[t] = (t._version, t.clone(), {})
    else:
        torch._assert_async((t == hit[1]).all(), _STALE)
    if key not in hit[2]:
        hit[2][key] = read()
    return hit[2][key]


def packed_rows_cu(pos: torch.Tensor, batch: int, seq: int) -> torch.Tensor | None:
    """int32 cu_seqlens of [batch, seq] rows flattened where the positions `pos` ([batch or 1, seq]) restart inside
    a row (packed documents, a document also starting at every row), else None (dense rows). Read once per
    positions tensor (``read_once``)."""
    def read():
        starts = position_restarts(pos.expand(batch, seq))
        return cu_from_starts(starts) if bool(starts.any()) else None
    return read_once(pos, ("packed_rows_cu", batch, seq), read)


def position_restarts(pos: torch.Tensor) -> torch.Tensor:
    """[batch, seq] bool: the tokens whose position does not continue the previous one's, where packed documents
    start (transformers' rule, masking_utils.find_packed_sequence_indices); all False for dense rows."""
    return torch.nn.functional.pad(pos[:, 1:] - pos[:, :-1] != 1, (1, 0))


def cu_from_starts(starts: torch.Tensor) -> torch.Tensor:
    """int32 cu_seqlens of [batch, seq] rows flattened, from a bool mask of the tokens that start a document (a
    document also starts at every row)."""
    starts = starts.clone()
    starts[:, 0] = True
    idx = torch.nonzero(starts.reshape(-1)).flatten()
    return torch.cat([idx, idx.new_tensor([starts.numel()])]).to(torch.int32)


def cu_from_position_ids(pos: torch.Tensor) -> torch.Tensor:
    return cu_from_starts(position_restarts(pos))


def prepare(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), cu_seqlens_q=None,
            cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    """Validate public attention arguments and turn them into 4-D views plus a segment table.

    Returns:
        (q4, k4, v4, segments, softmax_scale, packed)

    Raises:
        TypeError / ValueError naming the broken constraint, the values and the fix.
    """
    scale, window, packed = check_call(q, k, v, softmax_scale=softmax_scale, window_size=window_size,
                                       cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    segs = segments_of(q, k, causal=causal, window_size=window, cu_seqlens_q=cu_seqlens_q,
                       cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    if packed:
        return q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), segs, scale, True
    return q, k, v, segs, scale, False


def check_like(name, x, shape, dtype, device):
    """Check an output/accumulator/gradient argument has the expected shape, dtype and device."""
    _check_tensor(name, x)
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}; got {tuple(x.shape)}. Allocate it with "
                         f"torch.zeros({tuple(shape)}, dtype={dtype}).")
    if x.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}; got {x.dtype}. Allocate it with dtype={dtype}.")
    if x.device != device:
        raise ValueError(f"{name} must be on {device}; got {x.device}. Move it with .to({str(device)!r}).")


def lse_shape(q, packed: bool):
    """Public lse shape: [batch, heads, seq], or [heads, total_tokens] when packed."""
    return (q.shape[1], q.shape[0]) if packed else (q.shape[0], q.shape[2], q.shape[1])


def _acc_view(name, acc, shape, dtype, device, packed):
    if acc is None:
        return None
    check_like(name, acc, shape, dtype, device)
    return acc.unsqueeze(0) if packed else acc


def run_fwd(impl, q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), cu_seqlens_q=None,
            cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, out_acc=None, lse_acc=None, **kwargs):
    """Public-signature forward on top of a segment-level `impl(q4, k4, v4, segs, softmax_scale=,
    out_acc=, lse_acc=, **kwargs) -> (out, lse)`: validation, packed views and accumulator checks."""
    q4, k4, v4, segs, scale, packed = prepare(
        q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k)
    if (out_acc is None) != (lse_acc is None):
        raise ValueError("out_acc and lse_acc go together: pass both accumulators or neither")
    adt = acc_dtype(q.dtype)
    oa = _acc_view("out_acc", out_acc, q.shape, adt, q.device, packed)
    la = _acc_view("lse_acc", lse_acc, lse_shape(q, packed), adt, q.device, packed)
    out, lse = impl(q4, k4, v4, segs, softmax_scale=scale, out_acc=oa, lse_acc=la, **kwargs)
    if out_acc is not None:
        return out_acc, lse_acc
    return (out[0], lse[0]) if packed else (out, lse)


def run_bwd(impl, dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, window_size=(-1, -1),
            cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, dq_acc=None,
            dk_acc=None, dv_acc=None, **kwargs):
    """Public-signature backward on top of a segment-level `impl(dout4, q4, k4, v4, out4, lse3, segs,
    softmax_scale=, dq_acc=, dk_acc=, dv_acc=, **kwargs) -> (dq, dk, dv)`."""
    q4, k4, v4, segs, scale, packed = prepare(
        q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k)
    check_like("dout", dout, q.shape, q.dtype, q.device)
    check_like("out", out, q.shape, q.dtype, q.device)
    check_like("lse", lse, lse_shape(q, packed), acc_dtype(q.dtype), q.device)
    accs = [dq_acc, dk_acc, dv_acc]
    if any(a is not None for a in accs) and any(a is None for a in accs):
        raise ValueError("dq_acc, dk_acc and dv_acc go together: pass all three accumulators or none")
    adt = acc_dtype(q.dtype)
    dqa = _acc_view("dq_acc", dq_acc, q.shape, adt, q.device, packed)
    dka = _acc_view("dk_acc", dk_acc, k.shape, adt, q.device, packed)
    dva = _acc_view("dv_acc", dv_acc, v.shape, adt, q.device, packed)
    view = (lambda x: x.unsqueeze(0)) if packed else (lambda x: x)
    dq, dk, dv = impl(view(dout), q4, k4, v4, view(out), view(lse), segs, softmax_scale=scale,
                      dq_acc=dqa, dk_acc=dka, dv_acc=dva, **kwargs)
    if dq_acc is not None:
        return dq_acc, dk_acc, dv_acc
    return (dq[0], dk[0], dv[0]) if packed else (dq, dk, dv)


def check_merge_args(out_acc, lse_acc, block_out, block_lse):
    """Validate merge_attn_states_ arguments (fp32/fp64 accumulators, matching shapes)."""
    for name, x in (("out_acc", out_acc), ("lse_acc", lse_acc), ("block_out", block_out),
                    ("block_lse", block_lse)):
        _check_tensor(name, x)
    if out_acc.dtype not in (torch.float32, torch.float64) or lse_acc.dtype != out_acc.dtype:
        raise TypeError(f"out_acc and lse_acc must be float32 accumulators; got {out_acc.dtype}, {lse_acc.dtype}")
    if block_out.shape != out_acc.shape:
        raise ValueError(f"block_out must have out_acc's shape {tuple(out_acc.shape)}; got {tuple(block_out.shape)}. "
                         f"Merge blocks computed for the accumulator's rows.")
    if block_lse.shape != lse_acc.shape:
        raise ValueError(f"block_lse must have lse_acc's shape {tuple(lse_acc.shape)}; got {tuple(block_lse.shape)}. "
                         f"Pass the block's own lse ([batch, heads, seq]).")
    packed = out_acc.dim() == 3
    if out_acc.dim() not in (3, 4) or tuple(lse_acc.shape) != lse_shape(out_acc, packed):
        raise ValueError(f"out_acc must be [batch, seq, heads, dim] with lse [batch, heads, seq] (or packed "
                         f"[tokens, heads, dim] with lse [heads, tokens]); got {tuple(out_acc.shape)} and "
                         f"{tuple(lse_acc.shape)}")
