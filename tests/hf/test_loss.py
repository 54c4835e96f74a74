"""ndp.hf.loss and shard_batch(global_batch=True) in one process; the multi-process cases are in
test_quickstart.py (the README script at dp_shard 2 x cp 2 and other layouts against one process)."""
import pytest
import torch
import torch.nn.functional as F
from transformers import DataCollatorWithFlattening

import ndp
import ndp.hf
from ndp.train.presets import build_model
from ndp.testing import assert_close


def _model():
    return ndp.parallelize(build_model("tiny-llama", seed=0), ndp.ParallelismConfig(), None)


def test_loss_is_the_mean_cross_entropy_on_one_rank():
    model = _model()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = F.pad(ids[:, 1:], (0, 1), value=-100)
    labels[0, :5] = -100
    logits = model(ids).logits
    loss, mean = ndp.hf.loss(logits, labels, model, return_mean=True)
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert_close(loss, want, torch.float32)
    assert_close(mean, want, torch.float32)
    # num_tokens: the caller's global count (e.g. over micro-batches) replaces the local count
    half = ndp.hf.loss(logits, labels, model, num_tokens=2 * int((labels != -100).sum()))
    assert_close(half, want / 2, torch.float32)
    # no labelled token: 0, not NaN
    assert ndp.hf.loss(logits, torch.full_like(labels, -100), model).item() == 0.0


def test_scale_loss_sum_normalises_a_custom_summed_loss_as_loss_does():
    """The one normalisation ndp.hf.loss, lm_loss and ndp-train share, for a loss summed by other means (here label
    smoothing): the global mean, num_tokens replacing the count; a model ndp did not parallelize is refused."""
    model = _model()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    labels = F.pad(ids[:, 1:], (0, 1), value=-100)
    logits = model(ids).logits.flatten(0, 1)
    smoothed = F.cross_entropy(logits, labels.flatten(), label_smoothing=0.1, reduction="sum")
    loss, mean = ndp.hf.scale_loss_sum(smoothed, labels, model, return_mean=True)
    want = F.cross_entropy(logits, labels.flatten(), label_smoothing=0.1)
    assert_close(loss, want, torch.float32)
    assert_close(mean, want, torch.float32)
    quarter = ndp.hf.scale_loss_sum(smoothed, labels, model, num_tokens=4 * int((labels != -100).sum()))
    assert_close(quarter, want / 4, torch.float32)
    with pytest.raises(ValueError, match="ndp.hf.scale_loss_sum needs a model returned by ndp.parallelize"):
        ndp.hf.scale_loss_sum(smoothed, labels, build_model("tiny-llama", seed=0))


def test_loss_keeps_float64_logits_in_float64():
    model = _model()
    logits = torch.randn(2, 16, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    loss = ndp.hf.loss(logits, labels, model)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), labels.flatten()), rtol=1e-13, atol=0)


def test_loss_and_shard_batch_errors():
    ids = torch.zeros(2, 16, dtype=torch.long)
    plain = build_model("tiny-llama", seed=0)
    with pytest.raises(ValueError, match="ndp.hf.loss needs a model returned by ndp.parallelize"):
        ndp.hf.loss(torch.zeros(2, 16, 256), ids, plain)
    with pytest.raises(ValueError, match="shard_batch needs a model returned by ndp.parallelize"):
        ndp.hf.shard_batch(plain, input_ids=ids)
    model = _model()
    with pytest.raises(ValueError, match=r"logits \[batch, local_seq, vocab\] and labels \[batch, local_seq\]; got "
                                         r"logits \(2, 8, 256\), labels \(2, 16\)"):
        ndp.hf.loss(torch.zeros(2, 8, 256), ids, model)
    with pytest.raises(ValueError, match=r"needs integer class labels .* dtype torch.float32"):
        ndp.hf.loss(torch.zeros(2, 16, 256), ids.float(), model)
    with pytest.raises(ValueError, match=r"every tensor in one \[batch, seq\] shape; got \{'input_ids': \(2, 16\), "
                                         r"'labels': \(2, 15\)\}"):
        ndp.hf.shard_batch(model, input_ids=ids, labels=ids[:, 1:])
    with pytest.raises(ValueError, match=r"takes \[batch, seq\] tensors; \['labels'\]"):
        ndp.hf.shard_batch(model, input_ids=ids, labels=ids.flatten())
    # one process: the global batch is this rank's batch
    b = ndp.hf.shard_batch(model, global_batch=True, input_ids=ids)
    assert b["input_ids"] is ids


def test_shard_batch_refuses_labels_not_shifted():
    # transformers' convention (labels = input_ids; DataCollatorWithFlattening's labels, -100 at each document's
    # first token): taken as shifted, every token would be trained to predict itself. Shifted labels pass, also
    # where a token repeats (a shifted row equals its input_ids only there).
    model = _model()
    ids = torch.randint(1, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    flat = DataCollatorWithFlattening()([{"input_ids": r} for r in ids.tolist()])
    for labels in (ids.clone(), flat["labels"].view(2, 16)):
        with pytest.raises(ValueError, match=r"labels equal to the input_ids at every labelled token.*"
                                             r"F\.pad\(labels\[:, 1:\], \(0, 1\), value=-100\)"):
            ndp.hf.shard_batch(model, input_ids=ids, labels=labels)
    runs = torch.tensor([[5, 5, 5, 7, 7, 9]])
    for labels in (F.pad(ids[:, 1:], (0, 1), value=-100), F.pad(runs[:, 1:], (0, 1), value=-100)):
        rows = ids if labels.shape == ids.shape else runs
        assert ndp.hf.shard_batch(model, input_ids=rows, labels=labels)["labels"].equal(labels)


def _dp_slice_body(rank, world):
    cfg = ndp.ParallelismConfig(dp_shard_size=2)
    model = ndp.parallelize(build_model("tiny-llama", seed=0), cfg, cfg.build_device_mesh("cpu"))
    ids = torch.arange(4 * 8).reshape(4, 8)
    assert torch.equal(ndp.hf.shard_batch(model, global_batch=True, input_ids=ids)["input_ids"],
                       ids[2 * rank:2 * rank + 2])
    assert ndp.hf.shard_batch(model, input_ids=ids)["input_ids"] is ids  # default: already this rank's batch
    with pytest.raises(ValueError, match=r"input_ids has batch size 3, not divisible by the data-parallel size 2"):
        ndp.hf.shard_batch(model, global_batch=True, input_ids=ids[:3])


@pytest.mark.distributed
def test_shard_batch_global_batch_takes_this_dp_ranks_rows(tmp_path):
    from dist import spawn

    spawn(_dp_slice_body, 2, tmp_path)
