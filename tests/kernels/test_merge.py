"""Triton merge_attn_states_ (under TRITON_INTERPRET=1) against the reference merge."""
import pytest
import torch

from ndp_kernels import merge, reference
from ndp.testing import assert_close


def _states(shape_out, shape_lse, blk_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    out_acc = torch.randn(shape_out, generator=g)
    lse_acc = torch.randn(shape_lse, generator=g) * 3
    blk = torch.randn(shape_out, generator=g).to(blk_dtype)
    blk_lse = torch.randn(shape_lse, generator=g) * 3
    # -inf patterns: accumulator empty, block empty, both empty.
    flat_a, flat_b = lse_acc.view(-1), blk_lse.view(-1)
    flat_a[0:3] = float("-inf")
    flat_b[2:5] = float("-inf")
    return out_acc, lse_acc, blk, blk_lse


@pytest.mark.parametrize("blk_dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("layout", ["dense", "packed"])
def test_merge_matches_reference(blk_dtype, layout):
    if layout == "dense":
        shape_out, shape_lse = (2, 70, 3, 80), (2, 3, 70)
    else:
        shape_out, shape_lse = (70, 3, 64), (3, 70)
    out_acc, lse_acc, blk, blk_lse = _states(shape_out, shape_lse, blk_dtype, seed=0)
    ref_out, ref_lse = out_acc.clone(), lse_acc.clone()
    reference.merge_attn_states_ref(ref_out, ref_lse, blk, blk_lse)
    ret = merge.merge_attn_states_(out_acc, lse_acc, blk, blk_lse)
    assert ret[0] is out_acc and ret[1] is lse_acc
    assert not torch.isnan(out_acc).any() and not torch.isnan(lse_acc).any()
    assert torch.equal(torch.isneginf(lse_acc), torch.isneginf(ref_lse))
    assert_close(out_acc, ref_out, torch.float32)
    fin = torch.isfinite(ref_lse)
    assert_close(lse_acc[fin], ref_lse[fin], torch.float32)


def test_merge_both_empty_rows_unchanged():
    out_acc = torch.full((1, 4, 2, 16), 3.0)
    lse_acc = torch.full((1, 2, 4), float("-inf"))
    merge.merge_attn_states_(out_acc, lse_acc, torch.ones(1, 4, 2, 16), torch.full((1, 2, 4), float("-inf")))
    assert torch.all(out_acc == 3.0) and torch.isneginf(lse_acc).all()


def test_merge_non_contiguous_views():
    # Accumulator slices (a ring step updating half of the rows) are merged in place through strides.
    out_acc, lse_acc, blk, blk_lse = _states((2, 40, 2, 64), (2, 2, 40), torch.float32, seed=1)
    ref_out, ref_lse = out_acc.clone(), lse_acc.clone()
    reference.merge_attn_states_ref(ref_out[:, 20:], ref_lse[:, :, 20:], blk[:, 20:], blk_lse[:, :, 20:])
    merge.merge_attn_states_(out_acc[:, 20:], lse_acc[:, :, 20:], blk[:, 20:], blk_lse[:, :, 20:])
    assert_close(out_acc, ref_out, torch.float32)
    assert torch.equal(torch.isneginf(lse_acc), torch.isneginf(ref_lse))


def test_merge_errors():
    out_acc, lse_acc, blk, blk_lse = _states((1, 8, 2, 16), (1, 2, 8), torch.float32, seed=2)
    with pytest.raises(TypeError, match="out_acc and lse_acc must be float32"):
        merge.merge_attn_states_(out_acc.half(), lse_acc, blk, blk_lse)
    with pytest.raises(ValueError, match="block_out must have out_acc's shape"):
        merge.merge_attn_states_(out_acc, lse_acc, blk[:, :4], blk_lse)
    with pytest.raises(ValueError, match="block_lse must have lse_acc's shape"):
        merge.merge_attn_states_(out_acc, lse_acc, blk, blk_lse[:, :1])


@pytest.mark.cpu_only
def test_merge_falls_back_to_reference_without_interpreter(monkeypatch):
    # Plain CPU without TRITON_INTERPRET: the reference merge runs instead of the kernel.
    monkeypatch.setattr(merge, "interpreter_active", lambda: False)
    out_acc, lse_acc, blk, blk_lse = _states((1, 10, 2, 32), (1, 2, 10), torch.float16, seed=3)
    ref_out, ref_lse = out_acc.clone(), lse_acc.clone()
    reference.merge_attn_states_ref(ref_out, ref_lse, blk, blk_lse)
    merge.merge_attn_states_(out_acc, lse_acc, blk, blk_lse)
    assert torch.equal(out_acc, ref_out) and torch.equal(lse_acc, ref_lse)
