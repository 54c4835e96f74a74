"""DeviceMesh construction for (dp_replicate, dp_shard, cp, tp) and the CP groups attention uses."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ndp.cp import split_cp_group

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
        "dp_shard_cp", "dp_cp" (``mesh_axis(mesh, "dp_cp")`` etc.; torch keeps them on the mesh).
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
    adopt_mesh(config, mesh)
    return mesh


# The flattened axes ndp reads, and the axes each joins: the ranks holding different data (dp), FSDP's shard axis
# (CP ranks also hold different tokens, so they shard parameters like data-parallel ranks do), and every rank whose
# token losses enter the global mean (dp_cp).
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
    """Flattens on a mesh (ndp's, Accelerate's, a user's) the axes ndp reads (FLAT_AXES), so that later
    :func:`mesh_axis` calls find them; refuses a flattened axis of one of those names that joins other axes.
    Collective where it makes a process group: every rank calls it, after check_mesh (``parallelize`` and
    ``build_device_mesh`` do)."""
    if mesh is None:
        return
    for name in FLAT_AXES:
        parts = _present(mesh, name)
        if len(parts) > 1:
            _flatten(mesh, name, parts)


def _present(mesh: DeviceMesh, name: str) -> tuple:
    """The axes of flattened axis `name` that `mesh` has (Accelerate's leaves out those of size 1)."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    return tuple(a for a in FLAT_AXES[name] if a in names)


def _flatten(mesh: DeviceMesh, name: str, parts: tuple) -> DeviceMesh:
    """``parts`` of `mesh` flattened as axis `name`: made on the first call (a new process group), and kept by
    torch on the root mesh by name; torch refuses a name that already joins other axes."""
    try:
        return mesh[parts]._flatten(name)
    except ValueError as e:  # a flattened axis of that name already joins other axes (a mesh built elsewhere)
        raise ValueError(f"the DeviceMesh's flattened axis {name!r} does not join the axes {parts} ndp reads it as "
                         f"({e}); build the mesh with config.build_device_mesh(device_type) or Accelerate's "
                         f"ParallelismConfig.build_device_mesh") from e


def mesh_device(mesh: DeviceMesh | None) -> torch.device | None:
    """The device this process computes on for `mesh`: its current GPU for a CUDA mesh, the CPU for a CPU one;
    None without a mesh."""
    if mesh is None:
        return None
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def mesh_axis(mesh: DeviceMesh, name: str):
    """The 1-D mesh of axis ``name``: one of MESH_AXES or a flattened axis (FLAT_AXES: the axes of it the mesh
    has, flattened; the one it has; a stand-in of size 1 for none). For an axis of size 1 the mesh leaves out
    (Accelerate builds only the axes of degree > 1), a stand-in of size 1 (``size()``, ``get_local_rank()``)."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if name in names:
        return mesh[name]
    if name in FLAT_AXES:
        parts = _present(mesh, name)
        if len(parts) > 1:
            # Found in torch's record once adopt_mesh checked and made it (this runs on every loss call: slicing
            # the mesh again would cost ~0.1 ms); made here on a mesh nobody adopted.
            made = mesh._get_root_mesh()._flatten_mapping.get(name)
            return made if made is not None else _flatten(mesh, name, parts)
        return mesh[parts[0]] if parts else _OneRank()
    if name in MESH_AXES:
        return _OneRank()
    raise KeyError(f"the DeviceMesh has no axis {name!r}; axes: {names}")


@dataclass(frozen=True)
class CPContext:
    """What a CP attention call needs: the algorithm, the layout and its process groups.

    ``group`` is None when ``cp_size == 1`` (attention runs locally). For "usp", ``ulysses_group`` and
    ``ring_group`` split the CP group (adjacent ranks form a Ulysses group). ``mixers``: the config's
    ``cp_mixers`` (what CP does with token mixers outside attention).
    """

    impl: str
    layout: str
    group: Any = None
    ulysses_group: Any = None
    ring_group: Any = None
    size: int = 1
    rank: int = 0
    mixers: str = "refuse"

    @property
    def enabled(self) -> bool:
        return self.group is not None and self.size > 1


def cp_context(config: ParallelismConfig, mesh: DeviceMesh | None) -> CPContext:
    """The CPContext of this rank (collective when cp_impl='usp': every rank must call it).

    Raises:
        ValueError: cp_size > 1 without a mesh.
    """
    if config.cp_size == 1:
        return CPContext(impl=config.cp_impl, layout=config.cp_layout, mixers=config.cp_mixers)
    if mesh is None:
        raise ValueError(f"cp_size={config.cp_size} needs the DeviceMesh of build_device_mesh; got mesh=None")
    group = mesh.get_group("cp")
    gu = gr = None
    if config.cp_impl == "usp":
        gu, gr = split_cp_group(group, config.ulysses_size)
    return CPContext(impl=config.cp_impl, layout=config.cp_layout, group=group, ulysses_group=gu,
                     ring_group=gr, size=config.cp_size, rank=mesh.get_local_rank("cp"), mixers=config.cp_mixers)
