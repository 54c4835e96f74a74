"""All-gather attention (llama3-style CP): all-gather K/V, attend the local queries to the whole sequence.

K/V are all-gathered in kv-head slices: the gather of slice i+1 is in flight while slice i computes.
The gathered keys are put in global order (or rank-major order for striped queries), so causal masks,
windows and packed documents are plain segments over global positions: no merge of partial results.
Backward re-gathers K/V the same way and reduce-scatters the fp32 dK/dV to their owners.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ndp_kernels.segments import any_value_head

from ._common import acc_dtype, on_device, prepare_call, run_bwd_step, run_fwd_step, stacked_kv_function
from .compiled import CpImpl, dispatch, register, saved_as_given
from .schedule import build_step
from .stats import all_gather_flat, reduce_scatter_flat

__all__ = ["allgather_attention", "AllGatherAttnFunction"]

_MAX_HEAD_SLICES = 2


@dataclass(frozen=True, eq=False)
class GatherOrder:
    """Group-independent part of an all-gather plan (cached; caches never hold process groups)."""
    counts: tuple
    tmax: int             # padded per-rank rows in the gather buffer (uneven packed shards)
    index: torch.Tensor   # row t of the ordered keys = row index[t] of the padded rank-major buffer
    step: object          # Step: local queries against the ordered keys
    _on: dict

    def idx(self, device):
        return on_device(self._on, "index", self.index, device)


@dataclass(frozen=True, eq=False)
class AllGatherPlan:
    group: object
    world: int
    rank: int
    ord: GatherOrder
    scale: float
    backend: object  # _common.LocalEngine

    @property
    def tmax(self):
        return self.ord.tmax

    @property
    def step(self):
        return self.ord.step

    def idx(self, device):
        return self.ord.idx(device)


_CACHE = {}


def _allgather_plan(call):
    key = (id(call.placement), call.rank, call.mask)
    hit = _CACHE.get(key)
    if hit is None or hit[0] is not call.placement:
        pl = call.placement
        counts = pl.counts
        tmax = max(counts)
        padded = np.concatenate([j * tmax + np.arange(c) for j, c in enumerate(counts)])
        cat = np.concatenate(pl.positions)
        q_runs = pl.runs(call.rank)
        # Keys in global order give one band per query run, unless the query runs are strided (striped):
        # then the rank-major order keeps one band per (query run, key rank) pair.
        strided = any(r.stride > 1 and r.length > 1 for r in q_runs)
        order = np.arange(len(cat)) if strided else np.argsort(cat, kind="stable")
        step = build_step(q_runs, pl.gathered_runs(cat[order]), call.mask)
        hit = (pl, GatherOrder(counts, tmax, torch.from_numpy(padded[order]), step, {}))
        if len(_CACHE) > 256:
            _CACHE.clear()
        _CACHE[key] = hit
    return AllGatherPlan(call.group, call.world, call.rank, hit[1], call.scale, call.backend)


def _blocks(call):
    """The blocks _allgather_fwd / _bwd run (check_blocks): each head slice's queries against every key."""
    a, b = _head_slices(call.kv_heads)[0]
    counts, g = call.placement.counts, call.heads // call.kv_heads
    yield (_allgather_plan(call).step, (call.batch, counts[call.rank], (b - a) * g, call.head_dim),
           (call.batch, sum(counts), b - a, call.head_dim))


def _head_slices(kv_heads):
    n = max(p for p in range(1, _MAX_HEAD_SLICES + 1) if kv_heads % p == 0)
    w = kv_heads // n
    return [(i * w, (i + 1) * w) for i in range(n)]


def _start_gather(kv, sl, plan):
    """Posts the all-gather of kv heads [a, b) (padded to tmax rows); returns (work, buffer)."""
    a, b = sl
    part = kv[:, :, :, a:b]
    tl = part.shape[2]
    if tl != plan.tmax:
        pad = part.new_zeros(part.shape[:2] + (plan.tmax,) + part.shape[3:])
        pad[:, :, :tl] = part
        part = pad
    part = part.contiguous()
    out = part.new_empty((plan.world,) + tuple(part.shape))
    work = all_gather_flat(out.view(-1), part.view(-1), plan.group, async_op=True) if plan.world > 1 else None
    if work is None:
        out.copy_(part.unsqueeze(0))
    return work, out


def _ordered(gathered, plan):
    """[N, 2, B, tmax, h, D] -> [2, B, T, h, D] keys in the plan's order."""
    n, two, b, tmax, h, d = gathered.shape
    rm = gathered.permute(1, 2, 0, 3, 4, 5).reshape(two, b, n * tmax, h, d)
    return rm.index_select(2, plan.idx(gathered.device))


def _slices_of_q(q4, sl, group_size):
    a, b = sl
    return q4[:, :, a * group_size:b * group_size].contiguous()


def _allgather_fwd(q4, kv, plan):
    bsz, sq, h, d = q4.shape
    hk = kv.shape[3]
    g = h // hk
    acc = acc_dtype(q4.dtype)
    out = torch.empty((bsz, sq, h, d), dtype=q4.dtype, device=q4.device)
    lse = torch.empty((bsz, h, sq), dtype=acc, device=q4.device)
    slices = _head_slices(hk)
    pending = _start_gather(kv, slices[0], plan)
    for i, sl in enumerate(slices):
        work, buf = pending
        if i + 1 < len(slices):
            pending = _start_gather(kv, slices[i + 1], plan)  # next slice travels during this compute
        if work is not None:
            work.wait()
        kvf = _ordered(buf, plan)
        qs = _slices_of_q(q4, sl, g)
        o_acc = torch.zeros(qs.shape, dtype=acc, device=q4.device)
        l_acc = torch.full((bsz, qs.shape[2], sq), float("-inf"), dtype=acc, device=q4.device)
        if not plan.step.empty:
            run_fwd_step(qs, kvf[0], kvf[1], plan.step, o_acc, l_acc, scale=plan.scale, backend=plan.backend)
        out[:, :, sl[0] * g:sl[1] * g] = o_acc.to(q4.dtype)
        lse[:, sl[0] * g:sl[1] * g] = l_acc
    return out, lse


def _allgather_bwd(dout4, q4, kv, out4, lse, plan):
    bsz, sq, h, d = q4.shape
    hk = kv.shape[3]
    g = h // hk
    acc = acc_dtype(q4.dtype)
    dq = torch.empty(q4.shape, dtype=q4.dtype, device=q4.device)
    dkv = torch.empty(kv.shape, dtype=acc, device=kv.device)
    slices = _head_slices(hk)
    pending = _start_gather(kv, slices[0], plan)
    scatters = []
    tl = kv.shape[2]
    for i, sl in enumerate(slices):
        work, buf = pending
        if i + 1 < len(slices):
            pending = _start_gather(kv, slices[i + 1], plan)
        if work is not None:
            work.wait()
        kvf = _ordered(buf, plan)
        a, b = sl
        qs, dos, os_ = (_slices_of_q(x, sl, g) for x in (q4, dout4, out4))
        ls = lse[:, a * g:b * g].contiguous()
        dq_acc = torch.zeros(qs.shape, dtype=acc, device=q4.device)
        dkf = torch.zeros(kvf.shape, dtype=acc, device=q4.device)
        if not plan.step.empty:
            run_bwd_step(dos, qs, kvf[0], kvf[1], os_, ls, plan.step, dq_acc, dkf[0], dkf[1], scale=plan.scale,
                         backend=plan.backend)
        dq[:, :, a * g:b * g] = dq_acc.to(q4.dtype)
        # Back to the padded rank-major layout, then reduce-scatter (fp32 sums) to the owners.
        two, bb, _, hh, dd = dkf.shape
        rm = torch.zeros((two, bb, plan.world * plan.tmax, hh, dd), dtype=acc, device=q4.device)
        rm.index_copy_(2, plan.idx(q4.device), dkf)
        send = rm.view(two, bb, plan.world, plan.tmax, hh, dd).permute(2, 0, 1, 3, 4, 5).contiguous()
        mine = torch.empty(send.shape[1:], dtype=acc, device=q4.device)
        if plan.world > 1:
            scatters.append((reduce_scatter_flat(mine.view(-1), send.view(-1), plan.group, async_op=True), mine, sl))
        else:
            mine.copy_(send[0])
            scatters.append((None, mine, sl))
    for work, mine, (a, b) in scatters:
        if work is not None:
            work.wait()
        dkv[:, :, :, a:b] = mine[:, :, :tl]
    return dq, dkv


# Autograd of all-gather attention (block math from ndp.ops); ring attention shares its body.
AllGatherAttnFunction = stacked_kv_function("AllGatherAttnFunction", _allgather_fwd, _allgather_bwd)


@any_value_head
def allgather_attention(q, k, v, *, group=None, causal=True, softmax_scale=None, layout="zigzag", backend="auto",
                        window_size=(-1, -1), cu_seqlens=None, return_lse=False, deterministic=False, sinks=None,
                        chunk_size=None, softcap=0.0, bidirectional_spans=None):
    """Exact attention over a sequence sharded on the group, by all-gathering K/V (autograd).

    Args:
        q: this rank's shard ``[batch, seq/N, heads, head_dim]`` (``ndp.shard_sequence`` over `group`),
            or packed ``[local_tokens, heads, head_dim]`` with cu_seqlens.
        k, v: ``[batch, seq/N, kv_heads, head_dim]`` (packed ``[local_tokens, kv_heads, head_dim]``); v's head size
            may differ (MLA; ``any_value_head``: out then has v's).
        group, causal, softmax_scale, layout, backend, window_size, cu_seqlens, return_lse, deterministic, sinks,
            chunk_size, softcap, bidirectional_spans: as in ``ndp.ring_attention``.
    Returns:
        out (q's shape and dtype), and the lse when asked.
    Raises:
        ValueError / TypeError for bad input, on every rank before any transfer.
    """
    return dispatch("allgather", q, k, v, (group,), causal=causal, softmax_scale=softmax_scale, layout=layout,
                    backend=backend, window_size=window_size, cu_seqlens=cu_seqlens, return_lse=return_lse,
                    deterministic=deterministic, sinks=sinks, chunk_size=chunk_size, softcap=softcap,
                    bidirectional_spans=bidirectional_spans)


def _prepare(q, k, v, groups, need_lse=True, **kw):
    """AllGatherAttnFunction's arguments after q, k, v: validation, the validity exchange, the plan (its forward
    always returns the lse: need_lse is for the interface)."""
    call = prepare_call("allgather_attention", q, k, v, group=groups[0], **kw, blocks=_blocks)
    return kw["sinks"], _allgather_plan(call), call.packed


register("allgather", CpImpl(_prepare, AllGatherAttnFunction, saved_as_given))
