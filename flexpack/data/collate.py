"""Collate packed rows into one PackedBatch (DataLoader ``collate_fn``).

Rows come padded ((S,) per field, as ``PackedDataset`` yields them) or unpadded (a row's tokens
(T_r,) plus its document lengths ``seqlens`` (k_r,), as ``pack_dataset`` stores them); unpadded
rows are padded here, the layout rebuilt from ``seqlens`` by one compiled pass.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_PADDED = ("input_ids", "labels", "doc_ids")


def _as_array(x: Any, what: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.size == 0:
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what} has dtype {arr.dtype}, expected integers.")
    return arr


def _padded_row(row: Any, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if isinstance(row, Mapping):
        missing = [k for k in _PADDED if k not in row]
        if missing:
            raise ValueError(
                f"rows[{i}] has keys {sorted(row)}, missing {missing}; collate expects PackedBatch "
                "rows, padded dicts with input_ids, labels and doc_ids, or unpadded dicts with "
                "input_ids and seqlens (as pack_dataset writes them)."
            )
        parts = [_as_array(row[k], f"rows[{i}][{k!r}]") for k in _PADDED]
    elif all(hasattr(row, k) for k in _PADDED):
        parts = [_as_array(getattr(row, k), f"rows[{i}].{k}") for k in _PADDED]
    else:
        raise TypeError(
            f"rows[{i}] is a {type(row).__name__}, expected a PackedBatch (from PackedDataset / "
            "PackedIterableDataset) or a dict with input_ids, labels, doc_ids (padded rows) or "
            "input_ids, seqlens (unpadded rows)."
        )
    parts = [p[None] if p.ndim == 1 else p for p in parts]
    if any(p.ndim != 2 or p.shape != parts[0].shape for p in parts):
        raise ValueError(
            f"rows[{i}] has input_ids/labels/doc_ids of shapes {[p.shape for p in parts]}, "
            "expected equal shapes (S,) or (B, S)."
        )
    return parts[0], parts[1], parts[2]


def _is_unpadded(row: Any) -> bool:
    return isinstance(row, Mapping) and "seqlens" in row


def rows_from_flat(
    flat_ids: np.ndarray,
    flat_labels: np.ndarray | None,
    seqlens: np.ndarray,
    num_docs: np.ndarray,
    max_len: int,
    *,
    pad_id: int = 0,
) -> Any:
    """Padded rows from unpadded ones: the compiled pass that ``PackPlan.materialize`` uses.

    flat_ids: (T,) the rows' tokens back to back; flat_labels: (T,) or None (labels from the
    ids); seqlens: (N,) document lengths, row-major; num_docs: (R,) documents per row.
    The first token of every document gets label -100, as in every packed row.
    """
    from flexpack._packed_batch import _assemble

    seqlens = np.asarray(seqlens, dtype=np.int64)
    num_docs = np.asarray(num_docs, dtype=np.int64)
    seg = np.zeros((len(seqlens), 4), dtype=np.int64)
    seg[:, 0] = np.repeat(np.arange(len(num_docs)), num_docs)
    seg[:, 1] = np.arange(len(seqlens))
    seg[:, 3] = seqlens
    source = np.cumsum(seqlens) - seqlens
    return _assemble(seg, num_docs, max_len, flat_ids, flat_labels, source, pad_id=pad_id)


def _check_max_len(max_len: Any, longest: int) -> int:
    if max_len is None:
        return max(longest, 1)
    if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len <= 0:
        raise ValueError(f"max_len must be a positive int or None, got {max_len!r}.")
    if longest > max_len:
        raise ValueError(
            f"a row holds {longest} tokens, more than max_len={max_len}; pass the max_len the "
            "rows were packed to (or max_len=None to pad to the longest row of the batch)."
        )
    return int(max_len)


def _collate_unpadded(rows: Sequence[Any], max_len: int | None, pad_id: int) -> Any:
    ids, labels, seqlens, num_docs = [], [], [], []
    for i, row in enumerate(rows):
        if not _is_unpadded(row) or "input_ids" not in row:
            raise ValueError(
                f"rows[{i}] is not an unpadded row (a dict with input_ids and seqlens) while "
                "rows[0] is; collate one kind of row per batch."
            )
        x = _as_array(row["input_ids"], f"rows[{i}]['input_ids']").reshape(-1)
        s = _as_array(row["seqlens"], f"rows[{i}]['seqlens']").reshape(-1)
        if (s <= 0).any() or int(s.sum()) != len(x):
            raise ValueError(
                f"rows[{i}] has {len(x)} input_ids but seqlens {s.tolist()[:8]} (sum "
                f"{int(s.sum())}); seqlens must be positive and sum to the row's tokens."
            )
        lab = row.get("labels")
        if lab is not None:
            lab = _as_array(lab, f"rows[{i}]['labels']").reshape(-1)
            if len(lab) != len(x):
                raise ValueError(
                    f"rows[{i}] has {len(x)} input_ids but {len(lab)} labels; they must match."
                )
        ids.append(x)
        labels.append(lab)
        seqlens.append(s)
        num_docs.append(len(s))
    max_len = _check_max_len(max_len, max(len(x) for x in ids))
    flat_ids = np.concatenate(ids).astype(np.int64, copy=False)
    flat_labels = None
    if any(lab is not None for lab in labels):
        flat_labels = np.concatenate(
            [x if lab is None else lab for x, lab in zip(ids, labels, strict=True)]
        ).astype(np.int64, copy=False)
    return rows_from_flat(
        flat_ids,
        flat_labels,
        np.concatenate(seqlens),
        np.asarray(num_docs),
        max_len,
        pad_id=pad_id,
    )


def collate(rows: Sequence[Any], *, max_len: int | None = None, pad_id: int = 0) -> Any:
    """Concatenate packed rows into one ``PackedBatch``.

    Two kinds of rows:

    - padded: one-row (or k-row) ``PackedBatch`` es, or dicts with ``input_ids``, ``labels``,
      ``doc_ids`` each (S,) or (k, S) (``pack_dataset(..., padded=True)``). All share S.
    - unpadded (what ``pack_dataset`` stores): dicts with ``input_ids`` (T_r,) the row's tokens,
      ``seqlens`` (k_r,) its document lengths and, when kept, ``labels`` (T_r,). They are
      padded to ``max_len`` here and the layout (``doc_ids``, ``position_ids``,
      ``cu_seqlens``) is rebuilt from ``seqlens`` in one compiled pass (no Python per token).

    Args:
        rows: a list of rows of one kind.
        max_len: S for unpadded rows (default: the longest row of this batch); for padded rows
            it must equal S when given.
        pad_id: token id on padding (unpadded rows; padded rows carry theirs).

    Returns:
        PackedBatch with ``input_ids`` (R, S) int64, ``labels`` (R, S) int64 (-100 on padding
        and on each document's first token) and its layout (``doc_ids`` (R, S) int32). Doc ids
        outside int32 are renumbered per row, equal ids staying equal.

    Raises:
        ValueError: no rows, rows of different lengths or kinds, dicts missing a field, a row
            longer than ``max_len``, seqlens that do not sum to the row's tokens.
        TypeError: rows of another type.

    Example:
        >>> from flexpack.data import PackedDataset
        >>> ds = PackedDataset([[1, 2, 3], [4, 5], [6, 7, 8, 9]], max_len=5)
        >>> collate([ds[0], ds[1]]).input_ids.shape
        torch.Size([2, 5])
        >>> row = {"input_ids": [5, 6, 7, 8, 9], "seqlens": [3, 2]}
        >>> batch = collate([row], max_len=8)
        >>> batch.input_ids
        tensor([[5, 6, 7, 8, 9, 0, 0, 0]])
        >>> batch.doc_ids
        tensor([[ 0,  0,  0,  1,  1, -1, -1, -1]], dtype=torch.int32)
        >>> batch.labels
        tensor([[-100,    6,    7, -100,    9, -100, -100, -100]])
    """
    from flexpack._packed_batch import PackedBatch
    from flexpack.layout import PackedLayout

    if len(rows) == 0:
        raise ValueError("collate got no rows; the DataLoader batch is empty.")
    if _is_unpadded(rows[0]):
        return _collate_unpadded(rows, max_len, int(pad_id))
    if all(isinstance(r, PackedBatch) for r in rows):  # tensors stay where they are
        widths = {r.shape[1] for r in rows}
        if len(widths) != 1 or (max_len is not None and widths != {max_len}):
            raise ValueError(
                f"rows have lengths {sorted(widths)}"
                + (f", not max_len={max_len}" if max_len is not None else "")
                + "; pack every row to the same max_len."
            )
        return PackedBatch(
            input_ids=torch.cat([r.input_ids for r in rows]),
            labels=torch.cat([r.labels for r in rows]),
            layout=PackedLayout.from_doc_ids(torch.cat([r.doc_ids for r in rows])),
        )
    parts = [_padded_row(r, i) for i, r in enumerate(rows)]
    widths = {p[0].shape[1] for p in parts}
    if len(widths) != 1:
        raise ValueError(
            f"rows have different lengths {sorted(widths)}; pack every row to the same max_len."
        )
    if max_len is not None and widths != {max_len}:
        raise ValueError(
            f"rows are padded to {widths.pop()} tokens, not max_len={max_len}; drop max_len= "
            "(padded rows keep their length) or pack to that max_len."
        )
    input_ids, labels, doc_ids = (np.concatenate(ts, axis=0) for ts in zip(*parts, strict=True))
    return PackedBatch(
        input_ids=torch.from_numpy(input_ids.astype(np.int64, copy=False)),
        labels=torch.from_numpy(labels.astype(np.int64, copy=False)),
        layout=PackedLayout.from_doc_ids(doc_ids),  # renumbers ids of any size per row
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
    rows: Sequence[Any],
    *,
    mask: str = "document_causal",
    block_size: int = 128,
    max_len: int | None = None,
    pad_id: int = 0,
) -> MaskedBatch:
    """``collate`` plus the rows' BlockMask, built in the DataLoader worker.

    The BlockMask comes from the document boundaries (``flexpack.masks``' direct construction,
    no (S, S) evaluation), so building it in the worker is cheap and off the training loop.
    Use ``functools.partial(collate_with_mask, block_size=...)`` as ``collate_fn``.

    Args:
        rows, max_len, pad_id: as for ``collate``.
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
    batch = collate(rows, max_len=max_len, pad_id=pad_id)
    bm = _mask_of_kind(mask, batch.doc_ids).block_mask(block_size=block_size)
    return MaskedBatch(batch=batch, block_mask=bm, mask=mask)
