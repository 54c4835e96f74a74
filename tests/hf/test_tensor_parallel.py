"""Tensor parallel of transformers models with their own plans (``config.base_model_tp_plan``), float64, against one
process: per-head q/k norms (Qwen3, Gemma 3: "replicated_with_grad_allreduce"), gathered projections (OLMo 2, Phi-3:
"colwise_gather_output" / "rowwise_split_input"), attention sinks ("local_params": Granite SWA), parameters the plan
leaves whole beside split projections (below), mixtures of experts and multi-head latent attention (below), alone
and under FSDP2; a plan ndp cannot apply is refused by name before any work."""
import pytest
import torch
from torch.distributed.tensor import DTensor

import ndp
import ndp.hf
from _zoo import tiny_model
from dist import spawn

FAMILIES = ("qwen3", "gemma3_text", "olmo2", "phi3", "granite_swa", "apertus", "phi")
# Parameters a plan leaves whole beside column-split projections, each output element computed from the rank's own
# share (ndp.parallel.SummedParams: gradients summed over TP): Apertus' xIELU scalars on the split MLP width, Phi's
# q/k LayerNorms per head (qk_layernorm), Glm4-MoE's q/k norms (sarvam_moe: use_qk_norm, not in its plan). Without the
# sum the zoo's tp 2 run measured Apertus 3.0-4.0 and sarvam_moe 0.7-0.9 off (largest relative difference).
FIELDS = {"phi": dict(qk_layernorm=True)}
# Mixture-of-experts families, their stacked experts split over the TP ranks by ndp.parallel.ExpertsParallel (the
# plan's "moe_tp_experts"), the load-balancing loss on, run by transformers' batched-matmul experts kernel (its
# grouped one takes no float64 on CPU) and by the family's loop: Qwen3-MoE (its first layer a dense MLP: the plan's
# dense entries name layer 0's modules only), Aria (transposed weights), Nemotron-H (one projection, batched only),
# DeepSeek-V2 (its multi-head latent attention too: the shared rotary key's gradient summed, SharedKeyParallel),
# MiMo-V2-Flash (attention sinks split by heads in its sliding-window layers, none in the others: LocalParams),
# Llama 4 (a dense first layer; its plan under a prefix its causal LM does not hold; its experts take every
# expert's rows at once, ExpertsParallel(blocked=True); its MoE adds them into its row-split shared expert's output in
# place, RowwiseOwnOutput).
MOE = {"qwen3_moe": dict(mlp_only_layers=[0], output_router_logits=True, router_aux_loss_coef=0.5),
       "aria_text": dict(output_router_logits=True, router_aux_loss_coef=0.5), "deepseek_v2": {}, "mimo_v2_flash": {},
       "llama4_text": dict(moe_layers=[1]), "sarvam_moe": {}}
MOE_KERNELS = {"nemotron_h": ("batched_mm",), "llama4_text": ("eager",)}


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


def _model(family, experts="eager", **fields):
    model = tiny_model(family, **fields)
    model.config._experts_implementation = experts  # read by the experts' forward at every call
    return model


def _tp_body(rank, world, layout):
    cfg = ndp.ParallelismConfig(**layout)
    mesh = cfg.build_device_mesh("cpu")
    moe = [(f, dict(MOE.get(f, {}), experts=k)) for f in [*MOE, *MOE_KERNELS]
           for k in MOE_KERNELS.get(f, ("batched_mm", "eager"))]
    cases = [(f, FIELDS.get(f, {})) for f in FAMILIES] + moe
    for family, fields in cases:
        ref = _model(family, **fields)
        batch = _batch(ref.config.vocab_size)
        want, want_grads = _loss_and_grads(ref, batch)
        model = ndp.hf.parallelize(_model(family, **fields), cfg, mesh)
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
    ("inkling2_text", {}, r"Inkling2ForCausalLM's plan \(base_model_tp_plan\) splits model.embed_tokens as "
                          r"'replicate'.*styles ndp does not implement.*Train Inkling2ForCausalLM with tp_size=1"),
    # Nemotron-H's own experts loop indexes the experts other ranks hold (its batched kernels skip them)
    ("nemotron_h", {}, r"splits the experts model.layers.\*.mixer.experts \('moe_tp_experts'\), which ndp splits "
                       r"by experts where .* NemotronHExperts does not"),
    # the experts' parameters named without their module's entry
    ("qwen3_moe", dict(base_model_tp_plan={"layers.*.mlp.experts.down_proj": "rowwise"}),
     r"splits the parameters model.layers.\*.mlp.experts.down_proj by themselves"),
    # a plan naming none of the model's modules
    ("llama", dict(base_model_tp_plan={"decoder.*.self_attn.q_proj": "colwise"}),
     r"LlamaForCausalLM has no tensor-parallel plan that names its modules"),
    # No plan; laid out like Llama, its per-head q/k LayerNorms would be applied to another rank's heads.
    ("stablelm", dict(qk_layernorm=True), r"StableLmForCausalLM has no tensor-parallel plan .* does not guess one"),
    # a parameter per key/value head beside the split projections, neither a per-head norm's nor an activation's
    ("doge", {}, r"leaves model.layers.0.self_attn.A, model.layers.1.self_attn.A whole beside them"),
    ("gemma3n_text", {}, r"Gemma3nForCausalLM's activation sparsity .* statistics over the whole MLP width"),
])
def test_a_plan_ndp_cannot_apply_is_refused_before_any_work(family, fields, match):
    model = tiny_model(family) if not fields else _with(family, **fields)
    with pytest.raises(ndp.hf.Unsupported, match=match):
        ndp.hf.parallelize(model, ndp.ParallelismConfig(tp_size=2), None)


@pytest.mark.parametrize("family, field", [("qwen3_moe", "num_experts"), ("mixtral", "num_local_experts"),
                                           ("llama4_text", "num_local_experts")])
def test_experts_that_tp_cannot_split_evenly_are_refused_by_name(family, field):
    model = tiny_model(family, **{field: 5})
    with pytest.raises(ValueError, match=r"splits the experts of \w+Experts over the ranks: num_experts=5 must be a "
                                         r"multiple of tp_size=2"):
        ndp.hf.parallelize(model, ndp.ParallelismConfig(tp_size=2), None)
    ndp.hf.check_model(tiny_model(family, **{field: 6}), ndp.ParallelismConfig(tp_size=2))


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


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _step(model, batch):
    """One SGD step, weight decay on (it steps a parameter with a gradient, zero or not, and skips one without):
    the whole gradients and the whole parameters after it."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1)
    model(**batch).loss.backward()
    grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    return grads, {n: _full(p).detach() for n, p in model.named_parameters()}


def _idle_experts_body(rank, world, layout):
    cfg = ndp.ParallelismConfig(**layout)
    mesh = cfg.build_device_mesh("cpu")
    models = []
    for _ in range(2):
        models.append(tiny_model("afmoe").train())
        for n, p in models[-1].named_parameters():
            if n.endswith("expert_bias"):  # every token picks experts 0 and 1 (top 2 of 4): TP rank 0's
                p.data.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))
    batch = _batch(models[0].config.vocab_size)
    want_grads, want = _step(models[0], batch)
    model = ndp.hf.parallelize(models[1], cfg, mesh)
    grads, got = _step(model, batch)
    assert set(grads) == set(want_grads)
    for n, p in model.named_parameters():
        if ".experts." in n:  # a gradient on every rank (zeros on TP rank 1's idle experts), as one process's
            assert bool((p.grad.to_local() == 0).all()) == (mesh["tp"].get_local_rank() == 1), n
        if n in grads:  # afmoe routes in float32 inside the float64 model: float32's rounding, as the zoo's
            err = float((grads[n] - want_grads[n]).abs().max() / want_grads[n].abs().max().clamp(min=1e-30))
            assert err <= 1e-4, f"{n}: gradient {err:.1e} off one process's"
        # the step's decay alone moves each parameter by 1e-2 of itself: a parameter stepped apart is far off
        err = float((got[n] - want[n]).abs().max() / want[n].abs().max())
        assert err <= 1e-6, f"{n}: after one SGD step {err:.1e} off one process's"


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [dict(tp_size=2), dict(dp_shard_size=2, tp_size=2)], ids=["tp2", "fsdp2_tp2"])
def test_a_rank_whose_experts_get_no_token_trains_as_one_process(tmp_path, layout):
    """The router sends every token to TP rank 0's experts. Rank 1's experts still get their (zero) gradient, as one
    process's do, and join every sum: before, their gradients were None on that rank alone (the evaluation of the
    gradients hung in a collective rank 0 alone entered; FSDP2 and the optimizer would have treated them apart)."""
    spawn(_idle_experts_body, 2 * layout.get("dp_shard_size", 1), tmp_path, layout, timeout_s=120)


def _moe_checkpoint_body(rank, world, path, family):
    from transformers import AutoModelForCausalLM
    from _zoo import tiny_config
    from ndp.train.checkpoint import load_checkpoint, save_checkpoint

    def build(cfg):
        model = ndp.hf.parallelize(tiny_model(family), cfg, cfg.build_device_mesh("cpu"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    model, opt, sched = build(ndp.ParallelismConfig(tp_size=2))
    batch = _batch(model.config.vocab_size)
    model(**batch).loss.backward()
    opt.step()
    saved = save_checkpoint(path, 1, model, opt, sched)
    other, other_opt, other_sched = build(ndp.ParallelismConfig(dp_shard_size=2))
    load_checkpoint(saved, other, other_opt, other_sched)
    loaded = dict(other.named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(_full(p), _full(loaded[n])), n
        assert torch.equal(_full(opt.state[p]["exp_avg"]), _full(other_opt.state[loaded[n]]["exp_avg"])), n
    # a meta model split by experts gets the shards of the seeded initialisation
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.float64)
    cfg = ndp.ParallelismConfig(tp_size=2)
    meta = ndp.hf.parallelize(meta, cfg, cfg.build_device_mesh("cpu"), init_seed=3)
    whole = dict(ndp.hf.init_weights(tiny_model(family), seed=3).named_parameters())
    for n, p in meta.named_parameters():
        assert torch.equal(_full(p), whole[n]), n


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["qwen3_moe", "llama4_text"])
def test_experts_split_by_tp_checkpoint_in_whole_shapes_and_resume_on_another_layout(tmp_path, family):
    """The experts' parameters are DTensors of their whole shapes split along the experts, a layout distributed
    checkpoints save (splitting each expert's width packs gate and up: two pieces per rank, which they cannot);
    Llama 4's blocked experts alike."""
    spawn(_moe_checkpoint_body, 2, tmp_path, str(tmp_path / "ckpt"), family, timeout_s=120)
