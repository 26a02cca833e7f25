"""Collate packed rows into one PackedBatch (DataLoader ``collate_fn``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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


_MASKS = ("document_causal", "document")


def _mask_of_kind(kind: str, doc_ids: torch.Tensor) -> Any:
    from flexpack import masks

    m = masks.document(doc_ids)
    return m & masks.causal() if kind == "document_causal" else m


def _with_mask_mod(block_mask: Any, mask_mod: Any) -> Any:
    """The same block structure with another mask_mod (one whose doc_ids live beside it)."""
    from torch.nn.attention.flex_attention import BlockMask

    extra = {
        k: getattr(block_mask, k)
        for k in ("dq_write_order", "dq_write_order_full", "dq_kv_order", "dq_kv_order_spt")
        if hasattr(block_mask, k)
    }
    return BlockMask(
        tuple(block_mask.seq_lengths),
        block_mask.kv_num_blocks,
        block_mask.kv_indices,
        block_mask.full_kv_num_blocks,
        block_mask.full_kv_indices,
        block_mask.q_num_blocks,
        block_mask.q_indices,
        block_mask.full_q_num_blocks,
        block_mask.full_q_indices,
        BLOCK_SIZE=tuple(block_mask.BLOCK_SIZE),
        mask_mod=mask_mod,
        **extra,
    )


def _rebuild(batch: Any, kind: str, block_mask_fields: Any) -> MaskedBatch:
    bm = _with_mask_mod(block_mask_fields, _mask_of_kind(kind, batch.doc_ids).mask_mod)
    return MaskedBatch(batch=batch, block_mask=bm, mask=kind)


class _Fields:
    """A BlockMask's tensors and sizes without its mask_mod (a closure, which cannot pickle)."""

    def __init__(self, bm: Any) -> None:
        for k in (
            "seq_lengths",
            "kv_num_blocks",
            "kv_indices",
            "full_kv_num_blocks",
            "full_kv_indices",
            "q_num_blocks",
            "q_indices",
            "full_q_num_blocks",
            "full_q_indices",
            "BLOCK_SIZE",
            "dq_write_order",
            "dq_write_order_full",
            "dq_kv_order",
            "dq_kv_order_spt",
        ):
            if hasattr(bm, k):
                setattr(self, k, getattr(bm, k))


@dataclass(frozen=True, eq=False)
class MaskedBatch:
    """A ``PackedBatch`` with the BlockMask of its rows, built where the batch was collated.

    Attributes:
        batch: the ``PackedBatch`` (R, S).
        block_mask: BlockMask of shape (R, 1, S, S) over ``batch.doc_ids``
            (``flexpack.masks.mask_of(block_mask)`` gives its flexpack Mask).
        mask: ``"document_causal"`` or ``"document"``.

    Pickles (DataLoader workers send it to the main process) by its block tensors, its mask
    kind and the batch; the mask_mod is rebuilt on arrival over the arrived ``doc_ids``.
    ``.to(device)`` moves the batch and the BlockMask and rebuilds the mask_mod over the moved
    ``doc_ids``, so nothing is left behind on the CPU.
    """

    batch: Any
    block_mask: Any
    mask: str

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> MaskedBatch:
        """The batch and its BlockMask on ``device``.

        Example:
            >>> from flexpack.data import PackedDataset
            >>> rows = PackedDataset([[1, 2, 3], [4, 5]], max_len=8)
            >>> collate_with_mask([rows[0]]).to("cpu").block_mask.shape
            (1, 1, 8, 8)
        """
        batch = self.batch.to(device, non_blocking=non_blocking)
        moved = self.block_mask.to(device)
        bm = _with_mask_mod(moved, _mask_of_kind(self.mask, batch.doc_ids).mask_mod)
        return MaskedBatch(batch=batch, block_mask=bm, mask=self.mask)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_rebuild, (self.batch, self.mask, _Fields(self.block_mask)))


def collate_with_mask(
    rows: Sequence[Any], *, mask: str = "document_causal", block_size: int = 128
) -> MaskedBatch:
    """``collate`` plus the rows' BlockMask, built in the DataLoader worker.

    The BlockMask comes from the document boundaries (``flexpack.masks``' direct construction,
    no (S, S) evaluation), so building it in the worker is cheap and off the training loop.
    Use ``functools.partial(collate_with_mask, block_size=...)`` as ``collate_fn``.

    Args:
        rows: as for ``collate``.
        mask: ``"document_causal"`` (decoders) or ``"document"`` (bidirectional).
        block_size: BlockMask block size (tokens); S need not be a multiple of it.

    Returns:
        MaskedBatch: ``batch`` (PackedBatch (R, S)) and ``block_mask`` (R, 1, S, S).

    Raises:
        ValueError: an unknown mask, or see ``collate``.

    Example:
        >>> from flexpack.data import PackedDataset
        >>> rows = PackedDataset([[1, 2, 3], [4, 5], [6, 7, 8, 9]], max_len=8)
        >>> out = collate_with_mask([rows[0], rows[1]], block_size=4)
        >>> out.batch.input_ids.shape, out.block_mask.shape
        (torch.Size([2, 8]), (2, 1, 8, 8))
    """
    if mask not in _MASKS:
        raise ValueError(f"mask must be one of {_MASKS}, got {mask!r}.")
    batch = collate(rows)
    bm = _mask_of_kind(mask, batch.doc_ids).block_mask(block_size=block_size)
    return MaskedBatch(batch=batch, block_mask=bm, mask=mask)
