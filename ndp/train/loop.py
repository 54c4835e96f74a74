"""The training loop: model -> parallelize -> AdamW with warm-up + cosine -> steps, metrics, checkpoints.

Loss of a step = (sum of token losses over every DP and CP rank and micro-batch) / (global number of
tokens with a label). Every rank knows the global count without communication because every rank builds
the same global batch. FSDP averages gradients over its ``fsdp_size`` ranks, so each rank back-propagates
``local_sum * fsdp_size / global_count``; the averaged gradient is then the gradient of the global mean.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from tqdm import tqdm

import ndp
import ndp.hf
from ndp.hf.router import aux_loss_on
from ndp.parallel import ActivationOffload, clip_grad_norm_, mesh_axis, param_bytes

from . import checkpoint as ckpt
from .config import TrainConfig
from .data import IGNORE_INDEX, TokenDataset, load_documents, microbatches, model_inputs, tokenize_documents
from .presets import build_model

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a run returns on every rank (metrics are identical on every rank)."""

    losses: list = field(default_factory=list)
    grad_norms: list = field(default_factory=list)
    tokens_per_s: list = field(default_factory=list)
    step_times: list = field(default_factory=list)
    start_step: int = 0
    wall_time: float = 0.0
    param_bytes_per_rank: int = 0  # largest, over ranks, of the parameter bytes a rank holds (its shards)
    param_bytes_total: int = 0  # the whole model's parameter bytes
    state_dict: dict | None = None  # consolidated weights when train(..., return_state=True)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: no CUDA device is visible; use --device cpu")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def lr_lambda(cfg: TrainConfig):
    """Linear warm-up to 1, then cosine decay to ``min_lr_ratio`` at the last step."""
    warm, total, floor = cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio

    def f(step):
        if step < warm:
            return (step + 1) / warm
        t = (step - warm) / max(1, total - warm)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    return f


def _peak_mem_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def _fsdp_modules(model):
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _param_bytes_max(model) -> int:
    """Parameter bytes of the rank that holds the most (shards differ by padding when a dim does not divide)."""
    n = torch.tensor([param_bytes(model)], dtype=torch.int64)
    if dist.get_world_size() > 1:
        # CPU int64 over the default group: gloo carries it (also in a cpu:gloo,cuda:nccl job).
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return int(n.item())


@contextlib.contextmanager
def _single_process_group():
    # A one-rank gloo group (in-memory store, no ports) so that the one-process run uses the same code
    # path (DeviceMesh, DCP) as a multi-rank run.
    owned = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        owned = True
    try:
        yield
    finally:
        if owned:
            dist.destroy_process_group()


def run_identity(model, cfg: TrainConfig) -> dict:
    """What a checkpoint must match to be resumed by this run: architecture, vocabulary, sequence length."""
    c = model.config
    keys = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads")
    ident = {k: getattr(c, k, None) for k in keys}
    ident["seq_len"] = cfg.seq_len
    return ident


def attention_head_dim(config) -> int:
    """The attention head size of a transformers config (``head_dim``, else hidden size over heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def attention_head_kind(config) -> str:
    """"mha" when the config has as many K/V heads as query heads, else "gqa" (``ndp.ops.engines.HEAD_KINDS``)."""
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return "mha" if kv == config.num_attention_heads else "gqa"


def token_loss_sum(model, loss: str, kwargs: dict, labels) -> torch.Tensor:
    """This rank's summed token cross-entropy (fp32) of ``model(**kwargs)``: fused with the LM head, or on the
    model's logits (``TrainConfig.loss``)."""
    if loss == "fused":
        return ndp.hf.head_loss(model, labels, ignore_index=IGNORE_INDEX, **kwargs).float()
    logits = model(**kwargs).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def _first_nonfinite(model, loss_ok: bool) -> str:
    """Names the first tensor that is not finite on this rank: the loss, or a parameter's gradient."""
    if not loss_ok:
        return "the loss"
    for name, prm in model.named_parameters():
        g = prm.grad
        if g is None:
            continue
        g = g.to_local() if hasattr(g, "to_local") else g
        if not bool(torch.isfinite(g).all()):
            return f"the gradient of {name}"
    return "a gradient on another rank (every gradient on this rank is finite)"


def train(cfg: TrainConfig, *, return_state: bool = False, before_commit=None, step_hook=None) -> TrainResult:
    """Run training on the current process group (or a private one-rank group when none exists).

    Args:
        cfg: the TrainConfig; return_state: gather the final consolidated weights into the result.
        before_commit: checkpoint test hook (see ``save_checkpoint``).
        step_hook: test hook ``f(step, model)`` called after each step's backward, before the checks.
    Returns:
        TrainResult with per-step global losses.
    Raises:
        ValueError: config inconsistent with the world size or the model (raised before collectives), or
            a checkpoint of another run on --resume.
        RuntimeError: a non-finite loss or gradient norm (beyond --skip-nonfinite), or a corrupt checkpoint.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    cfg.check(world)
    with _single_process_group():
        return _train(cfg, return_state=return_state, before_commit=before_commit, step_hook=step_hook)


@dataclass
class _Run:
    """What the steps of one run share (built by :func:`_build`)."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    dataset: TokenDataset
    device: torch.device
    autocast: object
    fsdp_mods: list
    dp_rank: int
    dp_size: int
    loss_group: object           # the dp_cp group the loss is summed over (None: one rank)


def _check_token_loss_only(model) -> None:
    """ndp-train trains the token loss alone: a model whose config adds its routers' load-balancing loss to its
    loss is refused, on every rank before any work, rather than trained without it."""
    if aux_loss_on(model):
        text = ndp.hf.text_config(model)
        raise ndp.hf.Unsupported(
            f"{type(model).__name__}'s config adds its routers' load-balancing loss to its loss "
            f"(output_router_logits=True, router_aux_loss_coef={text.router_aux_loss_coef}), and ndp-train trains the "
            f"token loss alone. Set output_router_logits to false in the model's config.json to train without it, or "
            f"train with ndp.trainer.Trainer / SFTTrainer, or ndp.hf.loss + router_aux_loss_coef x aux_loss, which "
            f"add it exactly under context parallelism.")


def _build(cfg: TrainConfig, device: torch.device, rank: int) -> tuple[_Run, int, int]:
    """The model (parallelized), optimizer, schedule and data of a run; also (param bytes of the largest rank,
    the whole model's parameter bytes)."""
    p = cfg.parallel
    mesh = p.build_device_mesh(device.type)
    model = build_model(cfg.model, seed=cfg.seed, init=cfg.init)
    if cfg.pack_docs:  # refused on every rank before any work, not at the first packed batch
        ndp.hf.check_packed_model(model)
    _check_token_loss_only(model)
    if cfg.init == "full":
        model = model.to(device)
    param_total = sum(t.numel() * t.element_size() for t in model.parameters())
    mp_policy = None
    autocast = contextlib.nullcontext()
    if cfg.dtype == "bf16":
        if p.fsdp_size > 1:
            mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:
            autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    # Under TP the fused loss splits the LM head by vocabulary where it can (a tied head stays whole, as the embedding)
    loss_parallel = cfg.loss == "fused" and p.tp_size > 1 and ndp.hf.can_split_head(model)
    ndp.hf.parallelize(model, p, mesh, mp_policy=mp_policy, activation_checkpointing=cfg.activation_checkpointing,
                       loss_parallel=loss_parallel, init_seed=cfg.seed, init_device=device, compile=cfg.compile)
    rank_bytes = _param_bytes_max(model)
    if rank == 0:
        logger.info("parameters: %d bytes per rank (largest rank; --init %s), %d bytes in the whole model",
                    rank_bytes, cfg.init, param_total)
    fsdp_mods = _fsdp_modules(model)
    # foreach=False: one update order for every parallel layout (and DTensors of different meshes).
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=cfg.weight_decay, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    tokens, starts = tokenize_documents(load_documents(cfg.data))
    dataset = TokenDataset(tokens, starts, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed,
                           pack_docs=cfg.pack_docs)
    dp_mesh, loss_mesh = mesh_axis(mesh, "dp"), mesh_axis(mesh, "dp_cp")
    run = _Run(model, opt, sched, dataset, device, autocast, fsdp_mods, dp_mesh.get_local_rank(), dp_mesh.size(),
               loss_mesh.get_group() if loss_mesh.size() > 1 else None)
    return run, rank_bytes, param_total


def _resume(cfg: TrainConfig, run: _Run, identity: dict, rank: int) -> tuple[int, str | None]:
    """(the step to start from, a note when the saved run had another --steps) after --resume."""
    start_step, note = 0, None
    if cfg.resume:
        path = ckpt.latest_checkpoint(cfg.save_dir)
        if path is not None:
            meta = ckpt.read_meta(path)
            ckpt.check_identity(path, meta, identity)
            start_step = ckpt.load_checkpoint(path, run.model, run.opt, run.sched)["step"]
            logger.info("resumed from %s at step %d", path, start_step)
            saved_steps = meta.get("steps")
            if saved_steps is not None and saved_steps != cfg.steps:
                note = (f"resumed a run saved with --steps {saved_steps} under --steps {cfg.steps}: the "
                        f"learning-rate schedule follows --steps {cfg.steps} from step {start_step + 1} on "
                        f"(use --stop-after to run in time slices without changing it)")
                if rank == 0:
                    logger.warning(note)
        elif rank == 0:
            logger.warning("--resume: no checkpoint in %s, starting from scratch", cfg.save_dir)
    if start_step >= cfg.steps and rank == 0:
        logger.warning("--resume: the checkpoint is at step %d, --steps is %d: nothing to train", start_step,
                       cfg.steps)
    return start_step, note


def _open_metrics(cfg: TrainConfig, start_step: int, stack: contextlib.ExitStack):
    """Rank 0's metrics file (closed with ``stack``), keeping the records up to the resumed step."""
    os.makedirs(os.path.dirname(os.path.abspath(cfg.metrics)), exist_ok=True)
    kept = []
    if start_step and os.path.exists(cfg.metrics):
        # A crash may have logged steps after the checkpoint we resume from: drop them.
        with open(cfg.metrics, encoding="utf-8") as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] <= start_step]
    f = stack.enter_context(open(cfg.metrics, "w", encoding="utf-8"))
    f.writelines(kept)
    f.flush()
    return f


def _forward_backward(cfg: TrainConfig, run: _Run, batch) -> torch.Tensor:
    """Every micro-batch of this rank's share of ``batch``, forward and backward; returns the summed token loss."""
    n_global = batch.num_tokens
    mbs = microbatches(batch, dp_rank=run.dp_rank, dp_size=run.dp_size, grad_accum=cfg.grad_accum)
    loss_sum = torch.zeros((), device=run.device, dtype=torch.float32)
    for i, mb in enumerate(mbs):
        for m in run.fsdp_mods:
            m.set_requires_gradient_sync(i == len(mbs) - 1 or cfg.sharded_grad_accum)
        kwargs, labels = model_inputs(mb, run.model.ndp_cp, run.device)
        offload = ActivationOffload(run.device) if cfg.activation_offload else contextlib.nullcontext()
        with run.autocast, offload:
            ls = token_loss_sum(run.model, cfg.loss, kwargs, labels)
        ndp.hf.scale_loss_sum(ls, labels, run.model, ignore_index=IGNORE_INDEX, num_tokens=n_global).backward()
        loss_sum += ls.detach()
    return loss_sum


def _update(cfg: TrainConfig, run: _Run, step: int, loss: float, gnorm, skipped: int) -> tuple[bool, int]:
    """The optimizer step when the loss and norm are finite (they are global: every rank takes the same branch),
    else a skipped step or the error; returns (finite, steps skipped so far)."""
    finite = math.isfinite(loss) and math.isfinite(float(gnorm))
    if finite:
        run.opt.step()
    else:
        what = _first_nonfinite(run.model, math.isfinite(loss))
        msg = (f"step {step + 1}: non-finite {'loss' if not math.isfinite(loss) else 'gradient norm'} "
               f"(loss={loss}, grad_norm={float(gnorm)}); first non-finite tensor on rank {dist.get_rank()}: {what}")
        if skipped >= cfg.skip_nonfinite:
            raise RuntimeError(f"{msg}. Stopping: the weights are unchanged by this step and the last checkpoint "
                               f"is intact. Lower --lr, check the data, or allow skipping with --skip-nonfinite N "
                               f"(used {skipped} of {cfg.skip_nonfinite}).")
        skipped += 1
        logger.warning("%s: step skipped (%d of --skip-nonfinite %d)", msg, skipped, cfg.skip_nonfinite)
    run.sched.step()  # the schedule follows the step index, skipped or not (so resume math is unchanged)
    run.opt.zero_grad(set_to_none=True)
    return finite, skipped


def _warmup(cfg: TrainConfig, run: _Run, rank: int) -> None:
    # Measured and compiled before the first step, on rank 0 for every rank: the first step measures nothing
    # and every rank on every node runs the same kernels and engines.
    config = run.model.config
    warm = ndp.warmup(attention_head_dim(config), torch.bfloat16 if cfg.dtype == "bf16" else torch.float32,
                      head_kinds=attention_head_kind(config), device=run.device)
    if rank == 0:
        logger.info("attention warm-up: %s", warm)


def _train(cfg: TrainConfig, *, return_state: bool, before_commit, step_hook=None) -> TrainResult:
    t_start = time.perf_counter()
    rank = dist.get_rank()
    device = resolve_device(cfg.device)
    run, rank_bytes, param_total = _build(cfg, device, rank)
    identity = run_identity(run.model, cfg)
    start_step, schedule_note = _resume(cfg, run, identity, rank)
    end_step = min(cfg.steps, cfg.stop_after) if cfg.stop_after else cfg.steps
    ckpt_meta = {"identity": identity, "steps": cfg.steps}
    if device.type == "cuda":
        _warmup(cfg, run, rank)
    result = TrainResult(start_step=start_step, param_bytes_per_rank=rank_bytes, param_bytes_total=param_total)
    with contextlib.ExitStack() as stack:  # the metrics file and the progress bar close on an error too
        metrics_f = _open_metrics(cfg, start_step, stack) if cfg.metrics and rank == 0 else None
        bar = None
        if cfg.progress and rank == 0:
            bar = stack.enter_context(tqdm(total=cfg.steps, initial=start_step, desc=f"ndp-train {cfg.model}",
                                           dynamic_ncols=True))
        skipped = 0
        run.model.train()
        for step in range(start_step, end_step):
            t0 = time.perf_counter()
            batch = run.dataset.global_batch(step)
            loss_sum = _forward_backward(cfg, run, batch)
            if step_hook is not None:
                step_hook(step, run.model)
            gnorm = clip_grad_norm_(run.model.parameters(), cfg.grad_clip)
            if run.loss_group is not None:
                dist.all_reduce(loss_sum, group=run.loss_group)
            loss = loss_sum.item() / max(1, batch.num_tokens)
            finite, skipped = _update(cfg, run, step, loss, gnorm, skipped)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            rec = _record(cfg, run, result, step, batch, loss, gnorm, time.perf_counter() - t0)
            if not finite:
                rec["skipped"] = True
            if schedule_note is not None:
                rec["note"], schedule_note = schedule_note, None
            if metrics_f is not None:
                metrics_f.write(json.dumps(rec) + "\n")
                metrics_f.flush()
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{rec['tokens_per_s']:,.0f}",
                                step_s=f"{rec['step_time_s']:.2f}", mem=f"{rec['peak_mem_mb']:.0f}MB")
                bar.update(1)
            done = step + 1
            if cfg.save_dir and ((cfg.save_every and done % cfg.save_every == 0) or done == end_step):
                ckpt.save_checkpoint(cfg.save_dir, done, run.model, run.opt, run.sched, before_commit=before_commit,
                                     meta=ckpt_meta)
    _finish(cfg, run, result, return_state, end_step, t_start, rank)
    return result


def _record(cfg: TrainConfig, run: _Run, result: TrainResult, step: int, batch, loss: float, gnorm,
            dt: float) -> dict:
    """The step's metrics record, its figures appended to ``result``."""
    tps = batch.input_ids.numel() / dt
    result.losses.append(loss)
    result.grad_norms.append(float(gnorm))
    result.tokens_per_s.append(tps)
    result.step_times.append(dt)
    return {"step": step + 1, "loss": loss, "lr": run.sched.get_last_lr()[0], "grad_norm": float(gnorm),
            "tokens_per_s": tps, "step_time_s": dt, "tokens": batch.num_tokens,
            "peak_mem_mb": _peak_mem_mb(run.device), "schedule_steps": cfg.steps}


def _finish(cfg: TrainConfig, run: _Run, result: TrainResult, return_state: bool, end_step: int, t_start: float,
            rank: int) -> None:
    """Exports and the closing log lines."""
    if cfg.export_hf:
        ckpt.export_hf(run.model, cfg.export_hf)
    if return_state:
        result.state_dict = ckpt.full_state_dict(run.model)
    result.wall_time = time.perf_counter() - t_start
    if cfg.stop_after and end_step < cfg.steps and rank == 0:
        logger.info("stopped after step %d (--stop-after); continue with --resume (same --steps %d)", end_step,
                    cfg.steps)
    if rank == 0 and result.losses:
        n = len(result.losses)
        logger.info("done: %d steps, final loss %.4f, mean %.0f tokens/s, %.1f s", n, result.losses[-1],
                    sum(result.tokens_per_s) / n, result.wall_time)
