"""Apply TP, CP, activation checkpointing, compile and FSDP2 to any ``nn.Module``, in that order.

This layer knows no model library: what to split is described by a :class:`ModelPlan` (tensor-parallel
styles by module-name pattern, the repeated blocks FSDP and AC wrap, the attention modules that receive
the CP context and a callback that switches the model's attention to a CP-aware one). ``ndp.hf`` builds
the plan of a Hugging Face model.
"""
from __future__ import annotations

import copy
import fnmatch
import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from .config import ParallelismConfig, as_config
from .draws import share_tp_draws
from .init import is_meta, materialize, param_bytes, reset_parameters
from .mesh import CPContext, adopt_mesh, check_mesh, cp_context, mesh_axis, mesh_device

logger = logging.getLogger(__name__)

CP_ATTR = "ndp_cp"  # attribute holding the CPContext on attention modules (and on the root module)
PARALLEL_ATTR = "ndp_parallel"  # attribute holding the (config, mesh) a model was parallelized with


@dataclass(frozen=True)
class Parallelized:
    """What :func:`parallelize` leaves on the root module (as ``ndp_parallel``) for code that needs the
    degrees and groups later: batch slicing, loss normalisation."""

    config: ParallelismConfig
    mesh: DeviceMesh | None

    def axis(self, name: str):
        """The 1-D mesh of axis ``name`` (None without a mesh)."""
        return None if self.mesh is None else mesh_axis(self.mesh, name)


# Tensor-parallel styles by name (transformers' names in base_model_tp_plan), each a factory of a torch style.
TP_STYLES = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    # an nn.Embedding split by vocabulary rows, its output summed over the ranks (transformers' name)
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    "sequence_parallel": SequenceParallel,
    # A norm between a colwise and a rowwise layer (Qwen3's per-head q_norm / k_norm): its input is this rank's
    # heads, its weight replicated. Read as split along a dimension other than the normalized last one (-2: the
    # heads), the forward is the local computation and the weight's gradient, a sum over that dimension, is summed
    # over the ranks (each rank alone holds its heads' share).
    "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=-2, use_local_output=True),
}


def _tp_style(name: str) -> ParallelStyle:
    if name not in TP_STYLES:
        raise ValueError(f"unknown tensor-parallel style {name!r}; supported: {sorted(TP_STYLES)} or a "
                         f"torch.distributed.tensor.parallel.ParallelStyle instance")
    return TP_STYLES[name]()


@dataclass(frozen=True)
class ModelPlan:
    """How to parallelize one model (all names are ``named_modules`` fqns; ``*`` matches one level).

    Args:
        tp_plan: fqn pattern -> style name ("colwise", "rowwise", "colwise_rep", "rowwise_rep",
            "sequence_parallel") or a ``ParallelStyle``.
        blocks: fqn patterns of the repeated blocks (decoder layers): each gets its own FSDP unit and,
            with activation checkpointing, a checkpoint wrapper.
        attention: fqn patterns of attention modules; each gets the rank's CPContext as ``ndp_cp``.
        enable_cp: ``fn(model, ctx)`` switching the model's attention to a CP-aware implementation
            (called for every cp_size, so cp_size=1 runs the same attention code locally).
        init_module: ``fn(module)`` initializing one module's own parameters and buffers from the global CPU
            generator (the model's per-module init), used to materialize a meta-device model
            (``ndp.parallel.init``); None: ``module.reset_parameters()``.
    """

    tp_plan: Mapping[str, str | ParallelStyle] = field(default_factory=dict)
    blocks: Sequence[str] = ()
    attention: Sequence[str] = ()
    enable_cp: Callable[[nn.Module, CPContext], None] | None = None
    init_module: Callable[[nn.Module], None] | None = None


def match_modules(model: nn.Module, patterns: Iterable[str]) -> list[tuple[str, nn.Module]]:
    """(name, module) of `model`'s modules whose names match one of `patterns` (``*`` matches one name part)."""
    patterns = list(patterns)
    out = []
    for name, mod in model.named_modules():
        parts = name.split(".")
        for p in patterns:
            pp = p.split(".")
            if len(pp) == len(parts) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pp)):
                out.append((name, mod))
                break
    return out


def is_transformers_model(model: nn.Module) -> bool:
    """Whether `model` is a transformers ``PreTrainedModel`` (``ndp.hf``'s plan applies), told without importing
    transformers: its attention is switched by ``set_attn_implementation`` and described by ``config``."""
    return hasattr(model, "set_attn_implementation") and hasattr(model, "config")


def default_plan(model: nn.Module) -> ModelPlan:
    """Plan for an arbitrary module: the children of its largest ``nn.ModuleList`` are the blocks."""
    best, best_name = None, None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and (best is None or len(mod) > len(best)):
            best, best_name = mod, name
    blocks = (f"{best_name}.*",) if best is not None and best_name else ()
    return ModelPlan(blocks=blocks)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, tp_plan: Mapping[str, str | ParallelStyle]) -> nn.Module:
    """Tensor parallel: shard the matched modules' weights over ``tp_mesh`` (torch ``parallelize_module``); in
    training the model's forward draws its random numbers alike on every TP rank (``ndp.parallel.draws``).

    Args:
        model: any module; tp_mesh: 1-D mesh (``mesh["tp"]``); tp_plan: fqn pattern -> style.
    Returns:
        the same module, parallelized in place.
    Raises:
        ValueError: empty plan with tp > 1, unknown style, or a pattern matching nothing.
    """
    if tp_mesh.size() == 1:
        return model
    if not tp_plan:
        raise ValueError(f"tp_size={tp_mesh.size()} needs a tensor-parallel plan (fqn pattern -> style); got "
                         f"an empty plan. Pass ModelPlan(tp_plan=...) or use ndp.hf for transformers models.")
    plan = {}
    for pattern, style in tp_plan.items():
        if not match_modules(model, [pattern]):
            raise ValueError(f"tensor-parallel plan entry {pattern!r} matches no module of "
                             f"{type(model).__name__}")
        plan[pattern] = _tp_style(style) if isinstance(style, str) else style
    parallelize_module(model, tp_mesh, plan)
    share_tp_draws(model, tp_mesh)  # the TP ranks' copies of the whole activations draw alike
    return model


def apply_cp(model: nn.Module, config: ParallelismConfig, mesh: DeviceMesh | None, plan: ModelPlan) -> CPContext:
    """Context parallel: give every attention module the rank's CPContext and switch the attention.

    Returns:
        the CPContext (also stored as ``model.ndp_cp``).
    Raises:
        ValueError: cp_size > 1 and the plan has no ``enable_cp`` (the model's attention would ignore CP).
    """
    ctx = cp_context(config, mesh)
    if config.cp_size > 1 and plan.enable_cp is None:
        raise ValueError(f"cp_size={config.cp_size} needs a plan with enable_cp (how to switch the model's "
                         f"attention to CP attention); got none for {type(model).__name__}. Use ndp.hf for "
                         f"transformers models.")
    for _, mod in match_modules(model, plan.attention):
        setattr(mod, CP_ATTR, ctx)
    setattr(model, CP_ATTR, ctx)
    if plan.enable_cp is not None:
        plan.enable_cp(model, ctx)
    return ctx


def _replace(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent_name, _, child = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


AC_MODES = ("none", "full", "selective")
_aten = torch.ops.aten
# Selective checkpointing keeps what the matmuls return (the FLOPs that dominate a layer) and recomputes the rest
# of a block in the backward: element-wise ops, norms, activations, RoPE and the attention, whose kernels (Triton,
# flash-attn, SDPA, by engine) are recomputed alike on every device, so that what a layer keeps is one formula
# (ndp.plan.cost.selective_layer_bytes).
SAVED_OPS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default})


def ac_mode(value) -> str:
    """The activation-checkpointing mode of ``value``: one of AC_MODES, or a bool (True: "full", False: "none")."""
    if value is None or isinstance(value, bool):
        return "full" if value else "none"
    if value not in AC_MODES:
        raise ValueError(f"activation_checkpointing must be one of {', '.join(AC_MODES)} (or a bool: True is "
                         f"full); got {value!r}. full recomputes each block in the backward; selective keeps its "
                         f"matmul outputs and recomputes the rest (element-wise ops, attention).")
    return value


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module, blocks: Sequence[str], mode: str = "full") -> list[nn.Module]:
    """Activation checkpointing of each matched block: "full" recomputes its activations in the backward,
    "selective" keeps the outputs of SAVED_OPS (matmuls) and recomputes the rest, attention included.

    Returns:
        the wrapped blocks, in order.
    """
    kw = {}
    if ac_mode(mode) == "selective":
        kw["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
    out = []
    for name, mod in match_modules(model, blocks):
        wrapped = checkpoint_wrapper(mod, preserve_rng_state=False, **kw)
        _replace(model, name, wrapped)
        out.append(wrapped)
    return out


def fsdp_mesh(config: ParallelismConfig, mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: ``dp_shard_cp``, with ``dp_replicate`` in front for HSDP (on a mesh that
    leaves out a dp_shard_cp of size 1, Accelerate's, FSDP2 over ``dp_replicate`` alone: the same gradients)."""
    shard = mesh_axis(mesh, "dp_shard_cp")
    if config.dp_replicate_size == 1:
        return shard
    if not isinstance(shard, DeviceMesh):
        return mesh_axis(mesh, "dp_replicate")
    # as FSDP2 joins them itself: slicing a flattened axis from the root mesh is deprecated (a warning per call)
    return DeviceMesh._concatenate([mesh_axis(mesh, "dp_replicate"), shard])


def apply_fsdp(model: nn.Module, config: ParallelismConfig, mesh: DeviceMesh, blocks: Sequence[nn.Module], *,
               mp_policy=None, reshard_after_forward: bool = True) -> nn.Module:
    """FSDP2 ``fully_shard`` per block, then the root, over ``dp_shard_cp`` (HSDP with ``dp_replicate``).

    Args:
        mp_policy: ``torch.distributed.fsdp.MixedPrecisionPolicy`` or None (parameters' own dtype).
    """
    check_one_dtype_per_module(model)
    m = fsdp_mesh(config, mesh)
    kw = dict(mesh=m, mp_policy=mp_policy or MixedPrecisionPolicy())
    for i, blk in enumerate(blocks):
        # The last block's parameters are needed again right at the start of backward: keep them.
        last = i == len(blocks) - 1
        subs = _odd_dtype_modules(blk)
        for sub in subs:
            _shard_apart(sub, reshard_after_forward=reshard_after_forward and not last, **kw)
        _shard_apart(blk, reshard_after_forward=reshard_after_forward and not last, **kw)
        _unshard_with(blk, subs)
        tie_experts(blk)  # after fully_shard: its hook runs once FSDP has gathered the parameters
    subs = _odd_dtype_modules(model)
    for sub in subs:
        _shard_apart(sub, reshard_after_forward=reshard_after_forward, **kw)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kw)
    _unshard_with(model, subs)
    fresh_autocast_casts(model, m.device_type)
    return model


def fresh_autocast_casts(model: nn.Module, device_type: str) -> None:
    """Each FSDP2 unit of `model` drops autocast's cached weight casts when a forward with grad on starts it. A
    unit that ran under ``no_grad`` earlier in the same autocast region (HRM's low-level stack, in the cycles it
    runs without gradients) would reuse the casts made then: autograd reaches them after the unit's FSDP2
    post-backward hook, which has reduce-scattered no gradient, and every parameter of the unit silently gets none
    (hrm_text under cp 2 or dp 2 with bf16 autocast: all 128 of its low-level stack's). Casts made again cost a
    copy of the unit's weights; compiled code keeps no autocast cache."""
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.register_forward_pre_hook(functools.partial(_drop_autocast_casts, device_type))


def _drop_autocast_casts(device_type, module, args):
    if torch.is_grad_enabled() and torch.is_autocast_enabled(device_type) and not torch.compiler.is_compiling():
        torch.clear_autocast_cache()


def _unshard_with(unit: nn.Module, subs: list[nn.Module]) -> None:
    """Gather the parameters of the units `subs` sharded apart inside `unit` when `unit` runs: a model may read
    such a module's weights without calling it (Bailing's linear attention passes its fp32 conv1d's weight to
    ``causal_conv1d_fn``), and FSDP2 gathers a unit's parameters only in its own forward. Those the sub-module's
    forward did not reshard stay gathered until the backward's end, where FSDP2 reduces their gradients."""
    def gather(module, args):
        for sub in subs:
            sub.unshard()

    if subs:
        unit.register_forward_pre_hook(gather)


def _expert_params(block: nn.Module) -> list[nn.Parameter]:
    return [p for n, p in block.named_parameters() if p.requires_grad and "expert" in n.lower()]


def zero_tie(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """A zero that depends on each of `tensors` (a DTensor's local shard): added to an output, each gets a gradient,
    a zero tensor of its shape where nothing else used it, and the collectives behind it in the backward run
    whatever the data. Sums of empty slices: no work, and no NaN from an inf element."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).reshape(-1)[:0].sum() for t in tensors)


def _tie_hook(module, args, kwargs):
    if not torch.is_grad_enabled():
        return None
    tie = zero_tie(_expert_params(module))
    if args and torch.is_tensor(args[0]) and args[0].is_floating_point():
        return (args[0] + tie.to(args[0].dtype),) + tuple(args[1:]), kwargs
    hidden = kwargs.get("hidden_states")
    if torch.is_tensor(hidden) and hidden.is_floating_point():
        return args, {**kwargs, "hidden_states": hidden + tie.to(hidden.dtype)}
    return None


def tie_experts(block: nn.Module) -> None:
    """MoE blocks under FSDP2: every rank must reduce-scatter the same parameters, but an expert that no token of
    this rank's batch reached gets no gradient here (transformers' experts skip it), the ranks' collectives then
    disagree (gloo aborts, NCCL hangs). A zero-valued tie from each expert parameter (name containing "expert")
    into the block's input hidden states gives each a gradient, zero where unused, on every rank; it adds 0."""
    if _expert_params(block):
        block.register_forward_pre_hook(_tie_hook, with_kwargs=True)


def _odd_dtype_modules(root: nn.Module) -> list[nn.Module]:
    """Modules under ``root`` (not yet sharded) whose own parameters have another dtype than most of root's: FSDP2
    shards one dtype per unit, so each gets its own (e.g. a router kept in fp32 inside a bf16 model). Innermost
    first: sharding a module after its parent would find its parameters already sharded (ernie4_5_moe's router
    holds its fp32 bias statistics module)."""
    counts: dict = {}
    for p in root.parameters():
        counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    if len(counts) < 2:
        return []
    main = max(counts, key=counts.get)
    # a module inside a block sharded before is that block's (its parameters sharded with it), not root's
    done = {id(m) for unit in root.modules() if unit is not root and isinstance(unit, FSDPModule)
            for m in unit.modules()}
    return [mod for mod in reversed(list(root.modules())) if mod is not root and id(mod) not in done
            and any(p.dtype != main for p in mod.parameters(recurse=False))]


def _shard_apart(mod: nn.Module, **kw) -> None:
    """``fully_shard(mod)``; where ``mod``'s own parameters have another dtype than some children's, those children
    go first, as one unit of their own (flint's attention keeps fp32 sinks beside projections of the model's dtype)."""
    own = {p.dtype for p in mod.parameters(recurse=False)}
    kids = [c for c in mod.children()
            if not isinstance(c, FSDPModule) and any(p.dtype not in own for p in c.parameters())] if own else []
    if kids:
        fully_shard(kids, **kw)
    fully_shard(mod, **kw)


def check_one_dtype_per_module(model: nn.Module) -> None:
    """Raise ValueError naming a module whose own parameters mix dtypes: FSDP2 needs one dtype per unit, and a
    module's own parameters cannot be split into two units."""
    for name, mod in model.named_modules():
        own = {str(p.dtype) for p in mod.parameters(recurse=False)}
        if len(own) > 1:
            raise ValueError(f"FSDP2 shards one dtype per module, and {name or type(model).__name__} holds parameters "
                             f"of dtypes {sorted(own)} itself; cast them to one (model.to(dtype)) before "
                             f"ndp.parallelize.")


def _init_device(mesh: DeviceMesh | None, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    return mesh_device(mesh) or torch.device("cpu")


def parallelize(model: nn.Module, config: ParallelismConfig, mesh: DeviceMesh | None, *,
                plan: ModelPlan | None = None, mp_policy=None, activation_checkpointing: bool | str = False,
                compile: bool = False, reshard_after_forward: bool = True, init_seed: int = 0,
                init_device=None) -> nn.Module:
    """Apply TP, CP, activation checkpointing, compile and FSDP2 (in that order, as torchtitan does).

    A model on the meta device (any parameter or buffer on meta) is parallelized as it is, then only this
    rank's shards are allocated on ``init_device`` and initialized with the seeded per-module scheme of
    ``ndp.parallel.init``: the result equals, bit for bit, building the model in full, calling
    ``ndp.parallel.init_weights(model, seed=init_seed, init_module=plan.init_module)`` and parallelizing it.

    Args:
        model: the module, identical on every rank: fully materialized (same seed), or on the meta device.
        config: the degrees: ndp's ParallelismConfig, or Accelerate's (``ParallelismConfig.from_accelerate``).
        mesh: ``config.build_device_mesh(...)`` (None only when world size is 1): ndp's or Accelerate's, or any
            mesh whose named axes hold every degree > 1 (axes of size 1 may be left out).
        plan: what to split (``default_plan(model)`` when None: FSDP/AC only).
        mp_policy: FSDP2 MixedPrecisionPolicy (e.g. bf16 params, fp32 reduce) or None.
        activation_checkpointing: one of AC_MODES (see :func:`apply_ac`), or a bool (True: "full").
        compile: ``torch.compile`` each block.
        init_seed: meta model only: the seed of the per-module initialization.
        init_device: meta model only: where the shards are allocated (default: the mesh's device type, the
            current CUDA device for "cuda", else CPU).
    Returns:
        the parallelized module (same object; FSDP2 changes its class in place), materialized.
    Raises:
        ValueError: a degree the plan cannot serve (e.g. tp_size > 1 without tp_plan); a meta model whose
            per-module init leaves a parameter or buffer unset.
    """
    config = as_config(config)  # Accelerate's ParallelismConfig too (ndp's fields at their defaults)
    ac = ac_mode(activation_checkpointing)
    if mesh is None and config.world_size > 1:
        raise ValueError(f"world size {config.world_size} needs a DeviceMesh; got mesh=None. Pass "
                         f"mesh=config.build_device_mesh(device_type).")
    if mesh is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # Without a mesh every process would train its own copy of the model and never exchange a gradient.
        raise ValueError(f"parallelize got mesh=None in a job of {dist.get_world_size()} processes, with a "
                         f"ParallelismConfig for {config.world_size}. Set the degrees so that their product is "
                         f"{dist.get_world_size()} (e.g. dp_shard_size={dist.get_world_size()}) and pass "
                         f"mesh=config.build_device_mesh(device_type).")
    check_mesh(config, mesh)
    adopt_mesh(config, mesh)
    plan = plan or default_plan(model)
    # The unparallelized meta copy is the init source: the model's own modules and names, no data.
    source = copy.deepcopy(model) if is_meta(model) else None
    if config.fsdp_size > 1:
        check_one_dtype_per_module(model)  # before any module changes
    if config.tp_size > 1:
        apply_tp(model, mesh_axis(mesh, "tp"), plan.tp_plan)
    apply_cp(model, config, mesh, plan)
    blocks = [m for _, m in match_modules(model, plan.blocks)]
    if ac != "none":
        blocks = apply_ac(model, plan.blocks, ac)
    if compile:
        for blk in blocks:
            blk.compile()
    if config.fsdp_size > 1:
        apply_fsdp(model, config, mesh, blocks, mp_policy=mp_policy,
                   reshard_after_forward=reshard_after_forward)
    if source is not None:
        materialize(model, source, device=_init_device(mesh, init_device), seed=init_seed,
                    init_module=plan.init_module or reset_parameters)
        logger.info("materialized the meta-device model: %d parameter bytes on this rank", param_bytes(model))
    setattr(model, PARALLEL_ATTR, Parallelized(config, mesh))
    return model


@torch.no_grad()
@torch.profiler.record_function("ndp.clip_grad_norm_")
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, *, foreach=None) -> torch.Tensor:
    """Clip gradients by their global 2-norm, correct for any mix of FSDP and TP sharded DTensors.

    Each gradient contributes the squared norm of its local shard; shards are summed over the mesh axes
    the gradient is sharded on (never over replicated axes, which would count a tensor twice).

    Args:
        parameters: tensors (plain or DTensor) whose ``.grad`` is clipped in place.
        max_norm: the largest allowed global norm (<= 0 or inf: only measure).
    Returns:
        the global norm before clipping (fp32 scalar, plain tensor, identical on every rank); when it is not
        finite the gradients are left unscaled.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    buckets: dict[tuple, tuple] = {}  # (mesh ranks, shape, sharded axes) -> (mesh, sum of squares)
    plain = None
    for g in grads:
        if isinstance(g, DTensor):
            local = g.to_local()
            sq = local.float().pow(2).sum() if local.numel() else torch.zeros((), device=local.device)
            # Any shard-like placement (Shard, and FSDP-over-TP _StridedShard which is not a Shard subclass).
            axes = tuple(i for i, pl in enumerate(g.placements) if not (pl.is_replicate() or pl.is_partial()))
            # Key by mesh *value* (same on every rank), never by object identity: every rank must issue
            # the same all-reduces in the same order.
            key = (tuple(g.device_mesh.mesh.flatten().tolist()), tuple(g.device_mesh.mesh.shape), axes)
            if key in buckets:
                buckets[key] = (buckets[key][0], buckets[key][1] + sq)
            else:
                buckets[key] = (g.device_mesh, sq)
        else:
            sq = g.float().pow(2).sum()
            plain = sq if plain is None else plain + sq
    total = plain if plain is not None else None
    for (_, _, axes), (m, sq) in buckets.items():
        for ax in axes:
            dist.all_reduce(sq, group=m.get_group(ax))
        total = sq if total is None else total + sq.to(total.device)
    norm = total.sqrt()
    if max_norm > 0 and math.isfinite(max_norm):
        # A non-finite norm leaves the gradients as they are (no host sync here): scaling every gradient by
        # NaN would hide which tensor went bad, and the caller is going to skip or stop the step anyway.
        coef = torch.where(torch.isfinite(norm), torch.clamp(max_norm / (norm + 1e-6), max=1.0),
                           torch.ones_like(norm))
        for g in grads:
            (g.to_local() if isinstance(g, DTensor) else g).mul_(coef.to(g.device))
    return norm
