"""Argument checks shared by every CP implementation, and the per-call validity exchange.

Every CP call, before its first transfer, runs one small all-gather over its group: each rank sends
``(status, 128-bit fingerprint of its call)``; a rank whose local checks failed sends an error status
instead of raising at once. If any rank reports an error, or the fingerprints differ, every rank raises
a ValueError naming the ranks and the fields, so a bad input on one rank never leaves the others waiting
in a ring transfer, whatever earlier calls agreed on.

Cost: one all-gather of 3 int64 per rank per call (a CPU tensor when the group has a gloo backend, e.g.
``init_process_group("cpu:gloo,cuda:nccl")`` or the default ``init_process_group()``; on an NCCL-only
group it is a device tensor and reading the result waits for the device once per call).
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from ndp_kernels.segments import check_qkv, check_scale, check_window

from .schedule import LAYOUTS

__all__ = ["resolve_group", "resolve_group_or_input_error", "check_layout", "check_common", "agree",
           "raise_on_all_ranks", "group_key"]

_OK, _BAD = 0, 1


def resolve_group(group):
    """Returns (process_group, world_size, rank) for `group` (None = default group; 1-D DeviceMesh ok).

    Raises:
        RuntimeError: torch.distributed is not initialized.
        TypeError: group is not a ProcessGroup or a 1-D DeviceMesh.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ndp.cp needs an initialized torch.distributed process group; call "
                           "torch.distributed.init_process_group(...) first (or pass world_size/rank where "
                           "the function accepts them).")
    if group is None:
        group = dist.group.WORLD
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise TypeError(f"group must be a ProcessGroup or a 1-D DeviceMesh; got a {group.ndim}-D mesh with "
                            f"dims {group.mesh_dim_names}. Pass mesh['cp'] (one axis).")
        group = group.get_group()
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or a 1-D DeviceMesh; got "
                        f"{type(group).__name__}")
    return group, dist.get_world_size(group), dist.get_rank(group)


def resolve_group_or_input_error(group, local_checks):
    """resolve_group(group); when there is no usable group, an input error found by `local_checks` (which
    need no group) is the more useful one to report."""
    try:
        return resolve_group(group)
    except (RuntimeError, TypeError):
        local_checks()
        raise


def group_key(group) -> tuple:
    return (getattr(group, "group_name", None) or id(group), tuple(dist.get_process_group_ranks(group)))


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    return layout


def check_common(q, k, v, *, causal, softmax_scale, window_size, cu_seqlens):
    """Checks shared by all impls. Returns (window, scale, packed)."""
    packed = cu_seqlens is not None
    if not packed and torch.is_tensor(q) and q.dim() == 3:
        raise ValueError(f"q is 3-D {tuple(q.shape)}: packed input [local_tokens, heads, head_dim] needs "
                         f"cu_seqlens=<global cu_seqlens> (or the shard_packed result); dense input is "
                         f"[batch, local_seq, heads, head_dim].")
    check_qkv(q, k, v, packed=packed)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool; got {causal!r}")
    window = check_window(window_size)
    scale = check_scale(softmax_scale, q.shape[-1])
    if not packed and q.shape[1] != k.shape[1]:
        raise ValueError(f"context-parallel attention is self-attention over one sharded sequence: q and k "
                         f"need the same local seqlen; got q={q.shape[1]}, k={k.shape[1]}")
    # causal forces right = 0 (flash-attn semantics, as in ndp.ops.attention): Mask.band ignores it.
    return tuple(window), scale, packed


def _fingerprint(desc: tuple) -> tuple:
    h = hashlib.blake2b(repr(desc).encode(), digest_size=16).digest()
    return (int.from_bytes(h[:8], "little", signed=True), int.from_bytes(h[8:], "little", signed=True))


def _comm_device(group, like) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    # A group with a gloo backend (alone or beside NCCL) checks on the CPU: no device round trip.
    if "gloo" in backend or "nccl" not in backend:
        return torch.device("cpu")
    if torch.is_tensor(like) and like.device.type == "cuda":
        return like.device
    return torch.device("cuda", torch.cuda.current_device())


def _is_fake(group) -> bool:
    # torch's fake process group (bench/simulate_cp.py: one process plays one rank of a world-N job) moves no
    # data: what its all-gather returns is not the other ranks' fingerprints, and there are no other ranks to
    # disagree. Real backends (gloo, nccl, ...) always take the exchange.
    return str(dist.get_backend(group)).lower() == "fake"


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _exchange(group, world: int, desc, error_msg, like, what: str, relayed: bool = False):
    """One all-gather of (status, fingerprint) over `group`. Returns None when every rank is valid and
    called with the same fields, else a message (the same on every rank). Collective: every rank of
    `group` must call it once per CP call, valid or not. `relayed`: error_msg is another exchange's
    result (USP's second group), passed on as it is."""
    fp = _fingerprint(desc) if error_msg is None else (0, 0)
    mine = torch.tensor([_OK if error_msg is None else _BAD, *fp], dtype=torch.int64)
    dev = _comm_device(group, like)
    out = torch.empty(world * 3, dtype=torch.int64, device=dev)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, mine.to(dev), group=group)
    allv = out.view(world, 3).cpu()
    if bool((allv[:, 0] == _OK).all()) and bool((allv[:, 1:] == allv[0, 1:]).all()):
        return None
    # Every rank saw the same gathered table, so every rank takes this (rare) path together: one more
    # exchange for the details that make a useful message.
    infos = [None] * world
    dist.all_gather_object(infos, (None if desc is None else dict(desc), error_msg, relayed), group=group)
    ranks = dist.get_process_group_ranks(group)
    bad = [(r, m) for r, (_, m, rel) in enumerate(infos) if m is not None and not rel]
    passed_on = [m for _, m, rel in infos if m is not None and rel]
    if passed_on and not bad:
        return passed_on[0]
    if bad:
        detail = "; ".join(f"rank {r} (global rank {ranks[r]}) raised {m.rstrip('.')}" for r, m in bad)
        return (f"{what}: {len(bad)} of the {world} ranks of the CP group refused their input: {detail}. "
                f"Every rank raises so that none waits in a transfer; fix the input of "
                f"{'that rank' if len(bad) == 1 else 'those ranks'}.")
    descs = [d for d, _, _ in infos]
    keys = sorted(set().union(*[d.keys() for d in descs]))
    diff = [k for k in keys if len({repr(d.get(k)) for d in descs}) > 1]
    detail = "; ".join(f"{k}: " + ", ".join(f"rank {r}={d.get(k)!r}" for r, d in enumerate(descs)) for k in diff)
    return (f"{what}: the ranks of the CP group called with different arguments ({detail}). Every rank "
            f"must pass the same shapes, dtypes, layout, causal, window, softmax_scale, mask and cu_seqlens "
            f"(shard them with ndp.shard_sequence / ndp.shard_packed over the same group).")


def agree(groups, fields, like, what: str, error: BaseException | None = None) -> None:
    """Every rank of the CP group agrees that the call is valid before any transfer, or every rank raises.

    Runs one small all-gather per group in `groups` (in order: for USP the Ulysses group, then the ring
    group; an error seen in the first is carried into the second, so it reaches the whole 2-D group).

    Args:
        groups: sequence of (process_group, world_size) this call communicates over.
        fields: what the ranks must agree on (``None`` when `error` is set).
        like: a tensor of the call (picks the device of an NCCL-only exchange); may be None.
        what: the public function's name, for the message.
        error: this rank's local validation error, or None.
    Raises:
        `error` itself on the rank that produced it (with a note naming the exchange); ValueError on
        every other rank when any rank refused its input or the ranks' fields differ.
    """
    desc = None if fields is None else tuple(sorted(fields.items()))
    msg = None if error is None else _error_text(error)
    relayed = False
    for group, world in groups:
        if world == 1 or _is_fake(group):
            continue
        m = _exchange(group, world, desc, msg, like, what, relayed)
        if m is not None:
            msg, relayed = m, True
    if error is not None:
        if msg != _error_text(error) and hasattr(error, "add_note"):
            error.add_note(msg)
        raise error
    if msg is not None:
        raise ValueError(msg)


def raise_on_all_ranks(error: BaseException, *, group=None, ulysses_group=None, ring_group=None,
                       what: str = "ndp.cp") -> None:
    """Stand-in for a CP attention call on a rank that refused its input before making the call.

    Joins the validity exchange that the other ranks run at the start of their ``ring_attention``,
    ``allgather_attention``, ``ulysses_attention`` (pass `group`) or ``usp_attention`` (pass
    `ulysses_group` and `ring_group`) call, so that they raise a ValueError naming this rank's error
    instead of waiting in a transfer; then raises `error` here.

    Raises:
        `error`, always (after the exchange).
    """
    if ulysses_group is not None or ring_group is not None:
        ug, u_size, _ = resolve_group(ulysses_group)
        rg, r_size, _ = resolve_group(ring_group)
        groups = [(ug, u_size), (rg, r_size)]
    else:
        pg, world, _ = resolve_group(group)
        groups = [(pg, world)]
    agree(groups, None, None, what, error)
    raise error  # agree always raises when error is set; kept for readers and type checkers
