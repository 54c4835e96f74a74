"""Attention engines side by side in one run: ndp's per-block ``auto`` against torch's own fused attention.

    python bench/bench_engines.py --out bench/results/             # all parts (CPU: about 4 minutes)
    python bench/bench_engines.py --only single --seqlens 1024,4096
    python bench/bench_engines.py --only ring --ring-seqlen 8192 --with-reference-engine

1. single: one process, forward+backward of ``ndp.ops.attention`` per engine (auto, sdpa, the torch
   reference; triton on CUDA) against ``torch.nn.functional.scaled_dot_product_attention`` with autograd,
   causal and full, B=1 H=8 D=64, fp32 on CPU (bf16 on CUDA). Ratio = ndp time / SDPA time.
   host (``--only host``): the same causal calls (auto and SDPA), the host's time per call with the device not
   waited for: what a model step hides on a GPU, and what a synchronised short call shows.
2. ring (CPU, gloo): 2 processes, zigzag ring attention forward+backward, causal, B=1 H=8 D=64 fp32, one
   thread per rank: ``ndp.ring_attention(backend="auto")`` against torch's own context-parallel ring
   (``torch.distributed.tensor.experimental``'s load-balanced templated ring over the CPU flash kernel,
   inputs in the same head-tail sharding) and, with ``--with-reference-engine``, ndp's ring on the
   materialising ``torch`` engine (what ``auto`` ran on CPU before the sdpa engine). Slowest rank.

3. hf (``--only hf``): a Hugging Face Llama (4 layers, AdamW; on CPU hidden 512, 8:4 heads, d64, fp32; on a GPU
   hidden 2048, 16:8 heads, d128, bf16) trained for a few steps with ``attn_implementation="sdpa"`` and with
   ndp's attention (``ndp_ring``, no CP group: ``ndp.ops.attention`` with ``auto``); tokens/s, both from the
   same weights, losses compared; on a GPU also the host syncs of one step (torch's sync debug mode).

Before timing, every provider's output is checked against a reference (ndp/testing.py): the single
runs against SDPA on the same inputs, the ring outputs against single-process SDPA on the full sequence
cut with ndp.shard_sequence. Times are medians (perf_counter; CUDA synchronised) with p20/p80. Results:
a printed table, <out>/bench_engines.json and .csv (one row per result with machine, versions, git SHA).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import sys
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.dirname(os.path.abspath(__file__))):
    if p not in sys.path:
        sys.path.insert(0, p)

import bench_cp  # noqa: E402  (the machine/commit facts every benchmark CSV row carries)
import ndp.hf  # noqa: E402
from _common import rank_job, spawn_json  # noqa: E402  (a spawned job of ranks that hands one JSON result back)
from ndp.testing import tol  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


def _stats(times):
    t = np.asarray(times) * 1e3
    return dict(ms=float(np.median(t)), p20=float(np.percentile(t, 20)), p80=float(np.percentile(t, 80)))


def _check(name, got, want, dtype):
    atol, rtol = tol(dtype, "out")
    err = (got.double() - want.double()).abs()
    bad = int((err > atol + rtol * want.double().abs()).sum())
    print(f"reference check {name}: max|out-ref| = {err.max().item():.3e} {'ok' if bad == 0 else 'MISMATCH'}",
          flush=True)
    if bad:
        raise RuntimeError(f"bench_engines: {name} differs from the reference ({bad} elements over atol={atol:g}, "
                           f"rtol={rtol:g}); not timing a wrong result")
    return err.max().item()


# ---------------------------------------------------------------------------------------------- single process

def _interleaved(providers, dev, iters, warmup=1, sample=None):
    """Times {name: fn} round by round (every provider once per round), so that load from elsewhere on
    the machine hits all providers alike. sample(fn): the seconds of one round's run (default: one call,
    ``bench_cp._samples``). Returns {name: [seconds]}."""
    sample = sample or (lambda fn: bench_cp._samples(fn, dev, warmup=0, iters=1))
    for fn in providers.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in providers}
    for _ in range(iters):
        for name, fn in providers.items():
            times[name] += sample(fn)
    return times


def _rows(part, shape, times, errs):
    """One result row per provider of `times`, its ratio to torch SDPA's median."""
    base = _stats(times["torch SDPA"])["ms"]
    return [dict(part=part, provider=name, shape=shape, ratio=_stats(t)["ms"] / base, ref_err=errs.get(name, 0.0),
                 **_stats(t)) for name, t in times.items()]


def _case(s, causal, dev, dtype, engines):
    """(shape, {provider: fn}, {provider: max error}) of one single-process case: torch SDPA with autograd and
    ndp.ops.attention per engine, forward+backward, each ndp provider checked against SDPA's output first."""
    import ndp.ops

    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, s, 8, 64, generator=g).to(dev, dtype) for _ in range(4))
    shape = f"B=1 S={s} H=8 D=64 {str(dtype)[6:]} {'causal' if causal else 'full'}"
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))

    def sdpa():
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        out.backward(dout.transpose(1, 2))
        return out

    want = sdpa().transpose(1, 2).detach()
    providers, errs = {"torch SDPA": sdpa}, {}
    for e in engines:
        if e != "auto" and not ndp.ops.available_backends(dev)[e][0]:
            continue
        if e == "torch" and s > 4096:
            continue  # the materialising reference holds S x S per head
        qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))

        def run(qq=qq, kk=kk, vv=vv, e=e):
            out = ndp.ops.attention(qq, kk, vv, causal=causal, backend=e)
            out.backward(dout)
            return out

        errs[f"ndp {e}"] = _check(f"ndp {e} {shape}", run().detach(), want, dtype)
        providers[f"ndp {e}"] = run
    return shape, providers, errs


def _engines(dev, engines):
    return engines or (["auto", "sdpa", "triton"] if dev.type == "cuda" else ["auto", "sdpa", "torch"])


def _dtype(dev):
    return torch.bfloat16 if dev.type == "cuda" else torch.float32


def single(seqlens, dev, iters, engines=None):
    rows = []
    for s in seqlens:
        for causal in (True, False):
            shape, providers, errs = _case(s, causal, dev, _dtype(dev), _engines(dev, engines))
            rows += _rows("single", shape, _interleaved(providers, dev, iters), errs)
    return rows


def host(seqlens, dev, iters):
    """The host's time per forward+backward, the device not waited for (what the GPU hides inside a model step
    and shows when each call is synchronised, as in ``single``): per round 50 calls back to back, then one
    synchronisation; causal, SDPA and ndp's auto. On CPU the host does the work too (one call per round)."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    calls = 50 if dev.type == "cuda" else 1

    def issued(fn):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        seconds = (time.perf_counter() - t0) / calls
        sync()
        return [seconds]

    rows = []
    for s in seqlens:
        shape, providers, errs = _case(s, True, dev, _dtype(dev), ["auto"])
        rows += _rows("host", shape + " host", _interleaved(providers, dev, iters, warmup=0, sample=issued), errs)
    return rows


# ---------------------------------------------------------------------------------------------- ring (gloo)

def _ring_body(rank, tmp, out_file, world, cfg):
    rank_job(rank, world, tmp, out_file, lambda: _ring_times(cfg), timeout_s=600)


def _ring_times(cfg) -> dict:
    """This rank's times and reference error per ring provider (process group up; all-reduced: the slowest rank)."""
    import torch.distributed as dist

    import ndp
    from torch.distributed.tensor.experimental._context_parallel import _attention as tcp

    s, d = cfg["s"], 64
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, s, 8, d, generator=g) for _ in range(4))
    with torch.no_grad():
        full = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True)
    want = ndp.shard_sequence(full.transpose(1, 2), dim=1)
    ql, kl, vl, dl = (ndp.shard_sequence(x, dim=1) for x in (q, k, v, dout))
    res = {}

    def ndp_ring(backend):
        xs = [x.detach().requires_grad_() for x in (ql, kl, vl)]

        def run():
            out = ndp.ring_attention(*xs, causal=True, backend=backend)
            out.backward(dl)
            return out
        return run

    # torch's ring: zigzag ("load balanced") head-tail shards in [B, H, S, D], the CPU flash op per block.
    tcp._cp_options.enable_load_balance = True
    aten = torch.ops.aten
    qt, kt, vt, dt = (x.transpose(1, 2).contiguous() for x in (ql, kl, vl, dl))

    def torch_ring():
        out, lse = tcp._templated_ring_attention(dist.group.WORLD, 2, aten._scaled_dot_product_flash_attention_for_cpu,
                                                 qt, kt, vt, is_causal=True, dropout_p=0.0, scale=d ** -0.5)[:2]
        tcp._templated_ring_attention_backward(
            dist.group.WORLD, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default, grad_out=dt,
            grad_out_name="grad_out", query=qt, key=kt, value=vt, out=out, logsumexp=lse, is_causal=True,
            dropout_p=0.0, scale=d ** -0.5)
        return out.transpose(1, 2)

    providers = [("ndp ring auto", ndp_ring("auto")), ("torch context-parallel ring", torch_ring)]
    if cfg["with_reference_engine"]:
        providers.append(("ndp ring torch-engine", ndp_ring("torch")))
    # Interleave providers round by round so that machine noise hits all of them alike.
    times = {name: [] for name, _ in providers}
    errs = {}
    for name, fn in providers:
        errs[name] = _check_quiet(fn().detach(), want)
    for _ in range(cfg["iters"]):
        for name, fn in providers:
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    for name, _ in providers:
        t = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)   # per round, the slowest rank
        e = torch.tensor([errs[name]], dtype=torch.float64)
        dist.all_reduce(e, op=dist.ReduceOp.MAX)
        res[name] = dict(times=t.tolist(), ref_err=e.item())
    return res


def _check_quiet(got, want):
    atol, rtol = tol(torch.float32, "out")
    err = (got.double() - want.double()).abs()
    if bool((err > atol + rtol * want.double().abs()).any()):
        raise RuntimeError(f"bench_engines: ring output differs from single-process SDPA (max {err.max():.3e}); "
                           f"not timing a wrong result")
    return err.max().item()


def ring(s, iters, with_reference_engine):
    cfg = dict(s=s, iters=iters, with_reference_engine=with_reference_engine)
    res = spawn_json(_ring_body, 2, 2, cfg)
    shape = f"W=2 zigzag B=1 S={s} H=8 D=64 float32 causal"
    base = _stats(res["torch context-parallel ring"]["times"])["ms"]
    rows = []
    for name, r in res.items():
        st = _stats(r["times"])
        rows.append(dict(part="ring", provider=name, shape=shape, ratio=st["ms"] / base, ref_err=r["ref_err"], **st))
    return rows


# ---------------------------------------------------------------------------------------------- HF model

# The HF model per device: (LlamaConfig fields, dtype, the largest relative loss difference ndp vs sdpa allowed).
# On a GPU the shape of the first GPU measurement in bf16, where a few AdamW steps drift apart by rounding alone.
HF_MODELS = {"cpu": (dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4),
                     torch.float32, 1e-4),
             "cuda": (dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=8),
                      torch.bfloat16, 1e-2)}


def _train_step(model, opt, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _host_syncs(step) -> int:
    """How many times `step()` made the host wait for the GPU (torch's sync debug mode warns on each)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def hf(seqlen, steps, dev):
    ndp.hf.register_attention()
    fields, dtype, max_rel = HF_MODELS[dev.type]
    cfg = LlamaConfig(vocab_size=256, num_hidden_layers=4, max_position_embeddings=seqlen, **fields)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (steps + 2, 1, seqlen), generator=g).to(dev)
    runs = {}
    for impl in ("sdpa", "ndp_ring"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(dev, dtype)
        model.set_attn_implementation(impl)
        runs[impl] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3), [], [])
    for i in range(steps + 1):
        for impl, (model, opt, losses, times) in runs.items():  # step by step, alternating the two models
            t0 = time.perf_counter()
            loss = _train_step(model, opt, ids[i])
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            losses.append(loss.item())
            if i:  # step 0 is warm-up
                times.append(time.perf_counter() - t0)
    syncs = {impl: _host_syncs(lambda r=r: _train_step(r[0], r[1], ids[-1])) if dev.type == "cuda" else None
             for impl, r in runs.items()}
    res = {impl: (r[2], r[3]) for impl, r in runs.items()}
    (l0, t0), (l1, t1) = res["sdpa"], res["ndp_ring"]
    rel = max(abs(a - b) / abs(a) for a, b in zip(l0, l1))
    print(f"HF Llama losses, ndp vs sdpa: max relative difference {rel:.2e}; host syncs per step {syncs}", flush=True)
    if rel > max_rel:
        raise RuntimeError(f"bench_engines: HF losses differ between sdpa and ndp attention ({rel:.2e} > {max_rel})")
    shape = (f"Llama h{cfg.hidden_size} L4 {cfg.num_attention_heads}:{cfg.num_key_value_heads} d{cfg.head_dim} "
             f"S={seqlen} B=1 {str(dtype).replace('torch.', '')}")
    base = _stats(t0)["ms"]
    rows = []
    for (name, impl), t in zip((("HF sdpa", "sdpa"), ("HF ndp_ring (auto)", "ndp_ring")), (t0, t1)):
        st = _stats(t)
        rows.append(dict(part="hf", provider=name, shape=shape, ratio=st["ms"] / base, ref_err=rel,
                         tokens_per_s=seqlen / (st["ms"] / 1e3), host_syncs=syncs[impl], **st))
    return rows


# ---------------------------------------------------------------------------------------------- report

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--only", choices=["single", "host", "ring", "hf"], action="append")
    ap.add_argument("--hf-seqlen", type=int, default=2048)
    ap.add_argument("--hf-steps", type=int, default=5)
    ap.add_argument("--seqlens", default="1024,4096")
    ap.add_argument("--ring-seqlen", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--with-reference-engine", action="store_true",
                    help="also time the ring on the materialising torch engine (slow: ~20 s per step at S=8192)")
    args = ap.parse_args(argv)
    parts = set(args.only or ["single", "host", "ring", "hf"])
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    meta = dict(torch=torch.__version__, python=platform.python_version(), machine=platform.machine(),
                cpus=os.cpu_count(), threads=torch.get_num_threads(), git_sha=bench_cp._git_sha(),
                gpu=torch.cuda.get_device_name(0) if dev.type == "cuda" else "none",
                date=datetime.datetime.now(datetime.timezone.utc).isoformat())
    rows = []
    if "single" in parts:
        rows += single([int(x) for x in args.seqlens.split(",")], dev, args.iters)
    if "host" in parts:
        rows += host([int(x) for x in args.seqlens.split(",")], dev, args.iters)
    if "ring" in parts:
        rows += ring(args.ring_seqlen, args.iters, args.with_reference_engine)
    if "hf" in parts:
        rows += hf(args.hf_seqlen, args.hf_steps, dev)
    print(f"\n{'part':<7} {'provider':<28} {'shape':<44} {'ms':>10} {'p20':>10} {'p80':>10} {'ratio':>7}")
    for r in rows:
        print(f"{r['part']:<7} {r['provider']:<28} {r['shape']:<44} {r['ms']:>10.1f} {r['p20']:>10.1f} "
              f"{r['p80']:>10.1f} {r['ratio']:>7.3f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_engines.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(os.path.join(args.out, "bench_engines.csv"), "w", newline="") as f:
        keys = ["part", "provider", "shape", "ms", "p20", "p80", "ratio", "ref_err"]
        w = csv.DictWriter(f, fieldnames=["gpu", "torch", "git_sha"] + keys)
        w.writeheader()
        for r in rows:
            w.writerow(dict(gpu=meta["gpu"], torch=meta["torch"], git_sha=meta["git_sha"],
                            **{k: r.get(k) for k in keys}))
    print(f"\nwrote {args.out}/bench_engines.json and .csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
