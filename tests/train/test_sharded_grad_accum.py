"""--sharded-grad-accum: FSDP2 reduce-scatters every micro-batch into sharded accumulators. The gradient bytes a
rank holds between micro-batches drop to its shard (1/dp_shard) and the gradients equal those of accumulating whole
gradients and reducing once (2 gloo ranks, float64). The loss parity of the ndp-train layout is in test_parity.py."""
import pytest
import torch
import torch.nn.functional as F

import ndp
import ndp.hf
from dist import spawn
from ndp.train.loop import _fsdp_modules
from ndp.train.presets import build_model

pytestmark = pytest.mark.distributed


def _unsharded_grad_bytes(model) -> int:
    """Bytes of whole (unsharded) gradients FSDP2 keeps for the next micro-batch."""
    n = 0
    for m in _fsdp_modules(model):
        group = m._get_fsdp_state()._fsdp_param_group
        for fp in group.fsdp_params if group else []:
            g = fp.unsharded_accumulated_grad  # under a reduce dtype; else the unsharded parameter's grad
            if g is None and hasattr(fp, "_unsharded_param"):
                g = fp.unsharded_param.grad
            n += 0 if g is None else g.numel() * g.element_size()
    return n


def _accumulate(sharded):
    cfg = ndp.ParallelismConfig(dp_shard_size=2)
    model = ndp.hf.parallelize(build_model("tiny-llama", seed=0, dtype=torch.float64), cfg,
                               cfg.build_device_mesh("cpu"))
    held = []
    for i in range(2):
        for m in _fsdp_modules(model):
            m.set_requires_gradient_sync(sharded or i == 1)
        seed = 10 * i + torch.distributed.get_rank()
        ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(seed))
        logits = model(ids, use_cache=False).logits
        F.cross_entropy(logits.flatten(0, 1), F.pad(ids[:, 1:], (0, 1), value=-100).flatten()).backward()
        held.append(_unsharded_grad_bytes(model))
    return held, {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def _body(rank, world):
    whole_held, whole = _accumulate(False)
    sharded_held, sharded = _accumulate(True)
    params = sum(p.numel() * 8 for p in build_model("tiny-llama", seed=0, dtype=torch.float64).parameters())
    assert whole_held[0] >= params  # whole gradients held between the micro-batches
    assert sharded_held[0] == 0  # ... or none: each micro-batch was reduce-scattered into the shards
    for n, g in whole.items():
        torch.testing.assert_close(sharded[n], g, rtol=1e-12, atol=1e-15, msg=lambda m: f"{n}: {m}")


def test_sharded_accumulators_hold_no_whole_gradient_and_agree(tmp_path):
    spawn(_body, 2, tmp_path)
