"""A padding mask that falls on only one rank's CP shard (issue 11): every rank raises, none hangs."""
import time

import pytest
import torch

from dist import spawn
from ndp.train.presets import build_model

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


def _mask_body(rank, world, impl):
    import ndp
    import ndp.hf

    ulysses = dict(ulysses_size=2) if impl == "usp" else {}
    cfg = ndp.ParallelismConfig(cp_size=world, cp_impl=impl, cp_layout="zigzag", **ulysses)
    model = ndp.parallelize(build_model("tiny-llama", seed=0), cfg, cfg.build_device_mesh("cpu"))
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, 28:] = 0  # right padding: with zigzag it lands on one rank's shard only (rank 0 holds chunk 2N-1)
    b = ndp.hf.shard_batch(model, input_ids=ids, attention_mask=mask)
    holder = bool((b["attention_mask"] == 0).any())
    holders = [None] * world
    torch.distributed.all_gather_object(holders, holder)
    assert holders.count(True) == 1, holders  # the case under test: one rank's shard holds all the padding
    t0 = time.perf_counter()
    if holder:
        with pytest.raises(ValueError, match="cannot honour an attention mask with masked positions"):
            model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"])
    else:
        with pytest.raises(ValueError, match=r"refused their input: rank \d .*cannot honour an attention mask"):
            model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"])
    assert time.perf_counter() - t0 < 10
    # afterwards the model still runs on every rank
    assert model(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits.shape == (1, 32 // world, 256)


@pytest.mark.parametrize("impl,world", [("ring", 2), ("ulysses", 2), ("usp", 4)])
def test_padding_mask_on_one_cp_shard_raises_everywhere(tmp_path, impl, world):
    spawn(_mask_body, world, tmp_path, impl, timeout_s=20)
