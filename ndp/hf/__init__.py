"""Hugging Face ``transformers`` integration: ndp attention implementations and the parallel plan of
decoder-only causal LMs (Llama, Qwen2, Mistral and models laid out like them)."""
from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from ndp.ops.linear_ce import CHUNK_BYTES
from ndp.parallel import (TP_STYLES, ExpertsParallel, LocalParams, ModelPlan, ParallelismConfig, RowwiseOwnOutput,
                          SharedKeyParallel, SummedParams, ac_mode, as_config, expert_count, is_transformers_model,
                          match_modules)
from ndp.parallel.parallelize import check_one_dtype_per_module
from ndp.parallel import init_weights as _seeded_init_weights
from ndp.parallel import parallelize as _parallelize

from .attention import (IMPL_NAMES, guard_checkpointing, guard_counted_positions, guard_outside_layers, guard_packed,
                        guard_positions, ndp_attention_forward, register_attention)
from .batch import DECODER_SHARDS, guard_labels, parallel_state, shard_batch
from .rope import guard_rope
from .head import head_loss
from .models import (Unsupported, attention_modules, check_cp_model, check_layerdrop, check_packed_model,
                     counted_positions, cp_attention_modules, decoder_layers, gathered_mixers, head_counts,
                     layer_stacks, outside_layers, peft_inner, text_config, text_decoder)
from .mixers import gather_mixers, split_mixer_heads
from .multimodal import guard_whole_batches
from .router import aux_loss_on, check_router_loss, guard_router_loss

# Llama's split: a starting point for a plan of one's own (ndp.hf applies a model's own base_model_tp_plan only).
DEFAULT_TP_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}


def _base_prefix(model: nn.Module) -> str:
    """Where `model`'s base model sits: under its ``base_model_prefix``, or else under the child that is a
    transformers model of the same config (Llama 4's causal LM holds it as ``model``, its prefix
    ``language_model``)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    if prefix and hasattr(model, prefix):
        return f"{prefix}."
    inner = next((n for n, m in model.named_children() if is_transformers_model(m) and m.config is model.config), "")
    return f"{inner}." if inner else ""


def check_model(model: nn.Module, config: ParallelismConfig) -> None:
    """Raise before any collective when ndp cannot parallelize the model as ``config`` asks.

    Raises:
        ValueError: the heads cannot be split by tp / the Ulysses degree, nor stacked experts by tp.
        Unsupported: a module whose own parameters mix dtypes, under FSDP2 (``check_one_dtype_per_module``);
            LayerDrop across ranks that reduce gradients together (``ndp.hf.models.check_layerdrop``);
            (cp_size > 1) a layer CP cannot split exactly (``ndp.hf.models.check_cp_model``), or a
            load-balancing loss, turned on, that ndp cannot compute over the CP shards (``ndp.hf.router``).
    """
    if config.fsdp_size > 1:
        check_layerdrop(model, config.fsdp_size)
        try:
            check_one_dtype_per_module(model)
        except ValueError as e:  # a model ndp cannot shard as built (Mamba's A_log kept in fp32): named as such
            raise Unsupported(str(e)) from None
    if config.cp_size > 1:
        check_cp_model(model, config.cp_mixers, config.cp_size)
        if aux_loss_on(model):
            check_router_loss(model)
    for heads, kv in head_counts(text_config(model)):
        config.check_heads(heads, kv)
    if config.tp_size > 1:
        for pattern, style in _own_tp_plan(model).items():
            for _, module in match_modules(model, [pattern]) if isinstance(style, ExpertsParallel) else ():
                style.check(module, config.tp_size)


def hf_plan(model: nn.Module, *, loss_parallel: bool = False) -> ModelPlan:
    """ModelPlan of a transformers decoder-only model.

    TP comes from the model's own ``config.base_model_tp_plan`` (:func:`parallelize` refuses tp_size > 1 for a model
    without one or with styles ndp does not implement, ``check_tp_plan``);
    the layers of the text decoder's stacks (``layer_stacks``) are the FSDP/AC blocks; every module of
    the decoder layers that calls transformers' AttentionInterface, wherever it sits, receives the CP context;
    CP switches ``config._attn_implementation`` to ``ndp_<impl>`` through ``set_attn_implementation``; attention
    and token mixers outside the decoder layers (vision / audio towers) refuse to run under CP. ``loss_parallel``:
    the output embedding is split by vocabulary rows over TP too ("colwise"), for ``lm_loss`` / ``head_loss``.

    Raises:
        Unsupported: loss_parallel for a model whose output embedding is tied to its input embedding or is not
            a top-level nn.Linear.
    """
    tied = _tied_input_embedding(model)
    # TP keeps a tied input embedding whole: its output embedding computes with the same weight, unsplit
    # (transformers 5.17 adds "embed_tokens": "embedding_rowwise" to a tied model's plan).
    tp_plan = {k: v for k, v in _own_tp_plan(model).items() if k != tied}
    if loss_parallel:
        tp_plan[_loss_parallel_head(model)] = "colwise"

    outside = outside_layers(model)
    decoder = text_decoder(model)
    towers = decoder and (outside or text_config(model) is not model.config)  # found, or a multimodal config

    def enable_cp(m, ctx):
        register_attention()
        m.set_attn_implementation(text_attention(m, IMPL_NAMES[ctx.impl]))
        guard_packed(m, ctx)
        guard_labels(m, ctx)
        guard_checkpointing(m)
        if towers:  # a batch with a tower's input is not rows alone (shard_batch keeps it whole)
            setattr(m, DECODER_SHARDS, decoder)
        if ctx.enabled:
            if ctx.mixers == "gather":
                gather_mixers(m, gathered_mixers(m) or [], ctx)
            elif ctx.mixers == "heads":
                split_mixer_heads(m, gathered_mixers(m) or [], ctx)
            guard_outside_layers(m, outside, ctx)
            guard_counted_positions(m, counted_positions(m), ctx)
            if towers:
                guard_whole_batches(m, decoder, ctx)
            guard_positions(m, ctx)
            guard_rope(m, ctx)
            guard_router_loss(m, ctx)

    blocks = tuple(f"{stack}.*" for stack in layer_stacks(model))  # hrm_text has two
    return ModelPlan(tp_plan=tp_plan, blocks=blocks, attention=tuple(cp_attention_modules(model)),
                     enable_cp=enable_cp, init_module=SubmodelInit(model))


def text_attention(model: nn.Module, impl: str):
    """What ``set_attn_implementation`` takes to run `impl` in the model and its text decoder: a multimodal model's
    other sub-configs (vision and audio towers) keep their own implementation. ndp's CP never runs in a tower, and a
    tower's own masks are for its implementation to apply (Pixtral's block-diagonal image mask, which ndp's
    attention refuses: Mistral 3 with images was refused even on one process)."""
    cfg, text = model.config, text_config(model)
    keys = [k for k in getattr(cfg, "sub_configs", {}) if getattr(cfg, k, None) is text]
    return {"": impl, keys[0]: impl} if text is not cfg and keys else impl


def _own_tp_plan(model: nn.Module) -> dict:
    """The model's own tensor-parallel plan by full module name: its config's (under its base model), or for a
    multimodal wrapper without one, its text decoder's (under that decoder); a PEFT wrapper's, the model it wraps'
    with its LoRA layers split as :func:`_lora_tp_plan` splits them."""
    if peft_inner(model) is not model:
        return _lora_tp_plan(model, _own_tp_plan(peft_inner(model)))
    plan, prefix = getattr(model.config, "base_model_tp_plan", None), _base_prefix(model)
    if not plan:
        text = text_config(model)
        plan = getattr(text, "base_model_tp_plan", None)
        where = next((n for n, m in model.named_modules() if n and is_transformers_model(m) and m.config is text), None)
        if not plan or where is None:
            return {}
        prefix = f"{where}."
    return _completed(model, _styles(model, _built(model, {prefix + k: v for k, v in plan.items()})))


def _completed(model: nn.Module, plan: dict) -> dict:
    """`plan` with a :class:`ndp.parallel.SummedParams` entry for each module whose parameters it leaves whole beside
    column-split projections (:func:`_whole_in_split_modules`) and that computes each output element from the rank's
    own share: a per-head norm (every parameter 1-D of the head size of the attention holding it: Glm4-MoE's q/k
    norms, which its plan does not list) or an activation (every parameter a scalar: Apertus' xIELU). Other such
    parameters stay for :func:`check_tp_plan` to refuse by name."""
    out = dict(plan)
    for name in sorted({n.rpartition(".")[0] for n in _whole_in_split_modules(model, plan)}):
        module = model.get_submodule(name)
        own = list(module.parameters(recurse=False))
        if len(own) != len(list(module.parameters())):
            continue
        head = getattr(model.get_submodule(name.rpartition(".")[0]), "head_dim", None)
        per_head = "Norm" in type(module).__name__ and all(p.shape == (head,) for p in own)
        scalars = type(module).__module__ == "transformers.activations" and all(p.numel() == 1 for p in own)
        if per_head or scalars:
            out[name] = SummedParams()
    return out


def _built(model: nn.Module, plan: dict) -> dict:
    """`plan`'s entries that name a module or a parameter of `model`: an entry for a layer this config does not build
    is dropped (the dense MLP of a model whose every layer holds experts, ``q_proj`` where ``q_lora_rank`` builds
    ``q_a_proj`` and ``q_b_proj``)."""
    def names_any(pattern):
        owner, _, attr = pattern.rpartition(".")
        return match_modules(model, [pattern]) or any(attr in dict(m.named_parameters(recurse=False))
                                                      for _, m in match_modules(model, [owner]))
    return {k: v for k, v in plan.items() if names_any(k)}


def _styles(model: nn.Module, plan: dict) -> dict:
    """`plan` with the entries of transformers' styles that ndp implements beyond torch's made ndp's styles: stacked
    experts (:func:`_experts_fold`), parameters used per head (:func:`_local_params_fold`) and MLA's shared rotary
    key ("mla_kv_a_proj": ``SharedKeyParallel`` of the config's ``qk_rope_head_dim``)."""
    plan = _folded(model, _folded(model, plan, "moe_tp_experts", _experts_fold), "local_params", _local_params_fold)
    rope_dim = getattr(text_config(model), "qk_rope_head_dim", None)
    return {k: SharedKeyParallel(rope_dim) if v == "mla_kv_a_proj" and isinstance(rope_dim, int)
            else RowwiseOwnOutput() if v == "rowwise" and k.endswith(_ADDED_INTO) else v for k, v in plan.items()}


def _folded(model: nn.Module, plan: dict, name: str, fold) -> dict:
    """`plan` with each entry of transformers' style `name` made the style ``fold(modules, params, entries)``
    returns for it (the modules it names, their own parameters, the plan's entries naming those), those entries
    dropped; an entry `fold` returns None for is left as it is, for :func:`check_tp_plan` to refuse by name."""
    out = dict(plan)
    for pattern, style in plan.items():
        modules = [m for _, m in match_modules(model, [pattern])] if style == name else []
        params = {n: p for m in modules for n, p in m.named_parameters(recurse=False)}  # some layers hold none
        entries = {n: plan[f"{pattern}.{n}"] for n in params if f"{pattern}.{n}" in plan}
        made = fold(modules, params, entries) if modules else None
        if made is not None:
            out[pattern] = made
            for n in entries:
                del out[f"{pattern}.{n}"]
    return out


# Row-split layers whose output the family adds into in place (autograd forbids it on the view torch's
# RowwiseParallel hands over): Llama 4's MoE adds its experts' rows into its shared expert's output.
_ADDED_INTO = ("feed_forward.shared_expert.down_proj",)
# Experts whose forward takes every expert's rows at once, grouped by expert, [E * tokens, H] (ExpertsParallel's
# blocked contract): Llama 4's.
_BLOCKED_EXPERTS = ("Llama4TextExperts",)


def _experts_fold(modules, params, entries):
    """A ``moe_tp_experts`` module of stacked experts, its parameters' entries beside it: split by
    :class:`ndp.parallel.ExpertsParallel` where it can, the TP ranks splitting the experts instead of each expert's
    width (the same memory and all-reduce, a layout checkpoints save)."""
    if all(type(m).__name__ in _BLOCKED_EXPERTS and expert_count(m, blocked=True) for m in modules):
        return ExpertsParallel(blocked=True)
    return ExpertsParallel() if all(expert_count(m) and _skips_other_experts(m) for m in modules) else None


def _local_params_fold(modules, params, entries):
    """A ``local_params`` module (it uses parameters of its own per head beside its split projections: attention
    sinks), its parameters' entries "colwise" (split along the output dim): one :class:`ndp.parallel.LocalParams`."""
    if not entries or any(s != "colwise" for s in entries.values()):
        return None
    return LocalParams({n: max(params[n].ndim - 2, 0) for n in entries})


def _skips_other_experts(experts: nn.Module) -> bool:
    """Whether the experts' forward skips the index ``num_experts`` (an expert another rank holds): transformers'
    batched and grouped kernels do; its loop does where the family's own loop does (Nemotron-H's indexes it)."""
    if getattr(getattr(experts, "config", None), "_experts_implementation", "eager") != "eager":
        return True
    forward = type(experts).forward
    try:
        return "== self.num_experts" in inspect.getsource(getattr(forward, "__wrapped__", forward))
    except (OSError, TypeError):  # no source to read: not known to skip them
        return False


# The tensor-parallel styles a LoRA layer is split by: its base layer's, and the one adapter matrix whose split
# keeps the adapter's product on the base layer's split (the other one stays whole on every rank: colwise splits
# lora_B's outputs, lora_A's rank-r output whole; rowwise splits lora_A's inputs, its output summed over the ranks
# as the base layer's is, then lora_B whole).
_LORA_SPLIT = {"colwise": "lora_B", "colwise_rep": "lora_B", "colwise_gather_output": "lora_B", "rowwise": "lora_A",
               "rowwise_rep": "lora_A", "rowwise_split_input": "lora_A"}


def _lora_tp_plan(model: nn.Module, inner_plan: dict) -> dict:
    """The plan of a PEFT wrapper from the plan of the model it wraps (names under that model): each entry named
    under the wrapper, and a LoRA layer's entry given to its ``base_layer`` and, by :data:`_LORA_SPLIT`, to one of
    its adapter matrices (every adapter's); an entry on a layer ndp cannot split so stays on the layer, for
    :func:`check_tp_plan` to refuse by name."""
    where = next(n for n, m in model.named_modules() if m is peft_inner(model))
    plan = {}
    for pattern, style in inner_plan.items():
        full = f"{where}.{pattern}"
        matched = match_modules(model, [full])
        if not any(_lora_layer(m) for _, m in matched) or style not in _LORA_SPLIT:
            plan[full] = style
            continue
        for name, layer in matched:  # by name: PEFT may adapt some of the pattern's layers only
            if not _lora_layer(layer):
                plan[name] = style
                continue
            plan[f"{name}.base_layer"] = style
            for adapter in getattr(layer, _LORA_SPLIT[style]).keys():
                plan[f"{name}.{_LORA_SPLIT[style]}.{adapter}"] = style
                if style == "rowwise" and getattr(layer.lora_dropout[adapter], "p", 0.0):
                    plan[f"{name}.lora_dropout.{adapter}"] = ColumnDropout(layer.base_layer.in_features)
    return plan


class ColumnDropout(ParallelStyle):
    """A LoRA adapter's dropout before a row-split ``lora_A``, whose input is this TP rank's columns of the layer's
    input: it draws the whole input's mask, as one process's dropout does (the TP ranks draw alike,
    ``ndp.parallel.draws``), and keeps this rank's columns. Drawn on the columns alone, each rank's part would get
    the same mask, and the random streams would run apart from one process's."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        module.__class__ = _ColumnDropout  # in place: PEFT's layer keeps calling the same module
        module.width, module.tp = self.width, device_mesh
        return module


class _ColumnDropout(nn.Dropout):
    def forward(self, x):
        if not self.training or not self.p:
            return x
        part = -(-self.width // self.tp.size())  # DTensor's Shard: torch.chunk's parts
        start = self.tp.get_local_rank() * part
        noise = F.dropout(x.new_ones(*x.shape[:-1], self.width), self.p)
        return x * noise[..., start:start + x.shape[-1]].contiguous()  # a copy: the whole mask is not kept


def _lora_layer(module: nn.Module) -> bool:
    """Whether `module` is one of PEFT's LoRA layers around a linear layer (base_layer, lora_A / lora_B dicts)."""
    return all(isinstance(getattr(module, k, None), (nn.Linear, nn.ModuleDict)) for k in ("base_layer", "lora_A",
                                                                                         "lora_B"))


def _lora_tp_problem(model: nn.Module, inner_plan: dict) -> str | None:
    """Why ndp cannot split a PEFT wrapper's adapted layers by `inner_plan` (the wrapped model's plan) exactly, else
    None: a PEFT method other than LoRA, DoRA (its magnitude renormalizes the whole weight), a planned layer of
    another kind."""
    config = getattr(model, "active_peft_config", None)
    method = str(getattr(getattr(config, "peft_type", None), "value", config))
    if method != "LORA":
        return f"its PEFT method is {method}, and ndp splits LoRA adapters only"
    if getattr(config, "use_dora", False):
        return "DoRA rescales each adapted layer by the norm of its whole weight, which the split leaves on no rank"
    inner = peft_inner(model)
    odd = [n for pattern in inner_plan for n, m in match_modules(inner, [pattern])
           if any(k.startswith("lora_") for k in dict(m.named_children())) and not _lora_layer(m)]
    if odd:
        return f"{', '.join(odd[:3])} {'is' if len(odd) == 1 else 'are'} adapted by PEFT modules ndp does not split"
    return None


def check_tp_plan(model: nn.Module, tp_plan) -> None:
    """Raise :class:`Unsupported` unless ndp can apply `tp_plan` (``hf_plan(model).tp_plan``), the model's own
    tensor-parallel plan, exactly: a model without a plan is not guessed one (a layer laid out like Llama's may hold
    per-head norms a split applies to another rank's heads); experts ndp cannot split by experts
    (:func:`_experts_fold`: not stacked, or a loop that runs every index), a style ndp does not implement (MLA
    projections, local parameters) and a parameter the plan splits by itself are named; so are parameters the plan
    leaves whole inside a module whose projections it splits by columns, other than a per-head norm's or an
    activation's scalars (:func:`_completed` sums their gradients; Doge's per-head ``A``, a sparse indexer's
    projections: each rank would compute them on its share only) and Gemma 3n's activation sparsity
    (statistics over the split width). A PEFT wrapper: LoRA only, without DoRA (:func:`_lora_tp_problem`), the
    wrapped model checked with its own plan."""
    name = type(model).__name__
    fix = (f"Train {name} with tp_size=1 (shard it with dp_shard, split the sequence with cp), or pass a plan of your "
           f"own: ndp.hf.parallelize(..., plan=ndp.parallel.ModelPlan(tp_plan=...)).")
    if peft_inner(model) is not model:
        inner = peft_inner(model)
        inner_plan = _own_tp_plan(inner)
        problem = _lora_tp_problem(model, inner_plan)
        if problem:
            raise Unsupported(f"tensor parallel: {name} is a PEFT model and {problem}. {fix}")
        return check_tp_plan(inner, inner_plan)  # the wrapped model's plan, its entries its own
    if not _own_tp_plan(model):
        raise Unsupported(f"tensor parallel: {name} has no tensor-parallel plan that names its modules (its "
                          f"config's base_model_tp_plan and its text decoder's are empty, or name none of the "
                          f"modules this model holds) and ndp does not guess one. {fix}")
    experts = [k for k, v in tp_plan.items() if v == "moe_tp_experts"]  # left by _experts_fold
    if experts:
        raise Unsupported(f"tensor parallel: {name}'s plan (base_model_tp_plan) splits the experts "
                          f"{', '.join(experts)} ('moe_tp_experts'), which ndp splits by experts where the module "
                          f"stacks them (num_experts the first dim of each of its parameters) and its forward skips "
                          f"the experts other ranks hold (transformers' expert-parallel kernels: "
                          f"experts_implementation 'batched_mm' or 'grouped_mm', or a loop that skips them); "
                          f"{', '.join(type(m).__name__ for _, m in match_modules(model, experts[:1]))} does not. "
                          f"{fix}")
    unknown = {k: v for k, v in tp_plan.items() if isinstance(v, str) and v not in TP_STYLES}
    if unknown:
        raise Unsupported(f"tensor parallel: {name}'s plan (base_model_tp_plan) splits "
                          f"{', '.join(f'{k} as {v!r}' for k, v in unknown.items())}, styles ndp does not implement "
                          f"(it implements {', '.join(sorted(TP_STYLES))}, and stacked experts). {fix}")
    bare = [k for k, v in tp_plan.items() if isinstance(v, str) and not match_modules(model, [k])]
    if bare:
        raise Unsupported(f"tensor parallel: {name}'s plan (base_model_tp_plan) splits the parameters "
                          f"{', '.join(bare[:4])} by themselves, outside a module ndp splits whole (ndp splits "
                          f"stacked experts' parameters with their module's 'moe_tp_experts' entry only). {fix}")
    loose = _whole_in_split_modules(model, tp_plan)
    if loose:
        raise Unsupported(f"tensor parallel: {name}'s plan splits the outputs of projections by columns over the "
                          f"tensor-parallel ranks but leaves {', '.join(loose[:4])}{' ...' if len(loose) > 4 else ''} "
                          f"whole beside them: each rank would compute it on its share of the split outputs (its "
                          f"gradient one rank's part). {fix}")
    if any(getattr(text_config(model), "activation_sparsity_pattern", None) or ()):
        raise Unsupported(f"tensor parallel: {name}'s activation sparsity keeps each token's largest MLP activations "
                          f"by statistics over the whole MLP width, which tensor parallel splits. {fix}")


# Multi-head latent attention's compressions: the query's down-projection and norm and the keys' and values' norm
# compute on the whole activations, before the column-split up-projections (q_b_proj, kv_b_proj) whose styles sum
# their inputs' gradients: whole on every rank by the plan, exact.
_MLA_WHOLE = ("q_a_proj", "q_a_layernorm", "kv_a_layernorm")


def _whole_in_split_modules(model: nn.Module, tp_plan) -> list[str]:
    """Parameters that no plan entry covers inside a module one of whose children the plan splits by columns
    ("colwise": outputs left split for a rowwise layer); not the root's (a vocabulary-split LM head feeds the loss),
    nor an MLA attention's compressions (:data:`_MLA_WHOLE`, beside its ``SharedKeyParallel``)."""
    covered = [n for n, _ in match_modules(model, tp_plan)]
    split = {n.rpartition(".")[0] for n, _ in match_modules(model, [k for k, v in tp_plan.items() if v == "colwise"])}
    mla = {n.rpartition(".")[0] for n, _ in match_modules(model, [k for k, v in tp_plan.items()
                                                                  if isinstance(v, SharedKeyParallel)])}
    split.discard("")
    loose = []
    for parent in sorted(split):
        for pname, _ in model.get_submodule(parent).named_parameters():
            full = f"{parent}.{pname}"
            if not any(full.startswith(c + ".") for c in covered) and not (parent in mla and
                                                                          pname.split(".")[0] in _MLA_WHOLE):
                loose.append(full)
    return loose


def _tied_input_embedding(model: nn.Module) -> str | None:
    """The name of the input embedding when the output embedding shares its weight (tie_word_embeddings)."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if emb is None or head is None or getattr(head, "weight", None) is not getattr(emb, "weight", False):
        return None
    return next((n for n, m in model.named_modules() if m is emb), None)


def _loss_parallel_head(model: nn.Module) -> str:
    """The name of the output embedding a vocabulary-parallel loss splits."""
    head = model.get_output_embeddings()
    name = next((n for n, m in model.named_modules() if m is head and head is not None), None)
    if not isinstance(head, nn.Linear) or name is None:
        raise Unsupported(f"loss_parallel splits the output embedding, an nn.Linear; {type(model).__name__}'s is "
                          f"{type(head).__name__}. Leave loss_parallel off.")
    if _tied_input_embedding(model) is not None:
        raise Unsupported(f"loss_parallel splits the output embedding by vocabulary rows; {type(model).__name__}'s "
                          f"is tied to the input embedding (tie_word_embeddings), which tensor parallel keeps whole. "
                          f"Leave loss_parallel off (the fused loss then computes the whole vocabulary per rank).")
    return name


def can_split_head(model: nn.Module) -> bool:
    """Whether ``parallelize(..., loss_parallel=True)`` can split `model`'s output embedding by vocabulary over the
    tensor-parallel ranks (an untied top-level nn.Linear): the one place this is asked."""
    try:
        _loss_parallel_head(model)
    except Unsupported:
        return False
    return True


def init_weights(model: nn.Module, *, seed: int) -> nn.Module:
    """Initialize a materialized transformers model with ndp's seeded per-module scheme (``ndp.parallel.init``).

    Each module's own parameters and buffers are set by the model's own ``_init_weights`` (its distributions,
    norms to one, RoPE ``inv_freq`` recomputed from the config) after seeding the CPU generator from
    ``(seed, module name)``: a meta-device model given to :func:`parallelize` with ``init_seed=seed`` gets
    exactly this model's shards. Tied weights (``lm_head`` = ``embed_tokens``) stay one tensor, set once.

    Args:
        model: a transformers model, materialized (e.g. built on meta, then ``to_empty(device="cpu")``).
        seed: the run seed.
    Returns:
        the model, initialized in place.
    Raises:
        ValueError: a parameter or buffer the model's ``_init_weights`` does not set.
    """
    return _seeded_init_weights(model, seed=seed, init_module=SubmodelInit(model))


class SubmodelInit:
    """A transformers model's per-module init (``ModelPlan.init_module``) as transformers' ``initialize_weights``
    dispatches it: each module by the ``_init_weights`` of the innermost ``PreTrainedModel`` holding it (a vision
    tower's modules by the tower's own, an inner model's by the inner model's), never the outer model's alone.
    ``bind(copy)`` gives the same dispatch on a copy of the model (the meta build initializes a copy)."""

    def __init__(self, model: nn.Module):
        self._model, self._direct = model, None  # bound at the first direct call: the builds call bind(copy)

    @staticmethod
    def bind(model: nn.Module):
        inits, stack = {}, [(model, model)]
        while stack:
            module, owner = stack.pop()
            owner = module if isinstance(module, transformers.PreTrainedModel) else owner
            inits[id(module)] = owner._init_weights
            stack.extend((child, owner) for child in module.children())
        return lambda module: inits[id(module)](module)

    def __call__(self, module: nn.Module) -> None:
        if self._direct is None:
            self._direct = self.bind(self._model)
        self._direct(module)

    def __repr__(self) -> str:
        return f"{type(self._model).__name__}'s _init_weights, per sub-model"


def parallelize(model: nn.Module, config: ParallelismConfig, mesh, **kwargs) -> nn.Module:
    """``ndp.parallel.parallelize`` with the plan of a transformers causal LM (see :func:`hf_plan`).

    Args:
        model: e.g. ``LlamaForCausalLM`` built identically on every rank.
        config, mesh: the ParallelismConfig and its ``build_device_mesh`` mesh.
        kwargs: loss_parallel (see :func:`hf_plan`; the logits are then vocabulary shards: use :func:`lm_loss`),
            passed on (plan to override :func:`hf_plan`, mp_policy, activation_checkpointing, compile,
            reshard_after_forward, init_seed, init_device). A model that is not a transformers model takes the
            generic path. A model on the meta device is materialized shard by shard, initialized as
            :func:`init_weights` with ``seed=init_seed`` would (see ``ndp.parallel.parallelize``).
    Returns:
        the model, parallelized in place, its attention switched to ``ndp_<cp_impl>``.
    Raises:
        ValueError: heads not divisible by tp / the Ulysses degree.
        Unsupported: see :func:`check_model`; tp_size > 1 with the model's own plan where :func:`check_tp_plan`
            refuses it.
    """
    loss_parallel = kwargs.pop("loss_parallel", False)
    if not is_transformers_model(model):
        # Not a transformers model: the generic path (FSDP/AC over its repeated blocks, or kwargs["plan"]).
        return _parallelize(model, config, mesh, **kwargs)
    config = as_config(config)  # Accelerate's ParallelismConfig too
    check_model(model, config)
    loss_parallel = loss_parallel and config.tp_size > 1
    if "plan" not in kwargs:
        kwargs["plan"] = hf_plan(model, loss_parallel=loss_parallel)
        if config.tp_size > 1:
            check_tp_plan(model, kwargs["plan"].tp_plan)
    model.ndp_loss_parallel = loss_parallel
    if ac_mode(kwargs.get("activation_checkpointing")) != "none":
        # A recomputed layer would append its keys and values to the KV cache a second time (as transformers'
        # own gradient checkpointing, ndp's turns the cache off).
        model.config.use_cache = False
    return _parallelize(model, config, mesh, **kwargs)


def loss(logits, labels, model, *, ignore_index: int = -100, num_tokens=None, return_mean: bool = False):
    """Token cross-entropy of this rank's shard, scaled so that FSDP's gradient averaging yields the
    gradient of the global mean loss (every labelled token of every DP and CP rank counts once).

    FSDP2/HSDP average gradients over the ``fsdp_size = dp_replicate x dp_shard x cp`` ranks, so each
    rank back-propagates ``local_sum * fsdp_size / global_count``. The global count of labelled tokens
    is summed over the ``dp_cp`` ranks (one all-reduce of two numbers): it is right whether or not the
    batch was split over the data-parallel ranks (an unsplit batch counts each token dp_size times in
    both the sum and the count). Tensor-parallel ranks hold the same tokens and are not counted again.

    Args:
        logits: ``[batch, local_seq, vocab]`` (any float dtype; the loss is computed in fp32, or fp64 for fp64).
        labels: ``[batch, local_seq]`` int64, shifted before sharding (``ndp.hf.shard_batch``).
        model: the model returned by :func:`parallelize` (carries the degrees and the mesh).
        ignore_index: label value that marks tokens without a label.
        num_tokens: the global number of labelled tokens, when known (e.g. over all micro-batches of a
            step under gradient accumulation); None: counted here with one all-reduce.
        return_mean: also return the global mean loss (detached fp32 scalar, identical on every rank;
            for logging).
    Returns:
        the loss to call ``.backward()`` on (fp32 scalar); ``(loss, mean)`` when ``return_mean``.
    Raises:
        ValueError: the model was not parallelized by ndp, or logits and labels do not match.
    """
    parallel_state(model, "ndp.hf.loss")
    if getattr(model, "ndp_loss_parallel", False):
        raise ValueError("ndp.hf.loss: the model's LM head is split by vocabulary over the tensor-parallel ranks "
                         "(parallelize(..., loss_parallel=True)): its logits are one rank's columns, not the "
                         "vocabulary. Use ndp.hf.lm_loss(model, labels, **inputs).")
    if logits.dim() < 2 or tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise ValueError(f"ndp.hf.loss needs logits [batch, local_seq, vocab] and labels [batch, local_seq]; got "
                         f"logits {tuple(logits.shape)}, labels {tuple(labels.shape)}. Pass the labels that "
                         f"shard_batch returned with the input_ids.")
    labels = _class_labels(labels, ignore_index, "ndp.hf.loss")
    # fp32 at least (float64 logits stay float64)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    local_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                ignore_index=ignore_index, reduction="sum")
    return scale_loss_sum(local_sum, labels, model, ignore_index=ignore_index, num_tokens=num_tokens,
                          return_mean=return_mean)


def lm_loss(model, labels, *, ignore_index: int = -100, num_tokens=None, return_mean: bool = False,
            chunk_bytes: int = CHUNK_BYTES, **inputs):
    """:func:`loss` of ``model(**inputs)`` without the logits: the model runs to its hidden states and its LM head
    and the token cross-entropy run fused, a block of logits at a time (``ndp.hf.head.head_loss``), so that no
    ``[batch, local_seq, vocab]`` tensor is ever allocated. Same value, gradients and normalisation as
    ``loss(model(**inputs).logits, labels, model, ...)``.

    Args:
        model, labels, ignore_index, num_tokens, return_mean: as :func:`loss`.
        chunk_bytes: the fused op's working memory (fp32 logits of one block, ``ndp.ops.linear_ce.tiles``).
        inputs: the model's forward arguments from ``shard_batch`` (input_ids, position_ids, ...; not labels).
    Returns:
        as :func:`loss`.
    Raises:
        ValueError: as :func:`loss`.
        Unsupported: the model's LM head or what its forward does to the logits cannot be fused exactly
            (see ``ndp.hf.head``): use :func:`loss` on the logits.
    """
    parallel_state(model, "ndp.hf.lm_loss")
    labels = _class_labels(labels, ignore_index, "ndp.hf.lm_loss")
    local_sum = head_loss(model, labels, ignore_index=ignore_index, chunk_bytes=chunk_bytes, **inputs)
    return scale_loss_sum(local_sum, labels, model, ignore_index=ignore_index, num_tokens=num_tokens,
                          return_mean=return_mean)


def _class_labels(labels, ignore_index, what):
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(f"{what} needs integer class labels (token ids, {ignore_index} for none); got labels of "
                         f"dtype {labels.dtype}. Pass the labels shard_batch returned (input_ids shifted by one), as "
                         f"torch.long.")
    return labels.long()


def scale_loss_sum(local_sum, labels, model, *, ignore_index: int = -100, num_tokens=None, return_mean: bool = False):
    """The one loss normalisation of ndp (:func:`loss`, :func:`lm_loss`, ``ndp-train``): this rank's summed token
    loss scaled so that FSDP's gradient averaging yields the gradient of the global mean loss, for a loss summed by
    any means (e.g. a custom loss over the shard ``shard_batch`` returned).

    Returns ``local_sum * fsdp_size / count`` (``count``: `num_tokens`, or the labelled tokens of `labels` summed
    over the ``dp_cp`` ranks, one all-reduce of two numbers; at least 1), ``(loss, global mean)`` with
    `return_mean` (the mean detached fp32, identical on every rank). Raises ValueError for a model ndp did not
    parallelize."""
    state, _ = parallel_state(model, "ndp.hf.scale_loss_sum")
    stats = torch.stack([local_sum.detach().double(), (labels != ignore_index).sum().double()])
    group = state.axis("dp_cp")
    if group is not None and group.size() > 1 and (num_tokens is None or return_mean):
        dist.all_reduce(stats, group=group.get_group())
    count = stats[1] if num_tokens is None else torch.as_tensor(float(num_tokens), dtype=torch.float64,
                                                                 device=stats.device)
    count = count.clamp(min=1)  # a batch without labels gives 0, not NaN
    out = local_sum * (state.config.fsdp_size / count).to(local_sum.dtype)
    if return_mean:
        return out, (stats[0] / count).float()
    return out


__all__ = ["shard_batch", "loss", "lm_loss", "scale_loss_sum", "head_loss", "can_split_head", "init_weights",
           "SubmodelInit",
           "register_attention", "ndp_attention_forward", "hf_plan", "parallelize", "check_model", "check_tp_plan",
           "IMPL_NAMES",
           "DEFAULT_TP_PLAN", "Unsupported", "attention_modules", "decoder_layers", "layer_stacks", "check_cp_model",
           "check_packed_model", "text_config", "ColumnDropout"]
