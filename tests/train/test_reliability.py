"""Training reliability: resume refuses another run's checkpoint, corrupt checkpoints are detected, --stop-after
runs in time slices with the schedule of --steps, non-finite steps stop (or are skipped) with a message naming
the step and the tensor, and a checkpoint resumes across parallel layouts on the trajectory of one process."""
import json
import logging
import os

import pytest
import torch

from _runs import train_config
from dist import spawn
from ndp.train import train
from ndp.train.checkpoint import latest_checkpoint, read_meta
from ndp.train.config import TrainConfig, parse_config

STEPS = dict(steps=6, seq_len=64, batch_size=4)


def _one(tmp_path, **kw):
    return train(train_config(**{**STEPS, **kw}))


def test_resume_refuses_another_model_or_sequence_length(tmp_path):
    save = str(tmp_path / "ck")
    _one(tmp_path, steps=2, save_dir=save)
    meta = read_meta(latest_checkpoint(save))
    assert meta["identity"]["vocab_size"] == 256 and meta["identity"]["seq_len"] == 64 and meta["steps"] == 2
    with pytest.raises(ValueError, match=r"belongs to another run \(.*model_type: checkpoint 'llama', this run "
                                         r"'qwen2'.*Resume with the model"):
        _one(tmp_path, steps=4, save_dir=save, resume=True, model="tiny-qwen2")
    with pytest.raises(ValueError, match=r"seq_len: checkpoint 64, this run 32"):
        _one(tmp_path, steps=4, save_dir=save, resume=True, seq_len=32)


def test_corrupt_or_truncated_checkpoint_is_refused(tmp_path):
    save = str(tmp_path / "ck")
    _one(tmp_path, steps=1, save_dir=save)
    path = latest_checkpoint(save)
    files = [f for f in sorted(read_meta(path)["sha256"]) if f.endswith(".distcp")]
    assert files
    target = os.path.join(path, files[0])
    data = bytearray(open(target, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(target, "wb").write(bytes(data))
    with pytest.raises(RuntimeError, match=r"is corrupt: .*\.distcp \(sha256 differs\).*Resume from an older"):
        _one(tmp_path, steps=2, save_dir=save, resume=True)
    os.remove(target)
    with pytest.raises(RuntimeError, match=r"\(missing\)"):
        _one(tmp_path, steps=2, save_dir=save, resume=True)


def test_stop_after_runs_in_time_slices_with_the_schedule_of_steps(tmp_path, caplog):
    straight = _one(tmp_path).losses
    save, metrics = str(tmp_path / "ck"), str(tmp_path / "m.jsonl")
    first = _one(tmp_path, save_dir=save, stop_after=2, metrics=metrics)
    assert first.losses == straight[:2] and latest_checkpoint(save).endswith("step_00000002")
    second = _one(tmp_path, save_dir=save, stop_after=4, resume=True, metrics=metrics)
    third = _one(tmp_path, save_dir=save, resume=True, metrics=metrics)
    assert second.losses + third.losses == straight[2:]  # bit-exact: same schedule, same RNG, same data
    rows = [json.loads(line) for line in open(metrics)]
    assert [r["step"] for r in rows] == list(range(1, 7)) and all(r["schedule_steps"] == 6 for r in rows)
    assert all(r["grad_norm"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    # Resuming under another --steps changes the schedule: said in the log and in the metrics.
    with caplog.at_level(logging.WARNING, logger="ndp.train.loop"):
        _one(tmp_path, steps=8, save_dir=save, resume=True, metrics=metrics)
    assert "saved with --steps 6 under --steps 8" in caplog.text
    rows = [json.loads(line) for line in open(metrics)]
    assert "learning-rate schedule follows --steps 8 from step 7" in rows[6]["note"] and "note" not in rows[7]


@pytest.mark.parametrize("argv, match", [
    (["--stop-after", "0"], r"--stop-after must be in \[1, steps\]"),
    (["--stop-after", "3", "--steps", "2", "--save-dir", "x"], r"stop_after=3, steps=2"),
    (["--stop-after", "1"], r"--stop-after saves a checkpoint.*needs --save-dir"),
    (["--skip-nonfinite", "-1"], r"--skip-nonfinite must be >= 0"),
])
def test_bad_slice_flags(argv, match):
    with pytest.raises(ValueError, match=match):
        parse_config(argv, env={})


def _poison(at_step, name="model.layers.0.mlp.up_proj.weight"):
    def hook(step, model):
        if step + 1 == at_step:
            dict(model.named_parameters())[name].grad[0, 0] = float("nan")
    return hook


def test_nonfinite_gradient_stops_with_step_and_tensor(tmp_path):
    save = str(tmp_path / "ck")
    cfg = train_config(**STEPS, save_dir=save, save_every=1)
    with pytest.raises(RuntimeError, match=r"step 3: non-finite gradient norm \(loss=[0-9.]+, grad_norm=nan\); first "
                                           r"non-finite tensor on rank 0: the gradient of "
                                           r"model\.layers\.0\.mlp\.up_proj\.weight\. Stopping"):
        train(cfg, step_hook=_poison(3))
    assert latest_checkpoint(save).endswith("step_00000002")  # the last committed checkpoint is intact


def test_skip_nonfinite_skips_the_step_and_continues(tmp_path):
    metrics = str(tmp_path / "m.jsonl")
    res = train(train_config(**STEPS, skip_nonfinite=1, metrics=metrics), step_hook=_poison(3))
    rows = [json.loads(line) for line in open(metrics)]
    assert len(res.losses) == 6 and [r.get("skipped", False) for r in rows] == [False, False, True, False, False,
                                                                               False]
    assert all(torch.isfinite(torch.tensor(res.losses)))
    with pytest.raises(RuntimeError, match=r"step 5: .*used 1 of 1"):
        hooks = [_poison(3), _poison(5)]
        train(train_config(**STEPS, skip_nonfinite=1), step_hook=lambda s, m: [h(s, m) for h in hooks])


# ---------------------------------------------------------------------------------------------- across layouts

def _layout_run(rank, world, kw, out):
    res = train(train_config(kw.pop("_layout", None), **kw))
    if rank == 0 and out:
        torch.save(res.losses, out)


@pytest.mark.distributed
def test_resume_across_layouts_follows_the_one_process_trajectory(tmp_path):
    straight = train(train_config(**STEPS)).losses
    # dp_shard 2 x cp 2 (4 processes) saves at step 2 -> 1 process resumes to 4 -> cp 2 (2 processes) to 6.
    save = str(tmp_path / "ck")
    (tmp_path / "a").mkdir()
    spawn(_layout_run, 4, tmp_path / "a", dict(STEPS, _layout="dp_shard2_cp2", save_dir=save, stop_after=2),
          str(tmp_path / "a.pt"))
    mid = train(train_config(**STEPS, save_dir=save, resume=True, stop_after=4)).losses
    (tmp_path / "b").mkdir()
    spawn(_layout_run, 2, tmp_path / "b", dict(STEPS, _layout="cp2_ring", save_dir=save, resume=True),
          str(tmp_path / "b.pt"))
    got = torch.load(tmp_path / "a.pt") + mid + torch.load(tmp_path / "b.pt")
    rel = max(abs(a - b) / abs(b) for a, b in zip(got, straight))
    pairs = {"dp_shard2xcp2 -> 1 process": (2, 4), "1 process -> cp2": (4, 6)}
    print("resume across layouts, max relative loss difference vs one straight process: " + "; ".join(
        f"{k} {max(abs(got[i] - straight[i]) / abs(straight[i]) for i in range(a, b)):.2e}"
        for k, (a, b) in pairs.items()))
    # Different layouts reduce in different orders: fp32 rounding only (measured about 1e-7).
    assert rel <= 1e-6, (rel, got, straight)


def test_trainconfig_defaults_keep_old_behaviour():
    cfg = TrainConfig()
    assert cfg.stop_after is None and cfg.skip_nonfinite == 0
