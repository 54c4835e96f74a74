"""Training configuration: a frozen dataclass, built from flags, a YAML file and the environment.

Precedence: command-line flags > YAML (``--config FILE``) > environment (``NDP_*``) > defaults.
The flag names are a contract (scripts outside the repo call them).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import warnings
from dataclasses import dataclass, field

from ndp.hf.models import head_counts
from ndp.parallel import AC_MODES, CP_IMPLS, CP_LAYOUTS, CP_MIXERS, ParallelismConfig, ac_mode

from .presets import INITS

DTYPES = ("fp32", "bf16")
# fused: the LM head and the loss run fused (ndp.hf.head_loss), no [batch, seq, vocab] logits; full: cross_entropy
# on the model's logits (for a model whose head the fused path refuses).
LOSSES = ("fused", "full")
# Environment variables for the parallel degrees (as set by a launcher or a job script): the field each sets, and
# its type.
ENV_PARALLEL = {
    "NDP_DP_REPLICATE_SIZE": ("dp_replicate_size", int), "NDP_DP_SHARD_SIZE": ("dp_shard_size", int),
    "NDP_CP_SIZE": ("cp_size", int), "NDP_TP_SIZE": ("tp_size", int), "NDP_CP_IMPL": ("cp_impl", str),
    "NDP_ULYSSES_SIZE": ("ulysses_size", int), "NDP_CP_LAYOUT": ("cp_layout", str),
    "NDP_CP_MIXERS": ("cp_mixers", str),
}


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs (see ``ndp-train --help``).

    Raises:
        ValueError: a value out of range (checked in ``__post_init__``; checks that need the model or the
            world size are in :meth:`check`).
    """

    model: str = "tiny-llama"
    parallel: ParallelismConfig = field(default_factory=ParallelismConfig)
    seq_len: int = 256
    batch_size: int = 8
    grad_accum: int = 1
    sharded_grad_accum: bool = False  # reduce-scatter every micro-batch (sharded accumulators) instead of the last
    steps: int = 100
    lr: float = 1e-3
    warmup: int | None = None
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    dtype: str = "fp32"
    data: str | None = None
    pack_docs: bool = False
    metrics: str | None = None
    save_dir: str | None = None
    save_every: int = 0
    resume: bool = False
    export_hf: str | None = None
    activation_checkpointing: str = "none"  # one of AC_MODES (a bool is read as True: full, False: none)
    activation_offload: bool = False
    compile: bool = False  # torch.compile each decoder layer (ndp.parallelize(..., compile=True))
    device: str = "auto"
    progress: bool = True
    stop_after: int | None = None
    skip_nonfinite: int = 0
    init: str = "full"
    loss: str = "fused"

    def __post_init__(self):
        object.__setattr__(self, "activation_checkpointing", ac_mode(self.activation_checkpointing))
        for name in ("seq_len", "batch_size", "grad_accum", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {name}={getattr(self, name)}")
        if self.save_every < 0:
            raise ValueError(f"save_every must be >= 0; got {self.save_every}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}; got {self.dtype!r}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0; got {self.lr}")
        if self.resume and not self.save_dir:
            raise ValueError("--resume needs --save-dir (where the checkpoints are)")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda; got {self.device!r}")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            raise ValueError(f"--stop-after must be in [1, steps]; got stop_after={self.stop_after}, "
                             f"steps={self.steps}. It ends this run after that step; --steps keeps setting the "
                             f"learning-rate schedule.")
        if self.stop_after is not None and not self.save_dir:
            raise ValueError("--stop-after saves a checkpoint to resume from: it needs --save-dir")
        if self.init not in INITS:
            raise ValueError(f"--init must be one of {', '.join(INITS)} (full: build the whole model on CPU, then "
                             f"shard it; meta: build it on the meta device and materialize only this rank's "
                             f"shards); got init={self.init!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"--loss must be one of {', '.join(LOSSES)} (fused: the LM head and the loss in one "
                             f"op, no logits tensor; full: cross_entropy on the model's logits); got {self.loss!r}")
        if self.skip_nonfinite < 0:
            raise ValueError(f"--skip-nonfinite must be >= 0 (steps with a non-finite loss or gradient that may be "
                             f"skipped before the run stops); got {self.skip_nonfinite}")

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else max(1, self.steps // 10)

    def check(self, world_size: int) -> None:
        """Checks against the job and the model; run before any process-group work.

        Raises:
            ValueError: degrees vs world size, heads vs tp/ulysses, seq_len vs the CP layout, batch vs
                dp * grad_accum, an --export-hf path that cannot be written (each message names the values).
        Warns: a seq_len above the model's max_position_embeddings.
        """
        from .presets import has_weights, model_config

        p = self.parallel
        p.check_world_size(world_size)
        if self.init == "meta" and os.path.isdir(self.model) and has_weights(self.model):
            raise ValueError(f"--init meta builds random weights shard by shard; --model {self.model!r} is a model "
                             f"directory whose weights are loaded whole. Use --init full for it.")
        cfg = model_config(self.model)
        for heads, kv in head_counts(cfg):
            p.check_heads(heads, kv)
        if not self.pack_docs:
            p.check_seq_len(self.seq_len)
        limit = getattr(cfg, "max_position_embeddings", None)
        if limit and self.seq_len > limit and not self.pack_docs:
            # Warned, not refused: extending a model's context is what long-sequence training is for.
            warnings.warn(f"--seq-len {self.seq_len} is above the model's max_position_embeddings={limit} "
                          f"({self.model}): positions past it were never trained and its RoPE is set for {limit}. "
                          f"For a context extension, use a model directory whose config.json sets "
                          f"max_position_embeddings and the RoPE scaling for {self.seq_len}.", stacklevel=2)
        if self.batch_size % (p.dp_size * self.grad_accum):
            raise ValueError(
                f"--batch-size (global sequences) must be divisible by dp_replicate*dp_shard*grad_accum; got "
                f"batch_size={self.batch_size}, dp_replicate={p.dp_replicate_size}, dp_shard={p.dp_shard_size}, "
                f"grad_accum={self.grad_accum}. Use a multiple of {p.dp_size * self.grad_accum}.")
        if self.export_hf:
            _check_writable_dir("--export-hf", self.export_hf)

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)


def _check_writable_dir(flag: str, path: str) -> None:
    """Raises ValueError unless `path` is a directory that exists or can be created, and can be written."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a file; it must be a directory (created when missing).")
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path!r} cannot be written: {parent!r} is not a writable directory. Choose a "
                         f"directory you can write, checked now so that a run does not end without its export.")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ndp-train", description="ND-parallel (DP/FSDP2/TP/CP) causal-LM training.")
    a = p.add_argument
    a("--config", help="YAML file with any of the options below (flags win)")
    a("--model", help="preset (tiny-llama, small-llama, tiny-qwen2, ...) or a local HF model directory")
    a("--dp-replicate", type=int, help="replicas (DDP / HSDP replicate axis)")
    a("--dp-shard", type=int, help="FSDP2 shards")
    a("--cp", type=int, help="context-parallel degree")
    a("--tp", type=int, help="tensor-parallel degree")
    a("--cp-impl", choices=CP_IMPLS)
    a("--ulysses", type=int, help="Ulysses degree inside the CP group (cp-impl usp)")
    a("--cp-layout", choices=CP_LAYOUTS)
    a("--cp-mixers", choices=CP_MIXERS, help="gather: run a hybrid model's recurrent, state-space and convolution "
                                           "layers on the whole sequence, gathered on every CP rank (exact; "
                                           "cp times their work); heads: run them on the gathered sequence split "
                                           "by heads over the CP ranks (exact; 1/cp of their work; the mixers "
                                           "ndp.hf.mixers.HEAD_SPLITS names); refuse (default): "
                                           "refuse such a model under CP")
    a("--seq-len", type=int)
    a("--batch-size", type=int, help="global batch, in sequences")
    a("--grad-accum", type=int)
    a("--sharded-grad-accum", action="store_true", default=None,
      help="under FSDP, reduce-scatter the gradients of every micro-batch into sharded accumulators (1/dp_shard "
           "of the gradient bytes held between micro-batches, one reduce-scatter per micro-batch) instead of "
           "accumulating whole gradients and reducing once, after the last")
    a("--steps", type=int)
    a("--lr", type=float)
    a("--warmup", type=int, help="linear warm-up steps (default steps/10), then cosine decay")
    a("--min-lr-ratio", type=float)
    a("--weight-decay", type=float)
    a("--grad-clip", type=float, help="max global grad norm (0: no clipping)")
    a("--seed", type=int)
    a("--dtype", choices=DTYPES)
    a("--data", help="text file (documents separated by blank lines); default the shipped corpus")
    a("--pack-docs", action="store_true", default=None, help="keep documents apart (per-document attention)")
    a("--metrics", help="JSONL metrics file (one object per step)")
    a("--save-dir")
    a("--save-every", type=int)
    a("--resume", action="store_true", default=None)
    a("--export-hf", help="write consolidated HF weights (safetensors + config) here at the end")
    a("--activation-checkpointing", nargs="?", const="full", metavar="|".join(AC_MODES),
      help="recompute activations in the backward: full (the flag alone) recomputes each decoder layer; selective "
           "keeps its matmul outputs and recomputes the rest (element-wise ops, attention); none (default)")
    a("--activation-offload", action="store_true", default=None,
      help="copy the activations saved for the backward to pinned host memory in the forward (on a side stream) "
           "and bring them back ahead of the backward (with --activation-checkpointing: the layers' inputs)")
    a("--compile", action="store_true", default=None,
      help="torch.compile each decoder layer (whole, no graph break: ndp's attention and CP are custom ops)")
    a("--device", choices=("auto", "cpu", "cuda"))
    a("--no-progress", dest="progress", action="store_false", default=None)
    a("--stop-after", type=int, help="save and exit cleanly after this step (a time slice); the learning-rate "
                                     "schedule stays that of --steps")
    a("--skip-nonfinite", type=int, help="skip up to N steps whose loss or gradient norm is not finite "
                                         "(default 0: stop at the first)")
    # No argparse choices: TrainConfig names the choices (the same message for flags and YAML).
    a("--init", help=f"one of {'|'.join(INITS)}: full (default) builds the whole model on CPU and shards it; "
                     f"meta builds it on the meta device and materializes only this rank's shards, with the "
                     f"same values")
    a("--loss", help=f"one of {'|'.join(LOSSES)}: fused (default) computes the LM head and the token loss a chunk of "
                     f"tokens at a time, never the [batch, seq, vocab] logits; full computes the logits (for a "
                     f"model whose head the fused path refuses)")
    return p


_FLAG_TO_PARALLEL = {"dp_replicate": "dp_replicate_size", "dp_shard": "dp_shard_size", "cp": "cp_size",
                     "tp": "tp_size", "cp_impl": "cp_impl", "ulysses": "ulysses_size", "cp_layout": "cp_layout",
                     "cp_mixers": "cp_mixers"}


def _norm_key(k: str) -> str:
    return k.replace("-", "_")


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _as_flag_type(where: str, key: str, value, action):
    """A YAML value converted as its flag's value would be (``lr: 3e-3`` is a string to YAML; "8" is quoted)."""
    want = action.type if action is not None else None
    try:
        if action is not None and action.nargs == 0:  # store_true / store_false flags
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
                return value.lower() in _TRUE
            raise ValueError
        if want is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if want is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
    except (TypeError, ValueError):
        kind = "true or false" if action.nargs == 0 else ("an integer" if want is int else "a number")
        raise ValueError(f"{where}: {key} must be {kind} (as its flag --{key.replace('_', '-')}); got {value!r}") \
            from None
    if action is not None and action.choices is not None and value not in action.choices:
        raise ValueError(f"{where}: {key} must be one of {list(action.choices)}; got {value!r}")
    return value


def parse_config(argv=None, env=None) -> TrainConfig:
    """TrainConfig from flags, ``--config`` YAML and ``NDP_*`` environment variables.

    Raises:
        ValueError: unknown YAML keys, bad values (messages name the option).
    """
    env = os.environ if env is None else env
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    actions = {a.dest: a for a in parser._actions}
    by_parallel = {v: actions.get(k) for k, v in _FLAG_TO_PARALLEL.items()}
    values: dict = {}
    parallel: dict = {}
    for var, (name, kind) in ENV_PARALLEL.items():
        if env.get(var):
            parallel[name] = kind(env[var])
    if args.get("config"):
        import yaml

        with open(args["config"], encoding="utf-8") as f:
            doc = yaml.safe_load(f) or {}
        if not isinstance(doc, dict):
            raise ValueError(f"{args['config']}: expected a mapping of options, got {type(doc).__name__}")
        known = {f.name for f in dataclasses.fields(TrainConfig)} | set(_FLAG_TO_PARALLEL) | set(
            _FLAG_TO_PARALLEL.values())
        for k, v in doc.items():
            k = _norm_key(k)
            if k == "parallel" and isinstance(v, dict):
                for pk, pv in v.items():
                    pk = _FLAG_TO_PARALLEL.get(_norm_key(pk), _norm_key(pk))
                    parallel[pk] = _as_flag_type(args["config"], pk, pv, by_parallel.get(pk))
                continue
            if k not in known:
                import difflib

                close = difflib.get_close_matches(k, sorted(known), n=1)
                raise ValueError(f"{args['config']}: unknown option {k!r}"
                                 + (f"; did you mean {close[0]!r}?" if close else "")
                                 + f" Valid options: {', '.join(sorted(known))}.")
            if k in _FLAG_TO_PARALLEL or k in _FLAG_TO_PARALLEL.values():
                pk = _FLAG_TO_PARALLEL.get(k, k)
                parallel[pk] = _as_flag_type(args["config"], k, v, by_parallel.get(pk))
            else:
                values[k] = _as_flag_type(args["config"], k, v, actions.get(k))
    for k, v in args.items():
        if v is None or k == "config":
            continue
        if k in _FLAG_TO_PARALLEL:
            parallel[_FLAG_TO_PARALLEL[k]] = v
        else:
            values[k] = v
    return TrainConfig(parallel=ParallelismConfig(**parallel), **values)
