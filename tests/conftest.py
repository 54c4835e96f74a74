import os
import sys

import pytest

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

    class _CudaGenerator(torch.Generator):
        """torch.Generator() on the GPU: a subclass, not a function, since torch's own modules annotate with
        ``torch.Generator | None`` at import (torch.distributed.tensor)."""

        def __new__(cls, device="cuda"):
            return super().__new__(cls, device)

    torch.set_default_device("cuda")
    torch.Generator = _CudaGenerator


def pytest_collection_modifyitems(config, items):
    """With NDP_TEST_DEVICE=cuda the kernel tests run on the GPU: the tests of a CPU path do not apply."""
    if not GPU_MODE:
        return
    skip = pytest.mark.skip(reason="checks a CPU path; here the kernel tests run on the GPU (NDP_TEST_DEVICE=cuda)")
    for item in items:
        if "cpu_only" in item.keywords:
            item.add_marker(skip)
