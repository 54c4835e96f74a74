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

import contextvars
import functools
from dataclasses import dataclass, replace

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

import ndp.cp
import ndp.ops
from ndp_kernels.segments import packed_rows_cu, position_restarts, read_once
from ndp.cp.sharding import seq_multiple
from ndp.parallel import CP_ATTR

from .batch import whole_forward
from .masks import IMAGE_BLOCKS, describe, documents_of, marker, read_dense, spec_of, with_padding
from .models import Unsupported, check_packed_model, inside, kv_shared_layers, reentrant_checkpointed, text_decoder
from .padded import padded_attention, padding_plan

IMPL_NAMES = {"ring": "ndp_ring", "allgather": "ndp_allgather", "ulysses": "ndp_ulysses", "usp": "ndp_usp"}


def _window(sliding_window, causal):
    # transformers' sliding window of w lets a query see itself and the w - 1 keys before it.
    if sliding_window is None or sliding_window <= 0:
        return (-1, -1)
    return (int(sliding_window) - 1, 0 if causal else int(sliding_window) - 1)


def _cu_of_chunks(batch, seq, chunk, device):
    # Chunked attention (Llama4) on rows flattened: every chunk of every row is its own causal document.
    per_row = torch.arange(0, seq, chunk, device=device)
    starts = (per_row[None, :] + seq * torch.arange(batch, device=device)[:, None]).reshape(-1)
    return torch.cat([starts, starts.new_tensor([batch * seq])]).to(torch.int32)


# Keyword arguments transformers' attention layers pass that change nothing ndp computes (or are handled below).
_NEUTRAL = {"position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "output_attentions",
            "use_cache", "cache_position", "past_key_values", "past_key_value", "layer_idx", "is_causal",
            "position_embeddings", "return_dict", "output_hidden_states", "seq_idx", "logits_to_keep",
            # the loss's arguments, which transformers hands every layer with the rest of the forward's kwargs
            "labels", "shift_labels", "num_items_in_batch",
            # MoE: what the model returns (TRL's SFTTrainer asks for the router logits of its auxiliary loss)
            "output_router_logits"}
# Arguments that change the attention: refused by name unless they are None (or 0).
_REFUSED = {"sinks": "per-token attention sinks", "head_mask": "a head mask",
            "attention_chunk_size": "chunked attention"}


# Refusals found outside an attention call, raised at this rank's next CP attention call: {id(CPContext): error}.
_PENDING: dict = {}


@dataclass
class _Documents:
    """Under CP, the document table of the forward running now (``cu``: cu_seqlens), the length of its rows on this
    rank (``seq``) and whether ndp's mask interface handed it to the attention calls (``carried``)."""
    cu: torch.Tensor
    seq: int
    carried: bool = False


# ndp's mask interface hands the forward's documents to the attention calls in the mask marker, for the models
# whose decoder layers do not pass cu_seq_lens_q down to their attention (StableLM, Nemotron).
_FORWARD_DOCUMENTS: contextvars.ContextVar = contextvars.ContextVar("ndp_forward_documents", default=None)


def _shard_positions_error(pos, ctx, seq, impl):
    """Under CP, dense rows: None when position_ids are this rank's shard of ``0 .. seq * cp_size - 1`` (what
    ``shard_batch`` gives), else the error: an unsharded batch, a packed one without its document table, another
    layout. Checked once per position_ids tensor (every layer of a forward gets the same one)."""
    if not torch.is_tensor(pos) or pos.dim() != 2 or pos.shape[-1] != seq:
        return None  # no positions here, or a multimodal layout (3-D RoPE positions): nothing to compare
    total, need = seq * ctx.size, seq_multiple(ctx.size, ctx.layout)
    if total % need:  # no dense shard has this length: what follows says what a dense one would look like
        want = None
    else:
        want = _dense_shard_positions(total, ctx.size, ctx.rank, ctx.layout, str(pos.device))
        if read_once(pos, ("is_shard", seq, ctx.size, ctx.rank, ctx.layout), lambda: bool((pos == want).all())):
            return None
    expected = (f"expected {_short(want[0].tolist())}" if want is not None else
                f"a dense shard has a multiple of {need // ctx.size} tokens")
    return ValueError(
        f"ndp_{impl} attention under context parallelism (cp_size={ctx.size}, layout {ctx.layout}) got position_ids "
        f"that are not rank {ctx.rank}'s shard of a sequence of {total} tokens: {expected}, got "
        f"{_short(pos[0].tolist())}, and no document table (cu_seq_lens_q) for packed documents. Pass the batch "
        f"through ndp.hf.shard_batch(model, ...) (a packed batch with its position_ids restarting or cu_seq_lens_q) "
        f"and give the model (its forward, where ndp's mask takes the table to layers that do not hand it down) the "
        f"position_ids (and cu_seq_lens_q) it returns.")


def _short(xs):
    return str(xs) if len(xs) <= 12 else f"[{', '.join(map(str, xs[:6]))}, ..., {', '.join(map(str, xs[-3:]))}]"


@functools.lru_cache(maxsize=64)
def _dense_shard_positions(total, size, rank, layout, device):
    pos = torch.arange(total, device=device)[None]
    return ndp.cp.shard_sequence(pos, dim=1, world_size=size, rank=rank, layout=layout)


def _check_kwargs(kwargs):
    for name, value in kwargs.items():
        if value is None or value is False:
            continue
        if name in _REFUSED:
            raise Unsupported(f"ndp attention does not implement {_REFUSED[name]}; this model passes {name}. "
                              f"Use the model's own attention implementation (cp_size=1).")
        if name not in _NEUTRAL:
            raise Unsupported(f"ndp attention got the argument {name}={type(value).__name__}, which it does not "
                              f"know and would ignore. Use the model's own attention implementation (cp_size=1).")


def ndp_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *,
                          impl="ring", sliding_window=None, **kwargs):
    """transformers attention interface: ``(attn_output [B, S, H, Dv], None)``.

    Args:
        module: the attention layer (``ndp_cp``: CP groups; ``is_causal``; cross-attention: :func:`_cross_attention`).
        query, key: ``[B, H, S, D]`` / ``[B, Hkv, S, D]``; value ``[B, Hkv, S, Dv]`` (Dv may differ from D, as in
            MLA); local shards under CP, in the CP layout.
        attention_mask: what ndp's mask interface returned: None, a marker carrying the layer's
            :class:`~ndp.hf.masks.MaskSpec` (causal, window, chunk, packed; padding, applied on one process by
            ``ndp.hf.padded``), or a padding mask it could not read (refused); or a dense 4-D mask given to the
            model or built by it (:func:`~ndp.hf.masks.read_dense`: full, causal or causal packed documents are
            applied, any other is refused). A dense mask is the truth, as in eager attention: position_ids then
            only place RoPE.  scaling: softmax scale; dropout: must be 0.
        sliding_window: the layer's window (Mistral / Qwen2); the mask's window wins where the mask has one.
        kwargs: ``cu_seq_lens_q`` (global int32 cu_seqlens of packed documents; batch must be 1),
            ``max_length_q``, ``position_ids`` (packed documents without CP are found from them), ``is_causal``,
            ``s_aux`` (attention sinks: one logit per query head, gpt-oss), ``softcap`` (logit soft-capping,
            Gemma 2). Arguments that change attention and that ndp does not implement (per-token sinks, a head
            mask, unknown ones) are refused, never dropped.
    Raises:
        ValueError: padding under CP or in a form ndp cannot read, dropout, or a packed batch with batch > 1.
        Unsupported: an argument or mask ndp cannot apply exactly. Under CP either is raised on every rank of the
            CP group (no rank is left waiting in the ring).
    """
    ctx = getattr(module, CP_ATTR, None)
    cp_on = ctx is not None and ctx.enabled
    if cp_on and "CrossAttention" in type(module).__name__:  # keys of a tower's states, not of the rows
        return _cross_attention(module, query, key, value, attention_mask, ctx, impl, scaling=scaling,
                                dropout=dropout, **kwargs)
    spec, dense, cu = _mask_of(attention_mask, query.shape[0], query.shape[2], cp_on, kwargs.get("cu_seq_lens_q"))
    causal = kwargs.pop("is_causal", None)
    sinks = kwargs.pop("s_aux", None)  # gpt-oss style: one learnable logit per query head
    softcap = kwargs.pop("softcap", None) or 0.0  # Gemma 2: scores softcap * tanh(scores / softcap)
    _check_kwargs(kwargs)
    error = _call_error(ctx if cp_on else None, spec, attention_mask, dropout, query.shape[2], impl, kwargs, cu)
    if error is not None:
        if cp_on:
            raise_on_cp_ranks(error, ctx, f"ndp_{impl} attention")
        raise error
    if spec is not None:  # the mask transformers asked for is the truth (it is what eager attention applies)
        causal, sliding_window = spec.causal, spec.window
    elif causal is None:
        causal = bool(getattr(module, "is_causal", True))
    window = _window(sliding_window, causal)
    q, k, v = _one_dtype(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
    batch, seq = q.shape[0], q.shape[1]
    if cp_on and _temperature_tuned(module):
        q = _row_temperature(module, q, ctx, cu)
    used = None if spec is None else spec.q_offset + seq - spec.kv_offset  # keys up to the newest query's position
    if used is not None and used != k.shape[1]:
        k, v = _written_keys(k, v, used, causal)
    if spec is not None and spec.chunk is not None and spec.q_offset and spec.lengths is None:
        # decoding with chunked attention: each query sees its own chunk's keys, as the padding plan cuts rows
        spec = replace(spec, lengths=(spec.q_offset + seq,) * batch, starts=(0,) * batch)
    if spec is not None and spec.lengths is not None:  # padded rows, one process (refused under CP)
        plan = padding_plan(spec.starts, spec.lengths, (spec.q_offset, seq), (spec.kv_offset, k.shape[1]), causal,
                            spec.window, spec.chunk, q.device)
        return padded_attention(q, k, v, plan, softmax_scale=scaling, sinks=sinks, softcap=softcap), None
    # with a dense mask the mask alone says where documents are (as in eager attention), its rows flattened; with a
    # 2-D one, the rows are rows (transformers finds packed documents from position_ids only when no mask is given)
    flat = dense
    position_ids = None if dense or (spec is not None and spec.mask_given) else kwargs.get("position_ids")
    chunk = spec.chunk if spec is not None else None
    # Under CP a rank's positions do not continue (zigzag) and transformers calls that packing: not a packed batch.
    if chunk is not None and (cu is not None or (spec.packed and not cp_on)):
        raise Unsupported("chunked attention (Llama4's attention_chunk_size) with packed documents: ndp does not "
                          "cut documents into chunks. Pass unpacked rows (a chunk restarts every "
                          f"{chunk} positions of a row).")
    rows_pos = position_ids if cu is None and not cp_on and _row_positions(position_ids, seq) else None
    if chunk is not None and not cp_on and seq > chunk:
        cu, flat, rows_pos = _cu_of_chunks(batch, seq, chunk, q.device), True, None
    elif rows_pos is not None and not torch.compiler.is_compiling():
        # Eagerly, packed rows become cu_seqlens here (read once per position_ids tensor, for every layer);
        # compiled, the op finds them from the positions (no graph break).
        cu = packed_rows_cu(rows_pos, batch, seq)
        flat, rows_pos = cu is not None, None
    if cu is not None:
        if batch != 1 and not flat:
            raise ValueError(f"packed documents (cu_seq_lens_q) need batch size 1; got batch={batch}")
        cu = cu.to(device=q.device, dtype=torch.int32)
        q, k, v = (t.reshape(batch * seq, *t.shape[2:]) for t in (q, k, v))
    if not cp_on:
        if cu is None:
            out = _by_span_rows(spec, q, k, v, lambda q, k, v, spans, rows: ndp.ops.attention(
                q, k, v, causal=causal, softmax_scale=scaling, window_size=window, sinks=sinks, softcap=softcap,
                position_ids=_rows_of(rows_pos, rows), bidirectional_spans=spans))
        else:
            mx = None if flat else kwargs.get("max_length_q")
            out = ndp.ops.attention(q, k, v, causal=causal, softmax_scale=scaling, window_size=window,
                                    cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx, sinks=sinks,
                                    softcap=softcap)
    else:
        kw = dict(causal=causal, softmax_scale=scaling, layout=ctx.layout, window_size=window, sinks=sinks,
                  chunk_size=chunk, softcap=softcap, **({} if cu is None else dict(cu_seqlens=cu)))
        out = _by_span_rows(spec, q, k, v, lambda q, k, v, spans, rows: _cp_attention(
            q, k, v, ctx, impl, bidirectional_spans=spans, **kw))
    if cu is not None:
        out = out.reshape(batch, seq, *out.shape[1:])
    return out, None


def _by_span_rows(spec, q, k, v, attend):
    """`attend(q, k, v, spans, rows)` over the rows, one call per run of rows with the same image spans (the spec's,
    ``MaskSpec.spans``: every row's alike in one call, rows with other images in calls of their own), their
    outputs concatenated along the batch; ``rows`` the call's row slice (None: every row)."""
    spans = None if spec is None else spec.spans
    if spans is None or all(s == spans[0] for s in spans):
        return attend(q, k, v, spans and spans[0], None)
    outs, start = [], 0
    for i in range(1, len(spans) + 1):
        if i == len(spans) or spans[i] != spans[start]:
            rows = slice(start, i)
            outs.append(attend(q[rows], k[rows], v[rows], spans[start], rows))
            start = i
    return torch.cat(outs)


def _rows_of(position_ids, rows):
    """position_ids ([batch or 1, seq], or None) of the row slice `rows` (None: all of them)."""
    if rows is None or position_ids is None or position_ids.shape[0] == 1:
        return position_ids
    return position_ids[rows]


def _cross_attention(module, query, key, value, attention_mask, ctx, impl, **kwargs):
    """Under CP, a decoder's cross-attention (Mllama's text layers attending to the vision tower's states): its
    queries are this rank's rows, its keys and values the tower's states, whole on every rank where the batch
    reached the model whole (``ndp.hf.multimodal``: its mask cut to the shard's rows as well), so the model's own
    SDPA attention of the shard's rows is the whole rows' there. Refused on every rank of the CP group otherwise
    (a batch sharded before the model: the states would be a shard's)."""
    if whole_forward() is None:
        raise_on_cp_ranks(Unsupported(
            f"{type(module).__name__} (a cross-attention) under context parallelism on a batch sharded before the "
            f"model: ndp attends a cross-attention only where the batch reaches the model whole (ndp.hf.shard_batch "
            f"gives a batch with images to the model whole), its keys a tower's states. Train it with cp_size=1."),
            ctx, f"ndp_{impl} attention")
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _one_dtype(q, k, v):
    """Under autocast transformers' RoPE returns fp32 q/k next to a low-precision v: computed in the autocast dtype,
    as the model's other matmuls are."""
    if q.dtype == k.dtype == v.dtype:
        return q, k, v
    dt = torch.get_autocast_dtype(q.device.type) if torch.is_autocast_enabled(q.device.type) else v.dtype
    return q.to(dt), k.to(dt), v.to(dt)


def _temperature_tuned(module) -> bool:
    """Llama 4's NoPE layers: each query scaled by a temperature of its index in the call (transformers'
    ``attn_temperature_tuning``), 0 .. seq - 1 whatever the position_ids."""
    return bool(getattr(module, "attn_temperature_tuning", False)) and not getattr(module, "use_rope", True)


def _row_temperature(module, q, ctx, cu):
    """`q` ``[B, S, H, D]`` of a temperature-tuned layer under CP: transformers scaled each query by
    ``log1p(floor((i + 1) / floor_scale)) x attn_scale + 1`` of its index i in this rank's shard; rescaled to its
    index in the row (a run without CP), which differs past floor_scale tokens (8192 in Llama 4's configs: every
    long-context batch). Packed documents under CP are refused (each document's indices restart)."""
    if cu is not None:
        raise Unsupported(f"{type(module).__name__} scales its queries by their index in the row "
                          f"(attn_temperature_tuning), and packed documents under context parallelism give each rank "
                          f"pieces of documents. Train unpacked rows under CP, or packed ones without CP.")
    seq = q.shape[1]
    row = _dense_shard_positions(seq * ctx.size, ctx.size, ctx.rank, ctx.layout, str(q.device))[0]
    shard = torch.arange(seq, device=q.device)

    def temperature(i):  # transformers' formula, in its float32, then in the query's dtype
        return (torch.log1p(torch.floor((i.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0).to(q.dtype)

    return q * (temperature(row) / temperature(shard)).view(1, seq, 1, 1)


def _written_keys(k, v, used, causal):
    """The first `used` keys and values (``[B, S, ...]``): those up to the newest query's position. A static cache
    hands the attention all its slots, the later ones not written yet; the causal mask hides them from every query,
    so dropping them leaves each query its keys, bottom-right aligned."""
    if not causal or not 0 < used <= k.shape[1]:
        raise Unsupported(f"ndp attention got {k.shape[1]} keys where the queries' positions ask for {used} under a "
                          f"{'causal' if causal else 'bidirectional'} mask (a KV cache ndp cannot read). Generate with "
                          f"the model's own attention (model.set_attn_implementation('sdpa')).")
    return k[:, :used], v[:, :used]


def _mask_of(attention_mask, batch, seq, sharded, table):
    """(spec, dense, cu): the MaskSpec that ndp's marker carries, or that of a dense 4-D mask (``dense``), spec None
    for no mask or a 2-D one; and the batch's document table: a dense mask's packed documents (int32 cu_seqlens),
    else the one the layer handed down (`table`), else the one ndp's marker carries (for layers that do not)."""
    spec = spec_of(attention_mask)
    if spec is not None or attention_mask is None or attention_mask.dim() <= 2:
        return spec, False, documents_of(attention_mask) if table is None else table
    spec, cu = read_dense(attention_mask, batch, seq, sharded=sharded)
    return spec, True, cu


def _cp_attention(q, k, v, ctx, impl, **kw):
    if impl == "ring":
        return ndp.cp.ring_attention(q, k, v, group=ctx.group, **kw)
    if impl == "allgather":
        return ndp.cp.allgather_attention(q, k, v, group=ctx.group, **kw)
    if impl == "ulysses":
        return ndp.cp.ulysses_attention(q, k, v, group=ctx.group, **kw)
    if impl == "usp":
        return ndp.cp.usp_attention(q, k, v, ulysses_group=ctx.ulysses_group, ring_group=ctx.ring_group, **kw)
    raise ValueError(f"unknown CP impl {impl!r}; expected one of {sorted(IMPL_NAMES)}")


def _row_positions(position_ids, seq) -> bool:
    """position_ids of the rows' tokens ([batch or 1, seq]), not multimodal RoPE positions ([3, batch, seq])."""
    return torch.is_tensor(position_ids) and position_ids.dim() == 2 and position_ids.shape[1] == seq and seq > 1


def _call_error(ctx, spec, attention_mask, dropout, seq, impl, kwargs, table):
    """The first reason this attention call cannot run exactly (ctx: the CP context when CP is on), or None."""
    if ctx is not None and id(ctx) in _PENDING:
        return _PENDING.pop(id(ctx))
    if spec is None and attention_mask is not None and not bool(attention_mask.all()) or (
            ctx is not None and spec is not None and spec.lengths is not None):
        where = "under context parallelism" if ctx is not None else (
            f"of this form (shape {tuple(attention_mask.shape)} for {seq} queries: ndp reads a 2-D mask over "
            f"the positions up to the newest query's)")
        return ValueError(f"ndp attention cannot honour an attention mask with masked positions (padding) {where}; "
                          f"pack the documents instead (position_ids restarting at 0, or cu_seq_lens_q; "
                          f"ndp.hf.shard_batch pads what CP needs itself), or run this call with the model's own "
                          f"attention (model.set_attn_implementation('sdpa')).")
    if spec is not None and spec.refused:
        return Unsupported(spec.refused)
    if spec is not None and spec.spans is not None:
        why = _spans_error(spec, ctx, table)
        if why:
            return Unsupported(IMAGE_BLOCKS.format(why=why))
    if dropout:
        return ValueError(f"ndp attention has no attention dropout; got dropout={dropout}. Set the model's "
                          f"attention_dropout to 0.")
    if ctx is not None and table is None and not torch.compiler.is_compiling() and whole_forward() is None:
        # compiled decoder layers skip it: guard_positions checks once per forward, before the layers; a whole
        # batch's positions are the model's own, cut by ndp (PaliGemma's count from 1)
        return _shard_positions_error(kwargs.get("position_ids"), ctx, seq, impl)
    return None


def _spans_error(spec, ctx, table) -> str | None:
    """Where a batch's image blocks (``spec.spans``) cannot be attended as spans, what is in the way, else None."""
    if spec.lengths is not None:
        return "in padded rows (a 2-D attention mask with padding)"
    if spec.q_offset or spec.kv_offset:
        return "behind a KV cache (generation)"
    if table is not None or spec.packed:  # (a packed batch's spans would be dropped with its rows flattened)
        return "in packed documents"
    if spec.chunk is not None:
        return "under chunked attention"
    if ctx is not None and whole_forward() is None:
        return (f"in a batch sharded before the model (the images' positions are rank {ctx.rank}'s shard's, not the "
                f"row's; ndp.hf.shard_batch gives a batch with images to the model whole)")
    return None


def guard_positions(model, ctx) -> None:
    """Under CP, forward hooks on `model`: a packed batch's document table (cu_seq_lens_q) is held through the
    forward (``_FORWARD_DOCUMENTS``, for ndp's mask interface to hand to every attention call); without one, the
    batch is checked once per forward, before the decoder layers run, to be this rank's shard (what the attention
    checks per call in eager mode, where compiled layers cannot: a read of the positions' values), refused on every
    rank of the CP group as the attention would; so are a KV cache and ``logits_to_keep``. Run eagerly under
    torch.compile (a graph break at the forward's start and end): the table is the forward's, not a value of the
    graph."""
    held = []

    @torch.compiler.disable
    def enter(module, args, kwargs):
        _refuse_shard_positions(module, kwargs, ctx)
        if whole_forward() is not None:  # a whole batch: its text decoder takes the shard (ndp.hf.multimodal)
            held.append(_FORWARD_DOCUMENTS.set(None))
            return
        ref = next((t for t in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args[:1]) if torch.is_tensor(t)),
                   None)
        rows = ref is not None and ref.dim() >= 2
        cu = kwargs.get("cu_seq_lens_q")
        held.append(_FORWARD_DOCUMENTS.set(_Documents(cu, ref.shape[1]) if cu is not None and rows else None))
        if cu is not None or not rows:
            return
        pos = kwargs.get("position_ids")
        if pos is None:  # what the model builds without a cache: 0 .. local_seq - 1
            pos = torch.arange(ref.shape[1], device=ref.device)[None]
        error = _shard_positions_error(pos, ctx, ref.shape[1], ctx.impl)
        if error is not None:
            raise_on_cp_ranks(error, ctx, f"ndp_{ctx.impl} attention")

    @torch.compiler.disable
    def leave(module, args, kwargs, output):
        if not held:
            return
        documents = _FORWARD_DOCUMENTS.get()
        _FORWARD_DOCUMENTS.reset(held.pop())
        if documents is not None and documents.cu.numel() > 2 and not documents.carried:
            # the same on every rank (the table and the model are): refused before the loss and the backward
            raise Unsupported(
                f"{type(module).__name__} ran a packed batch ({documents.cu.numel() - 1} documents) under context "
                f"parallelism without building its attention mask through transformers' mask interface, and its "
                f"layers may not hand cu_seq_lens_q to the attention: ndp cannot tell that every attention call "
                f"kept the documents apart. Train unpacked rows, or this model without context parallelism.")

    model.register_forward_pre_hook(enter, with_kwargs=True)
    model.register_forward_hook(leave, with_kwargs=True, always_call=True)


def guard_packed(model, ctx) -> None:
    """For a model that cannot keep packed documents apart (:func:`~ndp.hf.models.check_packed_model`: a
    recurrent or convolution layer, an attention computed by the model itself), refuse a packed batch when it
    arrives: a forward pre-hook raises when the batch gives a document table (``cu_seq_lens_q`` of several
    documents), a ``seq_idx`` that changes inside a row, or, without an attention mask, positions that restart
    inside a row (transformers' rule; not under CP, where a dense shard's positions jump between its pieces and
    :func:`guard_positions` refuses positions that are not a dense shard's without a table). Other models get no
    hook."""
    try:
        check_packed_model(model)
        return
    except Unsupported as e:
        message = str(e)

    def refuse(module, args, kwargs):
        if _packed(kwargs, ctx.enabled):
            raise Unsupported(message)

    model.register_forward_pre_hook(refuse, with_kwargs=True)


def guard_checkpointing(model) -> None:
    """Refuse a training forward of a model whose layers share keys and values (:func:`~ndp.hf.models.
    kv_shared_layers`) while transformers checkpoints its layers with ``use_reentrant=True``: the layer that
    computes them runs without autograd inside its checkpoint and hands them on in a dict, so the layers reading
    them send no gradient back; transformers' own attention gives the same wrong gradients on one process (Gemma
    3n: up to 0.6 of a k_proj gradient's scale). Checked at each forward (checkpointing may be turned on after
    parallelize), on every rank alike, before any layer; models without such layers get no hook."""
    shared = kv_shared_layers(model)
    if not shared:
        return

    def refuse(module, args, kwargs):
        if module.training and torch.is_grad_enabled() and reentrant_checkpointed(module):
            raise Unsupported(
                f"{type(module).__name__} has layers that take their keys and values from an earlier layer "
                f"({', '.join(shared[:3])}{', ...' if len(shared) > 3 else ''}), and transformers' activation "
                f"checkpointing runs its layers with use_reentrant=True (given, or torch's default), which leaves "
                f"the earlier layers' key and value projections without those layers' gradients (transformers' own "
                f"attention too). Turn it on with gradient_checkpointing_kwargs={{'use_reentrant': False}} (the "
                f"default of gradient_checkpointing_enable()), or use ndp's activation checkpointing.")

    model.register_forward_pre_hook(refuse, with_kwargs=True)


def _packed(kwargs, sharded: bool) -> bool:
    cu, seq_idx, pos = kwargs.get("cu_seq_lens_q"), kwargs.get("seq_idx"), kwargs.get("position_ids")
    if torch.is_tensor(cu) and cu.numel() > 2:
        return True
    if torch.is_tensor(seq_idx) and seq_idx.dim() == 2 and bool((seq_idx != seq_idx[:, :1]).any()):
        return True
    return (not sharded and kwargs.get("attention_mask") is None and torch.is_tensor(pos) and pos.dim() == 2
            and bool(position_restarts(pos).any()))


def _refuse_shard_positions(module, kwargs, ctx) -> None:
    """Under CP, arguments that name positions of the sequence get this rank's shard: a KV cache
    (``past_key_values``: generation) and ``logits_to_keep`` other than 0 (the last N positions, or chosen ones).
    Refused on every rank."""
    keep = kwargs.get("logits_to_keep")
    if kwargs.get("past_key_values") is not None:
        what = "a KV cache (past_key_values: generate, or a prefix)"
    elif keep is not None and not (isinstance(keep, int) and keep == 0):
        what = f"logits_to_keep={keep}" if isinstance(keep, int) else "logits_to_keep (positions)"
    else:
        return
    raise_on_cp_ranks(Unsupported(
        f"{type(module).__name__} got {what} under context parallelism (cp_size={ctx.size}): it would hold or keep "
        f"positions of this rank's shard ({ctx.layout} layout), not of the sequence. ndp's context parallelism runs "
        f"whole sequences: pass logits_to_keep=0 and take the positions you want from the logits with the shard's "
        f"position_ids; generate with the model outside context parallelism."), ctx, f"ndp_{ctx.impl} attention")


def raise_on_cp_ranks(error: BaseException, ctx, what: str) -> None:
    """Raise `error` here and on every rank of ctx's CP group: only this rank may see the problem (its shard), so
    it joins the validity exchange the other ranks run at their next CP attention call instead of leaving them
    waiting in the ring."""
    groups = (dict(ulysses_group=ctx.ulysses_group, ring_group=ctx.ring_group) if ctx.impl == "usp"
              else dict(group=ctx.group))
    ndp.cp.raise_on_all_ranks(error, what=what, **groups)


def guard_outside_layers(model, names, ctx) -> None:
    """Under CP, the modules `names` (token mixers and attention outside the decoder layers: vision and audio
    towers, ``ndp.hf.models.outside_layers``) are refused when they run on a batch sharded before the model: they
    would see this rank's shard. Text-only batches never call them; a batch given whole (``ndp.hf.multimodal``)
    runs them on all of it."""
    _refuse_on_a_shard(model, names, ctx, lambda module: (
        f"{type(module).__name__} runs outside the decoder layers (a vision or audio tower, or a token mixer "
        f"before them) under context parallelism (cp_size={ctx.size}) on a batch sharded before the model: the "
        f"tower would see this rank's shard. Pass the batch through ndp.hf.shard_batch or ndp.trainer's trainers, "
        f"which give a batch with a tower's input to the model whole (its text decoder takes the shard), or "
        f"train batches of that modality with cp_size=1."))


def guard_counted_positions(model, names, ctx) -> None:
    """Under CP, the positional embeddings `names` (``ndp.hf.models.counted_positions``: they count positions from
    padding_idx + 1 over the row's non-pad tokens when given none, and take given position_ids as they are) are
    refused where they run on a shard: the position_ids CP gives (the shard's of 0, 1, ...) are not what they
    count, and the shard's own count would restart at every shard. Inside the text decoder that is also a batch
    given whole (with images: its decoder takes the shard at its entry); before it, such a batch is whole there."""
    decoder = text_decoder(model)
    for name in names:
        _refuse_on_a_shard(model, [name], ctx, lambda module: (
            f"{type(module).__name__} numbers the positions itself (from padding_idx={module.padding_idx} + 1, over "
            f"the row's non-pad tokens) and takes given position_ids as they are: under context parallelism "
            f"(cp_size={ctx.size}) it runs on this rank's shard, given the shard's positions 0, 1, ... instead, "
            f"another model than one process runs. Train this model with cp_size=1."),
            whole_ok=not (decoder and inside(name, [decoder])))


def _refuse_on_a_shard(model, names, ctx, message, whole_ok=True) -> None:
    """A forward pre-hook on each module of `names`: run on a shard (a batch sharded before the model, or, unless
    `whole_ok`, one given whole), it leaves the refusal ``message(module)`` for this rank's next CP attention call,
    which raises it on every rank (raised here, it would leave the other ranks in the FSDP all-gather of the next
    decoder layer while this one joined the attention's validity exchange)."""
    def refuse(module, args):
        # the batch reached the model whole, or a block recomputed in the backward (gradient checkpointing: its
        # forward was judged when it ran)
        if (whole_ok and whole_forward() is not None) or torch._C._current_graph_task_id() != -1:
            return
        _PENDING.setdefault(id(ctx), Unsupported(message(module)))

    for name in names:
        model.get_submodule(name).register_forward_pre_hook(refuse)


# Run eagerly under torch.compile (one graph break per mask a model builds): reading a mask function's closure
# values, which describe does, is what dynamo cannot trace for functions made inside the traced frame.
@torch.compiler.disable
def _ndp_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
              **kwargs):
    # ndp attention applies the mask itself: no dense mask, a marker carrying what the mask function asks for
    # (refused here, before any layer runs, when ndp cannot apply it) and the rows' padding, read once per forward.
    # A padding mask of another form is passed on, for the attention to refuse instead of silently ignoring it.
    spec = describe(mask_function) if mask_function is not None else None
    padded = attention_mask is not None and not bool(attention_mask.all())
    if spec is None:
        return attention_mask if padded else None
    # where the queries and keys sit (a KV cache); with a 2-D mask, as in transformers, position_ids place RoPE only
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    spec = replace(spec, q_offset=q_offset, kv_offset=kv_offset,
                   mask_given=attention_mask is not None and attention_mask.dim() == 2)
    if padded:
        if attention_mask.dim() != 2 or attention_mask.shape[-1] != q_offset + q_length:
            return attention_mask
        spec = with_padding(spec, attention_mask)
    return _marker_with_documents(spec, kwargs.get("device"), batch_size, q_length)


def _marker_with_documents(spec, device, batch, q_length):
    """The marker of `spec`, carrying the forward's document table (under CP, a batch given one) where the mask is
    over the batch's rows; a mask over another sequence (tokens added or dropped before the layers) of a packed
    batch is refused: the shards' documents would not be the table's."""
    documents = _FORWARD_DOCUMENTS.get()
    if documents is None:
        return marker(spec, device)
    if batch == 1 and q_length == documents.seq:
        documents.carried = True
        return marker(spec, device, documents.cu)
    if documents.cu.numel() > 2:
        spec = replace(spec, refused=(
            f"the batch packs {documents.cu.numel() - 1} documents in rows of {documents.seq} tokens on this rank, "
            f"and the model attends over {batch} x {q_length} queries (tokens added or dropped before its layers): "
            f"ndp cannot place the documents there. Train unpacked rows, or this model without context parallelism."))
    return marker(spec, device)


def register_attention() -> dict[str, str]:
    """Register the four ndp attention implementations with transformers (idempotent).

    Returns:
        {cp_impl: registered name}, e.g. {"ring": "ndp_ring", ...}.
    """
    for impl, name in IMPL_NAMES.items():
        AttentionInterface.register(name, functools.partial(ndp_attention_forward, impl=impl))
        AttentionMaskInterface.register(name, _ndp_mask)
    return dict(IMPL_NAMES)
