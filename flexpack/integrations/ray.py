"""Ray Data: pack a ``ray.data.Dataset`` across a cluster with one global plan.

1. The dataset is materialized (its blocks fixed, in order) and one task per block returns that
   block's sample lengths: only the lengths (8 bytes per sample) reach the driver.
2. The driver makes one plan, ``flexpack.pack(lengths, max_len, ...)``: global, not per block.
3. One task per block cuts its samples into the plan's segments, tagged with their packed row
   and slot in the row; ``groupby("row").map_groups(...)`` (Ray's ``map_batches`` over the
   shuffled groups) assembles each row where its pieces land. Every token moves once, through
   the object store; no node holds more than its blocks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flexpack.batch import _from_pieces
from flexpack.data._common import ArrowSource, check_positive_int, row_columns, split_list_array

__all__ = ["pack_ray_dataset"]


def _block_lengths(table: Any, column: str) -> np.ndarray:
    if column not in table.column_names:
        raise ValueError(
            f"column {column!r} is not in the dataset; it has columns {table.column_names}. "
            "Pass column=<name of the token-id column>."
        )
    return ArrowSource(table.column(column), f"column {column!r}").lengths()


def _block_pieces(table: Any, column: str, segs: np.ndarray) -> Any:
    """Arrow (row, slot, tokens) of segments (k, 5): row, slot, local sample, start, stop."""
    import pyarrow as pa

    tokens = split_list_array(table.column(column))
    pieces = [tokens[s][a:b] for s, a, b in segs[:, 2:].tolist()]
    return pa.table(
        {
            "row": pa.array(segs[:, 0], pa.int64()),
            "slot": pa.array(segs[:, 1], pa.int64()),
            "tokens": pa.array(pieces, pa.list_(pa.int64())),
        }
    )


def _assemble(group: dict[str, np.ndarray], *, max_len: int, pad_id: int) -> dict[str, Any]:
    order = np.argsort(group["slot"], kind="stable")
    pieces = [[np.asarray(group["tokens"][i], dtype=np.int64) for i in order]]
    return {
        "row": group["row"][:1].astype(np.int64),
        **row_columns(_from_pieces(pieces, max_len, pad_id=pad_id)),
    }


def pack_ray_dataset(
    ds: Any,
    max_len: int,
    *,
    column: str = "input_ids",
    strategy: str = "bfd",
    overflow: str = "error",
    seed: int = 0,
    pad_id: int = 0,
    max_docs_per_row: int | None = None,
    num_partitions: int | None = None,
) -> Any:
    """Pack the token column of a ``ray.data.Dataset`` into rows of ``max_len`` (global plan).

    Returns a ``ray.data.Dataset`` with one record per packed row: ``row`` int64 (its number in
    the plan; the output order is not the row order, sort by it if order matters),
    ``input_ids`` (max_len,) int64, ``labels`` (max_len,) int64 (-100 on padding and on each
    document's first token), ``doc_ids`` (max_len,) int32 (-1 on padding), ``position_ids``
    (max_len,) int64, ``num_tokens`` int64 (real tokens of the row). Rows equal
    ``flexpack.pack(lengths, max_len, ...).materialize(samples)``.

    Args:
        ds: a ``ray.data.Dataset`` whose ``column`` holds token-id lists; N samples, in the
            order of its materialized blocks.
        max_len: row length S.
        strategy, overflow, seed, max_docs_per_row: passed to ``flexpack.pack``.
        num_partitions: shuffle partitions for the row grouping (default: rows / 512, 1..200).

    Raises:
        ValueError: a missing column, max_len <= 0, or what ``flexpack.pack`` rejects.
        TypeError: ``ds`` is not a Ray dataset, or the column is not token ids.

    Example:
        Needs a Ray instance (slow to start, so not run as a doctest; see the tests):

        >>> import ray  # doctest: +SKIP
        >>> items = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]  # doctest: +SKIP
        >>> ds = ray.data.from_items(items)  # doctest: +SKIP
        >>> pack_ray_dataset(ds, 5).take_all()[0]["input_ids"].tolist()  # doctest: +SKIP
        [1, 2, 3, 4, 5]
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
    blocks = ds.select_columns([column]).materialize().to_arrow_refs()
    lengths_task = ray.remote(_block_lengths)
    per_block = ray.get([lengths_task.remote(b, column) for b in blocks])
    lengths = np.concatenate(per_block) if per_block else np.zeros(0, np.int64)
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
    first = np.concatenate([[0], np.cumsum([len(x) for x in per_block])])
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
        piece_refs.append(pieces_task.remote(ref, column, part))
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
            fn_kwargs={"max_len": max_len, "pad_id": int(pad_id)},
        )
    )
