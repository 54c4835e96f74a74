"""ND parallelism on one DeviceMesh: ParallelismConfig, mesh construction and apply_tp/cp/ac/fsdp.

Knows no model library (docs/design.md): models describe what to split with a :class:`ModelPlan`; ``ndp.hf``
provides the plan of Hugging Face causal LMs.
"""
from .config import CP_IMPLS, CP_LAYOUTS, CP_MIXERS, MESH_AXES, NDP_FIELDS, ParallelismConfig, as_config
from .draws import Draws, draws_of, share_tp_draws
from .styles import ExpertsParallel, LocalParams, RowwiseOwnOutput, SharedKeyParallel, SummedParams, expert_count
from .init import init_weights, is_meta, materialize, module_seed, param_bytes, to_empty
from .mesh import CPContext, adopt_mesh, build_device_mesh, check_mesh, cp_context, mesh_axis, mesh_device
from .offload import ActivationOffload, OffloadStats
from .parallelize import (AC_MODES, CP_ATTR, PARALLEL_ATTR, TP_STYLES, ModelPlan, Parallelized, ac_mode, apply_ac,
                          apply_cp, apply_fsdp, apply_tp, clip_grad_norm_, default_plan, fsdp_mesh,
                          is_transformers_model, match_modules, parallelize)

__all__ = ["ParallelismConfig", "as_config", "adopt_mesh", "check_mesh", "parallelize", "apply_tp", "apply_cp",
           "apply_fsdp", "apply_ac", "ac_mode", "AC_MODES", "ActivationOffload", "OffloadStats", "ModelPlan",
           "CPContext", "build_device_mesh", "cp_context", "mesh_axis", "mesh_device", "clip_grad_norm_",
           "default_plan", "fsdp_mesh", "is_transformers_model", "TP_STYLES", "match_modules",
           "CP_IMPLS", "CP_LAYOUTS", "CP_MIXERS", "NDP_FIELDS", "MESH_AXES", "CP_ATTR", "PARALLEL_ATTR",
           "Parallelized", "Draws", "draws_of", "share_tp_draws", "ExpertsParallel", "SharedKeyParallel",
           "LocalParams", "RowwiseOwnOutput", "SummedParams", "expert_count",
           "init_weights", "materialize", "is_meta", "module_seed", "param_bytes", "to_empty"]
