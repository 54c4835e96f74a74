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


def _pads_after(start, end, first_pad, pads, first_key, window, chunk):
    """The pads ``first_pad ..`` (`pads` of them) after a run ``[start, end)`` whose keys from `first_key` on are at
    hand: ``(pads that see a key, queries in the call, first key, left window)``; a call's queries past the first
    count are stand-ins (copies of the last pad, outputs dropped) that let rows share the window."""
    if chunk is not None:  # the last token's chunk (counted from the run's start, as transformers counts)
        first = start + chunk * ((end - start - 1) // chunk)
        seen = max(0, min(pads, first + chunk - first_pad))
        return seen, seen, max(first, first_key), -1
    # pad p sees keys from p - window + 1 on: the ones up to end + window - 2 see one
    seen = pads if window is None else max(0, min(pads, end + window - 1 - first_pad))
    if window is None or first_pad + seen - window <= first_key:  # every pad's window reaches the first key
        return seen, seen, first_key, -1
    # bottom-right aligned, the left window (w - 1 - queries) - (first_pad - end) puts each pad's window where its
    # position does; rounding the queries up to a power of two lets rows share a call (< twice the pads' queries)
    queries = min(window - 1 - (first_pad - end), 1 << (seen - 1).bit_length())
    return seen, queries, first_key, window - 1 - queries - (first_pad - end)


def _ranges(firsts, counts, real=None):
    """The positions ``first .. first + count - 1`` of each run, concatenated (int64); with `real`, positions past
    a run's first `real` repeat its last real one. One arange per run (a few per row), from host ints only, so a
    compiled layer traces it with static shapes."""
    real = counts if real is None else real
    return torch.cat([torch.arange(f, f + n).clamp_(max=f + r - 1) for f, n, r in zip(firsts, counts, real)])


def _cu(counts):
    return torch.tensor([0] + list(counts), dtype=torch.int64).cumsum(0).to(torch.int32)


@functools.lru_cache(maxsize=16)
def padding_plan(starts: tuple, lengths: tuple, q_span: tuple, k_span: tuple, causal: bool, window: int | None,
                 chunk: int | None, device) -> tuple:
    """The calls of padded rows whose queries sit at positions ``q_span = (offset, count)`` and keys at ``k_span``
    (a KV cache: both end at the newest token; training: ``(0, seq)`` both), flattened to ``[batch * count, ...]``:
    ``(calls, take)``; each call ``(q index, k index, cu_q, cu_k, max_q, max_k, causal, window_size)``; `take` the
    row of ``cat(call outputs, one zero row)`` each query's output is (the zero row for one that sees no key)."""
    (qo, nq_all), (ko, nk_all) = q_span, k_span
    real_win = (-1, -1) if window is None else (window - 1, 0 if causal else window - 1)
    groups = {}  # (window_size, causal) -> runs: (q first, q real, q in the call, k first, k count)

    def add(key, row, q_first, q_real, q_call, k_first, k_end):
        groups.setdefault(key, []).append((row * nq_all + q_first - qo, q_real, q_call, row * nk_all + k_first - ko,
                                           k_end - k_first))

    for row, (start, length) in enumerate(zip(starts, lengths)):
        end = start + length
        step = chunk or length
        for s in range(start, end, step):  # real queries: one causal document per run (per chunk)
            q_first, k_first, stop = max(s, qo), max(s, ko), min(s + step, end)
            if q_first < stop:
                add((real_win, causal), row, q_first, stop - q_first, stop - q_first, k_first, stop)
        first_pad = max(end, qo)
        seen, queries, first_key, left = _pads_after(start, end, first_pad, qo + nq_all - first_pad, max(start, ko),
                                                     window, chunk)
        if seen:
            add(((left, -1), False), row, first_pad, seen, queries, first_key, end)
    calls, take, done = [], torch.full((len(starts) * nq_all,), -1, dtype=torch.int64), 0
    for (win, is_causal), runs in groups.items():
        q0, real, nq, k0, nk = zip(*runs)
        cu_q = _cu(nq)
        take[_ranges(q0, real)] = _ranges([done + c for c in cu_q[:-1].tolist()], real)  # rows that are outputs
        calls.append((_ranges(q0, nq, real).to(device), _ranges(k0, nk).to(device), cu_q.to(device),
                      _cu(nk).to(device), max(nq), max(nk), is_causal, win))
        done += sum(nq)
    return tuple(calls), take.masked_fill_(take < 0, done).to(device)


def padded_attention(q, k, v, plan, **kw):
    """`q` (``[batch, seq_q, heads, dim]``), `k`, `v` (``[batch, seq_k, ...]``) attended as `plan`
    (:func:`padding_plan`) says; `kw` go to every ``ndp.ops.attention`` call (scale, sinks, softcap)."""
    batch, seq = q.shape[:2]
    calls, take = plan
    q, k, v = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
    outs = [ndp.ops.attention(q[qi], k[ki], v[ki], causal=causal, window_size=win, cu_seqlens_q=cu_q,
                              cu_seqlens_k=cu_k, max_seqlen_q=mq, max_seqlen_k=mk, **kw)
            for qi, ki, cu_q, cu_k, mq, mk, causal, win in calls]
    outs.append(outs[0].new_zeros(1, *outs[0].shape[1:]))
    return torch.cat(outs)[take].reshape(batch, seq, *outs[0].shape[1:])


__all__ = ["padded_attention", "padding_plan"]
