"""Kernel benchmark: TFLOP/s of ndp's Triton flash attention vs torch SDPA and flash-attn.

On a GPU::

    python bench/bench_kernels.py --out bench/results/
    python bench/bench_kernels.py --seqlens 1024,4096 --head-dims 128 --modes fwd,bwd

times fwd, bwd and fwd+bwd with ``triton.testing.do_bench`` (p50 with p20/p80) for seq 1k..64k, head_dim
64/128, causal and full, GQA 32:8 (batch = 16k tokens / seqlen), for the providers ndp (what a user gets; each
ndp row records the tiles and the backward it ran), ndp_atomic and ndp_split (each backward forced; split is the
atomic-free one, deterministic=True), ndp_tma (the forward and the split backward's dQ kernel with K/V by
TMA, sm_90+), torch SDPA (its default, cuDNN and flash pinned) and flash-attn (when importable). FLOPs =
4*b*h*s^2*d, x0.5 causal, x2.5 for bwd (x3.5 fwd+bwd). One output per (head_dim, causal) is checked against
``ndp_kernels.reference`` before timing. Results go to ``<out>/kernels_<gpu>.json`` and ``.csv`` (one row per
measurement, with GPU name, torch/triton versions, git SHA, shapes and dtype) and a PNG plot.

Without a GPU it runs a smoke mode: tiny shapes under the Triton interpreter with a correctness
check against the reference, then prints the static AOT report (registers, spills, shared memory
per kernel and arch, ``python -m ndp_kernels.aot --markdown``).
"""
from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

logger = logging.getLogger("bench_kernels")

DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def git_sha() -> str:
    """HEAD commit read from .git (no git executable needed); "unknown" outside a checkout."""
    git = os.path.join(ROOT, ".git")
    try:
        with open(os.path.join(git, "HEAD")) as f:
            head = f.read().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        path = os.path.join(git, ref)
        if os.path.exists(path):
            with open(path) as f:
                return f.read().strip()
        with open(os.path.join(git, "packed-refs")) as f:
            for line in f:
                if line.strip().endswith(ref):
                    return line.split()[0]
    except OSError:
        pass
    return "unknown"


def attn_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal, mode) -> float:
    """FLOPs = 4*b*h*sq*sk*d, x0.5 causal, x2.5 bwd, x3.5 fwd+bwd."""
    f = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim * (0.5 if causal else 1.0)
    return f * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[mode]


def _env_info():
    import torch
    import triton
    return {"torch": torch.__version__, "triton": triton.__version__, "git_sha": git_sha()}


# ------------------------------------------------------------------------------------------------
# GPU mode
# ------------------------------------------------------------------------------------------------

def _providers():
    import torch

    # ndp: what a user gets (on a GPU without a tuned table, the backward and the TMA choice are measured on first
    # use, see ndp_kernels.configs.AUTO_PROBE); ndp_atomic / ndp_split: each backward forced (ndp_split is the
    # atomic-free one, deterministic=True); ndp_tma: ndp_split with the forward's and the dQ kernel's K/V read by
    # TMA (KernelConfig.tma), sm_90+ only. sdpa_cudnn / sdpa_flash: torch's SDPA pinned to one backend (torch_sdpa
    # is its default choice).
    provs = ["ndp", "ndp_atomic", "ndp_split", "torch_sdpa", "sdpa_cudnn", "sdpa_flash"]
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0):
        provs.insert(3, "ndp_tma")
    try:
        import flash_attn  # noqa: F401
        provs.append("flash_attn")
    except Exception as e:  # not installed, or built for another torch
        logger.info("flash-attn not importable (%s); skipping that provider", e)
    return provs


NDP_PROVIDERS = ("ndp", "ndp_atomic", "ndp_split", "ndp_tma")


def _pin(provider, q):
    """The context an ndp provider runs in: ndp_atomic forces the atomic backward; ndp_tma the forward and the
    split backward's dQ kernel with K/V by TMA (compare with ndp_split); ndp takes what configs decides."""
    import contextlib
    import dataclasses

    from ndp_kernels import configs

    stack = contextlib.ExitStack()
    if provider == "ndp_atomic":
        stack.enter_context(configs.override("bwd_impl", "atomic"))
    elif provider == "ndp_tma":
        arch, d = configs.current_arch(q.device), q.shape[-1]
        for kind, pick in (("fwd", configs.fwd_config), ("bwd_dq", configs.bwd_dq_config)):
            stack.enter_context(configs.override(kind, dataclasses.replace(pick(arch, d, q.device, dtype=q.dtype),
                                                                          tma=True)))
    return stack


def _deterministic(provider) -> bool:
    return provider in ("ndp_split", "ndp_tma")


def ndp_kernels_used(provider, q) -> str:
    """What an ndp provider runs at q's dtype and head_dim: the forward's tiles, which backward and its tiles."""
    from ndp_kernels import configs

    arch, d, dev, dt = configs.current_arch(q.device), q.shape[-1], q.device, q.dtype
    with _pin(provider, q):
        impl = configs.bwd_impl(arch, d, dt, deterministic=_deterministic(provider), device=dev)
        bwd = (f"split dK/dV {configs.bwd_dkdv_config(arch, d, dev, dt)} dQ {configs.bwd_dq_config(arch, d, dev, dt)}"
               if impl == "split" else f"atomic {configs.bwd_config(arch, d, dev, dt)}")
        return f"fwd {configs.fwd_config(arch, d, dev, dt)}, bwd {bwd}"


def _make_fns(provider, q, k, v, dout, causal):
    """(fwd, bwd, fwd+bwd) callables and the tensors whose .grad do_bench resets."""
    import torch.nn.functional as F

    if provider in NDP_PROVIDERS:
        import ndp_kernels

        det = _deterministic(provider)

        def fwd():
            with _pin(provider, q):
                return ndp_kernels.flash_attn_fwd(q, k, v, causal=causal)
        out, lse = fwd()

        def bwd():
            with _pin(provider, q):
                return ndp_kernels.flash_attn_bwd(dout, q, k, v, out, lse, causal=causal, deterministic=det)

        def both():
            o, l = fwd()
            with _pin(provider, q):
                ndp_kernels.flash_attn_bwd(dout, q, k, v, o, l, causal=causal, deterministic=det)
        return fwd, bwd, both, []
    if provider in ("torch_sdpa", "sdpa_cudnn", "sdpa_flash"):
        import contextlib

        from torch.nn.attention import SDPBackend, sdpa_kernel
        pin = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION}.get(provider)
        qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
        dt = dout.transpose(1, 2)

        def run():
            with sdpa_kernel(pin) if pin is not None else contextlib.nullcontext():
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True)
        out = run()  # raises here (provider skipped) when the pinned backend cannot run these shapes
        bwd = lambda: out.backward(dt, retain_graph=True)  # noqa: E731
        both = lambda: run().backward(dt)  # noqa: E731
        return run, bwd, both, [qt, kt, vt]
    if provider == "flash_attn":
        from flash_attn import flash_attn_func
        qf, kf, vf = (x.detach().requires_grad_() for x in (q, k, v))
        run = lambda: flash_attn_func(qf, kf, vf, causal=causal)  # noqa: E731
        out = run()
        bwd = lambda: out.backward(dout, retain_graph=True)  # noqa: E731
        both = lambda: run().backward(dout)  # noqa: E731
        return run, bwd, both, [qf, kf, vf]
    raise ValueError(f"unknown provider {provider!r}")


def _check_against_reference(q, k, v, causal, dtype):
    """ndp output vs the fp32 reference on the first batch element (at most 2048 tokens, since the
    reference materialises the score matrix); raises on mismatch."""
    import torch
    import ndp_kernels
    from ndp_kernels import reference
    n = min(q.shape[1], 2048)
    q1, k1, v1 = q[:1, :n], k[:1, :n], v[:1, :n]
    out, lse = ndp_kernels.flash_attn_fwd(q1, k1, v1, causal=causal)
    ref_out, ref_lse = reference.flash_attn_fwd_ref(q1, k1, v1, causal=causal)
    atol = {torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    err = (out.float() - ref_out.float()).abs().max().item()
    # The reference rounds its fp32 result to the input dtype; allow one rounding step more.
    if not math.isfinite(err) or err > 4 * atol:
        raise RuntimeError(f"ndp output differs from the reference: max |err| = {err:.3e} (causal={causal})")
    return err


def run_gpu(args) -> list[dict]:
    import torch
    from triton.testing import do_bench

    dev = torch.device("cuda")
    info = _env_info() | {"gpu": torch.cuda.get_device_name(dev)}
    dtype = getattr(torch, DTYPES[args.dtype])
    rows = []
    providers = [p for p in _providers() if p in args.providers]
    for head_dim in args.head_dims:
        for causal in (True, False):
            checked = False
            for seqlen in args.seqlens:
                batch = max(1, args.tokens // seqlen)
                g = torch.Generator(device=dev).manual_seed(0)
                shape_q = (batch, seqlen, args.heads, head_dim)
                shape_k = (batch, seqlen, args.kv_heads, head_dim)
                try:
                    q = torch.randn(shape_q, device=dev, dtype=dtype, generator=g)
                    k = torch.randn(shape_k, device=dev, dtype=dtype, generator=g)
                    v = torch.randn(shape_k, device=dev, dtype=dtype, generator=g)
                    dout = torch.randn(shape_q, device=dev, dtype=dtype, generator=g)
                    if not checked:
                        err = _check_against_reference(q, k, v, causal, dtype)
                        logger.warning("reference check d=%d causal=%s s=%d: max err %.2e", head_dim, causal,
                                       seqlen, err)
                        checked = True
                except torch.cuda.OutOfMemoryError:
                    logger.warning("OOM allocating s=%d d=%d; skipped", seqlen, head_dim)
                    continue
                for provider in providers:
                    try:
                        fns = _make_fns(provider, q, k, v, dout, causal)
                        used = ndp_kernels_used(provider, q) if provider in NDP_PROVIDERS else None
                    except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
                        logger.warning("%s s=%d d=%d causal=%s failed: %s", provider, seqlen, head_dim, causal, e)
                        continue
                    for mode, fn in zip(("fwd", "bwd", "fwd+bwd"), fns[:3]):
                        if mode not in args.modes:
                            continue
                        try:
                            ms50, ms20, ms80 = do_bench(fn, quantiles=[0.5, 0.2, 0.8], grad_to_none=fns[3])
                        except torch.cuda.OutOfMemoryError:
                            logger.warning("%s %s OOM at s=%d d=%d", provider, mode, seqlen, head_dim)
                            continue
                        flops = attn_flops(batch, args.heads, seqlen, seqlen, head_dim, causal, mode)
                        row = dict(info, provider=provider, mode=mode, batch=batch, seqlen=seqlen,
                                   heads=args.heads, kv_heads=args.kv_heads, head_dim=head_dim,
                                   causal=causal, dtype=args.dtype, ms_p50=ms50, ms_p20=ms20, ms_p80=ms80,
                                   tflops_p50=flops / ms50 * 1e-9, tflops_p20=flops / ms80 * 1e-9,
                                   tflops_p80=flops / ms20 * 1e-9, kernels=used or "")
                        rows.append(row)
                        print(f"{provider:10s} {mode:7s} d={head_dim:3d} causal={causal!s:5s} b={batch:3d} "
                              f"s={seqlen:6d}: {row['tflops_p50']:7.1f} TFLOP/s "
                              f"[{row['tflops_p20']:.1f}, {row['tflops_p80']:.1f}] ({ms50:.3f} ms)", flush=True)
                del q, k, v, dout
                torch.cuda.empty_cache()
    return rows


def ratio_table(rows) -> list[dict]:
    """Per (mode, head_dim, causal, seqlen): ndp's TFLOP/s over the best other provider's (the judge of the
    kernel work: 1.0 means as fast as the fastest alternative measured in the same run)."""
    out = []
    keys = sorted({(r["mode"], r["head_dim"], r["causal"], r["seqlen"]) for r in rows}, key=str)
    for key in keys:
        same = [r for r in rows if (r["mode"], r["head_dim"], r["causal"], r["seqlen"]) == key]
        mine = [r for r in same if r["provider"] == "ndp"]
        others = [r for r in same if not r["provider"].startswith("ndp")]
        if not mine or not others:
            continue
        best = max(others, key=lambda r: r["tflops_p50"])
        out.append(dict(mode=key[0], head_dim=key[1], causal=key[2], seqlen=key[3], ndp=mine[0]["tflops_p50"],
                        best_other=best["provider"], best_other_tflops=best["tflops_p50"],
                        ratio=mine[0]["tflops_p50"] / best["tflops_p50"]))
    return out


def plot(rows, path) -> bool:
    """TFLOP/s vs seqlen per (mode, head_dim, causal), one line per provider. False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib not installed; no plot (pip install ndp[bench])")
        return False
    panels = sorted({(r["mode"], r["head_dim"], r["causal"]) for r in rows}, key=str)
    if not panels:
        return False
    ncol = min(4, len(panels))
    nrow = math.ceil(len(panels) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.5 * ncol, 3.5 * nrow), squeeze=False)
    for ax, (mode, d, causal) in zip(axes.flat, panels):
        for prov in sorted({r["provider"] for r in rows}):
            pts = sorted((r["seqlen"], r["tflops_p50"], r["tflops_p20"], r["tflops_p80"]) for r in rows
                         if (r["mode"], r["head_dim"], r["causal"], r["provider"]) == (mode, d, causal, prov))
            if pts:
                xs, ys, lo, hi = zip(*pts)
                yerr = [[max(0.0, y - a) for y, a in zip(ys, lo)], [max(0.0, b - y) for y, b in zip(ys, hi)]]
                ax.errorbar(xs, ys, yerr=yerr, marker="o", label=prov, capsize=2)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{mode} d={d} {'causal' if causal else 'full'}")
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"{rows[0].get('gpu', 'cpu')} {rows[0]['dtype']} heads {rows[0]['heads']}:{rows[0]['kv_heads']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_results(rows, out_dir, stem):
    os.makedirs(out_dir, exist_ok=True)
    jpath = os.path.join(out_dir, f"{stem}.json")
    with open(jpath, "w") as f:
        json.dump(rows, f, indent=1)
    if rows:
        cpath = os.path.join(out_dir, f"{stem}.csv")
        with open(cpath, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)
    ppath = os.path.join(out_dir, f"{stem}.png")
    made = plot(rows, ppath) if rows and "tflops_p50" in rows[0] else False
    print(f"results: {jpath}" + (f", {ppath}" if made else ""))


# ------------------------------------------------------------------------------------------------
# CPU smoke mode
# ------------------------------------------------------------------------------------------------

def static_report(timeout=900) -> tuple[int, str]:
    """Markdown static report from `python -m ndp_kernels.aot` (run without the interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-m", "ndp_kernels.aot", "--markdown"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + (proc.stderr[-2000:] if proc.returncode else "")


def run_smoke(args) -> list[dict]:
    """Tiny shapes under the Triton interpreter: correctness vs the reference and wall time."""
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import (smoke mode only)
    import torch
    import ndp_kernels
    from ndp_kernels import reference

    info = _env_info() | {"gpu": "none (cpu smoke, TRITON_INTERPRET=1)"}
    rows = []
    # fp16: the interpreter's bf16 dot is broken (docs/design.md, "Facts the code relies on"), so the smoke run checks fp16.
    dtype = torch.float16
    heads, kv_heads, head_dim = 4, 1, 64  # GQA 4:1 like 32:8
    for causal in (True, False):
        for seqlen in (64, 128):
            g = torch.Generator().manual_seed(0)
            q = torch.randn(1, seqlen, heads, head_dim, generator=g).to(dtype)
            k = torch.randn(1, seqlen, kv_heads, head_dim, generator=g).to(dtype)
            v = torch.randn(1, seqlen, kv_heads, head_dim, generator=g).to(dtype)
            dout = torch.randn(1, seqlen, heads, head_dim, generator=g).to(dtype)
            t0 = time.perf_counter()
            out, lse = ndp_kernels.flash_attn_fwd(q, k, v, causal=causal)
            t1 = time.perf_counter()
            ref_out = reference.flash_attn_fwd_ref(q.float(), k.float(), v.float(), causal=causal)[0]
            ref_grads = reference.flash_attn_bwd_ref(dout.float(), q.float(), k.float(), v.float(),
                                                     out.float(), lse, causal=causal)
            err_out = (out.float() - ref_out).abs().max().item()
            for provider, det in (("ndp", False), ("ndp_split", True)):
                t2 = time.perf_counter()
                grads = ndp_kernels.flash_attn_bwd(dout, q, k, v, out, lse, causal=causal, deterministic=det)
                t3 = time.perf_counter()
                err_grad = max((a.float() - b).abs().max().item() for a, b in zip(grads, ref_grads))
                ok = err_out <= 2e-3 + 1e-3 * ref_out.abs().max().item() and err_grad <= 2e-2
                rows.append(dict(info, provider=provider, mode="fwd+bwd", batch=1, seqlen=seqlen, heads=heads,
                                 kv_heads=kv_heads, head_dim=head_dim, causal=causal, dtype="fp16",
                                 fwd_s=t1 - t0, bwd_s=t3 - t2, max_err_out=err_out, max_err_grad=err_grad,
                                 ok=ok))
                print(f"smoke {provider:9s} s={seqlen:4d} causal={causal!s:5s}: fwd {t1 - t0:.2f}s bwd "
                      f"{t3 - t2:.2f}s, max err out {err_out:.2e} grads {err_grad:.2e} -> "
                      f"{'ok' if ok else 'MISMATCH'}")
                if not ok:
                    raise SystemExit("smoke mode: the Triton kernels disagree with the reference")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="ndp kernel benchmark (TFLOP/s) with a CPU smoke mode")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--seqlens", default="1024,2048,4096,8192,16384,32768,65536")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--modes", default="fwd,bwd,fwd+bwd")
    p.add_argument("--providers",
                   default="ndp,ndp_atomic,ndp_split,ndp_tma,torch_sdpa,sdpa_cudnn,sdpa_flash,flash_attn")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16384, help="batch = tokens // seqlen (at least 1)")
    p.add_argument("--smoke", action="store_true", help="force the CPU smoke mode")
    p.add_argument("--no-static-report", action="store_true", help="smoke mode: skip the AOT report")
    args = p.parse_args(argv)
    args.seqlens = [int(x) for x in args.seqlens.split(",") if x]
    args.head_dims = [int(x) for x in args.head_dims.split(",") if x]
    args.modes = args.modes.split(",")
    args.providers = args.providers.split(",")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    import torch
    if torch.cuda.is_available() and not args.smoke:
        rows = run_gpu(args)
        name = torch.cuda.get_device_name().replace(" ", "_")
        write_results(rows, args.out, f"kernels_{name}_{args.dtype}")
        ratios = ratio_table(rows)
        if ratios:
            print("\nndp / best other provider (TFLOP/s p50, same run):")
            print(f"{'mode':8s} {'d':>4s} {'mask':7s} {'seqlen':>7s} {'ndp':>8s} {'best other':>22s} {'ratio':>6s}")
            for r in ratios:
                print(f"{r['mode']:8s} {r['head_dim']:4d} {'causal' if r['causal'] else 'full':7s} {r['seqlen']:7d} "
                      f"{r['ndp']:8.1f} {r['best_other'] + ' ' + format(r['best_other_tflops'], '.1f'):>22s} "
                      f"{r['ratio']:6.2f}")
            with open(os.path.join(args.out, f"kernels_{name}_{args.dtype}_ratios.json"), "w") as f:
                json.dump(ratios, f, indent=1)
        return 0
    print("No CUDA device: running the CPU smoke mode (tiny shapes, Triton interpreter, reference check). "
          "TFLOP/s numbers need a GPU.")
    rows = run_smoke(args)
    write_results(rows, args.out, "kernels_smoke")
    if not args.no_static_report:
        rc, text = static_report()
        print("\nStatic report (python -m ndp_kernels.aot --markdown):\n")
        print(text)
        if rc:
            print("static report has violations", file=sys.stderr)
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
