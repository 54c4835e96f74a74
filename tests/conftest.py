import os
import sys

# Triton kernels run on CPU tensors only under the interpreter; the flag is read when kernels are
# decorated, so it must be set before anything imports triton.
# NDP_TEST_DEVICE=cuda runs the kernel tests compiled on a GPU instead (on a GPU machine): tensors made without a
# device, and the tests' seeded generators, land on the GPU.
GPU_MODE = os.environ.get("NDP_TEST_DEVICE") == "cuda"
os.environ.setdefault("TRITON_INTERPRET", "0" if GPU_MODE else "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")
# The interpreter's matmuls are tiny: a multithreaded BLAS under an oversubscribed machine only adds
# nondeterminism.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

if GPU_MODE:
    import torch

    torch.set_default_device("cuda")
    _Generator = torch.Generator
    torch.Generator = lambda device="cuda": _Generator(device)
