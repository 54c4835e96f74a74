"""ndp.plan: the cost model's formulas on hand-computed cases, against autograd and CommStats counts, and the CLI."""
import json
import os
import subprocess
import sys

import pytest
import torch

from bench_scripts import bench_json
from ndp.parallel import ParallelismConfig
from ndp.plan import (PlanRequest, Topology, cp_bytes_per_layer, enumerate_configs, estimate,
                      layer_activation_bytes, load_gpu_profile, load_model_spec, plan, root_activation_bytes)
from ndp.plan.cli import main as plan_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H100 = load_gpu_profile("h100")
L8B = load_model_spec("llama-3-8b")


def test_llama3_8b_parameter_count_by_hand():
    # embed and lm_head 128256*4096 each; per layer q,o 4096*4096, k,v 1024*4096, MLP 3*14336*4096, 2 norms
    layer = 2 * 16_777_216 + 2 * 4_194_304 + 3 * 58_720_256 + 2 * 4096
    assert layer == 218_112_000
    assert L8B.num_params == 32 * layer + 2 * 525_336_576 + 4096 == 8_030_261_248


@pytest.mark.parametrize("degrees, params", [
    # FSDP over 16: 8,030,261,248 / 16 = 501,891,328 fp32 parameters per GPU
    (dict(dp_shard_size=16), 501_891_328),
    # HSDP 2 x 8: sharded over 8 only
    (dict(dp_replicate_size=2, dp_shard_size=8), 1_003_782_656),
    # TP 2 x FSDP 8: layers' matmuls halved (32 * (218,103,808 / 2 + 8,192) = 3,489,923,072), lm_head halved by
    # the fused loss's vocabulary split (262,668,288), embeddings and final norm replicated (525,340,672):
    # 4,277,932,032 / 8
    (dict(tp_size=2, dp_shard_size=8), 534_741_504),
])
def test_state_bytes_per_gpu_llama3_8b_16xh100_128k(degrees, params):
    cfg = ParallelismConfig(**degrees)
    e = estimate(L8B, cfg, H100, Topology(16, 8), seq_len=131072, batch_size=16, dtype="bf16",
                 activation_checkpointing=True)
    # fp32 master weights, fp32 grads, two fp32 AdamW moments (ndp.train builds the model in fp32)
    assert e.mem["params"] == 4 * params
    assert e.mem["grads"] == 4 * params
    assert e.mem["optimizer"] == 8 * params


def test_h100_profile_reproduces_measured_kernel_rates():
    # docs/design.md ("Facts the code relies on"), ndp causal d128, TFLOP/s at S = 2048, 8192, 32768 (16:16 heads)
    from ndp.plan.cost import _rate

    for s, fwd, bwd in ((2048, 333, 152), (8192, 411, 219), (32768, 449, 231)):
        assert _rate(H100.attn_fwd_tflops, H100.attn_fwd_half_block, s) == pytest.approx(fwd, rel=0.03)
        assert _rate(H100.attn_bwd_tflops, H100.attn_bwd_half_block, s) == pytest.approx(bwd, rel=0.06)


def test_compute_time_by_hand_one_gpu_8k():
    e = estimate(L8B, ParallelismConfig(), H100, Topology(1, 8), seq_len=8192, batch_size=1, dtype="bf16")
    # matmul weights: 32 layers x 218,103,808 + lm_head 525,336,576 = 7,504,658,432; 6 FLOPs per weight and token,
    # 8 for lm_head under the fused loss (its backward recomputes the logits)
    assert e.time["matmul"] == pytest.approx((6 * 6_979_321_856 + 8 * 525_336_576) * 8192 / 695e12, rel=1e-9)
    full = estimate(L8B, ParallelismConfig(), H100, Topology(1, 8), seq_len=8192, batch_size=1, dtype="bf16",
                    loss="full")
    assert full.time["matmul"] == pytest.approx(6 * 8192 * 7_504_658_432 / 695e12, rel=1e-9)
    # causal pairs 8192*8193/2 = 33,558,528; 4*d*H FLOPs each per layer; fwd at 460*8192/(8192+800), bwd 2.5x
    fwd = 4 * 128 * 32 * 33_558_528 * 32
    assert e.time["attention"] == pytest.approx(fwd / (460e12 * 8192 / 8992) + 2.5 * fwd / (235e12 * 8192 / 9292),
                                                rel=1e-9)
    assert e.time["cp_comm"] == e.time["tp_comm"] == e.time["fsdp_comm"] == 0


def test_optimizer_bytes_and_ops_per_parameter_counted_in_torch():
    # Every element read and written by ndp-train's clip + AdamW(foreach=False) step, counted op by op
    # under a dispatch mode (tensors of the parameter's size only: scalars and the 0-d norm are free), and
    # the ops per parameter tensor (difference between a 3-tensor and a 1-tensor step, fixed costs cancel).
    from torch.utils._python_dispatch import TorchDispatchMode

    from ndp.parallel import clip_grad_norm_
    from ndp.plan.cost import OPTIMIZER_BYTES_PER_PARAM, OPTIMIZER_OPS_PER_TENSOR

    n = 4096

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.accesses = self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not str(func).startswith("profiler."):
                self.ops += 1
                leaves = torch.utils._pytree.tree_leaves((args, kwargs or {}, out))
                self.accesses += sum(isinstance(t, torch.Tensor) and t.numel() == n for t in leaves)
            return out

    counts = []
    for k in (1, 3):
        ps = [torch.nn.Parameter(torch.randn(n)) for _ in range(k)]
        for p in ps:
            p.grad = torch.randn(n)
        opt = torch.optim.AdamW(ps, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
        opt.step()  # the state is allocated (zeros_like) on the first step only
        with Count() as c:
            clip_grad_norm_(ps, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        counts.append(c)
    assert counts[0].accesses * 4 == OPTIMIZER_BYTES_PER_PARAM
    assert counts[1].accesses == 3 * counts[0].accesses
    assert (counts[1].ops - counts[0].ops) / 2 == OPTIMIZER_OPS_PER_TENSOR


def test_tp_all_reduces_by_hand():
    # tp 2 inside a node: per layer 2 forward all-reduces (o_proj, down_proj outputs) and 5 backward (inputs of
    # q, k, v, gate, up), each 2*(n-1)/n of [8192, 4096] bf16 at NVLink 360 GB/s plus 2 latencies of 10 us;
    # activation checkpointing recomputes the forward ones.
    one = 2 * (1 / 2) * 8192 * 4096 * 2 / 360e9 + 2 * 10e-6
    for ac, n in ((False, 7), (True, 9)):
        e = estimate(L8B, ParallelismConfig(tp_size=2), H100, Topology(2, 8), seq_len=8192, batch_size=1,
                     dtype="bf16", activation_checkpointing=ac)
        assert e.time["tp_comm"] == pytest.approx(32 * n * one, rel=1e-12)


def test_cp_bytes_are_bench_theory():
    # bench_cp._theory (the minimum CommStats measures, ratio 1.000 in the README), B=1, S=256, H=8, D=64, fp32
    spec = L8B.replace(name="t", num_heads=8, num_kv_heads=2, head_dim=64)
    sl = 256 // 4
    kv, kv32, q = 2 * sl * 2 * 64 * 4, 2 * sl * 2 * 64 * 4, sl * 8 * 64 * 4
    ring = cp_bytes_per_layer(spec, ParallelismConfig(cp_size=4), sl, 4)
    assert (ring["fwd_p2p"], ring["bwd_p2p"]) == (3 * kv, 3 * kv + 3 * kv32)
    ag = cp_bytes_per_layer(spec, ParallelismConfig(cp_size=4, cp_impl="allgather"), sl, 4)
    assert (ag["fwd_ag"], ag["bwd_ag"] + ag["bwd_rs"]) == (3 * kv, 3 * kv + 3 * kv32)
    uly = cp_bytes_per_layer(spec, ParallelismConfig(cp_size=4, cp_impl="ulysses"), sl, 4)
    kvr = 2 * sl * 4 * 64 * 4   # 2 kv heads replicated to one per rank of 4
    assert uly["fwd_a2a"] == uly["bwd_a2a"] == 0.75 * (2 * q + kvr)
    usp = cp_bytes_per_layer(spec, ParallelismConfig(cp_size=4, cp_impl="usp", ulysses_size=2), sl, 4)
    kvr2 = 2 * sl * 2 * 64 * 4
    assert usp["fwd_a2a"] == 0.5 * (2 * q + kvr2) and usp["fwd_p2p"] == kvr2
    assert usp["bwd_p2p"] == kvr2 + kvr2


def _saved_bytes(model, ids):
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids)
    return sum(seen.values())


@pytest.mark.parametrize("dtype, es", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_activation_bytes_equal_autograd_saved_bytes(dtype, es):
    import torch.distributed as dist
    from transformers import LlamaConfig, AutoModelForCausalLM

    import ndp.hf

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        h, i, heads, kv, s = 96, 160, 6, 2, 64
        got = []
        for layers in (1, 2):
            cfg = LlamaConfig(hidden_size=h, intermediate_size=i, num_attention_heads=heads, num_key_value_heads=kv,
                              vocab_size=128, num_hidden_layers=layers)
            cfg._attn_implementation = "sdpa"
            torch.manual_seed(0)
            m = AutoModelForCausalLM.from_config(cfg).to(dtype)
            p = ParallelismConfig()
            ndp.hf.parallelize(m, p, p.build_device_mesh("cpu"))   # ndp attention, as ndp.train runs it
            got.append(_saved_bytes(m, torch.randint(0, 128, (1, s))))
        spec = load_model_spec("tiny-llama").replace(hidden_size=h, intermediate_size=i, num_heads=heads,
                                                     num_kv_heads=kv, head_dim=16)
        # by hand for fp32: 2 norms (4h + 4h + 4) + 4*(4h + 2*32 + 4i) + 4*6 = 1544 + 4480 + 24
        per_layer = {4: 2 * (384 + 384 + 4) + 4 * (4 * 96 + 2 * 32 + 4 * 160) + 24,
                     2: 2 * (384 + 192 + 4) + 2 * (4 * 96 + 2 * 32 + 4 * 160) + 24}[es]
        assert layer_activation_bytes(spec, 1, es) == per_layer
        assert got[1] - got[0] == per_layer * s
        assert got[0] - per_layer * s == root_activation_bytes(spec, es) * s
    finally:
        if owned:
            dist.destroy_process_group()


def test_enumeration_tiny_llama_4_gpus_by_hand():
    spec = load_model_spec("tiny-llama")          # 4 heads, 2 kv heads
    got = enumerate_configs(spec, 4, 8, seq_len=64, batch_size=4)
    key = {(c.dp_replicate_size, c.dp_shard_size, c.cp_size, c.tp_size, c.cp_impl, c.ulysses_size) for c in got}
    # tp 4 is out (2 kv heads); tp1: cp1 x 3 dp splits, cp2 x 2 dp splits x 3 impls, cp4: ring, allgather,
    # ulysses (4 ranks, 2 kv heads replicated), usp u2; tp2: cp1 x 2 dp splits, cp2 x 3 impls
    assert len(got) == len(key) == 3 + 6 + 4 + 2 + 3
    assert (1, 1, 4, 1, "usp", 2) in key and (1, 1, 2, 2, "ulysses", 2) in key
    assert not any(c.tp_size == 4 for c in got)
    # a batch of 2 rules out dp 4; gpus per node 2 rules out Ulysses over 4 ranks and tp2 x ulysses2
    assert not any(c.dp_size == 4 for c in enumerate_configs(spec, 4, 8, seq_len=64, batch_size=2))
    narrow = enumerate_configs(spec, 4, 2, seq_len=64, batch_size=4)
    assert not any(c.head_parallel_size * c.tp_size > 2 for c in narrow)


def test_ranking_prefers_fitting_and_faster():
    req = PlanRequest(spec=L8B, profile=H100, gpus=16, seq_len=131072, batch_size=16)
    ests = plan(req)
    fits = [e for e in ests if e.fits]
    assert fits and ests[:len(fits)] == fits
    assert all(a.tokens_per_s >= b.tokens_per_s for a, b in zip(fits, fits[1:]))
    assert all(e.peak_bytes <= H100.usable_bytes for e in fits)
    # at 128k tokens a layout fits by splitting the sequence (CP), or by checkpointing every layer (and splitting
    # the heads by TP or offloading the layers' inputs to the host); the fastest splits the sequence
    assert all(e.config.cp_size > 1 or e.activation_checkpointing == "full" for e in fits)
    assert fits[0].config.cp_size > 1 and fits[0].activation_checkpointing != "full"


def test_ring_hides_transfers_inside_a_node_not_across():
    spec = L8B
    intra = estimate(spec, ParallelismConfig(cp_size=8), H100, Topology(8, 8), seq_len=131072, batch_size=1,
                     activation_checkpointing=True)
    assert intra.time["cp_comm"] < 0.01 * intra.time["attention"]
    # 64 ranks across 8 nodes at 8k tokens: blocks of 128 tokens, transfers over the network dominate
    across = estimate(spec, ParallelismConfig(cp_size=64), H100, Topology(64, 8), seq_len=8192, batch_size=1)
    assert across.time["cp_comm"] > across.time["attention"]


# ---------------------------------------------------------------------------------------------- CLI

def test_cli_table_json_and_flags(tmp_path, capsys):
    out = tmp_path / "c.json"
    rc = plan_main(["--model", "llama-3-8b", "--gpus", "16", "--gpu", "h100", "--seq-len", "131072",
                    "--global-batch-tokens", str(16 * 131072), "--json", str(out), "--top", "3"])
    text = capsys.readouterr().out
    assert rc == 0
    rows = json.loads(out.read_text())
    assert {"dp_replicate_size", "dp_shard_size", "cp_size", "tp_size", "cp_impl", "ulysses_size", "mem_gb",
            "step_s", "tokens_per_s", "mfu", "fits", "reason"} <= set(rows[0])
    assert rows[0]["fits"] and all(r["dp_replicate_size"] * r["dp_shard_size"] * r["cp_size"] * r["tp_size"] == 16
                                   for r in rows)
    assert any(not r["fits"] and "over by" in r["reason"] for r in rows)
    assert "-m ndp.train --model llama-3-8b" in text and f"--cp {rows[0]['cp_size']}" in text


def test_cli_nothing_fits_exit_3(capsys):
    rc = plan_main(["--model", "llama-3-70b", "--gpus", "8", "--seq-len", "1048576", "--batch-size", "1",
                    "--activation-checkpointing", "none"])
    err = capsys.readouterr().err
    assert rc == 3
    assert "nothing fits" in err and "over by" in err and "largest:" in err
    assert "smallest change that fits: --activation-checkpointing full" in err or "--gpus" in err


@pytest.mark.parametrize("argv, match", [
    (["--model", "gpt-9", "--gpus", "8", "--seq-len", "1024", "--batch-size", "8"], "unknown model 'gpt-9'"),
    (["--model", "llama-3-8b", "--gpus", "0", "--seq-len", "1024", "--batch-size", "8"], "--gpus must be a positive"),
    (["--model", "llama-3-8b", "--gpus", "8", "--seq-len", "1025", "--batch-size", "8"], "--seq-len must be even"),
    (["--model", "llama-3-8b", "--gpus", "12", "--seq-len", "1024", "--batch-size", "12"],
     "multiple of gpus_per_node"),
    (["--model", "llama-3-8b", "--gpus", "8", "--seq-len", "1024", "--global-batch-tokens", "1000"],
     "multiple of --seq-len"),
])
def test_cli_bad_input_exit_2(argv, match, capsys):
    with pytest.raises(SystemExit) as ex:
        plan_main(argv)
    assert ex.value.code == 2
    assert match in capsys.readouterr().err


def test_profile_override(tmp_path):
    f = tmp_path / "big.yaml"
    f.write_text("memory_gib: 1000\nnetwork_gbps: 400\ncp_overhead: {ring: 0.5}\n")
    p = load_gpu_profile("h100", str(f))
    assert p.memory_gib == 1000 and p.network_gbps == 400 and p.cp_overhead == dict(H100.cp_overhead, ring=0.5)
    assert p.matmul_tflops == 695
    f.write_text("memroy_gib: 1\n")
    with pytest.raises(ValueError, match="unknown field.*memroy_gib"):
        load_gpu_profile("h100", str(f))


def test_elementwise_rate_defaults_to_hbm_and_scales_its_term():
    import dataclasses

    cfg, kw = ParallelismConfig(), dict(seq_len=8192, batch_size=1, dtype="bf16")
    base = estimate(L8B, cfg, H100, Topology(1, 8), **kw)
    assert H100.elementwise_gbps == 0 and H100.elementwise_rate == H100.hbm_gbps * 1e9
    slow = estimate(L8B, cfg, dataclasses.replace(H100, elementwise_gbps=H100.hbm_gbps / 4), Topology(1, 8), **kw)
    assert slow.time["elementwise"] == pytest.approx(4 * base.time["elementwise"], rel=1e-12)
    assert slow.time["matmul"] == base.time["matmul"] and slow.time["optimizer"] == base.time["optimizer"]
    with pytest.raises(ValueError, match="elementwise_gbps must be a number >= 0; got elementwise_gbps=-1"):
        dataclasses.replace(H100, elementwise_gbps=-1)
    with pytest.raises(ValueError, match=r"comm_overlap must be a number in \[0, 1\].*got comm_overlap=2"):
        dataclasses.replace(H100, comm_overlap=2)
    with pytest.raises(ValueError, match=r"reduce_scatter_efficiency must be a number in \(0, 1\].*got "
                                         r"reduce_scatter_efficiency=0"):
        dataclasses.replace(H100, reduce_scatter_efficiency=0)


def test_gloo_like_profile_adds_transfers_to_compute():
    # comm_overlap 0 (one CPU thread per rank): FSDP's gathers and the ring's transfers add to the compute they
    # would hide behind on a GPU; reduce_scatter_efficiency slows only the reduce-scatters.
    import dataclasses

    kw = dict(seq_len=131072, batch_size=8, dtype="bf16", activation_checkpointing=True)
    cfg = ParallelismConfig(dp_shard_size=2, cp_size=8)
    gpu = estimate(L8B, cfg, H100, Topology(16, 8), **kw)
    cpu = estimate(L8B, cfg, dataclasses.replace(H100, comm_overlap=0.0), Topology(16, 8), **kw)
    assert cpu.time["fsdp_comm"] > gpu.time["fsdp_comm"] and cpu.time["cp_comm"] > gpu.time["cp_comm"]
    assert cpu.time["matmul"] == gpu.time["matmul"]
    slow_rs = estimate(L8B, cfg, dataclasses.replace(H100, reduce_scatter_efficiency=0.5, comm_overlap=0.0),
                       Topology(16, 8), **kw)
    assert slow_rs.time["fsdp_comm"] > cpu.time["fsdp_comm"] and slow_rs.time["cp_comm"] == cpu.time["cp_comm"]


def test_hf_directory_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="qwen2", num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256)))
    spec = load_model_spec(str(tmp_path))
    assert (spec.num_layers, spec.head_dim, spec.attention_bias) == (2, 16, True)


@pytest.mark.distributed
def test_best_tiny_config_runs_through_ndp_train(tmp_path, capsys):
    rc = plan_main(["--model", "tiny-llama", "--gpus", "4", "--gpu", "h100", "--seq-len", "64", "--batch-size", "4"])
    line = next(ln for ln in capsys.readouterr().out.splitlines() if " -m ndp.train " in ln)
    assert rc == 0 and line.startswith("torchrun --nproc-per-node 4 --standalone -m ndp.train ")
    flags = line.split(" -m ndp.train ", 1)[1].split()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m", "ndp.train",
           *flags, "--steps", "2", "--device", "cpu", "--no-progress", "--dtype", "fp32"]
    r = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.split("ndp-train summary: ", 1)[1].splitlines()[0])
    assert summary["steps"] == 2 and summary["world_size"] == 4


@pytest.mark.distributed
def test_predicted_bytes_equal_measured_gloo_ranks(tmp_path):
    # ndp.train's setup in a 2-rank gloo job (bench/plan_memory.py --only bytes): parameter and AdamW bytes per rank
    # exactly, saved activations exactly (autograd's saved tensors, parameters excluded)
    rows = bench_json("plan_memory.py", tmp_path, "--only", "bytes", "--model", "tiny-llama", "--configs",
                      "dp_shard2,tp2,cp2_ulysses", "--seq-len", 64, "--batch", 2)["bytes"]
    assert [r["config"] for r in rows] == ["dp_shard2", "tp2", "cp2_ulysses"]
    for r in rows:
        for term in ("params", "optimizer", "activations"):
            assert r[f"{term}_predicted"] == r[f"{term}_measured"], (r["config"], term, r)


def _smallest_gpu_count(seq_len, **kw):
    for gpus in (8, 16, 32, 64, 128):
        ests = plan(PlanRequest(spec=L8B, profile=H100, gpus=gpus, seq_len=seq_len, batch_size=8, **kw))
        if ests[0].fits:
            return gpus, ests[0]
    return None, None


def test_memory_options_bring_llama3_8b_long_context_onto_fewer_h100s():
    # the fused loss, sharded accumulators, selective checkpointing and offloading (the targets: 16 / 8)
    gpus, best = _smallest_gpu_count(1048576)
    assert gpus <= 16 and best.activation_checkpointing == "full" and best.activation_offload
    assert best.mem["logits"] < 0.05 * best.peak_bytes and best.mem["grad_accum"] == 0
    assert 0 < best.host_bytes and "--activation-offload" in best.flags
    gpus, best = _smallest_gpu_count(131072)
    assert gpus <= 8 and best.loss == "fused" and best.sharded_grad_accum
    # without them (full logits, whole accumulators, full checkpointing alone) nothing fits 131k on 8
    old = [estimate(L8B, c, H100, Topology(8, 8), seq_len=131072, batch_size=8, grad_accum=8 // c.dp_size,
                    loss="full", activation_checkpointing="full") for c in enumerate_configs(L8B, 8, 8, 131072, 8)]
    assert old and not any(e.fits for e in old)


def test_memory_option_constants_are_ndps():
    import ndp.parallel
    from ndp.ops.linear_ce import CHUNK_BYTES, MIN_BLOCK_ROWS
    from ndp.plan import cost
    from ndp.train.config import LOSSES

    assert cost.LOSS_CHUNK_BYTES == CHUNK_BYTES and cost.LOSS_MIN_BLOCK_ROWS == MIN_BLOCK_ROWS
    assert cost.LOSSES == LOSSES and cost.AC_MODES == ndp.parallel.AC_MODES


def test_fused_loss_and_selective_bytes_equal_measured(tmp_path):
    # bench/plan_memory.py --only options (plan_vs_measured.py --only memory): the storages the ops allocate, against
    # the planner's terms
    rows = bench_json("plan_memory.py", tmp_path, "--only", "options")["memory_options"]
    assert [(r["term"], r["dtype"]) for r in rows] == [(t, d) for t in ("logits (fused loss)",
                                                                        "activations per layer (selective)")
                                                       for d in ("float32", "bfloat16")]
    for r in rows:
        assert abs(r["predicted"] / r["measured"] - 1) <= 0.01, r
