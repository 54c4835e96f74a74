"""Pieces shared by the CP implementations: call preparation (validation + cached plans), P2P helpers."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ndp.ops.attention import engine_for
from ndp.ops.sinks import add_sinks, check_sinks, sinks_grad
from ndp_kernels.segments import Segments, acc_dtype, check_softcap, check_spans

from ._validate import agree, check_common, check_layout, resolve_group_or_input_error
from .schedule import Mask, Placement, Step
from .sharding import PackedShard, _check_divisible, _require_ops, packed_shard
from .stats import nbytes, record_comm, record_flops

__all__ = ["Call", "LocalEngine", "prepare_call", "check_blocks", "to_segments", "run_fwd_step", "run_bwd_step",
           "p2p_ring", "acc_dtype", "stacked_kv_function", "mask_of"]


@dataclass(frozen=True)
class LocalEngine:
    """How a CP call runs its blocks: the ndp.ops backend ("auto" = measured per block), whether the
    gradients must be bitwise reproducible, and the logit soft-cap of every block (0 = none)."""
    backend: str = "auto"
    deterministic: bool = False
    softcap: float = 0.0


@dataclass(frozen=True, eq=False)
class Call:
    """A validated CP attention call: group, geometry, mask, and where the tokens live."""
    group: object
    world: int
    rank: int
    layout: str
    mask: Mask
    scale: float
    backend: LocalEngine
    packed: bool
    placement: Placement
    batch: int
    heads: int
    kv_heads: int
    head_dim: int


def prepare_call(impl, q, k, v, *, group, causal, softmax_scale, window_size, layout, cu_seqlens, backend,
                 deterministic=False, sinks=None, chunk_size=None, softcap=0.0, bidirectional_spans=None,
                 extra=None, pre_check=None, blocks=None) -> Call:
    """Validates a public CP call on this rank, then agrees with the other ranks (one small all-gather).

    A local failure does not raise before the exchange: the rank reports it there, so that every rank
    of the group raises instead of one raising and the others waiting in a transfer. `blocks(call)` yields the
    blocks this rank will compute (see ``check_blocks``): an engine that cannot run one is such a failure.

    Raises:
        ValueError / TypeError naming the constraint, values and fix (on every rank of the group);
        RuntimeError for a bad environment.
    """
    _require_ops()
    from ndp.ops import resolve_backend

    pg, world, rank = resolve_group_or_input_error(group, lambda: check_common(
        q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size, cu_seqlens=cu_seqlens))
    fields, error, call = None, None, None
    try:
        window, scale, packed = check_common(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                             window_size=window_size, cu_seqlens=cu_seqlens)
        layout = check_layout(layout)
        resolve_backend(backend, q.device)
        engine = local_engine(backend, deterministic, softcap)
        check_sinks(sinks, q.shape[-2], q.device)
        if pre_check is not None:
            pre_check(world)
        placement, cu_desc, batch = placement_for(impl, q, world, rank, layout, cu_seqlens, chunk_size)
        mask = mask_of(impl, causal, window, bidirectional_spans, placement, packed, chunk_size)
        fields = call_fields(impl, q, k, layout, mask, scale, cu_desc, engine, extra, sinks, chunk_size)
        call = Call(pg, world, rank, layout, mask, scale, engine, packed, placement, batch, q.shape[-2], k.shape[-2],
                    q.shape[-1])
        if blocks is not None:
            check_blocks(blocks(call), q, engine)
    except (ValueError, TypeError, RuntimeError) as e:
        error = e
    agree([(pg, world)], fields, q if torch.is_tensor(q) else None, impl, error)
    return call


def check_blocks(blocks, like, engine: LocalEngine) -> None:
    """Raises where `engine` cannot run one of this rank's blocks: `blocks` yields (Step, q shape, k shape) as the
    call's steps will run them (forward, and the backward when deterministic). A CP call checks them before its
    validity exchange, so a forced engine that cannot run a block (a dtype, a layout, a head ratio) is refused on
    every rank before any transfer, not inside a step with transfers in flight that leaves the others waiting.

    Raises:
        ValueError / TypeError: a forced engine cannot run a block (``ndp.ops.engine_for``'s message);
        RuntimeError: no engine of ``auto`` can.
    """
    for step, q_shape, k_shape in blocks:
        if not step.empty:
            _check_step(step.passes, tuple(q_shape), tuple(k_shape), like.dtype, like.device, engine)


@functools.lru_cache(maxsize=4096)
def _check_step(passes, q_shape, k_shape, dtype, device, engine: LocalEngine) -> None:
    # Zero-stride stand-ins: the engines' checks read shapes, dtype and device only. Cached when they pass.
    q4, k4 = (torch.empty((), dtype=dtype, device=device).expand(shape) for shape in (q_shape, k_shape))
    for rows in passes:
        for det in {False, engine.deterministic}:
            engine_for(engine.backend, _segs_of_pass(rows), q4, k4, deterministic=det, softcap=engine.softcap)


def local_engine(backend, deterministic, softcap=0.0) -> LocalEngine:
    """The validated LocalEngine of a call.

    Raises:
        TypeError when deterministic is not a bool; TypeError / ValueError for a bad softcap.
    """
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool; got {deterministic!r}")
    return LocalEngine(backend, deterministic, check_softcap(softcap))


def mask_of(impl, causal, window, spans, placement, packed: bool, chunk_size) -> Mask:
    """The call's global Mask; `spans` (``bidirectional_spans``) checked against the whole sequence.

    Raises:
        ValueError / TypeError: spans malformed (``check_spans``), or given with packed documents or chunks.
    """
    spans = check_spans(spans, placement.total, causal)
    if spans and (packed or chunk_size is not None):
        raise ValueError(f"{impl}: bidirectional_spans apply to dense sequences; got them with "
                         f"{'packed documents (cu_seqlens)' if packed else f'chunk_size={chunk_size}'}. Pass one.")
    return Mask(causal, tuple(window), spans)


def call_fields(impl, q, k, layout, mask, scale, cu_desc, backend, extra, sinks=None, chunk_size=None):
    """What every rank of a group must agree on (compared by ``agree``)."""
    packed = cu_desc is not None
    return dict(impl=impl, layout=None if packed else layout, causal=mask.causal, window=mask.window, spans=mask.spans,
                sinks=None if sinks is None else str(sinks.dtype), chunk_size=chunk_size,
                scale=scale, dtype=str(q.dtype), device=q.device.type,
                q_shape=tuple(q.shape[-2:]) if packed else tuple(q.shape),
                kv_shape=tuple(k.shape[-2:]) if packed else tuple(k.shape), packed=cu_desc,
                backend=backend.backend, deterministic=backend.deterministic, softcap=backend.softcap,
                extra=extra)


def placement_for(impl, q, world, rank, layout, cu_seqlens, chunk_size=None):
    """(Placement, cu_seqlens signature or None, batch) of a CP call over `world` ranks (this one `rank`).
    With `chunk_size` (dense input only) attention stays inside chunks of that many global positions."""
    packed = cu_seqlens is not None
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise TypeError(f"{impl}: chunk_size must be a positive int or None; got {chunk_size!r}")
        if packed:
            raise ValueError(f"{impl}: chunk_size (chunked attention) with packed documents (cu_seqlens) is not "
                             f"supported: split the documents into chunks in cu_seqlens instead.")
    if packed:
        if isinstance(cu_seqlens, PackedShard):
            ps = cu_seqlens
            if ps.world_size != world or ps.rank != rank:
                raise ValueError(f"{impl}: cu_seqlens is a shard_packed result for world_size={ps.world_size}, "
                                 f"rank={ps.rank}, but the group has world_size={world} and this is rank {rank}. "
                                 f"Call shard_packed with the same group.")
        else:
            ps = packed_shard(cu_seqlens, world, rank)
        placement = ps.placement
        if q.shape[0] != ps.counts[rank]:
            raise ValueError(f"{impl}: packed q has {q.shape[0]} tokens but shard_packed gives this rank (rank "
                             f"{rank} of {world}) {ps.counts[rank]} of the {placement.total} tokens in cu_seqlens. "
                             f"Take x[shard.index] with shard = ndp.shard_packed(cu_seqlens, group=<the CP group>) and "
                             f"pass that shard (or the same global cu_seqlens) as cu_seqlens.")
        cu_desc = ps.signature
        batch = 1
    else:
        seqlen = q.shape[1] * world
        _check_divisible(seqlen, world, layout)
        placement = (Placement.dense(seqlen, world, layout) if chunk_size is None or chunk_size >= seqlen
                     else Placement.chunked(seqlen, world, layout, chunk_size))
        cu_desc = None
        batch = q.shape[0]
    return placement, cu_desc, batch


@functools.lru_cache(maxsize=4096)
def _segs_of_pass(rows: tuple) -> Segments:
    return Segments.from_rows(rows)


def to_segments(step: Step) -> tuple:
    """The step's passes as Segments tables (cached)."""
    return tuple(_segs_of_pass(p) for p in step.passes)


def run_fwd_step(q4, k4, v4, step: Step, out_acc, lse_acc, *, scale, backend: LocalEngine):
    """Merges the attention of one step's blocks into the fp32 accumulators."""
    from ndp.ops import attention_fwd

    for segs in to_segments(step):
        attention_fwd(q4, k4, v4, segs, softmax_scale=scale, out_acc=out_acc, lse_acc=lse_acc,
                      backend=backend.backend, softcap=backend.softcap)
    b, _, h, d = q4.shape
    record_flops(4 * b * h * d * step.pairs)


def run_bwd_step(dout4, q4, k4, v4, out4, lse, step: Step, dq_acc, dk_acc, dv_acc, *, scale,
                 backend: LocalEngine):
    """Adds one step's gradients into the accumulators."""
    from ndp.ops import attention_bwd

    for segs in to_segments(step):
        attention_bwd(dout4, q4, k4, v4, out4, lse, segs, softmax_scale=scale, dq_acc=dq_acc, dk_acc=dk_acc,
                      dv_acc=dv_acc, backend=backend.backend, deterministic=backend.deterministic,
                      softcap=backend.softcap)
    b, _, h, d = q4.shape
    record_flops(int(2.5 * 4 * b * h * d * step.pairs), backward=True)


def stacked_kv_function(name: str, fwd, bwd) -> type:
    """The autograd Function of a CP algorithm whose K and V travel as one stacked buffer (ring, all-gather):
    ``fwd(q4, kv, plan) -> (out, lse)`` and ``bwd(dout4, q4, kv, out, lse, plan) -> (dq, dkv)`` on dense
    ``[B, S, H, D]`` tensors (packed input is one row). The Function saves and restores context only; sinks join
    once after the last block. Its arguments after q, k, v: (sinks, plan, packed)."""

    def forward(ctx, q, k, v, sinks, plan, packed):
        q4, k4, v4 = (x.unsqueeze(0) if packed else x for x in (q, k, v))
        q4 = q4.contiguous()
        out, lse = fwd(q4, torch.stack([k4, v4]), plan)  # one buffer: K and V travel in one message
        out, lse = (out.to(q.dtype), lse) if sinks is None else add_sinks(out, lse, sinks, q.dtype)
        ctx.save_for_backward(q4, k4, v4, out, lse, sinks)
        ctx.plan, ctx.packed = plan, packed
        ctx.mark_non_differentiable(lse)
        return (out[0], lse[0]) if packed else (out, lse)

    def backward(ctx, dout, _dlse):
        q4, k4, v4, out, lse, sinks = ctx.saved_tensors
        dout4 = (dout.unsqueeze(0) if ctx.packed else dout).contiguous()
        dq, dkv = bwd(dout4, q4, torch.stack([k4, v4]), out, lse, ctx.plan)
        dq, dk, dv = dq.to(q4.dtype), dkv[0].to(k4.dtype), dkv[1].to(v4.dtype)
        dsinks = None if sinks is None else sinks_grad(dout4, out, lse, sinks)
        if ctx.packed:
            dq, dk, dv = dq[0], dk[0], dv[0]
        return dq, dk, dv, dsinks, None, None

    methods = {"forward": staticmethod(forward), "backward": staticmethod(backward), "__doc__": f"Autograd of {name}."}
    return type(name, (torch.autograd.Function,), methods)


def p2p_ring(send, recv, group, rank, world, tag):
    """Posts send->rank+1 and recv<-rank-1 on `group` (one batch); returns the requests."""
    ops = [dist.P2POp(dist.isend, send, group=group, group_peer=(rank + 1) % world, tag=tag),
           dist.P2POp(dist.irecv, recv, group=group, group_peer=(rank - 1) % world, tag=tag)]
    reqs = dist.batch_isend_irecv(ops)
    record_comm("p2p", nbytes(send), nbytes(recv))
    return reqs


def on_device(cache: dict, name: str, tensor: torch.Tensor, device) -> torch.Tensor:
    """`tensor` on `device`, copied once per (name, device) and kept in `cache`: plans are reused on every
    call, so their index tensors must not cross to the GPU again each time."""
    key = (name, str(device))
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = tensor.to(device)
    return hit


def wait_all(reqs):
    for r in reqs or ():
        r.wait()
