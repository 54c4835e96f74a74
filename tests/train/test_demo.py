"""`make demo` in miniature: the 4-process dp_shard 2 x cp 2 run and the 1-process run print the same curve."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.distributed
def test_demo_smoke(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "ndp.train.demo", "--steps", "3", "--seq-len", "64", "--batch-size", "4",
                        "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "max relative loss difference over 3 steps" in r.stdout
    assert os.path.exists(tmp_path / "metrics_dp2_cp2.jsonl") and os.path.exists(tmp_path / "metrics_single.jsonl")
