"""The wheel: `pip wheel --no-build-isolation .` builds it (with ndp._C), it installs into a fresh venv and
imports there. Marked slow (about a minute: one compile of the C++ ops, a venv, an install).

The fresh venv reuses the test venv's torch and other dependencies through a .pth file (no download, no
second 200 MB torch install) but gets its own site-packages, where the wheel installs; the checks run from
a scratch directory so the repository on sys.path cannot mask the installed package.
"""
import ast
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "csrc", "ndp", "ndp_kernels")


def _run(cmd, cwd, timeout, env=None):
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def _copy_sources(dst):
    # Build from a copy: the repository's build/ dir and the editable ndp/_C*.so must not leak into the wheel.
    ignore = shutil.ignore_patterns("__pycache__", "_C*.so", "*.egg-info", "build", "dist")
    for name in SOURCES:
        src = os.path.join(ROOT, name)
        if os.path.isdir(src):
            shutil.copytree(src, dst / name, ignore=ignore)
        elif os.path.exists(src):
            shutil.copy2(src, dst / name)


def test_wheel_builds_installs_and_imports_in_fresh_venv(tmp_path):
    src, wheels, venv, scratch = (tmp_path / d for d in ("src", "wheels", "venv", "scratch"))
    src.mkdir()
    scratch.mkdir()
    _copy_sources(src)
    env = dict(os.environ, MAX_JOBS=os.environ.get("MAX_JOBS", "2"), NDP_BUILD_CUDA="0")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w", str(wheels),
          str(src)], cwd=tmp_path, timeout=600, env=env)
    (wheel,) = list(wheels.glob("ndp-*.whl"))

    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("ndp/_C") and n.endswith(".so") for n in names), names
    for must in ("ndp/__init__.py", "ndp/_ops.py", "ndp/info.py", "ndp_kernels/__init__.py",
                 "ndp/ops/tables/engines-cpu.json", "ndp/ops/tables/engines-NVIDIA_H100_80GB_HBM3.json",
                 "ndp_kernels/tables/kernels-NVIDIA_H100_80GB_HBM3.json",
                 "ndp/plan/data/gpus.json", "ndp/train/assets/models.json"):
        assert must in names, f"{must} missing from the wheel"
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    for extra in ("flash", "hf", "test", "bench"):
        assert f"Provides-Extra: {extra}" in meta, f"extra [{extra}] missing"
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "ndp-train = ndp.train.cli:main" in entry
    assert "ndp-plan = ndp.plan.cli:main" in entry

    # --without-pip: no bundled (old) setuptools that would shadow the one torch requires; the test venv's pip
    # installs into it with --python.
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path, timeout=120)
    vpy = venv / "bin" / "python"
    vsite = _run([str(vpy), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                 cwd=scratch, timeout=60).strip()
    # torch, triton, numpy, ... from the test venv, after the fresh venv's own site-packages
    (open(os.path.join(vsite, "_ndp_test_deps.pth"), "w")
     .write(sysconfig.get_paths()["purelib"] + "\n"))
    # --no-index: every requirement must already be satisfied (by the .pth), nothing is downloaded
    _run([sys.executable, "-m", "pip", "--python", str(vpy), "install", "-q", "--no-index", str(wheel)],
         cwd=scratch, timeout=300)

    out = _run([str(vpy), "-c",
                "import ndp, ndp._C, ndp._ops, ndp.info, torch\n"
                "assert ndp.__file__.startswith(" + repr(vsite) + "), ndp.__file__\n"
                "assert ndp._ops.load_error is None, ndp._ops.load_error\n"
                "print(torch.ops.ndp.shard_index(8, 2, 1, 'zigzag').tolist())\n"
                "ndp.info.main([])\n"], cwd=scratch, timeout=300)
    assert "[2, 3, 4, 5]" in out and "compiled ops (torch.ops.ndp.*): loaded" in out, out


def _setup_function(name):
    # setup.py calls setup() when run: compile the one function from its source instead.
    with open(os.path.join(ROOT, "setup.py")) as f:
        (fn,) = [n for n in ast.parse(f.read()).body if isinstance(n, ast.FunctionDef) and n.name == name]
    scope = {"os": os, "shutil": shutil}
    exec(compile(ast.Module([fn], []), "setup.py", "exec"), scope)
    return scope[name]


def test_cuda_build_takes_only_the_headers_its_toolkit_lacks_from_the_torch_wheels(tmp_path):
    # torch 2.15's wheels ship CUDA 13.2 runtime headers; before nvcc 13.0's own they stop the build.
    link = _setup_function("_link_missing_headers")
    toolkit, cu13, cudnn = tmp_path / "toolkit", tmp_path / "cu13", tmp_path / "cudnn"
    for d, names in ((toolkit, ["cuda_runtime_api.h", "cccl/"]), (cu13, ["cuda_runtime_api.h", "cccl/", "cublas.h"]),
                     (cudnn, ["cudnn.h", "cublas.h"])):
        d.mkdir()
        for n in names:
            if n.endswith("/"):
                (d / n).mkdir()
            else:
                (d / n).write_text(n)
    for _ in range(2):  # a rebuild replaces the links
        dest = link([str(cu13), str(cudnn)], str(toolkit), str(tmp_path / "links"))
        assert sorted(os.listdir(dest)) == ["cublas.h", "cudnn.h"]
        assert os.path.realpath(os.path.join(dest, "cublas.h")) == str(cu13 / "cublas.h")
