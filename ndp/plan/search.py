"""Enumerate every valid ``ParallelismConfig`` for N GPUs, estimate each, rank them, and say what would fit."""
from __future__ import annotations

from dataclasses import dataclass

from ndp.parallel.config import ParallelismConfig

from .cost import LOSSES, GiB, Estimate, Topology, estimate
from .spec import GpuProfile, ModelSpec

AC_CHOICES = ("auto", "none", "selective", "full")
# Memory options in order of cost, each tried when nothing fits with the ones before (checkpointing mode, offload)
_AC_STEPS = {"none": [("none", False)], "selective": [("selective", False)], "full": [("full", False), ("full", True)],
             "auto": [("none", False), ("selective", False), ("full", False), ("full", True)]}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class PlanRequest:
    """What the user asks: model, GPUs, sequence and batch.

    Args:
        spec: the model. profile: the GPU kind. gpus: total GPUs. gpus_per_node: GPUs per node (TP and
            Ulysses groups stay inside one). seq_len: tokens per sequence. batch_size: global batch in
            sequences. dtype: "bf16" | "fp32". activation_checkpointing: "auto" (without, else selective, else
            full, else full with the layers' inputs offloaded, per candidate) | "none" | "selective" | "full"
            (with offload where it does not fit without). loss: "fused" (ndp-train's default) | "full".

    Raises:
        ValueError: a non-positive size, gpus not a multiple of gpus_per_node (when larger), an odd seq_len
            with more than one GPU (no CP degree could split it), an unknown dtype or checkpointing choice.
    """

    spec: ModelSpec
    profile: GpuProfile
    gpus: int
    seq_len: int
    batch_size: int
    gpus_per_node: int = 8
    dtype: str = "bf16"
    activation_checkpointing: str = "auto"
    loss: str = "fused"

    def __post_init__(self):
        for f in ("gpus", "seq_len", "batch_size", "gpus_per_node"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f} must be a positive int; got {f}={v!r}")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(f"gpus must fill whole nodes: a multiple of gpus_per_node when larger; got gpus="
                             f"{self.gpus}, gpus_per_node={self.gpus_per_node}. Use gpus = "
                             f"{self.gpus // self.gpus_per_node * self.gpus_per_node} or "
                             f"{-(-self.gpus // self.gpus_per_node) * self.gpus_per_node}.")
        if self.dtype not in ("bf16", "fp32"):
            raise ValueError(f"dtype must be bf16 or fp32; got {self.dtype!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}; got {self.loss!r}")
        if self.activation_checkpointing not in AC_CHOICES:
            raise ValueError(f"activation_checkpointing must be one of {AC_CHOICES}; got "
                             f"{self.activation_checkpointing!r}")

    @property
    def topology(self) -> Topology:
        return Topology(self.gpus, min(self.gpus_per_node, self.gpus) if self.gpus < self.gpus_per_node
                        else self.gpus_per_node)


def enumerate_configs(spec: ModelSpec, gpus: int, gpus_per_node: int, seq_len: int, batch_size: int):
    """Every ParallelismConfig that ndp accepts for this job (zigzag layout), TP and Ulysses inside a node.

    A config is kept when ``ParallelismConfig`` validates it, ``check_heads`` accepts the model's heads (kv
    heads included), ``check_seq_len`` accepts ``seq_len``, the global batch splits over ``dp_size``, and its
    tp group (and Ulysses group) lies inside one node.

    Returns:
        list of ParallelismConfig, in a fixed order.
    """
    topo = Topology(gpus, min(gpus_per_node, gpus))
    out = []
    for tp in _divisors(gpus):
        if not topo.intra_node(tp, 1):
            continue
        for cp in _divisors(gpus // tp):
            rest = gpus // tp // cp
            for rep in _divisors(rest):
                shard = rest // rep
                impls = [("ring", 1)]
                if cp > 1:
                    impls = [("ring", 1), ("allgather", 1), ("ulysses", cp)]
                    impls += [("usp", u) for u in _divisors(cp) if 1 < u < cp]
                for impl, u in impls:
                    try:
                        c = ParallelismConfig(dp_replicate_size=rep, dp_shard_size=shard, cp_size=cp, tp_size=tp,
                                              cp_impl=impl, ulysses_size=u)
                        c.check_world_size(gpus)
                        c.check_heads(spec.num_heads, spec.num_kv_heads)
                        c.check_seq_len(seq_len)
                    except ValueError:
                        continue
                    if batch_size % c.dp_size:
                        continue
                    if c.head_parallel_size > 1 and not topo.intra_node(c.head_parallel_size, tp):
                        continue
                    out.append(c)
    return out


def best_estimate(req: PlanRequest, cfg: ParallelismConfig) -> Estimate:
    """The fastest fitting (grad_accum, memory options) choice for ``cfg``; if none fits, the smallest one.

    grad_accum runs over the divisors of the per-rank batch (fewer sequences per micro-batch, less activation
    memory), with whole or (under FSDP, grad_accum > 1) sharded accumulators; checkpointing and offload step up
    as the request allows (``_AC_STEPS``) only while nothing fits.
    """
    per_rank = req.batch_size // cfg.dp_size
    best = smallest = None
    for ac, offload in _AC_STEPS[req.activation_checkpointing]:
        for ga in _divisors(per_rank):
            for sharded in (False, True) if ga > 1 and cfg.fsdp_size > 1 else (False,):
                e = estimate(req.spec, cfg, req.profile, req.topology, seq_len=req.seq_len,
                             batch_size=req.batch_size, grad_accum=ga, dtype=req.dtype, activation_checkpointing=ac,
                             loss=req.loss, activation_offload=offload, sharded_grad_accum=sharded)
                if e.fits and (best is None or e.step_s < best.step_s):
                    best = e
                if smallest is None or e.peak_bytes < smallest.peak_bytes:
                    smallest = e
        if best is not None:
            break
    return best if best is not None else smallest


def plan(req: PlanRequest) -> list[Estimate]:
    """All candidates, estimated: the fitting ones first by tokens/s per GPU, then the others by memory.

    Raises:
        ValueError: no valid ParallelismConfig at all (the message names the constraint that rules them out).
    """
    cfgs = enumerate_configs(req.spec, req.gpus, req.gpus_per_node, req.seq_len, req.batch_size)
    if not cfgs:
        raise ValueError(_why_none(req))
    ests = [best_estimate(req, c) for c in cfgs]
    return sorted(ests, key=lambda e: (not e.fits, -e.tokens_per_s if e.fits else e.peak_bytes))


def _why_none(req: PlanRequest) -> str:
    s, b = req.spec, req.batch_size
    return (f"no ParallelismConfig of {req.gpus} GPUs is valid for {s.name} (num_heads={s.num_heads}, "
            f"num_kv_heads={s.num_kv_heads}), seq_len={req.seq_len}, batch_size={b}: every split needs "
            f"dp_replicate*dp_shard dividing the batch, tp dividing the heads and kv heads within a node of "
            f"{req.gpus_per_node}, and seq_len divisible by 2*cp_size. Use a batch that is a multiple of the "
            f"data-parallel degree you want or a seq_len that is a multiple of {2 * req.gpus}.")


def suggest(req: PlanRequest) -> str:
    """The smallest change that makes something fit, tried in order: checkpointing, more GPUs (up to 64x),
    a shorter sequence (down to 1/64). Returns a sentence, or '' when none of those fits."""
    import dataclasses

    def any_fit(r):
        try:
            return next((e for e in plan(r) if e.fits), None)
        except ValueError:
            return None

    if req.activation_checkpointing != "auto":
        e = any_fit(dataclasses.replace(req, activation_checkpointing="auto"))
        if e is not None:
            return f"--activation-checkpointing auto would fit ({' '.join(e.flags) or 'none needed'})"
    ac = "auto"
    g = req.gpus
    for _ in range(6):
        g *= 2
        r = dataclasses.replace(req, gpus=g, activation_checkpointing=ac,
                                batch_size=req.batch_size)
        e = any_fit(r)
        if e is not None:
            return f"--gpus {g} would fit (best there: {describe(e.config)}, {e.peak_bytes / GiB:.1f} GiB)"
    s = req.seq_len
    for _ in range(6):
        if s % 2:
            break
        s //= 2
        e = any_fit(dataclasses.replace(req, seq_len=s, activation_checkpointing=ac))
        if e is not None:
            return f"--seq-len {s} would fit on {req.gpus} GPUs (best there: {describe(e.config)})"
    return ""


def describe(cfg: ParallelismConfig) -> str:
    """Short name of a config, e.g. 'dp2 x fsdp4 x cp8(usp u4) x tp2'."""
    parts = []
    if cfg.dp_replicate_size > 1:
        parts.append(f"rep{cfg.dp_replicate_size}")
    if cfg.dp_shard_size > 1:
        parts.append(f"fsdp{cfg.dp_shard_size}")
    if cfg.cp_size > 1:
        impl = cfg.cp_impl + (f" u{cfg.ulysses_size}" if cfg.cp_impl == "usp" else "")
        parts.append(f"cp{cfg.cp_size}({impl})")
    if cfg.tp_size > 1:
        parts.append(f"tp{cfg.tp_size}")
    return " x ".join(parts) or "1 GPU"


def train_flags(req: PlanRequest, e: Estimate, model: str) -> str:
    """The ``ndp-train`` command line that runs estimate ``e`` (torchrun with one process per GPU)."""
    c = e.config
    flags = [f"--model {model}", f"--dp-replicate {c.dp_replicate_size}", f"--dp-shard {c.dp_shard_size}",
             f"--cp {c.cp_size}", f"--tp {c.tp_size}", f"--cp-impl {c.cp_impl}"]
    if c.cp_impl == "usp":
        flags.append(f"--ulysses {c.ulysses_size}")
    flags += [f"--cp-layout {c.cp_layout}", f"--seq-len {req.seq_len}", f"--batch-size {req.batch_size}",
              f"--grad-accum {e.grad_accum}", f"--dtype {req.dtype}"] + e.flags
    nodes = max(1, req.gpus // req.gpus_per_node)
    launcher = (f"torchrun --nproc-per-node {min(req.gpus, req.gpus_per_node)}"
                + (f" --nnodes {nodes}" if nodes > 1 else " --standalone"))
    return f"{launcher} -m ndp.train " + " ".join(flags)
