"""ndp's Trainer predicts and evaluates with compute_metrics under context parallelism as a run without it does:
each rank's shard of the logits (and of the hidden states) is gathered back into the batch's order on every rank
(``ndp.hf.batch.gather_tokens``), and the Trainer gathers one copy per data-parallel batch."""
import os
import sys
import warnings

import numpy as np
import pytest
import torch
from accelerate.state import AcceleratorState
from transformers import AutoModelForCausalLM

import ndp.trainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dist import spawn  # noqa: E402
from ndp.testing import assert_close  # noqa: E402
from test_accelerate import (COLLATORS, _InOrder, _padded_samples, _rank_env, _samples, _save_tiny,  # noqa: E402
                             _sft_trainer, _trainer_args)

# case -> (family, its parallelism, eval batch size, collator, samples)
CASES = {"dense": ("llama", {"dp_shard_size": 2, "cp_size": 2}, 1, None, lambda: _samples()[:5]),
         "tp": ("llama", {"dp_shard_size": 2, "tp_size": 2}, 1, None, lambda: _samples()[:5]),
         "cp_tp": ("llama", {"cp_size": 2, "tp_size": 2}, 2, "pad", _padded_samples),
         "pad": ("llama", {"cp_size": 2}, 2, "pad", _padded_samples),
         "flatten": ("llama", {"cp_size": 2}, 2, "flatten", _padded_samples),
         "moe": ("olmoe", {"cp_size": 2}, 2, "pad", lambda: _padded_samples()[:2])}


def _accuracy(predictions, labels):
    """Next-token accuracy over the labelled tokens, as a user's compute_metrics computes it from the logits."""
    logits = predictions[0] if isinstance(predictions, tuple) else predictions
    hit, seen = logits[:, :-1].argmax(-1) == labels[:, 1:], labels[:, 1:] != -100
    return float(hit[seen].mean())


def _predict_rank(rank, world, tmp, model_dir, layer, case):
    _rank_env(rank, world)
    _, par, batch, collate, samples = CASES[case]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.config.output_hidden_states = case == "flatten"  # predictions (logits, hidden states)
    seen = []

    def metrics(p):
        seen.append(p)
        return {"accuracy": _accuracy(p.predictions, p.label_ids)}

    args = _trainer_args(tmp, par, layer, per_device_eval_batch_size=batch, include_for_metrics=["inputs"])
    trainer = _InOrder(model=model, args=args, compute_metrics=metrics, eval_dataset=samples(),
                       data_collator=COLLATORS[collate]() if collate else None)
    if case == "moe":  # its router logits (per token of the shard, flattened) and load-balancing loss: refused
        with pytest.raises(ValueError, match=r"outputs \['aux_loss', 'router_logits'\] are not per-token tensors"):
            trainer.predict(samples())
        got = {"predict": trainer.predict(samples(), ignore_keys=["aux_loss", "router_logits"])}
    else:
        got = {"eval": trainer.evaluate(), "inputs": seen[0].inputs, "predict": trainer.predict(samples())}
    if rank == 0:
        torch.save(got, os.path.join(tmp, "predict.pt"))


def _reference(model_dir, case):
    """One process, eager attention: each sample's logits and last hidden states alone (a causal model's outputs at
    a sample's tokens are the same padded or packed with others)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        outs = [model(input_ids=s["input_ids"][None], output_hidden_states=True) for s in CASES[case][4]()]
    return [o.logits[0] for o in outs], [o.hidden_states[-1][0] for o in outs]


def _rows(case):
    """Each predicted row's samples, in order: a sample per row, or (flatten) the samples packed in a batch."""
    n, batch = len(CASES[case][4]()), CASES[case][2]
    if case != "flatten":
        return [[i] for i in range(n)]
    return [list(range(i, min(i + batch, n))) for i in range(0, n, batch)]


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_trainer_predict_and_compute_metrics_under_cp_match_one_process(tmp_path, case):
    """Under CP ndp's Trainer refused compute_metrics and Trainer.predict (each rank held its shard of the logits):
    now dense rows at dp_shard 2 x cp 2 (5 rows: the last step padded, cut again), a padding collator's rows of
    lengths the layout cannot split (ndp pads 63 to 64) and packed documents (the shards' lengths differ) under cp 2
    return the logits (and hidden states) of one process at every real token, the labels and inputs whole, and
    compute_metrics gets them; an MoE's router outputs, not per token, are refused by name."""
    model_dir = str(tmp_path / "model")
    family = CASES[case][0]
    layer = _save_tiny(model_dir, family)
    spawn(_predict_rank, 4 if case in ("dense", "tp", "cp_tp") else 2, tmp_path, str(tmp_path), model_dir, layer, case,
          timeout_s=300)
    got = torch.load(tmp_path / "predict.pt", weights_only=False)
    logits, hidden = _reference(model_dir, case)
    out = got["predict"]
    preds = out.predictions if case != "flatten" else out.predictions[0]
    ref = np.array(preds)  # the predictions with one process's logits at every real token
    for r, members in enumerate(_rows(case)):
        want = torch.cat([logits[i] for i in members])
        assert_close(torch.as_tensor(preds[r, :len(want)]), want, torch.float32, msg=f"row {r} logits")
        ref[r, :len(want)] = want.numpy()
        if CASES[case][3] != "pad":  # past the row: the Trainer's padding across batches (-100), nothing of ndp's pads
            assert (preds[r, len(want):] == -100).all()
        if case == "flatten":  # hidden states: the embeddings' and every layer's, the last after the final norm
            assert len(out.predictions[1]) == 3
            assert_close(torch.as_tensor(out.predictions[1][-1][r, :len(want)]),
                         torch.cat([hidden[i] for i in members]), torch.float32, msg=f"row {r} hidden states")
    if case == "moe":
        return
    # labels and inputs as the batches hold them (whole, not a shard), and the metric from them
    ids = [s["input_ids"] for s in CASES[case][4]()]
    for r, members in enumerate(_rows(case)):
        row = torch.cat([ids[i] for i in members])
        assert torch.equal(torch.as_tensor(got["inputs"][r, :len(row)]), row)
        labels = torch.as_tensor(out.label_ids[r, :len(row)])
        firsts = torch.tensor([0, *[len(ids[i]) for i in members[:-1]]]).cumsum(0)
        if case == "flatten":  # DataCollatorWithFlattening: -100 at each document's first token
            row = row.index_fill(0, firsts, -100)
        assert torch.equal(labels, row)
    want = _accuracy(ref, np.asarray(out.label_ids))
    assert got["eval"]["eval_accuracy"] == pytest.approx(want) == out.metrics["test_accuracy"]
    # predict ran the Trainer's evaluation loop a second time: its loss is the first's (transformers resets the
    # loop's gather after each; the second gathered each batch once per CP rank: 5.5612 against 5.5604)
    assert out.metrics["test_loss"] == pytest.approx(got["eval"]["eval_loss"], rel=1e-6)


def _sft_predict(trainer):
    """`trainer` (an SFTTrainer on packed prompt-completion data, untrained) with compute_metrics: its evaluation
    and its predictions on the evaluation data."""
    with warnings.catch_warnings():  # the loss alone: no second forward for the logits (TRL warns when it runs one)
        warnings.simplefilter("error", FutureWarning)
        loss_only = trainer.evaluate()["eval_loss"]
    trainer.compute_metrics = lambda p: {"accuracy": _accuracy(p.predictions, p.label_ids)}
    return {"eval": trainer.evaluate(), "predict": trainer.predict(trainer.eval_dataset), "loss_only": loss_only}


def _sft_predict_rank(rank, world, tmp, model_dir):
    _rank_env(rank, world)
    got = _sft_predict(_sft_trainer(ndp.trainer.SFTTrainer, tmp, model_dir, True, None, {"cp_size": 2}))
    if rank == 0:
        torch.save(got, os.path.join(tmp, "sft_predict.pt"))


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_sft_trainer_predict_and_compute_metrics_under_cp_match_one_process(tmp_path):
    """ndp's SFTTrainer under cp 2 on packed prompt-completion data (blocks of 32 tokens, documents cut over the
    ranks unevenly): the predictions, labels and compute_metrics are one TRL SFTTrainer process's."""
    trl = pytest.importorskip("trl")
    model_dir = str(tmp_path / "model")
    _save_tiny(model_dir, "llama")
    spawn(_sft_predict_rank, 2, tmp_path, str(tmp_path), model_dir, timeout_s=300)
    got = torch.load(tmp_path / "sft_predict.pt", weights_only=False)
    want = _sft_predict(_sft_trainer(trl.SFTTrainer, str(tmp_path / "ref"), model_dir, True, None))
    AcceleratorState._reset_state(True)
    got_p, want_p = got["predict"], want["predict"]
    assert np.array_equal(got_p.label_ids, want_p.label_ids) and got_p.predictions.shape == want_p.predictions.shape
    assert_close(torch.as_tensor(got_p.predictions), torch.as_tensor(want_p.predictions), torch.float32)
    assert got["loss_only"] == pytest.approx(got["eval"]["eval_loss"], rel=1e-6)
    for name in ("loss", "accuracy"):
        assert got["eval"][f"eval_{name}"] == pytest.approx(want["eval"][f"eval_{name}"], rel=1e-5)
        assert got_p.metrics[f"test_{name}"] == pytest.approx(want_p.metrics[f"test_{name}"], rel=1e-5)
