"""The CP attention functions under ``torch.compile``: one custom op per direction (``ndp::cp_attention`` and
``ndp::cp_attention_backward``) that runs a whole CP call, communication included, as one graph node.

Traced code sees only the op (exact fake outputs: out in q's shape and dtype, the fp32 lse); the call's
preparation, the cross-rank validity exchange and the transfers run inside it, as in eager mode, so a bad input
on one rank still raises on every rank before any transfer. Each implementation registers (``register``) how to
prepare its call (the validity exchange and the plan, as its public function does) and what its autograd Function
saved, rebuilt from the op's inputs and outputs (q, k, v, out, lse); the backward op prepares the call again (one
more validity exchange) and runs the Function's backward. Ring and all-gather saved exactly those tensors;
Ulysses and USP saved them head-sharded, so their compiled backward moves q, k, v, out and lse to heads again
(all-to-alls eager mode does not repeat).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ndp.ops.attention import distinct_outputs
from ndp_kernels.segments import acc_dtype, flat_spans, lse_shape, paired_spans

from ._validate import resolve_group

__all__ = ["CpImpl", "register", "dispatch", "saved_as_given"]

Tensor = torch.Tensor


@dataclass(frozen=True)
class CpImpl:
    """One CP implementation as the ops run it.

    prepare(q, k, v, groups, **kw) -> the Function's arguments after (q, k, v): validates, agrees across ranks
        and plans (what the public function does before ``Function.apply``); lse is always asked for.
    function: the autograd Function (its forward and backward are called with a stand-in ctx).
    saved(q4, k4, v4, out4, lse4, sinks, rest) -> what the Function's forward saved for backward.
    """
    prepare: Callable
    function: type
    saved: Callable


_IMPLS: dict[str, CpImpl] = {}


def register(name: str, impl: CpImpl) -> None:
    _IMPLS[name] = impl


def saved_as_given(q4, k4, v4, out4, lse4, sinks, rest):
    """CpImpl.saved of a Function that saves q, k, v, out, lse and the sinks as they are (ring, all-gather)."""
    return q4, k4, v4, out4, lse4, sinks


class _Ctx:
    """What an autograd Function's forward and backward use of their ctx, outside autograd."""

    def __init__(self, saved=()):
        self.saved_tensors = tuple(saved)

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors):
        pass


def _groups(group: str, group2: str):
    """The process groups the op's names stand for (group2 "" when the call has one group)."""
    return [dist.distributed_c10d._resolve_process_group(n) for n in (group, group2) if n]


def _kwargs(cu_seqlens, sinks, causal, scale, left, right, layout, backend, deterministic, chunk_size, softcap, spans):
    return dict(cu_seqlens=cu_seqlens, sinks=sinks, causal=causal, softmax_scale=scale, window_size=(left, right),
                layout=layout, backend=backend, deterministic=deterministic,
                chunk_size=None if chunk_size < 0 else chunk_size, softcap=softcap,
                bidirectional_spans=paired_spans(spans))


@torch.library.custom_op("ndp::cp_attention", mutates_args=())
def _cp_attention(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, cu_seqlens: Tensor | None, impl: str,
                  group: str, group2: str, causal: bool, scale: float, left: int, right: int, layout: str, backend: str,
                  deterministic: bool, chunk_size: int, softcap: float, spans: list[int]) -> tuple[Tensor, Tensor]:
    cp = _IMPLS[impl]
    kw = _kwargs(cu_seqlens, sinks, causal, scale, left, right, layout, backend, deterministic, chunk_size, softcap,
                 spans)
    rest = cp.prepare(q, k, v, _groups(group, group2), **kw)
    out, lse = cp.function.forward(_Ctx(), q, k, v, *rest)
    return distinct_outputs((out, lse), (q, k, v, sinks))


@_cp_attention.register_fake
def _cp_attention_fake(q, k, v, sinks, cu_seqlens, impl, group, group2, causal, scale, left, right, layout, backend,
                       deterministic, chunk_size, softcap, spans):
    return q.new_empty(q.shape), q.new_empty(lse_shape(q, cu_seqlens is not None), dtype=acc_dtype(q.dtype))


@torch.library.custom_op("ndp::cp_attention_backward", mutates_args=())
def _cp_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                           sinks: Tensor | None, cu_seqlens: Tensor | None, impl: str, group: str, group2: str,
                           causal: bool, scale: float, left: int, right: int, layout: str, backend: str,
                           deterministic: bool, chunk_size: int, softcap: float,
                           spans: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    cp = _IMPLS[impl]
    kw = _kwargs(cu_seqlens, sinks, causal, scale, left, right, layout, backend, deterministic, chunk_size, softcap,
                 spans)
    rest = cp.prepare(q, k, v, _groups(group, group2), **kw)
    packed = cu_seqlens is not None
    q4, k4, v4, out4, lse4 = (x.unsqueeze(0) if packed else x for x in (q, k, v, out, lse))
    ctx = _Ctx(cp.saved(q4.contiguous(), k4, v4, out4, lse4, sinks, rest))
    ctx.plan, ctx.packed = rest[1], packed
    dq, dk, dv, dsinks, *_ = cp.function.backward(ctx, dout.contiguous(), None)
    dsinks = q.new_empty(0) if dsinks is None else dsinks
    return distinct_outputs((dq, dk, dv, dsinks), (dout, q, k, v, out, lse, sinks))


@_cp_attention_backward.register_fake
def _cp_attention_backward_fake(dout, q, k, v, out, lse, sinks, *args):
    dsinks = q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, cu_seqlens, *rest = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], sinks, cu_seqlens)
    ctx.rest = rest
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, sinks, cu_seqlens = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.ndp.cp_attention_backward(dout, q, k, v, out, lse, sinks, cu_seqlens, *ctx.rest)
    return dq, dk, dv, None if sinks is None else dsinks, None, *([None] * len(ctx.rest))


torch.library.register_autograd("ndp::cp_attention", _backward, setup_context=_setup_context)


def dispatch(impl: str, q, k, v, groups, *, return_lse=False, **kw):
    """Run a CP call of the registered implementation `impl`: eagerly its autograd Function on the prepared
    arguments; while torch.compile traces, the op (the CP public functions' one body).

    Args:
        groups: the call's process groups (or 1-D meshes; None = the default group): one, USP's two.
        kw: the public function's keywords (causal, softmax_scale, layout, backend, window_size, cu_seqlens,
            deterministic, sinks, chunk_size, softcap, bidirectional_spans).
    """
    if torch.compiler.is_compiling():
        return _op_call(impl, q, k, v, groups, return_lse=return_lse, **kw)
    cp = _IMPLS[impl]
    out, lse = cp.function.apply(q, k, v, *cp.prepare(q, k, v, groups, need_lse=bool(return_lse), **kw))
    return (out, lse) if return_lse else out


def _op_call(impl: str, q, k, v, groups, *, causal, softmax_scale, layout, backend, window_size, cu_seqlens,
             return_lse, deterministic, sinks, chunk_size, softcap, bidirectional_spans):
    """The call as the op ``ndp::cp_attention``.

    Raises:
        TypeError: cu_seqlens given as a ``shard_packed`` result (pass the global cu_seqlens tensor when
            compiling: the op takes tensors).
    """
    if cu_seqlens is not None and not torch.is_tensor(cu_seqlens):
        raise TypeError(f"{impl}_attention under torch.compile takes cu_seqlens as the global int32 tensor, not a "
                        f"{type(cu_seqlens).__name__}; pass shard.cu_seqlens.")
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    left, right = window_size
    names = [resolve_group(g)[0].group_name for g in groups] + [""]
    out, lse = torch.ops.ndp.cp_attention(
        q, k, v, sinks, cu_seqlens, impl, names[0], names[1], bool(causal), float(softmax_scale),
        int(left), int(right), layout, backend, bool(deterministic), -1 if chunk_size is None else int(chunk_size),
        float(softcap or 0.0), flat_spans(bidirectional_spans))
    return (out, lse) if return_lse else out
