"""Prefix-tree packing: shared prompts forwarded once (GRPO groups, DPO pairs, multi-turn rollouts).

A GRPO group is a prompt with G completions; a DPO pair a prompt with a chosen and a rejected
answer; a multi-turn rollout shares whole earlier turns. Forwarded one rollout per document they
cost ``G * (P + R)`` tokens; as a tree, ``P + G * R``. :func:`pack_trees` lays whole trees into rows
of ``max_len`` (a parent before its children, depth-first), :func:`flexpack.masks.tree` lets each
token see its own segment causally and every token of its ancestors, and position ids continue
along the path, so every root-to-leaf path sees exactly the positions, keys and values it would
see run alone. :meth:`TreeBatch.gather_logps` reads the log-probs back per rollout.

One group (prompt ``[5, 6, 7]``, completions ``[8, 9]`` and ``[4]``), ``max_len=8``, pad id 0::

    input_ids     5   6   7   8   9   4   0   0
    segment_ids   0   0   0   1   1   2  -1  -1       parents  -1   0   0
    position_ids  0   1   2   3   4   3   0   0

    rollout 0: log p(8 | 5 6 7), log p(9 | 5 6 7 8)     (targets of segment 1)
    rollout 1: log p(4 | 5 6 7)                         (target of segment 2)

Shape legend:
    R: packed rows; S = max_len tokens per row; V vocabulary; M: most segments in a row.
    N: rollouts (root-to-leaf paths); L: most targets of a rollout.
"""

from __future__ import annotations

from flexpack.trees._build import PaddedTrees, TreeBatch, pack_padded, pack_trees
from flexpack.trees._logps import RolloutLogps, grpo_loss, rollout_logps, sequence_logps

__all__ = [
    "PaddedTrees",
    "RolloutLogps",
    "TreeBatch",
    "grpo_loss",
    "pack_padded",
    "pack_trees",
    "rollout_logps",
    "sequence_logps",
]
