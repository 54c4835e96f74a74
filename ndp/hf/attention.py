"""ndp attention as a drop-in ``transformers`` attention implementation.

``register_attention()`` registers ``ndp_ring``, ``ndp_allgather``, ``ndp_ulysses`` and ``ndp_usp`` with
``transformers.AttentionInterface`` (and a mask function with ``AttentionMaskInterface`` so that
transformers builds no dense mask for them). A model switched to one of these names
(``model.set_attn_implementation("ndp_ring")``) calls :func:`ndp_attention_forward` in every attention
layer. The CP process groups come from the ``ndp_cp`` attribute that ``ndp.parallel.apply_cp`` puts on
each attention module; without it (or with ``cp_size == 1``) attention runs locally through
``ndp.ops.attention``.

HF passes query ``[batch, heads, seq, dim]`` and key/value ``[batch, kv_heads, seq, dim]`` (GQA not
expanded); ndp takes the flash-attn layout ``[batch, seq, heads, dim]``: a transpose, i.e. a strided view,
no copy (the kernels take strided inputs; the CP layer makes contiguous what it sends).
"""
from __future__ import annotations

import functools

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ndp.parallel import CP_ATTR

IMPL_NAMES = {"ring": "ndp_ring", "allgather": "ndp_allgather", "ulysses": "ndp_ulysses", "usp": "ndp_usp"}


def _window(sliding_window, causal):
    # transformers' sliding window of w lets a query see itself and the w - 1 keys before it.
    if sliding_window is None or sliding_window <= 0:
        return (-1, -1)
    return (int(sliding_window) - 1, 0 if causal else int(sliding_window) - 1)


def _cu_from_position_ids(position_ids, total):
    # Packed documents on one device: a document starts wherever position_ids restarts at 0.
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).flatten()
    if starts.numel() == 0 or starts[0] != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    cu = torch.cat([starts, starts.new_tensor([total])]).to(torch.int32)
    return cu


def ndp_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *,
                          impl="ring", sliding_window=None, **kwargs):
    """transformers attention interface: ``(attn_output [B, S, H, D], None)``.

    Args:
        module: the attention layer (its ``ndp_cp`` CPContext selects the CP groups; ``is_causal``).
        query: ``[B, H, S, D]``; key, value: ``[B, Hkv, S, D]`` (local shards under CP, in the CP layout).
        attention_mask: must be None (or all true): padding masks cannot be honoured, pack instead.
        scaling: softmax scale; dropout: must be 0.
        sliding_window: the layer's window (Mistral / Qwen2), honoured as flash-attn window_size.
        kwargs: ``cu_seq_lens_q`` (global int32 cu_seqlens of packed documents; batch must be 1),
            ``max_length_q``, ``position_ids`` (packed documents without CP are found from its resets).
    Raises:
        ValueError: a mask, dropout, or a packed batch with batch > 1. Under CP a mask or dropout refused
            on one rank raises on every rank of the CP group (no rank is left waiting in the ring).
    """
    ctx = getattr(module, CP_ATTR, None)
    cp_on = ctx is not None and ctx.enabled
    error = None
    if dropout:
        error = ValueError(f"ndp attention has no attention dropout; got dropout={dropout}. Set the model's "
                           f"attention_dropout to 0.")
    elif attention_mask is not None and not bool(attention_mask.all()):
        error = ValueError("ndp attention cannot honour an attention mask with masked positions (padding); "
                           "pack the documents instead (position_ids restarting at 0, or cu_seq_lens_q).")
    if error is not None:
        if cp_on:
            # Only this rank's shard may hold the padding: join the other ranks' validity exchange so that
            # every rank of the CP group raises instead of waiting in the ring.
            import ndp.cp

            groups = (dict(ulysses_group=ctx.ulysses_group, ring_group=ctx.ring_group) if impl == "usp"
                      else dict(group=ctx.group))
            ndp.cp.raise_on_all_ranks(error, what=f"ndp_{impl} attention", **groups)
        raise error
    causal = bool(getattr(module, "is_causal", True))
    window = _window(sliding_window, causal)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if not (q.dtype == k.dtype == v.dtype):
        # Under autocast transformers' RoPE returns fp32 q/k next to a low-precision v: compute in the
        # autocast dtype, as the model's other matmuls do.
        dt = (torch.get_autocast_dtype(q.device.type) if torch.is_autocast_enabled(q.device.type) else v.dtype)
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
    batch, seq = q.shape[0], q.shape[1]
    cu = kwargs.get("cu_seq_lens_q")
    position_ids = kwargs.get("position_ids")
    if cu is None and not cp_on and position_ids is not None and batch == 1 and seq > 1:
        pos = position_ids.reshape(-1)
        if bool((pos[1:] == 0).any()):
            cu = _cu_from_position_ids(pos, seq)
    if cu is not None:
        if batch != 1:
            raise ValueError(f"packed documents (cu_seq_lens_q) need batch size 1; got batch={batch}")
        cu = cu.to(device=q.device, dtype=torch.int32)
        q, k, v = q[0], k[0], v[0]
    if not cp_on:
        import ndp.ops

        if cu is None:
            out = ndp.ops.attention(q, k, v, causal=causal, softmax_scale=scaling, window_size=window)
        else:
            mx = int(kwargs.get("max_length_q") or int((cu[1:] - cu[:-1]).max()))
            out = ndp.ops.attention(q, k, v, causal=causal, softmax_scale=scaling, window_size=window,
                                    cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx)
    else:
        import ndp.cp

        kw = dict(causal=causal, softmax_scale=scaling, layout=ctx.layout, window_size=window)
        if cu is not None:
            kw["cu_seqlens"] = cu
        if impl == "ring":
            out = ndp.cp.ring_attention(q, k, v, group=ctx.group, **kw)
        elif impl == "allgather":
            out = ndp.cp.allgather_attention(q, k, v, group=ctx.group, **kw)
        elif impl == "ulysses":
            out = ndp.cp.ulysses_attention(q, k, v, group=ctx.group, **kw)
        elif impl == "usp":
            out = ndp.cp.usp_attention(q, k, v, ulysses_group=ctx.ulysses_group, ring_group=ctx.ring_group, **kw)
        else:
            raise ValueError(f"unknown CP impl {impl!r}; expected one of {sorted(IMPL_NAMES)}")
    if cu is not None:
        out = out.unsqueeze(0)
    return out, None


def _ndp_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
              **kwargs):
    # ndp attention applies causality/windows itself: no dense mask. A 2D padding mask is passed on only
    # when it masks something, so that the attention can refuse it instead of silently ignoring it.
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask


def register_attention() -> dict[str, str]:
    """Register the four ndp attention implementations with transformers (idempotent).

    Returns:
        {cp_impl: registered name}, e.g. {"ring": "ndp_ring", ...}.
    """
    for impl, name in IMPL_NAMES.items():
        AttentionInterface.register(name, functools.partial(ndp_attention_forward, impl=impl))
        AttentionMaskInterface.register(name, _ndp_mask)
    return dict(IMPL_NAMES)
