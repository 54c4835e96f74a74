"""Meta-device init (issue 10 item 3): ``--init meta`` gives the same initial weights, bit for bit, and the same
losses as ``--init full`` on 1, 2 and 4 ranks; a rank never allocates the whole model; bad ``--init`` values."""
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import ndp
import ndp.hf
from dist import spawn
from _runs import train_config
from ndp.parallel import ParallelismConfig, module_seed, param_bytes, to_empty
from ndp.train import TrainConfig, parse_config, train
from ndp.train.checkpoint import full_state_dict
from ndp.train.presets import build_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 3
TINY_BYTES = 427264  # tiny-llama: 106,816 fp32 parameters (2 layers of 36,992, embed + lm_head 2 x 16,384, norm 64)


def _tied_config():
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    return cfg


def _tied_model(init):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(_tied_config())
    if init == "full":
        to_empty(m, device="cpu")
        ndp.hf.init_weights(m, seed=0)
    return m


def _parallel(model, par):
    cfg = ParallelismConfig(**par)
    return ndp.parallelize(model, cfg, cfg.build_device_mesh("cpu"), init_seed=0)


def _assert_same_state(full, meta, what):
    a, b = full_state_dict(full), full_state_dict(meta)
    assert set(a) == set(b), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"
    # Non-persistent buffers (RoPE inv_freq) are recomputed, not random: compare them too.
    ba, bb = dict(full.named_buffers()), dict(meta.named_buffers())
    assert set(ba) == set(bb)
    for k in ba:
        assert torch.equal(ba[k], bb[k]), f"{what}: buffer {k} differs"


def _check_equal_init(rank, world, par, layout):
    # Initial state: the whole model built and initialized on every rank, then parallelized, vs meta.
    full = _parallel(build_model("tiny-llama", seed=0), par)
    meta = _parallel(build_model("tiny-llama", seed=0, init="meta"), par)
    assert not any(t.is_meta for t in meta.parameters()) and not any(t.is_meta for t in meta.buffers())
    _assert_same_state(full, meta, layout)
    assert param_bytes(meta) == param_bytes(full)
    # Tied embeddings stay one tensor through FSDP/TP sharding and materialization.
    tf, tm = _parallel(_tied_model("full"), par), _parallel(_tied_model("meta"), par)
    assert tm.lm_head.weight is tm.model.embed_tokens.weight and tf.lm_head.weight is tf.model.embed_tokens.weight
    _assert_same_state(tf, tm, f"{layout} tied")
    # Then the same loss for a few steps, through ndp-train's loop.
    a = train(train_config(layout, steps=STEPS, init="full"))
    b = train(train_config(layout, steps=STEPS, init="meta"))
    assert a.losses == b.losses and a.grad_norms == b.grad_norms, (a.losses, b.losses)
    assert a.param_bytes_per_rank == b.param_bytes_per_rank and a.param_bytes_total == b.param_bytes_total == TINY_BYTES
    return a.param_bytes_per_rank


@pytest.mark.distributed
@pytest.mark.parametrize("world,par,layout,expect_bytes", [
    # FSDP over 4 ranks (dp_shard x cp): every dim-0 divides by 4, so exactly a quarter.
    (4, dict(dp_shard_size=2, cp_size=2), "dp_shard2_cp2", TINY_BYTES // 4),
    # TP 2 without FSDP: the 14 projection weights and (the fused loss is vocabulary-parallel under TP) lm_head
    # [256, 64] are halved, embeddings and norms are whole.
    (2, dict(tp_size=2), "tp2", TINY_BYTES - (2 * 4 * (4096 + 2048 + 2048 + 4096 + 3 * 8192) + 4 * 256 * 64) // 2),
])
def test_meta_init_matches_full(tmp_path, world, par, layout, expect_bytes):
    spawn(_run_equal_init, world, tmp_path, par, layout, expect_bytes)


def _run_equal_init(rank, world, par, layout, expect_bytes):
    assert _check_equal_init(rank, world, par, layout) == expect_bytes


def test_meta_init_matches_full_one_process():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert _check_equal_init(0, 1, {}, None) == TINY_BYTES
    finally:
        dist.destroy_process_group()


def test_seeded_init_is_the_models_own_init():
    """Each module's values are its ``_init_weights`` drawn right after seeding from (seed, module name)."""
    from transformers import AutoModelForCausalLM

    m = build_model("tiny-llama", seed=3)
    torch.manual_seed(module_seed(3, "model.layers.1.mlp.up_proj"))
    ref = torch.empty(128, 64).normal_(mean=0.0, std=m.config.initializer_range)
    assert torch.equal(m.model.layers[1].mlp.up_proj.weight, ref)
    torch.manual_seed(module_seed(3, "lm_head"))
    assert torch.equal(m.lm_head.weight, torch.empty(256, 64).normal_(mean=0.0, std=0.02))
    assert torch.equal(m.model.norm.weight, torch.ones(64))
    # RoPE frequencies are computed, not drawn: the same as transformers' own build.
    hf = AutoModelForCausalLM.from_config(m.config)
    assert torch.equal(m.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)
    assert torch.equal(m.model.rotary_emb.original_inv_freq, hf.model.rotary_emb.original_inv_freq)
    # Another seed gives other weights; the same seed the same ones.
    assert not torch.equal(build_model("tiny-llama", seed=4).lm_head.weight, m.lm_head.weight)
    assert torch.equal(build_model("tiny-llama", seed=3).lm_head.weight, m.lm_head.weight)


# --- memory: the meta path never holds the whole model on a rank ---------------------------------------------

def _big_model(init):
    from transformers import AutoModelForCausalLM, LlamaConfig

    # 8 layers of 1,048,576 + 2 x 1,048,576 (embed, lm_head) + 256 (norm) = 10,485,760 + 256 fp32 parameters.
    cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg)
    if init == "full":
        to_empty(m, device="cpu")
        ndp.hf.init_weights(m, seed=0)
    return m


BIG_BYTES = 4 * (8 * (4 * 256 * 256 + 3 * 256 * 1024 + 2 * 256) + 2 * 4096 * 256 + 256)
BIG_LARGEST = 4 * 4096 * 256  # embed_tokens / lm_head


def _peak_cpu_bytes(fn):
    """Peak of live bytes the CPU allocator handed out while ``fn`` ran (the profiler's allocation events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return out, peak


def _check_memory(rank, world, out_dir):
    cfg = ParallelismConfig(dp_shard_size=world)
    mesh = cfg.build_device_mesh("cpu")
    meta, meta_peak = _peak_cpu_bytes(lambda: ndp.parallelize(_big_model("meta"), cfg, mesh, init_seed=0))
    full, full_peak = _peak_cpu_bytes(lambda: ndp.parallelize(_big_model("full"), cfg, mesh))
    a, b = full_state_dict(full), full_state_dict(meta)
    assert all(torch.equal(a[k], b[k]) for k in a)
    res = {"meta_peak": meta_peak, "full_peak": full_peak, "meta_bytes": param_bytes(meta),
           "full_bytes": param_bytes(full)}
    with open(os.path.join(out_dir, f"mem{rank}.json"), "w") as f:
        json.dump(res, f)


@pytest.mark.distributed
def test_meta_init_never_allocates_the_whole_model(tmp_path):
    world = 4
    spawn(_check_memory, world, tmp_path, str(tmp_path))
    for rank in range(world):
        r = json.load(open(tmp_path / f"mem{rank}.json"))
        # Every dim 0 divides by 4: each rank holds exactly a quarter of the parameters, either way.
        assert r["meta_bytes"] == r["full_bytes"] == BIG_BYTES // world, r
        # The probe sees a normal build: the whole model was allocated on the rank.
        assert r["full_peak"] >= BIG_BYTES, r
        # The meta build: its quarter, plus one module's temporaries (the largest parameter and the NaN check's
        # 1-byte mask of it), plus this rank's 1/4 slice of it while copying; never the whole model.
        bound = BIG_BYTES // world + BIG_LARGEST + BIG_LARGEST // 4 + BIG_LARGEST // world
        assert r["meta_peak"] <= bound, (r, bound)
        assert r["meta_peak"] < BIG_BYTES / 2, r


# --- bad input -------------------------------------------------------------------------------------------------

def test_init_bad_value_names_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"--init must be one of full, meta .*got init='lazy'"):
        TrainConfig(init="lazy")
    with pytest.raises(ValueError, match=r"--init must be one of full, meta"):
        parse_config(["--init", "lazy"], env={})
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("init: meta\nsteps: 2\n")
    assert parse_config(["--config", str(yaml_file)], env={}).init == "meta"
    assert parse_config([], env={}).init == "full"
    r = subprocess.run([sys.executable, "-m", "ndp.train", "--init", "lazy", "--no-progress"], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "--init must be one of full, meta" in r.stderr, r.stderr[-2000:]


def test_init_meta_refuses_a_model_directory(tmp_path):
    build_model("tiny-llama", seed=0).save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match="--init meta builds random weights shard by shard.*weights are loaded "
                                         "whole.*Use --init full"):
        TrainConfig(model=str(tmp_path / "m"), init="meta").check(1)


def test_cli_summary_reports_param_bytes(tmp_path):
    cmd = [sys.executable, "-m", "ndp.train", "--model", "tiny-llama", "--init", "meta", "--steps", "1",
           "--seq-len", "64", "--batch-size", "2", "--no-progress", "--device", "cpu"]
    r = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("ndp-train summary: "))
    summary = json.loads(line[len("ndp-train summary: "):])
    assert summary["init"] == "meta"
    assert summary["param_bytes_per_rank"] == summary["param_bytes_total"] == TINY_BYTES
    assert f"parameters: {TINY_BYTES} bytes per rank" in r.stderr
