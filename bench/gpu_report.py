"""One command measures a GPU: ``make gpu-report`` (``python bench/gpu_report.py``).

Parts, each a fresh process with its own time limit, run in this order (``--parts`` / ``PARTS=`` picks some):

- ``tests``: the GPU tests (``pytest -m gpu``: the CUDA ops of ``ndp._C``, the CUDA sdpa and flash-attn engines,
  the kernels on the device).
- ``kernels``: ``bench_kernels.py`` with every provider (ndp, its forced backwards, TMA, torch SDPA default /
  cuDNN / flash, flash-attn): TFLOP/s by sequence length, forward, backward, forward+backward, plus its PNG.
- ``engines``: ``bench_engines.py --only single --only host``: ``ndp.ops.attention`` per engine against SDPA, and
  the host's time per call (auto against SDPA, the device not waited for).
- ``hf``: ``bench_engines.py --only hf``: a Hugging Face Llama trained with ndp's attention against
  ``attn_implementation="sdpa"``, tokens/s, losses compared.
- ``memory``: ``bench_memory.py`` on the device: peak memory and time of the token loss, full logits against the
  fused linear cross-entropy (its Triton row kernels), Llama-3's vocabulary and hidden size, bf16.
- ``first_call``: ``first_call.py`` in a fresh process with empty Triton and tuning caches (cold), then again
  with the caches it filled (warm): the first forward+backward and the steady state.

Asked for by name only (``PARTS=tune,kernels``; not in the 10-minute run): ``tune``: ``python -m ndp_kernels.tune``
at head_dim 128, bf16, within the part's time (the tiles nearest the ones that run now first), into the user's
tuning table, where the parts after it (and ``tuning/`` of the report) find the rows; the report lists each kernel's
best tile against the static and the shipped table's.

Every part writes JSON under ``<out>/<gpu>/<part>/``; the report is ``<out>/<gpu>/report.md`` (figures from this
run only, the part's command and its status: a part that fails or runs past its limit is reported as such and the
others still run), rewritten after every part, so a run stopped from outside still leaves the parts it finished.
The full run fits in 10 minutes on one H100: the parts' own limits add up to more, so the run has a time budget
(``--budget-s``, 540 s on a GPU): a part gets what is left of it, a part that finds it spent is reported as not
run. ``--archive FILE.tar.gz`` packs the report folder into one file (to attach or to carry off the machine).

Without a CUDA device it runs the smoke mode: every part on tiny CPU shapes (Triton interpreter), in well under a
minute, to check the whole path; the report says that no GPU figure was measured.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import bench_cp  # noqa: E402  (the machine/commit facts every benchmark records)
from _common import markdown_table  # noqa: E402
from ndp_kernels import tuning  # noqa: E402

PARTS = ("tests", "kernels", "engines", "hf", "memory", "first_call")
EXTRA_PARTS = ("tune",)  # run only when named: they do not fit the 10-minute run beside the others
GPU_BUDGET_S = 540  # the whole run on a GPU, seconds: 10 minutes less the build and the start of the machine
PYTEST = ["-m", "pytest", "-q", "-p", "no:cacheprovider"]
# The tests part's second run: the kernel tests compiled on the device (NDP_TEST_DEVICE=cuda: tests/conftest.py puts
# tensors and generators on the GPU), in parallel where pytest-xdist is installed (the compiles take the time); the
# tuner's tests and the ahead-of-time compiles are CPU checks.
KERNEL_TESTS = (PYTEST + (["-n", "8", "-p", "no:benchmark"] if importlib.util.find_spec("xdist") else [])
                + ["tests/kernels", "--ignore=tests/kernels/test_tune.py", "--ignore=tests/kernels/test_aot.py"])
# (arguments on a GPU, arguments in the smoke mode, time limit on a GPU in seconds). Limits from the first H100 run
# (2026-11-26), cold caches: tests 172 s for the GPU tests (their Triton compiles) + about 100 s for the kernel
# tests, kernels 37 s, engines 15 s, hf 16 s, memory 46 s, first_call 38 s.
COMMANDS = {
    "tests": (PYTEST + ["-m", "gpu", "tests"], None, 330),
    "kernels": (["bench/bench_kernels.py", "--seqlens", "1024,4096,16384", "--head-dims", "128"],
                ["bench/bench_kernels.py", "--smoke", "--no-static-report"], 120),
    "engines": (["bench/bench_engines.py", "--only", "single", "--only", "host", "--seqlens", "1024,4096,16384"],
                ["bench/bench_engines.py", "--only", "single", "--only", "host", "--seqlens", "128", "--iters", "2"],
                60),
    "hf": (["bench/bench_engines.py", "--only", "hf", "--hf-seqlen", "4096", "--hf-steps", "5"],
           ["bench/bench_engines.py", "--only", "hf", "--hf-seqlen", "128", "--hf-steps", "2"], 60),
    "memory": (["bench/bench_memory.py", "--device", "cuda", "--seqlens", "8192", "--vocabs", "128256", "--hidden",
                "4096", "--dtype", "bfloat16"],
               ["bench/bench_memory.py", "--seqlens", "256", "--vocabs", "1024", "--hidden", "32"], 90),
    "first_call": (["bench/first_call.py", "--shape", "2,4096,32,8,128", "--dtype", "bfloat16"],
                   ["bench/first_call.py", "--shape", "1,128,4,2,64", "--dtype", "float32"], 120),
    "tune": (["-m", "ndp_kernels.tune", "--head-dims", "128", "--dtypes", "bfloat16"], None, 360),
}
# Why a part with no smoke-mode command is skipped without a GPU.
NO_SMOKE = {"tests": "no CUDA device: the GPU tests need one",
            "tune": "no CUDA device: tuning times the kernels on the GPU they run on"}
# Seconds a part that keeps to a budget of its own (``--budget-s``) leaves for starting and writing its results.
TUNE_MARGIN_S = 30


def run_part(part: str, gpu: bool, out: str, limit_s: float | None, budget_s: float | None = None) -> dict:
    """Runs one part in fresh processes within min(its limit, `budget_s` left of the run); returns its record
    (status, seconds, command, output tail)."""
    args = COMMANDS[part][0 if gpu else 1]
    if args is None:
        return dict(part=part, status="skipped", reason=NO_SMOKE[part], seconds=0.0)
    limit = limit_s or (COMMANDS[part][2] if gpu else 300)
    if budget_s is not None and budget_s < 1:
        return dict(part=part, status="not run", reason="the run's time budget (--budget-s) was spent", seconds=0.0)
    limit = limit if budget_s is None else min(limit, budget_s)
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if part == "first_call":
        caches = tempfile.mkdtemp(prefix="ndp-first-call-")
        env.update(TRITON_CACHE_DIR=os.path.join(caches, "triton"), NDP_TUNING_DIR=os.path.join(caches, "tuning"))
        runs = [(args + ["--label", label, "--out", out], {}) for label in ("cold", "warm")]
    elif part == "tests":
        runs = [(args, {}), (KERNEL_TESTS, {"NDP_TEST_DEVICE": "cuda"})]
    elif part == "tune":  # into the user's tuning table (the later parts read it), within the part's time
        runs = [(args + ["--budget-s", str(round(max(limit - TUNE_MARGIN_S, 1)))], {})]
    else:
        runs = [(args + ["--out", out], {})]
    t0, tail, status = time.perf_counter(), "", "ok"
    for a, extra in runs:
        left = limit - (time.perf_counter() - t0)
        try:
            proc = subprocess.run([sys.executable] + a, cwd=ROOT, env=dict(env, **extra), capture_output=True,
                                  text=True, timeout=max(left, 1))
        except subprocess.TimeoutExpired as e:
            status, tail = f"ran past its {limit:.3g} s limit", tail + _text(e.stdout) + _text(e.stderr)
            break
        tail += proc.stdout + proc.stderr
        if proc.returncode and status == "ok":  # the part's later runs still run (the kernel tests after the others)
            status = f"failed (exit {proc.returncode})"
    with open(os.path.join(out, "output.txt"), "w") as f:
        f.write(tail)
    command = " ; ".join(" ".join([f"{k}={v}" for k, v in extra.items()] + ["python"] + a) for a, extra in runs)
    return dict(part=part, status=status, seconds=round(time.perf_counter() - t0, 1), command=command,
                tail=tail[-1500:])


def copy_tuning_tables(base: str) -> list[str]:
    """The tuning tables in ``ndp_kernels.tuning.tuning_dir()`` (what the parts measured on this GPU, the kernels' and
    the engines'), copied into ``<base>/tuning/`` so that the report's archive carries them off the machine."""
    src = tuning.tuning_dir()
    names = sorted(p.name for p in src.glob("*.json")) if src.is_dir() else []
    if names:
        os.makedirs(os.path.join(base, "tuning"), exist_ok=True)
    for name in names:
        shutil.copy2(src / name, os.path.join(base, "tuning", name))
    return names


def _text(x) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def _load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def kernels_section(d: str) -> list[str]:
    """TFLOP/s (p50) per provider by sequence length, one table per (mode, mask); smoke: errors and times."""
    rows = next((_load(os.path.join(d, f)) for f in sorted(os.listdir(d)) if f.startswith("kernels_")
                 and f.endswith(".json") and not f.endswith("_ratios.json")), None) if os.path.isdir(d) else None
    if not rows:
        return ["no kernel rows were written"]
    if "tflops_p50" not in rows[0]:
        header = ("provider", "seqlen", "causal", "fwd s", "bwd s", "max err out", "max err grads", "ok")
        return [markdown_table(header, [(r["provider"], str(r["seqlen"]), str(r["causal"]), f"{r['fwd_s']:.2f}",
                                         f"{r['bwd_s']:.2f}", f"{r['max_err_out']:.1e}", f"{r['max_err_grad']:.1e}",
                                         str(r["ok"])) for r in rows])]
    lines = []
    providers = sorted({r["provider"] for r in rows})
    seqlens = sorted({r["seqlen"] for r in rows})
    for mode in ("fwd", "bwd", "fwd+bwd"):
        for causal in (True, False):
            sel = [r for r in rows if r["mode"] == mode and r["causal"] == causal]
            if not sel:
                continue
            d_ = sel[0]["head_dim"]
            got = {p: {r["seqlen"]: r.get("tflops_p50") for r in sel if r["provider"] == p} for p in providers}
            table = [(p, *(f"{got[p][s]:.0f}" if got[p].get(s) else "-" for s in seqlens)) for p in providers if got[p]]
            lines += ["", f"{mode}, {'causal' if causal else 'full'}, head_dim {d_}, TFLOP/s (p50):", "",
                      markdown_table(("provider", *(f"S={s}" for s in seqlens)), table)]
    pngs = [f for f in os.listdir(d) if f.endswith(".png")]
    lines += [""] + [f"![kernels](kernels/{p})" for p in pngs]
    return lines


def engines_section(d: str) -> list[str]:
    data = _load(os.path.join(d, "bench_engines.json"))
    if not data:
        return ["no engine rows were written"]
    header = ("provider", "shape", "ms (p50)", "p20", "p80", "ratio to the first", "tokens/s", "host syncs / step")
    return [markdown_table(header, [(r["provider"], str(r["shape"]), f"{r['ms']:.2f}", f"{r['p20']:.2f}",
                                     f"{r['p80']:.2f}", f"{r['ratio']:.3f}", _or_dash(r.get("tokens_per_s"), ".0f"),
                                     _or_dash(r.get("host_syncs"), "d")) for r in data["rows"]])]


def _or_dash(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def first_call_section(d: str) -> list[str]:
    try:
        with open(os.path.join(d, "first_call.jsonl")) as f:
            rows = [json.loads(x) for x in f if x.strip()]
    except OSError:
        return ["no first-call rows were written"]
    header = ("caches", "call", "forward s", "backward s", "Triton cache files added")
    return [markdown_table(header, [(r["label"], str(r["call"]), f"{r['fwd_s']:.3f}", f"{r['bwd_s']:.3f}",
                                     str(r["triton_cache_files_added"])) for r in rows])]


def memory_section(d: str) -> list[str]:
    data = _load(os.path.join(d, "memory.json"))
    if not data:
        return ["no memory rows were written"]
    header = ("loss", "seq", "vocab", "peak growth MiB", "x one fp32 logits tensor", "ms")
    rows = [(r["loss"], str(r["seq"]), str(r["vocab"]), f"{r['peak_growth_bytes'] / 2 ** 20:.0f}",
             f"{r['x_logits']:.3f}", f"{r['seconds'] * 1e3:.1f}") for r in data["rows"]]
    return [f"device {data['device']}, hidden {data['hidden']}, {data['dtype']}, chunk {data['chunk_mib']} MiB:", "",
            markdown_table(header, rows)]


def tune_section(d: str) -> list[str]:
    """The tuner's line per kernel (best tile, its time, the static and the table's tiles against it)."""
    try:
        with open(os.path.join(d, "output.txt")) as f:
            found = [x.strip() for x in f if ": best " in x or x.startswith("wrote ")]
    except OSError:
        return ["no tuning output was written"]
    return [f"- {x}" for x in found] or ["no kernel was tuned"]


SECTIONS = {"tune": tune_section, "kernels": kernels_section, "engines": engines_section, "hf": engines_section,
            "memory": memory_section, "first_call": first_call_section}


def write_report(records: list[dict], base: str, gpu: bool, device: str) -> str:
    meta = dict(device=device, torch=torch.__version__, triton=_version("triton"),
                transformers=_version("transformers"), git_sha=bench_cp._git_sha(),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    lines = [f"# ndp GPU report: {device}", "",
             ", ".join(f"{k} {v}" for k, v in meta.items() if k != "device"), ""]
    if not gpu:
        lines += ["**Smoke mode: no CUDA device.** Every part ran on tiny CPU shapes (Triton interpreter) to check "
                  "the path; no GPU figure was measured. Run `make gpu-report` on a GPU for the figures.", ""]
    status = [(r["part"], r["status"] + (": " + r["reason"] if r.get("reason") else ""), str(r["seconds"]))
              for r in records]
    lines += [markdown_table(("part", "status", "seconds"), status)]
    for r in records:
        lines += ["", f"## {r['part']}", ""]
        if r.get("command"):
            lines += [f"`{r['command']}`", ""]
        if r.get("reason"):
            lines += [r["reason"]]
        if r["part"] == "tests" and r.get("tail"):
            lines += _pytest_outcome(os.path.join(base, "tests", "output.txt"))
        elif r["status"] != "ok" and r.get("tail"):
            lines += ["```", r["tail"].strip()[-1200:], "```"]
        if r["part"] in SECTIONS:
            lines += SECTIONS[r["part"]](os.path.join(base, r["part"]))
    os.makedirs(base, exist_ok=True)
    path = os.path.join(base, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(base, "report.json"), "w") as f:
        json.dump(dict(meta=meta, gpu=gpu, parts=records), f, indent=1)
    return path


def _pytest_outcome(path: str) -> list[str]:
    """What the pytest runs in the output file `path` ended with: each run's closing line and every test that
    failed or errored (the output's tail is mostly plugin warnings)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return []
    failed = [x.strip() for x in text.splitlines() if re.match(r"(FAILED|ERROR) \S+", x)]
    return _pytest_summaries(text) + ([""] + [f"- {x}" for x in failed] if failed else [])


def _pytest_summaries(text: str) -> list[str]:
    """The closing line of each pytest run in `text` ("12 passed, 1 skipped in 3.1s")."""
    return [x.strip("= ") for x in text.splitlines()
            if re.search(r"\d+ (passed|failed|skipped|errors?|deselected)\b.* in [\d.]+s", x)]


def _version(mod: str) -> str:
    try:
        return __import__(mod).__version__
    except ImportError:
        return "not installed"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"comma-separated, run in the order given: {','.join(PARTS)} (default: all of them), and "
                         f"when named {','.join(EXTRA_PARTS)}")
    ap.add_argument("--smoke", action="store_true", help="the CPU smoke mode even where a GPU is present")
    ap.add_argument("--limit-s", type=float, default=None, help="time limit per part (default: per part)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help=f"time budget of the whole run (default: {GPU_BUDGET_S} s on a GPU, none in the smoke mode)")
    ap.add_argument("--archive", default=None, help="also pack the report folder into this .tar.gz file")
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    known = PARTS + EXTRA_PARTS
    unknown = sorted(set(parts) - set(known))
    if not parts:
        ap.error(f"--parts names no part; choose from {','.join(known)}")
    if unknown:
        ap.error(f"unknown parts {unknown}; choose from {','.join(known)}")
    gpu = torch.cuda.is_available() and not args.smoke
    device = torch.cuda.get_device_name(0) if gpu else "cpu (smoke mode)"
    base = os.path.join(args.out, re.sub(r"[^A-Za-z0-9]+", "_", device).strip("_"))
    budget = args.budget_s if args.budget_s is not None else (GPU_BUDGET_S if gpu else None)
    records, t0 = [], time.perf_counter()
    for part in parts:
        print(f"gpu-report: {part} ...", flush=True)
        left = None if budget is None else budget - (time.perf_counter() - t0)
        records.append(run_part(part, gpu, os.path.join(base, part), args.limit_s, left))
        print(f"gpu-report: {part}: {records[-1]['status']} ({records[-1]['seconds']} s)", flush=True)
        path = write_report(records, base, gpu, device)
    tables = copy_tuning_tables(base)
    print(f"report: {path}" + (f"; tuning tables: {', '.join(tables)} (in tuning/)" if tables else ""))
    if args.archive:
        with tarfile.open(args.archive, "w:gz") as tar:
            tar.add(base, arcname=os.path.basename(base))
        print(f"archive: {args.archive}")
    return 0 if all(r["status"] in ("ok", "skipped") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
