"""Peak memory and time of the token loss: cross_entropy on the full logits vs ndp's fused linear cross-entropy.

    python bench/bench_memory.py                          # seq 8192, vocab 512 .. 65536, hidden 128, fp32, CPU
    python bench/bench_memory.py --seqlens 4096,8192 --vocabs 32768 --out bench/results/
    python bench/bench_memory.py --train                  # whole ndp-train steps, --loss full vs fused
    python bench/bench_memory.py --device cuda --hidden 4096 --vocabs 128256 --dtype bfloat16   # a GPU

--train: ``ndp-train`` (1 process, fp32, batch 1, 3 steps) on a 2-layer Llama of hidden 128 built from a
config.json, per --seqlens and --vocabs, for each of VARIANTS (the loss, checkpointing and offload flags): peak RSS
and the median step time after the first (table, memory_train.json and memory_train.png under --out); for the
two losses also the growth of the peak over the vocab-512 run, less the vocabulary's own parameter, gradient and
AdamW bytes (16 per parameter), in units of one fp32 logits tensor.

Each case runs in its own process (peak RSS is per process): the LM head and the loss, forward and backward, on
``[seq, hidden]`` hidden states. Reported: the peak-RSS growth over the process after its inputs exist, in units of
one fp32 ``[seq, vocab]`` logits tensor, and the median time of 3 steps. The fused op keeps one chunk of logits
(``ndp.ops.linear_ce.CHUNK_BYTES``); the unfused path keeps the logits, their fp32 copy and the softmax gradient.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from _common import peak_bytes  # noqa: E402  (puts the repository on sys.path)
from ndp.ops import linear_cross_entropy
from ndp.ops.linear_ce import CHUNK_BYTES


def _step(fused, hidden, weight, labels, chunk_bytes):
    if fused:
        loss = linear_cross_entropy(hidden, weight, labels, chunk_bytes=chunk_bytes)
    else:
        loss = F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=-100, reduction="sum")
    loss.backward()
    return loss.item()


def measure(fused: bool, seq: int, vocab: int, hidden_size: int, dtype, chunk_bytes: int = CHUNK_BYTES,
            device: str = "cpu") -> dict:
    """One case in this process: peak-memory growth (bytes) and median seconds of the loss forward+backward."""
    device = torch.device(device)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(seq, hidden_size, generator=g, dtype=dtype).to(device).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=g, dtype=dtype) * 0.02).to(device).requires_grad_()
    labels = torch.randint(0, vocab, (seq,), generator=g).to(device)
    weight.grad = torch.zeros_like(weight)  # the gradient buffer counts as the parameters' own, not the loss's
    hidden.grad = torch.zeros_like(hidden)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    base = peak_bytes(device)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        _step(fused, hidden, weight, labels, chunk_bytes)
        sync()
        times.append(time.perf_counter() - t0)
    return {"peak_growth_bytes": peak_bytes(device) - base, "seconds": statistics.median(times)}


def _child(args) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(args)], capture_output=True, text=True,
                         check=True, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    return json.loads(out.stdout.strip().splitlines()[-1])


# ndp-train variants of --train: name -> flags
VARIANTS = {
    "full loss": ["--loss", "full"],
    "fused": [],
    "fused + selective AC": ["--activation-checkpointing", "selective"],
    "fused + full AC": ["--activation-checkpointing", "full"],
    "fused + full AC + offload": ["--activation-checkpointing", "full", "--activation-offload"],
}


def _train_run(vocab: int, seq: int, hidden: int, flags: list, tmp: str) -> tuple[float, float]:
    """(peak RSS MB, median step seconds) of a 3-step ndp-train run on a 2-layer Llama of this vocabulary (random
    weights from a config)."""
    d = os.path.join(tmp, f"llama-{vocab}-{seq}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(dict(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=seq, tie_word_embeddings=False), f)
    metrics = os.path.join(tmp, "m.jsonl")
    subprocess.run([sys.executable, "-m", "ndp.train", "--model", d, "--seq-len", str(seq), "--batch-size", "1",
                    "--steps", "3", "--device", "cpu", "--dtype", "fp32", "--no-progress", "--metrics", metrics]
                   + flags, check=True, capture_output=True, text=True,
                   env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    with open(metrics) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return max(r["peak_mem_mb"] for r in recs), statistics.median(r["step_time_s"] for r in recs[1:])


def train_rows(seqlens, vocabs, hidden: int) -> list[dict]:
    """ndp-train's peak memory and step time by sequence length, vocabulary and variant (see --train)."""
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seq in seqlens:
            base = {name: _train_run(512, seq, hidden, VARIANTS[name], tmp)[0] for name in ("full loss", "fused")}
            for vocab in vocabs:
                for name, flags in VARIANTS.items():
                    peak, step = _train_run(vocab, seq, hidden, flags, tmp)
                    row = dict(variant=name, seq=seq, vocab=vocab, peak_mb=peak, step_s=step)
                    if name in base:  # the loss's growth over vocab 512, beyond 16 bytes per vocabulary parameter
                        params = 16 * 2 * (vocab - 512) * hidden / 2 ** 20
                        row["x_logits"] = round((peak - base[name] - params) / (seq * vocab * 4 / 2 ** 20), 3)
                    rows.append(row)
    return rows


def plot(rows, path):
    """Peak memory and step time per variant, one group of bars per (seq, vocab)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(r["seq"], r["vocab"]) for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(VARIANTS)
    for k, name in enumerate(VARIANTS):
        got = {(r["seq"], r["vocab"]): r for r in rows if r["variant"] == name}
        xs = [i + k * width for i in range(len(cases))]
        axes[0].bar(xs, [got[c]["peak_mb"] for c in cases], width, label=name)
        axes[1].bar(xs, [got[c]["step_s"] for c in cases], width, label=name)
    for ax, what in zip(axes, ("peak RSS (MB)", "step time (s)")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))], [f"seq {s}\nvocab {v}" for s, v in cases])
        ax.set_ylabel(what)
    axes[0].legend(fontsize=8)
    fig.suptitle("ndp-train, 1 process, fp32, 2-layer Llama (CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench/bench_memory.py", description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", default="8192")
    ap.add_argument("--vocabs", default="512,8192,65536")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--chunk-mib", type=int, default=CHUNK_BYTES // 2 ** 20, help="the fused op's logits chunk")
    ap.add_argument("--out", default=None, help="directory for memory.json")
    ap.add_argument("--device", default="cpu", help="cpu (peak RSS) or cuda (the allocator's peak)")
    ap.add_argument("--train", action="store_true", help="whole ndp-train steps, --loss full vs fused")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.train:
        vocabs = [int(x) for x in a.vocabs.split(",") if int(x) != 512]
        rows = train_rows([int(x) for x in a.seqlens.split(",")], vocabs, a.hidden)
        print(f"{'variant':<26} {'seq':>6} {'vocab':>6} {'peak MB':>9} {'step s':>8} {'loss growth x logits':>21}")
        for r in rows:
            print(f"{r['variant']:<26} {r['seq']:>6} {r['vocab']:>6} {r['peak_mb']:>9.0f} {r['step_s']:>8.2f} "
                  f"{r.get('x_logits', ''):>21}")
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, "memory_train.json"), "w") as f:
                json.dump({"hidden": a.hidden, "device": "cpu", "rows": rows}, f, indent=1)
            plot(rows, os.path.join(a.out, "memory_train.png"))
        return 0
    if a.child:
        c = json.loads(a.child)
        print(json.dumps(measure(c["fused"], c["seq"], c["vocab"], c["hidden"], getattr(torch, c["dtype"]),
                                 c["chunk_mib"] * 2 ** 20, c["device"])))
        return 0
    rows = []
    print(f"{'seq':>6} {'vocab':>6} {'loss':<8} {'peak growth':>12} {'x logits':>9} {'ms':>9}")
    for seq in (int(x) for x in a.seqlens.split(",")):
        for vocab in (int(x) for x in a.vocabs.split(",")):
            logits = seq * vocab * 4
            for fused in (False, True):
                r = _child(dict(fused=fused, seq=seq, vocab=vocab, hidden=a.hidden, dtype=a.dtype,
                                chunk_mib=a.chunk_mib, device=a.device))
                row = dict(seq=seq, vocab=vocab, loss="fused" if fused else "full", **r,
                           x_logits=round(r["peak_growth_bytes"] / logits, 3))
                rows.append(row)
                print(f"{seq:>6} {vocab:>6} {row['loss']:<8} {r['peak_growth_bytes'] / 2 ** 20:>9.1f} MiB "
                      f"{row['x_logits']:>9.3f} {r['seconds'] * 1e3:>9.1f}")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "memory.json"), "w") as f:
            json.dump({"hidden": a.hidden, "dtype": a.dtype, "device": a.device, "chunk_mib": a.chunk_mib,
                       "rows": rows},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
