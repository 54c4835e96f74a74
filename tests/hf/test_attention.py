"""ndp attention inside transformers models (one process): same logits and gradients as transformers' sdpa,
sliding windows honoured, packed documents kept apart, masks it cannot honour refused."""
import copy

import pytest
import torch
from transformers import AttentionInterface

import ndp.hf
from ndp.parallel import ParallelismConfig
from ndp.train.presets import build_model
from ndp.testing import assert_close


def _pair(name):
    ref = build_model(name, seed=0)
    model = copy.deepcopy(ref)
    ndp.hf.parallelize(model, ParallelismConfig(), None)
    assert model.config._attn_implementation == "ndp_ring"
    return ref, model


def _ids(b=2, s=64, seed=1):
    return torch.randint(0, 256, (b, s), generator=torch.Generator().manual_seed(seed))


def test_registered_names():
    ndp.hf.register_attention()
    for name in ("ndp_ring", "ndp_allgather", "ndp_ulysses", "ndp_usp"):
        assert name in AttentionInterface._global_mapping


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-mistral"])
def test_matches_sdpa_forward_backward(name):
    ref, model = _pair(name)
    ids = _ids()
    lr, lm = ref(ids).logits, model(ids).logits
    assert_close(lm, lr, torch.float32, "out", msg=name)
    lr.square().mean().backward()
    lm.square().mean().backward()
    for (n, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        assert_close(q.grad, p.grad, torch.float32, "grad", msg=f"{name} {n}")


def test_sliding_window_is_honoured():
    ref, model = _pair("tiny-mistral")
    assert model.config.sliding_window == 32
    ids = _ids(1, 64)
    out = model(ids).logits
    assert_close(out, ref(ids).logits, torch.float32, "out")  # sdpa applies the window as a mask
    full = copy.deepcopy(model)
    full.config.sliding_window = None
    for layer in full.model.layers:
        if hasattr(layer.self_attn, "sliding_window"):
            layer.self_attn.sliding_window = None
    diff = (full(ids).logits - out).abs()
    assert diff[:, :32].max() < 1e-5 and diff[:, 32:].max() > 1e-4  # only rows past the window change


def test_packed_documents_match_separate_rows():
    _, model = _pair("tiny-llama")
    lens = [20, 7, 37]
    ids = _ids(1, sum(lens))
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    packed = model(ids, position_ids=pos).logits
    start = 0
    for n in lens:
        alone = model(ids[:, start:start + n]).logits
        assert_close(packed[:, start:start + n], alone, torch.float32, "out", msg=f"doc of {n}")
        start += n


def test_padding_mask_refused():
    _, model = _pair("tiny-llama")
    ids = _ids(2, 16)
    mask = torch.ones(2, 16, dtype=torch.long)
    model(ids, attention_mask=mask)  # an all-ones mask is fine
    mask[0, -3:] = 0
    with pytest.raises(ValueError, match="cannot honour an attention mask"):
        model(ids, attention_mask=mask)


def test_dropout_refused():
    _, model = _pair("tiny-llama")
    model.model.layers[0].self_attn.attention_dropout = 0.1
    model.train()
    with pytest.raises(ValueError, match="no attention dropout"):
        model(_ids(1, 16))


def test_heads_checked_before_anything():
    model = build_model("tiny-llama", seed=0)
    with pytest.raises(ValueError, match="divisible by tp_size"):
        ndp.hf.parallelize(model, ParallelismConfig(tp_size=4), None)


def test_uses_model_tp_plan():
    model = build_model("tiny-qwen2", seed=0)
    plan = ndp.hf.hf_plan(model)
    assert plan.tp_plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan.blocks == ("model.layers.*",)


def test_adapter_passes_views_not_copies(monkeypatch):
    import ndp.ops

    seen = {}
    real = ndp.ops.attention

    def spy(q, k, v, **kw):
        seen["q"], seen["k"] = q, k
        return real(q, k, v, **kw)

    monkeypatch.setattr(ndp.ops, "attention", spy)
    q = torch.randn(2, 4, 16, 16)  # HF layout [batch, heads, seq, dim]
    k = torch.randn(2, 2, 16, 16)
    module = torch.nn.Module()
    out, _ = ndp.hf.ndp_attention_forward(module, q, k, k.clone(), None, scaling=16 ** -0.5)
    assert seen["q"].data_ptr() == q.data_ptr() and seen["q"].shape == (2, 16, 4, 16)  # a transposed view
    assert seen["k"].data_ptr() == k.data_ptr() and seen["k"].shape == (2, 16, 2, 16)  # GQA not expanded
    assert out.shape == (2, 16, 4, 16)
