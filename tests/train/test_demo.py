"""`make demo` in miniature: the 4-process dp_shard 2 x cp 2 run and the 1-process run print the same curve,
and the demo leaves no temporary folder behind (its own metrics folder, torchrun's torchelastic_* logs)."""
import json
import os
import subprocess
import sys

import pytest

from ndp.train import demo

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.distributed
def test_demo_smoke(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, TMPDIR=str(tmp))
    r = subprocess.run([sys.executable, "-m", "ndp.train.demo", "--steps", "3", "--seq-len", "64", "--batch-size", "4"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "max relative loss difference over 3 steps" in r.stdout
    assert "removed at the end" in r.stdout
    assert sorted(os.listdir(tmp)) == [], "the demo left temporary files behind"


def test_demo_out_keeps_metrics_and_temp_is_removed(tmp_path, monkeypatch):
    # The two training runs replaced by a stub writing 3 steps of metrics; the rest of the demo runs.
    scratch_seen = []

    def fake_run(cmd, env, label):
        scratch_seen.append(env["TMPDIR"])
        path = cmd[cmd.index("--metrics") + 1]
        with open(path, "w") as f:
            for i in range(3):
                f.write(json.dumps({"step": i + 1, "loss": 5.0 - i, "tokens_per_s": 100.0}) + "\n")
        return 1.0

    monkeypatch.setattr(demo, "_run", fake_run)
    monkeypatch.setattr(demo.tempfile, "tempdir", str(tmp_path))
    assert demo.main(["--steps", "3"]) == 0
    assert os.listdir(tmp_path) == []  # metrics and scratch folder removed
    out = tmp_path / "kept"
    assert demo.main(["--steps", "3", "--out", str(out)]) == 0
    assert sorted(os.listdir(tmp_path)) == ["kept"]
    assert sorted(os.listdir(out)) == ["metrics_dp2_cp2.jsonl", "metrics_single.jsonl"]
    assert all(not os.path.exists(s) for s in scratch_seen)
