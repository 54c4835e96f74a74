"""DeviceMesh construction for (dp_replicate, dp_shard, cp, tp) and the CP groups attention uses."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .config import MESH_AXES, ParallelismConfig


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


def check_mesh(config, mesh: DeviceMesh | None) -> None:
    """Refuses a mesh whose axis sizes differ from the config's degrees (a mesh built from another config).

    Raises:
        ValueError: names every differing axis with both sizes and the fix.
    """
    if mesh is None:
        return
    names = getattr(mesh, "mesh_dim_names", None) or ()
    diff = []
    for axis in MESH_AXES:
        want = getattr(config, f"{axis}_size")
        got = mesh[axis].size() if axis in names else None
        if got != want:
            diff.append(f"{axis}: config {want}, mesh {got}")
    if diff:
        raise ValueError(f"the DeviceMesh does not match the ParallelismConfig ({'; '.join(diff)}). Build the mesh "
                         f"from the same config: mesh = config.build_device_mesh(device_type).")


def mesh_axis(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The 1-D mesh of axis ``name``: one of MESH_AXES or a flattened axis (dp, dp_shard_cp, dp_cp)."""
    flat = getattr(mesh, "ndp_flat", {})
    return flat[name] if name in flat else mesh[name]


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
