"""Bad input to the Triton entry points: clear ValueError/TypeError naming constraint, values and fix.

The checks live in ndp_kernels.segments and are shared with the reference, so both must raise the
same messages; every case runs against both.
"""
import pytest
import torch

from ndp_kernels import flash, reference
from ndp.testing import assert_close

FWDS = [pytest.param(flash.flash_attn_fwd, id="triton"), pytest.param(reference.flash_attn_fwd_ref, id="ref")]


def _qkv(b=1, s=8, h=4, hk=2, d=32, dtype=torch.float32):
    return (torch.randn(b, s, h, d, dtype=dtype), torch.randn(b, s, hk, d, dtype=dtype),
            torch.randn(b, s, hk, d, dtype=dtype))


@pytest.mark.parametrize("fwd", FWDS)
def test_wrong_rank(fwd):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"q must be 4-D \[batch, seq, heads, head_dim\]; got shape \(8, 4, 32\)"):
        fwd(q[0], k, v)
    with pytest.raises(ValueError, match="Packed input needs cu_seqlens_q and cu_seqlens_k"):
        fwd(q[0], k[0], v[0])


@pytest.mark.parametrize("fwd", FWDS)
def test_heads_not_divisible_by_kv_heads(fwd):
    q, k, v = _qkv(h=4, hk=3)
    with pytest.raises(ValueError, match=r"heads must be divisible by kv_heads.*heads=4, kv_heads=3"):
        fwd(q, k, v)


@pytest.mark.parametrize("fwd", FWDS)
def test_dtype_mismatch(fwd):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"q, k, v must share one dtype; got q=torch.float32, k=torch.float16"):
        fwd(q, k.half(), v)


def test_integer_dtype():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="q must be float16, bfloat16, float32 or float64"):
        flash.flash_attn_fwd(q.int(), k.int(), v.int())


def test_float64_needs_reference():
    q, k, v = _qkv(dtype=torch.float64)
    with pytest.raises(TypeError, match="the Triton kernels take float16, bfloat16 or float32 inputs"):
        flash.flash_attn_fwd(q, k, v)


def test_bf16_refused_under_the_interpreter(monkeypatch):
    """Triton's interpreter multiplies bf16 bit patterns in tl.dot: the launchers refuse bf16 there, before any
    launch, rather than return garbage (on a GPU, NDP_TEST_DEVICE=cuda, the same call under the env var)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = _qkv(dtype=torch.bfloat16)
    match = r"Triton's interpreter \(TRITON_INTERPRET=1\) computes a bfloat16 tl.dot on the raw bit patterns"
    with pytest.raises(TypeError, match=match):
        flash.flash_attn_fwd(q, k, v)
    out, lse = reference.flash_attn_fwd_ref(q, k, v)
    with pytest.raises(TypeError, match=match):
        flash.flash_attn_bwd(torch.ones_like(out), q, k, v, out, lse)


@pytest.mark.parametrize("fwd", FWDS)
def test_device_mismatch(fwd):
    q, k, v = _qkv()
    # q's device is the test device: cpu, or cuda:0 with NDP_TEST_DEVICE=cuda (the GPU report's kernel tests)
    with pytest.raises(ValueError, match=f"q, k, v must be on one device; got q={q.device}, k=meta"):
        fwd(q, k.to("meta"), v)


@pytest.mark.parametrize("fwd", FWDS)
def test_non_contiguous_last_dim(fwd):
    q, k, v = _qkv()
    q_t = torch.randn(1, 8, 32, 4).transpose(2, 3)  # [1, 8, 4, 32] with stride(-1) = 4
    with pytest.raises(ValueError, match=r"q must have stride 1 in the last dim.*call \.contiguous\(\)"):
        fwd(q_t, k, v)


@pytest.mark.parametrize("fwd", FWDS)
@pytest.mark.parametrize("d", [8, 512])
def test_head_dim_out_of_range(fwd, d):
    q, k, v = _qkv(d=d)
    with pytest.raises(ValueError, match=rf"head_dim must be in \[16, 256\]; got head_dim={d}"):
        fwd(q, k, v)


def _packed(total=10):
    return torch.randn(total, 2, 32), torch.randn(total, 2, 32), torch.randn(total, 2, 32)


@pytest.mark.parametrize("fwd", FWDS)
@pytest.mark.parametrize("cu, exc, match", [
    ([0, 6, 4, 10], ValueError,
     r"cu_seqlens_q must be non-decreasing; got cu_seqlens_q\[1\]=6 > cu_seqlens_q\[2\]=4"),
    (torch.tensor([0, 4, 10], dtype=torch.int64), TypeError, r"cu_seqlens_q must be int32; got torch.int64"),
    ([0, 4, 9], ValueError, r"cu_seqlens_q\[-1\] must equal the number of tokens \(10\); got 9"),
], ids=["not_increasing", "wrong_dtype", "last_entry"])
def test_bad_cu_seqlens(fwd, cu, exc, match):
    q, k, v = _packed()
    cu = cu if torch.is_tensor(cu) else torch.tensor(cu, dtype=torch.int32)
    with pytest.raises(exc, match=match):
        fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)


def test_cu_seqlens_only_one_given():
    q, k, v = _packed()
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="packed input needs both cu_seqlens_q and cu_seqlens_k"):
        flash.flash_attn_fwd(q, k, v, cu_seqlens_q=cu)


def test_accumulator_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="out_acc and lse_acc go together"):
        flash.flash_attn_fwd(q, k, v, out_acc=torch.zeros(q.shape))
    with pytest.raises(TypeError, match=r"out_acc must be torch.float32; got torch.float16"):
        flash.flash_attn_fwd(q, k, v, out_acc=torch.zeros(q.shape, dtype=torch.float16),
                             lse_acc=torch.zeros(1, 4, 8))
    with pytest.raises(ValueError, match=r"lse_acc must have shape \(1, 4, 8\); got \(1, 8, 4\)"):
        flash.flash_attn_fwd(q, k, v, out_acc=torch.zeros(q.shape), lse_acc=torch.zeros(1, 8, 4))


def test_bwd_errors():
    q, k, v = _qkv()
    out, lse = flash.flash_attn_fwd(q, k, v)
    with pytest.raises(ValueError, match=r"lse must have shape \(1, 4, 8\)"):
        flash.flash_attn_bwd(out, q, k, v, out, lse[:, :2])
    with pytest.raises(ValueError, match="dq_acc, dk_acc and dv_acc go together"):
        flash.flash_attn_bwd(out, q, k, v, out, lse, dq_acc=torch.zeros(q.shape))
    with pytest.raises(ValueError, match=r"heads must be divisible by kv_heads"):
        flash.flash_attn_bwd(out, q, k[:, :, :1].expand(1, 8, 3, 32), v[:, :, :1].expand(1, 8, 3, 32), out, lse)


@pytest.mark.cpu_only
def test_cpu_without_interpreter_is_a_runtime_error(monkeypatch):
    monkeypatch.setattr(flash, "interpreter_active", lambda: False)
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match="Triton kernels need a CUDA tensor or TRITON_INTERPRET=1"):
        flash.flash_attn_fwd(q, k, v)


@pytest.mark.parametrize("fwd", FWDS)
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), 0.0, -0.125])
def test_bad_softmax_scale(fwd, scale):
    # NaN/inf/<=0 used to give finite, wrong output; now refused in the shared check (fwd and bwd).
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"softmax_scale must be finite and > 0; got softmax_scale=.*Pass None"):
        fwd(q, k, v, softmax_scale=scale)
    out, lse = fwd(q, k, v)
    bwd = flash.flash_attn_bwd if fwd is flash.flash_attn_fwd else reference.flash_attn_bwd_ref
    with pytest.raises(ValueError, match="softmax_scale must be finite and > 0"):
        bwd(out, q, k, v, out, lse, softmax_scale=scale)


def test_softmax_scale_type():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="softmax_scale must be a real number or None.*'0.1'"):
        reference.flash_attn_fwd_ref(q, k, v, softmax_scale="0.1")
    # a valid explicit scale is the scale used: 0.1 with scores*0.1 == default scale on 1/sqrt(32)*... inputs
    out, _ = reference.flash_attn_fwd_ref(q, k, v, softmax_scale=0.1)
    want = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, dim=2)) * 0.1, -1)
    want = torch.einsum("bhqk,bkhd->bqhd", want, v.repeat_interleave(2, dim=2))
    assert_close(out, want, torch.float32)


def test_reference_has_the_kernel_signatures():
    """docs/design.md: the reference functions take the launchers' arguments (plus ``upcast``)."""
    import inspect

    import ndp_kernels
    from ndp_kernels import reference

    for kern, ref in ((ndp_kernels.flash_attn_fwd, reference.flash_attn_fwd_ref),
                      (ndp_kernels.flash_attn_bwd, reference.flash_attn_bwd_ref)):
        want = list(inspect.signature(kern).parameters)
        assert list(inspect.signature(ref).parameters) == want + ["upcast"], (kern.__name__, want)
