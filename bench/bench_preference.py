"""DPO or reward modelling under context parallelism: a training step's time and rank 0's peak memory, TRL alone vs
ndp's DPOTrainer / RewardTrainer.

    python bench/bench_preference.py                         # pairs of 2048 and 4096 tokens, cp 2, CPU, fp32
    python bench/bench_preference.py --trainer reward        # a reward model (sequence classification) instead
    python bench/bench_preference.py --seqlens 8192 --cp 4 --hidden 512 --out bench/results/

A Llama of --hidden (4 layers, heads of 64, vocabulary of the word tokenizer's 256) built from a config, one
preference pair per step whose chosen and rejected rows are --seqlens tokens each (a quarter prompt), TRL's
reference model loaded beside it (DPO; a reward model has none: the same Llama with a score head, TRL's seeded
init), fp32, SGD. Modes, each in fresh processes (peak RSS is per process): ``one``, TRL's trainer on one process;
``cp``, ndp's on --cp gloo ranks (FSDP2 over them, each rank's shard of the rows: policy and reference forwards,
the policy's backward). Reported: the median step time after the first, rank 0's peak-RSS growth over the process
just before training (activations, gradients, optimizer), and the logged losses (the same in both modes: ndp's
DPO and reward modelling are exact; DPO's first is log 2 in both, the policy starting as the reference). On a GPU
this bench is not run: it needs one GPU per CP rank.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

# _common first: importing it puts the repository on sys.path (some names unused here: F401)
from _common import ROOT, markdown_table, peak_bytes, rank_job, spawn_json, write_results  # noqa: F401
import ndp.trainer
import trl
from accelerate.parallelism_config import ParallelismConfig
from datasets import Dataset, load_from_disk
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast,
                          TrainerCallback)


def _save_inputs(where, seq, hidden):
    """The model, its word tokenizer (t0 pads) and one pair per step of `seq` tokens per row, in `where`."""
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                                 num_hidden_layers=4, num_attention_heads=hidden // 64, num_key_value_heads=2,
                                 max_position_embeddings=2 * seq)).save_pretrained(os.path.join(where, "model"))
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1").save_pretrained(
        os.path.join(where, "model"))
    g = torch.Generator().manual_seed(1)
    # words that are one token each: the special tokens t0 / t1 are matched inside a word (t17 -> t1, 7)
    one_token = torch.tensor([i for i in range(2, 256) if not str(i).startswith(("0", "1"))])

    def text(n):
        return " ".join(f"t{i}" for i in one_token[torch.randint(len(one_token), (n,), generator=g)].tolist())

    prompt = seq // 4  # TRL appends the end token: each row is exactly seq tokens
    rows = [(text(prompt), " " + text(seq - prompt - 1), " " + text(seq - prompt - 1)) for _ in range(8)]
    Dataset.from_dict({k: [r[i] for r in rows] for i, k in enumerate(("prompt", "chosen", "rejected"))}
                      ).save_to_disk(os.path.join(where, "data"))


class _StepTimes(TrainerCallback):
    def __init__(self):
        self.times, self.start = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.start)


# --trainer: (TRL's config, TRL's trainer, ndp's trainer)
TRAINERS = {"dpo": (trl.DPOConfig, trl.DPOTrainer, ndp.trainer.DPOTrainer),
            "reward": (trl.RewardConfig, trl.RewardTrainer, ndp.trainer.RewardTrainer)}


def run_mode(where, mode, world, steps, kind="dpo") -> dict:
    """This rank's median step seconds, peak-RSS growth over training and first loss for one mode."""
    par = {}
    if mode == "cp":
        os.environ.update(LOCAL_RANK=str(torch.distributed.get_rank()), RANK=str(torch.distributed.get_rank()),
                          WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
        par = dict(parallelism_config=ParallelismConfig(cp_size=world), fsdp="full_shard",
                   fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    config, theirs, ours = TRAINERS[kind]
    args = config(output_dir=os.path.join(where, f"out-{mode}"), per_device_train_batch_size=1, max_steps=steps,
                  learning_rate=1e-3, optim="sgd", logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                  bf16=False, max_length=None, dataloader_num_workers=0, **par)
    model_dir = os.path.join(where, "model")
    timer = _StepTimes()
    model = model_dir if kind == "reward" else AutoModelForCausalLM.from_pretrained(model_dir)  # TRL loads a scorer
    trainer = (ours if mode == "cp" else theirs)(model=model, args=args, callbacks=[timer],
                  train_dataset=load_from_disk(os.path.join(where, "data")),
                  processing_class=PreTrainedTokenizerFast.from_pretrained(model_dir))
    base = peak_bytes(torch.device("cpu"))
    trainer.train()
    growth = peak_bytes(torch.device("cpu")) - base
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return dict(trainer=kind, mode=mode, cp=world, step_s=statistics.median(timer.times[1:] or timer.times),
                peak_growth_bytes=growth, losses=losses)


def _rank(rank, tmp, out_file, where, mode, world, steps, kind):
    rank_job(rank, world, tmp, out_file, lambda: run_mode(where, mode, world, steps, kind), timeout_s=900)


def measure(seq, hidden, cp, steps, kind="dpo") -> list[dict]:
    """Both modes at one length, each in fresh processes."""
    with tempfile.TemporaryDirectory() as where:
        _save_inputs(where, seq, hidden)
        return [dict(spawn_json(_rank, world, where, mode, world, steps, kind), seq=seq, hidden=hidden)
                for mode, world in (("one", 1), ("cp", cp))]


def table(rows) -> str:
    return markdown_table(("trainer", "tokens per row", "mode", "cp", "step s", "rank 0 peak growth MiB", "last loss"),
                          [(r["trainer"], str(r["seq"]), r["mode"], str(r["cp"]), f"{r['step_s']:.2f}",
                            f"{r['peak_growth_bytes'] / 2**20:.0f}", f"{r['losses'][-1]:.6f}") for r in rows])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", default="2048,4096")
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--trainer", choices=sorted(TRAINERS), default="dpo")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    a = ap.parse_args(argv)
    rows = [r for seq in map(int, a.seqlens.split(",")) for r in measure(seq, a.hidden, a.cp, a.steps, a.trainer)]
    print(table(rows))
    write_results(a.out, "bench_preference", {"rows": rows})


if __name__ == "__main__":
    main()
