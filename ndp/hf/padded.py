"""Attention over padded rows, as transformers' padding mask asks, in a few varlen calls (one process).

Each row holds one run of real tokens, ``[start, start + length)``, with pads before it (left padding), after it
(right padding) or both. Under ``causal & padding`` (& the layer's window or chunk):

- a real token sees the real tokens before it (the run is one causal document; chunks cut it from its start);
- a pad after the run sees the run's tokens its window or chunk reaches: one non-causal call over the run's keys,
  bottom-right aligned, whose left window ``window - 1 - queries`` puts each pad's window where its position puts it;
- a pad that sees no key (every pad before the run; a pad past the window or chunk of the run's last token)
  gets zeros, as transformers' sdpa (``_safe_softmax``) and flash-attention give it. Eager attention fills such a
  row with the mean of every value (a softmax of equal dtype minima; NaN in float64): an artefact ndp does not copy.

A batch costs one call for its real tokens and one for the pads whose window reaches their row's first token (all
of them with Mistral's 4096 at 4096 tokens); the pads past a window take one call per power of two of their count
(queries rounded up with stand-ins, so that rows share the left window); zeros take none.
"""
from __future__ import annotations

import functools

import torch

import ndp.ops


def _pads_after(start, length, seq, window, chunk):
    """The pads after a run that see a key: ``(count, queries in the call, first key, left window)``; a call's
    queries past `count` are stand-ins (copies of the last pad, outputs dropped) that let rows share the window."""
    end, pads = start + length, seq - start - length
    if chunk is not None:  # the last token's chunk (counted from the run's start, as transformers counts)
        first = start + chunk * ((length - 1) // chunk)
        seen = min(pads, first + chunk - end)
        return seen, seen, first, -1
    seen = pads if window is None else min(pads, window - 1)  # pad i sees keys from end + i - window + 1 on
    if window is None or length + seen <= window:  # every pad's window reaches the run's first token
        return seen, seen, start, -1
    # bottom-right aligned, the left window w - 1 - queries puts each pad's window where its position does;
    # rounding the queries up to a power of two lets rows share a call (at most twice the pads' queries)
    queries = min(window - 1, 1 << (seen - 1).bit_length())
    return seen, queries, start, window - 1 - queries


def _ranges(firsts, counts, real=None):
    """The positions ``first .. first + count - 1`` of each run, concatenated (int64); with `real`, positions past
    a run's first `real` repeat its last real one. One arange per run (a few per row), from host ints only, so a
    compiled layer traces it with static shapes."""
    real = counts if real is None else real
    return torch.cat([torch.arange(f, f + n).clamp_(max=f + r - 1) for f, n, r in zip(firsts, counts, real)])


def _cu(counts):
    return torch.tensor([0] + list(counts), dtype=torch.int64).cumsum(0).to(torch.int32)


@functools.lru_cache(maxsize=16)
def padding_plan(starts: tuple, lengths: tuple, seq: int, causal: bool, window: int | None, chunk: int | None,
                 device) -> tuple:
    """The calls of padded rows flattened to ``[batch * seq, ...]``: ``(calls, take)``; each call ``(q index,
    k index, cu_q, cu_k, max_q, max_k, causal, window_size)``; `take` the row of ``cat(call outputs, one zero row)``
    each token's output is (the zero row for a token that sees no key)."""
    real_win = (-1, -1) if window is None else (window - 1, 0 if causal else window - 1)
    groups = {}  # (window_size, causal) -> runs: (q first, q real, q in the call, k first, k count)
    for row, (start, length) in enumerate(zip(starts, lengths)):
        at, end = row * seq + start, row * seq + start + length
        step = chunk or length
        for s in range(0, length, step):
            n = min(step, length - s)
            groups.setdefault((real_win, causal), []).append((at + s, n, n, at + s, n))
        seen, queries, first, left = _pads_after(start, length, seq, window, chunk)
        if seen:
            groups.setdefault(((left, -1), False), []).append((end, seen, queries, row * seq + first,
                                                                 end - row * seq - first))
    calls, take, done = [], torch.full((len(starts) * seq,), -1, dtype=torch.int64), 0
    for (win, is_causal), runs in groups.items():
        q0, real, nq, k0, nk = zip(*runs)
        q_idx = _ranges(q0, nq, real)
        mine = _ranges([done + c for c in _cu(nq)[:-1].tolist()], real)  # the call's rows that are tokens' outputs
        take[_ranges(q0, real)] = mine
        calls.append((q_idx.to(device), _ranges(k0, nk).to(device), _cu(nq).to(device), _cu(nk).to(device),
                      max(nq), max(nk), is_causal, win))
        done += sum(nq)
    return tuple(calls), take.masked_fill_(take < 0, done).to(device)


def padded_attention(q, k, v, plan, **kw):
    """`q`, `k`, `v` (``[batch, seq, heads, dim]``) attended as `plan` (:func:`padding_plan`) says; `kw` go to
    every ``ndp.ops.attention`` call (scale, sinks, softcap)."""
    batch, seq = q.shape[:2]
    calls, take = plan
    q, k, v = (t.reshape(batch * seq, *t.shape[2:]) for t in (q, k, v))
    outs = [ndp.ops.attention(q[qi], k[ki], v[ki], causal=causal, window_size=win, cu_seqlens_q=cu_q,
                              cu_seqlens_k=cu_k, max_seqlen_q=mq, max_seqlen_k=mk, **kw)
            for qi, ki, cu_q, cu_k, mq, mk, causal, win in calls]
    outs.append(outs[0].new_zeros(1, *outs[0].shape[1:]))
    return torch.cat(outs)[take].reshape(batch, seq, *outs[0].shape[1:])


__all__ = ["padded_attention", "padding_plan"]
