"""ndp.plan's step time against whole ndp-train steps under torchrun, with a measured CPU profile (CPU, fp32).

    python bench/plan_time.py                               # small-llama, dp_shard2, tp2, cp2_ring, cp2_ulysses
    python bench/plan_time.py --configs tp2 --seq-len 512   # fewer or smaller runs

``ndp-train`` runs under torchrun with ``--metrics``; the measured step time (median of the steps after the first)
is set against ``estimate`` with a CPU profile of the config (``config_profile``: rates of one thread at the
rank's shapes, memory rates with every rank streaming, the gloo link, the simulator's CP efficiency) plus the
step's fixed host cost (measured at S=32). Peak RSS is printed beside the predicted tensor bytes (RSS also holds
the Python/torch baseline). The CPU profile and ``predict_terms`` serve bench/plan_terms.py too.
Results: a printed table and <out>/plan_time.json (bench/plan_vs_measured.py runs this with the other checks).
"""
from __future__ import annotations

import json
import os
import tempfile

import torch

import bench_cp  # the benchmarks' one timer
from _common import CONFIGS, config_names, rank_job, parser, spawn_json, torchrun, write_json, write_results
from ndp.parallel import ParallelismConfig
from ndp.plan import Topology, estimate, load_model_spec
from ndp.plan.spec import GpuProfile

CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------------- CPU profile

def cpu_profile(block=512, heads=8, head_dim=32, tokens=2048, hidden=256, width=688, ranks=1,
                link=(1.0, 100.0, 1.0)) -> GpuProfile:
    """A GpuProfile of this CPU, one thread per rank, every rate measured here.

    matmul: fp32 [tokens, hidden] x [hidden, width]; attention: ``ndp.ops.attention`` causal fwd and fwd+bwd
    at ``block`` tokens (GQA 2:1); hbm_gbps: a 64 MB copy; elementwise_gbps: forward+backward of the
    elementwise part of a Llama layer (RMSNorm, SiLU gate, residual add) on [tokens, hidden] / [tokens,
    width] fp32 activations, in the planner's unit: the bytes autograd saves times ``elementwise_passes``,
    per second (on one CPU thread these ops run far below copy bandwidth: SiLU's backward is bound by its
    exp, not by memory); launch_us: host time per op of ndp-train's AdamW step on tiny parameters
    (dtensor_launch_us: the same on DTensors sharded over ``ranks``). ``ranks`` > 1: the
    memory-bound rates (hbm, elementwise) are measured in that many processes at once, each measurement
    started together, as the ranks of a job stream memory at once (they share the memory bus, GPUs do not);
    the compute-bound ones (matmul, attention) alone, as one rank's core runs them. link: (GB/s, latency
    us, reduce-scatter efficiency) of the process group (``gloo_link()``; the default is a placeholder for
    runs without communication); comm_overlap 0: with one thread per rank, a gloo collective blocks the
    rank's compute.
    """
    args = (block, heads, head_dim, tokens, hidden, width)
    r = _cpu_rates(*args)
    if ranks > 1:
        import torch.multiprocessing as mp

        together = spawn_json(_rates_worker, ranks, mp.get_context("spawn").Barrier(ranks), args)
        r.update({k: together[k] for k in ("hbm", "ew", "dtensor_launch")})
    return GpuProfile(name="this CPU (1 thread/rank)", peak_tflops=r["mm"], peak_fp32_tflops=r["mm"],
                      matmul_tflops=r["mm"], matmul_fp32_tflops=r["mm"], attn_fwd_tflops=r["attn_fwd"],
                      attn_bwd_tflops=r["attn_bwd"], attn_fwd_half_block=0, attn_bwd_half_block=0,
                      hbm_gbps=r["hbm"], elementwise_gbps=r["ew"], memory_gib=24, reserved_gib=1,
                      nvlink_gbps=link[0], network_gbps=link[0], nvlink_latency_us=link[1],
                      network_latency_us=link[1], reduce_scatter_efficiency=link[2], launch_us=r["launch"],
                      dtensor_launch_us=r.get("dtensor_launch", 0.0), comm_overlap=0.0)


def _rates_worker(rank, tmp, out_file, barrier, args):
    r = _cpu_rates(*args, sync=barrier.wait)
    world = barrier.parties

    def body():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        r["dtensor_launch"] = _optimizer_op_us(lambda t: distribute_tensor(t, mesh, [Shard(0)]))
        return r

    rank_job(rank, world, tmp, out_file, body)


def _cpu_rates(block, heads, head_dim, tokens, hidden, width, sync=lambda: None) -> dict:
    """The rates of cpu_profile; ``sync`` (a barrier of all measuring processes) starts each one together."""
    import ndp

    torch.set_num_threads(1)

    def med(fn, n=5):
        sync()
        return bench_cp._timed(fn, CPU, 1, n)

    a, b = torch.randn(tokens, hidden), torch.randn(hidden, width)
    mm = 2 * tokens * hidden * width / med(lambda: a @ b) / 1e12
    q = torch.randn(1, block, heads, head_dim, requires_grad=True)
    k = torch.randn(1, block, heads // 2, head_dim, requires_grad=True)
    v = torch.randn(1, block, heads // 2, head_dim, requires_grad=True)
    flops = 4 * heads * head_dim * block * (block + 1) / 2
    tf = med(lambda: ndp.ops.attention(q, k, v, causal=True))
    tfb = med(lambda: torch.autograd.grad(ndp.ops.attention(q, k, v, causal=True).sum(), (q, k, v)))
    x = torch.empty(2**24)
    y = torch.empty_like(x)
    hbm = 2 * x.numel() * 4 / med(lambda: y.copy_(x)) / 1e9
    x = y = None  # free 128 MB before the elementwise pool (not del: the lambda above closes over them)
    ew = _elementwise_rate(tokens, hidden, width, med)
    launch = _optimizer_op_us(lambda t: t)
    return dict(mm=mm, attn_fwd=flops / tf / 1e12, attn_bwd=2.5 * flops / max(tfb - tf, 1e-9) / 1e12, hbm=hbm,
                ew=ew, launch=launch)


def _gloo_worker(rank, tmp, out_file, world, nbytes):
    import torch.distributed as dist

    def med(fn, n):
        return bench_cp._timed(fn, CPU, 1, n, dist.barrier)

    def body():
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor   # torch < 2.13
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        n = max(world, nbytes // 4 // world * world)
        full, part = torch.ones(n), torch.ones(n // world)
        tiny, tiny_part = torch.ones(world), torch.ones(1)
        return dict(tiny_s=med(lambda: gather(tiny, tiny_part), 50), ag_s=med(lambda: gather(full, part), 9),
                    rs_s=med(lambda: scatter(part, full), 9), bytes=n * 4)

    rank_job(rank, world, tmp, out_file, body)


def gloo_link(world=2, nbytes=4 << 20) -> tuple[float, float, float]:
    """(GB/s, latency us, reduce-scatter efficiency) of gloo collectives on this machine, in the planner's terms.

    The planner charges an all-gather of N bytes (n-1)/n N / bw + latency and a reduce-scatter the same at
    bw * efficiency. Measured with all-gathers of 4 bytes per rank (latency) and of ``nbytes`` (about one
    FSDP unit of the small presets), and a reduce-scatter of ``nbytes``.
    """
    r = spawn_json(_gloo_worker, world, world, nbytes)
    lat = r["tiny_s"]
    moved = (world - 1) / world * r["bytes"]
    bw = moved / max(r["ag_s"] - lat, 1e-9)
    rs_bw = moved / max(r["rs_s"] - lat, 1e-9)
    return bw / 1e9, lat * 1e6, min(1.0, rs_bw / bw)


def _optimizer_op_us(wrap) -> float:
    """Host time of one AdamW (foreach=False, as ndp-train runs it) op on 32 tiny parameters made by ``wrap``
    (plain tensors, or DTensors sharded over a mesh), per parameter and op. The step alone: grad clip's
    all-reduce is a collective, which the planner charges as communication."""
    from ndp.plan.cost import ADAMW_OPS_PER_TENSOR

    params = [torch.nn.Parameter(wrap(torch.ones(64, 16))) for _ in range(32)]
    for p in params:
        p.grad = wrap(torch.full((64, 16), 1e-3))
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    return bench_cp._timed(opt.step, CPU, 1, 5) / (len(params) * ADAMW_OPS_PER_TENSOR) * 1e6


def _elementwise_rate(tokens, hidden, width, med) -> float:
    """elementwise_gbps of cpu_profile: saved bytes x passes / time of a Llama layer's elementwise ops.

    RMSNorm + residual on [tokens, hidden], SiLU gate on [tokens, width], forward and backward, over a pool
    of independent copies of 128 MB or more so their data come from memory, as in a training step.
    """
    import torch.nn.functional as F

    passes = GpuProfile.__dataclass_fields__["elementwise_passes"].default

    def make():
        x = torch.randn(tokens, hidden, requires_grad=True)
        w = torch.ones(hidden, requires_grad=True)
        g = torch.randn(tokens, width, requires_grad=True)
        u = torch.randn(tokens, width, requires_grad=True)
        return x, w, g, u, torch.randn(tokens, hidden), torch.randn(tokens, width)

    def block(x, w, g, u, gy, gz):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w + x
        z = F.silu(g) * u
        torch.autograd.backward((h, z), (gy, gz))

    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    one = make()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(*one)
    per_block = sum(saved.values())
    size = sum(t.numel() * t.element_size() for t in one)
    pool = [one] + [make() for _ in range(max(1, (128 << 20) // size) - 1)]

    def run():
        for args in pool:
            for t in args[:4]:
                t.grad = None
            block(*args)

    return per_block * len(pool) * passes / med(run, n=3) / 1e9


def _simulate_worker(_i, _tmp, out_file, kw):
    from simulate_cp import simulate

    torch.set_num_threads(1)
    write_json(out_file, simulate(**kw))


def cp_overhead(spec, pc, seq_len, batch) -> dict:
    """The CPU profile's cp_overhead for ``pc``'s CP algorithm: the per-rank efficiency that
    ``bench/simulate_cp.py`` measures (one rank under torch's fake process group against 1/N of the
    whole-sequence attention), in a fresh process (the simulation owns its process group)."""
    kw = dict(world=pc.cp_size, seq_len=seq_len, heads=spec.num_heads // pc.tp_size,
              kv_heads=spec.num_kv_heads // pc.tp_size, head_dim=spec.head_dim, batch=batch // pc.dp_size,
              impls=(pc.cp_impl,), ulysses=pc.ulysses_size, device="cpu", iters=5)
    sim = spawn_json(_simulate_worker, 1, kw)
    return {pc.cp_impl: sim[pc.cp_impl]["eff_fwd_bwd"]}


def config_profile(spec, pc, seq_len, batch) -> GpuProfile:
    """The CPU profile for one config, measured at its rank's shapes: its tokens, its TP share of the MLP width,
    attention at the whole sequence and, with CP, the simulator's per-rank efficiency against it
    (``cp_overhead``); with several ranks, memory rates and the link measured with all of them running."""
    prof = cpu_profile(block=seq_len, heads=spec.num_heads, head_dim=spec.head_dim,
                       tokens=batch // pc.dp_size * seq_len // pc.cp_size, hidden=spec.hidden_size,
                       width=spec.intermediate_size // pc.tp_size, ranks=pc.world_size,
                       link=gloo_link(pc.world_size) if pc.world_size > 1 else (1.0, 100.0, 1.0))
    if pc.cp_size > 1:
        prof = prof.replace(cp_overhead=cp_overhead(spec, pc, seq_len, batch))
    return prof


def predict_terms(spec, pc, prof, seq_len, batch) -> dict:
    """``estimate``'s seconds per step as the terms plan_terms.measure_terms splits: comm = CP + TP + FSDP2."""
    e = estimate(spec, pc, prof, Topology(pc.world_size, pc.world_size), seq_len=seq_len, batch_size=batch,
                 dtype="fp32")
    t = {k: e.time[k] for k in ("matmul", "attention", "elementwise", "optimizer")}
    t["comm"] = e.time["cp_comm"] + e.time["tp_comm"] + e.time["fsdp_comm"]
    t["step"] = e.step_s
    t["peak_mb"] = e.peak_bytes / 2**20
    return t


# ---------------------------------------------------------------------------------------------- timed runs

def _train_run(model, name, seq_len, batch, steps, tmp):
    pc = ParallelismConfig(**CONFIGS[name])
    metrics = os.path.join(tmp, f"{name}.jsonl")
    flags = ["--model", model, "--dp-replicate", str(pc.dp_replicate_size), "--dp-shard", str(pc.dp_shard_size),
             "--cp", str(pc.cp_size), "--tp", str(pc.tp_size), "--cp-impl", pc.cp_impl, "--seq-len", str(seq_len),
             "--batch-size", str(batch), "--steps", str(steps), "--dtype", "fp32", "--device", "cpu",
             "--metrics", metrics, "--no-progress", "--lr", "1e-3"]
    torchrun(pc.world_size, ["-m", "ndp.train"] + flags, cwd=tmp)
    with open(metrics) as f:
        recs = [json.loads(line) for line in f]
    times = sorted(r["step_time_s"] for r in recs[1:])
    return times[len(times) // 2], max(r["peak_mem_mb"] for r in recs)


def measure_time(model="small-llama", names=("dp_shard2", "tp2", "cp2_ring", "cp2_ulysses"), seq_len=1024,
                 batch=4, steps=4, base_seq_len=32):
    """Measured (ndp-train under torchrun, gloo) vs predicted step time and peak memory, per config.

    The prediction is ``estimate`` with the config's CPU profile (``config_profile``) plus the step's fixed
    host cost, which the planner's device model leaves out: measured as the ndp-train step at
    ``base_seq_len`` minus its prediction there (see plan_terms.measure_terms). Returns a list of rows.
    """
    spec = load_model_spec(model)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            pc = ParallelismConfig(**CONFIGS[name])
            step, rss = _train_run(model, name, seq_len, batch, steps, tmp)
            base, _ = _train_run(model, name, base_seq_len, batch, steps, tmp)
            prof = config_profile(spec, pc, seq_len, batch)
            full, small = (predict_terms(spec, pc, prof, s, batch) for s in (seq_len, base_seq_len))
            rows.append(dict(config=name, step_measured=step, step_predicted=full["step"] + base - small["step"],
                             fixed_measured=base, time_terms={k: round(v, 4) for k, v in full.items()},
                             peak_rss_mb=rss, predicted_peak_mb=full["peak_mb"]))
    return rows


TIME_CONFIGS = ("dp_shard2", "tp2", "cp2_ring", "cp2_ulysses")


def report(model="small-llama", names=TIME_CONFIGS, seq_len=1024, batch=4, steps=4, base_seq_len=32) -> list[dict]:
    """measure_time, printed."""
    rows = measure_time(model, names, seq_len, batch, steps, base_seq_len)
    print(f"\nstep time, {model}, S={seq_len}, batch {batch}, fp32, ndp-train under torchrun (gloo), predicted = model "
          f"with the config's CPU profile + fixed host cost (the measured step at S={base_seq_len} minus its "
          f"prediction)")
    for r in rows:
        print(f"{r['config']:<16} predicted {r['step_predicted']:.3f} s, measured {r['step_measured']:.3f} s, "
              f"ratio {r['step_predicted'] / r['step_measured']:.2f} (fixed {r['fixed_measured']:.3f} s); "
              f"terms {r['time_terms']}; peak RSS {r['peak_rss_mb']:.0f} MB (predicted tensors "
              f"{r['predicted_peak_mb']:.0f} MB)")
    return rows


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--configs", type=config_names, default=TIME_CONFIGS, help="comma-separated")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4, help="the global batch")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--base-seq-len", type=int, default=32, help="where the fixed host cost is measured")
    args = ap.parse_args(argv)
    rows = report(args.model, args.configs, args.seq_len, args.batch, args.steps, args.base_seq_len)
    write_results(args.out, "plan_time", {"time": rows})


if __name__ == "__main__":
    main()
