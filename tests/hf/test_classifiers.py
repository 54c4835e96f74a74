"""transformers' classification heads on ndp.trainer.Trainer: token classification (a label per token), sequence
classification (a label per row, read at its last real token) and question answering (a span's start and end over
the row) train and predict under FSDP2 x CP as on one process, and their loss is not inflated by gradient
accumulation or data parallelism (transformers' Trainer hands them a token count they drop)."""
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import (LlamaConfig, LlamaForQuestionAnswering, LlamaForSequenceClassification,
                          LlamaForTokenClassification)

import ndp.hf
import ndp.trainer
from dist import spawn
from test_accelerate import _InOrder, _rank_env, _trainer_args

HEADS = {"token": LlamaForTokenClassification, "sequence": LlamaForSequenceClassification,
         "span": LlamaForQuestionAnswering}
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
    differ per row and per CP shard); spans anywhere in the row (in another CP shard than their start, often)."""
    g = torch.Generator().manual_seed(2)
    rows = []
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(1, 256, (n,), generator=g)
        if head == "span":
            start, end = sorted(torch.randint(0, n, (2,), generator=g).tolist())
            rows.append({"input_ids": ids, "start_positions": torch.tensor(start), "end_positions": torch.tensor(end)})
            continue
        if head == "token":
            labels = torch.randint(0, 3, (n,), generator=g)
            labels[:20] = -100
            labels[30:] = -100 if i == 0 else labels[30:]
        else:
            labels = torch.randint(0, 3, (), generator=g)
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _row_loss(model, row, head):
    """(the row's summed loss: over its labelled tokens, or its one label's or span's, the row's outputs)"""
    out = model(input_ids=row["input_ids"][None])
    if head == "span":
        return (F.cross_entropy(out.start_logits, row["start_positions"][None]) +
                F.cross_entropy(out.end_logits, row["end_positions"][None])) / 2, out
    return F.cross_entropy(out.logits.reshape(-1, 3), row["labels"].reshape(-1), reduction="sum"), out


def _count(rows, head):
    """What the step's loss is divided by: its labelled tokens (token), its rows (sequence, span)."""
    return sum(int((r["labels"] != -100).sum()) for r in rows) if head == "token" else len(rows)


def _one_process(model, head, steps, per_step):
    """The reference: SGD at 1e-2 on `per_step` rows a step, the step's loss as transformers means it (token: the
    mean over the step's labelled tokens; sequence, span: the mean over its rows), row by row (their lengths
    differ)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    rows, losses = _rows(head), []
    for s in range(steps):
        step = rows[per_step * s:per_step * (s + 1)]
        total = 0.0
        for r in step:
            loss = _row_loss(model, r, head)[0] / _count(step, head)
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
    batch = {"input_ids": ids, "attention_mask": (ids != 0).long()}
    for k in rows[0].keys() - {"input_ids"}:
        batch[k] = torch.stack([F.pad(r[k], (0, longest - len(r[k])), value=-100) if r[k].dim() else r[k]
                                for r in rows])
    return batch


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
    """One process's outputs and loss on the first 4 rows, as a predict at dp 2, one row per rank and step,
    reports it: per step the mean over its two rows (token: over their labelled tokens), averaged over the steps."""
    rows, outs, losses = _rows(head)[:4], [], []
    with torch.no_grad():
        for pair in (rows[:2], rows[2:]):
            sums = [_row_loss(model, r, head) for r in pair]
            outs += [out for _, out in sums]
            losses.append(sum(loss.item() for loss, _ in sums) / _count(pair, head))
    return outs, sum(losses) / 2


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("head, ga, batch", [("token", 2, 1), ("token", 1, 2), ("sequence", 2, 1),
                                             ("sequence", 1, 2), ("span", 2, 1)])
def test_classifiers_under_fsdp2_and_cp_train_and_predict_as_one_process(tmp_path, head, ga, batch):
    """dp_shard 2 x cp 2, rows of odd lengths: one a micro-batch with gradient accumulation 2, or two rows a batch
    right-padded by a collator (pads unlabelled; the pooled token the last real one). Token classification was
    refused in the first forward ("computes its loss itself from `labels`": its head returns its call's mean, a
    shard's under CP), sequence classification when the model was prepared (its pooling would read each shard's
    last token), question answering too (its span read over each shard); at dp_shard 2 x GA 2 without CP the token
    and sequence heads logged and trained on 4x their loss. Against one process: the logged losses (4 digits), then
    predict's outputs (the token head's logits gathered from the CP shards, the pooled scores read at each row's last
    token of the whole row, the span's start and end logits over the whole row), labels and loss."""
    _save(str(tmp_path / "model"), head)
    spawn(_trainer_rank, 4, tmp_path, str(tmp_path), head, {"dp_shard_size": 2, "cp_size": 2}, ga, batch,
          timeout_s=300)
    got = torch.load(tmp_path / "got.pt", weights_only=False)
    model = HEADS[head].from_pretrained(str(tmp_path / "model")).eval()
    want = _one_process(model, head, steps=2, per_step=4)
    assert got["losses"] == pytest.approx(want, abs=1e-4) and want[0] != want[1]
    outs, loss = _predicted(model, head)
    span = head == "span"
    fields, names = (("start_logits", "end_logits"), ("start_positions", "end_positions")) if span else \
        (("logits",), ("labels",))
    preds, labels = (got["predictions"], got["labels"]) if span else ((got["predictions"],), (got["labels"],))
    for i, (row, out) in enumerate(zip(_rows(head), outs)):  # predict pads each batch's outputs to the longest
        for field, pred in zip(fields, preds):
            want = getattr(out, field)[0]
            torch.testing.assert_close(torch.as_tensor(pred[i])[:want.shape[0]], want, rtol=1e-5, atol=1e-6)
        for name, label in zip(names, labels):
            label = torch.as_tensor(label[i])
            assert torch.equal(label[:len(row[name])] if row[name].dim() else label, row[name])
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


def _padded_span_rank(rank, world, tmp):
    _rank_env(rank, world)
    model = HEADS["span"].from_pretrained(os.path.join(tmp, "model"))
    args = _trainer_args(tmp, {"cp_size": 2}, max_steps=1, per_device_train_batch_size=2)
    trainer = _InOrder(model=model, args=args, train_dataset=_rows("span"), data_collator=_pad)
    with pytest.raises(ValueError, match=r"cp_size=2\) a question-answering batch with padding \(3 pad tokens in "
                                         r"the attention_mask\): its start and end logits at the pads"):
        trainer.train()


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_padded_question_answering_batch_is_refused_under_cp_on_every_rank(tmp_path):
    """transformers' QA loss and predictions read the pads' start and end logits too, which under CP ndp computes
    without the padding mask: a padded batch is refused by name on each CP rank (both hold it), before the model's
    first collective."""
    _save(str(tmp_path / "model"), "span")
    spawn(_padded_span_rank, 2, tmp_path, str(tmp_path), timeout_s=60)


def test_packed_rows_stay_refused_for_a_head_read_on_the_gathered_rows():
    """The trainer marks a row head it reads on the gathered rows (POOLED_ON_WHOLE), which lets it through the CP
    check; packed documents would still share one pooled token, one span: refused."""
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    for head in ("sequence", "span"):
        model = HEADS[head](config)
        setattr(model, ndp.hf.models.POOLED_ON_WHOLE, True)
        ndp.hf.models.check_cp_model(model)
        with pytest.raises(ndp.hf.Unsupported, match=r"packed documents .* would not stay apart: its head reads"):
            ndp.hf.check_packed_model(model)
