"""Hypothesis strategies for packed layouts and composed masks.

Public API for users who property-test their own masks or kernels against flexpack's dense
references. Every strategy takes keyword-only bounds and draws the edge cases that break mask
code on purpose: padding (including whole padding rows on request), B > 1, one-token documents,
one document filling the row, and a sequence length that is not a multiple of the block size.

Requires ``hypothesis`` (the ``test`` extra).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

try:
    from hypothesis import strategies as st
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "flexpack.testing.strategies needs hypothesis: pip install hypothesis (or "
        "pip install -e '.[test]' in a flexpack checkout)."
    ) from err

__all__ = ["doc_ids", "forests", "masks", "prefix_lengths", "seqlens"]

# Row shapes drawn on purpose; "random" cuts the row at random points.
_ROW_STYLES = ("random", "random", "one_doc", "single_tokens")


def _check_bound(name: str, value: object, low: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}.")


@st.composite
def _row_seqlens(
    draw: st.DrawFn,
    seq_len: int,
    *,
    max_docs: int | None,
    allow_padding: bool,
    allow_empty_rows: bool,
) -> list[int]:
    """Document lengths of one row of ``seq_len`` tokens (sum <= seq_len)."""
    styles = list(_ROW_STYLES) + (["empty"] if allow_empty_rows else [])
    style = draw(st.sampled_from(styles))
    if style == "empty":
        return []
    pad = 0
    if allow_padding and seq_len > 1:
        # Half of the rows are padded; small pads are the common case, a mostly padded row
        # the rare one.
        pad = draw(st.one_of(st.just(0), st.integers(1, seq_len - 1)))
    used = seq_len - pad
    cap = used if max_docs is None else min(used, max_docs)
    if style == "one_doc" or cap == 1:
        return [used]
    if style == "single_tokens":
        n = cap
        return [1] * (n - 1) + [used - (n - 1)]
    n = draw(st.integers(1, cap))
    cuts = draw(
        st.lists(st.integers(1, used - 1), min_size=n - 1, max_size=n - 1, unique=True).map(sorted)
    )
    bounds = [0, *cuts, used]
    return [b - a for a, b in itertools.pairwise(bounds)]


@st.composite
def seqlens(
    draw: st.DrawFn,
    *,
    max_len: int = 300,
    batch_size: int | None = None,
    max_batch_size: int = 3,
    max_docs: int | None = None,
    allow_padding: bool = True,
    allow_empty_rows: bool = False,
) -> list[list[int]]:
    """Per-row document lengths of a packed batch, as ``PackedLayout.from_seqlens`` takes them.

    Args:
        max_len: tokens per row; each row's lengths sum to at most ``max_len`` (exactly
            ``max_len`` without padding).
        batch_size: number of rows; ``None`` draws it from 1..``max_batch_size``.
        max_batch_size: upper bound when ``batch_size`` is None.
        max_docs: at most this many documents per row (None: up to one per token).
        allow_padding: rows may end in padding.
        allow_empty_rows: rows may hold no document at all (all padding).

    Returns:
        A strategy for ``list[list[int]]``: one list of positive lengths per row.

    Example:
        >>> from hypothesis import find
        >>> rows = find(seqlens(max_len=8, batch_size=2), lambda rows: len(rows[0]) > 1)
        >>> len(rows), all(0 < sum(r) <= 8 for r in rows)
        (2, True)
    """
    _check_bound("max_len", max_len)
    _check_bound("max_batch_size", max_batch_size)
    if batch_size is not None:
        _check_bound("batch_size", batch_size)
    if max_docs is not None:
        _check_bound("max_docs", max_docs)
    B = batch_size if batch_size is not None else draw(st.integers(1, max_batch_size))
    row = _row_seqlens(
        max_len, max_docs=max_docs, allow_padding=allow_padding, allow_empty_rows=allow_empty_rows
    )
    return [draw(row) for _ in range(B)]


def _seq_len_strategy(min_seq_len: int, max_seq_len: int, block_size: int) -> st.SearchStrategy:
    # Lengths around multiples of the block size, where block-boundary bugs live, besides
    # uniform ones.
    near = sorted(
        {
            m + d
            for m in range(block_size, max_seq_len + 2, block_size)
            for d in (-1, 0, 1)
            if min_seq_len <= m + d <= max_seq_len
        }
        | {min_seq_len, max_seq_len}
    )
    return st.one_of(st.integers(min_seq_len, max_seq_len), st.sampled_from(near))


@st.composite
def doc_ids(
    draw: st.DrawFn,
    *,
    batch_size: int | None = None,
    max_batch_size: int = 3,
    seq_len: int | None = None,
    min_seq_len: int = 1,
    max_seq_len: int = 300,
    max_docs: int | None = None,
    allow_padding: bool = True,
    allow_empty_rows: bool = False,
    contiguous: bool = True,
    block_size: int = 128,
    dtype: torch.dtype = torch.int32,
) -> Tensor:
    """Document ids of a packed batch: ``(B, S)`` ints, ``-1`` (or any negative) for padding.

    With ``contiguous=True`` each row is what the packer emits: ids 0..n-1 in order, then
    padding at the end. With ``contiguous=False`` ids are arbitrary: out of order, of any size,
    adjacent runs of one id (one document), padding anywhere (any negative value); but each id
    one run of its row, as every flexpack entry point requires (``[0, 0, 1, 0]`` is refused:
    ``flexpack.PackedLayout.from_runs`` numbers such runs).

    Args:
        batch_size: number of rows; ``None`` draws it from 1..``max_batch_size``.
        max_batch_size: upper bound when ``batch_size`` is None.
        seq_len: fixed S (use it for compiled kernels, which compile once per shape); ``None``
            draws S from ``min_seq_len``..``max_seq_len``, often next to a multiple of
            ``block_size``.
        min_seq_len, max_seq_len: bounds on S when ``seq_len`` is None.
        max_docs: at most this many documents per row.
        allow_padding: rows may end in (or, non-contiguous, contain) padding.
        allow_empty_rows: rows may be all padding (every query of the row is fully masked).
        contiguous: ids 0..n-1 in order per row (True) or arbitrary ids (False).
        block_size: the block size whose multiples S is drawn around.
        dtype: integer dtype of the result.

    Returns:
        A strategy for a (B, S) tensor of ``dtype`` on CPU.

    Example:
        >>> from hypothesis import find
        >>> d = find(doc_ids(seq_len=4, batch_size=1), lambda d: bool((d < 0).any()))
        >>> d.shape, d.dtype, int(d[0, 0]), int(d[0, -1])
        (torch.Size([1, 4]), torch.int32, 0, -1)
    """
    _check_bound("max_batch_size", max_batch_size)
    _check_bound("min_seq_len", min_seq_len)
    _check_bound("block_size", block_size)
    if batch_size is not None:
        _check_bound("batch_size", batch_size)
    if seq_len is not None:
        _check_bound("seq_len", seq_len)
    elif max_seq_len < min_seq_len:
        raise ValueError(
            f"max_seq_len must be >= min_seq_len, got max_seq_len={max_seq_len}, "
            f"min_seq_len={min_seq_len}."
        )
    if dtype.is_floating_point or dtype == torch.bool or dtype.is_complex:
        raise ValueError(f"doc_ids dtype must be an integer dtype, got {dtype}.")
    # The ids are written as int64 and cast: an id or -1 that dtype cannot hold would wrap.
    if not dtype.is_signed and (allow_padding or allow_empty_rows):
        raise ValueError(
            f"doc_ids dtype {dtype} cannot hold -1 (padding); pass a signed dtype, or "
            f"allow_padding=False and allow_empty_rows=False."
        )
    longest = seq_len if seq_len is not None else max_seq_len
    if longest - 1 > torch.iinfo(dtype).max:
        raise ValueError(
            f"doc_ids dtype {dtype} holds ids up to {torch.iinfo(dtype).max}, but rows of up to "
            f"{longest} tokens need ids up to {longest - 1}; use a wider dtype or shorter rows."
        )
    S = (
        seq_len
        if seq_len is not None
        else draw(_seq_len_strategy(min_seq_len, max_seq_len, block_size))
    )
    rows = draw(
        seqlens(
            max_len=S,
            batch_size=batch_size,
            max_batch_size=max_batch_size,
            max_docs=max_docs,
            allow_padding=allow_padding,
            allow_empty_rows=allow_empty_rows,
        )
    )
    out = torch.full((len(rows), S), -1, dtype=torch.int64)
    for b, lengths in enumerate(rows):
        if not contiguous:
            lengths = _cut_runs(draw, lengths)
            ids = _one_run_each(_arbitrary_ids(draw, len(lengths), allow_padding, dtype))
        else:
            ids = list(range(len(lengths)))
        start = 0
        for doc, length in zip(ids, lengths, strict=True):
            out[b, start : start + length] = doc
            start += length
        if not contiguous and allow_padding and start < S:
            out[b, start:] = draw(st.integers(-3, -1))
    return out.to(dtype)


def _cut_runs(draw: st.DrawFn, lengths: list[int]) -> list[int]:
    # Arbitrary layouts: the same row lengths, further cut so that adjacent runs can carry
    # different ids (or the same id, which is then one document).
    out: list[int] = []
    for length in lengths:
        if length > 1 and draw(st.booleans()):
            cut = draw(st.integers(1, length - 1))
            out += [cut, length - cut]
        else:
            out.append(length)
    return out


def _arbitrary_ids(draw: st.DrawFn, n: int, allow_padding: bool, dtype: torch.dtype) -> list[int]:
    # Small pools make ids repeat in separate runs; the dtype's extremes catch overflow bugs.
    info = torch.iinfo(dtype)
    low = -2 if allow_padding else 0
    extremes = [info.max] + ([info.min] if allow_padding else [])
    pool = st.integers(low, max(1, n // 2 + 1)) | st.sampled_from(extremes)
    return draw(st.lists(pool, min_size=n, max_size=n))


def _one_run_each(ids: list[int]) -> list[int]:
    # An id drawn again after other runs would name two runs of the row, which flexpack refuses:
    # it takes the smallest id not used yet (the same id right after itself extends its run).
    out: list[int] = []
    used: set[int] = set()
    for k, i in enumerate(ids):
        if k and i == ids[k - 1]:
            i = out[-1]
        elif i >= 0 and i in used:
            i = next(j for j in range(len(ids) + 1) if j not in used)
        out.append(i)
        if i >= 0:
            used.add(i)
    return out


def _row_doc_lengths(doc_row: Tensor) -> list[int]:
    """Lengths of documents 0..n-1 of one row of contiguous doc ids."""
    real = doc_row[doc_row >= 0]
    if real.numel() == 0:
        return []
    return torch.bincount(real.to(torch.int64)).tolist()


def _check_contiguous(doc_ids: Tensor) -> None:
    rows = doc_ids if doc_ids.dim() == 2 else doc_ids[None]
    for b, row in enumerate(rows):
        real = row[row >= 0].to(torch.int64)
        n = real.numel()
        if n == 0:
            continue
        steps = real[1:] - real[:-1]
        padded_inside = bool((row[:n] < 0).any())
        if real[0] != 0 or bool(((steps != 0) & (steps != 1)).any()) or padded_inside:
            raise ValueError(
                f"prefix_lengths needs packer-style doc_ids (0..n-1 in order, padding only at "
                f"the row end); row {b} is {row.tolist()}. Draw them with "
                "doc_ids(contiguous=True)."
            )


@st.composite
def prefix_lengths(draw: st.DrawFn, doc_ids: Tensor) -> Tensor:
    """Per-document prefix lengths for ``prefix_lm(doc_ids, prefix_lengths)``.

    Each document of length L gets a prefix length in 0..L (0: plain causal; L: fully
    bidirectional), with those edges drawn often.

    Args:
        doc_ids: (S,) or (B, S) contiguous doc ids (0..n-1 in order per row, padding at the end),
            e.g. drawn by ``doc_ids(contiguous=True)``.

    Returns:
        A strategy for an int64 tensor: (num_docs,) for 1-D doc_ids, (B, max_docs) for 2-D, where
        max_docs is the largest number of documents in a row (0 past a row's documents).

    Raises:
        ValueError: doc_ids not of rank 1 or 2, or not contiguous.

    Example:
        >>> import torch
        >>> from hypothesis import find
        >>> d = torch.tensor([0, 0, 0, 1, -1])
        >>> p = find(prefix_lengths(d), lambda p: int(p[0]) == 3)
        >>> p.shape, int(p[0]), int(p[1]) <= 1
        (torch.Size([2]), 3, True)
    """
    if not isinstance(doc_ids, Tensor) or doc_ids.dim() not in (1, 2):
        got = tuple(doc_ids.shape) if isinstance(doc_ids, Tensor) else type(doc_ids).__name__
        raise ValueError(f"prefix_lengths expected doc_ids of shape (S,) or (B, S), got {got}.")
    _check_contiguous(doc_ids)
    rows = doc_ids if doc_ids.dim() == 2 else doc_ids[None]
    per_row = [_row_doc_lengths(row) for row in rows]
    width = max((len(r) for r in per_row), default=0)
    out = torch.zeros(len(per_row), width, dtype=torch.int64)
    for b, lengths in enumerate(per_row):
        for d, length in enumerate(lengths):
            edges = st.sampled_from(sorted({0, 1, length}))
            out[b, d] = draw(st.one_of(edges, st.integers(0, length)))
    return out if doc_ids.dim() == 2 else out[0]


def _is_contiguous(doc_ids: Tensor) -> bool:
    try:
        _check_contiguous(doc_ids)
    except ValueError:
        return False
    return True


@st.composite
def masks(
    draw: st.DrawFn,
    doc_ids: Tensor,
    *,
    max_depth: int = 2,
    kinds: Sequence[str] | None = None,
    max_window: int | None = None,
) -> object:
    """Random flexpack masks over ``doc_ids``: factories composed with ``&``, ``|`` and ``~``.

    Leaves are drawn from ``causal()``, ``document(doc_ids)``, ``document(doc_ids) & causal()``,
    ``padding(doc_ids)``, ``sliding_window(w)`` and, when doc_ids are contiguous and hold at
    least one document, ``prefix_lm(doc_ids, p)`` with ``p`` drawn by :func:`prefix_lengths`.

    Args:
        doc_ids: (S,) or (B, S) integer doc ids, negative for padding.
        max_depth: nesting depth of ``&`` / ``|`` / ``~`` (0 draws a single factory).
        kinds: restrict the leaves to these factory names (any of "causal", "document",
            "document_causal", "padding", "sliding_window", "prefix_lm").
        max_window: upper bound on sliding windows (default: S).

    Returns:
        A strategy for ``flexpack.masks.Mask``.

    Example:
        >>> import torch
        >>> from hypothesis import find
        >>> d = torch.tensor([[0, 0, 1, -1]])
        >>> find(masks(d, max_depth=0), lambda m: m.kind == "padding").kind
        'padding'
    """
    from flexpack import masks as fm

    if not isinstance(doc_ids, Tensor) or doc_ids.dim() not in (1, 2):
        got = tuple(doc_ids.shape) if isinstance(doc_ids, Tensor) else type(doc_ids).__name__
        raise ValueError(f"masks expected doc_ids of shape (S,) or (B, S), got {got}.")
    S = int(doc_ids.shape[-1])
    all_kinds = ["causal", "document", "document_causal", "padding", "sliding_window"]
    if _is_contiguous(doc_ids) and bool((doc_ids >= 0).any()):
        all_kinds.append("prefix_lm")
    if kinds is not None:
        unknown = set(kinds) - {*all_kinds, "prefix_lm"}
        if unknown:
            raise ValueError(f"masks got unknown kinds {sorted(unknown)}; expected {all_kinds}.")
        if "prefix_lm" in kinds and "prefix_lm" not in all_kinds:
            raise ValueError(
                "masks can only draw prefix_lm over contiguous doc_ids with a document."
            )
        all_kinds = [k for k in all_kinds if k in kinds]
    window_cap = S if max_window is None else max_window

    def leaf() -> object:
        kind = draw(st.sampled_from(all_kinds))
        if kind == "causal":
            return fm.causal()
        if kind == "document":
            return fm.document(doc_ids)
        if kind == "document_causal":
            return fm.document(doc_ids) & fm.causal()
        if kind == "padding":
            return fm.padding(doc_ids)
        if kind == "sliding_window":
            return fm.sliding_window(draw(st.integers(0, window_cap)))
        return fm.prefix_lm(doc_ids, draw(prefix_lengths(doc_ids)))

    def tree(depth: int) -> object:
        op = draw(st.sampled_from(["leaf", "and", "or", "not"])) if depth > 0 else "leaf"
        if op == "leaf":
            return leaf()
        if op == "not":
            return ~tree(depth - 1)
        left, right = tree(depth - 1), tree(depth - 1)
        return left & right if op == "and" else left | right

    return tree(max_depth)


# Tree shapes drawn on purpose; "random" attaches every segment anywhere it may go.
_FOREST_STYLES = ("random", "random", "chain", "star", "flat")


@st.composite
def forests(
    draw: st.DrawFn,
    *,
    batch_size: int | None = None,
    max_batch_size: int = 3,
    seq_len: int | None = None,
    min_seq_len: int = 1,
    max_seq_len: int = 300,
    max_segments: int | None = None,
    allow_padding: bool = True,
    block_size: int = 128,
    dtype: torch.dtype = torch.int32,
) -> tuple[Tensor, Tensor]:
    """Packed rows of prefix trees: ``(segment_ids, parents)`` for ``flexpack.masks.tree``.

    Each row holds segments 0..n-1 in depth-first order (a parent before its children, a whole
    subtree before the next sibling), each a contiguous run, then padding. Rows are drawn as one
    chain (multi-turn), one star (a GRPO group), all roots (ordinary documents) or a random forest.

    Args:
        batch_size: number of rows; ``None`` draws it from 1..``max_batch_size``.
        max_batch_size: upper bound when ``batch_size`` is None.
        seq_len: fixed S; ``None`` draws S from ``min_seq_len``..``max_seq_len``, often next to a
            multiple of ``block_size``.
        min_seq_len, max_seq_len: bounds on S when ``seq_len`` is None.
        max_segments: at most this many segments per row.
        allow_padding: rows may end in padding.
        block_size: the block size whose multiples S is drawn around.
        dtype: integer dtype of ``segment_ids``.

    Returns:
        A strategy for ``(segment_ids, parents)``: (B, S) ``dtype`` segment ids, -1 on padding,
        and (B, max n) int64 parents, -1 for roots and past a row's segments.

    Example:
        >>> from hypothesis import find
        >>> seg, par = find(forests(seq_len=6, batch_size=1), lambda f: int(f[1][0, -1]) > 0)
        >>> seg.shape, par.shape[0], int(par[0, 0])
        (torch.Size([1, 6]), 1, -1)
    """
    seg = draw(
        doc_ids(
            batch_size=batch_size,
            max_batch_size=max_batch_size,
            seq_len=seq_len,
            min_seq_len=min_seq_len,
            max_seq_len=max_seq_len,
            max_docs=max_segments,
            allow_padding=allow_padding,
            block_size=block_size,
            dtype=dtype,
        )
    )
    counts = [int(row.max()) + 1 if bool((row >= 0).any()) else 0 for row in seg]
    parents = torch.full((seg.shape[0], max(1, *counts)), -1, dtype=torch.int64)
    for b, n in enumerate(counts):
        style = draw(st.sampled_from(_FOREST_STYLES))
        path: list[int] = []  # segment n - 1 and its ancestors: where segment n may attach
        for k in range(n):
            if k == 0 or style == "flat":
                p = -1
            elif style == "chain":
                p = k - 1
            elif style == "star":
                p = 0
            else:
                p = draw(st.sampled_from([-1, *path]))
            parents[b, k] = p
            # The rightmost path after adding k: k's ancestors, then k.
            path = [*path[: path.index(p) + 1], k] if p >= 0 else [k]
    return seg, parents
