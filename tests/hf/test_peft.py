"""PEFT adapters under ndp's context parallelism: a LoRA / DoRA model trained by ndp's SFTTrainer, DPOTrainer and
KTOTrainer (TRL wraps the model with the trainer's ``peft_config``) equals the same training without CP; a PEFT
method that puts virtual tokens before each row (prompt, prefix, P-tuning) is refused by name."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import ndp
import ndp.hf
from test_accelerate import _save_tiny, _sft_against
from test_preference import _against, _decided

peft = pytest.importorskip("peft")


def _lora(**kw):
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM",
                           **kw)


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("packing, dp, dora", [(False, 1, False), (True, 2, False), (False, 1, True)])
def test_sft_trainer_with_adapters_under_cp_trains_and_evaluates_as_without(tmp_path, packing, dp, dora):
    """The PEFT wrapper computes no loss itself: it hands `shift_labels` and `num_items_in_batch` on to the
    transformers model, whose causal-LM loss takes them. ndp looked for that loss on the wrapper and refused every
    PEFT model given labels under CP ("PeftModelForCausalLM computes its loss itself from `labels`"): LoRA had no
    CP. Against TRL's one process (cp 2) or ndp's at dp_shard 2 (dp_shard 2 x cp 2, packed): losses, evaluation
    loss and TRL's metrics."""
    pytest.importorskip("trl")
    model_dir = str(tmp_path / "model")
    got, want = _sft_against(tmp_path, model_dir, packing, None, dp, layer=_save_tiny(model_dir, "llama"),
                             peft_config=_lora(use_dora=dora), learning_rate=0.1, max_grad_norm=0.0)
    assert len(got["losses"]) == 3 and got["losses"] == pytest.approx(want["losses"], rel=1e-6)
    assert got["losses"][0] != got["losses"][2]  # the adapters trained
    assert got["eval"] == pytest.approx(want["eval"], rel=1e-6)
    assert got["metrics"] == [pytest.approx(m, rel=1e-6) for m in want["metrics"]]


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind, par", [("dpo", {"cp_size": 2}), ("kto", {"dp_shard_size": 2, "cp_size": 2})])
def test_preference_trainers_with_lora_under_cp_train_as_without(tmp_path, kind, par):
    """Without a reference model TRL's reference is the policy with its adapters off (``disable_adapter``): the
    same model called twice per step, each call sharded and gathered by ndp's hooks."""
    pytest.importorskip("trl")
    got, want = _against(tmp_path, "llama", kind, par, peft_config=_lora())
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
    # tensor parallel: PEFT's adapted layers are not the nn.Linear the plan splits; refused by name
    with pytest.raises(ndp.hf.Unsupported, match="tensor parallel: PeftModelForCausalLM is a PEFT model"):
        ndp.hf.check_tp_plan(lora, ndp.hf.hf_plan(lora).tp_plan)
