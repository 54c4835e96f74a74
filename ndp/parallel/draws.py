"""Random draws that must agree across ranks: spans of a model's forward run on random streams shared by a group.

Tensor parallel leaves activations whole on every TP rank (the embeddings, the residual stream, a row-split layer's
summed output), each rank computing the same values. A dropout there must draw one mask on every TP rank: drawn apart
(ranks seeded each their own, as Accelerate's ``set_seed(device_specific=True)`` seeds them), each rank runs another
forward, the whole parameters' gradients differ between the ranks and the model's copies drift apart, silently. So
in training :func:`share_tp_draws` runs a model's forward on TP rank 0's random streams (the CPU's and the compute
device's, broadcast at the forward's start) on every TP rank: the forward draws as TP rank 0's alone would, as one
process seeded like TP rank 0 draws. After it, TP rank 0's streams are where the forward left them; the other TP
ranks' are their own again. Cost: one broadcast of the streams' states (~5 KB) over the TP group and a host read per
training forward.

A dropout on an activation the plan splits (a plan of one's own that drops out a column-split layer's output) draws
the same mask on each rank's part. Spans nest (:class:`Draws`): a vision tower's draws, shared by the CP and TP ranks
(``ndp.hf.multimodal``), inside the forward's.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .mesh import mesh_device

DRAWS_ATTR = "ndp_draws"  # the root module's Draws


class Draws:
    """A model's stack of this rank's random-stream states (CPU, and the compute device's), one entry per shared
    span of the forward that is running: a span saves the states it replaces, ``unwind`` restores them. Unwinding
    to a depth makes the spans' ends independent of the order their hooks run in."""

    def __init__(self):
        self.saved: list[list | None] = []

    def share_states(self, group, device) -> int:
        """Continue on the streams of `group`'s first rank (its own kept there: it draws on as alone); the depth
        to unwind to."""
        depth, gens = len(self.saved), _generators(device)
        states = [g.get_state() for g in gens]
        sizes = [s.numel() for s in states]
        packed = torch.cat(states).to(device)
        dist.broadcast(packed, group=group, group_src=0)
        self.saved.append(None if dist.get_rank(group) == 0 else list(zip(gens, states)))
        for g, s in zip(gens, packed.cpu().split(sizes)):
            g.set_state(s)
        return depth

    def share_seed(self, groups, device) -> int:
        """Continue on fresh streams seeded alike on every rank of `groups` (each group's first rank's seed, in
        turn: the first rank of all of them), drawn from this rank's streams; the depth to unwind to."""
        depth, gens = len(self.saved), _generators(device)
        seed = torch.randint(2 ** 62, (1,), dtype=torch.int64).to(device)
        for group in groups:
            dist.broadcast(seed, group=group, group_src=0)
        self.saved.append([(g, g.get_state()) for g in gens])
        seed = int(seed.item())
        for g in gens:
            g.manual_seed(seed)
        return depth

    def unwind(self, depth: int) -> None:
        """End the spans above `depth` (a no-op where they ended)."""
        while len(self.saved) > depth:
            for g, state in self.saved.pop() or ():
                g.set_state(state)


def draws_of(model: nn.Module) -> Draws:
    """The root module's :class:`Draws` (made on first use)."""
    draws = getattr(model, DRAWS_ATTR, None)
    if draws is None:
        draws = Draws()
        setattr(model, DRAWS_ATTR, draws)
    return draws


def _generators(device) -> list:
    gens = [torch.default_generator]
    if device.type == "cuda":
        gens.append(torch.cuda.default_generators[device.index if device.index is not None else
                                                  torch.cuda.current_device()])
    return gens


def share_tp_draws(model: nn.Module, tp_mesh) -> None:
    """In training, `model`'s forwards draw from TP rank 0's random streams on every rank of `tp_mesh` (module
    docstring); a no-op for one rank."""
    if tp_mesh.size() == 1:
        return
    draws, depths = draws_of(model), []

    @torch.compiler.disable
    def enter(module, args, kwargs):
        if module.training:
            depths.append(draws.share_states(tp_mesh.get_group(), mesh_device(tp_mesh)))

    @torch.compiler.disable
    def leave(module, args, kwargs, output):
        if depths:
            draws.unwind(depths.pop())

    # first: a span nested in the forward's (a tower's, ndp.hf.multimodal) starts inside it
    model.register_forward_pre_hook(enter, with_kwargs=True, prepend=True)
    model.register_forward_hook(leave, with_kwargs=True, always_call=True)


__all__ = ["Draws", "draws_of", "share_tp_draws", "DRAWS_ATTR"]
