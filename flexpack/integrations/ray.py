"""Ray Data: pack a ``ray.data.Dataset`` across a cluster with one global plan.

1. The dataset is materialized (its blocks fixed, in order) and one task per block returns that
   block's sample lengths: only the lengths (8 bytes per sample) reach the driver.
2. The driver makes one plan, ``flexpack.pack(lengths, max_len, ...)``: global, not per block.
3. One task per block cuts its samples into the plan's segments, tagged with their packed row
   and slot in the row; ``groupby("row").map_groups(...)`` (Ray's ``map_batches`` over the
   shuffled groups) assembles each row where its pieces land. Every token moves once, through
   the object store; no node holds more than its blocks.

Rows are stored unpadded by default, as ``flexpack.integrations.datasets.pack_dataset`` stores
them (``input_ids`` (T_r,), ``labels`` (T_r,) when kept, ``seqlens`` (k_r,), ``num_tokens``);
``flexpack.data.collate(rows, max_len=...)`` pads them. ``padded=True`` stores (max_len,) rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flexpack._packed_batch import _from_pieces
from flexpack.data._common import (
    ArrowSource,
    check_labels,
    check_positive_int,
    row_columns,
    split_list_array,
)

__all__ = ["pack_ray_dataset"]


def _block_rows(table: Any) -> int:
    return table.num_rows


def _block_lengths(
    table: Any, column: str, labels_column: str | None, base: int
) -> tuple[np.ndarray, np.ndarray | None, tuple[int, int]]:
    """(n,) lengths of the block's samples, their labels' lengths and the (min, max) of all
    values; a null row or token is a ValueError naming the row by its index in the whole
    dataset (``base`` + local index). A null labels row has length -1: no labels, the sample is
    labelled by its tokens (as on every flexpack path)."""
    import pyarrow as pa

    from flexpack.data._common import _chunks, check_list_chunk, value_range

    if column not in table.column_names:
        raise ValueError(
            f"column {column!r} is not in the dataset; it has columns {table.column_names}. "
            "Pass column=<name of the token-id column>."
        )
    ArrowSource(table.column(column), f"column {column!r}")  # type check

    lo, hi = 0, 0

    def lengths(col: str, labels: bool = False) -> np.ndarray:
        nonlocal lo, hi
        parts, n = [], base
        for chunk in _chunks(table.column(col)):
            if labels and pa.types.is_null(chunk.type):  # a block of null labels rows
                parts.append(np.full(len(chunk), -1, np.int64))
                n += len(chunk)
                continue
            parts.append(check_list_chunk(chunk, f"column {col!r}", n, labels=labels))
            a, b = value_range(chunk)
            lo, hi, n = min(lo, a), max(hi, b), n + len(chunk)
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    ids = lengths(column)
    return ids, lengths(labels_column, labels=True) if labels_column else None, (lo, hi)


def _block_pieces(table: Any, column: str, labels_column: str | None, segs: np.ndarray) -> Any:
    """Arrow (row, slot, tokens[, labels]) of segments (k, 5): row, slot, local sample, start,
    stop."""
    import pyarrow as pa

    def pieces(rows: list[np.ndarray]) -> Any:
        return pa.array([rows[s][a:b] for s, a, b in segs[:, 2:].tolist()], pa.list_(pa.int64()))

    tokens = split_list_array(table.column(column))
    out = {
        "row": pa.array(segs[:, 0], pa.int64()),
        "slot": pa.array(segs[:, 1], pa.int64()),
        "tokens": pieces(tokens),
    }
    if labels_column:
        labels = table.column(labels_column)
        if pa.types.is_null(labels.type):  # every labels row null: labelled by the tokens
            rows = tokens
        elif labels.null_count:  # a null labels row: labelled by its tokens
            null = np.asarray(labels.is_null(), dtype=bool).tolist()
            filled = split_list_array(labels.fill_null(pa.scalar([], labels.type)))
            rows = [t if n else lab for t, lab, n in zip(tokens, filled, null, strict=True)]
        else:
            rows = split_list_array(labels)
        out["labels"] = pieces(rows)
    return pa.table(out)


def _assemble(
    group: dict[str, np.ndarray], *, max_len: int, pad_id: int, padded: bool, dtype: str
) -> Any:
    import pyarrow as pa

    order = np.argsort(group["slot"], kind="stable")
    pieces = [np.asarray(group["tokens"][i], dtype=np.int64) for i in order]
    labels = None
    if "labels" in group:
        labels = [np.asarray(group["labels"][i], dtype=np.int64) for i in order]
    if padded:
        given = None if labels is None else [labels]
        cols = row_columns(_from_pieces([pieces], max_len, pad_id=pad_id, labels=given))
        return {"row": group["row"][:1].astype(np.int64), **cols}
    seqlens = np.array([len(p) for p in pieces], dtype=np.int32)
    typ = pa.int32() if dtype == "int32" else pa.int64()
    out = {
        "row": pa.array(group["row"][:1].astype(np.int64), pa.int64()),
        "input_ids": pa.array([np.concatenate(pieces).astype(dtype)], pa.list_(typ)),
    }
    if labels is not None:
        flat = np.concatenate(labels)
        flat[np.cumsum(seqlens) - seqlens] = -100  # a document's first token is never predicted
        out["labels"] = pa.array([flat.astype(dtype)], pa.list_(typ))
    out["seqlens"] = pa.array([seqlens], pa.list_(pa.int32()))
    out["num_tokens"] = pa.array([int(seqlens.sum())], pa.int64())
    return pa.table(out)


def pack_ray_dataset(
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
    num_partitions: int | None = None,
) -> Any:
    """Pack the token column of a ``ray.data.Dataset`` into rows of ``max_len`` (global plan).

    Returns a ``ray.data.Dataset`` with one record per packed row: ``row`` int64 (its number in
    the plan; the output order is not the row order, sort by it if order matters), and, stored
    unpadded as ``pack_dataset`` stores them: ``input_ids`` (T_r,) the row's tokens,
    ``labels`` (T_r,) when the dataset has ``labels_column`` (kept, -100 on each document's
    first token), ``seqlens`` (k_r,) int32 document lengths, ``num_tokens`` int64 (T_r); ids and
    labels are int32 when every value fits, else int64. ``flexpack.data.collate(rows,
    max_len=max_len)`` pads rows into a ``PackedBatch`` equal to
    ``flexpack.pack(lengths, max_len, ...).materialize(samples)``'s rows.

    With ``padded=True``: ``input_ids`` (max_len,) int64, ``labels`` (max_len,) int64 (-100 on
    padding and on each document's first token), ``doc_ids`` (max_len,) int32 (-1 on
    padding), ``position_ids`` (max_len,) int64, ``num_tokens`` int64.

    Args:
        ds: a ``ray.data.Dataset`` whose ``column`` holds token-id lists; N samples, in the
            order of its materialized blocks.
        max_len: row length S.
        labels_column: column of per-token labels, kept when the dataset has it; None ignores.
        padded: store padded (max_len,) rows.
        strategy, overflow, seed, max_docs_per_row: passed to ``flexpack.pack``.
        num_partitions: shuffle partitions for the row grouping (default: rows / 512, 1..200).

    Raises:
        ValueError: a missing column, max_len <= 0, a null row or token, labels whose length
            differs from the tokens', or what ``flexpack.pack`` rejects.
        TypeError: ``ds`` is not a Ray dataset, or the column is not token ids.

    Example (needs a Ray instance, slow to start, so not a doctest; the same rows are checked in
    tests/test_integrations_ray.py)::

            import ray
            items = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]
            ds = ray.data.from_items(items)
            row = pack_ray_dataset(ds, 5).take_all()[0]
            row["input_ids"].tolist(), row["seqlens"].tolist()
            # -> ([1, 2, 3, 4, 5], [3, 2])
    """
    import ray
    import ray.data

    from flexpack.packing import pack

    if not isinstance(ds, ray.data.Dataset):
        raise TypeError(
            f"ds is a {type(ds).__name__}, expected a ray.data.Dataset; for a datasets.Dataset "
            "use flexpack.integrations.datasets.pack_dataset."
        )
    max_len = check_positive_int("max_len", max_len)
    if column not in ds.columns():
        raise ValueError(
            f"column {column!r} is not in the dataset; it has columns {ds.columns()}. "
            "Pass column=<name of the token-id column>."
        )
    if labels_column == column or labels_column not in ds.columns():
        labels_column = None
    cols = [column] + ([labels_column] if labels_column else [])
    blocks = ds.select_columns(cols).materialize().to_arrow_refs()
    sizes = ray.get([ray.remote(_block_rows).remote(b) for b in blocks])
    first = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    lengths_task = ray.remote(_block_lengths)
    per_block = ray.get(
        [lengths_task.remote(b, column, labels_column, int(first[i])) for i, b in enumerate(blocks)]
    )
    lengths = np.concatenate([x[0] for x in per_block]) if per_block else np.zeros(0, np.int64)
    if labels_column:
        check_labels(lengths, np.concatenate([x[1] for x in per_block]), 0, labels_column)
    ranges = [(0, 0)] + [x[2] for x in per_block]
    lo, hi = min(r[0] for r in ranges), max(r[1] for r in ranges)
    dtype = "int32" if -(2**31) <= lo and hi < 2**31 else "int64"
    plan = pack(
        lengths,
        max_len,
        strategy=strategy,
        overflow=overflow,
        seed=seed,
        max_docs_per_row=max_docs_per_row,
    )
    seg = plan.segments  # ordered by row: slot = position inside the row's run
    slot = np.arange(len(seg), dtype=np.int64) - plan.row_offsets[seg[:, 0]]
    by_sample = np.argsort(seg[:, 1], kind="stable")
    sample_sorted = seg[by_sample, 1]
    pieces_task = ray.remote(_block_pieces)
    piece_refs = []
    for b, ref in enumerate(blocks):
        lo, hi = np.searchsorted(sample_sorted, [first[b], first[b + 1]])
        idx = by_sample[lo:hi]
        if len(idx) == 0:
            continue
        part = np.stack(
            [seg[idx, 0], slot[idx], seg[idx, 1] - first[b], seg[idx, 2], seg[idx, 3]], axis=1
        )
        piece_refs.append(pieces_task.remote(ref, column, labels_column, part))
    if num_partitions is None:
        num_partitions = int(min(200, max(1, plan.num_rows // 512)))
    if not piece_refs:
        return ray.data.from_items([])
    return (
        ray.data.from_arrow_refs(piece_refs)
        .groupby("row", num_partitions=num_partitions)
        .map_groups(
            _assemble,
            batch_format="numpy",
            fn_kwargs={
                "max_len": max_len,
                "pad_id": int(pad_id),
                "padded": bool(padded),
                "dtype": dtype,
            },
        )
    )
