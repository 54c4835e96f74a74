"""transformers' classification heads on ndp.trainer.Trainer: token classification (a label per token) and sequence
classification (a label per row, read at its last real token) train and predict under FSDP2 x CP as on one
process, and their loss is not inflated by gradient accumulation or data parallelism (transformers' Trainer hands
them a token count they drop)."""
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForSequenceClassification, LlamaForTokenClassification

import ndp.trainer
from dist import spawn
from test_accelerate import _InOrder, _rank_env, _trainer_args

HEADS = {"token": LlamaForTokenClassification, "sequence": LlamaForSequenceClassification}
LENGTHS = (61, 64, 50, 57, 64, 43, 59, 64)  # odd lengths: CP pads each row's shard


def _save(model_dir, head):
    # no dropout in the token head (transformers' default 0.1): both sides must compute the same function
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=3, pad_token_id=0,
                         classifier_dropout=0.0)
    torch.manual_seed(0)
    HEADS[head](config).save_pretrained(model_dir)


def _rows(head):
    """Rows of odd lengths; token labels -100 on each row's first 20 tokens and on half of row 0 (labelled tokens
    differ per row and per CP shard)."""
    g = torch.Generator().manual_seed(2)
    rows = []
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(1, 256, (n,), generator=g)
        if head == "token":
            labels = torch.randint(0, 3, (n,), generator=g)
            labels[:20] = -100
            labels[30:] = -100 if i == 0 else labels[30:]
        else:
            labels = torch.randint(0, 3, (), generator=g)
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _one_process(model, head, steps, per_step):
    """The reference: SGD at 1e-2 on `per_step` rows a step, the step's loss as transformers means it (token: the
    mean over the step's labelled tokens; sequence: the mean over its rows), row by row (their lengths differ)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    rows, losses = _rows(head), []
    for s in range(steps):
        step = rows[per_step * s:per_step * (s + 1)]
        labelled = sum(int((r["labels"] != -100).sum()) for r in step) if head == "token" else len(step)
        total = 0.0
        for r in step:
            logits = model(input_ids=r["input_ids"][None]).logits
            loss = F.cross_entropy(logits.reshape(-1, 3), r["labels"].reshape(-1), reduction="sum") / labelled
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _pad(rows):
    """A padding collator's batch (DataCollatorWithPadding / ForTokenClassification): right-padded with the pad
    token 0, the attention mask 0 there, token labels -100 there."""
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.stack([F.pad(r["input_ids"], (0, longest - len(r["input_ids"])), value=0) for r in rows])
    labels = [r["labels"] for r in rows]
    if labels[0].dim():
        labels = [F.pad(x, (0, longest - len(x)), value=-100) for x in labels]
    return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": torch.stack(labels)}


def _trainer_rank(rank, world, tmp, head, par, ga, batch):
    _rank_env(rank, world)
    model = HEADS[head].from_pretrained(os.path.join(tmp, "model"))
    args = _trainer_args(tmp, par, max_steps=2, gradient_accumulation_steps=ga, max_grad_norm=0.0,
                         per_device_eval_batch_size=1, per_device_train_batch_size=batch)
    trainer = _InOrder(model=model, args=args, train_dataset=_rows(head), eval_dataset=_rows(head)[:4],
                       data_collator=_pad)
    trainer.train()
    out = trainer.predict(_rows(head)[:4])
    if rank == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        torch.save({"losses": losses, "predictions": out.predictions, "labels": out.label_ids,
                    "loss": out.metrics["test_loss"]}, os.path.join(tmp, "got.pt"))


def _predicted(model, head):
    """One process's predictions and loss on the first 4 rows, as a predict at dp 2, one row per rank and step,
    reports it: per step the mean over its two rows (token: over their labelled tokens), averaged over the steps."""
    rows, logits, losses = _rows(head)[:4], [], []
    with torch.no_grad():
        for pair in (rows[:2], rows[2:]):
            outs = [model(input_ids=r["input_ids"][None]).logits[0] for r in pair]
            logits += outs
            flat = [F.cross_entropy(o.reshape(-1, 3), r["labels"].reshape(-1), reduction="sum") for o, r in
                    zip(outs, pair)]
            count = sum(int((r["labels"] != -100).sum()) for r in pair) if head == "token" else 2
            losses.append(sum(flat).item() / count)
    return logits, sum(losses) / 2


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("head", ["token", "sequence"])
@pytest.mark.parametrize("ga, batch", [(2, 1), (1, 2)])
def test_classifiers_under_fsdp2_and_cp_train_and_predict_as_one_process(tmp_path, head, ga, batch):
    """dp_shard 2 x cp 2, rows of odd lengths: one a micro-batch with gradient accumulation 2, or two rows a batch
    right-padded by a collator (pads unlabelled; the pooled token the last real one). Token classification was
    refused in the first forward ("computes its loss itself from `labels`": its head returns its call's mean, a
    shard's under CP), sequence classification when the model was prepared (its pooling would read each shard's
    last token); at dp_shard 2 x GA 2 without CP both logged and trained on 4x their loss. Against one process: the
    logged losses (4 digits), then predict's logits (the token head's gathered from the CP shards, the pooled scores
    read at each row's last token of the whole row), labels and loss."""
    _save(str(tmp_path / "model"), head)
    spawn(_trainer_rank, 4, tmp_path, str(tmp_path), head, {"dp_shard_size": 2, "cp_size": 2}, ga, batch,
          timeout_s=300)
    got = torch.load(tmp_path / "got.pt", weights_only=False)
    model = HEADS[head].from_pretrained(str(tmp_path / "model")).eval()
    want = _one_process(model, head, steps=2, per_step=4)
    assert got["losses"] == pytest.approx(want, abs=1e-4) and want[0] != want[1]
    logits, loss = _predicted(model, head)
    for i, row in enumerate(logits):
        pred = got["predictions"][i][:len(row)] if head == "token" else got["predictions"][i]
        torch.testing.assert_close(torch.as_tensor(pred), row, rtol=1e-5, atol=1e-6)
        labels = torch.as_tensor(got["labels"][i])
        assert torch.equal(labels[:len(row)] if head == "token" else labels, _rows(head)[i]["labels"])
    assert got["loss"] == pytest.approx(loss, rel=1e-5)


@pytest.mark.parametrize("head", ["token", "sequence"])
def test_classifier_loss_is_the_steps_mean_under_gradient_accumulation(tmp_path, head):
    """One process, gradient accumulation 2: transformers' Trainer hands the heads num_items_in_batch (their forward
    takes **kwargs), which they drop, and then leaves their loss undivided by the accumulation steps: it logged and
    trained on 2x the step's loss. ndp's Trainer: the step's mean (token: over its labelled tokens)."""
    _save(str(tmp_path / "model"), head)
    model = HEADS[head].from_pretrained(str(tmp_path / "model"))
    args = _trainer_args(str(tmp_path), None, max_steps=2, gradient_accumulation_steps=2, max_grad_norm=0.0)
    trainer = _InOrder(model=model, args=args, train_dataset=_rows(head))
    trainer.train()
    got = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    want = _one_process(HEADS[head].from_pretrained(str(tmp_path / "model")), head, steps=2, per_step=2)
    assert got == pytest.approx(want, abs=1e-4)
    if head == "token":  # ndp's loss from the logits, not a user's
        assert trainer.compute_loss_func is trainer._ndp_token_loss
