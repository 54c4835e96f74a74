"""Context-parallel attention (layer ``ndp/cp`` of docs/design.md): load-balanced sharding and ring, all-gather,
Ulysses and USP attention over a CP process group, forward and backward."""
from .allgather import allgather_attention
from .ring import ring_attention
from .sharding import gather_sequence, reduce_scatter_sequence, shard_packed, shard_sequence, sum_over_group
from .stats import CommStats
from ._validate import raise_on_all_ranks
from .ulysses import ulysses_attention
from .usp import split_cp_group, usp_attention

__all__ = ["shard_sequence", "gather_sequence", "reduce_scatter_sequence", "sum_over_group", "shard_packed",
           "ring_attention", "allgather_attention", "ulysses_attention", "usp_attention", "split_cp_group", "CommStats",
           "raise_on_all_ranks"]
