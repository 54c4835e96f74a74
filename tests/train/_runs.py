"""Shared helpers of the training tests: tiny runs (2 layers, hidden 64, 4 heads, 2 kv heads, vocab 256,
seq 64, 4 steps, fp32) and the parallel layouts the issue lists."""
import os

import torch

from ndp.parallel import ParallelismConfig
from ndp.train import TrainConfig, train

# A config-only Hugging Face directory (random weights from the seed): Qwen3-Next, a gated DeltaNet layer and an
# attention layer, its MoE MLPs
HYBRID = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "tiny-qwen3-next")
BASE = dict(model="tiny-llama", seq_len=64, batch_size=4, steps=4, lr=3e-3, warmup=1, seed=0, progress=False,
            device="cpu")

# name -> (world size, ParallelismConfig fields, TrainConfig overrides)
LAYOUTS = {
    "dp_shard2": (2, dict(dp_shard_size=2), {}),
    "dp_shard2_accum2": (2, dict(dp_shard_size=2), dict(grad_accum=2)),
    "dp_shard2_accum2_sharded": (2, dict(dp_shard_size=2), dict(grad_accum=2, sharded_grad_accum=True)),
    "dp_shard2_ac": (2, dict(dp_shard_size=2), dict(activation_checkpointing=True)),
    "dp_shard2_ac_offload": (2, dict(dp_shard_size=2), dict(activation_checkpointing=True, activation_offload=True)),
    "dp_shard2_sac": (2, dict(dp_shard_size=2), dict(activation_checkpointing="selective")),
    "cp2_ring_sac": (2, dict(cp_size=2), dict(activation_checkpointing="selective")),
    "dp_replicate2": (2, dict(dp_replicate_size=2), {}),
    "tp2": (2, dict(tp_size=2), {}),
    "cp2_ring": (2, dict(cp_size=2), {}),
    "cp2_ulysses": (2, dict(cp_size=2, cp_impl="ulysses"), {}),
    "cp2_allgather": (2, dict(cp_size=2, cp_impl="allgather"), {}),
    "cp2_ring_full_loss": (2, dict(cp_size=2), dict(loss="full")),  # the reference runs the fused loss
    "bf16_cp2_ring": (2, dict(cp_size=2), dict(dtype="bf16")),
    "qwen2_tp2": (2, dict(tp_size=2), dict(model="tiny-qwen2")),
    "mistral_cp2_ring": (2, dict(cp_size=2), dict(model="tiny-mistral")),
    "hybrid_cp2_gather": (2, dict(cp_size=2, cp_mixers="gather"), dict(model=HYBRID)),
    "hybrid_cp2_heads": (2, dict(cp_size=2, cp_mixers="heads"), dict(model=HYBRID)),
    "dp_shard2_cp2": (4, dict(dp_shard_size=2, cp_size=2), {}),
    "cp2_tp2": (4, dict(cp_size=2, tp_size=2), {}),
    "dp_replicate2_dp_shard2": (4, dict(dp_replicate_size=2, dp_shard_size=2), {}),
    "packed_dp_shard2_cp2": (4, dict(dp_shard_size=2, cp_size=2), dict(pack_docs=True)),
    "usp2x2": (4, dict(cp_size=4, cp_impl="usp", ulysses_size=2), {}),
}


def train_config(name=None, **over):
    par, extra = {}, {}
    if name is not None:
        _, par, extra = LAYOUTS[name]
    kw = dict(BASE, **extra)
    kw.update(over)
    return TrainConfig(parallel=ParallelismConfig(**par), **kw)


def run_layouts(rank, world_size, names, out_dir):
    """Spawned on every rank: train each layout in turn; rank 0 saves losses and final weights."""
    for name in names:
        res = train(train_config(name), return_state=True)
        if rank == 0:
            torch.save({"losses": res.losses, "grad_norms": res.grad_norms, "state": res.state_dict,
                        "tokens_per_s": res.tokens_per_s},
                       os.path.join(out_dir, f"{name}.pt"))
