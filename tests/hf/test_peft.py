"""PEFT adapters under ndp's context parallelism: a LoRA / DoRA model trained by ndp's SFTTrainer, DPOTrainer and
KTOTrainer (TRL wraps the model with the trainer's ``peft_config``) equals the same training without CP; a PEFT
method that puts virtual tokens before each row (prompt, prefix, P-tuning) is refused by name."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import ndp
import ndp.hf
from dist import spawn
from test_accelerate import _save_tiny, _sft_against, _tp_split
from test_preference import _against, _decided

peft = pytest.importorskip("peft")


def _lora(**kw):
    return peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "lora_dropout": 0.0,
                              "task_type": "CAUSAL_LM", **kw})


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("packing, dp, dora, split, dropout", [
    (False, 1, False, "cp_size", 0.0), (True, 2, False, "cp_size", 0.0), (False, 1, True, "cp_size", 0.0),
    (False, 2, False, "tp_size", 0.0), (False, 2, False, "tp_size", 0.3)])
def test_sft_trainer_with_adapters_under_cp_trains_and_evaluates_as_without(tmp_path, packing, dp, dora, split,
                                                                            dropout):
    """The PEFT wrapper computes no loss itself: it hands `shift_labels` and `num_items_in_batch` on to the
    transformers model, whose causal-LM loss takes them. ndp looked for that loss on the wrapper and refused every
    PEFT model given labels under CP ("PeftModelForCausalLM computes its loss itself from `labels`"): LoRA had no
    CP. Against TRL's one process (cp 2) or ndp's at dp_shard 2 (dp_shard 2 x cp 2, packed): losses, evaluation
    loss and TRL's metrics. LoRA at dp_shard 2 x tp 2 (refused before) against dp_shard 2: the 14 base layers
    and 14 adapter matrices split over the TP ranks; with lora_dropout (refused under TP before), the TP ranks draw
    as the data-parallel rank alone does (the Trainer seeds every rank alike), the row-split layers' masks drawn at
    the whole width."""
    pytest.importorskip("trl")
    model_dir = str(tmp_path / "model")
    got, want = _sft_against(tmp_path, model_dir, packing, None, dp, layer=_save_tiny(model_dir, "llama"),
                             split=split, peft_config=_lora(use_dora=dora, lora_dropout=dropout), learning_rate=0.1,
                             max_grad_norm=0.0)
    assert got["tp_split"] == (28 if split == "tp_size" else 0)
    assert len(got["losses"]) == 3 and got["losses"] == pytest.approx(want["losses"], rel=1e-6)
    assert got["losses"][0] != got["losses"][2]  # the adapters trained
    assert got["eval"] == pytest.approx(want["eval"], rel=1e-6)
    assert got["metrics"] == [pytest.approx(m, rel=1e-6) for m in want["metrics"]]


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind, par", [("dpo", {"cp_size": 2}), ("kto", {"dp_shard_size": 2, "cp_size": 2}),
                                       ("reward", {"cp_size": 2})])
def test_preference_trainers_with_lora_under_cp_train_as_without(tmp_path, kind, par):
    """Without a reference model TRL's reference is the policy with its adapters off (``disable_adapter``): the
    same model called twice per step, each call sharded and gathered by ndp's hooks. A reward model's score head
    is PEFT's trained copy (modules_to_save), its pooling found through the wrapper."""
    pytest.importorskip("trl")
    got, want = _against(tmp_path, "llama", kind, par,
                         peft_config=_lora(task_type="SEQ_CLS") if kind == "reward" else _lora())
    assert len(got["losses"]) == 3 and got["losses"] == pytest.approx(want["losses"], rel=1e-5)
    assert got["losses"][1] != got["losses"][2]
    assert got["eval"] == pytest.approx(want["eval"], rel=1e-5, abs=1e-5)
    assert _decided(got, want) == [pytest.approx(m, rel=1e-5, abs=1e-5) for m in _decided(want, want)]


@pytest.mark.parametrize("method", ["PromptTuningConfig", "PrefixTuningConfig", "PromptEncoderConfig"])
def test_virtual_token_methods_are_refused_under_cp_and_adapters_pass(tmp_path, method):
    """Prompt tuning prepends learned embeddings to each row, prefix tuning learned keys and values: under CP every
    rank's shard got them at its own start. Before, the attention's position check caught it inside the first
    forward, blaming the batch ("position_ids that are not rank 0's shard"); prefix tuning's keys and values
    are a cache the check would not see with positions given. Refused by check_model, before any work (it runs
    alike on every rank). LoRA passes, its loss found on the model it wraps."""
    _save_tiny(str(tmp_path), "llama")
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    wrapped = peft.get_peft_model(base, getattr(peft, method)(num_virtual_tokens=4, task_type="CAUSAL_LM"))
    with pytest.raises(ndp.hf.Unsupported, match=r"PEFT's \w+ puts learned virtual tokens before each row.*cp_size=1"):
        ndp.hf.check_model(wrapped, ndp.ParallelismConfig(cp_size=2))
    ndp.hf.check_model(wrapped, ndp.ParallelismConfig(dp_shard_size=2))  # without CP: PEFT's own business
    lora = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(str(tmp_path)), _lora())
    ndp.hf.check_model(lora, ndp.ParallelismConfig(cp_size=2))
    assert ndp.hf.models.takes_shift_labels(lora) and ndp.hf.models.peft_inner(lora) is lora.base_model.model
    assert torch.equal(lora.get_input_embeddings().weight, base.get_input_embeddings().weight)
    # tensor parallel: a LoRA layer's plan entry goes to its base layer and to the adapter matrix split alike
    plan = ndp.hf.hf_plan(lora).tp_plan
    ndp.hf.check_tp_plan(lora, plan)
    at = "base_model.model.model.layers.1."
    assert plan[at + "self_attn.q_proj.base_layer"] == plan[at + "self_attn.q_proj.lora_B.default"] == "colwise"
    assert plan[at + "mlp.down_proj.base_layer"] == plan[at + "mlp.down_proj.lora_A.default"] == "rowwise"
    assert len(plan) == 28  # by name: 2 layers x 7 projections x (base layer, adapter matrix)
    # refused by name: what the split cannot keep exact
    for config, why in ((_lora(use_dora=True), "DoRA rescales each adapted layer by the norm of its whole weight"),
                        (peft.IA3Config(task_type="CAUSAL_LM"), "its PEFT method is IA3, and ndp splits LoRA")):
        other = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(str(tmp_path)), config)
        with pytest.raises(ndp.hf.Unsupported, match=f"tensor parallel: PeftModelForCausalLM is a PEFT model and "
                                                     f"{why}"):
            ndp.hf.check_tp_plan(other, ndp.hf.hf_plan(other).tp_plan)


def _lora_llama(**lora):
    """A tiny Llama with LoRA on every linear layer (`lora`: other LoraConfig fields), its B matrices random (PEFT
    starts them at zero, which would leave the A matrices without a gradient)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    torch.manual_seed(1)
    model = peft.get_peft_model(model, _lora(**lora))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


def _batch():
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    return ids, F.pad(ids[:, 1:], (0, 1), value=-100)


def _parallelized_lora_rank(rank, world, tmp, par, lora, split):
    cfg = ndp.ParallelismConfig(**par)
    model = ndp.hf.parallelize(_lora_llama(**lora), cfg, cfg.build_device_mesh("cpu"))
    assert _tp_split(model) == split  # the parameters split over "tp": base layers and adapter matrices
    ids, labels = _batch()
    b = ndp.hf.shard_batch(model, global_batch=True, input_ids=ids, labels=labels,
                           position_ids=torch.arange(ids.shape[1]).expand_as(ids))
    out = model(**b)  # the model's own loss on the shard, labels as shard_batch marked them
    out.loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    loss = out.loss.detach().reshape(1)
    dist.all_reduce(loss)  # each rank's loss is scaled for FSDP's average: their mean is the batch's
    if rank == 0:
        torch.save((loss.item() / world, grads), os.path.join(tmp, "lora.pt"))


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("par, lora, grads, split", [
    ({"dp_shard_size": 2, "cp_size": 2}, {}, 28, 0), ({"cp_size": 2, "tp_size": 2}, {}, 28, 28),
    ({"cp_size": 2, "tp_size": 2}, {"target_modules": ["q_proj", "down_proj"], "layers_to_transform": [0]}, 4, 16)],
    ids=["dp_shard2-cp2", "cp2-tp2", "cp2-tp2-some"])
def test_parallelize_a_lora_model_under_fsdp2_cp_and_tp_matches_one_process(tmp_path, par, lora, grads, split):
    """ndp.hf.parallelize on a PEFT model (dp_shard 2 x cp 2; cp 2 x tp 2, each LoRA layer split with its base
    layer: refused before; LoRA on two projections of the first layer only, the others split as plain layers):
    its loss from shard_batch's labels and the adapters' gradients (the frozen weights get none; the B matrices
    random, so that the A matrices, kept whole beside a column split, get one) equal one process's on the whole
    batch."""
    spawn(_parallelized_lora_rank, 4, tmp_path, str(tmp_path), par, lora, split, timeout_s=120)
    loss, got = torch.load(tmp_path / "lora.pt")
    model = _lora_llama(**lora)
    ids, labels = _batch()
    want = model(input_ids=ids, labels=labels, shift_labels=labels)
    want.loss.backward()
    assert loss == pytest.approx(want.loss.item(), rel=1e-6)
    ref = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert sorted(got) == sorted(ref) and all("lora_" in n for n in ref) and len(ref) == grads
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7)


def _lora_dropout_rank(rank, world, tmp):
    cfg = ndp.ParallelismConfig(tp_size=world)
    model = ndp.hf.parallelize(_lora_llama(lora_dropout=0.5), cfg, cfg.build_device_mesh("cpu"))
    ids, labels = _batch()
    torch.manual_seed(100 + rank)  # each rank its own stream: the TP ranks draw TP rank 0's
    out = model(input_ids=ids, labels=labels, shift_labels=labels)
    out.loss.backward()
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
             for n, p in model.named_parameters() if p.grad is not None}
    if rank == 0:
        torch.save((out.loss.item(), grads), os.path.join(tmp, "lora.pt"))


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_lora_dropout_under_tp_draws_as_one_process(tmp_path):
    """lora_dropout > 0 at tp 2 (refused before: each TP rank drew its own masks, and the adapters kept whole drifted
    apart), the ranks seeded each their own: the loss and the 28 adapter gradients equal one process's seeded like TP
    rank 0. A row-split layer's A matrix takes this rank's columns of the layer's input: its dropout draws the whole
    input's mask and keeps the rank's columns (``ndp.hf.ColumnDropout``), as one process draws."""
    spawn(_lora_dropout_rank, 2, tmp_path, str(tmp_path), timeout_s=120)
    loss, got = torch.load(tmp_path / "lora.pt")
    model = _lora_llama(lora_dropout=0.5)
    ids, labels = _batch()
    torch.manual_seed(100)
    want = model(input_ids=ids, labels=labels, shift_labels=labels)
    want.loss.backward()
    assert loss == pytest.approx(want.loss.item(), rel=1e-6)
    with torch.no_grad():
        model.eval()
        assert model(input_ids=ids, labels=labels, shift_labels=labels).loss.item() != pytest.approx(loss, rel=1e-5)
    ref = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert sorted(got) == sorted(ref) and len(ref) == 28
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7)
