"""Model presets: tiny and small Llama, Qwen2 and Mistral configs (byte-level vocab), the real-size architectures of
``data/models.json`` (Llama 3, Qwen2, Mistral), all with random weights, and local Hugging Face directories (with
weights, or config.json alone for random weights)."""
from __future__ import annotations

import glob
import json
import os

import torch

_COMMON = dict(vocab_size=256, max_position_embeddings=8192, tie_word_embeddings=False, attention_dropout=0.0,
               rms_norm_eps=1e-5)
_SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4),
}
_FAMILIES = ("llama", "qwen2", "mistral")
INITS = ("full", "meta")  # how build_model materializes a preset (ndp-train --init)
PRESETS = tuple(f"{size}-{fam}" for fam in _FAMILIES for size in _SIZES)
_WEIGHTS = ("*.safetensors", "*.bin", "*.pt")


def _real_models() -> dict:
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "models.json"), encoding="utf-8") as f:
        return {k: v for k, v in json.load(f).items() if not k.startswith("_")}


REAL_MODELS = _real_models()  # name -> config.json fields of a real-size architecture (no weights)


def preset_config(name: str):
    """transformers config of a preset ("tiny-llama", "small-qwen2", "tiny-mistral", ...) or of a real-size
    architecture ("llama-3-8b", "qwen2-7b", ...: see ``REAL_MODELS``).

    Raises:
        ValueError: unknown name.
    """
    if name in REAL_MODELS:
        from transformers import AutoConfig

        fields = dict(REAL_MODELS[name])
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; choose a preset ({', '.join(PRESETS + tuple(REAL_MODELS))}) or "
                         f"pass a local Hugging Face model directory (config.json alone gives random weights)")
    size, fam = name.split("-", 1)
    kw = dict(_COMMON, **_SIZES[size])
    if fam == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**kw)
    if fam == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(use_sliding_window=False, **kw)
    from transformers import MistralConfig

    # A window shorter than the test sequences, so that sliding-window attention is really exercised.
    return MistralConfig(sliding_window=32 if size == "tiny" else 256, **kw)


def has_weights(directory: str) -> bool:
    """Whether a model directory holds weights (else its config.json alone is built with random weights)."""
    return any(glob.glob(os.path.join(directory, pattern)) for pattern in _WEIGHTS)


def model_config(name_or_dir: str):
    """The transformers config of a preset, a real-size architecture or a local model directory."""
    if os.path.isdir(name_or_dir):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(name_or_dir)
    return preset_config(name_or_dir)


def build_model(name_or_dir: str, *, seed: int, dtype=torch.float32, init: str = "full"):
    """Build a causal LM from a preset or a config (random weights from ``seed``) or load a local HF directory.

    A preset is always built on the meta device first. ``init="full"`` then allocates it on CPU and initializes
    it with ``ndp.hf.init_weights`` (the model's own ``_init_weights`` per module, each module's generator
    seeded from ``(seed, module name)``); ``init="meta"`` returns it on meta, for ``ndp.parallelize(...,
    init_seed=seed)`` to materialize shard by shard with the very same values. Seeding per module (not one
    random stream over the whole model, as ``from_config`` does) is what lets a rank initialize its shards
    without building the rest of the model: see ``ndp.parallel.init``.

    Args:
        name_or_dir: a preset or real-size name, or a local HF model directory (config.json alone: random
            weights); seed: the run seed; dtype: parameter dtype.
        init: "full" (materialized on CPU) or "meta" (random weights only).
    Returns:
        the model on CPU (or on meta) in ``dtype``, identical on every rank.
    Raises:
        ValueError: neither a preset nor a directory; ``init`` not in INITS; "meta" for a model directory.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}; got {init!r}")
    if os.path.isdir(name_or_dir) and has_weights(name_or_dir):
        if init == "meta":
            raise ValueError(f"--init meta builds random weights shard by shard; {name_or_dir!r} is a model directory "
                             f"whose weights are loaded whole. Use --init full for it.")
        cfg = AutoConfig.from_pretrained(name_or_dir)
        # transformers' own choice (sdpa where the family has it, else eager), not a config.json's (e.g. a
        # flash-attention build the machine may not have); sdpa forced would refuse Gemma 2, Mamba 2, xLSTM, ...
        cfg._attn_implementation = None
        return AutoModelForCausalLM.from_pretrained(name_or_dir, config=cfg, dtype=dtype)
    cfg = model_config(name_or_dir)
    cfg._attn_implementation = None  # as above
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    if init == "meta":
        return model
    import ndp.hf
    from ndp.parallel import to_empty

    to_empty(model, device="cpu")
    return ndp.hf.init_weights(model, seed=seed)
