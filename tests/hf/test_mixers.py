"""Hybrid models under context parallelism (``ParallelismConfig(cp_mixers="gather")``, ``ndp.hf.mixers``): their
recurrent, state-space, linear-attention and short-convolution layers run on the gathered sequence, every other
layer on the shard, and the loss and every gradient equal one process's on the whole batch (float64; the zoo runs
every family at zigzag cp 2; here the other layouts, padding, compile and data parallel beside CP). Without the
option they are refused by name, the option named; a model CP could split nothing of is refused either way.
``cp_mixers="heads"``: the gated DeltaNets, Mamba1 / Mamba2 layers and short convolutions split by heads (channels)
over the CP ranks equal one process too, each rank doing 1/cp_size of their work; the mixers ndp cannot split so are
refused by name, gathering named."""
import copy
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))

from dist import spawn  # noqa: E402
import _zoo  # noqa: E402


def _quiet():
    import warnings

    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()


def test_refused_by_default_with_the_option_named():
    import ndp
    import ndp.hf

    _quiet()
    model = _zoo.tiny_model("qwen3_next")
    with pytest.raises(ndp.hf.Unsupported, match=r"linear_attn \(Qwen3NextGatedDeltaNet\).*cp_mixers='gather'"):
        ndp.hf.check_model(model, ndp.ParallelismConfig(cp_size=2))
    ndp.hf.check_model(model, ndp.ParallelismConfig(cp_size=2, cp_mixers="gather"))
    with pytest.raises(ValueError, match=r"cp_mixers must be one of \('refuse', 'gather', 'heads'\); got "
                                         r"cp_mixers='all'"):
        ndp.ParallelismConfig(cp_size=2, cp_mixers="all")


@pytest.mark.parametrize("family", ["mamba", "rwkv"])
def test_attention_free_model_refused_even_gathered(family):
    import ndp
    import ndp.hf

    _quiet()
    with pytest.raises(ndp.hf.Unsupported, match="layers that mix tokens outside attention") as e:
        ndp.hf.check_model(_zoo.tiny_model(family), ndp.ParallelismConfig(cp_size=2, cp_mixers="gather"))
    assert "cp_mixers" not in str(e.value)  # gathering would split nothing: not offered


def _gather_body(rank, world, layout):
    from ndp.cp import gather_sequence, shard_sequence

    full = torch.randn(2, 8 * world, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    weights = torch.randn(world, *full.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    shard = shard_sequence(full, dim=1, world_size=world, rank=rank, layout=layout).requires_grad_()
    gathered = gather_sequence(shard, dim=1, layout=layout, reduce_grad=True)
    torch.testing.assert_close(gathered, full, rtol=0, atol=0)
    (gathered * weights[rank]).sum().backward()  # each rank uses the whole tensor its own way
    want = shard_sequence(weights.sum(0), dim=1, world_size=world, rank=rank, layout=layout)
    torch.testing.assert_close(shard.grad, want, rtol=1e-12, atol=1e-12)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["zigzag", "contiguous", "striped"])
def test_gather_sequence_sums_every_ranks_gradient(tmp_path, layout):
    spawn(_gather_body, 2, tmp_path, layout)


class _Scan(torch.nn.Module):
    """A recurrent toy: a running sum along the sequence of the hidden states scaled per token by RoPE-like
    (cos, sin), and its final state (not per token)."""

    def __init__(self, d):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(d, d, generator=torch.Generator().manual_seed(2), dtype=torch.float64))

    def forward(self, hidden_states, position_embeddings):
        cos, sin = position_embeddings
        out = ((hidden_states @ self.w) * cos + sin).cumsum(1)
        return out, out[:, -1]


class _Toy(torch.nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.scan = _Scan(d)
        # a causal convolution as Mamba's: padded on both sides, its output cut to the sequence by the caller
        self.conv = torch.nn.Conv1d(d, d, 3, padding=2, groups=d, dtype=torch.float64)

    def forward(self, x, rope):
        out, state = self.scan(x, position_embeddings=rope)
        return self.conv(out.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2), state


def _toy_body(rank, world, layout):
    from ndp.hf.mixers import gather_mixers
    from ndp.parallel import CPContext
    from ndp.cp import shard_sequence

    g = torch.Generator().manual_seed(0)
    x, cos, sin, weight = (torch.randn(2, 16, 4, generator=g, dtype=torch.float64) for _ in range(4))
    torch.manual_seed(0)  # the convolution's weights: the same on every rank
    ref = _Toy()
    x.requires_grad_()
    out, state = ref(x, (cos, sin))
    ((out * weight).sum() + state.sum()).backward()

    def shard(t):
        return shard_sequence(t, dim=1, world_size=world, rank=rank, layout=layout)

    model = copy.deepcopy(ref)
    model.zero_grad(set_to_none=True)
    gather_mixers(model, ["scan", "conv"], CPContext("ring", layout, group=dist.group.WORLD, size=world, rank=rank))
    mine = shard(x.detach()).requires_grad_()
    out, state = model(mine, (shard(cos), shard(sin)))
    torch.testing.assert_close(out, shard(ref(x, (cos, sin))[0]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, ref(x, (cos, sin))[1], rtol=1e-12, atol=1e-12)  # the whole sequence's
    ((out * shard(weight)).sum() + state.sum() / world).backward()
    torch.testing.assert_close(mine.grad, shard(x.grad), rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)  # each rank's own shard's share, as FSDP sums them
        torch.testing.assert_close(grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_gathered_modules_equal_the_unsharded_ones(tmp_path, layout):
    """A recurrent module taking per-token (cos, sin) and returning a state, and a causal convolution whose output
    runs past the sequence, hooked by gather_mixers on 2 ranks: each rank's outputs, the state, the input gradient
    and the summed parameter gradients equal the unsharded modules'."""
    spawn(_toy_body, 2, tmp_path, layout)


def _hybrid_body(rank, world, family, layout, seq, compile, dp_shard, tp, mixers="gather", impl="ring", fields=None):
    import ndp
    import ndp.hf

    _quiet()
    ids = torch.randint(3, _zoo.VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))
    labels = F.pad(ids[:, 1:], (0, 1), value=-100)
    pos = torch.arange(seq).expand(2, seq)
    # float64 throughout: OLMo-hybrid keeps A_log in float32, which FSDP2 (one dtype per module) refuses
    ref = _zoo.tiny_model(family, **(fields or {})).train().to(torch.float64)
    logits = ref(input_ids=ids, position_ids=pos).logits
    ref_loss, ref_grads = _zoo._loss_and_grads(ref, F.cross_entropy(logits.flatten(0, 1), labels.flatten()))
    cp = world // dp_shard // tp
    cfg = ndp.ParallelismConfig(dp_shard_size=dp_shard, cp_size=cp, tp_size=tp, cp_layout=layout, cp_mixers=mixers,
                                cp_impl=impl, ulysses_size=2 if impl == "usp" else cp if impl == "ulysses" else 1)
    model = ndp.hf.parallelize(_zoo.tiny_model(family, **(fields or {})).train().to(torch.float64), cfg, _zoo.mesh(cfg),
                               compile=compile)
    if dp_shard > 1:  # each data-parallel rank its row
        row = model.ndp_parallel.axis("dp_shard").get_local_rank()
        ids, labels, pos = ids[row:row + 1], labels[row:row + 1], pos[row:row + 1]
    b = ndp.hf.shard_batch(model, input_ids=ids, labels=labels, position_ids=pos)
    out = model(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
    rel = _zoo._against(model, out, b["labels"], ref_loss, ref_grads)
    rels = [None] * world
    dist.all_gather_object(rels, rel)
    assert max(rels) <= _zoo.tolerance(family), (family, rels)


@pytest.mark.distributed
@pytest.mark.parametrize("family, layout, seq, compile, dp_shard, tp, world", [
    ("jamba", "zigzag", 30, False, 1, 1, 2),            # padded by shard_batch to 32: the pads at the end
    ("qwen3_next", "contiguous", 32, False, 1, 1, 2),
    ("lfm2_moe", "striped", 32, False, 1, 1, 2),
    ("nemotron_h", "zigzag", 32, True, 1, 1, 2),        # decoder layers compiled
    ("falcon_h1", "zigzag", 32, False, 2, 1, 4),        # dp_shard 2 x cp 2
    ("qwen3_5_text", "zigzag", 32, False, 1, 2, 4),     # cp 2 x tp 2: the gated DeltaNet's projections split
])
def test_hybrid_under_cp_equals_one_process(tmp_path, family, layout, seq, compile, dp_shard, tp, world):
    spawn(_hybrid_body, world, tmp_path, family, layout, seq, compile, dp_shard, tp, timeout_s=300)


def _reduce_scatter_body(rank, world, layout):
    from ndp.cp import reduce_scatter_sequence, shard_sequence

    parts = torch.randn(world, 2, 8 * world, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    weight = torch.randn(2, 8 * world, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    mine = parts[rank].clone().requires_grad_()
    out = reduce_scatter_sequence(mine, dim=1, layout=layout)

    def shard(t):
        return shard_sequence(t, dim=1, world_size=world, rank=rank, layout=layout)

    torch.testing.assert_close(out, shard(parts.sum(0)), rtol=1e-12, atol=1e-12)
    (out * shard(weight)).sum().backward()  # each rank's loss on its shard: every rank's part reaches every shard
    torch.testing.assert_close(mine.grad, weight, rtol=0, atol=0)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_reduce_scatter_sequence_sums_the_parts(tmp_path, layout):
    spawn(_reduce_scatter_body, 2, tmp_path, layout)


def _sum_body(rank, world):
    from ndp.cp import CommStats, sum_over_group

    parts = torch.randn(world, 2, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    weights = torch.randn(world, 2, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    mine = parts[rank].clone().requires_grad_()
    with CommStats() as stats:
        total = sum_over_group(mine)
    torch.testing.assert_close(total, parts.sum(0), rtol=1e-12, atol=1e-12)
    # a ring all-reduce: 2 (N-1)/N of the tensor each way
    assert (stats.by_op["all_reduce"].calls, stats.bytes_sent) == (1, 2 * mine.numel() * 8 * (world - 1) // world)
    (total * weights[rank]).sum().backward()  # each rank uses the sum its own way: its part reaches them all
    torch.testing.assert_close(mine.grad, weights.sum(0), rtol=1e-12, atol=1e-12)


@pytest.mark.distributed
def test_sum_over_group_sums_the_parts_and_their_gradients(tmp_path):
    spawn(_sum_body, 2, tmp_path)


@pytest.mark.parametrize("family, cp, fields, match", [
    ("falcon_h1", 2, dict(mamba_rms_norm=True), r"FalconH1Mixer\) over cp_size=2 by heads: it has "
                                                r"\{'mamba_rms_norm': True\}, and its head split holds for "
                                                r"\{'n_groups': 1, 'mamba_rms_norm': False\} only"),
    ("zaya", 2, {}, r"cannot split model\.layers\.\d\.self_attn\.qkv_proj \(ZayaCCAProjection\) over cp_size=2 by "
                r"heads: ndp has no head split for ZayaCCAProjection.*Set cp_mixers='gather'"),
    ("bamba", 2, dict(mamba_n_groups=2), r"BambaMixer\) over cp_size=2 by heads: it has \{'n_groups': 2\}"),
    ("qwen3_next", 3, {}, r"cannot split model\.layers\.\d\.linear_attn \(Qwen3NextGatedDeltaNet\) over cp_size=3 by "
                      r"heads: its num_k_heads=16 is not a multiple of cp_size=3 \(or choose a cp_size that divides "
                      r"it\).*cp_mixers='gather'"),
])
def test_heads_refused_by_name_where_it_cannot_split(family, cp, fields, match):
    import ndp
    import ndp.hf

    _quiet()
    with pytest.raises(ndp.hf.Unsupported, match=match):
        ndp.hf.check_model(_zoo.tiny_model(family, **fields), ndp.ParallelismConfig(cp_size=cp, cp_mixers="heads"))


def _fused_body(rank, world):
    import ndp
    import ndp.hf
    from transformers.models.bamba import modeling_bamba

    _quiet()
    calls = []

    def fused(*args, **kwargs):  # the torch fallback's answer (None: take the unfused path), the call recorded
        calls.append(kwargs["ngroups"])

    modeling_bamba.mamba2_split_conv1d_scan_combined = fused
    ids = torch.randint(3, _zoo.VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    _zoo.tiny_model("bamba").train()(input_ids=ids)
    assert calls == [1], calls  # one process in training: transformers calls the fused kernel where one is installed
    cfg = ndp.ParallelismConfig(cp_size=world, cp_mixers="heads")
    model = ndp.hf.parallelize(_zoo.tiny_model("bamba").train(), cfg, _zoo.mesh(cfg))
    model(**ndp.hf.shard_batch(model, input_ids=ids))
    assert calls == [1], calls  # split by heads: never (the kernel's norm would cover this rank's heads alone)


@pytest.mark.distributed
def test_heads_keep_a_norm_over_all_heads_off_the_fused_kernel(tmp_path):
    """Where mamba_ssm or a hub kernel is installed (GPUs), transformers runs a training forward of Bamba's mixer as
    one fused kernel whose gated norm spans the heads it is given: split by heads, that would be the rank's alone."""
    spawn(_fused_body, 2, tmp_path)


def test_heads_refuses_a_module_with_a_parameter_its_split_does_not_know():
    from ndp.hf.mixers import head_split_problem

    _quiet()
    module = _zoo.tiny_model("qwen3_next").model.layers[0].linear_attn
    assert head_split_problem(module, 2) is None
    module.conv1d.bias = torch.nn.Parameter(torch.zeros(module.conv_dim, dtype=torch.float64))  # not split by heads
    assert "are not the ones its head split knows" in head_split_problem(module, 2)
    mamba = _zoo.tiny_model("bamba").model.layers[0].mamba
    assert head_split_problem(mamba, 2) is None
    del mamba.norm.weight  # the norm its split sums over the ranks, without its weight: refused, not a KeyError later
    assert head_split_problem(mamba, 2) == "it has no weight in ['norm'], which its head split sums over the ranks"


@pytest.mark.distributed
@pytest.mark.parametrize("family, layout, dp_shard, tp, impl, world", [
    ("qwen3_next", "zigzag", 1, 1, "ring", 2),
    ("lfm2", "zigzag", 1, 1, "ring", 2),                # LFM's short convolutions: split by channels
    ("lfm2_moe", "striped", 1, 1, "ulysses", 2),
    ("lfm3", "zigzag", 1, 1, "ring", 2),
    ("nemotron_h", "zigzag", 1, 1, "ring", 2),          # Mamba2 in 8 groups: split by groups
    ("falcon_h1", "zigzag", 1, 1, "ring", 2),           # Mamba2 of one group: its B and C whole on each rank
    ("bamba", "zigzag", 1, 1, "ring", 2),               # ... under a gated norm over all heads: its squares summed
    ("granitemoehybrid", "striped", 1, 1, "ulysses", 2),
    ("zamba2", "contiguous", 1, 1, "ring", 2),
    ("jamba", "zigzag", 1, 1, "ring", 2),               # Mamba1 per channel: x_proj's partial products summed
    ("bamba", "zigzag", 2, 1, "ring", 4),               # dp_shard 2 x cp 2: the summed norm's weight sharded
    ("kimi_linear", "zigzag", 1, 1, "ring", 2),         # a decay per channel, low-rank gates read whole
    ("bailing_hybrid", "striped", 1, 1, "ring", 2),     # its forget gate's head count scaled too
    ("minimax", "zigzag", 1, 1, "ring", 2),             # lightning attention: an RMS norm over all heads
    ("zamba", "zigzag", 1, 1, "ring", 2),               # Mamba1 heads, each with its own x_proj
    ("qwen3_5", "contiguous", 1, 1, "ring", 2),         # the multimodal model: its text decoder's gated DeltaNets
    ("qwen3_5_moe", "zigzag", 1, 1, "ulysses", 2),
    ("lara_mini", "striped", 1, 1, "ring", 2),
    ("olmo_hybrid", "zigzag", 1, 1, "ring", 2),         # q/k/v/a/b/g projections of their own
    ("qwen3_next", "zigzag", 1, 1, "usp", 4),           # cp 4: ulysses 2 x ring 2
    ("qwen3_next", "zigzag", 2, 1, "ring", 4),          # dp_shard 2 x cp 2
    ("qwen3_5_text", "zigzag", 1, 2, "ring", 4),        # cp 2 x tp 2
])
def test_heads_under_cp_equal_one_process(tmp_path, family, layout, dp_shard, tp, impl, world):
    # LFM with biases: the convolution's and the input projection's split, the output projection's added once
    # MiniMax in blocks of 8 tokens: its state carried from block to block
    fields = {"lfm2": {"conv_bias": True}, "minimax": {"block_size": 8}}.get(family)
    spawn(_hybrid_body, world, tmp_path, family, layout, 32, False, dp_shard, tp, "heads", impl, fields,
          timeout_s=300)


def _share_body(rank, world):
    import ndp
    import ndp.hf
    from bench_mixers import mixer_cost  # the benchmark's count: FLOPs and saved activations in the DeltaNets

    _quiet()
    ids = torch.randint(3, _zoo.VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(32).expand(2, 32)
    ref = _zoo.tiny_model("qwen3_next").train()
    whole, whole_saved = mixer_cost(ref, lambda: ref(input_ids=ids, position_ids=pos).logits.sum().backward())
    cost = {}
    for mixers in ("gather", "heads"):
        cfg = ndp.ParallelismConfig(cp_size=world, cp_mixers=mixers)
        model = ndp.hf.parallelize(_zoo.tiny_model("qwen3_next").train(), cfg, _zoo.mesh(cfg))
        b = ndp.hf.shard_batch(model, input_ids=ids, position_ids=pos)
        cost[mixers] = mixer_cost(model, lambda: model(**b).logits.sum().backward())
    (flops, saved), (heads_flops, heads_saved) = cost["gather"], cost["heads"]
    assert flops == whole and heads_flops == whole // world, (whole, cost)
    assert saved == whole_saved, (whole_saved, cost)
    # besides: the gathered input (kept for the projections' backward) and the rank's convolution weights (a copy
    # of its channels): 5% at these 32 tokens, 0.3% at 256
    assert saved / world < heads_saved < 1.1 * saved / world, cost


@pytest.mark.distributed
def test_heads_do_their_share_of_the_mixers_work(tmp_path):
    """Counted in the gated DeltaNets (torch's FLOP counter over forward and backward; the bytes of the activations
    autograd saves): gathered, each rank does and holds one process's whole; split by heads, its 1/cp_size."""
    spawn(_share_body, 2, tmp_path)
