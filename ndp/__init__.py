"""ndp: context-parallel attention for multi-GPU LLM training.

Layers (each knows only the ones below): ndp.train / ndp.hf -> ndp.parallel -> ndp.cp -> ndp.ops ->
ndp_kernels / the compiled ops ``torch.ops.ndp.*`` (ndp._C).
"""
from . import _ops  # noqa: F401  (registers torch.ops.ndp.* and their fake kernels when ndp._C is built)
from . import ops

__version__ = "0.1.0"
