"""A new user's mistakes under CP get one clear error on every rank, before any work: a batch that did not go
through shard_batch (dense or packed), a packed batch without its document table, parallelize without a mesh in a
multi-process job."""
import pytest
import torch
import torch.nn.functional as F
from transformers import DataCollatorWithFlattening

from dist import spawn
from ndp.train.presets import build_model

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


def _packed():
    docs = [list(range(3, 13)), list(range(20, 34)), list(range(40, 48))]
    b = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": d} for d in docs])
    b["labels"] = F.pad(b["labels"][:, 1:], (0, 1), value=-100)
    return dict(b)


def _mistakes_body(rank, world):
    import ndp
    import ndp.hf

    with pytest.raises(ValueError, match=r"mesh=None in a job of 2 processes.*config.build_device_mesh"):
        ndp.parallelize(build_model("tiny-llama", seed=0), ndp.ParallelismConfig(), None)
    cfg = ndp.ParallelismConfig(cp_size=world)
    model = ndp.parallelize(build_model("tiny-llama", seed=0), cfg, cfg.build_device_mesh("cpu"))
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    # the whole batch, not this rank's shard: positions 0..31 are no rank's zigzag shard of 64 tokens
    with pytest.raises(ValueError, match=r"position_ids that are not rank \d's shard of a sequence of 64 tokens.*"
                                         r"ndp.hf.shard_batch"):
        model(input_ids=ids)
    # a packed batch sharded as dense rows: the restarts are not the dense shard's positions
    p = _packed()
    dense = ndp.cp.shard_sequence(p["input_ids"], dim=1, layout="zigzag"), ndp.cp.shard_sequence(
        p["position_ids"], dim=1, layout="zigzag")
    with pytest.raises(ValueError, match=r"position_ids that are not rank \d's shard"):
        model(input_ids=dense[0], position_ids=dense[1])
    # the packed batch as the collator made it, with its document table but not sharded
    with pytest.raises(ValueError, match=r"packed q has 32 tokens but shard_packed gives this rank"):
        model(input_ids=p["input_ids"], position_ids=p["position_ids"], cu_seq_lens_q=p["cu_seq_lens_q"],
              cu_seq_lens_k=p["cu_seq_lens_k"])
    # and through shard_batch it runs
    b = ndp.hf.shard_batch(model, **p)
    labels = b.pop("labels")
    assert ndp.hf.loss(model(**b).logits, labels, model).isfinite()


def test_cp_mistakes_raise_on_every_rank(tmp_path):
    spawn(_mistakes_body, 2, tmp_path, timeout_s=60)
