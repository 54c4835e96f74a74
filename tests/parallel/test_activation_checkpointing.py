"""Activation checkpointing modes on a transformers model (float64, one process): none, full and selective give
the same loss and gradients; full recomputes every matmul of a layer in the backward, selective none of them
(it keeps their outputs and recomputes the rest: element-wise ops, attention). Under FSDP2 and CP:
tests/train/test_parity.py."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import ndp
import ndp.hf
from ndp.parallel.parallelize import SAVED_OPS
from ndp.train.presets import build_model


class _CountOps(TorchDispatchMode):
    """Counts the ops of SAVED_OPS (matmuls) and the other ops that run."""

    def __init__(self):
        super().__init__()
        self.saved = self.other = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SAVED_OPS:
            self.saved += 1
        else:
            self.other += 1
        return func(*args, **(kwargs or {}))


def _step(mode):
    model = ndp.hf.parallelize(build_model("tiny-llama", seed=0, dtype=torch.float64), ndp.ParallelismConfig(),
                               None, activation_checkpointing=mode)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    loss = F.cross_entropy(model(ids).logits.flatten(0, 1), F.pad(ids[:, 1:], (0, 1), value=-100).flatten())
    counts = _CountOps()
    with counts:
        loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, counts


def test_modes_agree_and_selective_recomputes_no_matmul():
    ref_loss, ref_grads, none = _step("none")
    _, _, full = _step(True)  # a bool still means full
    for mode in ("full", "selective"):
        loss, grads, counts = _step(mode)
        assert loss == ref_loss
        assert grads.keys() == ref_grads.keys()
        for n, g in ref_grads.items():
            torch.testing.assert_close(grads[n], g, rtol=1e-13, atol=0, msg=lambda m: f"{mode} {n}: {m}")
        if mode == "full":
            assert counts.saved > none.saved and counts.other > none.other  # the layers' forward runs again
        else:
            assert counts.saved == none.saved  # no matmul runs again ...
            assert counts.other > none.other  # ... the element-wise ops do
    assert full.saved > none.saved


def test_unknown_mode_is_refused_by_name():
    with pytest.raises(ValueError, match=r"one of none, full, selective .*got 'some'"):
        ndp.parallelize(build_model("tiny-llama", seed=0), ndp.ParallelismConfig(), None,
                        activation_checkpointing="some")
