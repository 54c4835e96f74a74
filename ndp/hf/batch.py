"""A batch the way Hugging Face trainers make it, cut into this rank's piece.

Dense rows are padded to the multiple the CP layout needs and sharded with ``shard_sequence``. Packed rows
(``DataCollatorWithFlattening``: position_ids that restart inside a row, or ``cu_seq_lens_q``/``cu_seq_lens_k``
with ``max_length_q``/``max_length_k``, or ``seq_idx``) are flattened into one sequence of documents and sharded
per document with ``shard_packed``; the global document table travels with them as ``cu_seq_lens_q`` so that the
attention of every layer runs the documents apart, on every rank.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ndp.cp
from ndp.cp.sharding import seq_multiple
from ndp.cp.stats import all_reduce_sum
from ndp.parallel import CP_ATTR, PARALLEL_ATTR, mesh_axis, mesh_device

from ndp_kernels.segments import cu_from_starts, packed_rows_cu, position_restarts

from .masks import padding_of
from .models import Unsupported, takes_shift_labels, text_config

# Keys of a packed batch that are not [batch, seq] tensors: the document table, rebuilt for the shard.
PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# The [batch, seq] targets transformers' losses read (-100: no target): a pad token gets -100 in each.
LABEL_KEYS = ("labels", "shift_labels")
# The tokens a run without CP counts (1) and the pads it never sees (0: ndp's, and a padded batch's whose mask CP
# makes all ones), as an attribute: of the all-ones mask ``without_padding`` returns (the batch's own mask), then of
# the shard's position_ids (their shard), for what averages over tokens outside the attention (an MoE's
# load-balancing loss, ``ndp.hf.router``). Sharded as a row of that name, padded with 0.
REAL_TOKENS = "_ndp_real_tokens"
# The labels shard_batch returns are shifted already (labels[:, i]: token i's target), marked as an attribute (of a
# view of them): the model given them as `labels` (``model(**batch)``) reads them as transformers' shift_labels
# (:func:`guard_labels`) instead of shifting them a second time.
SHIFTED = "_ndp_shifted"
# The batch's longest position + 1 (max(position_ids) + 1 before ndp pads it: what a run without CP reads as the
# sequence length), as an attribute of the shard's position_ids (a tensor, no host sync): the length transformers'
# dynamic and LongRoPE frequencies follow (``ndp.hf.rope``).
LONGEST = "_ndp_longest"
# Each shard token's place in the batch (its index in the flattened [batch, seq] rows; -1 for a pad ndp adds), as a
# row of that name sharded with the batch: what puts per-token outputs (the logits) back in the batch's order
# (:func:`gather_tokens`).
ORIGIN = "_ndp_origin"
# A batch that reaches a multimodal model whole under CP (``ndp.hf.multimodal``): a view of its input_ids carries,
# under this name, the :class:`Whole` facts its text decoder shards it with; the labels are the shard's already.
WHOLE = "_ndp_whole"
# The model attribute naming the text decoder of a model with towers, which under CP takes a whole batch's shard at
# its entry (``ndp.hf.multimodal.guard_whole_batches``); set by ``ndp.hf.parallelize``. Absent: a text model, every
# batch is rows alone, sharded before the model.
DECODER_SHARDS = "_ndp_decoder_shards"
# Inside the forward of a model given a whole batch: its Whole facts (None otherwise).
_WHOLE_FORWARD: contextvars.ContextVar = contextvars.ContextVar("ndp_whole_forward", default=None)
# Inside whole_batch(): the Whole facts of the batch a caller hands the model in copies of its tensors.
_WHOLE_HELD: contextvars.ContextVar = contextvars.ContextVar("ndp_whole_held", default=None)
# Inside shard_positions(): the shard's position_ids as shard_rows made them (carrying REAL_TOKENS and LONGEST), for
# a forward whose model gets its shard in other tensors (ndp.accelerate copies each shard into the caller's buffer).
_SHARD_POSITIONS: contextvars.ContextVar = contextvars.ContextVar("ndp_shard_positions", default=None)


@dataclass
class Whole:
    """A whole batch's facts for its shard: this rank's REAL_TOKENS (``[batch, seq / cp_size]``), the batch's
    LONGEST, and the padded length the text decoder's inputs must have."""
    real_tokens: torch.Tensor
    longest: torch.Tensor
    seq: int


def whole_forward():
    """The :class:`Whole` facts of the forward running now when its batch reached the model whole, else None."""
    return _WHOLE_FORWARD.get()


def whole_batch(input_ids):
    """Inside, a forward given input_ids of the length of `input_ids` (marked by :func:`whole_rows`) takes their
    :class:`Whole` facts: for a caller that hands the model copies of the batch's tensors (the Trainer's
    ``_prepare_inputs``, which drops tensor attributes)."""
    return holding(_WHOLE_HELD, getattr(input_ids, WHOLE))


def whole_of(input_ids):
    """The :class:`Whole` facts of a forward's input_ids: their own (``WHOLE``), else those :func:`whole_batch`
    holds for input_ids of that length; None for a batch sharded before the model."""
    whole = getattr(input_ids, WHOLE, None)
    held = _WHOLE_HELD.get()
    if whole is None and held is not None and torch.is_tensor(input_ids) and input_ids.dim() == 2:
        whole = held if input_ids.shape[1] == held.seq else None
    return whole


def parallel_state(model, what):
    """(ParallelState, CPContext) of a model that went through ``ndp.parallelize``; ValueError otherwise."""
    state, ctx = getattr(model, PARALLEL_ATTR, None), getattr(model, CP_ATTR, None)
    if state is None or ctx is None:
        raise ValueError(f"{what} needs a model returned by ndp.parallelize / ndp.hf.parallelize (it carries the "
                         f"parallel degrees and groups); got a {type(model).__name__} that was not parallelized.")
    return state, ctx


def _rows(tensors):
    """The [batch, seq] tensors (every key but the document table), checked to have one shape."""
    rows = {k: t for k, t in tensors.items() if k not in PACKING_KEYS}
    bad = [k for k, t in rows.items() if not torch.is_tensor(t) or t.dim() != 2]
    if bad:
        got = [tuple(rows[k].shape) if torch.is_tensor(rows[k]) else type(rows[k]).__name__ for k in bad]
        raise ValueError(f"shard_batch takes [batch, seq] tensors; {bad} are not (shapes {got}). Pass input_ids, "
                         f"labels, position_ids, ... of one shape.")
    shapes = {k: tuple(t.shape) for k, t in rows.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shard_batch needs every tensor in one [batch, seq] shape; got {shapes}. Build labels and "
                         f"position_ids from the same rows as input_ids.")
    return rows


def packed_cu(tensors) -> torch.Tensor | None:
    """The global int32 cu_seqlens of a packed batch (rows flattened in order), or None for dense rows.

    Raises:
        ValueError: a document table that does not cover the rows, or q and k tables that differ.
    """
    rows = _rows(tensors)
    if not rows:
        return None
    total = next(iter(rows.values())).numel()
    cu = tensors.get("cu_seq_lens_q")
    if cu is not None:
        cu_k = tensors.get("cu_seq_lens_k")
        if cu_k is not None and not torch.equal(cu_k.cpu(), cu.cpu()):
            raise ValueError("shard_batch: cu_seq_lens_k differs from cu_seq_lens_q; ndp's attention is "
                             "self-attention over one packed sequence, so the two document tables must be equal.")
        if cu.dim() != 1 or int(cu[0]) != 0 or int(cu[-1]) != total:
            raise ValueError(f"shard_batch: cu_seq_lens_q must run from 0 to the {total} tokens of the batch "
                             f"(rows flattened); got {cu.tolist()[:8]}{'...' if cu.numel() > 8 else ''}.")
        return cu.to(torch.int32)
    seq_idx = tensors.get("seq_idx")
    if seq_idx is not None:
        # one document per row is dense rows, as for positions that never restart inside a row (padded and
        # sharded as such, with no table the model must hand down)
        starts = F.pad(seq_idx[:, 1:] != seq_idx[:, :-1], (1, 0))
        if bool(starts.any()):
            return cu_from_starts(starts)
    pos = tensors.get("position_ids")
    return None if pos is None else packed_rows_cu(pos, *pos.shape)


def _pad_value(name, pad_id):
    if name in LABEL_KEYS:
        return -100
    if name == REAL_TOKENS:
        return 0
    if name == ORIGIN:
        return -1
    if name.endswith("token_type_ids") or name == "cross_attention_mask":
        return 0  # text (Gemma 3's token_type_ids, Qwen-VL's mm_token_type_ids); Mllama: a pad sees no image
    if name == "attention_mask":
        return 1  # pads sit after every real token: under a causal mask no real token sees them
    return pad_id


def pad_rows(rows, multiple, pad_id=0):
    """Dense rows ([batch, seq, ...]) padded at the end to a multiple of `multiple` tokens: labels -100, positions
    continued, attention mask 1, other tensors (input_ids) `pad_id` (``_pad_value``)."""
    seq = next(iter(rows.values())).shape[1]
    extra = -seq % multiple
    if not extra:
        return rows
    out = {}
    for name, t in rows.items():
        if name == "position_ids":
            tail = t[:, -1:] + torch.arange(1, extra + 1, device=t.device, dtype=t.dtype)
        else:
            tail = torch.full((t.shape[0], extra, *t.shape[2:]), _pad_value(name, pad_id), dtype=t.dtype,
                              device=t.device)
        out[name] = torch.cat([t, tail], dim=1)
    return out


def _refuse_unshifted(rows) -> None:
    """Labels equal to the input_ids at every labelled token (two token values at least) are transformers'
    convention, shifted inside the model; shard_batch's are shifted before sharding (a shifted row equals its
    input_ids only where a token repeats), and these would train each token to predict itself."""
    ids, labels = rows.get("input_ids"), rows.get("labels")
    if not (torch.is_tensor(ids) and torch.is_tensor(labels)):
        return
    seen = labels != -100
    if int(seen.sum()) >= 2 and bool((labels[seen] == ids[seen]).all()) and ids[seen].unique().numel() > 1:
        raise ValueError("shard_batch got labels equal to the input_ids at every labelled token: transformers' "
                         "convention, shifted inside the model, which under CP would shift inside each shard. "
                         "shard_batch takes labels shifted before sharding (labels[:, i] is token i's target): "
                         "labels = F.pad(labels[:, 1:], (0, 1), value=-100).")


def refuse_other_batches(rows, mesh, what, fix="") -> None:
    """The ranks of a CP group, and of a TP group, each take their part of one batch: rows that differ between them
    (a sampler over every rank rather than the data-parallel ones) would train on pieces of several batches,
    silently. Compared by two numbers (a checksum of the names, shapes and dtypes, a position-weighted sum of the
    integer rows): their maximum and minimum over the CP group, then over the TP group (one all-reduce each), so
    every rank holding the batch decides alike, before anything that could refuse it on one rank only. `what`
    names the caller, `fix` its own way out."""
    groups = [(axis, mesh_axis(mesh, axis)) for axis in ("cp", "tp")] if mesh is not None else []
    groups = [(axis, g) for axis, g in groups if g.size() > 1]
    rows = {k: t for k, t in rows.items() if torch.is_tensor(t)}
    if not groups or not rows:
        return
    mine = _fingerprint(rows)
    both = torch.cat([mine, -mine])
    for _, g in groups:
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=g.get_group())
    if torch.equal(both[:2], -both[2:]):
        return
    dp, ranks = mesh_axis(mesh, "dp"), math.prod(g.size() for _, g in groups)
    axes = " and ".join(axis for axis, _ in groups) + (" axes" if len(groups) > 1 else " axis")
    raise ValueError(f"{what} got other rows on the {ranks} ranks that each take their part of one batch (the "
                     f"{axes}): the step would train on pieces of several batches. Give every rank of a "
                     f"data-parallel group the same batch: sample over the {dp.size()} data-parallel ranks "
                     f"(DistributedSampler(dataset, num_replicas={dp.size()}, rank={dp.get_local_rank()}) here), not "
                     f"over every rank{fix}.")


def _fingerprint(rows) -> torch.Tensor:
    """[crc32 of the names, shapes and dtypes, a position-weighted sum of the integer rows' values] (int64)."""
    like = next(iter(rows.values()))
    layout = zlib.crc32(repr(sorted((k, tuple(t.shape), str(t.dtype)) for k, t in rows.items())).encode())
    total = torch.zeros((), dtype=torch.int64, device=like.device)
    for t in rows.values():
        if not t.is_floating_point():
            flat = t.reshape(-1).to(like.device, torch.int64)
            total = total + (flat * (torch.arange(flat.numel(), device=like.device) % 9973 + 1)).sum()
    return torch.stack([torch.tensor(layout, dtype=torch.int64, device=like.device), total])


def _refuse_restarts(pos, mask) -> None:
    """A batch with an attention_mask is rows, as transformers reads it (position_ids then place RoPE only): under
    CP, positions that restart between real tokens would be sharded as packed documents, which they are not."""
    if not torch.is_tensor(pos) or pos.shape != mask.shape:
        return
    keep = mask.bool()
    inside = position_restarts(pos)[:, 1:] & keep[:, 1:] & keep[:, :-1]
    if bool(inside.any()):
        rows = sorted(set(inside.nonzero()[:, 0].tolist()))
        raise ValueError(f"an attention_mask with position_ids that restart between real tokens (rows {rows}): "
                         f"transformers then attends across the restarts (a 2-D mask given, position_ids place RoPE "
                         f"only), which context parallelism cannot shard as rows. Drop the attention_mask to train the "
                         f"documents apart (packed rows, what DataCollatorWithFlattening gives), or the position_ids.")


def without_padding(tensors: dict, *, pads_read: bool = True) -> dict:
    """`tensors` with a right-padded batch's ``attention_mask`` made all ones, for context parallelism (which applies
    no padding mask): under a causal mask no real token sees a pad (pads come last), so every real token's output
    is unchanged, and with -100 as every pad's label (``labels``, ``shift_labels``) the pads' outputs, which then
    also see earlier pads, reach no loss: the loss and every gradient are the padded batch's. ``shard_batch`` pads
    the same way. Other tensors are returned as they are. ``pads_read=False``: the caller reads no pad's output (a
    sequence head's pooled real token), so no labels are needed.

    Raises:
        ValueError: padding that is not at the end of each row, a batch without labels (unless ``pads_read`` is
            False), a pad with a label, or position_ids that restart between real tokens (with a mask they place
            RoPE only: rows, not documents).
    """
    mask = tensors.get("attention_mask")
    if not torch.is_tensor(mask) or mask.dim() != 2:
        return tensors
    _refuse_restarts(tensors.get("position_ids"), mask)
    if bool(mask.all()):
        return tensors
    starts, lengths, one_run = padding_of(mask)
    right = one_run and not any(starts)
    fix = "Pad on the right with labels -100 at every pad, or pack the documents (DataCollatorWithFlattening)."
    if not right:
        raise ValueError(f"context parallelism takes right padding only; the attention_mask has padding that is not "
                         f"all at the end of each row (real tokens per row: {lengths}). {fix}")
    names = [k for k in LABEL_KEYS if torch.is_tensor(tensors.get(k))]
    if not names and pads_read:
        raise ValueError(f"a padded batch under context parallelism needs its labels (labels or shift_labels, -100 "
                         f"at every pad): the pads' outputs differ from the padded model's, and only labels of -100 "
                         f"keep them out of the loss. {fix}")
    for name in names:
        labelled = int((tensors[name][mask == 0] != -100).sum())
        if labelled:
            raise ValueError(f"{name} at padded positions must be -100 under context parallelism; {labelled} pads "
                             f"have a label (their outputs differ from the padded model's). {fix}")
    ones = torch.ones_like(mask)
    setattr(ones, REAL_TOKENS, mask)
    return dict(tensors, attention_mask=ones)


def origin_rows(like) -> torch.Tensor:
    """The ``ORIGIN`` row of a ``[batch, seq]`` batch shaped as `like`: each token's index in the flattened rows."""
    return torch.arange(like.numel(), device=like.device).reshape(like.shape)


def gather_over(tensor, axis) -> torch.Tensor:
    """`tensor` of every rank of the 1-D mesh `axis`, concatenated along dim 0 in rank order (itself alone on an axis
    of one rank)."""
    if axis.size() == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(axis.size())]
    dist.all_gather(parts, tensor.contiguous(), group=axis.get_group())
    return torch.cat(parts)


def gather_tokens(shard, origin, shape, axis) -> torch.Tensor:
    """Per-token values of this rank's CP shard (``[rows, tokens, ...]``, `origin` the shard's ``ORIGIN`` row)
    gathered from every rank of the CP axis `axis` into the batch's ``shape`` (``[batch, seq]``) and order, ndp's
    pads dropped: what a run without CP computes for the batch, on every rank. A packed batch's shards differ in
    length: each is padded to the longest for the all-gather. Differentiable: every rank uses the whole batch's
    values, so a shard's gradient is the sum of every CP rank's gradient of its tokens (one all-reduce)."""
    if shard.requires_grad and torch.is_grad_enabled():
        return _GatherTokens.apply(shard, origin, tuple(shape), axis)
    return _gathered_tokens(shard.detach(), origin, shape, axis)


def _gathered_tokens(shard, origin, shape, axis) -> torch.Tensor:
    if shard.dtype == torch.bool:  # gloo gathers no bool
        return _gathered_tokens(shard.to(torch.uint8), origin, shape, axis).bool()
    values = shard.reshape(origin.numel(), *shard.shape[origin.dim():])
    where = origin.reshape(-1)
    most = int(gather_over(torch.tensor([where.numel()], device=where.device), axis).max())
    values = torch.cat([values, values.new_zeros(most - len(values), *values.shape[1:])])
    where = F.pad(where, (0, most - where.numel()), value=-1)
    values, where = gather_over(values, axis), gather_over(where, axis)
    keep = where >= 0
    if int(keep.sum()) != math.prod(shape):
        raise RuntimeError(f"gather_tokens: the CP shards hold {int(keep.sum())} of the batch's {math.prod(shape)} "
                           f"tokens (shape {tuple(shape)}); the ORIGIN rows were not sharded with the batch")
    out = values.new_zeros(math.prod(shape), *values.shape[1:])
    out[where[keep]] = values[keep]
    return out.reshape(*shape, *values.shape[1:])


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, origin, shape, axis):
        ctx.save_for_backward(origin)
        ctx.shard_shape, ctx.axis = shard.shape, axis
        return _gathered_tokens(shard, origin, shape, axis)

    @staticmethod
    def backward(ctx, grad):
        (origin,) = ctx.saved_tensors
        grad = grad.contiguous().clone()
        if ctx.axis.size() > 1:
            all_reduce_sum(grad, ctx.axis.get_group())
        flat = grad.reshape(-1, *grad.shape[origin.dim():])
        where = origin.reshape(-1)
        mine = torch.where((where >= 0).reshape(-1, *[1] * (flat.dim() - 1)), flat[where.clamp(min=0)], 0)
        return mine.reshape(ctx.shard_shape), None, None, None


def _take_dp_rows(state, rows):
    dp_size = state.config.dp_size
    dp_rank = state.axis("dp").get_local_rank()
    out = {}
    for name, t in rows.items():
        if t.shape[0] % dp_size:
            raise ValueError(f"shard_batch(global_batch=True): {name} has batch size {t.shape[0]}, not divisible by "
                             f"the data-parallel size {dp_size} (dp_replicate_size={state.config.dp_replicate_size}"
                             f" x dp_shard_size={state.config.dp_shard_size}). Use a global batch that is a "
                             f"multiple of {dp_size}.")
        n = t.shape[0] // dp_size
        out[name] = t[dp_rank * n:(dp_rank + 1) * n]
    return out


def document_positions(tensors) -> torch.Tensor:
    """[batch, seq] position_ids for a batch that has none: inside each document of a packed batch (its
    ``cu_seq_lens_q`` or ``seq_idx``), else 0 .. seq - 1 in every row."""
    like = next(iter(_rows(tensors).values()))
    cu = packed_cu(tensors)
    return _positions_in_rows(like) if cu is None else _positions_in_documents(cu, like)


def _positions_in_rows(like):
    """[batch, seq] positions 0 .. seq - 1 in every row (dense rows)."""
    return torch.arange(like.shape[1], device=like.device).expand(like.shape).contiguous()


def _positions_in_documents(cu, like):
    """[batch, seq] positions restarting at every document of the flattened rows (RoPE of a packed batch)."""
    cu = cu.to(like.device, torch.int64)
    t = torch.arange(like.numel(), device=like.device)
    doc = torch.searchsorted(cu, t, right=True) - 1
    return (t - cu[doc]).reshape(like.shape)


def _shard_packed(rows, cu, ctx, pad, pad_id):
    shard = ndp.cp.shard_packed(cu, world_size=ctx.size, rank=ctx.rank)
    if 0 in shard.counts:  # the same on every rank: cu is the global table
        rows, cu = _padding_document(rows, cu, shard.counts, ctx.size, pad, pad_id)
        shard = ndp.cp.shard_packed(cu, world_size=ctx.size, rank=ctx.rank)
    out = {name: t.reshape(1, -1)[:, shard.index.to(t.device)] for name, t in rows.items()}
    like = next(iter(rows.values()))
    if "position_ids" not in out:
        out["position_ids"] = shard.position_ids.to(like.device)[None]
    out.update(document_table(cu, like.device))
    return out


def _padding_document(rows, cu, counts, cp_size, pad, pad_id):
    """(rows, cu) of a packed batch that leaves a rank without a token (no document of 2 x cp_size tokens to cut
    over every rank, fewer documents than ranks: a model cannot run on an empty shard), flattened into one row with
    one more document at the end: 2 x cp_size pads, cut over every rank. Pads are their own document (no real token
    attends to them) with labels -100, so the loss and every gradient are the batch's.

    Raises:
        ValueError: ``pad=False``, or no ``labels`` / ``shift_labels`` to keep the pads out of the loss.
    """
    lens = (cu[1:] - cu[:-1]).tolist()
    fix = "Pack more tokens per batch (a document of at least 2 x cp_size tokens spans every rank)"
    if not pad or not any(k in rows for k in LABEL_KEYS):
        why = "pad=False" if not pad else "the batch has no labels (or shift_labels) to keep pads out of the loss"
        raise ValueError(f"a packed batch of documents {lens[:16]}{'...' if len(lens) > 16 else ''} leaves "
                         f"{counts.count(0)} of the {cp_size} context-parallel ranks without a token (tokens per "
                         f"rank: {list(counts)}), and it is not padded ({why}). {fix}, or pass the labels to "
                         f"shard_batch with pad=True (the default) to add a padding document.")
    n = 2 * cp_size
    out = {}
    for name, t in rows.items():
        t = t.reshape(1, -1)
        if name == "position_ids":
            tail = torch.arange(n, device=t.device, dtype=t.dtype)[None]
        elif name == "seq_idx":  # the next document's index
            tail = (t[:, -1:] + 1).expand(1, n)
        else:
            tail = torch.full((1, n), _pad_value(name, pad_id), dtype=t.dtype, device=t.device)
        out[name] = torch.cat([t, tail], dim=1)
    return out, torch.cat([cu, cu[-1:] + n])


def document_table(cu, device) -> dict:
    """The packed batch's global document table as transformers' attention kwargs (``PACKING_KEYS``)."""
    longest = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    cu = cu.to(device=device, dtype=torch.int32)
    return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)


def shard_batch(model, *, global_batch: bool = False, pad: bool = True, **tensors):
    """This rank's piece of a batch: its data-parallel rows, then its context-parallel shard.

    Shift labels *before* sharding (``labels[:, i]`` is the target of token i; -100 for none).

    Args:
        model: a model returned by ``ndp.hf.parallelize``.
        global_batch: False (default): the tensors are this data-parallel rank's own batch. True: the global batch,
            the same on every rank; this rank takes ``batch / dp_size`` consecutive rows (block r of the ``dp``
            axis), then its CP shard.
        pad: pad dense rows at the end to the multiple the CP layout needs (2 x cp_size for zigzag, cp_size
            otherwise): labels -100, position_ids continued, input_ids the model's pad_token_id (0 without one),
            attention_mask 1. Under a causal mask no real token sees the pads, so the loss and gradients equal the
            unpadded ones. A packed batch too short to give every CP rank a token (no document of 2 x cp_size
            tokens, fewer documents than ranks) gets one padding document of 2 x cp_size tokens at the end
            (labels -100). False: such batches raise.
        tensors: ``[batch, seq]`` tensors (``input_ids``, ``labels``, ``position_ids``, ``seq_idx``,
            ``attention_mask``: right padding, every pad labelled -100, under CP; ...) and, for a
            packed batch, ``cu_seq_lens_q``/``cu_seq_lens_k``/``max_length_q``/``max_length_k`` as
            ``DataCollatorWithFlattening`` makes them. Under CP, a multimodal model's batch with a tower's input
            (``pixel_values``, ``image_grid_thw``, ...: tensors that are not ``[batch, seq]`` rows) reaches the
            model whole: its rows are padded as above, only the labels are sharded, and the model's text decoder
            takes this rank's shard at its entry (``ndp.hf.multimodal``; packed rows with images are refused).
    Returns:
        dict of the same names, on the device the model computes on (the mesh's: this process's current GPU; keep
        them there: the position_ids carry which tokens are pads, ``REAL_TOKENS``, which a copy drops);
        position_ids added when missing (global positions; packed: positions inside each
        document), so that RoPE sees true positions. Dense: ``[batch (/ dp_size), seq / cp_size]``. Packed under
        CP: ``[1, local_tokens]`` (documents balanced by
        ``shard_packed``) plus ``cu_seq_lens_q``/``cu_seq_lens_k`` (the global table the attention needs),
        ``max_length_q``/``max_length_k``. Pass it all to the model (its own loss is then ``ndp.hf.loss``'s: the
        labels are marked as shifted, ``SHIFTED``), or all but ``labels`` for ``ndp.hf.loss`` on the logits.
    Raises:
        ValueError: the model was not parallelized by ndp; tensors of different shapes; rows that differ between the
            ranks of a CP or TP group (each must be given its data-parallel batch whole); labels equal to the
            input_ids at every labelled token (not shifted); a document table that does
            not cover the rows; (global_batch) a batch size that does not divide by the data-parallel size;
            (pad=False) a length the layout cannot shard, or a packed batch that leaves a rank without a token (also
            with pad=True when it has no labels); under CP, an ``attention_mask`` with padding that
            ``without_padding`` cannot drop exactly (not at the end of each row, a pad with a label, or position_ids
            restarting between real tokens).
    """
    state, ctx = parallel_state(model, "shard_batch")
    device = mesh_device(state.mesh)
    if device is not None:  # the shard made where the model computes: what it carries (REAL_TOKENS) a copy drops
        tensors = {k: t.to(device) if torch.is_tensor(t) else t for k, t in tensors.items()}
    if keeps_whole(model, tensors):
        return _whole_batch(model, state, ctx, tensors, global_batch)
    rows = _rows(tensors)
    refuse_other_batches(rows, state.mesh, "shard_batch",
                         "; or pass the global batch, the same everywhere, with global_batch=True")
    _refuse_unshifted(rows)
    if global_batch and state.config.dp_size > 1:
        if "cu_seq_lens_q" in tensors:
            raise ValueError("shard_batch(global_batch=True) cannot split a packed batch with cu_seq_lens_q over "
                             f"{state.config.dp_size} data-parallel ranks (its rows share one document table). Give "
                             f"each data-parallel rank its own packed batch and global_batch=False.")
        rows = _take_dp_rows(state, rows)
    cu = packed_cu({**tensors, **rows})
    if not ctx.enabled:
        if cu is not None and rows and "position_ids" not in rows:
            rows["position_ids"] = _positions_in_documents(cu, next(iter(rows.values())))
        return _mark_shifted({**tensors, **rows})
    return _mark_shifted(shard_rows(without_padding(rows), ctx, cu=cu, pad=pad, pad_id=pad_id_of(model)))


def pad_id_of(model) -> int:
    """The token ndp pads input_ids with: the text decoder's pad_token_id (0 without one). No real token sees a pad
    (they come last, under a causal mask), but its id must be in the vocabulary the decoder embeds."""
    pad_id = getattr(text_config(model), "pad_token_id", None) if hasattr(model, "config") else None
    return pad_id if isinstance(pad_id, int) else 0


def keeps_whole(model, tensors) -> bool:
    """Whether a batch carries a tower's input for `model` (a model with towers given a tensor that is not one of the
    batch's ``[batch, seq]`` rows: pixel_values, image_grid_thw, ...); under CP such a batch reaches the model whole,
    its text decoder taking the shard (``ndp.hf.multimodal``)."""
    if getattr(model, DECODER_SHARDS, None) is None:
        return False
    like = tensors.get("input_ids", tensors.get("labels"))
    return any(torch.is_tensor(t) and t.dim() > 0 and k not in PACKING_KEYS and (like is None or t.shape != like.shape)
               for k, t in tensors.items())


def _whole_batch(model, state, ctx, tensors, global_batch):
    """shard_batch of a batch that reaches `model` whole (:func:`keeps_whole`): its rows checked; under CP right
    padding dropped and rows padded to the layout's multiple as for a sharded batch, only the labels sharded."""
    ids = tensors.get("input_ids")
    rows = row_tensors(tensors)
    if not torch.is_tensor(ids) or ids.dim() != 2:
        raise ValueError(f"{type(model).__name__} under context parallelism takes a batch with images (or another "
                         f"tower's input) whole, its text decoder sharding it: it needs the input_ids ([batch, seq]) "
                         f"that place them; got {sorted(tensors)}.")
    refuse_other_batches({k: t for k, t in tensors.items() if torch.is_tensor(t)}, state.mesh, "shard_batch")
    _refuse_unshifted(rows)
    if global_batch and state.config.dp_size > 1:
        raise ValueError(f"shard_batch(global_batch=True) cannot split a batch with images over "
                         f"{state.config.dp_size} data-parallel ranks (which images belong to which rows is the "
                         f"model's). Give each data-parallel rank its own batch and global_batch=False.")
    if not ctx.enabled:
        return _mark_shifted(dict(tensors))
    refuse_packed_whole(model, tensors, rows)
    rows = whole_rows(without_padding(rows), ctx, pad_id_of(model))
    return _mark_shifted({**tensors, **rows})


def row_tensors(tensors: dict) -> dict:
    """The tensors of a batch given whole that are along its rows: [batch, seq] as its input_ids, and [batch, seq,
    ...] (Mllama's cross_attention_mask), which :func:`whole_rows` pads with them."""
    ids = tensors.get("input_ids")
    if not torch.is_tensor(ids):
        return {}
    return {k: t for k, t in tensors.items() if torch.is_tensor(t) and t.dim() >= 2 and t.shape[:2] == ids.shape}


def refuse_packed_whole(model, tensors, rows) -> None:
    """Refuse a packed batch (a document table, positions or seq_idx restarting inside a row) that reaches `model`
    whole: its text decoder cuts rows, not documents."""
    flat = {k: t for k, t in rows.items() if t.dim() == 2}  # [batch, seq]: what names documents
    if packed_cu({**flat, **{k: tensors[k] for k in PACKING_KEYS if k in tensors}}) is not None:
        raise Unsupported(f"{type(model).__name__}: packed documents with images (or another tower's input) under "
                          f"context parallelism: ndp cuts such a batch at the text decoder, as rows. Pad the rows "
                          f"(labels -100 at the pads) instead of packing them, or train packed batches with cp_size=1.")


def whole_rows(rows, ctx, pad_id=0):
    """The ``[batch, seq]`` rows of a batch that reaches the model whole: padded at the end to the CP layout's
    multiple (as :func:`pad_rows`), the labels (``LABEL_KEYS``, ``ORIGIN``) sharded, the others whole, the
    input_ids a view carrying the :class:`Whole` facts (``WHOLE``)."""
    longest = _longest(rows, None)
    rows = pad_rows(dict(rows, **{REAL_TOKENS: _real_tokens(rows)}), seq_multiple(ctx.size, ctx.layout), pad_id)

    def shard(t):
        return ndp.cp.shard_sequence(t, dim=1, group=ctx.group, layout=ctx.layout)

    out = {k: shard(t) if k in (*LABEL_KEYS, ORIGIN) else t for k, t in rows.items() if k != REAL_TOKENS}
    ids = out["input_ids"].view_as(out["input_ids"])
    setattr(ids, WHOLE, Whole(shard(rows[REAL_TOKENS]), longest, ids.shape[1]))
    out["input_ids"] = ids
    return out


@contextlib.contextmanager
def holding(var: contextvars.ContextVar, value):
    """Inside, `var` holds `value` (yielded); its value before, after."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


def shard_positions(position_ids):
    """Inside, a forward's facts of the batch (``REAL_TOKENS``, ``LONGEST``: :func:`shard_attribute`) are those of
    `position_ids`, the shard's as :func:`shard_rows` returned them: for a caller that hands the model its shard in
    other tensors (ndp.accelerate's ``maybe_context_parallel``)."""
    return holding(_SHARD_POSITIONS, position_ids)


def shard_attribute(kwargs, name):
    """Attribute `name` (``REAL_TOKENS``, ``LONGEST``) of the shard a forward with `kwargs` runs on: of the
    position_ids :func:`shard_positions` holds, else of the forward's; None where ndp did not shard it."""
    held = _SHARD_POSITIONS.get()
    value = getattr(held if held is not None else kwargs.get("position_ids"), name, None)
    whole = whole_of(kwargs.get("input_ids"))
    if value is None and whole is not None:
        return {REAL_TOKENS: whole.real_tokens, LONGEST: whole.longest}.get(name)
    return value


def _mark_shifted(batch: dict) -> dict:
    labels = batch.get("labels")
    if torch.is_tensor(labels):
        batch["labels"] = labels.view_as(labels)  # the caller's own tensor stays unmarked
        setattr(batch["labels"], SHIFTED, True)
    return batch


def items_per_rank(shift_labels, model):
    """The labelled tokens of the batch, summed over the ranks FSDP averages gradients on (``dp_cp``), divided by
    their number (fsdp_size): a rank's loss summed over its shard and divided by this is the one ``ndp.hf.loss``
    returns, whose gradient FSDP's average makes the batch mean's."""
    state, _ = parallel_state(model, "items_per_rank")
    count = (shift_labels != -100).sum().to(torch.float64).reshape(1)
    group = state.axis("dp_cp")
    if group is not None and group.size() > 1:
        dist.all_reduce(count, group=group.get_group())
    return (count / state.config.fsdp_size).clamp(min=1e-12).to(torch.float32)[0]


def guard_labels(model, ctx) -> None:
    """A forward pre-hook on `model` for its own loss (``labels`` given). The labels :func:`shard_batch` returns
    are shifted: they become ``shift_labels``, with ``num_items_in_batch`` from :func:`items_per_rank` unless given,
    so ``model(**batch).loss`` is the loss ``ndp.hf.loss`` returns (transformers' shifts ``labels`` again:
    every target one token late). A model parallelized with ``loss_parallel`` refuses ``labels`` (its logits are
    vocabulary shards: ``ndp.hf.lm_loss``). Under CP ``labels`` without ``shift_labels`` are refused (shifted inside
    each shard, the targets at every shard edge misplaced), and so is a model whose loss ignores ``shift_labels`` and
    ``num_items_in_batch`` (:func:`~ndp.hf.models.takes_shift_labels`). Refused the same way on every rank, which
    all run the forward with their labels, before any layer. Run eagerly under torch.compile (it reads tensor
    attributes, the model class's source, and may all-reduce a count)."""

    @torch.compiler.disable
    def hook(module, args, kwargs):
        labels = kwargs.get("labels")
        if labels is not None and getattr(module, "ndp_loss_parallel", False):
            raise Unsupported(f"{type(module).__name__} was parallelized with loss_parallel: its logits are vocabulary "
                              f"shards, which transformers' loss cannot take. Pass the labels to "
                              f"ndp.hf.lm_loss(model, labels, **batch without labels) instead of the model.")
        marked = getattr(labels, SHIFTED, False)
        if labels is None or not (marked or ctx.enabled):
            return None
        shift = kwargs.get("shift_labels")
        if shift is None and not marked:
            raise ValueError("under context parallelism a model given `labels` shifts them inside this rank's "
                             "shard, which misplaces the targets at every shard edge. Shift them before sharding: "
                             "batch['shift_labels'] = F.pad(labels[:, 1:], (0, 1), value=-100), and pass it among "
                             "maybe_context_parallel's buffers (transformers' loss prefers it over labels), or "
                             "take the batch from ndp.hf.shard_batch.")
        if not takes_shift_labels(module):
            raise Unsupported(f"{type(module).__name__} computes its loss itself from `labels` (not transformers' "
                              f"causal-LM loss: shift_labels and num_items_in_batch are ignored), so on a shard of "
                              f"the batch it is that shard's mean. Compute the loss from the logits: "
                              f"ndp.hf.loss(model(**batch without labels).logits, labels, model).")
        extra = {"shift_labels": labels} if shift is None else {}
        if kwargs.get("num_items_in_batch") is None:
            extra["num_items_in_batch"] = items_per_rank(extra.get("shift_labels", shift), module)
        return args, {**kwargs, **extra}

    model.register_forward_pre_hook(hook, with_kwargs=True)


def shard_rows(rows, ctx, *, cu=None, pad=True, pad_id=0):
    """This rank's context-parallel piece of ``[batch, seq]`` rows (what :func:`shard_batch` does after the
    data-parallel split): packed rows (`cu`: their global document table) per document, dense rows padded (`pad`)
    and sharded in ``ctx.layout``; position_ids added when missing. `pad` pads by the rows' names (``labels``,
    ``shift_labels``: -100): rows under other names are not padded (pass pad=False). The shard's position_ids
    carry its tokens of the batch as ``REAL_TOKENS`` and the batch's longest position as ``LONGEST``."""
    if not rows:
        return {}
    longest = _longest(rows, cu)
    rows = dict(rows, **{REAL_TOKENS: _real_tokens(rows)})
    if cu is not None:
        out = _shard_packed(rows, cu, ctx, pad, pad_id)
    else:
        if "position_ids" not in rows:
            rows["position_ids"] = _positions_in_rows(rows[REAL_TOKENS])  # cu None: dense rows
        if pad:
            rows = pad_rows(rows, seq_multiple(ctx.size, ctx.layout), pad_id)
        out = {k: ndp.cp.shard_sequence(t, dim=1, group=ctx.group, layout=ctx.layout) for k, t in rows.items()}
    setattr(out["position_ids"], REAL_TOKENS, out.pop(REAL_TOKENS))
    setattr(out["position_ids"], LONGEST, longest)
    return out


def _longest(rows, cu) -> torch.Tensor:
    """The rows' max(position_ids) + 1 before padding (``LONGEST``); without position_ids the longest document (a
    packed batch: positions restart at each) or the rows' length (dense rows: 0 .. seq - 1)."""
    pos = rows.get("position_ids")
    like = next(iter(rows.values()))
    if torch.is_tensor(pos):
        return pos.max().reshape(1) + 1
    if cu is not None:
        return (cu[1:] - cu[:-1]).max().reshape(1).to(like.device, torch.int64)
    return torch.full((1,), like.shape[1], device=like.device, dtype=torch.int64)


def _real_tokens(rows):
    """[batch, seq] 1 where a run without CP counts a token: the batch's attention_mask (the one ``without_padding``
    made all ones kept it), else every token."""
    mask = rows.get("attention_mask")
    mask = getattr(mask, REAL_TOKENS, mask)
    if torch.is_tensor(mask) and mask.dim() == 2:
        return mask.to(torch.int8)
    like = next(iter(rows.values()))
    return torch.ones(like.shape[:2], dtype=torch.int8, device=like.device)


__all__ = ["shard_batch", "shard_rows", "items_per_rank", "guard_labels", "packed_cu", "pad_rows", "document_table",
           "document_positions", "parallel_state", "without_padding", "PACKING_KEYS", "LABEL_KEYS", "REAL_TOKENS",
           "SHIFTED", "LONGEST", "shard_positions", "shard_attribute", "refuse_other_batches", "holding", "WHOLE",
           "DECODER_SHARDS", "Whole", "whole_forward", "whole_batch", "whole_of", "keeps_whole", "whole_rows",
           "refuse_packed_whole", "pad_id_of", "row_tensors"]
