"""Attention over padded rows, as transformers' padding mask asks, in a few varlen calls (one process).

Each row holds one run of real tokens, ``[start, start + length)``, with pads before it (left padding), after it
(right padding) or both. Under ``causal & padding`` (& the layer's window or chunk):

- a real token sees the real tokens before it (the run is one causal document; chunks cut it from its start);
- a pad after the run sees the run's tokens its window or chunk reaches: one non-causal call over the run's keys,
  bottom-right aligned, whose left window ``window - 1 - pads`` puts each pad's window where its position puts it;
- a pad that sees no key (every pad before the run; a pad past the window or chunk of the run's last token)
  gets zeros, as transformers' sdpa (``_safe_softmax``) and flash-attention give it. Eager attention fills such a
  row with the mean of every value (a softmax of equal dtype minima): an artefact, which ndp does not copy.

Rows that share a pad window share a call, so a batch costs one call for its real tokens, one per distinct pad
window (one where the window reaches every pad, as with Mistral's 4096 at 4096 tokens), and no call for zeros.
"""
from __future__ import annotations

import functools

import torch

import ndp.ops


def _pads_after(start, length, seq, window, chunk):
    """(pads that see a key, their keys' first position, left window) for the pads after a run."""
    end, pads = start + length, seq - start - length
    if chunk is not None:  # the last token's chunk (counted from the run's start, as transformers counts)
        first = start + chunk * ((length - 1) // chunk)
        return min(pads, first + chunk - end), first, -1
    if window is None:
        return pads, start, -1
    seen = min(pads, window - 1)  # pad i (0-based) sees key positions >= end + i - window + 1
    left = window - 1 - seen
    return seen, start, -1 if left >= length - 1 else left  # a left window >= length - 1 reaches every key


@functools.lru_cache(maxsize=16)
def padding_plan(starts: tuple, lengths: tuple, seq: int, causal: bool, window: int | None, chunk: int | None,
                 device) -> tuple:
    """The calls of padded rows flattened to ``[batch * seq, ...]``: ``(calls, zeros, order)``; each call
    ``(q index, k index, cu_q, cu_k, max_q, max_k, causal, window_size)``, `zeros` the count of tokens that see no
    key, `order` the permutation that puts ``cat(call outputs, zeros)`` back in token order."""
    real_win = (-1, -1) if window is None else (window - 1, 0 if causal else window - 1)
    groups = {}  # (window_size, causal) -> [q positions, k positions, q lengths, k lengths]

    def add(key, q0, nq, k0, nk):
        g = groups.setdefault(key, ([], [], [], []))
        g[0].extend(range(q0, q0 + nq))
        g[1].extend(range(k0, k0 + nk))
        g[2].append(nq)
        g[3].append(nk)

    for row, (start, length) in enumerate(zip(starts, lengths)):
        at, end = row * seq + start, row * seq + start + length
        step = chunk or length
        for s in range(0, length, step):
            n = min(step, length - s)
            add((real_win, causal), at + s, n, at + s, n)
        seen, first, left = _pads_after(start, length, seq, window, chunk)
        if seen:
            add(((left, -1), False), end, seen, row * seq + first, start + length - first)
    calls, placed = [], []
    for (win, is_causal), (qi, ki, nq, nk) in groups.items():
        cu_q, cu_k = (torch.tensor([0] + n, dtype=torch.int32).cumsum(0, dtype=torch.int32) for n in (nq, nk))
        calls.append((torch.tensor(qi, device=device), torch.tensor(ki, device=device), cu_q.to(device),
                      cu_k.to(device), max(nq), max(nk), is_causal, win))
        placed.extend(qi)
    unseen = sorted(set(range(len(starts) * seq)) - set(placed))
    order = torch.argsort(torch.tensor(placed + unseen)).to(device)
    return tuple(calls), len(unseen), order


def padded_attention(q, k, v, plan, **kw):
    """`q`, `k`, `v` (``[batch, seq, heads, dim]``) attended as `plan` (:func:`padding_plan`) says; `kw` go to
    every ``ndp.ops.attention`` call (scale, sinks, softcap)."""
    batch, seq = q.shape[:2]
    calls, zeros, order = plan
    q, k, v = (t.reshape(batch * seq, *t.shape[2:]) for t in (q, k, v))
    outs = [ndp.ops.attention(q[qi], k[ki], v[ki], causal=causal, window_size=win, cu_seqlens_q=cu_q,
                              cu_seqlens_k=cu_k, max_seqlen_q=mq, max_seqlen_k=mk, **kw)
            for qi, ki, cu_q, cu_k, mq, mk, causal, win in calls]
    if zeros:
        outs.append(outs[0].new_zeros(zeros, *outs[0].shape[1:]))
    return torch.cat(outs)[order].reshape(batch, seq, *outs[0].shape[1:])


__all__ = ["padded_attention", "padding_plan"]
