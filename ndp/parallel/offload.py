"""Activation offloading: the tensors autograd saves in the forward go to (pinned) host memory and come back
ahead of the backward that needs them.

``with ActivationOffload(device): loss = model(...)`` installs saved-tensor hooks for the forward. Each saved
floating-point tensor on ``device`` of at least ``min_bytes`` that is not a parameter is copied to host memory
(on CUDA: into pinned memory, on a side stream, overlapped with the forward; the device memory is released once
the copy is done) and replaced by a handle. In the backward, the first unpack of a tensor also starts the copies
back of the next ``prefetch_bytes`` of tensors in backward order (the reverse of the forward's), on the side
stream, so that they arrive while the current layer's gradients are computed.

With full activation checkpointing the saved tensors are the checkpointed layers' inputs (what stays on the
device through the forward is then one layer's activations and the copies in flight); without it, every
activation. On a CPU device the same logic runs (host copies are plain copies): it is what the tests exercise,
counting the bytes each handle keeps on the device.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["ActivationOffload", "OffloadStats"]

MIN_BYTES = 2 ** 20
PREFETCH_BYTES = 256 * 2 ** 20


@dataclass
class OffloadStats:
    """Byte counts of one ``ActivationOffload`` context (forward and backward)."""

    saved_bytes: int = 0            # every saved tensor's bytes, as autograd asked
    kept_bytes: int = 0             # of those, activation bytes left on the device (small tensors, other devices)
    param_bytes: int = 0            # of those, parameters (kept: they stay on the device anyway)
    prefetched_bytes: int = 0       # bytes brought back ahead of their unpack
    offloaded: list = field(default_factory=list)  # bytes of each offloaded tensor, in forward order

    @property
    def offloaded_bytes(self) -> int:
        """Of the saved bytes, those copied to the host."""
        return sum(self.offloaded)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter, a view of one (a linear layer saves ``weight.t()``) or a leaf that requires grad."""
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) or (t.is_leaf and t.requires_grad)


class _Handle:
    __slots__ = ("index", "host", "event", "device_copy", "nbytes", "used")

    def __init__(self, index, host, event, nbytes):
        self.index, self.host, self.event, self.nbytes = index, host, event, nbytes
        self.device_copy, self.used = None, False


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that offload activations to host memory (see the module docstring).

    Args:
        device: the compute device whose saved tensors are offloaded (others are kept as they are).
        min_bytes: smaller tensors are kept (a copy costs more than it frees).
        prefetch_bytes: how far ahead, in bytes, the backward brings tensors back.
        pin_memory: pinned host buffers on CUDA (asynchronous copies); ignored on CPU.
    """

    def __init__(self, device, *, min_bytes: int = MIN_BYTES, prefetch_bytes: int = PREFETCH_BYTES,
                 pin_memory: bool = True):
        self.device = torch.device(device)
        self.min_bytes, self.prefetch_bytes = min_bytes, prefetch_bytes
        self.cuda = self.device.type == "cuda"
        self.pin = pin_memory and self.cuda
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.stats = OffloadStats()
        self._handles: list[_Handle] = []
        super().__init__(self._pack, self._unpack)

    def _offloads(self, t: torch.Tensor) -> bool:
        return (t.device == self.device and t.is_floating_point() and _nbytes(t) >= self.min_bytes
                and type(t) is torch.Tensor)  # a DTensor or another subclass is kept

    def _pack(self, t: torch.Tensor):
        n = _nbytes(t)
        self.stats.saved_bytes += n
        if _is_parameter(t):
            self.stats.param_bytes += n
            return t
        if not self._offloads(t):
            self.stats.kept_bytes += n
            return t
        host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, device="cpu", pin_memory=self.pin)
        event = None
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            t.record_stream(self.stream)  # its memory is reused only once the copy is done
        else:
            host.copy_(t)
        h = _Handle(len(self._handles), host, event, n)
        self._handles.append(h)
        self.stats.offloaded.append(n)
        return h

    def _bring_back(self, h: _Handle) -> None:
        """Start the copy of ``h`` back to the device (on the side stream on CUDA)."""
        if self.cuda:
            self.stream.wait_event(h.event)
            with torch.cuda.stream(self.stream):
                h.device_copy = h.host.to(self.device, non_blocking=True)
                h.event = torch.cuda.Event()
                h.event.record(self.stream)
        else:
            h.device_copy = h.host.clone()

    def _prefetch(self, after: int) -> None:
        """Bring back the handles packed before index ``after`` (the next ones the backward unpacks)."""
        budget = self.prefetch_bytes
        for h in reversed(self._handles[:after]):
            if h.used:
                continue
            if budget < h.nbytes:
                break
            if h.device_copy is None:
                self._bring_back(h)
                self.stats.prefetched_bytes += h.nbytes
            budget -= h.nbytes

    def _unpack(self, h):
        if not isinstance(h, _Handle):
            return h
        if h.device_copy is None:
            self._bring_back(h)
        t, h.device_copy, h.used = h.device_copy, None, True  # the device copy lives as long as autograd needs it
        self._prefetch(h.index)
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(h.event)
            t.record_stream(current)
        return t
