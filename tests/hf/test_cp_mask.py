"""A padding mask that falls on only one rank's CP shard (issue 11): every rank raises, none hangs. A right-padded
batch through shard_batch, every pad labelled -100: the loss and every gradient equal one process with the padding
mask; padding it cannot drop exactly is refused by name."""
import os
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist import spawn  # noqa: E402
from ndp.train.presets import build_model  # noqa: E402
import _zoo  # noqa: E402

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
    # sharded by hand, as a user who skips shard_batch would (shard_batch drops right padding when it is exact)
    b = {k: ndp.cp.shard_sequence(t, dim=1, layout="zigzag") for k, t in
         dict(input_ids=ids, attention_mask=mask, position_ids=torch.arange(32)[None]).items()}
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


def _padded_body(rank, world, impl):
    import ndp
    import ndp.hf

    ids, _, _ = _zoo.batch()  # [2, 32]
    mask = (torch.arange(_zoo.SEQ)[None] < torch.tensor([[_zoo.SEQ], [21]])).long()
    labels = F.pad(ids[:, 1:], (0, 1), value=-100).masked_fill(mask == 0, -100)
    ref = _zoo.tiny_model("llama").train()
    logits = ref(input_ids=ids, attention_mask=mask).logits
    ref_loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    ref_loss.backward()
    cfg = ndp.ParallelismConfig(cp_size=world, cp_impl=impl)
    model = ndp.hf.parallelize(_zoo.tiny_model("llama").train(), cfg, cfg.build_device_mesh("cpu"))
    b = ndp.hf.shard_batch(model, input_ids=ids, labels=labels, attention_mask=mask)
    assert bool(b["attention_mask"].all())
    local_labels = b.pop("labels")
    loss, mean = ndp.hf.loss(model(**b).logits, local_labels, model, return_mean=True)
    loss.backward()
    assert _zoo._rel(mean.detach().double(), ref_loss.detach()) <= _zoo.TOL  # the mean comes back in float32
    grads = {n: p.grad for n, p in ref.named_parameters()}
    floor = 1e-4 * max(float(g.abs().max()) for g in grads.values())  # as the zoo: zero in exact arithmetic is noise
    for n, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        assert _zoo._rel(g, grads[n.replace("_checkpoint_wrapped_module.", "")], floor) <= _zoo.TOL, n
    fix = r"Pad on the right with labels -100 at every pad, or pack the documents"
    with pytest.raises(ValueError, match=r"labels at padded positions must be -100 under context parallelism; 10 "
                                         r"pads have a label .*" + fix):
        ndp.hf.shard_batch(model, input_ids=ids, labels=F.pad(ids[:, 1:], (0, 1), value=-100), attention_mask=mask)
    with pytest.raises(ValueError, match=r"a padded batch under context parallelism needs its labels"):
        ndp.hf.shard_batch(model, input_ids=ids, attention_mask=mask)
    with pytest.raises(ValueError, match=r"right padding only; .* \(real tokens per row: \[32, 21\]\)"):
        ndp.hf.shard_batch(model, input_ids=ids, labels=labels, attention_mask=mask.flip(1))
    # a mask makes position_ids RoPE only (transformers attends across their restarts): not packed documents
    pos = torch.cat([torch.arange(10), torch.arange(22)]).expand(2, -1)
    with pytest.raises(ValueError, match=r"position_ids that restart between real tokens \(rows \[0, 1\]\)"):
        ndp.hf.shard_batch(model, input_ids=ids, labels=labels, attention_mask=torch.ones_like(mask), position_ids=pos)


@pytest.mark.parametrize("impl", ["ring", "ulysses"])
def test_right_padded_batch_through_shard_batch_is_exact_under_cp(tmp_path, impl):
    spawn(_padded_body, 2, tmp_path, impl, timeout_s=60)
