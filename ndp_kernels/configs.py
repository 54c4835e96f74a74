"""Launch configurations (block sizes, warps, pipeline stages) of the Triton attention kernels.

A table measured on the user's GPU (``python -m ndp_kernels.tune``, written to the tuning cache, see
``ndp_kernels.tuning``) is read first, over the one shipped for that GPU model (``SHIPPED_DIR``); a ``with
override(kind, cfg)`` block forces one configuration (what the tuner uses to time candidates). Otherwise the shipped
static tables below apply, except for the choices they leave unmeasured on a GPU (TMA K/V loads, atomic vs split
backward, ``PROBE_ALTERNATES``): where the table has no row for them, the first launch measures them once
(``AUTO_PROBE``, ``tune.probe``) and adds the rows.

One static table per architecture family and head_dim bucket. The values are chosen so that the
ahead-of-time compiles (``python -m ndp_kernels.aot``) have no register spills and fit the
shared memory of the SM (227 KB on sm_90, 163 KB on sm_80) for fp16, bf16 and fp32, under both
triton 3.9 (the test venv) and triton 3.6 (what the GPU users run with torch 2.11): the two
compilers allocate registers differently, and a config free of spills on one can spill on the
other. The static report in the README is produced from exactly these entries.

``"interpreter"`` is used under ``TRITON_INTERPRET=1``: the interpreter pays a fixed Python
cost per program and per block operation, so moderately large blocks keep tests fast.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from pathlib import Path

import torch
import triton

from . import interpreter_active, tuning

log = logging.getLogger("ndp_kernels")

__all__ = ["KernelConfig", "ARCHS", "kernel_bucket", "block_d", "current_arch", "fwd_config",
           "adopt_rows", "measure_first_use", "bwd_config", "bwd_dkdv_config", "bwd_dq_config", "bwd_impl",
           "merge_config", "launch_device", "override", "no_probe", "tma_here", "AUTO_PROBE", "head_splits",
           "sm_count", "SHIPPED_DIR"]

ARCHS = ("sm_80", "sm_90")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile shape and launch parameters of one kernel.

    ``block_m`` tiles the query rows and ``block_n`` the key rows; both kernels read the
    same two fields (the backward kernel owns a key block and walks query blocks).
    """
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # The kernels that walk key blocks (forward, split-backward dQ): K/V blocks by TMA (host tensor descriptors,
    # sm_90+, fp16/bf16) instead of pointer loads. No static table sets it (not yet timed on a GPU); on sm_90 the
    # first launch measures the static tiles with and without it, and `python -m ndp_kernels.tune` every tile.
    tma: bool = False

    def __str__(self) -> str:
        return f"M{self.block_m}/N{self.block_n}/w{self.num_warps}/s{self.num_stages}" + ("/tma" if self.tma else "")

    def as_row(self) -> list:
        """The tuned-table form, read back by ``KernelConfig(*row)``."""
        return [self.block_m, self.block_n, self.num_warps, self.num_stages] + ([True] if self.tma else [])


def kernel_bucket(head_dim: int) -> int:
    """The head_dim bucket of the kernel tables (64, 128 or 256) whose configuration serves ``head_dim`` (the engine
    tables bucket more finely: ``ndp.ops.engines.head_dim_bucket``)."""
    if head_dim <= 64:
        return 64
    if head_dim <= 128:
        return 128
    return 256


def block_d(head_dim: int) -> int:
    """Padded head dim of the tiles: next power of two (>= 16); columns past head_dim are masked."""
    return max(16, triton.next_power_of_2(int(head_dim)))


def launch_device(device: torch.device):
    """Context manager making ``device`` the current CUDA device for a kernel launch.

    Triton launches on the current device and its current stream, not on the device of the tensor
    arguments: without this a tensor on cuda:1 would be launched on cuda:0. A no-op off CUDA.
    """
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def current_arch(device: torch.device) -> str:
    """Configuration family for ``device``: "interpreter", "sm_80" or "sm_90"."""
    if device.type != "cuda" or interpreter_active():
        return "interpreter"
    major = tuning.device_properties(device).major
    # Hopper and datacenter Blackwell (227 KB shared memory) take the sm_90 tiles; Ampere, Ada and
    # consumer Blackwell take the sm_80 tiles (with fewer stages where shared memory is ~100 KB,
    # see _shrink_for_small_smem).
    return "sm_90" if major in (9, 10) else "sm_80"


# (arch, head_dim bucket) -> config. Chosen from the AOT static report (README), fp16/bf16.
# sm_90 head_dim 128: M128/N64/w8/s4 tied for the best of 24 forward configs in the H100 sweep of the
# previous forward kernel (d128 causal, S8192 B4 H16: 423 TFLOP/s against 394 for M128/N64/w8/s3;
# docs/design.md, "Facts the code relies on"); not yet re-measured with the lean/masked split. M128/N128/w8/s2, the other winner,
# spills registers with the split (AOT report).
_FWD = {
    ("sm_90", 64): KernelConfig(128, 64, 8, 3),
    ("sm_90", 128): KernelConfig(128, 64, 8, 4),
    ("sm_90", 256): KernelConfig(64, 64, 8, 2),
    ("sm_80", 64): KernelConfig(128, 64, 8, 3),
    ("sm_80", 128): KernelConfig(128, 64, 8, 3),
    ("sm_80", 256): KernelConfig(64, 64, 8, 2),
    ("interpreter", 64): KernelConfig(64, 64, 4, 1),
    ("interpreter", 128): KernelConfig(64, 64, 4, 1),
    ("interpreter", 256): KernelConfig(32, 32, 4, 1),
}
# The backward kernel keeps k, v, dk, dv of its key block in registers: block_n x head_dim x 4
# tiles. Larger tiles than these spill (measured with the AOT report); on sm_90 wgmma also needs
# a 64-row operand, which is why head_dim 256 there uses block_m=64 with a thin key block.
_BWD = {
    ("sm_90", 64): KernelConfig(64, 128, 8, 2),
    ("sm_90", 128): KernelConfig(32, 128, 8, 2),
    ("sm_90", 256): KernelConfig(64, 16, 8, 1),
    ("sm_80", 64): KernelConfig(32, 128, 8, 2),
    ("sm_80", 128): KernelConfig(32, 64, 8, 2),
    ("sm_80", 256): KernelConfig(16, 32, 8, 1),
    ("interpreter", 64): KernelConfig(64, 64, 4, 1),
    ("interpreter", 128): KernelConfig(64, 64, 4, 1),
    ("interpreter", 256): KernelConfig(32, 32, 4, 1),
}
# fp32 inputs: twice the bytes per tile and IEEE dots on FMA units (no tensor cores), so smaller
# tiles; checked by `python -m ndp_kernels.aot` (fp32 is in its default set, so CI checks them too)
# under triton 3.9 and 3.6 (every fp32 table below: no spills on either).
# Head_dim 80/128: an FMA dot loads a thread's rows and columns of both operands over the whole head
# dim; without the per-block branch of the old forward, 4 warps on 32x32 tiles spill (ptxas issues
# all of those loads ahead of the FMAs), so 8 warps (and 16-key blocks on sm_90).
_FWD32 = {
    ("sm_90", 64): KernelConfig(64, 32, 8, 2),
    ("sm_90", 128): KernelConfig(32, 16, 8, 2),
    ("sm_90", 256): KernelConfig(32, 16, 8, 2),
    ("sm_80", 64): KernelConfig(64, 32, 8, 2),
    ("sm_80", 128): KernelConfig(32, 32, 8, 2),
    ("sm_80", 256): KernelConfig(32, 16, 8, 2),
}
# Atomic backward, fp32. M32/N32/w8/s2 (head_dim 80/128, both archs) and M32/N64/w8/s2 (sm_80
# head_dim 64), spill-free on triton 3.9, spill on 3.6 (stack 40-64 and 480 bytes). Where a config
# spills, one pipeline stage fewer is tried first (it keeps the tiles), then more warps on the same
# tiles, and only then smaller tiles. s1 frees the 128 bucket at head_dim 80 and 128. At sm_80
# head_dim 64, s1, M16/N64 and M64/N32 at 8 warps spill on 3.6 and M32/N32/w8/s2 spills on 3.9;
# 16 warps keep the 64-key block (half the programs and dq atomics of N32) at ~100 registers per
# thread on both.
_BWD32 = {
    ("sm_90", 64): KernelConfig(32, 32, 8, 2),
    ("sm_90", 128): KernelConfig(32, 32, 8, 1),
    ("sm_90", 256): KernelConfig(16, 16, 8, 1),
    ("sm_80", 64): KernelConfig(32, 64, 16, 2),
    ("sm_80", 128): KernelConfig(32, 32, 8, 1),
    ("sm_80", 256): KernelConfig(16, 16, 8, 1),
}

# Split backward (``_flash_bwd_dkdv_kernel`` / ``_flash_bwd_dq_kernel``). The dK/dV kernel keeps dk
# and dv of its key block in registers and its dots have the key block (block_n) as the MMA M
# dimension; the dQ kernel keeps q, dout and dq of its query block and has block_m as the M
# dimension. On sm_90 those are >= 64 rows (a wgmma is 64 rows per warpgroup), except the dK/dV
# kernel at head_dim 256: dk + dv of a 64-row key block are 128 fp32 registers per thread at 8
# warps, and Triton lays chained dots out with all warps along M (a 64-row block at 8 warps is
# computed twice), so every 64-row variant spills; it runs 16-row key blocks on mma.sync instead.
# The query-block step of the dK/dV kernel (block_m) is 32 rows where 64 spills, and 16 where 32
# spills with triton 3.6 (sm_90 head_dim 80/128, sm_80 head_dim 64; M32 there is spill-free on
# 3.9 and a candidate for GPU tuning). Chosen from the AOT static report on triton 3.9 and 3.6 (no
# spills, shared memory within the SM); not yet timed on a GPU.
_BWD_DKDV = {
    ("sm_90", 64): KernelConfig(32, 128, 8, 3),
    ("sm_90", 128): KernelConfig(16, 128, 8, 2),
    ("sm_90", 256): KernelConfig(64, 16, 8, 1),
    ("sm_80", 64): KernelConfig(16, 128, 8, 2),
    ("sm_80", 128): KernelConfig(32, 64, 8, 2),
    ("sm_80", 256): KernelConfig(16, 64, 8, 1),
    ("interpreter", 64): KernelConfig(64, 64, 4, 1),
    ("interpreter", 128): KernelConfig(64, 64, 4, 1),
    ("interpreter", 256): KernelConfig(32, 32, 4, 1),
}
_BWD_DQ = {
    ("sm_90", 64): KernelConfig(128, 64, 8, 3),
    ("sm_90", 128): KernelConfig(128, 64, 8, 2),
    ("sm_90", 256): KernelConfig(64, 32, 8, 2),
    ("sm_80", 64): KernelConfig(128, 64, 8, 2),
    ("sm_80", 128): KernelConfig(128, 32, 8, 2),
    ("sm_80", 256): KernelConfig(64, 16, 8, 1),
    ("interpreter", 64): KernelConfig(64, 64, 4, 1),
    ("interpreter", 128): KernelConfig(64, 64, 4, 1),
    ("interpreter", 256): KernelConfig(32, 32, 4, 1),
}
# fp32 (IEEE dots on FMA units): the head_dim-128 bucket must also compile at head_dim 80, whose
# padded tiles need smaller steps than head_dim 128 itself to stay free of spills. Both tables are
# spill-free under triton 3.9 and 3.6 (AOT report).
_BWD_DKDV32 = {
    ("sm_90", 64): KernelConfig(32, 32, 8, 2),
    ("sm_90", 128): KernelConfig(16, 32, 8, 2),
    ("sm_90", 256): KernelConfig(16, 16, 8, 1),
    ("sm_80", 64): KernelConfig(32, 32, 8, 2),
    ("sm_80", 128): KernelConfig(32, 32, 8, 2),
    ("sm_80", 256): KernelConfig(16, 16, 8, 1),
}
_BWD_DQ32 = {
    ("sm_90", 64): KernelConfig(64, 32, 8, 2),
    ("sm_90", 128): KernelConfig(32, 16, 8, 2),
    ("sm_90", 256): KernelConfig(16, 16, 8, 1),
    ("sm_80", 64): KernelConfig(64, 32, 8, 2),
    ("sm_80", 128): KernelConfig(32, 32, 8, 2),
    ("sm_80", 256): KernelConfig(16, 16, 8, 1),
}
# Which backward serves deterministic=False: "atomic" (``_flash_bwd_kernel``, dq by fp32 atomics) or
# "split" (the atomic-free pair). Neither has been timed against the other on a GPU here, so on a GPU the
# first backward measures both (``AUTO_PROBE``) and the faster one serves; this table is what applies
# where that is off or failed: the atomic kernel, the one measured on an H100 (docs/design.md, "Facts the code relies on").
# deterministic=True always takes "split" (the only bitwise-reproducible one).
_BWD_IMPL = {
    ("sm_90", 64): "atomic",
    ("sm_90", 128): "atomic",
    ("sm_90", 256): "atomic",
    ("sm_80", 64): "atomic",
    ("sm_80", 128): "atomic",
    ("sm_80", 256): "atomic",
    ("interpreter", 64): "atomic",
    ("interpreter", 128): "atomic",
    ("interpreter", 256): "atomic",
}

# Row-wise kernels (merge, backward preprocess): ~8K elements per program keep two fp32 tiles in
# registers without spills at every head_dim.
_MERGE_ELEMENTS = 8192
_MERGE_WARPS = 4


def _shrink_for_small_smem(cfg: KernelConfig, device: torch.device | None) -> KernelConfig:
    # sm_86/sm_89/sm_120 have ~100 KB of shared memory per block instead of 163 KB: one stage fewer
    # keeps every sm_80 tile of the static report under 100 KB.
    if device is None or device.type != "cuda" or interpreter_active():
        return cfg
    optin = getattr(tuning.device_properties(device), "shared_memory_per_block_optin", None)
    if optin is not None and optin < 160 * 1024:
        return dataclasses.replace(cfg, num_stages=max(1, cfg.num_stages - 1))
    return cfg


KINDS = ("fwd", "bwd", "bwd_dkdv", "bwd_dq")
IMPLS = ("atomic", "split")
HALF_DTYPES = (torch.float16, torch.bfloat16)  # the tensor-core dtypes (TMA, probe alternates, head splits)
TMA_KINDS = ("fwd", "bwd_dq")  # the kernels that walk key blocks: their K/V loads can go through TMA
# The dQ kernel with TMA K/V loads spills registers at head_dim 256 (sm_90, static tiles; AOT report), so above
# this head_dim it keeps the pointer loads whatever the configuration says.
TMA_DQ_MAX_HEAD_DIM = 128


def tma_applies(kind: str, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether kernel `kind` reads K/V by TMA at `dtype` and `head_dim` when its configuration asks for it (given
    an sm_90+ GPU and K/V that meet the descriptor rules, ``flash._tma_aligned``): fp16/bf16, the forward at every
    head_dim, the dQ kernel up to TMA_DQ_MAX_HEAD_DIM. The one rule of the launchers, the tuner and the AOT report."""
    return (kind in TMA_KINDS and dtype in HALF_DTYPES
            and (kind != "bwd_dq" or head_dim <= TMA_DQ_MAX_HEAD_DIM))


def tma_here(kind: str, dtype: torch.dtype, device: torch.device | None, head_dim: int) -> bool:
    """Whether `kind` can read K/V by TMA on `device` (``tma_applies`` on an sm_90+ GPU); elsewhere a TMA
    configuration runs the pointer loads, so timing it would only time the plain kernel twice."""
    if device is None or device.type != "cuda" or not tma_applies(kind, dtype, head_dim):
        return False
    return tuning.device_properties(device).major >= 9


# The override() choices, process-wide (as no_probe): autograd runs a CUDA backward on its own worker
# thread, so a thread-local choice made around loss.backward() would not reach the kernels it launches.
_SCOPE = {"cfg": {}}
_SCOPE_LOCK = threading.Lock()
_TUNED: dict = {}
# Kernel tables measured by ndp's developers (``make gpu-report`` copies the measured rows under tuning/), shipped
# as package data: ``kernels-<device key>.json``. On that GPU model the first call measures nothing they settle.
SHIPPED_DIR = Path(__file__).resolve().parent / "tables"


def tuned_key(kind: str, arch: str, head_dim: int, dtype: torch.dtype) -> str:
    """Row key of a tuned table: ``kind/arch/head_dim bucket/dtype`` (kind may also be ``bwd_impl``)."""
    return f"{kind}/{arch}/{kernel_bucket(head_dim)}/{str(dtype).replace('torch.', '')}"


def tuned_table(device: torch.device | None, *, reload: bool = False) -> dict:
    """Rows of the tuned table of `device`'s model ({} when there is none): the table shipped in the package
    (SHIPPED_DIR, measured on that GPU model by ``make gpu-report``) under the user's (the tuning cache), whose rows
    win; a first-use measurement of another head_dim or dtype adds a user row and keeps the shipped ones.

    Raises:
        RuntimeError: a table exists but cannot be read (names the file and how to rebuild it).
    """
    if device is None:
        return {}
    key = tuning.device_key(device)
    if reload or key not in _TUNED:
        rows = {}
        for path in (tuning.table_path("kernels", key, SHIPPED_DIR), tuning.table_path("kernels", key)):
            rows.update(_file_rows(path))
        _TUNED[key] = rows
    return _TUNED[key]


def _file_rows(path) -> dict:
    """The rows of the kernel table at `path` ({} when it is missing or was measured for other kernels)."""
    data = tuning.load_json(path) or {}
    rows = data.get("rows", {}) if isinstance(data, dict) else None
    if not isinstance(rows, dict):
        raise RuntimeError(f"kernel tuning table {path} is malformed; delete it or re-run `python -m "
                           f"ndp_kernels.tune`")
    if not tuning.for_these_kernels(data):
        log.warning("ndp_kernels: %s was measured for other kernels (an earlier ndp); ignoring it (static tables "
                    "and first-use measurement apply; `python -m ndp_kernels.tune` measures a new one)", path)
        return {}
    return rows


def adopt_rows(device: torch.device, rows: dict) -> None:
    """Takes `rows` (measured by another process: ``ndp.ops.tune.warmup``'s rank 0) as the rows of `device`'s
    model, here and in the user's table on this machine: they replace the rows of the same keys, every other row
    stays. The launchers then run the kernels they name and measure nothing they settle."""
    if not rows:
        return
    tuned_table(device).update(rows)
    meta = (lambda: _TUNER.table_meta(device, current_arch(device))) if _TUNER is not None else \
        (lambda: {"kernels": tuning.kernels_fingerprint()})
    tuning.merge_rows(tuning.table_path("kernels", tuning.device_key(device)), rows, meta,
                      valid=tuning.for_these_kernels, replace=True)


@contextlib.contextmanager
def override(kind: str, cfg):
    """Within the block, kernels of `kind` (``fwd``, ``bwd``, ``bwd_dkdv``, ``bwd_dq``) launch with the
    KernelConfig `cfg`; with kind ``bwd_impl`` the non-deterministic backward is `cfg` (``atomic`` or
    ``split``); with kind ``head_splits`` the backward splits a GQA group's query heads over up to `cfg`
    programs (``head_splits``). Every thread of the process, the autograd worker that runs a CUDA backward
    included. Used by the tuner to time candidates through the public launchers, and by tests."""
    if kind == "bwd_impl":
        if cfg not in IMPLS:
            raise ValueError(f"a bwd_impl override must be one of {IMPLS}; got {cfg!r}")
    elif kind == "head_splits":
        if not isinstance(cfg, int) or cfg < 1:
            raise ValueError(f"a head_splits override must be an int >= 1; got {cfg!r}")
    elif kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, 'bwd_impl' or 'head_splits'; got {kind!r}")
    with _SCOPE_LOCK:
        old = _SCOPE["cfg"].get(kind)
        _SCOPE["cfg"] = {**_SCOPE["cfg"], kind: cfg}
    try:
        yield
    finally:
        with _SCOPE_LOCK:
            _SCOPE["cfg"] = {**_SCOPE["cfg"], kind: old} if old is not None else \
                {k: v for k, v in _SCOPE["cfg"].items() if k != kind}


def _forced(kind: str):
    return _SCOPE["cfg"].get(kind)


# First-use measurement. The static tables leave choices unmeasured on a GPU: whether the forward and the dQ
# kernel read K/V by TMA (sm_90+), which backward (atomic or split) serves deterministic=False, and the tiles of
# PROBE_ALTERNATES. On a GPU whose model has no tuned row for them, the first launch that needs one measures it
# once (``tune.probe``: each variant checked against the float64 reference, then timed) and adds the rows to the
# user's tuning table, so later processes read them. ``python -m ndp_kernels.tune`` measures everything, tiles
# included. Device types listed here probe; set to () to keep the static tables.
AUTO_PROBE = ("cuda",)
_PROBE_FAILED: set = set()
# The module that measures (``ndp_kernels.tune``: it times candidates through the launchers, which import this
# module, so it registers itself here when it loads, with the launchers; see ndp_kernels.__getattr__). None: no
# measurement, the static tables apply.
_TUNER = None


def use_tuner(module) -> None:
    """Registers the module whose ``probe(part, device, head_dim, dtype)`` and ``table_meta(device, arch)`` the
    first-use measurement calls (``ndp_kernels.tune`` does so when it loads)."""
    global _TUNER
    _TUNER = module


# Within the block (every thread), missing rows take the static tables instead of being measured (the engines'
# first-use measurement is off too).
no_probe = tuning.no_measurement


def probe_marker(part: str, arch: str, head_dim: int, dtype: torch.dtype) -> str:
    """The row whose presence in a tuned table says probe `part` ran (or a full tune measured it)."""
    return tuned_key("fwd" if part == "fwd" else "bwd_impl", arch, head_dim, dtype)


def _rows(part: str, arch: str, head_dim: int, dtype: torch.dtype, device, strict: bool = False) -> dict:
    """The tuned rows of `device`'s model, after measuring probe `part` (``fwd`` or ``bwd``, see
    ``tune.probe``) for (arch, head_dim bucket, dtype) where its rows are missing and probing is allowed: once per
    machine (``tuning.measure_once``: the other processes wait for the lock and take the rows written). A failed
    measurement is logged and the static tables apply; strict: it raises."""
    rows = tuned_table(device)
    marker = probe_marker(part, arch, head_dim, dtype)
    if marker in rows or _TUNER is None or not tuning.may_measure(device, AUTO_PROBE):
        return rows

    key = tuning.device_key(device)
    if (key, marker) in _PROBE_FAILED and not strict:
        return rows
    log.info("ndp_kernels: no measured %s row for %s on %s; measuring it once (python -m ndp_kernels.tune "
             "measures every tile)", part, marker, key)

    def measure():
        with no_probe(), launch_device(device):  # do_bench times the current device
            return _TUNER.probe(part, device, head_dim, dtype)

    try:
        new = tuning.measure_once(tuning.table_path("kernels", key), marker, measure,
                                  lambda: _TUNER.table_meta(device, arch), valid=tuning.for_these_kernels)
    except Exception as e:  # noqa: BLE001 - never let a measurement break the caller's attention
        if strict:
            raise
        _PROBE_FAILED.add((key, marker))
        log.warning("ndp_kernels: measuring %s on %s failed (%s: %s); the static tables apply", marker, key,
                    type(e).__name__, e)
        return rows
    for k, v in new.items():
        rows.setdefault(k, v)
    return rows


# Tiles the static tables could not settle without a GPU: the first-use measurement times them beside the static
# tile (fp16/bf16; a tile that spills on the running compiler is simply slower, one that fails its check or does
# not compile is never chosen).
PROBE_ALTERNATES = {
    # split dK/dV, head_dim 128: 32-row query steps (twice the MMA width of the two [keys x queries] dots) are
    # spill-free on triton 3.9 and spill on 3.6, so the static table keeps 16 (AOT report).
    ("bwd_dkdv", "sm_90", 128): (KernelConfig(32, 128, 8, 2),),
    # atomic backward, head_dim 128: the fastest of 67 tiles in the H100 sweep of the earlier kernel (273 against
    # 217 TFLOP/s for the static tile, docs/design.md, "Facts the code relies on"); it spills with the current kernel in the static report.
    ("bwd", "sm_90", 128): (KernelConfig(64, 128, 8, 3),),
}


def probe_variants(kind: str, arch: str, head_dim: int, dtype: torch.dtype, device) -> list[KernelConfig]:
    """What the first-use measurement times for `kind`: the static tile first, then PROBE_ALTERNATES, then the
    static tile with TMA K/V loads where they run (``tma_here``). One entry: nothing to decide."""
    static = static_config(kind, arch, head_dim, dtype, device)
    out = [static] + list(_alternates(kind, arch, head_dim, dtype))
    if tma_here(kind, dtype, device, head_dim):
        out.append(dataclasses.replace(static, tma=True))
    return out


def _alternates(kind, arch, head_dim, dtype) -> tuple:
    return PROBE_ALTERNATES.get((kind, arch, kernel_bucket(head_dim)), ()) if dtype in HALF_DTYPES else ()


_PART_KINDS = {"fwd": ("fwd",), "bwd": ("bwd", "bwd_dkdv", "bwd_dq")}  # what each probe of tune.probe settles


def _open(part, arch, head_dim, dtype, device, rows) -> bool:
    """Whether probe `part` has a choice to make here that `rows` do not settle. Every launch asks: the cheap tests
    first, and a choice is seen without building the variants (probe_variants has more than the static tile
    exactly when there are alternates or TMA runs here; the backward always chooses atomic or split)."""
    if probe_marker(part, arch, head_dim, dtype) in rows or device is None or device.type not in AUTO_PROBE:
        return False
    return part == "bwd" or any(_alternates(k, arch, head_dim, dtype) or tma_here(k, dtype, device, head_dim)
                                for k in _PART_KINDS[part])


def measure_ahead(arch: str, head_dim: int, dtype: torch.dtype, device, strict: bool = False) -> None:
    """Settles the forward's and the backward's open choices (first-use measurement) now. The forward launcher
    calls it: no measurement runs inside autograd's backward (``tuning.may_measure``), so the backward's is taken
    by the forward that precedes it. Every forward launch calls it: the device test first, the table read once.
    strict: a failed measurement raises (else it is logged and the static tables apply)."""
    if device is None or device.type not in AUTO_PROBE:
        return
    rows = tuned_table(device)
    for part in ("fwd", "bwd"):
        if _open(part, arch, head_dim, dtype, device, rows):
            rows = _rows(part, arch, head_dim, dtype, device, strict)


def measure_first_use(head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
    """Measures now what the first launches at (head_dim, dtype) on `device` would (``measure_ahead``); a failure
    raises (``ndp.warmup`` reports it on every rank) instead of leaving the static tables."""
    measure_ahead(current_arch(device), head_dim, dtype, device, strict=True)


def _pick(kind, static, arch, head_dim, device, dtype, measured=True) -> KernelConfig:
    forced = _forced(kind)
    if forced is not None:
        return forced
    if not measured:
        return _shrink_for_small_smem(static[(arch, kernel_bucket(head_dim))], device)
    rows = tuned_table(device)
    part = "fwd" if kind == "fwd" else "bwd"  # the probe that settles `kind` (tune.probe)
    if _open(part, arch, head_dim, dtype, device, rows):
        rows = _rows(part, arch, head_dim, dtype, device)
    row = rows.get(tuned_key(kind, arch, head_dim, dtype))
    if row is not None:
        # Measured on this GPU model: taken as is (no shared-memory shrink, it ran there).
        return KernelConfig(*row["config"])
    return _shrink_for_small_smem(static[(arch, kernel_bucket(head_dim))], device)


def static_config(kind: str, arch: str, head_dim: int, dtype: torch.dtype = torch.float16,
                  device: torch.device | None = None) -> KernelConfig:
    """The shipped (static-table) configuration of `kind`, ignoring tuned tables and overrides: the
    baseline the tuner must beat."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}; got {kind!r}")
    fp32 = dtype == torch.float32 and arch != "interpreter"
    table = {"fwd": _FWD32 if fp32 else _FWD, "bwd": _BWD32 if fp32 else _BWD,
             "bwd_dkdv": _BWD_DKDV32 if fp32 else _BWD_DKDV, "bwd_dq": _BWD_DQ32 if fp32 else _BWD_DQ}[kind]
    return _shrink_for_small_smem(table[(arch, kernel_bucket(head_dim))], device)


def fwd_config(arch: str, head_dim: int, device: torch.device | None = None,
               dtype: torch.dtype = torch.float16) -> KernelConfig:
    """Forward-kernel configuration for ``arch`` ("sm_80", "sm_90" or "interpreter"), ``head_dim``, ``dtype``."""
    table = _FWD32 if dtype == torch.float32 and arch != "interpreter" else _FWD
    return _pick("fwd", table, arch, head_dim, device, dtype)


def bwd_config(arch: str, head_dim: int, device: torch.device | None = None,
               dtype: torch.dtype = torch.float16) -> KernelConfig:
    """Backward-kernel configuration for ``arch``, ``head_dim`` and ``dtype``."""
    table = _BWD32 if dtype == torch.float32 and arch != "interpreter" else _BWD
    return _pick("bwd", table, arch, head_dim, device, dtype)


def bwd_dkdv_config(arch: str, head_dim: int, device: torch.device | None = None,
                    dtype: torch.dtype = torch.float16, deterministic: bool = False) -> KernelConfig:
    """Configuration of the split backward's dK/dV kernel.

    block_n key rows per program, block_m query rows per step of its loop. deterministic: the static tile
    (or an override), never a measured one: the tile sets the summation order, so bitwise-reproducible
    gradients must not depend on a timing (another machine, another run).
    """
    table = _BWD_DKDV32 if dtype == torch.float32 and arch != "interpreter" else _BWD_DKDV
    return _pick("bwd_dkdv", table, arch, head_dim, device, dtype, measured=not deterministic)


def bwd_dq_config(arch: str, head_dim: int, device: torch.device | None = None,
                  dtype: torch.dtype = torch.float16, deterministic: bool = False) -> KernelConfig:
    """Configuration of the split backward's dQ kernel (deterministic: as bwd_dkdv_config).

    block_m query rows per program, block_n key rows per step of its loop.
    """
    table = _BWD_DQ32 if dtype == torch.float32 and arch != "interpreter" else _BWD_DQ
    return _pick("bwd_dq", table, arch, head_dim, device, dtype, measured=not deterministic)


def with_softcap(kind: str, cfg: KernelConfig, head_dim: int) -> KernelConfig:
    """The tile a soft-capped launch of `kind` takes: the dK/dV kernel keeps one more score-sized tile live
    (the cap's derivative) and spills with the plain tile at head_dim bucket 256, and with triton 3.6 with the
    32 x 128 tile of bucket 64 (sm_90, 16-bit: 8 bytes of stack), so there it takes half the key rows
    (`python -m ndp_kernels.aot`, kernels *_softcap, on triton 3.9 and 3.6)."""
    bucket = kernel_bucket(head_dim)
    if kind == "bwd_dkdv" and (bucket == 256 or bucket == 64 and cfg.block_m * cfg.block_n >= 32 * 128):
        return dataclasses.replace(cfg, block_n=max(16, cfg.block_n // 2))
    return cfg


def bwd_impl(arch: str, head_dim: int, dtype: torch.dtype = torch.float16, deterministic: bool = False,
             device: torch.device | None = None) -> str:
    """Which backward to run: ``"split"`` (atomic-free dK/dV + dQ kernels) or ``"atomic"`` (``_flash_bwd_kernel``).

    Args:
        arch: "sm_80", "sm_90" or "interpreter" (``current_arch``).
        head_dim: the head dimension. dtype: the input dtype.
        deterministic: True demands bitwise-reproducible gradients, which only "split" gives.
        device: the tensors' device: a tuned table of its GPU model decides first (``ndp_kernels.tune``); on a GPU
            without that row the first call measures both backwards once (``AUTO_PROBE``) and saves the row.
    Returns:
        "split" or "atomic".
    Raises:
        KeyError for an unknown arch.
    """
    if deterministic:
        return "split"
    forced = _forced("bwd_impl")
    if forced is not None:
        return forced
    row = _rows("bwd", arch, head_dim, dtype, device).get(tuned_key("bwd_impl", arch, head_dim, dtype))
    if row is not None:
        return row["impl"]
    return _BWD_IMPL[(arch, kernel_bucket(head_dim))]


# The backward kernels that own a key block (the atomic one and the split dK/dV kernel) sum dK/dV over the query
# heads of their kv head's GQA group, one program per (key block, segment, kv head). Where that grid is small
# against the GPU (few kv heads, a small batch, short blocks: a ring step of an MQA/GQA model), most SMs would
# idle while each program walks the whole group, so the group is split over up to group_size programs until
# the grid reaches HEAD_SPLIT_WAVES programs per SM (the atomic kernel then adds dK/dV atomically; the split
# one adds per-part fp32 buffers in a fixed order, so it stays bitwise reproducible).
HEAD_SPLIT_WAVES = 2
# fp16/bf16 only: the fp32 dK/dV kernel with split heads spills registers on sm_80 at head_dim 64 (AOT report).
HEAD_SPLIT_DTYPES = HALF_DTYPES


def sm_count(device: torch.device | None) -> int:
    """Streaming multiprocessors of `device` (0 off CUDA and under the interpreter)."""
    if device is None or device.type != "cuda" or interpreter_active():
        return 0
    return tuning.device_properties(device).multi_processor_count


def head_splits(programs: int, group_size: int, device: torch.device | None, dtype: torch.dtype) -> int:
    """Into how many parts (a divisor of `group_size`) a key-block backward kernel splits each GQA group's query
    heads, for a grid of `programs` programs with one part per kv head (see HEAD_SPLIT_WAVES; 1 outside
    HEAD_SPLIT_DTYPES); an ``override("head_splits", n)`` block asks for up to n parts, at any dtype."""
    divisors = [n for n in range(1, group_size + 1) if group_size % n == 0]
    forced = _forced("head_splits")
    if forced is not None:
        return max(n for n in divisors if n <= forced)
    if dtype not in HEAD_SPLIT_DTYPES:
        return 1
    target = HEAD_SPLIT_WAVES * sm_count(device)
    return next((n for n in divisors if programs * n >= target), group_size)


def merge_config(arch: str, head_dim: int) -> KernelConfig:
    """Configuration of the standalone merge and the backward preprocess kernels (rows per program).

    The same on every arch: these kernels are memory bound and have no tiles to tune.
    """
    del arch
    return KernelConfig(max(8, _MERGE_ELEMENTS // block_d(head_dim)), 1, _MERGE_WARPS, 1)
