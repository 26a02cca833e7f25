"""Regenerate the pictures of docs/context_parallel.md into docs/img/ (run from the repository
root).

    python docs/make_parallel_images.py

Both pictures are drawn from what flexpack.parallel returns on one small packed row (512 tokens:
a long document among short ones, a padded tail) dealt to W = 4 ranks in blocks of 16 tokens,
the row-scale twin of the 128-token blocks of a 128K-token row:

- cp_dealing.png: which rank holds each token under ``shard_context(balance=...)`` for the
  three strategies, and each rank's attention work (document-causal (query, key) pairs).
- cp_ring.png: the ring schedule of ``context_parallel_attention(schedule="ring")``: the row's
  document-causal mask with queries and keys in rank order, each (rank, K/V block) tile labelled
  with the step that computes it, and per rank and step the pairs computed or the block skipped.
"""

from pathlib import Path

import numpy as np
import torch

from flexpack import masks
from flexpack.parallel import _ring_plan, shard_context
from flexpack.testing import dense_mask

IMG = Path(__file__).resolve().parent / "img"

# One 200-token document among shorter ones, 24 tokens of padding: S = 512 over W = 4 ranks.
LENGTHS = [200, 37, 61, 15, 90, 23, 42, 20]
S, W, BLOCK = 512, 4, 16
RANK_COLOURS = ["#2b59c3", "#f4a259", "#5b8e7d", "#bc4b51"]
BALANCES = ("contiguous", "head_tail", "work")


def doc_ids() -> torch.Tensor:
    """(1, S) ids of the example row; -1 on the padded tail."""
    ids = torch.full((1, S), -1)
    ids[0, : sum(LENGTHS)] = torch.repeat_interleave(
        torch.arange(len(LENGTHS)), torch.tensor(LENGTHS)
    )
    return ids


def owners(shards: list) -> np.ndarray:
    """(S,) rank that holds each position of the row, from the shards' own index."""
    owner = np.full(S, -1)
    for shard in shards:
        owner[shard.index[0].numpy()] = shard.rank
    assert (owner >= 0).all(), "every position on exactly one rank"
    return owner


def _doc_colours(ids: np.ndarray) -> np.ndarray:
    from matplotlib import colormaps
    from matplotlib.colors import to_rgba

    palette = colormaps["tab10"]
    return np.array([palette(int(i) % 10) if i >= 0 else to_rgba("white") for i in ids])


def _rank_colours(owner: np.ndarray) -> np.ndarray:
    from matplotlib.colors import to_rgba

    return np.array([to_rgba(RANK_COLOURS[r]) for r in owner])


def draw_dealing(ids: torch.Tensor, path: Path) -> None:
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    fig = Figure(figsize=(11, 4.6), dpi=100)
    gs = fig.add_gridspec(4, 2, width_ratios=[3.2, 1], height_ratios=[1, 1, 1, 1], hspace=0.9)
    ax = fig.add_subplot(gs[0, 0])
    ax.imshow(_doc_colours(ids[0].numpy())[None], aspect="auto", interpolation="nearest")
    ax.set_title(f"the packed row: {len(LENGTHS)} documents and padding, S = {S}", fontsize=10)
    ax.set_yticks([])
    ax.set_xticks([])
    bars = fig.add_subplot(gs[:, 1])
    for i, balance in enumerate(BALANCES):
        shards = [shard_context(ids, W, r, balance=balance, block_size=BLOCK) for r in range(W)]
        owner = owners(shards)
        ax = fig.add_subplot(gs[i + 1, 0])
        ax.imshow(_rank_colours(owner)[None], aspect="auto", interpolation="nearest")
        ax.set_yticks([])
        ax.set_xticks([0, 128, 256, 384, 511] if i == 2 else [])
        ax.set_title(f'balance="{balance}": work max / mean {shards[0].imbalance:.3f}', fontsize=10)
        work = np.array(shards[0].rank_work)
        x = np.arange(W) + i * (W + 1)
        bars.bar(x, work / 1000, color=RANK_COLOURS)
    ax.set_xlabel("token position in the row")
    bars.set_xticks([(W - 1) / 2 + i * (W + 1) for i in range(len(BALANCES))], BALANCES, fontsize=8)
    bars.set_ylabel("rank work: (query, key) pairs, thousands")
    bars.set_title(f"each rank's work, W = {W}", fontsize=10)
    bars.legend(
        handles=[Patch(color=c, label=f"rank {r}") for r, c in enumerate(RANK_COLOURS)],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.1),
        ncol=2,
        fontsize=8,
        frameon=False,
    )
    fig.suptitle(
        f"shard_context(doc_ids, {W}, rank, balance=..., block_size={BLOCK}): "
        f"every rank holds {S // W} tokens",
        fontsize=11,
    )
    fig.savefig(path, format="png", dpi=fig.dpi, bbox_inches="tight")


def ring_table(ids: torch.Tensor, shards: list, dense: np.ndarray) -> np.ndarray:
    """(W, W) pairs computed by rank r at ring step i (its K/V block from rank (r - i) % W);
    -1 where the block is passed on without computing. Skips are read from flexpack's own ring
    plan (no tile for that source rank) and checked against the dense mask."""
    per = S // W
    gathered = shards[0].gathered_index[0].numpy()
    table = np.zeros((W, W), dtype=np.int64)
    for r, shard in enumerate(shards):
        plan = _ring_plan(shard, True, 1, torch.device("cpu"))
        for i in range(W):
            src = (r - i) % W
            q = gathered[r * per : (r + 1) * per]
            k = gathered[src * per : (src + 1) * per]
            pairs = int(dense[np.ix_(q, k)].sum())
            skipped = not plan.tiles[src]
            assert skipped == (pairs == 0), (r, i, src, pairs)
            table[r, i] = -1 if skipped else pairs
    return table


def draw_ring(ids: torch.Tensor, path: Path) -> None:
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure

    shards = [shard_context(ids, W, r, block_size=BLOCK) for r in range(W)]
    dense = dense_mask(masks.document(ids) & masks.causal())[0, 0].numpy()
    order = shards[0].gathered_index[0].numpy()  # rank 0's positions, then rank 1's, ...
    per = S // W
    table = ring_table(ids, shards, dense)

    fig = Figure(figsize=(12, 5.6), dpi=100)
    gs = fig.add_gridspec(1, 2, width_ratios=[1, 1.05], wspace=0.3)
    ax = fig.add_subplot(gs[0, 0])
    ax.imshow(
        dense[np.ix_(order, order)],
        cmap=ListedColormap(["#f2f2f2", "#2b59c3"]),
        interpolation="nearest",
    )
    for edge in range(per, S, per):
        ax.axvline(edge - 0.5, color="black", linewidth=1)
        ax.axhline(edge - 0.5, color="black", linewidth=1)
    for r in range(W):
        for src in range(W):
            step = (r - src) % W
            ax.text(
                src * per + per - 4,
                r * per + 4,
                f"step {step}",
                ha="right",
                va="top",
                fontsize=8,
                color="black",
                bbox=dict(boxstyle="round", facecolor="white", alpha=0.8, linewidth=0),
            )
    ticks = [r * per + per / 2 for r in range(W)]
    ax.set_xticks(ticks, [f"K/V of\nrank {r}" for r in range(W)], fontsize=8)
    ax.set_yticks(ticks, [f"rank {r}\nqueries" for r in range(W)], fontsize=8)
    ax.set_title("document-causal mask, tokens in rank order", fontsize=10)

    ax = fig.add_subplot(gs[0, 1])
    shown = np.where(table < 0, np.nan, table)
    ax.imshow(shown, cmap="Blues", vmin=0, vmax=max(1, table.max()) * 1.3)
    for r in range(W):
        for i in range(W):
            src = (r - i) % W
            text = f"K/V of rank {src}\n" + (
                "skipped" if table[r, i] < 0 else f"{table[r, i]:,} pairs"
            )
            ax.text(i, r, text, ha="center", va="center", fontsize=8)
    ax.set_xticks(range(W), [f"step {i}" for i in range(W)], fontsize=9)
    ax.set_yticks(range(W), [f"rank {r}" for r in range(W)], fontsize=9)
    ax.set_title(
        "what each rank computes per step (forward): its queries\n"
        "against the K/V block in hand, then it passes the block to rank + 1",
        fontsize=10,
    )
    fig.suptitle(
        f'context_parallel_attention(schedule="ring"), W = {W}: a rank holds the K/V of rank '
        "(r - step) mod W",
        fontsize=11,
    )
    fig.savefig(path, format="png", dpi=fig.dpi, bbox_inches="tight")


def main(out: Path = IMG) -> None:
    out.mkdir(parents=True, exist_ok=True)
    ids = doc_ids()
    draw_dealing(ids, out / "cp_dealing.png")
    draw_ring(ids, out / "cp_ring.png")
    print(f"wrote context-parallel pictures to {out}")


if __name__ == "__main__":
    main()
