"""Packing: assign variable-length samples to rows of ``max_len`` tokens.

:func:`pack` looks only at lengths and returns a :class:`PackPlan`; the plan then gathers the
tokens of any rows (:meth:`PackPlan.materialize`) or just their layout (:meth:`PackPlan.layout`).

Strategies:

- ``"bfd"`` best-fit decreasing (default): largest first, each into the open row it fills most.
  O(n log max_len); on real length distributions within a fraction of a percent of the lower
  bound ``ceil(tokens / max_len)``.
- ``"ffd"`` first-fit decreasing: largest first, each into the lowest-numbered row it fits.
- ``"greedy"`` next-fit in the given order: order-preserving and streaming-friendly.
- ``"wrap"`` concat-and-chunk for pretraining: samples are cut at row ends, only the last row
  is padded.

Rows of ``"bfd"`` and ``"ffd"`` come back in a seeded random order: sorted packers otherwise put
all the tiny samples in the same rows, which shifts the loss from batch to batch. ``"greedy"``
and ``"wrap"`` keep the input order.

Fewer than 4,096 samples (or pieces) are packed by numpy; more by compiled kernels (numba,
compiled on their first use after an install and cached on disk). Both make the same plan, and
packing a list of lengths imports neither torch nor numba until a size needs it
(:mod:`flexpack._kernels`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from flexpack._choices import OVERFLOWS, STRATEGIES

if TYPE_CHECKING:
    import torch

    from flexpack._packed_batch import PackedBatch
    from flexpack.layout import PackedLayout

__all__ = ["OVERFLOWS", "STRATEGIES", "DocsPerRow", "PackPlan", "PackStats", "pack"]

_NO_LIMIT = np.iinfo(np.int64).max
_BFD_MAX_LEN = 1 << 24  # bfd's capacity table: 8 bytes per capacity, 128 MiB at this limit


@dataclass(frozen=True)
class DocsPerRow:
    """Summary of the number of documents in each row."""

    min: int
    mean: float
    max: int


@dataclass(frozen=True)
class PackStats:
    """What a packing did with the tokens it was given.

    ``tokens == placed + truncated + dropped`` always holds; the counts are exact Python ints,
    never wrapped (``pack([2**62] * 3, 8, overflow="drop").stats.tokens == 3 * 2**62``).
    ``lower_bound_rows`` is ``ceil(placed / max_len)``: no packer can use fewer rows for the
    tokens it places.
    """

    samples: int
    tokens: int
    placed: int
    truncated: int
    dropped: int
    truncated_samples: int
    dropped_samples: int
    split_samples: int
    rows: int
    max_len: int
    lower_bound_rows: int
    docs_per_row: DocsPerRow
    empty_samples: int = 0  # samples of no tokens: counted in ``samples``, in no row

    @property
    def efficiency(self) -> float:
        """placed / (rows * max_len): the share of the rows that holds tokens (0.0 if no rows)."""
        return self.placed / (self.rows * self.max_len) if self.rows else 0.0

    @property
    def over_lower_bound(self) -> float:
        """rows / lower_bound_rows - 1: 0.0 is optimal."""
        return self.rows / self.lower_bound_rows - 1.0 if self.lower_bound_rows else 0.0


@dataclass(frozen=True, eq=False)
class PackPlan:
    """Which slice of which sample goes where: the result of :func:`pack`.

    Attributes:
        segments: (n_segments, 4) int64, read-only; columns (row, sample, start, stop): tokens
            ``start:stop`` of sample ``sample`` form the next document of row ``row``. Ordered
            by row, then by position in the row (a row's documents in sample order).
        num_rows: R, the number of rows.
        max_len: S, tokens per row.
        lengths: (n_samples,) int64, read-only: the sample lengths the plan was made for.
        strategy: the strategy that made it.
        stats: :class:`PackStats`.

    Example:
        >>> plan = pack([3, 5, 2, 4], max_len=8, seed=None)
        >>> plan.num_rows, plan.efficiency
        (2, 0.875)
        >>> plan.segments.tolist()
        [[0, 0, 0, 3], [0, 1, 0, 5], [1, 2, 0, 2], [1, 3, 0, 4]]
    """

    segments: np.ndarray
    num_rows: int
    max_len: int
    lengths: np.ndarray
    strategy: str
    stats: PackStats

    @property
    def efficiency(self) -> float:
        """Placed tokens / (num_rows * max_len); 0.0 for an empty plan."""
        return self.stats.efficiency

    def __len__(self) -> int:
        return self.num_rows

    def __repr__(self) -> str:
        s = self.stats
        return (
            f"PackPlan(strategy={self.strategy!r}, samples={s.samples}, rows={self.num_rows}, "
            f"max_len={self.max_len}, efficiency={self.efficiency:.4f}, "
            f"lower_bound_rows={s.lower_bound_rows})"
        )

    @cached_property
    def row_offsets(self) -> np.ndarray:
        """(num_rows + 1,) int64: row r is ``segments[row_offsets[r]:row_offsets[r + 1]]``."""
        counts = np.bincount(self.segments[:, 0], minlength=self.num_rows)
        offsets = np.zeros(self.num_rows + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        offsets.setflags(write=False)
        return offsets

    def row_lengths(self) -> np.ndarray:
        """(num_rows,) int64: tokens in each row.

        Example:
            >>> pack([3, 5, 2, 4], max_len=8, seed=None).row_lengths()
            array([8, 6])
        """
        seg = self.segments
        return np.bincount(
            seg[:, 0], weights=seg[:, 3] - seg[:, 2], minlength=self.num_rows
        ).astype(np.int64)

    def _select(self, rows: Any) -> tuple[np.ndarray, np.ndarray]:
        """Segments of the chosen rows renumbered 0..k-1 in the order given, and docs per row."""
        if rows is None:
            seg = self.segments
            return seg, np.diff(self.row_offsets)
        if isinstance(rows, slice):
            idx = np.arange(self.num_rows)[rows]
        else:
            if _is_tensor(rows):
                rows = rows.cpu().numpy()
            idx = np.asarray(rows)
            if idx.ndim == 0:
                idx = idx[None]
            if idx.size == 0:
                idx = idx.astype(np.int64)
            if idx.dtype.kind not in "iu" or idx.ndim != 1:
                raise TypeError(
                    f"rows must be None, a slice or a 1-D sequence of row indices; got {rows!r}"
                )
            if idx.size and (idx.min() < 0 or idx.max() >= self.num_rows):
                raise ValueError(
                    f"rows must lie in [0, {self.num_rows}); got min {idx.min()}, max {idx.max()}"
                )
        idx = idx.astype(np.int64)
        off = self.row_offsets
        first, counts = off[idx], off[idx + 1] - off[idx]
        total = int(counts.sum())
        take = np.repeat(first - (np.cumsum(counts) - counts), counts) + np.arange(total)
        seg = self.segments[take].copy()
        seg[:, 0] = np.repeat(np.arange(idx.size, dtype=np.int64), counts)
        return seg, counts

    def layout(self, rows: Sequence[int] | slice | None = None) -> PackedLayout:
        """The :class:`PackedLayout` of the chosen rows (default all), without any tokens.

        Example:
            >>> pack([3, 5, 2, 4], max_len=8, seed=None).layout([1]).doc_ids
            tensor([[ 0,  0,  1,  1,  1,  1, -1, -1]], dtype=torch.int32)
        """
        from flexpack import _kernels
        from flexpack.layout import PackedLayout

        seg, num_docs = self._select(rows)
        empty = np.zeros(0, dtype=np.int64)
        _, _, doc_ids, position_ids, indices = _kernels.assemble_rows(
            seg, num_docs, self.max_len, empty, empty, empty, 0, False
        )
        return PackedLayout._from_parts(
            doc_ids, position_ids, seg[:, 3] - seg[:, 2], num_docs, indices, self.max_len
        )

    def materialize(
        self,
        sequences: Sequence[Any],
        rows: Sequence[int] | slice | None = None,
        *,
        pad_id: int = 0,
    ) -> PackedBatch:
        """Gather the tokens of the chosen rows (default all) into a :class:`PackedBatch`.

        Args:
            sequences: the samples the plan was made for, indexable by sample number: token
                sequences (lists, numpy arrays, 1-D tensors) or dicts with ``"input_ids"`` and
                optional ``"labels"`` (e.g. -100 on prompt tokens; kept as given).
            rows: which rows, in which order (indices, a slice or None for all).
            pad_id: token id written on padding.

        Raises:
            ValueError: a sequence's length differs from the one the plan was made for, or a
                token id or ``pad_id`` does not fit int64.
            TypeError: a sample is not a 1-D sequence of integer token ids (the error names the
                sample and the element), or ``pad_id`` is not an int.

        Example:
            >>> seqs = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14]]
            >>> batch = pack([len(s) for s in seqs], max_len=8, seed=None).materialize(seqs)
            >>> batch.input_ids
            tensor([[ 1,  2,  3,  4,  5,  6,  7,  8],
                    [ 9, 10, 11, 12, 13, 14,  0,  0]])
            >>> batch.labels
            tensor([[-100,    2,    3, -100,    5,    6,    7,    8],
                    [-100,   10, -100,   12,   13,   14, -100, -100]])
        """
        from flexpack._packed_batch import _materialize

        seg, num_docs = self._select(rows)
        return _materialize(seg, num_docs, self.max_len, self.lengths, sequences, pad_id=pad_id)


def _is_tensor(x: Any) -> bool:
    """``isinstance(x, torch.Tensor)`` without importing torch: packing plain lists and arrays
    never loads it (seconds on a busy machine), and a tensor means torch is loaded already."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _as_lengths(lengths: Any) -> np.ndarray:
    if _is_tensor(lengths):
        lengths = lengths.detach().cpu().numpy()
    try:
        arr = np.asarray(lengths)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"lengths must be a 1-D array-like of non-negative ints; got {type(lengths).__name__}"
            f" ({e})"
        ) from None
    if arr.size == 0:
        arr = arr.astype(np.int64).reshape(-1)
    # Python ints past int64 make numpy pick float64 ([3, 2**63]) or object ([3, 2**64]).
    big = None
    if arr.dtype.kind in "fO" and arr.ndim == 1 and all(type(x) is int for x in lengths):
        big = next((j for j, x in enumerate(lengths) if not -(2**63) <= x < 2**63), None)
    if big is not None:
        raise ValueError(
            f"lengths[{big}] = {lengths[big]} does not fit int64: lengths are tokens per sample; "
            "pass e.g. [len(s) for s in samples]."
        )
    if arr.dtype.kind not in "iu":
        raise TypeError(
            f"lengths must be integers (tokens per sample); got dtype {arr.dtype} "
            f"(first values {arr.reshape(-1)[:3].tolist()}). Pass e.g. [len(s) for s in samples]."
        )
    if arr.ndim != 1:
        raise ValueError(
            f"lengths must be 1-D (one length per sample); got shape {arr.shape}. Flatten it."
        )
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > _NO_LIMIT:
        bad = int(np.argmax(arr > _NO_LIMIT))
        raise ValueError(
            f"lengths[{bad}] = {int(arr[bad])} does not fit int64: lengths are tokens per "
            "sample; pass e.g. [len(s) for s in samples]."
        )
    arr = arr.astype(np.int64)  # a copy: the plan keeps it read-only
    if arr.size and arr.min() < 0:
        bad = int(np.argmax(arr < 0))
        raise ValueError(
            f"lengths must be >= 0; got {int(arr[bad])} at index {bad} "
            f"({int((arr < 0).sum())} negative in all)"
        )
    return arr


def _exact_sum(a: np.ndarray) -> int:
    """Sum of non-negative int64 ``a`` as a Python int: never wraps (int64 sums can)."""
    if a.size == 0:
        return 0
    if int(a.max()) <= _NO_LIMIT // a.size:  # cannot overflow: one fast numpy sum
        return int(a.sum())
    return sum(a.tolist())


def _check_int(value: Any, name: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int >= {minimum}; got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")
    return int(value)


def pack(
    lengths: Sequence[int] | np.ndarray | torch.Tensor,
    max_len: int,
    *,
    strategy: str = "bfd",
    overflow: str = "error",
    seed: int | None = 0,
    max_docs_per_row: int | None = None,
) -> PackPlan:
    """Assign samples of the given lengths to rows of ``max_len`` tokens.

    Args:
        lengths: (n,) non-negative ints, tokens per sample. Empty samples are counted, not placed.
        max_len: tokens per row, >= 1.
        strategy: ``"bfd"`` (best-fit decreasing), ``"ffd"`` (first-fit decreasing),
            ``"greedy"`` (next-fit in order) or ``"wrap"`` (concat-and-chunk).
        overflow: what to do with samples longer than ``max_len``: ``"error"``, ``"split"``
            (``max_len`` pieces, each its own document), ``"truncate"`` (keep the first
            ``max_len`` tokens) or ``"drop"``. ``"wrap"`` cuts samples at row ends by design, so
            ``"error"`` and ``"split"`` change nothing there; ``"truncate"``/``"drop"`` still apply.
        seed: shuffles the rows of ``"bfd"``/``"ffd"`` (same lengths and seed, same plan);
            ``None`` keeps the packer's order. ``"greedy"``/``"wrap"`` always keep input order.
        max_docs_per_row: a row stops accepting samples once it holds this many documents.

    Returns:
        A :class:`PackPlan`.

    Raises:
        TypeError: non-integer lengths or max_len.
        ValueError: negative lengths or seed, lengths past int64, ``max_len < 1``, unknown
            strategy or overflow, or ``overflow="error"`` with samples longer than ``max_len``.

    Example:
        >>> plan = pack([3, 5, 2, 4, 7], max_len=8)
        >>> plan.num_rows, plan.stats.lower_bound_rows, round(plan.efficiency, 3)
        (3, 3, 0.875)
        >>> pack([10, 3], max_len=4, overflow="split", strategy="greedy").segments.tolist()
        [[0, 0, 0, 4], [1, 0, 4, 8], [2, 0, 8, 10], [3, 1, 0, 3]]
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if overflow not in OVERFLOWS:
        raise ValueError(f"unknown overflow {overflow!r}; choose one of {', '.join(OVERFLOWS)}")
    max_len = _check_int(max_len, "max_len", minimum=1)
    max_docs = (
        _NO_LIMIT
        if max_docs_per_row is None
        else _check_int(max_docs_per_row, "max_docs_per_row", minimum=1)
    )
    if seed is not None and not isinstance(seed, int | np.integer):
        raise TypeError(f"seed must be an int or None; got {seed!r}")
    if seed is not None and seed < 0:  # numpy's Generator refuses it with a bare message
        raise ValueError(f"seed must be >= 0; got {seed}. Pass a non-negative int or None.")
    if strategy == "bfd" and max_len > _BFD_MAX_LEN:
        raise ValueError(
            f"strategy='bfd' keeps a table over every free capacity 0..max_len, too large for "
            f"max_len={max_len} (limit {_BFD_MAX_LEN}); use strategy='ffd' (memory O(samples))"
        )
    lengths = _as_lengths(lengths)
    n = lengths.shape[0]
    tokens = _exact_sum(lengths)

    long = lengths > max_len
    n_long = int(long.sum()) if n else 0
    if n_long and overflow == "error" and strategy != "wrap":
        first = int(np.argmax(long))
        raise ValueError(
            f"{n_long} of {n} samples are longer than max_len={max_len} (longest "
            f"{int(lengths.max())} tokens, first at index {first}). Pass overflow='split' "
            "(cut them into max_len pieces, each its own document), 'truncate' (keep the first "
            "max_len tokens) or 'drop' (leave them out), or raise max_len."
        )
    truncated = _exact_sum(lengths[long] - max_len) if overflow == "truncate" else 0
    dropped = _exact_sum(lengths[long]) if overflow == "drop" else 0

    from flexpack import _kernels as K

    if strategy == "wrap":
        if overflow == "truncate":
            eff = np.minimum(lengths, max_len)
        elif overflow == "drop":
            eff = np.where(long, 0, lengths)
        else:
            eff = lengths
        segments, num_rows = K.wrap(eff, max_len, max_docs)
    else:
        mode = {"truncate": K.TRUNCATE, "drop": K.DROP}.get(overflow, K.SPLIT)
        sample, start, stop = K.make_pieces(lengths, max_len, mode)
        sizes = stop - start
        packer = {
            "bfd": K.best_fit_decreasing,
            "ffd": K.first_fit_decreasing,
            "greedy": K.next_fit,
        }[strategy]
        row_of, num_rows = packer(sizes, max_len, max_docs)
        num_rows = int(num_rows)
        if strategy in ("bfd", "ffd") and seed is not None and num_rows > 1:
            new_row = np.random.default_rng(seed).permutation(num_rows)
        else:
            new_row = np.zeros(0, dtype=np.int64)
        segments, docs = K.emit_segments(row_of, new_row, num_rows, sample, start, stop)

    num_rows = int(num_rows)
    placed = tokens - truncated - dropped
    if strategy == "wrap":
        docs = np.bincount(segments[:, 0], minlength=num_rows)
    stats = PackStats(
        samples=n,
        tokens=tokens,
        placed=placed,
        truncated=truncated,
        dropped=dropped,
        truncated_samples=n_long if overflow == "truncate" else 0,
        dropped_samples=n_long if overflow == "drop" else 0,
        split_samples=n_long
        if overflow == "split" or (strategy, overflow) == ("wrap", "error")
        else 0,
        rows=num_rows,
        max_len=max_len,
        lower_bound_rows=-(-placed // max_len),  # exact ceil, no float rounding
        empty_samples=int((lengths == 0).sum()) if n else 0,
        docs_per_row=DocsPerRow(
            min=int(docs.min()) if num_rows else 0,
            mean=float(segments.shape[0] / num_rows) if num_rows else 0.0,
            max=int(docs.max()) if num_rows else 0,
        ),
    )
    segments.setflags(write=False)
    lengths.setflags(write=False)
    plan = PackPlan(segments, num_rows, max_len, lengths, strategy, stats)
    offsets = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(docs, out=offsets[1:])
    offsets.setflags(write=False)
    plan.__dict__["row_offsets"] = offsets  # fills the cached_property: no second pass
    return plan
