"""What ndp can see of a transformers causal LM before it parallelizes it: where its attention modules and decoder
layers are, and which of its layers mix tokens in ways ndp's context parallelism cannot split exactly.

ndp's CP replaces one thing, the attention call made through transformers' ``AttentionInterface``. Anything else that
mixes information along the sequence (a recurrent or state-space layer, a causal convolution, an attention the
model computes itself, a sparse "indexer" that picks keys from the whole sequence) would run on each rank's shard
alone and give a different model. Such a model is refused by name (:class:`Unsupported`) on every rank, before
any work.
"""
from __future__ import annotations

import functools
import inspect
import re

from torch import nn


class Unsupported(ValueError):
    """ndp cannot run this model or attention call exactly; the message names the feature and what to do."""


# Class-name markers of token-mixing layers that are not attention through the AttentionInterface.
_RECURRENT = re.compile(r"Mamba|Mixer|SSM|Recurrent|RGLRU|Rwkv|RWKV|LSTM|Lstm|xLSTM|DeltaNet|LinearAttention|"
                        r"Lightning|ShortConv|GatedConv|Retention")
_INDEXER = re.compile(r"Indexer")


def text_config(model: nn.Module):
    """The config that holds the decoder's sizes (a multimodal wrapper's text config, else the model's)."""
    cfg = model.config
    get = getattr(cfg, "get_text_config", None)
    return get(decoder=True) if get is not None else cfg


@functools.lru_cache(maxsize=None)
def _calls_interface(cls) -> bool:
    # transformers' attention modules look their implementation up in ALL_ATTENTION_FUNCTIONS at each forward.
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in src


def attention_modules(model: nn.Module) -> list[str]:
    """Names of the modules whose forward calls transformers' AttentionInterface (the ones ndp replaces)."""
    return [name for name, m in model.named_modules() if name and _calls_interface(type(m))]


def decoder_layers(model: nn.Module) -> tuple[str, list[str]]:
    """(``<list>.*`` pattern, names) of the decoder layers: the ModuleList holding the most attention modules."""
    attn = attention_modules(model)
    best, best_count = None, 0
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > 0:
            count = sum(1 for a in attn if a.startswith(f"{name}."))
            if count > best_count:
                best, best_count = name, count
    if best is None:
        return "", []
    return f"{best}.*", [f"{best}.{i}" for i in range(len(model.get_submodule(best)))]


def _mixers(module: nn.Module) -> list[str]:
    found = []
    for name, m in module.named_modules():
        cls = type(m).__name__
        if isinstance(m, nn.Conv1d) or _RECURRENT.search(cls) or _INDEXER.search(cls):
            found.append(f"{name or '.'} ({cls})")
    return found


def check_cp_model(model: nn.Module) -> None:
    """Raise :class:`Unsupported` when ndp's CP would not compute this model exactly (see the module docstring)."""
    kind = type(model).__name__
    mixers = _mixers(model)
    indexers = [m for m in mixers if _INDEXER.search(m)]
    if indexers:
        raise Unsupported(
            f"{kind}: sparse indexed attention ({', '.join(indexers[:3])}) selects keys from the whole sequence "
            f"outside the attention call; ndp's context parallelism cannot split it. Run it with cp_size=1.")
    if mixers:
        raise Unsupported(
            f"{kind}: layers that mix tokens outside attention ({', '.join(mixers[:4])}"
            f"{', ...' if len(mixers) > 4 else ''}: recurrent, state-space, linear-attention or convolution "
            f"layers) would restart at every context-parallel shard, so ndp cannot pass their state between "
            f"ranks. Run it with cp_size=1.")
    attn = attention_modules(model)
    if not attn:
        raise Unsupported(
            f"{kind}: no attention module calls transformers' AttentionInterface (the model computes attention "
            f"itself), so ndp's context parallelism cannot reach it and each rank would attend within its own "
            f"shard. Run it with cp_size=1, or use a model whose attention goes through the AttentionInterface.")
    _, layers = decoder_layers(model)
    without = [name for name in layers if not any(a.startswith(f"{name}.") for a in attn)]
    if without:
        raise Unsupported(
            f"{kind}: decoder layers {without[:4]} hold no attention that calls transformers' AttentionInterface; "
            f"ndp's context parallelism cannot reach what mixes tokens there. Run it with cp_size=1.")


__all__ = ["Unsupported", "text_config", "attention_modules", "decoder_layers", "check_cp_model"]
