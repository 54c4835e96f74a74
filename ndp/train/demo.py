"""``make demo``: N-D parallel training gives the same result as training on one device.

Runs the same tiny-Llama training twice on the shipped corpus with the same seed:

1. 4 processes, ``dp_shard 2 x cp 2`` (FSDP2 over 2 data shards, ring attention with zigzag sharding over
   2 context-parallel ranks), launched with torchrun;
2. 1 process;

then prints both loss curves side by side. Uses 4 GPUs (NCCL) when at least 4 are visible, otherwise
the CPU (gloo).

    python -m ndp.train.demo [--steps N] [--seq-len N] [--batch-size N] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch


def _run(cmd, env, label):
    t0 = time.perf_counter()
    print(f"\n$ {' '.join(cmd)}", flush=True)
    r = subprocess.run(cmd, env=env)
    if r.returncode != 0:
        raise SystemExit(f"demo: the {label} run failed (exit code {r.returncode})")
    return time.perf_counter() - t0


def _read(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _plot(a, b, width=60, height=12):
    # Two curves on one ASCII chart: '*' 4-process, 'o' 1-process ('#' where they coincide).
    lo, hi = min(a + b), max(a + b)
    span = (hi - lo) or 1.0
    n = len(a)
    cols = [int(i * (n - 1) / max(1, width - 1)) for i in range(min(width, n))]
    grid = [[" "] * len(cols) for _ in range(height)]
    for c, i in enumerate(cols):
        ra = int(round((hi - a[i]) / span * (height - 1)))
        rb = int(round((hi - b[i]) / span * (height - 1)))
        grid[rb][c] = "o"
        grid[ra][c] = "#" if ra == rb else "*"
    lines = []
    for r, row in enumerate(grid):
        y = hi - r * span / (height - 1)
        lines.append(f"{y:7.3f} |" + "".join(row))
    lines.append(" " * 8 + "+" + "-" * len(cols))
    lines.append(" " * 9 + f"step 1 .. {n}   (* = 4 processes, o = 1 process, # = both)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="directory for the metrics files (kept); default: a temporary "
                    "directory removed at the end")
    args = ap.parse_args(argv)

    # One temporary folder per run, removed at the end: the metrics (unless --out) and the children's
    # TMPDIR, where torchrun leaves a torchelastic_* log folder per launch.
    with tempfile.TemporaryDirectory(prefix="ndp-demo-") as tmp:
        if args.out is not None:
            os.makedirs(args.out, exist_ok=True)
        return _demo(args, args.out or tmp, tmp, kept=args.out is not None)


def _demo(args, out, scratch, *, kept):
    gpus = torch.cuda.device_count()
    device = "cuda" if gpus >= 4 else "cpu"
    env = dict(os.environ, TMPDIR=scratch)
    env.setdefault("OMP_NUM_THREADS", "1")
    common = ["--model", args.model, "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
              "--steps", str(args.steps), "--lr", str(args.lr), "--seed", str(args.seed), "--dtype", "fp32",
              "--device", device]
    m4, m1 = os.path.join(out, "metrics_dp2_cp2.jsonl"), os.path.join(out, "metrics_single.jsonl")
    print(f"ndp demo: {args.model}, {args.steps} steps of {args.batch_size} x {args.seq_len} tokens on "
          f"{'4 GPUs' if device == 'cuda' else 'CPU (gloo)'}; metrics in {out}"
          f"{'' if kept else ' (removed at the end; --out DIR keeps them)'}")
    t4 = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m",
               "ndp.train", *common, "--dp-shard", "2", "--cp", "2", "--cp-impl", "ring", "--cp-layout", "zigzag",
               "--metrics", m4], env, "4-process")
    env1 = dict(env)
    if device == "cpu":
        env1["OMP_NUM_THREADS"] = str(min(4, os.cpu_count() or 1))
    t1 = _run([sys.executable, "-m", "ndp.train", *common, "--metrics", m1], env1, "1-process")

    a, b = _read(m4), _read(m1)
    la, lb = [r["loss"] for r in a], [r["loss"] for r in b]
    print("\n  step | 4 procs: dp_shard 2 x cp 2 (ring, zigzag) | 1 process |  rel. diff")
    print("  -----+------------------------------------------+-----------+-----------")
    every = max(1, len(la) // 15)
    worst = 0.0
    for i, (x, y) in enumerate(zip(la, lb)):
        rel = abs(x - y) / abs(y)
        worst = max(worst, rel)
        if i % every == 0 or i == len(la) - 1:
            print(f"  {i + 1:4d} | {x:40.6f} | {y:9.6f} | {rel:9.2e}")
    print()
    print(_plot(la, lb))
    tps4 = sum(r["tokens_per_s"] for r in a) / len(a)
    tps1 = sum(r["tokens_per_s"] for r in b) / len(b)
    print(f"\nmax relative loss difference over {len(la)} steps: {worst:.2e}")
    print(f"wall time: 4 processes {t4:.1f} s ({tps4:,.0f} tokens/s), 1 process {t1:.1f} s ({tps1:,.0f} tokens/s)")
    if device == "cpu":
        print("(on CPU the 4 processes share the cores: the point is the identical curve, not the speed)")
    return 0 if worst < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
