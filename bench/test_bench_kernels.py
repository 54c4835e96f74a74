"""pytest-benchmark timings of the Triton kernels (GPU only; skipped without CUDA).

    pytest bench/test_bench_kernels.py --benchmark-columns=median,iqr

Shapes follow bench_kernels.py (GQA 32:8, 16k tokens); the full TFLOP/s sweep is bench_kernels.py.
"""
import os
import sys

import pytest
import torch

pytest.importorskip("pytest_benchmark")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="kernel benchmarks need a CUDA device (and no TRITON_INTERPRET)")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _inputs(seqlen, head_dim, dtype=torch.bfloat16, heads=32, kv_heads=8, tokens=16384):
    b = max(1, tokens // seqlen)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, seqlen, heads, head_dim, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(b, seqlen, kv_heads, head_dim, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, seqlen, kv_heads, head_dim, device="cuda", dtype=dtype, generator=g)
    return q, k, v, torch.randn_like(q)


def _timed(benchmark, fn):
    def run():
        fn()
        torch.cuda.synchronize()
    fn()  # compile outside the timing
    torch.cuda.synchronize()
    benchmark.pedantic(run, rounds=20, warmup_rounds=3)


@pytest.mark.parametrize("seqlen", [4096, 16384])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_bench_fwd(benchmark, seqlen, head_dim, causal):
    import ndp_kernels
    q, k, v, _ = _inputs(seqlen, head_dim)
    _timed(benchmark, lambda: ndp_kernels.flash_attn_fwd(q, k, v, causal=causal))


@pytest.mark.parametrize("seqlen", [4096, 16384])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "split"])
def test_bench_bwd(benchmark, seqlen, head_dim, causal, deterministic):
    import ndp_kernels
    q, k, v, dout = _inputs(seqlen, head_dim)
    out, lse = ndp_kernels.flash_attn_fwd(q, k, v, causal=causal)
    _timed(benchmark, lambda: ndp_kernels.flash_attn_bwd(dout, q, k, v, out, lse, causal=causal,
                                                         deterministic=deterministic))


@pytest.mark.parametrize("seqlen", [4096])
def test_bench_fwd_accumulate_ring_step(benchmark, seqlen):
    # A ring step: the block result merged into fp32 accumulators in the kernel epilogue.
    import ndp_kernels
    q, k, v, _ = _inputs(seqlen, 128)
    out_acc = torch.zeros(q.shape, device="cuda", dtype=torch.float32)
    lse_acc = torch.full((q.shape[0], q.shape[2], seqlen), float("-inf"), device="cuda")
    _timed(benchmark, lambda: ndp_kernels.flash_attn_fwd(q, k, v, out_acc=out_acc, lse_acc=lse_acc))
