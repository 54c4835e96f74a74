"""ndp's HF attention reads the model's mask function and refuses what it cannot apply (never drops it)."""
from dataclasses import replace

import pytest
import torch
from torch.utils.checkpoint import detach_variable
from transformers import masking_utils as mu

from ndp.hf import Unsupported
from ndp.hf.attention import ndp_attention_forward
from ndp.hf.masks import MaskSpec, describe, marker, with_padding


def test_describe_reads_causal_window_chunk_and_packing():
    assert describe(mu.causal_mask_function) == MaskSpec(causal=True)
    assert describe(mu.sliding_window_causal_mask_function(7)) == MaskSpec(causal=True, window=7)
    assert describe(mu.chunked_causal_mask_function(16, torch.zeros(2, dtype=torch.long))) == \
        MaskSpec(causal=True, chunk=16)
    window, ids = mu.sliding_window_causal_mask_function(5), torch.zeros(1, 4, dtype=torch.long)
    if hasattr(mu, "packed_sequence_compatibility_function"):  # newer transformers remap positions per document
        packed = mu.packed_sequence_compatibility_function(window, ids, ids)
    else:  # transformers 5.17 (the GPU machines'): the packed piece and-ed to the mask, as its create_*_mask do
        packed = mu.and_masks(window, mu.packed_sequence_mask_function(ids))
    assert describe(packed) == MaskSpec(causal=True, window=5, packed=True)
    assert describe(mu.bidirectional_mask_function) == MaskSpec(causal=False)


def _masked_reference(mask_function, q, k, v, scale):
    """Attention under the dense mask `mask_function` gives (transformers' own mask, evaluated at every index)."""
    b, n = q.shape[0], q.shape[2]
    r, i, j = torch.arange(b)[:, None, None], torch.arange(n)[None, :, None], torch.arange(n)[None, None, :]
    keep = mask_function(r, torch.tensor(0), i, j).expand(b, n, n)
    s = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~keep[:, None], float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(1, 2)


@pytest.mark.parametrize("rows", ["alike", "unlike"])
@pytest.mark.parametrize("window", [None, 4])
def test_image_blocks_attended_as_transformers_masks_them(rows, window):
    # Gemma 3 / Gemma 4: causal OR bidirectional image blocks (block_sequence_ids >= 0 inside an image), a sliding
    # window and-ed after the or. Rows alike share one call; unlike rows (an image in one only) a call each.
    ids = torch.full((2, 16), -1)
    ids[:, 2:7] = 0
    ids[:, 9:14] = 1
    if rows == "unlike":
        ids[0] = -1
        ids[1, 14] = 2
    fn = mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(ids))
    if window:
        fn = mu.and_masks(fn, mu.sliding_window_overlay(window))
    spec = describe(fn)
    want_spans = ((2, 7), (9, 14)) + (() if rows == "alike" else ((14, 15),))
    assert spec.refused is None and spec.spans[1] == want_spans and spec.window == window
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 16, 16, generator=g, dtype=torch.float64) for _ in range(3))
    out, _ = ndp_attention_forward(_Attn(), q, k, v, marker(spec, "cpu"), scaling=0.5)
    torch.testing.assert_close(out, _masked_reference(fn, q, k, v, 0.5), rtol=1e-10, atol=1e-10)
    assert (out - _ref(q, k, v, 0.5, window).transpose(1, 2)).abs().max() > 0.1  # not the causal mask alone
    text = mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(torch.full((2, 8), -1)))
    assert describe(text) == MaskSpec(causal=True)  # text-only rows: the causal mask, no spans


def test_image_blocks_ndp_cannot_attend_exactly_are_refused():
    ids = torch.full((1, 12), -1)
    ids[0, 2:5] = 0
    windowed_inside = mu.or_masks(mu.sliding_window_causal_mask_function(4), mu.blockwise_overlay(ids))
    assert "or-ed to a sliding-window mask" in describe(windowed_inside).refused
    split = ids.clone()
    split[0, 8:10] = 0  # one group in two runs: a query of the first would see keys of the second
    assert "not one run" in describe(mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(split))).refused
    spec = describe(mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(ids)))
    q = torch.zeros(1, 2, 12, 16)
    for changed, match in ((dict(lengths=(10,), starts=(0,)), "in padded rows"),
                           (dict(q_offset=4, kv_offset=0), "behind a KV cache"),
                           (dict(packed=True), "packed documents"), (dict(chunk=4), "under chunked attention")):
        with pytest.raises(Unsupported, match=f"bidirectional image blocks .*{match}"):
            ndp_attention_forward(_Attn(), q, q, q, marker(replace(spec, **changed), "cpu"))
    # The refusal depends on the batch: the attention raises it (under CP on every rank of the group).
    with pytest.raises(Unsupported, match="bidirectional image blocks .*not one run"):
        spec = describe(mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(split)))
        ndp_attention_forward(_Attn(), q, q, q, marker(spec, "cpu"))


def test_describe_refuses_what_it_cannot_apply():
    with pytest.raises(Unsupported, match="or_mask"):
        describe(mu.or_masks(mu.causal_mask_function, mu.bidirectional_mask_function))
    with pytest.raises(Unsupported, match="lambda"):
        describe(mu.and_masks(mu.causal_mask_function, lambda b, h, q, kv: kv != 3))
    # chunks counted from each row's first real token: with_padding reads those from the mask (test_padded.py)
    assert describe(mu.chunked_causal_mask_function(16, torch.tensor([0, 2]))) == MaskSpec(causal=True, chunk=16)


def test_with_padding_reads_each_rows_run_of_real_tokens():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 0], [1, 1, 1, 1, 1]])
    spec = with_padding(MaskSpec(causal=True, window=3), mask)
    assert spec == MaskSpec(causal=True, window=3, lengths=(3, 2, 5), starts=(0, 2, 0))
    # a bidirectional mask lets a leading pad see the real tokens after it: ndp applies that nowhere
    assert "under a causal mask only" in with_padding(MaskSpec(causal=False), mask).refused
    assert with_padding(MaskSpec(causal=False), mask[[0, 2]]).refused is None


def test_marker_refuses_arithmetic_and_indexing():
    m = marker(MaskSpec(window=4), "cpu")
    assert bool(m.all()) and m.ndp_mask.window == 4
    with pytest.raises(Unsupported, match="outside the attention call"):
        m[:, :, :2]
    with pytest.raises(Unsupported, match="outside the attention call"):
        torch.zeros(2) + m


class _Attn(torch.nn.Module):
    is_causal = True


def _ref(q, k, v, scale, window=None):
    s = (q @ k.transpose(-1, -2)) * scale
    i = torch.arange(q.shape[2])
    ok = i[None, :] <= i[:, None]
    if window is not None:
        ok &= i[None, :] > i[:, None] - window
    return torch.softmax(s.masked_fill(~ok, float("-inf")), -1) @ v


@pytest.mark.parametrize("dv", [8, 16, 24])
def test_value_head_size_unlike_query(dv):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 4, 12, 16, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 4, 12, dv, generator=g, dtype=torch.float64)
    out, _ = ndp_attention_forward(_Attn(), q, k, v, None)
    torch.testing.assert_close(out, _ref(q, k, v, 16 ** -0.5).transpose(1, 2), rtol=1e-10, atol=1e-10)


def test_softcap_applied():
    # Gemma 2's attention passes softcap: scores c * tanh(s / c) before the mask.
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 12, 16, generator=g, dtype=torch.float64) * 3 for _ in range(3))
    out, _ = ndp_attention_forward(_Attn(), q, k, v, None, scaling=0.25, softcap=2.0)
    s = 2.0 * torch.tanh((q @ k.transpose(-1, -2)) * 0.25 / 2.0)
    i = torch.arange(12)
    want = torch.softmax(s.masked_fill(i[None, :] > i[:, None], float("-inf")), -1) @ v
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=1e-10, atol=1e-10)
    assert (out - _ref(q, k, v, 0.25).transpose(1, 2)).abs().max() > 0.1


def test_window_from_the_mask_wins():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 12, 16, generator=g, dtype=torch.float64) for _ in range(3))
    out, _ = ndp_attention_forward(_Attn(), q, k, v, marker(MaskSpec(window=3), "cpu"), scaling=0.25)
    torch.testing.assert_close(out, _ref(q, k, v, 0.25, window=3).transpose(1, 2), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kw,match", [(dict(sinks=torch.zeros(2)), "per-token attention sinks"),
                                      (dict(head_mask=torch.ones(2)), "a head mask"),
                                      (dict(position_bias=torch.zeros(1)), "position_bias")])
def test_attention_arguments_are_refused_not_dropped(kw, match):
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(Unsupported, match=match):
        ndp_attention_forward(_Attn(), q, q, q, None, **kw)


def test_marker_survives_what_frameworks_do_to_inputs():
    m = marker(MaskSpec(window=4), "cpu")
    assert not m.is_floating_point()
    # reentrant checkpointing detaches a positional argument and sets its requires_grad (Zamba2's mask)
    for moved in (m.to("cpu"), m.detach(), m.clone(), m.contiguous(), *detach_variable((m,))):
        assert moved.ndp_mask == MaskSpec(window=4)
    with pytest.raises(Unsupported, match="outside the attention call"):  # its values stay the marker's
        m.data = torch.zeros(1, 1, 1, 1, dtype=torch.bool)
