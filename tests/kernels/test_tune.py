"""Kernel tuning: the tuner checks every candidate against the reference before timing it and keeps the
fastest that passes; configs.py reads a tuned table before its static tables; without a GPU the command
says so and exits 2."""
import json
import subprocess
import sys

import pytest
import torch

import ndp_kernels
from ndp_kernels import configs, reference
from ndp_kernels.configs import KernelConfig

pytest.importorskip("triton")
needs_interp = pytest.mark.skipif(not ndp_kernels.interpreter_active(), reason="runs kernels under TRITON_INTERPRET=1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_cli_without_gpu_says_so_and_exits_2():
    r = subprocess.run([sys.executable, "-m", "ndp_kernels.tune"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no CUDA device is visible" in r.stderr


@needs_interp
def test_tune_kind_keeps_the_fastest_candidate_that_passes_its_check():
    from ndp_kernels import tune

    good, bad = KernelConfig(32, 32, 4, 1), KernelConfig(48, 32, 4, 1)  # 48: not a power of two, cannot compile
    row = tune.tune_kind("fwd", torch.float32, 16, torch.device("cpu"), seqlen=64, batch=1, heads=2, kv_heads=2,
                         cands=[bad, good], log=lambda *_: None)
    assert row["config"] == [32, 32, 4, 1] and row["ms"] > 0
    assert row["candidates"][str(bad)] == "failed to launch"
    ok, err = tune.check_candidate("bwd_dq", KernelConfig(32, 32, 4, 1), torch.float32, 16, torch.device("cpu"),
                                   s=48, fixed={"bwd_dkdv": KernelConfig(32, 32, 4, 1)})
    assert ok and err < 1e-4


@needs_interp
def test_configs_read_the_tuned_table_first(tmp_path, monkeypatch):
    monkeypatch.setenv("NDP_TUNING_DIR", str(tmp_path))
    cpu = torch.device("cpu")
    (tmp_path / "kernels-cpu.json").write_text(json.dumps({"rows": {
        "fwd/interpreter/64/float32": {"config": [16, 32, 4, 1], "ms": 1.0},
        "bwd_impl/interpreter/64/float32": {"impl": "split", "ms": {"atomic": 2.0, "split": 1.0}}}}))
    try:
        configs.tuned_table(cpu, reload=True)
        assert configs.fwd_config("interpreter", 32, cpu, torch.float32) == KernelConfig(16, 32, 4, 1)
        assert configs.fwd_config("interpreter", 32, None, torch.float32) == configs._FWD[("interpreter", 64)]
        assert configs.bwd_impl("interpreter", 32, torch.float32, device=cpu) == "split"
        assert configs.bwd_impl("interpreter", 32, torch.float16, device=cpu) == "atomic"  # no row: static
        with configs.override("fwd", KernelConfig(64, 16, 4, 1)):
            assert configs.fwd_config("interpreter", 32, cpu, torch.float32) == KernelConfig(64, 16, 4, 1)
        # the kernels launched with the tuned tiles still match the reference
        g = torch.Generator().manual_seed(0)
        q, k, v, do = (torch.randn(1, 37, 2, 32, generator=g) for _ in range(4))
        out, lse = ndp_kernels.flash_attn_fwd(q, k, v, causal=True)
        ro, rl = reference.flash_attn_fwd_ref(q, k, v, causal=True)
        torch.testing.assert_close(out, ro, atol=1e-5, rtol=1e-5)
        grads = ndp_kernels.flash_attn_bwd(do, q, k, v, ro, rl, causal=True)
        for a, b in zip(grads, reference.flash_attn_bwd_ref(do, q, k, v, ro, rl, causal=True)):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        (tmp_path / "kernels-cpu.json").write_text("[1, 2]")
        with pytest.raises(RuntimeError, match="malformed; delete it or re-run `python -m ndp_kernels.tune`"):
            configs.tuned_table(cpu, reload=True)
    finally:
        monkeypatch.delenv("NDP_TUNING_DIR")
        configs.tuned_table(cpu, reload=True)


@needs_interp
def test_tune_kind_always_times_the_shipped_config(monkeypatch):
    from ndp_kernels import configs, tune

    seen = []
    real = tune.check_candidate

    def only_two(kind, cfg, *a, **kw):  # time the shipped config and one grid config, refuse the rest quickly
        seen.append(cfg)
        if len(seen) > 2:
            return False, float("inf")
        return real(kind, cfg, *a, **kw)

    monkeypatch.setattr(tune, "check_candidate", only_two)
    row = tune.tune_kind("fwd", torch.float32, 16, torch.device("cpu"), seqlen=64, batch=1, heads=2, kv_heads=2,
                         quick=True, log=lambda *_: None)
    static = configs.static_config("fwd", "interpreter", 16, torch.float32)
    assert seen[0] == static and seen.count(static) == 1
    assert row["static"]["config"] == [static.block_m, static.block_n, static.num_warps, static.num_stages]
    assert row["static"]["ms"] > 0 and row["config"] is not None


def test_tma_candidates_only_for_the_kernels_that_walk_key_blocks():
    from ndp_kernels import tune

    plain = tune.candidates("fwd", quick=True)
    both = tune.candidates("fwd", quick=True, tma=True)
    assert not any(c.tma for c in plain) and len(both) == 2 * len(plain)
    assert [c for c in both if c.tma] == [KernelConfig(c.block_m, c.block_n, c.num_warps, c.num_stages, tma=True)
                                          for c in plain]
    assert len(tune.candidates("bwd_dq", quick=True, tma=True)) == 2 * len(tune.candidates("bwd_dq", quick=True))
    assert tune.candidates("bwd_dkdv", quick=True, tma=True) == tune.candidates("bwd_dkdv", quick=True)
    assert not tune._tma_here("fwd", torch.bfloat16, torch.device("cpu"), 128)     # no Hopper here
    assert not tune._tma_here("bwd", torch.bfloat16, torch.device("cpu"), 128)
