"""Ahead-of-time compile of every Triton kernel for sm_80 and sm_90 (no GPU needed).

Fails on register spills (STACK or LOCAL non-zero), shared memory over the SM limit, and sm_90
attention kernels without wgmma. Runs `python -m ndp_kernels.aot` in a subprocess because the
test session sets TRITON_INTERPRET=1, which replaces the compiler with the interpreter.
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.aot

WGMMA_KERNELS = ("fwd", "fwd_acc", "bwd", "bwd_heads", "bwd_dkdv", "bwd_dkdv_heads", "bwd_dq")
WGMMA_EXEMPT_MARK = "no (by design)"


def _run_aot(*args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return subprocess.run([sys.executable, "-m", "ndp_kernels.aot", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_aot_static_report_no_spills_fits_smem_uses_wgmma():
    proc = _run_aot("--markdown", "--jobs", "2")
    assert proc.returncode == 0, f"AOT report has violations:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    # 10 kernels (3 of them the soft-capped forward, dK/dV and dQ) x 2 archs x 3 dtypes (bf16, fp16, fp32) x 4 head
    # dims (64, 80, 128, 256), plus the TMA forward
    # (8) and the TMA dQ kernel (6: head_dim <= 128) on sm_90 in bf16 and fp16, and the two key-block backward
    # kernels with split GQA heads (2 x 2 archs x bf16, fp16 x 4 head dims), and the fused cross-entropy's three row
    # kernels (fp32, once per arch: 6); a TMA variant without TMA loads in its PTX is a violation (ok != "yes").
    assert len(rows) == 292, proc.stdout
    kernels = {line.split("|")[1].strip() for line in rows}
    assert {"bwd_dkdv", "bwd_dq", "fwd_tma", "bwd_dq_tma", "bwd_heads", "bwd_dkdv_heads", "fwd_softcap",
            "bwd_dkdv_softcap", "bwd_dq_softcap", "ce_stats", "ce_grad", "ce_grad_softcap"} <= kernels, kernels
    for name, count in (("fwd_tma", 8), ("bwd_dq_tma", 6)):
        tma = [r for r in rows if r.split("|")[1].strip() == name]
        assert len(tma) == count and all("| sm_90 |" in r and "/tma |" in r for r in tma), tma
    for name in ("bwd_heads", "bwd_dkdv_heads"):
        heads = [r for r in rows if r.split("|")[1].strip() == name]
        assert len(heads) == 16 and not any("| fp32 |" in r for r in heads), heads
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        kernel, arch, dtype, head_dim, _, reg, stack, local, shared, wgmma, ok = cells
        assert ok == "yes" and stack == "0" and local == "0", row
        assert 0 < int(reg) <= 255 and int(shared) <= (227 if arch == "sm_90" else 163) * 1024, row
        # fp32 runs IEEE dots on FMA units (no TF32), so only 16-bit kernels use wgmma.
        if arch == "sm_90" and kernel in WGMMA_KERNELS and dtype != "fp32":
            # The one exemption: the split dK/dV kernel at head_dim 256 (see aot.WGMMA_EXEMPT).
            exempt = kernel in ("bwd_dkdv", "bwd_dkdv_heads", "bwd_dkdv_softcap") and head_dim == "256"
            assert wgmma == (WGMMA_EXEMPT_MARK if exempt else "yes"), row


def test_aot_refuses_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "ndp_kernels.aot", "--kernels", "merge"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "needs the real Triton compiler" in proc.stderr
