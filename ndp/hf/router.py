"""An MoE's load-balancing loss under context parallelism, exact.

transformers' MoE families add ``router_aux_loss_coef x load_balancing_loss_func(router_logits, ...)`` to their
loss (and return it as ``aux_loss``): ``num_experts x sum_e T_e x P_e``, T the share of the top-k picks that went
to expert e and P its mean router probability, both averaged over the batch's tokens (its attention_mask's). On
one CP rank's shard those means are the shard's, a different loss than the batch's. Under CP ndp computes the
family's formula from sums: the picks and the token count are summed over the CP group (one all-reduce of
num_experts + 1 numbers per forward; they carry no gradient), and each rank's share is ``num_experts x sum_e
T_e x (its tokens' probability sum for e / the batch's tokens)``: the shares of the CP ranks sum to the batch's
loss, and each rank's gradient is its tokens' part of the batch's. The pads a run without CP never sees are left
out (ndp's own and a padded batch's: ``ndp.hf.batch.REAL_TOKENS``).

Scaled like the loss around it: ``aux_loss`` (what TRL adds to its own token loss, and a loop on
``ndp.hf.loss``) is the share times cp_size, for FSDP's averaging over the CP ranks (its mean over the ranks is the
batch's loss, as TRL logs it); inside the model's ``loss`` it is the share alone where the caller sums the ranks'
losses (:func:`losses_summed`: transformers' Trainer, whose ``num_items_in_batch`` counts every rank's tokens and
which multiplies the loss by the ranks' number), else times cp_size (ndp.accelerate's ``num_items_in_batch``).

A family whose ``load_balancing_loss_func`` is not that formula (checked on numbers when the model is
parallelized: Doge's takes other arguments) is refused by name when its loss is on.
"""
from __future__ import annotations

import contextvars
import functools
import inspect
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .batch import REAL_TOKENS, holding, shard_attribute
from .models import Unsupported, text_config

_PARAMS = ("gate_logits", "num_experts", "top_k", "attention_mask")
# True inside losses_summed(): the caller sums the ranks' losses (the model's loss holds each rank's share alone).
_SUMMED: contextvars.ContextVar = contextvars.ContextVar("ndp_losses_summed", default=False)
# Inside recorded_shares(): the list each forward's share is appended to.
_RECORD: contextvars.ContextVar = contextvars.ContextVar("ndp_router_record", default=None)


def losses_summed():
    """Inside, the load-balancing loss in a model's ``loss`` is each CP rank's share of its batch's: for a caller
    that sums the ranks' losses (transformers' Trainer: ``num_items_in_batch`` over every rank's tokens and the loss
    multiplied by the ranks' number)."""
    return holding(_SUMMED, True)


def recorded_shares():
    """Inside, each forward's share of its batch's load-balancing loss (detached, not scaled) is appended to the list
    this yields: for a caller that combines a loss's token mean and its load-balancing loss over the CP ranks
    apart (TRL's evaluation normalises each shard's token loss by its own tokens)."""
    return holding(_RECORD, [])


def family_loss(model: nn.Module):
    """The module-level ``load_balancing_loss_func`` of the model's family (what its forward adds), or None."""
    return getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)


def expert_counts(model: nn.Module) -> tuple[int | None, int | None]:
    """(num_experts, top_k) as the family's forward passes them: its own attributes, else its text config's."""
    text = text_config(model)
    return tuple(getattr(model, name, None) or getattr(text, name, None)
                 for name in ("num_experts", "num_experts_per_tok"))


def aux_loss_on(model: nn.Module) -> bool:
    """The model's config adds its routers' load-balancing loss (output_router_logits, a coefficient not 0)."""
    text = text_config(model)
    return bool(getattr(text, "output_router_logits", False)) and getattr(text, "router_aux_loss_coef", 0) != 0


def check_router_loss(model: nn.Module) -> None:
    """Raise Unsupported when the model's family adds a load-balancing loss ndp cannot compute over the CP group
    (a ``load_balancing_loss_func`` that is not the formula of the module docstring on a probe, or no expert
    counts to call it with); nothing for a family without one."""
    fn = family_loss(model)
    if fn is None:
        return
    experts, top_k = expert_counts(model)
    if not _reproduces(fn, experts, top_k):
        raise Unsupported(
            f"{type(model).__name__} adds its routers' load-balancing loss ({fn.__module__}.load_balancing_loss_func, "
            f"num_experts={experts}, top_k={top_k}) in a form ndp does not reproduce over context-parallel shards: "
            f"each rank would compute it over its shard alone. Turn it off (model.config.output_router_logits = "
            f"False; TRL: SFTConfig(router_aux_loss_coef=0.0)) or train the model without context parallelism.")


@functools.lru_cache(maxsize=None)
def _reproduces(fn, experts, top_k) -> bool:
    """The family's function takes ndp's arguments and equals ndp's formula on random router logits of two layers,
    with and without a mask (once per function and expert counts: the forward hook asks at every forward)."""
    if tuple(inspect.signature(fn).parameters) != _PARAMS or not (isinstance(experts, int) and isinstance(top_k, int)):
        return False
    gen = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(6, experts, generator=gen) for _ in range(2))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    for m in (None, mask):
        want = fn(logits, experts, top_k, m)
        got = balance_loss(logits, experts, top_k, torch.ones(6) if m is None else m, None)
        if not torch.is_tensor(want) or not torch.allclose(want.double(), got.double(), rtol=1e-5, atol=1e-7):
            return False
    return True


def balance_loss(gate_logits, experts: int, top_k: int, tokens, group) -> torch.Tensor:
    """This rank's share of the load-balancing loss of the tokens of `group`'s ranks (module docstring); `tokens`
    weighs this rank's rows (1: counted, 0: a pad), `group` None: this rank's tokens alone (the family's value)."""
    device = gate_logits[0].device
    weight = tokens.reshape(-1).to(device, torch.float32)
    picks = torch.zeros(experts, dtype=torch.float32, device=device)
    probs = torch.zeros(experts, dtype=torch.float32, device=device)
    for layer in gate_logits:
        p = F.softmax(layer.to(device), dim=-1)
        if p.shape[0] != weight.numel():
            raise Unsupported(f"the router logits have {p.shape[0]} rows and the batch's shard {weight.numel()} "
                              f"tokens: ndp cannot weigh the load-balancing loss's tokens.")
        top = torch.topk(p, top_k, dim=-1).indices
        picks = picks.scatter_add(0, top.reshape(-1), weight.repeat_interleave(top_k))
        probs = probs + (p.float() * weight[:, None]).sum(0)
    count = weight.sum() * len(gate_logits)
    if group is not None:
        stats = torch.cat([picks, count.reshape(1)]).double()
        dist.all_reduce(stats, group=group)
        picks, count = stats[:-1].float(), stats[-1].float()
    return experts * (picks / count * (probs / count)).sum()


def _tokens(kwargs, rows: int):
    """This rank's token weights: the shard's REAL_TOKENS (ndp sharded the batch:
    :func:`~ndp.hf.batch.shard_attribute`), else its attention_mask (as the family reads it), else every token."""
    tokens = shard_attribute(kwargs, REAL_TOKENS)
    mask = kwargs.get("attention_mask")
    if tokens is None and torch.is_tensor(mask) and mask.dim() == 2:
        tokens = mask
    return torch.ones(rows) if tokens is None else tokens


def guard_router_loss(model: nn.Module, ctx) -> None:
    """Under CP, a forward hook on `model` that replaces its ``aux_loss`` (and its part of ``loss``) by this rank's
    share of the batch's load-balancing loss (module docstring), for a family that adds one."""
    if family_loss(model) is None:
        return
    text = text_config(model)
    held = []  # the base model's router logits of the forward running now (TRL's fused LM head returns none)

    @torch.compiler.disable
    def hold(module, args, output):
        held[:] = [getattr(output, "router_logits", None)]

    @torch.compiler.disable
    def exact(module, args, kwargs, output):
        aux = getattr(output, "aux_loss", None)
        # the family's forward returns its router logits; TRL's fused LM head returns none, and adds the loss with
        # the text config's coefficient (the family's forward with the one it read at its init)
        made = getattr(output, "router_logits", None)
        logits = made or (held.pop() if held else None)
        if not torch.is_tensor(aux):
            return None  # no router logits asked for
        if not logits:
            raise Unsupported(f"{type(module).__name__} returned a load-balancing loss (aux_loss) without its router "
                              f"logits: ndp cannot compute it over the context-parallel group.")
        check_router_loss(module)
        experts, top_k = expert_counts(module)
        share = balance_loss(logits, experts, top_k, _tokens(kwargs, logits[0].shape[0]), ctx.group)
        if output.loss is not None and kwargs.get("labels") is not None:  # the forward added it to its loss
            coef = getattr(module, "router_aux_loss_coef", None) if made else None
            coef = getattr(text, "router_aux_loss_coef", 0.0) if coef is None else coef
            inside = share if _SUMMED.get() else share * ctx.size
            output.loss = output.loss - coef * aux.to(output.loss.device) + coef * inside
        output.aux_loss = share * ctx.size
        if _RECORD.get() is not None:
            _RECORD.get().append(share.detach())
        return output

    model.base_model.register_forward_hook(hold)
    model.register_forward_hook(exact, with_kwargs=True)


__all__ = ["balance_loss", "check_router_loss", "guard_router_loss", "losses_summed", "recorded_shares",
           "aux_loss_on", "family_loss", "expert_counts"]
