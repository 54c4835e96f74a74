"""The ndp-train CLI: flag/YAML/env parsing, config errors before any process-group work, a torchrun
run with metrics JSONL and an HF export that from_pretrained loads."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import ndp.hf
from ndp.parallel import ParallelismConfig
from ndp.train import TrainConfig, parse_config, train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(extra)
    return env


def test_flags_are_the_contract():
    cfg = parse_config(["--model", "tiny-qwen2", "--dp-replicate", "2", "--dp-shard", "2", "--cp", "4", "--tp", "2",
                        "--cp-impl", "usp", "--ulysses", "2", "--cp-layout", "striped", "--cp-mixers", "gather",
                        "--seq-len", "128",
                        "--batch-size", "16", "--grad-accum", "2", "--steps", "7", "--lr", "0.01", "--seed", "3",
                        "--dtype", "bf16", "--data", "x.txt", "--metrics", "m.jsonl", "--save-dir", "ck",
                        "--save-every", "5", "--resume", "--export-hf", "hf"], env={})
    assert cfg.parallel == ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, cp_size=4, tp_size=2,
                                             cp_impl="usp", ulysses_size=2, cp_layout="striped", cp_mixers="gather")
    assert (cfg.model, cfg.seq_len, cfg.batch_size, cfg.grad_accum, cfg.steps, cfg.lr, cfg.seed, cfg.dtype,
            cfg.data, cfg.metrics, cfg.save_dir, cfg.save_every, cfg.resume, cfg.export_hf) == (
        "tiny-qwen2", 128, 16, 2, 7, 0.01, 3, "bf16", "x.txt", "m.jsonl", "ck", 5, True, "hf")


def test_memory_flags(tmp_path):
    assert parse_config([], env={}).activation_checkpointing == "none"
    assert parse_config([], env={}).loss == "fused"
    assert parse_config(["--activation-checkpointing"], env={}).activation_checkpointing == "full"  # as before
    cfg = parse_config(["--activation-checkpointing", "selective", "--loss", "full", "--sharded-grad-accum",
                        "--activation-offload"], env={})
    assert (cfg.activation_checkpointing, cfg.loss, cfg.sharded_grad_accum, cfg.activation_offload) == (
        "selective", "full", True, True)
    y = tmp_path / "c.yaml"
    y.write_text("activation_checkpointing: true\n")  # the YAML of the boolean flag
    assert parse_config(["--config", str(y)], env={}).activation_checkpointing == "full"
    with pytest.raises(ValueError, match="one of none, full, selective"):
        parse_config(["--activation-checkpointing", "some"], env={})
    with pytest.raises(ValueError, match="--loss must be one of fused, full"):
        parse_config(["--loss", "chunked"], env={})


def test_compile_trains_as_eager():
    # --compile: every decoder layer compiled whole; the same losses as eager (fp32 on CPU)
    assert parse_config(["--compile"], env={}).compile is True
    runs = [train(TrainConfig(steps=3, seq_len=64, batch_size=2, progress=False, device="cpu", compile=c)).losses
            for c in (False, True)]
    torch.testing.assert_close(torch.tensor(runs[1]), torch.tensor(runs[0]), rtol=1e-5, atol=1e-6)


def test_yaml_and_env_precedence(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("model: tiny-mistral\nsteps: 9\nparallel:\n  cp: 2\n  cp-impl: ulysses\nseq_len: 32\n")
    cfg = parse_config(["--config", str(y), "--steps", "11"], env={"NDP_TP_SIZE": "2", "NDP_CP_SIZE": "8",
                                                                   "NDP_CP_MIXERS": "gather"})
    assert cfg.model == "tiny-mistral" and cfg.steps == 11 and cfg.seq_len == 32
    assert cfg.parallel.cp_size == 2 and cfg.parallel.cp_impl == "ulysses" and cfg.parallel.tp_size == 2
    assert cfg.parallel.cp_mixers == "gather"
    y.write_text("bogus: 1\n")
    with pytest.raises(ValueError, match="unknown option 'bogus'"):
        parse_config(["--config", str(y)], env={})


def test_yaml_values_take_the_flags_types(tmp_path):
    y = tmp_path / "c.yaml"
    # YAML reads 3e-3 as a string and "8" is quoted: both must mean what --lr 3e-3 / --steps 8 mean
    y.write_text('lr: 3e-3\nsteps: "8"\npack_docs: "true"\nparallel:\n  cp: "2"\n')
    cfg = parse_config(["--config", str(y)], env={})
    assert (cfg.lr, cfg.steps, cfg.pack_docs, cfg.parallel.cp_size) == (3e-3, 8, True, 2)
    for text, match in (("steps: 2.5\n", r"steps must be an integer \(as its flag --steps\); got 2.5"),
                        ("lr: fast\n", r"lr must be a number \(as its flag --lr\); got 'fast'"),
                        ("dtype: fp8\n", r"dtype must be one of \['fp32', 'bf16'\]; got 'fp8'")):
        y.write_text(text)
        with pytest.raises(ValueError, match=match):
            parse_config(["--config", str(y)], env={})


def test_models_the_planner_names_and_config_only_directories(tmp_path):
    from ndp.plan.spec import real_model_names
    from ndp.train.presets import build_model, preset_config

    for name in real_model_names():  # every name ndp-plan prints builds (random weights)
        TrainConfig(model=name, seq_len=4096).check(1)
    with pytest.warns(UserWarning, match=r"--seq-len 16384 is above the model's max_position_embeddings=8192"):
        TrainConfig(model="llama-3-8b", seq_len=16384).check(1)
    model = build_model("llama-3-8b", seed=0, init="meta")
    assert 8.0e9 < sum(p.numel() for p in model.parameters()) < 8.1e9
    preset_config("tiny-qwen2").save_pretrained(tmp_path / "cfg")  # config.json only: random weights
    a = build_model(str(tmp_path / "cfg"), seed=1)
    b = build_model("tiny-qwen2", seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert a.config._attn_implementation == "sdpa"


def test_a_family_without_sdpa_attention_trains_with_its_own_default(tmp_path):
    # Gemma 2 (soft-capped scores) has no sdpa attention in transformers: ndp-train used to force sdpa and stop.
    from transformers import Gemma2Config
    from ndp.train.presets import build_model

    Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16).save_pretrained(tmp_path / "gemma2")
    assert build_model(str(tmp_path / "gemma2"), seed=0).config._attn_implementation == "eager"
    res = train(TrainConfig(model=str(tmp_path / "gemma2"), seq_len=32, batch_size=2, steps=2, device="cpu",
                            progress=False))
    assert len(res.losses) == 2 and all(5.0 < x < 6.0 for x in res.losses)  # ln(256) = 5.55 at random init


def test_pack_docs_is_refused_for_a_model_that_would_let_documents_see_each_other(tmp_path):
    # Mamba's scan runs across a packed row: refused by name before the first step (on every rank alike).
    from transformers import MambaConfig

    MambaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, state_size=8).save_pretrained(tmp_path / "m")
    cfg = dict(model=str(tmp_path / "m"), seq_len=32, batch_size=2, steps=1, device="cpu", progress=False)
    with pytest.raises(ndp.hf.Unsupported, match=r"MambaForCausalLM: packed documents .* without --pack-docs"):
        train(TrainConfig(pack_docs=True, **cfg))
    assert len(train(TrainConfig(**cfg)).losses) == 1


def test_a_model_whose_config_adds_its_load_balancing_loss_is_refused_not_trained_without_it(tmp_path):
    # ndp-train trains the token loss alone: OLMoE's config asking for its routers' loss would have been dropped
    from transformers import OlmoeConfig

    OlmoeConfig(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, output_router_logits=True,
                router_aux_loss_coef=0.01).save_pretrained(tmp_path / "moe")
    cfg = dict(model=str(tmp_path / "moe"), seq_len=32, batch_size=2, steps=1, device="cpu", progress=False)
    with pytest.raises(ndp.hf.Unsupported, match=r"OlmoeForCausalLM's config adds its routers' load-balancing loss "
                                                 r".*router_aux_loss_coef=0.01.*output_router_logits to false"):
        train(TrainConfig(**cfg))
    config = json.loads((tmp_path / "moe" / "config.json").read_text())
    (tmp_path / "moe" / "config.json").write_text(json.dumps(dict(config, output_router_logits=False)))
    assert len(train(TrainConfig(**cfg)).losses) == 1


def test_export_dir_must_be_writable(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"--export-hf .*file.* is a file; it must be a directory"):
        TrainConfig(export_hf=str(tmp_path / "file")).check(1)


def test_cli_reports_an_error_found_after_start_up_in_one_line(tmp_path):
    r = subprocess.run([PY, "-m", "ndp.train", "--data", str(tmp_path / "missing.txt"), "--steps", "1",
                        "--no-progress", "--device", "cpu"], env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "ndp-train: error:" in r.stderr and "missing.txt" in r.stderr


@pytest.mark.distributed
def test_torchrun_error_found_after_start_up_is_one_line_and_exit_2_on_every_rank(tmp_path):
    # Twice: gloo's teardown aborted one rank (SIGABRT) on about half of the runs before ranks left without it.
    for _ in range(2):
        r = subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                            "ndp.train", "--data", str(tmp_path / "missing.txt"), "--steps", "1", "--cp", "2",
                            "--no-progress", "--device", "cpu"], env=_env(), capture_output=True, text=True,
                           timeout=300)
        assert r.stderr.count("ndp-train: error:") == 1 and "missing.txt" in r.stderr, r.stderr[-2000:]
        assert "terminate called" not in r.stderr and "SIGABRT" not in r.stderr, r.stderr[-2000:]
        assert r.stderr.count("exitcode  : 2") == 2, r.stderr[-2000:]  # torchrun's per-rank failure table


@pytest.mark.parametrize("kw, world, match", [
    (dict(parallel=ParallelismConfig(dp_shard_size=2, cp_size=2)), 2, "= 4, world_size=2"),
    (dict(parallel=ParallelismConfig(tp_size=4)), 4, "divisible by tp_size"),
    (dict(parallel=ParallelismConfig(cp_size=2), seq_len=66), 2, "zigzag sharding needs seq_len divisible"),
    (dict(parallel=ParallelismConfig(dp_shard_size=2), batch_size=3), 2, "--batch-size .* divisible"),
    (dict(model="tiny-gpt"), 1, "unknown model 'tiny-gpt'; choose a preset .*llama-3-8b"),
])
def test_bad_config_raises_before_process_group(kw, world, match):
    cfg = TrainConfig(**kw)
    with pytest.raises(ValueError, match=match):
        cfg.check(world)
    if world == 1:
        with pytest.raises(ValueError, match=match):
            train(cfg)
    assert not dist.is_initialized()


def test_cli_reports_config_error_without_launching():
    r = subprocess.run([PY, "-m", "ndp.train", "--dp-shard", "2", "--cp", "2", "--no-progress"], env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "dp_shard_size=2 * cp_size=2 * tp_size=1 = 4, world_size=1" in r.stderr


@pytest.mark.distributed
def test_torchrun_metrics_and_hf_export(tmp_path):
    metrics, export = tmp_path / "m.jsonl", tmp_path / "hf"
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "ndp.train",
           "--model", "tiny-llama", "--dp-shard", "2", "--seq-len", "64", "--batch-size", "4", "--steps", "3",
           "--metrics", str(metrics), "--export-hf", str(export), "--device", "cpu"]
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all({"loss", "tokens_per_s", "lr", "grad_norm", "peak_mem_mb"} <= set(row) for row in rows)
    assert "ndp-train summary" in r.stdout

    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(export))
    ids = torch.randint(0, 256, (1, 32))
    from ndp.train.presets import build_model

    ref = build_model("tiny-llama", seed=0)
    assert m.config._attn_implementation != "ndp_ring"
    # trained weights differ from the initial ones, and the export is complete
    assert set(dict(m.named_parameters())) == set(dict(ref.named_parameters()))
    assert not torch.allclose(m(ids).logits, ref(ids).logits)
    # the export is also a valid --model for further training
    r = subprocess.run([PY, "-m", "ndp.train", "--model", str(export), "--steps", "1", "--seq-len", "64",
                        "--batch-size", "2", "--no-progress"], env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "ndp-train summary" in r.stdout, r.stderr[-3000:]
