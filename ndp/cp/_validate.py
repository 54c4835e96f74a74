"""Argument checks shared by every CP implementation, and the cross-rank metadata check.

Local checks raise before any communication. Then, once per (group, call signature), every rank
all-gathers a 16-byte fingerprint of its call (shapes, dtypes, layout, mask, cu_seqlens, ...): ranks
that disagree get a ValueError naming the differing fields instead of hanging in a transfer.
"""
from __future__ import annotations

import hashlib
import threading

import torch
import torch.distributed as dist

from ndp_kernels._segments import check_qkv, check_window

from .schedule import LAYOUTS

__all__ = ["resolve_group", "check_layout", "check_common", "check_across_ranks", "group_key"]

# group key -> fingerprints every rank of that group has already agreed on. Per group, so that every
# member of a group sees the same history (and clears the bounded cache at the same call).
_AGREED: dict = {}
_AGREED_LOCK = threading.Lock()


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
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if not packed and q.shape[1] != k.shape[1]:
        raise ValueError(f"context-parallel attention is self-attention over one sharded sequence: q and k "
                         f"need the same local seqlen; got q={q.shape[1]}, k={k.shape[1]}")
    # causal forces right = 0 (flash-attn semantics, as in ndp.ops.attention): Mask.band ignores it.
    return tuple(window), scale, packed


def _fingerprint(desc: tuple) -> torch.Tensor:
    h = hashlib.blake2b(repr(desc).encode(), digest_size=16).digest()
    return torch.tensor([int.from_bytes(h[:8], "little", signed=True),
                         int.from_bytes(h[8:], "little", signed=True)], dtype=torch.int64)


def _comm_device(group, like: torch.Tensor) -> torch.device:
    backend = dist.get_backend(group)
    if "nccl" in str(backend).lower():
        return like.device if like.device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _is_fake(group) -> bool:
    # torch's fake process group (bench/simulate_cp.py: one process plays one rank of a world-N job) moves no
    # data: what its all-gather returns is not the other ranks' fingerprints, and there are no other ranks to
    # disagree. Real backends (gloo, nccl, ...) always take the exchange.
    return str(dist.get_backend(group)).lower() == "fake"


def check_across_ranks(group, world: int, fields: dict, like: torch.Tensor, what: str) -> None:
    """Raises ValueError on every rank when the ranks of `group` called with different `fields`.

    The exchange runs once per (group, fields): later calls with the same arguments cost nothing.
    """
    if world == 1 or _is_fake(group):
        return
    desc = tuple(sorted(fields.items()))
    fp = _fingerprint(desc)
    gkey, key = group_key(group), tuple(fp.tolist())
    with _AGREED_LOCK:
        if key in _AGREED.get(gkey, ()):
            return
    dev = _comm_device(group, like)
    out = torch.empty(world * 2, dtype=torch.int64, device=dev)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, fp.to(dev), group=group)
    allfp = out.view(world, 2).cpu()
    if bool((allfp == fp).all()):
        with _AGREED_LOCK:
            seen = _AGREED.setdefault(gkey, set())
            if len(seen) >= 4096:  # packed batches bring new cu_seqlens every step: keep the cache bounded
                seen.clear()
            seen.add(key)
        return
    # Disagreement: every rank sees it (same gathered fingerprints), so all take this path together.
    descs = [None] * world
    dist.all_gather_object(descs, dict(desc), group=group)
    keys = sorted(set().union(*[d.keys() for d in descs]))
    diff = [k for k in keys if len({repr(d.get(k)) for d in descs}) > 1]
    detail = "; ".join(f"{k}: " + ", ".join(f"rank {r}={d.get(k)!r}" for r, d in enumerate(descs)) for k in diff)
    raise ValueError(f"{what}: the ranks of the CP group called with different arguments ({detail}). Every rank "
                     f"must pass the same shapes, dtypes, layout, mask and cu_seqlens (shard them with "
                     f"ndp.shard_sequence / ndp.shard_packed over the same group).")
