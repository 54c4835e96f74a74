"""Load-balanced sequence sharding: `shard_sequence`, `gather_sequence`, `reduce_scatter_sequence`, `shard_packed`;
and `sum_over_group`, the differentiable sum over the CP group of parts split by something other than the sequence.

The permutations themselves are the compiled ops `torch.ops.ndp.shard_index / shard_gather /
unshard / packed_shard_plan` (csrc/); this module adds process groups, autograd and the packed
document plan object that the CP implementations consume.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

import ndp._ops  # noqa: F401  registers torch.ops.ndp.*
from ndp_kernels.segments import read_once

from ._validate import check_layout, resolve_group
from .schedule import Placement
from .stats import all_gather_flat, all_reduce_sum, reduce_scatter_flat

__all__ = ["shard_sequence", "gather_sequence", "reduce_scatter_sequence", "sum_over_group", "shard_packed",
           "PackedShard", "DEFAULT_MIN_PIECE", "seq_multiple"]

# Documents of at least 2*N*DEFAULT_MIN_PIECE tokens are cut in 2N zigzag pieces; shorter ones travel
# whole. 8 keeps pieces from being tiny while the per-rank work stays level (<= 1.05 max/mean
# down to 2k tokens per rank over 32 ranks; bench/bench_cp.py measures it).
DEFAULT_MIN_PIECE = 8


def _require_ops():
    if ndp._ops.load_error is not None:
        raise RuntimeError(f"ndp.cp needs the compiled ops torch.ops.ndp.*: {ndp._ops.load_error}")


def _world_rank(group, world_size, rank):
    if world_size is not None or rank is not None:
        if world_size is None or rank is None:
            raise ValueError(f"pass both world_size and rank (or a group); got world_size={world_size}, rank={rank}")
        if not (isinstance(world_size, int) and isinstance(rank, int)) or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need an int world_size >= 1 and 0 <= rank < world_size; got world_size={world_size}, "
                             f"rank={rank}. Pass this process's rank in the CP group (or the group itself).")
        if group is not None:
            _, w, r = resolve_group(group)
            if (w, r) != (world_size, rank):
                raise ValueError(f"world_size/rank ({world_size}, {rank}) disagree with the group's ({w}, {r}); "
                                 f"pass either the group or world_size/rank")
            return group, world_size, rank
        return None, world_size, rank
    pg, w, r = resolve_group(group)
    return pg, w, r


def _check_seq(x, dim, world, layout, what):
    if not torch.is_tensor(x):
        raise TypeError(f"{what} expects a torch.Tensor; got {type(x).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for a tensor of shape {tuple(x.shape)}; pass the sequence dim, "
                         f"in [{-x.dim()}, {x.dim() - 1}]")
    return dim % x.dim()


def _all_gather_stack(x, group, world):
    """[N, *x.shape]: every rank's x, in group rank order."""
    x = x.contiguous()
    out = x.new_empty((world * x.numel(),))
    all_gather_flat(out, x.reshape(-1), group)
    return out.view(world, *x.shape)


class _ShardFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, world, rank, layout):
        ctx.dim, ctx.group, ctx.world, ctx.rank, ctx.layout = dim, group, world, rank, layout
        ctx.full_shape = x.shape
        return ndp._ops.shard_gather(x, dim, world, rank, layout)

    @staticmethod
    def backward(ctx, grad):
        if ctx.group is None:
            # No group: the exact gradient of taking this rank's rows (zeros elsewhere).
            idx = torch.ops.ndp.shard_index(ctx.full_shape[ctx.dim], ctx.world, ctx.rank, ctx.layout)
            full = grad.new_zeros(ctx.full_shape).index_copy(ctx.dim, idx.to(grad.device), grad)
        else:
            # x is replicated on the group: its gradient is every rank's shard gradient, gathered.
            full = ndp._ops.unshard(_all_gather_stack(grad, ctx.group, ctx.world), ctx.dim, ctx.world, ctx.layout)
        return full, None, None, None, None, None


def _gather(x, dim, group, world, layout):
    """Every rank's shard `x`, put back in sequence order: the full tensor."""
    return ndp._ops.unshard(_all_gather_stack(x, group, world), dim, world, layout)


def _reduce_scatter(full, dim, group, world, layout):
    """This rank's shard of `full` summed over the ranks (each holding its own `full`)."""
    full = full.contiguous()
    parts = torch.stack([ndp._ops.shard_gather(full, dim, world, r, layout) for r in range(world)])
    out = parts.new_empty(parts.shape[1:])
    reduce_scatter_flat(out.view(-1), parts.view(-1), group)
    return out


class _GatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, world, rank, layout, reduce_grad):
        ctx.dim, ctx.group, ctx.world, ctx.rank, ctx.layout = dim, group, world, rank, layout
        ctx.reduce_grad = reduce_grad
        return _gather(x, dim, group, world, layout)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.reduce_grad:
            # The gathered tensor is used replicated on every rank: each keeps its own shard of the gradient.
            return ndp._ops.shard_gather(grad.contiguous(), ctx.dim, ctx.world, ctx.rank, ctx.layout), *(None,) * 6
        # Each rank used it differently: every rank's gradient of this rank's shard, summed.
        return _reduce_scatter(grad, ctx.dim, ctx.group, ctx.world, ctx.layout), *(None,) * 6


class _ReduceScatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, full, dim, group, world, layout):
        ctx.dim, ctx.group, ctx.world, ctx.layout = dim, group, world, layout
        return _reduce_scatter(full, dim, group, world, layout)

    @staticmethod
    def backward(ctx, grad):
        # every rank's full tensor reached every shard: each gets the whole gradient
        return _gather(grad, ctx.dim, ctx.group, ctx.world, ctx.layout), None, None, None, None


class _SumFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_reduce_sum(x.clone(memory_format=torch.contiguous_format), group)

    @staticmethod
    def backward(ctx, grad):
        # this rank's x reached every rank's sum: its gradient is the sum of theirs
        return all_reduce_sum(grad.clone(memory_format=torch.contiguous_format), ctx.group), None


def shard_sequence(x, dim=1, group=None, layout="zigzag", *, world_size=None, rank=None):
    """This rank's load-balanced shard of `x` along `dim` (differentiable).

    Args:
        x: the full tensor (same on every rank), e.g. ``[batch, seq, heads, head_dim]`` with dim=1.
        dim: the sequence dim.
        group: the CP ProcessGroup (None = default group) or a 1-D DeviceMesh.
        layout: "zigzag" (2N chunks, rank r holds r and 2N-1-r), "contiguous" or "striped".
        world_size, rank: instead of a group (no communication; backward then gives zeros off-shard).
    Returns:
        ``x`` restricted to this rank's positions (``seq // N`` along dim), in local order.
    Raises:
        ValueError: seqlen not divisible (by N, zigzag by 2N), bad layout/dim; TypeError: not a tensor.
    """
    _require_ops()
    layout = check_layout(layout)
    pg, world, r = _world_rank(group, world_size, rank)
    d = _check_seq(x, dim, world, layout, "shard_sequence")
    _check_divisible(x.shape[d], world, layout)
    return _ShardFn.apply(x, d, pg, world, r, layout)


def seq_multiple(world: int, layout: str) -> int:
    """The multiple a dense sequence's length must be to shard over `world` ranks in `layout` (zigzag: 2 pieces
    per rank)."""
    return 2 * world if layout == "zigzag" else world


def _check_divisible(seqlen, world, layout):
    need = seq_multiple(world, layout)
    if seqlen % need:
        what = "2*cp_size" if layout == "zigzag" else "cp_size"
        raise ValueError(f"{layout} sharding needs seqlen divisible by {what}; got seqlen={seqlen}, "
                         f"cp_size={world}. Pad the sequence to a multiple of {need}"
                         f"{' or use layout=contiguous/striped' if layout == 'zigzag' else ''}, or pack it with "
                         f"cu_seqlens and ndp.shard_packed (any lengths).")


def gather_sequence(x, dim=1, group=None, layout="zigzag", *, reduce_grad=False):
    """Inverse of `shard_sequence`: the full tensor on every rank (differentiable; backward = shard).

    Args:
        x: this rank's shard (same shape on every rank).  dim: the sequence dim.
        group: the CP group (None = default group).  layout: the layout x was sharded with.
        reduce_grad: the ranks use the full tensor differently (e.g. each keeps its own shard of what it computes
            from it): backward sums every rank's gradient of this rank's shard (a reduce-scatter). False: it is
            used replicated (the same computation on every rank), and each rank keeps its shard of the gradient.
    Returns:
        the full tensor, ``N * x.shape[dim]`` along dim, in global order.
    Raises:
        ValueError: bad layout or dim; RuntimeError: torch.distributed not initialized.
    """
    _require_ops()
    layout = check_layout(layout)
    pg, world, r = resolve_group(group)
    d = _check_seq(x, dim, world, layout, "gather_sequence")
    return _GatherFn.apply(x, d, pg, world, r, layout, bool(reduce_grad))


def reduce_scatter_sequence(x, dim=1, group=None, layout="zigzag"):
    """This rank's shard of the sum over the CP group of every rank's full tensor `x` (differentiable; backward =
    gather): the way back from a computation split over the ranks by something other than the sequence (heads),
    each rank holding its part of the whole sequence's result.

    Args:
        x: this rank's partial full tensor (same shape on every rank).  dim: the sequence dim.
        group: the CP group (None = default group).  layout: the layout of the shard returned.
    Returns:
        this rank's positions of the sum, ``x.shape[dim] // N`` along dim, in local order.
    Raises:
        ValueError: seqlen not divisible (by N, zigzag by 2N), bad layout or dim; RuntimeError: torch.distributed
            not initialized.
    """
    _require_ops()
    layout = check_layout(layout)
    pg, world, _ = resolve_group(group)
    d = _check_seq(x, dim, world, layout, "reduce_scatter_sequence")
    _check_divisible(x.shape[d], world, layout)
    return _ReduceScatterFn.apply(x, d, pg, world, layout)


def sum_over_group(x, group=None):
    """The sum over the group of every rank's `x` (same shape on every rank; differentiable: backward sums the
    gradients alike). torch's differentiable all_reduce (``torch.distributed.nn``) is deprecated.

    Args:
        x: this rank's part.  group: the CP group (None = default group).
    Returns:
        the sum, on every rank.
    Raises:
        RuntimeError: torch.distributed not initialized.
    """
    pg, _, _ = resolve_group(group)
    return _SumFn.apply(x, pg)


@dataclass(frozen=True, eq=False)
class PackedShard:
    """This rank's share of packed documents (result of `shard_packed`).

    Attributes:
        index: int64 ``[local_tokens]``, the global token indices this rank holds (use ``x[index]``).
        cu_seqlens_local: int32 ``[pieces + 1]``, boundaries of the document pieces in local order.
        max_seqlen_local: longest local piece.
        position_ids: int64 ``[local_tokens]``, each local token's position inside its document (RoPE).
        cu_seqlens: the global int32 cu_seqlens (CPU).  plan: int64 ``[pieces, 4]`` rows
            (doc, global_start, length, rank) of every rank.  world_size, rank, min_piece.
        counts: tokens held by every rank (uneven in general).
    """
    index: torch.Tensor
    cu_seqlens_local: torch.Tensor
    max_seqlen_local: int
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    plan: torch.Tensor
    world_size: int
    rank: int
    min_piece: int
    counts: tuple
    placement: Placement = field(repr=False)

    @property
    def signature(self) -> tuple:
        return (tuple(self.cu_seqlens.tolist()), self.world_size, self.min_piece)


@functools.lru_cache(maxsize=64)
def _packed_placement(cu: tuple, world: int, min_piece: int):
    """(plan, Placement) of the documents of `cu` over `world` ranks. Where `min_piece` would leave a rank without a
    token, documents are cut down to one-token pieces (min_piece 1: every document of at least 2N tokens spans every
    rank): a model's forward cannot run on an empty shard (transformers' mask builders index its last token). The
    rule depends on (cu, world, min_piece) only, so the batch's shard and every attention call agree."""
    plan = _plan_rows(cu, world, min_piece)
    rows = plan.tolist()
    if min_piece > 1 and {rk for _, _, n, rk in rows if n > 0} != set(range(world)):
        plan = _plan_rows(cu, world, 1)
        rows = plan.tolist()
    positions = []
    for r in range(world):
        mine = [(s, n) for _, s, n, rk in rows if rk == r and n > 0]
        positions.append(np.concatenate([np.arange(s, s + n) for s, n in mine]) if mine
                         else np.zeros(0, dtype=np.int64))
    return plan, Placement(positions, cu)


def _plan_rows(cu: tuple, world: int, min_piece: int) -> torch.Tensor:
    return torch.ops.ndp.packed_shard_plan(torch.tensor(cu, dtype=torch.int64), world, min_piece)


def packed_shard(cu_seqlens, world: int, rank: int, min_piece: int = DEFAULT_MIN_PIECE) -> PackedShard:
    """`shard_packed` with explicit world size and rank (no communication); cached."""
    _require_ops()
    cu = _check_cu(cu_seqlens)
    if not isinstance(min_piece, int) or min_piece < 1:
        raise ValueError(f"min_piece must be an int >= 1; got {min_piece!r}")
    return _packed_shard_cached(cu, world, rank, min_piece)


@functools.lru_cache(maxsize=256)
def _packed_shard_cached(cu: tuple, world: int, rank: int, min_piece: int) -> PackedShard:
    plan, placement = _packed_placement(cu, world, min_piece)
    rows = [row for row in plan.tolist() if row[3] == rank and row[2] > 0]
    index = torch.from_numpy(placement.positions[rank].copy())
    lens = [n for _, _, n, _ in rows]
    cu_local = torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int32)
    starts = np.asarray(cu, dtype=np.int64)
    doc = placement.doc_of(placement.positions[rank])
    pos_ids = torch.from_numpy(placement.positions[rank] - starts[doc])
    return PackedShard(index=index, cu_seqlens_local=cu_local, max_seqlen_local=max(lens, default=0),
                       position_ids=pos_ids, cu_seqlens=torch.tensor(cu, dtype=torch.int32), plan=plan,
                       world_size=world, rank=rank, min_piece=min_piece, counts=placement.counts,
                       placement=placement)


def _check_cu(cu_seqlens) -> tuple:
    if not torch.is_tensor(cu_seqlens):
        if isinstance(cu_seqlens, (list, tuple)):
            cu_seqlens = torch.tensor(cu_seqlens)
        else:
            raise TypeError(f"cu_seqlens must be an int tensor [num_docs + 1]; got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor [num_docs + 1]; got dtype={cu_seqlens.dtype}, "
                         f"shape={tuple(cu_seqlens.shape)}")
    vals = tuple(int(x) for x in read_once(cu_seqlens, "values", cu_seqlens.tolist))
    if vals[0] != 0 or any(b < a for a, b in zip(vals, vals[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing (cumulative document lengths); got "
                         f"{list(vals[:8])}{'...' if len(vals) > 8 else ''}")
    return vals


def shard_packed(cu_seqlens, group=None, *, world_size=None, rank=None, min_piece=DEFAULT_MIN_PIECE) -> PackedShard:
    """Per-document load-balanced sharding of packed input (any document lengths).

    Documents of at least ``2 * N * min_piece`` tokens are cut in 2N nearly equal pieces (pieces i and
    2N-1-i on rank i: zigzag per document); shorter documents go whole, longest first, to the rank
    with the least causal work. Ranks may hold different token counts; where that would leave a rank without a
    token, every document of at least 2N tokens is cut (as with min_piece 1). A rank is empty only when no document
    has 2N tokens and there are fewer documents than ranks (``ndp.hf.shard_batch`` then pads).

    Args:
        cu_seqlens: global int32/int64 ``[num_docs + 1]`` (same on every rank).
        group: the CP group (None = default group), or pass world_size and rank.
        min_piece: smallest piece a document is cut into.
    Returns:
        PackedShard with ``.index`` (take ``x[index]`` of the packed ``[total_tokens, ...]`` tensors),
        ``.cu_seqlens_local``, ``.max_seqlen_local``, ``.position_ids`` and the plan the CP
        implementations use (pass it, or the global cu_seqlens, as ``cu_seqlens=`` to them).
    Raises:
        ValueError / TypeError for malformed cu_seqlens or world_size/rank.
    """
    _, world, r = _world_rank(group, world_size, rank)
    return packed_shard(cu_seqlens, world, r, min_piece)
