"""Token mixers outside attention under context parallelism, run on the gathered sequence.

A recurrent, state-space, linear-attention or short-convolution layer (Mamba's mixer, Qwen3-Next's gated DeltaNet,
LFM's short convolution) carries information along the whole sequence: on a rank's shard alone it would restart its
state at every shard. With ``ParallelismConfig(cp_mixers="gather")`` ndp runs each such layer on the whole sequence
instead: a forward pre-hook all-gathers its sequence inputs from the CP group (the hidden states, and every argument
laid out per token: a padding mask, position ids) and puts them in sequence order, the layer runs on them on every
rank, and a forward hook keeps this rank's shard of its per-token outputs. The result is exactly the layer on the
unsharded sequence. The backward sums every rank's gradient of this rank's inputs (a reduce-scatter): each rank's
parameter gradients are those of its own shard's outputs, as for every other layer under CP.

The cost is the layer's own: each rank computes it over the whole sequence (``cp_size`` times its work) and holds
its activations for the whole sequence. The attention layers, MLPs and the head stay sharded. A model whose every
token mixer is such a layer (no attention CP could split: Mamba, RWKV, xLSTM) is refused: CP would split nothing.

``cp_mixers="heads"`` splits the work instead (a gated DeltaNet's, whose heads are independent, ``HEAD_SPLITS``): each
rank runs the layer on the gathered sequence with its ``1/cp_size`` of the heads (its rows of the input projections,
its channels of the convolution, its columns of the output projection), and the partial outputs are summed over the
ranks and scattered back to the shards (``ndp.cp.reduce_scatter_sequence``); a part reading every head (Mamba1's
projection to dt, B and C; a norm over all the heads) sums the rank's share over the ranks. Exact as gathering is;
each rank computes the layer's ``1/cp_size`` and holds its activations' ``1/cp_size`` (the gathered input and the
summed output stay whole), the communication the same as gathering's.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
import math
from operator import attrgetter

import torch
from torch import nn
import torch.nn.functional as F

from ndp.cp import gather_sequence, reduce_scatter_sequence, shard_sequence, sum_over_group


def _reference(args, kwargs):
    """The module's hidden states: ``hidden_states``, else its first tensor input."""
    hidden = kwargs.get("hidden_states")
    return hidden if torch.is_tensor(hidden) else next((t for t in (*args, *kwargs.values()) if torch.is_tensor(t)),
                                                       None)


def _per_token(t, batch: int, seq: int, dim: int) -> bool:
    return torch.is_tensor(t) and t.dim() >= 2 and t.shape[0] in (1, batch) and t.shape[dim] == seq


def _each(value, fn):
    """fn applied to `value`, or to each item of a tuple or list of them (RoPE's (cos, sin)), one level down."""
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(fn(v) for v in value)
    return fn(value)


def gather_mixers(model: nn.Module, names: list[str], ctx) -> None:
    """Hook the modules `names` of `model` to run on the sequence gathered over ctx's CP group (module docstring)."""
    for name in names:
        module = model.get_submodule(name)
        conv = isinstance(module, nn.Conv1d)
        dim = -1 if conv else 1  # nn.Conv1d takes [batch, channels, seq]; the mixers take [batch, seq, ...]
        module.register_forward_pre_hook(_gather_inputs(ctx, dim), with_kwargs=True)
        module.register_forward_hook(_shard_outputs(ctx, dim, conv), with_kwargs=True)


def _gather_inputs(ctx, dim):
    def hook(module, args, kwargs):
        ref = _reference(args, kwargs)
        if ref is None or ref.dim() < 2:
            return None
        batch, seq = ref.shape[0], ref.shape[dim]

        def gather(t):
            if not _per_token(t, batch, seq, dim):
                return t
            return gather_sequence(t, dim=dim % t.dim(), group=ctx.group, layout=ctx.layout, reduce_grad=True)

        return tuple(_each(t, gather) for t in args), {k: _each(t, gather) for k, t in kwargs.items()}

    return hook


def _shard_outputs(ctx, dim, conv):
    def hook(module, args, kwargs, output):
        ref = _reference(args, kwargs)
        if ref is None or ref.dim() < 2:
            return None
        batch, full = ref.shape[0], ref.shape[dim]

        def shard(t):
            # a causal convolution's output runs past the sequence (its padding): the sequence is its first `full`
            if conv and torch.is_tensor(t) and t.dim() >= 2 and t.shape[dim] > full:
                t = t.narrow(dim, 0, full)
            if not _per_token(t, batch, full, dim):
                return t  # a state, a cache: not per token
            return shard_sequence(t, dim=dim % t.dim(), layout=ctx.layout, world_size=ctx.size, rank=ctx.rank)

        return _each(output, shard)

    return hook


@dataclass(frozen=True)
class HeadSplit:
    """How a token mixer's work splits over ranks by heads (``cp_mixers="heads"``).

    Attributes:
        unit: the attribute counting the groups of heads the ranks divide (a gated DeltaNet's key heads, each with
            its value heads; a short convolution's channels), dotted for one of its config's; a multiple of the CP
            size.
        scaled: the attributes counting heads or channels (dotted for a submodule's), divided by the CP size while a
            rank runs its heads.
        split: parameter (or buffer) -> (dim, segments): along dim it holds the segments, each laid out head by head
            (their sizes: attribute names, or products of them "a*b"; "" for the whole dim), and a rank takes its
            share of each; a segment marked "=" every head reads whole (Mamba2's B and C of its one group), and
            every rank takes it whole.
        shared: the parameters every head uses whole (a per-head norm's weight).
        once: the parameters the output takes once, not per head (the output projection's bias): rank 0 adds them.
        requires: attribute values the split holds for only (one group of B and C, no norm over all heads).
        derived: attribute -> its rank's value from a getter of the rank's attributes (a count of channels that
            holds whole segments besides split ones), set after the scaled ones.
        summed: submodule -> kind ("linear", "rms_norm" in ``_SUMMED``): the submodules reading every head (Mamba1's
            projection of all channels to dt, B and C; a norm over all the heads), each replaced while a rank runs by
            one that sums its heads' part over the CP group.
        during: attribute values while a rank runs its heads (``training=False``: transformers' fused Mamba2 kernel
            would take the norm over the rank's heads alone; its unfused path calls the module's norm, summed).
    """
    unit: str
    scaled: tuple
    split: dict
    shared: tuple = field(default=())
    once: tuple = field(default=())
    requires: dict = field(default_factory=dict)
    derived: dict = field(default_factory=dict)
    summed: dict = field(default_factory=dict)
    during: dict = field(default_factory=dict)


_DELTA_SCALED = ("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim")
_QKV = ("key_dim", "key_dim", "value_dim")  # the convolution's channels: queries, keys, values
_DELTA_GATES = {"conv1d.weight": (0, _QKV), "dt_bias": (0, ("",)), "A_log": (0, ("",))}
# Qwen3-Next's fused projections interleave q, k, v, z (and b, a) key-head group by group: a rank's rows are one piece
_QWEN3_NEXT = HeadSplit("num_k_heads", _DELTA_SCALED, {
    "in_proj_qkvz.weight": (0, ("",)), "in_proj_ba.weight": (0, ("",)), "out_proj.weight": (1, ("",)),
    **_DELTA_GATES}, shared=("norm.weight",))
_QWEN3_5 = HeadSplit("num_k_heads", _DELTA_SCALED, {
    "in_proj_qkv.weight": (0, _QKV), "in_proj_z.weight": (0, ("",)), "in_proj_b.weight": (0, ("",)),
    "in_proj_a.weight": (0, ("",)), "out_proj.weight": (1, ("",)), **_DELTA_GATES}, shared=("norm.weight",))
_OLMO_HYBRID = HeadSplit("num_k_heads", _DELTA_SCALED, {
    **{f"{p}_proj.weight": (0, ("",)) for p in "qkvabg"}, "o_proj.weight": (1, ("",)), **_DELTA_GATES},
    shared=("o_norm.weight",))
# LFM's short convolution: per channel (B * x, convolved, times C), its input projection's rows [B | C | x]
_CHANNELS = ("config.hidden_size",)
_SHORT_CONV = HeadSplit("config.hidden_size", (), {
    "in_proj.weight": (0, _CHANNELS * 3), "in_proj.bias": (0, _CHANNELS * 3), "conv.weight": (0, ("",)),
    "conv.bias": (0, ("",)), "out_proj.weight": (1, ("",))}, once=("out_proj.bias",))
# Nemotron-H's Mamba2: the ranks divide its groups (each with its heads, its B and C, its channels of the gated norm)
_XBC = ("intermediate_size", "n_groups*ssm_state_size", "n_groups*ssm_state_size")
_MAMBA2 = HeadSplit("n_groups", ("num_heads", "intermediate_size", "n_groups", "conv_dim"), {
    **{f"in_proj.{p}": (0, ("intermediate_size", *_XBC, "num_heads")) for p in ("weight", "bias")},
    **{f"conv1d.{p}": (0, _XBC) for p in ("weight", "bias")}, "norm.weight": (0, ("",)), "dt_bias": (0, ("",)),
    "A_log": (0, ("",)), "D": (0, ("",)), "out_proj.weight": (1, ("",))}, once=("out_proj.bias",))
# Falcon-H1's Mamba2 of one group, without a norm over the heads: the ranks divide its heads, each reads the group's
# B and C whole (its input projection scaled row by row by its muP vector, a buffer, split alike)
_ONE_GROUP = ("intermediate_size", "=ssm_state_size", "=ssm_state_size")
_IN_ROWS = (0, ("intermediate_size", *_ONE_GROUP, "num_heads"))
_FALCON_H1 = HeadSplit("num_heads", ("num_heads", "intermediate_size"), {
    **{f"in_proj.{p}": _IN_ROWS for p in ("weight", "bias")}, "mup_vector": (2, _IN_ROWS[1]),
    **{f"conv1d.{p}": (0, _ONE_GROUP) for p in ("weight", "bias")}, "dt_bias": (0, ("",)), "A_log": (0, ("",)),
    "D": (0, ("",)), "out_proj.weight": (1, ("",))}, once=("out_proj.bias",),
    requires={"n_groups": 1, "mamba_rms_norm": False},
    derived={"conv_dim": lambda get: get("intermediate_size") + 2 * get("ssm_state_size")})
# Bamba's, Granite 4's and Zamba2's Mamba2 of one group under a gated norm over all the heads: Falcon-H1's split, the
# norm's squares summed over the ranks
_NORMED_ONE_GROUP = HeadSplit(
    "num_heads", ("num_heads", "intermediate_size"),
    {k: v for k, v in _FALCON_H1.split.items() if k != "mup_vector"} | {"norm.weight": (0, ("",))},
    once=("out_proj.bias",), requires={"n_groups": 1}, derived=_FALCON_H1.derived,
    summed={"norm": "rms_norm"}, during={"training": False})
# Kimi's delta attention: a gated DeltaNet with a decay per channel; its gates' low-rank down-projections (forget,
# output) and the per-head norm read whole by every head
_KIMI_DELTA = HeadSplit("num_heads", ("num_heads", "qkv_dim", "conv_dim"), {
    **{f"{p}_proj.weight": (0, ("",)) for p in "qkvb"}, "conv1d.weight": (0, ("qkv_dim",) * 3),
    "forget_gate.dt_bias": (0, ("",)), "forget_gate.A_log": (2, ("",)), "forget_gate.f_b_proj.weight": (0, ("",)),
    "g_b_proj.weight": (0, ("",)), "o_proj.weight": (1, ("",))},
    shared=("forget_gate.f_a_proj.weight", "g_a_proj.weight", "o_norm.weight"))
# Bailing's (Ling / Ring linear) delta attention: Kimi's, its gates projected whole per head, its forget gate counting
# the heads too
_BAILING_DELTA = HeadSplit("num_heads", ("num_heads", "qkv_dim", "conv_dim", "forget_gate.num_heads",
                                         "forget_gate.qkv_dim"), {
    **{f"{p}_proj.weight": (0, ("",)) for p in "qkvbg"}, "conv1d.weight": (0, ("qkv_dim",) * 3),
    **{f"forget_gate.{p}": (0, ("",)) for p in ("A_log", "dt_bias", "f_proj.weight")}, "o_proj.weight": (1, ("",))},
    shared=("o_norm.weight",))
# MiniMax's lightning attention: per head (its decays, buffers, too), an RMS norm over all the heads summed
_LIGHTNING = HeadSplit("num_attention_heads", ("num_attention_heads",), {
    **{p: (0, ("",)) for p in ("qkv_proj.weight", "output_gate.weight", "norm.weight", "slope_rate", "query_decay",
                               "key_decay")}, "diagonal_decay": (1, ("",)), "out_proj.weight": (1, ("",))},
    summed={"norm": "rms_norm"})
# Zamba's Mamba1 of several heads, each with its own x_proj and dt_proj (its in_proj's rows: x and gate per channel)
_ZAMBA_MAMBA = HeadSplit("n_mamba_heads", ("n_mamba_heads", "intermediate_size"), {
    **{p: (0, ("",)) for p in ("in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias", "x_proj_weight",
                               "dt_proj_weight", "dt_proj_bias", "A_log", "D")}, "out_proj.weight": (1, ("",))},
    once=("out_proj.bias",))
# Jamba's Mamba1: per channel but for x_proj, which reads every channel (its partial products summed over the ranks)
# into dt, B and C; their norms and dt_proj's input whole on each rank
_MAMBA1 = HeadSplit("intermediate_size", ("intermediate_size",), {
    **{f"in_proj.{p}": (0, ("intermediate_size",) * 2) for p in ("weight", "bias")},
    **{f"{m}.{p}": (0, ("",)) for m in ("conv1d", "dt_proj") for p in ("weight", "bias")}, "A_log": (0, ("",)),
    "D": (0, ("",)), "x_proj.weight": (1, ("",)), "out_proj.weight": (1, ("",))}, once=("out_proj.bias",),
    shared=("dt_layernorm.weight", "b_layernorm.weight", "c_layernorm.weight"), summed={"x_proj": "linear"})
# The token mixers ndp splits by heads, by class name: each checked against one process (tests/hf/test_mixers.py).
HEAD_SPLITS = {"Qwen3NextGatedDeltaNet": _QWEN3_NEXT, "Qwen3_5GatedDeltaNet": _QWEN3_5,
               "Qwen3_5MoeGatedDeltaNet": _QWEN3_5, "LaraMiniGatedDeltaNet": _QWEN3_5,
               "OlmoHybridGatedDeltaNet": _OLMO_HYBRID, "Lfm2ShortConv": _SHORT_CONV,
               "Lfm2MoeShortConv": _SHORT_CONV, "Lfm3ShortConv": _SHORT_CONV, "NemotronHMamba2Mixer": _MAMBA2,
               "FalconH1Mixer": _FALCON_H1, "BambaMixer": _NORMED_ONE_GROUP,
               "GraniteMoeHybridMambaLayer": _NORMED_ONE_GROUP, "Zamba2MambaMixer": _NORMED_ONE_GROUP,
               "JambaMambaMixer": _MAMBA1, "KimiLinearDeltaAttention": _KIMI_DELTA,
               "BailingHybridDeltaAttention": _BAILING_DELTA, "MiniMaxLightningAttention": _LIGHTNING,
               "ZambaMambaMixer": _ZAMBA_MAMBA}
# The modules cp_mixers="gather" runs whole (ndp.hf.models.gathered_mixers) whose forward does per-token work alone
# around one mixer (Zamba's and Zamba2's Mamba decoder layer inside a hybrid layer: a norm, a sum, the residual):
# "heads" splits the mixer, the rest runs on the shard.
PER_TOKEN_WRAPPERS = {"ZambaMambaDecoderLayer": "mamba", "Zamba2MambaDecoderLayer": "mamba"}


def split_target(model: nn.Module, name: str) -> str:
    """The module that ``cp_mixers="heads"`` splits for the gathered module `name`: itself, or the mixer a
    ``PER_TOKEN_WRAPPERS`` module wraps."""
    child = PER_TOKEN_WRAPPERS.get(type(model.get_submodule(name)).__name__)
    return f"{name}.{child}" if child else name


def head_split_problem(module: nn.Module, size: int) -> str | None:
    """Why `module` cannot run split by heads over `size` ranks (a phrase), else None."""
    split = HEAD_SPLITS.get(type(module).__name__)
    if split is None:
        return f"ndp has no head split for {type(module).__name__} (it splits {', '.join(HEAD_SPLITS)})"
    wrong = {a: getattr(module, a, None) for a, v in split.requires.items() if getattr(module, a, None) != v}
    if wrong:
        return f"it has {wrong}, and its head split holds for {split.requires} only"
    tensors = _tensors(module)
    if set(tensors) - set(split.split) - set(split.shared) - set(split.once):
        return f"its parameters and buffers {sorted(tensors)} are not the ones its head split knows"
    missing = [n for n in split.summed if f"{n}.weight" not in tensors]
    if missing:
        return f"it has no weight in {missing}, which its head split sums over the ranks"
    units = attrgetter(split.unit)(module)
    if units % size:
        return f"its {split.unit}={units} is not a multiple of cp_size={size} (or choose a cp_size that divides it)"
    for name, (dim, segments) in _present(split, tensors):
        sizes = _segments(module, tensors[name], dim, segments)
        if sum(n for n, _ in sizes) != tensors[name].shape[dim] or any(n % units for n, whole in sizes if not whole):
            return f"{name} of shape {tuple(tensors[name].shape)} does not hold {segments} along dim {dim}"
    return None


def _tensors(module) -> dict:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _segments(module, tensor, dim, segments) -> list[tuple[int, bool]]:
    """(size, read whole by every head) of each segment."""
    return [(math.prod(attrgetter(a)(module) for a in s.lstrip("=").split("*")) if s else tensor.shape[dim],
             s.startswith("=")) for s in segments]


def _present(split, tensors):
    """The split's parameters and buffers the module has (a bias is optional)."""
    return [(name, how) for name, how in split.split.items() if name in tensors]


def _my_heads(module, split, size, rank) -> dict:
    """This rank's share of each split parameter or buffer (views or copies of it: their gradients reach it); the
    `once` parameters rank 0's, zeros elsewhere."""
    tensors = _tensors(module)
    mine = {name: tensors[name] * (rank == 0) for name in split.once if name in tensors}
    for name, (dim, segments) in _present(split, tensors):
        tensor = tensors[name]
        pieces, start = [], 0
        for n, whole in _segments(module, tensor, dim, segments):
            pieces.append(tensor.narrow(dim, start, n) if whole else
                          tensor.narrow(dim, start + rank * (n // size), n // size))
            start += n
        mine[name] = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)
    return mine


@contextlib.contextmanager
def _swapped(module, tensors: dict, attrs: dict):
    """`module` with the parameters or buffers `tensors` and the attributes `attrs` in place of its own, for a while
    (``torch.func.functional_call`` swaps the same way, but calls the module, which would come back here)."""
    slots = {}
    for n in tensors:
        owner, leaf = module.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2]
        slots[n] = (owner._parameters if leaf in owner._parameters else owner._buffers, leaf)
    saved = {n: where[leaf] for n, (where, leaf) in slots.items()}
    values = {a: attrgetter(a)(module) for a in attrs}
    try:
        for n, (where, leaf) in slots.items():
            where[leaf] = tensors[n]
        for a, v in attrs.items():
            _set(module, a, v)
        yield
    finally:
        for n, (where, leaf) in slots.items():
            where[leaf] = saved[n]
        for a, v in values.items():
            _set(module, a, v)


def _set(module, dotted: str, value) -> None:
    """setattr for a dotted attribute of `module` (a submodule's: ``forget_gate.num_heads``)."""
    head, _, leaf = dotted.rpartition(".")
    setattr(attrgetter(head)(module) if head else module, leaf, value)


class _SummedLinear(nn.Module):
    """A projection of every channel (no bias) run by a rank on its channels: its partial product summed over the
    CP group (backward: the gradient summed alike, each rank's part feeding every rank's heads)."""

    def __init__(self, weight, group):
        super().__init__()
        self.weight, self.group = weight, group

    def forward(self, x):
        return sum_over_group(F.linear(x, self.weight), self.group)


class _SummedRMSNorm(nn.Module):
    """An RMS norm over all the heads (MiniMax's; transformers' gated one of Mamba2 of one group: the gate applied
    before the norm, the weight after) run by a rank on its heads' channels: their squares summed over the CP
    group."""

    def __init__(self, norm, weight, group):
        super().__init__()
        # the norm's weight covers every channel it normalizes (one group): inside the forward, FSDP2's is whole
        self.weight, self.group, self.eps, self.size = weight, group, norm.variance_epsilon, norm.weight.shape[0]

    def forward(self, hidden_states, gate=None):
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        if gate is not None:
            h = h * F.silu(gate.to(torch.float32))
        squares = sum_over_group(h.pow(2).sum(-1, keepdim=True), self.group)
        return self.weight * (h * torch.rsqrt(squares / self.size + self.eps)).to(dtype)


_SUMMED = {"linear": lambda old, weight, group: _SummedLinear(weight, group), "rms_norm": _SummedRMSNorm}


def _heads_forward(module, split, ctx, *args, **kwargs):
    """The module's own forward on the gathered sequence with this rank's heads: its part of the output."""
    # A cache built under CP (an eval forward with use_cache) holds shards and serves no generation (ndp's attention
    # refuses a cache passed in); this rank's heads' states are left out of it.
    kwargs = {k: None if k in ("cache", "cache_params") else v for k, v in kwargs.items()}
    local = {a: attrgetter(a)(module) // ctx.size for a in split.scaled}
    local.update({a: fn(lambda b: local.get(b, attrgetter(b)(module))) for a, fn in split.derived.items()})
    mine = _my_heads(module, split, ctx.size, ctx.rank)
    local.update({name: _SUMMED[kind](module.get_submodule(name), mine[f"{name}.weight"], ctx.group)
                  for name, kind in split.summed.items()})
    with _swapped(module, mine, {**local, **split.during}):
        return type(module).forward(module, *args, **kwargs)


def split_mixer_heads(model: nn.Module, names: list[str], ctx) -> None:
    """Hook the modules `names` of `model` (each of a class in ``HEAD_SPLITS``) to run this rank's heads on the
    sequence gathered over ctx's CP group, their outputs summed over it and scattered back (module docstring)."""
    for name in (split_target(model, n) for n in names):
        module = model.get_submodule(name)
        module.register_forward_pre_hook(_gather_inputs(ctx, 1), with_kwargs=True)
        module.register_forward_hook(_sum_outputs(ctx), with_kwargs=True)
        module.forward = functools.partial(_heads_forward, module, HEAD_SPLITS[type(module).__name__], ctx)


def _sum_outputs(ctx):
    def hook(module, args, kwargs, output):
        full = _reference(args, kwargs).shape[1]
        # (output, state): MiniMax's lightning attention returns its heads' last state too, which its decoder layer
        # drops; the rank's heads' state is no model's, so None goes back in its place
        out = output[0] if isinstance(output, tuple) else output
        if not (torch.is_tensor(out) and out.dim() >= 2 and out.shape[1] == full):
            raise RuntimeError(f"{type(module).__name__} split by heads returned {type(output).__name__} where ndp "
                               f"sums one per-token tensor over the ranks")
        out = reduce_scatter_sequence(out, dim=1, group=ctx.group, layout=ctx.layout)
        return (out, *(None for _ in output[1:])) if isinstance(output, tuple) else out

    return hook


__all__ = ["gather_mixers", "split_mixer_heads", "split_target", "head_split_problem", "HeadSplit", "HEAD_SPLITS",
           "PER_TOKEN_WRAPPERS"]
