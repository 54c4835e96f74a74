"""Activation offloading (ndp.parallel.ActivationOffload) on CPU, float64: the loss and gradients are those of the
run without it, every activation autograd saves leaves the device (parameters stay), and the backward is served
from copies brought back ahead of their use. With full checkpointing, what is offloaded is the layers' inputs.
The loss parity of ndp-train --activation-offload under FSDP2: tests/train/test_parity.py."""
import torch
import torch.nn.functional as F

import ndp
import ndp.hf
from ndp.parallel import ActivationOffload
from ndp.train.presets import build_model

B, S = 2, 32


def _step(ac, offload, prefetch_bytes=2 ** 40):
    model = ndp.hf.parallelize(build_model("tiny-llama", seed=0, dtype=torch.float64), ndp.ParallelismConfig(),
                               None, activation_checkpointing=ac)
    ids = torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(0))
    ctx = ActivationOffload("cpu", min_bytes=0, prefetch_bytes=prefetch_bytes) if offload else None
    with ctx or torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        logits = model(ids, use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1), F.pad(ids[:, 1:], (0, 1), value=-100).flatten())
    loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, ctx and ctx.stats


def test_offloaded_activations_give_the_same_gradients():
    for ac in ("none", "full"):
        ref_loss, ref_grads, _ = _step(ac, False)
        loss, grads, stats = _step(ac, True)
        assert loss == ref_loss
        for n, g in ref_grads.items():
            torch.testing.assert_close(grads[n], g, rtol=0, atol=0, msg=lambda m: f"{ac} {n}: {m}")
        # every activation left but the token ids (integers stay); the parameters (and their views) stayed
        assert stats.kept_bytes == B * S * 8
        if ac == "none":
            assert stats.param_bytes >= sum(p.numel() * 8 for n, p in ref_grads.items() if "layers" in n)
        assert stats.offloaded_bytes == stats.saved_bytes - stats.param_bytes - stats.kept_bytes
        # the backward unpacks the last-saved tensor first: everything else was brought back ahead of its unpack
        assert stats.prefetched_bytes == stats.offloaded_bytes - stats.offloaded[-1]
        _, grads, stats = _step(ac, True, prefetch_bytes=0)  # no prefetch: each tensor comes back when unpacked
        assert stats.prefetched_bytes == 0 and all(torch.equal(grads[n], g) for n, g in ref_grads.items())


def test_under_full_checkpointing_the_layer_inputs_are_what_is_offloaded():
    _, _, none = _step("none", True)
    _, _, full = _step("full", True)
    hidden = B * S * 64 * 8  # one [batch, seq, hidden] float64 tensor
    layer_inputs = [n for n in full.offloaded if n == hidden]
    assert len(layer_inputs) >= 2  # each of the 2 checkpointed layers' input
    assert full.offloaded_bytes < none.offloaded_bytes / 3  # without checkpointing: every activation of the layers
