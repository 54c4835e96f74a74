"""A new user's mistakes under CP get one clear error on every rank, before any work: a batch that did not go
through shard_batch (dense or packed), a packed batch without its document table, a dense 4-D mask, parallelize
without a mesh in a multi-process job, a vision or audio tower (outside the decoder layers) run under CP, a head
that reads chosen positions of a row (sequence classification, question answering) under CP or packing, another
batch on each rank of a CP or TP group."""
import copy
import os
import re
import sys

import pytest
import torch
from torch import nn
import torch.nn.functional as F
import transformers
from transformers import (CONFIG_MAPPING, AutoConfig, DataCollatorWithFlattening, LlamaConfig,
                          LlamaForSequenceClassification, LlamaForTokenClassification)
from transformers.models.auto import modeling_auto

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ndp  # noqa: E402
import ndp.hf  # noqa: E402
from dist import spawn  # noqa: E402
from ndp.hf.attention import guard_outside_layers  # noqa: E402
from ndp.hf.models import (_pooling_head, check_cp_model, check_packed_model, cp_attention_modules,  # noqa: E402
                           decoder_layers, head_counts, outside_layers)
from ndp.testing import assert_close  # noqa: E402
from ndp.train.presets import build_model  # noqa: E402
from _zoo import _loss_and_grads, _rel, tiny_model, tolerance  # noqa: E402

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


def _other_batches_body(rank, world):
    cfg = ndp.ParallelismConfig(cp_size=2, tp_size=2)
    model = ndp.hf.parallelize(build_model("tiny-llama", seed=0, dtype=torch.float64), cfg,
                               cfg.build_device_mesh("cpu"))

    def rows(seed):
        ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(seed))
        return dict(input_ids=ids, labels=F.pad(ids[:, 1:], (0, 1), value=-100))

    match = r"other rows on the 4 ranks that each take their part of one batch \(the cp and tp axes\).*" \
            r"DistributedSampler\(dataset, num_replicas=1, rank=0\)"
    # a sampler over every rank: each rank its own batch; then rank 1's alone (rank 2 shares neither its CP nor its
    # TP group, yet refuses too: the comparison spans both axes, no rank is left waiting in a collective)
    for seeds in ((0, 1, 2, 3), (0, 1, 0, 0)):
        with pytest.raises(ValueError, match=match):
            ndp.hf.shard_batch(model, **rows(seeds[rank]))
    b = ndp.hf.shard_batch(model, **rows(7))  # one batch: sharded, and the model's loss is the batch's
    ref = build_model("tiny-llama", seed=0, dtype=torch.float64)
    want = F.cross_entropy(ref(**{k: v for k, v in rows(7).items() if k != "labels"}).logits.flatten(0, 1),
                           rows(7)["labels"].flatten(), ignore_index=-100)
    loss = model(**b).loss.detach()
    torch.distributed.all_reduce(loss, group=model.ndp_cp.group)
    assert_close(loss / 2, want.detach(), torch.float32)  # transformers computes its loss in float32


def test_other_batches_on_the_ranks_of_one_batch_are_refused_on_every_rank(tmp_path):
    """The classic sampler mistake (DistributedSampler over every rank, not the data-parallel ones) gave each CP
    and TP rank its own batch, and shard_batch took each rank's piece of another batch: trained silently."""
    spawn(_other_batches_body, 4, tmp_path, timeout_s=60)


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
    match = r"Embedding runs outside the decoder layers .* on a batch sharded before the model"
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
    ("jamba", r"\(model\.layers\.0\.mamba \(JambaMambaMixer\):", ["DecoderLayer", "conv1d"]),
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


def _head_classes(*tasks):
    """transformers' classes of the auto mappings MODEL_FOR_<task>_MAPPING_NAMES that this version exports."""
    names = {n for t in tasks for v in getattr(modeling_auto, f"MODEL_FOR_{t}_MAPPING_NAMES").values()
             for n in ([v] if isinstance(v, str) else v)}
    return sorted((getattr(transformers, n) for n in names if hasattr(transformers, n)), key=lambda c: c.__name__)


def _stand_in(cls):
    return cls.__new__(cls)  # the class alone is what the check reads: no config, no weights


def test_every_head_reading_chosen_positions_is_refused_under_cp_and_packing():
    # Sequence classification pools each row's last non-pad token: under cp 2 (zigzag) rank 1's "last" token is
    # the middle of the row (its logits differed from one process's, rank 0's matched); question answering and
    # multiple choice read spans and choice tokens of the row alike. Every such class transformers maps is refused
    # (and a remote-code class named alike); every causal-LM and token-classification head passes.
    pooling = _head_classes("SEQUENCE_CLASSIFICATION", "QUESTION_ANSWERING", "MULTIPLE_CHOICE",
                            "NEXT_SENTENCE_PREDICTION") + [transformers.GPT2DoubleHeadsModel]
    per_token = _head_classes("CAUSAL_LM", "TOKEN_CLASSIFICATION")
    assert len(pooling) > 200 and len(per_token) > 250
    for cls in pooling:
        with pytest.raises(ndp.hf.Unsupported, match=rf"^{cls.__name__}: its head reads chosen positions of each "
                                                     rf"row .* the positions it reads would be the shard's\. Run it "
                                                     rf"with cp_size=1"):
            check_cp_model(_stand_in(cls))
        with pytest.raises(ndp.hf.Unsupported, match=r"packed documents .* would not stay apart: its head reads "
                                                     r"chosen positions .* one set for all the documents of a row"):
            check_packed_model(_stand_in(cls))
    remote = type("MyLongForSequenceClassification", (nn.Module,), {})
    with pytest.raises(ndp.hf.Unsupported, match="^MyLongForSequenceClassification: its head"):
        check_cp_model(remote())
    assert [cls.__name__ for cls in per_token if _pooling_head(_stand_in(cls))] == []


def test_encoder_decoder_models_are_refused_under_cp():
    """An encoder-decoder model (T5, BART, Florence-2, ...) under CP: its decoder cross-attends to the encoder's
    output and its labels are the decoder's own sequence. Before, Florence-2 went through parallelize and
    shard_batch (its text model taken for a decoder) and failed inside the attention with a KV-cache message, or not
    at all where the lengths happened to fit; BART was sent to compute its loss from the logits."""
    refused = []
    for family in sorted({*modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, "florence2"}):
        try:
            config = AutoConfig.for_model(family)
        except Exception:  # no default config to build (a family that needs a checkpoint's)
            continue
        if not any(c.is_encoder_decoder for c in (config, config.get_text_config(decoder=True))):
            continue  # an audio LM in that mapping (Qwen2-Audio, Voxtral): a decoder-only model with a tower
        model = nn.Module()
        model.config = config
        with pytest.raises(ndp.hf.Unsupported, match=r"is an encoder-decoder model .* shards one decoder-only "
                                                     r"sequence\. Run it with cp_size=1"):
            check_cp_model(model)
        refused.append(family)
    assert len(refused) > 20 and {"bart", "t5", "mbart", "florence2"} <= set(refused)
    check_cp_model(tiny_model("bart"))  # BART's decoder alone (BartForCausalLM) is a decoder-only model


def test_layerdrop_is_refused_across_ranks_that_reduce_together():
    """LayerDrop skips each decoder layer on a draw of each rank's own stream: under CP or FSDP, ranks that drew apart
    ran different layers, their per-layer collectives paired with another layer's (ring attention or FSDP's
    all-gather of layer 2 on one rank with layer 3's on another). Refused by name before any work, for the causal LMs
    that have it; tensor parallel alone draws alike (ndp.parallel.draws), one rank is its own business."""
    for family in ("opt", "xglm", "biogpt", "bart", "mbart", "marian", "pegasus", "plbart", "trocr", "whisper"):
        model = tiny_model(family, layerdrop=0.5, decoder_layerdrop=0.5)
        for par in ({"cp_size": 2}, {"dp_shard_size": 2}, {"dp_replicate_size": 2}):
            with pytest.raises(ndp.hf.Unsupported, match=r"skips each decoder layer with probability 0.5 \(LayerDrop\)"
                                                         r".* Set the config's layerdrop \(decoder_layerdrop\) to 0.0"):
                ndp.hf.check_model(model, ndp.ParallelismConfig(**par))
        ndp.hf.check_model(model, ndp.ParallelismConfig(tp_size=2))
        ndp.hf.check_model(model, ndp.ParallelismConfig())
        ndp.hf.check_model(tiny_model(family), ndp.ParallelismConfig(dp_shard_size=2))  # layerdrop 0


def _heads_body(rank, world):
    import ndp
    import ndp.hf

    cfg = ndp.ParallelismConfig(cp_size=world)
    mesh = cfg.build_device_mesh("cpu")
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=3, pad_token_id=0)
    torch.manual_seed(0)
    with pytest.raises(ndp.hf.Unsupported, match="LlamaForSequenceClassification: its head reads chosen positions"):
        ndp.parallelize(LlamaForSequenceClassification(config), cfg, mesh)  # on each rank, before any collective
    # a per-token head is exact: this rank's shard of one process's logits
    torch.manual_seed(0)
    whole = LlamaForTokenClassification(config).double().eval()  # eval: no dropout in its head
    model = ndp.parallelize(copy.deepcopy(whole), cfg, mesh)
    ids = torch.randint(1, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    b = ndp.hf.shard_batch(model, input_ids=ids)
    want = ndp.cp.shard_sequence(whole(input_ids=ids).logits, dim=1, layout=cfg.cp_layout)
    assert_close(model(**b).logits, want, torch.float64)


def test_a_pooling_head_is_refused_on_every_rank_and_a_per_token_head_is_exact_under_cp(tmp_path):
    spawn(_heads_body, 2, tmp_path, timeout_s=60)


def _grads(model, ids):
    """The gradients of the model's next-token loss on `ids`, taken off the model (the next call starts at none)."""
    logits = model(input_ids=ids).logits
    _, grads = _loss_and_grads(model, F.cross_entropy(logits[0, :-1], ids[0, 1:]))
    model.zero_grad(set_to_none=True)
    return grads


def _rel_grads(got, ref):
    return max(_rel(got[n], g) for n, g in ref.items())


def test_reentrant_checkpointing_of_layers_sharing_keys_and_values_is_refused():
    """Gemma 3n's later layers read keys and values an earlier layer stored in a dict: under transformers'
    reentrant checkpointing that layer runs without autograd, and its projections lose those layers' gradients,
    with transformers' own attention too. ndp refuses it (given or torch's default); non-reentrant is exact."""
    ids = torch.randint(3, 100, (1, 16), generator=torch.Generator().manual_seed(0))
    eager = tiny_model("gemma3n_text").train()
    ref = _grads(eager, ids)
    eager.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert _rel_grads(_grads(eager, ids), ref) > 0.1  # transformers' own: silently off

    model = ndp.hf.parallelize(tiny_model("gemma3n_text").train(), ndp.ParallelismConfig(), None)
    for kwargs in ({"use_reentrant": True}, {}):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        with pytest.raises(ndp.hf.Unsupported, match=r"earlier layer \(model.layers.2.self_attn.*use_reentrant=True"):
            model(input_ids=ids)
        with torch.no_grad():  # no backward, nothing to lose
            model(input_ids=ids)
    model.gradient_checkpointing_enable()  # transformers' default: use_reentrant=False
    assert _rel_grads(_grads(model, ids), ref) < tolerance("gemma3n_text")  # RMSNorm in float32
