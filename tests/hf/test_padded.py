"""Padded rows (``ndp.hf.padded``): every token and gradient equal dense attention under ``causal & padding`` (& a
window or chunk), with zeros where a row sees no key (sdpa's and flash-attention's answer); then whole models with
left, right and two-sided padding, windows, chunks, sinks and soft-capping against their eager attention."""
import copy

import pytest
import torch
import torch.nn.functional as F

import ndp.hf
from ndp.hf.padded import padded_attention, padding_plan
from ndp.testing import assert_close, assert_within_lowp_bound

from _zoo import TOL, _rel, tiny_model

SEQ = 24


def _runs_mask(runs, seq=SEQ):
    pos = torch.arange(seq)
    return torch.stack([(pos >= a) & (pos < a + n) for a, n in runs]).long()


def _dense(q, k, v, keep, scale, sinks=None, softcap=0.0):
    """Attention with a dense [B, Sq, Sk] keep mask in float64; a row that keeps no key gives zeros."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(q.shape[2] // k.shape[2], 2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~keep[:, None], float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks[None, :, None, None].expand(*s.shape[:3], 1)], -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)[..., :k.shape[1]]
    return torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(q.shape[2] // v.shape[2], 2))


def _keep(runs, causal, window, chunk, seq=SEQ):
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    rows = []
    for a, n in runs:
        keep = ((j >= a) & (j < a + n)).expand(seq, seq)
        if causal:
            keep = keep & (j <= i)
        if window is not None:
            keep = keep & (i - j < window) & (causal or (j - i < window))
        if chunk is not None:
            keep = keep & ((i - a).div(chunk, rounding_mode="floor") == (j - a).div(chunk, rounding_mode="floor"))
        rows.append(keep)
    return torch.stack(rows)


CASES = {  # runs of real tokens (start, length) per row; causal, window, chunk
    "right": ([(0, 24), (0, 3), (0, 13), (0, 1)], True, None, None),
    "left and both sides": ([(20, 4), (0, 24), (5, 11), (23, 1)], True, None, None),
    "window, pads past it": ([(0, 24), (0, 3), (4, 13), (2, 19)], True, 5, None),  # 3 pads: 1 stand-in query
    "window wider than the row": ([(0, 9), (7, 17), (0, 24)], True, 64, None),
    "chunk": ([(0, 24), (0, 3), (0, 13), (0, 7)], True, None, 6),
    "bidirectional": ([(0, 24), (0, 3), (0, 13)], False, None, None),
    "bidirectional window": ([(0, 24), (0, 3), (0, 13)], False, 4, None),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("extra", ["plain", "sinks", "softcap"])
def test_padded_rows_match_dense_attention(case, extra):
    runs, causal, window, chunk = CASES[case]
    g = torch.Generator().manual_seed(0)
    b, h, hkv, d = len(runs), 4, 2, 16
    q = torch.randn(b, SEQ, h, d, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, SEQ, hkv, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in "kv")
    kw = dict(sinks=torch.randn(h, generator=g, dtype=torch.float64, requires_grad=True)) if extra == "sinks" else (
        dict(softcap=0.5) if extra == "softcap" else {})
    starts, lengths = tuple(a for a, _ in runs), tuple(n for _, n in runs)
    plan = padding_plan(starts, lengths, (0, SEQ), (0, SEQ), causal, window, chunk, q.device)
    got = padded_attention(q, k, v, plan, softmax_scale=0.3, **kw)
    want = _dense(q, k, v, _keep(runs, causal, window, chunk), 0.3, **kw)
    assert_close(got, want, torch.float64, "out", msg=case)
    w = torch.randn(want.shape, generator=g, dtype=torch.float64)
    inputs = [q, k, v] + ([kw["sinks"]] if "sinks" in kw else [])
    for x, gx, wx in zip(inputs, torch.autograd.grad((got * w).sum(), inputs),
                         torch.autograd.grad((want * w).sum(), inputs)):
        assert_close(gx, wx, torch.float64, "grad", msg=case)


def test_plan_calls_few_and_no_per_token_work():
    # Mistral's window at its length reaches every pad: two calls, as without a window
    calls, take = padding_plan((0, 0, 0), (4096, 100, 3000), (0, 4096), (0, 4096), True, 4096, None, "cpu")
    assert len(calls) == 2 and not bool((take == sum(len(c[0]) for c in calls)).any())  # no zero row
    # pads past a window of 8: 7 (the window's reach), 4 and 2 of them see a key; the other 47 pads are the zero row
    calls, take = padding_plan((0, 0, 0, 0), (64, 10, 60, 62), (0, 64), (0, 64), True, 8, None, "cpu")
    assert [len(c[0]) for c in calls] == [64 + 10 + 60 + 62, 7, 4, 2] and int((take == 196 + 13).sum()) == 47
    # one call per power of two of pads that see a key, not one per row
    # (28, 31, 33, 37, 63, 63 pads see a key: 32, 32, then 63 queries, the window's reach)
    calls, _ = padding_plan((0,) * 6, (100, 97, 95, 91, 60, 2), (0, 128), (0, 128), True, 64, None, "cpu")
    assert [len(c[0]) for c in calls] == [445, 32 + 32, 63 * 4]


def _keyed(runs, seq, reach):
    """[B, seq] bool: the tokens compared: real tokens and the pads after the run within `reach` (a window's
    ``w - 1``, the rest of the last token's chunk); every token when `reach` is None."""
    pos = torch.arange(seq)
    if reach is None:
        return torch.ones(len(runs), seq, dtype=torch.bool)
    return torch.stack([(pos >= a) & (pos < a + n + reach(a, n)) for a, n in runs])


# family: (reference attention, runs, pad reach); tiny configs have sliding_window = attention_chunk_size = 8.
# sdpa gives zeros where a row sees no key, as ndp does: every token is compared. Eager fills such a row with the
# mean of the values (NaN in float64, which the next layer's values carry into every token): with an eager
# reference every pad is within reach and only the tokens that see a key are compared.
MODELS = {
    "mistral": ("sdpa", [(6, 26), (0, 5), (3, 11), (0, 32)], None),  # left, right, both sides; a window
    "qwen2": ("sdpa", [(6, 26), (0, 5), (3, 11), (0, 32)], None),
    "gpt_oss": ("eager", [(0, 32), (0, 5), (0, 20), (0, 29)], lambda a, n: 7),  # sinks; a window every other layer
    "gemma2": ("eager", [(0, 32), (0, 25), (0, 30), (0, 27)], lambda a, n: 7),  # soft-capping and a window
    "llama4_text": ("eager", [(0, 32), (0, 25), (0, 20), (0, 29)], lambda a, n: -n % 8),  # chunks of 8
    # chunks counted from each row's first real token
    "llama4_text left": ("sdpa", [(6, 26), (0, 5), (3, 11), (0, 32)], None),
}


@pytest.mark.parametrize("family", sorted(MODELS))
def test_padded_models_match_their_attention(family):
    """float64, vs the model's sdpa or eager attention: the logits and every gradient of a loss over them."""
    impl, runs, reach = MODELS[family]
    family = family.split()[0]
    ref = tiny_model(family).train()
    ref.set_attn_implementation(impl)
    model = tiny_model(family).train()
    ndp.hf.register_attention()
    model.set_attn_implementation("ndp_ring")
    ids = torch.randint(3, 128, (len(runs), 32), generator=torch.Generator().manual_seed(1))
    mask, keyed = _runs_mask(runs, 32), _keyed(runs, 32, reach)
    want, got = ref(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits
    assert _rel(got[keyed], want[keyed]) <= TOL, family
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(2), dtype=want.dtype)
    (want * w)[keyed].sum().backward()
    (got * w)[keyed].sum().backward()
    for (name, p), (_, pg) in zip(ref.named_parameters(), model.named_parameters()):
        assert (p.grad is None) == (pg.grad is None), name
        if p.grad is not None:
            assert _rel(pg.grad, p.grad) <= TOL, f"{family} {name}"


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3_text", "gpt_oss"])
def test_left_padded_generation_matches_the_models_attention(family):
    """Batched greedy generation from left-padded prompts (what TRL's online trainers do with the model they
    train): the prefill's padding, then every decoding step's queries over the KV cache (a sliding window's cache
    drops old keys: windows of 8, 32 positions), equal sdpa's (eager's for gpt-oss, whose sinks sdpa lacks)."""
    ref, model = tiny_model(family), tiny_model(family)
    if family != "gpt_oss":  # eager turns a row with no key into NaN in float64
        ref.set_attn_implementation("sdpa")
    ndp.hf.register_attention()
    model.set_attn_implementation("ndp_ring")
    ids = torch.randint(3, 128, (3, 12), generator=torch.Generator().manual_seed(1))
    mask = _runs_mask([(0, 12), (5, 7), (11, 1)], 12)
    kw = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, output_logits=True,
              return_dict_in_generate=True, pad_token_id=0, use_cache=True)  # the tiny configs turn it off
    want, got = ref.generate(ids, **kw), model.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert max(_rel(g, w) for g, w in zip(got.logits, want.logits)) <= TOL


@pytest.mark.parametrize("family", ["llama", "mistral", "llama4_text"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_cached_generation_matches_sdpa(family, cache, padded):
    """Greedy generation over a KV cache, tokens and logits equal sdpa's. A static cache (compiled generation's)
    hands the attention all its slots, the later ones not written yet, and Llama 4's chunked layers let a query see
    its own chunk only: ndp attended every slot and every chunk (another token from the third step on, tiny-llama
    and tiny-llama4); now the causal mask's and the chunks' answer. Prompts of 6, windows and chunks of 8: the
    caches fill and the chunks turn during generation."""
    ref, model = tiny_model(family), tiny_model(family)
    ref.set_attn_implementation("sdpa")
    ndp.hf.register_attention()
    model.set_attn_implementation("ndp_ring")
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = _runs_mask([(0, 6), (2, 4) if padded else (0, 6)], 6)
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, output_logits=True,
              return_dict_in_generate=True, pad_token_id=0, use_cache=True, cache_implementation=cache)
    want, got = ref.generate(ids, **kw), model.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert max(_rel(g, w) for g, w in zip(got.logits, want.logits)) <= TOL


GPU = "cuda"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["mistral", "gemma3_text"])
def test_padded_batches_and_generation_on_the_gpu(family):
    """On the GPU's engines: a padded batch (left, right, both sides; windows of 8) in bf16 within the low-precision
    bound of sdpa in bf16 against float64, and left-padded float32 generation over the KV cache against float64."""
    ref = tiny_model(family)
    ref.set_attn_implementation("sdpa")
    ids = torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    mask = _runs_mask([(6, 26), (0, 5), (3, 11), (0, 32)], 32)
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        lowp = copy.deepcopy(ref).to(GPU, torch.bfloat16)
        model = copy.deepcopy(lowp)
        ndp.hf.register_attention()
        model.set_attn_implementation("ndp_ring")
        on = dict(input_ids=ids.to(GPU), attention_mask=mask.to(GPU))
        assert_within_lowp_bound(model(**on).logits.cpu(), want, lowp(**on).logits.cpu(), torch.bfloat16)
    # generation in float32 over the KV cache; each step's logits against float64 sdpa on the same tokens
    prompt = _runs_mask([(0, 12), (5, 7), (11, 1), (2, 10)], 12)
    model = copy.deepcopy(ref).to(GPU, torch.float32)
    model.set_attn_implementation("ndp_ring")
    out = model.generate(ids[:, :12].to(GPU), attention_mask=prompt.to(GPU), max_new_tokens=20, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0, use_cache=True)
    steps = len(out.logits)
    with torch.no_grad():  # position 11 + t predicts token 12 + t
        want = ref(out.sequences.cpu(), attention_mask=F.pad(prompt, (0, steps), value=1)).logits[:, 11:-1]
    assert _rel(torch.stack(out.logits, 1).cpu().double(), want) <= 1e-4
