"""Process-group teardown that does not abort the process (``ndp.shutdown``)."""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def shutdown(*, barrier: bool = True) -> bool:
    """End the job's torch.distributed state cleanly: a barrier, then ``destroy_process_group()``.

    Under torch 2.13 with gloo, a rank that destroys its process group (or exits) while a peer still has
    transfers in flight can die after correct results with ``terminate called without an active
    exception`` (SIGABRT). The barrier makes every rank reach teardown together. Call it once at the end
    of a script, on every rank; without a process group it does nothing.

    Args:
        barrier: wait for every rank first (default). Pass False on an error path: a rank that failed
            must not wait for peers that may never arrive.
    Returns:
        True when a process group was destroyed, False when there was none.
    Raises:
        RuntimeError: from the barrier when a peer is gone (gloo/NCCL timeout); the group is still
            destroyed.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        if barrier and dist.get_world_size() > 1:
            if dist.get_backend() == "nccl" and torch.cuda.is_available():
                dist.barrier(device_ids=[torch.cuda.current_device()])
            else:
                dist.barrier()
    finally:
        dist.destroy_process_group()
    return True
