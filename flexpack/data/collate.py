"""Collate packed rows into one PackedBatch (DataLoader ``collate_fn``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


def _row_tensors(row: Any, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if isinstance(row, Mapping):
        missing = [k for k in ("input_ids", "labels", "doc_ids") if k not in row]
        if missing:
            raise ValueError(
                f"rows[{i}] has keys {sorted(row)}, missing {missing}; collate expects PackedBatch "
                "rows or dicts with input_ids, labels and doc_ids (as pack_dataset writes them)."
            )
        parts = [torch.as_tensor(row[k]) for k in ("input_ids", "labels", "doc_ids")]
    elif hasattr(row, "input_ids") and hasattr(row, "labels") and hasattr(row, "doc_ids"):
        parts = [row.input_ids, row.labels, row.doc_ids]
    else:
        raise TypeError(
            f"rows[{i}] is a {type(row).__name__}, expected a PackedBatch (from PackedDataset / "
            "PackedIterableDataset) or a dict with input_ids, labels, doc_ids."
        )
    parts = [p.unsqueeze(0) if p.dim() == 1 else p for p in parts]
    if any(p.dim() != 2 or p.shape != parts[0].shape for p in parts):
        raise ValueError(
            f"rows[{i}] has input_ids/labels/doc_ids of shapes {[tuple(p.shape) for p in parts]}, "
            "expected equal shapes (S,) or (B, S)."
        )
    input_ids, labels, doc_ids = parts
    return input_ids.long(), labels.long(), doc_ids.int()


def collate(rows: Sequence[Any]) -> Any:
    """Concatenate packed rows into one ``PackedBatch``.

    Args:
        rows: a list of one-row (or k-row) ``PackedBatch`` es, or of dicts with ``input_ids``,
            ``labels``, ``doc_ids`` each (S,) or (k, S) (rows of ``pack_dataset``'s output).

    Returns:
        PackedBatch with ``input_ids`` (R, S) int64, ``labels`` (R, S) int64 and a layout from the
        concatenated ``doc_ids`` (R, S) int32. All rows must share S.

    Raises:
        ValueError: no rows, rows of different lengths, or dicts missing a field.
        TypeError: rows of another type.

    Example:
        >>> from flexpack.data import PackedDataset
        >>> ds = PackedDataset([[1, 2, 3], [4, 5], [6, 7, 8, 9]], max_len=5)
        >>> collate([ds[0], ds[1]]).input_ids.shape
        torch.Size([2, 5])
    """
    from flexpack.batch import PackedBatch
    from flexpack.layout import PackedLayout

    if len(rows) == 0:
        raise ValueError("collate got no rows; the DataLoader batch is empty.")
    parts = [_row_tensors(r, i) for i, r in enumerate(rows)]
    widths = {p[0].shape[1] for p in parts}
    if len(widths) != 1:
        raise ValueError(
            f"rows have different lengths {sorted(widths)}; pack every row to the same max_len."
        )
    input_ids, labels, doc_ids = (torch.cat(ts, dim=0) for ts in zip(*parts, strict=True))
    return PackedBatch(
        input_ids=input_ids, labels=labels, layout=PackedLayout.from_doc_ids(doc_ids)
    )
