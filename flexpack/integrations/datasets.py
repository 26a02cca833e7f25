"""Hugging Face ``datasets``: pack a tokenized ``datasets.Dataset`` with one global plan.

Only the lengths are read into RAM (from the Arrow list offsets, 8 bytes per sample); the plan
is one ``flexpack.pack`` over all of them; rows are built with ``Dataset.map(batched=True)``
over row numbers, each batch reading its samples by an Arrow take and writing Arrow, so tokens
stream from the source's files to the result's files without ever being all in memory.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np

from flexpack.data._common import HFSource, check_positive_int, row_columns

__all__ = ["pack_dataset"]

_ROW = "__flexpack_row__"


def _build_rows(batch: dict[str, list[int]], *, source: HFSource, plan: Any, pad_id: int) -> Any:
    import pyarrow as pa

    from flexpack.data.dataset import _Fetched

    rows = np.asarray(batch[_ROW], dtype=np.int64)
    seg, off = plan.segments, plan.row_offsets
    need = np.unique(np.concatenate([seg[off[r] : off[r + 1], 1] for r in rows]))
    fetched = _Fetched(len(plan.lengths), dict(zip(need.tolist(), source.take(need), strict=True)))
    cols = row_columns(plan.materialize(fetched, rows.tolist(), pad_id=pad_id))
    num_tokens = pa.array(cols.pop("num_tokens"), pa.int64())
    # (R, S) arrays -> Arrow fixed_size_list int32, no Python lists
    fixed = {
        k: pa.FixedSizeListArray.from_arrays(pa.array(v.ravel(), pa.int32()), plan.max_len)
        for k, v in cols.items()
    }
    return pa.table({**fixed, "num_tokens": num_tokens})


def pack_dataset(
    ds: Any,
    max_len: int,
    *,
    column: str = "input_ids",
    strategy: str = "bfd",
    overflow: str = "error",
    seed: int = 0,
    pad_id: int = 0,
    max_docs_per_row: int | None = None,
    num_proc: int | None = None,
    batch_size: int = 256,
    cache_file_name: str | None = None,
    keep_in_memory: bool = False,
) -> Any:
    """Pack the token column of a ``datasets.Dataset`` into rows of ``max_len`` (global plan).

    The result has one example per packed row, every column of length ``max_len``:
    ``input_ids`` (``pad_id`` on padding), ``labels`` (-100 on padding and on each document's
    first token; unshifted), ``doc_ids`` (-1 on padding), ``position_ids``, all stored as int32
    (half the bytes; ``with_format("torch")`` returns int64 tensors, as ``PackedBatch`` has), and
    ``num_tokens`` int64 (real tokens of the row, for ``DistributedPackedSampler``'s balance).
    ``with_format("torch")`` gives (B, max_len) tensors; ``flexpack.data.collate`` turns a list of
    its rows into a ``PackedBatch``. Other columns are not carried over.

    Unlike TRL's ``pack_dataset`` (one packing per ``map`` batch of 1,000 rows by default), the
    plan is made once over all lengths, so rows are as few as the packer can make them.
    The result is written next to the source's cache files (memory-mapped) when the source has
    any, else kept in memory; ``cache_file_name`` / ``keep_in_memory`` override.

    Args:
        ds: a ``datasets.Dataset`` with a ``list<int>`` column ``column``; N samples.
        max_len: row length S.
        strategy, overflow, seed, max_docs_per_row: passed to ``flexpack.pack``.
        num_proc: processes for ``map`` (each gets a copy of the plan: 32 bytes per sample).
        batch_size: rows built per ``map`` call (also the Arrow writer batch).

    Returns:
        ``datasets.Dataset`` of R rows, R = ``flexpack.pack(lengths, max_len, ...).num_rows``.

    Raises:
        ValueError: a missing column, max_len <= 0, or what ``flexpack.pack`` rejects.
        TypeError: ``ds`` is not a ``datasets.Dataset``, or the column is not token ids.

    Example:
        >>> import datasets
        >>> ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]]})
        >>> packed = pack_dataset(ds, 5, seed=None)
        >>> packed[:]["input_ids"]
        [[6, 7, 8, 9, 0], [1, 2, 3, 4, 5]]
        >>> packed[:]["doc_ids"]
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
    source = HFSource(ds, column)
    lengths = source.lengths()
    plan = pack(
        lengths,
        max_len,
        strategy=strategy,
        overflow=overflow,
        seed=seed,
        max_docs_per_row=max_docs_per_row,
    )
    key = hashlib.sha256()
    key.update(repr((ds._fingerprint, column, max_len, strategy, overflow, seed)).encode())
    key.update(repr((pad_id, max_docs_per_row, plan.num_rows)).encode())
    key.update(np.ascontiguousarray(plan.segments).tobytes())
    fingerprint = key.hexdigest()[:32]
    if cache_file_name is None and not keep_in_memory and ds.cache_files:
        folder = os.path.dirname(ds.cache_files[0]["filename"])
        cache_file_name = os.path.join(folder, f"flexpack-packed-{fingerprint}.arrow")

    row = datasets.List(datasets.Value("int32"), length=max_len)
    features = datasets.Features(
        {
            "input_ids": row,
            "labels": row,
            "doc_ids": row,
            "position_ids": row,
            "num_tokens": datasets.Value("int64"),
        }
    )
    if plan.num_rows == 0:  # map() on no rows would drop the features: build the empty table
        return datasets.Dataset.from_dict({k: [] for k in features}, features=features)
    rows = datasets.Dataset.from_dict({_ROW: np.arange(plan.num_rows, dtype=np.int64)})
    return rows.map(
        _build_rows,
        batched=True,
        batch_size=batch_size,
        writer_batch_size=batch_size,
        remove_columns=[_ROW],
        features=features,
        fn_kwargs={"source": source, "plan": plan, "pad_id": int(pad_id)},
        num_proc=num_proc,
        cache_file_name=cache_file_name,
        keep_in_memory=keep_in_memory,
        new_fingerprint=fingerprint,
        desc="flexpack: packing rows",
    )
