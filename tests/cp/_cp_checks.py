"""Per-rank bodies of the CP tests: compare a CP implementation against single-process fp64 attention on
the full sequence, sliced per rank with the library's own shard functions (docs/design.md, "Conventions: tests")."""
import torch
import torch.distributed as dist

import ndp.ops
from ndp.cp import CommStats, shard_packed, shard_sequence
from dense_attention import dense_reference
from ndp.testing import assert_close


def make_inputs(case, seed=0):
    """Full q, k, v, dout on every rank from the same seed (packed: [T, H, D])."""
    g = torch.Generator().manual_seed(seed)
    h, hk, d = case["heads"], case["kv_heads"], case["dim"]
    dv = case.get("dim_v", d)  # MLA: a value head size of its own
    rows = (sum(case["docs"]),) if case.get("docs") is not None else (case["batch"], case["seqlen"])
    q = torch.randn(*rows, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(*rows, hk, d, generator=g, dtype=torch.float64)
    v = torch.randn(*rows, hk, dv, generator=g, dtype=torch.float64)
    dout = torch.randn(*rows, h, dv, generator=g, dtype=torch.float64)
    return q, k, v, dout


def reference(case, q, k, v, dout, dtype=torch.float64):
    """Full-sequence fp64 reference (out, lse, dq, dk, dv); inputs first rounded to `dtype`."""
    q, k, v = (x.to(dtype).double().requires_grad_() for x in (q, k, v))
    kw = dict(causal=case["causal"], window_size=case.get("window", (-1, -1)), backend="torch", return_lse=True)
    if case.get("docs") is not None:
        cu = cu_of(case["docs"])
        kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(case["docs"]), max_seqlen_k=max(case["docs"]))
    out, lse = ndp.ops.attention(q, k, v, **kw)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), lse.detach(), dq, dk, dv


def cu_of(docs):
    cu = [0]
    for n in docs:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


class Sharder:
    """Shards full tensors (and lse) the way the CP call expects them."""

    def __init__(self, case, group=None):
        self.case, self.group = case, group
        self.packed = case.get("docs") is not None
        if self.packed:
            self.shard = shard_packed(cu_of(case["docs"]), group=group)

    def __call__(self, x):
        if self.packed:
            return x[self.shard.index]
        return shard_sequence(x, dim=1, group=self.group, layout=self.case.get("layout", "zigzag"))

    def lse(self, lse):
        if self.packed:
            return lse[:, self.shard.index]
        return shard_sequence(lse, dim=2, group=self.group, layout=self.case.get("layout", "zigzag"))

    @property
    def cu(self):
        return self.shard if self.packed else None


def run_case(fn, case, dtype=torch.float64, group=None, check=True, **kw):
    """Runs CP `fn` on this rank's shards; compares out, lse, dq, dk, dv with the fp64 reference.
    Returns (errors dict, CommStats)."""
    q, k, v, dout = make_inputs(case, case.get("seed", 0))
    sinks = None
    if case.get("sinks"):
        sinks = torch.randn(case["heads"], generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    if sinks is not None or case.get("chunk") or case.get("softcap") or case.get("dim_v") or case.get("spans"):
        ref = dense_reference(case, *(x.to(dtype) for x in (q, k, v)), dout,
                              None if sinks is None else sinks.to(dtype))
    else:
        ref = reference(case, q, k, v, dout, dtype)
    sh = Sharder(case, group)
    ql, kl, vl = (sh(x).to(dtype).requires_grad_() for x in (q, k, v))
    dl = sh(dout).to(dtype)
    args = dict(causal=case["causal"], window_size=case.get("window", (-1, -1)), cu_seqlens=sh.cu,
                backend=case.get("backend", "auto"), return_lse=True)
    if not sh.packed:
        args["layout"] = case.get("layout", "zigzag")
    if case.get("chunk"):
        args["chunk_size"] = case["chunk"]
    if case.get("softcap"):
        args["softcap"] = case["softcap"]
    if case.get("spans"):
        args["bidirectional_spans"] = case["spans"]
    inputs = (ql, kl, vl)
    if sinks is not None:
        inputs += (sinks.to(dtype).requires_grad_(),)
        args["sinks"] = inputs[-1]
    args.update(kw)
    with CommStats() as st:
        out, lse = fn(ql, kl, vl, **args)
        grads = torch.autograd.grad(out, inputs, dl)
    exp = (sh(ref[0]), sh.lse(ref[1]), sh(ref[2]), sh(ref[3]), sh(ref[4]))
    got = (out, lse) + grads[:3]
    names = ("out", "lse", "dq", "dk", "dv")
    if sinks is not None:
        # Each rank's sink gradient covers its rows (Ulysses: its heads); data parallelism over CP sums them.
        dsinks = grads[3].clone()
        dist.all_reduce(dsinks)
        got, exp, names = got + (dsinks,), exp + (ref[5],), names + ("dsinks",)
    errs = {n: (g.double() - e.double()).abs().max().item() if g.numel() else 0.0 for n, g, e in zip(names, got, exp)}
    if check:
        for n, g, e in zip(names, got, exp):
            assert g.shape == e.shape, f"{n}: shape {tuple(g.shape)} != {tuple(e.shape)} ({case})"
            assert g.dtype == (torch.float32 if n == "lse" and dtype != torch.float64 else dtype), (n, g.dtype)
            assert_close(g, e, dtype, "out" if n in ("out", "lse") else "grad",
                         msg=f"rank {dist.get_rank()} {n} {case}")
    return errs, st


def cases_dense(layouts=("zigzag", "contiguous", "striped"), kv_cycle=(1, 2, 4), dims=(64, 80), heads=4,
                seqlen=64, batch=2):
    """Every layout, causal and full, kv_heads / head_dim cycling so each value appears."""
    out, i = [], 0
    for layout in layouts:
        for causal in (True, False):
            out.append(dict(batch=batch, seqlen=seqlen, heads=heads, kv_heads=kv_cycle[i % len(kv_cycle)],
                            dim=dims[i % len(dims)], causal=causal, layout=layout, seed=i))
            i += 1
    return out


WINDOW_CASES = [
    dict(batch=1, seqlen=64, heads=4, kv_heads=1, dim=16, causal=True, window=(9, 0), layout="zigzag"),
    dict(batch=1, seqlen=64, heads=4, kv_heads=2, dim=16, causal=False, window=(5, 3), layout="zigzag"),
    dict(batch=1, seqlen=64, heads=4, kv_heads=2, dim=16, causal=True, window=(6, -1), layout="striped"),
    dict(batch=1, seqlen=64, heads=4, kv_heads=4, dim=16, causal=False, window=(-1, 4), layout="contiguous"),
]

PACKED_CASES = [
    dict(docs=[5, 300, 64, 1, 700], heads=4, kv_heads=2, dim=16, causal=True),
    dict(docs=[17, 3, 40, 8], heads=4, kv_heads=1, dim=16, causal=False, window=(4, 2)),
    dict(docs=[0, 5, 0, 9], heads=4, kv_heads=2, dim=16, causal=True),  # empty docs; ranks with no tokens
]


def run_all(fn, cases, **kw):
    return [run_case(fn, c, **kw) for c in cases]
