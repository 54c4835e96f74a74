"""Measure every attention engine per block class on this device and write the table ``auto`` reads.

    python -m ndp.ops.tune                       # this machine's GPU (CPU when there is none)
    python -m ndp.ops.tune --device cpu --ship   # write the table shipped inside the package
    python -m ndp.ops.tune --warmup --head-dims 128 --dtypes bfloat16   # before training: first-use rows only

For each block class (full, causal, window, varlen, other), dtype and head_dim bucket it builds one
representative block, checks every available engine that can run it exactly against the float64
reference (out, lse, dq, dk, dv; an engine that fails is rejected, never timed), times forward+backward
of the block (median of ``--iters``), and writes the engines ordered fastest first. The reference
engine (``torch``) is timed for comparison but ``auto`` never picks it. The table goes to the user's
tuning cache (``ndp_kernels.tuning.tuning_dir()``, ``$NDP_TUNING_DIR``) as ``engines-<device>.json``;
``python -m ndp.info`` shows the table in use.

``warmup`` (``ndp.warmup``, ``--warmup``) measures only what the first attention calls would, for given head
sizes and dtypes, and in a distributed job shares rank 0's rows with every rank.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import itertools
import logging
import statistics
import sys
import time

import torch
import torch.distributed as dist

import ndp_kernels
from ndp_kernels import NO_LIMIT, Segments, tuning

from ._check import compare_to_reference
from .attention import attention_bwd, attention_fwd
from . import engines
from .engines import (AUTO_ENGINES, CLASSES, ENGINES, HEAD_KINDS, SHIPPED_DIR, block_class, capable,
                      engine_available)

log = logging.getLogger(__name__)

__all__ = ["class_block", "check_engine", "time_engine", "tune", "warmup", "main"]


def class_block(cls: str, s: int) -> tuple[Segments, int, int]:
    """A representative block of class `cls` with about `s` query rows: (segments, seq_q, seq_k)."""
    if cls == "full":
        return Segments.dense(s, s, causal=False), s, s
    if cls == "causal":
        return Segments.dense(s, s, causal=True), s, s
    if cls == "window":
        return Segments.dense(s, s, causal=True, window_size=(max(1, s // 8), 0)), s, s
    if cls == "varlen":
        lens = [s // 2, s // 4, s // 8, s - s // 2 - s // 4 - s // 8]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        return Segments.from_cu_seqlens(cu, cu, causal=True), s, s
    if cls == "other":
        # The zigzag ring's diagonal step: chunk r causal, then chunk 2N-1-r against both chunks.
        c = s // 2
        return Segments.from_rows([(0, c, 0, c, -NO_LIMIT, 0), (c, s - c, 0, s, -NO_LIMIT, c)]), s, s
    raise ValueError(f"unknown block class {cls!r}; classes are {CLASSES}")


def _inputs(sq, sk, h, hk, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, n, hh, d, generator=g, dtype=torch.float64) for n, hh in ((sq, h), (sk, hk), (sk, hk)))
    dout = torch.randn(1, sq, h, d, generator=g, dtype=torch.float64)
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v, dout))


def _fwd_bwd(engine, q, k, v, dout, segs, scale):
    out, lse = attention_fwd(q, k, v, segs, softmax_scale=scale, backend=engine)
    grads = attention_bwd(dout, q, k, v, out, lse, segs, softmax_scale=scale, backend=engine)
    return (out, lse) + tuple(grads)


def check_engine(engine, cls, dtype, head_dim, device, *, s=97, h=4, hk=2) -> tuple[bool, float]:
    """Whether `engine` matches the float64 reference on a small block of class `cls`: (ok, worst error)."""
    segs, sq, sk = class_block(cls, s)
    q, k, v, dout = _inputs(sq, sk, h, hk, head_dim, dtype, device, seed=1)
    scale = head_dim ** -0.5
    got = _fwd_bwd(engine, q, k, v, dout, segs, scale)
    return compare_to_reference(got, q, k, v, dout, segs, scale)


def time_engine(engine, cls, dtype, head_dim, device, *, s, h=8, hk=2, iters=3) -> float:
    """Median milliseconds of forward+backward of one block of class `cls` on `engine`."""
    segs, sq, sk = class_block(cls, s)
    q, k, v, dout = _inputs(sq, sk, h, hk, head_dim, dtype, device)
    scale = head_dim ** -0.5
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    _fwd_bwd(engine, q, k, v, dout, segs, scale)  # warm-up (compiles Triton kernels on first use)
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        _fwd_bwd(engine, q, k, v, dout, segs, scale)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# Query and K/V heads of the blocks each head kind (engines.HEAD_KINDS) is checked and timed on.
CHECK_HEADS = {"mha": (4, 4), "gqa": (4, 2)}
TIME_HEADS = {"mha": (8, 8), "gqa": (8, 2)}


def measure_row(device, cls, dtype, head_dim, *, s, iters, with_reference=True, kind="gqa") -> dict:
    """One table row: every engine available and exact here for a block of class `cls`, checked against the
    float64 reference and then timed; ``{"order": fastest first (auto's engines only), "ms": ..., "engines": auto's
    engines installed here, "rejected"}``.
    An engine that differs from the reference or raises is named in ``rejected`` and never in ``order``
    (``engines.choose`` skips it, its default order included). kind: the head layout of the blocks."""
    segs, sq, sk = class_block(cls, 8)
    (h, hk), (th, thk) = CHECK_HEADS[kind], TIME_HEADS[kind]
    probe_q = torch.empty(1, sq, h, head_dim, dtype=dtype, device=device)
    probe_k = torch.empty(1, sk, hk, head_dim, dtype=dtype, device=device)
    assert block_class(segs, sq, sk) == cls
    ms, rejected = {}, {}
    names = [e for e in ENGINES if e in AUTO_ENGINES or (with_reference and e == "torch")]
    for e in names:
        ok, why = engine_available(e, device)
        if ok:
            ok, why = capable(e, segs, probe_q, probe_k)
        if not ok:
            continue
        try:
            good, err = check_engine(e, cls, dtype, head_dim, device, h=h, hk=hk)
            if good:
                ms[e] = round(time_engine(e, cls, dtype, head_dim, device, s=s, h=th, hk=thk, iters=iters), 3)
            else:
                rejected[e] = f"differs from the float64 reference (max error {err:.3e})"
        except torch.OutOfMemoryError:
            raise  # the device is full now, not the engine broken: no row is written (auto's default order serves)
        except Exception as exc:  # noqa: BLE001 - an engine that fails here is dropped from the row, named
            rejected[e] = f"failed: {type(exc).__name__}: {exc}"
            log.warning("ndp.ops.tune: engine %r failed on a %s block (%s, head_dim %d) on %s and is left out of "
                        "auto's order (%s)", e, cls, dtype, head_dim, device, rejected[e])
    order = sorted((e for e in ms if e in AUTO_ENGINES), key=ms.get)
    installed = [e for e in AUTO_ENGINES if engine_available(e, device)[0]]  # what a shipped row is valid for
    return {"order": order, "ms": ms, "engines": installed, **({"rejected": rejected} if rejected else {})}


def _row_key(cls, dtype, head_dim, kind) -> str:
    return "/".join(map(str, engines.row_key(cls, dtype, head_dim, kind)))


def _meta(device, s, iters) -> dict:
    return {
        "device_key": tuning.device_key(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": _triton_version(),
        "measured": datetime.date.today().isoformat(),
        "block": f"B=1 S={s} H=8, Hkv=8 (mha) or 2 (gqa), forward+backward, median of {iters}",
        "threads": torch.get_num_threads(),
    }


def tune(device, *, dtypes, head_dims, s, iters, with_reference=True, kinds=HEAD_KINDS, log=print) -> dict:
    """Measures every (class, dtype, head_dim, head kind) row; returns the table as a JSON-ready dict."""
    device = torch.device(device)
    rows = {}
    for cls, dtype, d, kind in itertools.product(CLASSES, dtypes, head_dims, kinds):
        key = _row_key(cls, dtype, d, kind)
        row = rows[key] = measure_row(device, cls, dtype, d, s=s, iters=iters, with_reference=with_reference,
                                      kind=kind)
        times = sorted(row["ms"].items(), key=lambda x: x[1])
        log(f"{key:<28} " + "  ".join(f"{e} {t:9.2f} ms" for e, t in times)
            + (f"  rejected: {row['rejected']}" if "rejected" in row else ""))
    return {**_meta(device, s, iters), "rows": rows}


# The first-use probe: auto on a device whose table has no row for a block measures that row once (a small
# block, the engines auto may pick) and adds it to the user's table, so later processes read it.
PROBE_SEQLEN = 2048
PROBE_ITERS = 3


def probe_row(device, cls, dtype, head_dim, kind) -> dict:
    """The row (cls, dtype, head_dim bucket, head kind) on `device` (``measure_row``), measured once per machine and
    merged into the user's engine table (``tuning.measure_once``: a process that waited for the lock takes the row
    written, so the ranks of a node run one engine order; the table keeps every other row)."""
    device = torch.device(device)
    key = _row_key(cls, dtype, head_dim, kind)

    def measure():
        row = measure_row(device, cls, dtype, head_dim, s=PROBE_SEQLEN, iters=PROBE_ITERS, with_reference=False,
                          kind=kind)
        return {key: {**row, "probed": True}}

    rows = tuning.measure_once(tuning.table_path("engines", tuning.device_key(device)), key, measure,
                               lambda: _meta(device, PROBE_SEQLEN, PROBE_ITERS))
    return rows[key]


# The explicit warm-up: what the first attention calls would measure and compile, done before training.
WARMUP_SEQLEN = 256
WARMUP_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def warmup(head_dims, dtypes=(torch.bfloat16,), *, head_kinds=HEAD_KINDS, device=None, group=None,
           classes=CLASSES) -> dict:
    """Measures and compiles now what the first attention calls would (the kernels' open choices and auto's engine
    order per block class, for each head size, dtype and head layout: ``head_kinds`` "mha" and/or "gqa", the
    model's), so the first training step measures nothing. A launcher
    runs it before training (``python -m ndp.ops.tune --warmup``); ``ndp.train`` calls it.

    In a distributed job (`group`; default the world once torch.distributed is initialized) call it on every rank
    of the group: rank 0 of the group measures and broadcasts its rows, and every rank takes them (and merges them
    into its machine's tables), so every rank on every node runs the same kernels and engines. A rank whose GPU
    model differs from rank 0's measures its own. With ``NDP_AUTO_PROBE=0`` nothing is measured (the tables
    apply) and the kernels are only compiled.

    Returns:
        ``{"device", "measured_by", "kernel_rows", "engine_rows", "seconds"}`` (the group rank whose rows this
        rank runs, the rows of each table in use, this rank's time).
    Raises:
        ValueError: a head size or dtype ndp cannot run (before any work or communication).
        RuntimeError: rank 0's measurement failed (on every rank of the group, naming rank 0's error).
    """
    what = _warmup_args(head_dims, dtypes, head_kinds, classes)
    device = torch.device(device) if device is not None else \
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    size, rank = (dist.get_world_size(group), dist.get_rank(group)) if group is not None else (1, 0)
    t0 = time.perf_counter()
    measured_by = 0
    if rank == 0:
        sent = _measured_or_error(device, what)
    if size > 1:
        box = [(tuning.device_key(device), sent) if rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group,
                                   device=device if device.type == "cuda" else None)
        sent = box[0][1]
        if isinstance(sent, str):
            raise RuntimeError(f"ndp.warmup: rank 0 of the group failed while measuring: {sent}")
        if rank != 0 and box[0][0] == tuning.device_key(device):
            _adopt(device, sent)
            with tuning.no_measurement():  # rank 0's rows decide, also where it could not measure one
                _first_calls(device, what)
        elif rank != 0:  # another GPU model: rank 0's timings say nothing about this one
            measured_by = rank
            _first_calls(device, what, measure=True)
    elif isinstance(sent, str):
        raise RuntimeError(f"ndp.warmup failed: {sent}")
    return {"device": tuning.device_key(device), "measured_by": measured_by,
            "kernel_rows": len(_kernel_rows(device)), "engine_rows": len(engines.table_rows(device)),
            "seconds": round(time.perf_counter() - t0, 3)}


def _warmup_args(head_dims, dtypes, kinds, classes) -> tuple:
    """(head_dims, dtypes, kinds, classes) checked, as lists."""
    head_dims = [head_dims] if isinstance(head_dims, int) else list(head_dims)
    dtypes = [dtypes] if isinstance(dtypes, torch.dtype) else list(dtypes)
    bad = [d for d in head_dims if not isinstance(d, int) or isinstance(d, bool) or d < 1]
    if not head_dims or bad:
        raise ValueError(f"ndp.warmup: head_dims must be positive ints (the model's attention head sizes, e.g. "
                         f"[128]); got {head_dims}")
    if not dtypes or any(t not in WARMUP_DTYPES for t in dtypes):
        raise ValueError(f"ndp.warmup: dtypes must be among {WARMUP_DTYPES} (the dtype attention runs in); "
                         f"got {dtypes}")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    if not kinds or any(k not in HEAD_KINDS for k in kinds):
        raise ValueError(f"ndp.warmup: head_kinds must be among {HEAD_KINDS} ('mha': as many K/V heads as query "
                         f"heads, 'gqa': fewer); got {kinds}")
    if not classes or any(c not in CLASSES for c in classes):
        raise ValueError(f"ndp.warmup: classes must be among {CLASSES}; got {classes}")
    return head_dims, dtypes, kinds, list(classes)


def _measured_or_error(device, what):
    """Measures and compiles (``_first_calls``) and returns the rows to share, or the error as text (so a failing
    rank 0 still reaches the broadcast and every rank raises instead of waiting)."""
    try:
        _first_calls(device, what, measure=True)
        return {"kernels": _kernel_rows(device), "engines": engines.table_rows(device)}
    except Exception as e:  # noqa: BLE001 - reported on every rank by warmup
        return f"{type(e).__name__}: {e}"


def _first_calls(device, what, *, measure=False):
    """measure: first what the first calls would measure, failures raised (engine rows per block class and head
    kind, the kernels' open choices where the Triton kernels run here). Then one forward+backward of each block
    class through auto, and one through the Triton kernels, which compiles what the first step runs."""
    head_dims, dtypes, kinds, classes = what
    triton_here = engine_available("triton", device)[0]
    for dtype, d, kind in itertools.product(dtypes, head_dims, kinds):
        if measure:
            for cls in classes:
                engines.measure_first_use(cls, dtype, d, kind, device)
            if triton_here:
                ndp_kernels.measure_first_use(d, dtype, device)
        calls = [("auto", cls) for cls in classes] + ([("triton", "causal")] if triton_here else [])
        for engine, cls in calls:
            segs, sq, sk = class_block(cls, WARMUP_SEQLEN)
            q, k, v, dout = _inputs(sq, sk, *CHECK_HEADS[kind], d, dtype, device)
            if engine == "auto" or capable(engine, segs, q, k)[0]:  # triton: no bf16 under the interpreter
                _fwd_bwd(engine, q, k, v, dout, segs, d ** -0.5)


def _kernel_rows(device) -> dict:
    return dict(ndp_kernels.tuned_table(device)) if ndp_kernels.triton_available()[0] else {}


def _adopt(device, sent) -> None:
    if sent["kernels"]:
        ndp_kernels.adopt_rows(device, sent["kernels"])
    engines.adopt_rows(device, sent["engines"])


def _triton_version():
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ndp.ops.tune", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--seqlen", type=int, default=None, help="rows per block (default 4096 on GPU, 1024 on CPU)")
    ap.add_argument("--dtypes", default=None, help="comma list (default bfloat16,float16,float32 on GPU; "
                                                   "float32,bfloat16,float16,float64 on CPU)")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", action="store_true", help="measure and compile only what the first attention "
                    "calls would (kernels and engines; --head-dims, --dtypes default bfloat16): a launcher runs it "
                    "once per machine before training")
    ap.add_argument("--ship", action="store_true", help="write into the package (ndp/ops/tables) instead of the "
                                                        "user cache")
    ap.add_argument("--out", default=None, help="directory to write to (default: the user tuning cache)")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("python -m ndp.ops.tune: --device cuda asked, but no CUDA device is visible", file=sys.stderr)
        return 2
    gpu = device.type == "cuda"
    if args.warmup:
        got = warmup([int(x) for x in args.head_dims.split(",")],
                     [getattr(torch, t) for t in (args.dtypes or "bfloat16").split(",")], device=device)
        print(f"warm: {got}")
        return 0
    dtypes = [getattr(torch, t) for t in (args.dtypes or ("bfloat16,float16,float32" if gpu else
                                                          "float32,bfloat16,float16,float64")).split(",")]
    head_dims = [int(x) for x in args.head_dims.split(",")]
    s = args.seqlen or (4096 if gpu else 1024)
    table = tune(device, dtypes=dtypes, head_dims=head_dims, s=s, iters=args.iters)
    directory = SHIPPED_DIR if args.ship else (args.out or tuning.tuning_dir())
    path = tuning.save_json(tuning.table_path("engines", table["device_key"], directory), table)
    print(f"wrote {path}")
    return 0


engines.use_tuner(sys.modules[__name__])

if __name__ == "__main__":
    sys.exit(main())
