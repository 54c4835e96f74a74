"""Hugging Face ``transformers`` integration: ndp attention implementations and the parallel plan of
decoder-only causal LMs (Llama, Qwen2, Mistral and models laid out like them)."""
from __future__ import annotations

from torch import nn

from ndp.parallel import ModelPlan, ParallelismConfig
from ndp.parallel import parallelize as _parallelize

from .attention import IMPL_NAMES, ndp_attention_forward, register_attention

# Used when a model's config carries no base_model_tp_plan (same split as Llama's).
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
    prefix = getattr(model, "base_model_prefix", "") or ""
    return f"{prefix}." if prefix and hasattr(model, prefix) else ""


def check_model(model: nn.Module, config: ParallelismConfig) -> None:
    """Raise ValueError when the model's heads cannot be split as ``config`` asks (before any collective)."""
    cfg = model.config
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    config.check_heads(heads, kv)


def hf_plan(model: nn.Module) -> ModelPlan:
    """ModelPlan of a transformers decoder-only model.

    TP comes from the model's own ``config.base_model_tp_plan`` when it has one (else DEFAULT_TP_PLAN);
    the decoder layers are the FSDP/AC blocks; ``*.self_attn`` modules receive the CP context; CP switches
    ``config._attn_implementation`` to ``ndp_<impl>`` through ``set_attn_implementation``.
    """
    prefix = _base_prefix(model)
    base_plan = getattr(model.config, "base_model_tp_plan", None) or DEFAULT_TP_PLAN
    tp_plan = {prefix + k: v for k, v in base_plan.items()}

    def enable_cp(m, ctx):
        register_attention()
        m.set_attn_implementation(IMPL_NAMES[ctx.impl])

    return ModelPlan(tp_plan=tp_plan, blocks=(f"{prefix}layers.*",), attention=(f"{prefix}layers.*.self_attn",),
                     enable_cp=enable_cp)


def parallelize(model: nn.Module, config: ParallelismConfig, mesh, **kwargs) -> nn.Module:
    """``ndp.parallel.parallelize`` with the plan of a transformers causal LM (see :func:`hf_plan`).

    Args:
        model: e.g. ``LlamaForCausalLM`` built identically on every rank.
        config, mesh: the ParallelismConfig and its ``build_device_mesh`` mesh.
        kwargs: passed on (plan to override :func:`hf_plan`, mp_policy, activation_checkpointing, compile,
            reshard_after_forward). A model that is not a transformers model takes the generic path.
    Returns:
        the model, parallelized in place, its attention switched to ``ndp_<cp_impl>``.
    Raises:
        ValueError: heads not divisible by tp / the Ulysses degree.
    """
    if not (hasattr(model, "set_attn_implementation") and hasattr(model, "config")):
        # Not a transformers model: the generic path (FSDP/AC over its repeated blocks, or kwargs["plan"]).
        return _parallelize(model, config, mesh, **kwargs)
    check_model(model, config)
    kwargs.setdefault("plan", hf_plan(model))
    return _parallelize(model, config, mesh, **kwargs)


def shard_batch(model: nn.Module, **tensors):
    """This rank's context-parallel shard of ``[batch, seq]`` tensors, in the layout the attention uses.

    Shift labels *before* sharding and pass global ``position_ids`` so RoPE sees true positions.
    Identity when the model runs without CP.

    Args:
        model: a model returned by :func:`parallelize`.
        tensors: e.g. ``input_ids=..., labels=..., position_ids=...``, each ``[batch, seq]``.
    Returns:
        dict of the same names -> ``[batch, seq / cp_size]`` shards.
    Raises:
        ValueError: the model was not parallelized by ndp.
    """
    from ndp.parallel import CP_ATTR

    ctx = getattr(model, CP_ATTR, None)
    if ctx is None:
        raise ValueError("shard_batch needs a model returned by ndp.hf.parallelize (it carries the CP groups)")
    if not ctx.enabled:
        return dict(tensors)
    import ndp.cp

    return {k: ndp.cp.shard_sequence(t, dim=1, group=ctx.group, layout=ctx.layout) for k, t in tensors.items()}


__all__ = ["shard_batch", "register_attention", "ndp_attention_forward", "hf_plan", "parallelize", "check_model", "IMPL_NAMES",
           "DEFAULT_TP_PLAN"]
