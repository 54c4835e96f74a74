"""Attention sinks: a learnable logit per query head that joins every row's softmax denominator (gpt-oss).

The sink has no value, so it only rescales a row. With a row's final lse over its keys (after every block and
every CP merge), ``lse' = logaddexp(lse, sink)`` and ``out' = out * exp(lse - lse')``: the sink enters the fp32
merge once, after the last block. Backward: the plain attention backward run with ``(out', lse')`` instead of
``(out, lse)`` gives exact dq, dk, dv (its ``rowsum(dout * out')`` is the softmax's term over keys and sink), and
``d sink[h] = -sum over rows of exp(sink[h] - lse') * rowsum(dout * out')``.

Layouts are those of the CP and ops autograd Functions: out ``[B, S, H, D]``, lse ``[B, H, S]``.
"""
from __future__ import annotations

import torch

__all__ = ["check_sinks", "add_sinks", "sinks_grad"]


def check_sinks(sinks, heads: int, device) -> None:
    """Raises ValueError / TypeError unless `sinks` is None or a floating ``[heads]`` tensor on `device`."""
    if sinks is None:
        return
    if not torch.is_tensor(sinks) or not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating-point tensor of shape [heads]; got {type(sinks).__name__}"
                        f"{'' if not torch.is_tensor(sinks) else ' of dtype ' + str(sinks.dtype)}")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks must have shape [heads] = [{heads}] (one logit per query head of this call); got "
                         f"{tuple(sinks.shape)}. Under tensor parallelism pass this rank's heads' sinks.")
    if sinks.device != torch.device(device):
        raise ValueError(f"sinks are on {sinks.device} but q is on {device}; move them to q's device.")


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, dtype: torch.dtype):
    """(out', lse'): the rows of (out, lse) with the sinks joined, out' in `dtype`, lse' in lse's dtype."""
    s = sinks.detach().to(lse.dtype)[None, :, None]
    lse2 = torch.logaddexp(lse, s)
    # Rows with no key (lse = -inf) give all their weight to the sink: out' = 0, lse' = sink.
    scale = torch.exp(lse - lse2).transpose(1, 2).unsqueeze(-1)
    return (out.to(lse.dtype) * scale).to(dtype), lse2


def sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks ``[H]`` (sinks' dtype) from the rows' dout, final out' and lse'."""
    acc = lse.dtype
    d = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)       # [B, H, S]
    p = torch.exp(sinks.detach().to(acc)[None, :, None] - lse)
    return -(p * d).sum((0, 2)).to(sinks.dtype)
