"""A transformers model's random init as transformers runs it (``ndp.hf.init_weights``, ``init_seed`` of a meta
model): each module by its own sub-model's ``_init_weights`` (a vision tower by SigLIP's), and a tensor an
enclosing module's init sets (a MoE block its router, SigLIP's attention its projections, Falcon-H1's model its
mixers' ``mup_vector``) takes that value, as transformers' parents-after-children order gives it; the meta build
equals the full build bit for bit."""
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.falcon_h1.modeling_falcon_h1 import compute_mup_vector

import ndp
import ndp.hf
from _zoo import tiny_config
from ndp.parallel import ParallelismConfig, module_seed, to_empty

SEED = 3


def _build(family, init):
    cfg = tiny_config(family)
    cfg._attn_implementation = None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if init == "meta":
        return ndp.parallelize(model, ParallelismConfig(), None, init_seed=SEED)
    return ndp.hf.init_weights(to_empty(model, device="cpu"), seed=SEED)


def _drawn(key, shape, draw):
    torch.manual_seed(module_seed(SEED, key))
    return draw(torch.empty(shape))


def _state(model):
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize("family", ["falcon_h1", "qwen3_5_moe_text", "gemma3", "xlstm", "llama"])
def test_meta_build_equals_full_build(family):
    full, meta = _state(_build(family, "full")), _state(_build(family, "meta"))
    assert set(full) == set(meta)
    for k, t in full.items():
        assert not (t.is_floating_point() and torch.isnan(t).any()), k
        assert torch.equal(t, meta[k]), f"{family}: {k} differs between the full and the meta build"


def test_a_tensor_set_by_an_enclosing_modules_init_takes_that_value():
    falcon = _build("falcon_h1", "full")
    # FalconH1Model's init sets every mixer's mup_vector (the mixer's own leaves it): transformers' own vector.
    assert torch.equal(falcon.model.layers[1].mamba.mup_vector, compute_mup_vector(falcon.config))
    moe = _build("qwen3_5_moe_text", "full")
    # The sparse MoE block's init draws its router's weight; drawn at the router's seed under the block.
    gate = "model.layers.1.mlp.gate"
    std = moe.config.initializer_range
    assert torch.equal(moe.model.layers[1].mlp.gate.weight,
                       _drawn(f"{gate}<model.layers.1.mlp", (4, 64), lambda t: t.normal_(0.0, std)))


def test_a_vision_tower_is_initialized_by_its_own_models_init():
    m = _build("gemma3", "full")
    tower = "model.vision_tower"
    xavier = torch.nn.init.xavier_uniform_
    # SigLIP's pooling head: its probe (its own), its attention's packed projection (set by the head's init).
    head = m.model.vision_tower.head
    assert torch.equal(head.probe, _drawn(f"{tower}.head", (1, 1, 64), xavier))
    assert torch.equal(head.attention.in_proj_weight,
                       _drawn(f"{tower}.head.attention<{tower}.head", (192, 64), xavier))
    # SigLIP's attention sets its projections (xavier) after each Linear's own init (lecun normal): the last wins.
    attn = f"{tower}.encoder.layers.0.self_attn"
    q = m.model.vision_tower.encoder.layers[0].self_attn.q_proj
    assert torch.equal(q.weight, _drawn(f"{attn}.q_proj<{attn}", (64, 64), xavier))
    assert torch.equal(q.bias, torch.zeros(64))
    # The text decoder's Linears keep Gemma 3's normal(0, initializer_range).
    up = "model.language_model.layers.0.mlp.up_proj"
    std = m.config.text_config.initializer_range
    assert torch.equal(m.get_submodule(up).weight,
                       _drawn(up, tuple(m.get_submodule(up).weight.shape), lambda t: t.normal_(0.0, std)))


@pytest.mark.parametrize("family, name", [("apertus", "mlp.act_fn.alpha_p"), ("openai-gpt", "attn.c_attn.weight")])
def test_a_tensor_no_init_sets_is_refused_by_name(family, name):
    # transformers leaves these to their constructors (XIELU's scalars, GPT's Conv1D): a random build from a config
    # has no values for them, so ndp names them rather than train on uninitialized memory.
    with pytest.raises(ValueError, match=rf"initialization left \S*0\.{name} .* unset \(NaN\).*enclosing"):
        _build(family, "full")
