"""Mesh construction and parallelize() on a plain (non-HF) module: FSDP2 + TP + grad-norm clipping
match a single-process run. One 4-rank spawn checks several layouts."""
import copy

import pytest
import torch
from torch.distributed.tensor import DTensor

from _nets import PLAN, Net
from dist import spawn
from ndp.parallel import (ModelPlan, ParallelismConfig, apply_cp, clip_grad_norm_, default_plan, mesh_axis,
                          parallelize)
from ndp.testing import assert_close




def _grads(model):
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        out[n.replace("_checkpoint_wrapped_module.", "")] = g.full_tensor() if isinstance(g, DTensor) else g
    return out


def _check(rank, world):
    torch.manual_seed(0)
    ref = Net()
    x = torch.randn(8, 16)  # same on every rank
    ref(x).backward()
    ref_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in ref.parameters()))
    ref_grads = _grads(ref)
    layouts = [dict(dp_shard_size=4), dict(dp_shard_size=2, tp_size=2), dict(dp_replicate_size=2, tp_size=2),
               dict(dp_replicate_size=2, dp_shard_size=2)]
    for kw in layouts:
        cfg = ParallelismConfig(**kw)
        mesh = cfg.build_device_mesh("cpu")
        assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "cp", "tp")
        assert mesh_axis(mesh, "dp").size() == cfg.dp_size
        assert mesh_axis(mesh, "dp_shard_cp").size() == cfg.dp_shard_size * cfg.cp_size
        assert mesh_axis(mesh, "dp_cp").size() == cfg.fsdp_size
        model = copy.deepcopy(ref)
        model.zero_grad(set_to_none=True)
        parallelize(model, cfg, mesh, plan=PLAN, activation_checkpointing=kw.get("tp_size", 1) == 1)
        # Every data-parallel rank sees its slice of the batch; scale so FSDP's mean is the sum.
        dp, dpr = mesh_axis(mesh, "dp").size(), mesh_axis(mesh, "dp").get_local_rank()
        xs = x.chunk(dp)[dpr]
        (model(xs) * cfg.fsdp_size).backward()
        got = _grads(model)
        for n, g in ref_grads.items():
            assert_close(got[n], g, torch.float32, "grad", msg=f"{kw} {n}")
        norm = clip_grad_norm_(model.parameters(), 0.5)
        assert_close(norm, ref_norm, torch.float32, "grad", msg=f"{kw} norm")
        clipped = _grads(model)
        for n, g in ref_grads.items():
            assert_close(clipped[n], g * (0.5 / (ref_norm + 1e-6)), torch.float32, "grad", msg=f"{kw} clipped {n}")


@pytest.mark.distributed
def test_plain_module_fsdp_tp_matches_single_process(tmp_path):
    spawn(_check, 4, tmp_path)


def test_default_plan_finds_blocks():
    assert default_plan(Net()).blocks == ("blocks.*",)


@pytest.mark.distributed
def test_tp_without_plan_is_refused(tmp_path):
    spawn(_refuse_tp, 2, tmp_path)


def _refuse_tp(rank, world):
    cfg = ParallelismConfig(tp_size=2)
    mesh = cfg.build_device_mesh("cpu")
    with pytest.raises(ValueError, match="needs a tensor-parallel plan"):
        parallelize(Net(), cfg, mesh)
    with pytest.raises(ValueError, match="matches no module"):
        parallelize(Net(), cfg, mesh, plan=ModelPlan(tp_plan={"blocks.*.nothing": "colwise"}))
    cfg2 = ParallelismConfig(cp_size=2)
    with pytest.raises(ValueError, match="needs a plan with enable_cp"):
        apply_cp(Net(), cfg2, cfg2.build_device_mesh("cpu"), ModelPlan())


class _Embedded(torch.nn.Module):
    """Token ids -> an embedding split by vocabulary rows over TP -> the MLP blocks."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.net = Net()

    def forward(self, ids):
        return self.net(self.emb(ids))


def _embedding_rowwise(rank, world):
    torch.manual_seed(0)
    ref = _Embedded()
    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    ref(ids).backward()
    cfg = ParallelismConfig(tp_size=2)
    model = copy.deepcopy(ref)
    model.zero_grad(set_to_none=True)
    plan = ModelPlan(tp_plan={"emb": "embedding_rowwise", "net.blocks.*.up": "colwise",
                              "net.blocks.*.down": "rowwise"}, blocks=("net.blocks.*",))
    parallelize(model, cfg, cfg.build_device_mesh("cpu"), plan=plan)
    assert model.emb.weight.placements[0].is_shard(0)  # vocabulary rows split
    model(ids).backward()
    got = _grads(model)
    for n, g in _grads(ref).items():
        assert_close(got[n], g, torch.float32, "grad", msg=n)


@pytest.mark.distributed
def test_an_embedding_split_by_vocabulary_rows_matches_single_process(tmp_path):
    # transformers' "embedding_rowwise" TP style (nemotron_h's embeddings, doge's expert embeddings)
    spawn(_embedding_rowwise, 2, tmp_path)


class _Sinks(torch.nn.Module):
    """Keeps a float32 parameter of its own beside children of the model's dtype, as flint's attention keeps its
    sinks (transformers 5.24): FSDP2 shards one dtype per unit."""

    def __init__(self, d):
        super().__init__()
        self.proj = torch.nn.Linear(d, d)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, d, dtype=torch.float32))

    def forward(self, x):
        return self.proj(x) * self.scale.to(x.dtype)


class _MixedBlock(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = _Sinks(d)
        self.mlp = torch.nn.Linear(d, d)
        self.gate = torch.nn.Parameter(torch.full((d,), 0.75, dtype=torch.float32))  # the block's own, float32
        # float32 too, its weight read without calling it (Bailing's linear attention passes its conv1d's weight to
        # causal_conv1d_fn): FSDP2 gathers a unit's parameters in its own forward only
        self.read = torch.nn.Linear(d, d, bias=False)

    def forward(self, x):
        x = x + torch.nn.functional.linear(x, self.read.weight.to(x.dtype))
        return x + self.mlp(torch.tanh(self.attn(x))) * self.gate.to(x.dtype)


class _MixedNet(torch.nn.Module):
    def __init__(self, d=8):
        super().__init__()
        # the last block holds no parameter of its own, only a child of the model's dtype (a decoder layer)
        self.blocks = torch.nn.ModuleList([_MixedBlock(d), _MixedBlock(d), torch.nn.Sequential(torch.nn.Linear(d, d))])
        # float32 outside the blocks, more parameters than they hold (Apertus 1.5's image tokenizer beside a tiny
        # float64 text model): the root's own dtype is then float32, the last block's child "other" than it (FSDP2
        # refused to shard it a second time: "Cannot concatenate overlapping meshes")
        self.tower = torch.nn.Linear(d, 128)

    def forward(self, x):
        x = x + self.tower(x.float())[:, :x.shape[1]].to(x.dtype)
        for b in self.blocks:
            x = b(x)
        return x.sum()


def _mixed_dtypes(rank, world):
    torch.manual_seed(0)
    ref = _MixedNet().double()
    for m in ref.modules():  # .double() cast them too: back to float32, as transformers builds them
        for name in ("scale", "gate"):
            if name in m._parameters:
                m._parameters[name].data = m._parameters[name].data.float()
    for b in ref.blocks[:2]:
        b.read.float()
    ref.tower.float()
    x = torch.randn(4, 8, dtype=torch.float64)
    ref(x).backward()
    model = copy.deepcopy(ref)
    model.zero_grad(set_to_none=True)
    # FSDP over cp 2 (the flattened dp_shard_cp mesh: a parameter sharded twice fails there): both ranks hold the
    # batch, FSDP averages their equal gradients
    cfg = ParallelismConfig(cp_size=2)
    plan = ModelPlan(blocks=("blocks.*",), enable_cp=lambda module, ctx: None)  # no attention to switch
    parallelize(model, cfg, cfg.build_device_mesh("cpu"), plan=plan)
    model(x).backward()
    got = _grads(model)
    for n, g in _grads(ref).items():
        assert got[n].dtype == g.dtype, n
        assert_close(got[n], g, g.dtype, "grad", msg=n)
    bad = copy.deepcopy(ref)
    bad.blocks[0].attn.proj.register_parameter("odd", torch.nn.Parameter(torch.ones(2, dtype=torch.float32)))
    with pytest.raises(ValueError, match=r"blocks.0.attn.proj holds parameters of dtypes \['torch.float32', 'torch"):
        parallelize(bad, cfg, cfg.build_device_mesh("cpu"), plan=plan)


@pytest.mark.distributed
def test_float32_parameters_beside_the_models_dtype_shard_and_match_one_process(tmp_path):
    spawn(_mixed_dtypes, 2, tmp_path)


class _Cycles(Net):
    """HRM's recurrence: the blocks run once without gradients, then again with them, in one forward."""
    def forward(self, x):
        with torch.no_grad():
            h = x
            for b in self.blocks:
                h = b(h)
        for b in self.blocks:
            x = b(x + h)
        return self.head(x).sum()


def _autocast_cycles(rank, world):
    torch.manual_seed(0)
    ref = _Cycles()
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref(x).backward()
    for kw in (dict(dp_shard_size=2), dict(dp_replicate_size=2)):
        cfg = ParallelismConfig(**kw)
        model = copy.deepcopy(ref)
        model.zero_grad(set_to_none=True)
        parallelize(model, cfg, cfg.build_device_mesh("cpu"), plan=PLAN)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x).backward()  # both ranks hold the batch: FSDP averages their equal gradients
        got = _grads(model)
        for n, g in _grads(ref).items():
            # the blocks' casts cached in the no-grad pass gave them no gradient under FSDP2 (fresh_autocast_casts)
            assert got[n] is not None, f"{kw} {n}: no gradient"
            assert_close(got[n], g, torch.bfloat16, "grad", msg=f"{kw} {n}")


@pytest.mark.distributed
def test_blocks_run_first_without_gradients_under_autocast_get_their_gradients(tmp_path):
    spawn(_autocast_cycles, 2, tmp_path)
