"""Regenerate the pictures of docs/trees.md into docs/img/ (run from the repository root).

    python docs/make_tree_images.py

A small packed row of prefix trees (64 tokens, blocks of 16) for the element mask, and a realistic
8,192-token row of GRPO groups (blocks of 128) for the block structure.
"""

from pathlib import Path

import numpy as np

import flexpack
from flexpack.viz import plot_block_mask, plot_mask

IMG = Path(__file__).resolve().parent / "img"

# A GRPO group (prompt of 14, completions of 6, 3 and 5), a DPO pair (prompt of 9, chosen 4,
# rejected 6), a two-turn rollout branching at the second turn, and a plain document of 7.
SMALL = [
    ([1] * 14, [[2] * 6, [3] * 3, [4] * 5]),
    ([5] * 9, [[6] * 4, [7] * 6]),
    ([8] * 4, [([9] * 2, [[10] * 2, [11]])]),
    [12] * 7,
]


def grpo_row(seed: int = 0, max_len: int = 8192) -> list:
    """GRPO groups (prompt median 1,000 tokens, 8 completions median 300) filling one row."""
    rng = np.random.default_rng(seed)
    groups, used = [], 0
    while True:
        P = int(rng.lognormal(np.log(1000), 0.5))
        R = rng.lognormal(np.log(300), 0.5, size=8).astype(int) + 1
        if used + P + R.sum() > max_len:
            return groups
        groups.append(([0] * P, [[1] * int(r) for r in R]))
        used += P + int(R.sum())


def main() -> None:
    IMG.mkdir(exist_ok=True)
    batch = flexpack.pack_trees(SMALL, max_len=64, seed=None)
    plot_mask(batch.mask(), IMG / "tree.png", block_size=16, title="tree: 4 trees in 64 tokens")
    big = flexpack.pack_trees(grpo_row(), max_len=8192, seed=None)
    plot_block_mask(
        big.mask().block_mask(block_size=128),
        IMG / "tree_grpo_blocks.png",
        title="tree over 8,192 tokens of GRPO groups (G = 8), blocks of 128",
    )
    print(f"wrote tree pictures to {IMG}")


if __name__ == "__main__":
    main()
