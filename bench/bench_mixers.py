"""Cost per rank of a hybrid's token mixers under CP: ``cp_mixers="gather"`` vs ``"heads"`` (ndp.hf.mixers).

    python bench/bench_mixers.py                                  # seq 4096, cp 2, fp32, CPU (gloo)
    python bench/bench_mixers.py --seqlens 2048,8192 --cp 2 --out bench/results/
    python bench/bench_mixers.py --device cuda --cp 2 --seqlens 32768 --dtype bfloat16   # GPUs (nccl)
    python bench/bench_mixers.py --family granite4 --seqlens 2048                 # Granite 4's Mamba2

A hybrid built from a config (random weights): one mixer layer and one attention layer, the mixer at a real model's
sizes, hidden --hidden. --family qwen3_next: Qwen3-Next's gated DeltaNet (16 key heads and 32 value heads of 128);
granite4: Granite 4.0-H's Mamba2 (128 heads of 64, one group of state 256, under a gated norm over all the heads).
For each mode, cp ranks run --steps forward+backward steps of the causal-LM loss on one row of --seqlens tokens (ring
attention, zigzag); reported per mode: the median step time after the first, the peak memory growth of rank 0 over
the process once its model is built (CUDA's allocator peak on a GPU, the peak RSS on CPU), and the FLOPs and the
activation bytes autograd saves in the mixer on rank 0 (``mixer_cost``; tests/hf/test_mixers.py counts with it
too). ``one`` is the same model in one process on the whole row, for scale. Gathering runs the mixer over the whole
row on every rank; splitting by heads runs each rank's 1/cp of its heads.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, GraniteMoeHybridConfig, Qwen3NextConfig

from _common import ROOT, markdown_table, peak_bytes, rank_job, spawn_json, write_results

import ndp  # noqa: E402
import ndp.hf  # noqa: E402

MODES = ("one", "gather", "heads")


def tiny_qwen3_next(hidden: int, dtype):
    cfg = Qwen3NextConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                          layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
                          num_key_value_heads=2, head_dim=64, num_experts=0, mlp_only_layers=[0, 1],
                          linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                          linear_value_head_dim=128, use_cache=False)
    return _built(cfg, dtype)


def tiny_granite4(hidden: int, dtype):
    cfg = GraniteMoeHybridConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden,
                                 shared_intermediate_size=2 * hidden, num_hidden_layers=2, num_local_experts=0,
                                 layer_types=["mamba", "attention"], num_attention_heads=4, num_key_value_heads=2,
                                 mamba_n_heads=128, mamba_d_head=64, mamba_expand=128 * 64 // hidden, mamba_n_groups=1,
                                 mamba_d_state=256, use_cache=False)
    return _built(cfg, dtype)


def _built(cfg, dtype):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").train()


# family -> (builder, the suffix of its mixers' names)
FAMILIES = {"qwen3_next": (tiny_qwen3_next, "linear_attn"), "granite4": (tiny_granite4, "mamba")}


def mixer_cost(model, step, suffix="linear_attn") -> tuple[int, int]:
    """(FLOPs, bytes of the activations autograd saves) inside the modules named ``*<suffix>`` during ``step()``:
    torch's FLOP counter, every op but the convolution's backward, which torch counts as a dense convolution's
    (quadratic in the channels of a depthwise one); the running module's weights are not activations. Each saved
    tensor is held until the count ends, so no storage's address is reused by another's (the allocator's reuse of
    a freed one made the count machine-dependent)."""
    saved, kept, weights = {}, [], set()

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            saved[ptr] = t.untyped_storage().nbytes()
            kept.append(t)
        return t

    def enter(module, args, kwargs):
        weights.clear()  # FSDP2 frees a unit's gathered weights after it: their addresses come back as activations'
        weights.update(p.untyped_storage().data_ptr() for p in module.parameters())
        module.saving = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        module.saving.__enter__()

    def leave(module, *_):
        module.saving.__exit__(None, None, None)

    mixers = [m for name, m in model.named_modules() if name.endswith(suffix)]
    hooks = [h for m in mixers for h in (m.register_forward_pre_hook(enter, with_kwargs=True),
                                          m.register_forward_hook(leave))]
    with FlopCounterMode(display=False) as counter:
        step()
    for h in hooks:
        h.remove()
    flops = sum(n for name, ops in counter.get_flop_counts().items() if name.endswith(suffix)
                for op, n in ops.items() if "convolution_backward" not in str(op))
    return flops, sum(saved.values())


def run_mode(family, mode, world, seq, hidden, dtype, device, steps) -> dict:
    """This rank's median step seconds, peak-memory growth and mixer cost for one mode."""
    ids = torch.randint(0, 512, (1, seq), generator=torch.Generator().manual_seed(1)).to(device)
    labels = F.pad(ids[:, 1:], (0, 1), value=-100)
    build, suffix = FAMILIES[family]
    model = build(hidden, dtype).to(device)
    batch = dict(input_ids=ids, labels=labels)
    if mode != "one":
        cfg = ndp.ParallelismConfig(cp_size=world, cp_mixers=mode)
        model = ndp.hf.parallelize(model, cfg, cfg.build_device_mesh(device.type))
        batch = ndp.hf.shard_batch(model, **batch)

    def step():
        logits = model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids")).logits
        loss = ndp.hf.loss(logits, batch["labels"], model) if mode != "one" else \
            F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else peak_bytes(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    growth = peak_bytes(device) - base
    flops, saved = mixer_cost(model, step, suffix)
    return dict(family=family, mode=mode, seq=seq, cp=world, step_s=statistics.median(times[1:] or times),
                peak_growth_bytes=growth, mixer_flops=flops, mixer_saved_bytes=saved)


def _rank(rank, tmp, out_file, world, family, mode, seq, hidden, dtype, device_type, steps):
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    rank_job(rank, world, tmp, out_file, lambda: run_mode(family, mode, world, seq, hidden, dtype, device, steps),
             timeout_s=600, device_type=device_type)


def measure(family, mode, world, seq, hidden, dtype, device_type, steps) -> dict:
    """One mode in fresh processes (``one``: a single rank on the whole row)."""
    world = world if mode != "one" else 1
    return spawn_json(_rank, world, world, family, mode, seq, hidden, dtype, device_type, steps)


def table(rows) -> str:
    return markdown_table(("family", "seq", "mode", "cp", "step s", "peak growth MiB", "mixer saved MiB"),
                          [(r["family"], str(r["seq"]), r["mode"], str(r["cp"]), f"{r['step_s']:.3f}",
                            f"{r['peak_growth_bytes'] / 2**20:.1f}", f"{r['mixer_saved_bytes'] / 2**20:.1f}")
                           for r in rows])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="qwen3_next", choices=sorted(FAMILIES))
    ap.add_argument("--seqlens", default="4096")
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    rows = [measure(args.family, mode, args.cp, int(seq), args.hidden, dtype, args.device, args.steps)
            for seq in args.seqlens.split(",") for mode in args.modes.split(",")]
    print(table(rows))
    write_results(args.out, "bench_mixers", dict(device=args.device, dtype=args.dtype, hidden=args.hidden,
                                                 family=args.family, rows=rows))
    return rows


if __name__ == "__main__":
    sys.exit(main() and 0)
