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
    mesh = cfg.build_device_mesh("cpu")
    for family in FAMILIES:
        ref = tiny_model(family)
        batch = _batch(ref.config.vocab_size)
        want, want_grads = _loss_and_grads(ref, batch)
        model = ndp.hf.parallelize(tiny_model(family), cfg, mesh)
        got, grads = _loss_and_grads(model, batch)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0, msg=lambda m: f"{family} loss: {m}")
        assert set(grads) == set(want_grads)
        for n, g in want_grads.items():
            if g is None:  # a parameter the forward does not use
                assert grads[n] is None, f"{family} {n}: a gradient where one process has none"
                continue
            # Relative to the tensor's largest entry: the norms of these families compute in float32 inside the
            # float64 model, so a gradient summed in another order rounds differently there (measured <= 2e-7);
            # a gradient missing a rank's share is off by tens of percent.
            err = float((grads[n] - g).abs().max() / g.abs().max())
            assert err <= 1e-6, f"{family} {n}: gradient differs from one process's by {err:.1e} of its largest entry"


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [dict(tp_size=2), dict(dp_shard_size=2, tp_size=2)], ids=["tp2", "fsdp2_tp2"])
def test_tensor_parallel_with_the_models_own_plan_matches_one_process(tmp_path, layout):
    spawn(_tp_body, 2 * layout.get("dp_shard_size", 1), tmp_path, layout, timeout_s=120)


# Dropout on the activations every TP rank holds whole: the embeddings', the residual stream's, a row-split layer's
# summed output's.
DROPOUT = {"gpt_neox": dict(hidden_dropout=0.5), "phi3": dict(resid_pdrop=0.5, embd_pdrop=0.5),
           "starcoder2": dict(residual_dropout=0.5, embedding_dropout=0.5)}


def _dropout_body(rank, world, layout):
    cfg = ndp.ParallelismConfig(**layout)
    mesh = cfg.build_device_mesh("cpu")
    tp_group = torch.distributed.get_process_group_ranks(mesh["tp"].get_group())
    # every data-parallel replica's TP rank 0 (the same batch on each: FSDP averages their gradients)
    leaders = [None] * world
    torch.distributed.all_gather_object(leaders, tp_group[0])
    leaders = sorted(set(leaders))
    for family, fields in DROPOUT.items():
        batch = _batch(tiny_model(family).config.vocab_size)
        refs = []
        for leader in leaders:  # one process seeded as that replica's TP rank 0 is
            ref = tiny_model(family, **fields).train()
            torch.manual_seed(100 + leader)
            refs.append(_loss_and_grads(ref, batch))
            if leader == rank:
                after = torch.get_rng_state()
        model = ndp.hf.parallelize(tiny_model(family, **fields).train(), cfg, mesh)
        torch.manual_seed(100 + rank)  # each rank its own stream, as Accelerate's set_seed(device_specific=True)
        own = torch.get_rng_state()
        got, grads = _loss_and_grads(model, batch)
        # TP rank 0 draws on as one process; the others' streams are their own again
        assert torch.equal(torch.get_rng_state(), after if rank == tp_group[0] else own)
        want = refs[leaders.index(tp_group[0])][0]
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0, msg=lambda m: f"{family} loss: {m}")
        assert not torch.allclose(refs[0][0], _loss_and_grads(tiny_model(family).eval(), batch)[0])  # it drew
        for n, g in refs[0][1].items():
            if g is not None:
                g = sum(r[1][n] for r in refs) / len(refs)
                err = float((grads[n] - g).abs().max() / g.abs().max())
                assert err <= 1e-6, f"{family} {n}: gradient differs from one process's by {err:.1e}"


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [dict(tp_size=2), dict(dp_shard_size=2, tp_size=2)], ids=["tp2", "fsdp2_tp2"])
def test_dropout_under_tp_draws_as_one_process_seeded_like_tp_rank_0(tmp_path, layout):
    """Dropout on the whole activations in training, each rank seeded its own: the TP ranks draw one mask, TP rank
    0's, and the loss and every gradient equal one process's seeded like it. Before, each TP rank drew its own masks:
    its copy of the forward was another, the whole parameters' gradients differed between the ranks."""
    spawn(_dropout_body, 2 * layout.get("dp_shard_size", 1), tmp_path, layout, timeout_s=180)


@pytest.mark.parametrize("family, fields, match", [
    ("qwen3_moe", {}, r"Qwen3MoeForCausalLM's plan \(base_model_tp_plan\) splits .*experts.* as 'moe_tp_experts'.*"
                      r"styles ndp does not implement.*Train Qwen3MoeForCausalLM with tp_size=1"),
    # No plan; laid out like Llama, its per-head q/k LayerNorms would be applied to another rank's heads.
    ("stablelm", dict(qk_layernorm=True), r"StableLmForCausalLM has no tensor-parallel plan .* does not guess one"),
    # xIELU's two scalars act on the split MLP width: measured 120% off in the gradient without the refusal.
    ("apertus", {}, r"leaves model.layers.0.mlp.act_fn.alpha_p, model.layers.0.mlp.act_fn.alpha_n, .* whole beside"),
    # q/k LayerNorms its plan does not list
    ("phi", dict(qk_layernorm=True), r"leaves model.layers.0.self_attn.q_layernorm.weight, .* whole beside them"),
    ("gemma3n_text", {}, r"Gemma3nForCausalLM's activation sparsity .* statistics over the whole MLP width"),
])
def test_a_plan_ndp_cannot_apply_is_refused_before_any_work(family, fields, match):
    model = tiny_model(family) if not fields else _with(family, **fields)
    with pytest.raises(ndp.hf.Unsupported, match=match):
        ndp.hf.parallelize(model, ndp.ParallelismConfig(tp_size=2), None)


def _with(family, **fields):
    from transformers import AutoModelForCausalLM
    from _zoo import tiny_config

    cfg = tiny_config(family)
    for k, v in fields.items():
        setattr(cfg, k, v)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float64)


def test_a_multimodal_wrapper_splits_its_text_decoder_by_the_decoders_plan():
    model = tiny_model("gemma3")
    plan = ndp.hf.hf_plan(model).tp_plan
    assert plan["model.language_model.layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    assert not any("vision" in k for k in plan)
