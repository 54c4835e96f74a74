"""Peak memory and time of the token loss: cross_entropy on the full logits vs ndp's fused linear cross-entropy.

    python bench/bench_memory.py                          # seq 8192, vocab 512 .. 65536, hidden 128, fp32, CPU
    python bench/bench_memory.py --seqlens 4096,8192 --vocabs 32768 --out bench/results/
    python bench/bench_memory.py --train                  # whole ndp-train steps, --loss full vs fused

--train: ``ndp-train`` (1 process, fp32, seq 8192, batch 1, 2 steps) on a 2-layer Llama of hidden 128 built from a
config.json, at vocab 512 and at each --vocabs; reported: the growth of the run's peak RSS over the vocab-512 run,
less the vocabulary's own parameter, gradient and AdamW bytes (16 per parameter), in units of one logits tensor.

Each case runs in its own process (peak RSS is per process): the LM head and the loss, forward and backward, on
``[seq, hidden]`` hidden states. Reported: the peak-RSS growth over the process after its inputs exist, in units of
one fp32 ``[seq, vocab]`` logits tensor, and the median time of 3 steps. The fused op keeps one chunk of logits
(``ndp.ops.linear_ce.CHUNK_BYTES``); the unfused path keeps the logits, their fp32 copy and the softmax gradient.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from ndp.ops import linear_cross_entropy
from ndp.ops.linear_ce import CHUNK_BYTES


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _step(fused, hidden, weight, labels, chunk_bytes):
    if fused:
        loss = linear_cross_entropy(hidden, weight, labels, chunk_bytes=chunk_bytes)
    else:
        loss = F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=-100, reduction="sum")
    loss.backward()
    return loss.item()


def measure(fused: bool, seq: int, vocab: int, hidden_size: int, dtype, chunk_bytes: int = CHUNK_BYTES) -> dict:
    """One case in this process: peak-RSS growth (bytes) and median seconds of the loss forward+backward."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(seq, hidden_size, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=g, dtype=dtype) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (seq,), generator=g)
    weight.grad = torch.zeros_like(weight)  # the gradient buffer counts as the parameters' own, not the loss's
    hidden.grad = torch.zeros_like(hidden)
    base = _peak_rss()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        _step(fused, hidden, weight, labels, chunk_bytes)
        times.append(time.perf_counter() - t0)
    return {"peak_growth_bytes": _peak_rss() - base, "seconds": statistics.median(times)}


def _child(args) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(args)], capture_output=True, text=True,
                         check=True, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    return json.loads(out.stdout.strip().splitlines()[-1])


def _train_peak_mb(vocab: int, seq: int, hidden: int, loss: str, tmp: str) -> float:
    """Peak RSS (MB) of an ndp-train run on a 2-layer Llama of this vocabulary (random weights from a config)."""
    d = os.path.join(tmp, f"llama-{vocab}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(dict(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=seq, tie_word_embeddings=False), f)
    metrics = os.path.join(tmp, f"m-{vocab}-{loss}.jsonl")
    subprocess.run([sys.executable, "-m", "ndp.train", "--model", d, "--seq-len", str(seq), "--batch-size", "1",
                    "--steps", "2", "--device", "cpu", "--dtype", "fp32", "--loss", loss, "--no-progress",
                    "--metrics", metrics], check=True, capture_output=True, text=True,
                   env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    with open(metrics) as f:
        return max(json.loads(line)["peak_mem_mb"] for line in f if line.strip())


def train_rows(seq: int, vocabs, hidden: int) -> list[dict]:
    """ndp-train's peak memory by vocabulary and loss (see --train)."""
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for loss in ("full", "fused"):
            base = _train_peak_mb(512, seq, hidden, loss, tmp)
            for vocab in vocabs:
                peak = _train_peak_mb(vocab, seq, hidden, loss, tmp)
                params = 16 * 2 * (vocab - 512) * hidden / 2 ** 20  # embedding + lm_head: weight, grad, 2 moments
                logits = seq * vocab * 4 / 2 ** 20
                rows.append(dict(loss=loss, seq=seq, vocab=vocab, peak_mb=peak, base_peak_mb=base,
                                 x_logits=round((peak - base - params) / logits, 3)))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench/bench_memory.py", description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", default="8192")
    ap.add_argument("--vocabs", default="512,8192,65536")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--chunk-mib", type=int, default=CHUNK_BYTES // 2 ** 20, help="the fused op's logits chunk")
    ap.add_argument("--out", default=None, help="directory for memory.json")
    ap.add_argument("--train", action="store_true", help="whole ndp-train steps, --loss full vs fused")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.train:
        vocabs = [int(x) for x in a.vocabs.split(",") if int(x) != 512]
        rows = train_rows(int(a.seqlens.split(",")[0]), vocabs, a.hidden)
        print(f"{'loss':<6} {'vocab':>6} {'peak MB':>9} {'vocab 512':>9} {'growth x logits':>16}")
        for r in rows:
            print(f"{r['loss']:<6} {r['vocab']:>6} {r['peak_mb']:>9.0f} {r['base_peak_mb']:>9.0f} {r['x_logits']:>16.3f}")
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, "memory_train.json"), "w") as f:
                json.dump({"hidden": a.hidden, "device": "cpu", "rows": rows}, f, indent=1)
        return 0
    if a.child:
        c = json.loads(a.child)
        print(json.dumps(measure(c["fused"], c["seq"], c["vocab"], c["hidden"], getattr(torch, c["dtype"]),
                                 c["chunk_mib"] * 2 ** 20)))
        return 0
    rows = []
    print(f"{'seq':>6} {'vocab':>6} {'loss':<8} {'peak growth':>12} {'x logits':>9} {'ms':>9}")
    for seq in (int(x) for x in a.seqlens.split(",")):
        for vocab in (int(x) for x in a.vocabs.split(",")):
            logits = seq * vocab * 4
            for fused in (False, True):
                r = _child(dict(fused=fused, seq=seq, vocab=vocab, hidden=a.hidden, dtype=a.dtype,
                                chunk_mib=a.chunk_mib))
                row = dict(seq=seq, vocab=vocab, loss="fused" if fused else "full", **r,
                           x_logits=round(r["peak_growth_bytes"] / logits, 3))
                rows.append(row)
                print(f"{seq:>6} {vocab:>6} {row['loss']:<8} {r['peak_growth_bytes'] / 2 ** 20:>9.1f} MiB "
                      f"{row['x_logits']:>9.3f} {r['seconds'] * 1e3:>9.1f}")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "memory.json"), "w") as f:
            json.dump({"hidden": a.hidden, "dtype": a.dtype, "device": "cpu", "chunk_mib": a.chunk_mib, "rows": rows},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
