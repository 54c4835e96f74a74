"""Ring attention: K/V blocks travel around the CP group while each rank computes against the block it holds.

Forward, step s on rank r: post the P2P transfer of the current K/V block to r+1 (and the receive of
the next one from r-1), then compute the current block (from rank r-s) while it travels; results merge
into fp32 accumulators by LSE (the backend's out_acc/lse_acc). Which blocks a step computes, and
with which masks, is data: the RingSchedule of the layout (see schedule.py).

Backward: K/V travel the same way; the fp32 dK/dV partial sums of block j start on rank j+1 and travel
with it, so after N-1 hops each gradient arrives at its owner (rank j's own diagonal contribution
stays home). Only kv_heads travel: GQA is never expanded before communication.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ndp_kernels.segments import any_value_head

from ._common import acc_dtype, p2p_ring, prepare_call, run_bwd_step, run_fwd_step, stacked_kv_function, wait_all
from .compiled import CpImpl, dispatch, register, saved_as_given
from .schedule import RingSchedule

__all__ = ["ring_attention", "RingAttnFunction", "RingPlan", "ring_fwd", "ring_bwd"]

_KV_TAG, _DKV_TAG = 17, 18


@dataclass(frozen=True, eq=False)
class RingPlan:
    """Everything one rank needs to run a ring: group, its rank, the schedule and block sizes."""
    group: object
    world: int
    rank: int
    schedule: RingSchedule
    scale: float
    backend: object  # _common.LocalEngine

    def count(self, rank: int) -> int:
        return self.schedule.placement.counts[rank]

    def step(self, s: int):
        """(key rank, Step) of ring step s on this rank."""
        j = (self.rank - s) % self.world
        return j, self.schedule.step(self.rank, j)


_SCHEDULES = {}


def ring_schedule(placement, mask) -> RingSchedule:
    """RingSchedule per (placement, mask), cached (placements are cached per signature)."""
    key = (id(placement), mask)
    sch = _SCHEDULES.get(key)
    if sch is None or sch.placement is not placement:
        sch = RingSchedule(placement, mask)
        if len(_SCHEDULES) > 256:
            _SCHEDULES.clear()
        _SCHEDULES[key] = sch
    return sch


def ring_blocks(schedule, rank: int, world: int, batch: int, heads: int, kv_heads: int, head_dim: int):
    """(Step, q shape, k shape) of each ring step of `rank`: the blocks ring_fwd and ring_bwd run (check_blocks)."""
    counts = schedule.placement.counts
    for j in range(world):
        yield (schedule.step(rank, j), (batch, counts[rank], heads, head_dim),
               (batch, counts[j], kv_heads, head_dim))


def _kv_shape(kv: torch.Tensor, count: int):
    shape = list(kv.shape)
    shape[2] = count
    return shape


def ring_fwd(q4, kv, plan: RingPlan):
    """Ring forward. q4 ``[B, Sq, H, D]``, kv ``[2, B, Sk, Hkv, D]`` (K and V stacked, contiguous).

    Returns (out_acc, lse_acc) in fp32 (fp64 for fp64 input): ``[B, Sq, H, D]``, ``[B, H, Sq]``.
    """
    b, sq, h, d = q4.shape
    acc = acc_dtype(q4.dtype)
    out_acc = torch.zeros((b, sq, h, d), dtype=acc, device=q4.device)
    lse_acc = torch.full((b, h, sq), float("-inf"), dtype=acc, device=q4.device)
    cur = kv
    for s in range(plan.world):
        reqs, nxt = None, None
        if s < plan.world - 1:
            # Post the next block's transfer before this block's compute so the two overlap.
            nxt = kv.new_empty(_kv_shape(kv, plan.count((plan.rank - s - 1) % plan.world)))
            reqs = p2p_ring(cur, nxt, plan.group, plan.rank, plan.world, _KV_TAG)
        _, step = plan.step(s)
        if not step.empty:
            run_fwd_step(q4, cur[0], cur[1], step, out_acc, lse_acc, scale=plan.scale, backend=plan.backend)
        if reqs is not None:
            wait_all(reqs)
            cur = nxt
    return out_acc, lse_acc


def ring_bwd(dout4, q4, kv, out4, lse, plan: RingPlan):
    """Ring backward. Returns (dq_acc ``[B, Sq, H, D]``, dkv_acc ``[2, B, Sk, Hkv, D]``), fp32."""
    acc = acc_dtype(q4.dtype)
    dq = torch.zeros(q4.shape, dtype=acc, device=q4.device)
    own = torch.zeros(kv.shape, dtype=acc, device=kv.device)   # this rank's diagonal contribution
    cur = kv
    dkv_reqs, dkv_in, sending = None, None, None
    n = plan.world
    for s in range(n):
        reqs, nxt = None, None
        if s < n - 1:
            nxt = kv.new_empty(_kv_shape(kv, plan.count((plan.rank - s - 1) % n)))
            reqs = p2p_ring(cur, nxt, plan.group, plan.rank, n, _KV_TAG)
        _, step = plan.step(s)
        blk = own if s == 0 else torch.zeros(cur.shape, dtype=acc, device=cur.device)
        if not step.empty:
            run_bwd_step(dout4, q4, cur[0], cur[1], out4, lse, step, dq, blk[0], blk[1], scale=plan.scale,
                         backend=plan.backend)
        if s >= 1:
            if dkv_reqs is not None:
                # The partial sum of this block from the ranks before us; waiting here (after our
                # compute) lets the transfer overlap the block's backward.
                wait_all(dkv_reqs)
                blk += dkv_in
            dkv_in = torch.empty(_kv_shape(own, plan.count((plan.rank - s - 1) % n)), dtype=acc, device=kv.device)
            sending = blk  # keep the send buffer alive until the transfer completes
            dkv_reqs = p2p_ring(sending, dkv_in, plan.group, plan.rank, n, _DKV_TAG)
        if reqs is not None:
            wait_all(reqs)
            cur = nxt
    if dkv_reqs is not None:
        wait_all(dkv_reqs)
        own += dkv_in  # after N-1 hops the partial sum of our own block is back
    del sending
    return dq, own


# Autograd of ring attention (block math from ndp.ops); all-gather attention shares its body.
RingAttnFunction = stacked_kv_function("RingAttnFunction", ring_fwd, ring_bwd)


@any_value_head
def ring_attention(q, k, v, *, group=None, causal=True, softmax_scale=None, layout="zigzag", backend="auto",
                   window_size=(-1, -1), cu_seqlens=None, return_lse=False, deterministic=False, sinks=None,
                   chunk_size=None, softcap=0.0, bidirectional_spans=None):
    """Exact attention over a sequence sharded on the CP group, by passing K/V around a ring (autograd).

    Args:
        q: this rank's shard ``[batch, seq/N, heads, head_dim]`` (``ndp.shard_sequence(x, dim=1,
            group=group, layout=layout)``), or packed ``[local_tokens, heads, head_dim]`` with cu_seqlens.
        k, v: ``[batch, seq/N, kv_heads, head_dim]`` (packed ``[local_tokens, kv_heads, head_dim]``); v's head size
            may differ (MLA; ``any_value_head``: out then has v's).
        group: the CP ProcessGroup (None = default group) or a 1-D DeviceMesh.
        causal: causal mask over global positions.  softmax_scale: default head_dim ** -0.5.
        layout: "zigzag" | "contiguous" | "striped", the layout the inputs were sharded with.
        backend: local attention engine: "auto" (per block, the fastest exact engine measured on this
            device) or one of "sdpa" | "triton" | "flash_attn" | "flash_attn3" | "torch".
        window_size: (left, right) sliding window over global positions, -1 = unlimited.
        cu_seqlens: packed documents: the global int32 cu_seqlens (or the ``shard_packed`` result) with
            q, k, v taken as ``x[shard.index]``.
        return_lse: also return the fp32 lse ``[batch, heads, seq/N]`` (packed ``[heads, local_tokens]``).
        deterministic: bitwise-reproducible gradients (every block on an engine with a deterministic backward).
        sinks: optional ``[heads]`` attention sinks (gpt-oss), joined once after the last ring step; their
            gradient covers this rank's rows (data parallelism over the CP group sums the ranks' parts).
        chunk_size: chunked attention (Llama4): a query sees only keys of its own chunk of chunk_size global
            positions (with the causal mask / window inside it); dense input only.
        softcap: logit soft-capping (Gemma 2): every block's scores ``softcap * tanh(scores / softcap)``;
            0 = off (blocks run on an engine with soft-capping: triton, or the reference).
        bidirectional_spans: causal dense input only: ``(start, end)`` ranges of global positions inside which
            every query sees every key (a vision-language model's image blocks), each query's window (if any)
            still bounding the keys before it; the ring's schedule computes the blocks they add.
    Returns:
        out, q's shape and dtype (and lse when asked).
    Raises:
        ValueError / TypeError for bad input (raised on every rank, before any transfer; ranks called
        with different arguments get a ValueError too); RuntimeError for a missing process group.
    """
    return dispatch("ring", q, k, v, (group,), causal=causal, softmax_scale=softmax_scale, layout=layout,
                    backend=backend, window_size=window_size, cu_seqlens=cu_seqlens, return_lse=return_lse,
                    deterministic=deterministic, sinks=sinks, chunk_size=chunk_size, softcap=softcap,
                    bidirectional_spans=bidirectional_spans)


def _prepare(q, k, v, groups, need_lse=True, **kw):
    """RingAttnFunction's arguments after q, k, v: validation, the validity exchange, the plan (its forward
    always returns the lse: need_lse is for the interface)."""
    call = prepare_call("ring_attention", q, k, v, group=groups[0], **kw, blocks=lambda c: ring_blocks(
        ring_schedule(c.placement, c.mask), c.rank, c.world, c.batch, c.heads, c.kv_heads, c.head_dim))
    plan = RingPlan(call.group, call.world, call.rank, ring_schedule(call.placement, call.mask), call.scale,
                    call.backend)
    return kw["sinks"], plan, call.packed


register("ring", CpImpl(_prepare, RingAttnFunction, saved_as_given))
