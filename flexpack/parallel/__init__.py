"""flexpack.parallel: context parallelism for packed rows, balanced by the work the mask implies.

A packed row too long for one device is split along the sequence across the ranks of a
context-parallel group. Each rank holds ``S // world_size`` tokens of every row; attention
either gathers the keys and values of the whole row (one all-gather per layer) or passes them
around the group in blocks (a ring: K/V memory O(S / W) per rank, partial results merged by
their log-sum-exp), and each rank attends its own queries to the keys their documents allow,
exactly: the result is the single-process ``flexpack.attention`` on the full row, at this
rank's positions.

The split decides the speed. Under a document-causal mask a query at position ``i`` of its
document sees ``i + 1`` keys, so a contiguous split leaves the rank holding the end of a long
document with most of the work. :func:`shard_context` deals the row out in blocks of tokens so
that every rank holds exactly ``S // world_size`` tokens and the number of (query, key) pairs the
mask allows is as even as the blocks permit (``balance="work"``), with any document lengths and
padding.

Shape legend: B rows, S tokens per row, W world size (ranks of the context-parallel group),
S_l = S // W tokens per rank, H heads, D head dimension.

- :func:`shard_context`: this rank's :class:`ContextShard` of a (B, S) ``doc_ids`` batch:
  positions, ids and work; ``take`` / ``put`` / ``gather`` move (B, S, ...) tensors to and from
  its order; ``load_balancer()`` hands the plan to torch's experimental context parallelism.
- :func:`context_parallel_attention`: this rank's queries against the whole row's keys,
  forward and backward (the gradient of each key and value lands on the rank that holds it).
- :func:`shard_block_mask`: the (S_l, S) BlockMask of a shard, which the CUDA path runs flex
  with.
- :class:`ContextStats` (``shard.stats``): which schedule ran ("all_gather" or "ring"), the
  bytes this rank sent, the ring blocks it skipped.

The package, in import order (each module imports only those above it):

- ``planning``: who holds which tokens: per-token work, the deal, the plan cache and the
  fingerprint the ranks agree on (numpy on the host).
- ``sharding``: :class:`ContextShard`, :func:`shard_context`, :class:`ContextStats` and the
  collectives with autograd (the sequence all-gather, the agreement check).
- ``ring``: the ring schedule, its tiles and its autograd Function.
- ``attention``: :func:`context_parallel_attention` (picks and runs a schedule), the
  all-gather path's local attention and :func:`shard_block_mask`.
"""

# The private names are read through the package face by bench/context_parallel.py and
# docs/make_parallel_images.py; the tests import internals from the module that defines them.
from flexpack.parallel.attention import (  # noqa: F401
    _auto_schedule,
    _local_attention,
    context_parallel_attention,
    shard_block_mask,
)
from flexpack.parallel.planning import _PLANS, _token_work  # noqa: F401
from flexpack.parallel.ring import _ring_plan  # noqa: F401
from flexpack.parallel.sharding import ContextShard, ContextStats, ShardBalancer, shard_context

__all__ = [
    "ContextShard",
    "ContextStats",
    "ShardBalancer",
    "context_parallel_attention",
    "shard_block_mask",
    "shard_context",
]
