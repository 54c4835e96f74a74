"""Tune the Triton kernels' launch configurations on the GPU this runs on.

    python -m ndp_kernels.tune                               # fwd, bwd, split bwd; head_dim 64,128; bf16, fp16
    python -m ndp_kernels.tune --kinds fwd --head-dims 128 --dtypes bfloat16 --quick
    python -m ndp_kernels.tune --head-dims 128 --dtypes bfloat16 --budget-s 300   # make gpu-report PARTS=tune

For each (kernel, arch, head_dim bucket, dtype) it runs the static configuration, the one a tuned table (shipped
for this GPU model, or the user's) names, the first-use probe's variants, then every configuration of a grid (for
the kernels that walk key blocks on sm_90+ in fp16/bf16, each tile also with K/V read by TMA) through the public
launchers (``configs.override``), checks each candidate against the float64 reference on a small causal block
before timing it (a wrong or failing candidate is dropped, never timed), times the survivors with
``triton.testing.do_bench`` on a large causal block and a full one (each recorded), and keeps the fastest
(``--budget-s``: the grid candidates a row's share of the time does not reach are listed as not timed). It then
times the two backwards (``atomic`` and ``split``, each with its best tiles) and records which one serves
``deterministic=False``. The table goes to ``<tuning dir>/kernels-<GPU name>.json`` (``$NDP_TUNING_DIR``,
default ``~/.cache/ndp``), which ``ndp_kernels.configs`` reads before its static tables.

``probe`` is the small version that runs without being asked: on a GPU whose table lacks the rows, the first
launch measures the choices the static tables leave open (TMA on or off with the static tiles, the
``configs.PROBE_ALTERNATES`` tiles, atomic or split backward) on one block and adds those rows to the same table.

Without a GPU the command says so and exits 2 (the interpreter cannot time kernels).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import itertools
import sys
import time

import torch
import triton
from triton.testing import do_bench

from triton.errors import TritonError

from . import configs, flash, reference, tuning
from .configs import (KINDS, TMA_KINDS, KernelConfig, current_arch, no_probe, override, probe_marker,
                      probe_variants, static_config, tma_here, tuned_key)

__all__ = ["candidates", "check_candidate", "tune_kind", "tune_head_dim", "probe", "main"]

# Candidate grids per kernel: (block_m, block_n, num_warps, num_stages). Candidates that cannot compile
# or launch on this GPU (registers, shared memory) fail and are skipped.
_GRID = {
    "fwd": dict(m=(64, 128), n=(32, 64, 128), w=(4, 8), s=(2, 3, 4, 5)),
    "bwd": dict(m=(16, 32, 64), n=(64, 128), w=(4, 8), s=(1, 2, 3, 4)),
    "bwd_dkdv": dict(m=(16, 32, 64), n=(64, 128), w=(4, 8), s=(1, 2, 3, 4)),
    "bwd_dq": dict(m=(64, 128), n=(16, 32, 64), w=(4, 8), s=(1, 2, 3, 4)),
}
_QUICK = {
    "fwd": dict(m=(128,), n=(64, 128), w=(8,), s=(2, 3)),
    "bwd": dict(m=(32, 64), n=(128,), w=(8,), s=(2, 3)),
    "bwd_dkdv": dict(m=(16, 32), n=(128,), w=(8,), s=(2, 3)),
    "bwd_dq": dict(m=(128,), n=(32, 64), w=(8,), s=(2, 3)),
}
# What a candidate that cannot run here raises (triton's compile, resource, ptxas and interpreter errors; CUDA
# launch and memory errors); anything else is a bug and propagates (first use then logs it, static tables apply).
LAUNCH_FAILURES = (TritonError, RuntimeError)
_ATOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-4}


def candidates(kind: str, quick: bool = False, *, tma: bool = False) -> list[KernelConfig]:
    """The candidate configurations of `kind`; with `tma` (the forward and the dQ kernel on sm_90+ in fp16/bf16)
    each tile also with K/V read by TMA."""
    g = (_QUICK if quick else _GRID)[kind]
    plain = [KernelConfig(*c) for c in itertools.product(g["m"], g["n"], g["w"], g["s"])]
    if not (tma and kind in TMA_KINDS):
        return plain
    return plain + [dataclasses.replace(c, tma=True) for c in plain]


def _overrides(cfgs: dict):
    """Nested ``configs.override`` blocks for every kind in `cfgs`."""
    stack = contextlib.ExitStack()
    for kind, cfg in cfgs.items():
        stack.enter_context(override(kind, cfg))
    return stack


def _inputs(b, s, h, hk, d, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=gen, device=device, dtype=dtype)  # noqa: E731
    return mk(b, s, h, d), mk(b, s, hk, d), mk(b, s, hk, d), mk(b, s, h, d)


def _run(kind, q, k, v, dout, causal, out=None, lse=None):
    """One call of the kernel(s) `kind` through the public launchers; returns what it computed."""
    if kind == "fwd":
        return flash.flash_attn_fwd(q, k, v, causal=causal)
    if kind == "bwd":  # the atomic backward, whatever a tuned table says serves deterministic=False
        with override("bwd_impl", "atomic"):
            return flash.flash_attn_bwd(dout, q, k, v, out, lse, causal=causal)
    # bwd_dkdv / bwd_dq: the split backward (deterministic=True takes it).
    return flash.flash_attn_bwd(dout, q, k, v, out, lse, causal=causal, deterministic=True)


def check_candidate(kind, cfg, dtype, head_dim, device, *, s=192, h=4, hk=2, fixed=None) -> tuple[bool, float]:
    """Whether `kind` launched with `cfg` matches the float64 reference on a small causal GQA block.

    Returns:
        (ok, max abs error); (False, inf) when the candidate fails to compile or launch.
    """
    q, k, v, dout = _inputs(1, s, h, hk, head_dim, dtype, device, seed=1)
    q64, k64, v64, d64 = (x.double().cpu() for x in (q, k, v, dout))
    ref_out, ref_lse = reference.flash_attn_fwd_ref(q64, k64, v64, causal=True)
    want = (ref_out, ref_lse) if kind == "fwd" else \
        reference.flash_attn_bwd_ref(d64, q64, k64, v64, ref_out, ref_lse, causal=True)
    out, lse = ref_out.to(device=device, dtype=dtype), ref_lse.float().to(device)
    try:
        with _overrides({**(fixed or {}), kind: cfg}):
            got = _run(kind, q, k, v, dout, True, out, lse)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except LAUNCH_FAILURES:  # does not compile or launch here (registers, shared memory): not a candidate
        return False, float("inf")
    err = max((g.double().cpu() - w).abs().max().item() for g, w in zip(got, want))
    scale = max(w.abs().max().item() for w in want)
    return err <= _ATOL[dtype] * max(1.0, scale), err


def _bench(fn, device):
    """Median milliseconds of fn (do_bench on CUDA; one timed call after a warm-up under the interpreter,
    where only the mechanism is exercised)."""
    if device.type == "cuda":
        return float(do_bench(fn, quantiles=[0.5, 0.2, 0.8])[0])
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _table_config(kind, dtype, head_dim, device) -> KernelConfig | None:
    """The configuration the launchers take now from a tuned table (shipped for this GPU model or the user's), or
    None where no table has a row: the baseline a new measurement is compared with."""
    row = configs.tuned_table(device).get(tuned_key(kind, current_arch(device), head_dim, dtype))
    return KernelConfig(*row["config"]) if row and row.get("config") else None


def ordered_candidates(kind, dtype, head_dim, device, quick=False) -> tuple[list[KernelConfig], KernelConfig, int]:
    """(candidates, static, kept): the static configuration, the tuned table's, the first-use probe's variants
    (``configs.probe_variants``), then the grid, each once. The first `kept` (the static and the table's) are timed
    whatever the time budget: a new table never does worse than the tiles that run now."""
    static = static_config(kind, current_arch(device), head_dim, dtype, device)
    table = _table_config(kind, dtype, head_dim, device)
    first = [static] + ([table] if table is not None and table != static else [])
    grid = sorted(candidates(kind, quick, tma=tma_here(kind, dtype, device, head_dim)),
                  key=lambda c: _distance(c, first[-1]))
    rest = probe_variants(kind, current_arch(device), head_dim, dtype, device) + grid
    return list(dict.fromkeys(first + rest)), static, len(first)


def _distance(a: KernelConfig, b: KernelConfig) -> float:
    """How far tile `a` is from `b` (powers of two of the blocks and warps, stages, TMA): a time budget reaches the
    neighbours of the configuration that runs now first (stable sort: ties keep the grid's order)."""
    log2 = lambda x: x.bit_length()  # noqa: E731 - the block sizes and warps are powers of two
    return (abs(log2(a.block_m) - log2(b.block_m)) + abs(log2(a.block_n) - log2(b.block_n))
            + abs(log2(a.num_warps) - log2(b.num_warps)) + abs(a.num_stages - b.num_stages) / 2 + (a.tma != b.tma) / 2)


def tune_kind(kind, dtype, head_dim, device, *, seqlen=8192, batch=2, heads=16, kv_heads=16, quick=False,
              cands=None, fixed=None, deadline=None, log=print) -> dict:
    """Tunes one (kind, dtype, head_dim) row on `device` (``fixed``: configs of other kinds held during it,
    e.g. the best dK/dV tiles while the dQ kernel of the same split backward is tuned). ``deadline``
    (``time.perf_counter()`` value): candidates not reached by then are listed as not timed, except the static and
    the tuned table's configuration, which are always timed (``ordered_candidates``).

    Returns:
        ``{"config": [m, n, w, s], "ms": best, "candidates": {str(cfg): ms or reason}, "masks": {str(cfg):
        [causal ms, full ms]}, ...}`` (``static`` / ``table``: the static and the table's configuration and their
        times); ``config`` is None when no candidate passed its check.
    """
    q, k, v, dout = _inputs(batch, seqlen, heads, kv_heads, head_dim, dtype, device)
    out = lse = None
    if kind != "fwd":
        out, lse = flash.flash_attn_fwd(q, k, v, causal=True)
    results, masks, best = {}, {}, None
    static = table = None
    kept = len(cands or ())
    if cands is None:
        cands, static, kept = ordered_candidates(kind, dtype, head_dim, device, quick)
        table = _table_config(kind, dtype, head_dim, device)
    for i, cfg in enumerate(cands):
        if i >= kept and deadline is not None and time.perf_counter() > deadline:
            results[str(cfg)] = "not timed (the time budget was spent)"
            continue
        ok, err = check_candidate(kind, cfg, dtype, head_dim, device, fixed=fixed)
        if not ok:
            results[str(cfg)] = "failed to launch" if err == float("inf") else f"wrong (max error {err:.2e})"
            continue
        with _overrides({**(fixed or {}), kind: cfg}):
            try:
                by_mask = [_bench(lambda c=c: _run(kind, q, k, v, dout, c, out, lse), device) for c in (True, False)]
            except LAUNCH_FAILURES as e:  # e.g. out of memory at the large shape
                results[str(cfg)] = f"failed at the timing shape ({type(e).__name__})"
                continue
        ms = sum(by_mask)
        results[str(cfg)], masks[str(cfg)] = round(ms, 4), [round(t, 4) for t in by_mask]
        if best is None or ms < best[1]:
            best = (cfg, ms)
    row = {"config": None if best is None else best[0].as_row(),
           "ms": None if best is None else round(best[1], 4), "candidates": results, "masks": masks,
           "shape": f"B={batch} S={seqlen} H={heads} Hkv={kv_heads} causal+full"}
    vs = ""
    for name, cfg in (("static", static), ("table", table)):
        if cfg is None:
            continue
        # what the new row gains over the static tiles and over the table's row that runs now
        row[name] = {"config": cfg.as_row(), "ms": results.get(str(cfg))}
        if isinstance(row[name]["ms"], float) and best is not None:
            vs += f", {name} {cfg} {row[name]['ms']} ms ({row[name]['ms'] / best[1]:.2f}x)"
    untimed = sum(str(r).startswith("not timed") for r in results.values())
    log(f"{kind:9s} {str(dtype)[6:]:9s} d={head_dim:3d}: best {best[0] if best else None} "
        f"({row['ms']} ms) of {len(results) - untimed} timed candidates{vs}"
        + (f"; {untimed} not timed (budget)" if untimed else ""))
    return row


def tune_head_dim(kinds, dtype, head_dim, device, *, cands_for=None, failed=None, budget_s=None, log=print,
                  **kw) -> dict:
    """Rows of `kinds` (KINDS order) at (dtype, head_dim) on `device`, and which backward serves
    deterministic=False (``bwd_impl``): the dK/dV kernel is tuned before the dQ kernel, whose timing (the whole
    split backward) runs with the best dK/dV tiles; the faster of the two backwards, each with its best tiles,
    serves. `cands_for(kind)` gives each kind's candidates (default: ``ordered_candidates``); a kind none of whose
    candidates passed gets no row (its candidates and why go into `failed` when given); ``budget_s``: seconds for
    all of them, shared equally by the kinds still to tune; `kw` goes to ``tune_kind``."""
    arch = current_arch(device)
    rows, fixed = {}, {}
    order = sorted(kinds, key=KINDS.index)
    t_end = None if budget_s is None else time.perf_counter() + budget_s
    for i, kind in enumerate(order):
        deadline = None if t_end is None else time.perf_counter() + (t_end - time.perf_counter()) / (len(order) - i)
        row = tune_kind(kind, dtype, head_dim, device, cands=cands_for(kind) if cands_for else None,
                        fixed=fixed if kind == "bwd_dq" else None, deadline=deadline, log=log, **kw)
        if row["config"] is None:
            if failed is not None:
                failed[kind] = row["candidates"]
            continue
        rows[tuned_key(kind, arch, head_dim, dtype)] = row
        if kind == "bwd_dkdv":
            fixed["bwd_dkdv"] = KernelConfig(*row["config"])
    a, sq = rows.get(tuned_key("bwd", arch, head_dim, dtype)), rows.get(tuned_key("bwd_dq", arch, head_dim, dtype))
    ms = {"atomic": a["ms"] if a else None, "split": sq["ms"] if sq and "bwd_dkdv" in fixed else None}
    timed = {impl: t for impl, t in ms.items() if t is not None}
    if timed and {"bwd", "bwd_dq"} <= set(kinds):
        rows[tuned_key("bwd_impl", arch, head_dim, dtype)] = {"impl": min(timed, key=timed.get), "ms": ms}
    return rows


# The first-use probe (``configs._rows``): the choices the static tables leave unmeasured, timed on one block.
# GQA 32:8 (Llama-3-like) at 8k tokens: a grid that fills an H100 without splitting heads (configs.head_splits).
PROBE_SHAPE = dict(seqlen=4096, batch=2, heads=32, kv_heads=8)


def probe(part: str, device, head_dim: int, dtype: torch.dtype) -> dict:
    """Measures the choices the static tables leave open for (this GPU model, head_dim bucket, dtype) and returns
    their rows (``configs`` merges them into the user's kernel table, once per machine: ``tuning.measure_once``).

    Each kernel's variants are ``configs.probe_variants``: its static tile, the PROBE_ALTERNATES tiles, and the
    static tile with TMA K/V loads where they run. part ``"fwd"``: the forward. part ``"bwd"``: the atomic
    backward, the split backward's dK/dV and dQ kernels, and which backward serves deterministic=False
    (``bwd_impl``: the faster, each with its best variant). Every variant is checked against the float64
    reference before it is timed; one that fails is never chosen. Rows of kernels with one variant are not
    written (the static table already says it).

    Raises:
        RuntimeError: no variant of a choice passed its check (the message lists why each failed).
        ValueError: an unknown part.
    """
    device = torch.device(device)
    arch = current_arch(device)
    if part not in ("fwd", "bwd"):
        raise ValueError(f"part must be 'fwd' or 'bwd'; got {part!r}")
    kinds = ("fwd",) if part == "fwd" else ("bwd", "bwd_dkdv", "bwd_dq")
    variants = {kind: probe_variants(kind, arch, head_dim, dtype, device) for kind in kinds}
    failed = {}
    measured = tune_head_dim(kinds, dtype, head_dim, device, cands_for=variants.get, failed=failed,
                             log=lambda *_: None, **PROBE_SHAPE)
    # Keep the rows that decided something (more than the static tile was timed) and the backward choice.
    rows = {key: {**row, "probed": True} for key, row in measured.items()
            if key.startswith("bwd_impl/") or len(variants[key.split("/")[0]]) > 1}
    if probe_marker(part, arch, head_dim, dtype) not in rows:
        raise RuntimeError(f"no {part} variant passed its check on {device} at head_dim {head_dim}, {dtype}: "
                           f"{failed}")
    return rows


def table_meta(device, arch) -> dict:
    """The fields of a new kernel table for `device` (what it was measured with; ``kernels``: the digest)."""
    return {"device_name": tuning.device_properties(device).name if device.type == "cuda" else device.type,
            "arch": arch, "torch": torch.__version__, "triton": triton.__version__,
            "kernels": tuning.kernels_fingerprint(), "measured": datetime.date.today().isoformat()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ndp_kernels.tune", description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--quick", action="store_true", help="a small grid (minutes instead of tens of minutes)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds for the whole run, shared by the (dtype, head_dim, kind) rows: candidates not "
                         "reached in a row's share are not timed (the static and the table's tiles always are)")
    ap.add_argument("--out", default=None, help="directory (default: the tuning cache, $NDP_TUNING_DIR)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m ndp_kernels.tune: no CUDA device is visible. Tuning times the kernels on the GPU they "
              "will run on; run it on a machine with the GPU (the static tables in ndp_kernels/configs.py "
              "apply meanwhile).", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    arch = current_arch(device)
    kinds = [x for x in args.kinds.split(",") if x]
    bad = [x for x in kinds if x not in KINDS]
    if bad:
        ap.error(f"--kinds must be among {KINDS}; got {bad}")
    kinds.sort(key=KINDS.index)
    dtypes = [getattr(torch, t) for t in args.dtypes.split(",")]
    path = tuning.table_path("kernels", tuning.device_key(device), args.out)
    todo = [(dtype, int(d)) for dtype in dtypes for d in args.head_dims.split(",")]
    t_end = None if args.budget_s is None else time.perf_counter() + args.budget_s
    measured = 0
    with no_probe():  # every row is measured here, with its tiles; nothing to measure on first use
        for i, (dtype, d) in enumerate(todo):
            share = None if t_end is None else (t_end - time.perf_counter()) / (len(todo) - i)
            rows = tune_head_dim(kinds, dtype, d, device, seqlen=args.seqlen, quick=args.quick, budget_s=share)
            # Merged after each (dtype, head_dim), so a run stopped from outside keeps what it measured: the rows
            # measured here replace theirs, every other row of the table (other head sizes, dtypes) stays.
            table = tuning.merge_rows(path, rows, lambda: table_meta(device, arch), valid=tuning.for_these_kernels,
                                      replace=True)
            measured += len(rows)
            print(f"wrote {path} ({measured} rows measured, {len(table['rows'])} in the table); ndp_kernels.configs "
                  f"reads it on this GPU model", flush=True)
    return 0


configs.use_tuner(sys.modules[__name__])

if __name__ == "__main__":
    sys.exit(main())
