"""A new user's mistakes under CP get one clear error on every rank, before any work: a batch that did not go
through shard_batch (dense or packed), a packed batch without its document table, a dense 4-D mask, parallelize
without a mesh in a multi-process job, a vision or audio tower (outside the decoder layers) run under CP."""
import os
import re
import sys

import pytest
import torch
from torch import nn
import torch.nn.functional as F
from transformers import CONFIG_MAPPING, AutoConfig, DataCollatorWithFlattening

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ndp  # noqa: E402
import ndp.hf  # noqa: E402
from dist import spawn  # noqa: E402
from ndp.hf.attention import guard_outside_layers  # noqa: E402
from ndp.hf.models import (check_cp_model, cp_attention_modules, decoder_layers, head_counts,  # noqa: E402
                           outside_layers)
from ndp.train.presets import build_model  # noqa: E402
from _zoo import tiny_model  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


def _packed():
    docs = [list(range(3, 13)), list(range(20, 34)), list(range(40, 48))]
    b = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": d} for d in docs])
    b["labels"] = F.pad(b["labels"][:, 1:], (0, 1), value=-100)
    return dict(b)


def _mistakes_body(rank, world):
    import ndp
    import ndp.hf

    with pytest.raises(ValueError, match=r"mesh=None in a job of 2 processes.*config.build_device_mesh"):
        ndp.parallelize(build_model("tiny-llama", seed=0), ndp.ParallelismConfig(), None)
    cfg = ndp.ParallelismConfig(cp_size=world)
    model = ndp.parallelize(build_model("tiny-llama", seed=0), cfg, cfg.build_device_mesh("cpu"))
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    # the whole batch, not this rank's shard: positions 0..31 are no rank's zigzag shard of 64 tokens
    with pytest.raises(ValueError, match=r"position_ids that are not rank \d's shard of a sequence of 64 tokens.*"
                                         r"ndp.hf.shard_batch"):
        model(input_ids=ids)
    # a packed batch sharded as dense rows: the restarts are not the dense shard's positions
    p = _packed()
    dense = ndp.cp.shard_sequence(p["input_ids"], dim=1, layout="zigzag"), ndp.cp.shard_sequence(
        p["position_ids"], dim=1, layout="zigzag")
    with pytest.raises(ValueError, match=r"position_ids that are not rank \d's shard"):
        model(input_ids=dense[0], position_ids=dense[1])
    # a document's shard of a length no dense shard has (its table not handed down): named, not a layout error
    with pytest.raises(ValueError, match=r"not rank \d's shard of a sequence of 30 tokens: a dense shard has a "
                                         r"multiple of 2 tokens, got .*no document table"):
        model(input_ids=ids[:1, :15], position_ids=torch.arange(15)[None])
    # the packed batch as the collator made it, with its document table but not sharded
    with pytest.raises(ValueError, match=r"packed q has 32 tokens but shard_packed gives this rank"):
        model(input_ids=p["input_ids"], position_ids=p["position_ids"], cu_seq_lens_q=p["cu_seq_lens_q"],
              cu_seq_lens_k=p["cu_seq_lens_k"])
    # and through shard_batch it runs
    b = ndp.hf.shard_batch(model, **p)
    labels = b.pop("labels")
    assert ndp.hf.loss(model(**b).logits, labels, model).isfinite()
    # a dense mask of this rank's shard (even one that keeps every key) cannot describe the sequence
    d = ndp.hf.shard_batch(model, input_ids=ids)
    with pytest.raises(ndp.hf.Unsupported, match=r"dense attention mask of shape \(2, 1, 16, 16\) .* reaches a "
                                                 r"context-parallel shard"):
        model(**d, attention_mask=torch.ones(2, 1, 16, 16, dtype=torch.bool))


def test_cp_mistakes_raise_on_every_rank(tmp_path):
    spawn(_mistakes_body, 2, tmp_path, timeout_s=60)


def _towers_body(rank, world):
    import ndp
    import ndp.hf

    cfg = ndp.ParallelismConfig(cp_size=world)
    model = ndp.parallelize(build_model("tiny-llama", seed=0), cfg, cfg.build_device_mesh("cpu"))
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    b = ndp.hf.shard_batch(model, input_ids=ids)
    # A module outside the decoder layers (here the embedding, standing in for a vision / audio tower) that runs
    # on rank 0 only, as an image in one rank's batch would make it: rank 0 refuses, rank 1 learns it at its first
    # CP attention call instead of waiting in the ring.
    if rank == 0:
        guard_outside_layers(model, ["model.embed_tokens"], model.ndp_cp)
    match = r"Embedding runs outside the decoder layers .* ndp shards the text sequence only"
    with pytest.raises(ndp.hf.Unsupported if rank == 0 else ValueError, match=match):
        model(**b)


def test_towers_outside_the_decoder_refuse_under_cp_on_every_rank(tmp_path):
    spawn(_towers_body, 2, tmp_path, timeout_s=60)


def test_decoder_layers_are_the_text_decoders():
    # A multimodal model's audio encoder holds more attention layers than its language model (24 vs 2 here): the
    # FSDP / checkpoint blocks and the CP attention are the language model's; the towers are guarded instead.
    model = tiny_model("phi4_multimodal")
    assert decoder_layers(model)[0] == "model.layers.*"
    assert cp_attention_modules(model) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    towers = outside_layers(model)
    assert "model.embed_tokens_extend.audio_embed.encoder.encoders" not in towers  # the outermost mixers only
    assert any(t.startswith("model.embed_tokens_extend.audio_embed") for t in towers)
    assert any(t.startswith("model.embed_tokens_extend.image_embed") for t in towers)
    check_cp_model(model)  # no token mixer in the decoder layers: allowed


@pytest.mark.parametrize("family, named, not_named", [
    ("mamba", r"\(backbone\.layers\.0\.mixer \(MambaMixer\), backbone\.layers\.1\.mixer \(MambaMixer\):",
     ["MambaForCausalLM", "MambaBlock", "RMSNorm", "conv1d"]),
    ("mamba2", r"\(backbone\.layers\.0\.mixer \(Mamba2Mixer\), ", ["Mamba2Model", "RMSNormGated", "conv1d"]),
    ("jamba", r"\(model\.layers\.0\.mamba \(JambaMambaMixer\), ", ["DecoderLayer", "conv1d"]),
    ("qwen3_next", r"\(model\.layers\.0\.linear_attn \(Qwen3NextGatedDeltaNet\):", ["conv1d"])])
def test_a_refusal_names_the_token_mixers_not_the_model_or_blocks_holding_them(family, named, not_named):
    # Mamba's model, blocks and norms carry the family's name too; the refusal names the mixers themselves.
    with pytest.raises(ndp.hf.Unsupported) as err:
        check_cp_model(tiny_model(family))
    assert re.search(named, str(err.value)), str(err.value)
    assert not [word for word in not_named if word in str(err.value).split(":")[1]], str(err.value)


@pytest.mark.skipif("dots3_note_text" not in CONFIG_MAPPING, reason="dots3_note_text is new in transformers 5.24")
def test_heads_set_per_layer_are_checked_layer_by_layer():
    # A heterogeneous config (dots3_note: 128 heads in indexed layers, 64 in sliding ones) raises on a read of
    # num_attention_heads from the whole config; ndp checks every kind of layer.
    cfg = AutoConfig.for_model("dots3_note_text")
    assert head_counts(cfg) == [(64, 64), (128, 128)]
    model = nn.Module()
    model.config = cfg
    ndp.hf.check_model(model, ndp.ParallelismConfig(tp_size=64))
    with pytest.raises(ValueError, match="num_heads=64, num_kv_heads=64, tp_size=128"):
        ndp.hf.check_model(model, ndp.ParallelismConfig(tp_size=128))
