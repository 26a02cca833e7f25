"""``PackedBatch`` and the gather that fills it: token sequences into packed rows of tensors.

One compiled pass (:func:`flexpack._kernels.assemble_rows`) writes ``input_ids``, ``labels`` and
the layout of every row from a flat token array and a table of segments, whoever made them:
:meth:`flexpack.PackPlan.materialize` (through :func:`_materialize`), the collators and the CLI
(:func:`_assemble`), the streaming buffer and Ray (:func:`_from_pieces`). It knows no plan, so
that :mod:`flexpack.packing` (plans over lengths) imports it and :mod:`flexpack.batch`
(:func:`flexpack.pack_sequences`) stands above both.

Shapes: R rows of S = ``max_len`` tokens; segments ``seg`` (m, 4) int64 with columns (row,
sample, start, stop), rows numbered 0..R-1 in order; ``num_docs`` (R,) segments per row.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from flexpack.layout import PackedLayout


@dataclass(frozen=True, eq=False)
class PackedBatch:
    """Packed rows ready for a model: token ids, labels and their :class:`PackedLayout`.

    Attributes:
        input_ids: (R, S) int64; the pad id on padding.
        labels: (R, S) int64; -100 on padding and on the first token of every document
            (HF-style unshifted: the model shifts), per-sample labels kept elsewhere.
        layout: the :class:`PackedLayout` of the rows; ``doc_ids``, ``position_ids``,
            ``cu_seqlens``, ``seqlens``, ``max_seqlen`` are forwarded from it.

    Example:
        >>> from flexpack import pack_sequences
        >>> batch = pack_sequences([[5, 6, 7], [8, 9]], max_len=8)
        >>> batch.input_ids
        tensor([[5, 6, 7, 8, 9, 0, 0, 0]])
        >>> batch.labels
        tensor([[-100,    6,    7, -100,    9, -100, -100, -100]])
        >>> batch.doc_ids
        tensor([[ 0,  0,  0,  1,  1, -1, -1, -1]], dtype=torch.int32)
        >>> batch.position_ids
        tensor([[0, 1, 2, 0, 1, 0, 0, 0]])
        >>> batch.cu_seqlens, batch.max_seqlen
        (tensor([0, 3, 5], dtype=torch.int32), 3)
    """

    input_ids: Tensor
    labels: Tensor
    layout: PackedLayout

    def __post_init__(self) -> None:
        shape = tuple(self.layout.shape)
        for name in ("input_ids", "labels"):
            t = getattr(self, name)
            if not isinstance(t, Tensor) or tuple(t.shape) != shape:
                got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(
                    f"{name} must be a tensor of the layout's shape {shape}; got {got}"
                )

    @property
    def doc_ids(self) -> Tensor:
        """(R, S) int32: document of each token within its row, -1 on padding."""
        return self.layout.doc_ids

    @property
    def position_ids(self) -> Tensor:
        """(R, S) int64: position within the document, restarting at 0; 0 on padding."""
        return self.layout.position_ids

    @property
    def cu_seqlens(self) -> Tensor:
        """(N + 1,) int32: document boundaries in the unpadded token stream."""
        return self.layout.cu_seqlens

    @property
    def seqlens(self) -> Tensor:
        """(N,) int32: document lengths, row-major."""
        return self.layout.seqlens

    @property
    def max_seqlen(self) -> int:
        """The longest document."""
        return self.layout.max_seqlen

    @property
    def shape(self) -> tuple[int, int]:
        """(R, S)."""
        return self.layout.shape

    def __len__(self) -> int:
        return self.shape[0]

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> PackedBatch:
        """The same batch on ``device``.

        Example:
            >>> from flexpack import pack_sequences
            >>> pack_sequences([[1, 2]], max_len=4).to("cpu").input_ids.device
            device(type='cpu')
        """
        return PackedBatch(
            self.input_ids.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
            self.layout.to(device, non_blocking=non_blocking),
        )

    def __repr__(self) -> str:
        r, s = self.shape
        return f"PackedBatch(shape=({r}, {s}), layout={self.layout!r})"


def _split_item(item: Any) -> tuple[Any, Any]:
    if isinstance(item, Mapping):
        if "input_ids" not in item:
            hint = (
                " flexpack packs token ids and does not tokenize: tokenize first, e.g. "
                "{'input_ids': tokenizer(sample['text'])['input_ids']}."
                if "text" in item
                else ""
            )
            raise ValueError(
                f"a dict sample needs an 'input_ids' key; got keys {sorted(item)[:8]}. "
                f"Rename the column or pass the token lists themselves.{hint}"
            )
        return item["input_ids"], item.get("labels")
    return item, None


_INT64_MAX = np.iinfo(np.int64).max


def _first_non_token(x: Any) -> str:
    """Where a list of token ids first holds something else (for error messages)."""
    for j, t in enumerate(x):
        if isinstance(t, str | bytes):
            return (
                f"; element {j} is {t!r}. flexpack packs token ids and does not tokenize: "
                "tokenize first (e.g. tokenizer(text)['input_ids'])"
            )
        if isinstance(t, bool) or not isinstance(t, int | np.integer):
            return f"; element {j} is {t!r} ({type(t).__name__})"
        if not -_INT64_MAX - 1 <= int(t) <= _INT64_MAX:
            return f"; element {j} is {t}, which does not fit int64"
    return ""


def _to_array(x: Any, what: str) -> np.ndarray:
    if isinstance(x, Tensor):
        x = x.detach().cpu().numpy()
    try:
        arr = x if isinstance(x, np.ndarray) else np.asarray(x)
    except (TypeError, ValueError, OverflowError):  # ragged: [1, [2]]
        arr = np.asarray(x, dtype=object)
    if arr.ndim != 1 or (arr.dtype.kind not in "iu" and arr.size):
        where = _first_non_token(x) if arr.ndim == 1 and not isinstance(x, np.ndarray) else ""
        raise TypeError(
            f"{what} must be a 1-D sequence of integer token ids; got "
            f"{type(x).__name__} with shape {arr.shape} and dtype {arr.dtype}{where}."
        )
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > _INT64_MAX:
        j = int(np.argmax(arr > _INT64_MAX))
        raise ValueError(
            f"{what}: element {j} is {int(arr[j])}, which does not fit int64; token ids must be "
            "below 2**63 (check the tokenizer output)."
        )
    return arr


def _check_pad_id(pad_id: Any) -> int:
    if isinstance(pad_id, bool) or not isinstance(pad_id, int | np.integer):
        raise TypeError(
            f"pad_id must be an int token id (the id written on padding, e.g. "
            f"tokenizer.pad_token_id or 0); got {pad_id!r} of type {type(pad_id).__name__}"
        )
    if not 0 <= int(pad_id) <= _INT64_MAX:
        raise ValueError(
            f"pad_id must be a token id in 0..2**63 - 1 (a vocabulary index, as the CLI's "
            f"--pad-id); got {pad_id}. Padding is told apart by doc_ids == -1 and labels == -100, "
            "not by the id written there: pass e.g. tokenizer.pad_token_id or 0."
        )
    return int(pad_id)


def _materialize(
    seg: np.ndarray,
    num_docs: np.ndarray,
    max_len: int,
    lengths: np.ndarray,
    sequences: Sequence[Any],
    *,
    pad_id: int = 0,
) -> PackedBatch:
    """Gather tokens for segments ``seg`` (rows renumbered 0..R-1) of a plan made for samples of
    ``lengths`` (n_samples,): one concatenation of the samples needed, then index arithmetic; no
    Python loop over tokens or rows (:meth:`flexpack.PackPlan.materialize`)."""
    try:
        n_seq = len(sequences)
    except TypeError:
        raise TypeError(
            f"sequences must be indexable (a list or dataset); got {type(sequences).__name__}"
        ) from None
    if n_seq != lengths.shape[0]:
        raise ValueError(
            f"the plan was made for {lengths.shape[0]} samples but {n_seq} sequences were "
            "given; materialize with the same sequences you packed"
        )
    samples, inverse = np.unique(seg[:, 1], return_inverse=True)
    expected = lengths[samples]

    ids_parts, label_parts, any_labels = [], [], False
    for i in samples.tolist():
        ids, lab = _split_item(sequences[i])
        ids_parts.append(ids)
        label_parts.append(ids if lab is None else lab)
        any_labels |= lab is not None
    flat_ids = _flatten(ids_parts, expected, samples, "")
    flat_labels = _flatten(label_parts, expected, samples, "labels of ") if any_labels else None
    sample_offset = np.cumsum(expected) - expected
    return _assemble(
        seg, num_docs, max_len, flat_ids, flat_labels, sample_offset[inverse], pad_id=pad_id
    )


def _flatten(parts: list[Any], expected: np.ndarray, samples: np.ndarray, what: str) -> np.ndarray:
    """One int64 array of all parts, checking each part's length against the plan."""
    for part, n, i in zip(parts, expected.tolist(), samples.tolist(), strict=True):
        if isinstance(part, Tensor | np.ndarray) and part.ndim != 1:
            raise TypeError(
                f"{what}sequence {i} must be 1-D token ids; got shape {tuple(part.shape)}"
            )
        if len(part) != n:
            if what:
                raise ValueError(
                    f"sequence {i} has {n} input_ids but {len(part)} labels; they must have "
                    "the same length"
                )
            raise ValueError(
                f"sequence {i} has {len(part)} tokens but the plan was made for {n}; "
                "materialize with the same sequences you packed"
            )
    total = int(expected.sum())
    try:
        return _flatten_lists(parts, total)
    except (TypeError, ValueError, OverflowError):  # not plain int lists: the checked path
        pass
    arrays = [
        _to_array(p, f"{what}sequence {i}") for p, i in zip(parts, samples.tolist(), strict=True)
    ]
    if not arrays:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(arrays).astype(np.int64, copy=False)


def _flatten_lists(parts: list[Any], total: int) -> np.ndarray:
    """The fast path of :func:`_flatten`; raises TypeError for anything but int lists.

    Python lists (the common case, e.g. from a tokenizer) go through one C-level pass, twice as
    fast as converting each list. np.fromiter would silently truncate floats: the first element
    of each list is checked to be an int, and a float anywhere makes the C-level sum a float
    (a fifth of the pass's cost), which sends the lists to the checked path. Anything else in a
    list (a str, None, a nested list) makes the sum raise, and an id past int64 makes fromiter
    raise: the checked path then names the sample and the element.
    """
    if all(type(p) is list and (not p or type(p[0]) is int) for p in parts) and isinstance(
        sum(map(sum, parts)), int | np.integer
    ):
        return np.fromiter(itertools.chain.from_iterable(parts), np.int64, total)
    raise TypeError("not plain int lists")


def _assemble(
    seg: np.ndarray,
    num_docs: np.ndarray,
    max_len: int,
    flat_ids: np.ndarray,
    flat_labels: np.ndarray | None,
    seg_source: np.ndarray,
    *,
    pad_id: int = 0,
) -> PackedBatch:
    """Rows from a flat token array: segment j's sample starts at ``flat_ids[seg_source[j]]``.

    seg: (m, 4) int64 with rows 0..R-1; num_docs: (R,) segments per row; flat_labels: same
    shape as flat_ids, or None to use the ids themselves. One compiled pass writes every tensor.
    """
    from flexpack import _kernels

    pad_id = _check_pad_id(pad_id)
    if flat_ids.size and int(flat_ids.min()) < 0:  # as the CLI refuses them
        bad = int(flat_ids[np.argmax(flat_ids < 0)])
        raise ValueError(
            f"a sample holds token id {bad}; token ids are vocabulary indices, >= 0 (an "
            "embedding would read a negative id from the end of the table). Map or drop that "
            "sample; labels may hold -100, input_ids may not."
        )
    no_labels = np.zeros(0, dtype=np.int64)
    input_ids, labels, doc_ids, position_ids, indices = _kernels.assemble_rows(
        seg,
        num_docs.astype(np.int64, copy=False),
        max_len,
        flat_ids.astype(np.int64, copy=False),
        no_labels if flat_labels is None else flat_labels.astype(np.int64, copy=False),
        seg_source.astype(np.int64, copy=False),
        pad_id,
        True,
    )
    layout = PackedLayout._from_parts(
        doc_ids, position_ids, seg[:, 3] - seg[:, 2], num_docs, indices, max_len
    )
    return PackedBatch(
        torch.from_numpy(input_ids.reshape(-1, max_len)),
        torch.from_numpy(labels.reshape(-1, max_len)),
        layout,
    )


def _from_pieces(
    pieces: Sequence[Sequence[np.ndarray]],
    max_len: int,
    *,
    pad_id: int = 0,
    labels: Sequence[Sequence[np.ndarray | None]] | None = None,
) -> PackedBatch:
    """Rows from per-row lists of token arrays, each piece one document in row order.

    The same compiled pass as ``PackPlan.materialize``, for packers that hold their pieces
    themselves (the streaming buffer, Ray's row groups). ``labels`` has the same nesting, None
    where a piece has none (its tokens are used).
    """
    num_docs = np.array([len(row) for row in pieces], dtype=np.int64)
    flat = [np.asarray(p, dtype=np.int64) for row in pieces for p in row]
    lengths = np.array([len(p) for p in flat], dtype=np.int64)
    assert all(sum(len(p) for p in row) <= max_len for row in pieces), "row over max_len"
    seg = np.zeros((len(flat), 4), dtype=np.int64)
    seg[:, 0] = np.repeat(np.arange(len(pieces)), num_docs)
    seg[:, 1] = np.arange(len(flat))
    seg[:, 3] = lengths
    flat_ids = np.concatenate(flat) if flat else np.zeros(0, dtype=np.int64)
    flat_labels = None
    if labels is not None and any(lab is not None for row in labels for lab in row):
        flat_labels = np.concatenate(
            [
                np.asarray(p if lab is None else lab, dtype=np.int64)
                for prow, lrow in zip(pieces, labels, strict=True)
                for p, lab in zip(prow, lrow, strict=True)
            ]
        )
    source = np.cumsum(lengths) - lengths
    return _assemble(seg, num_docs, max_len, flat_ids, flat_labels, source, pad_id=pad_id)
