"""Tensor-parallel styles beyond torch's, for layers transformers' plans split: a mixture of experts' stacked
experts (:class:`ExpertsParallel`) and multi-head latent attention's shared rotary key (:class:`SharedKeyParallel`).

**Stacked experts** (one parameter per projection, its first dim the experts: transformers' ``gate_up_proj``
``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``). The TP ranks split the experts: each holds ``E / tp`` whole experts
(every parameter split along its first dim) and runs them on the tokens the router sent them, among the whole tokens
every TP rank holds; a token's output, the sum of its experts' weighted outputs, is the sum over the ranks of the
parts their experts gave. The router stays whole on every rank (its inputs are the whole activations), so every rank
routes each token alike. This is the memory and the one all-reduce of the output that splitting every expert's
hidden width costs (transformers' "moe_tp_experts" plan), without that split's packed layout (gate and up stacked
along one dim, each rank taking a share of each: no single contiguous chunk per rank, which distributed checkpoints
cannot save). The parameters keep their whole shapes and names (DTensors), so checkpoints load on any layout.

The experts' forward (transformers' loop, batched or grouped matmuls) runs on this rank's experts as plain tensors,
through transformers' expert-parallel contract: ``num_experts`` is the local count, and an expert held by another
rank is the index ``num_experts``, its routing weight zero, which the kernels skip. In the backward the hidden
states' and routing weights' gradients, each rank's experts' part, are summed over the TP ranks.

**Blocked experts** (``ExpertsParallel(blocked=True)``; Llama 4's): the forward takes every expert's rows at once,
``[E * tokens, H]`` grouped by expert (the router's weights applied before), and returns them in that order. Each rank
runs its experts on their block of rows; the blocks are gathered over the TP ranks in expert order (the backward
hands each rank its block's part of the whole, alike gradient), and the input's gradient, each rank's blocks' part,
is summed over the TP ranks.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel

from ndp.cp.stats import all_gather_flat, all_reduce_sum

from .parallelize import zero_tie

ROUTING = ("hidden_states", "top_k_index", "top_k_weights")  # the experts' forward arguments, in order


def expert_count(module: nn.Module, blocked: bool = False) -> int | None:
    """The number of experts `module` stacks when it follows transformers' expert-parallel contract (its
    ``num_experts`` the first dim of every parameter it holds itself, its kernels told by ``_is_expert_parallel``
    to skip the index ``num_experts``; `blocked`: the blocked experts' contract, module docstring, which needs no
    such switch), else None."""
    params = list(module.parameters(recurse=False))
    count = getattr(module, "num_experts", None)
    if not params or not isinstance(count, int) or not (blocked or hasattr(module, "_is_expert_parallel")):
        return None
    if len(params) != len(list(module.parameters())) or any(p.dim() < 2 or p.shape[0] != count for p in params):
        return None
    return count


class ExpertsParallel(ParallelStyle):
    """Split a module of stacked experts (:func:`expert_count`) over the TP ranks by experts: each rank holds
    its ``num_experts / tp`` of every parameter's first dim, runs those experts on the tokens routed to them, and the
    ranks' outputs are summed. Its forward takes ``hidden_states [tokens, H]``, ``top_k_index`` and
    ``top_k_weights [tokens, k]`` and returns the tokens' outputs.

    Args:
        blocked: the module's forward takes every expert's rows, ``[E * tokens, H]`` grouped by expert, and returns
            them so (module docstring): each rank runs its experts' blocks, the blocks are gathered.
    """

    def __init__(self, blocked: bool = False):
        super().__init__()
        self.blocked = blocked

    def check(self, module: nn.Module, tp_size: int) -> int:
        """`module`'s number of experts; raise ValueError unless it is a module of stacked experts that `tp_size`
        ranks split evenly."""
        count = expert_count(module, self.blocked)
        if count is None:
            raise ValueError(f"ExpertsParallel splits a module of stacked experts (num_experts the first dim of "
                             f"each of its parameters, transformers' expert-parallel kernels); "
                             f"{type(module).__name__} is not one")
        if count % tp_size:
            raise ValueError(f"tensor parallel splits the experts of {type(module).__name__} over the ranks: "
                             f"num_experts={count} must be a multiple of tp_size={tp_size}. Use a tp_size that "
                             f"divides the number of experts.")
        return count

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        count = self.check(module, device_mesh.size())
        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(distribute_tensor(param, device_mesh, [Shard(0)]),
                                                         requires_grad=param.requires_grad))
        first = device_mesh.get_local_rank() * (count // device_mesh.size())
        local = _blocked_forward if self.blocked else _local_forward
        module.forward = local(module, module.forward, first, device_mesh.get_group())
        return module

    def __repr__(self) -> str:
        return f"ExpertsParallel(blocked={self.blocked})"


def _local_forward(module: nn.Module, forward, first: int, group):
    """`forward` run on this rank's experts (the first one `first`), the tokens' outputs summed over `group`."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        given = dict(zip(ROUTING, args), **kwargs)
        if set(given) != set(ROUTING):
            raise TypeError(f"ExpertsParallel runs {type(module).__name__}'s forward with {', '.join(ROUTING)}; got "
                            f"{', '.join(given)}")
        hidden, weights = grad_summed(group, given["hidden_states"], given["top_k_weights"])
        with _local_experts(module) as params:
            count = module.num_experts
            local = given["top_k_index"] - first
            mine = (local >= 0) & (local < count)
            out = forward(hidden, torch.where(mine, local, count), torch.where(mine, weights, weights.new_zeros(())))
            # Tied to the inputs and the parameters whatever the routing: on a rank whose experts got no token the
            # backward still runs the sums every rank joins, and the parameters get their zero gradient (one
            # process's for those experts), so the optimizer steps them as one process's.
            out = out + zero_tie((hidden, weights, *params))
        return _SumOutput.apply(out, group)

    return run


def _blocked_forward(module: nn.Module, forward, first: int, group):
    """`forward` run on this rank's experts' blocks of rows (the first expert `first`), the blocks gathered over
    `group` in expert order."""

    @functools.wraps(forward)
    def run(hidden_states):
        (rows,) = grad_summed(group, hidden_states)
        with _local_parameters(module) as params:
            count = params[0].shape[0]
            blocks = rows.view(module.num_experts, -1, rows.shape[-1])
            out = forward(blocks[first:first + count].reshape(-1, rows.shape[-1]))
        return _GatherBlocks.apply(out, group)

    return run


@contextlib.contextmanager
def _parameters_as(module: nn.Module, tensors: dict):
    """The module's own parameters named in `tensors` read as those tensors for a forward; yields the tensors."""
    held = dict(module._parameters)
    module._parameters.update(tensors)
    try:
        yield list(tensors.values())
    finally:
        module._parameters.update(held)


def _local_parameters(module: nn.Module):
    """The module's own parameters as this rank's shards, plain tensors, for a forward (``to_local`` is
    differentiable: the gradients reach the DTensors; read when the forward runs, after FSDP2 has put its gathered
    parameters in place); yields those tensors."""
    return _parameters_as(module, {n: p.to_local() if isinstance(p, DTensor) else p
                                   for n, p in module._parameters.items()})


@contextlib.contextmanager
def _local_experts(module: nn.Module):
    """The module as transformers' expert-parallel kernels read it for the forward: its parameters this rank's
    shards (:func:`_local_parameters`), ``num_experts`` their count; yields those tensors."""
    saved = module.num_experts, module._is_expert_parallel
    with _local_parameters(module) as params:
        module.num_experts, module._is_expert_parallel = params[0].shape[0], True
        try:
            yield params
        finally:
            module.num_experts, module._is_expert_parallel = saved


class _SumGradients(torch.autograd.Function):
    """Identity forward of `tensors`; the backward sums each one's gradient (each rank's part) over the ranks. One
    node for all of them: its sums run in one order on every rank, whatever order the rank's backward finishes
    their gradients in."""

    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        return None, *(all_reduce_sum(g.clone(memory_format=torch.contiguous_format), ctx.group) if need else None
                       for g, need in zip(grads, ctx.needs_input_grad[1:]))


def grad_summed(group, *tensors) -> tuple[torch.Tensor, ...]:
    """`tensors` as they are, their gradients summed over `group` in the backward (one node: see above)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _SumGradients.apply(group, *tensors)
    return tensors


class _SumOutput(torch.autograd.Function):
    """The sum of the ranks' partial outputs; the backward hands the (whole, alike) gradient to each part."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_sum(x.clone(memory_format=torch.contiguous_format), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherBlocks(torch.autograd.Function):
    """The ranks' blocks of rows, concatenated in rank order; the backward hands each rank its block's rows of the
    (whole, alike) gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.rank, ctx.rows = dist.get_rank(group), x.shape[0]
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        all_gather_flat(out, x.contiguous(), group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows], None


class SummedParams(ParallelStyle):
    """A module whose own parameters stay whole on every TP rank while it computes on this rank's share of a split
    activation, each output element from its own share only (a per-head norm on the rank's heads, an activation's
    scalars on the rank's share of the MLP width): its forward reads them through one node that sums their gradients,
    each rank's share's part, over the TP ranks."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        forward, group = module.forward, device_mesh.get_group()

        @functools.wraps(forward)
        def run(*args, **kwargs):
            names = [n for n, p in module._parameters.items() if p is not None]
            summed = grad_summed(group, *(module._parameters[n] for n in names))
            with _parameters_as(module, dict(zip(names, summed))):
                return forward(*args, **kwargs)

        module.forward = run
        return module


class RowwiseOwnOutput(RowwiseParallel):
    """torch's ``RowwiseParallel`` whose replicated output is a tensor of its own (one copy), not the view of the
    summed DTensor torch hands over, which autograd forbids modifying in place: for a layer whose caller adds into
    its output (Llama 4's MoE adds its experts' rows into its shared expert's, ``out.add_``)."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        out = RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return out.clone() if isinstance(out, torch.Tensor) and not isinstance(out, DTensor) else out


class SharedKeyParallel(ParallelStyle):
    """Multi-head latent attention's ``kv_a_proj_with_mqa`` (DeepSeek-V2's, MiniCPM3's), kept whole on every TP rank:
    its output is the compressed keys and values (to a column-split ``kv_b_proj``, whose own style sums their
    gradient) and, in its last ``rope_dim`` columns, one rotary key that every head shares, read by this rank's heads
    only. That key's gradient, each rank's heads' part, is summed over the TP ranks in the backward.

    Args:
        rope_dim: the shared key's width (the config's ``qk_rope_head_dim``).
    """

    def __init__(self, rope_dim: int):
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        module.register_forward_hook(functools.partial(_shared_key, self.rope_dim, device_mesh.get_group()))
        return module

    def __repr__(self) -> str:
        return f"SharedKeyParallel(rope_dim={self.rope_dim})"


def _shared_key(rope_dim: int, group, module, args, out):
    latent, key = out.split([out.shape[-1] - rope_dim, rope_dim], dim=-1)
    return torch.cat([latent, *grad_summed(group, key)], dim=-1)


class LocalParams(ParallelStyle):
    """A module that uses some of its own parameters per head beside its split projections (attention sinks, a
    per-head gate bias): each such parameter split along a dim over the TP ranks (``torch.chunk``'s parts, as the
    heads are), and the module's forward run on this rank's parts as plain tensors. Its children keep their own
    styles. A part only this rank's heads read needs no sum: its gradient is the rank's own.

    Args:
        splits: parameter name -> the dim it is split along.
    """

    def __init__(self, splits: dict[str, int]):
        super().__init__()
        self.splits = dict(splits)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for name, dim in self.splits.items():
            param = module._parameters.get(name)
            if param is None:  # a layer without it (Mimo-V2-Flash's full-attention layers hold no sinks)
                continue
            module.register_parameter(name, nn.Parameter(distribute_tensor(param, device_mesh, [Shard(dim)]),
                                                         requires_grad=param.requires_grad))
        forward = module.forward

        @functools.wraps(forward)
        def run(*args, **kwargs):
            with _local_parameters(module):
                return forward(*args, **kwargs)

        module.forward = run
        return module

    def __repr__(self) -> str:
        return f"LocalParams({self.splits})"
