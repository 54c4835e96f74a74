"""Communication and work counters for context-parallel attention (`CommStats`)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

__all__ = ["CommStats"]

# The open CommStats of this process. A process-wide list (not a ContextVar) on purpose: on GPU the
# autograd engine runs backward on its own threads, and the backward's transfers must still be counted
# by the `with CommStats()` block that is open around `loss.backward()`.
_ACTIVE: list["CommStats"] = []
_LOCK = threading.Lock()


@dataclass
class OpStats:
    """Totals for one kind of transfer (`p2p`, `all_gather`, `reduce_scatter`, `all_to_all`, ...)."""
    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


@dataclass
class CommStats:
    """Counts, on this rank, the bytes ndp.cp moves and the attention FLOPs it computes.

    Use as a context manager::

        with ndp.cp.CommStats() as st:
            out = ndp.ring_attention(q, k, v, group=g)
            out.sum().backward()
        st.bytes_sent, st.bytes_received, st.attn_flops, st.by_op["p2p"].bytes_sent

    Bytes are the payload this rank sends and receives with a bandwidth-optimal algorithm for each
    collective: P2P exact; all-gather (N-1) local chunks each way; reduce-scatter and all-to-all
    (N-1)/N of the input each way; all-reduce 2(N-1)/N of it. `attn_flops` counts 4*B*H*D per visible
    (query, key) pair of every block the schedule ran in forward, and 2.5x that in backward (the FLOP
    convention of docs/design.md).
    `fwd_flops`/`bwd_flops` split it; `by_op` is a dict op-kind -> OpStats.

    Nested and concurrent CommStats all record. Counts are per process (per rank), not summed over
    the group.
    """
    bytes_sent: int = 0
    bytes_received: int = 0
    attn_flops: int = 0
    fwd_flops: int = 0
    bwd_flops: int = 0
    by_op: dict = field(default_factory=dict)

    def __enter__(self) -> "CommStats":
        with _LOCK:
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _LOCK:
            for i in range(len(_ACTIVE) - 1, -1, -1):
                if _ACTIVE[i] is self:
                    del _ACTIVE[i]
                    break

    def _add_comm(self, op: str, sent: int, received: int) -> None:
        s = self.by_op.setdefault(op, OpStats())
        s.calls += 1
        s.bytes_sent += sent
        s.bytes_received += received
        self.bytes_sent += sent
        self.bytes_received += received

    def _add_flops(self, flops: int, backward: bool) -> None:
        self.attn_flops += flops
        if backward:
            self.bwd_flops += flops
        else:
            self.fwd_flops += flops


def record_comm(op: str, sent: int, received: int) -> None:
    """Adds one transfer to every open CommStats (no-op when none is open)."""
    if not _ACTIVE:
        return
    with _LOCK:
        for st in _ACTIVE:
            st._add_comm(op, int(sent), int(received))


def record_flops(flops: int, backward: bool = False) -> None:
    """Adds attention FLOPs to every open CommStats."""
    if not _ACTIVE or not flops:
        return
    with _LOCK:
        for st in _ACTIVE:
            st._add_flops(int(flops), backward)


def nbytes(t) -> int:
    return t.numel() * t.element_size()


def all_gather_flat(out, inp, group, async_op=False):
    """dist.all_gather_single (all_gather_into_tensor before torch 2.13) with byte accounting."""
    import torch.distributed as dist

    world = out.numel() // max(inp.numel(), 1) if inp.numel() else dist.get_world_size(group)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = fn(out, inp, group=group, async_op=async_op)
    record_comm("all_gather", nbytes(inp) * (world - 1), nbytes(inp) * (world - 1))
    return work


def all_reduce_sum(t, group):
    """dist.all_reduce (sum, in place) with byte accounting (a ring's: 2(N-1)/N of the tensor each way)."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    dist.all_reduce(t, group=group)
    moved = 2 * nbytes(t) * (world - 1) // world
    record_comm("all_reduce", moved, moved)
    return t


def reduce_scatter_flat(out, inp, group, async_op=False):
    """dist.reduce_scatter_single (reduce_scatter_tensor before torch 2.13), sum, with byte accounting."""
    import torch.distributed as dist

    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    work = fn(out, inp, group=group, async_op=async_op)
    moved = nbytes(inp) - nbytes(out)   # (N-1)/N of the input each way
    record_comm("reduce_scatter", moved, moved)
    return work
