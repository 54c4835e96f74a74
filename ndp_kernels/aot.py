"""Ahead-of-time compilation of every Triton kernel for sm_80 and sm_90, with a static resource report.

No GPU is needed: ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cap, 32))`` produces PTX and
a cubin, and the ``cuobjdump`` inside the triton wheel reads the cubin's resource use. A kernel
configuration passes when it has no register spills (``STACK == LOCAL == 0``), its shared memory
(static + dynamic) fits the SM (227 KB on sm_90, 163 KB on sm_80), and on sm_90 the attention
kernels' PTX uses ``wgmma`` (Hopper tensor-core instructions; ``WGMMA_EXEMPT`` lists the variants
that run mma.sync by design, and why), and the TMA variants' PTX loads K/V by TMA (``cp.async.bulk.tensor``).

    python -m ndp_kernels.aot --markdown          # report table; exit status 1 on a violation
    python -m ndp_kernels.aot --head-dims 64,80,128,256 --json report.json

Must run WITHOUT ``TRITON_INTERPRET`` (the interpreter replaces ``@triton.jit`` functions).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time

from . import interpreter_active

logger = logging.getLogger(__name__)

SMEM_LIMIT = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}
CAPABILITY = {"sm_80": 80, "sm_90": 90}
DTYPES = {"fp16": "fp16", "bf16": "bf16", "fp32": "fp32"}
DEFAULT_HEAD_DIMS = (64, 80, 128, 256)
DEFAULT_DTYPES = ("bf16", "fp16", "fp32")
DEFAULT_KERNELS = ("fwd", "fwd_acc", "fwd_tma", "bwd_preprocess", "bwd", "bwd_heads", "bwd_dkdv", "bwd_dkdv_heads",
                   "bwd_dq", "bwd_dq_tma", "merge", "fwd_softcap", "bwd_dkdv_softcap", "bwd_dq_softcap",
                   "ce_stats", "ce_grad", "ce_grad_softcap")
# The fused cross-entropy's row kernels (cross_entropy.py): fp32 logits whatever the model's dtype, no head_dim;
# compiled once per arch (reported at the first head_dim).
CE_KERNELS = ("ce_stats", "ce_grad", "ce_grad_softcap")
# Kernels whose 16-bit sm_90 PTX must use wgmma (the attention kernels with tensor-core dots).
WGMMA_KERNELS = ("fwd", "fwd_acc", "fwd_tma", "bwd", "bwd_heads", "bwd_dkdv", "bwd_dkdv_heads", "bwd_dq",
                 "bwd_dq_tma", "fwd_softcap", "bwd_dkdv_softcap", "bwd_dq_softcap")
# The attention kernels with logit soft-capping (SOFTCAP: a tanh per score, and its derivative in the backward;
# soft-capped gradients always take the split backward, with configs.with_softcap's tiles).
SOFTCAP_SUFFIX = "_softcap"
# The key-block backward kernels with a GQA group's query heads split over programs (HEAD_SPLITS, here 4 parts;
# configs.head_splits): what runs where the grid is small against the GPU, fp16/bf16 only.
HEADS_KERNELS = ("bwd_heads", "bwd_dkdv_heads")
HEADS_SPLITS = 4
# The forward and dQ kernels with K/V by TMA (KernelConfig.tma): sm_90, 16-bit only (the launchers take pointer
# loads elsewhere); their PTX must hold TMA loads.
TMA_KERNELS = ("fwd_tma", "bwd_dq_tma")
TMA_PTX = "cp.async.bulk.tensor"
# (kernel, head_dim bucket) that run mma.sync on sm_90 by design, with the reason (configs.py):
# the split dK/dV kernel at head_dim 256 spills with any key block of 64 rows, so it takes 16.
WGMMA_EXEMPT = {("bwd_dkdv", 256): "dk+dv of a 64-row key block at head_dim 256 spill registers",
                ("bwd_dkdv_heads", 256): "as bwd_dkdv", ("bwd_dkdv_softcap", 256): "as bwd_dkdv"}
WGMMA_EXEMPT_MARK = "no (by design)"


@dataclasses.dataclass
class Row:
    """One compiled kernel and its resource use."""
    kernel: str
    arch: str
    dtype: str
    head_dim: int
    config: str
    reg: int = -1
    stack: int = -1
    local: int = -1
    shared: int = -1
    wgmma: str = "n/a"
    tma: str = "n/a"
    seconds: float = 0.0
    error: str = ""

    @property
    def violations(self) -> list[str]:
        v = []
        if self.error:
            return [f"compile error: {self.error}"]
        if self.stack or self.local:
            v.append(f"spills (STACK={self.stack}, LOCAL={self.local})")
        if self.shared > SMEM_LIMIT[self.arch]:
            v.append(f"shared memory {self.shared} B > {SMEM_LIMIT[self.arch]} B")
        if self.wgmma == "no":
            v.append("sm_90 PTX has no wgmma")
        if self.tma == "no":
            v.append(f"PTX has no TMA load ({TMA_PTX})")
        return v


def applies(kernel: str, arch: str, dtype: str, head_dim: int) -> bool:
    """Whether the launchers ever run this variant: a TMA kernel only on sm_90 and where
    ``configs.tma_applies`` (fp16/bf16; the dQ kernel up to head_dim 128, at 256 it spills); split GQA heads
    where ``configs.HEAD_SPLIT_DTYPES`` allows (fp16/bf16)."""
    from .configs import HEAD_SPLIT_DTYPES, tma_applies

    if kernel in CE_KERNELS:
        return dtype == "fp32" and head_dim == DEFAULT_HEAD_DIMS[0]
    if kernel in HEADS_KERNELS:
        return _torch_dtype(dtype) in HEAD_SPLIT_DTYPES
    if kernel not in TMA_KERNELS:
        return True

    return arch == "sm_90" and tma_applies(kernel.removesuffix("_tma"), _torch_dtype(dtype), head_dim)


def _torch_dtype(dtype: str):
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]


def _cuobjdump() -> str:
    import triton
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(path):
        raise RuntimeError(f"cuobjdump not found at {path}; the triton wheel should ship it "
                           f"(reinstall triton)")
    return path


def resource_usage(cubin: bytes) -> dict:
    """REG/STACK/LOCAL/SHARED of the (single) kernel in ``cubin`` via ``cuobjdump --dump-resource-usage``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name], check=True,
                              capture_output=True, text=True).stdout
    res = {}
    for key in ("REG", "STACK", "SHARED", "LOCAL"):
        m = re.search(rf"\b{key}:(\d+)", text)
        if m is None:
            raise RuntimeError(f"cannot read {key} from cuobjdump output:\n{text}")
        res[key] = int(m.group(1))
    return res


@dataclasses.dataclass(frozen=True)
class _Variant:
    """One (dtype, head_dim, arch) the kernels are compiled for, and what their signatures derive from it."""
    dtype: str
    head_dim: int
    arch: str

    @property
    def ptr(self) -> str:
        return f"*{self.dtype}"

    @property
    def bd(self) -> int:
        from .configs import block_d

        return block_d(self.head_dim)

    @property
    def prec(self) -> str:
        # As the launchers: fp32 dots in IEEE precision (FMA, no tensor cores), 16-bit ones on tensor cores.
        return "ieee" if self.dtype == "fp32" else "tf32"

    @property
    def torch_dtype(self):
        return _torch_dtype(self.dtype)


def _build(fn, args, constexprs, cfg):
    """(fn, signature in argument order, constexprs, divisibility attrs, cfg) from `args` [(name, type[:16])]."""
    sig, attrs = {}, {}
    names = fn.arg_names
    if "SOFTCAP" in names:  # the plain variant; the _softcap kernels set it
        constexprs = {"SOFTCAP": False, **constexprs}
    for name in names:
        if name in constexprs:
            sig[name] = "constexpr"
    for name, ty in args:
        hint = None
        if ty.endswith(":16"):
            ty, hint = ty[:-3], 16
        sig[name] = ty
        if hint:
            attrs[(names.index(name),)] = [["tt.divisibility", 16]]
    missing = [n for n in names if n not in sig]
    assert not missing, f"signature of {fn.__name__} misses {missing}"
    return fn, {n: sig[n] for n in names}, constexprs, attrs, cfg


def _strides(prefix, dims):
    return [(f"stride_{prefix}_{d}", "i32:16") for d in dims]


def _spec(kernel: str, dtype: str, head_dim: int, arch: str):
    """(jit fn, signature, constexprs, attrs, KernelConfig) of one kernel variant.

    Hints mirror what the JIT specializes at run time on contiguous tensors: pointers and the
    strides of [B, S, H, D] tensors are multiples of 16, the lse/delta sequence stride is 1.
    """
    from . import cross_entropy
    from .configs import KernelConfig, with_softcap

    if kernel in CE_KERNELS:
        return _ce_spec(kernel, cross_entropy, KernelConfig(1, cross_entropy.BLOCK_V, cross_entropy.NUM_WARPS, 1))
    if kernel.endswith(SOFTCAP_SUFFIX):
        base = kernel.removesuffix(SOFTCAP_SUFFIX)
        fn, sig, consts, attrs, cfg = _spec(base, dtype, head_dim, arch)
        cfg = with_softcap(base, cfg, head_dim)
        return fn, sig, {**consts, "SOFTCAP": True, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n}, attrs, cfg
    v = _Variant(dtype, head_dim, arch)
    for kernels, spec in ((("fwd", "fwd_acc", "fwd_tma"), _fwd_spec), (("bwd", "bwd_heads"), _bwd_spec),
                          (("bwd_dkdv", "bwd_dkdv_heads", "bwd_dq", "bwd_dq_tma"), _split_bwd_spec),
                          (("bwd_preprocess",), _preprocess_spec), (("merge",), _merge_spec)):
        if kernel in kernels:
            return spec(kernel, v)
    raise ValueError(f"unknown kernel {kernel!r}; choose from {DEFAULT_KERNELS}")


def _fwd_spec(kernel, v: _Variant):
    from . import flash
    from .configs import fwd_config

    cfg = fwd_config(v.arch, v.head_dim, dtype=v.torch_dtype)
    acc = kernel == "fwd_acc"
    tma = kernel == "fwd_tma"
    if tma:  # the static forward tiles with K/V by TMA: what the tuner's first TMA candidate runs
        cfg = dataclasses.replace(cfg, tma=True)
    kv = f"tensordesc<{v.dtype}[1,{cfg.block_n},1,{v.bd}]>" if tma else v.ptr + ":16"
    args = [("q_ptr", v.ptr + ":16"), ("k_ptr", kv), ("v_ptr", kv),
            ("out_ptr", ("*fp32" if acc else v.ptr) + ":16"), ("lse_ptr", "*fp32:16"),
            ("seg_ptr", "*i32:16"), ("qk_scale", "fp32"), ("cap_in", "fp32"), ("num_segments", "i32"),
            ("group_size", "i32")]
    for p in ("q", "k", "v", "o"):
        args += _strides(p, ("b", "s", "h"))
    args += [("stride_lse_b", "i32:16"), ("stride_lse_h", "i32:16")]
    consts = dict(stride_lse_s=1, HEAD_DIM=v.head_dim, BLOCK_D=v.bd, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, ACCUMULATE=acc, DOT_PRECISION=v.prec, USE_TMA=tma)
    return _build(flash._flash_fwd_kernel, args, consts, cfg)


def _bwd_spec(kernel, v: _Variant):
    from . import flash
    from .configs import bwd_config

    cfg = bwd_config(v.arch, v.head_dim, dtype=v.torch_dtype)
    ptr = v.ptr
    args = [("q_ptr", ptr + ":16"), ("k_ptr", ptr + ":16"), ("v_ptr", ptr + ":16"),
            ("dout_ptr", ptr + ":16"), ("lse_ptr", "*fp32:16"), ("delta_ptr", "*fp32:16"),
            ("seg_ptr", "*i32:16"), ("dq_ptr", "*fp32:16"), ("dk_ptr", "*fp32:16"),
            ("dv_ptr", "*fp32:16"), ("softmax_scale", "fp32"), ("qk_scale", "fp32"), ("cap_in", "fp32"),
            ("num_segments", "i32"), ("group_size", "i32")]
    for p in ("q", "k", "v", "do"):
        args += _strides(p, ("b", "s", "h"))
    args += [("stride_lse_b", "i32:16"), ("stride_lse_h", "i32:16"),
             ("stride_delta_b", "i32:16"), ("stride_delta_h", "i32:16")]
    for p in ("dq", "dk", "dv"):
        args += _strides(p, ("b", "s", "h"))
    # ATOMIC_KV=True is the context-parallel case (segments share keys) and the heavier variant.
    consts = dict(stride_lse_s=1, HEAD_DIM=v.head_dim, BLOCK_D=v.bd, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, ATOMIC_KV=True, DOT_PRECISION=v.prec,
                  HEAD_SPLITS=HEADS_SPLITS if kernel in HEADS_KERNELS else 1)
    return _build(flash._flash_bwd_kernel, args, consts, cfg)


def _split_bwd_spec(kernel, v: _Variant):
    from . import flash
    from .configs import bwd_dkdv_config, bwd_dq_config

    dkdv = kernel.startswith("bwd_dkdv")
    tma = kernel == "bwd_dq_tma"
    cfg = (bwd_dkdv_config if dkdv else bwd_dq_config)(v.arch, v.head_dim, dtype=v.torch_dtype)
    if tma:
        cfg = dataclasses.replace(cfg, tma=True)
    kv = f"tensordesc<{v.dtype}[1,{cfg.block_n},1,{v.bd}]>" if tma else v.ptr + ":16"
    args = [("q_ptr", v.ptr + ":16"), ("k_ptr", kv), ("v_ptr", kv),
            ("dout_ptr", v.ptr + ":16"), ("lse_ptr", "*fp32:16"), ("delta_ptr", "*fp32:16"),
            ("seg_ptr", "*i32:16")]
    args += ([("dk_ptr", "*fp32:16"), ("dv_ptr", "*fp32:16")] if dkdv else [("dq_ptr", "*fp32:16")])
    args += [("softmax_scale", "fp32"), ("qk_scale", "fp32"), ("cap_in", "fp32"), ("num_segments", "i32"),
             ("group_size", "i32")]
    if dkdv:  # per-part dK/dV buffers (GQA heads split over programs) are stacked along the batch
        args += [("batch", "i32")]
    for p in ("q", "k", "v", "do"):
        args += _strides(p, ("b", "s", "h"))
    args += [("stride_lse_b", "i32:16"), ("stride_lse_h", "i32:16"),
             ("stride_delta_b", "i32:16"), ("stride_delta_h", "i32:16")]
    for p in (("dk", "dv") if dkdv else ("dq",)):
        args += _strides(p, ("b", "s", "h"))
    consts = dict(stride_lse_s=1, HEAD_DIM=v.head_dim, BLOCK_D=v.bd, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, DOT_PRECISION=v.prec)
    if dkdv:
        consts["HEAD_SPLITS"] = HEADS_SPLITS if kernel in HEADS_KERNELS else 1
    else:
        consts["USE_TMA"] = tma
    fn = flash._flash_bwd_dkdv_kernel if dkdv else flash._flash_bwd_dq_kernel
    return _build(fn, args, consts, cfg)


def _preprocess_spec(kernel, v: _Variant):
    from . import flash
    from .configs import merge_config

    cfg = merge_config(v.arch, v.head_dim)
    args = [("out_ptr", v.ptr + ":16"), ("dout_ptr", v.ptr + ":16"), ("delta_ptr", "*fp32:16"), ("seqlen", "i32")]
    args += _strides("o", ("b", "s", "h")) + _strides("do", ("b", "s", "h"))
    args += [("stride_delta_b", "i32:16"), ("stride_delta_h", "i32:16")]
    consts = dict(HEAD_DIM=v.head_dim, BLOCK_D=v.bd, BLOCK_M=cfg.block_m)
    return _build(flash._flash_bwd_preprocess_kernel, args, consts, cfg)


def _merge_spec(kernel, v: _Variant):
    from . import merge
    from .configs import merge_config

    cfg = merge_config(v.arch, v.head_dim)
    args = [("out_acc_ptr", "*fp32:16"), ("lse_acc_ptr", "*fp32:16"), ("blk_ptr", v.ptr + ":16"),
            ("blk_lse_ptr", "*fp32:16"), ("seqlen", "i32")]
    args += _strides("oa", ("b", "s", "h")) + [("stride_la_b", "i32:16"), ("stride_la_h", "i32:16")]
    args += _strides("ob", ("b", "s", "h")) + [("stride_lb_b", "i32:16"), ("stride_lb_h", "i32:16")]
    consts = dict(stride_la_s=1, stride_lb_s=1, HEAD_DIM=v.head_dim, BLOCK_D=v.bd, BLOCK_M=cfg.block_m)
    return _build(merge._merge_attn_states_kernel, args, consts, cfg)


def _ce_spec(kernel, cross_entropy, cfg):
    """(jit fn, signature, constexprs, attrs, cfg) of a cross-entropy row kernel: fp32 logits, int64 targets."""
    if kernel == "ce_stats":
        fn, consts = cross_entropy._ce_stats_kernel, {"BLOCK_V": cfg.block_n}
        args = {"z_ptr": "*fp32", "target_ptr": "*i64", "stats_ptr": "*fp32", "n_rows": "i32", "vocab": "i32",
                "stride_z": "i32"}
    else:
        fn, consts = cross_entropy._ce_grad_kernel, {"BLOCK_V": cfg.block_n, "SOFTCAP": kernel.endswith("softcap")}
        args = {"z_ptr": "*fp32", "target_ptr": "*i64", "lse_ptr": "*fp32", "coef_ptr": "*fp32",
                "scale_row_ptr": "*fp32", "vocab": "i32", "stride_z": "i32", "target_coef": "fp32",
                "smooth_per_col": "fp32", "softcap": "fp32", "scale": "fp32"}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in args if n.endswith("_ptr")}
    sig = {n: ("constexpr" if n in consts else args[n]) for n in fn.arg_names}
    return fn, sig, consts, attrs, cfg


def compile_one(kernel: str, arch: str, dtype: str, head_dim: int) -> Row:
    """Compile one kernel variant for ``arch`` and read its resource use."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import triton

    from .configs import kernel_bucket

    fn, sig, consts, attrs, cfg = _spec(kernel, dtype, head_dim, arch)
    row = Row(kernel, arch, dtype, head_dim, str(cfg))
    t0 = time.perf_counter()
    try:
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", CAPABILITY[arch], 32),
                           options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        res = resource_usage(k.asm["cubin"])
        row.reg, row.stack, row.local = res["REG"], res["STACK"], res["LOCAL"]
        row.shared = res["SHARED"] + int(k.metadata.shared)
        if arch == "sm_90" and kernel in WGMMA_KERNELS and dtype != "fp32":
            row.wgmma = "yes" if "wgmma" in k.asm["ptx"] else "no"
            if row.wgmma == "no" and (kernel, kernel_bucket(head_dim)) in WGMMA_EXEMPT:
                row.wgmma = WGMMA_EXEMPT_MARK
        if kernel in TMA_KERNELS:
            row.tma = "yes" if TMA_PTX in k.asm["ptx"] else "no"
    except Exception as e:  # reported as a violation row; the report keeps going
        row.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    row.seconds = time.perf_counter() - t0
    return row


def _compile_star(args) -> Row:
    return compile_one(*args)


def run(kernels=DEFAULT_KERNELS, archs=("sm_80", "sm_90"), dtypes=DEFAULT_DTYPES,
        head_dims=DEFAULT_HEAD_DIMS, jobs: int = 1) -> list[Row]:
    """Compile every (kernel, arch, dtype, head_dim) combination; returns the report rows in that order.

    ``jobs > 1`` compiles in that many worker processes (compilation is CPU bound and single threaded).
    """
    if interpreter_active():
        raise RuntimeError("ahead-of-time compilation needs the real Triton compiler; unset "
                           "TRITON_INTERPRET (run `python -m ndp_kernels.aot` in a clean environment)")
    todo = [(kernel, arch, dtype, hd) for kernel in kernels for arch in archs for dtype in dtypes
            for hd in head_dims if applies(kernel, arch, dtype, hd)]
    if jobs <= 1:
        return [compile_one(*t) for t in todo]
    import concurrent.futures
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter per worker: no inherited state
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        return list(pool.map(_compile_star, todo))


def markdown(rows: list[Row]) -> str:
    """The static report as a markdown table."""
    lines = ["| kernel | arch | dtype | head_dim | config | REG | STACK | LOCAL | SHARED (B) | wgmma | ok |",
             "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        ok = "yes" if not r.violations else "NO: " + "; ".join(r.violations)
        lines.append(f"| {r.kernel} | {r.arch} | {r.dtype} | {r.head_dim} | {r.config} | {r.reg} | "
                     f"{r.stack} | {r.local} | {r.shared} | {r.wgmma} | {ok} |")
    return "\n".join(lines)


def _csv_list(text, cast=str):
    return tuple(cast(x) for x in text.split(",") if x)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--markdown", action="store_true", help="print the report as a markdown table")
    p.add_argument("--json", help="write the rows as JSON to this file")
    p.add_argument("--kernels", type=_csv_list, default=DEFAULT_KERNELS)
    p.add_argument("--archs", type=_csv_list, default=("sm_80", "sm_90"))
    p.add_argument("--dtypes", type=_csv_list, default=DEFAULT_DTYPES)
    p.add_argument("--head-dims", type=lambda t: _csv_list(t, int), default=DEFAULT_HEAD_DIMS)
    p.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    args = p.parse_args(argv)
    for a in args.archs:
        if a not in CAPABILITY:
            p.error(f"unknown arch {a!r}; choose from {sorted(CAPABILITY)}")
    for d in args.dtypes:
        if d not in DTYPES:
            p.error(f"unknown dtype {d!r}; choose from {sorted(DTYPES)}")
    logging.basicConfig(level=logging.WARNING)
    t0 = time.perf_counter()
    try:
        rows = run(args.kernels, args.archs, args.dtypes, args.head_dims, jobs=args.jobs)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.markdown:
        print(markdown(rows))
    else:
        for r in rows:
            print(f"{r.kernel:15s} {r.arch} {r.dtype} d={r.head_dim:<3d} {r.config:18s} REG={r.reg:<4d} "
                  f"STACK={r.stack} LOCAL={r.local} SHARED={r.shared:<6d} wgmma={r.wgmma:3s} "
                  f"{'ok' if not r.violations else 'VIOLATION: ' + '; '.join(r.violations)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) | {"violations": r.violations} for r in rows], f, indent=1)
    bad = [r for r in rows if r.violations]
    print(f"\n{len(rows)} kernels compiled in {time.perf_counter() - t0:.0f} s; "
          f"{len(bad)} violation(s)", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
