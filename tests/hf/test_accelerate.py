"""ndp on Accelerate's inputs: its ParallelismConfig and the DeviceMesh it builds (axes of size 1 left out,
flattened axes of its own) go straight into ndp.parallelize; loss and every gradient match one process."""
import pytest
import torch
from accelerate.parallelism_config import ParallelismConfig as AccelerateConfig

import ndp
from dist import spawn
from ndp.parallel import adopt_mesh, as_config, check_mesh, mesh_axis
from test_quickstart import CFG_LINE, _run, quickstart_code


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("fields", ["dp_shard_size=2, cp_size=2", "cp_size=4", "tp_size=2, cp_size=2"])
def test_accelerate_config_and_mesh_into_parallelize(tmp_path, fields):
    # The README's script with its config line swapped for Accelerate's: `cfg.build_device_mesh` is then
    # Accelerate's mesh, and ndp.parallelize, shard_batch and loss take both as they are.
    code = quickstart_code()
    line = f"from accelerate.parallelism_config import ParallelismConfig\ncfg = ParallelismConfig({fields})"
    _run(tmp_path, code.replace(CFG_LINE, line))


def test_conversion_both_ways_and_what_is_refused():
    acc = AccelerateConfig(dp_shard_size=2, cp_size=4, tp_size=2)
    cfg = ndp.ParallelismConfig.from_accelerate(acc, cp_impl="usp", ulysses_size=2)
    assert (cfg.dp_replicate_size, cfg.dp_shard_size, cfg.cp_size, cfg.tp_size) == (1, 2, 4, 2)
    assert (cfg.cp_impl, cfg.ulysses_size, cfg.cp_layout) == ("usp", 2, "zigzag")
    assert as_config(acc) == ndp.ParallelismConfig(dp_shard_size=2, cp_size=4, tp_size=2) and as_config(cfg) is cfg
    with pytest.raises(ValueError, match="sp_size=2 is DeepSpeed's sequence parallelism.*cp_impl='ulysses'"):
        as_config(AccelerateConfig(sp_size=2, dp_shard_size=2))
    with pytest.raises(ValueError, match=r"only ndp's own fields.*\['cp_size'\]"):
        ndp.ParallelismConfig.from_accelerate(acc, cp_size=8)
    with pytest.raises(TypeError, match="without"):
        as_config(object())


def _meshes(rank, world):
    # Accelerate's mesh has only the axes of degree > 1; ndp registers the flattened axes it reads (Accelerate's
    # own where it made them) and answers size 1 for the axes left out. A mesh of other degrees is refused.
    for fields, flat in [(dict(dp_shard_size=2, cp_size=2), {"dp": 2, "dp_shard_cp": 4, "dp_cp": 4}),
                         (dict(cp_size=4), {"dp_shard_cp": 4, "dp_cp": 4}),
                         (dict(tp_size=2, cp_size=2), {"dp_shard_cp": 2, "dp_cp": 2}),
                         (dict(dp_replicate_size=2, dp_shard_size=2), {"dp": 4, "dp_shard_cp": 2, "dp_cp": 4})]:
        acc = AccelerateConfig(**fields)
        mesh, cfg = acc.build_device_mesh("cpu"), as_config(acc)
        check_mesh(cfg, mesh)
        adopt_mesh(cfg, mesh)
        assert {k: v.size() for k, v in mesh.ndp_flat.items()} == flat
        assert mesh_axis(mesh, "tp").size() == cfg.tp_size and mesh_axis(mesh, "dp_replicate").size() == \
            cfg.dp_replicate_size
    with pytest.raises(ValueError, match="dp_shard: config 2, mesh 4; cp: config 2, mesh absent"):
        check_mesh(ndp.ParallelismConfig(dp_shard_size=2, cp_size=2),
                   AccelerateConfig(dp_shard_size=4).build_device_mesh("cpu"))


@pytest.mark.distributed
def test_accelerate_meshes_are_read_as_ndp_meshes(tmp_path):
    spawn(_meshes, 4, tmp_path)
