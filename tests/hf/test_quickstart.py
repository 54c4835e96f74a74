"""The README quick start, run as written (2 CP ranks) against one process."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist import spawn
from ndp.train.presets import build_model


def _quickstart(rank, world, out):
    import ndp.hf
    from ndp.parallel import ParallelismConfig  # the lead re-exports it as ndp.ParallelismConfig

    model = build_model("tiny-llama", seed=0)  # any transformers causal LM, same weights on every rank
    input_ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    # --- quick start ---
    cfg = ParallelismConfig(cp_size=world, cp_impl="ring", cp_layout="zigzag")
    model = ndp.hf.parallelize(model, cfg, cfg.build_device_mesh("cpu"))  # TP plan, ndp_ring, FSDP2
    labels = F.pad(input_ids[:, 1:], (0, 1), value=-100)  # shift BEFORE sharding
    pos = torch.arange(input_ids.shape[1]).expand_as(input_ids)  # global positions for RoPE
    b = ndp.hf.shard_batch(model, input_ids=input_ids, labels=labels, position_ids=pos)
    logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
    n_tokens = (labels != -100).sum()  # global count: every rank holds the full batch
    # FSDP averages gradients over cfg.fsdp_size ranks: scale so that the result is d(global mean)
    loss = F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100,
                           reduction="sum") * cfg.fsdp_size / n_tokens
    loss.backward()
    # --- end ---
    loss = loss.detach() / cfg.fsdp_size
    dist.all_reduce(loss)
    if rank == 0 and out:
        torch.save(loss.item(), out)


@pytest.mark.distributed
def test_quickstart_cp2(tmp_path):
    out = os.path.join(tmp_path, "l.pt")
    spawn(_quickstart, 2, tmp_path, out)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    model = build_model("tiny-llama", seed=0)
    ref = F.cross_entropy(model(ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    # fp32 sums in another order: the parity bound of the training tests
    assert torch.load(out) == pytest.approx(ref.item(), rel=1e-5)
