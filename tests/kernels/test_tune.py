"""Kernel tuning: the tuner checks every candidate against the reference before timing it and keeps the
fastest that passes; configs.py reads a tuned table before its static tables; without a GPU the command
says so and exits 2."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ndp_kernels
from ndp_kernels import configs, reference, tuning
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
    assert not configs.tma_here("fwd", torch.bfloat16, torch.device("cpu"), 128)     # no Hopper here
    assert not configs.tma_here("bwd", torch.bfloat16, torch.device("cpu"), 128)


# --- the first-use probe: the choices the static tables leave unmeasured (TMA, atomic vs split backward) ---

CPU = torch.device("cpu")


@pytest.fixture
def probe_env(tmp_path, monkeypatch):
    """An empty tuning dir, probing allowed on CPU (the interpreter runs the kernels), a tiny probe block, and a
    timer that says the variant named by state["fast"] (split, atomic, tma: the forward or dQ kernel with TMA,
    plain: without) takes 1 ms and every other 3 ms."""
    from ndp_kernels import tune

    monkeypatch.setenv("NDP_TUNING_DIR", str(tmp_path))
    monkeypatch.setattr(configs, "AUTO_PROBE", ("cpu",))
    monkeypatch.setattr(tune, "PROBE_SHAPE", dict(seqlen=48, batch=1, heads=2, kv_heads=1))
    configs._PROBE_FAILED.clear()
    configs.tuned_table(CPU, reload=True)
    state = {"fast": "split", "calls": []}

    def fake_bench(fn, device):
        fn()
        walk = [configs._forced(kind) for kind in configs.TMA_KINDS if configs._forced(kind) is not None]
        fast = {"split": configs._forced("bwd_dq") is not None, "atomic": configs._forced("bwd") is not None,
                "tma": any(c.tma for c in walk), "plain": bool(walk) and not any(c.tma for c in walk)}[state["fast"]]
        return 1.0 if fast else 3.0

    real_probe = tune.probe

    def spy(part, *a, **kw):
        state["calls"].append(part)
        return real_probe(part, *a, **kw)

    monkeypatch.setattr(tune, "_bench", fake_bench)
    monkeypatch.setattr(tune, "probe", spy)
    state["table"] = tmp_path / "kernels-cpu.json"
    yield state
    monkeypatch.delenv("NDP_TUNING_DIR")
    configs._PROBE_FAILED.clear()
    configs.tuned_table(CPU, reload=True)


def _grads_match(q, k, v, do, **kw):
    ro, rl = reference.flash_attn_fwd_ref(q, k, v, causal=True)
    grads = ndp_kernels.flash_attn_bwd(do, q, k, v, ro, rl, causal=True, **kw)
    for a, b in zip(grads, reference.flash_attn_bwd_ref(do, q, k, v, ro, rl, causal=True)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def _qkvd(d=16, s=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, s, 2, d, generator=g) for _ in range(4)]


@needs_interp
@pytest.mark.parametrize("fast", ["split", "atomic"])
def test_first_backward_measures_which_backward_serves_it_once_and_saves_it(probe_env, monkeypatch, fast):
    from ndp_kernels import flash

    probe_env["fast"] = fast
    spies = {"atomic": [], "split": []}
    for impl in spies:
        real = getattr(flash, f"_bwd_{impl}")
        monkeypatch.setattr(flash, f"_bwd_{impl}",
                            lambda *a, _r=real, _n=impl, **kw: (spies[_n].append(1), _r(*a, **kw))[1])
    q, k, v, do = _qkvd()
    _grads_match(q, k, v, do)
    assert probe_env["calls"] == ["bwd"]
    row = configs.tuned_table(CPU)["bwd_impl/interpreter/64/float32"]
    assert row["impl"] == fast and row["probed"] and row["ms"] == {fast: 2.0, ({"split", "atomic"} - {fast}).pop(): 6.0}
    # both backwards ran while measuring; afterwards deterministic=False runs the faster one, without measuring
    n = {i: len(spies[i]) for i in spies}
    assert n["atomic"] and n["split"]
    _grads_match(q, k, v, do)
    assert probe_env["calls"] == ["bwd"]
    assert len(spies[fast]) == n[fast] + 1 and sum(map(len, spies.values())) == sum(n.values()) + 1
    # saved: a new process reads the row instead of measuring again
    saved = json.loads(probe_env["table"].read_text())["rows"]
    assert saved["bwd_impl/interpreter/64/float32"]["impl"] == fast
    configs.tuned_table(CPU, reload=True)
    assert configs.bwd_impl("interpreter", 16, torch.float32, device=CPU) == fast
    assert configs.bwd_impl("interpreter", 32, torch.float32, device=CPU) == fast  # same head_dim bucket
    assert probe_env["calls"] == ["bwd"]
    # a new dtype is a new row; the rows already in the file are kept
    configs.bwd_impl("interpreter", 16, torch.float16, device=CPU)
    assert probe_env["calls"] == ["bwd", "bwd"]
    saved = json.loads(probe_env["table"].read_text())["rows"]
    assert {"bwd_impl/interpreter/64/float32", "bwd_impl/interpreter/64/float16"} <= set(saved)


@needs_interp
@pytest.mark.parametrize("fast", ["tma", "plain"])
def test_on_hopper_the_first_use_measures_tma_against_pointer_loads(probe_env, monkeypatch, fast):
    from ndp_kernels import tune

    # The interpreter runs TMA descriptors; pretend this is an sm_90 GPU for the rule that decides to measure.
    monkeypatch.setattr(configs, "tma_here", lambda kind, dtype, device, hd: configs.tma_applies(kind, dtype, hd))
    monkeypatch.setattr(tune, "tma_here", configs.tma_here)
    probe_env["fast"] = fast
    q, k, v, do = (x.half() for x in _qkvd())
    out, lse = ndp_kernels.flash_attn_fwd(q, k, v, causal=True)
    ro, rl = reference.flash_attn_fwd_ref(q.double(), k.double(), v.double(), causal=True)
    torch.testing.assert_close(out.double(), ro, atol=2e-3, rtol=2e-3)
    assert probe_env["calls"] == ["fwd", "bwd"]  # the forward settles the backward's choices too
    row = configs.tuned_table(CPU)["fwd/interpreter/64/float16"]
    static = configs.static_config("fwd", "interpreter", 16, torch.float16)
    assert row["probed"] and row["config"] == static.as_row() + ([True] if fast == "tma" else [])
    assert set(row["candidates"]) == {str(static), str(static) + "/tma"}
    assert configs.fwd_config("interpreter", 16, CPU, torch.float16).tma == (fast == "tma")
    ndp_kernels.flash_attn_fwd(q, k, v, causal=True)
    assert probe_env["calls"] == ["fwd", "bwd"]
    # fp32 has no TMA: nothing to measure for the forward, the backward's choice only
    ndp_kernels.flash_attn_fwd(q.float(), k.float(), v.float(), causal=True)
    assert probe_env["calls"] == ["fwd", "bwd", "bwd"]
    # the backward measured by the forward (the split one's dQ kernel with and without TMA, then the faster
    # backward): it measures nothing itself
    grads = ndp_kernels.flash_attn_bwd(do.half(), q, k, v, out, lse, causal=True)
    assert probe_env["calls"] == ["fwd", "bwd", "bwd"]
    want = reference.flash_attn_bwd_ref(do.double(), q.double(), k.double(), v.double(), ro, rl, causal=True)
    for g, w in zip(grads, want):
        torch.testing.assert_close(g.double(), w, atol=1e-2, rtol=1e-2)
    rows = configs.tuned_table(CPU)
    dq = configs.static_config("bwd_dq", "interpreter", 16, torch.float16)
    assert rows["bwd_impl/interpreter/64/float16"]["impl"] == "split"
    assert rows["bwd_dq/interpreter/64/float16"]["config"] == dq.as_row() + ([True] if fast == "tma" else [])
    assert configs.bwd_dq_config("interpreter", 16, CPU, torch.float16).tma == (fast == "tma")
    saved = json.loads(probe_env["table"].read_text())["rows"]
    assert {"fwd/interpreter/64/float16", "bwd_dq/interpreter/64/float16", "bwd_impl/interpreter/64/float16",
            "bwd_impl/interpreter/64/float32"} == set(saved)


@needs_interp
def test_a_failed_probe_is_logged_once_and_the_static_tables_apply(probe_env, monkeypatch, caplog):
    from ndp_kernels import tune

    calls = []

    def broken(part, *a, **kw):
        calls.append(part)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (stand-in)")

    monkeypatch.setattr(tune, "probe", broken)
    q, k, v, do = _qkvd()
    with caplog.at_level("WARNING", logger="ndp_kernels"):
        _grads_match(q, k, v, do)
        _grads_match(q, k, v, do)
    assert calls == ["bwd"]
    assert "failed (OutOfMemoryError: CUDA out of memory (stand-in)); the static tables apply" in caplog.text
    assert configs.bwd_impl("interpreter", 16, torch.float32, device=CPU) == configs._BWD_IMPL[("interpreter", 64)]
    assert not probe_env["table"].exists()


@needs_interp
def test_no_probe_where_it_is_switched_off(probe_env, monkeypatch):
    q, k, v, do = _qkvd()
    with configs.no_probe():
        _grads_match(q, k, v, do)
    with monkeypatch.context() as m:  # torch.compile tracing (or a CUDA graph capture) never measures
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        _grads_match(q, k, v, do)
    with monkeypatch.context() as m:  # the launcher's switch
        m.setenv("NDP_AUTO_PROBE", "0")
        _grads_match(q, k, v, do)
    monkeypatch.setattr(configs, "AUTO_PROBE", ())
    _grads_match(q, k, v, do)
    assert configs.bwd_impl("interpreter", 16, torch.float32, device=None) == "atomic"  # no device: no table
    assert probe_env["calls"] == [] and not probe_env["table"].exists()


@needs_interp
def test_tuning_the_atomic_backward_times_it_even_where_the_table_says_split(tmp_path, monkeypatch):
    from ndp_kernels import flash, tune

    monkeypatch.setenv("NDP_TUNING_DIR", str(tmp_path))
    (tmp_path / "kernels-cpu.json").write_text(json.dumps({"rows": {
        "bwd_impl/interpreter/64/float32": {"impl": "split", "ms": {"atomic": 2.0, "split": 1.0}}}}))
    ran = []
    for impl in ("atomic", "split"):
        monkeypatch.setattr(flash, f"_bwd_{impl}", lambda *a, _n=impl, **kw: ran.append(_n))
    try:
        configs.tuned_table(CPU, reload=True)
        q, k, v, do = _qkvd()
        out, lse = reference.flash_attn_fwd_ref(q, k, v, causal=True)
        flash.flash_attn_bwd(do, q, k, v, out, lse, causal=True)
        tune._run("bwd", q, k, v, do, True, out, lse)
        tune._run("bwd_dq", q, k, v, do, True, out, lse)
        assert ran == ["split", "atomic", "split"]
        with configs.override("bwd_impl", "atomic"):
            assert configs.bwd_impl("interpreter", 16, torch.float32, device=CPU) == "atomic"
            assert configs.bwd_impl("interpreter", 16, torch.float32, deterministic=True, device=CPU) == "split"
        with pytest.raises(ValueError, match="a bwd_impl override must be one of"):
            with configs.override("bwd_impl", "fast"):
                pass
    finally:
        monkeypatch.delenv("NDP_TUNING_DIR")
        configs.tuned_table(CPU, reload=True)


@needs_interp
def test_a_table_measured_for_other_kernels_is_ignored_and_replaced(probe_env, caplog):
    from ndp_kernels import tuning

    stale = {"kernels": "0" * 16, "rows": {"bwd_impl/interpreter/64/float32": {"impl": "split", "ms": {}},
                                           "fwd/interpreter/64/float32": {"config": [64, 64, 4, 1, True]}}}
    probe_env["table"].write_text(json.dumps(stale))
    with caplog.at_level("WARNING", logger="ndp_kernels"):
        assert configs.tuned_table(CPU, reload=True) == {}
    assert "was measured for other kernels (an earlier ndp); ignoring it" in caplog.text
    q, k, v, do = _qkvd()
    _grads_match(q, k, v, do)                      # measures anew: the stale row did not count
    assert probe_env["calls"] == ["bwd"]
    saved = json.loads(probe_env["table"].read_text())
    assert saved["kernels"] == tuning.kernels_fingerprint() and "fwd/interpreter/64/float32" not in saved["rows"]
    assert configs.tuned_table(CPU, reload=True)["bwd_impl/interpreter/64/float32"]["probed"]


@needs_interp
def test_a_cache_that_cannot_be_written_keeps_the_measurement_for_this_process(probe_env, monkeypatch, caplog):
    from ndp_kernels import tuning

    def read_only(path, data):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(tuning, "save_json", read_only)
    q, k, v, do = _qkvd()
    with caplog.at_level("WARNING", logger="ndp"):
        _grads_match(q, k, v, do)
    assert "could not save the measured rows" in caplog.text and "Permission denied" in caplog.text
    assert configs.tuned_table(CPU)["bwd_impl/interpreter/64/float32"]["impl"] == "split"   # used in-process
    _grads_match(q, k, v, do)
    assert probe_env["calls"] == ["bwd"] and not probe_env["table"].exists()


@needs_interp
@pytest.mark.parametrize("alt_wins", [True, False])
def test_first_use_times_the_alternate_tiles_beside_the_static_one(probe_env, monkeypatch, alt_wins):
    from ndp_kernels import tune

    alt = KernelConfig(32, 16, 4, 1)
    static = configs.static_config("bwd_dkdv", "interpreter", 16, torch.float16)
    monkeypatch.setitem(configs.PROBE_ALTERNATES, ("bwd_dkdv", "interpreter", 64), (alt,))
    assert configs.probe_variants("bwd_dkdv", "interpreter", 16, torch.float16, CPU) == [static, alt]
    assert configs.probe_variants("bwd_dkdv", "interpreter", 16, torch.float32, CPU) == [static]  # 16-bit only

    def fake_bench(fn, device):
        fn()
        dkdv = configs._forced("bwd_dkdv")
        return 1.0 if (dkdv == alt) == alt_wins and dkdv is not None else 3.0

    monkeypatch.setattr(tune, "_bench", fake_bench)
    q, k, v, do = (x.half() for x in _qkvd())
    out, lse = reference.flash_attn_fwd_ref(q.double(), k.double(), v.double(), causal=True)
    # deterministic=True never depends on a timing: the static dK/dV tiles, no measurement
    want = reference.flash_attn_bwd_ref(do.double(), q.double(), k.double(), v.double(), out, lse, causal=True)
    seen = []
    real_cfg = configs.bwd_dkdv_config
    monkeypatch.setattr(ndp_kernels.flash, "bwd_dkdv_config",
                        lambda *a, **kw: (seen.append(real_cfg(*a, **kw)), seen[-1])[1])
    for det in (True, False):
        grads = ndp_kernels.flash_attn_bwd(do, q, k, v, out.half(), lse.float(), causal=True, deterministic=det)
        for g, w in zip(grads, want):
            torch.testing.assert_close(g.double(), w, atol=1e-2, rtol=1e-2)
        assert probe_env["calls"] == ([] if det else ["bwd"])  # deterministic=False: the dK/dV tiles measured
    assert seen[0] == static
    rows = configs.tuned_table(CPU)
    row = rows["bwd_dkdv/interpreter/64/float16"]
    assert row["probed"] and row["config"] == (alt if alt_wins else static).as_row()
    assert set(row["candidates"]) == {str(static), str(alt)}
    assert configs.bwd_dkdv_config("interpreter", 16, CPU, torch.float16) == (alt if alt_wins else static)
    assert configs.bwd_dkdv_config("interpreter", 16, CPU, torch.float16, deterministic=True) == static
    # one variant each: the atomic and dQ kernels get no row; the backward choice does
    assert "bwd/interpreter/64/float16" not in rows and "bwd_dq/interpreter/64/float16" not in rows
    # the split backward was timed with the winning dK/dV tiles (1 ms per call here), the atomic one at 3 ms
    assert rows["bwd_impl/interpreter/64/float16"]["impl"] == "split"
    assert rows["bwd_impl/interpreter/64/float16"]["ms"] == {"atomic": 6.0, "split": 2.0}


@needs_interp
def test_a_probe_where_nothing_passes_says_why(probe_env, monkeypatch):
    from ndp_kernels import tune

    monkeypatch.setattr(tune, "check_candidate", lambda *a, **k: (False, 0.5))
    with pytest.raises(RuntimeError, match=r"no bwd variant passed its check on cpu at head_dim 16.*wrong \(max "
                                           r"error 5.00e-01\)"):
        tune.probe("bwd", CPU, 16, torch.float32)
    with pytest.raises(ValueError, match="part must be 'fwd' or 'bwd'"):
        tune.probe("dq", CPU, 16, torch.float32)


_RACER = """
import json, sys, time
from ndp_kernels import tuning
path, marker, tag, out = sys.argv[1:5]
def measure():
    time.sleep(1.0)  # long enough for the other process to be waiting on the lock
    return {marker: {"by": tag}, "extra/" + tag: {"by": tag}}
rows = tuning.measure_once(path, marker, measure, lambda: {"kernels": "x"})
json.dump({"measured": "extra/" + tag in rows and rows["extra/" + tag]["by"] == tag, "row": rows[marker]},
          open(out, "w"))
"""


def test_two_processes_measuring_at_once_take_one_decision_and_the_table_keeps_every_row(tmp_path):
    # The ranks of one node reach their first launch together: one measures, the other waits for the lock and
    # takes the rows written. A later measurement of another row is merged in, never replacing the table.
    path = tmp_path / "kernels-x.json"
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(path), "fwd/a", tag, str(tmp_path / f"{tag}.json")])
             for tag in ("r0", "r1")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    got = [json.loads((tmp_path / f"{t}.json").read_text()) for t in ("r0", "r1")]
    assert sorted(g["measured"] for g in got) == [False, True]   # measured once
    assert got[0]["row"] == got[1]["row"]                         # one decision
    tuning.merge_rows(path, {"fwd/b": {"by": "later"}, "fwd/a": {"by": "loser"}}, lambda: {})
    rows = json.loads(path.read_text())["rows"]
    assert rows["fwd/b"] == {"by": "later"} and rows["fwd/a"] == got[0]["row"] and len(rows) == 3
    tuning.merge_rows(path, {"fwd/a": {"by": "full tune"}}, lambda: {}, replace=True)
    assert json.loads(path.read_text())["rows"]["fwd/a"] == {"by": "full tune"} and len(rows) == 3


def test_never_measured_inside_autograd_backward():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(tuning.may_measure(CPU, ("cpu",)))
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen.append(tuning.may_measure(CPU, ("cpu",)))
            return g * 2

    Probe.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert seen == [True, False]


def test_the_kernel_digest_covers_every_source_the_kernels_depend_on(tmp_path, monkeypatch):
    assert set(tuning.KERNEL_SOURCES) >= {"flash.py", "merge.py", "segments.py", "configs.py"}
    base = tuning.kernels_fingerprint()
    for name in tuning.KERNEL_SOURCES:
        pkg = tmp_path / name.replace(".py", "")
        pkg.mkdir()
        for other in tuning.KERNEL_SOURCES:
            src = (Path(tuning.__file__).parent / other).read_bytes()
            (pkg / other).write_bytes(src + (b"\n# changed\n" if other == name else b""))
        monkeypatch.setattr(tuning, "__file__", str(pkg / "tuning.py"))
        tuning.kernels_fingerprint.cache_clear()
        assert tuning.kernels_fingerprint() != base, name
    monkeypatch.undo()
    tuning.kernels_fingerprint.cache_clear()
    assert tuning.kernels_fingerprint() == base


def test_shipped_kernel_tables_are_for_these_kernels():
    """Each table shipped in the package names tiles these kernels take, and its digest is these kernels' (a table
    measured for other kernels is ignored, so a kernel change that forgets it would silently drop it)."""
    tables = sorted(configs.SHIPPED_DIR.glob("kernels-*.json"))
    assert tables, f"no kernel table shipped in {configs.SHIPPED_DIR}"
    for path in tables:
        data = json.loads(path.read_text())
        assert tuning.for_these_kernels(data), (
            f"{path.name} was measured for other kernels ({data.get('kernels')} != {tuning.kernels_fingerprint()}): "
            f"measure it again on that GPU (make gpu-report copies the rows under tuning/), or, where the change "
            f"touched neither a kernel nor a tile, set its 'kernels' field to the new digest")
        for key, row in data["rows"].items():
            kind, arch, bucket, dtype = key.split("/")
            assert arch in configs.ARCHS and int(bucket) == configs.kernel_bucket(int(bucket))
            assert isinstance(getattr(torch, dtype), torch.dtype)
            if kind == "bwd_impl":
                assert row["impl"] in configs.IMPLS
            else:
                assert kind in configs.KINDS and KernelConfig(*row["config"]).block_m > 0


def test_shipped_rows_serve_their_gpu_under_the_users_rows(tmp_path, monkeypatch):
    """On the GPU model of a shipped table (here the H100's, read through a stand-in device key) its rows decide
    without a measurement; a user's row of the same key wins, and the user's other rows add to the shipped ones."""
    h100 = "NVIDIA_H100_80GB_HBM3"
    shipped = json.loads((configs.SHIPPED_DIR / f"kernels-{h100}.json").read_text())["rows"]
    monkeypatch.setenv("NDP_TUNING_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "device_key", lambda device: h100)
    try:
        assert configs.tuned_table(CPU, reload=True) == shipped
        want = KernelConfig(*shipped["fwd/sm_90/128/bfloat16"]["config"])
        assert configs.fwd_config("sm_90", 128, CPU, torch.bfloat16) == want
        assert configs.bwd_impl("sm_90", 128, torch.bfloat16, device=CPU) == shipped["bwd_impl/sm_90/128/bfloat16"][
            "impl"]
        user = {"fwd/sm_90/128/bfloat16": {"config": [64, 64, 4, 2], "ms": 1.0},
                "fwd/sm_90/256/bfloat16": {"config": [64, 32, 8, 2], "ms": 1.0}}
        (tmp_path / f"kernels-{h100}.json").write_text(json.dumps({"rows": user}))
        rows = configs.tuned_table(CPU, reload=True)
        assert rows == {**shipped, **user}
        assert configs.fwd_config("sm_90", 128, CPU, torch.bfloat16) == KernelConfig(64, 64, 4, 2)
        # a user table measured for other kernels is ignored; the shipped rows stay
        (tmp_path / f"kernels-{h100}.json").write_text(json.dumps({"kernels": "0" * 16, "rows": user}))
        assert configs.tuned_table(CPU, reload=True) == shipped
    finally:
        monkeypatch.undo()
        configs.tuned_table(CPU, reload=True)


@needs_interp
def test_a_full_tune_times_the_tiles_that_run_now_first_then_their_neighbours(tmp_path, monkeypatch):
    # `python -m ndp_kernels.tune` (make gpu-report PARTS=tune): the static tile, then the table's (shipped or the
    # user's), then the grid nearest the table's first; past the time budget only those two are still timed.
    from ndp_kernels import tune

    monkeypatch.setenv("NDP_TUNING_DIR", str(tmp_path))
    table = KernelConfig(16, 32, 4, 1)
    (tmp_path / "kernels-cpu.json").write_text(json.dumps({"rows": {
        "fwd/interpreter/64/float32": {"config": table.as_row(), "ms": 1.0}}}))
    timed = []
    monkeypatch.setattr(tune, "_bench", lambda fn, device: (timed.append(configs._forced("fwd")), 2.0)[1])
    try:
        configs.tuned_table(CPU, reload=True)
        static = configs.static_config("fwd", "interpreter", 16, torch.float32)
        cands, first, kept = tune.ordered_candidates("fwd", torch.float32, 16, CPU, quick=True)
        assert (cands[:2], first, kept) == ([static, table], static, 2) and len(set(cands)) == len(cands)
        dist = [tune._distance(c, table) for c in cands[2:]]
        assert dist == sorted(dist) and set(cands[2:]) >= set(tune.candidates("fwd", quick=True)) - {static, table}
        row = tune.tune_kind("fwd", torch.float32, 16, CPU, seqlen=32, batch=1, heads=2, kv_heads=2, quick=True,
                             deadline=0.0, log=lambda *_: None)
    finally:
        monkeypatch.delenv("NDP_TUNING_DIR")
        configs.tuned_table(CPU, reload=True)
    assert timed == [static, static, table, table]  # causal, then full, per tile
    assert row["static"]["config"] == static.as_row() and row["table"] == {"config": table.as_row(), "ms": 4.0}
    assert row["masks"] == {str(static): [2.0, 2.0], str(table): [2.0, 2.0]}
    assert {str(c): "not timed (the time budget was spent)" for c in cands[2:]}.items() <= row["candidates"].items()


def test_a_tune_budget_is_shared_by_the_kinds_left(monkeypatch):
    from ndp_kernels import tune

    clock, deadlines = [100.0], {}

    def fake_kind(kind, *a, deadline=None, **kw):  # each kind takes 10 s of its share
        deadlines[kind] = deadline - clock[0]
        clock[0] += 10
        return {"config": [64, 64, 4, 1], "ms": 1.0}

    monkeypatch.setattr(tune.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(tune, "tune_kind", fake_kind)
    rows = tune.tune_head_dim(["bwd_dq", "fwd", "bwd", "bwd_dkdv"], torch.float32, 16, CPU, budget_s=100)
    assert deadlines == {"fwd": 25.0, "bwd": 30.0, "bwd_dkdv": 40.0, "bwd_dq": 70.0}  # (200 - now) / kinds left
    assert rows["bwd_impl/interpreter/64/float32"]["impl"] in ("atomic", "split")
