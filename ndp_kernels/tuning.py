"""Where measured tuning tables live: one JSON file per (table kind, device), in a user cache directory.

The directory is ``$NDP_TUNING_DIR`` when set, else ``$XDG_CACHE_HOME/ndp`` (``~/.cache/ndp``). Tables
written by a tuning run there take precedence over the ones shipped inside the package. This is the
only place in ndp that reads the environment for tuning, so the layers above take plain arguments.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path

import torch

__all__ = ["tuning_dir", "device_properties", "device_key", "table_path", "load_json", "save_json", "save_measured",
           "table_lock", "merge_rows", "measure_once", "no_measurement", "measurement_off", "may_measure",
           "kernels_fingerprint", "for_these_kernels"]


def tuning_dir() -> Path:
    """The user's tuning cache directory (not created here)."""
    env = os.environ.get("NDP_TUNING_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ndp"


def device_properties(device):
    """torch's properties of the CUDA `device` (name, capability, SMs, shared memory), queried once per device:
    the launchers read them on every launch."""
    device = torch.device(device)
    return _properties(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _properties(index: int):
    return torch.cuda.get_device_properties(index)


def device_key(device) -> str:
    """A file-name-safe key per device model: ``cpu``, or the GPU's name (``NVIDIA_H100_80GB_HBM3``)."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    return _name_key(device_properties(device).name)


@functools.cache
def _name_key(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def table_path(kind: str, key: str, directory: Path | None = None) -> Path:
    """Path of the table `kind` (e.g. ``engines``) for device `key` in `directory` (default: tuning_dir())."""
    return Path(directory or tuning_dir()) / f"{kind}-{key}.json"


def load_json(path: Path):
    """The parsed table at `path`, or None when it does not exist.

    Raises:
        RuntimeError: the file exists but is not valid JSON (the message names it and how to rebuild it).
    """
    path = Path(path)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise RuntimeError(f"tuning table {path} is unreadable ({e}); delete it or re-run the tuning command "
                           f"that wrote it") from None


def save_json(path: Path, data) -> Path:
    """Writes `data` to `path` atomically (a crash never leaves half a table); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    return path


def save_measured(path: Path, data) -> bool:
    """save_json for a first-use measurement: where the cache cannot be written (a read-only home, a full disk)
    it logs a warning and returns False, and the caller keeps the measured rows for this process only."""
    try:
        save_json(path, data)
        return True
    except OSError as e:
        logging.getLogger("ndp").warning("could not save the measured rows to %s (%s); they serve this process only "
                                         "(set NDP_TUNING_DIR to a writable directory to keep them)", path, e)
        return False


@contextlib.contextmanager
def table_lock(path: Path):
    """Holds an exclusive lock on the table at `path` for every process of this machine (``flock`` on
    ``<path>.lock``): the one writer of the table at a time. Where the lock file cannot be made (a read-only
    cache), the block runs unlocked."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path.with_name(path.name + ".lock"), "a")
    except OSError:
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _current(path: Path, meta, valid) -> dict:
    """The table at `path` when it is a valid ``{..., "rows": {...}}`` table, else a new one from meta()."""
    data = load_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("rows"), dict) or not valid(data):
        data = {**meta(), "rows": {}}
    return data


def merge_rows(path: Path, rows: dict, meta, *, valid=lambda data: True, replace: bool = False) -> dict:
    """Adds `rows` to the table at `path` under table_lock and writes it atomically; returns the table.

    Rows of other keys are never dropped (another process, another head size, a shipped row). replace: the new
    rows win over the file's rows of the same keys (a full tuning run); else the file's win (a first-use
    measurement that lost a race keeps the decision already taken). meta(): the fields of a new table, used where
    the file is missing or not `valid` (measured for other kernels)."""
    with table_lock(path):
        data = _current(path, meta, valid)
        _add(data["rows"], rows, replace)
        save_measured(path, data)
    return data


def _add(table_rows: dict, rows: dict, replace: bool) -> None:
    if replace:
        table_rows.update(rows)
    else:
        for key, row in rows.items():
            table_rows.setdefault(key, row)


def measure_once(path: Path, marker: str, measure, meta, *, valid=lambda data: True) -> dict:
    """The one first-use measurement of ndp (kernel tiles and attention engines): the rows of the table at
    `path` once it holds `marker`. Under table_lock the table is read again: a process of this machine that
    measured while this one waited has written the rows, and they are taken as they are, so every rank of a node
    runs one decision; else measure() (its rows) is run and merged in (rows already there kept). Returns rows."""
    with table_lock(path):
        data = _current(path, meta, valid)
        if marker not in data["rows"]:
            _add(data["rows"], measure(), replace=False)
            save_measured(path, data)
    return data["rows"]


_OFF = [False]  # process-wide, not thread-local: autograd's CUDA backward runs on its own thread


@contextlib.contextmanager
def no_measurement():
    """Within the block, in every thread of the process, no first-use measurement runs (kernels and engines): the
    tables and static defaults apply."""
    old, _OFF[0] = _OFF[0], True
    try:
        yield
    finally:
        _OFF[0] = old


def measurement_off() -> bool:
    """Whether a ``no_measurement`` block is running."""
    return _OFF[0]


def may_measure(device, device_types) -> bool:
    """Whether a first-use measurement (the kernels' and the engines' probes) may run now on `device`: its type is
    in `device_types`, no ``no_measurement`` block runs, ``NDP_AUTO_PROBE=0`` is not set (the switch a launcher
    turns them off with: then the shipped and tuned tables, else the static defaults), autograd is not running a
    backward (a measurement there would stall every rank's backward and its collectives; the forward measures what
    the backward needs), and torch is neither compiling a graph nor capturing a CUDA graph on the current stream
    (timing there would be wrong or break the capture)."""
    if device is None or device.type not in device_types or _OFF[0] or torch.compiler.is_compiling():
        return False
    if torch._C._current_graph_task_id() != -1:
        return False
    if os.environ.get("NDP_AUTO_PROBE", "1").strip() == "0":
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


# Every source the launched kernels depend on: the kernels, their launchers, the segment tables they walk, the
# static tiles and rules, the merge kernel.
KERNEL_SOURCES = ("flash.py", "merge.py", "segments.py", "configs.py")


@functools.cache
def kernels_fingerprint() -> str:
    """A digest of the kernels' sources (KERNEL_SOURCES): a kernel table measured for other kernels names launch
    configurations that may now be slower or no longer compile, so ``configs.tuned_table`` ignores it."""
    h = hashlib.sha256()
    for name in KERNEL_SOURCES:
        h.update((Path(__file__).parent / name).read_bytes())
    return h.hexdigest()[:16]


def for_these_kernels(table: dict) -> bool:
    """Whether a kernel table was measured for the kernels installed now (a table without a digest counts as such;
    see kernels_fingerprint)."""
    return table.get("kernels", kernels_fingerprint()) == kernels_fingerprint()
