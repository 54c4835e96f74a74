"""A multimodal model's batch under context parallelism: whole at the model's entry, sharded at its text decoder's.

A vision-language model (Qwen2-VL, LLaVA, ...) embeds its images with a tower, scatters the features into the text's
placeholder tokens and, for multimodal RoPE, computes every token's positions from the whole row. A batch sharded
before the model would give a rank placeholders that do not match its images, and positions of its shard alone. So
a batch that carries a tower's input (``ndp.hf.batch.keeps_whole``) reaches the model whole on every rank of the CP
group (``shard_batch`` shards its labels only, and marks its input_ids): each rank runs the towers on the whole
images (cp_size times their work: the ranks hold the same images) and embeds the whole rows, and the text decoder's
forward pre-hook cuts what it is given (the embeddings, the positions, a 2-D attention mask, Qwen3-VL's deepstack
features at the shard's visual tokens) into this rank's shard, in the CP layout, as ``shard_batch`` cuts a text
batch. The decoder's output, the logits and the labels are then the shard's, as for text. Gradients: a rank's towers
get its shard's tokens' part; FSDP's reduction over the CP ranks adds the parts up to the whole batch's.

In training, what runs before the text decoder draws its random numbers alike on every rank that holds the batch
(the CP and TP ranks; streams seeded by the first of them, a span of ``ndp.parallel.draws``): a tower's dropout or
drop-path draws once for the batch, as on one process; drawn apart, one image's tokens would carry features of
different draws on different ranks (and a TP rank's decoder another input than its peers'). The decoder draws from
the streams of the forward around the towers again (this rank's own; TP rank 0's under tensor parallel).

Refused by name, on every rank, before the decoder layers run: a decoder argument along the sequence that ndp does
not know how to cut, a dense 4-D mask, inputs given positionally or of another length than the batch's.
"""
from __future__ import annotations

import torch

import ndp.cp
from ndp.parallel import draws_of, mesh_axis

from .attention import raise_on_cp_ranks
from .batch import _WHOLE_FORWARD, LONGEST, REAL_TOKENS, parallel_state, whole_forward, whole_of
from .masks import spec_of
from .models import Unsupported

# The text decoder's arguments a whole batch's shard is cut from; cache_position is dropped (each decoder builds it
# for its shard, as for a sharded text batch).
_CUT = ("inputs_embeds", "input_ids", "position_ids", "attention_mask")
# [batch, ..., seq, ...] decoder arguments cut along their rows at a dim of their own: Gemma 4's per-layer inputs
# ([batch, seq, layers, dim]), Mllama's cross-attention mask and its rows' mask ([batch, 1, seq, vision or 1]).
_ROWS_AT = {"per_layer_inputs": 1, "cross_attention_mask": 2, "full_text_row_masked_out_mask": 2}
_DROPPED = ("cache_position",)
# A [batch, seq] mask of the visual tokens -> the decoder argument holding per-visual-token features placed there,
# in the mask's row-major order (Qwen3-VL's deepstack: one [visual tokens, hidden] tensor per layer it adds to): the
# mask is cut as the rows, the features to the shard's visual tokens.
_PLACED = {"visual_pos_masks": "deepstack_visual_embeds"}


def guard_whole_batches(model, decoder: str, ctx) -> None:
    """Under CP, `model` (with towers; `decoder`: its text decoder's name) takes batches whole where
    ``shard_batch`` marks them so: forward hooks hold the batch's facts through the forward (``whole_forward``)
    and a forward pre-hook on the decoder cuts its inputs into this rank's shard (module docstring)."""
    held, draws, depths = [], draws_of(model), []

    @torch.compiler.disable
    def enter(module, args, kwargs):
        whole = whole_of(kwargs.get("input_ids"))
        held.append(_WHOLE_FORWARD.set(whole))
        if whole is not None and module.training:
            mesh = parallel_state(module, "ndp.hf.multimodal")[0].mesh
            groups = [mesh_axis(mesh, axis) for axis in ("cp", "tp")]
            depths.append(draws.share_seed([g.get_group() for g in groups if g.size() > 1],
                                           kwargs["input_ids"].device))

    def own():
        if depths:  # the towers' span ends: the decoder draws from the streams of the forward around them
            draws.unwind(depths.pop())

    @torch.compiler.disable
    def leave(module, args, kwargs, output):
        own()  # where the forward ended before its decoder ran
        if held:
            _WHOLE_FORWARD.reset(held.pop())

    @torch.compiler.disable
    def cut(module, args, kwargs):
        whole = whole_forward()
        if whole is None:
            return None
        own()
        try:
            kwargs = shard_decoder_inputs(module, args, kwargs, whole, ctx)
        except Unsupported as error:
            raise_on_cp_ranks(error, ctx, f"ndp_{ctx.impl} attention")
        return args, kwargs

    # after the forward's own span of tensor-parallel draws (ndp.parallel.draws): the towers' nests inside it
    model.register_forward_pre_hook(enter, with_kwargs=True)
    model.register_forward_hook(leave, with_kwargs=True, always_call=True)
    model.get_submodule(decoder).register_forward_pre_hook(cut, with_kwargs=True)


def shard_decoder_inputs(module, args, kwargs, whole, ctx) -> dict:
    """`kwargs` of the text decoder `module` with its whole inputs cut into this rank's shard: its tokens
    (inputs_embeds, else input_ids: Mllama's decoder embeds them) and a 2-D attention mask along dim 1, the
    arguments of ``_ROWS_AT`` along theirs, position_ids (``[batch, seq]``, or multimodal RoPE's ``[k, batch, seq]``)
    along their last dim (0 .. seq - 1 where none are given), carrying the shard's REAL_TOKENS and the batch's
    LONGEST."""
    name = type(module).__name__
    key = "inputs_embeds" if kwargs.get("inputs_embeds") is not None else "input_ids"
    tokens = kwargs.get(key)
    if args or not torch.is_tensor(tokens) or tokens.dim() != (3 if key == "inputs_embeds" else 2) or \
            tokens.shape[1] != whole.seq:
        got = tuple(tokens.shape) if torch.is_tensor(tokens) else None
        raise Unsupported(f"{name} got a whole batch of {whole.seq} tokens under context parallelism, but not as "
                          f"inputs_embeds [batch, {whole.seq}, hidden] or input_ids [batch, {whole.seq}] by keyword "
                          f"(got {len(args)} positional arguments, {key} {got}): ndp cannot cut it into this rank's "
                          f"shard. Train batches with images with cp_size=1.")
    batch, seq = tokens.shape[:2]
    _refuse_uncut(name, kwargs, batch, seq)
    pos = kwargs.get("position_ids")
    if pos is None:
        pos = torch.arange(seq, device=tokens.device).expand(batch, seq)
    out = {k: v for k, v in kwargs.items() if k not in _DROPPED}
    for k in ("inputs_embeds", "input_ids"):
        if torch.is_tensor(kwargs.get(k)):  # both given: the decoder would refuse them, as without CP
            out[k] = _cut(kwargs[k], 1, ctx)
    out["position_ids"] = _cut(pos, pos.dim() - 1, ctx)
    mask = kwargs.get("attention_mask")
    if torch.is_tensor(mask) and mask.dim() == 2:
        out["attention_mask"] = _cut(mask, 1, ctx)
    for arg, dim in _ROWS_AT.items():
        t = kwargs.get(arg)
        if torch.is_tensor(t):
            if t.dim() <= dim or t.shape[0] != batch or t.shape[dim] != seq:
                raise Unsupported(f"{name} got {arg} {tuple(t.shape)} under context parallelism; ndp cuts it along "
                                  f"dim {dim} as [batch ({batch}), ..., seq ({seq}) at dim {dim}, ...]. Train batches "
                                  f"with images with cp_size=1.")
            out[arg] = _cut(t, dim, ctx)
    for where, features in _PLACED.items():
        if torch.is_tensor(kwargs.get(where)):
            out[where], out[features] = _placed(name, kwargs[where], kwargs.get(features), features, ctx)
    setattr(out["position_ids"], REAL_TOKENS, whole.real_tokens)
    setattr(out["position_ids"], LONGEST, whole.longest)
    return out


def _refuse_uncut(name, kwargs, batch, seq) -> None:
    """Refuse the decoder arguments along the sequence ndp cannot cut: tensors other than :data:`_CUT` with the
    batch's length in a dim, and a mask that is neither 2-D nor ndp's (a dense 4-D one, over the whole batch)."""
    mask = kwargs.get("attention_mask")
    masks = mask.values() if isinstance(mask, dict) else [mask]
    dense = [tuple(m.shape) for m in masks if torch.is_tensor(m) and m.dim() > 2 and spec_of(m) is None]
    if dense:
        raise Unsupported(f"{name} got a dense attention mask {dense[0]} over the whole batch under context "
                          f"parallelism: ndp cannot cut it into this rank's shard. Let the model build its mask "
                          f"(no 4-D attention_mask), or train batches with images with cp_size=1.")
    for key, value in kwargs.items():
        if key in (*_CUT, *_DROPPED, *_PLACED, *_ROWS_AT):
            continue
        along = [t for t in _tensors(value) if seq in tuple(t.shape) and t.numel() >= batch * seq]
        if along:
            raise Unsupported(f"{name} got {key} {tuple(along[0].shape)} along the batch's {seq} tokens under "
                              f"context parallelism, which ndp does not know how to cut into this rank's shard (it "
                              f"cuts {', '.join(_CUT)}). Train batches with images with cp_size=1.")


def _tensors(value) -> list:
    """The tensors in `value`, inside lists, tuples and dicts too."""
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    return [t for v in value for t in _tensors(v)] if isinstance(value, (list, tuple)) else []


def _placed(name, where, features, key, ctx):
    """(the shard's mask, its features): `where` ([batch, seq] bool) cut as the rows, and of each tensor of
    `features` (rows in `where`'s row-major order) the rows of the shard's marked tokens, in the shard's order."""
    count = int(where.sum())
    tensors = list(features) if isinstance(features, (list, tuple)) else None
    if tensors is None or any(not torch.is_tensor(f) or f.shape[0] != count for f in tensors):
        got = [tuple(f.shape) if torch.is_tensor(f) else type(f).__name__ for f in tensors or [features]]
        raise Unsupported(f"{name} got {key} {got} for a mask of {count} tokens under context parallelism: ndp cuts "
                          f"a list of [{count}, ...] tensors, one row per marked token. Train batches with images "
                          f"with cp_size=1.")
    order = (torch.cumsum(where.reshape(-1).long(), 0) - 1).view_as(where)
    mine = _cut(where, 1, ctx)
    rows = _cut(order, 1, ctx)[mine]
    return mine, [f[rows] for f in tensors]


def _cut(t, dim, ctx):
    # by rank, with no group: the backward gives this rank's shard's gradient alone (zeros elsewhere), which FSDP's
    # reduction adds up over the CP ranks; a group's backward would gather the whole gradient on every rank
    return ndp.cp.shard_sequence(t, dim=dim, layout=ctx.layout, world_size=ctx.size, rank=ctx.rank)


__all__ = ["guard_whole_batches", "shard_decoder_inputs"]
