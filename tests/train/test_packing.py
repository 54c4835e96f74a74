"""Packed documents through the whole stack (data path, HF model, ndp attention, CP sharding) give the
same loss and gradients as the same documents as separate padded rows."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ndp.hf
from dist import spawn
from ndp.parallel import ParallelismConfig, clip_grad_norm_
from ndp.train.data import IGNORE_INDEX, ByteTokenizer, batch_from_documents, load_documents, model_inputs
from ndp.train.presets import build_model

LENS = [50, 13, 90, 31]
# fp32 sums of ~180 token losses in a different order, and a grad norm over all parameters.
RTOL = 1e-5


def _docs():
    tok = ByteTokenizer()
    docs = [d for d in load_documents() if len(d) > 100]
    return [tok.encode(d)[:n] for d, n in zip(docs, LENS)]


def _loss_and_norm(cfg, mesh, batch):
    model = build_model("tiny-llama", seed=0)
    ndp.hf.parallelize(model, cfg, mesh)
    kw, labels = model_inputs(batch, model.ndp_cp, "cpu")
    logits = model(**kw).logits
    s = F.cross_entropy(logits.reshape(-1, 256), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    n = batch.num_tokens
    (s * cfg.fsdp_size / n).backward()
    s = s.detach()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(s)
    return (s / n).item(), clip_grad_norm_(model.parameters(), 0).item()


def _cp_run(rank, world, impl, out):
    cfg = ParallelismConfig(cp_size=world, cp_impl=impl)
    res = _loss_and_norm(cfg, cfg.build_device_mesh("cpu"), batch_from_documents(_docs(), packed=True))
    if rank == 0:
        torch.save(res, out)


@pytest.fixture(scope="module")
def unpacked():
    return _loss_and_norm(ParallelismConfig(), None, batch_from_documents(_docs(), packed=False))


def test_packed_equals_unpacked_one_process(unpacked):
    loss, norm = _loss_and_norm(ParallelismConfig(), None, batch_from_documents(_docs(), packed=True))
    assert loss == pytest.approx(unpacked[0], rel=RTOL) and norm == pytest.approx(unpacked[1], rel=RTOL)


@pytest.mark.distributed
@pytest.mark.parametrize("impl", ["ring", "allgather"])
def test_packed_with_cp_equals_unpacked(tmp_path, unpacked, impl):
    out = os.path.join(tmp_path, "res.pt")
    spawn(_cp_run, 2, tmp_path, impl, out)
    loss, norm = torch.load(out)
    assert loss == pytest.approx(unpacked[0], rel=RTOL) and norm == pytest.approx(unpacked[1], rel=RTOL)
