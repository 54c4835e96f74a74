"""What the planner plans for: the model's shape (``ModelSpec``) and the GPU's measured rates (``GpuProfile``).

Both are frozen, validated data. GPU profiles ship as JSON next to this file (``data/gpus.json``); the models are
those ``ndp-train --model`` builds (the real-size architectures of ``ndp/train/assets/models.json``, the tiny/small
presets, any local Hugging Face config directory), so every command the planner prints runs as printed; a YAML/JSON
file overrides fields of a GPU profile.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field

from ndp.train.presets import PRESETS, REAL_MODELS, preset_config

_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def _load(name: str) -> dict:
    with open(os.path.join(_DATA, name), encoding="utf-8") as f:
        return {k: v for k, v in json.load(f).items() if not k.startswith("_")}


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only causal LM laid out like Llama (RMSNorm, RoPE, GQA attention, gated MLP).

    Args:
        name: for messages and tables.
        num_layers, hidden_size, intermediate_size, num_heads, num_kv_heads, vocab_size: the architecture.
        head_dim: per-head width (default ``hidden_size // num_heads``).
        tie_word_embeddings: lm_head shares the embedding matrix.
        attention_bias: q/k/v projections carry biases (Qwen2).
        sliding_window: attention window in tokens (Mistral-style), None for full causal attention.

    Raises:
        ValueError: a size < 1, heads not a multiple of kv heads.
    """

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    head_dim: int = 0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None

    def __post_init__(self):
        for f in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "vocab_size"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelSpec.{f} must be an int >= 1; got {f}={v!r} (model {self.name!r})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads must be a multiple of num_kv_heads; got num_heads={self.num_heads}, "
                             f"num_kv_heads={self.num_kv_heads} (model {self.name!r})")
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.sliding_window is not None and self.sliding_window < 1:
            object.__setattr__(self, "sliding_window", None)

    # ------------------------------------------------------------------ parameter tensors
    def tensors(self, split_head: bool = False) -> list[tuple[str, tuple[int, ...], int | None, str]]:
        """Every parameter tensor as (name, shape, tensor-parallel dim or None, FSDP unit).

        The TP dims are those of ndp's plan (``ndp.hf``: Llama's ``base_model_tp_plan``: q/k/v, gate/up
        colwise = dim 0, o/down rowwise = dim 1); embeddings and norms stay replicated, lm_head too unless
        ``split_head`` (ndp-train's fused loss under TP splits an untied lm_head by vocabulary: dim 0).
        FSDP units: "block" (one per decoder layer, listed once: multiply by ``num_layers``) and "root".
        """
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        hq, hkv = self.num_heads * d, self.num_kv_heads * d
        block = [("q_proj", (hq, h), 0), ("k_proj", (hkv, h), 0), ("v_proj", (hkv, h), 0), ("o_proj", (h, hq), 1),
                 ("gate_proj", (i, h), 0), ("up_proj", (i, h), 0), ("down_proj", (h, i), 1),
                 ("input_layernorm", (h,), None), ("post_attention_layernorm", (h,), None)]
        if self.attention_bias:
            block += [("q_bias", (hq,), 0), ("k_bias", (hkv,), 0), ("v_bias", (hkv,), 0)]
        root = [("embed_tokens", (self.vocab_size, h), None), ("norm", (h,), None)]
        if not self.tie_word_embeddings:
            root.append(("lm_head", (self.vocab_size, h), 0 if split_head else None))
        return [(n, s, tp, "block") for n, s, tp in block] + [(n, s, tp, "root") for n, s, tp in root]

    @property
    def num_params(self) -> int:
        """Total parameter count."""
        n = 0
        for _, shape, _, unit in self.tensors():
            n += math.prod(shape) * (self.num_layers if unit == "block" else 1)
        return n

    @property
    def block_matmul_params(self) -> int:
        """Weights of one decoder layer's matmuls (q, k, v, o, gate, up, down)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        return 2 * h * self.num_heads * d + 2 * h * self.num_kv_heads * d + 3 * h * i

    def attn_pairs(self, seq_len: int) -> int:
        """Visible (query, key) pairs of one sequence under the causal (and sliding-window) mask."""
        s, w = seq_len, self.sliding_window
        if w is None or w >= s:
            return s * (s + 1) // 2
        return w * (w + 1) // 2 + (s - w) * w

    def replace(self, **changes) -> "ModelSpec":
        return dataclasses.replace(self, **changes)


def real_model_names() -> tuple[str, ...]:
    """Names of the real-size model presets shipped as data."""
    return tuple(REAL_MODELS)


def spec_from_hf_config(cfg: dict, name: str) -> ModelSpec:
    """ModelSpec from a Hugging Face ``config.json`` mapping (Llama, Qwen2, Mistral field names).

    Raises:
        ValueError: a required field is missing.
    """
    need = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
    missing = [k for k in need if cfg.get(k) is None]
    if missing:
        raise ValueError(f"model {name!r}: config lacks {missing}; ndp.plan needs a decoder-only config with "
                         f"{list(need)} (Llama/Qwen2/Mistral layout)")
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:
        window = None
    return ModelSpec(name=name, num_layers=int(cfg["num_hidden_layers"]), hidden_size=int(cfg["hidden_size"]),
                     intermediate_size=int(cfg["intermediate_size"]), num_heads=int(cfg["num_attention_heads"]),
                     num_kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
                     vocab_size=int(cfg["vocab_size"]), head_dim=int(cfg.get("head_dim") or 0),
                     tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                     attention_bias=bool(cfg.get("attention_bias", False)) or cfg.get("model_type") == "qwen2",
                     sliding_window=int(window) if window else None)


def load_model_spec(name_or_dir: str) -> ModelSpec:
    """ModelSpec of a real-size preset, an ``ndp.train`` preset (tiny-llama, ...) or a local HF directory.

    Raises:
        ValueError: unknown name (the message lists the choices), or a directory without config.json.
    """
    real = REAL_MODELS
    if name_or_dir in real:
        return spec_from_hf_config(real[name_or_dir], name_or_dir)
    if os.path.isdir(name_or_dir):
        path = os.path.join(name_or_dir, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"--model {name_or_dir!r} is a directory without config.json; pass a Hugging Face "
                             f"model directory (config.json is enough) or a preset name")
        with open(path, encoding="utf-8") as f:
            return spec_from_hf_config(json.load(f), os.path.basename(os.path.normpath(name_or_dir)))
    if name_or_dir in PRESETS:
        return spec_from_hf_config(preset_config(name_or_dir).to_dict(), name_or_dir)
    raise ValueError(f"unknown model {name_or_dir!r}; choose a preset ({', '.join(list(real) + list(PRESETS))}) "
                     f"or pass a local Hugging Face model directory with a config.json")


@dataclass(frozen=True)
class GpuProfile:
    """Measured and datasheet figures of one GPU kind (see ``data/gpus.json`` for units and sources).

    Raises:
        ValueError: a rate, bandwidth or memory figure that is not > 0, or an unknown field.
    """

    name: str
    peak_tflops: float
    peak_fp32_tflops: float
    matmul_tflops: float
    matmul_fp32_tflops: float
    attn_fwd_tflops: float
    attn_bwd_tflops: float
    attn_fwd_half_block: float
    attn_bwd_half_block: float
    hbm_gbps: float
    memory_gib: float
    reserved_gib: float
    nvlink_gbps: float
    network_gbps: float
    nvlink_latency_us: float = 10.0
    network_latency_us: float = 20.0
    launch_us: float = 5.0
    elementwise_passes: float = 4.0
    elementwise_gbps: float = 0.0   # memory-bound elementwise ops on activations; 0: hbm_gbps
    comm_overlap: float = 1.0       # share of a collective hidden behind compute issued beside it (0..1)
    dtensor_launch_us: float = 0.0  # host cost of one optimizer op on a DTensor (FSDP2 / TP) param; 0: launch_us
    reduce_scatter_efficiency: float = 1.0   # reduce-scatter bandwidth / all-gather bandwidth (0..1]
    pcie_gbps: float = 50.0         # host <-> GPU copies (activation offload), GB/s per direction
    cp_overhead: dict = field(default_factory=lambda: {"ring": 1.0, "allgather": 1.0, "ulysses": 1.0, "usp": 1.0})
    measured: tuple = ()
    source: str = ""

    def __post_init__(self):
        for f in ("peak_tflops", "peak_fp32_tflops", "matmul_tflops", "matmul_fp32_tflops", "attn_fwd_tflops",
                  "attn_bwd_tflops", "hbm_gbps", "memory_gib", "nvlink_gbps", "network_gbps", "pcie_gbps"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"GPU profile {self.name!r}: {f} must be a number > 0; got {f}={v!r}")
        for f in ("attn_fwd_half_block", "attn_bwd_half_block", "reserved_gib", "nvlink_latency_us",
                  "network_latency_us", "launch_us", "elementwise_passes", "elementwise_gbps",
                  "dtensor_launch_us"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"GPU profile {self.name!r}: {f} must be a number >= 0; got {f}={v!r}")
        for f, zero_ok, what in (("comm_overlap", True, "1: collectives run beside compute, 0: they block it"),
                                 ("reduce_scatter_efficiency", False, "reduce-scatter / all-gather bandwidth")):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and (v >= 0 if zero_ok else v > 0)
                    and v <= 1):
                raise ValueError(f"GPU profile {self.name!r}: {f} must be a number in {'[' if zero_ok else '('}0, 1] "
                                 f"({what}); got {f}={v!r}")
        if self.reserved_gib >= self.memory_gib:
            raise ValueError(f"GPU profile {self.name!r}: reserved_gib must be < memory_gib; got "
                             f"reserved_gib={self.reserved_gib}, memory_gib={self.memory_gib}")
        over = dict(self.cp_overhead)
        for k, v in over.items():
            if k not in ("ring", "allgather", "ulysses", "usp") or not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"GPU profile {self.name!r}: cp_overhead maps ring|allgather|ulysses|usp to a "
                                 f"number > 0; got {k!r}: {v!r}")
        object.__setattr__(self, "cp_overhead", {**{"ring": 1.0, "allgather": 1.0, "ulysses": 1.0, "usp": 1.0},
                                                 **over})
        object.__setattr__(self, "measured", tuple(self.measured))

    @property
    def elementwise_rate(self) -> float:
        """Bytes/s of the memory-bound elementwise ops (``elementwise_gbps``, else ``hbm_gbps``)."""
        return (self.elementwise_gbps or self.hbm_gbps) * 1e9

    @property
    def usable_bytes(self) -> float:
        """Bytes a training step may allocate: memory minus the CUDA context, NCCL and allocator slack."""
        return (self.memory_gib - self.reserved_gib) * 2**30

    def replace(self, **changes) -> "GpuProfile":
        return dataclasses.replace(self, **changes)


GPU_KINDS = ("h100", "h200", "a100", "b200")


def load_gpu_profile(kind: str, override: str | dict | None = None) -> GpuProfile:
    """The shipped profile of ``kind``, with fields overridden from a YAML/JSON file or a dict.

    An override file may hold the fields at top level or under the key ``kind``.

    Raises:
        ValueError: unknown kind, unknown field, unreadable file, or an invalid value.
    """
    profiles = _load("gpus.json")
    if kind not in profiles:
        raise ValueError(f"unknown --gpu {kind!r}; choose one of {sorted(profiles)} (or pass --profile FILE to "
                         f"override a shipped profile's figures)")
    data = dict(profiles[kind])
    if override is not None:
        if isinstance(override, str):
            try:
                with open(override, encoding="utf-8") as f:
                    text = f.read()
            except OSError as e:
                raise ValueError(f"--profile {override!r}: cannot read it ({e})") from e
            if override.endswith((".yaml", ".yml")):
                import yaml

                doc = yaml.safe_load(text) or {}
            else:
                doc = json.loads(text)
            if not isinstance(doc, dict):
                raise ValueError(f"--profile {override!r}: expected a mapping of profile fields, got "
                                 f"{type(doc).__name__}")
        else:
            doc = dict(override)
        if kind in doc and isinstance(doc[kind], dict):
            doc = doc[kind]
        known = {f.name for f in dataclasses.fields(GpuProfile)}
        bad = sorted(set(doc) - known)
        if bad:
            raise ValueError(f"--profile: unknown field(s) {bad}; known fields: {sorted(known)}")
        if "cp_overhead" in doc:
            doc["cp_overhead"] = {**data.get("cp_overhead", {}), **doc["cp_overhead"]}
        data.update(doc)
    return GpuProfile(**data)
