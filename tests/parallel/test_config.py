"""ParallelismConfig validation: every rule raises its message before any process-group work."""
import pytest
import torch.distributed as dist

from ndp.parallel import ParallelismConfig


def test_defaults_and_sizes():
    c = ParallelismConfig(dp_replicate_size=2, dp_shard_size=3, cp_size=4, tp_size=5)
    assert c.world_size == 120 and c.dp_size == 6 and c.fsdp_size == 24
    assert ParallelismConfig().world_size == 1


@pytest.mark.parametrize("kw, exc, match", [
    (dict(dp_shard_size=0), ValueError, "dp_shard_size must be >= 1; got dp_shard_size=0"),
    (dict(tp_size=1.5), TypeError, "tp_size must be an int"),
    (dict(cp_size=True), TypeError, "cp_size must be an int"),
    (dict(cp_impl="magic"), ValueError, "cp_impl must be one of"),
    (dict(cp_layout="diagonal"), ValueError, "cp_layout must be one of"),
    (dict(cp_size=4, ulysses_size=3, cp_impl="usp"), ValueError, "ulysses_size must divide cp_size"),
    (dict(cp_size=4, ulysses_size=4, cp_impl="usp"), ValueError, "needs 1 < ulysses_size < cp_size"),
    (dict(cp_size=4, ulysses_size=2, cp_impl="ulysses"), ValueError, "uses the whole CP group"),
    (dict(cp_size=4, ulysses_size=2, cp_impl="ring"), ValueError, "only applies to cp_impl='usp'"),
])
def test_bad_fields(kw, exc, match):
    with pytest.raises(exc, match=match):
        ParallelismConfig(**kw)


def test_world_size_message_names_every_factor():
    c = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, cp_size=2, tp_size=1)
    with pytest.raises(ValueError, match=r"dp_replicate_size=2 \* dp_shard_size=2 \* cp_size=2 \* tp_size=1 = 8, "
                                         r"world_size=4"):
        c.check_world_size(4)
    c.check_world_size(8)


@pytest.mark.parametrize("kw, heads, kv, match", [
    (dict(tp_size=4), 4, 2, "num_heads and num_kv_heads must be divisible by tp_size; got num_heads=4, "
                            "num_kv_heads=2, tp_size=4"),
    (dict(tp_size=3), 4, 4, "divisible by tp_size"),
    (dict(cp_size=8, cp_impl="ulysses"), 4, 2, "all-to-all of degree 8"),
    (dict(cp_size=4, tp_size=2, cp_impl="ulysses"), 4, 2, "num_heads / tp_size must be divisible"),
    (dict(), 6, 4, "num_heads must be a multiple of num_kv_heads"),
])
def test_bad_heads(kw, heads, kv, match):
    with pytest.raises(ValueError, match=match):
        ParallelismConfig(**kw).check_heads(heads, kv)


def test_heads_ok():
    ParallelismConfig(tp_size=2).check_heads(4, 2)
    ParallelismConfig(cp_size=4, cp_impl="ulysses").check_heads(4, 2)  # kv heads replicated to 4
    ParallelismConfig(cp_size=4, cp_impl="usp", ulysses_size=2).check_heads(4, 2)


@pytest.mark.parametrize("layout, seq, ok", [("zigzag", 64, True), ("zigzag", 68, False), ("contiguous", 68, True),
                                             ("striped", 66, False)])
def test_seq_len(layout, seq, ok):
    c = ParallelismConfig(cp_size=4, cp_layout=layout)
    if ok:
        c.check_seq_len(seq)
    else:
        with pytest.raises(ValueError, match=f"{layout} sharding needs seq_len divisible by .*seq_len={seq}"):
            c.check_seq_len(seq)


def test_mesh_needs_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="initialized default process group"):
        ParallelismConfig().build_device_mesh("cpu")


def test_frozen():
    c = ParallelismConfig()
    with pytest.raises(Exception):
        c.cp_size = 2
    assert c.replace(cp_size=2).cp_size == 2
