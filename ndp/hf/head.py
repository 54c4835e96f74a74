"""A causal LM's forward with its LM head and token loss fused: the logits are never materialised.

``head_loss(model, labels, **inputs)`` runs ``model(**inputs)`` with the output embedding (``lm_head``) replaced,
for this call, by ``ndp.ops.linear_cross_entropy`` on the hidden states it receives. Running inside the model's own
forward is what keeps it right under FSDP2 (the head's weight is gathered there and its gradient reduced like every
other parameter's) and under activation checkpointing. A head split by vocabulary rows over a tensor-parallel group
(``ndp.hf.parallelize(..., loss_parallel=True)``) runs loss parallel: each rank computes its rows' share and the
ranks exchange per-token sums, never the logits.

What a model does to its logits after the head must be reproduced by the fused op, so the head hands the rest of
the forward a stand-in (``[..., 0]`` logits) that records every op applied to it, and the loss is computed at the
end of the model's forward, from the recorded ops: constant scales (Cohere's logit_scale, Granite's
logits_scaling) and one soft-capping (Gemma 2) are reproduced; anything else raises ``Unsupported`` before the loss
is computed: the fused path is exact or refuses, family by family.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils._pytree import tree_leaves

from ndp.ops.linear_ce import CHUNK_BYTES, linear_cross_entropy

from .models import Unsupported

__all__ = ["head_loss", "logit_transform"]

# torch function name -> the op it is on the logits (scalar operand recorded)
_OPS = {"__truediv__": "div", "div": "div", "true_divide": "div", "__mul__": "mul", "__rmul__": "mul",
        "mul": "mul", "tanh": "tanh"}
# Ops that do not change the values a loss sees (dtype / layout); the fused loss is fp32 (fp64) already. An op
# whose result holds no tensor (stride(), numel(): torch 2.15's FSDP2 asks the head's output its strides) is a query.
_NEUTRAL = {"float", "to", "contiguous", "__get__", "size", "dim", "view_as"}


class _Logits(torch.Tensor):
    """Stands in for the logits after the fused head; records the ops the forward applies to them."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", repr(func))
        log = next(a._ndp_log for a in tree_leaves((args, kwargs)) if isinstance(a, _Logits))
        out = super().__torch_function__(func, types, args, kwargs or {})
        if name not in _NEUTRAL and any(isinstance(t, torch.Tensor) for t in tree_leaves(out)):
            log.append(_record(name, args))
        if isinstance(out, _Logits):
            out._ndp_log = log
        return out


def _record(name, args):
    op = _OPS.get(name, name)
    if op not in ("mul", "div"):
        return (op,)
    other = [a for a in args if not isinstance(a, _Logits)]
    const = len(other) == 1 and (isinstance(other[0], (int, float)) or (
        isinstance(other[0], torch.Tensor) and other[0].numel() == 1 and not other[0].requires_grad))
    return (op, float(other[0])) if const else (op, "a tensor")


def logit_transform(ops: list) -> tuple[float, float]:
    """(scale, softcap) of the ops a forward applied to its head's output: constant multiplications and
    divisions (Cohere's logit_scale, Granite's logits_scaling), then at most one soft-capping ``c * tanh(z / c)``
    (Gemma 2). Raises Unsupported for anything else (the message lists the ops)."""
    scale, cap, i = 1.0, 0.0, 0
    while i < len(ops):
        op = ops[i]
        if ops[i:i + 3] == [("div", op[-1]), ("tanh",), ("mul", op[-1])] and not cap:
            cap, i = op[1], i + 3
            continue
        if op[0] not in ("mul", "div") or isinstance(op[1], str) or cap:
            raise Unsupported(f"ndp's fused loss cannot reproduce what the forward does to the LM head's output "
                              f"({ops}): it reproduces constant scales followed by one soft-capping. Compute the "
                              f"logits and use ndp.hf.loss (ndp-train --loss full).")
        scale = scale * op[1] if op[0] == "mul" else scale / op[1]
        i += 1
    return scale, cap


def _head(model: nn.Module) -> nn.Linear:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        raise Unsupported(f"ndp's fused loss needs the model's output embedding to be a torch.nn.Linear; "
                          f"{type(model).__name__}'s is {type(head).__name__}. Compute the logits and use "
                          f"ndp.hf.loss (ndp-train --loss full).")
    return head


def _vocab_split(model, head) -> dict:
    """How the head's weight is held as the forward sees it (FSDP2 has gathered it): whole (``{}``), or rows of the
    vocabulary split over a tensor-parallel group (loss parallel: the keywords of ``linear_cross_entropy``)."""
    w = head.weight
    if not isinstance(w, DTensor) or all(pl.is_replicate() for pl in w.placements):
        return {}
    if w.device_mesh.ndim != 1 or w.placements[0] != Shard(0):
        raise Unsupported(f"ndp's fused loss splits the vocabulary over one tensor-parallel mesh dimension (rows of "
                          f"the weight, Shard(0)); {type(model).__name__}'s output embedding is {w.placements} on "
                          f"a {w.device_mesh.ndim}-d mesh. Compute the logits and use ndp.hf.loss.")
    _, offset = compute_local_shape_and_global_offset(w.shape, w.device_mesh, w.placements)
    return dict(vocab_group=w.device_mesh.get_group(), vocab_start=offset[0], vocab_size=w.shape[0])


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _stand_in_forward(state):
    def forward(hidden):
        if "hidden" in state:
            raise Unsupported("ndp's fused loss: the model calls its LM head more than once in a forward; compute "
                              "the logits and use ndp.hf.loss (ndp-train --loss full).")
        mesh = hidden.device_mesh if isinstance(hidden, DTensor) else None  # a tensor-parallel head's input
        if mesh is not None and not all(pl.is_replicate() for pl in hidden.placements):
            raise Unsupported(f"ndp's fused loss needs the LM head's input whole on every tensor-parallel rank; got "
                              f"{hidden.placements}. Compute the logits and use ndp.hf.loss.")
        hidden = _local(hidden)
        dev = hidden.device.type
        # as nn.Linear would compute under autocast
        state["dtype"] = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
        state["hidden"] = hidden.to(state["dtype"])
        stand_in = hidden.detach().new_empty(hidden.shape[:-1] + (0,)).as_subclass(_Logits)
        stand_in._ndp_log = state["ops"]
        # a vocabulary-parallel head returns its shard of the logits, for the TP output hook to lay out
        return stand_in if mesh is None else DTensor.from_local(stand_in, mesh, [Shard(-1)], run_check=False)

    return forward


def _loss_hook(model, head, labels, ignore_index, chunk_bytes, state):
    def hook(module, args, output):
        logits = output.get("logits") if isinstance(output, dict) else None
        if "hidden" not in state or not isinstance(logits, _Logits):
            raise Unsupported(f"ndp's fused loss: {type(model).__name__}'s forward does not return the output of "
                              f"its LM head as its logits; compute the logits and use ndp.hf.loss (ndp-train "
                              f"--loss full).")
        scale, softcap = logit_transform(state["ops"])
        dt = state["dtype"]
        split = _vocab_split(model, head)
        weight, bias = _local(head.weight).to(dt), _local(head.bias)
        with torch.autocast(state["hidden"].device.type, enabled=False):
            output["loss"] = linear_cross_entropy(state.pop("hidden"), weight, labels,
                                                  bias=None if bias is None else bias.to(dt), scale=scale,
                                                  softcap=softcap, ignore_index=ignore_index, chunk_bytes=chunk_bytes,
                                                  **split)
        return output

    return hook


@contextlib.contextmanager
def _fused_head(model, head, labels, ignore_index, chunk_bytes):
    state = {"ops": []}
    head.forward = _stand_in_forward(state)  # an instance attribute: nn.Module.__call__ takes it over the class's
    # prepend: before FSDP2's post-forward hook, so that the head's weight is still gathered and the loss is one of
    # the outputs FSDP registers its pre-backward hook on (as a loss the model computed itself would be).
    handle = model.register_forward_hook(_loss_hook(model, head, labels, ignore_index, chunk_bytes, state),
                                         prepend=True)
    try:
        yield
    finally:
        handle.remove()
        del head.forward


def head_loss(model: nn.Module, labels: torch.Tensor, *, ignore_index: int = -100, chunk_bytes: int = CHUNK_BYTES,
              **inputs) -> torch.Tensor:
    """Summed token cross-entropy of ``model(**inputs)`` against `labels`, the logits never materialised.

    Args:
        model: a transformers causal LM (parallelized by ndp or not).
        labels: ``[batch, seq]`` targets already aligned with the positions (shifted; `ignore_index` for none).
        chunk_bytes: the fused op's working memory (fp32 logits of one block, ``ndp.ops.linear_ce.tiles``).
        inputs: the model's forward arguments (input_ids, position_ids, ...; not labels).
    Returns:
        fp32 (fp64) scalar: this rank's sum over labelled tokens, equal to ``cross_entropy(logits, labels,
        reduction="sum")`` on the model's own logits.
    Raises:
        Unsupported: the head is not an nn.Linear, is split otherwise than by vocabulary rows over one tensor-parallel
            mesh dimension (that split runs loss parallel), is called more than once or not at all, or the
            forward changes its output otherwise than by constant scales and a soft-capping (raised at the end
            of the forward, before the loss is computed).
    """
    head = _head(model)
    with _fused_head(model, head, labels, ignore_index, chunk_bytes):
        return model(**inputs)["loss"]
