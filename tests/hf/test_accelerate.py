"""ndp on Accelerate's inputs: its ParallelismConfig and the DeviceMesh it builds (axes of size 1 left out,
flattened axes of its own) go straight into ndp.parallelize; loss and every gradient match one process."""
import contextlib
import math
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.multiprocessing as mp
import torch.distributed as dist
import torch.nn.functional as F
from accelerate.parallelism_config import ParallelismConfig as AccelerateConfig
from accelerate.state import AcceleratorState
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.tensor import DTensor
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorWithFlattening, LlamaConfig,
                          LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback, TrainingArguments)

import ndp
import ndp.accelerate
import ndp.trainer
from dist import spawn
from ndp.parallel import adopt_mesh, as_config, check_mesh, mesh_axis
from ndp.parallel.mesh import FLAT_AXES
import _zoo
import test_packed
from test_quickstart import CFG_LINE, ROOT, _free_port, _run, quickstart_code
from ndp.testing import assert_close


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("fields", ["dp_shard_size=2, cp_size=2", "cp_size=4", "tp_size=2, cp_size=2"])
def test_accelerate_config_and_mesh_into_parallelize(tmp_path, fields):
    # The README's script with its config line swapped for Accelerate's: `cfg.build_device_mesh` is then
    # Accelerate's mesh, and ndp.parallelize, shard_batch and loss take both as they are.
    code = quickstart_code()
    line = f"from accelerate.parallelism_config import ParallelismConfig\ncfg = ParallelismConfig({fields})"
    _run(tmp_path, code.replace(CFG_LINE, line))


def test_conversion_both_ways_and_what_is_refused():
    acc = AccelerateConfig(dp_shard_size=2, cp_size=4, tp_size=2)
    cfg = ndp.ParallelismConfig.from_accelerate(acc, cp_impl="usp", ulysses_size=2)
    assert (cfg.dp_replicate_size, cfg.dp_shard_size, cfg.cp_size, cfg.tp_size) == (1, 2, 4, 2)
    assert (cfg.cp_impl, cfg.ulysses_size, cfg.cp_layout) == ("usp", 2, "zigzag")
    assert as_config(acc) == ndp.ParallelismConfig(dp_shard_size=2, cp_size=4, tp_size=2) and as_config(cfg) is cfg
    with pytest.raises(ValueError, match="sp_size=2 is DeepSpeed's sequence parallelism.*cp_impl='ulysses'"):
        as_config(AccelerateConfig(sp_size=2, dp_shard_size=2))
    with pytest.raises(ValueError, match=r"only ndp's own fields.*\['cp_size'\]"):
        ndp.ParallelismConfig.from_accelerate(acc, cp_size=8)
    with pytest.raises(TypeError, match="without"):
        as_config(object())
    back = ndp.accelerate.accelerate_config(cfg)                     # and back: the degrees
    assert isinstance(back, AccelerateConfig) and ndp.ParallelismConfig.from_accelerate(
        back, cp_impl="usp", ulysses_size=2) == cfg


def _meshes(rank, world):
    # Accelerate's mesh has only the axes of degree > 1; ndp registers the flattened axes it reads (Accelerate's
    # own where it made them) and answers size 1 for the axes left out. A mesh of other degrees is refused.
    for fields, flat in [(dict(dp_shard_size=2, cp_size=2), {"dp": 2, "dp_shard_cp": 4, "dp_cp": 4}),
                         (dict(cp_size=4), {"dp_shard_cp": 4, "dp_cp": 4}),
                         (dict(tp_size=2, cp_size=2), {"dp_shard_cp": 2, "dp_cp": 2}),
                         (dict(dp_replicate_size=2, dp_shard_size=2), {"dp": 4, "dp_shard_cp": 2, "dp_cp": 4})]:
        acc = AccelerateConfig(**fields)
        mesh, cfg = acc.build_device_mesh("cpu"), as_config(acc)
        check_mesh(cfg, mesh)
        adopt_mesh(cfg, mesh)
        assert {k: mesh_axis(mesh, k).size() for k in flat} == flat
        assert all(mesh_axis(mesh, k).size() == 1 for k in FLAT_AXES if k not in flat)
        assert mesh_axis(mesh, "tp").size() == cfg.tp_size and mesh_axis(mesh, "dp_replicate").size() == \
            cfg.dp_replicate_size
    with pytest.raises(ValueError, match="dp_shard: config 2, mesh 4; cp: config 2, mesh absent"):
        check_mesh(ndp.ParallelismConfig(dp_shard_size=2, cp_size=2),
                   AccelerateConfig(dp_shard_size=4).build_device_mesh("cpu"))


@pytest.mark.distributed
def test_accelerate_meshes_are_read_as_ndp_meshes(tmp_path):
    spawn(_meshes, 4, tmp_path)


def readme_block(i: int) -> str:
    """The i-th Python block of the README's "With Accelerate, Trainer and TRL" (0: the script, 1: the Trainer,
    2: the SFTTrainer)."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text[text.index("## With Accelerate, Trainer and TRL"):]
    return re.findall(r"```python\n(.*?)```", section, re.S)[i]


def _save_tiny_llama(model_dir):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(model_dir)


def _fsdp2_plugin(layer="LlamaDecoderLayer"):
    """Accelerate's FSDP2 plugin wrapping each decoder layer of class name `layer`."""
    return FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                          transformer_cls_names_to_wrap=[layer])


def _rank_env(rank, world, **extra):
    """torchrun's variables for a rank of a tests/dist.py job (its process group exists; Accelerate reads them)."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="1", **extra)


def _blog_rank(rank, world, code, port, out, model_dir):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", MODEL=model_dir)
    torch.set_num_threads(1)
    ns = {"__name__": "__main__"}
    end = ndp.accelerate.Accelerator.end_training

    def record_then_end(self):
        full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
        weights = {n: full(p).detach().clone() for n, p in ns["model"].named_parameters()}
        if rank == 0:
            torch.save({"weights": weights, "losses": ns["losses"]}, out)
        return end(self)

    ndp.accelerate.Accelerator.end_training = record_then_end
    exec(compile(code, "README.md:accelerate", "exec"), ns)
    sys.stdout.flush()
    os._exit(0)  # past torch 2.13 gloo's teardown at interpreter exit (see tests/dist.py)


def _one_process(model_dir, tokens, steps, dp, clip=None, collate=None):
    # The same model and batches on one process: step s trains on the dp samples the dp ranks took; clip: the
    # Trainer's max_grad_norm; collate: samples -> a batch with labels and an attention_mask or packed position_ids
    # (else tokens are rows).
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    return _train_one_process(model, tokens, steps, dp, clip, collate)


def _train_one_process(model, tokens, steps, dp, clip=None, collate=None):
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses = []
    for s in range(steps):
        b = collate(tokens[dp * s:dp * (s + 1)]) if collate else {"input_ids": tokens[dp * s:dp * (s + 1)]}
        # no cache: with one, transformers does not find packed documents in the position_ids (one row attends all)
        out = model(input_ids=b["input_ids"], attention_mask=b.get("attention_mask"),
                    position_ids=b.get("position_ids"), use_cache=False)
        labels = b.get("labels", b["input_ids"])
        loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        if getattr(out, "aux_loss", None) is not None:  # an MoE's load-balancing loss, as its forward adds it
            loss = loss + model.router_aux_loss_coef * out.aux_loss
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_readme_accelerate_script_verbatim(tmp_path):
    code = readme_block(0)
    assert "\nfrom ndp.accelerate import Accelerator" in code and "\nfrom accelerate import Accelerator" not in code
    model_dir = str(tmp_path / "model")
    _save_tiny_llama(model_dir)
    out = str(tmp_path / "run.pt")
    mp.spawn(_blog_rank, args=(4, code, _free_port(), out, model_dir), nprocs=4, join=True)
    got = torch.load(out)
    tokens = torch.randint(0, 256, (10, 64), generator=torch.Generator().manual_seed(1))  # the script's data
    losses, model = _one_process(model_dir, tokens, steps=5, dp=2)
    assert got["losses"] == pytest.approx(losses, rel=1e-5)
    for n, w in model.named_parameters():
        assert_close(got["weights"][n], w.detach(), torch.float32, "grad", msg=n)


def _packed_through_accelerator(rank, world, cases):
    # A DataCollatorWithFlattening batch (position_ids restarting per document) through the Accelerator's
    # maybe_context_parallel: loss and every gradient equal each document run alone (float64).
    _rank_env(rank, world)
    for model_type, impl in cases:
        os.environ.pop("NDP_CP_IMPL", None)
        if impl == "ulysses":
            os.environ["NDP_CP_IMPL"] = "ulysses"   # as `accelerate launch` would pass ndp's field
        model = _zoo.tiny_model(model_type).train()
        layer = type(model.model.layers[0]).__name__
        plugin = _fsdp2_plugin(layer)
        acc = ndp.accelerate.Accelerator(parallelism_config=AccelerateConfig(cp_size=world), fsdp_plugin=plugin)
        assert acc.ndp_config.cp_impl == impl
        model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
        b = test_packed.collated("position_ids")
        batch = {"input_ids": b["input_ids"], "labels": b["labels"].clone(), "shift_labels": b["labels"],
                 "position_ids": b["position_ids"]}
        buffers = list(batch.values())
        with acc.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * 4, no_restore_buffers=set(buffers)):
            assert buffers[0].shape[1] < sum(test_packed.DOCS)                 # sharded in place, per document
            loss = model(**batch).loss
            acc.backward(loss)
        ref_loss, ref_grads = test_packed.reference(model_type)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        assert test_packed._rel(mean / world, ref_loss) < test_packed.TOL, (model_type, impl)
        for n, p in model.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            assert test_packed._rel(g, ref_grads[n]) < test_packed.TOL, (model_type, impl, n)
        with pytest.raises(ValueError, match="Shift them before sharding"):
            ids = torch.randint(3, 50, (1, 32))
            with acc.maybe_context_parallel(buffers=[ids]):
                model(input_ids=ids, labels=ids)
        AcceleratorState._reset_state(True)                                   # a new Accelerator next case


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_accelerator_packed_documents_sliding_window_and_sinks_exact(tmp_path):
    spawn(_packed_through_accelerator, 2, tmp_path, [("mistral", "ring"), ("llama", "ulysses"), ("gpt_oss", "ring"),
                                                    ("qwen2", "ring")],
          timeout_s=300)


def _autocast_grads(model, acc=None):
    """{name: gradient} of one bf16-autocast training step of `model` on the zoo's batch (`acc`: through its
    Accelerator's CP context, ndp.hf.loss on this rank's shard)."""
    ids, labels, pos = _zoo.batch()  # labels shifted already
    buffers = [ids, labels, pos]
    cp = acc.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * 3, no_restore_buffers=set(buffers)) \
        if acc else contextlib.nullcontext()
    with cp, torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids, position_ids=pos).logits.float()
    if acc:
        acc.backward(ndp.hf.loss(logits, labels, model))
    else:
        F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    full = lambda g: g.full_tensor() if isinstance(g, DTensor) else g  # noqa: E731
    return {n: full(p.grad) for n, p in model.named_parameters()}


def _autocast_through_accelerator(rank, world):
    _rank_env(rank, world)
    want = _autocast_grads(_zoo.tiny_model("hrm_text").train().float())
    acc = ndp.accelerate.Accelerator(parallelism_config=AccelerateConfig(cp_size=world),
                                     fsdp_plugin=_fsdp2_plugin("HrmTextDecoderLayer"))
    model = _zoo.tiny_model("hrm_text").train().float()
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
    got = _autocast_grads(model, acc)
    for n, g in want.items():
        if g is not None:  # bf16 rounding apart (the ranks' attention sums in another order): 8.9e-3 measured
            assert got[n] is not None and _zoo._rel(got[n], g) < 0.1, (n, got[n] is not None and _zoo._rel(got[n], g))


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_accelerators_fsdp2_under_autocast_gives_a_stack_run_first_without_gradients_its_gradients(tmp_path):
    """HRM runs its low-level stack under no_grad, then with gradients, in one forward: under bf16 autocast the casts
    cached in the first pass reached Accelerate's FSDP2 units after their gradient reduction (none: the stack never
    trained); ndp's Accelerator drops them as each unit starts (``ndp.parallel.parallelize.fresh_autocast_casts``)."""
    spawn(_autocast_through_accelerator, 2, tmp_path, timeout_s=300)


def _in_order(cls):
    """`cls` (a Trainer class) reading its training data in order: the 1-process reference takes the same batches."""
    return type(f"InOrder{cls.__name__}", (cls,), {"_get_train_sampler": lambda self, *args, **kwargs:
                                                   torch.utils.data.SequentialSampler(self.train_dataset)})


_InOrder = _in_order(ndp.trainer.Trainer)


def _trainer_args(tmp, par, layer="LlamaDecoderLayer", state_dict_type=None, cls=TrainingArguments, **overrides):
    """The tests' Trainer arguments (`cls`: TrainingArguments or TRL's SFTConfig): FSDP2 per decoder layer under
    Accelerate's ParallelismConfig(**par) (par None: one process, neither), 3 SGD steps at a constant 1e-2, every
    loss logged, nothing saved; `overrides` replace any of them."""
    kw = dict(output_dir=os.path.join(tmp, "out"), per_device_train_batch_size=1, max_steps=3, learning_rate=1e-2,
              lr_scheduler_type="constant", optim="sgd", logging_steps=1, report_to=[], save_strategy="no",
              use_cpu=True, dataloader_num_workers=0)
    if par:
        fsdp_config = {"fsdp_version": 2, "transformer_layer_cls_to_wrap": [layer]}
        if state_dict_type:
            fsdp_config["state_dict_type"] = state_dict_type
        kw.update(parallelism_config=AccelerateConfig(**par), fsdp="full_shard", fsdp_config=fsdp_config)
    return cls(**{**kw, **overrides})


def _trainer_rank(rank, world, tmp, model_dir, ga, steps, compile=False, par=None):
    _rank_env(rank, world)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    args = _trainer_args(tmp, par or {"dp_shard_size": 2, "cp_size": 2}, max_steps=steps,
                         gradient_accumulation_steps=ga, per_device_eval_batch_size=1, torch_compile=compile,
                         torch_compile_backend="aot_eager" if compile else None, include_num_input_tokens_seen=True)
    trainer = _InOrder(model=model, args=args, train_dataset=_samples(), eval_dataset=_samples()[:5])
    assert isinstance(trainer.accelerator, ndp.accelerate.Accelerator)
    trainer.train()
    # under tp 2 the 7 projections of each of the 2 layers split over the TP ranks (Accelerate skipped the model)
    assert _tp_split(trainer.model) == (14 if par and par.get("tp_size", 1) > 1 else 0)
    assert not compile or torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the model ran compiled
    ev = trainer.evaluate()   # 5 rows over 2 data-parallel ranks: the last step pads one rank, cut off again
    if rank == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        torch.save({"losses": losses, "eval": ev["eval_loss"], "seen": trainer.state.num_input_tokens_seen},
                   os.path.join(tmp, "trainer.pt"))


def _tp_split(model) -> int:
    """How many of the model's parameters are sharded over the mesh's "tp" axis."""
    def on_tp(p):
        names = p.device_mesh.mesh_dim_names or ()
        return "tp" in names and p.placements[names.index("tp")].is_shard()

    return sum(isinstance(p, DTensor) and on_tp(p) for p in model.parameters())


def _samples():
    tokens = torch.randint(0, 256, (10, 64), generator=torch.Generator().manual_seed(2))
    return [{"input_ids": t, "labels": t.clone()} for t in tokens]


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("ga, steps, compile, par", [
    (1, 5, False, None), (2, 2, False, None), (1, 3, True, None),
    pytest.param(1, 3, False, {"dp_shard_size": 2, "tp_size": 2}, id="tp2")])
def test_trainer_on_dp_shard_2_with_cp_2_or_tp_2_matches_one_process(tmp_path, ga, steps, compile, par):
    # dp_shard 2 x cp 2 (par None); with gradient accumulation the Trainer's num_items_in_batch spans the
    # micro-batches; torch_compile: the Trainer compiles the model (ndp's attention and CP ops inside the graphs).
    # dp_shard 2 x tp 2: the evaluation gathered each batch's loss once per TP rank and cut the last, partial step
    # to its first entries (5 rows: 5.549458 against 5.548819), and the token count is each batch's once.
    model_dir = str(tmp_path / "model")
    _save_tiny_llama(model_dir)
    spawn(_trainer_rank, 4, tmp_path, str(tmp_path), model_dir, ga, steps, compile, par, timeout_s=300)
    got = torch.load(tmp_path / "trainer.pt")
    data = torch.stack([s["input_ids"] for s in _samples()])
    losses, model = _one_process(model_dir, data, steps=steps, dp=2 * ga, clip=1.0)
    assert len(got["losses"]) == steps and got["losses"] == pytest.approx(losses, abs=1e-4)  # logged to 4 digits
    with torch.no_grad():   # the eval loss after training: the mean of the 5 eval rows (not x cp_size, not a shard's)
        logits = model(input_ids=data[:5]).logits
        want = F.cross_entropy(logits[:, :-1].flatten(0, 1), data[:5, 1:].flatten()).item()
    assert got["eval"] == pytest.approx(want, rel=1e-5)
    # each data-parallel batch once (the Trainer gathers every rank's count, and both CP ranks of a batch hold it)
    assert got["seen"] == steps * ga * 2 * data.shape[1]


def _evaluate_first_rank(rank, world, tmp, model_dir, par, compile):
    _rank_env(rank, world)
    args = _trainer_args(tmp, par, per_device_eval_batch_size=1, torch_compile=compile,
                         torch_compile_backend="aot_eager" if compile else None)
    trainer = _InOrder(model=AutoModelForCausalLM.from_pretrained(model_dir), args=args, train_dataset=_samples(),
                       eval_dataset=_samples()[:5])
    before = trainer.evaluate()["eval_loss"]  # no optimizer yet: Accelerate refused the model alone under FSDP2
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    if rank == 0:
        torch.save({"before": before, "after": after,
                    "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]},
                   os.path.join(tmp, "first.pt"))


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("par, compile", [({"dp_shard_size": 2, "cp_size": 2}, False),
                                          ({"dp_shard_size": 2, "cp_size": 2}, True),
                                          ({"dp_shard_size": 2, "tp_size": 2}, False)])
def test_trainer_evaluates_before_training_then_trains_as_one_process(tmp_path, par, compile):
    """An evaluation before any training (a baseline; predict on a trained checkpoint) under FSDP2: Accelerate's
    prepare refused the model without its optimizer ("a model and optimizer must be passed together"); ndp's
    Accelerator prepares it alone (CP, TP, FSDP2; compiled under torch_compile, where the Trainer prepares the
    optimizer alone later). The evaluation is one process's on the untrained model, and the training after it and
    its evaluation are one process's."""
    model_dir = str(tmp_path / "model")
    _save_tiny_llama(model_dir)
    spawn(_evaluate_first_rank, 4, tmp_path, str(tmp_path), model_dir, par, compile, timeout_s=300)
    got = torch.load(tmp_path / "first.pt")
    data = torch.stack([s["input_ids"] for s in _samples()])

    def eval_loss(model):
        with torch.no_grad():
            logits = model(input_ids=data[:5]).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), data[:5, 1:].flatten()).item()

    before = eval_loss(AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager"))
    losses, model = _one_process(model_dir, data, steps=3, dp=2, clip=1.0)
    assert got["before"] == pytest.approx(before, rel=1e-5) and got["after"] == pytest.approx(eval_loss(model), rel=1e-5)
    assert got["losses"] == pytest.approx(losses, abs=1e-4)  # logged to 4 digits


def _smoothing_run(tmp, model_dir, par, batch=1, **overrides):
    """The Trainer with label smoothing 0.1 on the tiny Llama: 3 SGD steps, then an evaluation on 3 rows; the trainer,
    the evaluation loss and the weights after training."""
    args = _trainer_args(tmp, par, label_smoothing_factor=0.1, per_device_eval_batch_size=1,
                         per_device_train_batch_size=batch, **overrides)
    trainer = _InOrder(model=AutoModelForCausalLM.from_pretrained(model_dir), args=args, train_dataset=_samples(),
                       eval_dataset=_samples()[:3])
    trainer.train()
    got = {"eval": trainer.evaluate()["eval_loss"]}
    got["weights"] = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                      for n, p in trainer.model.named_parameters()}
    return trainer, got


def _smoothing_rank(rank, world, tmp, model_dir, par):
    _rank_env(rank, world)
    trainer, got = _smoothing_run(tmp, model_dir, par)
    if par.get("cp_size", 1) > 1:
        # a loss of its own would get each rank's shard of the logits and labels: refused by name
        trainer.compute_loss_func = lambda outputs, labels, num_items_in_batch=None: outputs.logits.sum()
        with pytest.raises(ValueError, match=r"compute_loss_func under context parallelism \(cp_size=2\) would "
                                             r"get each rank's shard"):
            trainer.evaluate()
    if rank == 0:
        torch.save(got, os.path.join(tmp, "smoothing.pt"))


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("par", [{"cp_size": 2}, {"dp_shard_size": 2}])
def test_trainer_label_smoothing_under_fsdp2_and_cp_matches_one_process(tmp_path, par):
    """The Trainer's label smoother shifts a causal LM's labels when it finds the class name in transformers'
    causal-LM mapping; FSDP2 renames the class (FSDPLlamaForCausalLM), so under ndp's Accelerator it did not shift
    (every token trained to predict itself: the losses 5.655 / 5.682 / 5.637 under cp 2 against one process's 5.57 /
    5.577 / 5.53), and a shift under CP would have been each shard's. It now shifts as meant, under CP the labels
    shifted before sharding: the weights after 3 SGD steps and the evaluation loss equal one process's (on the
    same rows per step); under CP a compute_loss_func is refused by name."""
    model_dir = str(tmp_path / "model")
    _save_tiny_llama(model_dir)
    spawn(_smoothing_rank, 2, tmp_path, str(tmp_path), model_dir, par, timeout_s=300)
    got = torch.load(tmp_path / "smoothing.pt")
    _, want = _smoothing_run(str(tmp_path / "ref"), model_dir, None, batch=par.get("dp_shard_size", 1))
    AcceleratorState._reset_state(True)
    assert got["eval"] == pytest.approx(want["eval"], rel=1e-5)
    for n, w in want["weights"].items():
        assert_close(got["weights"][n], w, torch.float32, msg=n)


def test_trainer_label_smoothing_under_torch_compile_shifts_a_causal_lms_labels(tmp_path):
    """Under torch_compile=True the Trainer's model is torch.compile's OptimizedModule, whose class name the label
    smoother's causal-LM test (transformers' and ndp's, unwrapping with Accelerate's default keep_torch_compile=True)
    did not find: one process trained every token to predict itself (losses 5.655 / 5.682 against 5.570 / 5.577).
    Compiled, the weights after 3 SGD steps and the evaluation loss equal the eager run's."""
    model_dir = str(tmp_path / "model")
    _save_tiny_llama(model_dir)
    trainer, got = _smoothing_run(str(tmp_path / "compiled"), model_dir, None, torch_compile=True,
                                  torch_compile_backend="aot_eager")
    assert type(trainer.model_wrapped).__name__ == "OptimizedModule"  # the Trainer ran it compiled
    _, want = _smoothing_run(str(tmp_path / "eager"), model_dir, None)
    assert got["eval"] == pytest.approx(want["eval"], rel=1e-5)
    for n, w in want["weights"].items():
        assert_close(got["weights"][n], w, torch.float32, msg=n)


class _EmbeddingsMax(TrainerCallback):
    """Records, per training forward, the input embeddings' largest |output| after NEFTune's noise (its hook is
    registered when training starts, before this one)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.seen = []
        model.get_input_embeddings().register_forward_hook(
            lambda m, i, out: self.seen.append(out.detach().abs().max().item()) if m.training else None)


def _neftune_rank(rank, world, tmp, model_dir):
    _rank_env(rank, world)
    probe = _EmbeddingsMax()
    args = _trainer_args(tmp, {"cp_size": 2}, neftune_noise_alpha=1e4, max_steps=2)
    trainer = _InOrder(model=AutoModelForCausalLM.from_pretrained(model_dir), args=args, train_dataset=_samples(),
                       callbacks=[probe])
    trainer.train()
    torch.save(probe.seen, os.path.join(tmp, f"neftune{rank}.pt"))


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_trainer_neftune_noise_under_cp_has_the_batchs_magnitude(tmp_path):
    """NEFTune adds uniform noise of magnitude alpha / sqrt(row length x width), reading the length from the
    embeddings' output: under cp 2 the shard's 32 tokens, sqrt(2) x the 64-token rows' magnitude (221 for 156). At
    alpha 1e4 the noise dwarfs the embeddings, so the largest |output| of 32 x 64 uniform draws is the magnitude."""
    model_dir = str(tmp_path / "model")
    _save_tiny_llama(model_dir)
    spawn(_neftune_rank, 2, tmp_path, str(tmp_path), model_dir, timeout_s=300)
    magnitude = 1e4 / math.sqrt(64 * 64)  # the tiny Llama's width, _samples' rows
    for rank in range(2):
        seen = torch.load(tmp_path / f"neftune{rank}.pt")
        assert len(seen) == 2 and seen == pytest.approx([magnitude] * 2, rel=1e-2), (rank, seen)


def _family_trainer_rank(rank, world, tmp, family, tokens, par, layer_class, env=None):
    _rank_env(rank, world, **(env or {}))
    args = _trainer_args(tmp, par, layer=layer_class)
    trainer = _InOrder(model=_zoo.tiny_model(family).train(), args=args,
                       train_dataset=[{"input_ids": t, "labels": t.clone()} for t in tokens])
    trainer.train()
    if rank == 0:
        torch.save([h["loss"] for h in trainer.state.log_history if "loss" in h], os.path.join(tmp, "family.pt"))


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family, par", [("longcat_flash", {"cp_size": 2}), ("longcat_flash", {"dp_shard_size": 2}),
                                         ("gemma4", {"cp_size": 2})])
def test_trainer_on_families_accelerates_fsdp2_broke_matches_one_process(tmp_path, family, par):
    """LongCat-Flash sends most tokens to its identity (zero-compute) experts: a rank's tokens (a shard of the
    sequence under cp 2, a row under dp_shard 2) often reach none of the routed experts, whose parameters then had
    no gradient there, and the ranks' FSDP2 reduce-scatters disagreed (gloo aborted; NCCL hangs); tied into each
    MoE layer's input, they get a zero one. Gemma 4 (multimodal, text-only batches) reads its input embedding's
    weight after the embedding's own forward, where Accelerate's FSDP2 had resharded it ("mixed torch.Tensor and
    DTensor"), and hands `labels` down to its attention layers."""
    model = _zoo.tiny_model(family).train()  # seeded: every rank builds the same one
    layer_class = type(model.get_submodule(ndp.hf.decoder_layers(model)[1][0])).__name__
    dp = par.get("dp_shard_size", 1)
    tokens = torch.randint(0, _zoo.VOCAB, (3 * dp, 48), generator=torch.Generator().manual_seed(7))
    spawn(_family_trainer_rank, 2, tmp_path, str(tmp_path), family, tokens, par, layer_class, timeout_s=300)
    want, _ = _train_one_process(model, tokens, steps=3, dp=dp, clip=1.0)
    assert torch.load(tmp_path / "family.pt") == pytest.approx(want, rel=1e-6)


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mixers", ["gather", "heads"])
def test_trainer_trains_a_hybrid_under_cp_with_its_mixers_gathered(tmp_path, mixers):
    """Qwen3-Next (gated DeltaNet layers beside its attention) under the Trainer at cp 2 with ``NDP_CP_MIXERS=gather``
    or ``heads`` (ndp's CP through Accelerate's FSDP2): the 3 logged losses equal one process's."""
    model = _zoo.tiny_model("qwen3_next").train()
    tokens = torch.randint(0, _zoo.VOCAB, (3, 48), generator=torch.Generator().manual_seed(7))
    spawn(_family_trainer_rank, 2, tmp_path, str(tmp_path), "qwen3_next", tokens, {"cp_size": 2},
          "Qwen3NextDecoderLayer", {"NDP_CP_MIXERS": mixers}, timeout_s=300)
    want, _ = _train_one_process(model, tokens, steps=3, dp=1, clip=1.0)
    assert torch.load(tmp_path / "family.pt") == pytest.approx(want, rel=1e-6)


# Lengths the CP layout cannot split (63, 23, 37 at cp 2: multiples of 4 needed), the last batch one sample.
PADDED_LENGTHS = (63, 40, 52, 23, 37)
COLLATORS = {"pad": lambda: _pad_collate,
             "flatten": lambda: DataCollatorWithFlattening(return_flash_attn_kwargs=True)}


def _padded_samples():
    tokens = torch.randint(1, 256, (len(PADDED_LENGTHS), 64), generator=torch.Generator().manual_seed(3))
    return [{"input_ids": t[:n]} for t, n in zip(tokens, PADDED_LENGTHS)]


def _pad_collate(samples):
    """What DataCollatorForLanguageModeling(mlm=False) gives on the right: pad id 0, mask 0, label -100 at pads."""
    ids = torch.nn.utils.rnn.pad_sequence([s["input_ids"] for s in samples], batch_first=True, padding_value=0)
    mask = (torch.arange(ids.shape[1])[None] < torch.tensor([len(s["input_ids"]) for s in samples])[:, None]).long()
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def _padded_trainer_rank(rank, world, tmp, model_dir, collate, layer):
    _rank_env(rank, world, NDP_CP_MIXERS="gather")  # qwen3_next's gated DeltaNet layers; the others have none
    # the tokens seen: the pad collator's without its pads (its attention mask), the flattening one's all (no pads)
    args = _trainer_args(tmp, {"cp_size": 2}, layer, per_device_train_batch_size=2, per_device_eval_batch_size=2,
                         include_num_input_tokens_seen="non_padding" if collate == "pad" else "all")
    trainer = _InOrder(model=AutoModelForCausalLM.from_pretrained(model_dir), args=args,
                       train_dataset=_padded_samples(), data_collator=COLLATORS[collate]())
    trainer.train()
    ev = trainer.evaluate(eval_dataset=_padded_samples()[:4]) if collate == "pad" else {}
    if rank == 0:
        torch.save({"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                    "seen": trainer.state.num_input_tokens_seen, "eval": ev.get("eval_loss")},
                   os.path.join(tmp, "padded.pt"))


def _eval_one_process(model, samples, collate):
    """The Trainer's evaluation loss on one process: the mean over batches of 2 of each batch's loss (its token mean,
    plus an MoE's load-balancing term, as its forward adds it)."""
    losses = []
    with torch.no_grad():
        for i in range(0, len(samples), 2):
            b = collate(samples[i:i + 2])
            losses.append(float(model(**b, use_cache=False).loss))
    return sum(losses) / len(losses)


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family, collate", [("llama", "flatten"), ("llama", "pad"), ("stablelm", "flatten"),
                                             ("olmoe", "pad"), ("phi3_longrope", "pad"), ("qwen3_next", "pad")])
def test_trainer_batches_of_any_length_under_cp_match_one_process(tmp_path, family, collate):
    """A padding collator's batches and packed ones (DataCollatorWithFlattening with its document table; the last
    batch one document, sharded as rows) under cp 2, of lengths the CP layout cannot split: ndp's Trainer pads them
    by name (labels -100), and the losses are one process's on the same batches. StableLM's decoder layers do not
    hand the document table to their attention (ndp's mask carries it; refused before). OLMoE adds its routers'
    load-balancing loss to its loss: each rank's share of the batch's, the batch's pads left out (ndp.hf.router).
    Phi-3's LongRoPE chooses its frequencies from the batch's longest position (ndp.hf.rope): the one without ndp's
    pads, which the buffers the model gets do not carry (63 tokens: short factors; 64 would take the long).
    Qwen3-Next's gated DeltaNet layers (cp_mixers="gather", run on the gathered rows) are causal as its attention
    is: the pads at each row's end (its mask all ones under CP) change no real token's output."""
    model_dir = str(tmp_path / "model")
    layer = _save_tiny(model_dir, family)
    spawn(_padded_trainer_rank, 2, tmp_path, str(tmp_path), model_dir, collate, layer, timeout_s=300)
    want, model = _one_process(model_dir, _padded_samples(), steps=3, dp=2, clip=1.0, collate=COLLATORS[collate]())
    got = torch.load(tmp_path / "padded.pt")
    assert got["losses"] == pytest.approx(want, abs=1e-4)  # logged to 4 digits
    if collate == "pad":  # the trained model's evaluation on padded batches, 2 of 4 rows, lengths 63, 40, 52, 23
        assert got["eval"] == pytest.approx(_eval_one_process(model, _padded_samples()[:4], _pad_collate), rel=1e-5)
    # the batch's tokens, counted once: not each rank's shard (the Trainer counts after training_step, and ndp
    # shards the batch's tensors in place), ndp's pads not among them
    assert got["seen"] == sum(PADDED_LENGTHS)


def _resume_rank(rank, world, tmp, model_dir, par, optim, state_dict_type):
    _rank_env(rank, world)
    runs, weights, stateless = [], [], []
    for resume in (None, os.path.join(tmp, "out", "checkpoint-2")):
        args = _trainer_args(tmp, par, max_steps=4, lr_scheduler_type="linear", optim=optim, save_strategy="steps",
                             save_steps=2, state_dict_type=state_dict_type)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        torch.manual_seed(0)
        model.unused = torch.nn.Linear(4, 4)  # never given a gradient (a vision tower under text-only batches)
        trainer = _InOrder(model=model, args=args, train_dataset=_samples())
        trainer.train(resume_from_checkpoint=resume)
        runs.append({h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h})
        weights.append({n: p.full_tensor() for n, p in trainer.model.named_parameters()})
        stateless.append(trainer.model.unused.weight not in trainer.optimizer.state)
        dist.barrier()
        AcceleratorState._reset_state(True)
    # the resumed run reads steps 1-2 from the checkpoint's state and trains 3 and 4: the uninterrupted run's,
    # the learning rate where the linear schedule had it, the unused parameter without optimizer state in both
    assert sorted(runs[1]) == [1, 2, 3, 4], runs
    assert [runs[1][s] for s in (3, 4)] == pytest.approx([runs[0][s] for s in (3, 4)], rel=1e-6), runs
    for name, w in weights[0].items():
        torch.testing.assert_close(weights[1][name], w, atol=1e-7, rtol=0, msg=name)
    assert stateless == [True, True]


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("par, optim, state_dict_type", [
    ({"dp_shard_size": 2, "cp_size": 2}, "adamw_torch", "FULL_STATE_DICT"),
    ({"cp_size": 2}, "adamw_torch", "SHARDED_STATE_DICT"),
    ({"cp_size": 2}, "sgd", "FULL_STATE_DICT"),   # no optimizer state at all: only the param groups to load
    ({"cp_size": 2, "tp_size": 2}, "adamw_torch", "FULL_STATE_DICT"),   # parameters split over 2 mesh axes
    ({"dp_shard_size": 2, "tp_size": 2}, "adamw_torch", "SHARDED_STATE_DICT")])
def test_trainer_checkpoint_save_and_resume_under_cp(tmp_path, par, optim, state_dict_type):
    """Resume as if uninterrupted, with a parameter the optimizer kept no state for (Accelerate's FSDP2 load
    stopped on it: "Missing optimizer state for parameter"; with none at all, on "Expected device to be set")."""
    model_dir = str(tmp_path / "model")
    _save_tiny_llama(model_dir)
    spawn(_resume_rank, math.prod(par.values()), tmp_path, str(tmp_path), model_dir, par, optim,
          state_dict_type, timeout_s=300)


def _unreadable_optimizer_rank(rank, world, checkpoint):
    with pytest.raises(RuntimeError, match=r"rank 0 could not read the optimizer state in .*ckpt"):
        ndp.accelerate.saved_optimizer_state(checkpoint)  # every rank raises, none waits for rank 0


def test_an_optimizer_state_rank_0_cannot_read_raises_on_every_rank(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "optimizer.bin").write_bytes(b"truncated")
    spawn(_unreadable_optimizer_rank, 2, tmp_path, str(tmp_path / "ckpt"), timeout_s=20)


def _readme_trainer_rank(rank, world, tmp, code, model_dir):
    _rank_env(rank, world, MODEL=model_dir)
    os.chdir(tmp)
    ns = {"__name__": "__main__"}
    exec(compile(code, "README.md:trainer", "exec"), ns)
    assert isinstance(ns["trainer"].accelerator, ndp.accelerate.Accelerator)
    if rank == 0:
        torch.save([h["loss"] for h in ns["trainer"].state.log_history if "loss" in h], os.path.join(tmp, "l.pt"))


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_readme_trainer_verbatim_matches_a_one_process_trainer(tmp_path):
    code = readme_block(1)
    assert "\nfrom ndp.trainer import Trainer" in code
    model_dir = str(tmp_path / "model")
    _save_tiny_llama(model_dir)
    spawn(_readme_trainer_rank, 4, tmp_path, str(tmp_path), code, model_dir, timeout_s=300)
    got = torch.load(tmp_path / "l.pt")
    want = _one_process_script(code, ("from ndp.trainer import Trainer", "from transformers import Trainer"),
                               tmp_path, model_dir)
    assert len(got) == 5 and got == pytest.approx(want, abs=1e-4)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_readme_sft_trainer_packing_under_cp_matches_one_process(tmp_path):
    # TRL refuses packing=True with cp_size > 1; ndp's SFTTrainer trains it, per document.
    pytest.importorskip("trl")  # an optional dependency (ndp[hf]); CI installs it
    code = readme_block(2)
    assert "\nfrom ndp.trainer import SFTTrainer" in code and "packing=True" in code
    model_dir = str(tmp_path / "model")
    _save_tiny_llama(model_dir)
    _save_word_tokenizer(model_dir)
    spawn(_readme_trainer_rank, 4, tmp_path, str(tmp_path), code, model_dir, timeout_s=300)
    got = torch.load(tmp_path / "l.pt")
    want = _one_process_script(code, ("from ndp.trainer import SFTTrainer", "from trl import SFTTrainer"),
                               tmp_path, model_dir)
    # SFTConfig's default bf16=True autocasts the one process; Accelerate's FSDP2 on CPU trains in fp32: that moves
    # these losses by up to 4e-4 (exact with bf16=False: the test below); documents attending across their
    # boundaries, or a wrong normalisation, move them by > 1e-2
    assert len(got) == 4 and got == pytest.approx(want, abs=5e-4), (got, want)


def _save_word_tokenizer(model_dir):
    """A tokenizer of the tiny models' 256 ids: the words t0 ... t255 (t0 pads, t1 ends), split at spaces."""
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1").save_pretrained(model_dir)


def _prompt_completions(seed, lengths):
    """A prompt-completion dataset of the tokenizer's words: SFTTrainer trains on the completions only."""
    from datasets import Dataset
    g = torch.Generator().manual_seed(seed)
    docs = [[f"t{i}" for i in torch.randint(2, 256, (n,), generator=g).tolist()] for n in lengths]
    return Dataset.from_dict({"prompt": [" ".join(d[:len(d) // 3]) for d in docs],
                              "completion": [" " + " ".join(d[len(d) // 3:]) for d in docs]})


def _sft_trainer(cls, tmp, model_dir, packing, eval_packing, par=None, layer="LlamaDecoderLayer", **overrides):
    """cls (ndp's SFTTrainer under Accelerate's ParallelismConfig(**par), or TRL's on one process) on the model in
    model_dir, fp32, the data in order: 3 SGD steps, then an evaluation on 5 documents, one per step; `overrides`
    replace any of the SFTConfig arguments (`peft_config`: the trainer's, its adapters' initialization seeded)."""
    from trl import SFTConfig
    peft = _seeded_peft(overrides)
    args = _trainer_args(tmp, par, layer, cls=SFTConfig, per_device_eval_batch_size=1, bf16=False, max_length=32,
                         packing=packing, eval_packing=eval_packing, **overrides)
    in_order = type("InOrder", (cls,), {"_get_train_sampler": _InOrder._get_train_sampler})
    return in_order(model=AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=None if par else "eager"),
                    args=args, train_dataset=_prompt_completions(5, (19, 40, 12, 23, 37, 9, 30, 45)),
                    eval_dataset=_prompt_completions(6, (33, 8, 26, 14, 38)),
                    processing_class=AutoTokenizer.from_pretrained(model_dir), **peft)


def _seeded_peft(overrides) -> dict:
    """The trainer's `peft_config` taken out of a test's overrides ({} without one), the generator seeded: TRL
    initialises the adapters in its constructor, alike on every rank and in the one-process reference."""
    if "peft_config" not in overrides:
        return {}
    torch.manual_seed(0)
    return {"peft_config": overrides.pop("peft_config")}


def _sft_rank(rank, world, tmp, model_dir, packing, eval_packing, par, layer, overrides):
    _rank_env(rank, world)
    trainer = _sft_trainer(ndp.trainer.SFTTrainer, tmp, model_dir, packing, eval_packing, par, layer, **overrides)
    trainer.train()
    ev = trainer.evaluate()["eval_loss"]
    if rank == 0:
        torch.save(_sft_losses(trainer, ev), os.path.join(tmp, "sft.pt"))


def _sft_losses(trainer, eval_loss):
    """The logged training losses, the eval loss and TRL's metrics of each logged step (training, then eval)."""
    logs = [h for h in trainer.state.log_history if "loss" in h or "eval_loss" in h]
    return {"losses": [h["loss"] for h in logs if "loss" in h], "eval": eval_loss, "tp_split": _tp_split(trainer.model),
            "metrics": [{k: v for k, v in h.items() if k.removeprefix("eval_") in TRL_METRICS} for h in logs]}


TRL_METRICS = ("num_tokens", "mean_token_accuracy", "entropy", "aux_loss")


def _sft_against(tmp_path, model_dir, packing, eval_packing, dp, layer="LlamaDecoderLayer", split="cp_size",
                 **overrides):
    """ndp's SFTTrainer at dp_shard dp x cp 2 (`split`: or tp_size 2), and what it must equal: one TRL SFTTrainer
    process at dp 1, ndp's at dp_shard dp alone (TRL normalises each rank's evaluation batch by its own tokens: not
    one process's mean)."""
    import trl
    args = (str(tmp_path), model_dir, packing, eval_packing)
    spawn(_sft_rank, 2 * dp, tmp_path, *args, {"dp_shard_size": dp, split: 2}, layer, overrides, timeout_s=300)
    got = torch.load(tmp_path / "sft.pt")
    if dp > 1:
        (tmp_path / "dp").mkdir()  # a rendezvous of its own
        spawn(_sft_rank, dp, tmp_path / "dp", str(tmp_path / "dp"), *args[1:], {"dp_shard_size": dp}, layer,
              overrides, timeout_s=300)
        return got, torch.load(tmp_path / "dp" / "sft.pt")
    ref = _sft_trainer(trl.SFTTrainer, str(tmp_path / "ref"), *args[1:], **overrides)
    ref.train()
    want = _sft_losses(ref, ref.evaluate()["eval_loss"])
    AcceleratorState._reset_state(True)
    return got, want


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family, packing, eval_packing, dp, split", [
    ("llama", True, None, 1, "cp_size"), ("llama", True, False, 1, "cp_size"), ("llama", False, None, 1, "cp_size"),
    ("llama", False, None, 2, "cp_size"), ("opt", False, None, 1, "cp_size"), ("llama", False, None, 2, "tp_size")])
def test_sft_trainer_under_cp_trains_and_evaluates_as_without(tmp_path, family, packing, eval_packing, dp, split):
    """TRL's evaluation step neither shards the batch for CP nor counts its tokens (every rank's attention got the
    whole batch: refused); with packing, the evaluation data went unpacked (eval_packing None) and untruncated
    (eval_packing False): TRL's constructor saw packing off. Prompt-completion data: a completion-only loss, uneven
    over the CP shards and the data-parallel ranks. OPT: Accelerate puts the LM head in one FSDP2 unit with the
    final norm it finds among the base model's children, and OPT's (decoder.final_layer_norm) is not one, so the
    head was a unit of its own, gathered only when called as a module; TRL's fused LM head reads its weight
    directly, and its gradient missed the reduce-scatter (the head moved 0.92x one process's, the losses 1e-4 off
    from step 2, with or without CP). dp_shard 2 x tp 2 against dp_shard 2: the evaluation gathered each batch's
    loss once per TP rank (eval loss 5.4394 against 5.4343) and TRL counted each batch's tokens once per TP rank."""
    pytest.importorskip("trl")
    model_dir = str(tmp_path / "model")
    got, want = _sft_against(tmp_path, model_dir, packing, eval_packing, dp, layer=_save_tiny(model_dir, family),
                             split=split)
    assert len(got["losses"]) == 3 and got["losses"] == pytest.approx(want["losses"], rel=1e-6)
    assert got["eval"] == pytest.approx(want["eval"], rel=1e-6)
    # TRL's metrics: num_tokens counted each CP shard, ndp's pads and a padded batch's pads included (78 tokens
    # after 3 steps counted 84); at dp 2 Accelerate cut the padded last evaluation batch entry by entry, keeping
    # rank 0's shard alone (eval_entropy 5e-6 off); under tp 2 TRL counted each batch once per TP rank
    def tokens(run):
        return [{k: v for k, v in m.items() if k.endswith("num_tokens")} for m in run["metrics"]]

    assert tokens(got) == tokens(want)
    assert got["metrics"] == [pytest.approx(m, rel=1e-6) for m in want["metrics"]]


# The decoder layer class FSDP2 wraps, by family of the tests' tiny models.
DECODER_LAYERS = {"llama": "LlamaDecoderLayer", "opt": "OPTDecoderLayer", "stablelm": "StableLmDecoderLayer",
                  "olmoe": "OlmoeDecoderLayer", "phi3_longrope": "Phi3DecoderLayer",
                  "qwen3_next": "Qwen3NextDecoderLayer"}


def _save_tiny(model_dir, family):
    """The tests' tiny Llama or a zoo family's tiny model, with the word tokenizer; its decoder layer class."""
    if family == "llama":
        _save_tiny_llama(model_dir)
        _save_word_tokenizer(model_dir)
    else:
        _save_tiny_family(model_dir, family)
    return DECODER_LAYERS[family]


def _save_tiny_family(model_dir, family):
    """A zoo family's tiny model (fp32, seeded) and the word tokenizer, its vocabulary the tokenizer's 256 words;
    an MoE (olmoe) with its routers' load-balancing loss on, at a coefficient large enough to show in every loss;
    phi3_longrope: Phi-3 with LongRoPE (``_zoo.rope_model``)."""
    if family == "phi3_longrope":  # its long factors past 63 tokens: the first padded batch's length
        _zoo.rope_model("longrope", 63, vocab_size=256).float().save_pretrained(model_dir)
        _save_word_tokenizer(model_dir)
        return
    cfg = _zoo.tiny_config(family)
    cfg.vocab_size = 256
    if family == "olmoe":
        cfg.output_router_logits, cfg.router_aux_loss_coef = True, 0.5
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(model_dir)
    _save_word_tokenizer(model_dir)


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("packing, dp, split", [(False, 1, "cp_size"), (True, 1, "cp_size"), (False, 2, "cp_size"),
                                               (False, 2, "tp_size")])
def test_sft_trainer_moe_load_balancing_loss_under_cp_matches_one_process(tmp_path, packing, dp, split):
    """TRL adds an MoE's load-balancing loss (its aux_loss) by default; under CP each rank's is its share of the
    batch's, scaled for FSDP's averaging (ndp.hf.router): losses, eval loss and metrics are one process's (at
    dp_shard 2 x cp 2, dp_shard 2's), on rows with pads (ndp's and the collator's: left out of the loss's token
    means) and packed documents. Before, each rank computed it over its shard (refused). At dp_shard 2 x tp 2 (as
    dp_shard 2) the experts are split over the TP ranks (ndp.parallel.ExpertsParallel; refused before)."""
    pytest.importorskip("trl")
    model_dir = str(tmp_path / "model")
    got, want = _sft_against(tmp_path, model_dir, packing, None, dp, layer=_save_tiny(model_dir, "olmoe"),
                             split=split)
    assert len(got["losses"]) == 3 and got["losses"] == pytest.approx(want["losses"], rel=1e-6)
    assert got["eval"] == pytest.approx(want["eval"], rel=1e-6)
    assert got["metrics"] == [pytest.approx(m, rel=1e-6) for m in want["metrics"]]


def test_trainer_needs_no_trl_and_sft_trainer_says_what_to_install():
    # trl is optional (ndp[hf]): without it ndp.trainer imports, Trainer is there, SFTTrainer names what is missing.
    code = ("import sys; sys.modules['trl'] = None\n"  # what `import trl` meets where trl is not installed
            "import transformers, ndp.trainer as t\n"
            "assert issubclass(t.Trainer, transformers.Trainer)\n"
            "t._check_token_loss_trainer(t.Trainer, 2)\n"  # the CP check reads no trl attribute
            "for cls in (t.SFTTrainer, t.DPOTrainer, t.KTOTrainer, t.RewardTrainer):\n"
            "    try:\n        cls()\n    except ImportError as e:\n        print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "SFTTrainer subclasses trl.SFTTrainer, and trl is not installed: pip install trl (or ndp[hf])" in out.stdout
    for name in ("DPOTrainer", "KTOTrainer", "RewardTrainer"):
        assert f"ndp.trainer.{name} subclasses trl.{name}, and trl is not installed: pip install trl" in out.stdout


def _one_process_script(code, imports, tmp_path, model_dir):
    """The logged losses of a README trainer script run as its upstream trainer in this process (no process group):
    `imports` (ndp's import line, upstream's) swapped, per-device batch 2 (the dp 2 global batch, the same seeded
    sampler order), the parallelism and FSDP arguments dropped."""
    code = code.replace(*imports).replace("per_device_train_batch_size=1", "per_device_train_batch_size=2")
    code = re.sub(r"parallelism_config=.*?\n\s*fsdp_config=\{.*?\}\)", ")", code, flags=re.S)
    assert imports[1] in code and "parallelism_config=" not in code and "fsdp=" not in code
    cwd = os.getcwd()
    os.environ["MODEL"] = model_dir
    try:
        os.chdir(tmp_path)
        ns = {"__name__": "__main__"}
        exec(compile(code, "README.md (1 process)", "exec"), ns)
    finally:
        os.chdir(cwd)
        del os.environ["MODEL"]
        AcceleratorState._reset_state(True)
    return [h["loss"] for h in ns["trainer"].state.log_history if "loss" in h]


def _gather_rank(rank, world, par):
    _rank_env(rank, world)
    plugin = _fsdp2_plugin()
    acc = ndp.accelerate.Accelerator(parallelism_config=AccelerateConfig(**par), fsdp_plugin=plugin)
    cp_rank = acc.torch_device_mesh["cp"].get_local_rank() if "cp_size" in par else 0
    rows, parts = {1: [], 2: []}, []
    for batch in rows:  # 5 samples over 2 dp ranks: the last step padded (1 real sample)
        for b in acc.prepare(torch.utils.data.DataLoader(torch.arange(5) * 10, batch_size=batch)):
            rows[batch].append(acc.gather_for_metrics(b))  # per-sample values: each CP rank's copy, or part
            if batch == 1:
                parts.append(acc.gather_for_metrics(b.sum() + cp_rank))  # a per-rank value: a CP rank's part
    rows, parts = {k: torch.cat(v).tolist() for k, v in rows.items()}, torch.cat(parts).tolist()
    if "tp_size" in par:  # each batch once, not once per TP rank; the padded last step cut to its real batch
        assert rows[1] == rows[2] == parts == [0, 10, 20, 30, 40]
    else:  # each batch's CP parts together, the last step's too (Accelerate cut it entry by entry: [40]; the
        # per-sample rows [40] too, after the others' CP copies: 9 entries, the last sample's weight halved)
        assert parts == [0, 1, 10, 11, 20, 21, 30, 31, 40, 41]
        assert rows[1] == [0, 0, 10, 10, 20, 20, 30, 30, 40, 40]
        assert rows[2] == [0, 10, 0, 10, 20, 30, 20, 30, 40, 40]


@pytest.mark.distributed
@pytest.mark.parametrize("par", [{"dp_shard_size": 2, "tp_size": 2}, {"dp_shard_size": 2, "cp_size": 2}])
def test_gather_for_metrics_takes_each_data_parallel_batch_once(tmp_path, par):
    """Accelerate's gather_for_metrics gathers every rank: under TP each batch came once per TP rank ([0, 0, 10,
    10, ..., 40] for 5 rows at dp_shard 2 x tp 2), and the padded last step was cut entry by entry."""
    spawn(_gather_rank, 4, tmp_path, par, timeout_s=120)


def _other_buffers_rank(rank, world):
    _rank_env(rank, world)
    plugin = _fsdp2_plugin()
    acc = ndp.accelerate.Accelerator(parallelism_config=AccelerateConfig(cp_size=world), fsdp_plugin=plugin)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(rank))  # a loader of its own
    for names in (None, ["input_ids"]):
        with pytest.raises(ValueError, match=r"maybe_context_parallel got other rows on the 2 ranks .* \(the cp "
                                             r"axis\).*accelerator.prepare\(loader\)"):
            with acc.maybe_context_parallel(buffers=[ids.clone()], buffer_seq_dims=[1], names=names):
                pass


def _uneven_batches_rank(rank, world):
    from accelerate.utils import DataLoaderConfiguration
    _rank_env(rank, world)
    plugin = _fsdp2_plugin()
    acc = ndp.accelerate.Accelerator(parallelism_config=AccelerateConfig(dp_shard_size=2, cp_size=2),
                                     fsdp_plugin=plugin, dataloader_config=DataLoaderConfiguration(even_batches=False))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(5, 8)), batch_size=1)
    with pytest.raises(ValueError, match=r"even_batches=False gives the ranks 2 to 3 batches each \(this rank "
                                         r"[23]\): a rank out of batches .* Keep even_batches=True"):
        acc.prepare(loader)
    even = acc.prepare(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 8)), batch_size=1))
    assert len(even) == 2


@pytest.mark.distributed
def test_uneven_batches_are_refused_on_every_rank_before_a_hang(tmp_path):
    """even_batches=False on 5 samples over 2 data-parallel ranks (each with 2 CP ranks): 3 batches on one, 2 on the
    other, whose FSDP2 and CP collectives the third step would leave the first rank waiting in. Refused by name at
    prepare on all 4 ranks; 4 samples are prepared."""
    spawn(_uneven_batches_rank, 4, tmp_path, timeout_s=60)


@pytest.mark.distributed
def test_maybe_context_parallel_refuses_another_batch_on_each_cp_rank(tmp_path):
    """A data loader not prepared by the Accelerator (a sampler over every rank) gave each CP rank its own batch,
    and maybe_context_parallel sharded each: the step trained on pieces of two batches, silently."""
    spawn(_other_buffers_rank, 2, tmp_path, timeout_s=60)


def _loaded_split_rank(rank, world, model_dir):
    _rank_env(rank, world)
    acc = ndp.accelerate.Accelerator(parallelism_config=AccelerateConfig(dp_shard_size=2, tp_size=2),
                                     fsdp_plugin=_fsdp2_plugin())
    split = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", device_mesh=acc.torch_device_mesh["tp"])
    assert any(isinstance(p, DTensor) for p in split.parameters())
    for prepare in (lambda: acc.prepare(split, torch.optim.SGD(split.parameters(), lr=0.1)),
                    lambda: acc.prepare_tp(split)):  # TRL's reference model
        with pytest.raises(ValueError, match=r"tp_size=2 and a model split already, not by ndp \(DTensor parameters: "
                                             r"transformers loaded split.*Load it whole, without tp_plan / device_mesh"):
            prepare()
    whole = AutoModelForCausalLM.from_pretrained(model_dir)
    model, _ = acc.prepare(whole, torch.optim.SGD(whole.parameters(), lr=0.1))
    assert acc.prepare_tp(model) is model  # split by ndp already: passed through


@pytest.mark.distributed
def test_a_model_transformers_loaded_split_is_refused_by_name_on_every_rank(tmp_path):
    """Accelerate's ND-parallel recipe loads the model split by transformers' TP (from_pretrained with tp_plan and
    device_mesh): Accelerate 1.15's preparation of it failed on transformers 5.24 with an ImportError, and ndp neither
    checks that split nor shares its dropout draws. Refused by name at prepare, on all 4 ranks (dp_shard 2 x tp 2);
    loaded whole, ndp splits it."""
    _save_tiny_llama(str(tmp_path / "model"))
    spawn(_loaded_split_rank, 4, tmp_path, str(tmp_path / "model"), timeout_s=120)


def test_packed_rows_are_recognised_only_by_unambiguous_positions():
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]])
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]])
    cu, name = ndp.accelerate._packed({"a": seq_idx, "b": pos})
    assert name == "b" and cu.tolist() == [0, 3, 7, 8]
    assert ndp.accelerate._packed({"a": seq_idx[:, :3]}) == (None, None)      # one document: zeros only
    assert ndp.accelerate._packed({"a": torch.tensor([[0, 0, 1, 1, 2]])}) == (None, None)   # a seq_idx
    one_token_doc = torch.tensor([[0, 1, 0, 0, 1]])   # ambiguous by value: sharded dense, refused by the attention
    assert ndp.accelerate._packed({"a": one_token_doc}) == (None, None)
    cu, name = ndp.accelerate._packed({"a": seq_idx, "p": one_token_doc}, position_ids=one_token_doc)
    assert name == "p" and cu.tolist() == [0, 2, 3, 5]                        # named: taken as it is
    with pytest.raises(ValueError, match="must be one of the buffers"):
        ndp.accelerate._packed({"a": seq_idx}, position_ids=pos)


def test_a_packed_batch_too_short_for_every_rank_is_refused_not_padded():
    # Accelerate's buffers are unnamed (which one holds the labels is unknown), so a packed batch that leaves a CP
    # rank without a token (no document of 2 x cp tokens, fewer documents than ranks) is refused on every rank; a
    # longer document is cut over every rank.
    from ndp.parallel.mesh import CPContext

    pos = torch.tensor([[0, 1, 2, 0, 1]])
    ids = torch.arange(5)[None]
    for rank in (0, 1, 2, 3):
        ctx = CPContext("ring", "zigzag", group=object(), size=4, rank=rank)
        with pytest.raises(ValueError, match=r"documents \[3, 2\] leaves 2 of the 4 context-parallel ranks without"):
            ndp.accelerate.shard_buffers([ids, pos], None, ctx)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1]])
    shards = [ndp.accelerate.shard_buffers([torch.arange(10)[None], pos], None,
                                           CPContext("ring", "zigzag", group=object(), size=4, rank=r))[0][0]
              for r in range(4)]
    assert all(s.numel() for s in shards) and sorted(torch.cat(shards, 1)[0].tolist()) == list(range(10))


def _named_dense_rank(rank, world):
    from ndp.parallel.mesh import CPContext

    ids, pos = torch.arange(1, 8)[None], torch.arange(7)[None]
    rows = [ids, ids + 100, pos, torch.ones_like(ids)]
    names = ["input_ids", "shift_labels", "position_ids", "attention_mask"]
    ctx = CPContext("ring", "zigzag", group=dist.group.WORLD, size=world, rank=rank)
    with pytest.raises(ValueError, match=r"dense rows of 7 tokens .* multiple of 4 .* pass names="):
        ndp.accelerate.shard_buffers(rows, None, ctx)
    with pytest.raises(ValueError, match="names each buffer once"):
        ndp.accelerate.shard_buffers(rows, None, ctx, names=names[:3])
    shards, extra = ndp.accelerate.shard_buffers(rows, None, ctx, names=names)
    want = ([[1, 2, 7, 0]], [[101, 102, 107, -100]], [[0, 1, 6, 7]], [[1, 1, 1, 1]]) if rank == 0 else \
        ([[3, 4, 5, 6]], [[103, 104, 105, 106]], [[2, 3, 4, 5]], [[1, 1, 1, 1]])   # zigzag: chunks 0, 3 | 1, 2 of 8
    assert [s.tolist() for s in shards] == list(want) and extra == {}
    # a collator's seq_idx of one document per row (TRL's padding-free one adds it) is dense rows too: no table a
    # model may not hand down to its attention (StableLM, Nemotron), no document shard no dense shard matches
    shards, extra = ndp.accelerate.shard_buffers(rows + [torch.zeros_like(ids)], None, ctx, names=names + ["seq_idx"])
    assert [s.tolist() for s in shards[:4]] == list(want) and extra == {}


@pytest.mark.distributed
def test_named_buffers_are_padded_as_shard_batch_pads_them_unnamed_are_refused(tmp_path):
    # Dense rows of 7 tokens at cp 2 (zigzag: a multiple of 4): unnamed buffers are refused by name (which holds the
    # labels is unknown); named ones (ndp's Trainer) are padded at the end and sharded: labels -100, positions
    # continued, mask 1. A named packed batch too short for every rank gets its padding document.
    from ndp.parallel.mesh import CPContext

    spawn(_named_dense_rank, 2, tmp_path)
    pos = torch.tensor([[0, 1, 2, 0, 1]])                      # documents [3, 2]: no rank 4 would stay empty
    names = ["input_ids", "shift_labels", "position_ids"]
    out = [ndp.accelerate.shard_buffers([torch.arange(5)[None], torch.arange(5)[None] + 100, pos], None,
                                        CPContext("ring", "zigzag", group=object(), size=4, rank=r), names=names)
           for r in range(4)]
    assert all(o[0][0].numel() for o in out)
    assert out[0][1]["cu_seq_lens_q"].tolist() == [0, 3, 5, 13]  # + one padding document of 2 x cp tokens
    labels = torch.cat([o[0][1] for o in out], 1)[0].tolist()
    assert sorted(labels) == [-100] * 8 + [100, 101, 102, 103, 104]
    with pytest.raises(ValueError, match="no labels"):
        ndp.accelerate.shard_buffers([torch.arange(5)[None], pos], None,
                                     CPContext("ring", "zigzag", group=object(), size=4, rank=0),
                                     names=["input_ids", "position_ids"])


def test_a_document_table_for_buffers_sharded_as_rows_is_dropped_or_refused():
    # A collator's document table (cu_seq_lens_q among the model's kwargs) whose buffers were sharded as dense rows
    # (no position_ids buffer): one document is the rows themselves; more would be read against the wrong shards.
    assert ndp.accelerate._dense_table(torch.tensor([0, 12])) == dict.fromkeys(ndp.hf.batch.PACKING_KEYS)
    with pytest.raises(ValueError, match="2 documents.*sharded its buffers as dense rows.*position_ids"):
        ndp.accelerate._dense_table(torch.tensor([0, 5, 12]))


def test_trainer_hands_every_per_token_tensor_by_name_and_positions_per_document():
    # A packing collator's batch without position_ids (its document table only) plus a per-token tensor the model
    # takes: every [batch, seq] tensor goes to maybe_context_parallel by name (shift_labels made before sharding),
    # positions restart at each document, and the collator's table (of the unsharded rows) is not passed on.
    class Accel:
        parallelism_config = AccelerateConfig(cp_size=2)

        @contextlib.contextmanager
        def maybe_context_parallel(self, **kwargs):
            self.kwargs = kwargs
            yield

        def unwrap_model(self, model, keep_torch_compile=True):
            return model

    trainer = type("T", (ndp.trainer.NdpTrainerMixin,), {})()
    trainer.accelerator = Accel()
    ids = torch.arange(10, 17)[None]
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)
    labels = ids.masked_fill(torch.tensor([[1, 0, 0, 0, 1, 0, 0]], dtype=torch.bool), -100)  # -100 at doc starts
    batch = dict(input_ids=ids, labels=labels, token_type_ids=torch.zeros_like(ids), cu_seq_lens_q=cu,
                 cu_seq_lens_k=cu, max_length_q=4, max_length_k=4)
    cp, inputs = trainer._prepare_context_parallel_inputs(None, batch)
    with cp():
        kwargs = trainer.accelerator.kwargs
    assert kwargs["names"] == ["input_ids", "labels", "token_type_ids", "shift_labels", "position_ids"]
    assert all(a is inputs[k] for a, k in zip(kwargs["buffers"], kwargs["names"]))
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert inputs["shift_labels"].tolist() == [[11, 12, 13, -100, 15, 16, -100]]
    assert not set(inputs) & set(ndp.hf.batch.PACKING_KEYS)


@pytest.mark.parametrize("batch, match", [
    (dict(inputs_embeds=torch.zeros(1, 8, 4), labels=torch.zeros(1, 8, dtype=torch.long)),
     r"inputs_embeds \(shape \(1, 8, 4\)\).*cp_size=2.*Pass input_ids"),
    (dict(inputs_embeds=torch.zeros(1, 8, 4)), "inputs_embeds"),
    (dict(attention_mask=torch.ones(1, 8)), r"needs \[batch, seq\] input_ids or labels.*'attention_mask': \(1, 8\)"),
])
def test_trainer_refuses_a_cp_batch_it_cannot_shard_by_tokens(batch, match):
    # Embeddings left whole beside sharded labels would not line up; a batch with no token ids has no shape to shard
    # by. Both are refused by name before maybe_context_parallel is reached (no collective started).
    class Accel:
        parallelism_config = AccelerateConfig(cp_size=2)

        def maybe_context_parallel(self, **kwargs):
            raise AssertionError("reached sharding")

    trainer = type("T", (ndp.trainer.NdpTrainerMixin,), {})()
    trainer.accelerator = Accel()
    with pytest.raises(ValueError, match=match):
        trainer._prepare_context_parallel_inputs(None, batch)


def _preferences():
    """A preference dataset of the word tokenizer's words (prompt, chosen, rejected)."""
    from datasets import Dataset
    g = torch.Generator().manual_seed(3)
    words = lambda n: " ".join(f"t{i}" for i in torch.randint(2, 256, (n,), generator=g).tolist())  # noqa: E731
    return Dataset.from_dict({"prompt": [words(6), words(9)], "chosen": [" " + words(7), " " + words(4)],
                              "rejected": [" " + words(5), " " + words(8)]})


def test_trl_trainers_whose_loss_is_not_a_token_sum_are_refused_under_cp(tmp_path):
    # DPO sums each sequence's log-probabilities inside a non-linear loss: under CP with the mixin alone each rank
    # would sum its shard's (with equal-length chosen / rejected rows nothing else stopped it). Refused when the
    # trainer is built, before the Accelerator (no collective: one process here), ndp.trainer.DPOTrainer named (it
    # gathers them: tests/hf/test_preference.py); the same trainer without CP is built.
    trl = pytest.importorskip("trl")
    model_dir = str(tmp_path / "model")
    _save_tiny(model_dir, "llama")
    dpo = type("NdpDPO", (ndp.trainer.NdpTrainerMixin, trl.DPOTrainer), {})

    def build(par):
        args = _trainer_args(str(tmp_path), par, cls=trl.DPOConfig, bf16=False)
        return dpo(model=AutoModelForCausalLM.from_pretrained(model_dir), args=args, train_dataset=_preferences(),
                   processing_class=AutoTokenizer.from_pretrained(model_dir))

    with pytest.raises(ValueError, match=r"NdpDPO takes its loss from trl\.trainer\.dpo_trainer\.DPOTrainer, which "
                                         r"ndp's context parallelism \(cp_size=2\) cannot compute .* Use "
                                         r"ndp\.trainer\.DPOTrainer \(it runs it under CP\), or train it with "
                                         r"cp_size=1"):
        build({"cp_size": 2})
    AcceleratorState._reset_state(True)
    assert isinstance(build(None), trl.DPOTrainer)
    # the rule reads which class's compute_loss the trainer runs: TRL's other trainers are refused (GKD too, an
    # SFTTrainer whose loss runs a teacher on the shard), a subclass's own loss on top of transformers' Trainer or
    # trl.SFTTrainer is the user's (not refused); KTO is refused on the mixin alone, served by ndp's KTOTrainer;
    # a reward model's pooled score on the mixins (NdpPooledScoreMixin alone pools for transformers' Trainer, not
    # for TRL's), served by ndp's RewardTrainer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # trl.experimental says its API may change
        from trl.experimental.gkd import GKDTrainer
    own = {"compute_loss": lambda self, *a, **k: None}
    for cls in (trl.KTOTrainer, trl.RewardTrainer, GKDTrainer,
                type("SeqReward", (ndp.trainer.NdpSequenceLossMixin, trl.RewardTrainer), {}),
                type("PoolReward", (ndp.trainer.NdpPooledScoreMixin, trl.RewardTrainer), {})):
        with pytest.raises(ValueError, match=rf"{cls.__name__} takes its loss from trl\.\S+Trainer, which"):
            ndp.trainer._check_token_loss_trainer(cls, 2)
    for cls in (ndp.trainer.Trainer, ndp.trainer.SFTTrainer, ndp.trainer.DPOTrainer, ndp.trainer.KTOTrainer,
                ndp.trainer.RewardTrainer, type("Mine", (ndp.trainer.Trainer,), own),
                type("MySft", (ndp.trainer.SFTTrainer,), own)):
        ndp.trainer._check_token_loss_trainer(cls, 2)
