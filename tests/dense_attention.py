"""Attention written from its definition (materialised scores, fp64), independent of ndp: the reference for
features no other implementation here has (attention sinks, chunked attention, logit soft-capping)."""
import torch


def dense_allowed(case, n):
    """[n, n] bool: key j visible to query i over the full sequence (documents, chunks, causal, window; the case's
    ``spans``, bidirectional ranges or-ed to the causal mask, the window and-ed after them, as transformers' Gemma 3
    composes its image blocks)."""
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    ok = torch.ones(n, n, dtype=torch.bool)
    if case.get("docs") is not None:
        doc = torch.repeat_interleave(torch.arange(len(case["docs"])), torch.tensor(case["docs"]))
        ok &= doc[:, None] == doc[None, :]
    if case.get("chunk"):
        ok &= i // case["chunk"] == j // case["chunk"]
    left, right = case.get("window", (-1, -1))
    if case["causal"]:
        right = 0
    if left >= 0:
        ok &= i - j <= left
    if right >= 0:
        seen = j - i <= right
        for a, b in case.get("spans", ()):
            seen |= (i >= a) & (i < b) & (j >= a) & (j < b)
        ok &= seen
    return ok


def dense_reference(case, q, k, v, dout, sinks=None):
    """Materialised fp64 attention, the softmax with one extra logit per head when `sinks` are given (the sink,
    no value), the scores soft-capped (``c * tanh(s / c)``) when the case has ``softcap`` c:
    (out, lse, dq, dk, dv[, dsinks]). Written from the definition, independently of ndp."""
    if sinks is None:
        sinks = torch.full((q.shape[-2],), float("-inf"), dtype=torch.float64)
        with_sinks = False
    else:
        with_sinks = True
    q, k, v, sinks = (x.detach().double().requires_grad_() for x in (q, k, v, sinks))
    packed = q.dim() == 3
    q4, k4, v4 = (x.unsqueeze(0) if packed else x for x in (q, k, v))
    rep = q4.shape[2] // k4.shape[2]
    kr, vr = (x.repeat_interleave(rep, dim=2) for x in (k4, v4))
    s = torch.einsum("bqhd,bkhd->bhqk", q4, kr) * q4.shape[-1] ** -0.5
    if case.get("softcap"):
        s = case["softcap"] * torch.tanh(s / case["softcap"])
    s = s.masked_fill(~dense_allowed(case, s.shape[-1]), float("-inf"))
    snk = sinks[None, :, None, None].expand(s.shape[0], -1, s.shape[2], 1)
    full = torch.cat([s, snk], dim=-1)
    lse = torch.logsumexp(full, dim=-1)                                   # [B, H, S]
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(full - lse[..., None])[..., :-1], vr)
    if packed:
        out, lse = out[0], lse[0]
    grads = torch.autograd.grad(out, (q, k, v) + ((sinks,) if with_sinks else ()), dout)
    return (out.detach(), lse.detach()) + grads
