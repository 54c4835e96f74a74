"""Compiled ops (torch.ops.ndp.*, CPU kernels) against Python references written here, plus fake kernels,
torch.compile, autograd and the error messages of bad input."""

import pytest
import torch

import ndp.cp
import ndp_kernels
from ndp import _ops
from ndp.ops import _pieces
from ndp.testing import assert_close

LAYOUTS = ("contiguous", "zigzag", "striped")
WORLD_SIZES = (1, 2, 4)


@pytest.fixture(autouse=True)
def _need_extension():
    if _ops.load_error is not None:
        pytest.fail(f"compiled ops not loaded: {_ops.load_error}")


ops = torch.ops.ndp


# ------------------------------------------------------------------------------------------------------------
# Python references


def ref_shard_index(seqlen, world_size, rank, layout):
    n = world_size
    if layout == "contiguous":
        step = seqlen // n
        return list(range(rank * step, (rank + 1) * step))
    if layout == "zigzag":
        c = seqlen // (2 * n)
        return list(range(rank * c, (rank + 1) * c)) + list(range((2 * n - 1 - rank) * c, (2 * n - rank) * c))
    return list(range(rank, seqlen, n))


def ref_merge(out_acc, lse_acc, block_out, block_lse):
    """float64 merge by the formula of docs/design.md, "Ring step", with both -inf -> unchanged."""
    o, l = out_acc.double(), lse_acc.double()
    b, bl = block_out.double(), block_lse.double()
    new = torch.logaddexp(l, bl)
    both_empty = torch.isneginf(l) & torch.isneginf(bl)
    safe = torch.where(both_empty, torch.zeros_like(new), new)
    wa = torch.where(both_empty, torch.ones_like(l), torch.exp(l - safe))
    wb = torch.where(both_empty, torch.zeros_like(l), torch.exp(bl - safe))
    if o.dim() == 4:  # lse [B, H, S] -> [B, S, H, 1]
        wa, wb = wa.transpose(1, 2).unsqueeze(-1), wb.transpose(1, 2).unsqueeze(-1)
    else:  # lse [H, T] -> [T, H, 1]
        wa, wb = wa.t().unsqueeze(-1), wb.t().unsqueeze(-1)
    return o * wa + b * wb, torch.where(both_empty, l, new)


def ref_plan(lengths, world_size, min_piece):
    """Python re-implementation of the planner described in docs/design.md."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    pieces, work, whole = [], [0] * world_size, []
    k = 2 * world_size
    for d, n in enumerate(lengths):
        if n == 0:
            continue
        if n >= k * min_piece:
            for i in range(k):
                s, e = i * n // k, (i + 1) * n // k
                r = i if i < world_size else k - 1 - i
                pieces.append((d, starts[d] + s, e - s, r))
                work[r] += (e - s) * s + (e - s) * (e - s + 1) // 2
        else:
            whole.append(d)
    for d in sorted(whole, key=lambda d: -lengths[d]):  # stable: lower doc first on ties
        r = min(range(world_size), key=lambda r: (work[r], r))
        pieces.append((d, starts[d], lengths[d], r))
        work[r] += lengths[d] * (lengths[d] + 1) // 2
    return sorted(pieces, key=lambda p: p[1])


def causal_work_per_rank(plan, cu, world_size):
    work = [0] * world_size
    for doc, start, length, rank in plan.tolist():
        off = start - cu[doc]
        work[rank] += length * off + length * (length + 1) // 2
    return work


def _seqlens(layout, world_size):
    """Odd lengths where the layout allows them (only world_size 1 for contiguous/striped), else odd multiples."""
    mult = 2 * world_size if layout == "zigzag" else world_size
    return sorted({mult, mult * 25, 97 if mult == 1 else mult * 49})


# ------------------------------------------------------------------------------------------------------------
# shard_index / shard_gather / unshard


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_shard_index_matches_reference_and_partitions(layout, world_size):
    for seqlen in _seqlens(layout, world_size):
        seen = []
        for rank in range(world_size):
            idx = ops.shard_index(seqlen, world_size, rank, layout)
            assert idx.dtype == torch.int64 and idx.shape == (seqlen // world_size,)
            assert idx.tolist() == ref_shard_index(seqlen, world_size, rank, layout), (seqlen, rank)
            seen += idx.tolist()
        assert sorted(seen) == list(range(seqlen))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_shard_gather_and_unshard_roundtrip(layout, world_size, dtype):
    seqlen = 2 * world_size * 13
    x = torch.arange(2 * seqlen * 3 * 5).reshape(2, seqlen, 3, 5).to(dtype)
    for dim in (1, -3):
        shards = []
        for rank in range(world_size):
            local = ops.shard_gather(x, dim, world_size, rank, layout)
            ref = x[:, ref_shard_index(seqlen, world_size, rank, layout)]
            assert local.dtype == dtype and torch.equal(local, ref)
            shards.append(local)
        assert torch.equal(ops.unshard(torch.stack(shards), dim, world_size, layout), x)
    # sequence in the first and in the last dim, non-contiguous input
    y = x.permute(1, 0, 2, 3).reshape(seqlen, -1)
    shards = [ops.shard_gather(y.t(), -1, world_size, r, layout) for r in range(world_size)]
    assert torch.equal(shards[-1], y.t()[:, ref_shard_index(seqlen, world_size, world_size - 1, layout)])
    assert torch.equal(ops.unshard(torch.stack(shards), 1, world_size, layout), y.t())
    shards = [ops.shard_gather(y, 0, world_size, r, layout) for r in range(world_size)]
    assert torch.equal(ops.unshard(torch.stack(shards), 0, world_size, layout), y)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shard_gather_and_unshard_autograd(layout):
    x = torch.randn(2, 8, 3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t: ops.shard_gather(t, 1, 2, 1, layout), (x,))
    chunks = torch.randn(2, 2, 4, 3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t: ops.unshard(t, 1, 2, layout), (chunks,))


# ------------------------------------------------------------------------------------------------------------
# merge_attn_states_


def _merge_inputs(shape, dtype, packed=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, s, h, d = shape
    out_shape, lse_shape = ((s, h, d), (h, s)) if packed else ((b, s, h, d), (b, h, s))
    out_acc = torch.randn(out_shape, generator=g)
    block = torch.randn(out_shape, generator=g).to(dtype)
    lse_acc = torch.randn(lse_shape, generator=g) * 3
    block_lse = torch.randn(lse_shape, generator=g) * 3
    # rows where only the accumulator, only the block, or neither saw a key
    flat_a, flat_b = lse_acc.view(-1), block_lse.view(-1)
    flat_a[0::5] = float("-inf")
    flat_b[1::5] = float("-inf")
    flat_a[2::7] = float("-inf")
    flat_b[2::7] = float("-inf")
    # both -inf and the accumulator row still zero, as a fresh accumulator is
    return out_acc, lse_acc, block, block_lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "packed"])
def test_merge_matches_float64_formula(dtype, packed):
    out_acc, lse_acc, block, block_lse = _merge_inputs((2, 37, 3, 20), dtype, packed)
    want_out, want_lse = ref_merge(out_acc, lse_acc, block, block_lse)
    ops.merge_attn_states_(out_acc, lse_acc, block, block_lse)
    assert not out_acc.isnan().any() and not lse_acc.isnan().any()
    # fp32 arithmetic on exactly representable inputs: fp32 tolerance whatever block_out's dtype
    assert_close(out_acc, want_out, torch.float32)
    assert_close(lse_acc, want_lse, torch.float32)
    assert torch.equal(torch.isneginf(lse_acc), torch.isneginf(want_lse))


def test_merge_both_empty_rows_unchanged_and_never_nan():
    out_acc = torch.full((1, 4, 2, 8), float("nan"))
    out_acc[:, 2:] = 0.5
    lse_acc = torch.full((1, 2, 4), float("-inf"))
    block = torch.randn(1, 4, 2, 8)
    block[:, 2:] = float("nan")  # garbage in a block row that carries no probability mass
    block_lse = torch.zeros(1, 2, 4)
    block_lse[..., 2:] = float("-inf")
    ops.merge_attn_states_(out_acc, lse_acc, block, block_lse)
    # rows 0,1: empty accumulator (even holding NaN) takes the block as is
    assert torch.equal(out_acc[:, :2], block[:, :2]) and torch.equal(lse_acc[..., :2], torch.zeros(1, 2, 2))
    # rows 2,3: both empty -> accumulator unchanged, lse stays -inf
    assert torch.equal(out_acc[:, 2:], torch.full((1, 2, 2, 8), 0.5))
    assert torch.isneginf(lse_acc[..., 2:]).all()


def test_merge_strided_in_place_and_repeated_blocks():
    """Accumulators given as non-contiguous views are updated in place; merging block by block equals a
    softmax over the concatenated blocks."""
    torch.manual_seed(0)
    b, s, h, d, nblk = 2, 5, 3, 16, 4
    store_out = torch.zeros(b, h, s, d)
    out_acc = store_out.transpose(1, 2)  # [B, S, H, D] view, last dim stride 1
    store_lse = torch.full((b, s, h), float("-inf"))
    lse_acc = store_lse.transpose(1, 2)  # [B, H, S] view
    scores = torch.randn(nblk, b, h, s, 7, dtype=torch.float64)
    values = torch.randn(nblk, b, h, 7, d, dtype=torch.float64)
    for i in range(nblk):
        lse_i = torch.logsumexp(scores[i], -1)
        out_i = torch.softmax(scores[i], -1) @ values[i]  # [B, H, S, D]
        ops.merge_attn_states_(out_acc, lse_acc, out_i.transpose(1, 2).float(), lse_i.float())
    all_scores = torch.cat(list(scores), -1)
    all_values = torch.cat(list(values), -2)
    want = (torch.softmax(all_scores, -1) @ all_values).transpose(1, 2)
    assert_close(store_out.transpose(1, 2), want, torch.float32)
    assert_close(store_lse.transpose(1, 2), torch.logsumexp(all_scores, -1), torch.float32)


# ------------------------------------------------------------------------------------------------------------
# packed_shard_plan


def _check_plan(plan, lengths, world_size, min_piece):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    rows = plan.tolist()
    assert plan.dtype == torch.int64 and plan.dim() == 2 and plan.shape[1] == 4
    # every token of every document in exactly one piece, pieces in global order, inside their document
    assert [r[1] for r in rows] == sorted(r[1] for r in rows)
    covered = []
    for doc, start, length, rank in rows:
        assert length > 0 and 0 <= rank < world_size
        assert cu[doc] <= start and start + length <= cu[doc + 1]
        covered += range(start, start + length)
    assert covered == list(range(cu[-1]))
    # long documents: 2N nearly equal pieces, piece i and 2N-1-i on rank i (zigzag per document)
    for doc, n in enumerate(lengths):
        mine = [r for r in rows if r[0] == doc]
        if n >= 2 * world_size * min_piece:
            assert len(mine) == 2 * world_size
            assert max(r[2] for r in mine) - min(r[2] for r in mine) <= 1
            k = 2 * world_size
            assert [r[3] for r in mine] == [i if i < world_size else k - 1 - i for i in range(k)]
        elif n > 0:
            assert len(mine) == 1
    return cu


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_packed_plan_small_cases(world_size, dtype):
    for lengths, min_piece in [([1, 17, 64, 300], 4), ([0, 5, 0, 33, 2], 2), ([97], 1), ([3, 3, 3, 3, 3], 8)]:
        cu = torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(len(lengths))], dtype=dtype)
        plan = ops.packed_shard_plan(cu, world_size, min_piece)
        _check_plan(plan, lengths, world_size, min_piece)
        assert [tuple(r) for r in plan.tolist()] == ref_plan(lengths, world_size, min_piece)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_plan_lognormal_balance(seed):
    world_size, min_piece = 4, 32
    g = torch.Generator().manual_seed(seed)
    lengths = torch.empty(64).log_normal_(mean=5.5, std=1.0, generator=g).long().clamp_(1, 8192).tolist()
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    plan = ops.packed_shard_plan(cu, world_size, min_piece)
    cu_list = _check_plan(plan, lengths, world_size, min_piece)
    assert [tuple(r) for r in plan.tolist()] == ref_plan(lengths, world_size, min_piece)
    n_whole = sum(1 for n in lengths if n < 2 * world_size * min_piece)
    assert n_whole >= 16, "the set must exercise the greedy part of the planner"
    work = causal_work_per_rank(plan, cu_list, world_size)
    ratio = max(work) / (sum(work) / world_size)
    assert ratio <= 1.05, f"causal work per rank {work}: max/mean = {ratio:.4f}"


# ------------------------------------------------------------------------------------------------------------
# fake kernels, torch.compile


def _opcheck_samples():
    out_acc, lse_acc, block, block_lse = _merge_inputs((1, 6, 2, 8), torch.bfloat16)
    x = torch.randn(2, 8, 3)
    return [
        (ops.merge_attn_states_, (out_acc, lse_acc, block, block_lse)),
        (ops.shard_gather, (x, 1, 2, 1, "zigzag")),
        (ops.shard_gather, (x.requires_grad_(), -2, 4, 3, "striped")),
        (ops.unshard, (torch.randn(2, 2, 4, 3), 1, 2, "zigzag")),
        (ops.shard_index, (12, 3, 2, "contiguous")),
        (ops.packed_shard_plan, (torch.tensor([0, 3, 50, 51, 300], dtype=torch.int32), 2, 4)),
    ]


@pytest.mark.parametrize("case", range(6))
def test_opcheck(case):
    op, args = _opcheck_samples()[case]
    torch.library.opcheck(op, args)


def test_fake_kernels_give_right_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv()):
        x = torch.empty(2, 16, 3, 4)
        assert ops.shard_gather(x, 1, 4, 0, "zigzag").shape == (2, 4, 3, 4)
        assert ops.unshard(torch.empty(4, 2, 4, 3, 4), 1, 4, "zigzag").shape == (2, 16, 3, 4)
        assert ops.shard_index(12, 4, 1, "striped").shape == (3,)
        plan = ops.packed_shard_plan(torch.empty(5, dtype=torch.int32), 2, 8)
        assert plan.dtype == torch.int64 and plan.shape[1] == 4 and isinstance(plan.shape[0], torch.SymInt)
        ops.merge_attn_states_(torch.empty(2, 16, 3, 4), torch.empty(2, 3, 16), torch.empty(2, 16, 3, 4),
                               torch.empty(2, 3, 16))


def test_torch_compile_fullgraph():
    def step(out_acc, lse_acc, block, block_lse, x):
        ops.merge_attn_states_(out_acc, lse_acc, block, block_lse)
        local = ops.shard_gather(x, 1, 2, 0, "zigzag")
        return ops.unshard(torch.stack([local, ops.shard_gather(x, 1, 2, 1, "zigzag")]), 1, 2, "zigzag") * 2

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    a = _merge_inputs((1, 6, 2, 8), torch.float16)
    b = tuple(t.clone() for t in a)
    x = torch.randn(3, 8, 2)
    y_eager = step(*a, x)
    y_comp = compiled(*b, x)
    assert torch.equal(y_eager, y_comp) and torch.equal(y_eager, 2 * x)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # in-place updates survive functionalization

    # data-dependent number of pieces (unbacked size) inside a compiled graph
    plan_tokens = torch.compile(lambda cu: ops.packed_shard_plan(cu, 2, 4)[:, 2].sum(), backend="aot_eager",
                                fullgraph=True)
    assert plan_tokens(torch.tensor([0, 3, 50, 51, 300], dtype=torch.int32)).item() == 300


# ------------------------------------------------------------------------------------------------------------
# bad input: constraint, values and fix in the message


def test_errors_sharding():
    with pytest.raises(ValueError, match=r"zigzag sharding needs seqlen divisible by 2\*world_size; got "
                                         r"seqlen=98, world_size=2; pad the sequence to a multiple of 4 or use "
                                         r"layout='contiguous'"):
        ops.shard_index(98, 2, 0, "zigzag")
    with pytest.raises(ValueError, match=r"striped sharding needs seqlen divisible by world_size; got seqlen=97, "
                                         r"world_size=4; pad the sequence to a multiple of 4"):
        ops.shard_gather(torch.zeros(1, 97), 1, 4, 0, "striped")
    with pytest.raises(ValueError, match=r"unknown sharding layout 'ring'; expected one of 'contiguous', "
                                         r"'zigzag', 'striped'"):
        ops.shard_index(8, 2, 0, "ring")
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size\); got rank=2, world_size=2"):
        ops.shard_gather(torch.zeros(8), 0, 2, 2, "contiguous")
    with pytest.raises(ValueError, match=r"world_size must be >= 1, got world_size=0"):
        ops.shard_index(8, 0, 0, "contiguous")
    with pytest.raises(IndexError, match=r"dim=3 is out of range for x with 2 dims"):
        ops.shard_gather(torch.zeros(2, 8), 3, 2, 0, "contiguous")
    with pytest.raises(ValueError, match=r"chunks.size\(0\) must equal world_size .*got chunks.size\(0\)=3, "
                                         r"world_size=2"):
        ops.unshard(torch.zeros(3, 4, 2), 0, 2, "zigzag")
    with pytest.raises(ValueError, match=r"zigzag sharding needs seqlen divisible by 2\*world_size; got seqlen=6"):
        ops.unshard(torch.zeros(2, 3), 0, 2, "zigzag")


def test_errors_merge():
    out, lse = torch.zeros(1, 4, 2, 8), torch.zeros(1, 2, 4)
    with pytest.raises(TypeError, match=r"out_acc must be float32 .*got BFloat16; allocate it with "
                                        r"dtype=torch.float32"):
        ops.merge_attn_states_(out.bfloat16(), lse, out, lse)
    with pytest.raises(TypeError, match=r"block_out must be float32, float16 or bfloat16, got Double"):
        ops.merge_attn_states_(out, lse, out.double(), lse)
    with pytest.raises(TypeError, match=r"block_lse must be float32, got Half"):
        ops.merge_attn_states_(out, lse, out, lse.half())
    with pytest.raises(ValueError, match=r"lse_acc must have shape \[1, 2, 4\] \(\[batch, heads, seq\]\) for "
                                         r"out_acc of shape \[1, 4, 2, 8\], got \[1, 4, 2\]"):
        ops.merge_attn_states_(out, lse.transpose(1, 2).contiguous(), out, lse)
    with pytest.raises(ValueError, match=r"block_out shape \[1, 4, 2, 4\] must equal out_acc shape \[1, 4, 2, 8\]"):
        ops.merge_attn_states_(out, lse, out[..., :4], lse)
    with pytest.raises(ValueError, match=r"stride 1 in the last dim, got 1 and 2; call .contiguous\(\)"):
        ops.merge_attn_states_(out, lse, torch.zeros(1, 4, 2, 16)[..., ::2], lse)
    with pytest.raises(RuntimeError, match=r"more than one element of the written-to tensor refers to a single"):
        ops.merge_attn_states_(out, torch.zeros(1, 2, 1).expand(1, 2, 4), out, lse)
    with pytest.raises(ValueError, match=r"out_acc must be \[batch, seq, heads, head_dim\] or packed"):
        ops.merge_attn_states_(out[0, 0], lse[0], out[0, 0], lse[0])


def test_errors_packed_plan():
    with pytest.raises(ValueError, match=r"cu_seqlens must start at 0, got cu_seqlens\[0\]=3; prepend a 0"):
        ops.packed_shard_plan(torch.tensor([3, 5], dtype=torch.int32), 2, 4)
    with pytest.raises(ValueError, match=r"cu_seqlens must be non-decreasing; got cu_seqlens\[1\]=5 > "
                                         r"cu_seqlens\[2\]=4"):
        ops.packed_shard_plan(torch.tensor([0, 5, 4], dtype=torch.int32), 2, 4)
    with pytest.raises(TypeError, match=r"cu_seqlens must be int32 or int64, got Float"):
        ops.packed_shard_plan(torch.tensor([0.0, 5.0]), 2, 4)
    with pytest.raises(ValueError, match=r"cu_seqlens must be 1-D \[num_docs \+ 1\], got shape \[1, 2\]"):
        ops.packed_shard_plan(torch.tensor([[0, 5]]), 2, 4)
    with pytest.raises(ValueError, match=r"min_piece must be >= 1, got min_piece=0"):
        ops.packed_shard_plan(torch.tensor([0, 5]), 2, 0)


def test_info_reports_compiled_ops():
    from ndp import info

    report = info.collect()
    assert report["compiled_ops"]["loaded"]
    for op in _ops.OP_NAMES:
        assert report["compiled_ops"]["ops"][op]["CPU"], op
    if not _ops.WITH_CUDA:
        assert "not built" in report["compiled_ops"]["cuda_why"]
    text = info.format_report(report)
    assert "torch.ops.ndp" in text and torch.__version__ in text


# ------------------------------------------------------------------------------------------------------------
# CUDA kernels against the CPU ops (GPU machines only)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kernels_match_cpu():
    if not _ops.WITH_CUDA:
        pytest.skip("ndp._C was built without CUDA kernels (CPU torch or no nvcc at build time)")
    dev = "cuda"
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for packed in (False, True):
            a = _merge_inputs((2, 37, 3, 20), dtype, packed)
            b = [t.to(dev) for t in a]
            ops.merge_attn_states_(*a)
            ops.merge_attn_states_(*b)
            assert_close(b[0].cpu(), a[0], torch.float32)
            assert_close(b[1].cpu(), a[1], torch.float32)
    for dtype, inner in ((torch.float32, (3, 5)), (torch.bfloat16, (8,)), (torch.uint8, (3,)), (torch.int64, ())):
        for layout in LAYOUTS:
            for world_size in WORLD_SIZES:
                x = torch.randint(0, 100, (2, 4 * world_size * 3, *inner)).to(dtype)
                shards = [ops.shard_gather(x.to(dev), 1, world_size, r, layout) for r in range(world_size)]
                for r, s in enumerate(shards):
                    assert torch.equal(s.cpu(), ops.shard_gather(x, 1, world_size, r, layout))
                assert torch.equal(ops.unshard(torch.stack(shards), 1, world_size, layout).cpu(), x)
    cu = torch.tensor([0, 3, 50, 51, 300], dtype=torch.int32)
    plan = ops.packed_shard_plan(cu.to(dev), 2, 4)
    assert plan.device.type == "cuda" and torch.equal(plan.cpu(), ops.packed_shard_plan(cu, 2, 4))


def test_load_error_explains_missing_or_stale_extension(monkeypatch):
    monkeypatch.setattr(_ops.glob, "glob", lambda pattern: [])
    msg = _ops._explain(ImportError("No module named 'ndp._C'"))
    assert "ndp._C is not built" in msg and "pip install --no-build-isolation -e ." in msg
    monkeypatch.setattr(_ops.glob, "glob", lambda pattern: ["/x/ndp/_C.cpython-311-x86_64-linux-gnu.so"])
    msg = _ops._explain(ImportError("/x/ndp/_C.so: undefined symbol: _ZN3c104impl"))
    assert "built against another torch than the installed" in msg and "rebuild" in msg


@pytest.mark.parametrize("layout", ["zigzag", "contiguous", "striped"])
def test_ops_without_a_kernel_for_the_device_are_never_called(layout, monkeypatch):
    """A build without nvcc has CPU kernels only: CUDA tensors must take the Python path, not raise
    NotImplementedError mid-training. Stand-in: the ops report no kernel for this (CPU) device, and calling them
    fails; sharding, unsharding (with autograd) and the engines' piece merge still give the compiled ops' results."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 24, 3, generator=g, dtype=torch.float64, requires_grad=True)
    want = [ndp.cp.shard_sequence(x, dim=1, world_size=4, rank=r, layout=layout) for r in range(4)]
    full = _ops.unshard(torch.stack([w.detach() for w in want]), 1, 4, layout)
    oa, la = torch.randn(1, 6, 2, 8, generator=g), torch.randn(1, 2, 6, generator=g)
    blk_o, blk_l = torch.randn(1, 4, 2, 8, generator=g), torch.randn(1, 2, 4, generator=g)
    piece = _pieces.Piece("full", 1, 5, 0, 4)
    merged = [t.clone() for t in (oa, la)]
    _pieces._merge(*merged, piece, blk_o, blk_l)

    def no_kernel(*args, **kwargs):
        raise NotImplementedError("no kernel for this device's dispatch key")

    monkeypatch.setattr(_ops, "runs_on", lambda op, device: False)
    for op in ("shard_gather", "unshard", "merge_attn_states_"):
        monkeypatch.setattr(torch.ops.ndp, op, no_kernel)
    for r in range(4):
        got = ndp.cp.shard_sequence(x, dim=1, world_size=4, rank=r, layout=layout)
        assert torch.equal(got, want[r])
        gx, = torch.autograd.grad(got.sum(), x)
        gw, = torch.autograd.grad(want[r].sum(), x)
        assert torch.equal(gx, gw)
    assert torch.equal(_ops.unshard(torch.stack([w.detach() for w in want]), 1, 4, layout), full)
    assert torch.equal(full, x.detach())
    fallback = [t.clone() for t in (oa, la)]
    _pieces._merge(*fallback, piece, blk_o, blk_l)
    for a, b in zip(fallback, merged):
        assert_close(a, b, torch.float32)


def test_one_merge_entry_point_picks_the_implementation_by_device(monkeypatch):
    """The compiled op where it has a kernel for the device (fp32), the Triton kernel on a GPU whose build has no
    CUDA kernel, the reference elsewhere (fp64, CPU without the op); each merges to the reference's numbers."""
    for has in (True, False):
        monkeypatch.setattr(_ops, "runs_on", lambda op, device, has=has: has)
        want_cuda = torch.ops.ndp.merge_attn_states_ if has else ndp_kernels.merge_attn_states_
        assert _ops.merge_impl(torch.device("cuda", 0), torch.float32) is want_cuda
        assert _ops.merge_impl("cuda", torch.float64) is ndp_kernels.merge_attn_states_
        want_cpu = torch.ops.ndp.merge_attn_states_ if has else ndp_kernels.reference.merge_attn_states_ref
        assert _ops.merge_impl("cpu", torch.float32) is want_cpu
        assert _ops.merge_impl("cpu", torch.float64) is ndp_kernels.reference.merge_attn_states_ref
    monkeypatch.undo()
    g = torch.Generator().manual_seed(1)
    oa, la = torch.randn(2, 5, 3, 16, generator=g), torch.randn(2, 3, 5, generator=g)
    blk = torch.randn(2, 5, 3, 16, generator=g).to(torch.bfloat16)
    blk_lse = torch.randn(2, 3, 5, generator=g)
    la[0, 1, :2] = blk_lse[0, 1, :2] = float("-inf")   # rows no key reached on either side stay as they are
    want = [t.clone() for t in (oa, la)]
    ndp_kernels.reference.merge_attn_states_ref(*want, blk, blk_lse)
    for impl in (_ops.merge_attn_states_, ndp_kernels.merge_attn_states_):   # compiled op; Triton (interpreter)
        got = [t.clone() for t in (oa, la)]
        assert impl(*got, blk, blk_lse)[0] is got[0]
        for a, b in zip(got, want):
            assert_close(a, b, torch.float32)
