"""An MoE's load-balancing loss under context parallelism (``ndp.hf.router``): for OLMoE, Mixtral, Qwen2-MoE and
gpt-oss (every family: the zoo's pass (g)), ``ndp.hf.loss + coef x aux_loss`` under cp 2 gives one process's loss and
every gradient (float64, 1e-6), and so does the model's own loss through ndp's Accelerator, on rows of a length the
layout cannot split (ndp's pads), right-padded rows (the batch's pads, its mask made all ones under CP) and packed
documents; a family whose loss ndp does not reproduce is refused by name."""
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate.parallelism_config import ParallelismConfig as AccelerateConfig
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ndp  # noqa: E402
import ndp.accelerate  # noqa: E402
import ndp.hf  # noqa: E402
from ndp.hf.router import balance_loss, check_router_loss, expert_counts, family_loss  # noqa: E402
from dist import spawn  # noqa: E402
import _zoo  # noqa: E402
import test_packed  # noqa: E402
from test_accelerate import _fsdp2_plugin, _rank_env  # noqa: E402

COEF = _zoo.AUX_COEF
TOL = 1e-6
FAMILIES = ("olmoe", "mixtral", "qwen2_moe", "gpt_oss")
aux_model = _zoo.aux_model


def _rows(case):
    """(input_ids, labels (labels[i]: token i's target), attention_mask or None, position_ids or None)."""
    g = torch.Generator().manual_seed(4)
    if case == "packed":
        b = test_packed.collated("position_ids")
        return b["input_ids"], b["labels"], None, b["position_ids"]
    ids = torch.randint(3, _zoo.VOCAB, (2, 30), generator=g)  # 30: zigzag at cp 2 needs 32 (ndp pads 2)
    labels = F.pad(ids[:, 1:], (0, 1), value=-100)
    mask = torch.ones_like(ids)
    if case == "right padded":
        mask[1, 25:] = 0  # 5 pads: each sees a real key within mixtral's window of 8 (eager gives NaN otherwise)
        labels = labels.masked_fill(mask == 0, -100)
        labels[1, 24] = -100
    return ids, labels, (mask if case == "right padded" else None), None


def _reference(family, case):
    """One process: (aux_loss, {name: grad}) of CE mean + COEF x aux_loss, the family's own load-balancing loss;
    packed documents each in a forward of its own, the loss over all their router logits."""
    model = aux_model(family)
    ids, labels, mask, pos = _rows(case)
    if case == "packed":
        outs = [model(input_ids=d[None]) for d in ids[0].split(test_packed.DOCS)]
        logits = torch.cat([o.logits[0] for o in outs])[None]
        router = tuple(torch.cat(layer) for layer in zip(*(o.router_logits for o in outs)))
        aux = family_loss(model)(router, *expert_counts(model), None)
    else:
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
        logits, aux = out.logits, out.aux_loss
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    (ce + COEF * aux).backward()
    return aux.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _cp_rank(rank, world, families, case, impl):
    for family in families:
        aux_ref, grads = _reference(family, case)
        cfg = ndp.ParallelismConfig(cp_size=world, cp_impl=impl)
        model = ndp.hf.parallelize(aux_model(family), cfg, _zoo.mesh(cfg))
        ids, labels, mask, pos = _rows(case)
        given = dict(input_ids=ids, labels=labels, attention_mask=mask, position_ids=pos)
        b = ndp.hf.shard_batch(model, **{k: v for k, v in given.items() if v is not None})
        labels = b.pop("labels")
        out = model(**b)
        (ndp.hf.loss(out.logits, labels, model) + COEF * out.aux_loss).backward()
        aux = out.aux_loss.detach().clone()
        dist.all_reduce(aux)  # each rank's is its share x cp_size: their mean is the batch's
        assert _zoo._rel(aux / world, aux_ref) <= TOL, (family, float(aux / world), float(aux_ref))
        floor = 1e-4 * max(float(g.abs().max()) for g in grads.values())
        for n, p in model.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            assert _zoo._rel(g, grads[n], floor) <= TOL, (family, n, _zoo._rel(g, grads[n], floor))


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case, impl", [("odd length", "ring"), ("right padded", "ulysses"), ("packed", "ring")])
def test_load_balancing_loss_under_cp_is_one_process(tmp_path, case, impl):
    spawn(_cp_rank, 2, tmp_path, FAMILIES, case, impl, timeout_s=300)


def _accelerator_rank(rank, world, family):
    # The model's own loss (shift_labels, the Accelerator's num_items_in_batch) with its load-balancing loss inside,
    # backward through Accelerate's FSDP2, on rows of a length the layout cannot split (named buffers: ndp pads them)
    _rank_env(rank, world)
    aux_ref, grads = _reference(family, "odd length")
    model = aux_model(family)
    plugin = _fsdp2_plugin(type(model.model.layers[0]).__name__)
    acc = ndp.accelerate.Accelerator(parallelism_config=AccelerateConfig(cp_size=world), fsdp_plugin=plugin)
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
    ids, labels, _, _ = _rows("odd length")
    batch = {"input_ids": ids, "labels": labels.clone(), "shift_labels": labels,
             "position_ids": torch.arange(ids.shape[1]).expand(ids.shape).clone()}
    buffers = list(batch.values())
    with acc.maybe_context_parallel(buffers=buffers, names=list(batch), no_restore_buffers=set(buffers)):
        out = model(**batch)
        acc.backward(out.loss)
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)  # the ranks' losses average to one process's, as FSDP averages their gradients
    ce = F.cross_entropy(*[t.flatten(0, 1) for t in _reference_logits(family)], ignore_index=-100)
    assert _zoo._rel(loss / world, ce + COEF * aux_ref) <= TOL
    floor = 1e-4 * max(float(g.abs().max()) for g in grads.values())
    for n, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        assert _zoo._rel(g, grads[n], floor) <= TOL, (family, n, _zoo._rel(g, grads[n], floor))


def _reference_logits(family):
    ids, labels, _, _ = _rows("odd length")
    with torch.no_grad():
        return aux_model(family)(input_ids=ids).logits, labels


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_load_balancing_loss_inside_the_models_loss_through_the_accelerator(tmp_path):
    spawn(_accelerator_rank, 2, tmp_path, "olmoe", timeout_s=300)


def test_the_families_function_is_the_one_ndp_computes():
    """Over one process's tokens (no group) ndp's formula is the family's, with a mask and without; a share of a
    group's tokens sums to the batch's."""
    model = aux_model("olmoe")
    fn = family_loss(model)
    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(10, 4, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.tensor([[1] * 5, [1, 1, 1, 0, 0]])
    for m in (None, mask):
        want = fn(logits, 4, 2, m)
        got = balance_loss(logits, 4, 2, torch.ones(10) if m is None else m, None)
        assert torch.allclose(got.double(), want.double(), rtol=1e-6)


def test_a_family_whose_loss_ndp_does_not_reproduce_is_refused_by_name():
    # Doge's load_balancing_loss_func takes its product-key experts' arguments
    model = aux_model("doge")
    with pytest.raises(ndp.hf.Unsupported, match=r"DogeForCausalLM adds its routers' load-balancing loss .*"
                                                 r"output_router_logits = False"):
        check_router_loss(model)
    with pytest.raises(ndp.hf.Unsupported, match="DogeForCausalLM adds its routers' load-balancing loss"):
        ndp.hf.check_model(model, ndp.ParallelismConfig(cp_size=2))
    model.config.output_router_logits = False  # off: nothing to refuse
    ndp.hf.check_model(model, ndp.ParallelismConfig(cp_size=2))
    check_router_loss(aux_model("olmoe"))
