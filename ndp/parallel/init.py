"""Seeded, order-independent weight initialization, and materialization of a meta-device model shard by shard.

Why a seed per module rather than one random stream (the scheme of a normal build): the values a normal build
draws depend on the order in which the whole model consumes one global random stream (in ``transformers``,
every ``nn.Linear`` constructor draws a kaiming-uniform weight that ``post_init`` later overwrites, and the
inner model's ``post_init`` runs before the LM head exists). Reproducing that stream without building the whole
model would mean replaying every constructor on real memory. Here instead every module's own parameters and
buffers are initialized by the model's own per-module init (``ModelPlan.init_module``: ``_init_weights`` of a
transformers model, ``reset_parameters`` otherwise) on full-size CPU temporaries, right after seeding the
generator with a hash of ``(seed, module name)``. A value then depends only on the seed, the module's name and
the model's own init, never on which other modules were initialized before it or on which rank. The full
build (:func:`init_weights`) and the meta build (:func:`materialize`) run the same routine and copy the same
temporaries, the full build into whole tensors, the meta build into this rank's shards: the two agree bit
for bit, and the meta build never holds more than one module's own full tensors at a time beyond its shards.
"""
from __future__ import annotations

import copy
import hashlib
import itertools
import logging
from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

logger = logging.getLogger(__name__)

# Names that wrappers insert between a module and its parameters (activation checkpointing, torch.compile).
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """A parameter or module name without the wrapper levels AC and compile insert."""
    for p in _WRAPPER_PREFIXES:
        name = name.replace(p, "")
    return name


def module_seed(seed: int, name: str) -> int:
    """The generator seed of module ``name`` (a 63-bit hash of the run seed and the name, the same everywhere)."""
    digest = hashlib.sha256(f"{int(seed)}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def reset_parameters(module: nn.Module) -> None:
    """The default ``init_module``: torch's convention, ``module.reset_parameters()`` where a module has it."""
    fn = getattr(module, "reset_parameters", None)
    if callable(fn):
        fn()


def is_meta(model: nn.Module) -> bool:
    """True if any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def param_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds: local shards of DTensors, whole plain tensors (tied ones once)."""
    total = 0
    for p in model.parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        total += t.numel() * t.element_size()
    return total


def to_empty(model: nn.Module, *, device) -> nn.Module:
    """``model.to_empty(device=...)`` that keeps tied tensors tied.

    ``nn.Module.to_empty`` gives each module its own new Parameter when moving off the meta device, which would
    untie an ``lm_head`` tied to ``embed_tokens``; every module that shared a tensor gets the first one back.

    Args:
        model: the module (its tensors on meta, or anywhere); device: where to allocate.
    Returns:
        the module, its tensors allocated (uninitialized) on ``device``.
    """
    groups: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for mod in model.modules():
        for kind, table in (("p", mod._parameters), ("b", mod._buffers)):
            for n, t in table.items():
                if t is not None:
                    groups.setdefault(id(t), []).append((mod, kind, n))
    model.to_empty(device=device)
    for aliases in groups.values():
        mod0, kind0, n0 = aliases[0]
        first = (mod0._parameters if kind0 == "p" else mod0._buffers)[n0]
        for mod, kind, n in aliases[1:]:
            table = mod._parameters if kind == "p" else mod._buffers
            if table[n] is not first:
                table[n] = first
    return model


def _own_tensors(module: nn.Module):
    for n, t in module.named_parameters(recurse=False):
        yield "p", n, t
    for n, t in module.named_buffers(recurse=False):
        if t is not None:
            yield "b", n, t


def _copy_into(target: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(target, DTensor):
        # src_data_rank=None: every rank holds the same full tensor and keeps its own piece (no communication);
        # this also slices FSDP-over-TP (_StridedShard) placements exactly as the parallel layout lays them out.
        local = distribute_tensor(full, target.device_mesh, list(target.placements), src_data_rank=None).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(full)


@torch.no_grad()
def _seeded_init(source: nn.Module, targets: dict[str, torch.Tensor], *, seed: int,
                 init_module: Callable[[nn.Module], None]) -> None:
    """Initialize ``targets`` (clean name -> tensor) module by module from ``source``'s modules (a meta copy).

    For each module of ``source`` (``named_modules`` order) that owns parameters or buffers not seen before
    (a tied tensor belongs to its first owner), the module's own tensors are swapped for full-size CPU
    temporaries (floating ones NaN-filled, so that a tensor no init sets is caught), the inits run
    (:func:`_run_inits`), each temporary is copied into its target and the module gets its own tensors back.
    """
    what = getattr(init_module, "__qualname__", init_module)  # for the message: what the caller gave
    init_module = _bound(init_module, source)
    seen: set[int] = set()
    for mod_name, mod in source.named_modules():
        own = [(kind, n, t) for kind, n, t in _own_tensors(mod) if id(t) not in seen]
        if not own:
            continue
        seen.update(id(t) for _, _, t in own)
        temps = {n: (kind, _nan_like(t, kind)) for kind, n, t in own}
        held = _put(mod, temps)
        try:
            _run_inits(source, mod_name, seed=seed, init_module=init_module)
            for n, (kind, tmp) in temps.items():
                fqn = clean_name(f"{mod_name}.{n}" if mod_name else n)
                if (tmp.is_floating_point() or tmp.is_complex()) and bool(torch.isnan(tmp).any()):
                    raise ValueError(
                        f"initialization left {fqn} ({'parameter' if kind == 'p' else 'buffer'} of "
                        f"{type(mod).__name__}) unset (NaN): the model's per-module init ({what}) does not "
                        f"initialize it, on the module or an enclosing one. Give ModelPlan(init_module=fn) a "
                        f"function that sets every parameter and buffer of the module it is called on, or build "
                        f"and initialize the model in full yourself (not on the meta device).")
                if fqn not in targets:
                    raise ValueError(f"{fqn}: no tensor of that name in the model to initialize (names: "
                                     f"{sorted(targets)[:8]}...); the model and its init source differ")
                _copy_into(targets[fqn], tmp.detach())
        finally:
            _put(mod, held)


def _run_inits(source: nn.Module, mod_name: str, *, seed: int, init_module: Callable[[nn.Module], None]) -> None:
    """``init_module`` on module `mod_name`, then on each enclosing module, nearest first, each call after seeding
    the CPU generator with :func:`module_seed` of the module's name (``"module<enclosing"`` for the enclosing
    ones). That is transformers' order: ``initialize_weights`` runs a parent's init after its children's, and some
    parents set their children's tensors (a MoE block its router's weight, SigLIP's attention its projections,
    FalconH1Model its mixers' ``mup_vector``), so the last write wins. Every tensor of ``source`` but this
    module's temporaries is on meta: a call writes and draws for them only, whatever else it touches."""
    parts = mod_name.split(".") if mod_name else []
    for depth in range(len(parts), -1, -1):
        name = ".".join(parts[:depth])
        key = clean_name(mod_name) if name == mod_name else f"{clean_name(mod_name)}<{clean_name(name)}"
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(module_seed(seed, key))
            init_module(source.get_submodule(name))


def _meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters and buffers are meta stand-ins (no data copied, tied ones still one)."""
    memo = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        stand_in = torch.empty_like(t, device="meta")
        is_param = isinstance(t, nn.Parameter)
        memo[id(t)] = nn.Parameter(stand_in, requires_grad=t.requires_grad) if is_param else stand_in
    return copy.deepcopy(model, memo)


def _bound(init_module: Callable[[nn.Module], None], model: nn.Module) -> Callable[[nn.Module], None]:
    """init_module as a function of one module of `model`: an init with a ``bind(model)`` method (one that
    depends on where a module sits, as transformers' sub-models' own inits do) is bound to the model it runs on
    (the meta build runs it on a copy)."""
    bind = getattr(init_module, "bind", None)
    return bind(model) if callable(bind) else init_module


def _nan_like(t: torch.Tensor, kind: str) -> torch.Tensor:
    """A CPU temporary for `t` (floating ones NaN-filled, so that a value never written is seen)."""
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    out.fill_(float("nan") if out.is_floating_point() or out.is_complex() else 0)
    return nn.Parameter(out, requires_grad=t.requires_grad) if kind == "p" else out


def _put(mod: nn.Module, tensors: dict[str, tuple[str, torch.Tensor]]) -> dict[str, tuple[str, torch.Tensor]]:
    """Swap module `mod`'s own tensors for `tensors` (name -> (kind, tensor)); returns what they replaced."""
    old = {}
    for n, (kind, t) in tensors.items():
        table = mod._parameters if kind == "p" else mod._buffers
        old[n] = (kind, table[n])
        table[n] = t
    return old


def _named_targets(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for n, t in itertools.chain(model.named_parameters(remove_duplicate=False),
                                model.named_buffers(remove_duplicate=False)):
        out[clean_name(n)] = t
    return out


def init_weights(model: nn.Module, *, seed: int,
                 init_module: Callable[[nn.Module], None] = reset_parameters) -> nn.Module:
    """Initialize every parameter and buffer of a materialized, unparallelized model with the seeded scheme.

    This is the full-build counterpart of a meta-device ``parallelize``: ``parallelize(meta_model, ...,
    init_seed=seed)`` gives each rank exactly the shards of ``init_weights(full_model, seed=seed)``.

    Args:
        model: the model, on CPU (or any device), identical structure on every rank.
        seed: the run seed (each module's generator is seeded from it and the module's name).
        init_module: ``fn(module)`` setting one module's own (``recurse=False``) parameters and buffers from
            the global CPU generator; default ``module.reset_parameters()``.
    Returns:
        the same model, initialized in place.
    Raises:
        ValueError: a floating parameter or buffer that ``init_module`` leaves unset (named).
    """
    _seeded_init(_meta_copy(model), _named_targets(model), seed=seed, init_module=init_module)
    return model


def materialize(model: nn.Module, source: nn.Module, *, device, seed: int,
                init_module: Callable[[nn.Module], None] = reset_parameters) -> nn.Module:
    """Allocate a parallelized meta-device model's local shards on ``device`` and initialize them.

    ``model.to_empty`` allocates only what this rank holds (FSDP2 and TP parameters are DTensors whose
    local tensor is the shard); then each module of ``source`` is initialized as :func:`init_weights` does,
    one module's full tensors at a time on CPU, and each rank keeps its shards of them. Peak memory beyond
    the shards is the largest module's own tensors (one weight matrix and its bias), never the model.

    Args:
        model: the parallelized model (its tensors on meta).
        source: an unparallelized meta copy of it (the same module names, the model's own classes).
        device: where the shards go; seed, init_module: as in :func:`init_weights`.
    Returns:
        the model, materialized in place (tied parameters stay one tensor).
    Raises:
        ValueError: a tensor that ``init_module`` leaves unset.
    """
    to_empty(model, device=device)
    _seeded_init(source, _named_targets(model), seed=seed, init_module=init_module)
    return model
