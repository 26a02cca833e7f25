"""Regenerate the pictures of docs/masks.md into docs/img/ (run from the repository root).

    python docs/make_images.py

Small, fixed examples (64 tokens, blocks of 16 for the element pictures) so that every pair is
visible; the block-structure picture uses a realistic 2,048-token row with blocks of 128.
"""

from pathlib import Path

import torch

from flexpack import masks
from flexpack.viz import plot_block_mask, plot_mask

IMG = Path(__file__).resolve().parent / "img"

# Four documents of 20, 9, 1 and 24 tokens, then 10 tokens of padding: a one-token document, a
# padded tail, and S = 64 with block edges falling inside documents.
DOC_IDS = torch.tensor([0] * 20 + [1] * 9 + [2] * 1 + [3] * 24 + [-1] * 10)
PREFIX_LENGTHS = torch.tensor([8, 3, 0, 10])


def realistic_row(seed: int = 0, S: int = 2048) -> torch.Tensor:
    """One packed row of lognormal-length documents (median ~200 tokens) and a padded tail."""
    torch.manual_seed(seed)
    lengths = torch.distributions.LogNormal(5.3, 0.8).sample((64,)).clamp(1, 1200).long()
    ids, used = [], 0
    for doc, n in enumerate(lengths.tolist()):
        if used + n > S - 40:
            break
        ids += [doc] * n
        used += n
    return torch.tensor(ids + [-1] * (S - used))


def main(out: Path = IMG) -> None:
    torch.manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    d = DOC_IDS
    S = d.shape[0]
    examples = {
        "document": masks.document(d),
        "document_causal": masks.document(d) & masks.causal(),
        "prefix_lm": masks.prefix_lm(d, PREFIX_LENGTHS),
        "sliding_window": masks.document(d) & masks.causal() & masks.sliding_window(6),
        "padding": masks.padding(d),
        "composition": (masks.document(d) & masks.causal())
        | (masks.padding(d) & masks.causal() & masks.sliding_window(3)),
    }
    for name, mask in examples.items():
        plot_mask(mask, out / f"{name}.png", block_size=16)
        if name == "document_causal":
            bm = mask.block_mask(block_size=16, Q_LEN=S, KV_LEN=S)
            plot_block_mask(bm, out / f"{name}_blocks.png")
    row = realistic_row()
    bm = masks.document(row) & masks.causal()
    plot_block_mask(
        bm.block_mask(block_size=128),
        out / "document_causal_2048_blocks.png",
        title="document_causal over 2,048 packed tokens, blocks of 128",
    )
    print(f"wrote {len(examples) + 2} pictures to {out}")


if __name__ == "__main__":
    main()
