"""Ring schedules as data: every step's segments reproduce the global mask exactly (no process group)."""
import itertools

import numpy as np
import pytest
import torch

from ndp.cp.schedule import LAYOUTS, Mask, Placement, RingSchedule, build_step
from ndp.cp.sharding import packed_shard, shard_packed, shard_sequence


def _dense_mask(qp, kp, cu, mask):
    lo, hi = mask.band()
    d = kp[None, :] - qp[:, None]
    dq, dk = np.searchsorted(cu, qp, "right"), np.searchsorted(cu, kp, "right")
    return (d >= lo) & (d <= hi) & (dq[:, None] == dk[None, :])


def _step_mask(step, nq, nk):
    m = np.zeros((nq, nk), bool)
    for p in step.passes:
        seen = np.zeros(nq, bool)
        for qs, ql, ks, kl, lo, hi in p:
            assert not seen[qs:qs + ql].any(), "query ranges of one pass must not overlap"
            seen[qs:qs + ql] = True
            d = np.arange(kl)[None, :] - np.arange(ql)[:, None]
            blk = (d >= lo) & (d <= hi)
            assert not (m[qs:qs + ql, ks:ks + kl] & blk).any(), "a pair computed twice"
            m[qs:qs + ql, ks:ks + kl] |= blk
    return m


def _check_schedule(pl, mask):
    sch = RingSchedule(pl, mask)
    for q, k in itertools.product(range(pl.world_size), repeat=2):
        st = sch.step(q, k)
        ref = _dense_mask(pl.positions[q], pl.positions[k], pl.cu_seqlens, mask)
        assert (_step_mask(st, len(pl.positions[q]), len(pl.positions[k])) == ref).all(), (q, k, st)
        assert st.pairs == ref.sum()
    return sch


MASKS = [Mask(True), Mask(False), Mask(True, (5, -1)), Mask(False, (3, 7)), Mask(False, (-1, 4)), Mask(True, (0, 0))]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_dense_schedule_matches_mask(layout, world):
    for seqlen, mask in itertools.product([24, 48], MASKS):
        _check_schedule(Placement.dense(seqlen, world, layout), mask)


def test_zigzag_blocks_are_the_three_kinds():
    # docs/design.md, "Ring step": diagonal (causal + second half vs both), first key half, second query half.
    sch = RingSchedule(Placement.dense(64, 4, "zigzag"), Mask(True))
    c, nl = 8, 1 << 30
    assert sch.step(1, 1).passes == (((0, c, 0, c, -nl, 0), (c, c, 0, 2 * c, -nl, c)),)
    assert sch.step(1, 0).passes == (((0, 2 * c, 0, c, -nl, nl),),)
    assert sch.step(1, 2).passes == (((c, c, 0, 2 * c, -nl, nl),),)
    striped = RingSchedule(Placement.dense(64, 4, "striped"), Mask(True))
    assert striped.step(1, 2).passes == (((0, 16, 0, 16, -nl, -1),),)  # shifted causal: band_hi = -1


@pytest.mark.parametrize("layout,ratio", [("zigzag", 1.0), ("striped", None), ("contiguous", None)])
def test_causal_balance(layout, ratio):
    for n in (2, 4, 8):
        p = RingSchedule(Placement.dense(64 * n, n, layout), Mask(True)).pairs_per_rank()
        r = max(p) / (sum(p) / n)
        if layout == "zigzag":
            assert r == 1.0
        elif layout == "striped":
            assert r < 1.0 + 2.0 / 64  # rank r sees r extra diagonal pairs per stripe: O(N / seqlen)
        else:
            assert r > 1.3


def test_packed_schedule_and_plan():
    cu = [0, 5, 305, 369, 370, 1070]
    for world in (1, 2, 4):
        ps = [shard_packed(torch.tensor(cu), world_size=world, rank=r) for r in range(world)]
        allidx = torch.cat([p.index for p in ps]).sort().values
        assert torch.equal(allidx, torch.arange(cu[-1]))  # every token exactly once
        for p in ps:
            assert p.cu_seqlens_local[-1] == len(p.index) and p.max_seqlen_local <= 700
        sch = _check_schedule(ps[0].placement, Mask(True))
        pairs = sch.pairs_per_rank()
        assert max(pairs) / (sum(pairs) / world) <= 1.05
    _check_schedule(packed_shard([0, 17, 20, 60, 68], 3, 0, 1).placement, Mask(False, (4, 2)))


@pytest.mark.parametrize("docs,world,empty", [([9], 2, 0), ([30], 4, 0), ([1, 2, 20], 4, 0), ([8, 8], 4, 0),
                                               ([3], 2, 1), ([1, 2, 3], 4, 1)])
def test_packed_shards_leave_no_rank_empty_where_a_document_spans_every_rank(docs, world, empty):
    # A model cannot run on an empty shard (transformers' mask builders index its last token): where the default
    # min_piece would leave a rank without a token, every document of >= 2N tokens is cut over every rank; a rank
    # stays empty only when no document has 2N tokens and there are fewer documents than ranks.
    cu = torch.tensor([0] + docs).cumsum(0)
    ps = [shard_packed(cu, world_size=world, rank=r) for r in range(world)]
    assert list(ps[0].counts).count(0) == empty and [len(p.index) for p in ps] == list(ps[0].counts)
    assert torch.equal(torch.cat([p.index for p in ps]).sort().values, torch.arange(sum(docs)))
    assert all(p.min_piece == 8 for p in ps)  # the rule depends on the requested min_piece: every caller agrees


def test_allgather_order_steps():
    for layout in LAYOUTS:
        pl = Placement.dense(48, 4, layout)
        order = np.arange(48)
        for r in range(4):
            st = build_step(pl.runs(r), pl.gathered_runs(order), Mask(True, (7, -1)))
            ref = _dense_mask(pl.positions[r], order, pl.cu_seqlens, Mask(True, (7, -1)))
            assert (_step_mask(st, 12, 48) == ref).all()


def test_shard_without_group_and_errors():
    x = torch.arange(48.0).view(1, 48, 1).requires_grad_()
    parts = [shard_sequence(x, dim=1, world_size=3, rank=r, layout="zigzag") for r in range(3)]
    assert parts[1][0, :, 0].tolist() == [8, 9, 10, 11, 12, 13, 14, 15, 32, 33, 34, 35, 36, 37, 38, 39]
    sum(p.sum() for p in parts).backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    with pytest.raises(ValueError, match="divisible by 2\\*cp_size"):
        shard_sequence(torch.zeros(1, 10, 2), dim=1, world_size=4, rank=0)
    with pytest.raises(ValueError, match="layout must be one of"):
        shard_sequence(torch.zeros(1, 8, 2), dim=1, world_size=2, rank=0, layout="zig")
    with pytest.raises(ValueError, match="both world_size and rank"):
        shard_sequence(torch.zeros(1, 8, 2), dim=1, world_size=2)
    with pytest.raises(ValueError, match="non-decreasing"):
        shard_packed(torch.tensor([0, 5, 3]), world_size=2, rank=0)
