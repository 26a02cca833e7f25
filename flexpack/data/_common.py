"""Shared pieces of the data pipeline: token sources and argument checks.

A *source* wraps whatever holds the token sequences (a list, a numpy object array, an Arrow list
column, a Hugging Face ``datasets.Dataset`` column) behind three operations: ``len``, ``lengths()``
(all sequence lengths at once, cheaply: Arrow list offsets rather than one Python call per row) and
``take_items(indices)`` (a few samples as ``PackPlan.materialize`` reads them: token arrays, or
dicts with ``input_ids`` and ``labels``).
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from flexpack.layout import _as_int64_ids

_TOKEN_KINDS = "iu"


# What to pass for each positive-int argument, said in its error (4096 fits max_len, not ranks).
_POSITIVE_HINTS = {
    "max_len": "pass the row length in tokens, e.g. max_len=4096",
    "world_size": "pass the number of ranks, e.g. world_size=torch.distributed.get_world_size()",
    "num_replicas": "pass the number of ranks, e.g. "
    "num_replicas=torch.distributed.get_world_size()",
}


def check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        hint = _POSITIVE_HINTS.get(name, f"pass an int >= 1 for {name}")
        raise ValueError(f"{name} must be a positive int, got {value!r}; {hint}.")
    return int(value)


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}.")
    return value


def as_tokens(sample: Any, where: str) -> np.ndarray:
    """One sample as a 1-D integer numpy array, or a TypeError that names the sample."""
    if isinstance(sample, (str, bytes)) or isinstance(sample, Mapping) or np.isscalar(sample):
        raise TypeError(
            f"{where} is a {type(sample).__name__} ({sample!r:.60}), expected a sequence of token "
            "ids (list of int, 1-D integer numpy array or tensor); tokenize the text first, or "
            "pass column=... when samples are dicts."
        )
    if hasattr(sample, "detach"):  # torch.Tensor
        sample = sample.detach().cpu().numpy()
    arr = np.asarray(sample)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in _TOKEN_KINDS):
        raise TypeError(
            f"{where} has shape {arr.shape} and dtype {arr.dtype}, expected a 1-D sequence of "
            "integer token ids; tokenize the samples first."
        )
    return _as_int64_ids(arr, where)


def _is_arrow(obj: Any) -> bool:
    mod = type(obj).__module__
    return mod.startswith("pyarrow") and (hasattr(obj, "type") or hasattr(obj, "column_names"))


def _is_hf_dataset(obj: Any) -> bool:
    return type(obj).__module__.startswith("datasets") and hasattr(obj, "column_names")


class SequenceSource:
    """Any indexable of token sequences: list, tuple, numpy object or 2-D int array, tensor list;
    or of dicts holding them under ``column`` (default ``"input_ids"``), with per-token labels
    under ``labels_column`` when a dict has that key."""

    def __init__(
        self, samples: Any, column: str | None = None, labels_column: str | None = None
    ) -> None:
        if isinstance(samples, (str, bytes, Mapping)) or not hasattr(samples, "__getitem__"):
            raise TypeError(
                f"samples is a {type(samples).__name__}, expected an indexable of token sequences "
                "(list of lists, numpy object array, datasets.Dataset with column=..., Arrow list "
                "column); for a generator use PackedIterableDataset."
            )
        self.samples = samples
        self.column = column
        self.labels_column = labels_column

    def __len__(self) -> int:
        return len(self.samples)

    def _ids_and_labels(self, x: Any, i: int) -> tuple[Any, Any]:
        if not isinstance(x, Mapping):
            if self.column is not None:
                raise TypeError(
                    f"samples[{i}] is a {type(x).__name__}, but column={self.column!r} selects a "
                    "key of dict samples; drop column=... for plain token sequences."
                )
            return x, None
        key = self.column or "input_ids"
        if key not in x:
            raise ValueError(
                f"samples[{i}] is a dict with keys {sorted(x)[:8]}, without {key!r}; pass "
                "column=<key of the token ids> (and labels_column=<key of the labels>)."
            )
        lab = x.get(self.labels_column) if self.labels_column is not None else None
        return x[key], lab

    def lengths(self) -> np.ndarray:
        s = self.samples
        if isinstance(s, np.ndarray) and s.dtype != object:
            if s.ndim != 2 or s.dtype.kind not in _TOKEN_KINDS:
                raise TypeError(
                    f"samples is a numpy array of shape {s.shape} and dtype {s.dtype}, expected a "
                    "2-D integer array (N, L) or a 1-D object array of token sequences."
                )
            return np.full(len(s), s.shape[1], dtype=np.int64)
        out = np.empty(len(s), dtype=np.int64)
        for i in range(len(s)):
            x, lab = self._ids_and_labels(s[i], i)
            if isinstance(x, (str, bytes)) or not hasattr(x, "__len__"):
                as_tokens(x, f"samples[{i}]")  # raises the TypeError
            if i == 0 or isinstance(x, np.ndarray):
                as_tokens(x, f"samples[{i}]")  # dtype check: first sample and all arrays
            out[i] = len(x)
            if lab is not None:
                check_label_length(i, out[i], len(lab), self.labels_column)
        return out

    def take_items(self, indices: np.ndarray) -> list[Any]:
        """Samples ``indices`` as ``PackPlan.materialize`` reads them: token arrays, or dicts with
        ``input_ids`` and ``labels`` where a sample has labels."""
        out: list[Any] = []
        for i in indices:
            i = int(i)
            ids, lab = self._ids_and_labels(self.samples[i], i)
            ids = as_tokens(ids, f"samples[{i}]")
            if lab is None:
                out.append(ids)
            else:
                lab = as_tokens(lab, f"labels of samples[{i}]")
                check_label_length(i, len(ids), len(lab), self.labels_column)
                out.append({"input_ids": ids, "labels": lab})
        return out


def check_label_length(i: int | str, n_ids: int, n_labels: int, labels_column: Any) -> None:
    """ValueError unless a sample has one label per token; ``i`` is its index or a description
    ("stream item 3")."""
    if n_ids != n_labels:
        where = f"sample {i}" if isinstance(i, int) else i
        raise ValueError(
            f"{where} has {n_ids} input_ids but {n_labels} labels; they must have the same "
            f"length (one label per token, -100 where no loss). Fix that sample, or pass "
            f"labels_column=None to ignore the {labels_column!r} labels."
        )


def _first(mask: Any) -> int:
    return int(np.flatnonzero(np.asarray(mask, dtype=bool))[0])


def check_list_chunk(chunk: Any, name: str, base: int = 0, labels: bool = False) -> np.ndarray:
    """(n,) int64 lengths of one Arrow ``list<int>`` array, after checking that no row is null,
    no token is null and no uint64 value exceeds int64 (rows named from ``base``).

    For a labels column (``labels=True``) a null row is allowed, its length -1: the sample has
    no labels and is labelled by its tokens, as a dict sample without the labels key is."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if chunk.null_count and not labels:
        row = base + _first(pc.is_null(chunk))
        raise ValueError(
            f"{name} row {row} is null (no token list); drop or fill null rows first (for a "
            "datasets.Dataset: ds.filter(lambda x: x[<that column>] is not None))."
        )
    values = pc.list_flatten(chunk)
    if values.null_count:
        where = np.asarray(pc.list_parent_indices(chunk))[_first(pc.is_null(values))]
        raise ValueError(
            f"{name} row {base + int(where)} holds a null token (None inside its list); "
            "token ids must all be integers: fix or drop that row."
        )
    if pa.types.is_uint64(values.type) and len(values) and pc.max(values).as_py() >= 2**63:
        row = base + int(
            np.asarray(pc.list_parent_indices(chunk))[
                _first(pc.greater_equal(values, pa.scalar(2**63, pa.uint64())))
            ]
        )
        raise ValueError(
            f"{name} row {row} holds a uint64 token id >= 2**63; flexpack stores token ids as "
            "int64: map the ids below 2**63 first."
        )
    return np.asarray(pc.fill_null(pc.list_value_length(chunk), -1), dtype=np.int64)


def value_range(chunk: Any) -> tuple[int, int]:
    """(min, max) of the values of one Arrow list array; (0, 0) when it has none."""
    import pyarrow.compute as pc

    values = pc.list_flatten(chunk)
    if len(values) == 0:
        return 0, 0
    mm = pc.min_max(values)
    return int(mm["min"].as_py()), int(mm["max"].as_py())


def _chunks(col: Any) -> list[Any]:
    import pyarrow as pa

    return list(col.chunks) if isinstance(col, pa.ChunkedArray) else [col]


def _is_null_type(typ: Any) -> bool:
    """Arrow type ``null``: a column in which every row is null (datasets' type for it)."""
    import pyarrow as pa

    return pa.types.is_null(typ)


def _check_list_type(typ: Any, name: str, labels: bool = False) -> None:
    import pyarrow as pa

    if not (pa.types.is_list(typ) or pa.types.is_large_list(typ)) or not (
        pa.types.is_integer(typ.value_type)
    ):
        if labels:
            raise TypeError(
                f"{name} has Arrow type {typ}, expected list<int> (one label per token); pass "
                "labels_column=None to ignore it, or the name of the per-token labels column."
            )
        if (pa.types.is_list(typ) or pa.types.is_large_list(typ)) and pa.types.is_null(
            typ.value_type
        ):  # [[], [], ...]: Arrow infers list<null> when no sample holds a token
            raise ValueError(
                f"{name} has Arrow type {typ}: every sample is empty (no token in any of them), "
                "so there is nothing to pack; check that tokenization wrote this column."
            )
        raise TypeError(
            f"{name} has Arrow type {typ}, expected list<int> (token ids); tokenize it first."
        )


class ArrowSource:
    """A pyarrow ``list<int>`` Array or ChunkedArray; lengths come from the list offsets.

    ``labels`` is an optional second ``list<int>`` column of the same rows (per-token labels)."""

    def __init__(
        self, column: Any, name: str = "column", labels: Any = None, labels_name: str = "labels"
    ) -> None:
        _check_list_type(column.type, name)
        if labels is not None:
            _check_list_type(labels.type, f"column {labels_name!r}", labels=True)
        self.column = column
        self.name = name
        self.labels = labels
        self.labels_name = labels_name
        self.value_range = (0, 0)  # (min, max) of the token ids (and labels), set by lengths()

    def __len__(self) -> int:
        return len(self.column)

    def lengths(self, scan_values: bool = False) -> np.ndarray:
        """All lengths, checking rows for nulls and labels for their length; with
        ``scan_values`` also records ``value_range`` (a pass over every token)."""
        parts, lo, hi, base = [], 0, 0, 0
        for chunk in _chunks(self.column):
            parts.append(check_list_chunk(chunk, self.name, base))
            a, b = value_range(chunk) if scan_values else (0, 0)
            lo, hi, base = min(lo, a), max(hi, b), base + len(chunk)
        lengths = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if self.labels is not None:
            lab, base = [], 0
            for chunk in _chunks(self.labels):
                name = f"column {self.labels_name!r}"
                lab.append(check_list_chunk(chunk, name, base, labels=True))
                a, b = value_range(chunk) if scan_values else (0, 0)
                lo, hi, base = min(lo, a), max(hi, b), base + len(chunk)
            labels = np.concatenate(lab) if lab else lengths[:0]
            check_labels(lengths, labels, 0, self.labels_name)
        self.value_range = (lo, hi)
        return lengths

    def take(self, indices: np.ndarray) -> list[np.ndarray]:
        return split_list_array(self.column.take(np.asarray(indices, dtype=np.int64)))

    def take_items(self, indices: np.ndarray) -> list[Any]:
        return items_of(self.take(indices), self.labels, indices)


def check_labels(lengths: np.ndarray, label_lengths: np.ndarray, base: int, column: Any) -> None:
    """A length error for the first sample whose labels (length -1: a null row, none) differ."""
    bad = np.flatnonzero((label_lengths >= 0) & (lengths != label_lengths))
    if len(bad):
        i = int(bad[0])
        check_label_length(base + i, int(lengths[i]), int(label_lengths[i]), column)


def items_of(tokens: list[np.ndarray], labels: Any, indices: np.ndarray) -> list[Any]:
    if labels is None:
        return list(tokens)
    return with_labels(tokens, labels.take(np.asarray(indices, dtype=np.int64)))


def with_labels(tokens: list[np.ndarray], labels: Any) -> list[Any]:
    """Items of ``tokens`` with the rows of the Arrow list column ``labels``; a sample whose labels
    row is null is labelled by its tokens (a bare token array, as without a labels column)."""
    import pyarrow as pa

    if isinstance(labels, pa.ChunkedArray):
        labels = labels.combine_chunks() if labels.num_chunks != 1 else labels.chunk(0)
    if not labels.null_count:
        labs = split_list_array(labels)
        return [{"input_ids": t, "labels": lab} for t, lab in zip(tokens, labs, strict=True)]
    null = np.asarray(labels.is_null(), dtype=bool)
    labs = split_list_array(labels.fill_null(pa.scalar([], labels.type)))
    return [
        t if n else {"input_ids": t, "labels": lab}
        for t, lab, n in zip(tokens, labs, null.tolist(), strict=True)
    ]


def split_list_array(arr: Any) -> list[np.ndarray]:
    """A pyarrow list array (or chunked) as a list of int64 numpy arrays, through its offsets."""
    offsets, values = flat_list_array(arr)
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]


def flat_list_array(arr: Any) -> tuple[np.ndarray, np.ndarray]:
    """A pyarrow list array (or chunked) as (offsets (n + 1,) int64 from 0, values int64)."""
    import pyarrow as pa

    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    offsets = np.asarray(arr.offsets, dtype=np.int64)
    # a slice's .values is its parent's whole buffer: convert only the referenced range
    used = arr.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    values = np.asarray(used.to_numpy(zero_copy_only=False), dtype=np.int64)
    return offsets - offsets[0], values


class HFSource:
    """One column of a Hugging Face ``datasets.Dataset``, read through Arrow (no per-row Python),
    and its per-token labels from ``labels_column`` when the dataset has that column."""

    def __init__(self, ds: Any, column: str, labels_column: str | None = None) -> None:
        if column not in ds.column_names:
            raise ValueError(
                f"column {column!r} is not in the dataset; it has columns {ds.column_names}. "
                "Pass column=<name of the token-id column>."
            )
        if labels_column == column or labels_column not in ds.column_names:
            labels_column = None
        elif _is_null_type(ds.data.column(labels_column).type):
            labels_column = None  # every labels row is null: every sample labelled by its tokens
        cols = [column] + ([labels_column] if labels_column else [])
        self.ds = ds.with_format("arrow", columns=cols)
        self.column = column
        self.labels_column = labels_column
        self.value_range = (0, 0)
        self.null_labels: np.ndarray | None = None  # (N,) bool after lengths(): labels row null
        _check_list_type(self.ds.data.column(column).type, f"column {column!r}")
        if labels_column:
            typ = self.ds.data.column(labels_column).type
            _check_list_type(typ, f"column {labels_column!r}", labels=True)

    def __len__(self) -> int:
        return len(self.ds)

    def lengths(self, batch_size: int = 1 << 16, scan_values: bool = False) -> np.ndarray:
        """All lengths, checking rows for nulls and labels for their length on the way; with
        ``scan_values`` also records ``value_range``, the (min, max) of the ids and labels."""
        parts, lo, hi, base, label_parts = [], 0, 0, 0, []
        for tbl in self.ds.iter(batch_size=batch_size):
            mine, n = [], 0
            for chunk in _chunks(tbl.column(self.column)):
                mine.append(check_list_chunk(chunk, f"column {self.column!r}", base + n))
                a, b = value_range(chunk) if scan_values else (0, 0)
                lo, hi, n = min(lo, a), max(hi, b), n + len(chunk)
            parts += mine
            if self.labels_column:
                lab, m = [], 0
                for chunk in _chunks(tbl.column(self.labels_column)):
                    name = f"column {self.labels_column!r}"
                    lab.append(check_list_chunk(chunk, name, base + m, labels=True))
                    a, b = value_range(chunk) if scan_values else (0, 0)
                    lo, hi, m = min(lo, a), max(hi, b), m + len(chunk)
                check_labels(np.concatenate(mine), np.concatenate(lab), base, self.labels_column)
                label_parts += lab
            base += n
        self.value_range = (lo, hi)
        if label_parts:
            null = np.concatenate(label_parts) < 0
            self.null_labels = null if bool(null.any()) else None
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_views", None)  # numpy views of memory-mapped buffers: rebuilt per process
        return state

    def flat_views(self, column: str) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]] | None:
        """Zero-copy access to a column's tokens where the dataset allows it (no indices
        mapping, integer values without nulls): ``(chunk_of (N,) int64, start_of (N,) int64,
        values)``, sample i's tokens being ``values[chunk_of[i]][start_of[i]:][:length]``.
        The values are numpy views of the (memory-mapped) Arrow buffers: reading a sample's
        tokens touches only its pages. None when not possible (then use ``take_table``)."""
        views = self.__dict__.setdefault("_views", {})
        if column not in views:
            views[column] = self._make_views(column)
        return views[column]

    def _make_views(self, column: str) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]] | None:
        if self.ds._indices is not None:
            return None
        chunks = _chunks(self.ds.data.column(column))
        values, chunk_of, start_of = [], [], []
        for c, chunk in enumerate(chunks):
            try:
                values.append(chunk.values.to_numpy(zero_copy_only=True))
            except Exception:  # nulls, or a type numpy cannot view: take instead
                return None
            off = np.asarray(chunk.offsets, dtype=np.int64)[:-1]
            start_of.append(off)
            chunk_of.append(np.full(len(off), c, dtype=np.int64))
        if not values:
            return None
        return np.concatenate(chunk_of), np.concatenate(start_of), values

    def take_table(self, indices: np.ndarray) -> Any:
        """A pyarrow Table of samples ``indices``: the token column, then the labels column."""
        return self.ds[[int(i) for i in indices]]

    def take_items(self, indices: np.ndarray) -> list[Any]:
        if len(indices) == 0:
            return []
        tbl = self.take_table(indices)
        tokens = split_list_array(tbl.column(self.column))
        if not self.labels_column:
            return tokens
        return with_labels(tokens, tbl.column(self.labels_column))


@functools.cache
def _copy_kernel() -> Any:
    """A compiled copy of many token runs (numba, compiled on first use and cached on disk,
    like flexpack._kernels): ``out[dst[j]:][:n[j]] = values[src[j]:][:n[j]]``."""
    from numba import njit

    @njit(cache=True, nogil=True)
    def copy_runs(values, src, dst, lengths, out):  # pragma: no cover - compiled
        for j in range(src.shape[0]):
            s = src[j]
            d = dst[j]
            for k in range(lengths[j]):
                out[d + k] = values[s + k]

    return copy_runs


def copy_runs(
    values: np.ndarray, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray, out: np.ndarray
) -> None:
    """Copy run j, ``values[src[j]:src[j] + lengths[j]]``, to ``out[dst[j]:...]`` (cast to
    ``out``'s dtype); one compiled pass, no temporaries the size of the tokens."""
    _copy_kernel()(values, src, dst, lengths, out)


def as_source(
    samples: Any, column: str | None, labels_column: str | None = None
) -> SequenceSource | ArrowSource | HFSource:
    """Pick the source for ``samples``; ``column`` selects the token column of a table (or key of
    dict samples), ``labels_column`` the per-token labels where present (None: none)."""
    if _is_hf_dataset(samples):
        return HFSource(samples, column or "input_ids", labels_column)
    if _is_arrow(samples):
        if hasattr(samples, "column_names"):  # pa.Table
            if (column or "input_ids") not in samples.column_names:
                raise ValueError(
                    f"column {column or 'input_ids'!r} is not in the table; it has columns "
                    f"{samples.column_names}. Pass column=<name of the token-id column>."
                )
            labels = None
            if labels_column is not None and labels_column in samples.column_names:
                labels = samples.column(labels_column)
                if _is_null_type(labels.type):  # all null: every sample labelled by its tokens
                    labels = None
            name = repr(column or "input_ids")
            col = samples.column(column or "input_ids")
            return ArrowSource(col, name, labels, labels_column or "labels")
        return ArrowSource(samples, "samples")
    return SequenceSource(samples, column, labels_column)


def row_columns(batch: Any) -> dict[str, np.ndarray]:
    """A PackedBatch's rows as the columns packed datasets store: the four (R, S) tensors as
    numpy, and ``num_tokens`` (R,) int64, the real tokens per row (the sampler's balance)."""
    doc_ids = batch.doc_ids.numpy()
    return {
        "input_ids": batch.input_ids.numpy(),
        "labels": batch.labels.numpy(),
        "doc_ids": doc_ids,
        "position_ids": batch.position_ids.numpy(),
        "num_tokens": (doc_ids >= 0).sum(axis=1).astype(np.int64),
    }
