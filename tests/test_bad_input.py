"""Bad input across the public API: each case must raise at once with an exception whose message names the
constraint, the offending values and the fix (pinned by a regex per case); none may hang (each case runs
under a timeout) or compute a wrong answer. The cases of ranks that disagree run in a multi-process job in
tests/cp (every rank must raise there); here every case is single-process."""
import math

import pytest
import torch

import ndp
import ndp.ops
from ndp_kernels import reference

pytestmark = pytest.mark.timeout(60)


def _qkv(b=1, s=16, h=4, hk=2, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(b, s, h, d, generator=g, dtype=dtype), torch.randn(b, s, hk, d, generator=g, dtype=dtype),
            torch.randn(b, s, hk, d, generator=g, dtype=dtype))


def _cu(*vals, dtype=torch.int32):
    return torch.tensor(vals, dtype=dtype)


def _attn(**kw):
    q, k, v = kw.pop("qkv", None) or _qkv()
    return ndp.ops.attention(q, k, v, **kw)


def _packed(cu_q, cu_k=None, total=16, **kw):
    q, k, v = (x[0] for x in _qkv(s=total))
    return ndp.ops.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_q if cu_k is None else cu_k, **kw)


def _kernel_fwd(**kw):
    q, k, v = kw.pop("qkv", None) or _qkv()
    return reference.flash_attn_fwd_ref(q, k, v, **kw)


def _train_config(**kw):
    from ndp.train.config import TrainConfig

    return TrainConfig(**kw)


def _yaml(text):
    import tempfile

    from ndp.train.config import parse_config

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(text)
    return parse_config(["--config", f.name], env={})


def _parallelize_mismatched_mesh():
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = ndp.ParallelismConfig().build_device_mesh("cpu")
        ndp.parallelize(torch.nn.Sequential(torch.nn.Linear(4, 4)), ndp.ParallelismConfig(tp_size=2), mesh)
    finally:
        if owned:
            dist.destroy_process_group()


def _load(path):
    from ndp.train.data import load_documents

    return load_documents(path)


q0, k0, v0 = _qkv()

# (id, callable, exception type, regex that names the constraint, the values and the fix)
CASES = [
    # ---- kernels / ops: dtypes, devices, shapes, heads, head_dim, strides
    ("int dtype", lambda: _attn(qkv=(q0.long(), k0.long(), v0.long())), TypeError,
     r"q must be float16, bfloat16, float32 or float64; got torch.int64. Cast q, k, v"),
    ("mixed dtypes", lambda: _attn(qkv=(q0, k0.half(), v0)), TypeError,
     r"share one dtype; got q=torch.float32, k=torch.float16.*Cast them"),
    ("3-D q without cu_seqlens", lambda: _attn(qkv=(q0[0], k0[0], v0[0])), ValueError,
     r"must be 4-D .*got shape \(16, 4, 16\).*needs cu_seqlens_q and cu_seqlens_k"),
    ("k and v shapes differ", lambda: _attn(qkv=(q0, k0, v0[:, :8])), ValueError,
     r"k and v must have the same shape \(.*\); got k=\(1, 16, 2, 16\), v=\(1, 8, 2, 16\). Pass"),
    ("batch mismatch", lambda: _attn(qkv=(torch.cat([q0, q0]), k0, v0)), ValueError,
     r"same batch size; got q=2, k=1. Pass k and v with q's batch \(2\)"),
    ("head_dim mismatch", lambda: _attn(qkv=(q0, k0[..., :8].contiguous(), v0[..., :8].contiguous())), ValueError,
     r"same head_dim; got q=16, k=8. Project q, k and v to one head_dim"),
    ("heads not divisible", lambda: _attn(qkv=_qkv(h=5, hk=2)), ValueError,
     r"heads must be divisible by kv_heads.*heads=5, kv_heads=2.*Use a kv_heads that divides 5"),
    ("head_dim too small", lambda: _attn(qkv=_qkv(d=8)), ValueError,
     r"head_dim must be in \[16, 256\]; got head_dim=8.*Pad the head dimension"),
    ("head_dim too large", lambda: _attn(qkv=_qkv(d=264)), ValueError,
     r"head_dim must be in \[16, 256\]; got head_dim=264.*split heads"),
    ("non-contiguous last dim", lambda: _attn(qkv=(q0.transpose(-1, -2).contiguous().transpose(-1, -2), k0, v0)),
     ValueError, r"q must have stride 1 in the last dim \(head_dim\), got stride 4; call .contiguous\(\)"),
    ("not a tensor", lambda: _attn(qkv=(q0.tolist(), k0, v0)), TypeError, r"q must be a torch.Tensor, got list; pass torch.as_tensor\(q\)"),
    ("window not a pair", lambda: _attn(window_size=3), TypeError, r"window_size must be a pair \(left, right\)"),
    ("window below -1", lambda: _attn(window_size=(-2, 0)), ValueError,
     r"window_size entries must be >= -1 \(-1 = unlimited\); got \(-2, 0\)"),
    ("unknown backend", lambda: _attn(backend="cudnn"), ValueError, r"backend must be one of \('auto',.*got 'cudnn'"),
    ("flash_attn on CPU", lambda: _attn(backend="flash_attn"), RuntimeError,
     r"'flash_attn' is not available on cpu: flash-attn needs a CUDA device.*Use backend='auto' or 'torch'"),
    # ---- packed input: cu_seqlens
    ("cu_seqlens int64", lambda: _packed(_cu(0, 8, 16, dtype=torch.int64)), TypeError,
     r"cu_seqlens_q must be int32; got torch.int64. Use cu_seqlens_q.to\(torch.int32\)"),
    ("cu_seqlens not from 0", lambda: _packed(_cu(2, 8, 16)), ValueError, r"cu_seqlens_q must start at 0; got "
                                                                          r"cu_seqlens_q\[0\]=2. Prepend the 0"),
    ("cu_seqlens decreasing", lambda: _packed(_cu(0, 9, 8, 16)), ValueError,
     r"cu_seqlens_q must be non-decreasing; got cu_seqlens_q\[1\]=9 > cu_seqlens_q\[2\]=8. It is the cumulative sum"),
    ("cu_seqlens not ending at tokens", lambda: _packed(_cu(0, 8, 15)), ValueError,
     r"cu_seqlens_q\[-1\] must equal the number of tokens \(16\); got 15.*cumulative sum"),
    ("cu_seqlens one entry", lambda: _packed(_cu(0)), ValueError, r"at least 2 entries; got shape \(1,\). Use \[0, len_1"),
    ("only cu_seqlens_q", lambda: ndp.ops.attention(q0[0], k0[0], v0[0], cu_seqlens_q=_cu(0, 16)), ValueError,
     r"needs both cu_seqlens_q and cu_seqlens_k \(pass the same tensor twice"),
    ("doc counts differ", lambda: _packed(_cu(0, 8, 16), _cu(0, 16)), ValueError,
     r"same number of documents; got 2 and 1. Pass one entry per document"),
    ("max_seqlen too small", lambda: _packed(_cu(0, 10, 16), max_seqlen_q=4), ValueError,
     r"max_seqlen_q=4 is smaller than the longest document \(10\); pass max of the document lengths or None"),
    # ---- numerics: scale, non-finite inputs
    ("scale nan", lambda: _attn(softmax_scale=float("nan")), ValueError, r"softmax_scale.*nan"),
    ("scale inf", lambda: _attn(softmax_scale=math.inf), ValueError, r"softmax_scale.*inf"),
    ("scale negative", lambda: _attn(softmax_scale=-0.1), ValueError, r"softmax_scale.*-0.1"),
    # ---- accumulators (kernel API)
    ("out_acc without lse_acc", lambda: _kernel_fwd(out_acc=torch.zeros(q0.shape)), ValueError,
     r"out_acc and lse_acc go together: pass both accumulators or neither"),
    ("out_acc wrong dtype", lambda: _kernel_fwd(out_acc=torch.zeros(q0.shape, dtype=torch.float16),
                                                lse_acc=torch.zeros(1, 4, 16)), TypeError,
     r"out_acc must be torch.float32; got torch.float16. Allocate it with dtype=torch.float32"),
    ("lse_acc wrong shape", lambda: _kernel_fwd(out_acc=torch.zeros(q0.shape), lse_acc=torch.zeros(1, 16, 4)),
     ValueError, r"lse_acc must have shape \(1, 4, 16\); got \(1, 16, 4\). Allocate it with torch.zeros"),
    ("merge shapes differ", lambda: reference.merge_attn_states_ref(torch.zeros(1, 4, 2, 16), torch.zeros(1, 2, 4),
                                                                    torch.zeros(1, 5, 2, 16), torch.zeros(1, 2, 4)),
     ValueError, r"block_out must have out_acc's shape \(1, 4, 2, 16\); got \(1, 5, 2, 16\). Merge blocks"),
    # ---- sharding
    ("zigzag seqlen not divisible", lambda: ndp.shard_sequence(torch.zeros(1, 10, 2), dim=1, world_size=4, rank=0),
     ValueError, r"zigzag sharding needs seqlen divisible by 2\*cp_size; got seqlen=10, cp_size=4. Pad the sequence to a "
     r"multiple of 8"),
    ("unknown layout", lambda: ndp.shard_sequence(torch.zeros(1, 8), dim=1, world_size=2, rank=0, layout="ring"),
     ValueError, r"layout.*'ring'"),
    ("dim out of range", lambda: ndp.shard_sequence(torch.zeros(1, 8), dim=3, world_size=2, rank=0), ValueError,
     r"dim=3 is out of range for a tensor of shape \(1, 8\); pass the sequence dim, in \[-2, 1\]"),
    ("rank out of range", lambda: ndp.shard_sequence(torch.zeros(1, 8), dim=1, world_size=2, rank=2), ValueError,
     r"0 <= rank < world_size; got world_size=2, rank=2. Pass this process's rank"),
    ("world_size without rank", lambda: ndp.shard_sequence(torch.zeros(1, 8), dim=1, world_size=2), ValueError,
     r"pass both world_size and rank \(or a group\); got world_size=2, rank=None"),
    ("shard_packed decreasing", lambda: ndp.shard_packed(_cu(0, 9, 8), world_size=2, rank=0), ValueError,
     r"cu_seqlens must start at 0 and be non-decreasing"),
    ("shard_packed float", lambda: ndp.shard_packed(torch.tensor([0.0, 4.0]), world_size=2, rank=0), ValueError,
     r"1-D int32/int64 tensor.*dtype=torch.float32"),
    ("shard_packed min_piece", lambda: ndp.shard_packed(_cu(0, 8), world_size=2, rank=0, min_piece=0), ValueError,
     r"min_piece must be an int >= 1; got 0"),
    # ---- ParallelismConfig
    ("degree zero", lambda: ndp.ParallelismConfig(cp_size=0), ValueError, r"ParallelismConfig.cp_size must be >= 1; "
                                                                          r"got cp_size=0"),
    ("degree not int", lambda: ndp.ParallelismConfig(tp_size=2.0), TypeError, r"ParallelismConfig.tp_size must be "
                                                                              r"an int; got 2.0"),
    ("unknown cp_impl", lambda: ndp.ParallelismConfig(cp_impl="ringg"), ValueError,
     r"cp_impl must be one of \(.*\); got cp_impl='ringg'"),
    ("unknown cp_layout", lambda: ndp.ParallelismConfig(cp_layout="zz"), ValueError,
     r"cp_layout must be one of .*got cp_layout='zz'"),
    ("ulysses not dividing cp", lambda: ndp.ParallelismConfig(cp_size=4, cp_impl="usp", ulysses_size=3), ValueError,
     r"ulysses_size must divide cp_size; got ulysses_size=3"),
    # ---- training config, CLI/YAML, data, parallelize
    ("unknown preset", lambda: _train_config(model="huge-llama").check(1), ValueError,
     r"unknown model 'huge-llama'; choose a preset \(tiny-llama, .*llama-3-8b.*\) or pass a local Hugging Face model directory"),
    ("yaml unknown key", lambda: _yaml("sq_len: 3\n"), ValueError,
     r"unknown option 'sq_len'; did you mean 'seq_len'\? Valid options: .*batch_size"),
    ("yaml not a mapping", lambda: _yaml("- a\n- b\n"), ValueError, r"expected a mapping of options, got list"),
    ("batch not divisible", lambda: _train_config(seq_len=64, batch_size=3,
                                                  parallel=ndp.ParallelismConfig(dp_shard_size=2)).check(2),
     ValueError, r"--batch-size .* must be divisible .*batch_size=3.*Use a multiple of 2"),
    ("unreadable data file", lambda: _load("/nonexistent/corpus.txt"), ValueError,
     r"--data '/nonexistent/corpus.txt' cannot be read as UTF-8 text .*leave --data out for the shipped corpus"),
    ("mesh of another config", _parallelize_mismatched_mesh, ValueError,
     r"DeviceMesh does not match the ParallelismConfig \(tp: config 2, mesh 1\).*config.build_device_mesh"),
    ("resume without save dir", lambda: _train_config(resume=True), ValueError, r"--resume needs --save-dir"),
    ("stop-after out of range", lambda: _train_config(steps=2, stop_after=5, save_dir="x"), ValueError,
     r"--stop-after must be in \[1, steps\]; got stop_after=5, steps=2"),
    ("degrees vs world", lambda: ndp.ParallelismConfig(dp_shard_size=2, cp_size=2).check_world_size(8), ValueError,
     r"must equal the world size; got .* = 4, world_size=8. Change the degrees or launch 4 processes"),
]


@pytest.mark.parametrize("name,fn,exc,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_a_clear_error(name, fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


def test_there_are_at_least_forty_cases():
    assert len(CASES) >= 50
