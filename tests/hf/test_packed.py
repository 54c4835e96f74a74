"""Packed SFT batches the way transformers' DataCollatorWithFlattening makes them (position_ids restarting,
cu_seq_lens_q/k + max_length_q/k, seq_idx) through ``shard_batch`` + the model + ``ndp.hf.loss``: loss and every
gradient equal a per-document 1-process reference (float64, 1e-6) at cp 1, 2 and 4, ring / all-gather / Ulysses /
USP, llama / qwen2 / mistral (sliding window 8 inside documents of up to 16 tokens). Odd lengths: dense rows padded
by shard_batch give the unpadded loss and gradients. Batches too short to give every rank a token (one short
document) are cut finer or get a padding document, and are exact too."""
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from transformers import DataCollatorWithFlattening

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist import spawn  # noqa: E402
import _zoo  # noqa: E402

DOCS = [10, 14, 8, 16, 16]
MODES = {"position_ids": {}, "flash_attn_kwargs": dict(return_flash_attn_kwargs=True),
         "seq_idx": dict(return_seq_idx=True)}
MODELS = ("llama", "qwen2", "mistral")
TOL = 1e-6


def _documents(lens=DOCS):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, _zoo.VOCAB, (n,), generator=g).tolist() for n in lens]


def collated(mode, lens=DOCS):
    """The collator's batch with labels shifted (ndp's convention: labels[i] is the target of token i)."""
    b = DataCollatorWithFlattening(**MODES[mode])([{"input_ids": d} for d in _documents(lens)])
    b["labels"] = F.pad(b["labels"][:, 1:], (0, 1), value=-100)
    if mode == "seq_idx":  # the collator adds position_ids too: leave only seq_idx to say where documents start
        del b["position_ids"]
    return dict(b)


def reference(model_type, lens=DOCS):
    """Each document alone through the model's eager attention: (mean loss, {name: grad})."""
    model = _zoo.tiny_model(model_type).train()
    total, count = 0.0, 0
    for d in _documents(lens):
        ids = torch.tensor([d])
        labels = F.pad(ids[:, 1:], (0, 1), value=-100)
        logits = model(input_ids=ids, position_ids=torch.arange(len(d))[None]).logits
        total = total + F.cross_entropy(logits[0], labels[0], ignore_index=-100, reduction="sum")
        count += int((labels != -100).sum())
    loss = total / count
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def run_packed(model_type, mode, world, impl, lens=DOCS):
    """Relative difference (loss and every gradient) of the packed batch of documents `lens` under ndp vs
    :func:`reference`."""
    import ndp
    import ndp.hf

    ref_loss, ref_grads = reference(model_type, lens)
    extra = dict(ulysses_size=2) if impl == "usp" else {}
    cfg = ndp.ParallelismConfig(cp_size=world, cp_impl=impl, **extra)
    mesh = _zoo.mesh(cfg) if world > 1 else None
    model = ndp.hf.parallelize(_zoo.tiny_model(model_type).train(), cfg, mesh)
    if world == 1:
        ndp.hf.register_attention()
        model.set_attn_implementation("ndp_ring")
    b = ndp.hf.shard_batch(model, **collated(mode, lens))
    labels = b.pop("labels")
    logits = model(**b).logits
    loss, mean = ndp.hf.loss(logits, labels, model, return_mean=True)
    loss.backward()
    rel = _rel(mean.double(), ref_loss)
    for n, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        rel = max(rel, _rel(g, ref_grads[n.replace("_checkpoint_wrapped_module.", "")]))
    return rel


def run_odd_length(model_type, world, impl, seq=30):
    """Relative difference of dense rows of `seq` tokens (not a multiple of 2 x cp) padded by shard_batch vs the
    unpadded rows on 1 process."""
    import ndp
    import ndp.hf

    ids = torch.randint(3, _zoo.VOCAB, (2, seq), generator=torch.Generator().manual_seed(5))
    labels = F.pad(ids[:, 1:], (0, 1), value=-100)
    ref = _zoo.tiny_model(model_type).train()
    logits = ref(input_ids=ids).logits
    ref_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    ref_loss.backward()
    cfg = ndp.ParallelismConfig(cp_size=world, cp_impl=impl)
    model = ndp.hf.parallelize(_zoo.tiny_model(model_type).train(), cfg, _zoo.mesh(cfg))
    with pytest.raises(ValueError, match="zigzag sharding needs seqlen divisible by 2[*]cp_size"):
        ndp.hf.shard_batch(model, input_ids=ids, labels=labels, pad=False)
    b = ndp.hf.shard_batch(model, input_ids=ids, labels=labels)
    loss, mean = ndp.hf.loss(model(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits, b["labels"],
                             model, return_mean=True)
    loss.backward()
    rel = _rel(mean.double(), ref_loss.detach())
    for (n, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        rel = max(rel, _rel(g, r.grad))
    return rel


def _combos(impls):
    """Every impl with every model, the collator modes cycling so each (impl, mode) and (model, mode) appears."""
    modes = list(MODES)
    return [(mt, modes[(i + j) % len(modes)], impl) for i, impl in enumerate(impls) for j, mt in enumerate(MODELS)]


# Batches too short for every rank at the default cut (one document of 2N..16N tokens: cut over every rank) or at
# any cut (no document of 2N tokens, fewer documents than ranks: a padding document is added), per world size.
# (One document with position_ids only is a dense row: the collator's document table makes it packed.)
SHORT = {2: [("llama", "flash_attn_kwargs", "ring", [9]), ("qwen2", "flash_attn_kwargs", "ulysses", [3])],
         4: [("mistral", "seq_idx", "allgather", [12, 1]), ("llama", "position_ids", "usp", [5, 2])]}


def _body(rank, world, impls):
    import transformers

    transformers.logging.set_verbosity_error()
    for mt, mode, impl in _combos(impls):
        rel = run_packed(mt, mode, world, impl)
        assert rel <= TOL, (mt, mode, impl, world, rel)
    for mt, mode, impl, lens in SHORT[world]:
        rel = run_packed(mt, mode, world, impl, lens)
        assert rel <= TOL, ("short", mt, mode, impl, world, lens, rel)
    _short_batch_refused_unpadded(world)
    if world == 2:
        for mt, impl in (("llama", "ring"), ("mistral", "ulysses")):
            rel = run_odd_length(mt, world, impl)
            assert rel <= TOL, ("odd length", mt, impl, rel)


def _short_batch_refused_unpadded(world):
    """A packed batch that leaves a rank without a token, with pad=False or without labels: ValueError on every
    rank (the document table is global), before the model runs."""
    import ndp
    import ndp.hf

    cfg = ndp.ParallelismConfig(cp_size=world)
    model = ndp.hf.parallelize(_zoo.tiny_model("llama").train(), cfg, _zoo.mesh(cfg))
    b = collated("flash_attn_kwargs", [3])
    with pytest.raises(ValueError, match=rf"documents \[3\] leaves {world - 1} of the {world} context-parallel ranks "
                                         r"without a token .* \(pad=False\)"):
        ndp.hf.shard_batch(model, pad=False, **b)
    with pytest.raises(ValueError, match=r"the batch has no labels \(or shift_labels\)"):
        ndp.hf.shard_batch(model, **{k: v for k, v in b.items() if k != "labels"})


def test_padding_gives_every_label_name_minus_100():
    from ndp.hf.batch import pad_rows

    rows = pad_rows({"input_ids": torch.ones(1, 5, dtype=torch.long), "labels": torch.ones(1, 5, dtype=torch.long),
                     "shift_labels": torch.ones(1, 5, dtype=torch.long)}, 4, pad_id=7)
    assert rows["input_ids"][0, 5:].tolist() == [7, 7, 7]
    assert rows["labels"][0, 5:].tolist() == rows["shift_labels"][0, 5:].tolist() == [-100] * 3


@pytest.mark.parametrize("mode", list(MODES))
def test_packed_without_cp_is_per_document(mode):
    for mt in MODELS:
        assert run_packed(mt, mode, 1, "ring") <= TOL, (mt, mode)


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize("world,impls", [(2, ("ring", "allgather", "ulysses")),
                                         (4, ("ring", "allgather", "ulysses", "usp"))])
def test_packed_under_cp_is_per_document(tmp_path, world, impls):
    spawn(_body, world, tmp_path, impls, timeout_s=300)


@pytest.mark.parametrize("model_type", ["mamba", "mpt"])
def test_a_model_that_would_let_packed_documents_see_each_other_refuses_them(model_type):
    # Mamba's scan carries its state across the row, MPT computes its attention itself (ALiBi): packed documents
    # would see each other (both measured 90-220% off per-document training). The collator's batches in each form
    # are refused by name, before any layer runs; dense rows and a left-padded batch (positions restart after the
    # pads, but the attention mask says where the tokens are) run.
    import ndp
    import ndp.hf

    model = ndp.hf.parallelize(_zoo.tiny_model(model_type).train(), ndp.ParallelismConfig(), None)
    ran = []
    model.get_input_embeddings().register_forward_pre_hook(lambda *a: ran.append(1))
    for mode in MODES:
        b = collated(mode)
        b.pop("labels")
        with pytest.raises(ndp.hf.Unsupported, match=r"packed documents .* would not stay apart: .*--pack-docs"):
            model(**b)
    assert not ran
    ids = torch.randint(3, _zoo.VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, position_ids=torch.arange(8).expand(2, 8))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8])
    model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).masked_fill(mask == 0, 1))
    with pytest.raises(ndp.hf.Unsupported, match="packed documents"):
        ndp.hf.check_packed_model(model)
    ndp.hf.check_packed_model(_zoo.tiny_model("llama"))  # its attention keeps them apart: no refusal

