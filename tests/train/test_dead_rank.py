"""A dead rank ends the job loudly: SIGKILL one of 4 ndp-train processes mid-run; every process exits, the
launcher reports the dead rank and exits non-zero, nothing is left running, and the last committed checkpoint
is intact (its checksums verify and a resumed run continues from it)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ndp.train.checkpoint import latest_checkpoint, read_meta, verify_checkpoint

pytestmark = pytest.mark.distributed
PY = sys.executable
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, NDP_PG_TIMEOUT="30", TRITON_INTERPRET="0")


def _children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_sigkill_of_one_rank_ends_every_process_and_keeps_the_checkpoint(tmp_path):
    save, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    args = ["--model", "tiny-llama", "--dp-shard", "2", "--cp", "2", "--seq-len", "64", "--batch-size", "4",
            "--steps", "400", "--save-dir", str(save), "--save-every", "2", "--metrics", str(metrics),
            "--device", "cpu", "--no-progress"]
    launcher = subprocess.Popen([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                                 "-m", "ndp.train", *args], env=_env(), cwd=str(tmp_path),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    workers = []
    try:
        deadline = time.time() + 240
        while time.time() < deadline and launcher.poll() is None:
            rows = metrics.read_text().splitlines() if metrics.exists() else []
            if len(rows) >= 5 and latest_checkpoint(str(save)):
                break
            time.sleep(0.5)
        assert launcher.poll() is None, launcher.communicate()[0][-3000:]
        workers = [c for c in _children(launcher.pid) if _alive(c)]
        assert len(workers) == 4, workers
        victim = workers[2]
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)  # mid-step: steps take milliseconds and run back to back
        gone = {}
        while time.time() - t_kill < 120 and (len(gone) < len(workers) or launcher.poll() is None):
            for w in workers:
                if w not in gone and not _alive(w):
                    gone[w] = time.time() - t_kill
            time.sleep(0.05)
        out, _ = launcher.communicate(timeout=60)
        t_exit = time.time() - t_kill
        exits = ", ".join("%.2f" % gone[w] if w in gone else "alive" for w in workers)
        print(f"dead rank: worker exit times after the SIGKILL (s): {exits}; launcher exit {t_exit:.2f} s, "
              f"code {launcher.returncode}")
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)
    assert launcher.returncode != 0
    assert t_exit < 60 and len(gone) == 4 and max(gone.values()) < 60, (t_exit, gone)
    assert "SIGKILL" in out or "Signal 9" in out, out[-3000:]
    time.sleep(1)
    assert not [w for w in workers if _alive(w)], "a worker outlived the job"
    path = latest_checkpoint(str(save))
    verify_checkpoint(path)  # every file matches the checksum written at save
    step = read_meta(path)["step"]
    assert step >= 2 and step % 2 == 0
    # The checkpoint resumes (one process, another layout) and continues from its step.
    r = subprocess.run([PY, "-m", "ndp.train", "--model", "tiny-llama", "--seq-len", "64", "--batch-size", "4",
                        "--steps", str(step + 1), "--save-dir", str(save), "--resume", "--metrics",
                        str(tmp_path / "r.jsonl"), "--device", "cpu", "--no-progress"], env=_env(),
                       capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == step + 1
