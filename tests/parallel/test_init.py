"""Seeded per-module init and meta-device parallelize on a plain (non-HF) module: the shards a meta model gets
are exactly those of the fully built, ``init_weights``-initialized model; a tensor no init sets is refused."""
import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from _nets import PLAN, Net
from dist import spawn
from ndp.parallel import ModelPlan, ParallelismConfig, init_weights, module_seed, param_bytes, parallelize


NET_BYTES = 4 * (2 * (16 * 64 + 64 + 64 * 16 + 16 + 2 * 16) + 16 + 1)


def _full(model):
    return {n.replace("_checkpoint_wrapped_module.", ""): (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            for n, p in model.named_parameters()}


def test_init_weights_is_reset_parameters_per_module_seed():
    m = init_weights(Net(), seed=5)
    ref = nn.Linear(16, 64)
    torch.manual_seed(module_seed(5, "blocks.1.up"))
    ref.reset_parameters()
    assert torch.equal(m.blocks[1].up.weight, ref.weight) and torch.equal(m.blocks[1].up.bias, ref.bias)
    assert torch.equal(m.blocks[0].norm.weight, torch.ones(16))


def _check_meta(rank, world):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    for kw, ac in [(dict(dp_shard_size=2, tp_size=2), True), (dict(dp_shard_size=4), False)]:
        cfg = ParallelismConfig(**kw)
        mesh = cfg.build_device_mesh("cpu")
        full = parallelize(init_weights(Net(), seed=7), cfg, mesh, plan=PLAN, activation_checkpointing=ac)
        with torch.device("meta"):
            meta = Net()
        meta = parallelize(meta, cfg, mesh, plan=PLAN, activation_checkpointing=ac, init_seed=7)
        a, b = _full(full), _full(meta)
        assert set(a) == set(b)
        for k in a:
            assert torch.equal(a[k], b[k]), f"{kw}: {k}"
        assert param_bytes(meta) == param_bytes(full)
        assert torch.equal(full(x), meta(x))


@pytest.mark.distributed
def test_meta_parallelize_plain_module_matches_full(tmp_path):
    spawn(_check_meta, 4, tmp_path)


def test_meta_parallelize_one_process():
    cfg = ParallelismConfig()
    with torch.device("meta"):
        meta = Net()
    meta = parallelize(meta, cfg, None, plan=PLAN, init_seed=7)
    full = init_weights(Net(), seed=7)
    for k, v in _full(full).items():
        assert torch.equal(_full(meta)[k], v), k
    assert param_bytes(meta) == NET_BYTES


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))  # no reset_parameters sets it

    def forward(self, x):
        return self.lin(x) * self.scale


def test_meta_parallelize_refuses_an_uninitialized_tensor():
    with torch.device("meta"):
        m = Scaled()
    with pytest.raises(ValueError, match=r"initialization left scale \(parameter of Scaled\) unset.*init_module"):
        parallelize(m, ParallelismConfig(), None)
    # With an init_module that sets it, the same model materializes.
    def init(mod):
        if isinstance(mod, Scaled):
            nn.init.ones_(mod.scale)
        elif hasattr(mod, "reset_parameters"):
            mod.reset_parameters()

    with torch.device("meta"):
        m = Scaled()
    m = parallelize(m, ParallelismConfig(), None, plan=ModelPlan(init_module=init))
    assert torch.equal(m.scale, torch.ones(4))


class Routed(nn.Module):
    """A block whose init sets its children's weights, as a MoE block sets its router's (transformers runs a
    parent's init after its children's)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(4, 2, bias=False)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) + self.router(x).sum(-1, keepdim=True)


def _routed_init(mod):
    if isinstance(mod, Routed):
        nn.init.constant_(mod.router.weight, 0.5)
        nn.init.normal_(mod.lin.weight)  # after lin's own reset_parameters: this value is the last word
    elif isinstance(mod, nn.Linear) and mod.out_features == 4:
        mod.reset_parameters()


def test_an_enclosing_modules_init_has_the_last_word_and_touches_nothing_else():
    full = init_weights(nn.Sequential(Routed(), nn.Linear(4, 4)), seed=5, init_module=_routed_init)
    assert torch.equal(full[0].router.weight, torch.full((2, 4), 0.5))  # its own init leaves it: the parent's
    torch.manual_seed(module_seed(5, "0.lin<0"))
    assert torch.equal(full[0].lin.weight, torch.empty(4, 4).normal_())
    ref = nn.Linear(4, 4)
    torch.manual_seed(module_seed(5, "0.lin"))
    ref.reset_parameters()
    assert torch.equal(full[0].lin.bias, ref.bias)  # the parent does not write it: the module's own value
    torch.manual_seed(module_seed(5, "1"))
    ref.reset_parameters()
    assert torch.equal(full[1].weight, ref.weight)  # a sibling draws at its own seed only
    with torch.device("meta"):
        meta = nn.Sequential(Routed(), nn.Linear(4, 4))
    meta = parallelize(meta, ParallelismConfig(), None, plan=ModelPlan(init_module=_routed_init), init_seed=5)
    assert all(torch.equal(a, b) for a, b in zip(full.state_dict().values(), meta.state_dict().values()))
