"""ndp.plan: pick the ND-parallel degrees and CP algorithm for a model on N GPUs, before touching them.

    from ndp.plan import PlanRequest, load_model_spec, load_gpu_profile, plan
    ests = plan(PlanRequest(spec=load_model_spec("llama-3-8b"), profile=load_gpu_profile("h100"),
                            gpus=16, seq_len=131072, batch_size=16))
    ests[0].config, ests[0].peak_bytes, ests[0].step_s, ests[0].tokens_per_s, ests[0].mfu

The top layer: it reads ``ndp.parallel.config`` (validity rules) and ``ndp.train.presets`` (tiny presets);
nothing in ndp imports it. The cost model is in ``cost.py`` (see its docstring for every term).
"""
from .cost import (MEM_TERMS, Estimate, Topology, attention_buffer_bytes, cp_bytes_per_layer, estimate,
                   layer_activation_bytes, local_param_numel, logits_bytes, root_activation_bytes)
from .search import PlanRequest, best_estimate, describe, enumerate_configs, plan, suggest, train_flags
from .spec import GPU_KINDS, GpuProfile, ModelSpec, load_gpu_profile, load_model_spec, spec_from_hf_config

__all__ = ["PlanRequest", "plan", "estimate", "enumerate_configs", "best_estimate", "suggest", "describe",
           "train_flags", "Estimate", "Topology", "ModelSpec", "GpuProfile", "GPU_KINDS", "MEM_TERMS",
           "load_model_spec", "load_gpu_profile", "spec_from_hf_config", "local_param_numel",
           "layer_activation_bytes", "root_activation_bytes", "logits_bytes", "attention_buffer_bytes",
           "cp_bytes_per_layer"]
