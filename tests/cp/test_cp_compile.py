"""The CP attention functions under torch.compile on 2 gloo ranks: a layer (projections, CP attention, output
projection) traces with 0 graph breaks and compiles fullgraph (aot_eager, inductor) to eager's output and
gradients (fp32, 1e-5), for ring, all-gather, Ulysses (and USP on 4 ranks), dense (with bidirectional spans) and
packed; a bad input on one rank still raises on every rank."""
import os
import sys

import pytest
import torch
import torch._dynamo as dynamo
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dist import spawn  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]
CU = torch.tensor([0, 20, 23, 64], dtype=torch.int32)


class Layer(torch.nn.Module):
    def __init__(self, impl, groups, packed, heads=4, kv_heads=2, dim=32):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.q = torch.nn.Parameter(torch.randn(64, heads * dim, generator=g) * 0.1)
        self.kv = torch.nn.Parameter(torch.randn(64, 2 * kv_heads * dim, generator=g) * 0.1)
        self.o = torch.nn.Parameter(torch.randn(heads * dim, 64, generator=g) * 0.1)
        self.sinks = torch.nn.Parameter(torch.randn(heads, generator=g))
        self.impl, self.groups, self.packed, self.shape = impl, groups, packed, (heads, kv_heads, dim)

    def forward(self, x, cu=None):
        import ndp.cp

        h, hk, d = self.shape
        lead = x.shape[:-1]
        q = (x @ self.q).view(*lead, h, d)
        k, v = (x @ self.kv).view(*lead, 2, hk, d).unbind(-3)
        kw = dict(causal=True, sinks=self.sinks, window_size=(24, 0))
        if cu is not None:
            kw["cu_seqlens"] = cu
        else:  # image blocks (Gemma 3): the spans reach the op as ints
            kw["bidirectional_spans"] = ((5, 30), (40, 41))
        if self.impl == "usp":
            out = ndp.cp.usp_attention(q, k, v, ulysses_group=self.groups[0], ring_group=self.groups[1], **kw)
        else:
            out = getattr(ndp.cp, f"{self.impl}_attention")(q, k, v, group=self.groups[0], **kw)
        return out.reshape(*lead, h * d) @ self.o


def _inputs(rank, world, packed, groups):
    import ndp.cp

    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    if packed:
        shard = ndp.cp.shard_packed(CU, world_size=world, rank=rank)
        return x[shard.index], CU
    return ndp.cp.shard_sequence(x[None].expand(2, -1, -1), dim=1, world_size=world, rank=rank), None


def _step(layer, fn, x, cu):
    for p in layer.parameters():
        p.grad = None
    out = fn(x, cu)
    out.square().sum().backward()
    return [out.detach()] + [p.grad.clone() for p in layer.parameters()]


def _groups_of(impl, world):
    import ndp.cp

    if impl == "usp":
        return ndp.cp.split_cp_group(dist.group.WORLD, 2)
    return (dist.group.WORLD,)


def _body(rank, world, impls):
    for impl in impls:
        groups = _groups_of(impl, world)
        for packed in (False, True):
            layer = Layer(impl, groups, packed)
            x, cu = _inputs(rank, world, packed, groups)
            dynamo.reset()
            explain = dynamo.explain(layer)(x, cu)
            assert explain.graph_break_count == 0, (impl, packed, [str(b.reason)[:200] for b in
                                                                   explain.break_reasons])
            eager = _step(layer, layer, x, cu)
            for backend in ("aot_eager", "inductor"):
                dynamo.reset()
                compiled = _step(layer, torch.compile(layer, backend=backend, fullgraph=True), x, cu)
                for a, b in zip(compiled, eager):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{impl} {packed} {m}")


@pytest.mark.parametrize("world,impls", [(2, ("ring", "allgather", "ulysses")), (4, ("usp",))])
def test_cp_layer_compiles_fullgraph_and_equals_eager(tmp_path, world, impls):
    spawn(_body, world, tmp_path, impls, timeout_s=280)


def _bad_body(rank, world):
    import ndp.cp

    q = torch.randn(2, 16, 4, 32)
    # rank 1 passes another window: the validity exchange inside the op refuses the call on both ranks
    f = torch.compile(lambda q: ndp.cp.ring_attention(q, q, q, window_size=(4 + rank, 0)), backend="aot_eager",
                      fullgraph=True)
    with pytest.raises(ValueError, match=r"ranks of the CP group called with different arguments \(window"):
        f(q)


def test_bad_input_on_one_rank_raises_on_every_rank_under_compile(tmp_path):
    spawn(_bad_body, 2, tmp_path, timeout_s=120)
