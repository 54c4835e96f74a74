"""Local attention backends (layer ``ndp/ops`` of docs/design.md)."""
from .attention import (BACKENDS, attention, attention_backward, attention_bwd, attention_fwd, available_backends,
                        resolve_backend)

__all__ = ["BACKENDS", "attention", "attention_fwd", "attention_bwd", "attention_backward",
           "available_backends", "resolve_backend"]
