"""ndp.plan's predictions against measured gloo runs on this machine (CPU, fp32).

    python bench/plan_vs_measured.py                       # exact bytes + timed ndp-train runs
    python bench/plan_vs_measured.py --only bytes          # only the in-process byte counts (quick)

1. Bytes per rank, exact: each config is set up the way ``ndp.train`` does it (fp32 model from the preset,
   ``ndp.hf.parallelize``, AdamW foreach=False) in a gloo job; per rank we count the parameter bytes (local
   shards), AdamW state bytes after one step, and the bytes autograd saves during one forward
   (``torch.autograd.graph.saved_tensors_hooks``, parameter storages excluded), and compare them with
   ``ndp.plan``'s params, optimizer and activations (+ root) terms.
2. Time and peak memory, loosely: ``ndp-train`` runs under torchrun with ``--metrics``; the measured step time
   (median of the steps after the first) and peak RSS are set against the planner's prediction with a CPU
   profile measured here (matmul and attention rates of one thread, memory bandwidth, gloo bandwidth).
   RSS includes the Python/torch baseline, so the comparison is of the increase over a 1-step baseline run.
Results: a printed table and <out>/plan_vs_measured.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from ndp.parallel import ParallelismConfig  # noqa: E402
from ndp.plan import Topology, estimate, load_model_spec  # noqa: E402
from ndp.plan.spec import GpuProfile  # noqa: E402

CONFIGS = {   # name -> ParallelismConfig fields (world 2 and 4)
    "dp_shard2": dict(dp_shard_size=2),
    "tp2": dict(tp_size=2),
    "cp2_ring": dict(cp_size=2),
    "cp2_ulysses": dict(cp_size=2, cp_impl="ulysses"),
    "cp2_allgather": dict(cp_size=2, cp_impl="allgather"),
    "dp_replicate2": dict(dp_replicate_size=2),
    "dp_shard2_cp2": dict(dp_shard_size=2, cp_size=2),
    "cp2_tp2": dict(cp_size=2, tp_size=2),
}


# ---------------------------------------------------------------------------------------------- exact bytes

def _bytes_worker(rank, world, tmp, model, names, seq_len, batch, out_file):
    import torch.distributed as dist

    import ndp.hf
    from ndp.train.presets import build_model

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    res = {}
    try:
        for name in names:
            pc = ParallelismConfig(**CONFIGS[name])
            if pc.world_size != world:
                continue
            mesh = pc.build_device_mesh("cpu")
            m = build_model(model, seed=0)
            ndp.hf.parallelize(m, pc, mesh)
            local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
            params = sum(local(p).numel() * local(p).element_size() for p in m.parameters())
            pstores = {local(p).untyped_storage().data_ptr() for p in m.parameters()}
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(0, m.config.vocab_size, (batch // pc.dp_size, seq_len), generator=g)
            pos = torch.arange(seq_len).expand_as(ids)
            b = ndp.hf.shard_batch(m, input_ids=ids, labels=ids, position_ids=pos)
            seen = {}

            def pack(t):
                # Parameters (also FSDP's gathered, unsharded ones) are weights, not activations.
                if not isinstance(t, torch.nn.Parameter):
                    st = local(t).untyped_storage()
                    # FSDP2 swaps in the gathered parameters during forward: their storages (and views of
                    # them, e.g. the weight.t() a linear saves) are weights too.
                    now = {local(p).untyped_storage().data_ptr() for p in m.parameters()}
                    if st.data_ptr() not in pstores and st.data_ptr() not in now:
                        seen[st.data_ptr()] = st.nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                logits = m(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
            logits.float().sum().backward()
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False)
            opt.step()
            opt_bytes = sum(local(v).numel() * local(v).element_size() for s in opt.state.values()
                            for k, v in s.items() if torch.is_tensor(v) and k != "step")
            res[name] = dict(params=params, optimizer=opt_bytes, saved=sum(seen.values()),
                             tokens=b["input_ids"].numel())
            m = opt = logits = None  # free this config before the next one
        allres = [None] * world
        dist.all_gather_object(allres, res)
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(allres, f)
    finally:
        dist.destroy_process_group()


def measure_bytes(model="small-llama", names=tuple(CONFIGS), seq_len=128, batch=4):
    """Per-rank measured bytes and the planner's prediction for each config. Returns a list of rows."""
    import torch.multiprocessing as mp

    spec = load_model_spec(model)
    rows = []
    for world in (2, 4):
        todo = [n for n in names if ParallelismConfig(**CONFIGS[n]).world_size == world]
        if not todo:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "bytes.json")
            mp.spawn(_bytes_worker, args=(world, tmp, model, todo, seq_len, batch, out), nprocs=world, join=True)
            with open(out) as f:
                per_rank = json.load(f)
        for name in todo:
            pc = ParallelismConfig(**CONFIGS[name])
            e = estimate(spec, pc, _dummy_profile(), Topology(world, world), seq_len=seq_len, batch_size=batch,
                         dtype="fp32")
            meas = max(r[name]["params"] for r in per_rank), max(r[name]["optimizer"] for r in per_rank), \
                max(r[name]["saved"] for r in per_rank)
            pred_act = e.mem["activations"]
            rows.append(dict(config=name, world=world, params_measured=meas[0], params_predicted=e.mem["params"],
                             optimizer_measured=meas[1], optimizer_predicted=e.mem["optimizer"],
                             activations_measured=meas[2], activations_predicted=pred_act))
    return rows


def _dummy_profile():
    # Memory terms do not depend on the rates; any valid profile works for them.
    from ndp.plan import load_gpu_profile

    return load_gpu_profile("h100")


# ---------------------------------------------------------------------------------------------- CPU profile

def cpu_profile(block=512, heads=8, head_dim=32) -> GpuProfile:
    """A GpuProfile of this CPU, one thread per rank: measured fp32 matmul and attention rates, copy bandwidth."""
    import ndp

    torch.set_num_threads(1)

    def med(fn, n=5):
        fn()
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[len(ts) // 2]

    a, b = torch.randn(512, 256), torch.randn(256, 688)
    mm = 2 * 512 * 256 * 688 / med(lambda: a @ b) / 1e12
    q = torch.randn(1, block, heads, head_dim, requires_grad=True)
    k = torch.randn(1, block, heads // 2, head_dim, requires_grad=True)
    v = torch.randn(1, block, heads // 2, head_dim, requires_grad=True)
    flops = 4 * heads * head_dim * block * (block + 1) / 2
    tf = med(lambda: ndp.ops.attention(q, k, v, causal=True))
    out = ndp.ops.attention(q, k, v, causal=True)
    tfb = med(lambda: torch.autograd.grad(ndp.ops.attention(q, k, v, causal=True).sum(), (q, k, v)))
    x = torch.empty(2**24)
    y = torch.empty_like(x)
    hbm = 2 * x.numel() * 4 / med(lambda: y.copy_(x)) / 1e9
    del out
    return GpuProfile(name="this CPU (1 thread/rank)", peak_tflops=mm, peak_fp32_tflops=mm, matmul_tflops=mm,
                      matmul_fp32_tflops=mm, attn_fwd_tflops=flops / tf / 1e12,
                      attn_bwd_tflops=2.5 * flops / max(tfb - tf, 1e-9) / 1e12, attn_fwd_half_block=0,
                      attn_bwd_half_block=0, hbm_gbps=hbm, memory_gib=24, reserved_gib=1, nvlink_gbps=1.0,
                      network_gbps=1.0, nvlink_latency_us=100, network_latency_us=100, launch_us=2)


# ---------------------------------------------------------------------------------------------- timed runs

def _train_run(model, name, seq_len, batch, steps, tmp):
    pc = ParallelismConfig(**CONFIGS[name])
    metrics = os.path.join(tmp, f"{name}.jsonl")
    flags = ["--model", model, "--dp-replicate", str(pc.dp_replicate_size), "--dp-shard", str(pc.dp_shard_size),
             "--cp", str(pc.cp_size), "--tp", str(pc.tp_size), "--cp-impl", pc.cp_impl, "--seq-len", str(seq_len),
             "--batch-size", str(batch), "--steps", str(steps), "--dtype", "fp32", "--device", "cpu",
             "--metrics", metrics, "--no-progress", "--lr", "1e-3"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(pc.world_size),
           "-m", "ndp.train"] + flags
    subprocess.run(cmd, check=True, env=env, cwd=tmp, capture_output=True, timeout=900)
    with open(metrics) as f:
        recs = [json.loads(line) for line in f]
    times = sorted(r["step_time_s"] for r in recs[1:])
    return times[len(times) // 2], max(r["peak_mem_mb"] for r in recs)


def measure_time(model="small-llama", names=("dp_shard2", "tp2", "cp2_ring", "cp2_ulysses"), seq_len=1024,
                 batch=4, steps=4):
    """Measured (ndp-train, gloo) vs predicted (CPU profile) step time. Returns (profile, rows)."""
    spec = load_model_spec(model)
    prof = cpu_profile(block=seq_len // 2, heads=spec.num_heads, head_dim=spec.head_dim)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            pc = ParallelismConfig(**CONFIGS[name])
            step, rss = _train_run(model, name, seq_len, batch, steps, tmp)
            e = estimate(spec, pc, prof, Topology(pc.world_size, pc.world_size), seq_len=seq_len, batch_size=batch,
                         dtype="fp32")
            rows.append(dict(config=name, step_measured=step, step_predicted=e.step_s,
                             time_terms={k: round(v, 4) for k, v in e.time.items()}, peak_rss_mb=rss,
                             predicted_peak_mb=e.peak_bytes / 2**20))
    return prof, rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--only", choices=("bytes", "time"))
    ap.add_argument("--model", default="small-llama")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    result = {}
    if args.only in (None, "bytes"):
        rows = measure_bytes(args.model)
        result["bytes"] = rows
        print(f"bytes per rank, {args.model}, S=128, batch 4, fp32 (predicted / measured):")
        print(f"{'config':<16} {'params':>22} {'optimizer':>22} {'activations':>26}")
        for r in rows:
            cells = []
            for t in ("params", "optimizer", "activations"):
                p, m = r[f"{t}_predicted"], r[f"{t}_measured"]
                cells.append(f"{p / 1e6:8.3f}/{m / 1e6:8.3f} MB {p / m:5.3f}")
            print(f"{r['config']:<16} " + " ".join(cells))
    if args.only in (None, "time"):
        prof, rows = measure_time(args.model)
        result["cpu_profile"] = {k: getattr(prof, k) for k in ("matmul_tflops", "attn_fwd_tflops", "attn_bwd_tflops",
                                                               "hbm_gbps")}
        result["time"] = rows
        print(f"\nstep time, {args.model}, S=1024, batch 4, fp32, ndp-train under torchrun (gloo); CPU profile: "
              f"matmul {prof.matmul_tflops * 1e3:.1f} GFLOP/s, attention fwd {prof.attn_fwd_tflops * 1e3:.1f} / "
              f"bwd {prof.attn_bwd_tflops * 1e3:.1f} GFLOP/s, copy {prof.hbm_gbps:.1f} GB/s")
        for r in rows:
            print(f"{r['config']:<16} predicted {r['step_predicted']:.3f} s, measured {r['step_measured']:.3f} s, "
                  f"ratio {r['step_predicted'] / r['step_measured']:.2f}; terms {r['time_terms']}; "
                  f"peak RSS {r['peak_rss_mb']:.0f} MB (predicted tensors {r['predicted_peak_mb']:.0f} MB)")
    with open(os.path.join(args.out, "plan_vs_measured.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
