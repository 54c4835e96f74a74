"""ndp.plan's predictions against measured gloo runs on this machine (CPU, fp32).

    python bench/plan_vs_measured.py                       # all three parts below
    python bench/plan_vs_measured.py --only bytes          # only the in-process byte counts (quick)
    python bench/plan_vs_measured.py --only memory         # the fused loss and selective checkpointing terms
    python bench/plan_vs_measured.py --only time           # whole steps of ndp-train under torchrun
    python bench/plan_vs_measured.py --only terms          # the step split into the planner's terms

1. Bytes per rank, exact: each config is set up the way ``ndp.train`` does it (fp32 model from the preset,
   ``ndp.hf.parallelize``, AdamW foreach=False) in a gloo job; per rank we count the parameter bytes (local
   shards), AdamW state bytes after one step, and the bytes autograd saves during one forward
   (``torch.autograd.graph.saved_tensors_hooks``, parameter storages excluded), and compare them with
   ``ndp.plan``'s params, optimizer and activations (+ root) terms.
2. Whole steps: ``ndp-train`` runs under torchrun with ``--metrics``; the measured step time (median of the
   steps after the first) is set against ``estimate`` with a CPU profile of the config (``config_profile``:
   rates of one thread at the rank's shapes, memory rates with every rank streaming, the gloo link, the
   simulator's CP efficiency) plus the step's fixed host cost (measured at S=32). Peak RSS is printed beside
   the predicted tensor bytes (RSS also holds the Python/torch baseline).
3. Time per term: the profiler splits ndp-train's step on the critical-path rank into the planner's matmul,
   attention, elementwise, comm and optimizer terms (``measure_terms``), for one process and 2-rank configs.
4. Memory options: the fused loss's working bytes and the bytes selective checkpointing keeps per layer, counted
   as the storages the ops allocate (``LiveTensorBytes``), against ``fused_loss_bytes`` and
   ``selective_layer_bytes``.
Results: a printed table and <out>/plan_vs_measured.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_cp  # noqa: E402  (the benchmarks' one timer)
from ndp.parallel import ParallelismConfig  # noqa: E402
from ndp.plan import Topology, estimate, load_model_spec  # noqa: E402
from ndp.plan.cost import fused_loss_bytes, selective_layer_bytes  # noqa: E402
from ndp.plan.spec import GpuProfile  # noqa: E402

CPU = torch.device("cpu")
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
    ok = False
    try:
        for name in names:
            pc = ParallelismConfig(**CONFIGS[name])
            if pc.world_size != world:
                continue
            mesh = pc.build_device_mesh("cpu")
            m = build_model(model, seed=0)
            ndp.hf.parallelize(m, pc, mesh, loss_parallel=True)  # as ndp-train's fused loss under TP
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
        ok = True
    finally:
        bench_cp.end_rank(ok)


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


# ---------------------------------------------------------------------------------------------- memory options

class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the tensor storages the ops run inside it allocate, while they live (``cur``) and at most
    (``peak``): a view or an in-place result shares an argument's storage and is not counted again."""

    def __init__(self):
        super().__init__()
        self.live, self.cur, self.peak = {}, 0, 0

    def _free(self, ptr):
        self.cur -= self.live.pop(ptr, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr and ptr not in given and ptr not in self.live:
                self.live[ptr] = st.nbytes()
                self.cur += st.nbytes()
                self.peak = max(self.peak, self.cur)
                weakref.finalize(st, self._free, ptr)
        return out


def measure_loss_bytes(tokens=4096, vocab=8192, hidden=64, chunk_bytes=2 ** 20):
    """The fused loss's peak bytes beyond its inputs and returned gradients, measured and predicted
    (``fused_loss_bytes``), fp32 and bf16. Returns rows."""
    from ndp.ops import linear_cross_entropy

    spec = load_model_spec("tiny-llama").replace(vocab_size=vocab, hidden_size=hidden)
    rows = []
    for dtype, es in ((torch.float32, 4), (torch.bfloat16, 2)):
        g = torch.Generator().manual_seed(0)
        h = torch.randn(tokens, hidden, generator=g).to(dtype).requires_grad_()
        w = torch.randn(vocab, hidden, generator=g).to(dtype).requires_grad_()
        y = torch.randint(0, vocab, (tokens,), generator=g)
        live = LiveTensorBytes()
        with live:
            grads = torch.autograd.grad(linear_cross_entropy(h, w, y, chunk_bytes=chunk_bytes), (h, w))
        measured = live.peak - sum(t.numel() * t.element_size() for t in grads)
        rows.append(dict(term="logits (fused loss)", dtype=str(dtype).split(".")[-1], measured=measured,
                         predicted=fused_loss_bytes(spec, tokens, es, chunk_bytes)))
    return rows


def measure_selective_bytes(seq_len=64):
    """Bytes a forward keeps per token and layer under selective checkpointing (the tensors alive after it, 1 vs 2
    layers), measured and predicted (``selective_layer_bytes``), fp32 and bf16. Returns rows."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    import ndp.hf

    spec = load_model_spec("tiny-llama").replace(hidden_size=96, intermediate_size=160, num_heads=6,
                                                 num_kv_heads=2, head_dim=16)
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rows = []
    try:
        for dtype, es in ((torch.float32, 4), (torch.bfloat16, 2)):
            kept = []
            for layers in (1, 2):
                cfg = LlamaConfig(hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=2,
                                  vocab_size=128, num_hidden_layers=layers)
                cfg._attn_implementation = "sdpa"
                torch.manual_seed(0)
                m = AutoModelForCausalLM.from_config(cfg).to(dtype)
                p = ParallelismConfig()
                ndp.hf.parallelize(m, p, p.build_device_mesh("cpu"), activation_checkpointing="selective")
                live = LiveTensorBytes()
                with live:
                    out = m(input_ids=torch.randint(0, 128, (1, seq_len)), use_cache=False).logits
                kept.append(live.cur - out.untyped_storage().nbytes())
            rows.append(dict(term="activations per layer (selective)", dtype=str(dtype).split(".")[-1],
                             measured=(kept[1] - kept[0]) / seq_len, predicted=selective_layer_bytes(spec, 1, es)))
    finally:
        if owned:
            dist.destroy_process_group()
    return rows


def _dummy_profile():
    # Memory terms do not depend on the rates; any valid profile works for them.
    from ndp.plan import load_gpu_profile

    return load_gpu_profile("h100")


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

        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rates.json")
            mp.spawn(_rates_worker, args=(mp.get_context("spawn").Barrier(ranks), args, out, tmp), nprocs=ranks,
                     join=True)
            with open(out) as f:
                together = json.load(f)
        r.update({k: together[k] for k in ("hbm", "ew", "dtensor_launch")})
    return GpuProfile(name="this CPU (1 thread/rank)", peak_tflops=r["mm"], peak_fp32_tflops=r["mm"],
                      matmul_tflops=r["mm"], matmul_fp32_tflops=r["mm"], attn_fwd_tflops=r["attn_fwd"],
                      attn_bwd_tflops=r["attn_bwd"], attn_fwd_half_block=0, attn_bwd_half_block=0,
                      hbm_gbps=r["hbm"], elementwise_gbps=r["ew"], memory_gib=24, reserved_gib=1,
                      nvlink_gbps=link[0], network_gbps=link[0], nvlink_latency_us=link[1],
                      network_latency_us=link[1], reduce_scatter_efficiency=link[2], launch_us=r["launch"],
                      dtensor_launch_us=r.get("dtensor_launch", 0.0), comm_overlap=0.0)


def _rates_worker(rank, barrier, args, out_file, tmp):
    import torch.distributed as dist

    r = _cpu_rates(*args, sync=barrier.wait)
    world = barrier.parties
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    ok = False
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        r["dtensor_launch"] = _optimizer_op_us(lambda t: distribute_tensor(t, mesh, [Shard(0)]))
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(r, f)
        ok = True
    finally:
        bench_cp.end_rank(ok)


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


def _gloo_worker(rank, world, tmp, nbytes, out_file):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    ok = False
    try:
        def med(fn, n):
            return bench_cp._timed(fn, CPU, 1, n, dist.barrier)

        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor   # torch < 2.13
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        n = max(world, nbytes // 4 // world * world)
        full, part = torch.ones(n), torch.ones(n // world)
        tiny, tiny_part = torch.ones(world), torch.ones(1)
        r = dict(tiny_s=med(lambda: gather(tiny, tiny_part), 50), ag_s=med(lambda: gather(full, part), 9),
                 rs_s=med(lambda: scatter(part, full), 9), bytes=n * 4)
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(r, f)
        ok = True
    finally:
        bench_cp.end_rank(ok)


def gloo_link(world=2, nbytes=4 << 20) -> tuple[float, float, float]:
    """(GB/s, latency us, reduce-scatter efficiency) of gloo collectives on this machine, in the planner's terms.

    The planner charges an all-gather of N bytes (n-1)/n N / bw + latency and a reduce-scatter the same at
    bw * efficiency. Measured with all-gathers of 4 bytes per rank (latency) and of ``nbytes`` (about one
    FSDP unit of the small presets), and a reduce-scatter of ``nbytes``.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "gloo.json")
        mp.spawn(_gloo_worker, args=(world, tmp, nbytes, out), nprocs=world, join=True)
        with open(out) as f:
            r = json.load(f)
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
                 batch=4, steps=4, base_seq_len=32):
    """Measured (ndp-train under torchrun, gloo) vs predicted step time and peak memory, per config.

    The prediction is ``estimate`` with the config's CPU profile (``config_profile``) plus the step's fixed
    host cost, which the planner's device model leaves out: measured as the ndp-train step at
    ``base_seq_len`` minus its prediction there (see measure_terms). Returns a list of rows.
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


# ---------------------------------------------------------------------------------------------- time per term

MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::mv", "aten::addmv"})
ATTENTION_SCOPES = ("ndp::attention", "AttnFunction", "ndp::cp_")  # ndp.ops' op, the CP Functions and ops (fwd, bwd)
OPTIMIZER_SCOPES = ("Optimizer.step", "Optimizer.zero_grad", "ndp.clip_grad_norm_")
# collectives (c10d, functional ones as DTensor/TP issue them, and their waits), FSDP2 gather/scatter
COMM_SCOPES = ("c10d::", "_c10d_functional::", "gloo:", "record_param_comms", "FSDP::")
TERMS = ("matmul", "attention", "elementwise", "comm", "optimizer")


def _term_of(event) -> str:
    """The planner term an op's self time belongs to: comm, optimizer, attention, matmul or elementwise."""
    scopes = []
    e = event
    while e is not None:
        scopes.append(e.name)
        e = e.cpu_parent
    if any(n.startswith(COMM_SCOPES) for n in scopes):
        return "comm"
    if any(n.startswith(OPTIMIZER_SCOPES) for n in scopes):
        return "optimizer"
    if any(k in n for n in scopes for k in ATTENTION_SCOPES):
        return "attention"
    return "matmul" if event.name in MATMUL_OPS else "elementwise"


def step_terms(cfg, windows=3, warmup=2) -> dict:
    """Seconds per planner term of ndp-train's step with TrainConfig ``cfg`` (this rank; runs ``train``).

    ``ndp.train``'s step hook runs at the same point of every step (after backward), so hook to hook is
    one whole step (clip, optimizer, zero_grad, data, forward, loss, backward). After ``warmup`` steps
    (first-touch page faults, lazy init), ``windows`` steps run under the profiler: each op's self time
    goes to the term of its scope (``_term_of``), the step's time outside any op (Python) to elementwise;
    then ``windows`` steps run without it for the wall time ("step"), and each term is its profiled share
    of that (the profiler's own cost is spread in proportion). Medians over the windows.
    """
    from ndp.train.loop import train

    runs, walls = [], []
    state = {}

    def hook(step, _model):
        now = time.perf_counter()
        if "prof" in state:
            state.pop("prof").stop()
            terms = dict.fromkeys(TERMS, 0.0)
            for e in state.pop("events")():
                terms[_term_of(e)] += e.self_cpu_time_total / 1e6
            terms["elementwise"] += max(0.0, now - state["t0"] - sum(terms.values()))
            runs.append({k: v / sum(terms.values()) for k, v in terms.items()})
        elif step > warmup + windows:
            walls.append(now - state["t0"])
        if warmup <= step < warmup + windows:
            p = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            state["prof"], state["events"] = p, p.events
            p.start()
        state["t0"] = time.perf_counter()

    torch.set_num_threads(1)
    train(dataclasses.replace(cfg, steps=warmup + 2 * windows + 1, progress=False), step_hook=hook)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    step = med(walls)
    out = {k: med([r[k] for r in runs]) * step for k in TERMS}
    out["step"] = step
    return out


def _simulate_worker(_i, kw, out_file):
    from simulate_cp import simulate

    torch.set_num_threads(1)
    with open(out_file, "w") as f:
        json.dump(simulate(**kw), f)


def cp_overhead(spec, pc, seq_len, batch) -> dict:
    """The CPU profile's cp_overhead for ``pc``'s CP algorithm: the per-rank efficiency that
    ``bench/simulate_cp.py`` measures (one rank under torch's fake process group against 1/N of the
    whole-sequence attention), in a fresh process (the simulation owns its process group)."""
    import torch.multiprocessing as mp

    kw = dict(world=pc.cp_size, seq_len=seq_len, heads=spec.num_heads // pc.tp_size,
              kv_heads=spec.num_kv_heads // pc.tp_size, head_dim=spec.head_dim, batch=batch // pc.dp_size,
              impls=(pc.cp_impl,), ulysses=pc.ulysses_size, device="cpu", iters=5)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "sim.json")
        mp.spawn(_simulate_worker, args=(kw, out), nprocs=1, join=True)
        with open(out) as f:
            sim = json.load(f)
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
    """``estimate``'s seconds per step as the terms measure_terms splits: comm = CP + TP + FSDP2."""
    e = estimate(spec, pc, prof, Topology(pc.world_size, pc.world_size), seq_len=seq_len, batch_size=batch,
                 dtype="fp32")
    t = {k: e.time[k] for k in ("matmul", "attention", "elementwise", "optimizer")}
    t["comm"] = e.time["cp_comm"] + e.time["tp_comm"] + e.time["fsdp_comm"]
    t["step"] = e.step_s
    t["peak_mb"] = e.peak_bytes / 2**20
    return t


def measure_terms(model="small-llama", name="single", seq_len=1024, batch=2, base_seq_len=32):
    """ndp-train's step per planner term, measured (this machine) and predicted (``estimate``, CPU profile).

    ``name``: "single" (one process, in this process) or a key of CONFIGS (a torchrun job of this script in
    ``--terms-worker`` mode; the terms of the rank that waits least in collectives, the critical path).
    Each term is compared by its size-dependent part: the step at ``seq_len`` minus the step at
    ``base_seq_len``, measured and predicted alike. The rest is the step's fixed host cost (Python, dispatch,
    FSDP2 hooks, DTensor, collective latencies on one CPU thread): the planner's device model leaves it out
    (on a GPU the host runs ahead of the device), so it is measured at ``base_seq_len`` and added to the
    predicted whole step. Returns ``(measured, predicted, profile)``: dicts of seconds per step for matmul,
    attention, elementwise, comm (CP + TP + FSDP, exposed; differences), optimizer (whole, it does not
    depend on the size), "fixed" (the step at ``base_seq_len``) and "step" (whole steps at ``seq_len``).
    """
    from ndp.train.config import TrainConfig

    spec = load_model_spec(model)
    pc = ParallelismConfig(**CONFIGS.get(name, {}))
    if pc.world_size == 1:
        full, base = (step_terms(TrainConfig(model=model, seq_len=s, batch_size=batch, device="cpu", dtype="fp32"))
                      for s in (seq_len, base_seq_len))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "terms.json")
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(pc.world_size), os.path.abspath(__file__), "--terms-worker", name, "--model", model,
                   "--seq-len", str(seq_len), "--base-seq-len", str(base_seq_len), "--batch", str(batch),
                   "--out", out]
            subprocess.run(cmd, check=True, env=env, cwd=tmp, capture_output=True, timeout=900)
            with open(out) as f:
                full, base = json.load(f)
    prof = config_profile(spec, pc, seq_len, batch)
    est = [predict_terms(spec, pc, prof, s, batch) for s in (seq_len, base_seq_len)]
    terms = ("matmul", "attention", "elementwise", "comm")
    measured = {k: full[k] - base[k] for k in terms}
    predicted = {k: est[0][k] - est[1][k] for k in terms}
    measured["optimizer"], predicted["optimizer"] = full["optimizer"], est[0]["optimizer"]  # size-independent
    measured["fixed"] = predicted["fixed"] = base["step"]
    measured["step"] = full["step"]
    predicted["step"] = est[0]["step"] + base["step"] - est[1]["step"]
    return measured, predicted, prof


def _terms_worker(args):
    import torch.distributed as dist

    from ndp.train.config import TrainConfig

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    pc = ParallelismConfig(**CONFIGS[args.terms_worker])
    cfg = TrainConfig(model=args.model, parallel=pc, seq_len=args.seq_len, batch_size=args.batch, device="cpu",
                      dtype="fp32")
    both = []
    for s in (args.seq_len, args.base_seq_len):
        res = step_terms(dataclasses.replace(cfg, seq_len=s))
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, res)
        # The critical path: the rank that waits least in collectives is the one the others wait for; its
        # comm is the transfers themselves, the others' also holds the skew between ranks.
        both.append(dict(min(every, key=lambda r: r["comm"]), ranks=every))
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(both, f)
    bench_cp.end_rank(True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--only", choices=("bytes", "memory", "time", "terms"))
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--terms-worker", help=argparse.SUPPRESS)   # internal: one rank of measure_terms' job
    ap.add_argument("--seq-len", type=int, default=1024, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--base-seq-len", type=int, default=32, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.terms_worker:
        return _terms_worker(args)
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
    if args.only in (None, "memory"):
        rows = measure_loss_bytes() + measure_selective_bytes()
        result["memory_options"] = rows
        print("\nmemory options, predicted / measured bytes (tensors the ops allocate, LiveTensorBytes):")
        for r in rows:
            print(f"{r['term']:<36} {r['dtype']:<9} {r['predicted']:>12,.0f} / {r['measured']:>12,.0f}  "
                  f"{r['predicted'] / r['measured']:.4f}")
    if args.only in (None, "time"):
        rows = measure_time(args.model)
        result["time"] = rows
        print(f"\nstep time, {args.model}, S=1024, batch 4, fp32, ndp-train under torchrun (gloo), predicted = model "
              f"with the config's CPU profile + fixed host cost (the measured step at S=32 minus its prediction)")
        for r in rows:
            print(f"{r['config']:<16} predicted {r['step_predicted']:.3f} s, measured {r['step_measured']:.3f} s, "
                  f"ratio {r['step_predicted'] / r['step_measured']:.2f} (fixed {r['fixed_measured']:.3f} s); "
                  f"terms {r['time_terms']}; peak RSS {r['peak_rss_mb']:.0f} MB (predicted tensors "
                  f"{r['predicted_peak_mb']:.0f} MB)")
    if args.only in (None, "terms"):
        result["terms"] = {}
        print(f"\nstep time per term, {args.model}, batch 2, fp32, ndp-train's step on the critical-path rank: "
              f"predicted / measured s (ratio) of the size-dependent part (S=1024 minus S=32; optimizer: whole); "
              f"comm = CP + TP + "
              f"FSDP2 collectives; fixed = the measured step at S=32 (host cost); step = whole step at S=1024, "
              f"predicted = model + fixed")
        cols = ("matmul", "attention", "elementwise", "comm", "optimizer", "fixed", "step")
        print(f"{'config':<12}" + "".join(f"{k:>23}" for k in cols))
        for name in ("single", "dp_shard2", "tp2", "cp2_ring", "cp2_ulysses"):
            meas, pred, prof = measure_terms(args.model, name)
            result["terms"][name] = dict(measured=meas, predicted=pred, cpu_profile={
                k: getattr(prof, k) for k in ("matmul_tflops", "attn_fwd_tflops", "attn_bwd_tflops", "hbm_gbps",
                                              "elementwise_gbps", "launch_us", "nvlink_gbps", "nvlink_latency_us",
                                              "reduce_scatter_efficiency")})
            cells = []
            for k in cols:
                if k == "fixed":
                    cells.append(f"{meas[k]:.3f}")
                    continue
                r = f"({pred[k] / meas[k]:.2f})" if abs(meas[k]) > 1e-4 else "(-)"
                cells.append(f"{pred[k]:.3f}/{meas[k]:.3f} {r:>6}")
            print(f"{name:<12}" + "".join(f"{c:>23}" for c in cells))
    with open(os.path.join(args.out, "plan_vs_measured.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
