"""ndp: context-parallel attention for multi-GPU LLM training.

Layers (each knows only the ones below): ndp.train / ndp.hf -> ndp.parallel -> ndp.cp -> ndp.ops ->
ndp_kernels / the compiled ops ``torch.ops.ndp.*`` (ndp._C).
"""
from . import _ops  # noqa: F401  (registers torch.ops.ndp.* and their fake kernels when ndp._C is built)
from . import cp, ops
from ._runtime import shutdown
from .cp import (CommStats, allgather_attention, gather_sequence, ring_attention, shard_packed, shard_sequence,
                 split_cp_group, ulysses_attention, usp_attention)
from .ops.tune import warmup
from .parallel import ParallelismConfig, is_transformers_model

__version__ = "0.1.0"

__all__ = ["ops", "cp", "shard_sequence", "gather_sequence", "shard_packed", "ring_attention",
           "allgather_attention", "ulysses_attention", "usp_attention", "split_cp_group", "CommStats",
           "ParallelismConfig", "parallelize", "shutdown", "warmup"]


def parallelize(model, config, mesh, **kwargs):
    """Apply TP, CP, activation checkpointing and FSDP2 to `model` on `mesh` (docs/design.md, "Architecture").

    A Hugging Face causal LM gets the plan of ``ndp.hf`` (its own TP plan, attention switched to
    ``ndp_<cp_impl>``); any other ``nn.Module`` goes to ``ndp.parallel.parallelize`` with its plan.
    ``ndp.hf`` is imported only here, on use, so the lower layers never depend on transformers.
    A model on the meta device is parallelized as it is and then only this rank's shards are allocated and
    initialized (``init_seed=``, ``init_device=``; see ``ndp.parallel.init``): the same values as building it
    in full, initializing it with ``ndp.hf.init_weights(model, seed=init_seed)`` and parallelizing that.

    Args:
        model: the model to parallelize in place (materialized, or on the meta device).
        config: ``ParallelismConfig``.  mesh: the DeviceMesh from ``config.build_device_mesh(...)``.
        kwargs: see ``ndp.parallel.parallelize``.
    Returns:
        the parallelized model.
    Raises:
        ValueError: config and mesh disagree, the model cannot be split as configured, or (meta) its init
            leaves a parameter or buffer unset.
    """
    if is_transformers_model(model):
        from .hf import parallelize as impl
    else:
        from .parallel import parallelize as impl
    return impl(model, config, mesh, **kwargs)
