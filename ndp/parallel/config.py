"""ParallelismConfig: the degrees of every parallelism and the checks that tie them together.

Field names follow Hugging Face Accelerate's ``ParallelismConfig`` (``dp_replicate_size``,
``dp_shard_size``, ``cp_size``, ``tp_size``) so that a user of ``accelerate`` reads them without a manual.
Parsing (flags, YAML, environment) lives in ``ndp.train``; this layer takes explicit values only.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .mesh import MESH_AXES, build_device_mesh

CP_IMPLS = ("ring", "allgather", "ulysses", "usp")
CP_LAYOUTS = ("zigzag", "contiguous", "striped")
# What CP does with a model's token mixers outside attention (recurrent, state-space, short convolutions).
CP_MIXERS = ("refuse", "gather", "heads")
# The fields Accelerate's ParallelismConfig has no name for.
NDP_FIELDS = ("cp_impl", "ulysses_size", "cp_layout", "cp_mixers")


@dataclass(frozen=True)
class ParallelismConfig:
    """Degrees of data, context and tensor parallelism; their product is the world size.

    Args:
        dp_replicate_size: replicas of the model (DDP / the replicate axis of HSDP).
        dp_shard_size: FSDP2 shards of the model within one replica.
        cp_size: context-parallel degree (the sequence is split over this many ranks).
        tp_size: tensor-parallel degree (heads and MLP columns are split over this many ranks).
        cp_impl: "ring" | "allgather" | "ulysses" | "usp".
        ulysses_size: all-to-all degree inside the CP group; only "usp" uses a value other than 1
            (``cp_size // ulysses_size`` ring ranks); "ulysses" accepts 1 or ``cp_size``.
        cp_layout: "zigzag" | "contiguous" | "striped" (how the sequence is split over CP ranks).
        cp_mixers: "refuse" | "gather" | "heads": what CP does with a model's layers that mix tokens outside
            attention (recurrent, state-space, linear-attention, short convolutions: a hybrid model's). "refuse"
            (default): such a model is refused by name; "gather": each runs on the whole sequence, gathered on every
            CP rank (exact; cp_size times their work and their activations for the whole sequence); "heads": each
            runs on the gathered sequence split by heads over the CP ranks (exact; 1/cp_size of their work each; the
            mixers ``ndp.hf.mixers.HEAD_SPLITS`` names: gated DeltaNets and delta attention, Mamba2 and Mamba1
            layers, MiniMax's lightning attention, LFM's short convolutions; others refused by name).

    Raises:
        TypeError: a size is not an int.
        ValueError: a size < 1, an unknown impl or layout, or ``ulysses_size`` not fitting ``cp_impl``.
    """

    dp_replicate_size: int = 1
    dp_shard_size: int = 1
    cp_size: int = 1
    tp_size: int = 1
    cp_impl: str = "ring"
    ulysses_size: int = 1
    cp_layout: str = "zigzag"
    cp_mixers: str = "refuse"

    def __post_init__(self):
        for name in ("dp_replicate_size", "dp_shard_size", "cp_size", "tp_size", "ulysses_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"ParallelismConfig.{name} must be an int; got {value!r} "
                                f"({type(value).__name__})")
            if value < 1:
                raise ValueError(f"ParallelismConfig.{name} must be >= 1; got {name}={value}")
        if self.cp_impl not in CP_IMPLS:
            raise ValueError(f"cp_impl must be one of {CP_IMPLS}; got cp_impl={self.cp_impl!r}")
        if self.cp_layout not in CP_LAYOUTS:
            raise ValueError(f"cp_layout must be one of {CP_LAYOUTS}; got cp_layout={self.cp_layout!r}")
        if self.cp_mixers not in CP_MIXERS:
            raise ValueError(f"cp_mixers must be one of {CP_MIXERS}; got cp_mixers={self.cp_mixers!r}")
        if self.cp_size % self.ulysses_size:
            raise ValueError(f"ulysses_size must divide cp_size; got ulysses_size={self.ulysses_size}, "
                             f"cp_size={self.cp_size}. Pick ulysses_size in "
                             f"{[d for d in range(1, self.cp_size + 1) if self.cp_size % d == 0]}.")
        if self.cp_impl == "usp":
            if self.cp_size > 1 and not 1 < self.ulysses_size < self.cp_size:
                raise ValueError(
                    f"cp_impl='usp' needs 1 < ulysses_size < cp_size (an all-to-all group inside a ring); "
                    f"got ulysses_size={self.ulysses_size}, cp_size={self.cp_size}. Use cp_impl='ulysses' "
                    f"for ulysses_size == cp_size or cp_impl='ring' for ulysses_size == 1.")
        elif self.cp_impl == "ulysses":
            if self.ulysses_size not in (1, self.cp_size):
                raise ValueError(f"cp_impl='ulysses' uses the whole CP group; got ulysses_size="
                                 f"{self.ulysses_size}, cp_size={self.cp_size}. Set ulysses_size=1 (or "
                                 f"{self.cp_size}), or use cp_impl='usp' for a ulysses x ring split.")
        elif self.ulysses_size != 1:
            raise ValueError(f"ulysses_size={self.ulysses_size} only applies to cp_impl='usp' or 'ulysses'; "
                             f"got cp_impl={self.cp_impl!r}. Set ulysses_size=1 or cp_impl='usp'.")

    # ------------------------------------------------------------------ derived sizes
    @property
    def world_size(self) -> int:
        """dp_replicate_size * dp_shard_size * cp_size * tp_size."""
        return self.dp_replicate_size * self.dp_shard_size * self.cp_size * self.tp_size

    @property
    def dp_size(self) -> int:
        """Number of distinct data streams (dp_replicate_size * dp_shard_size)."""
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def fsdp_size(self) -> int:
        """Ranks over which gradients are averaged by FSDP/HSDP (dp_replicate * dp_shard * cp)."""
        return self.dp_replicate_size * self.dp_shard_size * self.cp_size

    @property
    def head_parallel_size(self) -> int:
        """All-to-all degree that splits attention heads inside the CP group (1 for ring/allgather)."""
        if self.cp_impl == "ulysses":
            return self.cp_size
        if self.cp_impl == "usp":
            return self.ulysses_size
        return 1

    @classmethod
    def from_accelerate(cls, config, **ndp_fields) -> "ParallelismConfig":
        """ndp's config from Accelerate's ``ParallelismConfig`` (or any object with its size fields), e.g. one
        ``accelerate launch --use_parallelism_config`` filled from the environment. ``ndp_fields``: the fields
        Accelerate has no name for (``NDP_FIELDS``: ``cp_impl``, ``ulysses_size``, ``cp_layout``, ``cp_mixers``;
        their defaults otherwise).
        Accelerate's ``cp_handler`` (torch's ring rotation) does not apply: ndp runs its own CP attention.

        Raises:
            ValueError: ``sp_size > 1`` (DeepSpeed's sequence parallelism; ndp's all-to-all is
                ``cp_impl="ulysses"``), or a field ndp does not have.
            TypeError: `config` lacks Accelerate's size fields.
        """
        missing = [f"{a}_size" for a in MESH_AXES if not hasattr(config, f"{a}_size")]
        if missing:
            raise TypeError(f"expected ndp's or Accelerate's ParallelismConfig; got {type(config).__name__} "
                            f"without {missing}")
        sp = getattr(config, "sp_size", 1) or 1
        if sp > 1:
            raise ValueError(f"sp_size={sp} is DeepSpeed's sequence parallelism, which ndp does not run; for an "
                             f"all-to-all over the sequence set cp_size={sp} and cp_impl='ulysses' instead")
        bad = sorted(set(ndp_fields) - set(NDP_FIELDS))
        if bad:
            raise ValueError(f"from_accelerate takes only ndp's own fields ({', '.join(NDP_FIELDS)}); got {bad}")
        return cls(**{f"{a}_size": getattr(config, f"{a}_size") or 1 for a in MESH_AXES}, **ndp_fields)

    def replace(self, **changes) -> "ParallelismConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ checks against the job
    def check_world_size(self, world_size: int) -> None:
        """Raise ValueError unless the product of the degrees equals ``world_size``."""
        if self.world_size != world_size:
            raise ValueError(
                f"dp_replicate_size * dp_shard_size * cp_size * tp_size must equal the world size; got "
                f"dp_replicate_size={self.dp_replicate_size} * dp_shard_size={self.dp_shard_size} * "
                f"cp_size={self.cp_size} * tp_size={self.tp_size} = {self.world_size}, world_size="
                f"{world_size}. Change the degrees or launch {self.world_size} processes.")

    def check_heads(self, num_heads: int, num_kv_heads: int) -> None:
        """Raise ValueError unless TP (and the Ulysses all-to-all) can split the attention heads."""
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads must be a multiple of num_kv_heads; got num_heads={num_heads}, "
                             f"num_kv_heads={num_kv_heads}")
        tp = self.tp_size
        if num_heads % tp or num_kv_heads % tp:
            raise ValueError(
                f"tensor parallel splits heads: num_heads and num_kv_heads must be divisible by tp_size; got "
                f"num_heads={num_heads}, num_kv_heads={num_kv_heads}, tp_size={tp}. Pick tp_size dividing "
                f"{_gcd(num_heads, num_kv_heads)}.")
        u = self.head_parallel_size
        if u > 1:
            local_heads, local_kv = num_heads // tp, num_kv_heads // tp
            if local_heads % u:
                raise ValueError(
                    f"cp_impl={self.cp_impl!r} splits heads over an all-to-all of degree {u}: num_heads / "
                    f"tp_size must be divisible by it; got num_heads={num_heads}, tp_size={tp}, "
                    f"degree={u}. Use fewer ulysses ranks or cp_impl='ring'.")
            if local_kv % u and u % local_kv:
                raise ValueError(
                    f"cp_impl={self.cp_impl!r} needs num_kv_heads / tp_size and the all-to-all degree to "
                    f"divide one another; got num_kv_heads={num_kv_heads}, tp_size={tp}, degree={u}.")

    def check_seq_len(self, seq_len: int) -> None:
        """Raise ValueError unless ``seq_len`` splits evenly over the CP ranks in ``cp_layout``."""
        n = self.cp_size
        if n == 1:
            return
        need = 2 * n if self.cp_layout == "zigzag" else n
        if seq_len % need:
            raise ValueError(
                f"{self.cp_layout} sharding needs seq_len divisible by "
                f"{'2*cp_size' if self.cp_layout == 'zigzag' else 'cp_size'}; got seq_len={seq_len}, "
                f"cp_size={n}. Use seq_len a multiple of {need}"
                + (" or cp_layout='contiguous'." if self.cp_layout == "zigzag" else "."))

    def build_device_mesh(self, device_type: str):
        """One DeviceMesh over all ranks with axes (dp_replicate, dp_shard, cp, tp).

        The flattened axes ``dp`` (dp_replicate x dp_shard: data streams), ``dp_shard_cp`` (FSDP's shard
        axis) and ``dp_cp`` (loss averaging) are registered on it. Needs an initialized default process
        group whose size equals ``self.world_size``.

        Raises:
            RuntimeError: no default process group.  ValueError: world size mismatch.
        """
        return build_device_mesh(self, device_type)


def as_config(config) -> ParallelismConfig:
    """`config` as ndp's ParallelismConfig: ndp's as it is, Accelerate's through ``from_accelerate``."""
    return config if isinstance(config, ParallelismConfig) else ParallelismConfig.from_accelerate(config)


def _gcd(a, b):
    while b:
        a, b = b, a % b
    return a
