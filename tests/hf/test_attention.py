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


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_right_padding_matches_sdpa_at_every_position(name):
    """A right-padded batch (DataCollatorWithPadding's): every token, pads included, and every gradient equal
    transformers' own attention with the same mask (a pad sees its row's real tokens, no token sees a pad); the
    real tokens equal the row without its pads."""
    ref, model = _pair(name)
    ids = _ids(3, 16)
    mask = (torch.arange(16)[None, :] < torch.tensor([16, 11, 5])[:, None]).long()
    want, got = ref(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits
    assert_close(got, want, torch.float32, "out", msg=name)
    (want * torch.linspace(-1, 1, want.shape[-1])).sum().backward()  # the pads' logits count too
    (got * torch.linspace(-1, 1, got.shape[-1])).sum().backward()
    for (n, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        assert_close(q.grad, p.grad, torch.float32, "grad", msg=f"{name} {n}")
    with torch.no_grad():
        assert_close(got[2:, :5], model(ids[2:, :5]).logits, torch.float32, "out")
        assert (got[2:, 5:] - model(ids[2:]).logits[:, 5:]).abs().max() > 1e-3  # the pads saw no pad
        # with a mask transformers reads no packing from position_ids (they place RoPE only); nor does ndp
        pos = torch.cat([torch.arange(6), torch.arange(10)]).expand(3, 16)
        for m in (mask, torch.ones_like(mask)):  # an all-ones mask too: then tokens see across the restart
            assert_close(model(ids, attention_mask=m, position_ids=pos).logits,
                         ref(ids, attention_mask=m, position_ids=pos).logits, torch.float32, "out")


def test_padding_ndp_cannot_apply_is_refused_by_name():
    _, model = _pair("tiny-llama")
    ids = _ids(2, 16)
    mask = torch.ones(2, 16, dtype=torch.long)
    model(ids, attention_mask=mask)  # an all-ones mask is no mask
    gap, empty = mask.clone(), mask.clone()
    gap[0, 5:7] = 0
    empty[1] = 0
    for m, why in ((gap, r"a gap \(pads between real tokens\) \(real tokens per row: \[14, 16\]\)"),
                   (empty, r"a row with no real token")):
        with pytest.raises(ndp.hf.Unsupported, match=r"applies padding before and after each row's real tokens; "
                           r"the attention_mask has " + why + r".*tokenizer.padding_side"):
            model(ids, attention_mask=m)


def _float_mask(keep):
    return torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)


def _doc_mask(lens_per_row):
    """[rows, 1, S, S] bool: causal inside each document of each row, nothing across documents."""
    masks = []
    for lens in lens_per_row:
        doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        masks.append((doc[:, None] == doc[None, :]).tril())
    return torch.stack(masks)[:, None]


@pytest.mark.parametrize("as_float", [False, True], ids=["bool", "float"])
def test_dense_masks_full_causal_and_packed_match_sdpa(as_float):
    """A 4-D mask reaches the attention as it is (a user's custom mask; BLT builds one): sdpa and eager apply the
    mask alone. All-keep is full attention (ndp applied its causal mask before: a silent difference), causal is
    causal, block-diagonal causal is packed documents (each row its own split), forward and backward."""
    ref, model = _pair("tiny-llama")
    ids = _ids(2, 16)
    full = torch.ones(2, 1, 16, 16, dtype=torch.bool)
    causal = full.tril()
    packed = _doc_mask([[5, 11], [3, 6, 7]])
    for name, keep in (("full", full), ("causal", causal), ("packed", packed)):
        mask = _float_mask(keep) if as_float else keep
        ref.zero_grad(), model.zero_grad()
        want, got = ref(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits
        assert_close(got, want, torch.float32, "out", msg=name)
        want.square().mean().backward()
        got.square().mean().backward()
        for (n, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
            assert_close(q.grad, p.grad, torch.float32, "grad", msg=f"{name} {n}")
    with torch.no_grad():  # the three masks differ: each case tests what it names
        plain = model(ids).logits
        assert (model(ids, attention_mask=full).logits - plain).abs().max() > 1e-3
        assert_close(model(ids, attention_mask=causal).logits, plain, torch.float32, "out")
        alone = model(ids[1:, 3:9]).logits  # row 1's second document, on its own
        assert_close(model(ids, attention_mask=packed).logits[1:, 3:9], alone, torch.float32, "out")


def test_dense_masks_ndp_cannot_apply_are_refused_by_name():
    _, model = _pair("tiny-llama")
    ids = _ids(2, 16)
    causal = torch.ones(2, 1, 16, 16, dtype=torch.bool).tril()
    window = causal & ~torch.ones(16, 16, dtype=torch.bool).tril(-4)
    bias = _float_mask(causal) + torch.where(causal, -0.5, 0.0)
    cases = [(window, r"is not full, causal, or causal within packed documents"),
             (causal.expand(2, 4, 16, 16), r"is not \[batch \(2\) or 1, 1, seq \(16\), seq\]"),
             (causal[..., :8], r"shape \(2, 1, 16, 8\)"),
             (bias, r"adds values other than 0 and -inf to the scores"),
             (causal.long(), r"is neither boolean .* nor floating point")]
    for mask, match in cases:
        with pytest.raises(ndp.hf.Unsupported, match=r"ndp attention got a dense attention mask .*" + match +
                           r".*position_ids restarting at 0"):
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
