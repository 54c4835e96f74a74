"""ndp.trainer.DPOTrainer and KTOTrainer: TRL's DPO and KTO under ndp's context parallelism equal TRL's without it
(losses, evaluation loss, TRL's metrics), their per-sequence log-probability sums computed from every CP rank's
shard."""
import math
import os

import pytest
import torch
from accelerate.state import AcceleratorState
from datasets import Dataset, load_from_disk
from transformers import AutoModelForCausalLM, AutoTokenizer

import ndp.trainer
from dist import spawn
from test_accelerate import (DECODER_LAYERS, _in_order, _rank_env, _save_tiny, _save_tiny_family, _seeded_peft,
                             _tp_split, _trainer_args)

# TRL's DPO and KTO metrics a run logs, training and evaluation.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy", "num_tokens",
           "aux_loss", "kl", "count/chosen", "count/rejected", "min_reward", "mean_reward", "max_reward", "accuracy",
           "margin")
# ndp's and TRL's trainer classes by kind (a reward model trains on DPO's data: prompt, chosen, rejected)
TRAINERS = {"dpo": "DPOTrainer", "kto": "KTOTrainer", "reward": "RewardTrainer"}


def _preferences(seed, n, kind):
    """A preference dataset of the word tokenizer's words, completions of uneven lengths (pads in every batch):
    prompt, chosen and rejected (DPO; a reward model's also a margin per pair, which TRL hands to the model call
    too) or prompt, completion and a label alternating True / False (KTO)."""
    g = torch.Generator().manual_seed(seed)

    def words(lo, hi):
        size = int(torch.randint(lo, hi, (1,), generator=g))
        return " ".join(f"t{i}" for i in torch.randint(2, 256, (size,), generator=g).tolist())

    rows = [(words(5, 14), " " + words(3, 20), " " + words(3, 20)) for _ in range(n)]
    if kind == "kto":
        return Dataset.from_dict({"prompt": [r[0] for r in rows], "completion": [r[1] for r in rows],
                                  "label": [i % 2 == 0 for i in range(n)]})
    data = {k: [r[i] for r in rows] for i, k in enumerate(("prompt", "chosen", "rejected"))}
    if kind == "reward":
        data["margin"] = [0.25 * (i % 3) for i in range(n)]
    return Dataset.from_dict(data)


def _save_preferences(where, kind):
    """The training (6 rows) and evaluation (3 rows; KTO 4) data saved in `where`: on disk, TRL's precomputed
    reference log-probabilities are cached next to them, where every rank finds them."""
    _preferences(1, 6, kind).save_to_disk(os.path.join(where, "train"))
    _preferences(2, 4 if kind == "kto" else 3, kind).save_to_disk(os.path.join(where, "eval"))
    return where


def _trainer(cls, tmp, model_dir, data, par=None, layer="LlamaDecoderLayer", **overrides):
    """cls (ndp's DPOTrainer / KTOTrainer / RewardTrainer under Accelerate's ParallelismConfig(**par), or TRL's on
    one process) on the model in model_dir and the data saved in `data`, fp32, the data in order: 3 SGD steps
    (unclipped: a gradient of the wrong scale shows) of one DPO pair or two KTO rows (KTO's KL pairs each completion
    with another prompt of its batch) per data-parallel rank, then an evaluation; `overrides` replace any of the
    config's arguments. A reward model is loaded by TRL from model_dir (its score head seeded by TRL's set_seed)."""
    import trl
    kto = issubclass(cls, trl.KTOTrainer)
    reward = issubclass(cls, trl.RewardTrainer)
    peft = _seeded_peft(overrides)
    config = trl.KTOConfig if kto else trl.RewardConfig if reward else trl.DPOConfig
    args = _trainer_args(tmp, par, layer, cls=config,
                         per_device_train_batch_size=2 if kto else 1, per_device_eval_batch_size=2 if kto else 1,
                         include_num_input_tokens_seen=True,
                         **{"bf16": False, "learning_rate": 0.1, "max_grad_norm": 0.0, **overrides})
    in_order = _in_order(cls)
    model = model_dir if reward else AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation=None if par else "eager")
    return in_order(model=model, args=args, train_dataset=load_from_disk(os.path.join(data, "train")),
                    eval_dataset=load_from_disk(os.path.join(data, "eval")),
                    processing_class=AutoTokenizer.from_pretrained(model_dir), **peft)


def _save_family(model_dir, family):
    """A zoo family's tiny model and the word tokenizer in model_dir; its decoder layer class (what FSDP2 wraps)."""
    _save_tiny_family(model_dir, family)
    return sorted(AutoModelForCausalLM.from_pretrained(model_dir)._no_split_modules)[0]


def _log(trainer, eval_loss):
    logs = [h for h in trainer.state.log_history if "loss" in h or "eval_loss" in h]
    return {"losses": [h["loss"] for h in logs if "loss" in h], "eval": eval_loss,
            "seen": trainer.state.num_input_tokens_seen,
            "metrics": [{k: v for k, v in h.items() if k.removeprefix("eval_") in METRICS} for h in logs]}


def _rank(rank, world, tmp, model_dir, kind, par, layer, overrides, env):
    _rank_env(rank, world, **env)
    trainer = _trainer(getattr(ndp.trainer, TRAINERS[kind]), tmp, model_dir, os.path.join(tmp, "data"), par, layer,
                       **overrides)
    trainer.train()
    ev = trainer.evaluate()["eval_loss"]
    log = _log(trainer, ev)
    ref = getattr(trainer, "ref_model", None)  # TRL's reference model, where it keeps one
    log["split"] = [_tp_split(m) for m in (trainer.model, ref) if m is not None]
    if rank == 0:
        torch.save(log, os.path.join(tmp, "log.pt"))


def _against(tmp_path, family, kind, par, env=None, **overrides):
    """ndp's trainer of `kind` under Accelerate's ParallelismConfig(**par) (`env`: ndp's variables, e.g.
    NDP_CP_MIXERS), and what it must equal: the same without CP and TP, ndp's at the data-parallel degrees left, else
    TRL's trainer on one process."""
    env = env or {}
    import trl
    model_dir = str(tmp_path / "model")
    layer = _save_tiny(model_dir, family) if family in DECODER_LAYERS else _save_family(model_dir, family)
    _save_preferences(str(tmp_path / "data"), kind)
    spawn(_rank, math.prod(par.values()), tmp_path, str(tmp_path), model_dir, kind, par, layer, overrides, env,
          timeout_s=300)
    got = torch.load(tmp_path / "log.pt")
    dp = {k: v for k, v in par.items() if k not in ("cp_size", "tp_size")}
    if dp:
        (tmp_path / "dp").mkdir()  # a rendezvous of its own, its own data (and reference log-probabilities)
        _save_preferences(str(tmp_path / "dp" / "data"), kind)
        spawn(_rank, math.prod(dp.values()), tmp_path / "dp", str(tmp_path / "dp"), model_dir, kind, dp, layer,
              overrides, env, timeout_s=300)
        return got, torch.load(tmp_path / "dp" / "log.pt")
    ref = _trainer(getattr(trl, TRAINERS[kind]), str(tmp_path / "ref"), model_dir,
                   _save_preferences(str(tmp_path / "ref"), kind), **overrides)
    ref.train()
    want = _log(ref, ref.evaluate()["eval_loss"])
    AcceleratorState._reset_state(True)
    return got, want


def _decided(run, want):
    """`run`'s logged metrics, less each reward accuracy whose chosen and rejected rewards `want` logged tied
    (|margin| < 1e-6: the first step, the policy still the reference): at a tie the float rounding of the two
    log-probability sums decides it."""
    def tie(m, k):
        return k.endswith("rewards/accuracies") and abs(m.get(k.replace("accuracies", "margins"), 1.0)) < 1e-6

    return [{k: v for k, v in m.items() if not tie(w, k)} for m, w in zip(run["metrics"], want["metrics"])]


def _approx_metrics(want):
    """`want`'s decided metrics (:func:`_decided`) as approx values: 1e-5. KTO's KL estimate, a difference of float32
    log-probability sums (~150 in size) whose rounding differs by CPU, to 1e-4 (an AMD EPYC host without AVX-512:
    0.804239 against 0.804215 at dp_shard 2 x cp 2)."""
    return [{k: pytest.approx(v, rel=1e-5, abs=1e-4 if k.endswith("kl") else 1e-5) for k, v in m.items()}
            for m in _decided(want, want)]


CP2 = {"cp_size": 2}


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family, kind, par, overrides", [
    ("llama", "dpo", CP2, {}),
    ("llama", "dpo", {"dp_shard_size": 2, "cp_size": 2}, {"gradient_accumulation_steps": 2}),
    ("llama", "dpo", {"cp_size": 2, "tp_size": 2}, {}),
    ("llama", "dpo", {"dp_shard_size": 2, "tp_size": 2}, {}),
    # IPO's loss is ~20 here: smaller steps, else float noise grows past the tolerance by the evaluation
    ("llama", "dpo", CP2, {"loss_type": ["ipo", "sft"], "loss_weights": [1.0, 0.5], "ld_alpha": 0.5,
                           "use_weighting": True, "learning_rate": 0.01}),
    # precomputed over 2 data-parallel ranks: the evaluation's 3 pairs pad the last step, cut once per DP rank
    ("llama", "dpo", {"dp_shard_size": 2, "cp_size": 2}, {"precompute_ref_log_probs": True}),
    ("olmoe", "dpo", CP2, {}),
    # sliding windows and softcapping, an MoE, sinks, MLA, an LM head Accelerate shards alone
    ("gemma2", "dpo", CP2, {}),
    ("qwen3_moe", "dpo", CP2, {}),
    ("gpt_oss", "dpo", CP2, {}),
    ("deepseek_v3", "dpo", CP2, {}),
    ("opt", "dpo", CP2, {}),
    ("llama", "kto", CP2, {}),
    ("llama", "kto", {"dp_shard_size": 2, "cp_size": 2}, {}),
    ("llama", "kto", CP2, {"precompute_ref_log_probs": True}),
    # a reward model: each row's score pooled at its last real token, read from the gathered scores (margins
    # in the data: TRL hands them to the model too, which ndp's attention refused as an unknown argument)
    ("llama", "reward", CP2, {}),
    ("llama", "reward", {"dp_shard_size": 2, "cp_size": 2}, {"center_rewards_coefficient": 0.01}),
    ("llama", "reward", {"cp_size": 2, "tp_size": 2}, {}),
    ("gemma2", "reward", CP2, {}),
])
def test_preference_trainers_under_cp_train_and_evaluate_as_without(tmp_path, family, kind, par, overrides):
    """Each rank summed its shard's log-probabilities (refused before): the chosen / rejected sums, the losses
    built on them (sigmoid; IPO's per-token means, LD-DPO's shared-length split, WPO's weights), the reference
    model's (TRL shards it with FSDP2 itself, without CP; precomputed in the constructor, gathered once per
    data-parallel batch), an MoE's load-balancing loss (its metric and the evaluation loss each CP rank's share x
    cp_size without the sum), every metric TRL logs (KTO's KL estimate too), with gradient accumulation. Under TP
    (no CP) TRL divided its token count by tp_size after ndp's gather had left the TP copies out: num_tokens half
    the count. A reward model's pooled score (refused under CP before: each rank would pool its shard's last token)
    and the reward metrics (min / mean / max, accuracy, margin), the rewards' centring term."""
    pytest.importorskip("trl")
    got, want = _against(tmp_path, family, kind, par, **overrides)
    assert len(got["losses"]) == 3 and got["losses"] == pytest.approx(want["losses"], rel=1e-5)
    assert got["eval"] == pytest.approx(want["eval"], rel=1e-5, abs=1e-5)
    assert _decided(got, want) == _approx_metrics(want)
    assert got["seen"] == want["seen"] > 0  # the Trainer's num_input_tokens_seen: each batch once
    # under TP the policy and TRL's reference model (DPO's) split alike: the 7 projections of each of the 2 layers
    split = 14 if par.get("tp_size", 1) > 1 else 0
    assert set(got["split"]) == {split} and (not split or len(got["split"]) == (1 if kind == "reward" else 2))


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["dpo", "kto", "reward"])
def test_preference_trainers_in_bf16_under_cp_stay_near_one_process(tmp_path, kind):
    """bf16=True: FSDP2's bf16 mixed precision under CP (the gathered per-token outputs and their summed gradients in
    bf16) against TRL's one process under bf16 autocast. The two round differently (measured: at most 1.7e-3
    relative over the losses); a gradient of the wrong scale moved DPO's second loss 1.4e-2 in fp32."""
    pytest.importorskip("trl")
    got, want = _against(tmp_path, "llama", kind, CP2, bf16=True)
    assert len(got["losses"]) == 3 and got["losses"] == pytest.approx(want["losses"], rel=5e-3)
    assert got["eval"] == pytest.approx(want["eval"], rel=5e-3)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_dpo_on_a_hybrid_under_cp_with_its_mixers_split_by_heads(tmp_path):
    """Qwen3-Next's gated DeltaNets split by heads over the CP group (cp_mixers="heads") inside the policy's and the
    reference model's calls: DPO's losses and metrics are TRL's on one process."""
    pytest.importorskip("trl")
    got, want = _against(tmp_path, "qwen3_next", "dpo", CP2, env={"NDP_CP_MIXERS": "heads"})
    assert len(got["losses"]) == 3 and got["losses"] == pytest.approx(want["losses"], rel=1e-5)
    assert got["eval"] == pytest.approx(want["eval"], rel=1e-5, abs=1e-5)
    assert _decided(got, want) == _approx_metrics(want)


def _gather_grad_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    axis = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    full = torch.randn(2, 6, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    # uneven shards, as a packed batch's: rank 1's has a pad column (origin -1)
    cols = [[0, 1, 5], [2, 3, 4, -1]][rank]
    origin = torch.arange(12).reshape(2, 6)[:, cols]
    origin[:, torch.tensor(cols) < 0] = -1
    shard = full[:, cols].clone()
    shard[:, torch.tensor(cols) < 0] = 0
    shard.requires_grad_(True)
    gathered = ndp.hf.batch.gather_tokens(shard, origin, (2, 6), axis)
    assert torch.equal(gathered, full)
    weights = [torch.randn(2, 6, 3, generator=torch.Generator().manual_seed(1 + r), dtype=torch.float64)
               for r in range(world)]
    (gathered * weights[rank]).sum().backward()  # each rank its own use of the whole batch
    want = sum(weights)[:, cols]
    want[:, torch.tensor(cols) < 0] = 0
    assert torch.equal(shard.grad, want), (shard.grad, want)
    # without gradient: the values alone, no autograd node
    assert not ndp.hf.batch.gather_tokens(shard.detach(), origin, (2, 6), axis).requires_grad


@pytest.mark.distributed
def test_gather_tokens_gradient_is_every_ranks_gradient_of_its_tokens(tmp_path):
    """What DPO's gradient rests on: every CP rank uses the whole batch's log-probabilities, so each shard's gradient
    is the sum of every rank's gradient of its tokens (a pad ndp added gets none)."""
    spawn(_gather_grad_rank, 2, tmp_path)


def _unfused_rank(rank, world, tmp, model_dir):
    _rank_env(rank, world)
    trainer = _trainer(ndp.trainer.DPOTrainer, tmp, model_dir, os.path.join(tmp, "data"), CP2)
    trainer.compute_metrics = lambda p: {"n": float(len(p.predictions))}
    with pytest.raises(ValueError, match=r"ndp.trainer: under context parallelism \(cp_size=2\) .* the logits asked "
                                         r"for \(prediction_loss_only=False\).* Evaluate without compute_metrics, "
                                         r"or with cp_size=1"):
        trainer.evaluate()
    model = trainer.accelerator.prepare(trainer.model)
    hooks = (len(model._forward_hooks), len(model._forward_pre_hooks))
    with trainer._calls_on_shards(model), pytest.raises(ValueError, match="no fused LM head"):
        model(input_ids=torch.ones(2, 8, dtype=torch.long))
    assert (len(model._forward_hooks), len(model._forward_pre_hooks)) == hooks  # the call's hooks gone


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_dpo_logits_under_cp_are_refused_by_name_on_every_rank(tmp_path):
    """TRL recomputes the logits without its fused LM head for compute_metrics and predict: ndp gathers the fused
    log-probabilities only, and refuses the rest before any forward, on every rank."""
    pytest.importorskip("trl")
    model_dir = str(tmp_path / "model")
    _save_tiny(model_dir, "llama")
    _save_preferences(str(tmp_path / "data"), "dpo")
    spawn(_unfused_rank, 2, tmp_path, str(tmp_path), model_dir, timeout_s=120)


def _nested_rank(rank, world, tmp, model_dir, layer):
    _rank_env(rank, world)
    trainer = _trainer(ndp.trainer.DPOTrainer, tmp, model_dir, os.path.join(tmp, "data"), CP2, layer)
    with pytest.raises(ValueError, match=r"FSDPLlama4ForCausalLM was called again inside its own forward: TRL's "
                                         r"fused LM head runs the model's base_model"):
        trainer.train()


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_model_that_is_its_own_base_model_is_refused_by_name_on_every_rank(tmp_path):
    """TRL's fused LM head runs ``model.base_model`` as the backbone; Llama4ForCausalLM's is the model itself, so
    the fused forward calls the model again (TRL fails on it without CP: no last_hidden_state). Under CP that
    nested call would be sharded a second time: refused by name instead."""
    pytest.importorskip("trl")
    model_dir = str(tmp_path / "model")
    _save_tiny_family(model_dir, "llama4_text")
    _save_preferences(str(tmp_path / "data"), "dpo")
    spawn(_nested_rank, 2, tmp_path, str(tmp_path), model_dir, "Llama4TextDecoderLayer", timeout_s=120)


def _other_pooling_rank(rank, world, tmp, model_dir):
    _rank_env(rank, world)
    with pytest.raises(ValueError, match=r"InOrder\w* under context parallelism \(cp_size=2\) pools each row's "
                                         r"score .* OPTForSequenceClassification's head is not one\. Train it with "
                                         r"cp_size=1"):
        _trainer(ndp.trainer.RewardTrainer, tmp, model_dir, os.path.join(tmp, "data"), CP2, "OPTDecoderLayer")


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_reward_model_pooled_otherwise_is_refused_by_name_on_every_rank(tmp_path):
    """OPT's sequence classification pools in its own forward (not transformers' GenericForSequenceClassification,
    whose pooling ndp reproduces on the gathered scores): refused when the trainer is built, on every rank."""
    pytest.importorskip("trl")
    model_dir = str(tmp_path / "model")
    _save_tiny(model_dir, "opt")
    _save_preferences(str(tmp_path / "data"), "reward")
    spawn(_other_pooling_rank, 2, tmp_path, str(tmp_path), model_dir, timeout_s=120)
