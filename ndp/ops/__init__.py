"""Local attention backends (layer ``ndp/ops`` of docs/design.md)."""
from .attention import (BACKENDS, attention, attention_backward, attention_bwd, attention_fwd, available_backends,
                        resolve_backend)
from ._sdpa_cuda import set_kernel_order as set_sdpa_cuda_kernels
from .linear_ce import linear_cross_entropy
from . import tune  # noqa: F401  (registers the engines' first-use measurement: engines.use_tuner)

__all__ = ["BACKENDS", "attention", "attention_fwd", "attention_bwd", "attention_backward",
           "available_backends", "resolve_backend", "set_sdpa_cuda_kernels", "linear_cross_entropy"]
