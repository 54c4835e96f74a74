"""Local (one-device) attention engines behind one interface.

Engines (one module each, named in ``engines.ENGINE_MODULES``): ``sdpa`` (``_sdpa``: torch's fused SDPA kernels
with log-sum-exp: CPU flash; CUDA cuDNN, flash, efficient), ``triton`` (``_triton``: ``ndp_kernels`` kernels; on
CPU only under the Triton interpreter), ``flash_attn`` / ``flash_attn3`` (``_flash_attn``, ``_flash_attn3``:
flash-attn's CUDA kernels when importable), ``torch`` (``_reference``: plain PyTorch, the materialising
reference, float64 capable). ``auto`` picks per block the fastest engine that is exact for it, from
measurements (see ``engines.py``). Every engine keeps the same conventions, including the fp32 accumulators of
ring steps.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ndp_kernels.segments import (acc_dtype, any_value_head, check_call, check_softcap, check_spans, flat_spans,
                                   lse_shape, packed_rows_cu, paired_spans, run_bwd, segments_of)

from .engines import ENGINE_MODULES, ENGINES, block_class, capable, choose, engine_available, engine_module
from .sinks import add_sinks, check_sinks, sinks_grad

BACKENDS = ("auto",) + ENGINES


def _check_backend(backend) -> None:
    if backend != "auto" and backend not in ENGINE_MODULES:
        raise ValueError(f"backend must be one of {('auto',) + tuple(ENGINE_MODULES)}; got {backend!r}")


def available_backends(device="cpu") -> dict[str, tuple[bool, str]]:
    """Map engine name -> (usable on `device`, reason when not)."""
    return {e: engine_available(e, device) for e in ENGINE_MODULES}


def resolve_backend(backend: str, device) -> str:
    """Validate ``backend`` for ``device``: "auto" (chosen per block) or an engine that can run here.

    Returns:
        the backend name ("auto" stays "auto": the engine is chosen per block).
    Raises:
        ValueError: unknown name.  RuntimeError: the engine cannot run here (the message says why).
    """
    _check_backend(backend)
    if backend == "auto":
        return backend
    device = torch.device(device)
    ok, why = engine_available(backend, device)
    if not ok:
        raise RuntimeError(f"attention backend {backend!r} is not available on {device}: {why}. "
                           f"Use backend='auto' or 'torch'.")
    return backend


def engine_for(backend, segs, q4, k4, *, deterministic=False, softcap=0.0) -> str:
    """The engine that runs this block: the forced one (checked to be exact for it) or auto's choice.

    Raises:
        ValueError / RuntimeError: unknown or unavailable engine; TypeError / ValueError: the forced
        engine cannot run this block (names the block and the engines that can).
    """
    if backend == "auto":
        return choose(segs, q4, k4, deterministic=deterministic, softcap=softcap)
    resolve_backend(backend, q4.device)
    ok, why = capable(backend, segs, q4, k4, deterministic=deterministic, softcap=softcap)
    if not ok:
        able = [e for e in ENGINE_MODULES if engine_available(e, q4.device)[0]
                and capable(e, segs, q4, k4, deterministic=deterministic, softcap=softcap)[0]]
        cls = block_class(segs, q4.shape[1], k4.shape[1])
        err = TypeError if q4.dtype == torch.float64 and not softcap else ValueError
        traits = (", deterministic" if deterministic else "") + (f", softcap {softcap:g}" if softcap else "")
        raise err(f"backend {backend!r} cannot run this {cls} attention block ({q4.dtype}, head_dim "
                  f"{q4.shape[-1]}{traits}): {why}. Engines that can here: {able}; use one of them or "
                  f"backend='auto'.")
    return backend


def attention_fwd(q4, k4, v4, segs, *, softmax_scale, out_acc=None, lse_acc=None, backend="auto", softcap=0.0):
    """Segment-level forward of one block (what a ring step calls).

    Args:
        q4: ``[B, Sq, H, D]``; k4, v4: ``[B, Sk, Hkv, D]``; segs: ``ndp_kernels.Segments``.
        out_acc: optional fp32 ``[B, Sq, H, D]``; lse_acc: optional fp32 ``[B, H, Sq]``; merged into in place.
        backend: "auto" (per-block measured choice) or one engine of ``ENGINES``.
        softcap: logit soft-cap c > 0 (scores c * tanh(scores / c)), 0 = off (``SOFTCAP_ENGINES`` only).
    Returns:
        (out, lse) or (out_acc, lse_acc).
    Raises:
        ValueError / RuntimeError for an unknown or unavailable backend, or one that cannot run the block.
    """
    return _engine_fwd(engine_for(backend, segs, q4, k4, softcap=softcap), q4, k4, v4, segs,
                       softmax_scale=softmax_scale, out_acc=out_acc, lse_acc=lse_acc, softcap=softcap)


def _engine_fwd(engine, q4, k4, v4, segs, *, softmax_scale, out_acc=None, lse_acc=None, softcap=0.0):
    """attention_fwd on `engine`, which ``engine_for`` chose or checked for this block."""
    kw = dict(softmax_scale=softmax_scale, out_acc=out_acc, lse_acc=lse_acc)
    if softcap:  # only the engines of SOFTCAP_ENGINES get here with it
        kw["softcap"] = softcap
    return engine_module(engine).fwd(q4, k4, v4, segs, **kw)


def attention_bwd(dout4, q4, k4, v4, out4, lse3, segs, *, softmax_scale, dq_acc=None, dk_acc=None, dv_acc=None,
                  backend="auto", deterministic=False, softcap=0.0):
    """Segment-level backward of one block, given the rows' final out and lse.

    Args:
        deterministic: bitwise-reproducible gradients (engines without such a mode are not used).
        softcap: the forward's soft-cap (0 = off).
    Returns:
        (dq, dk, dv), or the fp32 accumulators with this block's gradients added.
    """
    be = engine_for(backend, segs, q4, k4, deterministic=deterministic, softcap=softcap)
    kw = dict(softmax_scale=softmax_scale, dq_acc=dq_acc, dk_acc=dk_acc, dv_acc=dv_acc)
    if softcap:
        kw["softcap"] = softcap
    return engine_module(be).bwd(dout4, q4, k4, v4, out4, lse3, segs, deterministic=deterministic, **kw)


# ndp.ops.attention is the custom op ``ndp::attention`` (and ``ndp::attention_backward``): torch.compile traces
# it as one node with exact fake outputs, while the segment table is built from host data inside the op, where
# a cu_seqlens' values may be read (a graph break in traced Python).
Tensor = torch.Tensor


def distinct_outputs(outputs, inputs) -> tuple:
    """`outputs` contiguous, each one copied where it shares memory with an input or an earlier output (views of
    one buffer, e.g. dK and dV of a stacked accumulator): a custom op's outputs may not alias (torch.library)."""
    seen = {x.untyped_storage().data_ptr() for x in inputs if torch.is_tensor(x) and x.numel()}
    out = []
    for x in outputs:
        x = x.contiguous()
        ptr = x.untyped_storage().data_ptr()
        if x.numel() and ptr in seen:
            x = x.clone()
        seen.add(x.untyped_storage().data_ptr())
        out.append(x)
    return tuple(out)


class _Layout:
    """How the op's tensors are viewed as the 4-D blocks of ``attention_fwd``: dense ``[B, S, H, D]`` as they
    are; packed ``[T, H, D]`` as one row; dense rows whose ``position_ids`` restart (transformers' packed rows)
    as one row of ``B * S`` tokens. lse: ``[B, H, S]`` / ``[H, T]`` outside, ``[B', H, S']`` inside."""

    def __init__(self, q, k, cu_q, cu_k, pos, causal, window, max_q, max_k, spans):
        self.rows = None
        if cu_q is None and pos is not None:
            cu_q = cu_k = packed_rows_cu(pos, q.shape[0], q.shape[1])
            if cu_q is not None:
                self.rows = q.shape[:2]
        self.packed = cu_q is not None and self.rows is None
        flat = (lambda x: x.reshape(-1, *x.shape[2:])) if self.rows is not None else (lambda x: x)
        self.segs = segments_of(flat(q), flat(k), causal=causal, window_size=window, cu_seqlens_q=cu_q,
                                cu_seqlens_k=cu_k, max_seqlen_q=None if max_q < 0 else max_q,
                                max_seqlen_k=None if max_k < 0 else max_k, spans=paired_spans(spans))

    def block(self, x):
        """A q/k/v/out-like tensor as a 4-D block."""
        if self.rows is not None:
            return x.reshape(1, -1, *x.shape[2:])
        return x.unsqueeze(0) if self.packed else x

    def block_lse(self, lse):
        if self.rows is not None:
            return lse.transpose(0, 1).reshape(1, lse.shape[1], -1)
        return lse.unsqueeze(0) if self.packed else lse

    def outside(self, x):
        if self.rows is not None:
            return x.reshape(*self.rows, *x.shape[2:])
        return x[0] if self.packed else x

    def outside_lse(self, lse):
        if self.rows is not None:
            return lse[0].reshape(lse.shape[1], *self.rows).transpose(0, 1)
        return lse[0] if self.packed else lse


def _forward(lay, q, k, v, sinks, scale, softcap, backend, deterministic):
    """(out, lse) of the op's forward on `lay`'s blocks, in the caller's layout (may be views of fresh tensors)."""
    q4, k4, v4 = lay.block(q), lay.block(k), lay.block(v)
    # Refuse an engine that cannot run this block before any work (forward and backward alike).
    be = engine_for(backend, lay.segs, q4, k4, deterministic=deterministic, softcap=softcap)
    if deterministic:  # that was the backward's engine: the forward picks its own
        be = engine_for(backend, lay.segs, q4, k4, softcap=softcap)
    out, lse = _engine_fwd(be, q4, k4, v4, lay.segs, softmax_scale=scale, softcap=softcap)
    if sinks is not None:
        out, lse = add_sinks(out, lse, sinks, q.dtype)
    return lay.outside(out), lay.outside_lse(lse)


def _attention_impl(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor | None, cu_k: Tensor | None, pos: Tensor | None,
                    sinks: Tensor | None, causal: bool, left: int, right: int, max_q: int, max_k: int, scale: float,
                    softcap: float, backend: str, deterministic: bool, spans: list[int]) -> tuple[Tensor, Tensor]:
    lay = _Layout(q, k, cu_q, cu_k, pos, causal, (left, right), max_q, max_k, spans)
    return distinct_outputs(_forward(lay, q, k, v, sinks, scale, softcap, backend, deterministic), (q, k, v, sinks))


_attention_op = torch.library.custom_op("ndp::attention", mutates_args=())(_attention_impl)


@_attention_op.register_fake
def _attention_fake(q, k, v, cu_q, cu_k, pos, sinks, causal, left, right, max_q, max_k, scale, softcap, backend,
                    deterministic, spans):
    return q.new_empty(q.shape), q.new_empty(lse_shape(q, cu_q is not None), dtype=acc_dtype(q.dtype))


def _backward(lay, dout, q, k, v, out, lse, sinks, scale, softcap, backend, deterministic):
    """(dq, dk, dv, dsinks) of the op on `lay`'s blocks, in the caller's layout (dsinks empty without sinks)."""
    dout4, q4, k4, v4, out4 = (lay.block(x) for x in (dout.contiguous(), q, k, v, out))
    lse4 = lay.block_lse(lse)
    dq, dk, dv = attention_bwd(dout4, q4, k4, v4, out4, lse4, lay.segs, softmax_scale=scale, backend=backend,
                               deterministic=deterministic, softcap=softcap)
    dsinks = q.new_empty(0) if sinks is None else sinks_grad(dout4, out4, lse4, sinks)
    return [lay.outside(x) for x in (dq, dk, dv)] + [dsinks]


def _attention_bwd_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        cu_q: Tensor | None, cu_k: Tensor | None, pos: Tensor | None, sinks: Tensor | None,
                        causal: bool, left: int, right: int, max_q: int, max_k: int, scale: float, softcap: float,
                        backend: str, deterministic: bool, spans: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    lay = _Layout(q, k, cu_q, cu_k, pos, causal, (left, right), max_q, max_k, spans)
    return distinct_outputs(_backward(lay, dout, q, k, v, out, lse, sinks, scale, softcap, backend, deterministic),
                            (dout, q, k, v, out, lse, sinks))


_attention_bwd_op = torch.library.custom_op("ndp::attention_backward", mutates_args=())(_attention_bwd_impl)


@_attention_bwd_op.register_fake
def _attention_bwd_fake(dout, q, k, v, out, lse, cu_q, cu_k, pos, sinks, *args):
    dsinks = q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, pos, sinks, *rest = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_q, cu_k, pos, sinks)
    ctx.rest = rest
    ctx.mark_non_differentiable(output[1])


def _attention_grad(ctx, dout, _dlse):
    q, k, v, out, lse, cu_q, cu_k, pos, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.ndp.attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, pos, sinks, *ctx.rest)
    return dq, dk, dv, None, None, None, None if sinks is None else dsinks, *([None] * len(ctx.rest))


torch.library.register_autograd("ndp::attention", _attention_grad, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The op's body and backward without the custom-op dispatch, for eager calls: that dispatch costs about 0.25 ms of
    host time each way per call (CPU-measured; on an H100 short calls went from ~0.8 to 0.3-0.5 ms per
    forward+backward over SDPA with this path, docs/gpu-h100.md). The backward reuses the forward's layout and
    segment table; the forward's outputs are fresh tensors, so they skip the op's no-alias check (torch.library's
    rule; the gradients keep it: dK and dV may be views of one buffer). Compiled callers, dispatch modes (fake
    tensors, selective checkpointing) and tensor subclasses get the op."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, pos, sinks, opts):
        causal, left, right, max_q, max_k, scale, softcap, backend, deterministic, spans = opts
        ctx.lay = _Layout(q, k, cu_q, cu_k, pos, causal, (left, right), max_q, max_k, spans)
        out, lse = _forward(ctx.lay, q, k, v, sinks, scale, softcap, backend, deterministic)
        out, lse = out.contiguous(), lse.contiguous()
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.opts = (scale, softcap, backend, deterministic)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # lse's gradient stays None (not a zeros tensor and its fill kernel per call)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv, dsinks = distinct_outputs(_backward(ctx.lay, dout, q, k, v, out, lse, sinks, *ctx.opts),
                                              (dout, q, k, v, out, lse, sinks))
        return dq, dk, dv, None, None, None, None if sinks is None else dsinks, None


def _eager(*tensors) -> bool:
    """Whether a call on `tensors` may take `_EagerAttention`: not traced, no dispatch mode, plain tensors."""
    return not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None and \
        all(t is None or type(t) is torch.Tensor for t in tensors)


@any_value_head
def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), cu_seqlens_q=None,
              cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, backend="auto", return_lse=False,
              deterministic=False, sinks=None, softcap=0.0, position_ids=None, bidirectional_spans=None):
    """Attention on one device, differentiable with respect to q, k and v.

    Args:
        q: ``[batch, seq_q, heads, head_dim]`` (packed: ``[total_tokens, heads, head_dim]`` with cu_seqlens).
        k, v: ``[batch, seq_k, kv_heads, head_dim]`` with ``heads % kv_heads == 0``; v's head size may differ
            (MLA; ``any_value_head``: out then has v's).
        causal: bottom-right aligned causal mask.  window_size: (left, right), -1 = unlimited.
        cu_seqlens_q / cu_seqlens_k: int32 ``[num_seqs + 1]`` for packed documents.
        backend: "auto" (the fastest exact engine for the block, from measurements) or one of
            "triton" | "sdpa" | "flash_attn" | "flash_attn3" | "torch".
        return_lse: also return the fp32 lse (``[batch, heads, seq_q]`` or ``[heads, total_tokens]``).
        deterministic: bitwise-reproducible gradients (flash-attn's word).
        sinks: optional ``[heads]`` attention sinks (gpt-oss): a learnable logit per head joining every row's
            softmax denominator; differentiable, the returned lse includes it (see ``ndp/ops/sinks.py``).
        softcap: logit soft-capping (Gemma 2; flash-attn's keyword): scores ``softcap * tanh(scores /
            softcap)`` before the mask and the softmax; 0 or None = off. Engines: triton, torch (``auto`` takes
            only these for it).
        position_ids: dense input only: ``[batch, seq]`` (or ``[1, seq]``) positions; where they do not continue
            the previous token's, a packed document starts (transformers' packed rows): attention stays inside
            each document. Read inside the op, so a compiled caller does not break its graph on them.
        bidirectional_spans: dense rows, as many queries as keys, causal: ``(start, end)`` position ranges inside
            which every query sees every key (a vision-language model's image blocks, transformers'
            ``block_sequence_ids``), each query's window (if any) still bounding the keys before it.
    Returns:
        out in q's dtype and shape (and lse when asked).
    Raises:
        ValueError / TypeError for malformed input or a forced engine that cannot run the block,
        RuntimeError for an unavailable backend.

    Under ``torch.compile`` the call is one graph node (the op ``ndp::attention``): no graph break.
    """
    scale, (left, right), packed = check_call(q, k, v, softmax_scale=softmax_scale, window_size=window_size,
                                              cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    _check_positions(position_ids, q, packed)
    softcap = check_softcap(softcap)
    _check_backend(backend)
    check_sinks(sinks, q.shape[-2], q.device)
    spans = check_spans(bidirectional_spans, q.shape[1] if q.dim() == 4 else q.shape[0], bool(causal))
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, position_ids, sinks, bool(causal), left, right,
            _given(max_seqlen_q), _given(max_seqlen_k), scale, softcap, backend, bool(deterministic),
            flat_spans(spans))
    if _eager(q, k, v, cu_seqlens_q, cu_seqlens_k, position_ids, sinks):
        out, lse = _EagerAttention.apply(*args[:7], args[7:])  # one options tuple: Function.apply walks each argument
    else:
        out, lse = torch.ops.ndp.attention(*args)
    return (out, lse) if return_lse else out


def _check_positions(position_ids, q, packed):
    if position_ids is None:
        return
    if packed:
        raise ValueError("position_ids find packed documents in dense rows; packed input already has cu_seqlens. "
                         "Pass one of them.")
    if not torch.is_tensor(position_ids) or position_ids.dim() != 2 or position_ids.shape[1] != q.shape[1] or \
            position_ids.shape[0] not in (1, q.shape[0]) or position_ids.device != q.device:
        got = tuple(position_ids.shape) if torch.is_tensor(position_ids) else type(position_ids).__name__
        raise ValueError(f"position_ids must be a [batch, seq] = [{q.shape[0]}, {q.shape[1]}] (or [1, {q.shape[1]}]) "
                         f"tensor on {q.device}; got {got}. Pass the model's position_ids of these rows.")


def _given(max_seqlen) -> int:
    """A max_seqlen argument as the op takes it (-1: not given)."""
    return -1 if max_seqlen is None else int(max_seqlen)


def attention_backward(dout, q, k, v, out, lse, **kwargs):
    """Public-signature backward (same keywords as ``flash_attn_bwd`` plus ``backend`` and ``deterministic``)."""
    backend = kwargs.pop("backend", "auto")
    det = kwargs.pop("deterministic", False)
    cap = check_softcap(kwargs.pop("softcap", 0.0))
    return run_bwd(lambda *a, **kw: attention_bwd(*a, backend=backend, deterministic=det, softcap=cap, **kw), dout, q,
                   k, v, out, lse, **kwargs)
