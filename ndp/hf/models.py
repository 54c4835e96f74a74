"""What ndp can see of a transformers causal LM before it parallelizes it: where its attention modules and decoder
layers are, and which of its layers mix tokens in ways ndp's context parallelism cannot split exactly.

ndp's CP replaces one thing, the attention call made through transformers' ``AttentionInterface``. Anything else that
mixes information along the sequence (a recurrent or state-space layer, a causal convolution, an attention the
model computes itself, a sparse "indexer" that picks keys from the whole sequence) would run on each rank's shard
alone and give a different model. Such a model is refused by name (:class:`Unsupported`) on every rank, before
any work. Token mixers and attention outside the decoder layers (a multimodal model's vision or audio tower) run on
their own modality's inputs, never on the sharded text: they are allowed, and refused when they run under CP
(:func:`outside_layers`; ``ndp.hf.attention.guard_outside_layers``), so text-only batches train exactly.

A head that reads chosen positions of each row rather than every token's output (sequence classification's last
non-pad token, question answering's span over the row, a multiple-choice token) would read them in each rank's shard
(or, over packed documents, in the row's last document alone): refused too, unless its caller reads it on the
gathered rows (``POOLED_ON_WHOLE``: ndp.trainer's sequence classification and question answering, :func:`row_head`;
packed rows stay refused). Per-token heads (causal LM, token classification) and the base model are exact. So is a
PEFT wrapper whose adapters change weights (LoRA, DoRA): it is judged by the model it wraps (:func:`peft_inner`);
one that learns virtual tokens before each row (prompt, prefix, P-tuning) would put them at every shard's start:
refused.
"""
from __future__ import annotations

import functools
import inspect
import re

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel
from transformers.modeling_layers import (GenericForQuestionAnswering, GenericForSequenceClassification,
                                         GenericForTokenClassification, GradientCheckpointingLayer)

from .mixers import head_split_problem, split_target


class Unsupported(ValueError):
    """ndp cannot run this model or attention call exactly; the message names the feature and what to do."""


# Class-name markers of token-mixing layers that are not attention through the AttentionInterface.
_RECURRENT = re.compile(r"Mamba|Mixer|SSM|Recurrent|RGLRU|Rwkv|RWKV|LSTM|Lstm|xLSTM|DeltaNet|LinearAttention|"
                        r"Lightning|ShortConv|GatedConv|Retention")
_INDEXER = re.compile(r"Indexer")
_ATTENTION = re.compile(r"Attention|Attn")
# Class-name markers of heads that read chosen positions of a row (transformers' sequence-classification,
# question-answering, multiple-choice and next-sentence heads, GPT-2's double heads; remote code named alike).
_POOLING_HEAD = re.compile(r"For(SequenceClassification|QuestionAnswering\w*|MultipleChoice|NextSentencePrediction)$|"
                           r"DoubleHeadsModel$")


def text_config(model: nn.Module):
    """The config that holds the decoder's sizes (a multimodal wrapper's text config, else the model's)."""
    cfg = model.config
    get = getattr(cfg, "get_text_config", None)
    return get(decoder=True) if get is not None else cfg


def head_counts(cfg) -> list[tuple[int, int]]:
    """(query heads, key/value heads) of the decoder's layers: one pair, or one per kind of layer where the config
    sets them per layer (a heterogeneous config, dots3_note: reading them from the whole config raises there)."""
    layers = cfg.per_layer_config if getattr(cfg, "is_heterogeneous", False) else [cfg]
    counts = set()
    for c in layers:
        heads = getattr(c, "num_attention_heads", None)
        if heads is not None:
            counts.add((heads, getattr(c, "num_key_value_heads", None) or heads))
    return sorted(counts)


@functools.lru_cache(maxsize=None)
def _forward_names(cls, name: str) -> bool:
    """Whether the source of ``cls.forward`` names `name` (False where there is no source)."""
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return name in src


def _calls_interface(cls) -> bool:
    # transformers' attention modules look their implementation up in ALL_ATTENTION_FUNCTIONS at each forward.
    return _forward_names(cls, "ALL_ATTENTION_FUNCTIONS")


def attention_modules(model: nn.Module) -> list[str]:
    """Names of the modules whose forward calls transformers' AttentionInterface (the ones ndp replaces)."""
    return [name for name, m in model.named_modules() if name and _calls_interface(type(m))]


def text_decoder(model: nn.Module) -> str:
    """Name of the text decoder transformers' ``get_decoder()`` returns ("" for the model itself or none): a
    multimodal model's vision or audio encoder may hold more attention layers than its language model."""
    try:
        dec = model.get_decoder()
    except Exception:  # noqa: BLE001 - not every model defines it; the whole model is searched then
        return ""
    return next((name for name, m in model.named_modules() if m is dec), "")


def layer_stacks(model: nn.Module) -> list[str]:
    """The text decoder's layer stacks: of its ModuleLists that hold attention modules, the shallowest ones (a
    tower inside the decoder module nests deeper: phi4_multimodal's audio encoder; hrm_text has two stacks), the
    one holding the most attention modules first."""
    attn = attention_modules(model)
    dec = text_decoder(model)
    found = []
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > 0 and (not dec or inside(name, [dec])):
            count = sum(1 for a in attn if a.startswith(f"{name}."))
            if count:
                found.append((name.count("."), -count, name))
    depth = min((f[0] for f in found), default=None)
    return [name for d, _, name in sorted(found) if d == depth]


def decoder_layers(model: nn.Module) -> tuple[str, list[str]]:
    """(``<list>.*`` pattern, names) of the decoder layers: the first of the text decoder's stacks."""
    stacks = layer_stacks(model)
    if not stacks:
        return "", []
    best = stacks[0]
    return f"{best}.*", [f"{best}.{i}" for i in range(len(model.get_submodule(best)))]


def _mixer_names(module: nn.Module) -> list[str]:
    # not a module that calls the AttentionInterface, whatever its name (Kimi Linear's full attention is
    # KimiLinearAttention)
    return [name for name, m in module.named_modules()
            if isinstance(m, nn.Conv1d) or not _calls_interface(type(m)) and (
                _RECURRENT.search(type(m).__name__) or _INDEXER.search(type(m).__name__))]


def inside(name: str, layers: list[str]) -> bool:
    """Whether module `name` is one of `layers` or inside one."""
    return any(name == layer or name.startswith(f"{layer}.") for layer in layers)


def outside_layers(model: nn.Module) -> list[str]:
    """Names of the outermost token mixers and attention modules that sit outside the decoder layers (vision and
    audio towers); empty when the model has no decoder layers (then every mixer is the text model's)."""
    layers = layer_stacks(model)
    if not layers:
        return []
    found = [n for n in _mixer_names(model) + attention_modules(model) if n and not inside(n, layers)]
    return sorted(n for n in found if not any(inside(n, [o]) and n != o for o in found))


def kv_shared_layers(model: nn.Module) -> list[str]:
    """The modules that take their keys and values from an earlier layer (transformers' KV sharing, Gemma 3n /
    Gemma 4 / Mistral Large 4: ``is_kv_shared_layer``), which reach them in a dict outside the layers' arguments."""
    return [name for name, m in model.named_modules() if getattr(m, "is_kv_shared_layer", False) is True]


def reentrant_checkpointed(model: nn.Module) -> list[str]:
    """The decoder layers transformers' activation checkpointing runs with ``use_reentrant=True`` (given, or
    torch's default when not given: ``gradient_checkpointing_kwargs={}``). Such a layer is differentiated through
    its positional arguments alone; a checkpoint function ndp cannot read (not torch's) is not listed."""
    out = []
    for name, m in model.named_modules():
        fn = getattr(m, "_gradient_checkpointing_func", None)
        if not (isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing and fn is not None):
            continue
        partial = isinstance(fn, functools.partial)
        keywords = fn.keywords if partial else {}
        if "use_reentrant" in keywords or (fn.func if partial else fn) is checkpoint:
            if keywords.get("use_reentrant") in (None, True):
                out.append(name)
    return out


def counted_positions(model: nn.Module) -> list[str]:
    """Names of the positional embeddings that number a row's tokens themselves when given no position_ids, from
    padding_idx + 1 over its non-pad tokens (fairseq's convention, transformers' ``create_position_ids_from_input_ids``:
    Kosmos-2.5's text model), and take given position_ids as they are."""
    return [name for name, m in model.named_modules()
            if callable(getattr(m, "create_position_ids_from_input_ids", None))
            and isinstance(getattr(m, "padding_idx", None), int)]


def cp_attention_modules(model: nn.Module) -> list[str]:
    """The attention modules CP runs: those not in :func:`outside_layers`."""
    outside = outside_layers(model)
    return [name for name in attention_modules(model) if not inside(name, outside)]


def _mixers(module: nn.Module) -> list[str]:
    """The token mixers CP cannot split, as ``name (class)``: those of the decoder layers (or all, without any)."""
    outside = outside_layers(module)
    return [f"{name or '.'} ({type(module.get_submodule(name)).__name__})" for name in _mixer_names(module)
            if not inside(name, outside)]


def _named_mixers(module: nn.Module, mixers: list[str]) -> list[str]:
    """Of :func:`_mixers`, the ones to name to a user: the innermost whose class, the family's prefix taken off,
    names a mixer (``MambaMixer``, not ``MambaBlock``, ``MambaRMSNorm`` or the model, matched for their prefix),
    and the convolutions outside those; all of them where that leaves none."""
    family = re.match(r"(.+?)(For[A-Z]|Model|LMHead|WithLMHead|$)", type(module).__name__).group(1)
    names = [m.rsplit(" (", 1)[0] for m in mixers]
    mods = {n: module.get_submodule("" if n == "." else n) for n in names}
    kept = [n for n in names if not isinstance(mods[n], PreTrainedModel) and "Norm" not in type(mods[n]).__name__]
    role = {n: type(mods[n]).__name__.removeprefix(family) for n in kept}
    own = [n for n in kept if _RECURRENT.search(role[n]) or _INDEXER.search(role[n])]
    own = [n for n in own if not any(o != n and o.startswith(f"{n}.") for o in own)]
    convs = [n for n in kept if role[n] == "Conv1d" and not any(n.startswith(f"{o}.") for o in own)]
    shown = set(own + convs) or set(kept)
    return [m for m, n in zip(mixers, names) if n in shown] or mixers


def _layers(model: nn.Module) -> list[str]:
    """Every decoder layer of the text decoder's stacks, by name."""
    return [f"{s}.{i}" for s in layer_stacks(model) for i in range(len(model.get_submodule(s)))]


def gathered_mixers(model: nn.Module) -> list[str] | None:
    """The modules CP runs on the gathered sequence (``cp_mixers="gather"``, ``ndp.hf.mixers``): for each token mixer
    of the decoder layers, its outermost ancestor inside its decoder layer that is not and holds no attention module
    CP runs (a gated DeltaNet whole, a Mamba mixer, the projection a short convolution sits in), so that whatever
    the layer does along the sequence around the mixer (a shift, a pad) runs on the whole sequence too. None where a
    mixer sits outside every decoder layer (an attention-free model: CP would split nothing)."""
    layers, attn = _layers(model), cp_attention_modules(model)
    found = set()
    for name in (m.rsplit(" (", 1)[0] for m in _mixers(model)):
        if any(inside(lay, [name]) for lay in layers):
            continue  # a decoder layer or the model, named like a mixer (JambaMambaDecoderLayer): its mixer counts
        layer = next((lay for lay in layers if name.startswith(f"{lay}.")), None)
        if layer is None:
            return None
        top = name
        while (up := top.rpartition(".")[0]) != layer and not any(inside(a, [up]) for a in attn):
            top = up
        found.add(top)
    return sorted(n for n in found if not any(o != n and inside(n, [o]) for o in found))


def _mixing_outside_attention(model: nn.Module, gather: bool = False) -> str | None:
    """What in the text decoder mixes tokens outside the attention call ndp replaces (a noun phrase naming the
    modules), else None; with `gather`, the mixers :func:`gathered_mixers` runs on the gathered sequence are not
    named."""
    mixers = _mixers(model)
    indexers = [m for m in mixers if _INDEXER.search(m)]
    if indexers:
        return f"sparse indexed attention ({', '.join(indexers[:3])}), which selects keys from the whole sequence,"
    if mixers and not (gather and gathered_mixers(model) is not None):
        shown = _named_mixers(model, mixers)
        return (f"layers that mix tokens outside attention ({', '.join(shown[:4])}{', ...' if len(shown) > 4 else ''}"
                f": recurrent, state-space, linear-attention or convolution layers)")
    attn = attention_modules(model)
    if not attn:
        return "an attention the model computes itself (no module of it calls transformers' AttentionInterface)"
    gathered = (gathered_mixers(model) or []) if gather else []
    # gathering a hybrid's mixers, a layer that holds neither them nor attention is taken for its MLP or MoE layer
    # (Nemotron-H's), unless a module of it is named like an attention
    without = [name for name in _layers(model) if not any(a.startswith(f"{name}.") for a in attn + gathered)
               and (not gather or any(_ATTENTION.search(type(m).__name__)
                                      for m in model.get_submodule(name).modules()))]
    if without:
        return f"decoder layers {without[:4]}, which hold no attention that calls transformers' AttentionInterface,"
    return None


def peft_inner(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (the one its adapters were injected into; what transformers'
    Trainer looks at for a PEFT model), else `model`. Looked up through FSDP2's renamed class."""
    peft = any(c.__module__.startswith("peft.") for c in type(model).__mro__)
    return model.get_base_model() if peft and hasattr(model, "get_base_model") else model


def takes_shift_labels(model: nn.Module) -> bool:
    """Whether the model's own loss (``labels`` given) is transformers' causal-LM loss, which reads the targets from
    ``shift_labels`` when given and divides by ``num_items_in_batch`` (every forward hands its kwargs on); False
    for a model that computes its loss itself (BART's decoder family, Whisper, XLNet: a mean over this rank's
    tokens of ``labels`` as given)."""
    model = peft_inner(model)  # a PEFT wrapper hands its kwargs on to the model it wraps
    fn = getattr(model, "loss_function", None)
    return _forward_names(type(model), "self.loss_function(") and getattr(fn, "__name__", "") == "ForCausalLMLoss"


# Set on a sequence-classification model whose caller pools its scores from the gathered sequence
# (ndp.trainer.RewardTrainer: pooled_last_token), not from each rank's shard.
POOLED_ON_WHOLE = "ndp_pooled_on_whole"


def pools_last_token(model: nn.Module) -> bool:
    """Whether the model's head is transformers' sequence classification (GenericForSequenceClassification: a
    per-token ``score`` Linear, pooled at each row's last token that is not the pad token), which
    :func:`pooled_last_token` reproduces; through a PEFT wrapper and FSDP2's renamed class."""
    return row_head(model) == "score"


def row_head(model: nn.Module) -> str | None:
    """The name of the per-token Linear of transformers' heads that read chosen positions of each row, whose output
    a caller under CP gathers from the shards and reads on the whole row (``score``: GenericForSequenceClassification,
    pooled at the last non-pad token; ``qa_outputs``: GenericForQuestionAnswering, a span's start and end over the
    row), else None; through a PEFT wrapper and FSDP2's renamed class."""
    inner = peft_inner(model)
    for cls, name in ((GenericForSequenceClassification, "score"), (GenericForQuestionAnswering, "qa_outputs")):
        if isinstance(inner, cls) and isinstance(getattr(inner, name, None), nn.Module):
            return name
    return None


def classifies_tokens(model: nn.Module) -> bool:
    """Whether the model's head is transformers' token classification (GenericForTokenClassification: a label per
    token, its loss a mean over the labelled tokens of the call, unshifted), through a PEFT wrapper and FSDP2's
    renamed class. Its forward hands no ``num_items_in_batch`` to that loss: a caller that splits a batch (micro-
    batches, data-parallel ranks, CP shards) computes the loss from the logits with the batch's count."""
    return isinstance(peft_inner(model), GenericForTokenClassification)


def pooled_last_token(model: nn.Module, scores: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """transformers' sequence-classification pooling of per-token `scores` [batch, seq, labels]: each row's scores
    at its rightmost token whose id is not the config's pad token (left or right padding alike), or at the row's
    last token where the config has no pad token (one row only, as transformers refuses more)."""
    pad = peft_inner(model).config.get_text_config().pad_token_id
    if pad is None:
        if scores.shape[0] != 1:
            raise ValueError(f"{type(model).__name__}: pooling a batch of {scores.shape[0]} rows needs the config's "
                             f"pad_token_id (transformers refuses it too); set model.config.pad_token_id.")
        return scores[:, -1]
    kept = (input_ids != pad).to(scores.device, torch.int32)
    last = (torch.arange(input_ids.shape[-1], device=scores.device, dtype=torch.int32) * kept).argmax(-1)
    return scores[torch.arange(scores.shape[0], device=scores.device), last]


def _pooling_head(model: nn.Module, whole_rows: bool = True) -> str | None:
    """What in the model's head reads chosen positions of each row (a noun phrase), else None (none, or, where
    `whole_rows` serves it, one its caller reads on the gathered rows: ``POOLED_ON_WHOLE``; a packed row's
    documents still share it)."""
    if whole_rows and getattr(model, POOLED_ON_WHOLE, False):
        return None
    if isinstance(model, (GenericForSequenceClassification, GenericForQuestionAnswering)) or \
            _POOLING_HEAD.search(type(model).__name__):
        return ("its head reads chosen positions of each row (a pooled last token, an answer span, a choice token) "
                "rather than every token's output")
    return None


def _virtual_tokens(model: nn.Module) -> str | None:
    """The PEFT method, named, when the model is a PEFT wrapper learning a prompt (prompt, prefix, P-tuning:
    virtual tokens before each row, as embeddings or as keys and values), else None."""
    peft_config = getattr(model, "active_peft_config", None) if peft_inner(model) is not model else None
    return str(peft_config.peft_type.value) if getattr(peft_config, "is_prompt_learning", False) else None


def check_cp_model(model: nn.Module, mixers: str = "refuse", cp_size: int = 2) -> None:
    """Raise :class:`Unsupported` when ndp's CP would not compute this model exactly (see the module docstring);
    `mixers` (``ParallelismConfig.cp_mixers``): "gather" accepts the token mixers :func:`gathered_mixers` runs on
    the gathered sequence, "heads" those of them ``ndp.hf.mixers`` splits by heads over `cp_size` ranks."""
    name = type(model).__name__
    if hasattr(model, "config") and any(getattr(c, "is_encoder_decoder", False) for c in (model.config,
                                                                                          text_config(model))):
        raise Unsupported(
            f"{name} is an encoder-decoder model (its decoder cross-attends to the encoder's output, and its labels "
            f"are the decoder's own sequence): ndp's context parallelism shards one decoder-only sequence. Run it "
            f"with cp_size=1.")
    virtual = _virtual_tokens(model)
    if virtual:
        raise Unsupported(
            f"{name}: PEFT's {virtual} puts learned virtual tokens before each row, and under context parallelism "
            f"each rank holds a shard of the row: every shard would get them, at its own start. Run it with "
            f"cp_size=1, or train an adapter that changes weights only (LoRA, DoRA, IA3) under CP.")
    head = _pooling_head(model)
    if head:
        raise Unsupported(
            f"{name}: {head}, and under context parallelism each rank holds a shard of the row: the positions it "
            f"reads would be the shard's. Run it with cp_size=1, or put a per-token head (causal LM, token "
            f"classification) under CP; transformers' sequence classification trains under CP with ndp.trainer.Trainer "
            f"(a classifier) or ndp.trainer.RewardTrainer (a reward model), which pool each row's score from the "
            f"gathered sequence.")
    what = _mixing_outside_attention(model, gather=mixers in ("gather", "heads"))
    if what:
        gatherable = not _mixing_outside_attention(model, gather=True)
        raise Unsupported(
            f"{name}: {what} would see this rank's shard alone under context parallelism (ndp replaces the attention "
            f"call only and cannot pass their state between ranks). Run it with cp_size=1" + (
                ", or set ParallelismConfig(cp_mixers='gather') (ndp-train --cp-mixers gather, NDP_CP_MIXERS=gather) "
                "to run those layers on the whole sequence, gathered on every rank (exact; each rank computes them "
                "over the whole sequence: cp_size times their work, their activations for the whole sequence)."
                if gatherable else "."))
    if mixers == "heads":
        _check_head_splits(model, cp_size)


def check_layerdrop(model: nn.Module, fsdp_size: int) -> None:
    """Raise :class:`Unsupported` for LayerDrop (a module's ``layerdrop`` > 0: OPT, XGLM, BioGPT, the BART family's
    and Whisper's decoders) across the `fsdp_size` > 1 ranks that reduce gradients together (FSDP, HSDP, CP). In
    training it skips each decoder layer on a draw of each rank's own random stream; ranks that drew apart would run
    different layers, their per-layer collectives (FSDP's all-gathers and reductions, CP's attention exchanges)
    paired with another layer's on the other ranks. Under tensor parallel alone the ranks draw alike
    (``ndp.parallel.draws``)."""
    drops = {n: m.layerdrop for n, m in model.named_modules() if isinstance(getattr(m, "layerdrop", None), float)
             and m.layerdrop > 0}
    if drops:
        where, p = next(iter(drops.items()))
        raise Unsupported(
            f"{type(model).__name__}: {where or 'the model'} skips each decoder layer with probability {p} "
            f"(LayerDrop) on a draw of each rank's own random stream: the {fsdp_size} ranks that reduce gradients "
            f"together (data parallel, context parallel) would run different layers, their per-layer collectives out "
            f"of step. Set the config's layerdrop (decoder_layerdrop) to 0.0, or train on one data-parallel rank.")


def _check_head_splits(model: nn.Module, cp_size: int) -> None:
    for name in (split_target(model, n) for n in gathered_mixers(model) or []):
        module = model.get_submodule(name)
        problem = head_split_problem(module, cp_size)
        if problem:
            raise Unsupported(
                f"{type(model).__name__}: cp_mixers='heads' cannot split {name} ({type(module).__name__}) over "
                f"cp_size={cp_size} by heads: {problem}. Set cp_mixers='gather' (ndp-train --cp-mixers gather, "
                f"NDP_CP_MIXERS=gather) to run it whole on the gathered sequence on every rank (exact; cp_size times "
                f"its work).")


def check_packed_model(model: nn.Module) -> None:
    """Raise :class:`Unsupported` when packed documents (several in one row) would not stay apart in this model:
    ndp's attention keeps them apart, a token mixer outside it (:func:`check_cp_model`'s) runs across the row, a
    pooling head reads one position of the row for all its documents."""
    packed = "packed documents (several in one row: position_ids restarting at 0, cu_seq_lens_q or seq_idx)"
    fix = ("Train it on one document per row (unpacked rows, padded with labels -100), e.g. ndp-train without "
           "--pack-docs.")
    head = _pooling_head(model, whole_rows=False)
    if head:
        raise Unsupported(f"{type(model).__name__}: {packed} would not stay apart: {head}, one set for all the "
                          f"documents of a row. {fix}")
    what = _mixing_outside_attention(model)
    if what:
        raise Unsupported(
            f"{type(model).__name__}: {packed} would not stay apart: {what} would run across the documents of a row "
            f"(ndp's attention keeps them apart, nothing else does). {fix}")


__all__ = ["Unsupported", "text_config", "peft_inner", "POOLED_ON_WHOLE", "pools_last_token", "pooled_last_token",
           "row_head", "classifies_tokens", "takes_shift_labels", "attention_modules", "decoder_layers",
           "outside_layers", "cp_attention_modules", "text_decoder", "layer_stacks", "check_cp_model",
           "check_packed_model", "gathered_mixers"]
