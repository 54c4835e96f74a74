"""Loads the compiled ops (``ndp._C`` -> ``torch.ops.ndp.*``) and registers their fake and autograd kernels.

Importing this module never fails: when the extension is missing or does not load, ``load_error`` says why
and how to fix it, and ``torch.ops.ndp.*`` stays undefined (callers fall back to Python implementations). A build
without nvcc (most runtime containers) has CPU kernels only: :func:`runs_on` tells whether an op runs on a device,
and :func:`merge_attn_states_` / :func:`shard_gather` / :func:`unshard` are the entry points that pick an
implementation by device (the compiled op where it runs, else the Triton merge on a GPU, indexing, the reference).

Ops (schemas in csrc/ops.cpp, semantics in docs/design.md):
    merge_attn_states_(out_acc, lse_acc, block_out, block_lse) -> ()     # in place, fp32 accumulators
    shard_index(seqlen, world_size, rank, layout) -> int64 [seqlen // world_size]  (CPU tensor)
    shard_gather(x, dim, world_size, rank, layout) -> local shard of x along dim
    unshard(chunks, dim, world_size, layout) -> full tensor from torch.stack of every rank's shard
    packed_shard_plan(cu_seqlens, world_size, min_piece) -> int64 [npieces, 4] (doc, global_start, length, rank)
"""
from __future__ import annotations

import glob
import logging
import os

import torch

import ndp_kernels

logger = logging.getLogger(__name__)

OP_NAMES = ("merge_attn_states_", "shard_index", "shard_gather", "unshard", "packed_shard_plan")

_BUILD_HINT = "build it with `pip install --no-build-isolation -e .` in the repository (or `make build`)"


def _explain(exc: BaseException) -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    built = glob.glob(os.path.join(here, "_C*.so")) + glob.glob(os.path.join(here, "_C*.pyd"))
    if not built:
        return f"ndp._C is not built (no _C*.so in {here}); {_BUILD_HINT}"
    msg = str(exc)
    if "undefined symbol" in msg or "version" in msg.lower():
        return (f"ndp._C ({os.path.basename(built[0])}) failed to load: {msg}. It was most likely built against "
                f"another torch than the installed {torch.__version__}; rebuild: {_BUILD_HINT}")
    return f"ndp._C ({os.path.basename(built[0])}) failed to load: {type(exc).__name__}: {msg}; {_BUILD_HINT}"


load_error: str | None = None
WITH_CUDA = False  # whether the loaded extension was compiled with its CUDA kernels
try:
    from . import _C  # noqa: F401  (importing it registers torch.ops.ndp.*)

    WITH_CUDA = bool(getattr(_C, "WITH_CUDA", 0))
except ImportError as exc:  # OSError from dlopen surfaces as ImportError
    load_error = _explain(exc)
    logger.debug("compiled ops unavailable: %s", load_error)


def available() -> bool:
    """True when ``torch.ops.ndp.*`` are registered."""
    return load_error is None


def has_kernel(op: str, dispatch_key: str) -> bool:
    """Whether a compiled op has a kernel for a dispatch key.

    Args:
        op: op name without namespace, one of ``OP_NAMES``.
        dispatch_key: "CPU", "CUDA", ...
    Returns:
        True when ``torch.ops.ndp.<op>`` runs for that key (the factory ``shard_index`` runs for every key).
    """
    if load_error is not None:
        return False
    name = f"ndp::{op}"
    if torch._C._dispatch_has_kernel_for_dispatch_key(name, dispatch_key):
        return True
    # shard_index is a factory (no tensor argument): one device-independent kernel.
    return torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd")


def runs_on(op: str, device) -> bool:
    """Whether ``torch.ops.ndp.<op>`` runs on tensors of `device`: loaded, with a kernel for its dispatch key (a
    CUDA tensor reaching a CPU-only build raises NotImplementedError in the middle of training)."""
    return has_kernel(op, "CUDA" if torch.device(device).type == "cuda" else "CPU")


def merge_impl(device, dtype):
    """The LSE merge that runs for accumulators of `dtype` on `device`: ``torch.ops.ndp.merge_attn_states_`` (C++ on
    CPU, CUDA kernel in a CUDA build) where it runs there and they are fp32; else on a GPU the Triton kernel
    ``ndp_kernels.merge_attn_states_`` (a build without nvcc on a GPU machine; it takes fp64 to the reference
    itself); else the reference (no triton import). All share the math of docs/design.md ("Ring step"): the same
    weights, rows where both lse are -inf kept."""
    if dtype == torch.float32 and runs_on("merge_attn_states_", device):
        return torch.ops.ndp.merge_attn_states_
    if torch.device(device).type == "cuda":
        return ndp_kernels.merge_attn_states_
    return ndp_kernels.reference.merge_attn_states_ref


def merge_attn_states_(out_acc, lse_acc, block_out, block_lse):
    """The one LSE merge entry point: a block's (out, lse) into fp32 (or fp64) accumulators, in place, by the
    implementation :func:`merge_impl` picks for their device. Returns (out_acc, lse_acc)."""
    merge_impl(out_acc.device, out_acc.dtype)(out_acc, lse_acc, block_out, block_lse)
    return out_acc, lse_acc


def shard_gather(x: torch.Tensor, dim: int, world_size: int, rank: int, layout: str) -> torch.Tensor:
    """This rank's shard of `x` along `dim` (``torch.ops.ndp.shard_gather``, or its rows by ``index_select`` where
    the op has no kernel for x's device)."""
    if runs_on("shard_gather", x.device):
        return torch.ops.ndp.shard_gather(x, dim, world_size, rank, layout)
    d = _seq_dim(dim, x.dim())
    return x.index_select(d, torch.ops.ndp.shard_index(x.shape[d], world_size, rank, layout).to(x.device))


def unshard(chunks: torch.Tensor, dim: int, world_size: int, layout: str) -> torch.Tensor:
    """The full tensor from ``torch.stack`` of every rank's shard (``torch.ops.ndp.unshard``, or by ``index_copy``
    where the op has no kernel for the chunks' device)."""
    if runs_on("unshard", chunks.device):
        return torch.ops.ndp.unshard(chunks, dim, world_size, layout)
    d = _seq_dim(dim, chunks.dim() - 1)
    n = chunks.shape[1 + d] * world_size
    idx = torch.cat([torch.ops.ndp.shard_index(n, world_size, r, layout) for r in range(world_size)])
    flat = torch.cat(chunks.unbind(0), dim=d)  # rank 0's rows, then rank 1's, ...: row i goes to position idx[i]
    return flat.new_empty(flat.shape).index_copy(d, idx.to(flat.device), flat)


# --------------------------------------------------------------------------------------------------------------
# Fake (meta) kernels: shapes only, for torch.compile / FakeTensorMode.

def _seq_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise IndexError(f"dim={dim} is out of range for a tensor with {ndim} dims; pass a dim in "
                         f"[{-ndim}, {ndim - 1}]")
    return dim % ndim


def _fake_merge(out_acc, lse_acc, block_out, block_lse):
    return None


def _fake_shard_index(seqlen, world_size, rank, layout):
    return torch.empty(seqlen // world_size, dtype=torch.int64, device="cpu")


def _fake_shard_gather(x, dim, world_size, rank, layout):
    d = _seq_dim(dim, x.dim())
    shape = list(x.shape)
    shape[d] = shape[d] // world_size
    return x.new_empty(shape)


def _fake_unshard(chunks, dim, world_size, layout):
    d = _seq_dim(dim, chunks.dim() - 1)
    shape = list(chunks.shape[1:])
    shape[d] = shape[d] * world_size
    return chunks.new_empty(shape)


def _fake_packed_shard_plan(cu_seqlens, world_size, min_piece):
    # The number of pieces depends on the lengths (data): an unbacked symbolic size.
    npieces = torch.library.get_ctx().new_dynamic_size()
    return cu_seqlens.new_empty((npieces, 4), dtype=torch.int64)


# --------------------------------------------------------------------------------------------------------------
# Autograd: shard_gather and unshard are permutations, so each one's backward is a gather/scatter.

def _gather_setup(ctx, inputs, output):
    x, dim, world_size, rank, layout = inputs
    ctx.shape, ctx.dim, ctx.world_size, ctx.rank, ctx.layout = x.shape, dim, world_size, rank, layout


def _gather_backward(ctx, grad):
    d = _seq_dim(ctx.dim, len(ctx.shape))
    idx = torch.ops.ndp.shard_index(ctx.shape[d], ctx.world_size, ctx.rank, ctx.layout).to(grad.device)
    full = grad.new_zeros(ctx.shape).index_copy(d, idx, grad)
    return full, None, None, None, None


def _unshard_setup(ctx, inputs, output):
    _, dim, world_size, layout = inputs
    ctx.dim, ctx.world_size, ctx.layout = dim, world_size, layout


def _unshard_backward(ctx, grad):
    shards = [shard_gather(grad, ctx.dim, ctx.world_size, r, ctx.layout) for r in range(ctx.world_size)]
    return torch.stack(shards), None, None, None


if load_error is None:
    torch.library.register_fake("ndp::merge_attn_states_")(_fake_merge)
    torch.library.register_fake("ndp::shard_index")(_fake_shard_index)
    torch.library.register_fake("ndp::shard_gather")(_fake_shard_gather)
    torch.library.register_fake("ndp::unshard")(_fake_unshard)
    torch.library.register_fake("ndp::packed_shard_plan")(_fake_packed_shard_plan)
    torch.library.register_autograd("ndp::shard_gather", _gather_backward, setup_context=_gather_setup)
    torch.library.register_autograd("ndp::unshard", _unshard_backward, setup_context=_unshard_setup)
