"""The values of cu_seqlens and position_ids reach the host once per tensor and version of its values.

On a GPU each read waits for the device, and every layer of a step passes the same tensors (forward and backward):
the reads are remembered (``ndp_kernels.segments.read_once``). On CPU they are not (a read costs nothing, and a
tensor sharing numpy's memory changes values without its version); these tests remember them on CPU as on a GPU
and check the count of reads and that a tensor changed in place is read again (never a stale document table).
"""
import pytest
import torch

import ndp
import ndp_kernels.segments as segments
from dense_attention import dense_reference
from ndp.testing import assert_close


@pytest.fixture
def remembered(monkeypatch):
    """Reads remembered on CPU as on a GPU; counts the host reads of the tensors in `watched`."""
    monkeypatch.setattr(segments, "_READ_EVERY_TIME", set())
    watched, reads = [], []
    tolist = torch.Tensor.tolist

    def counting(self):
        if any(self is t for t in watched):
            reads.append(1)
        return tolist(self)
    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    return watched, reads


def _qkv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, h, 16, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))


def _layers(q, k, v, calls, **kw):
    """`calls` forward+backward attention calls on the same inputs, as the layers of a step make them."""
    outs = []
    for _ in range(calls):
        out = ndp.ops.attention(q, k, v, causal=True, **kw)
        out.sum().backward()
        outs.append(out.detach())
    return outs


def _check_docs(out, q, k, v, docs):
    case = dict(causal=True, docs=docs)
    want = dense_reference(case, q, k, v, torch.ones_like(out))[0]
    assert_close(out, want, torch.float64)


def test_cu_seqlens_are_read_once_per_tensor_and_again_after_an_in_place_change(remembered):
    watched, reads = remembered
    q, k, v = _qkv(40)
    cu = torch.tensor([0, 7, 30, 40], dtype=torch.int32)
    watched.append(cu)
    outs = _layers(q, k, v, 3, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert len(reads) == 1  # three forwards and three backwards, one read
    for out in outs:
        _check_docs(out, q, k, v, [7, 23, 10])
    cu.copy_(torch.tensor([0, 12, 13, 40], dtype=torch.int32))  # a new batch in the same buffer
    (out,) = _layers(q, k, v, 1, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert len(reads) == 2
    _check_docs(out, q, k, v, [12, 1, 27])


def test_a_write_that_skips_the_version_counter_fails_loudly(remembered):
    # dist.broadcast into the same buffer (or a write through .data) leaves the version as it was: the remembered
    # read would be stale. It is compared with the tensor on the device (on a GPU without waiting; the CPU raises
    # at once) and refused, never reused.
    q, k, v = _qkv(40)
    cu = torch.tensor([0, 7, 30, 40], dtype=torch.int32)
    _layers(q, k, v, 1, cu_seqlens_q=cu, cu_seqlens_k=cu)
    version = cu._version
    cu.data.copy_(torch.tensor([0, 12, 13, 40], dtype=torch.int32))
    assert cu._version == version
    with pytest.raises(RuntimeError, match="changed without its version counter .* pass a new tensor for each batch"):
        _layers(q, k, v, 1, cu_seqlens_q=cu, cu_seqlens_k=cu)


def test_packed_rows_of_position_ids_are_found_once_per_tensor(remembered):
    q, k, v = _qkv(40)
    pos = torch.tensor([list(range(25)) + list(range(15))])
    first = segments.packed_rows_cu(pos, 1, 40)
    assert first is segments.packed_rows_cu(pos, 1, 40)  # one table: its values are read once too
    assert first.tolist() == [0, 25, 40]
    (out,) = _layers(q[None], k[None], v[None], 1, position_ids=pos)
    _check_docs(out[0], q, k, v, [25, 15])
    pos.copy_(torch.tensor([list(range(5)) + list(range(35))]))
    assert segments.packed_rows_cu(pos, 1, 40).tolist() == [0, 5, 40]
    (out,) = _layers(q[None], k[None], v[None], 1, position_ids=pos)
    _check_docs(out[0], q, k, v, [5, 35])
    assert segments.packed_rows_cu(torch.arange(40)[None], 1, 40) is None  # dense rows


def test_cpu_tensors_and_inference_tensors_are_read_every_time(monkeypatch):
    calls = []
    t = torch.arange(4)

    def read():
        calls.append(1)
        return t.tolist()
    for _ in range(2):
        assert segments.read_once(t, "values", read) == [0, 1, 2, 3]
    assert len(calls) == 2
    with torch.inference_mode():
        s = torch.arange(4)
    monkeypatch.setattr(segments, "_READ_EVERY_TIME", set())
    for _ in range(2):
        segments.read_once(s, "values", read)
    assert len(calls) == 4
