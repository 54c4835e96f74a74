"""Sharded checkpoints (torch.distributed.checkpoint), atomic commit, bit-exact resume, HF export.

Layout of ``save_dir``::

    step_00000003/          a committed checkpoint (DCP files + one rank<r>.pt per rank: RNG, schedule)
    .tmp_step_00000006/     a save in progress (ignored, removed by the next save)
    latest                  text file naming the newest committed checkpoint

A save writes everything into the temporary directory, waits for every rank, then rank 0 renames it
and rewrites ``latest`` with an atomic ``os.replace``: a crash at any moment leaves ``latest`` naming a
complete checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from ndp.parallel.init import clean_name

logger = logging.getLogger(__name__)

LATEST = "latest"


def _rank():
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def latest_checkpoint(save_dir: str) -> str | None:
    """Path of the newest committed checkpoint in ``save_dir`` (None when there is none)."""
    marker = os.path.join(save_dir, LATEST)
    if not os.path.exists(marker):
        return None
    with open(marker, encoding="utf-8") as f:
        name = f.read().strip()
    path = os.path.join(save_dir, name)
    return path if os.path.isdir(path) else None


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _data_files(path: str) -> list[str]:
    """Every file of a checkpoint directory except meta.json (relative paths, sorted)."""
    out = []
    for root, _, files in os.walk(path):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), path)
            if rel != "meta.json":
                out.append(rel)
    return sorted(out)


def read_meta(path: str) -> dict:
    """The meta.json of a committed checkpoint.

    Raises:
        FileNotFoundError: not a committed ndp checkpoint.  RuntimeError: meta.json unreadable.
    """
    meta_path = os.path.join(path, "meta.json")
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"{path} is not a committed ndp checkpoint (no meta.json)")
    try:
        with open(meta_path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise RuntimeError(f"checkpoint {path}: meta.json is unreadable ({e}); the checkpoint is corrupt. Resume "
                           f"from an older one (point {LATEST} at it) or start without --resume.") from None


def verify_checkpoint(path: str) -> None:
    """Checks every file of the checkpoint against the sha256 written at save (collective when a process
    group exists: each rank hashes its share of the files, every rank gets the verdict).

    Raises:
        RuntimeError: a file is missing or its checksum differs (names the files and the fix), on every rank.
    """
    meta = read_meta(path)
    want = meta.get("sha256")
    if want is None:
        logger.warning("checkpoint %s has no checksums (written by an older ndp): not verified", path)
        return
    rank, world = _rank(), (dist.get_world_size() if dist.is_initialized() else 1)
    names = sorted(want)
    bad = []
    for i, name in enumerate(names):
        if i % world != rank:
            continue
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            bad.append(f"{name} (missing)")
        elif _sha256(full) != want[name]:
            bad.append(f"{name} (sha256 differs)")
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, bad)
        bad = sorted(b for part in every for b in part)
    if bad:
        raise RuntimeError(f"checkpoint {path} is corrupt: {', '.join(bad)}. Resume from an older checkpoint "
                           f"(write its directory name into {os.path.join(os.path.dirname(path), LATEST)}) or "
                           f"start without --resume.")


def check_identity(path: str, meta: dict, identity: dict) -> None:
    """Refuses a checkpoint of another model, vocabulary or sequence length.

    Raises:
        ValueError: names every differing field with both values, and the fix.
    """
    saved = meta.get("identity")
    if saved is None:
        return
    diff = {k: (saved.get(k), v) for k, v in identity.items() if k in saved and saved.get(k) != v}
    if diff:
        detail = "; ".join(f"{k}: checkpoint {a!r}, this run {b!r}" for k, (a, b) in diff.items())
        raise ValueError(f"--resume: checkpoint {path} belongs to another run ({detail}). Resume with the "
                         f"model, vocabulary and --seq-len it was saved with, or use a new --save-dir.")


def save_checkpoint(save_dir: str, step: int, model, optimizer, scheduler, *, extra: dict | None = None,
                    before_commit=None, meta: dict | None = None) -> str:
    """Save a sharded checkpoint of ``step`` (collective: every rank calls it).

    Args:
        save_dir: directory of checkpoints; step: the number of completed steps.
        model, optimizer, scheduler: the (parallelized) model, its optimizer and LR scheduler.
        extra: small picklable per-rank state (e.g. metrics position).
        before_commit: test hook called on every rank after the files are written, before the commit.
        meta: JSON-able run facts stored in meta.json (``identity``, ``steps``), checked on resume.
    Returns:
        the committed checkpoint directory.
    """
    name = f"step_{step:08d}"
    final = os.path.join(save_dir, name)
    tmp = os.path.join(save_dir, f".tmp_{name}")
    if _rank() == 0:
        os.makedirs(save_dir, exist_ok=True)
        for entry in os.listdir(save_dir):  # leftovers of interrupted saves
            if entry.startswith(".tmp_"):
                shutil.rmtree(os.path.join(save_dir, entry), ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    rank_state = {
        "step": step,
        "scheduler": scheduler.state_dict(),
        "torch_rng": torch.random.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "extra": extra or {},
    }
    path = os.path.join(tmp, f"rank{_rank()}.pt")
    torch.save(rank_state, path + ".part")
    os.replace(path + ".part", path)
    _barrier()
    if before_commit is not None:
        before_commit()
    if _rank() == 0:
        # Checksums of every file, so that a resume detects a truncated or corrupted checkpoint.
        sums = {name: _sha256(os.path.join(tmp, name)) for name in _data_files(tmp)}
        with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
            json.dump({"step": step, "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                       "sha256": sums, **(meta or {})}, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        marker = os.path.join(save_dir, LATEST)
        with open(marker + ".part", "w", encoding="utf-8") as f:
            f.write(name)
            f.flush()
            os.fsync(f.fileno())
        os.replace(marker + ".part", marker)
        _fsync_dir(save_dir)
    _barrier()
    return final


def load_checkpoint(path: str, model, optimizer, scheduler) -> dict:
    """Load a checkpoint written by :func:`save_checkpoint` into model/optimizer/scheduler and RNG.

    The DCP part reshards to any parallel layout; RNG state is per rank (rank 0's when the world size
    changed).

    Returns:
        the rank state dict (``step``, ``extra``).
    Raises:
        FileNotFoundError: not a checkpoint directory.  RuntimeError: a file fails its checksum.
    """
    verify_checkpoint(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    _drop_unsaved_state(optim_sd, dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    # strict=False for the parameters left stateless above; the model's keys were all loaded (dcp.load is strict)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=False))
    rank_file = os.path.join(path, f"rank{_rank()}.pt")
    if not os.path.exists(rank_file):
        rank_file = os.path.join(path, "rank0.pt")
    rs = torch.load(rank_file, weights_only=False)
    scheduler.load_state_dict(rs["scheduler"])
    torch.random.set_rng_state(rs["torch_rng"])
    if rs.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rs["cuda_rng"])
    return rs


def _drop_unsaved_state(optim_sd: dict, saved) -> None:
    """Leave out of the optimizer state to load the parameters that had none when the checkpoint was saved.

    Such a parameter never got a gradient (a vision tower under text-only batches, a frozen branch): the
    optimizer skips it and stores nothing, while the fresh optimizer's state dict asks for every parameter's.
    Left out, the loaded state holds none for it either, as in the uninterrupted run."""
    stateful = stateful_params(saved, "optim.state.")
    for fqn in [k for k in optim_sd["state"] if k not in stateful]:
        del optim_sd["state"][fqn]


def stateful_params(keys, prefix: str) -> set[str]:
    """The parameters (fqns) an optimizer state held at save, from a DCP checkpoint's flattened keys
    ``<prefix><fqn>.<field>`` (``exp_avg``, ``step``, ``momentum_buffer``, ...)."""
    return {k[len(prefix):].rsplit(".", 1)[0] for k in keys if k.startswith(prefix)}


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """Consolidated (unsharded) CPU state dict with the model's own parameter names (collective)."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {clean_name(k): v for k, v in sd.items()}


def export_hf(model, out_dir: str) -> str | None:
    """Write consolidated HF weights (``model.safetensors`` + ``config.json``) that ``from_pretrained`` loads.

    Collective (every rank calls it); rank 0 writes. Returns out_dir on rank 0, None elsewhere.
    """
    from safetensors.torch import save_file

    sd = full_state_dict(model)
    if _rank() != 0:
        return None
    os.makedirs(out_dir, exist_ok=True)
    cfg = model.config
    saved_impl = cfg._attn_implementation
    try:
        # The exported model must load where ndp is not installed: transformers' own attention, its default
        # for the family (sdpa where the family has it, else eager).
        cfg._attn_implementation_internal = None
        cfg.save_pretrained(out_dir)
    finally:
        cfg._attn_implementation_internal = saved_impl
    tensors = {k: v.contiguous() for k, v in sd.items()}
    tmp = os.path.join(out_dir, "model.safetensors.part")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out_dir, "model.safetensors"))
    return out_dir
