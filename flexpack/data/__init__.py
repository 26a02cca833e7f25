"""From a dataset to packed batches on every rank.

- ``PackedDataset``: map-style; plans once from the lengths, builds rows lazily.
- ``DistributedPackedSampler`` / ``PackedDataset.shard`` / ``shard_rows``: equal row counts per
  rank, every row once per epoch (remainder chosen by the user), tokens balanced per step.
- ``PackedIterableDataset``: streaming with a bounded buffer and exact mid-epoch resume;
  ``sync_ranks=True`` gives every rank the same row count; ``ds.stats`` (``StreamStats``) counts
  the padding rows that equalize ranks and the tokens ``overflow="truncate"`` cut.
- ``collate``: rows -> ``PackedBatch`` (DataLoader ``collate_fn``); pads unpadded rows
  (``input_ids`` + ``seqlens``, as ``pack_dataset`` stores them) to ``max_len`` and rebuilds their
  layout; ``collate_with_mask`` also builds the BlockMask in the worker (``MaskedBatch``).
- Per-token labels (``labels_column``, e.g. -100 on prompts) are kept on every path.

Hugging Face datasets and Ray live in ``flexpack.integrations.datasets`` / ``.ray``.
"""

from flexpack.data.collate import MaskedBatch, collate, collate_with_mask
from flexpack.data.dataset import (
    DistributedPackedSampler,
    PackedDataset,
    flops_weights,
    shard_rows,
)
from flexpack.data.streaming import PackedIterableDataset, StreamStats

__all__ = [
    "DistributedPackedSampler",
    "MaskedBatch",
    "PackedDataset",
    "PackedIterableDataset",
    "StreamStats",
    "collate",
    "collate_with_mask",
    "flops_weights",
    "shard_rows",
]
