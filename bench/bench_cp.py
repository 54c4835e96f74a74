"""Context-parallel attention benchmark: work balance, communication bytes, and time.

    python bench/bench_cp.py --out bench/results/            # everything that runs here
    python bench/bench_cp.py --only balance                   # no processes spawned

1. Work balance (no process group: the schedules and shard_packed plans are evaluated directly):
   max/mean attention FLOPs per rank for dense causal attention (N = 2..32) per layout and impl, and
   for packed documents (lognormal and long-tail length mixes) with ndp.shard_packed against a naive
   equal-token split. Targets: 1.00 zigzag/striped dense, <= 1.05 packed with shard_packed.
2. Communication: bytes per rank and layer, forward and backward, measured with ndp.cp.CommStats in
   a gloo job, against the theoretical minimum of each impl (ratio target 1.00).
3. Time on CPU (gloo, one thread per rank): fwd+bwd of ring / allgather / ulysses against
   single-process attention on the whole sequence -> parallel efficiency T1 / (N * T_N), T_N the
   slowest rank. With CUDA (NCCL) the same runs on GPUs and report % of ideal (T1 / N). Before timing,
   each impl's output is checked against single-process attention on the full sequence (ndp.ops, torch
   backend, cut with ndp.shard_sequence; tolerances from ndp/testing.py): a mismatch raises.
Results: a printed table, <out>/bench_cp.json and <out>/bench_cp.png.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from ndp.cp.schedule import LAYOUTS, Mask, Placement, RingSchedule, build_step  # noqa: E402
from ndp.cp.sharding import DEFAULT_MIN_PIECE, packed_shard  # noqa: E402
from ndp.testing import tol  # noqa: E402

LAYERS_NOTE = "bytes per rank for one attention layer (B=1, S=256, H=8, D=64, fp32)"


# ---------------------------------------------------------------------------------------------- balance

def _ratio(work):
    work = np.asarray(work, dtype=np.float64)
    return float(work.max() / work.mean()) if work.mean() > 0 else 1.0


def _usp_pairs(placement, mask, u):
    """Per-rank pairs of USP with Ulysses size u (ring over groups of u adjacent ranks, heads split by u)."""
    n = placement.world_size
    r = n // u
    from ndp.cp.ulysses import make_a2a_order

    # the same local reorder usp_attention applies after its all-to-all
    groups = [make_a2a_order([placement.positions[g * u + i] for i in range(u)], placement)[1] for g in range(r)]
    ring = RingSchedule(Placement(groups, placement.cu_seqlens), mask)
    per_group = ring.pairs_per_rank()
    return [per_group[c // u] / u for c in range(n)]


def balance_dense(ns=(2, 4, 8, 16, 32), chunk=1024):
    rows = []
    mask = Mask(True)
    for n in ns:
        seqlen = 2 * n * chunk
        for layout in LAYOUTS:
            pl = Placement.dense(seqlen, n, layout)
            ring = RingSchedule(pl, mask).pairs_per_rank()
            rows.append(dict(kind="dense causal", impl="ring/allgather", layout=layout, N=n, ratio=_ratio(ring)))
            if n >= 4:
                rows.append(dict(kind="dense causal", impl="usp(u=2)", layout=layout, N=n,
                                 ratio=_ratio(_usp_pairs(pl, mask, 2))))
        # Ulysses splits heads: every rank computes the whole sequence for heads/N heads.
        rows.append(dict(kind="dense causal", impl="ulysses", layout="any", N=n, ratio=1.0))
    return rows


def doc_mixes(total=65536, seed=0):
    rng = np.random.default_rng(seed)
    mixes = {}
    lens = []
    while sum(lens) < total:
        lens.append(int(np.clip(rng.lognormal(np.log(1024), 1.0), 16, 16384)))
    mixes["lognormal(1k, 1.0)"] = lens
    lens = []
    while sum(lens) < total:
        if rng.random() < 0.04:
            lens.append(int(rng.integers(8192, 24577)))
        else:
            lens.append(int(rng.integers(32, 513)))
    mixes["long-tail (96% 32-512, 4% 8k-24k)"] = lens
    return mixes


def balance_packed(ns=(2, 4, 8, 16, 32), min_piece=DEFAULT_MIN_PIECE):
    rows = []
    mask = Mask(True)
    for name, lens in doc_mixes().items():
        cu = np.concatenate([[0], np.cumsum(lens)]).tolist()
        t = cu[-1]
        for n in ns:
            pl = packed_shard(cu, n, 0, min_piece).placement
            p = RingSchedule(pl, mask).pairs_per_rank()
            rows.append(dict(kind=f"packed {name}", impl="ring/allgather", layout="shard_packed", N=n,
                             ratio=_ratio(p), docs=len(lens), tokens=t))
            # baseline: equal token counts, contiguous in the packed stream
            edges = np.linspace(0, t, n + 1).astype(np.int64)
            naive = Placement([np.arange(edges[i], edges[i + 1]) for i in range(n)], cu)
            q = [build_step(naive.runs(r), naive.gathered_runs(np.arange(t)), mask).pairs for r in range(n)]
            rows.append(dict(kind=f"packed {name}", impl="ring/allgather", layout="naive contiguous", N=n,
                             ratio=_ratio(q), docs=len(lens), tokens=t))
    return rows


# ---------------------------------------------------------------------------------------------- bytes

def _theory(impl, n, b, s, h, hk, d, es, u=None):
    """Theoretical minimum bytes sent per rank (fwd, bwd) for one layer."""
    sl = s // n
    kv = 2 * b * sl * hk * d * es            # local K and V
    kv32 = 2 * b * sl * hk * d * 4           # fp32 dK/dV partial sums
    q = b * sl * h * d * es
    if impl in ("ring", "allgather"):
        # every rank must receive every other rank's K/V; partial dK/dV sums must reach the owners
        return (n - 1) * kv, (n - 1) * kv + (n - 1) * kv32
    if impl == "ulysses":
        f = (n - 1) / n
        kvr = 2 * b * sl * max(hk, n) * d * es   # kv heads replicated just to one per rank
        return f * (q + kvr + q), f * (q + q + kvr)
    if impl == "usp":
        r = n // u
        f = (u - 1) / u
        kvr = 2 * b * sl * max(hk, u) * d * es
        kv_ring = kvr                             # the group's tokens for this rank's heads: same size
        kv_ring32 = kv_ring // es * 4
        return f * (2 * q + kvr) + (r - 1) * kv_ring, f * (2 * q + kvr) + (r - 1) * (kv_ring + kv_ring32)
    raise ValueError(impl)


def _bytes_body(rank, world, out_file, shapes):
    import torch.distributed as dist

    from ndp.cp import (CommStats, allgather_attention, ring_attention, shard_sequence, split_cp_group,
                        ulysses_attention, usp_attention)

    res = []
    b, s, h, d = shapes["b"], shapes["s"], shapes["h"], shapes["d"]
    impls = [("ring", ring_attention), ("allgather", allgather_attention), ("ulysses", ulysses_attention)]
    if world >= 4:
        ug, rg = split_cp_group(None, 2)
        impls.append(("usp", lambda *a, **k: usp_attention(*a, ulysses_group=ug, ring_group=rg, **k)))
    for hk in (h // 4, h):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(b, s, h, d, generator=g)
        k = torch.randn(b, s, hk, d, generator=g)
        v = torch.randn(b, s, hk, d, generator=g)
        ql, kl, vl = (shard_sequence(x, dim=1).requires_grad_() for x in (q, k, v))
        for name, fn in impls:
            with CommStats() as fwd:
                out = fn(ql, kl, vl, causal=True, backend="torch")
            with CommStats() as bwd:
                out.sum().backward()
            res.append(dict(impl=name, N=world, kv_heads=hk, heads=h, fwd_sent=fwd.bytes_sent,
                            fwd_recv=fwd.bytes_received, bwd_sent=bwd.bytes_sent, bwd_recv=bwd.bytes_received,
                            fwd_flops=fwd.attn_flops, bwd_flops=bwd.attn_flops))
    allres = [None] * world
    dist.all_gather_object(allres, res)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(allres, f)


def _spawn(fn, world, *args):
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(fn, world, tmp, args), nprocs=world, join=True)


def _entry(rank, fn, world, tmp, args, backend="gloo"):
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    ok = False
    try:
        fn(rank, world, *args)
        ok = True
    finally:
        end_rank(ok)


def end_rank(ok: bool) -> None:
    """Leave a benchmark's process group: every rank together, then without the C++ teardown on success.

    torch 2.13's gloo can abort in its static destructors at interpreter exit ("terminate called without an
    active exception") after every rank finished, failing a run whose results are already written. A
    failing rank (ok False) only destroys its group and lets its exception reach mp.spawn.
    """
    import ndp

    ndp.shutdown(barrier=ok)
    if ok:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def comm_bytes(worlds=(2, 4), shapes=None):
    shapes = shapes or dict(b=1, s=256, h=8, d=64)
    rows = []
    for n in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            f = os.path.join(tmp, "bytes.json")
            _spawn(_bytes_body, n, f, shapes)
            with open(f) as fh:
                per_rank = json.load(fh)
        for i, base in enumerate(per_rank[0]):
            ranks = [r[i] for r in per_rank]
            tf, tb = _theory(base["impl"], n, shapes["b"], shapes["s"], shapes["h"], base["kv_heads"], shapes["d"], 4,
                             u=2)
            fs = max(r["fwd_sent"] for r in ranks)
            bs = max(r["bwd_sent"] for r in ranks)
            rows.append(dict(impl=base["impl"], N=n, heads=base["heads"], kv_heads=base["kv_heads"], fwd_bytes=fs,
                             bwd_bytes=bs, fwd_min=tf, bwd_min=tb, fwd_ratio=fs / tf if tf else 1.0,
                             bwd_ratio=bs / tb if tb else 1.0,
                             flops_ratio=_ratio([r["fwd_flops"] for r in ranks])))
    return rows


# ---------------------------------------------------------------------------------------------- time

def _samples(step, dev, warmup, iters, barrier=None):
    """Seconds of each timed run of step() (docs/design.md, benchmarks): warm-up runs, then each timed run
    starts after `barrier` (distributed) and is timed with CUDA events on GPU, perf_counter only on CPU.
    The one timer of the benchmarks (bench_engines, simulate_cp and plan_vs_measured call it too)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        if barrier is not None:
            barrier()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return times


def _timed(step, dev, warmup, iters, barrier=None):
    """Median seconds of step() over ``_samples``."""
    return float(np.median(_samples(step, dev, warmup, iters, barrier)))


def _reference_shard(q, k, v, dtype):
    """Single-process fp32 attention on the full sequence (ndp.ops, backend="torch"; inputs first rounded to
    `dtype`), this rank's part cut with ndp.shard_sequence. One query head at a time: the dense
    reference holds S x S per head."""
    import ndp
    import ndp.ops

    q, k, v = (x.to(dtype).float() for x in (q, k, v))
    r = q.shape[2] // k.shape[2]
    with torch.no_grad():
        ref = torch.cat([ndp.ops.attention(q[:, :, i:i + 1], k[:, :, i // r:i // r + 1], v[:, :, i // r:i // r + 1],
                                           causal=True, backend="torch").cpu() for i in range(q.shape[2])], dim=2)
    return ndp.shard_sequence(ref, dim=1)


def _check_reference(name, out, ref, dtype, dev):
    """Compare one CP output with the reference before timing; every rank raises on a mismatch on any rank.
    Tolerances: ndp/testing.py ("out" row of `dtype`). Returns the max abs error over ranks."""
    import torch.distributed as dist

    atol, rtol = tol(dtype, "out")
    diff = (out.detach().cpu().double() - ref.double()).abs()
    bad = (diff > atol + rtol * ref.double().abs()).sum() + (~torch.isfinite(diff)).sum()
    stats = torch.tensor([diff.max().item(), float(bad)], dtype=torch.float64, device=dev)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)   # NCCL only reduces CUDA tensors
    err, nbad = stats.tolist()
    ok = nbad == 0
    if dist.get_rank() == 0:
        print(f"reference check {name} N={dist.get_world_size()} {str(dtype)[6:]}: max|out-ref| = {err:.3e} "
              f"(atol {atol:g}, rtol {rtol:g}) {'ok' if ok else 'MISMATCH'}", flush=True)
    if not ok:
        raise RuntimeError(f"bench_cp: {name} output differs from the single-process reference on rank "
                           f"{dist.get_rank()}: max abs error {err:.3e}, {int(nbad)} elements over atol={atol:g} "
                           f"rtol={rtol:g} (max over ranks); not timing a wrong result")
    return err


def _time_body(rank, world, out_file, cfg):
    import torch.distributed as dist

    from ndp.cp import allgather_attention, ring_attention, shard_sequence, ulysses_attention

    dev = torch.device("cuda", rank) if cfg["device"] == "cuda" else torch.device("cpu")
    b, s, h, hk, d = cfg["b"], cfg["s"], cfg["h"], cfg["hk"], cfg["d"]
    dtype = getattr(torch, cfg["dtype"])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, s, hh, d, generator=g) for hh in (h, hk, hk))
    ref = _reference_shard(q.to(dev), k.to(dev), v.to(dev), dtype)
    ql, kl, vl = (shard_sequence(x, dim=1).to(dev, dtype).requires_grad_() for x in (q, k, v))
    res = {}
    for name, fn in (("ring", ring_attention), ("allgather", allgather_attention), ("ulysses", ulysses_attention)):
        if name == "ulysses" and (h % world or (hk < world and world % hk) or (hk >= world and hk % world)):
            continue
        with torch.no_grad():
            err = _check_reference(name, fn(ql, kl, vl, causal=True, backend=cfg["backend"]), ref, dtype, dev)

        def step():
            fn(ql, kl, vl, causal=True, backend=cfg["backend"]).sum().backward()

        # on the rank's device: NCCL only reduces CUDA tensors
        t = torch.tensor([_timed(step, dev, cfg["warmup"], cfg["iters"], dist.barrier)], dtype=torch.float64,
                         device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)   # the slowest rank sets the pace
        res[name] = dict(tN=t.item(), ref_err=err)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(res, f)


def _single_time(cfg):
    import ndp.ops

    torch.set_num_threads(1)
    dev = torch.device("cuda", 0) if cfg["device"] == "cuda" else torch.device("cpu")
    dtype = getattr(torch, cfg["dtype"])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(cfg["b"], cfg["s"], hh, cfg["d"], generator=g).to(dev, dtype).requires_grad_()
               for hh in (cfg["h"], cfg["hk"], cfg["hk"]))

    def step():
        ndp.ops.attention(q, k, v, causal=True, backend=cfg["backend"]).sum().backward()

    return _timed(step, dev, cfg["warmup"], cfg["iters"])


def timing(worlds=(2, 4), device="cpu", s=1024):
    cfg = dict(b=1, s=s, h=8, hk=2, d=64, dtype="float32" if device == "cpu" else "bfloat16",
               backend="auto", warmup=1, iters=3, device=device)
    t1 = _single_time(cfg)
    rows = []
    for n in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            f = os.path.join(tmp, "time.json")
            if device == "cuda":
                import torch.multiprocessing as mp

                mp.spawn(_entry, args=(_time_body, n, tmp, (f, cfg), "nccl"), nprocs=n, join=True)
            else:
                _spawn(_time_body, n, f, cfg)
            with open(f) as fh:
                res = json.load(fh)
        for impl, r in res.items():
            tn = r["tN"]
            rows.append(dict(device=device, impl=impl, N=n, t1=t1, tN=tn, ref_err=r["ref_err"],
                             efficiency=t1 / (n * tn), pct_ideal=100 * (t1 / n) / tn,
                             shape=f"B=1 S={s} H=8 Hkv=2 D=64 {cfg['dtype']} causal"))
    return rows


# ---------------------------------------------------------------------------------------------- report

def _table(rows, cols, title):
    print(f"\n== {title}")
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(cols, widths)))


def _fmt(x):
    if isinstance(x, float):
        return f"{x:.3f}" if x == 0 or 1e-3 <= abs(x) < 1e5 else f"{x:.3e}"
    return str(x)


def _plot(result, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax = axes[0]
    for layout in LAYOUTS:
        rs = [r for r in result["balance"] if r["kind"] == "dense causal" and r["layout"] == layout
              and r["impl"] == "ring/allgather"]
        ax.plot([r["N"] for r in rs], [r["ratio"] for r in rs], marker="o", label=f"ring {layout}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N ranks")
    ax.set_ylabel("max/mean FLOPs per rank")
    ax.set_title("dense causal balance")
    ax.legend()
    ax = axes[1]
    kinds = sorted({r["kind"] for r in result["balance"] if r["kind"].startswith("packed")})
    for kind in kinds:
        for layout in ("shard_packed", "naive contiguous"):
            rs = [r for r in result["balance"] if r["kind"] == kind and r["layout"] == layout]
            ax.plot([r["N"] for r in rs], [r["ratio"] for r in rs], marker="o",
                    linestyle="-" if layout == "shard_packed" else "--", label=f"{kind[7:20]} {layout}")
    ax.axhline(1.05, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("N ranks")
    ax.set_title("packed documents balance")
    ax.legend(fontsize=7)
    ax = axes[2]
    if result.get("bytes"):
        labels = [f"{r['impl']}\nN={r['N']} kv={r['kv_heads']}" for r in result["bytes"]]
        x = np.arange(len(labels))
        ax.bar(x - 0.2, [r["fwd_ratio"] for r in result["bytes"]], 0.4, label="fwd")
        ax.bar(x + 0.2, [r["bwd_ratio"] for r in result["bytes"]], 0.4, label="bwd")
        ax.set_xticks(x)
        ax.set_xticklabels(labels, fontsize=6, rotation=90)
        ax.set_ylabel("bytes / theoretical minimum")
        ax.set_title("communication")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _git_sha():
    """The checked-out commit: ``$NDP_GIT_SHA`` (a copy of the tree without .git, e.g. on a GPU machine), else read
    from .git with no git process (a worktree's ``gitdir:`` file and packed refs followed)."""
    if os.environ.get("NDP_GIT_SHA"):
        return os.environ["NDP_GIT_SHA"]
    try:
        git = os.path.join(ROOT, ".git")
        if os.path.isfile(git):  # a worktree: "gitdir: <its folder in the main repository>"
            git = open(git).read().split("gitdir:", 1)[1].strip()
        head = open(os.path.join(git, "HEAD")).read().strip()
        if not head.startswith("ref: "):
            return head
        common = os.path.join(git, open(os.path.join(git, "commondir")).read().strip()) \
            if os.path.exists(os.path.join(git, "commondir")) else git
        ref = os.path.join(common, head[5:])
        if os.path.exists(ref):
            return open(ref).read().strip()
        packed = os.path.join(common, "packed-refs")
        lines = open(packed).read().splitlines() if os.path.exists(packed) else []
        return next((x.split()[0] for x in lines if x.endswith(" " + head[5:])), "unknown")
    except (OSError, IndexError):
        return "unknown"


def _write_csv(result, path):
    """One CSV row per result with the machine, versions and git SHA (docs/design.md, "Conventions: benchmarks")."""
    import csv

    meta = result["meta"]
    rows = [dict(section=sec, **r) for sec in ("balance", "bytes", "time") for r in result.get(sec, [])]
    keys = sorted({k for r in rows for k in r})
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["gpu", "torch", "git_sha"] + keys)
        w.writeheader()
        for r in rows:
            w.writerow(dict(gpu=meta.get("gpu", "none"), torch=meta["torch"], git_sha=meta["git_sha"], **r))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--only", choices=["balance", "bytes", "time"], action="append")
    ap.add_argument("--seqlen", type=int, default=1024, help="sequence length of the timing runs")
    args = ap.parse_args(argv)
    parts = set(args.only or ["balance", "bytes", "time"])
    os.makedirs(args.out, exist_ok=True)
    result = dict(meta=dict(torch=torch.__version__, python=platform.python_version(), machine=platform.machine(),
                            cpus=os.cpu_count(), cuda=torch.cuda.is_available(), git_sha=_git_sha(),
                            gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
                            date=datetime.datetime.now(datetime.timezone.utc).isoformat()))
    if "balance" in parts:
        result["balance"] = balance_dense() + balance_packed()
        _table(result["balance"], ["kind", "impl", "layout", "N", "ratio"], "work balance: max/mean FLOPs per rank")
    if "bytes" in parts:
        result["bytes"] = comm_bytes()
        _table(result["bytes"], ["impl", "N", "kv_heads", "fwd_bytes", "fwd_min", "fwd_ratio", "bwd_bytes", "bwd_min",
                                 "bwd_ratio", "flops_ratio"], f"communication, {LAYERS_NOTE}")
    if "time" in parts:
        rows = timing(device="cpu", s=args.seqlen)
        _table(rows, ["device", "impl", "N", "t1", "tN", "pct_ideal", "efficiency", "ref_err", "shape"],
               f"fwd+bwd time, gloo on CPU, one thread per rank ({os.cpu_count()} cores on this machine)")
        if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
            n = torch.cuda.device_count()
            gpu = timing(worlds=tuple(w for w in (2, 4, 8) if w <= n), device="cuda", s=max(args.seqlen, 16384))
            _table(gpu, ["device", "impl", "N", "t1", "tN", "pct_ideal", "ref_err", "shape"],
                   "fwd+bwd time, NCCL on GPUs")
            rows += gpu
        else:
            print("\nno CUDA devices (or fewer than 2): GPU/NCCL mode skipped; the CPU figures above are gloo.")
        result["time"] = rows
    path = os.path.join(args.out, "bench_cp.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    _write_csv(result, os.path.join(args.out, "bench_cp.csv"))
    if "balance" in result:
        _plot(result, os.path.join(args.out, "bench_cp.png"))
    print(f"\nsaved {path}" + (" and bench_cp.png" if "balance" in result else ""))


if __name__ == "__main__":
    main()
