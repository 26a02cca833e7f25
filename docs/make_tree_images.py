"""Regenerate the pictures of docs/trees.md and docs/rl.md into docs/img/ (run from the
repository root).

    python docs/make_tree_images.py

A small packed row of prefix trees (64 tokens, blocks of 16) for the element mask, a realistic
8,192-token row of GRPO groups (blocks of 128) for the block structure, and one GRPO group (a
prompt and G = 4 completions) as TRL forwards it and as ``pack_trees`` packs it, with its mask.
"""

from pathlib import Path

import numpy as np

import flexpack
from flexpack.testing import dense_mask
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


# One GRPO group: a prompt of 12 tokens and G = 4 completions of 6, 4, 7 and 5 tokens.
PROMPT, COMPLETIONS = 12, [6, 4, 7, 5]


def _segment_colours(segment_ids: np.ndarray) -> np.ndarray:
    from matplotlib import colormaps
    from matplotlib.colors import to_rgba

    palette = colormaps["tab10"]
    return np.array([palette(int(s) % 10) if s >= 0 else to_rgba("white") for s in segment_ids])


def draw_grpo_group(path: Path) -> None:
    """The group as TRL's padded batch holds it, as pack_trees packs it, and the tree mask."""
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure

    group = ([0] * PROMPT, [[g + 1] * n for g, n in enumerate(COMPLETIONS)])
    S = PROMPT + sum(COMPLETIONS) + 6
    batch = flexpack.pack_trees([group], max_len=S, seed=None)
    seg = batch.segment_ids[0].numpy()
    pos = batch.position_ids[0].numpy()
    G, C = len(COMPLETIONS), max(COMPLETIONS)
    # TRL: one row per completion, the prompt repeated, padded to the longest completion.
    padded = np.full((G, PROMPT + C), -1)
    padded[:, :PROMPT] = 0
    for g, n in enumerate(COMPLETIONS):
        padded[g, PROMPT : PROMPT + n] = g + 1

    fig = Figure(figsize=(12, 5.4), dpi=100)
    gs = fig.add_gridspec(
        3, 2, width_ratios=[1.25, 1], height_ratios=[1.6, 0.5, 1.1], hspace=0.75, wspace=0.22
    )
    ax = fig.add_subplot(gs[0, 0])  # the tree
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 3)
    ax.axis("off")
    colours = _segment_colours(np.arange(G + 1))
    ax.text(5, 2.4, f"prompt: {PROMPT} tokens\npositions 0..{PROMPT - 1}", ha="center",
            va="center", fontsize=9,
            bbox=dict(boxstyle="round", facecolor=colours[0], alpha=0.35))  # fmt: skip
    for g, n in enumerate(COMPLETIONS):
        where = pos[seg == g + 1]
        x = 1.25 + g * 2.5
        ax.annotate("", xy=(x, 0.95), xytext=(5, 2.0), arrowprops=dict(arrowstyle="->"))
        ax.text(x, 0.55, f"completion {g + 1}: {n}\npositions {where[0]}..{where[-1]}",
                ha="center", va="center", fontsize=8,
                bbox=dict(boxstyle="round", facecolor=colours[g + 1], alpha=0.35))  # fmt: skip
    ax.set_title(f"a GRPO group: one prompt, G = {G} completions", fontsize=10)

    ax = fig.add_subplot(gs[1, 0])  # the packed row
    ax.imshow(_segment_colours(seg)[None], aspect="auto", interpolation="nearest")
    ax.set_yticks([])
    ax.set_xticks([*np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]]), S - 1])
    ax.set_title(
        f"pack_trees: one row, {batch.num_tokens} tokens forwarded (P + G·R), "
        f"{S - batch.num_tokens} padding",
        fontsize=10,
    )
    ax = fig.add_subplot(gs[2, 0])  # TRL's padded rows
    ax.imshow(
        _segment_colours(padded.reshape(-1)).reshape(G, -1, 4),
        aspect="auto",
        interpolation="nearest",
    )
    ax.set_xlim(-0.5, S - 0.5)
    ax.set_yticks(range(G), [f"row {g}" for g in range(G)], fontsize=8)
    ax.set_xlabel("token slot")
    ax.set_title(
        f"TRL: a row per completion, {padded.size} slots (G·(P + R_max)): the prompt {G} times",
        fontsize=10,
    )

    ax = fig.add_subplot(gs[:, 1])  # the mask
    dense = dense_mask(batch.mask())[0, 0].numpy()
    ax.imshow(dense, cmap=ListedColormap(["#f2f2f2", "#2b59c3"]), interpolation="nearest")
    starts = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]])
    for edge in starts[1:]:
        ax.axvline(edge - 0.5, color="#f4a259", linewidth=0.8)
        ax.axhline(edge - 0.5, color="#f4a259", linewidth=0.8)
    ax.set_xlabel("key (kv_idx)")
    ax.set_ylabel("query (q_idx)")
    ax.set_title(
        "batch.mask(): each completion sees the prompt and itself,\nnever its siblings",
        fontsize=10,
    )
    fig.savefig(path, format="png", dpi=fig.dpi, bbox_inches="tight")


def main(out: Path = IMG) -> None:
    out.mkdir(parents=True, exist_ok=True)
    batch = flexpack.pack_trees(SMALL, max_len=64, seed=None)
    plot_mask(batch.mask(), out / "tree.png", block_size=16, title="tree: 4 trees in 64 tokens")
    big = flexpack.pack_trees(grpo_row(), max_len=8192, seed=None)
    plot_block_mask(
        big.mask().block_mask(block_size=128),
        out / "tree_grpo_blocks.png",
        title="tree over 8,192 tokens of GRPO groups (G = 8), blocks of 128",
    )
    draw_grpo_group(out / "tree_grpo_group.png")
    print(f"wrote tree pictures to {out}")


if __name__ == "__main__":
    main()
