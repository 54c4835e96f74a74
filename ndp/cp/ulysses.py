"""Ulysses attention: all-to-all from sequence-sharded to head-sharded, local attention, all-to-all back.

Inputs come sharded with shard_sequence/shard_packed over the whole group (any layout). After the
all-to-all a rank holds every rank's tokens for its heads in rank-major (sharded) order; one local
index_select puts them in global order, so one segment table describes causal masks, windows and
packed documents. Needs heads % degree == 0; with kv_heads < degree each kv head is replicated
degree / kv_heads times (just enough for one per rank) and the replicas' gradients are summed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ndp.ops.sinks import add_sinks, sinks_grad
from ndp_kernels.segments import any_value_head

from ._common import acc_dtype, on_device, prepare_call, run_bwd_step, run_fwd_step
from .compiled import CpImpl, dispatch, register
from .schedule import Placement, build_step
from .stats import record_comm

__all__ = ["ulysses_attention", "UlyssesAttnFunction", "A2APlan", "A2AOrder", "check_heads", "seq_to_head",
           "head_to_seq", "heads_of", "sinks_grad_of_heads", "lse_to_seq", "lse_to_head"]


@dataclass(frozen=True, eq=False)
class A2AOrder:
    """The group-independent part of an all-to-all plan (cached; module caches never hold process groups,
    whose destruction at interpreter exit must stay with torch.distributed).

    counts[j]: tokens member j holds; order: int64, row t of the reordered sequence is row order[t] of
    the rank-major concatenation; inverse: its inverse permutation.
    """
    counts: tuple
    order: torch.Tensor
    inverse: torch.Tensor
    _on: dict

    def index(self, which: str, device) -> torch.Tensor:
        return on_device(self._on, which, getattr(self, which), device)


@dataclass(frozen=True, eq=False)
class A2APlan:
    """One Ulysses all-to-all group (built per call) and its cached A2AOrder."""
    group: object
    size: int
    rank: int
    ord: A2AOrder

    @property
    def counts(self) -> tuple:
        return self.ord.counts

    @property
    def order(self) -> torch.Tensor:
        return self.ord.order

    def index(self, which: str, device) -> torch.Tensor:
        return self.ord.index(which, device)


def make_a2a_order(member_positions, placement):
    """A2AOrder plus the positions of the reordered rows. The reorder sorts by global position (one run per
    contiguous range) unless the rank-major order has fewer runs (striped shards inside USP)."""
    cat = np.concatenate(member_positions) if member_positions else np.zeros(0, np.int64)
    order = np.argsort(cat, kind="stable")
    if len(placement.gathered_runs(cat)) < len(placement.gathered_runs(cat[order])):
        order = np.arange(len(cat))
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return A2AOrder(tuple(len(p) for p in member_positions), torch.from_numpy(order), torch.from_numpy(inverse),
                    {}), cat[order]


def check_heads(what, heads, kv_heads, degree):
    """Ulysses head constraints; returns the kv replication factor."""
    if heads % degree:
        raise ValueError(f"{what}: Ulysses needs heads % ulysses degree == 0; got heads={heads}, degree={degree}. "
                         f"Use a degree that divides {heads}, or ring_attention / usp_attention with a smaller "
                         f"ulysses_size.")
    if kv_heads >= degree:
        if kv_heads % degree:
            raise ValueError(f"{what}: Ulysses needs kv_heads % degree == 0 when kv_heads >= degree; got "
                             f"kv_heads={kv_heads}, degree={degree}. Use a degree that divides {kv_heads}, or "
                             f"ring_attention.")
        return 1
    if degree % kv_heads:
        raise ValueError(f"{what}: with kv_heads < degree Ulysses replicates kv heads degree/kv_heads times and "
                         f"needs degree % kv_heads == 0; got kv_heads={kv_heads}, degree={degree}. Use a "
                         f"degree that is a multiple of {kv_heads}, or ring_attention.")
    return degree // kv_heads


def _a2a(send_flat, recv_flat, in_splits, out_splits, group, rank):
    dist.all_to_all_single(recv_flat, send_flat, output_split_sizes=out_splits, input_split_sizes=in_splits,
                           group=group)
    es = send_flat.element_size()
    record_comm("all_to_all", (sum(in_splits) - in_splits[rank]) * es, (sum(out_splits) - out_splits[rank]) * es)


def seq_to_head(x4, ap: A2APlan):
    """[B, T_local, H, D] sequence-sharded -> [B, T_group, H/U, D] head-sharded, reordered by ap.order."""
    b, tl, h, d = x4.shape
    u, hs = ap.size, h // ap.size
    if u == 1:
        return x4.index_select(1, ap.index("order", x4.device)) if len(ap.order) > 1 else x4
    send = x4.reshape(b, tl, u, hs, d).permute(2, 0, 1, 3, 4).contiguous()   # [U, B, Tl, Hs, D]
    total = sum(ap.counts)
    recv = x4.new_empty((total * b * hs * d,))
    per = b * hs * d
    _a2a(send.view(-1), recv, [tl * per] * u, [c * per for c in ap.counts], ap.group, ap.rank)
    if b == 1:
        rm = recv.view(1, total, hs, d)
    else:
        rm = recv.view(u, b, total // u, hs, d).permute(1, 0, 2, 3, 4).reshape(b, total, hs, d)
    return rm.index_select(1, ap.index("order", x4.device))


def head_to_seq(y4, ap: A2APlan):
    """Inverse of seq_to_head: [B, T_group, Hs, D] (reordered) -> [B, T_local, U*Hs, D]."""
    b, total, hs, d = y4.shape
    u = ap.size
    rm = y4.index_select(1, ap.index("inverse", y4.device))  # back to rank-major order
    if u == 1:
        return rm
    tl = ap.counts[ap.rank]
    if b == 1:
        send = rm.reshape(-1)
    else:
        send = rm.reshape(b, u, total // u, hs, d).permute(1, 0, 2, 3, 4).contiguous().view(-1)
    per = b * hs * d
    recv = y4.new_empty((u * b * tl * hs * d,))
    _a2a(send, recv, [c * per for c in ap.counts], [tl * per] * u, ap.group, ap.rank)
    return recv.view(u, b, tl, hs, d).permute(1, 2, 0, 3, 4).reshape(b, tl, u * hs, d)


@dataclass(frozen=True, eq=False)
class UlyssesPlan:
    a2a: A2APlan
    step: object          # Step of the full (reordered) sequence against itself
    rep: int              # kv head replication factor
    scale: float
    backend: object  # _common.LocalEngine


_CACHE = {}


def _ulysses_plan(call, rep):
    key = (id(call.placement), call.rank, call.mask, call.world)
    hit = _CACHE.get(key)
    if hit is None or hit[0] is not call.placement:
        pl = call.placement
        order, ordered = make_a2a_order(list(pl.positions), pl)
        full = Placement([ordered], pl.cu_seqlens)
        hit = (pl, order, build_step(full.runs(0), full.runs(0), call.mask))
        if len(_CACHE) > 256:
            _CACHE.clear()
        _CACHE[key] = hit
    _, order, step = hit
    return UlyssesPlan(A2APlan(call.group, call.world, call.rank, order), step, rep, call.scale, call.backend)


def _blocks(call, rep):
    """The block _ulysses_fwd / _bwd run (check_blocks): every token, this rank's share of the heads."""
    t, n = sum(call.placement.counts), call.world
    yield (_ulysses_plan(call, rep).step, (call.batch, t, call.heads // n, call.head_dim),
           (call.batch, t, call.kv_heads * rep // n, call.head_dim))


def _expand_kv(k4, rep):
    return k4 if rep == 1 else k4.repeat_interleave(rep, dim=2)


def _reduce_kv(dk4, rep):
    if rep == 1:
        return dk4
    b, t, hr, d = dk4.shape
    return dk4.view(b, t, hr // rep, rep, d).sum(3)


def heads_of(sinks, ap: A2APlan):
    """The sinks of the heads this rank holds after seq_to_head (None stays None)."""
    if sinks is None:
        return None
    hs = sinks.shape[0] // ap.size
    return sinks[ap.rank * hs:(ap.rank + 1) * hs]


def sinks_grad_of_heads(dout_h, out_h, lse_h, sinks, ap: A2APlan):
    """d sinks ``[H]``: this rank's heads' part (rows of the whole group), zeros elsewhere."""
    if sinks is None:
        return None
    full = torch.zeros_like(sinks)
    hs = sinks.shape[0] // ap.size
    full[ap.rank * hs:(ap.rank + 1) * hs] = sinks_grad(dout_h, out_h, lse_h, heads_of(sinks, ap))
    return full


def _ulysses_fwd(q4, k4, v4, sinks, plan: UlyssesPlan):
    """Returns head-sharded (qh, kh, vh, out_h, lse_h) with out_h fp32-accumulated then cast (sinks joined)."""
    ap = plan.a2a
    qh = seq_to_head(q4, ap)
    kh = seq_to_head(_expand_kv(k4, plan.rep), ap)
    vh = seq_to_head(_expand_kv(v4, plan.rep), ap)
    b, t, hs, d = qh.shape
    acc = acc_dtype(q4.dtype)
    out_acc = torch.zeros((b, t, hs, d), dtype=acc, device=q4.device)
    lse = torch.full((b, hs, t), float("-inf"), dtype=acc, device=q4.device)
    if not plan.step.empty:
        run_fwd_step(qh, kh, vh, plan.step, out_acc, lse, scale=plan.scale, backend=plan.backend)
    if sinks is not None:
        return (qh, kh, vh) + add_sinks(out_acc, lse, heads_of(sinks, ap), q4.dtype)
    return qh, kh, vh, out_acc.to(q4.dtype), lse


def _ulysses_bwd(dout4, qh, kh, vh, out_h, lse_h, sinks, plan: UlyssesPlan):
    ap = plan.a2a
    douth = seq_to_head(dout4, ap)
    dsinks = sinks_grad_of_heads(douth, out_h, lse_h, sinks, ap)
    acc = acc_dtype(qh.dtype)
    dq = torch.zeros(qh.shape, dtype=acc, device=qh.device)
    dk = torch.zeros(kh.shape, dtype=acc, device=qh.device)
    dv = torch.zeros(vh.shape, dtype=acc, device=qh.device)
    if not plan.step.empty:
        run_bwd_step(douth, qh, kh, vh, out_h, lse_h, plan.step, dq, dk, dv, scale=plan.scale,
                     backend=plan.backend)
    # Gradients travel in the input dtype: each element is final (kv replicas are summed after the
    # transfer, in fp32), so fp32 on the wire would double the bytes for no accuracy.
    dq = head_to_seq(dq.to(qh.dtype), ap)
    dk, dv = head_to_seq(dk.to(kh.dtype), ap), head_to_seq(dv.to(vh.dtype), ap)
    if plan.rep > 1:
        dk, dv = dk.to(acc), dv.to(acc)
    return dq, _reduce_kv(dk, plan.rep).to(kh.dtype), _reduce_kv(dv, plan.rep).to(vh.dtype), dsinks


def lse_to_seq(lse_h, ap):
    """[B, Hs, T_group] head-sharded lse -> [B, H, T_local] (small; only when the caller asks for lse)."""
    y = lse_h.transpose(1, 2).unsqueeze(-1).contiguous()       # [B, T, Hs, 1]
    return head_to_seq(y, ap).squeeze(-1).transpose(1, 2).contiguous()


class UlyssesAttnFunction(torch.autograd.Function):
    """Autograd of Ulysses attention (all-to-all, local attention from ndp.ops, all-to-all)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, plan, packed, need_lse):
        q4, k4, v4 = (x.unsqueeze(0) if packed else x for x in (q, k, v))
        qh, kh, vh, out_h, lse_h = _ulysses_fwd(q4, k4, v4, sinks, plan)
        out = head_to_seq(out_h, plan.a2a)
        lse = lse_to_seq(lse_h, plan.a2a) if need_lse else out.new_empty(0)
        ctx.save_for_backward(qh, kh, vh, out_h, lse_h, sinks)
        ctx.plan, ctx.packed = plan, packed
        ctx.mark_non_differentiable(lse)
        return (out[0], lse[0] if need_lse else lse) if packed else (out, lse)

    @staticmethod
    def backward(ctx, dout, _dlse):
        dout4 = (dout.unsqueeze(0) if ctx.packed else dout).contiguous()
        dq, dk, dv, dsinks = _ulysses_bwd(dout4, *ctx.saved_tensors, ctx.plan)
        if ctx.packed:
            dq, dk, dv = dq[0], dk[0], dv[0]
        return dq, dk, dv, dsinks, None, None, None


@any_value_head
def ulysses_attention(q, k, v, *, group=None, causal=True, softmax_scale=None, layout="zigzag", backend="auto",
                      window_size=(-1, -1), cu_seqlens=None, return_lse=False, deterministic=False, sinks=None,
                      chunk_size=None, softcap=0.0, bidirectional_spans=None):
    """Exact attention over a sequence sharded on the group, by all-to-all to head sharding (autograd).

    Args:
        q: this rank's shard ``[batch, seq/N, heads, head_dim]`` (``ndp.shard_sequence`` over `group`,
            any layout), or packed ``[local_tokens, heads, head_dim]`` with cu_seqlens.
        k, v: ``[batch, seq/N, kv_heads, head_dim]`` (packed ``[local_tokens, kv_heads, head_dim]``); v's head size
            may differ (MLA; ``any_value_head``: out then has v's).
        group: the CP group (its size is the Ulysses degree N); None = default group.
        causal, softmax_scale, window_size: mask and scale over global positions.
        layout: the layout the inputs were sharded with.  backend: local attention backend.
        cu_seqlens: packed documents (global cu_seqlens or the shard_packed result).
        return_lse: also return the fp32 lse of this rank's rows.
        deterministic: bitwise-reproducible gradients.
        sinks: optional ``[heads]`` attention sinks (as in ``ndp.ring_attention``; each rank joins its heads').
        chunk_size: chunked attention, as in ``ndp.ring_attention``.
        softcap, bidirectional_spans: logit soft-capping, image blocks, as in ``ndp.ring_attention``.
    Returns:
        out (q's shape and dtype), and lse when asked.
    Raises:
        ValueError: heads % N != 0, or kv_heads not a multiple/divisor of N (the message names the
            alternatives), plus every check of ring_attention.
    """
    return dispatch("ulysses", q, k, v, (group,), causal=causal, softmax_scale=softmax_scale, layout=layout,
                    backend=backend, window_size=window_size, cu_seqlens=cu_seqlens, return_lse=return_lse,
                    deterministic=deterministic, sinks=sinks, chunk_size=chunk_size, softcap=softcap,
                    bidirectional_spans=bidirectional_spans)


def _prepare(q, k, v, groups, need_lse=True, **kw):
    """UlyssesAttnFunction's arguments after q, k, v: validation, the validity exchange, the plan."""
    call = prepare_call("ulysses_attention", q, k, v, group=groups[0], **kw,
                        pre_check=lambda n: check_heads("ulysses_attention", q.shape[-2], k.shape[-2], n),
                        blocks=lambda c: _blocks(c, check_heads("ulysses_attention", c.heads, c.kv_heads, c.world)))
    rep = check_heads("ulysses_attention", q.shape[-2], k.shape[-2], call.world)
    return kw["sinks"], _ulysses_plan(call, rep), call.packed, need_lse


def lse_to_head(lse4, ap):
    """Inverse of lse_to_seq: [B, H, T_local] -> [B, Hs, T_group] head-sharded, reordered."""
    y = lse4.transpose(1, 2).unsqueeze(-1).contiguous()       # [B, T, H, 1]
    return seq_to_head(y, ap).squeeze(-1).transpose(1, 2).contiguous()


def _saved(q4, k4, v4, out4, lse4, sinks, rest):
    plan = rest[1]
    ap = plan.a2a
    heads = (seq_to_head(x, ap) for x in (q4, _expand_kv(k4, plan.rep), _expand_kv(v4, plan.rep), out4))
    return (*heads, lse_to_head(lse4, ap), sinks)


register("ulysses", CpImpl(_prepare, UlyssesAttnFunction, _saved))
