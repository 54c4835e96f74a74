"""GQA heads spread over programs in the backward kernels that own a key block (the atomic backward and the
split backward's dK/dV kernel): the rule that picks the number of parts, and the gradients with the heads of a
group split over 2..group_size programs against the reference (fp32, fp16; windows, causal, packed documents,
segments sharing key rows, fp32 accumulators), bitwise reproducible for deterministic=True."""
import pytest
import torch

from ndp_kernels import configs, flash, reference
from ndp_kernels.segments import NO_LIMIT, Segments
from _kernel_cases import DTYPES, qkv
from ndp.testing import assert_close

GPU = torch.device("cuda")  # only read by the rule through sm_count, which the tests replace


@pytest.mark.parametrize("programs,group,sms,want", [
    (2048, 4, 132, 1),    # a long-sequence training block fills an H100 as is
    (264, 4, 132, 1),     # exactly two programs per SM
    (32, 4, 132, 4),      # an MQA-like ring step: 32 programs; all 4 heads apart still leave SMs idle
    (100, 8, 132, 4),     # 4 parts reach 264 programs first
    (100, 6, 132, 3),     # parts divide the group: 3 (2 gives 200, short of 264)
    (70, 12, 132, 4),     # 3 parts give 210, 4 give 280
    (10, 1, 132, 1),      # MHA: nothing to split
    (10, 5, 0, 1),        # no GPU (interpreter): never split
])
def test_parts_rule(monkeypatch, programs, group, sms, want):
    monkeypatch.setattr(configs, "sm_count", lambda device: sms)
    for dtype in (torch.bfloat16, torch.float16):
        assert configs.head_splits(programs, group, GPU, dtype) == want
    assert group % want == 0
    # fp32: never split by the rule (its dK/dV kernel with split heads spills on sm_80, see the AOT report)
    assert configs.head_splits(programs, group, GPU, torch.float32) == 1


def test_forced_parts_are_the_largest_divisor_at_most_asked():
    with configs.override("head_splits", 4):
        assert [configs.head_splits(1, g, None, torch.float32) for g in (1, 2, 3, 4, 6, 8)] == [1, 2, 3, 4, 3, 4]
    with pytest.raises(ValueError, match="head_splits override must be an int >= 1"):
        with configs.override("head_splits", 0):
            pass


class _GridSpy:
    """Stands in for a @triton.jit kernel: records each launch grid, then launches the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.grids, self.calls = kernel, [], []

    def __getitem__(self, grid):
        self.grids.append(grid)

        def launch(*args, **kw):
            self.calls.append((args, kw))
            return self.kernel[grid](*args, **kw)
        return launch


@pytest.fixture
def spies(monkeypatch):
    out = {}
    for name in ("_flash_bwd_kernel", "_flash_bwd_dkdv_kernel"):
        out[name] = _GridSpy(getattr(flash, name))
        monkeypatch.setattr(flash, name, out[name])
    return out


def _run(dout, q, k, v, impl, parts, **kw):
    out, lse = reference.flash_attn_fwd_ref(q.float(), k.float(), v.float(), **kw)
    with configs.override("head_splits", parts), configs.override("bwd_impl", impl):
        return flash.flash_attn_bwd(dout, q, k, v, out.to(q.dtype), lse, deterministic=impl == "split", **kw)


@pytest.mark.parametrize("impl", ["atomic", "split"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("h,hk,parts,kw", [
    (8, 2, 2, dict(causal=True)),
    (8, 2, 4, dict(causal=True)),
    (6, 2, 3, dict(window_size=(20, 5))),
    (4, 1, 4, dict(causal=True, window_size=(32, -1))),
], ids=["gqa4-2parts-causal", "gqa4-4parts-causal", "gqa3-3parts-window", "mqa4-4parts-causal-window"])
def test_split_heads_match_the_reference(spies, impl, dtype, h, hk, parts, kw):
    q, k, v, dout = qkv(2, 97, 97, h, hk, 64, dtype, seed=3)
    grads = _run(dout, q, k, v, impl, parts, **kw)
    ref_out, ref_lse = reference.flash_attn_fwd_ref(q.float(), k.float(), v.float(), **kw)
    ref = reference.flash_attn_bwd_ref(dout.float(), q.float(), k.float(), v.float(),
                                       ref_out.to(dtype).float(), ref_lse, **kw)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        assert g.dtype == dtype
        assert_close(g, r, dtype, "grad", msg=name)
    kernel = spies["_flash_bwd_kernel" if impl == "atomic" else "_flash_bwd_dkdv_kernel"]
    assert [grid[2] for grid in kernel.grids] == [hk * parts]   # one program per (kv head, part)
    (args, kwargs), = kernel.calls
    if impl == "atomic":
        # programs of different parts add into the same dk/dv rows: only atomics are safe on a GPU (the
        # interpreter runs programs one after another, so a read-add-write would pass here)
        assert kwargs["ATOMIC_KV"]
    else:
        # each part adds into its own buffer (same reason): every part holds a share of dk and dv
        for buf in args[7:9]:
            assert buf.shape == (parts, *k.shape)
            assert all(buf[i].abs().sum() > 0 for i in range(parts))


@pytest.mark.parametrize("impl", ["atomic", "split"])
def test_split_heads_with_shared_key_rows_and_accumulators(spies, impl):
    # Segments sharing key rows (three dK/dV launches adding into the per-part buffers), rows in no segment,
    # and fp32 accumulators that already hold values.
    segs = Segments.from_rows([(0, 15, 0, 30, -NO_LIMIT, 15), (15, 25, 10, 40, -8, 15),
                               (40, 9, 45, 5, -NO_LIMIT, NO_LIMIT), (49, 20, 30, 20, -5, NO_LIMIT)])
    q, k, v, dout = qkv(2, 80, 60, 8, 2, 64, torch.float32, seed=5)
    scale = 0.125
    out, lse = reference.attn_fwd_segments_ref(q, k, v, segs, softmax_scale=scale)
    ref = reference.attn_bwd_segments_ref(dout, q, k, v, out, lse, segs, softmax_scale=scale)
    g = torch.Generator().manual_seed(9)
    init = [torch.randn(x.shape, generator=g) for x in (q, k, v)]
    accs = [x.clone() for x in init]
    with configs.override("head_splits", 4), configs.override("bwd_impl", impl):
        ret = flash.attn_bwd_segments(dout, q, k, v, out, lse, segs, softmax_scale=scale, dq_acc=accs[0],
                                      dk_acc=accs[1], dv_acc=accs[2], deterministic=impl == "split")
    assert all(r is a for r, a in zip(ret, accs))
    for name, acc, x0, r in zip(("dq", "dk", "dv"), accs, init, ref):
        assert_close(acc - x0, r, torch.float32, "grad", msg=name)
    assert torch.equal(accs[0][:, 69:], init[0][:, 69:])   # rows in no segment untouched
    grids = spies["_flash_bwd_kernel" if impl == "atomic" else "_flash_bwd_dkdv_kernel"].grids
    assert grids and all(grid[2] == 2 * 4 for grid in grids)
    if impl == "split":
        assert len(grids) == len(segs.key_groups()) == 3


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_split_heads_stay_bitwise_reproducible(dtype):
    cu = torch.tensor([0, 1, 18, 83, 120], dtype=torch.int32)
    q, k, v, dout = qkv(1, 120, 120, 6, 2, 64, dtype, seed=11, packed=True)
    kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=65, max_seqlen_k=65)
    runs = [_run(dout, q, k, v, "split", 3, **kw) for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    whole = _run(dout, q, k, v, "split", 1, **kw)   # one part: the same gradients up to fp32 rounding
    for a, b in zip(runs[0], whole):
        assert_close(a, b.float(), dtype, "grad")


@pytest.mark.parametrize("impl", ["atomic", "split"])
def test_split_heads_into_strided_accumulator_views(impl):
    # Ring-style: two key chunks of one causal attention added into slices of the same fp32 accumulators.
    sq, sk, bounds = 70, 150, [0, 50, 150]
    q, k, v, dout = qkv(1, sq, sk, 4, 1, 64, torch.float32, seed=8)
    out, lse = reference.flash_attn_fwd_ref(q, k, v, causal=True)
    ref = reference.flash_attn_bwd_ref(dout, q, k, v, out, lse, causal=True)
    accs = [torch.zeros(x.shape) for x in (q, k, v)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        segs = Segments.from_rows([(0, sq, 0, b - a, -NO_LIMIT, (sk - sq) - a)])
        with configs.override("head_splits", 2), configs.override("bwd_impl", impl):
            flash.attn_bwd_segments(dout, q, k[:, a:b], v[:, a:b], out, lse, segs, softmax_scale=64 ** -0.5,
                                    dq_acc=accs[0], dk_acc=accs[1][:, a:b], dv_acc=accs[2][:, a:b],
                                    deterministic=impl == "split")
    for name, acc, r in zip(("dq", "dk", "dv"), accs, ref):
        assert_close(acc, r, torch.float32, "grad", msg=name)
