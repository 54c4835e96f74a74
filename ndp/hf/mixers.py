"""Token mixers outside attention under context parallelism, run on the gathered sequence.

A recurrent, state-space, linear-attention or short-convolution layer (Mamba's mixer, Qwen3-Next's gated DeltaNet,
LFM's short convolution) carries information along the whole sequence: on a rank's shard alone it would restart its
state at every shard. With ``ParallelismConfig(cp_mixers="gather")`` ndp runs each such layer on the whole sequence
instead: a forward pre-hook all-gathers its sequence inputs from the CP group (the hidden states, and every argument
laid out per token: a padding mask, position ids) and puts them in sequence order, the layer runs on them on every
rank, and a forward hook keeps this rank's shard of its per-token outputs. The result is exactly the layer on the
unsharded sequence. The backward sums every rank's gradient of this rank's inputs (a reduce-scatter): each rank's
parameter gradients are those of its own shard's outputs, as for every other layer under CP.

The cost is the layer's own: each rank computes it over the whole sequence (``cp_size`` times its work) and holds
its activations for the whole sequence. The attention layers, MLPs and the head stay sharded. A model whose every
token mixer is such a layer (no attention CP could split: Mamba, RWKV, xLSTM) is refused: CP would split nothing.
"""
from __future__ import annotations

import torch
from torch import nn

from ndp.cp import gather_sequence, shard_sequence


def _reference(args, kwargs):
    """The module's hidden states: ``hidden_states``, else its first tensor input."""
    hidden = kwargs.get("hidden_states")
    return hidden if torch.is_tensor(hidden) else next((t for t in (*args, *kwargs.values()) if torch.is_tensor(t)),
                                                       None)


def _per_token(t, batch: int, seq: int, dim: int) -> bool:
    return torch.is_tensor(t) and t.dim() >= 2 and t.shape[0] in (1, batch) and t.shape[dim] == seq


def _each(value, fn):
    """fn applied to `value`, or to each item of a tuple or list of them (RoPE's (cos, sin)), one level down."""
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(fn(v) for v in value)
    return fn(value)


def gather_mixers(model: nn.Module, names: list[str], ctx) -> None:
    """Hook the modules `names` of `model` to run on the sequence gathered over ctx's CP group (module docstring)."""
    for name in names:
        module = model.get_submodule(name)
        conv = isinstance(module, nn.Conv1d)
        dim = -1 if conv else 1  # nn.Conv1d takes [batch, channels, seq]; the mixers take [batch, seq, ...]
        module.register_forward_pre_hook(_gather_inputs(ctx, dim), with_kwargs=True)
        module.register_forward_hook(_shard_outputs(ctx, dim, conv), with_kwargs=True)


def _gather_inputs(ctx, dim):
    def hook(module, args, kwargs):
        ref = _reference(args, kwargs)
        if ref is None or ref.dim() < 2:
            return None
        batch, seq = ref.shape[0], ref.shape[dim]

        def gather(t):
            if not _per_token(t, batch, seq, dim):
                return t
            return gather_sequence(t, dim=dim % t.dim(), group=ctx.group, layout=ctx.layout, reduce_grad=True)

        return tuple(_each(t, gather) for t in args), {k: _each(t, gather) for k, t in kwargs.items()}

    return hook


def _shard_outputs(ctx, dim, conv):
    def hook(module, args, kwargs, output):
        ref = _reference(args, kwargs)
        if ref is None or ref.dim() < 2:
            return None
        batch, full = ref.shape[0], ref.shape[dim]

        def shard(t):
            # a causal convolution's output runs past the sequence (its padding): the sequence is its first `full`
            if conv and torch.is_tensor(t) and t.dim() >= 2 and t.shape[dim] > full:
                t = t.narrow(dim, 0, full)
            if not _per_token(t, batch, full, dim):
                return t  # a state, a cache: not per token
            return shard_sequence(t, dim=dim % t.dim(), layout=ctx.layout, world_size=ctx.size, rank=ctx.rank)

        return _each(output, shard)

    return hook


__all__ = ["gather_mixers"]
