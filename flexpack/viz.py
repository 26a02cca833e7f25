"""PNG pictures of masks: a BlockMask's block structure, and the element mask of a small example.

Needs matplotlib (the ``viz`` extra: ``pip install -e '.[viz]'`` in a checkout), imported only
when a function here is called. Figures are drawn on matplotlib's ``Figure`` directly (Agg
canvas), so nothing here touches the pyplot state or the user's backend.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexpack.testing.references import EMPTY, FULL, PARTIAL, block_states, dense_mask

__all__ = ["plot_block_mask", "plot_mask"]

# Colours shared by both pictures: masked / skipped is light, allowed / full is dark.
_EMPTY_COLOUR = "#f2f2f2"
_PARTIAL_COLOUR = "#f4a259"
_FULL_COLOUR = "#2b59c3"
_PADDING_COLOUR = "#ffffff"


def _figure(**kwargs: Any) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(
            "flexpack.viz needs matplotlib, which is not installed; install the viz extra: "
            "pip install matplotlib (or pip install -e '.[viz]' in a flexpack checkout)."
        ) from err
    return Figure(**kwargs)


def _check_index(name: str, value: int, size: int) -> None:
    if not isinstance(value, int) or not 0 <= value < size:
        raise ValueError(f"{name} must be an int in 0..{size - 1}, got {value!r}.")


def _save(fig: Any, path: str | os.PathLike) -> Path:
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"path must end in .png, got {str(path)!r}.")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=fig.dpi, bbox_inches="tight")
    return path


def plot_block_mask(
    block_mask: BlockMask,
    path: str | os.PathLike,
    *,
    batch: int = 0,
    head: int = 0,
    title: str | None = None,
) -> Path:
    """Save a picture of a BlockMask's block structure: skipped, partial and full blocks.

    Args:
        block_mask: torch ``BlockMask`` of shape (B, H, Q_LEN, KV_LEN).
        path: output file, ending in ``.png`` (parent folders are created).
        batch, head: which (batch, head) slice to draw.
        title: figure title; defaults to the shape, block size and counts of each state.

    Returns:
        The path written, as a ``pathlib.Path``.

    Raises:
        ImportError: matplotlib is missing (install the ``viz`` extra).
        TypeError: block_mask is not a BlockMask.
        ValueError: batch/head out of range, or a path not ending in .png.

    Example:
        >>> import tempfile, pathlib
        >>> from torch.nn.attention.flex_attention import create_block_mask
        >>> causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
        >>> bm = create_block_mask(causal, 1, 1, 300, 300, device="cpu", BLOCK_SIZE=64)
        >>> out = plot_block_mask(bm, pathlib.Path(tempfile.mkdtemp()) / "causal.png")
        >>> out.read_bytes()[:4]
        b'\\x89PNG'
    """
    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            f"plot_block_mask expected a BlockMask, got {type(block_mask).__name__}; for a "
            "flexpack Mask call mask.block_mask() first, or use plot_mask for the element mask."
        )
    states = block_states(block_mask)
    _check_index("batch", batch, states.shape[0])
    _check_index("head", head, states.shape[1])
    grid = states[batch, head].cpu()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    nq, nkv = grid.shape
    side = min(8.0, max(3.0, 0.25 * max(nq, nkv)))
    fig = _figure(figsize=(side + 2.2, side), dpi=100)
    ax = fig.add_subplot()
    cmap = ListedColormap([_EMPTY_COLOUR, _PARTIAL_COLOUR, _FULL_COLOUR])
    ax.imshow(grid.numpy(), cmap=cmap, vmin=0, vmax=2, interpolation="nearest")
    if max(nq, nkv) <= 48:  # block edges, when they are few enough to see
        ax.set_xticks([x - 0.5 for x in range(1, nkv)], minor=True)
        ax.set_yticks([y - 0.5 for y in range(1, nq)], minor=True)
        ax.grid(which="minor", color="white", linewidth=1)
        ax.tick_params(which="minor", length=0)
    counts = {s: int((grid == s).sum()) for s in (EMPTY, PARTIAL, FULL)}
    ax.legend(
        handles=[
            Patch(color=_EMPTY_COLOUR, label=f"skipped ({counts[EMPTY]})"),
            Patch(color=_PARTIAL_COLOUR, label=f"partial: mask_mod ({counts[PARTIAL]})"),
            Patch(color=_FULL_COLOUR, label=f"full ({counts[FULL]})"),
        ],
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
        frameon=False,
    )
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("kv block")
    ax.set_ylabel("q block")
    bq, bkv = block_mask.BLOCK_SIZE
    Q, KV = block_mask.seq_lengths
    ax.set_title(
        title
        if title is not None
        else f"BlockMask b={batch} h={head}: {Q}x{KV} tokens, blocks of {bq}x{bkv}",
        fontsize=10,
    )
    return _save(fig, path)


def _doc_strip_colours(doc_row: Tensor) -> Any:
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import to_rgba

    palette = colormaps["tab10"]
    ids = doc_row.cpu().to(torch.int64)
    # Colour by order of first appearance, so ids 5 and 500 look as distinct as 0 and 1.
    uniq = {}
    for value in ids.tolist():
        if value >= 0 and value not in uniq:
            uniq[value] = len(uniq)
    rgba = np.array([to_rgba(_PADDING_COLOUR)] * len(ids))
    for i, value in enumerate(ids.tolist()):
        if value >= 0:
            rgba[i] = palette(uniq[value] % 10)
    return rgba


def plot_mask(
    mask_or_dense: object,
    path: str | os.PathLike,
    *,
    batch: int = 0,
    head: int = 0,
    Q_LEN: int | None = None,
    KV_LEN: int | None = None,
    doc_ids: Tensor | None = None,
    block_size: int | None = None,
    title: str | None = None,
) -> Path:
    """Save a picture of an element mask: which query (row) attends which key (column).

    Meant for small examples (a few hundred tokens): the mask is evaluated densely with
    :func:`flexpack.testing.dense_mask`.

    Args:
        mask_or_dense: a flexpack ``Mask``, a mask_mod callable, a ``BlockMask`` (its effective
            element mask), or a bool tensor (Q_LEN, KV_LEN) or (B, H, Q_LEN, KV_LEN).
        path: output file, ending in ``.png`` (parent folders are created).
        batch, head: which (batch, head) slice to draw.
        Q_LEN, KV_LEN: grid size for a plain mask_mod (Masks with doc_ids know theirs).
        doc_ids: (S,) or (B, S) doc ids drawn as coloured strips along both axes (padding
            white); defaults to the Mask's own doc_ids.
        block_size: draw block edges every ``block_size`` tokens (default: the BlockMask's,
            none otherwise).
        title: figure title; defaults to the mask's name and the share of allowed pairs.

    Returns:
        The path written, as a ``pathlib.Path``.

    Raises:
        ImportError: matplotlib is missing (install the ``viz`` extra).
        TypeError, ValueError: inputs :func:`~flexpack.testing.dense_mask` rejects, a non-bool
            or wrongly shaped tensor, batch/head out of range, or a path not ending in .png.

    Example:
        >>> import tempfile, pathlib
        >>> causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
        >>> out = plot_mask(causal, pathlib.Path(tempfile.mkdtemp()) / "m.png", Q_LEN=8, KV_LEN=8)
        >>> out.read_bytes()[:4]
        b'\\x89PNG'
    """
    if isinstance(mask_or_dense, Tensor):
        dense = mask_or_dense
        if dense.dtype != torch.bool:
            raise TypeError(f"plot_mask expected a bool tensor, got {dense.dtype}.")
        if dense.dim() == 2:
            dense = dense[None, None]
        if dense.dim() != 4:
            raise ValueError(
                "plot_mask expected a tensor of shape (Q_LEN, KV_LEN) or (B, H, Q_LEN, KV_LEN), "
                f"got {tuple(mask_or_dense.shape)}."
            )
        name = "mask"
    else:
        dense = dense_mask(mask_or_dense, None, None, Q_LEN, KV_LEN)
        mod = getattr(mask_or_dense, "mask_mod", mask_or_dense)
        name = getattr(mod, "__name__", type(mask_or_dense).__name__)
        if doc_ids is None:
            doc_ids = getattr(mask_or_dense, "doc_ids", None)
        if block_size is None and isinstance(mask_or_dense, BlockMask):
            block_size = mask_or_dense.BLOCK_SIZE[0]
    _check_index("batch", batch, dense.shape[0])
    _check_index("head", head, dense.shape[1])
    grid = dense[batch, head].cpu()
    Q, KV = grid.shape

    from matplotlib.colors import ListedColormap

    side = min(7.0, max(3.0, 0.2 * max(Q, KV)))
    fig = _figure(figsize=(side, side), dpi=100)
    if doc_ids is not None:
        rows = doc_ids if doc_ids.dim() == 2 else doc_ids[None]
        row = rows[min(batch, rows.shape[0] - 1)]
        if row.shape[0] != KV or Q != KV:
            raise ValueError(
                f"plot_mask got doc_ids of length {row.shape[0]} for a {Q}x{KV} mask; the doc "
                "strip needs a square mask over the same tokens."
            )
        gs = fig.add_gridspec(
            2, 2, width_ratios=[1, 24], height_ratios=[1, 24], wspace=0.02, hspace=0.02
        )
        ax = fig.add_subplot(gs[1, 1])
        top, left = fig.add_subplot(gs[0, 1], sharex=ax), fig.add_subplot(gs[1, 0], sharey=ax)
        colours = _doc_strip_colours(row)
        top.imshow(colours[None], aspect="auto", interpolation="nearest")
        left.imshow(colours[:, None], aspect="auto", interpolation="nearest")
        # tick_params, not set_xticks([]): the strips share their axis with the mask.
        top.tick_params(bottom=False, labelbottom=False, left=False, labelleft=False)
        left.tick_params(bottom=False, labelbottom=False)
        top.set_title(title if title is not None else _default_title(name, grid), fontsize=10)
    else:
        ax = fig.add_subplot()
        ax.set_title(title if title is not None else _default_title(name, grid), fontsize=10)
    ax.imshow(
        grid.numpy(),
        cmap=ListedColormap([_EMPTY_COLOUR, _FULL_COLOUR]),
        vmin=0,
        vmax=1,
        interpolation="nearest",
        aspect="auto" if doc_ids is not None else "equal",
    )
    if block_size is not None:
        for edge in range(block_size, max(Q, KV), block_size):
            if edge < KV:
                ax.axvline(edge - 0.5, color=_PARTIAL_COLOUR, linewidth=1)
            if edge < Q:
                ax.axhline(edge - 0.5, color=_PARTIAL_COLOUR, linewidth=1)
    ax.set_xlabel("key (kv_idx)")
    if doc_ids is None:
        ax.set_ylabel("query (q_idx)")
    else:
        ax.tick_params(labelleft=False)
        fig.axes[2].set_ylabel("query (q_idx)")
    return _save(fig, path)


def _default_title(name: str, grid: Tensor) -> str:
    share = 100.0 * float(grid.float().mean()) if grid.numel() else 0.0
    return f"{name}: {share:.0f}% of (q, kv) pairs allowed"
