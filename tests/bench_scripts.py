"""Run a bench/ script the way its reader does, as a subprocess (tests import no benchmark), and read what it wrote."""
import json
import os
import pathlib
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(script, *args, timeout=600) -> str:
    """``python bench/<script> *args`` on one thread per process; its stdout (a failure shows its output tail)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), *map(str, args)], capture_output=True,
                       text=True, timeout=timeout, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def bench_json(script, out_dir, *args, timeout=600):
    """run_bench with ``--out out_dir``; the results it wrote there (``<out_dir>/<script's stem>.json``)."""
    run_bench(script, *args, "--out", out_dir, timeout=timeout)
    return json.loads((pathlib.Path(out_dir) / f"{pathlib.Path(script).stem}.json").read_text())
