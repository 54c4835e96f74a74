"""USP (unified sequence parallel): Ulysses inside groups of adjacent ranks, ring across them.

The CP group of N = U * R ranks is split (split_cp_group) into R Ulysses groups of U adjacent ranks
and U ring groups. CP rank c = g * U + u is member u of Ulysses group g and rank g of ring group u.
Inputs are sharded over the whole CP group (shard_sequence / shard_packed with N ranks). After the
Ulysses all-to-all, group g holds the shards of CP ranks gU..gU+U-1 for its heads: with zigzag these
are exactly the ring's 2R-way zigzag chunk pair g (a local reorder, no extra communication), and
the ring runs on them with the schedule built from their global positions.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ndp.ops.sinks import add_sinks, check_sinks
from ndp_kernels.segments import any_value_head

from ._common import acc_dtype, call_fields, check_blocks, local_engine, mask_of, placement_for
from ._validate import (agree, check_common, check_layout, group_key, resolve_group,
                        resolve_group_or_input_error)
from .compiled import CpImpl, dispatch, register
from .ring import RingPlan, ring_blocks, ring_bwd, ring_fwd
from .schedule import Placement, RingSchedule
from .sharding import _require_ops
from .ulysses import (A2APlan, _expand_kv, _reduce_kv, check_heads, head_to_seq, heads_of, lse_to_head, lse_to_seq,
                      make_a2a_order, seq_to_head, sinks_grad_of_heads)

__all__ = ["usp_attention", "UspAttnFunction", "split_cp_group"]

_SPLITS = {}
_SPLITS_LOCK = threading.Lock()


def split_cp_group(group=None, ulysses_size=1):
    """Splits a CP group (or DeviceMesh) into (ulysses_group, ring_group) for usp_attention.

    Ulysses groups are `ulysses_size` adjacent ranks of the CP group (fast links); ring groups take
    every ulysses_size-th rank. Collective: every rank of the default group must call it (with the
    same ulysses_size), since new process groups are created.

    Args:
        group: the CP ProcessGroup (None = default group), or a DeviceMesh: 1-D, or one with a "cp" axis.
        ulysses_size: U, must divide the CP size N.
    Returns:
        (ulysses_group, ring_group) of sizes U and N / U, cached per (group, ulysses_size).
    Raises:
        ValueError: ulysses_size does not divide the CP size.
    """
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        mesh = group
        if mesh.ndim > 1:
            names = mesh.mesh_dim_names or ()
            if "cp" not in names:
                raise ValueError(f"split_cp_group needs a 1-D mesh or a mesh with a 'cp' axis; got axes {names}")
            mesh = mesh["cp"]
        group = mesh.get_group()
    pg, world, _ = resolve_group(group)
    if not isinstance(ulysses_size, int) or ulysses_size < 1 or world % ulysses_size:
        raise ValueError(f"ulysses_size must be a positive divisor of the CP size; got ulysses_size={ulysses_size}, "
                         f"cp_size={world}. Use one of {[d for d in range(1, world + 1) if world % d == 0]}.")
    key = (group_key(pg), ulysses_size)
    with _SPLITS_LOCK:
        refs = _SPLITS.get(key)
        hit = refs and (refs[0](), refs[1]())
        if hit and hit[0] is not None and hit[1] is not None:
            return hit
    cp_ranks = dist.get_process_group_ranks(pg)
    if len(cp_ranks) == dist.get_world_size():
        all_cp = [cp_ranks]
    else:
        # Every rank must create every subgroup in the same order: learn all CP groups first.
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, cp_ranks)
        all_cp = sorted({tuple(r) for r in gathered})
    me = dist.get_rank()
    mine = None
    for ranks in all_cp:
        ranks = list(ranks)
        n = len(ranks)
        if n % ulysses_size:
            raise ValueError(f"ulysses_size={ulysses_size} does not divide the size {n} of CP group {ranks}")
        uly = [dist.new_group(ranks[g * ulysses_size:(g + 1) * ulysses_size]) for g in range(n // ulysses_size)]
        ring = [dist.new_group(ranks[u::ulysses_size]) for u in range(ulysses_size)]
        if me in ranks:
            c = ranks.index(me)
            mine = (uly[c // ulysses_size], ring[c % ulysses_size])
    with _SPLITS_LOCK:
        # weak references: the groups belong to torch.distributed (destroy_process_group frees them)
        _SPLITS[key] = (weakref.ref(mine[0]), weakref.ref(mine[1])) if mine else None
    return mine


@dataclass(frozen=True, eq=False)
class UspPlan:
    a2a: object
    ring: RingPlan
    rep: int


_CACHE = {}


def _usp_plan(placement, mask, ug, u_size, u, rg, r_size, g, rep, scale, backend):
    key = (id(placement), mask, u_size, r_size, g)
    hit = _CACHE.get(key)
    if hit is None or hit[0] is not placement:
        ordered_all, mine = [], None
        for gg in range(r_size):
            members = [placement.positions[gg * u_size + uu] for uu in range(u_size)]
            order, ordered = make_a2a_order(members, placement)
            ordered_all.append(ordered)
            if gg == g:
                mine = order
        hit = (placement, mine, RingSchedule(Placement(ordered_all, placement.cu_seqlens), mask))
        if len(_CACHE) > 256:
            _CACHE.clear()
        _CACHE[key] = hit
    _, order, schedule = hit
    return UspPlan(A2APlan(ug, u_size, u, order), RingPlan(rg, r_size, g, schedule, scale, backend), rep)


class UspAttnFunction(torch.autograd.Function):
    """Autograd of USP attention: Ulysses all-to-all, ring over the ring group, all-to-all back."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, plan, packed, need_lse):
        q4, k4, v4 = (x.unsqueeze(0) if packed else x for x in (q, k, v))
        ap = plan.a2a
        qh = seq_to_head(q4, ap)
        kv = torch.stack([seq_to_head(_expand_kv(k4, plan.rep), ap), seq_to_head(_expand_kv(v4, plan.rep), ap)])
        out_acc, lse_h = ring_fwd(qh, kv, plan.ring)
        if sinks is None:
            out_h = out_acc.to(q.dtype)
        else:
            out_h, lse_h = add_sinks(out_acc, lse_h, heads_of(sinks, ap), q.dtype)
        out = head_to_seq(out_h, ap)
        lse = lse_to_seq(lse_h, ap) if need_lse else out.new_empty(0)
        ctx.save_for_backward(qh, kv, out_h, lse_h, sinks)
        ctx.plan, ctx.packed = plan, packed
        ctx.mark_non_differentiable(lse)
        return (out[0], lse[0] if need_lse else lse) if packed else (out, lse)

    @staticmethod
    def backward(ctx, dout, _dlse):
        qh, kv, out_h, lse_h, sinks = ctx.saved_tensors
        plan, ap = ctx.plan, ctx.plan.a2a
        dout4 = (dout.unsqueeze(0) if ctx.packed else dout).contiguous()
        dout_h = seq_to_head(dout4, ap)
        dq_h, dkv_h = ring_bwd(dout_h, qh, kv, out_h, lse_h, plan.ring)
        dsinks = sinks_grad_of_heads(dout_h, out_h, lse_h, sinks, ap)
        dq = head_to_seq(dq_h.to(qh.dtype), ap)
        # Final gradients travel in the input dtype; kv replicas are summed after, in fp32.
        dk, dv = head_to_seq(dkv_h[0].to(kv.dtype), ap), head_to_seq(dkv_h[1].to(kv.dtype), ap)
        if plan.rep > 1:
            dk, dv = dk.to(acc_dtype(kv.dtype)), dv.to(acc_dtype(kv.dtype))
        dk, dv = _reduce_kv(dk, plan.rep).to(kv.dtype), _reduce_kv(dv, plan.rep).to(kv.dtype)
        if ctx.packed:
            dq, dk, dv = dq[0], dk[0], dv[0]
        return dq, dk, dv, dsinks, None, None, None


@any_value_head
def usp_attention(q, k, v, *, ulysses_group, ring_group, causal=True, softmax_scale=None, layout="zigzag",
                  backend="auto", window_size=(-1, -1), cu_seqlens=None, return_lse=False, deterministic=False,
                  sinks=None, chunk_size=None, softcap=0.0, bidirectional_spans=None):
    """Exact attention with Ulysses inside `ulysses_group` and a ring across `ring_group` (autograd).

    Args:
        q, k, v: this rank's shards over the whole CP group of N = U * R ranks (``ndp.shard_sequence(x,
            group=<CP group>)`` or ``x[ndp.shard_packed(cu_seqlens, group=<CP group>).index]``), shapes as
            in ``ndp.ring_attention``.
        ulysses_group, ring_group: from ``ndp.cp.split_cp_group(cp_group, ulysses_size)`` (CP rank
            c = ring_rank * U + ulysses_rank).
        causal, softmax_scale, layout, backend, window_size, cu_seqlens, return_lse, deterministic, sinks,
            chunk_size, softcap, bidirectional_spans: as in ring_attention
            (a PackedShard passed as cu_seqlens must be for the whole CP group).
    Returns:
        out (q's shape and dtype), and the lse when asked.
    Raises:
        ValueError: heads % U != 0 or kv_heads neither a multiple nor a divisor of U, plus every check
            of ring_attention; raised on every rank before any transfer.
    """
    return dispatch("usp", q, k, v, (ulysses_group, ring_group), causal=causal, softmax_scale=softmax_scale,
                    layout=layout, backend=backend, window_size=window_size, cu_seqlens=cu_seqlens,
                    return_lse=return_lse, deterministic=deterministic, sinks=sinks, chunk_size=chunk_size,
                    softcap=softcap, bidirectional_spans=bidirectional_spans)


def _prepare(q, k, v, groups, *, causal, softmax_scale, window_size, layout, cu_seqlens, backend, deterministic,
             sinks, chunk_size, softcap, bidirectional_spans=None, need_lse=True):
    """UspAttnFunction's arguments after q, k, v: validation, the validity exchange over both groups, the plan."""
    ulysses_group, ring_group = groups
    _require_ops()
    from ndp.ops import resolve_backend

    def local():
        return check_common(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                            cu_seqlens=cu_seqlens)

    ug, u_size, u = resolve_group_or_input_error(ulysses_group, local)
    rg, r_size, g = resolve_group_or_input_error(ring_group, local)
    fields, error, plan = None, None, None
    try:
        window, scale, packed = local()
        layout = check_layout(layout)
        resolve_backend(backend, q.device)
        engine = local_engine(backend, deterministic, softcap)
        check_sinks(sinks, q.shape[-2], q.device)
        rep = check_heads("usp_attention", q.shape[-2], k.shape[-2], u_size)
        n, c = u_size * r_size, g * u_size + u
        placement, cu_desc, batch = placement_for("usp_attention", q, n, c, layout, cu_seqlens, chunk_size)
        mask = mask_of("usp_attention", causal, window, bidirectional_spans, placement, packed, chunk_size)
        fields = call_fields("usp_attention", q, k, layout, mask, scale, cu_desc, engine, (u_size, r_size), sinks,
                             chunk_size)
        plan = _usp_plan(placement, mask, ug, u_size, u, rg, r_size, g, rep, scale, engine)
        check_blocks(ring_blocks(plan.ring.schedule, g, r_size, batch, q.shape[-2] // u_size,
                                 k.shape[-2] * rep // u_size, q.shape[-1]), q, engine)
    except (ValueError, TypeError, RuntimeError) as e:
        error = e
    # Ulysses group first, then the ring group: an error seen in one Ulysses group reaches every rank.
    agree([(ug, u_size), (rg, r_size)], fields, q if torch.is_tensor(q) else None, "usp_attention", error)
    return sinks, plan, packed, need_lse


def _saved(q4, k4, v4, out4, lse4, sinks, rest):
    plan = rest[1]
    ap = plan.a2a
    kv = torch.stack([seq_to_head(_expand_kv(k4, plan.rep), ap), seq_to_head(_expand_kv(v4, plan.rep), ap)])
    return seq_to_head(q4, ap), kv, seq_to_head(out4, ap), lse_to_head(lse4, ap), sinks


register("usp", CpImpl(_prepare, UspAttnFunction, _saved))
