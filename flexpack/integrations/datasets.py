"""Hugging Face ``datasets``: pack a tokenized ``datasets.Dataset`` with one global plan.

Only the lengths are read into RAM (from the Arrow list offsets, 8 bytes per sample); the plan
is one ``flexpack.pack`` over all of them; rows are built with ``Dataset.map(batched=True)``
over row numbers, each batch reading its samples by an Arrow take and writing Arrow, so tokens
stream from the source's files to the result's files without ever being all in memory.

Rows are stored unpadded, the layout's natural form (R rows, row r holding T_r tokens in k_r
documents)::

    input_ids  (T_r,)  the row's tokens, documents back to back
    labels     (T_r,)  only when the source has a labels column: its labels, -100 on each
                       document's first token
    seqlens    (k_r,)  int32 document lengths; doc_ids / position_ids / cu_seqlens follow
    num_tokens ()      int64 T_r, for DistributedPackedSampler's balance

``flexpack.data.collate`` (or ``PackedDataset`` over the result) pads rows to ``max_len`` and
rebuilds the layout on the fly. ``padded=True`` stores (max_len,) rows with ``labels``,
``doc_ids`` and ``position_ids`` instead.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np

from flexpack.data._common import (
    HFSource,
    check_positive_int,
    copy_runs,
    flat_list_array,
    row_columns,
)

__all__ = ["pack_dataset"]

_ROW = "__flexpack_row__"


def _gather(
    source: HFSource,
    column: str,
    seg: np.ndarray,
    starts: np.ndarray,
    dtype: str,
    taken: dict[str, Any],
) -> np.ndarray:
    """(T,) tokens of the segments ``seg`` back to back, ``starts`` (m,) each one's first
    output position. Zero-copy reads of the source's buffers, one fancy index per Arrow chunk;
    an Arrow take where the dataset has an indices mapping, made once per batch and kept in
    ``taken`` for the other column (the take returns both)."""
    seqlens = seg[:, 3] - seg[:, 2]
    total = int(seqlens.sum())
    views = source.flat_views(column)
    if views is None:
        if not taken:
            need, taken["inv"] = np.unique(seg[:, 1], return_inverse=True)
            taken["table"] = source.take_table(need)
        offsets, values = flat_list_array(taken["table"].column(column))
        src = offsets[taken["inv"]] + seg[:, 2]
        return values[np.repeat(src - starts, seqlens) + np.arange(total)].astype(dtype)
    chunk_of, start_of, values = views
    out = np.empty(total, dtype=dtype)
    seg_chunk = chunk_of[seg[:, 1]]
    src = start_of[seg[:, 1]] + seg[:, 2]
    order = np.argsort(seg_chunk, kind="stable")
    bounds = np.searchsorted(seg_chunk[order], np.arange(len(values) + 1))
    for c in np.flatnonzero(np.diff(bounds)).tolist():
        sel = order[bounds[c] : bounds[c + 1]]
        copy_runs(values[c], src[sel], starts[sel], seqlens[sel], out)
    return out


def _labels(
    source: HFSource,
    seg: np.ndarray,
    seqlens: np.ndarray,
    starts: np.ndarray,
    ids: np.ndarray,
    dtype: str,
    taken: dict[str, Any],
) -> np.ndarray:
    """(T,) labels of the segments ``seg``: the labels column's, the tokens ``ids`` for samples
    whose labels row is null (labelled by their tokens, as on every other path). A null row has
    no values to read, so only the other segments are gathered, then scattered into place."""
    null = source.null_labels
    if null is None:
        return _gather(source, source.labels_column, seg, starts, dtype, taken)
    labels = ids.copy()
    keep = ~null[seg[:, 1]]
    if keep.any():
        part_len = seqlens[keep]
        part_starts = np.cumsum(part_len) - part_len
        part = _gather(source, source.labels_column, seg[keep], part_starts, dtype, {})
        labels[np.repeat(starts[keep] - part_starts, part_len) + np.arange(part.size)] = part
    return labels


def _build_unpadded(batch: dict[str, list[int]], *, source: HFSource, plan: Any, dtype: str) -> Any:
    """Arrow rows: tokens gathered by fancy indexing (no Python per token or per segment)."""
    import pyarrow as pa

    rows = np.asarray(batch[_ROW], dtype=np.int64)
    seg, counts = plan._select(rows)
    seqlens = seg[:, 3] - seg[:, 2]
    starts = np.cumsum(seqlens) - seqlens  # each document's first token in the output
    row_tokens = np.add.reduceat(seqlens, np.cumsum(counts) - counts) if len(rows) else counts
    row_off = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(row_tokens, out=row_off[1:])
    doc_off = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(counts, out=doc_off[1:])

    def lists(vals: np.ndarray, off: np.ndarray, typ: Any) -> Any:
        return pa.LargeListArray.from_arrays(pa.array(off, pa.int64()), pa.array(vals, typ))

    typ = pa.int32() if dtype == "int32" else pa.int64()
    taken: dict[str, Any] = {}
    ids = _gather(source, source.column, seg, starts, dtype, taken)
    out = {"input_ids": lists(ids, row_off, typ)}
    if source.labels_column:
        labels = _labels(source, seg, seqlens, starts, ids, dtype, taken)
        labels[starts] = -100  # a document's first token is never predicted
        out["labels"] = lists(labels, row_off, typ)
    out["seqlens"] = lists(seqlens.astype(np.int32), doc_off, pa.int32())
    out["num_tokens"] = pa.array(row_tokens, pa.int64())
    return pa.table(out)


def _build_padded(
    batch: dict[str, list[int]], *, source: HFSource, plan: Any, pad_id: int, dtype: str
) -> Any:
    import pyarrow as pa

    from flexpack.data.dataset import _Fetched

    rows = np.asarray(batch[_ROW], dtype=np.int64)
    seg, _ = plan._select(rows)
    need = np.unique(seg[:, 1])
    items = dict(zip(need.tolist(), source.take_items(need), strict=True))
    fetched = _Fetched(len(plan.lengths), items)
    cols = row_columns(plan.materialize(fetched, rows.tolist(), pad_id=pad_id))
    num_tokens = pa.array(cols.pop("num_tokens"), pa.int64())
    typ = pa.int32() if dtype == "int32" else pa.int64()
    # (R, S) arrays -> Arrow fixed_size_list, no Python lists
    fixed = {
        k: pa.FixedSizeListArray.from_arrays(pa.array(v.ravel().astype(dtype), typ), plan.max_len)
        for k, v in cols.items()
    }
    return pa.table({**fixed, "num_tokens": num_tokens})


def _features(padded: bool, labels: bool, dtype: str, max_len: int) -> Any:
    import datasets

    value = datasets.Value(dtype)
    if padded:
        row = datasets.List(value, length=max_len)
        names = ("input_ids", "labels", "doc_ids", "position_ids")
        cols = {k: row for k in names}
        cols["doc_ids"] = datasets.List(datasets.Value("int32"), length=max_len)
    else:
        cols = {"input_ids": datasets.LargeList(value)}
        if labels:
            cols["labels"] = datasets.LargeList(value)
        cols["seqlens"] = datasets.LargeList(datasets.Value("int32"))
    cols["num_tokens"] = datasets.Value("int64")
    return datasets.Features(cols)


def pack_dataset(
    ds: Any,
    max_len: int,
    *,
    column: str = "input_ids",
    labels_column: str | None = "labels",
    padded: bool = False,
    strategy: str = "bfd",
    overflow: str = "error",
    seed: int = 0,
    pad_id: int = 0,
    max_docs_per_row: int | None = None,
    num_proc: int | None = None,
    batch_size: int = 1000,
    cache_file_name: str | None = None,
    keep_in_memory: bool = False,
) -> Any:
    """Pack the token column of a ``datasets.Dataset`` into rows of ``max_len`` (global plan).

    The result has one example per packed row, stored unpadded: ``input_ids`` (the row's T_r
    tokens), ``labels`` (T_r,) when the source has ``labels_column`` (its labels kept, -100 on
    each document's first token; unshifted), ``seqlens`` (k_r,) int32 (the row's document
    lengths) and ``num_tokens`` int64 (T_r, for ``DistributedPackedSampler``'s balance).
    Token ids and labels are stored as int32 when every value fits, else int64.
    ``flexpack.data.collate(rows, max_len=max_len)`` pads a list of rows into a ``PackedBatch``
    (labels from the ids where none are stored) and ``PackedDataset(result, max_len)`` serves
    rows as ``PackedBatch`` es; both rebuild ``doc_ids`` / ``position_ids`` / ``cu_seqlens``
    from ``seqlens``. Other columns are not carried over.

    With ``padded=True`` every column is (max_len,): ``input_ids`` (``pad_id`` on padding),
    ``labels`` (-100 on padding and on each document's first token), ``doc_ids`` (-1 on
    padding), ``position_ids``, plus ``num_tokens``: about 4x the bytes, for trainers that need
    fixed-size rows without a collator.

    Unlike TRL's ``pack_dataset`` (one packing per ``map`` batch of 1,000 rows by default), the
    plan is made once over all lengths, so rows are as few as the packer can make them.
    The result is written next to the source's cache files (memory-mapped) when the source has
    any, else kept in memory; ``cache_file_name`` / ``keep_in_memory`` override.

    Args:
        ds: a ``datasets.Dataset`` with a ``list<int>`` column ``column``; N samples.
        max_len: row length S.
        labels_column: column of per-token labels (same lengths as the tokens), kept when the
            dataset has it; None ignores it.
        padded: store padded (max_len,) rows instead of unpadded ones.
        strategy, overflow, seed, max_docs_per_row: passed to ``flexpack.pack``.
        num_proc: processes for ``map`` (each gets a copy of the plan: 32 bytes per sample).
        batch_size: rows built per ``map`` call (also the Arrow writer batch).

    Returns:
        ``datasets.Dataset`` of R rows, R = ``flexpack.pack(lengths, max_len, ...).num_rows``.

    Raises:
        ValueError: a missing column, max_len <= 0, a null row or token (named), a labels list
            whose length differs from its tokens (the sample named), or what ``flexpack.pack``
            rejects.
        TypeError: ``ds`` is not a ``datasets.Dataset``, or the column is not token ids.

    Example:
        >>> import datasets
        >>> from flexpack.data import collate
        >>> ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]]})
        >>> packed = pack_dataset(ds, 5, seed=None)
        >>> packed[:]["input_ids"], packed[:]["seqlens"]
        ([[6, 7, 8, 9], [1, 2, 3, 4, 5]], [[4], [3, 2]])
        >>> collate(list(packed), max_len=5).doc_ids
        tensor([[ 0,  0,  0,  0, -1],
                [ 0,  0,  0,  1,  1]], dtype=torch.int32)
        >>> pack_dataset(ds, 5, seed=None, padded=True)[:]["doc_ids"]
        [[0, 0, 0, 0, -1], [0, 0, 0, 1, 1]]
    """
    import datasets

    from flexpack.packing import pack

    if not isinstance(ds, datasets.Dataset):
        raise TypeError(
            f"ds is a {type(ds).__name__}, expected a datasets.Dataset (for a DatasetDict pack "
            "each split: {k: pack_dataset(v, ...) for k, v in dd.items()}; for an "
            "IterableDataset use flexpack.data.PackedIterableDataset)."
        )
    max_len = check_positive_int("max_len", max_len)
    batch_size = check_positive_int("batch_size", batch_size)
    source = HFSource(ds, column, labels_column)
    lengths = source.lengths(scan_values=True)
    plan = pack(
        lengths,
        max_len,
        strategy=strategy,
        overflow=overflow,
        seed=seed,
        max_docs_per_row=max_docs_per_row,
    )
    lo, hi = source.value_range
    if padded:
        lo, hi = min(lo, int(pad_id), -100), max(hi, int(pad_id))
    dtype = "int32" if -(2**31) <= lo and hi < 2**31 else "int64"
    key = hashlib.sha256()
    key.update(repr((ds._fingerprint, column, source.labels_column, padded, dtype)).encode())
    key.update(repr((max_len, strategy, overflow, seed)).encode())
    key.update(repr((pad_id, max_docs_per_row, plan.num_rows)).encode())
    key.update(np.ascontiguousarray(plan.segments).tobytes())
    fingerprint = key.hexdigest()[:32]
    if cache_file_name is None and not keep_in_memory and ds.cache_files:
        folder = os.path.dirname(ds.cache_files[0]["filename"])
        cache_file_name = os.path.join(folder, f"flexpack-packed-{fingerprint}.arrow")

    features = _features(bool(padded), source.labels_column is not None, dtype, max_len)
    if plan.num_rows == 0:  # map() on no rows would drop the features: build the empty table
        return datasets.Dataset.from_dict({k: [] for k in features}, features=features)
    if padded:
        build, kwargs = _build_padded, {"pad_id": int(pad_id)}
    else:
        build, kwargs = _build_unpadded, {}
    rows = datasets.Dataset.from_dict({_ROW: np.arange(plan.num_rows, dtype=np.int64)})
    return rows.map(
        build,
        batched=True,
        batch_size=batch_size,
        writer_batch_size=batch_size,
        remove_columns=[_ROW],
        features=features,
        fn_kwargs={"source": source, "plan": plan, "dtype": dtype, **kwargs},
        num_proc=num_proc,
        cache_file_name=cache_file_name,
        keep_in_memory=keep_in_memory,
        new_fingerprint=fingerprint,
        desc="flexpack: packing rows",
    )
