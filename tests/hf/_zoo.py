"""The model zoo: every decoder-only causal-LM family the installed transformers can build from a tiny config.

``families()`` lists (model_type, class name) from transformers' causal-LM auto mapping; ``tiny_model(model_type)``
builds one with random float64 weights, every size field shrunk (hidden 64, 2-4 layers, 4 heads of 16, 2 KV heads,
tiny vocab, MoE with 4 experts), or raises when the family cannot be built that way (a multimodal wrapper that needs
a processor, a missing optional dependency)."""
import contextlib
import functools
import importlib
import inspect

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

from ndp.testing import tol

VOCAB = 128
# Field -> tiny value, applied to every (sub)config that has the field.
TINY = dict(
    vocab_size=VOCAB, hidden_size=64, n_embd=64, d_model=64, embed_dim=64, dim=64, model_dim=64, n_embed=64,
    intermediate_size=128, ffn_dim=128, n_inner=128, ffn_hidden_size=128, d_ff=128, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, expert_intermediate_size=32, decoder_ffn_dim=128, ffn_intermediate_size=128,
    num_hidden_layers=2, n_layer=2, num_layers=2, n_layers=2, decoder_layers=2, num_decoder_layers=2,
    num_attention_heads=4, n_head=4, n_heads=4, num_heads=4, decoder_attention_heads=4,
    num_key_value_heads=2, n_kv_heads=2, num_kv_heads=2, head_dim=16, kv_channels=16,
    max_position_embeddings=512, n_positions=512, n_ctx=512, max_seq_len=512, seq_length=512,
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    moe_topk=2, top_k=2, moe_k=2, n_group=1, topk_group=1, n_shared_experts=1, num_shared_experts=1,
    first_k_dense_replace=1, sliding_window=8, attention_chunk_size=8, chunk_size=8, attention_window=8,
    q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, qk_head_dim=16,
    attention_dropout=0.0, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, hidden_dropout=0.0,
    attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0, dropout=0.0, ffn_dropout=0.0, activation_dropout=0.0,
    vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16,  # Gemma 3n/4: 262144 x 256 per layer
    router_jitter_noise=0.0, input_jitter_noise=0.0, residual_dropout=0.0, use_cache=False, tie_word_embeddings=False,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


def families() -> list[str]:
    """Decoder-only causal-LM model types (encoder-decoder and encoder-as-decoder families left out)."""
    out = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            cfg = AutoConfig.for_model(model_type)
        except Exception:  # cannot even build its default config: reported by tiny_model
            out.append(model_type)
            continue
        if (getattr(cfg, "is_encoder_decoder", False) or "is_decoder" in cfg.__dict__
                or "add_cross_attention" in cfg.__dict__):
            continue
        out.append(model_type)
    return out


def _shrink(cfg, seen):
    if id(cfg) in seen:
        return
    seen.add(id(cfg))
    for name, value in TINY.items():
        name = getattr(cfg, "attribute_map", {}).get(name, name)  # kimi_linear: num_experts_per_tok -> ..._token
        if name in cfg.__dict__ and not isinstance(cfg.__dict__[name], (dict, list)) or name in ("vocab_size",):
            try:
                setattr(cfg, name, value)
            except Exception:
                pass
    for name, value in list(cfg.__dict__.items()):
        if isinstance(value, transformers.PretrainedConfig):
            _shrink(value, seen)
    d = cfg.__dict__
    if "qk_rope_head_dim" in d:  # MLA
        if "head_dim" in d:  # the RoPE part is the "head_dim"
            cfg.head_dim = d["qk_rope_head_dim"]
        if "num_key_value_heads" in d:  # MLA projects keys for every head
            cfg.num_key_value_heads = d["num_attention_heads"]
    if "rotary_dim" in d and isinstance(d["rotary_dim"], int):
        cfg.rotary_dim = 8
    if "mamba_d_head" in d and "mamba_n_heads" in d:  # mamba heads x head size = expand x hidden
        cfg.mamba_d_head, cfg.mamba_n_heads = 16, getattr(cfg, "mamba_expand", 2) * cfg.hidden_size // 16
        if "mamba_d_ssm" in d:  # falcon_h1 names the product too
            cfg.mamba_d_ssm = cfg.mamba_d_head * cfg.mamba_n_heads
    if "expand" in d and "n_groups" in d and "head_dim" in d:  # Mamba2
        cfg.num_heads = cfg.expand * cfg.hidden_size // cfg.head_dim
    for name in ("layer_types", "layers_block_type", "block_types", "hybrid_override_pattern"):
        v = cfg.__dict__.get(name)
        if isinstance(v, list) and len(v) > 0:
            n = getattr(cfg, "num_hidden_layers", 2)
            # keep one of each kind, in order, padded to the layer count
            kinds = list(dict.fromkeys(v))
            setattr(cfg, name, (kinds * n)[:max(n, len(kinds))])
            if len(kinds) > n and "num_hidden_layers" in cfg.__dict__:
                cfg.num_hidden_layers = len(kinds)


# Families whose default config transformers cannot build a model from, or whose tiny form needs more than the
# shrinking above: set after it.
FIXES = {
    # its default config sets no layer_types (the model reads them): one convolution layer, one attention layer
    "lfm2_moe": lambda c: c.__dict__.update(layer_types=["conv", "full_attention"], num_dense_layers=1),
    # its tiny form kept attention layers only (the convolution never ran): one of each
    "lfm2": lambda c: setattr(c, "layer_types", ["conv", "full_attention"]),
    # hybrids whose first layers are all state-space ones by default: one Mamba layer, one attention layer
    "bamba": lambda c: setattr(c, "attn_layer_indices", [1]),
    "jamba": lambda c: c.__dict__.update(attn_layer_period=2, attn_layer_offset=1),
    "granitemoehybrid": lambda c: setattr(c, "layer_types", ["linear_attention", "full_attention"]),
    # DbrxAttention reads rope_theta (the config has none) and clamps q/k/v by clip_qkv (None by default: a crash)
    "dbrx": lambda c: c.attn_config.__dict__.update(rope_theta=10000.0, clip_qkv=8.0),
    "cohere_compass_text": lambda c: setattr(c, "rope_parameters", {"full_attention": {"rope_type": "default",
                                                                                        "rope_theta": 10000.0}}),
    # the attention reads the hidden states joined to the embeddings (2 x hidden); sizes derived at __init__
    "zamba": lambda c: c.__dict__.update(attention_hidden_size=128, attention_head_dim=32, mamba_dt_rank=4,
                                         num_key_value_heads=4),
    "zamba2": lambda c: c.__dict__.update(attention_hidden_size=128, attention_head_dim=32, mamba_headdim=16,
                                          kv_channels=16, num_query_groups=4, num_key_value_heads=4, adapter_rank=8,
                                          hybrid_layer_ids=[i for i, t in enumerate(c.layers_block_type)
                                                            if t == "hybrid"]),
    # the local encoder/decoder cross-attend to the global transformer's patches; byte-group hashes of a small vocab
    "blt": lambda c: [c.__dict__.update(encoder_hash_byte_group_vocab=64),
                      c.global_config.__dict__.update(encoder_cross_output_size=64 * c.cross_attn_k)] + [
        s.__dict__.update(hidden_size_global=64) for s in (c.encoder_config, c.decoder_config)],
    "xlstm": lambda c: c.__dict__.update(embedding_dim=64, num_blocks=2, num_heads=4),
    "dots3_note_text": lambda c: setattr(c, "head_dim", 16),
    "dots3_note": lambda c: setattr(c.text_config, "head_dim", 16),
    # 4 layers, the last 2 reading the keys/values of the first 2 (KV sharing)
    # a NoPE layer (the second), whose queries Llama 4 scales by their index past floor_scale tokens (8192)
    "llama4_text": lambda c: c.__dict__.update(no_rope_layers=[1, 0], floor_scale=4),
    "llama4": lambda c: c.text_config.__dict__.update(no_rope_layers=[1, 0], floor_scale=4),
    "gemma3n_text": lambda c: c.__dict__.update(num_hidden_layers=4, num_kv_shared_layers=2,
                                                layer_types=c.layer_types[:2] * 2,
                                                activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0]),
}


# Families whose sizes are read or derived at __init__ (heterogeneous per-layer configs, RoPE fractions, indexer
# checks): given then, shrunk. dots3_note: MLA heads of 8 + 8 (its head_dim is the whole q/k head, reset after the
# shrinking); qwen4_exp: its sparse indexer's sizes (none by default, with indexed layers by default).
_DOTS3 = dict(swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_q_lora_rank=32, swa_kv_lora_rank=16,
              swa_head_dim=16, swa_qk_nope_head_dim=8, swa_v_head_dim=8, head_dim=16, qk_rope_head_dim=8,
              qk_nope_head_dim=8, v_head_dim=8, index_head_dim=16)
_QWEN4_EXP = dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                  indexer_compress_ratio=4, head_dim=16)
AT_INIT = {"dots3_note_text": _DOTS3, "dots3_note": dict(text_config=_DOTS3),
           "qwen4_exp_text": _QWEN4_EXP, "qwen4_exp": dict(text_config=_QWEN4_EXP)}


def tiny_config(model_type: str):
    cfg = AutoConfig.for_model(model_type, **AT_INIT.get(model_type, {}))
    _shrink(cfg, set())
    FIXES.get(model_type, lambda c: None)(cfg)
    cfg._attn_implementation = REFERENCE_ATTENTION.get(model_type, "eager")
    return cfg


# Families whose eager attention is not a reference: their own other implementation is.
REFERENCE_ATTENTION = {"blt": "sdpa"}  # eager gives NaN on cross-attention rows whose every key is masked


def tiny_model(model_type: str, seed: int = 0, **fields):
    """The family's tiny float64 model (eval mode), `fields` set on its config and its text config."""
    cfg = tiny_config(model_type)
    for c in {id(c): c for c in (cfg, cfg.get_text_config())}.values():
        for name, value in fields.items():
            setattr(c, name, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float64,
                                             attn_implementation=REFERENCE_ATTENTION.get(model_type, "eager"),
                                             experts_implementation="eager")
    return model.eval()


def rope_model(kind, threshold, **fields):
    """A tiny float64 model (:func:`tiny_model`, `fields` set) whose RoPE changes above `threshold` tokens: Phi-3
    with LongRoPE (its long factors far from the short ones) or Llama with dynamic NTK; queries and keys scaled so
    that the attention, and the logits, follow the rotation."""
    if kind == "longrope":
        half = TINY["head_dim"] // 2  # a factor per rotated pair
        rope = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=1.0, short_factor=[1.0] * half,
                    long_factor=[4.0 + i for i in range(half)], original_max_position_embeddings=threshold)
        model = tiny_model("phi3", original_max_position_embeddings=threshold, rope_parameters=rope, **fields)
    else:
        model = tiny_model("llama", max_position_embeddings=threshold,
                           rope_parameters=dict(rope_type=kind, rope_theta=10000.0, factor=4.0), **fields)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in ("qkv_proj", "q_proj", "k_proj")):
                p.mul_(10)
    return model.train()


# ------------------------------------------------------------------------------------------------ the checks
TOL = 1e-6     # float64: EXACT means within this relative difference (the gradients' max over parameters)
# Families computing part of a layer in float32: float32's gradient tolerance (ndp.testing); their gradients differ
# from the reference's by float32 rounding summed in another order, which depends on the CPU (qwen3_5 under tp 2:
# 9.5e-6 on one machine, 1.9e-5 on another).
FP32_TOL = tol(torch.float32, "grad")[1]
SEQ, BATCH = 32, 2
# Families that compute part of a layer in float32 inside a float64 model: a parameter's gradient summed over the
# tokens in another order differs by float32 rounding (checked parameter by parameter), so FP32_TOL there.
FP32_INSIDE = {"apertus": "xIELU activation (alpha_p, alpha_n) in float32",
               "apertus1p5_text": "xIELU's scalar alpha_p gradient sums float32-rounded values (the reference's "
                                  "softmax, RMSNorm): 1.7e-6; 1e-14 with both in float64",
               "gemma4_unified_text": "RMSNorm of q/k in float32",
               "gemma3n_text": "RMSNorm in float32 (Gemma3nRMSNorm upcasts)",
               "gemma4": "RMSNorm in float32 (Gemma4RMSNorm upcasts; cp 2: 1.8e-6, 8.1e-7 with it in float64)",
               "gemma4_text": "RMSNorm in float32 (Gemma4RMSNorm upcasts)",
               "gemma4_unified": "its text model's RMSNorm of q/k in float32",
               "longcat_flash": "router logits in float32",
               "mamba2": "gated RMSNorm and residual in float32",
               "olmo_hybrid": "RoPE cos/sin and the gated delta rule's norm in float32 (tensor parallel: 1.0e-6)",
               "qwen3_5": "gated delta rule in float32 (tensor parallel: 9.5e-6 to 1.9e-5; cp 2: 5.2e-5, 2.2e-7 with "
                          "it in float64)",
               "qwen3_5_text": "gated delta rule in float32 (tensor parallel)",
               "qwen3_5_moe": "gated delta rule in float32 (cp 2: 9.4e-6, 1.9e-7 with it in float64)",
               "qwen3_5_moe_text": "gated delta rule in float32 (cp 2: 9.4e-6)",
               "qwen3_next": "gated delta rule in float32 (cp 2: 6.4e-6, 1.3e-7 with it in float64)",
               "lara_mini": "gated delta rule in float32 (cp 2: 1.3e-5, 1.7e-7 with it in float64)",
               "bailing_hybrid": "its convolution's weight and forget gate kept in float32 (cp 2: 9.9e-7, 2.8e-8 "
                                 "with them in float64)",
               # image-text-to-text classes (cp_vlm_text)
               **dict.fromkeys(("minicpm_ocr", "minicpmv4_6", "minicpmv4_7"),
                               "its Qwen3.5 text model's gated delta rule in float32 (cp 2: 2.4e-5)"),
               **dict.fromkeys(("muse_glimmer", "muse_spark"),
                               "router logits and residual gates in float32 (cp 2: 1.0e-6, 1.2e-6)")}


def tolerance(model_type: str) -> float:
    """What EXACT means for the family: TOL, or FP32_TOL for one that computes part of a layer in float32."""
    return FP32_TOL if model_type in FP32_INSIDE else TOL


def _rel(a, b, floor=1e-30):
    return float((a - b).abs().max() / b.abs().max().clamp(min=floor))


@contextlib.contextmanager
def float64_softmax():
    """Inside (or a check decorated with it), a float64 input's softmax stays float64. transformers' eager attention
    takes its softmax in float32 (``softmax(..., dtype=torch.float32)``), which left the float64 reference up to
    ~1e-6 off the exact attention ndp computes (opt under cp 2: 9.9e-7 against TOL 1e-6; 2.1e-8 inside); routers'
    float32 softmaxes go float64 alike in the reference and the ndp run."""
    plain = torch.nn.functional.softmax

    def softmax(x, *args, dtype=None, **kw):
        return plain(x, *args, dtype=None if x.dtype == torch.float64 else dtype, **kw)

    torch.nn.functional.softmax = softmax
    try:
        yield
    finally:
        torch.nn.functional.softmax = plain


def batch():
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    return ids, labels, pos


def _inputs(model, ids, pos):
    params = inspect.signature(model.forward).parameters
    # position_ids named, or through **kwargs (moss_transcribe_diarize hands them to its language model)
    takes_pos = "position_ids" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    return dict(input_ids=ids, position_ids=pos) if takes_pos else dict(input_ids=ids)


def _forward(model, ids, pos):
    return model(**_inputs(model, ids, pos)).logits


def _reference_inputs(model, ids, pos):
    """The eager reference's inputs: the ndp run's, plus an all-ones attention_mask where the model's eager attention
    skips its causal mask without one (moshi in transformers 5.17 builds no mask when none is given, so its eager
    attention is bidirectional while sdpa and ndp apply the layers' is_causal)."""
    inputs = _inputs(model, ids, pos)
    masked = dict(inputs, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        plain = model(**inputs).logits
        try:
            with_mask = model(**masked).logits
        except Exception:  # noqa: BLE001 - a model that takes no mask: its plain run is the reference
            return inputs
    return inputs if _rel(with_mask, plain) <= TOL else masked


def classify(fn, tol=TOL):
    """("EXACT"|"DIFF", rel) from fn() -> rel, ("REFUSED", msg) for ndp's Unsupported, ("CRASH", msg) otherwise."""
    import ndp.hf

    try:
        rel = fn()
    except ndp.hf.Unsupported as e:
        return "REFUSED", str(e).split(". ")[0][:200]
    except Exception as e:  # noqa: BLE001 - a sweep reports every failure
        return "CRASH", f"{type(e).__name__}: {str(e)[:200]}"
    return ("EXACT" if rel <= tol else "DIFF"), rel


@float64_softmax()
def single(model_type):
    """1 process: ndp attention vs the model's eager attention, logits."""
    import ndp.hf

    try:
        model = tiny_model(model_type)
        ids, _, pos = batch()
        with torch.no_grad():
            ref = model(**_reference_inputs(model, ids, pos)).logits
    except Exception as e:  # noqa: BLE001 - transformers cannot run it from a tiny config: not ndp's to judge
        return "UNBUILT", f"{type(e).__name__}: {str(e)[:120]}"

    def run():
        with torch.no_grad():
            ndp.hf.register_attention()
            model.set_attn_implementation("ndp_ring")
            out = _forward(model, ids, pos)
        return _rel(out, ref)

    return classify(run)


def reference(model_type, seed=None, **fields):
    """1 process on the whole batch: (mean loss, {name: grad}) with eager attention; `fields` set on the config, the
    forward's random streams seeded with `seed` (where not None)."""
    model = tiny_model(model_type, **fields).train()
    ids, labels, pos = batch()
    inputs = _reference_inputs(model, ids, pos)  # (it runs the model: in training, it draws)
    if seed is not None:
        torch.manual_seed(seed)
    logits = model(**inputs).logits
    return _loss_and_grads(model, torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                                    labels.reshape(-1)))


def _worst(loss, grads, ref_loss, ref_grads):
    """Largest relative difference of one process's loss and gradients from the reference's (a gradient the run
    lacks: inf); a gradient that is zero in exact arithmetic is measured against the largest one."""
    floor = 1e-4 * max(float(g.abs().max()) for g in ref_grads.values())
    return max([_rel(loss, ref_loss)] + [_rel(grads[k], g, floor) if k in grads else float("inf")
                                         for k, g in ref_grads.items()])


def _loss_and_grads(model, loss):
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@float64_softmax()
def fused(model_type):
    """1 process: ndp's fused LM-head loss (``ndp.hf.head.head_loss``) vs cross_entropy on the model's logits
    (the summed loss and every gradient)."""
    from ndp.hf.head import head_loss

    try:
        model = tiny_model(model_type).train()
        ids, labels, pos = batch()
        logits = _forward(model, ids, pos)
        ref, ref_grads = _loss_and_grads(model, torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"))
    except Exception as e:  # noqa: BLE001 - transformers cannot run it from a tiny config: not ndp's to judge
        return "UNBUILT", f"{type(e).__name__}: {str(e)[:120]}"

    def run():
        model.zero_grad(set_to_none=True)
        got, grads = _loss_and_grads(model, head_loss(model, labels, **_inputs(model, ids, pos)))
        return _worst(got, grads, ref, ref_grads)

    return classify(run, tolerance(model_type))


DOCS = (10, 14, 8)  # documents packed in one row (SEQ tokens)


def _documents(lens=DOCS):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=g) for n in lens]


def _doc_loss(model, ids, pos, labels, **extra):
    """(the model's summed loss over labelled tokens, their count) with ndp's attention."""
    logits = model(input_ids=ids, position_ids=pos, **extra).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), labels.reshape(-1),
                                             ignore_index=-100, reduction="sum")
    return loss, int((labels != -100).sum())


def _packed_positions(docs):
    return torch.cat([torch.arange(len(d)) for d in docs])[None]


def _targets(docs):
    return [torch.nn.functional.pad(d[1:], (0, 1), value=-100) for d in docs]


def _per_document(model_type, docs, targets):
    """This process alone, ndp's attention: each document in a call of its own, (the mean loss over every
    document's labelled tokens, {name: grad})."""
    import ndp.hf

    ndp.hf.register_attention()
    model = tiny_model(model_type).train()
    model.set_attn_implementation("ndp_ring")
    total, count = 0.0, 0
    for d, t in zip(docs, targets):
        loss, n = _doc_loss(model, d[None], torch.arange(len(d))[None], t[None])
        total, count = total + loss, count + n
    return _loss_and_grads(model, total / count)


@float64_softmax()
def packed(model_type):
    """1 process, ndp's attention: the documents packed in one row (position_ids restarting, the document table
    ``cu_seq_lens_q``, as ndp-train and DataCollatorWithFlattening give them) against each document in a call of
    its own through the same model (the mean loss and every gradient). A model that would let the documents see
    each other (a recurrent layer, an attention of its own) is refused by name (``ndp.hf.check_packed_model``)."""
    import ndp
    import ndp.hf
    from ndp.hf.batch import document_table

    docs = _documents()
    try:
        model = tiny_model(model_type)
        with torch.no_grad():
            model(input_ids=docs[0][None])
    except Exception as e:  # noqa: BLE001 - transformers cannot run it from a tiny config: not ndp's to judge
        return "UNBUILT", f"{type(e).__name__}: {str(e)[:120]}"
    targets = _targets(docs)

    def run():
        ndp.hf.parallelize(model.train(), ndp.ParallelismConfig(), None)
        cu = torch.tensor([0, *torch.tensor(DOCS).cumsum(0).tolist()], dtype=torch.int32)
        loss, n = _doc_loss(model, torch.cat(docs)[None], _packed_positions(docs), torch.cat(targets)[None],
                            **document_table(cu, "cpu"))
        got, grads = _loss_and_grads(model, loss / n)  # first: a refusal needs no reference
        ref_loss, ref_grads = _per_document(model_type, docs, targets)
        return _worst(got, grads, ref_loss, ref_grads)

    return classify(run, tolerance(model_type))


@functools.cache
def _mesh(sizes):
    import ndp

    return ndp.ParallelismConfig(**dict(sizes)).build_device_mesh("cpu")


def mesh(cfg):
    """`cfg`'s mesh, one per set of degrees (and CP algorithm: usp's ulysses_size needs it) in this process: a
    DeviceMesh's process groups (gloo threads and sockets) live until the process ends, so a sweep that built one
    per family slowed family by family (tp 2 over the zoo: 374 s, most of it system time, with 18 threads more per
    family; 65 s with one mesh)."""
    degrees = ("dp_replicate_size", "dp_shard_size", "cp_size", "tp_size", "ulysses_size", "cp_impl")
    return _mesh(frozenset((k, getattr(cfg, k)) for k in degrees))


@float64_softmax()
def cp(model_type, impl, world, tp_size=1, checkpointing=None):
    """cp ``world`` (this rank's part): parallelize + shard_batch + ndp.hf.loss vs :func:`reference`; `tp_size`: the
    model also split by its own plan over that many ranks (a job of ``world * tp_size`` ranks); `checkpointing`:
    transformers' activation checkpointing on before parallelize (``gradient_checkpointing_enable`` with these
    ``gradient_checkpointing_kwargs``, as Trainer's ``gradient_checkpointing=True`` turns it on)."""
    import ndp
    import ndp.hf

    def run():
        ref_loss, ref_grads = reference(model_type)
        cfg = ndp.ParallelismConfig(cp_size=world, tp_size=tp_size, cp_impl=impl, cp_layout="zigzag",
                                    cp_mixers="gather")
        model = tiny_model(model_type).train()
        if checkpointing is not None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
        model = ndp.hf.parallelize(model, cfg, mesh(cfg))
        ids, labels, pos = batch()
        b = ndp.hf.shard_batch(model, input_ids=ids, labels=labels, position_ids=pos)
        logits = _forward(model, b["input_ids"], b["position_ids"])
        return _against(model, logits, b["labels"], ref_loss, ref_grads)

    return classify(run, tolerance(model_type))


@float64_softmax()
def cp_packed(model_type, impl, world, compile=False, lens=DOCS):
    """cp ``world`` (this rank's part): documents of `lens` tokens (:func:`packed`'s) in one row through parallelize
    (``compile``: the decoder layers compiled) + shard_batch (positions restarting: sharded per document, with the
    shards' document table) + ndp.hf.loss vs each document in a call of its own on one process."""
    import ndp
    import ndp.hf

    def run():
        docs = _documents(lens)
        ref_loss, ref_grads = _per_document(model_type, docs, _targets(docs))
        cfg = ndp.ParallelismConfig(cp_size=world, cp_impl=impl, cp_layout="zigzag", cp_mixers="gather")
        model = ndp.hf.parallelize(tiny_model(model_type).train(), cfg, mesh(cfg), compile=compile)
        b = ndp.hf.shard_batch(model, input_ids=torch.cat(docs)[None], labels=torch.cat(_targets(docs))[None],
                               position_ids=_packed_positions(docs))
        labels = b.pop("labels")
        return _against(model, model(**b).logits, labels, ref_loss, ref_grads)

    return classify(run, tolerance(model_type))


PADDED = (29, 26)  # real tokens per row of a right-padded batch (SEQ each, pads after: a padding collator's)


def padded_batch():
    """A padding collator's batch of :func:`batch`'s ids: rows of PADDED real tokens, then the pad id (0), an
    attention_mask of 0 at the pads, labels shifted with -100 at every pad and at each row's last real token."""
    ids, _, _ = batch()
    mask = (torch.arange(SEQ) < torch.tensor(PADDED)[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    labels = torch.nn.functional.pad(ids.masked_fill(mask == 0, -100)[:, 1:], (0, 1), value=-100)
    return ids, labels, mask


def two_sided_batch():
    """:func:`padded_batch` with its second row padded on the left instead (pads first: what generation-style
    tokenizers give), its labels shifted over the moved tokens."""
    ids, labels, mask = padded_batch()
    move = SEQ - PADDED[1]
    ids[1], mask[1] = ids[1].roll(move), mask[1].roll(move)
    labels[1] = torch.nn.functional.pad(ids[1, 1:], (0, 1), value=-100).masked_fill(mask[1] == 0, -100)
    labels[1, -1] = -100
    return ids, labels, mask


@float64_softmax()
def padded_single(model_type):
    """1 process: :func:`two_sided_batch` through ndp's attention (``ndp.hf.padded``: each row's run of real tokens)
    against the model's sdpa (eager where the family has none: a pad that sees no key gets every value's mean there,
    zeros in sdpa and ndp, and no real token sees a pad), the mean loss and every gradient."""
    import ndp
    import ndp.hf

    ids, labels, mask = two_sided_batch()
    try:
        model = tiny_model(model_type).train()
        with contextlib.suppress(ValueError):  # the family has no sdpa: eager
            model.set_attn_implementation("sdpa")
        logits = model(input_ids=ids, attention_mask=mask).logits
        ref_loss, ref_grads = _loss_and_grads(model, torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                                                     labels.flatten()))
        if not torch.isfinite(ref_loss):
            return "UNBUILT", "transformers' own run on the padded batch is not finite (mpt's eager attention)"
    except Exception as e:  # noqa: BLE001 - transformers cannot run it from a tiny config: not ndp's to judge
        return "UNBUILT", f"{type(e).__name__}: {str(e)[:120]}"

    def run():
        model = ndp.hf.parallelize(tiny_model(model_type).train(), ndp.ParallelismConfig(), None)
        logits = model(input_ids=ids, attention_mask=mask).logits
        got, grads = _loss_and_grads(model, torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))
        return _worst(got, grads, ref_loss, ref_grads)

    return classify(run, tolerance(model_type))


@float64_softmax()
def cp_padded(model_type, impl, world, own_loss=False):
    """cp ``world`` (this rank's part): a right-padded batch as a tokenizer and a padding collator give it
    (attention_mask, no position_ids, labels -100 at the pads) through parallelize + shard_batch + ndp.hf.loss
    against one process's eager run on the padded batch with its mask (the mean loss and every gradient);
    `own_loss`: the model given the labels, its own loss (``model(**batch).loss``) instead of ndp.hf.loss."""
    import ndp
    import ndp.hf

    def run():
        ids, labels, mask = padded_batch()
        model = tiny_model(model_type).train()
        logits = model(input_ids=ids, attention_mask=mask).logits
        ref_loss, ref_grads = _loss_and_grads(model, torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)))
        cfg = ndp.ParallelismConfig(cp_size=world, cp_impl=impl, cp_layout="zigzag", cp_mixers="gather")
        model = ndp.hf.parallelize(tiny_model(model_type).train(), cfg, mesh(cfg))
        b = ndp.hf.shard_batch(model, input_ids=ids, labels=labels, attention_mask=mask)
        inputs = dict(_inputs(model, b["input_ids"], b["position_ids"]), attention_mask=b["attention_mask"])
        if own_loss:
            return _against(model, None, None, ref_loss, ref_grads, own=model(**inputs, labels=b["labels"]).loss)
        return _against(model, model(**inputs).logits, b["labels"], ref_loss, ref_grads)

    return classify(run, tolerance(model_type))


# ------------------------------------------------------------------------ bf16 autocast, float32 weights
BF16_RATIO = 2.5  # how much further from the float64 truth ndp under CP may be than one process (0.60-1.43 measured)


@float64_softmax()
def cp_autocast(model_type, impl, world):
    """cp ``world`` (this rank's part): :func:`cp` with the model in float32 under bf16 autocast (a loop under
    ``torch.autocast``; Trainer's ``bf16=True`` without FSDP2), against the float64 truth (:func:`reference`), one
    process's run of the model's sdpa (eager where it has none) under the same autocast the yardstick: ndp's largest
    relative difference (the loss and every gradient) over the yardstick's, EXACT up to BF16_RATIO. A family that
    routes tokens to experts: 0 where every gradient is there (inf where one is missing), as a bf16 rounding may send
    a token to another expert, a gradient far off that no tolerance follows (mixtral under cp 2: 1 token of 64 in its
    first layer, 0.25 off)."""
    import ndp
    import ndp.hf

    ids, labels, pos = batch()
    try:
        ref_loss, ref_grads = reference(model_type)
        model = tiny_model(model_type).train().float()
        with contextlib.suppress(ValueError):  # the family has no sdpa: eager
            model.set_attn_implementation("sdpa")
        inputs = _reference_inputs(model, ids, pos)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(**inputs).logits.float()
        loss, grads = _loss_and_grads(model, torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))
        yardstick = _worst(loss, grads, ref_loss, ref_grads)
        assert yardstick < float("inf"), "transformers' own run under autocast is not finite"
    except Exception as e:  # noqa: BLE001 - transformers cannot run it under bf16 autocast: not ndp's to judge
        return "UNBUILT", f"{type(e).__name__}: {str(e)[:120]}"
    routed = any("expert" in n.lower() for n in grads)

    def run():
        cfg = ndp.ParallelismConfig(cp_size=world, cp_impl=impl, cp_layout="zigzag", cp_mixers="gather")
        model = ndp.hf.parallelize(tiny_model(model_type).train().float(), cfg, mesh(cfg))
        b = ndp.hf.shard_batch(model, input_ids=ids, labels=labels, position_ids=pos)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = _forward(model, b["input_ids"], b["position_ids"]).float()
        rel = _against(model, logits, b["labels"], ref_loss, ref_grads)
        return 0.0 if routed and rel < float("inf") else rel / max(yardstick, 1e-3)

    return classify(run, BF16_RATIO)


# ------------------------------------------------------------------- MoE load-balancing loss (ndp.hf.router)
AUX_COEF = 0.5  # large, so that a wrong load-balancing term shows in every router's gradient


def causal_lm_class(model_type):
    """The class :func:`tiny_model` builds for the family (a text model's too: qwen3_5_moe_text's lives in
    qwen3_5_moe), or None where its tiny config cannot be built (tiny_model reports it)."""
    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(tiny_config(model_type))]
    except Exception:  # noqa: BLE001 - a sweep reports every failure elsewhere
        return None


def has_aux_loss(model_type) -> bool:
    """The family's causal LM adds its routers' load-balancing loss (its module's load_balancing_loss_func)."""
    import sys

    cls = causal_lm_class(model_type)
    return cls is not None and hasattr(sys.modules[cls.__module__], "load_balancing_loss_func")


def checkpointable(model_type) -> bool:
    """transformers can checkpoint the family's layers (``supports_gradient_checkpointing``)."""
    return bool(getattr(causal_lm_class(model_type), "supports_gradient_checkpointing", False))


def aux_model(model_type):
    """:func:`tiny_model` with its routers' load-balancing loss on (coefficient AUX_COEF), in the training mode;
    Doge with its experts (``is_moe``, off by default)."""
    moe = dict(is_moe=True) if hasattr(tiny_config(model_type), "is_moe") else {}
    model = tiny_model(model_type, output_router_logits=True, router_aux_loss_coef=AUX_COEF, **moe).train()
    if hasattr(model, "router_aux_loss_coef"):  # what the family's forward multiplies by, read at its init
        model.router_aux_loss_coef = AUX_COEF
    return model


@float64_softmax()
def cp_aux(model_type, impl, world, padded=False):
    """cp ``world`` (this rank's part): :func:`cp` with the family's load-balancing loss on, ``ndp.hf.loss +
    AUX_COEF x aux_loss`` against one process's mean loss + AUX_COEF x its aux_loss; `padded`: on
    :func:`padded_batch` (the reference given its mask, which the family's loss reads to leave the pads out)."""
    import ndp
    import ndp.hf

    if padded:
        ids, labels, mask = padded_batch()
        ref_inputs = dict(input_ids=ids, attention_mask=mask)
        rows = dict(input_ids=ids, labels=labels, attention_mask=mask)
    else:
        ids, labels, pos = batch()
        rows = dict(input_ids=ids, labels=labels, position_ids=pos)
    try:
        model = aux_model(model_type)
        out = model(**(ref_inputs if padded else _reference_inputs(model, ids, pos)))
        ref_loss, ref_grads = _loss_and_grads(model, torch.nn.functional.cross_entropy(
            out.logits.flatten(0, 1), labels.flatten()) + AUX_COEF * out.aux_loss)
    except Exception as e:  # noqa: BLE001 - the family's own forward fails with the loss on: not ndp's to judge
        return "UNBUILT", f"{type(e).__name__}: {str(e)[:120]}"

    def run():
        cfg = ndp.ParallelismConfig(cp_size=world, cp_impl=impl, cp_layout="zigzag", cp_mixers="gather")
        model = ndp.hf.parallelize(aux_model(model_type), cfg, mesh(cfg))
        b = ndp.hf.shard_batch(model, **rows)
        inputs = _inputs(model, b["input_ids"], b["position_ids"])
        out = model(**inputs, **({"attention_mask": b["attention_mask"]} if padded else {}))
        return _against(model, out.logits, b["labels"], ref_loss, ref_grads, aux=AUX_COEF * out.aux_loss)

    return classify(run, tolerance(model_type))


def _against(model, logits, labels, ref_loss, ref_grads, aux=None, own=None):
    """Largest relative difference of ndp.hf.loss's mean (plus `aux`, each rank's load-balancing term: their mean
    over the ranks is the batch's), or of the model's `own` loss (each rank's is ndp.hf.loss's: their mean over the
    ranks is the batch's mean), and of every gradient from the reference's."""
    import ndp.hf
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if own is None:
        loss, mean = ndp.hf.loss(logits, labels, model, return_mean=True)
    else:
        loss, mean = own, own.detach().clone()
        dist.all_reduce(mean)
        mean = mean / dist.get_world_size()
    if aux is not None:
        loss = loss + aux
        term = aux.detach().clone()
        dist.all_reduce(term)
        mean = mean + term / dist.get_world_size()
    loss.backward()
    # a replicated parameter's gradient is this rank's own: it must hold every rank's share already
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.full_tensor() if isinstance(p.grad, DTensor)
             else p.grad for n, p in model.named_parameters() if p.grad is not None}
    if any(n not in ref_grads and bool(g.abs().max() > 0) for n, g in grads.items()):
        return float("inf")  # a gradient where the reference has none
    return _worst(mean.double(), grads, ref_loss, ref_grads)


# Dropout fields the tp run leaves at 0: the attention's (ndp's attention refuses it), a classifier's (unused), LayerDrop
# (refused across data-parallel ranks).
_KEPT_OFF = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "classifier_dropout", "layerdrop")


def dropout_fields(model_type) -> dict:
    """Every other dropout (and router jitter) field of the family's config and text config, at 0.3."""
    cfg = tiny_config(model_type)
    return {k: 0.3 for c in (cfg, cfg.get_text_config()) for k, v in c.to_dict().items()
            if isinstance(v, float) and ("drop" in k or "jitter" in k) and not any(o in k for o in _KEPT_OFF)}


@float64_softmax()
def tp(model_type, world):
    """tp ``world`` with the model's own plan, in training with the family's dropout on (:func:`dropout_fields`) and
    each rank seeded its own: parallelize + ndp.hf.loss on the whole batch vs :func:`reference` seeded like TP rank 0
    (the TP ranks draw its masks, ``ndp.parallel.draws``; refused plans are refused before the reference runs)."""
    import ndp
    import ndp.hf

    def run():
        fields = dropout_fields(model_type)
        cfg = ndp.ParallelismConfig(tp_size=world)
        model = ndp.hf.parallelize(tiny_model(model_type, **fields).train(), cfg, mesh(cfg))
        ref_loss, ref_grads = reference(model_type, seed=100, **fields)
        ids, labels, pos = batch()
        torch.manual_seed(100 + torch.distributed.get_rank())
        return _against(model, _forward(model, ids, pos), labels, ref_loss, ref_grads)

    return classify(run, tolerance(model_type))


# ------------------------------------------------------------ vision-language classes on text-only batches
def vlm_families() -> list[str]:
    """Model types of transformers' image-text-to-text auto mapping (the class a VLM is fine-tuned as)."""
    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def tiny_vlm(model_type: str):
    """The family's image-text-to-text class shrunk as :func:`tiny_config` shrinks it, float64 (its multimodal RoPE
    sections fitted to heads of 16), or raises where it cannot be built so."""
    cfg = tiny_config(model_type)
    # multimodal RoPE (Qwen2-VL's and its kin's): a section per axis, 8 rotary frequencies in all (transformers'
    # defaults, for heads of 128, stand in the model's code where the config names none)
    try:
        mrope = "mrope_section" in inspect.getsource(importlib.import_module(
            type(cfg).__module__.replace(".configuration_", ".modeling_")))
    except ImportError:  # its model in another family's module (glmga)
        mrope = False
    for c in (cfg, *(v for v in vars(cfg).values() if isinstance(v, transformers.PretrainedConfig))):
        rope = getattr(c, "rope_parameters", None)
        if isinstance(rope, dict) and (mrope or "mrope_section" in rope):
            rope["mrope_section"] = [2, 3, 3]
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(cfg, dtype=torch.float64, experts_implementation="eager")


@float64_softmax()
def cp_vlm_text(model_type, impl, world):
    """cp ``world``: a text-only batch as a tokenizer gives it (input_ids and an all-ones attention_mask, no
    position_ids) through parallelize + shard_batch + ndp.hf.loss against one process's eager run on the whole
    batch (the loss and every gradient); UNBUILT where that one-process run fails."""
    import ndp
    import ndp.hf

    ids, labels, _ = batch()
    mask = torch.ones_like(ids)
    try:
        model = tiny_vlm(model_type).train()
        logits = model(input_ids=ids, attention_mask=mask).logits
        ref_loss, ref_grads = _loss_and_grads(model, torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)))
    except Exception as e:  # noqa: BLE001 - transformers cannot run it from a tiny config: not ndp's to judge
        return "UNBUILT", f"{type(e).__name__}: {str(e)[:120]}"

    def run():
        cfg = ndp.ParallelismConfig(cp_size=world, cp_impl=impl, cp_layout="zigzag", cp_mixers="gather")
        model = ndp.hf.parallelize(tiny_vlm(model_type).train(), cfg, mesh(cfg))
        b = ndp.hf.shard_batch(model, input_ids=ids, attention_mask=mask, labels=labels)
        shard_labels = b.pop("labels")
        return _against(model, model(**b).logits, shard_labels, ref_loss, ref_grads)

    return classify(run, tolerance(model_type))
