"""DeviceMesh construction for (dp_replicate, dp_shard, cp, tp) and the CP groups attention uses."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

if TYPE_CHECKING:  # annotations only: the config imports this module (it builds its mesh here)
    from .config import ParallelismConfig

MESH_AXES = ("dp_replicate", "dp_shard", "cp", "tp")  # the mesh's named axes, outermost first


def build_device_mesh(config: ParallelismConfig, device_type: str) -> DeviceMesh:
    """Build the 4-axis mesh and register its flattened axes.

    Args:
        config: the degrees.
        device_type: "cpu" or "cuda".
    Returns:
        DeviceMesh with axes ("dp_replicate", "dp_shard", "cp", "tp") and flattened axes "dp",
        "dp_shard_cp", "dp_cp" (``mesh["dp_cp"]`` etc.).
    Raises:
        RuntimeError: no default process group.
        ValueError: ``config.world_size`` != the process group's size (message names every factor).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("build_device_mesh needs an initialized default process group; call "
                           "torch.distributed.init_process_group first (torchrun sets up its rendezvous).")
    config.check_world_size(dist.get_world_size())
    shape = (config.dp_replicate_size, config.dp_shard_size, config.cp_size, config.tp_size)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES)
    # Flattened axes: the ranks holding different data (dp), FSDP's shard axis (CP ranks also hold
    # different tokens, so they shard parameters like data-parallel ranks do), and every rank whose
    # token losses enter the global mean (dp_cp).
    # torch asks callers to keep the flattened meshes rather than slice them from the root again.
    mesh.ndp_flat = {
        "dp": mesh["dp_replicate", "dp_shard"]._flatten("dp"),
        "dp_shard_cp": mesh["dp_shard", "cp"]._flatten("dp_shard_cp"),
        "dp_cp": mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
    }
    return mesh


# The flattened axes ndp reads, and the axes each joins.
FLAT_AXES = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
             "dp_cp": ("dp_replicate", "dp_shard", "cp")}


def check_mesh(config, mesh: DeviceMesh | None) -> None:
    """Refuses a mesh whose axes do not hold the config's degrees (a mesh built from another config). A mesh
    may leave out axes of size 1 (Accelerate's does) and carry other axes of size 1; its named axes must cover
    every degree > 1 with exactly that size.

    Raises:
        ValueError: names every differing or unknown axis with both sizes and the fix.
    """
    if mesh is None:
        return
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    diff = []
    for axis in MESH_AXES:
        want = getattr(config, f"{axis}_size")
        got = mesh[axis].size() if axis in names else 1
        if got != want:
            diff.append(f"{axis}: config {want}, mesh {got if axis in names else 'absent (size 1)'}")
    diff += [f"{axis}: not a degree of the config, size {mesh[axis].size()} in the mesh" for axis in names
             if axis not in MESH_AXES and mesh[axis].size() > 1]
    if diff:
        raise ValueError(f"the DeviceMesh does not match the ParallelismConfig ({'; '.join(diff)}). Build the mesh "
                         f"from the same config: mesh = config.build_device_mesh(device_type).")


class _OneRank:
    """An axis of size 1 that a mesh leaves out (Accelerate builds only the axes of degree > 1)."""

    def size(self) -> int:
        return 1

    def get_local_rank(self) -> int:
        return 0


def adopt_mesh(config, mesh: DeviceMesh | None) -> None:
    """Registers on a mesh that was not built by ndp (Accelerate's ``build_device_mesh``, a user's) the flattened
    axes ndp reads (FLAT_AXES): the mesh's own flattened axis of that name where it has one, else the one
    enabled axis, else a new flatten of the enabled axes (collective: every rank calls it). Call after
    check_mesh; a mesh ndp built is left as it is."""
    if mesh is None or hasattr(mesh, "ndp_flat"):
        return
    flat = {}
    for name, parts in FLAT_AXES.items():
        on = tuple(a for a in parts if getattr(config, f"{a}_size") > 1)
        if len(on) == 1:
            flat[name] = mesh[on[0]]
        elif on:
            flat[name] = _flattened(mesh, name, on)
    mesh.ndp_flat = flat


def _flattened(mesh: DeviceMesh, name: str, parts: tuple) -> DeviceMesh:
    try:
        got = mesh[name]  # registered by whoever built the mesh (Accelerate flattens dp, dp_shard_cp, dp_cp)
    except (KeyError, ValueError, RuntimeError):
        return mesh[parts]._flatten(name)
    if got.size() != math.prod(mesh[a].size() for a in parts):
        raise ValueError(f"the DeviceMesh's axis {name!r} has {got.size()} ranks, not the product of {parts}")
    return got


def mesh_axis(mesh: DeviceMesh, name: str):
    """The 1-D mesh of axis ``name``: one of MESH_AXES or a flattened axis (dp, dp_shard_cp, dp_cp); for an
    axis of size 1 the mesh leaves out, a stand-in of size 1 (``size()``, ``get_local_rank()``)."""
    flat = getattr(mesh, "ndp_flat", {})
    if name in flat:
        return flat[name]
    if name in (getattr(mesh, "mesh_dim_names", None) or ()):
        return mesh[name]
    if name in MESH_AXES or name in FLAT_AXES:
        return _OneRank()
    raise KeyError(f"the DeviceMesh has no axis {name!r}; axes: {mesh.mesh_dim_names}")


@dataclass(frozen=True)
class CPContext:
    """What a CP attention call needs: the algorithm, the layout and its process groups.

    ``group`` is None when ``cp_size == 1`` (attention runs locally). For "usp", ``ulysses_group`` and
    ``ring_group`` split the CP group (adjacent ranks form a Ulysses group).
    """

    impl: str
    layout: str
    group: Any = None
    ulysses_group: Any = None
    ring_group: Any = None
    size: int = 1
    rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.group is not None and self.size > 1


def cp_context(config: ParallelismConfig, mesh: DeviceMesh | None) -> CPContext:
    """The CPContext of this rank (collective when cp_impl='usp': every rank must call it).

    Raises:
        ValueError: cp_size > 1 without a mesh.
    """
    if config.cp_size == 1:
        return CPContext(impl=config.cp_impl, layout=config.cp_layout)
    if mesh is None:
        raise ValueError(f"cp_size={config.cp_size} needs the DeviceMesh of build_device_mesh; got mesh=None")
    group = mesh.get_group("cp")
    gu = gr = None
    if config.cp_impl == "usp":
        from ndp.cp import split_cp_group

        gu, gr = split_cp_group(group, config.ulysses_size)
    return CPContext(impl=config.cp_impl, layout=config.cp_layout, group=group, ulysses_group=gu,
                     ring_group=gr, size=config.cp_size, rank=mesh.get_local_rank("cp"))
