"""ndp.hf.lm_loss (the LM head and the loss fused, no logits) against ndp.hf.loss on the model's logits: one rank,
and FSDP2 x CP on 2 gloo ranks (the loss and every gradient, float64); a forward that changes its logits in a way
the fused op cannot reproduce is refused by name. Every family of the zoo: tests/hf/test_zoo.py."""
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import ndp
import ndp.hf
from dist import spawn
from ndp.train.presets import build_model
import _zoo
from ndp.testing import assert_close


def _batch(vocab=256, seq=32, seed=0):
    ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(seed))
    labels = F.pad(ids[:, 1:], (0, 1), value=-100)
    labels[0, :5] = -100
    return ids, labels, torch.arange(seq).expand(2, seq)


def _grads(model):
    out = {}
    for n, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        out[n] = g.clone()
    model.zero_grad(set_to_none=True)
    return out


def _both(model, b):
    """(loss, mean, grads) of ndp.hf.loss on the logits, then of ndp.hf.lm_loss."""
    res = []
    for fused in (False, True):
        kw = {k: b[k] for k in ("input_ids", "position_ids")}
        if fused:
            loss, mean = ndp.hf.lm_loss(model, b["labels"], return_mean=True, chunk_bytes=4096, **kw)
        else:
            loss, mean = ndp.hf.loss(model(**kw).logits, b["labels"], model, return_mean=True)
        loss.backward()
        res.append((loss.detach(), mean, _grads(model)))
    return res


def _assert_same(full, fused, rtol=1e-12):
    for a, b in zip(full[:2], fused[:2]):
        torch.testing.assert_close(b.double(), a.double(), rtol=rtol, atol=0)
    for n, g in full[2].items():
        torch.testing.assert_close(fused[2][n], g, rtol=rtol, atol=1e-15, msg=lambda m: f"{n}: {m}")


def test_lm_loss_equals_loss_on_the_logits_one_rank():
    model = ndp.parallelize(build_model("tiny-llama", seed=0, dtype=torch.float64), ndp.ParallelismConfig(), None)
    ids, labels, pos = _batch()
    _assert_same(*_both(model, dict(input_ids=ids, labels=labels, position_ids=pos)))


def _fsdp_cp_body(rank, world):
    cfg = ndp.ParallelismConfig(cp_size=2, cp_layout="zigzag")
    model = ndp.hf.parallelize(build_model("tiny-llama", seed=0, dtype=torch.float64), cfg,
                               cfg.build_device_mesh("cpu"))
    ids, labels, pos = _batch()
    b = ndp.hf.shard_batch(model, input_ids=ids, labels=labels, position_ids=pos)
    _assert_same(*_both(model, b), rtol=1e-10)


@pytest.mark.distributed
def test_lm_loss_equals_loss_on_the_logits_under_fsdp_and_cp(tmp_path):
    spawn(_fsdp_cp_body, 2, tmp_path)


def _loss_parallel_body(rank, world):
    ids, labels, pos = _batch()
    ref = build_model("tiny-llama", seed=0, dtype=torch.float64)
    logits = ref(input_ids=ids, position_ids=pos, use_cache=False).logits
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    want.backward()
    cfg = ndp.ParallelismConfig(tp_size=2)
    model = ndp.hf.parallelize(build_model("tiny-llama", seed=0, dtype=torch.float64), cfg,
                               cfg.build_device_mesh("cpu"), loss_parallel=True)
    assert model.lm_head.weight.placements[0].is_shard(0)  # the vocabulary is split over the TP ranks
    b = ndp.hf.shard_batch(model, input_ids=ids, labels=labels, position_ids=pos)
    loss, mean = ndp.hf.lm_loss(model, b["labels"], return_mean=True, chunk_bytes=4096, input_ids=b["input_ids"],
                                position_ids=b["position_ids"])
    loss.backward()
    torch.testing.assert_close(mean.double(), want.detach(), rtol=1e-6, atol=0)  # mean: fp32
    torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=0)
    grads = _grads(model)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-10, atol=1e-14, msg=lambda m: f"{n}: {m}")
    with pytest.raises(ValueError, match="split by vocabulary .* Use ndp.hf.lm_loss"):
        ndp.hf.loss(model(input_ids=b["input_ids"]).logits, b["labels"], model)
    # the model's own loss cannot take vocabulary shards either (transformers raised a batch-size mismatch)
    with pytest.raises(ndp.hf.Unsupported, match=r"parallelized with loss_parallel: .* ndp\.hf\.lm_loss\(model"):
        model(**b)


@pytest.mark.distributed
def test_loss_parallel_under_tp_equals_one_process(tmp_path):
    spawn(_loss_parallel_body, 2, tmp_path)


def _query_then_scale(module, args, out):
    # what torch 2.15's FSDP2 does to a module's output (asks its strides), then a Granite-like scale
    assert out.stride() and out.numel() >= 0 and out.is_contiguous() in (True, False)
    return out * 0.5


def test_queries_of_the_logits_do_not_refuse_the_fused_loss():
    model = ndp.parallelize(build_model("tiny-llama", seed=0, dtype=torch.float64), ndp.ParallelismConfig(), None)
    model.lm_head.register_forward_hook(_query_then_scale)
    ids, labels, pos = _batch()
    full, fused = _both(model, dict(input_ids=ids, labels=labels, position_ids=pos))
    _assert_same(full, fused)  # the fused loss applied the scale, and only it


def test_a_forward_that_changes_its_logits_otherwise_is_refused():
    model = ndp.parallelize(build_model("tiny-llama", seed=0), ndp.ParallelismConfig(), None)
    ids, labels, _ = _batch()
    handle = model.lm_head.register_forward_hook(lambda m, a, out: out + 1.0)
    with pytest.raises(ndp.hf.Unsupported, match=r"cannot reproduce .*\[\('add',\)\].*use ndp.hf.loss"):
        ndp.hf.lm_loss(model, labels, input_ids=ids)
    handle.remove()
    assert "forward" not in vars(model.lm_head)  # the head is restored, also after a refusal
    plain = build_model("tiny-llama", seed=0)
    with pytest.raises(ValueError, match="ndp.hf.lm_loss needs a model returned by ndp.parallelize"):
        ndp.hf.lm_loss(plain, labels, input_ids=ids)


def test_an_output_embedding_that_is_not_a_linear_is_refused():
    model = ndp.parallelize(build_model("tiny-llama", seed=0), ndp.ParallelismConfig(), None)
    model.lm_head = torch.nn.Sequential(model.lm_head)
    ids, labels, _ = _batch()
    with pytest.raises(ndp.hf.Unsupported, match="output embedding to be a torch.nn.Linear; LlamaForCausalLM's is "
                                                 "Sequential"):
        ndp.hf.lm_loss(model, labels, input_ids=ids)


def test_a_tied_output_embedding_is_not_split_by_vocabulary():
    # The one question "can the LM head be split over TP?" (ndp-train asks it to choose its loss under TP).
    untied = build_model("tiny-llama", seed=0)
    assert ndp.hf.can_split_head(untied)
    tied = build_model("tiny-llama", seed=0)
    tied.lm_head.weight = tied.model.embed_tokens.weight
    assert not ndp.hf.can_split_head(tied)
    with pytest.raises(ndp.hf.Unsupported, match=r"LlamaForCausalLM's is tied to the input embedding "
                                                 r"\(tie_word_embeddings\).*Leave loss_parallel off"):
        ndp.hf.hf_plan(tied, loss_parallel=True)
    wrapped = build_model("tiny-llama", seed=0)
    wrapped.lm_head = torch.nn.Sequential(wrapped.lm_head)
    assert not ndp.hf.can_split_head(wrapped)


def test_tensor_parallel_keeps_a_tied_input_embedding_whole():
    # transformers 5.17 adds "embed_tokens": "embedding_rowwise" to the plan of a tied model; its head computes
    # with the same weight, unsplit, so the plan leaves the embedding out (an untied one keeps its entry).
    for tie in (True, False):
        model = build_model("tiny-llama", seed=0)
        if tie:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.config.base_model_tp_plan = {**ndp.hf.DEFAULT_TP_PLAN, "embed_tokens": "rowwise_rep"}
        plan = ndp.hf.hf_plan(model).tp_plan
        assert ("model.embed_tokens" in plan) is not tie
        assert plan["model.layers.*.self_attn.q_proj"] == "colwise"


def _own_loss_body(rank, world):
    # model(**batch) on shard_batch's batch, labels included: transformers shifted the (already shifted) labels a
    # second time (every target one token late) and averaged each shard alone; now the model's own loss is
    # ndp.hf.loss's, under CP and under data parallelism alone.
    ids, labels, pos = _batch()
    for cfg in (ndp.ParallelismConfig(cp_size=2), ndp.ParallelismConfig(dp_shard_size=2)):
        model = ndp.hf.parallelize(build_model("tiny-llama", seed=0, dtype=torch.float64), cfg,
                                   cfg.build_device_mesh("cpu"))
        b = ndp.hf.shard_batch(model, global_batch=True, input_ids=ids, labels=labels, position_ids=pos)
        own = model(**b).loss
        own.backward()
        got = own.detach(), _grads(model)
        want = ndp.hf.loss(model(**{k: v for k, v in b.items() if k != "labels"}).logits, b["labels"], model)
        want.backward()
        # transformers' loss computes in float32 (logits.float()): float32's tolerances
        assert_close(got[0], want.detach(), torch.float32)
        for n, g in _grads(model).items():
            assert_close(got[1][n], g, torch.float32, "grad", msg=f"{cfg} {n}")
    # labels not from shard_batch (not shifted before sharding, as far as ndp can tell): refused under CP
    with pytest.raises(ValueError, match=r"model given `labels` shifts them inside this rank's shard.*shard_batch"):
        model_cp = ndp.hf.parallelize(build_model("tiny-llama", seed=0), ndp.ParallelismConfig(cp_size=2),
                                      ndp.ParallelismConfig(cp_size=2).build_device_mesh("cpu"))
        b = ndp.hf.shard_batch(model_cp, input_ids=ids, position_ids=pos)
        model_cp(**b, labels=b["input_ids"].clone())
    # a family whose loss ignores shift_labels and num_items_in_batch (BART's decoder): refused, not a shard's mean
    cfg = ndp.ParallelismConfig(cp_size=2)
    bart = ndp.hf.parallelize(_zoo.tiny_model("bart"), cfg, cfg.build_device_mesh("cpu"))
    b = ndp.hf.shard_batch(bart, input_ids=ids % 64, labels=labels.where(labels < 0, labels % 64), position_ids=pos)
    with pytest.raises(ndp.hf.Unsupported, match=r"BartForCausalLM computes its loss itself .* ndp\.hf\.loss\("):
        bart(**b)


@pytest.mark.distributed
def test_the_models_own_loss_on_shard_batch_labels_is_ndp_loss(tmp_path):
    spawn(_own_loss_body, 2, tmp_path)
