"""transformers models on ndp attention under torch.compile: decoder layers compile fullgraph (0 graph breaks; aot_eager
and inductor equal eager, fp32, loss/logits and every gradient) on 1 process and through
``ndp.hf.parallelize(..., compile=True)`` at cp 2 (ring, Ulysses); the whole model compiles with the mask
construction as its only graph breaks; a batch that is not this rank's shard still raises on every rank."""
import os
import sys
from unittest import mock

import pytest
import torch
import torch._dynamo as dynamo
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist import spawn  # noqa: E402
import _zoo  # noqa: E402

IDS = torch.randint(3, 100, (2, 32), generator=torch.Generator().manual_seed(0))
POS = torch.cat([torch.arange(12), torch.arange(20)])[None]  # two packed documents per row


def _ndp_model(model_type):
    import ndp.hf

    ndp.hf.register_attention()
    torch.manual_seed(0)
    model = _zoo.tiny_model(model_type).float().train()
    model.set_attn_implementation("ndp_ring")
    return model


def _run(model, call):
    model.zero_grad()
    out = call(input_ids=IDS, position_ids=POS).logits
    out.square().mean().backward()
    return [out.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _close(a, b):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.reset()


@pytest.mark.parametrize("model_type", ["llama", "mistral", "gemma2"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_decoder_layers_compile_fullgraph(model_type, backend):
    model = _ndp_model(model_type)
    eager = _run(model, model)
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = torch.compile(layer, backend=backend, fullgraph=True)
    _close(_run(model, model), eager)


def test_compiled_layers_follow_each_batchs_padding():
    """Right-padded batches (the padding read into the mask marker's spec): compiled layers equal eager for each
    batch's own padding, never a padding compiled in from an earlier batch."""
    model = _ndp_model("llama")
    masks = [(torch.arange(32)[None] < torch.tensor([[32], [n]])).long() for n in (20, 9)]
    eager = [_run(model, lambda **kw: model(**kw, attention_mask=m)) for m in masks]
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = torch.compile(layer, backend="aot_eager", fullgraph=True)
    for m, e in zip(masks, eager):
        _close(_run(model, lambda **kw: model(**kw, attention_mask=m)), e)


def test_whole_model_compiles_with_breaks_only_at_the_mask():
    model = _ndp_model("llama")
    eager = _run(model, model)
    _close(_run(model, torch.compile(model, backend="aot_eager")), eager)
    explain = dynamo.explain(model)(input_ids=IDS, position_ids=POS)
    assert explain.break_reasons and all("_ndp_mask" in str(b.reason) for b in explain.break_reasons), \
        [str(b.reason)[:200] for b in explain.break_reasons]


def _grads(model):
    return [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]


def _cp_body(rank, world):
    import ndp
    import ndp.hf
    import transformers

    transformers.logging.set_verbosity_error()
    labels = F.pad(IDS[:, 1:], (0, 1), value=-100)
    for model_type, impl in (("llama", "ring"), ("mistral", "ulysses")):
        res = []
        for compile in (False, True):
            dynamo.reset()
            cfg = ndp.ParallelismConfig(cp_size=world, cp_impl=impl)
            model = ndp.hf.parallelize(_zoo.tiny_model(model_type).float().train(), cfg, cfg.build_device_mesh("cpu"),
                                       compile=compile)
            b = ndp.hf.shard_batch(model, input_ids=IDS, labels=labels)
            lab = b.pop("labels")
            loss = ndp.hf.loss(model(**b).logits, lab, model)
            loss.backward()
            res.append([loss.detach()] + _grads(model))
            if compile:  # every decoder layer compiled whole
                assert not dynamo.utils.counters["graph_break"], dict(dynamo.utils.counters["graph_break"])
                assert dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the layers share one graph
        _close(res[1], res[0])
        if impl == "ring":  # the whole batch, not this rank's shard: refused before the compiled layers
            with pytest.raises(ValueError, match=r"position_ids that are not rank \d's shard"):
                model(input_ids=IDS)


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_parallelize_compile_under_cp_equals_eager(tmp_path):
    spawn(_cp_body, 2, tmp_path, timeout_s=300)


def _packed_cp_body(rank, world):
    import transformers
    from transformers.models.stablelm import modeling_stablelm

    transformers.logging.set_verbosity_error()
    # documents that give every rank as many tokens (uneven shards would differ in shape across the ring: refused)
    even = (12, 16, 4)
    for compile in (False, True):
        dynamo.reset()
        assert _zoo.cp_packed("stablelm", "ring", world, compile=compile, lens=even)[0] == "EXACT", compile
    # a model that builds no mask through transformers' mask interface either: nothing carries the table
    dynamo.reset()
    with mock.patch.object(modeling_stablelm, "create_causal_mask", lambda **kwargs: None):
        got = _zoo.cp_packed("stablelm", "ring", world, compile=True, lens=even)
    assert got[0] == "REFUSED" and "StableLmForCausalLM ran a packed batch (3 documents)" in got[1], got


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_packed_documents_reach_compiled_layers_that_drop_the_table(tmp_path):
    """StableLM's decoder layers do not hand cu_seq_lens_q to their attention: ndp's mask marker carries the
    forward's document table there. Before, eager refused the packed batch at the position check, and compiled
    layers (which skip that check) attended across the shards' documents: the gradients up to 161% off, silently.
    Where no ndp mask reaches the layers either, the forward is refused on every rank, before the loss."""
    spawn(_packed_cp_body, 2, tmp_path, timeout_s=300)
