"""Checkpoints: resume is bit-exact (6 straight == 3 + save + kill + resume 3), a kill during a save
leaves the previous checkpoint loadable, and a sharded checkpoint resumes under another layout."""
import json
import os
import shutil

import pytest
import torch
import torch.multiprocessing as mp

from dist import spawn
from _runs import train_config
from ndp.train import train
from ndp.train.checkpoint import latest_checkpoint

pytestmark = pytest.mark.distributed


def _run(rank, world, kw, out):
    kw = dict(kw)
    die = kw.pop("_die", False)
    cfg = train_config(kw.pop("_layout", "dp_shard2"), **kw)
    calls = []

    def die_on_second_commit():
        calls.append(1)
        if len(calls) == 2:  # the processes die with checkpoint 6 written but not committed
            os._exit(3)

    res = train(cfg, before_commit=die_on_second_commit if die else None)
    if rank == 0 and out:
        torch.save(res.losses, out)


def _spawn(tmp_path, tag, kw, out=None):
    d = tmp_path / tag
    d.mkdir()
    spawn(_run, 2, d, kw, out)
    return torch.load(out) if out else None


def test_resume_is_bit_exact_and_survives_kill_during_save(tmp_path):
    ref = _spawn(tmp_path, "a", dict(steps=6), str(tmp_path / "straight.pt"))

    # Steps 1-6 with a checkpoint every 3 steps; the processes are killed while saving step 6.
    save, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    with pytest.raises(mp.ProcessExitedException):
        _spawn(tmp_path, "b", dict(steps=6, save_dir=save, save_every=3, metrics=metrics, _die=True))
    assert latest_checkpoint(save).endswith("step_00000003")
    assert any(e.startswith(".tmp_step_00000006") for e in os.listdir(save))  # the interrupted save
    shutil.copytree(save, save + "_copy")

    # Resume from checkpoint 3: steps 4-6 are bit-identical to the uninterrupted run.
    got = _spawn(tmp_path, "c", dict(steps=6, save_dir=save, resume=True, metrics=metrics), str(tmp_path / "r.pt"))
    assert got == ref[3:], f"resumed losses {got} != uninterrupted {ref[3:]}"
    rows = [json.loads(line) for line in open(metrics)]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # steps logged after checkpoint 3 were replaced
    assert [r["loss"] for r in rows] == ref and all(r["tokens_per_s"] > 0 for r in rows)
    assert latest_checkpoint(save).endswith("step_00000006")
    assert not any(e.startswith(".tmp_") for e in os.listdir(save))

    # The sharded checkpoint reshards on load: resume the dp_shard 2 checkpoint as tp 2 (fp32 rounding of
    # a different reduction order only, hence the parity bound instead of equality).
    got = _spawn(tmp_path, "d", dict(steps=6, save_dir=save + "_copy", resume=True, _layout="tp2"),
                 str(tmp_path / "r2.pt"))
    assert got == pytest.approx(ref[3:], rel=1e-5)


def test_a_parameter_never_given_a_gradient_resumes_as_if_uninterrupted(tmp_path):
    # A multimodal model's vision tower under text-only batches: its parameters never get a gradient, so the
    # optimizer holds no state for them when the checkpoint is saved. The resumed run must load (a fresh optimizer
    # expects state for every parameter) and keep them stateless, as the uninterrupted run does.
    from torch import nn

    from ndp.train.checkpoint import load_checkpoint, save_checkpoint

    def build():
        torch.manual_seed(0)
        model = nn.ModuleDict({"text": nn.Linear(4, 4), "vision": nn.Linear(4, 4)})
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))

    def step(model, opt, sched, i):
        x = torch.arange(8.0).reshape(2, 4) + i
        model["text"](x).square().sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()

    model, opt, sched = build()
    step(model, opt, sched, 0)
    path = save_checkpoint(str(tmp_path / "ckpt"), 1, model, opt, sched)
    for i in (1, 2):
        step(model, opt, sched, i)
    resumed, ropt, rsched = build()
    load_checkpoint(path, resumed, ropt, rsched)
    assert resumed["vision"].weight not in ropt.state and resumed["text"].weight in ropt.state
    for i in (1, 2):
        step(resumed, ropt, rsched, i)
    for k, v in model.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k
