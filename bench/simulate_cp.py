"""One rank of a world-N context-parallel job on one device, through torch's fake process group.

    python bench/simulate_cp.py --world 8 --seq-len 131072 --heads 32 --kv-heads 8 --head-dim 128   # GPU
    python bench/simulate_cp.py --world 4 --seq-len 256 --heads 4 --kv-heads 2 --head-dim 32 --dtype fp32  # CPU

The fake process group (``torch.testing._internal.distributed.fake_pg``) runs every collective as a no-op,
so one process runs exactly the work rank ``--rank`` of a world-N job does: its ring steps, its all-gather
slices, its Ulysses all-to-all reorders, on its shard of the sequence. The script times that rank's forward
and forward+backward for ring / all-gather / Ulysses / USP against 1/N of the single-device attention on
the whole sequence (same engine), which is the compute efficiency of the CP layer with communication free.

That efficiency is then fed into ndp.plan's cost model (``cp_overhead`` of the GPU profile: measured
efficiency / the model's block-length efficiency) and the predicted efficiency *with* communication is
printed for N = 8 ... 1024 and S = 128k ... 1M tokens on that GPU kind (H100 unless ``--gpu``).
Received blocks hold no data under the fake group (the values are whatever the buffer held); timing does not
depend on them, and denormals are flushed so that garbage cannot slow the CPU down.
Results: printed tables and <out>/simulate_cp.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_cp  # noqa: E402  (the benchmarks' one timer)

IMPLS = ("ring", "allgather", "ulysses", "usp")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _fwd_bwd(fn, q, k, v):
    def fwd():
        with torch.no_grad():
            fn(q, k, v)

    def both():
        out = fn(q, k, v)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    return fwd, both


def simulate(world, seq_len, heads, kv_heads, head_dim, *, dtype="fp32", batch=1, rank=0, ulysses=2,
             impls=IMPLS, device=None, backend="auto", iters=3):
    """Time one rank of a world-``world`` CP job against 1/world of the single-device attention.

    Returns:
        dict with "single" (fwd, fwd_bwd seconds on the whole sequence) and per impl: fwd, fwd_bwd seconds of
        this rank and eff_fwd, eff_fwd_bwd = (single / world) / rank time. Impls whose constraints the shape
        breaks (Ulysses heads, USP degree) are left out with the reason.
    Raises:
        ValueError: seq_len not divisible by 2*world (zigzag), rank out of range.
        RuntimeError: a default process group already exists (the simulation needs its own fake one).
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import ndp

    if seq_len % (2 * world):
        raise ValueError(f"zigzag CP needs seq_len divisible by 2*world; got seq_len={seq_len}, world={world}. "
                         f"Use seq_len a multiple of {2 * world}.")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world); got rank={rank}, world={world}")
    if dist.is_initialized():
        raise RuntimeError("simulate() creates its own fake process group; a default group is already initialized. "
                           "Run it in a fresh process.")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cpu":
        torch.set_flush_denormal(True)
    dt = DTYPES[dtype]
    timed = lambda fn, iters: bench_cp._timed(fn, dev, 1, iters)  # noqa: E731
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(s, h, grad=True):
        return torch.randn(batch, s, h, head_dim, generator=g).to(dev, dt).requires_grad_(grad)

    res = {"world": world, "rank": rank, "seq_len": seq_len, "heads": heads, "kv_heads": kv_heads,
           "head_dim": head_dim, "dtype": dtype, "batch": batch, "device": str(dev),
           "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}
    q, k, v = rnd(seq_len, heads), rnd(seq_len, kv_heads), rnd(seq_len, kv_heads)
    f1, b1 = _fwd_bwd(lambda a, b_, c: ndp.ops.attention(a, b_, c, causal=True, backend=backend), q, k, v)
    res["single"] = {"fwd": timed(f1, iters=iters), "fwd_bwd": timed(b1, iters=iters)}
    del q, k, v

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        sl = seq_len // world
        ql, kl, vl = rnd(sl, heads), rnd(sl, kv_heads), rnd(sl, kv_heads)
        for impl in impls:
            try:
                cfg = ndp.ParallelismConfig(cp_size=world, cp_impl=impl,
                                            ulysses_size=ulysses if impl == "usp" else 1)
                cfg.check_heads(heads, kv_heads)
            except ValueError as e:
                res[impl] = {"skipped": str(e)}
                continue
            if impl == "usp":
                gu, gr = ndp.split_cp_group(None, ulysses)
                fn = lambda a, b_, c: ndp.usp_attention(a, b_, c, ulysses_group=gu, ring_group=gr,  # noqa: E731
                                                        causal=True, backend=backend)
            else:
                attn = {"ring": ndp.ring_attention, "allgather": ndp.allgather_attention,
                        "ulysses": ndp.ulysses_attention}[impl]
                fn = lambda a, b_, c, attn=attn: attn(a, b_, c, causal=True, backend=backend)  # noqa: E731
            fw, fb = _fwd_bwd(fn, ql, kl, vl)
            t_f, t_fb = timed(fw, iters=iters), timed(fb, iters=iters)
            res[impl] = {"fwd": t_f, "fwd_bwd": t_fb, "eff_fwd": res["single"]["fwd"] / world / t_f,
                         "eff_fwd_bwd": res["single"]["fwd_bwd"] / world / t_fb}
    finally:
        dist.destroy_process_group()
    return res


def predict(sim, gpu="h100", worlds=(8, 16, 32, 64, 128, 256, 512, 1024), seqs=(131072, 262144, 524288, 1048576),
            gpus_per_node=8, ulysses=8, feed=True, shape=None):
    """Predicted CP efficiency with communication (ndp.plan's model), per impl, N and S, for one attention
    layer; with ``feed`` the measured compute efficiency replaces the profile's cp_overhead.

    Args:
        sim: simulate()'s result. gpu: profile kind. shape: (heads, kv_heads, head_dim) of the predicted layer
            (default the simulated one).
    Returns:
        (cp_overhead used, {impl: {(N, S): efficiency or None (config invalid)}}).
    """
    from ndp.parallel import ParallelismConfig
    from ndp.plan import ModelSpec, Topology, estimate, load_gpu_profile
    from ndp.plan.cost import _rate, attention_block

    prof = load_gpu_profile(gpu)
    h, hk, d = shape or (sim["heads"], sim["kv_heads"], sim["head_dim"])
    spec = ModelSpec(name="attn", num_layers=1, hidden_size=h * d, intermediate_size=1, num_heads=h,
                     num_kv_heads=hk, vocab_size=1, head_dim=d)
    over = dict(prof.cp_overhead)
    # measured efficiency / what the block-length model alone predicts at the simulated shape
    for impl in IMPLS:
        r = sim.get(impl, {})
        if not feed or "eff_fwd_bwd" not in r:
            continue
        c = ParallelismConfig(cp_size=sim["world"], cp_impl=impl, ulysses_size=ulysses_of(impl, sim["world"]))
        blk, s = attention_block(spec, c, sim["seq_len"]), sim["seq_len"]
        model_eff = ((_rate(prof.attn_fwd_tflops, prof.attn_fwd_half_block, blk) /
                      _rate(prof.attn_fwd_tflops, prof.attn_fwd_half_block, s)) +
                     2.5 * (_rate(prof.attn_bwd_tflops, prof.attn_bwd_half_block, blk) /
                            _rate(prof.attn_bwd_tflops, prof.attn_bwd_half_block, s))) / 3.5
        over[impl] = r["eff_fwd_bwd"] / model_eff
    prof = prof.replace(cp_overhead=over)
    table = {}
    es = 2 if sim["dtype"] in ("bf16", "fp16") else 4
    dtype = "bf16" if es == 2 else "fp32"
    for impl in IMPLS:
        table[impl] = {}
        for n in worlds:
            for s in seqs:
                u = ulysses_of(impl, n, ulysses)
                try:
                    c = ParallelismConfig(cp_size=n, cp_impl=impl, ulysses_size=u)
                    c.check_heads(h, hk)
                    c.check_seq_len(s)
                    if c.head_parallel_size > gpus_per_node:
                        raise ValueError("all-to-all group larger than a node")
                except ValueError:
                    table[impl][(n, s)] = None
                    continue
                one = estimate(spec, ParallelismConfig(), prof, Topology(1, gpus_per_node), seq_len=s, batch_size=1,
                               dtype=dtype)
                e = estimate(spec, c, prof, Topology(n, gpus_per_node), seq_len=s, batch_size=1, dtype=dtype)
                ideal = one.time["attention"] / n
                table[impl][(n, s)] = ideal / (e.time["attention"] + e.time["cp_comm"])
    return over, table


def ulysses_of(impl, n, u=8):
    if impl == "ulysses":
        return n
    if impl == "usp":
        return min(u, n // 2) if n >= 4 else 1
    return 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=None, help="simulated world size (default 8 on GPU, 4 on CPU)")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--seq-len", type=int, default=None, help="default 131072 on GPU, 256 on CPU")
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=tuple(DTYPES), default=None)
    ap.add_argument("--ulysses", type=int, default=2, help="Ulysses degree of the simulated USP")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--gpu", default="h100", help="GPU profile for the prediction")
    ap.add_argument("--feed", action=argparse.BooleanOptionalAction, default=None,
                    help="feed the measured efficiency into the prediction (default: on GPU only; on CPU at small S "
                         "the efficiency measures Python overhead, not a GPU's kernels)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    a = ap.parse_args(argv)
    gpu = torch.cuda.is_available()
    dflt = dict(world=8, seq_len=131072, heads=32, kv_heads=8, head_dim=128, dtype="bf16") if gpu else \
        dict(world=4, seq_len=256, heads=4, kv_heads=2, head_dim=32, dtype="fp32")
    for k, v in dflt.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    sim = simulate(a.world, a.seq_len, a.heads, a.kv_heads, a.head_dim, dtype=a.dtype, batch=a.batch, rank=a.rank,
                   ulysses=a.ulysses, backend=a.backend, iters=a.iters)
    print(f"one rank of {a.world} ({sim['device_name']}), S={a.seq_len}, H{a.heads}:{a.kv_heads}, d{a.head_dim}, "
          f"{a.dtype}, causal zigzag; single device: fwd {sim['single']['fwd'] * 1e3:.2f} ms, fwd+bwd "
          f"{sim['single']['fwd_bwd'] * 1e3:.2f} ms")
    print(f"{'impl':<10} {'fwd ms':>9} {'fwd+bwd ms':>11} {'eff fwd':>8} {'eff fwd+bwd':>12}")
    for impl in IMPLS:
        r = sim.get(impl, {})
        if "skipped" in r:
            print(f"{impl:<10} skipped: {r['skipped']}")
        elif r:
            print(f"{impl:<10} {r['fwd'] * 1e3:>9.2f} {r['fwd_bwd'] * 1e3:>11.2f} {r['eff_fwd']:>8.2f} "
                  f"{r['eff_fwd_bwd']:>12.2f}")
    feed = gpu if a.feed is None else a.feed
    # On CPU the prediction is for the profile's GPU with Llama-3-8B's attention shape (32:8 heads, d128).
    over, table = predict(sim, gpu=a.gpu, feed=feed, shape=None if gpu else (32, 8, 128))
    seqs = sorted({s for t in table.values() for (_, s) in t})
    print(f"\npredicted efficiency with communication, one attention layer fwd+bwd ({a.gpu} profile, 8 GPUs/node, "
          f"{'measured compute efficiency fed in' if feed else 'profile compute efficiency'}: cp_overhead {json.dumps({k: round(v, 3) for k, v in over.items()})})")
    for impl in IMPLS:
        print(f"{impl}:" + "".join(f"{'S=' + str(s // 1024) + 'k':>9}" for s in seqs))
        for n in sorted({n for (n, _) in table[impl]}):
            cells = [table[impl][(n, s)] for s in seqs]
            print(f"  N={n:<5}" + "".join(f"{c:>9.2f}" if c is not None else f"{'-':>9}" for c in cells))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "simulate_cp.json"), "w") as f:
        json.dump({"simulation": sim, "cp_overhead": over,
                   "predicted": {impl: {f"{n}x{s}": v for (n, s), v in t.items()} for impl, t in table.items()}},
                  f, indent=1)
    return sim, table


if __name__ == "__main__":
    main()
