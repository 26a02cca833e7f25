"""Shared pieces of the data pipeline: token sources and argument checks.

A *source* wraps whatever holds the token sequences (a list, a numpy object array, an Arrow list
column, a Hugging Face ``datasets.Dataset`` column) behind three operations: ``len``, ``lengths()``
(all sequence lengths at once, cheaply: Arrow list offsets rather than one Python call per row) and
``take(indices)`` (the token arrays of a few samples).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

_TOKEN_KINDS = "iu"


def check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}; pass e.g. {name}=4096.")
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
    return arr.astype(np.int64, copy=False)


def _is_arrow(obj: Any) -> bool:
    mod = type(obj).__module__
    return mod.startswith("pyarrow") and (hasattr(obj, "type") or hasattr(obj, "column_names"))


def _is_hf_dataset(obj: Any) -> bool:
    return type(obj).__module__.startswith("datasets") and hasattr(obj, "column_names")


class SequenceSource:
    """Any indexable of token sequences: list, tuple, numpy object or 2-D int array, tensor list."""

    def __init__(self, samples: Any) -> None:
        if isinstance(samples, (str, bytes, Mapping)) or not hasattr(samples, "__getitem__"):
            raise TypeError(
                f"samples is a {type(samples).__name__}, expected an indexable of token sequences "
                "(list of lists, numpy object array, datasets.Dataset with column=..., Arrow list "
                "column); for a generator use PackedIterableDataset."
            )
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

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
            x = s[i]
            if isinstance(x, Mapping):  # as_tokens' "column=" hint is for streams, not lists
                raise TypeError(
                    f"samples[{i}] is a {type(x).__name__} with keys {sorted(x)[:8]}, expected a "
                    'token sequence: pass [s["input_ids"] for s in samples], or a '
                    "datasets.Dataset / pyarrow.Table of them with column=<token column>."
                )
            if isinstance(x, (str, bytes)) or not hasattr(x, "__len__"):
                as_tokens(x, f"samples[{i}]")  # raises the TypeError
            if i == 0 or isinstance(x, np.ndarray):
                as_tokens(x, f"samples[{i}]")  # dtype check: first sample and all arrays
            out[i] = len(x)
        return out

    def take(self, indices: np.ndarray) -> list[np.ndarray]:
        return [as_tokens(self.samples[int(i)], f"samples[{int(i)}]") for i in indices]


class ArrowSource:
    """A pyarrow ``list<int>`` Array or ChunkedArray; lengths come from the list offsets."""

    def __init__(self, column: Any, name: str = "column") -> None:
        import pyarrow as pa

        typ = column.type
        if not (pa.types.is_list(typ) or pa.types.is_large_list(typ)) or not (
            pa.types.is_integer(typ.value_type)
        ):
            raise TypeError(
                f"{name} has Arrow type {typ}, expected list<int> (token ids); tokenize it first."
            )
        self.column = column
        self.name = name

    def __len__(self) -> int:
        return len(self.column)

    def lengths(self) -> np.ndarray:
        import pyarrow.compute as pc

        if self.column.null_count:
            raise ValueError(
                f"{self.name} has {self.column.null_count} null rows; drop them first."
            )
        return np.asarray(pc.list_value_length(self.column), dtype=np.int64)

    def take(self, indices: np.ndarray) -> list[np.ndarray]:
        return split_list_array(self.column.take(np.asarray(indices, dtype=np.int64)))


def split_list_array(arr: Any) -> list[np.ndarray]:
    """A pyarrow list array (or chunked) as a list of int64 numpy arrays, through its offsets."""
    import pyarrow as pa

    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    offsets = np.asarray(arr.offsets, dtype=np.int64)
    values = np.asarray(arr.values.to_numpy(zero_copy_only=False), dtype=np.int64)
    values = values[offsets[0] : offsets[-1]]
    offsets = offsets - offsets[0]
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(arr))]


class HFSource:
    """One column of a Hugging Face ``datasets.Dataset``, read through Arrow (no per-row Python)."""

    def __init__(self, ds: Any, column: str) -> None:
        if column not in ds.column_names:
            raise ValueError(
                f"column {column!r} is not in the dataset; it has columns {ds.column_names}. "
                "Pass column=<name of the token-id column>."
            )
        self.ds = ds.with_format("arrow", columns=[column])
        self.column = column
        ArrowSource(self.ds.data.column(column), f"column {column!r}")  # type check

    def __len__(self) -> int:
        return len(self.ds)

    def lengths(self, batch_size: int = 1 << 16) -> np.ndarray:
        import pyarrow.compute as pc

        parts = [
            np.asarray(pc.list_value_length(tbl.column(self.column)), dtype=np.int64)
            for tbl in self.ds.iter(batch_size=batch_size)
        ]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def take(self, indices: np.ndarray) -> list[np.ndarray]:
        if len(indices) == 0:
            return []
        tbl = self.ds[[int(i) for i in indices]]
        return split_list_array(tbl.column(self.column))


def as_source(samples: Any, column: str | None) -> SequenceSource | ArrowSource | HFSource:
    """Pick the source for ``samples``; ``column`` selects the token column of a table."""
    if _is_hf_dataset(samples):
        return HFSource(samples, column or "input_ids")
    if _is_arrow(samples):
        if hasattr(samples, "column_names"):  # pa.Table
            if (column or "input_ids") not in samples.column_names:
                raise ValueError(
                    f"column {column or 'input_ids'!r} is not in the table; it has columns "
                    f"{samples.column_names}. Pass column=<name of the token-id column>."
                )
            return ArrowSource(samples.column(column or "input_ids"), repr(column or "input_ids"))
        return ArrowSource(samples, "samples")
    if column is not None:
        raise ValueError(
            f"column={column!r} given but samples is a {type(samples).__name__}; column selects "
            "a column of a datasets.Dataset or pyarrow.Table. Drop column=... for plain sequences."
        )
    return SequenceSource(samples)


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
