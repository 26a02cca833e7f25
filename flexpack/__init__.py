"""flexpack: packed-sequence training for PyTorch.

Packing (``pack``, ``pack_sequences``, ``PackedLayout``) assigns variable-length samples to rows of
``max_len``; masks (``document_causal_mask`` and friends) keep every document to itself in
FlexAttention; ``attention`` runs them on any device; ``packed_cross_entropy`` keeps the loss
unbiased; ``pack_trees`` forwards shared prompts once (GRPO groups, DPO pairs).
"""

from flexpack.attention import RecompileLimitError, attention
from flexpack.batch import PackedBatch, pack_sequences
from flexpack.layout import PackedLayout
from flexpack.loss import packed_cross_entropy
from flexpack.masks import document_causal_mask, document_mask, prefix_lm_mask
from flexpack.packing import PackPlan, PackStats, pack
from flexpack.trees import TreeBatch, pack_trees

__version__ = "0.1.0"

__all__ = [
    "PackPlan",
    "PackStats",
    "PackedBatch",
    "PackedLayout",
    "RecompileLimitError",
    "TreeBatch",
    "attention",
    "document_causal_mask",
    "document_mask",
    "pack",
    "pack_sequences",
    "pack_trees",
    "packed_cross_entropy",
    "prefix_lm_mask",
]
