"""The mask a transformers model asks for, read from its mask function instead of materialised.

transformers builds each layer type's mask from a *mask function* (``masking_utils``: causal, sliding-window,
chunked, packed-sequence pieces joined by ``and_masks``). ndp's attention builds no dense mask: it applies
causality, a window or document boundaries itself. :func:`describe` reads the mask function's pieces (their code
and closure values) into a :class:`MaskSpec`, so that the attention call applies exactly that mask; a piece ndp
cannot express (a learned or arbitrary mask, ``or_masks``) raises :class:`~ndp.hf.models.Unsupported` instead of
being dropped. Bidirectional image blocks (``blockwise_overlay`` or-ed to the causal mask: Gemma 3, Gemma 4) become
each row's spans (``MaskSpec.spans``: every image's token run, attended bidirectionally, a sliding window and-ed
after the or still bounding the keys before a query); what cannot be a span (an image group whose tokens are not one
run, a window inside the or) depends on the data, so its refusal travels in the spec and the attention raises it on
every CP rank at once.

A dense 4-D mask handed to the model (transformers passes it to the attention as it is: a user's "custom 4D mask",
or one a model builds itself, BLT's cross-attention) is read by :func:`read_dense`: full attention, causal, or causal
packed documents are applied exactly; any other mask is refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from transformers import masking_utils as mu

from ndp_kernels.segments import cu_from_starts, read_once

from .models import Unsupported


@dataclass(frozen=True)
class MaskSpec:
    """A mask ndp applies itself: ``causal``; ``window`` (transformers' sliding window: a query sees itself and
    the ``window - 1`` keys before it); ``chunk`` (queries see keys of their own ``chunk``-token block only);
    ``packed`` (documents told apart by position_ids that do not continue); ``lengths`` / ``starts``: each row's
    run of real tokens where transformers' 2-D padding mask masks something (read once per forward), else None;
    ``q_offset`` / ``kv_offset``: the positions of the first query and key in that mask (a KV cache), else 0;
    ``mask_given``: the batch came with a 2-D attention_mask, so position_ids place RoPE only (transformers then
    reads no packed documents from them, all-ones mask included); ``spans``: per row, the ``(start, end)`` position
    ranges of its image blocks (attended bidirectionally), None where no row has one; ``refused``: why this batch
    cannot be attended exactly (a data-dependent refusal the attention raises on every rank), else None."""
    causal: bool = True
    window: int | None = None
    chunk: int | None = None
    packed: bool = False
    lengths: tuple[int, ...] | None = None
    starts: tuple[int, ...] | None = None
    q_offset: int = 0
    kv_offset: int = 0
    mask_given: bool = False
    spans: tuple | None = None
    refused: str | None = None


def _code(factory, *args):
    fn = getattr(mu, factory, None)
    return None if fn is None else fn(*args).__code__


_CAUSAL = mu.causal_mask_function.__code__
_FULL = mu.bidirectional_mask_function.__code__
_AND = _code("and_masks", mu.causal_mask_function)
_WINDOW = _code("sliding_window_overlay", 1)
_CHUNK = _code("chunked_overlay", 1, None)
_PACKED = _code("packed_sequence_mask_function", None)
_REMAP = _code("remap_positions_for_packed_sequence", mu.causal_mask_function, None)
_OR = _code("or_masks", mu.causal_mask_function)
_BLOCKWISE = _code("blockwise_overlay", None)
IMAGE_BLOCKS = ("the batch has bidirectional image blocks (tokens with a block_sequence_ids / token_type_ids "
                "group) {why}: ndp attends each image's run of tokens bidirectionally, under the causal mask and a "
                "sliding window and-ed after it. Use the model's own attention implementation (cp_size=1).")


def _closure(fn) -> dict:
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))


def _pieces(fn):
    """The mask function as a flat list of its and-ed pieces (packed remapping unwrapped; an or-ed image-block
    piece is kept as itself, for ``describe`` to judge, behind the base's window if the base has one)."""
    code = getattr(fn, "__code__", None)
    if code is _AND:
        return [p for f in _closure(fn)["mask_functions"] for p in _pieces(f)]
    if code is _OR:
        fns = _closure(fn)["mask_functions"]
        blocks = [f for f in fns if getattr(f, "__code__", None) is _BLOCKWISE]
        if len(blocks) == len(fns) - 1:  # base OR image blocks: the base's pieces, and the blocks to judge
            base = _pieces(next(f for f in fns if f not in blocks))
            windowed = any(getattr(p, "__code__", None) is _WINDOW for p in base)
            return base + [_InsideOr(b) if windowed else b for b in blocks]
    if code is _REMAP:  # positions remapped inside each packed document: the inner mask, per document
        return _pieces(_closure(fn)["mask_function"])
    return [fn]


class _InsideOr:
    """An image-block piece or-ed to a windowed mask: its keys beyond the window would be seen too (no model
    composes its mask so; Gemma and-s the window after the or). Refused where the batch has image blocks."""

    def __init__(self, piece):
        self.piece = piece


def _block_spans(ids) -> tuple[tuple | None, str | None]:
    """(per row, the (start, end) runs of each image group of `ids` ([batch, positions], -1 = text), or None where
    no row has one; why they cannot be spans, else None)."""
    if not torch.is_tensor(ids) or not bool((ids >= 0).any()):
        return None, None
    ids = ids.cpu()
    image = ids >= 0
    first = image & (ids != F.pad(ids, (1, 0), value=-1)[:, :-1])
    last = image & (ids != F.pad(ids, (0, 1), value=-1)[:, 1:])
    rows = []
    for i in range(ids.shape[0]):
        starts, ends = first[i].nonzero()[:, 0], last[i].nonzero()[:, 0] + 1
        if ids[i, starts].unique().numel() != starts.numel():
            return None, "with an image group whose tokens are not one run"
        rows.append(tuple(zip(starts.tolist(), ends.tolist())))
    return tuple(rows), None


def describe(mask_function) -> MaskSpec:
    """The MaskSpec of a transformers mask function.

    Raises:
        Unsupported: a piece ndp cannot apply exactly (named in the message).
    """
    causal, window, chunk, packed, spans, refused = False, None, None, False, None, None
    for piece in _pieces(mask_function):
        code = getattr(piece, "__code__", None)
        if code is _CAUSAL:
            causal = True
        elif code is _FULL:
            pass
        elif code is _WINDOW:
            w = int(_closure(piece)["sliding_window"])
            window = w if window is None else min(window, w)
        elif code is _CHUNK:  # with left padding, chunks count from each row's first real token (with_padding)
            chunk = int(_closure(piece)["chunk_size"])
        elif code is _PACKED:
            packed = True
        elif code is _BLOCKWISE:
            spans, why = _block_spans(_closure(piece)["block_sequence_ids"])
            refused = refused or (why and IMAGE_BLOCKS.format(why=why))
        elif isinstance(piece, _InsideOr):
            if _block_spans(_closure(piece.piece)["block_sequence_ids"])[0] is not None:
                refused = IMAGE_BLOCKS.format(why="or-ed to a sliding-window mask (keys past the window seen)")
        else:
            name = getattr(piece, "__qualname__", type(piece).__name__)
            raise Unsupported(
                f"the model's attention mask uses the mask function {name!r}, which ndp attention cannot apply "
                f"exactly (it applies causal, sliding-window, chunked and packed-document masks). Use the model's "
                f"own attention implementation.")
    if chunk is not None and window is not None:
        raise Unsupported(f"a mask that is both chunked ({chunk}) and windowed ({window}): ndp applies one of them.")
    return MaskSpec(causal=causal, window=window, chunk=chunk, packed=packed, spans=spans, refused=refused)


_PAD_FIX = ("Pad on one side (tokenizer.padding_side), or pack the documents (position_ids restarting at 0, no "
            "attention_mask).")


def padding_of(mask: torch.Tensor) -> tuple[list[int], list[int], bool]:
    """(first real token, real tokens) per row of a 2-D padding mask (1 = real token), and whether every row's real
    tokens form one run (pads before and after it only; an empty row starts at 0)."""
    keep = mask.bool()
    lengths = keep.sum(1)
    starts = keep.int().argmax(1)
    pos = torch.arange(keep.shape[1], device=keep.device)
    one_run = (pos >= starts[:, None]) & (pos < (starts + lengths)[:, None])
    return starts.tolist(), lengths.tolist(), bool((keep == one_run).all())


def with_padding(spec: MaskSpec, mask: torch.Tensor) -> MaskSpec:
    """`spec` for rows padded as the 2-D `mask` ([batch, positions], 1 = real token) says, when ndp can apply it
    exactly (``ndp.hf.padded``): each row's real tokens one run, with pads before it (left padding, a causal mask)
    and after it; queries from ``spec.q_offset`` and keys from ``spec.kv_offset`` on (generation with a KV cache).
    Gaps inside a row and a row with no real token are refused."""
    starts, lengths, one_run = padding_of(mask)
    q_offset, kv_offset = spec.q_offset, spec.kv_offset
    spec = replace(spec, lengths=tuple(lengths), starts=tuple(starts))
    if not one_run or min(lengths) == 0:
        why = "a row with no real token" if one_run else "a gap (pads between real tokens)"
        return replace(spec, refused=f"ndp attention applies padding before and after each row's real tokens; the "
                                     f"attention_mask has {why} (real tokens per row: {lengths}). {_PAD_FIX}")
    if not spec.causal and (max(starts) or q_offset or kv_offset):
        return replace(spec, refused=f"ndp attention applies left padding and a KV cache under a causal mask only; "
                                     f"this mask is not causal (first real token per row: {starts}). {_PAD_FIX}")
    return spec


class _Marker(torch.Tensor):
    """A one-element ``[1, 1, 1, 1]`` True tensor carrying a MaskSpec (a mask's rank, so that shape checks pass).
    A model that computes with its mask outside the attention call (indexes it, adds it to scores: a sparse
    indexer, a learned mask) gets :class:`Unsupported`, not a broadcast scalar."""
    # What frameworks do to every tensor argument (FSDP's input casts, checkpointing, device moves): they keep the
    # spec; anything that reads the mask's values is refused.
    _ALLOWED = {"__get__", "__bool__", "all", "__repr__", "__format__", "__reduce_ex__", "__deepcopy__", "detach",
                "is_floating_point", "is_complex", "dim", "size", "numel", "element_size", "to", "clone",
                "contiguous", "requires_grad_", "__eq__",
                # the metadata torch.compile reads from a graph input (a compiled decoder block's mask argument)
                "_is_view", "is_neg", "is_conj", "untyped_storage", "storage_offset", "stride"}

    # Attributes a framework may set: reentrant checkpointing sets a detached argument's requires_grad.
    _SETTABLE = {"requires_grad"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name == "__set__" and getattr(getattr(func, "__self__", None), "__name__", None) in cls._SETTABLE:
            name = "requires_grad_"
        if name not in cls._ALLOWED:
            raise Unsupported(f"the model computes with its attention mask outside the attention call ({name}); "
                              f"ndp attention applies the mask itself and cannot follow that. Use the model's own "
                              f"attention implementation (cp_size=1).")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if torch.is_tensor(out) and out.shape == (1, 1, 1, 1) and out.dtype == torch.bool:
            source = next(a for a in args if isinstance(a, _Marker))
            out = _carrying(out, source.ndp_mask, source.ndp_documents)
        return out


def _carrying(t, spec, documents):
    t = torch.Tensor._make_subclass(_Marker, t)
    t.ndp_mask, t.ndp_documents = spec, documents
    return t


def marker(spec: MaskSpec, device, documents: torch.Tensor | None = None) -> torch.Tensor:
    """What ndp's mask interface hands the attention calls: a one-element True tensor carrying the spec, and the
    forward's document table (`documents`: cu_seqlens) for layers that do not hand it to their attention."""
    return _carrying(torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device), spec, documents)


def spec_of(attention_mask) -> MaskSpec | None:
    return getattr(attention_mask, "ndp_mask", None)


def documents_of(attention_mask) -> torch.Tensor | None:
    """The document table (cu_seqlens) a marker carries, else None."""
    return getattr(attention_mask, "ndp_documents", None)


_DENSE_FIX = ("Pass the documents as position_ids restarting at 0 (or cu_seq_lens_q) instead of a dense mask, or use "
              "the model's own attention implementation.")


def read_dense(mask: torch.Tensor, batch: int, seq: int, *, sharded: bool) -> tuple[MaskSpec, torch.Tensor | None]:
    """What a dense ``[batch or 1, 1, seq, seq]`` mask asks of self-attention over rows of `seq` tokens, when ndp
    can apply it exactly: every key (full attention, as eager applies an all-keep mask whatever ``is_causal``
    says), causal, or causal documents packed in each row (a block-diagonal causal mask). Boolean masks keep True;
    floating-point masks are added to the scores, so they keep 0 and mask -inf (or transformers' dtype minimum).
    Read once per mask tensor (``read_once``).

    Args:
        sharded: the rows are this rank's CP shard: every dense mask is refused there.
    Returns:
        (spec, cu): ``spec.refused`` names why the mask cannot be applied (raised by the attention, on every CP
        rank), else ``spec.causal``; cu: int32 cu_seqlens of the rows flattened when documents are packed, else None.
    """
    if sharded:  # refused before read_once, which would copy the whole mask first
        return _refused(mask, "reaches a context-parallel shard (each rank holds pieces of the sequence, which a "
                              "dense mask of the shard cannot describe)")
    return read_once(mask, ("read_dense", batch, seq), lambda: _read_dense(mask, batch, seq))


def _refused(mask, why: str) -> tuple[MaskSpec, None]:
    return MaskSpec(refused=f"ndp attention got a dense attention mask of shape {tuple(mask.shape)} and dtype "
                            f"{mask.dtype} that {why}. {_DENSE_FIX}"), None


def _read_dense(mask, batch, seq):
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[0] not in (1, batch) or mask.shape[2:] != (seq, seq):
        return _refused(mask, f"is not [batch ({batch}) or 1, 1, seq ({seq}), seq] (self-attention over the rows, "
                              f"one mask for every head)")
    if mask.dtype == torch.bool:
        keep = mask
    elif mask.is_floating_point():
        keep = mask == 0
        if not bool((keep | (mask <= torch.finfo(mask.dtype).min / 2)).all()):
            return _refused(mask, "adds values other than 0 and -inf to the scores (a bias)")
    else:
        return _refused(mask, "is neither boolean (True keeps) nor floating point (0 keeps, -inf masks)")
    keep = keep[:, 0].expand(batch, seq, seq)
    if bool(keep.all()):
        return MaskSpec(causal=False), None
    # a token starts a document where it cannot see the token before it; the mask must then be exactly causal
    # inside each document and nothing across documents
    starts = F.pad(~keep.diagonal(offset=-1, dim1=1, dim2=2), (1, 0))
    doc = starts.cumsum(1)
    want = (doc[:, :, None] == doc[:, None, :]).tril_()
    if not torch.equal(keep, want):
        return _refused(mask, "is not full, causal, or causal within packed documents (ndp applies those exactly)")
    packed = bool(starts[:, 1:].any())
    return MaskSpec(causal=True, packed=packed), cu_from_starts(starts) if packed else None


__all__ = ["MaskSpec", "describe", "documents_of", "marker", "padding_of", "read_dense", "spec_of", "with_padding"]
