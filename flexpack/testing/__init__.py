"""Testing kit for users: dense references, hypothesis strategies, block-mask assertions.

- :func:`dense_mask` evaluates a flexpack ``Mask``, a ``mask_mod`` or a ``BlockMask`` on the
  full (B, H, Q_LEN, KV_LEN) grid; :func:`reference_attention` is masked attention in float64;
  :func:`dense_tree_mask` spells out the prefix-tree mask from its definition.
- :func:`assert_block_mask_matches` checks a BlockMask's element mask and block structure
  against the mask it should implement, with a readable diff.
- :mod:`flexpack.testing.strategies` (needs hypothesis) draws packed layouts, composed masks
  and random forests of segments.

Everything here materializes dense (q, kv) grids: use it at test sizes, not in training.
"""

from flexpack.testing.assertions import assert_block_mask_matches, expected_block_states
from flexpack.testing.references import (
    block_states,
    dense_mask,
    dense_tree_mask,
    reference_attention,
)

__all__ = [
    "assert_block_mask_matches",
    "block_states",
    "dense_mask",
    "dense_tree_mask",
    "expected_block_states",
    "reference_attention",
]
