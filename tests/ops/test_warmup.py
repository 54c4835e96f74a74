"""ndp.warmup: the first-use measurement done before training, one decision for every rank of every node."""
import json
import os
import re

import pytest
import torch

import ndp
import ndp_kernels
from dist import spawn
from ndp.ops import engines, tune
from ndp_kernels import configs
from ndp_kernels import tune as kernel_tune

CPU = torch.device("cpu")
needs_interp = pytest.mark.skipif(not ndp_kernels.interpreter_active(), reason="runs kernels under TRITON_INTERPRET=1")


def _probing_here(rank_tag, fast_engine, fast_bwd, calls):
    """This process as a GPU machine would be: first-use measurement on, its own tuning dir (its own node), and
    timers under which `fast_engine` and the `fast_bwd` backward win; `calls` records what is measured here."""
    os.environ["NDP_TUNING_DIR"] = rank_tag
    engines.AUTO_PROBE = configs.AUTO_PROBE = ("cpu",)
    engines._TABLES.clear()
    configs.tuned_table(CPU, reload=True)
    kernel_tune.PROBE_SHAPE = dict(seqlen=48, batch=1, heads=2, kv_heads=1)
    engines.SHIPPED_DIR = os.path.join(rank_tag, "shipped")  # no shipped CPU table: every row is measured

    def time_engine(engine, cls, *a, **k):
        calls.append(("engine", cls, engine))
        return 1.0 if engine == fast_engine else 3.0

    def bench(fn, device):
        fn()
        calls.append(("kernel", "bwd"))
        return 1.0 if configs._forced({"atomic": "bwd", "split": "bwd_dq"}[fast_bwd]) is not None else 3.0
    tune.time_engine = time_engine
    kernel_tune._bench = bench


def _two_nodes(rank, world, tmp):
    # Each rank is its own "node" (its own tuning dir), and its timers would pick another engine and another
    # backward than rank 0's: after warmup every rank runs rank 0's choices, measured once, on rank 0.
    calls = []
    mine = os.path.join(tmp, f"node{rank}")
    _probing_here(mine, ("triton", "sdpa")[rank], ("atomic", "split")[rank], calls)
    got = ndp.warmup(16, torch.float32, classes=("causal", "varlen"))
    assert got["measured_by"] == 0 and got["device"] == "cpu", got
    assert bool(calls) == (rank == 0), calls
    for cls in ("causal", "varlen"):
        for kind in engines.HEAD_KINDS:
            assert engines.engine_table(CPU).order(cls, torch.float32, 32, kind) == (("triton", "sdpa"), "measured")
    assert configs.bwd_impl("interpreter", 16, torch.float32, device=CPU) == "atomic"
    # this node's tables hold rank 0's rows too: a later process here takes them without measuring
    saved = json.loads(open(os.path.join(mine, "engines-cpu.json")).read())["rows"]
    assert saved["varlen/float32/32/gqa"]["order"] == ["triton", "sdpa"]
    kernels = json.loads(open(os.path.join(mine, "kernels-cpu.json")).read())["rows"]
    assert kernels["bwd_impl/interpreter/64/float32"]["impl"] == "atomic"
    # the first training-like call measures nothing more
    segs, sq, sk = tune.class_block("causal", 64)
    q, k, v, dout = tune._inputs(sq, sk, 4, 2, 16, torch.float32, CPU)
    n = len(calls)
    tune._fwd_bwd("auto", q, k, v, dout, segs, 0.25)
    assert len(calls) == n


@needs_interp
@pytest.mark.distributed
def test_warmup_measures_on_rank_0_and_every_node_runs_its_choices(tmp_path):
    spawn(_two_nodes, 2, tmp_path, str(tmp_path), timeout_s=240)


def _rank0_fails(rank, world, tmp):
    calls = []
    _probing_here(os.path.join(tmp, f"node{rank}"), "sdpa", "atomic", calls)
    if rank == 0:
        def broken(*a, **k):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        tune.time_engine = broken
    with pytest.raises(RuntimeError, match="rank 0 of the group failed while measuring: OutOfMemoryError"):
        ndp.warmup(16, torch.float32, classes=("full",))


@pytest.mark.distributed
def test_a_failing_rank_0_fails_every_rank_instead_of_a_hang(tmp_path):
    spawn(_rank0_fails, 2, tmp_path, str(tmp_path), timeout_s=60)


@pytest.mark.parametrize("args, match", [
    (dict(head_dims=[0]), "head_dims must be positive ints"),
    (dict(head_dims=[128.0]), "head_dims must be positive ints"),
    (dict(head_dims=[], ), "head_dims must be positive ints"),
    (dict(head_dims=[64], dtypes=[torch.int8]), "dtypes must be among"),
    (dict(head_dims=[64], classes=("dense",)), "classes must be among"),
    (dict(head_dims=[64], head_kinds=("mqa",)), "head_kinds must be among"),
])
def test_bad_arguments_are_refused_before_any_work(args, match, monkeypatch):
    monkeypatch.setattr(tune, "_first_calls", lambda *a: pytest.fail("work started"))
    with pytest.raises(ValueError, match=match):
        ndp.warmup(**args)


def test_cli_warmup_on_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NDP_TUNING_DIR", str(tmp_path))
    monkeypatch.setattr(engines, "_TABLES", {})
    assert tune.main(["--warmup", "--device", "cpu", "--head-dims", "64", "--dtypes", "float32"]) == 0
    out = capsys.readouterr().out
    assert "warm: {'device': 'cpu', 'measured_by': 0" in out


def test_readme_warmup_block_runs_verbatim(tmp_path, monkeypatch, capsys):
    text = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md"), encoding="utf-8").read()
    block = re.search(r"\*\*Warm up before training\*\*.*?```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.setenv("NDP_TUNING_DIR", str(tmp_path))
    monkeypatch.setattr(engines, "_TABLES", {})
    exec(compile(block, "README.md:warmup", "exec"), {})
    assert "'measured_by': 0" in capsys.readouterr().out
