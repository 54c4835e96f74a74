"""Data path: byte-level tokenizer, the shipped corpus, deterministic global batches, and their DP/CP shards.

Every rank builds the same *global* batch of a step from (seed, step) alone, so the data is the same
whatever the parallel degrees. A rank then takes its data-parallel rows, its gradient-accumulation
micro-batch and, with context parallelism, its sequence shard in the SAME layout as the attention
(``ndp.cp.shard_sequence`` / ``ndp.cp.shard_packed``). Labels are shifted before sharding and position_ids
are global, so RoPE sees true positions on every CP rank.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from ndp.hf.batch import document_table, packed_cu, shard_rows

IGNORE_INDEX = -100
DEFAULT_CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "corpus.txt")


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, nothing to download."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def load_documents(path: str | None = None) -> list[str]:
    """Documents of a text file: paragraphs separated by blank lines (default: the shipped corpus).

    Raises:
        ValueError: the file cannot be read as text, or holds no text.
    """
    path = path or DEFAULT_CORPUS
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--data {path!r} cannot be read as UTF-8 text ({type(e).__name__}: {e}). Pass a text file "
                         f"with documents separated by blank lines, or leave --data out for the shipped corpus.") from None
    docs = [d.strip() for d in text.split("\n\n") if d.strip()]
    if not docs:
        raise ValueError(f"data file {path!r} holds no text; pass a file with at least one paragraph of text")
    return docs


def tokenize_documents(docs: list[str], tokenizer: ByteTokenizer | None = None):
    """Concatenate tokenized documents. Returns (tokens int64 [N], doc_start bool [N])."""
    tok = tokenizer or ByteTokenizer()
    ids, starts = [], []
    for d in docs:
        t = tok.encode(d + "\n")
        ids.extend(t)
        starts.extend([True] + [False] * (len(t) - 1))
    return torch.tensor(ids, dtype=torch.long), torch.tensor(starts, dtype=torch.bool)


@dataclass
class Batch:
    """Token ids, shifted labels (IGNORE_INDEX where no loss) and global position ids, all ``[B, S]``.

    ``packed``: rows hold several documents (position_ids restart at 0 at each document start) that must
    not attend to one another.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    packed: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        """Tokens that carry a loss (labels != IGNORE_INDEX)."""
        return int((self.labels != IGNORE_INDEX).sum())

    def rows(self, start: int, stop: int) -> "Batch":
        return Batch(self.input_ids[start:stop], self.labels[start:stop], self.position_ids[start:stop],
                     self.packed)


class TokenDataset:
    """Windows of ``seq_len + 1`` tokens of the concatenated corpus, drawn in a seeded order.

    Step ``s`` takes windows ``s*B .. s*B + B - 1`` of an epoch-wise permutation (``torch.Generator`` seeded
    with ``seed`` and the epoch): a pure function of (seed, step), so resuming at step s gives the batches
    an uninterrupted run would have seen.

    Args:
        tokens, doc_start: from :func:`tokenize_documents`.
        seq_len: tokens per row; batch_size: global rows per step.
        pack_docs: keep documents apart (position_ids restart, no loss across a boundary, and attention
            masked per document); otherwise the corpus is one stream.
    Raises:
        ValueError: corpus shorter than one window.
    """

    def __init__(self, tokens, doc_start, *, seq_len: int, batch_size: int, seed: int, pack_docs: bool = False):
        self.tokens, self.doc_start = tokens, doc_start
        self.seq_len, self.batch_size, self.seed, self.pack_docs = seq_len, batch_size, seed, pack_docs
        self.num_windows = (tokens.numel() - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"corpus of {tokens.numel()} tokens is shorter than one window of seq_len+1="
                             f"{seq_len + 1}; use a smaller --seq-len or more data")
        self._perm_epoch, self._perm = None, None

    def _window_index(self, g: int) -> int:
        epoch, pos = divmod(g, self.num_windows)
        if self._perm_epoch != epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.num_windows, generator=gen), epoch
        return int(self._perm[pos])

    def global_batch(self, step: int) -> Batch:
        """The step's global batch ``[batch_size, seq_len]`` (identical on every rank)."""
        S, B = self.seq_len, self.batch_size
        ids, labels, pos = [], [], []
        for j in range(B):
            w = self._window_index(step * B + j)
            toks = self.tokens[w * S: w * S + S + 1]
            x, y = toks[:-1].clone(), toks[1:].clone()
            if self.pack_docs:
                starts = self.doc_start[w * S: w * S + S + 1]
                y[starts[1:]] = IGNORE_INDEX  # never predict the first token of the next document
                p = _positions_from_starts(starts[:-1])
            else:
                p = torch.arange(S)
            ids.append(x)
            labels.append(y)
            pos.append(p)
        return Batch(torch.stack(ids), torch.stack(labels), torch.stack(pos), packed=self.pack_docs)


def _positions_from_starts(starts: torch.Tensor) -> torch.Tensor:
    # position = distance to the latest document start (or to the window start).
    S = starts.numel()
    idx = torch.arange(S)
    marks = torch.where(starts, idx, torch.zeros_like(idx))
    marks[0] = 0
    last = torch.cummax(marks, dim=0).values
    return idx - last


def batch_from_documents(docs: list[list[int]], *, packed: bool) -> Batch:
    """A batch made of whole documents (tests: packed must equal unpacked).

    packed=True: one row with every document, position_ids restarting per document.
    packed=False: one row per document, right-padded with IGNORE_INDEX labels (causal attention keeps the
    padding invisible to real tokens, so no mask is needed).
    """
    if packed:
        ids, labels, pos = [], [], []
        for d in docs:
            t = torch.as_tensor(d, dtype=torch.long)
            ids.append(t)
            labels.append(torch.cat([t[1:], t.new_tensor([IGNORE_INDEX])]))
            pos.append(torch.arange(t.numel()))
        return Batch(torch.cat(ids)[None], torch.cat(labels)[None], torch.cat(pos)[None], packed=True)
    L = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), L, dtype=torch.long)
    labels = torch.full((len(docs), L), IGNORE_INDEX, dtype=torch.long)
    for i, d in enumerate(docs):
        t = torch.as_tensor(d, dtype=torch.long)
        ids[i, :t.numel()] = t
        labels[i, :t.numel() - 1] = t[1:]
    pos = torch.arange(L).expand(len(docs), L).clone()
    return Batch(ids, labels, pos, packed=False)


def microbatches(batch: Batch, *, dp_rank: int, dp_size: int, grad_accum: int) -> list[Batch]:
    """This data-parallel rank's rows of the global batch, cut into ``grad_accum`` micro-batches.

    Raises:
        ValueError: rows not divisible by dp_size * grad_accum.
    """
    B = batch.input_ids.shape[0]
    if B % (dp_size * grad_accum):
        raise ValueError(f"global batch of {B} sequences must be divisible by dp_replicate*dp_shard*grad_accum"
                         f" = {dp_size}*{grad_accum}; change --batch-size or --grad-accum")
    per_rank = B // dp_size
    mine = batch.rows(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    m = per_rank // grad_accum
    return [mine.rows(i * m, (i + 1) * m) for i in range(grad_accum)]


def model_inputs(mb: Batch, ctx=None, device=None) -> tuple[dict, torch.Tensor]:
    """Model kwargs and labels of this rank for one micro-batch.

    Dense rows are split along the sequence with ``ndp.cp.shard_sequence`` (the attention's layout).
    Packed rows are flattened into one row and split per document with ``ndp.cp.shard_packed``; the
    attention gets the *global* ``cu_seq_lens_q`` (transformers' flash varlen kwarg names).

    Args:
        mb: micro-batch; ctx: ``ndp.parallel.CPContext`` (None or disabled: no CP); device: target.
    Returns:
        (kwargs for ``model(**kwargs)``, labels) with the same local token order.
    """
    # Move first: the CP helpers may check arguments across ranks on the group's device (NCCL: CUDA).
    rows = {name: t.to(device) for name, t in (("input_ids", mb.input_ids), ("labels", mb.labels),
                                                ("position_ids", mb.position_ids))}
    if mb.packed:
        rows = {name: t.reshape(1, -1) for name, t in rows.items()}
    cu = packed_cu(rows) if mb.packed else None
    if ctx is not None and ctx.enabled:
        rows = shard_rows(rows, ctx, cu=cu, pad=False)
    elif cu is not None:
        rows.update(document_table(cu, device))
    labels = rows.pop("labels")
    return dict(rows, use_cache=False), labels
