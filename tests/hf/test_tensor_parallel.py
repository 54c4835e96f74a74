"""Tensor parallel of transformers models with their own plans (``config.base_model_tp_plan``), float64, against one
process: per-head q/k norms (Qwen3, Gemma 3: "replicated_with_grad_allreduce"), gathered projections (OLMo 2, Phi-3:
"colwise_gather_output" / "rowwise_split_input"), alone and under FSDP2; a plan ndp cannot apply is refused by name
before any work."""
import pytest
import torch
from torch.distributed.tensor import DTensor

import ndp
import ndp.hf
from _zoo import tiny_model
from dist import spawn

FAMILIES = ("qwen3", "gemma3_text", "olmo2", "phi3")


def _batch(vocab, seq=24):
    ids = torch.randint(3, vocab, (2, seq), generator=torch.Generator().manual_seed(1))
    return dict(input_ids=ids, labels=ids.clone(), use_cache=False)


def _loss_and_grads(model, batch):
    loss = model(**batch).loss
    loss.backward()
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad
        # A replicated parameter's gradient is this rank's own: it must already hold every rank's share.
        grads[n] = g.full_tensor() if isinstance(g, DTensor) else g
    return loss.detach(), grads


def _tp_body(rank, world, layout):
    cfg = ndp.ParallelismConfig(**layout)
    for family in FAMILIES:
        ref = tiny_model(family)
        batch = _batch(ref.config.vocab_size)
        want, want_grads = _loss_and_grads(ref, batch)
        model = ndp.hf.parallelize(tiny_model(family), cfg, cfg.build_device_mesh("cpu"))
        got, grads = _loss_and_grads(model, batch)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0, msg=lambda m: f"{family} loss: {m}")
        assert set(grads) == set(want_grads)
        for n, g in want_grads.items():
            # Relative to the tensor's largest entry: the norms of these families compute in float32 inside the
            # float64 model, so a gradient summed in another order rounds differently there (measured <= 2e-7);
            # a gradient missing a rank's share is off by tens of percent.
            err = float((grads[n] - g).abs().max() / g.abs().max())
            assert err <= 1e-6, f"{family} {n}: gradient differs from one process's by {err:.1e} of its largest entry"


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [dict(tp_size=2), dict(dp_shard_size=2, tp_size=2)], ids=["tp2", "fsdp2_tp2"])
def test_tensor_parallel_with_the_models_own_plan_matches_one_process(tmp_path, layout):
    spawn(_tp_body, 2 * layout.get("dp_shard_size", 1), tmp_path, layout, timeout_s=120)


@pytest.mark.parametrize("family, match", [
    ("qwen3_moe", r"Qwen3MoeForCausalLM's plan \(base_model_tp_plan\) splits .*experts.* as 'moe_tp_experts'.*"
                  r"styles ndp does not implement.*Train Qwen3MoeForCausalLM with tp_size=1"),
    ("stablelm", r"StableLmForCausalLM has no tensor-parallel plan .* ndp does not guess one"),
])
def test_a_plan_ndp_cannot_apply_is_refused_before_any_work(family, match):
    # StableLM has no plan; laid out like Llama, its per-head q/k LayerNorms (qk_layernorm) would be applied to
    # another rank's heads by Llama's split.
    with pytest.raises(ndp.hf.Unsupported, match=match):
        ndp.hf.parallelize(tiny_model(family), ndp.ParallelismConfig(tp_size=2), None)
