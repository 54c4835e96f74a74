"""Rotary embeddings whose frequencies follow the sequence's length (transformers' LongRoPE and dynamic NTK) under
context parallelism: every rank rotates with the frequencies of the batch's longest position, as one process does
(``ndp.hf.rope``), for dense rows, rows ndp pads and packed documents; arguments naming positions of the sequence
(``logits_to_keep``, a KV cache) are refused on every rank."""
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _zoo  # noqa: E402
import ndp  # noqa: E402
import ndp.hf  # noqa: E402
from dist import spawn  # noqa: E402
from ndp.hf.batch import document_table  # noqa: E402
from ndp.hf.rope import length_dependent  # noqa: E402


def _batch(case):
    """(input_ids, shifted labels, position_ids, the document table or None, the RoPE threshold): dense rows of 32
    tokens (threshold 28: the zigzag rank holding the middle sees 24), rows of 30 that ndp pads to 32 under
    zigzag (threshold 30: the pads must not count), documents of 20 and 12 tokens in one row (threshold 16)."""
    g = torch.Generator().manual_seed(0)
    if case == "packed":
        lens = (20, 12)
        ids = torch.randint(3, _zoo.VOCAB, (1, sum(lens)), generator=g)
        docs = ids[0].split(lens)
        labels = torch.cat([F.pad(d[1:], (0, 1), value=-100) for d in docs])[None]
        pos = torch.cat([torch.arange(n) for n in lens])[None]
        return ids, labels, pos, torch.tensor([0, 20, 32], dtype=torch.int32), 16
    seq, threshold = (32, 28) if case == "dense" else (30, 30)
    ids = torch.randint(3, _zoo.VOCAB, (2, seq), generator=g)
    return ids, F.pad(ids[:, 1:], (0, 1), value=-100), torch.arange(seq).expand(2, seq), None, threshold


def _reference(kind, case):
    """One process on the whole batch, ndp's attention (documents kept apart): (mean loss, {name: grad})."""
    ids, labels, pos, cu, threshold = _batch(case)
    model = _zoo.rope_model(kind, threshold)
    ndp.hf.register_attention()
    model.set_attn_implementation("ndp_ring")
    extra = {} if cu is None else document_table(cu, "cpu")
    logits = model(input_ids=ids, position_ids=pos, **extra).logits
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    return _zoo._loss_and_grads(model, loss)


def _rope_body(rank, world):
    for impl, layout in (("ring", "zigzag"), ("ulysses", "contiguous")):
        cfg = ndp.ParallelismConfig(cp_size=world, cp_impl=impl, cp_layout=layout)
        for kind in ("longrope", "dynamic"):
            for case in ("dense", "padded", "packed"):
                ref_loss, ref_grads = _reference(kind, case)
                ids, labels, pos, cu, threshold = _batch(case)
                model = ndp.hf.parallelize(_zoo.rope_model(kind, threshold), cfg, _zoo.mesh(cfg))
                extra = {} if cu is None else document_table(cu, "cpu")
                b = ndp.hf.shard_batch(model, input_ids=ids, labels=labels, position_ids=pos, **extra)
                shard_labels = b.pop("labels")
                rel = _zoo._against(model, model(**b).logits, shard_labels, ref_loss, ref_grads)
                assert rel <= _zoo.TOL, f"{impl} {kind} {case}: {rel:.3g}"


@pytest.mark.distributed
def test_length_following_rope_is_the_batchs_on_every_cp_rank(tmp_path):
    spawn(_rope_body, 2, tmp_path, timeout_s=120)


def _positions_body(rank, world):
    cfg = ndp.ParallelismConfig(cp_size=world, cp_layout="zigzag")
    model = ndp.hf.parallelize(_zoo.tiny_model("llama").train(), cfg, _zoo.mesh(cfg))
    ids, labels, pos, _, _ = _batch("dense")
    b = ndp.hf.shard_batch(model, input_ids=ids, labels=labels, position_ids=pos)
    for extra in (dict(logits_to_keep=1), dict(logits_to_keep=torch.tensor([0, 3])),
                  dict(past_key_values=DynamicCache(config=model.config))):
        with pytest.raises(ndp.hf.Unsupported, match="not of the sequence"):
            model(**b, **extra)
    assert model(**b, logits_to_keep=0).logits.shape[1] == ids.shape[1] // world  # 0: every position


@pytest.mark.distributed
def test_arguments_naming_sequence_positions_are_refused_on_every_cp_rank(tmp_path):
    spawn(_positions_body, 2, tmp_path, timeout_s=60)


@pytest.mark.parametrize("kind,want", [("longrope", [None]), ("dynamic", [None]), ("default", []), ("linear", []),
                                       ("llama3", []), ("yarn", [])])
def test_rotaries_following_the_length_are_found(kind, want):
    extra = dict(factor=4.0, original_max_position_embeddings=16, low_freq_factor=1.0, high_freq_factor=4.0)
    params = dict(rope_type=kind, rope_theta=10000.0, **({} if kind == "default" else extra))
    model = _zoo.rope_model("longrope", 16) if kind == "longrope" else _zoo.tiny_model("llama", rope_parameters=params)
    found = {name: length_dependent(m) for name, m in model.named_modules() if length_dependent(m)}
    assert found == ({"model.rotary_emb": want} if want else {})


def _temperature_body(rank, world):
    cfg = ndp.ParallelismConfig(cp_size=world, cp_layout="zigzag")
    model = ndp.hf.parallelize(_zoo.tiny_model("llama4_text", no_rope_layers=[0, 0]).train(), cfg, _zoo.mesh(cfg))
    ids, labels, pos, cu, _ = _batch("packed")
    b = ndp.hf.shard_batch(model, input_ids=ids, labels=labels, position_ids=pos, **document_table(cu, "cpu"))
    with pytest.raises(ndp.hf.Unsupported, match="attn_temperature_tuning"):
        model(**b)


@pytest.mark.distributed
def test_llama4_query_temperature_of_packed_documents_is_refused_under_cp(tmp_path):
    """Llama 4's NoPE layers scale queries by their index in the row; the zoo's cp 2 passes check dense rows exact
    (ndp rescales the shard's index to the row's), packed documents under CP are refused on every rank (both layers
    NoPE here: Llama 4's chunked RoPE layers refuse packed documents first)."""
    spawn(_temperature_body, 2, tmp_path, timeout_s=60)
