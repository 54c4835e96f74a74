"""Which engine runs each attention block: block classes, capabilities, and the measured choice of ``auto``.

Every block (a segment table over a query and a key range, see ``ndp_kernels.segments``) falls in one
class:

- ``full``:   one segment, every query sees every key;
- ``causal``: one segment with no lower limit and an upper one (bottom-right causal, or shifted);
- ``window``: one segment with a lower limit (sliding window);
- ``varlen``: several segments laid out back to back in queries and keys (packed documents);
- ``other``:  anything else (the zigzag ring's diagonal step, overlapping key ranges, ...).

An engine is *capable* of a block when it computes it exactly (no engine ever approximates a mask), in
the block's dtype, with deterministic gradients when asked, and with the logits soft-capped when asked
(``SOFTCAP_ENGINES``). ``auto`` runs, per block, the first capable
engine of a measured preference order for (device, class, dtype, head_dim bucket). The orders come from
a table written by ``python -m ndp.ops.tune`` on the device (user cache, see ``ndp_kernels.tuning``) or
shipped with ndp for that device; where no table has a row, ``auto`` uses a fixed default order and
``python -m ndp.info`` says so; on a GPU (``AUTO_PROBE``) such a row is measured once on first use instead and
saved into the user's table. The ``torch`` engine (the materialising reference) is chosen by ``auto`` only
for a block no other engine here can run exactly (a soft-capped block on CPU), with a warning once.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ndp_kernels import tuning

from . import _flash_attn, _flash_attn3, _reference, _sdpa, _triton

log = logging.getLogger(__name__)

__all__ = ["CLASSES", "ENGINE_MODULES", "ENGINES", "AUTO_ENGINES", "SOFTCAP_ENGINES", "engine_module", "block_class",
           "head_dim_bucket", "engine_available", "capable",
           "HEAD_KINDS", "head_kind", "row_key", "EngineTable", "engine_table", "table_rows", "adopt_rows",
           "measure_first_use", "choose", "SHIPPED_DIR"]

CLASSES = ("full", "causal", "window", "varlen", "other")
# The engines: name -> module exposing available(device), capable(segs, q4, k4, *, deterministic), fwd and bwd
# (the segment-level calls of ndp.ops.attention_fwd / attention_bwd) and SOFTCAP. A new engine is one module and
# one entry here (and in AUTO_ENGINES where auto may pick it).
ENGINE_MODULES = {"triton": _triton, "sdpa": _sdpa, "flash_attn": _flash_attn, "flash_attn3": _flash_attn3,
                  "torch": _reference}
ENGINES = tuple(ENGINE_MODULES)
AUTO_ENGINES = ("flash_attn3", "flash_attn", "sdpa", "triton")  # the engines auto picks first (the reference last)
# Engines that soft-cap the logits (Gemma 2's attn_logit_softcapping) in forward and backward.
SOFTCAP_ENGINES = tuple(name for name, m in ENGINE_MODULES.items() if m.SOFTCAP)
HEAD_DIM_BUCKETS = (32, 64, 128, 256)
# Rows may also be kept per head layout: "mha" (as many K/V heads as query heads) or "gqa" (fewer). On CUDA the
# fastest engine differs between them (cuDNN and the memory-efficient kernel run MHA only, flash runs GQA whole).
HEAD_KINDS = ("mha", "gqa")
SHIPPED_DIR = Path(__file__).resolve().parent / "tables"
# Used only where no measured table has a row for the block and none could be measured (printed as such by
# ndp.info). On CUDA, sdpa comes last: it runs where neither flash-attn nor triton is installed.
DEFAULT_ORDER = {"cuda": ("flash_attn", "triton", "sdpa"), "cpu": ("sdpa",)}


def head_kind(q4, k4) -> str:
    """The head layout of a block (HEAD_KINDS): "mha" when K/V have as many heads as the queries, else "gqa"."""
    return "mha" if q4.shape[2] == k4.shape[2] else "gqa"


def row_key(cls: str, dtype: torch.dtype, bucket: int, kind: str | None = None) -> tuple:
    """A table row's key: (class, dtype name, head_dim bucket[, head kind]); ``"/".join`` of it names it in a file."""
    return (cls, str(dtype).replace("torch.", ""), bucket) + ((kind,) if kind else ())


def head_dim_bucket(head_dim: int) -> int:
    """Smallest bucket >= head_dim (32, 64, 128, 256)."""
    for b in HEAD_DIM_BUCKETS:
        if head_dim <= b:
            return b
    return HEAD_DIM_BUCKETS[-1]


def _classify(rows, sq: int, sk: int) -> str:
    rows = [r for r in rows if r[1] > 0]
    if len(rows) == 1:
        qs, ql, ks, kl, lo, hi = rows[0]
        if qs != 0 or ql != sq or ks != 0 or kl != sk:
            return "other"
        lo_free = lo <= -(ql - 1)
        hi_free = hi >= kl - 1
        if lo_free and hi_free:
            return "full"
        if lo_free:
            return "causal"
        return "window"
    q_end = k_end = 0
    for qs, ql, ks, kl, _, _ in sorted(rows):
        if qs != q_end or ks != k_end:
            return "other"
        q_end, k_end = qs + ql, ks + kl
    return "varlen" if rows and q_end == sq and k_end == sk else "other"


def block_class(segs, sq: int, sk: int) -> str:
    """The class of a block (cached on the Segments table)."""
    key = ("class", sq, sk)
    hit = segs.memo.get(key)
    if hit is None:
        hit = segs.memo[key] = _classify(segs.table.tolist(), sq, sk)
    return hit


def engine_module(engine: str):
    """The module of engine `engine` (see ENGINE_MODULES).

    Raises:
        ValueError: unknown engine name.
    """
    module = ENGINE_MODULES.get(engine)
    if module is None:
        raise ValueError(f"unknown attention engine {engine!r}; engines are {ENGINES}")
    return module


def engine_available(engine: str, device) -> tuple[bool, str]:
    """(usable on `device`, reason when not) for one engine name."""
    return engine_module(engine).available(torch.device(device))


def capable(engine: str, segs, q4, k4, *, deterministic: bool = False, softcap: float = 0.0) -> tuple[bool, str]:
    """Whether `engine` computes this block exactly here (assumes it is available), and why not."""
    module = engine_module(engine)
    if softcap and not module.SOFTCAP:
        return False, f"{engine} has no logit soft-capping in ndp (engines with it: {SOFTCAP_ENGINES})"
    return module.capable(segs, q4, k4, deterministic=deterministic)


@dataclass
class EngineTable:
    """A measured preference table for one device: ``rows[(class, dtype, bucket[, head kind])] = {"order": [...],
    "ms": {...}}``; a row without a head kind serves both layouts."""
    device_key: str
    source: str                      # path of the file, or "none"
    rows: dict
    meta: dict
    shipped: set = field(default_factory=set)  # keys of the rows read from the package's table (not the user's)

    def row_of(self, cls: str, dtype: torch.dtype, bucket: int, kind: str | None = None):
        """The key of the row measured for exactly this block (its head kind's, else one for both layouts), or
        None."""
        return next((k for k in (row_key(cls, dtype, bucket, kind), row_key(cls, dtype, bucket)) if k in self.rows),
                    None)

    def row(self, cls: str, dtype: torch.dtype, bucket: int, kind: str | None = None):
        """The row measured for exactly this block (``row_of``), or None."""
        key = self.row_of(cls, dtype, bucket, kind)
        return None if key is None else self.rows[key]

    def order(self, cls: str, dtype: torch.dtype, bucket: int, kind: str | None = None):
        """(engine order, how it was found) for a block; order is () when no row applies."""
        row = self.row(cls, dtype, bucket, kind)
        if row is not None:
            return tuple(row["order"]), "measured"
        dt = row_key(cls, dtype, bucket)[1]
        # the nearest head_dim bucket, the block's head kind first
        near = sorted((abs(k[2] - bucket), len(k) == 4 and k[3] != kind, k) for k in self.rows
                      if k[0] == cls and k[1] == dt)
        if near:
            k = near[0][2]
            return tuple(self.rows[k]["order"]), f"measured at head_dim {k[2]}"
        other = sorted((k[1], k[2], k) for k in self.rows if k[0] == cls)
        if other:
            t, b, k = other[0]
            return tuple(self.rows[k]["order"]), f"measured for {t} head_dim {b}"
        return (), "no measured row"

    def rejected(self, cls: str, dtype: torch.dtype, bucket: int, kind: str | None = None) -> dict:
        """{engine: why} for the engines the measurement of this exact row rejected (wrong, or raised)."""
        return (self.row(cls, dtype, bucket, kind) or {}).get("rejected", {})


def parse_table(data: dict, source: str) -> EngineTable:
    """An EngineTable from the JSON written by ``ndp.ops.tune``.

    Raises:
        RuntimeError: malformed table (names the file and how to rebuild it).
    """
    try:
        rows = {}
        for key, row in data["rows"].items():
            cls, dt, bucket, *kind = key.split("/")
            if cls not in CLASSES or any(e not in ENGINES for e in row["order"]) or \
                    len(kind) > 1 or (kind and kind[0] not in HEAD_KINDS):
                raise ValueError(f"unknown class, engine or head kind in row {key!r}")
            rows[(cls, dt, int(bucket), *kind)] = row
        return EngineTable(data["device_key"], source, rows, {k: v for k, v in data.items() if k != "rows"})
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise RuntimeError(f"engine table {source} is malformed ({e}); delete it or rebuild it with "
                           f"`python -m ndp.ops.tune`") from None


_TABLES: dict = {}


def engine_table(device, *, reload: bool = False) -> EngineTable:
    """The engine table in use for `device`: the one shipped in the package for its model (SHIPPED_DIR) under the
    user's tuned table, whose rows win (a row measured here for another block keeps the shipped ones); an empty
    table where neither exists."""
    key = tuning.device_key(device)
    if not reload and key in _TABLES:
        return _TABLES[key]
    table = EngineTable(key, "none", {}, {})
    for path, shipped in ((tuning.table_path("engines", key, SHIPPED_DIR), True), (tuning.table_path("engines", key),
                                                                                   False)):
        data = tuning.load_json(path)
        if data is not None:
            part = parse_table(data, str(path))
            table.rows.update(part.rows)
            table.shipped = set(part.rows) if shipped else table.shipped - set(part.rows)
            table.source, table.meta = part.source, part.meta
    _TABLES[key] = table
    return table


def _measured_here(table: EngineTable, cls: str, dtype, bucket: int, kind: str, device) -> bool:
    """Whether `table` decides this block on `device` without a measurement: it has a row measured for exactly it,
    unless that row shipped with ndp and an engine auto may run here was not installed where it was measured
    (``"engines"`` of the row; e.g. the H100 rows, measured without flash-attn, on a machine with it): that row is
    measured here, where measuring is allowed."""
    key = table.row_of(cls, dtype, bucket, kind)
    if key is None:
        return False
    if key not in table.shipped:
        return True
    installed = table.rows[key].get("engines", ())
    return all(e in installed or not engine_available(e, device)[0] for e in AUTO_ENGINES)


# Device types on which auto measures a missing table row on first use (``ndp.ops.tune.probe_row``) instead of
# taking DEFAULT_ORDER. CPU ships its table; set to () to never probe.
AUTO_PROBE = ("cuda",)
_PROBE_FAILED: set = set()
# The module that measures rows (``ndp.ops.tune``: it times the engines through ``attention``, which imports this
# module, so it registers itself when it loads; ndp.ops imports it). None: the table's rows or DEFAULT_ORDER.
_TUNER = None


def use_tuner(module) -> None:
    """Registers the module whose ``probe_row(device, cls, dtype, bucket, kind)`` measures a missing row on first
    use."""
    global _TUNER
    _TUNER = module


def _may_probe(device) -> bool:
    return _TUNER is not None and tuning.may_measure(device, AUTO_PROBE)


def _probe(table: EngineTable, cls: str, dtype, bucket: int, kind: str, device) -> tuple:
    """Measures the row once (see ``tune.probe_row``), adds it to the in-memory table, returns its order; on
    failure (logged once) the order the table had for a neighbouring row, else () (auto then takes DEFAULT_ORDER)."""
    key = row_key(cls, dtype, bucket, kind)
    if (table.device_key,) + key in _PROBE_FAILED:
        return table.order(cls, dtype, bucket, kind)[0]
    log.info("auto: no engine row measured here for %s on %s; measuring it once (python -m ndp.ops.tune measures the "
             "whole table)", "/".join(map(str, key)), table.device_key)
    try:
        return _measure(table, cls, dtype, bucket, kind, device)
    except Exception as e:
        _PROBE_FAILED.add((table.device_key,) + key)
        log.warning("auto: measuring engines for %s on %s failed (%s: %s); using the table's nearest row or the "
                    "default order %s", "/".join(map(str, key)), table.device_key, type(e).__name__, e,
                    DEFAULT_ORDER.get(device.type))
        return table.order(cls, dtype, bucket, kind)[0]


def _measure(table: EngineTable, cls: str, dtype, bucket: int, kind: str, device) -> tuple:
    row, key = _TUNER.probe_row(device, cls, dtype, bucket, kind), row_key(cls, dtype, bucket, kind)
    table.rows[key] = row
    table.shipped.discard(key)
    if table.source == "none":
        table.source = str(tuning.table_path("engines", table.device_key))
    return tuple(row["order"])


def measure_first_use(cls: str, dtype: torch.dtype, head_dim: int, kind: str, device) -> None:
    """Measures now the row (cls, dtype, head_dim bucket, head kind) that auto's first block of that kind on
    `device` would (no measured row, measurement allowed here); a failure raises (``ndp.warmup`` reports it)."""
    table, bucket = engine_table(device), head_dim_bucket(head_dim)
    if not _measured_here(table, cls, dtype, bucket, kind, device) and _may_probe(device):
        _measure(table, cls, dtype, bucket, kind, device)


def table_rows(device) -> dict:
    """The rows of `device`'s engine table in use, keyed as in its file (``class/dtype/bucket[/head kind]``)."""
    return {"/".join(map(str, k)): row for k, row in engine_table(device).rows.items()}


def adopt_rows(device, rows: dict) -> None:
    """Takes `rows` (``table_rows`` of another process: ``ndp.ops.tune.warmup``'s rank 0) as `device`'s rows,
    here and in the user's table on this machine; rows of the same keys are replaced, every other row stays."""
    if not rows:
        return
    table = engine_table(device)
    adopted = parse_table({"device_key": table.device_key, "rows": rows}, "rows adopted").rows
    table.rows.update(adopted)
    table.shipped -= set(adopted)
    path = tuning.table_path("engines", table.device_key)
    tuning.merge_rows(path, rows, lambda: {"device_key": table.device_key}, replace=True)
    if table.source == "none":
        table.source = str(path)


_WARNED_REFERENCE: set = set()


def _reference_as_last_resort(cls: str, q4, reasons: dict) -> str:
    """auto's answer for a block only the reference can run here: "torch", with a warning once per dtype and device."""
    key = (q4.dtype, str(q4.device))
    if key not in _WARNED_REFERENCE:
        _WARNED_REFERENCE.add(key)
        log.warning("auto: no fast attention engine can run this %s block (%s, head_dim %d) on %s (%s); running "
                    "the materialising reference (backend='torch': memory grows with seq_q * seq_k)", cls, q4.dtype,
                    q4.shape[-1], q4.device, "; ".join(f"{e}: {w}" for e, w in reasons.items()))
    return "torch"


def choose(segs, q4, k4, *, deterministic: bool = False, softcap: float = 0.0) -> str:
    """The engine ``auto`` runs for this block (cached on the table per dtype, head_dim, device).

    Raises:
        RuntimeError: no engine here can run the block (the message lists each engine's reason).
    """
    sq, sk = q4.shape[1], k4.shape[1]
    kind = head_kind(q4, k4)
    key = ("auto", sq, sk, q4.dtype, q4.shape[-1], kind, str(q4.device), deterministic, bool(softcap))
    hit = segs.memo.get(key)
    if hit is not None:
        return hit
    cls = block_class(segs, sq, sk)
    table = engine_table(q4.device)
    bucket = head_dim_bucket(q4.shape[-1])
    order, _ = table.order(cls, q4.dtype, bucket, kind)
    if not _measured_here(table, cls, q4.dtype, bucket, kind, q4.device) and _may_probe(q4.device):
        order = _probe(table, cls, q4.dtype, bucket, kind, q4.device)
    fallback = DEFAULT_ORDER.get(q4.device.type, ("triton",))
    reasons = dict(table.rejected(cls, q4.dtype, bucket, kind))  # failed their measurement here: never run by auto
    for e in tuple(order) + tuple(x for x in fallback if x not in order):
        if e not in AUTO_ENGINES or e in reasons:
            continue
        ok, why = engine_available(e, q4.device)
        if ok:
            ok, why = capable(e, segs, q4, k4, deterministic=deterministic, softcap=softcap)
        if ok:
            segs.memo[key] = e
            return e
        reasons[e] = why
    if softcap:  # soft-capping is the one feature the reference alone has on some devices (CPU)
        segs.memo[key] = _reference_as_last_resort(cls, q4, reasons)
        return segs.memo[key]
    detail = "; ".join(f"{e}: {w}" for e, w in reasons.items()) or "no engine is listed for this device"
    raise RuntimeError(f"no attention engine can run this {cls} block ({q4.dtype}, head_dim {q4.shape[-1]}) on "
                       f"{q4.device} with backend='auto' ({detail}). backend='torch' (the reference) runs "
                       f"everything.")
