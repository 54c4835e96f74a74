"""Rotary embeddings whose frequencies follow the sequence's length, exact under context parallelism.

transformers' dynamic NTK and LongRoPE (``rope_type`` "dynamic", "longrope": Phi-3 / Phi-3.5 / Phi-4 mini with
128k context, Phi-3.5 MoE) choose their frequencies in the rotary module's forward from the longest position it
is given (``dynamic_rope_update``: ``max(position_ids) + 1``, against the pretraining length). On a CP rank that
is its shard's longest, not the batch's: ranks holding the start of a sequence rotate their queries and keys with
other frequencies than the ranks holding its end, and the attention mixes them (measured on tiny float64 models
under cp 2, ``tests/hf/test_rope.py``: the loss and gradients of Phi-3 with LongRoPE 0.8-1.7 off one process's,
relative, of Llama with dynamic NTK 0.1-0.4).

Under CP ndp runs transformers' own update once per forward, before the layers, with the batch's longest position
(``ndp.hf.batch.LONGEST``, recorded when the batch was sharded, before ndp padded it; the shard's longest where the
caller sharded it) agreed over the CP group (one all-reduce of one number), and the rotary modules then compute
their embeddings without updating again.
"""
from __future__ import annotations

import types

import torch
import torch.distributed as dist
from transformers.modeling_rope_utils import dynamic_rope_update

from .batch import LONGEST, shard_attribute

# The code of transformers' length-following forward: every rotary module decorated by it shares this code object.
_FOLLOWS_LENGTH = dynamic_rope_update(lambda self, x, position_ids: None).__code__


def length_dependent(module) -> list:
    """The layer types (None: the module has one) whose frequencies ``module``'s forward chooses from the longest
    position it is given, as transformers' ``dynamic_rope_update`` does ("dynamic" in the type, or "longrope");
    empty for any other module."""
    forward = getattr(type(module), "forward", None)
    if getattr(forward, "__code__", None) is not _FOLLOWS_LENGTH:
        return []
    kinds = module.rope_type if isinstance(module.rope_type, dict) else {None: module.rope_type}
    return [layer for layer, kind in kinds.items() if "dynamic" in kind or kind == "longrope"]


def guard_rope(model, ctx) -> None:
    """Under CP, make `model`'s length-following rotary modules (:func:`length_dependent`) choose their frequencies
    from the batch's longest position: their forward no longer updates, and a forward pre-hook on `model` runs
    transformers' update with that length before the layers (eagerly under torch.compile: it all-reduces)."""
    rotaries = {module: layers for module in model.modules() if (layers := length_dependent(module))}
    if not rotaries:
        return
    for module in rotaries:
        module.forward = types.MethodType(type(module).forward.__wrapped__, module)

    @torch.compiler.disable
    def update(module, args, kwargs):
        longest = _batch_longest(args, kwargs, ctx)
        if longest is None:
            return
        position = (longest - 1).reshape(1, 1)
        probe = torch.zeros((1, 1, 1), device=position.device)  # the update reads its device; the output is dropped
        for rotary, layers in rotaries.items():
            for layer in layers:
                type(rotary).forward(rotary, probe, position, **({} if layer is None else {"layer_type": layer}))

    model.register_forward_pre_hook(update, with_kwargs=True)


def _batch_longest(args, kwargs, ctx):
    """The batch's max(position_ids) + 1 over the CP group: what shard_rows recorded (``LONGEST``), else this
    shard's (the caller sharded the batch, without pads), else its length (the positions transformers makes)."""
    pos = kwargs.get("position_ids")
    longest = shard_attribute(kwargs, LONGEST)
    if longest is not None:
        longest = longest.clone()
    elif torch.is_tensor(pos):
        longest = pos.max().reshape(1) + 1
    else:
        ref = next((t for t in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args[:1])
                    if torch.is_tensor(t) and t.dim() >= 2), None)
        if ref is None:
            return None
        longest = torch.full((1,), ref.shape[1], device=ref.device, dtype=torch.int64)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=ctx.group)
    return longest
