"""Build and packaging of ndp.

The compiled extension ``ndp._C`` (torch.ops.ndp.*) is built with torch's extension builder (ninja):

* the C++ CPU ops (csrc/ops.cpp) always;
* the CUDA ops (csrc/ops_cuda.cu + csrc/kernels/*.cu) when the installed torch is a CUDA build and nvcc is
  found (``$CUDA_HOME/bin/nvcc``, CUDA_HOME defaulting to /usr/local/cuda). ``TORCH_CUDA_ARCH_LIST`` is
  honoured and defaults to "8.0;9.0". ``NDP_BUILD_CUDA=0`` forces a CPU-only build, ``NDP_BUILD_CUDA=1``
  fails instead of silently skipping CUDA.

Build with the torch that is already installed: ``pip install --no-build-isolation -e .`` (or
``pip wheel --no-build-isolation .``); build isolation would fetch another torch.
"""

import glob
import os
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("csrc")


def _default_cuda_home():
    # torch's builder guesses CUDA_HOME from `which nvcc`; /usr/local/bin/nvcc would give /usr/local and the link
    # then fails on -lcudart. Point it at the toolkit before torch.utils.cpp_extension is imported.
    if not os.environ.get("CUDA_HOME") and not os.environ.get("CUDA_PATH"):
        if os.path.exists("/usr/local/cuda/bin/nvcc"):
            os.environ["CUDA_HOME"] = "/usr/local/cuda"


_default_cuda_home()
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")

import torch  # noqa: E402  (CUDA_HOME must be set first)
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def _cuda_decision():
    """Returns (build_cuda: bool, reason: str)."""
    want = os.environ.get("NDP_BUILD_CUDA", "auto").strip().lower()
    if want in ("0", "false", "no", "off"):
        return False, "NDP_BUILD_CUDA=0"
    missing = []
    if not torch.version.cuda:
        missing.append(f"torch {torch.__version__} is not a CUDA build")
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        missing.append(f"nvcc not found (CUDA_HOME={CUDA_HOME!r})")
    if missing:
        if want in ("1", "true", "yes", "on"):
            sys.exit("NDP_BUILD_CUDA=1 but the CUDA ops cannot be built: " + "; ".join(missing))
        return False, "; ".join(missing)
    return True, f"torch CUDA {torch.version.cuda}, nvcc at {nvcc}, archs {os.environ['TORCH_CUDA_ARCH_LIST']}"


def _link_missing_headers(wheel_dirs, toolkit_include, dest):
    """Links into ``dest`` each entry of ``wheel_dirs`` (first wins) that ``toolkit_include`` lacks; returns dest."""
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    for d in wheel_dirs:
        for name in sorted(os.listdir(d)):
            link = os.path.join(dest, name)
            if not os.path.exists(os.path.join(toolkit_include, name)) and not os.path.lexists(link):
                os.symlink(os.path.join(d, name), link)
    return dest


def _cuda_include_dirs():
    # CUDA torch wheels ship the headers torch's own headers include (cuBLAS, cuSPARSE, ...) in the nvidia-* wheels
    # (site-packages/nvidia/cu13/include, or nvidia/<lib>/include for older layouts), beside a CUDA runtime's
    # headers. nvcc must keep its own runtime headers (torch 2.15's CUDA 13.2 headers stop nvcc 13.0: "CUDA compiler
    # and CUDA toolkit headers are incompatible"), so one folder links in only what the toolkit lacks.
    site = os.path.dirname(os.path.dirname(torch.__file__))
    wheel_dirs = sorted(glob.glob(os.path.join(site, "nvidia", "cu*", "include")))
    wheel_dirs = list(dict.fromkeys(wheel_dirs + sorted(glob.glob(os.path.join(site, "nvidia", "*", "include")))))
    dest = os.path.join(ROOT, "build", "cuda-wheel-headers")
    return [_link_missing_headers(wheel_dirs, os.path.join(CUDA_HOME, "include"), dest)]


def _extensions():
    build_cuda, reason = _cuda_decision()
    print(f"ndp: building ndp._C with {'CPU + CUDA' if build_cuda else 'CPU only'} ops ({reason})")
    cxx = ["-O3"]
    include_dirs = [os.path.join(ROOT, "csrc")]
    if not build_cuda:
        return [CppExtension("ndp._C", [os.path.join(CSRC, "ops.cpp")], include_dirs=include_dirs,
                             extra_compile_args={"cxx": cxx})]
    sources = [os.path.join(CSRC, "ops.cpp"), os.path.join(CSRC, "ops_cuda.cu")]
    sources += sorted(glob.glob(os.path.join(CSRC, "kernels", "*.cu")))
    return [CUDAExtension("ndp._C", sources, include_dirs=include_dirs + _cuda_include_dirs(),
                          define_macros=[("NDP_WITH_CUDA", "1")],
                          extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "--expt-relaxed-constexpr"]})]


setup(
    name="ndp",
    version="0.1.0",
    description="Context-parallel attention (ring, Ulysses, USP) with Triton and C++/CUDA kernels for PyTorch",
    python_requires=">=3.10",
    packages=find_packages(include=["ndp", "ndp.*", "ndp_kernels", "ndp_kernels.*"]),
    package_data={"ndp.train": ["assets/*.txt", "assets/*.py", "assets/*.json"], "ndp.ops": ["tables/*.json"],
                  "ndp.plan": ["data/*.json"], "ndp_kernels": ["tables/*.json"]},
    ext_modules=_extensions(),
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    install_requires=[
        "torch>=2.6",
        "triton; platform_system == 'Linux' and platform_machine == 'x86_64'",
        "numpy",
        "pyyaml",
        "tqdm",
        "transformers",
        "safetensors",
    ],
    extras_require={
        "flash": ["flash-attn>=2.6,<2.9"],
        "hf": ["transformers", "safetensors", "accelerate>=1.10", "trl>=1.0"],
        "test": ["pytest", "pytest-timeout", "transformers", "accelerate", "trl", "pyyaml"],
        "bench": ["matplotlib", "pytest-benchmark"],
    },
    entry_points={"console_scripts": ["ndp-train = ndp.train.cli:main", "ndp-plan = ndp.plan.cli:main"]},
    zip_safe=False,
)
