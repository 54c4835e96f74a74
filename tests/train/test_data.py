"""Data path: tokenizer, deterministic global batches, packing, DP/CP sharding in the attention's layout."""
import pytest
import torch

import ndp.cp
from dist import spawn
from ndp_kernels.segments import cu_from_position_ids
from ndp.parallel import CPContext
from ndp.train.data import (DEFAULT_CORPUS, IGNORE_INDEX, ByteTokenizer, TokenDataset, batch_from_documents,
                            load_documents, microbatches, model_inputs, tokenize_documents)


def _dataset(pack=False, seed=0, B=8, S=64):
    t, s = tokenize_documents(load_documents())
    return TokenDataset(t, s, seq_len=S, batch_size=B, seed=seed, pack_docs=pack)


def test_corpus_and_tokenizer():
    import os

    assert os.path.getsize(DEFAULT_CORPUS) > 200_000
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("héllo")) == "héllo" and max(tok.encode("héllo")) < 256
    assert len(load_documents()) > 100


def test_batches_depend_only_on_seed_and_step():
    a, b = _dataset(), _dataset()
    for step in (0, 3, 1000):  # 1000 wraps into later epochs
        x, y = a.global_batch(step), b.global_batch(step)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.labels, y.labels)
    assert not torch.equal(a.global_batch(0).input_ids, _dataset(seed=1).global_batch(0).input_ids)
    g = a.global_batch(0)
    # labels are the inputs shifted by one (before any sharding)
    assert torch.equal(g.labels[:, :-1], g.input_ids[:, 1:])


def test_packed_docs_positions_and_labels():
    g = _dataset(pack=True).global_batch(0)
    assert g.packed
    for row in range(g.input_ids.shape[0]):
        pos, lab = g.position_ids[row], g.labels[row]
        restarts = torch.nonzero(pos[1:] == 0).flatten() + 1
        for r in restarts.tolist():  # a document starts at r: no loss for predicting it from r-1
            assert lab[r - 1] == IGNORE_INDEX
            assert pos[r - 1] > 0
        cu = cu_from_position_ids(pos[None])
        assert cu[0] == 0 and cu[-1] == pos.numel() and len(cu) == len(restarts) + 2


def test_microbatches_cover_global_batch():
    g = _dataset().global_batch(5)
    parts = []
    for r in range(2):
        parts += microbatches(g, dp_rank=r, dp_size=2, grad_accum=2)
    assert torch.equal(torch.cat([p.input_ids for p in parts]), g.input_ids)
    with pytest.raises(ValueError, match="divisible by dp_replicate\\*dp_shard\\*grad_accum"):
        microbatches(g, dp_rank=0, dp_size=3, grad_accum=1)


def test_batch_from_documents():
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    p = batch_from_documents(docs, packed=True)
    u = batch_from_documents(docs, packed=False)
    assert p.num_tokens == u.num_tokens == 6
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]


def _cp_shards(rank, world, layout):
    g = _dataset(B=2, S=64).global_batch(0)
    ctx = CPContext(impl="ring", layout=layout, group=torch.distributed.group.WORLD, size=world, rank=rank)
    kw, labels = model_inputs(g, ctx, "cpu")
    for name, full, local in (("input_ids", g.input_ids, kw["input_ids"]), ("labels", g.labels, labels),
                              ("position_ids", g.position_ids, kw["position_ids"])):
        # the attention's own shard function gives the same layout
        assert torch.equal(local, ndp.cp.shard_sequence(full, dim=1, group=None, layout=layout)), name
        assert torch.equal(ndp.cp.gather_sequence(local, dim=1, group=None, layout=layout), full), name
    assert local.shape[1] == 64 // world
    # packed rows: per-document balanced pieces, global cu_seqlens for the attention
    gp = _dataset(pack=True, B=2, S=64).global_batch(0)
    kw, labels = model_inputs(gp, ctx, "cpu")
    cu = cu_from_position_ids(gp.position_ids.reshape(1, -1))
    assert torch.equal(kw["cu_seq_lens_q"], cu)
    idx = ndp.cp.shard_packed(cu, group=None).index.long()
    assert torch.equal(kw["input_ids"][0], gp.input_ids.reshape(-1)[idx])
    assert torch.equal(labels[0], gp.labels.reshape(-1)[idx])


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_cp_sharding_uses_attention_layout(tmp_path, layout):
    spawn(_cp_shards, 2, tmp_path, layout)
