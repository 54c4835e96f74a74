"""First-call latency of ndp attention in a fresh process: the first forward+backward holds the Triton compiles
and (on a GPU without a tuned table) the first-use measurements; the second call is the steady state.

    python bench/first_call.py --backend triton --out DIR     # one JSON row per call, printed and saved

Run it twice with the same TRITON_CACHE_DIR / NDP_TUNING_DIR to see cold against warm caches."""
import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import ndp.ops  # noqa: E402


def _files(path):
    return sum(len(f) for _, _, f in os.walk(path)) if path and os.path.isdir(path) else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--shape", default="2,4096,32,8,128", help="batch,seqlen,heads,kv_heads,head_dim")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    b, s, h, hk, d = (int(x) for x in args.shape.split(","))
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    g = torch.Generator(dev).manual_seed(0)
    q = torch.randn(b, s, h, d, device=dev, dtype=dtype, generator=g).requires_grad_()
    k = torch.randn(b, s, hk, d, device=dev, dtype=dtype, generator=g).requires_grad_()
    v = torch.randn(b, s, hk, d, device=dev, dtype=dtype, generator=g).requires_grad_()
    dout = torch.randn_like(q)
    cache = os.environ.get("TRITON_CACHE_DIR")
    rows = []
    for i in range(args.calls):
        before = _files(cache)
        t0 = time.perf_counter()
        out = ndp.ops.attention(q, k, v, causal=True, backend=args.backend)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        out.backward(dout)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        rows.append(dict(label=args.label, call=i + 1, backend=args.backend, shape=args.shape, dtype=args.dtype,
                         fwd_s=round(t1 - t0, 4), bwd_s=round(t2 - t1, 4), triton_cache_files_added=_files(cache) - before))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "first_call.jsonl"), "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
