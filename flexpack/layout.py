"""``PackedLayout``: where every document sits in a batch of packed rows.

One frozen object carries the layout everywhere (packer, masks, varlen kernels, loss). It stores
``doc_ids`` and derives every other view from it, in flash-attn's vocabulary:

====================  ================  ==========================================================
view                  shape, dtype      meaning
====================  ================  ==========================================================
``doc_ids``           (B, S) int32      document of each token within its row; -1 on padding
``position_ids``      (B, S) int64      position of each token in its document; 0 on padding
``seqlens``           (N,) int32        length of every document, row-major
``cu_seqlens``        (N + 1,) int32    cumulative ``seqlens`` over the unpadded token stream
``indices``           (T,) int64        positions of the T real tokens in the flat (B * S,) stream
``max_seqlen``        int               longest document
``num_docs``          (B,) int64        documents per row
====================  ================  ==========================================================

A *document* is a maximal run of equal, non-negative ``doc_ids`` within a row, and each id names
one run only: ``[0, 0, 1, 1, 0, 0]`` (id 0 twice, maybe one document, maybe two) is refused, here
and by every entry point that reads doc ids (masks, attention, loss, context parallelism, model
forwards), with one ValueError that names the id and its positions; :meth:`PackedLayout.from_runs`
numbers each run as its own document. A layout stores its ids renumbered 0..n-1 per row (a copy
of any ids it is given, whatever their integer dtype or size).
Each constructor is named by its input and has an inverse view, so
``PackedLayout.from_X(layout.X) == layout``. Past 2**31 - 1 real tokens ``cu_seqlens`` (int32, as
flash-attn requires) cannot be built: that raises a ``ValueError``, it never wraps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from flexpack._tensor_cache import PerTensor

__all__ = ["PackedLayout"]

_INT32_MAX = 2**31 - 1


def _check_int32_tokens(total: int) -> None:
    """cu_seqlens are int32 (flash-attn's varlen API): refuse, never wrap, past 2**31 - 1."""
    if total > _INT32_MAX:
        raise ValueError(
            f"the batch holds {total} real tokens but cu_seqlens are int32 (at most "
            f"2**31 - 1 = {_INT32_MAX}, flash-attn's varlen format); split it into smaller "
            "batches, e.g. layout rows in chunks."
        )


def _cu_seqlens_of(seqlens: np.ndarray) -> np.ndarray:
    """(N + 1,) int32 cumulative ``seqlens`` (N,) from 0; ValueError past 2**31 - 1 tokens.

    Example:
        >>> _cu_seqlens_of(np.array([3, 2]))
        array([0, 3, 5], dtype=int32)
    """
    cu = np.zeros(seqlens.shape[0] + 1, dtype=np.int64)
    np.cumsum(seqlens, out=cu[1:])
    _check_int32_tokens(int(cu[-1]))
    return cu.astype(np.int32)


def _canonical_doc_ids(d: Tensor, *, one_run_each: bool = True) -> Tensor:
    """(B, S) int32: the runs of ``d`` numbered 0..n-1 per row, -1 on padding (a new tensor).

    Raises ValueError when an id names two separate runs of a row, unless ``one_run_each`` is
    False (then every run is numbered as its own document: :meth:`PackedLayout.from_runs`)."""
    if d.dtype == torch.uint64:  # no comparisons on uint64 tensors; via numpy (checks range)
        d = _as_int_tensor(d.cpu().numpy(), "doc_ids").to(d.device)
    elif d.dtype in (torch.uint16, torch.uint32):  # nor on these: int64 holds them all
        d = d.to(torch.int64)
    start = _run_starts(d) if one_run_each else _first_of_runs(d)
    run = torch.cumsum(start, dim=1, dtype=torch.int32) - 1
    return torch.where(d >= 0, run, torch.full_like(run, -1))


def _first_of_runs(d: Tensor) -> Tensor:
    """(B, S) bool: the first token of every run of equal non-negative ids of ``d`` (B, S)."""
    start = d >= 0
    start[:, 1:] &= d[:, 1:] != d[:, :-1]
    return start


def _has_split_run(d: Tensor) -> Tensor:
    """0-d bool on ``d``'s device: whether an id of ``d`` (B, S) (signed integers) names two
    separate runs of a row. No host sync and fixed shapes, so a caller can read it back with
    the values it syncs for anyway, and it traces under torch.compile.

    Example:
        >>> bool(_has_split_run(torch.tensor([[0, 0, 1, 1, 0, 0]])))
        True
    """
    first = _first_of_runs(d)
    ids = torch.where(first, d, torch.full_like(d, -1)).sort(dim=1).values  # each run's id once
    return ((ids[:, 1:] == ids[:, :-1]) & (ids[:, 1:] >= 0)).any()


def _split_run_on_host(d: Tensor) -> bool:
    """:func:`_has_split_run` of a CPU tensor, in numpy: no torch op, so nothing a sync counter
    (or a dispatch mode) sees; torch's ops where numpy cannot read the tensor (a subclass)."""
    try:
        ids = d.detach().numpy()
    except (RuntimeError, TypeError):
        return bool(_has_split_run(d))
    ids = ids.reshape(-1, ids.shape[-1]).astype(np.int64, copy=False)
    first = ids >= 0
    first[:, 1:] &= ids[:, 1:] != ids[:, :-1]
    runs = np.sort(np.where(first, ids, -1), axis=1)  # each run's id once
    return bool(((runs[:, 1:] == runs[:, :-1]) & (runs[:, 1:] >= 0)).any())


def _run_starts(d: Tensor, where: str = "doc_ids") -> Tensor:
    """(B, S) bool: the first token of every run of equal non-negative ids of ``d`` (B, S)
    (signed integers). The one rule of what a document is, for layouts and for every entry
    point that reads doc ids (masks, attention, loss, context parallelism, the transformers
    integration and its mixers).

    Raises ValueError when an id names two separate runs of a row (``[0, 0, 1, 1, 0]``): one
    document or two? Masks and the loss would join the runs, positions, cu_seqlens and
    recurrent states would split them, so no entry point guesses."""
    start = _first_of_runs(d)
    rows, cols = start.nonzero(as_tuple=True)  # one entry per run, row-major
    if rows.numel() > 1:
        ids = d[rows, cols].to(torch.int64)
        order = torch.argsort(ids, stable=True)
        order = order[torch.argsort(rows[order], stable=True)]  # by (row, id), then position
        r, i = rows[order], ids[order]
        dup = (r[1:] == r[:-1]) & (i[1:] == i[:-1])
        if bool(dup.any()):
            k = int(dup.nonzero()[0])
            row, first, again = int(r[k]), int(cols[order[k]]), int(cols[order[k + 1]])
            raise ValueError(
                f"{where}: doc id {int(i[k])} names two separate runs of row {row} (at "
                f"positions {first} and {again}, with other ids or padding between), but a "
                "document must be one contiguous run of its row. Give each run its own id if "
                f"the runs are separate documents (flexpack.PackedLayout.from_runs({where})"
                ".doc_ids numbers them 0..n-1), or make its tokens contiguous if they are one."
            )
    return start


# Doc ids found to name one run per id, per tensor: a check costs a host sync on an accelerator,
# once per tensor (masks, layers and steps that reuse one tensor pay it once).
_ONE_RUN_EACH: PerTensor[bool] = PerTensor(16)


def _check_runs(doc_ids: Tensor, where: str = "doc_ids") -> None:
    """Refuse ``doc_ids`` (B, S) (signed integers) where an id names two separate runs of a row,
    with :func:`_run_starts`'s ValueError: the one refusal of every public entry point.

    Once per unmodified tensor; one host sync on an accelerator (entry points that sync anyway
    read :func:`_has_split_run` with their own values instead), none on CPU. Skipped while
    torch.compile traces: the check runs eagerly, before the compiled code is reached.
    """
    if torch.compiler.is_compiling():
        return

    def check() -> bool:
        if (
            _split_run_on_host(doc_ids)
            if doc_ids.device.type == "cpu"
            else bool(_has_split_run(doc_ids))
        ):
            _run_starts(doc_ids, where)  # finds the id and positions, and raises
        return True

    _ONE_RUN_EACH.get(doc_ids, check)


def _as_doc_ids(doc_ids: Any, name: str = "doc_ids") -> Tensor:
    """Validate doc ids (S,) or (B, S) and return a (B, S) copy the caller owns (a mask keeps it
    as the one snapshot all its paths read); unsigned ids become int64, so that -1 fits."""
    if not isinstance(doc_ids, Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor of integer document ids, got {type(doc_ids).__name__}; "
            f"convert it with torch.as_tensor({name}, dtype=torch.int32)."
        )
    if doc_ids.dtype == torch.bool or doc_ids.is_floating_point() or doc_ids.is_complex():
        raise TypeError(
            f"{name} must hold integer document ids (e.g. int32, -1 for padding), got dtype "
            f"{doc_ids.dtype}; a boolean padding mask converts with "
            f"`torch.where(mask, 0, -1).int()`, float ids with `.long()`."
        )
    if doc_ids.dim() not in (1, 2):
        raise ValueError(
            f"{name} must have shape (S,) or (B, S), got {doc_ids.dim()} dimensions "
            f"{tuple(doc_ids.shape)}; flatten extra leading dimensions into B with "
            f"`{name}.reshape(-1, {name}.shape[-1])`."
        )
    if doc_ids.numel() == 0:
        raise ValueError(
            f"{name} is empty (shape {tuple(doc_ids.shape)}); a mask needs at least one row of "
            f"at least one token."
        )
    if not doc_ids.dtype.is_signed:  # uint8, ...: valid ids, but -1 (padding) must fit
        # torch has no uint64 comparisons on CPU: ids >= 2**63 are the negative int64 views.
        if doc_ids.dtype == torch.uint64 and bool((doc_ids.view(torch.int64) < 0).any()):
            raise ValueError(
                f"{name} holds uint64 ids >= 2**63, which would "
                f"wrap to negative int64 ids, i.e. padding; use ids below 2**63 (any smaller "
                f"distinct integers name the same documents)."
            )
        doc_ids = doc_ids.to(torch.int64)
    return (doc_ids if doc_ids.dim() == 2 else doc_ids[None]).clone()


def _doc_ids_from_sources(
    B: int,
    S: int,
    padding: Tensor | None,
    doc_ids: Tensor | None,
    seq_idx: Tensor | None,
    position_ids: Tensor | None,
) -> Tensor:
    """(B, S) integer document ids, -1 on padding, from the first source of a model call that is
    given: the one rule flexpack's attention (the transformers integration) and its token mixers
    read the call's documents by.

    Args:
        padding: (B, S') 2-D padding ``attention_mask`` (its last S columns), or None.
        doc_ids, seq_idx: (B, S) or (1, S) integer ids, each naming one run of a row
            (ValueError otherwise, :func:`_check_runs`, the refusal of every flexpack entry
            point); ``doc_ids`` first.
        position_ids: (B, S), or (k, B, S) for mRoPE; without ids a document starts wherever
            they do not step by one (transformers' packed-sequence rule). None of the three:
            one document per row.

    Signed ids keep their dtype (an int64 id of 2**32 stays itself: a cast to int32 would merge it
    with document 0); unsigned ids become int64 so that -1 fits, uint64 ids past int64 refused
    (:func:`_as_doc_ids`)."""
    given = None
    for name, ids in (("doc_ids", doc_ids), ("seq_idx", seq_idx)):
        if ids is not None:
            given = name
            if not isinstance(ids, Tensor) or tuple(ids.shape) not in ((B, S), (1, S)):
                got = tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__
                raise ValueError(
                    f"{name} must be a (B, S) = {(B, S)} integer tensor like input_ids, got {got}."
                )
            # an alias (same storage and version counter), not a view of the caller's tensor:
            # what the caches keep must not hold it (torch.utils.swap_tensors counts its uses)
            ids = ids.detach()
            break
    else:
        if position_ids is None:
            ids = torch.zeros(1, S, dtype=torch.int64)  # one sequence per row: plain causal
        else:
            if position_ids.dim() == 3:  # mRoPE (3 or 4, B, S): the first row steps by one
                position_ids = position_ids[0]  # along a document (temporal, or text positions)
            # transformers' packed-sequence rule: a new sequence wherever positions don't step by 1
            step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
            ids = (step != 1).cumsum(-1)
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise TypeError(
            f"document ids must be an integer tensor like input_ids, got dtype {ids.dtype}; "
            "convert with .long()."
        )
    if not ids.dtype.is_signed:
        ids = _as_doc_ids(ids)  # refuses uint64 ids past int64, else int64
    if given is not None and ids.device.type == "cpu":
        # flexpack's one rule: an id names one run of a row, or the call is refused (here to
        # name the source). On a GPU the check waits for a host sync the forward makes anyway
        # (tests/test_fake_cuda_paths.py holds it to one): flexpack.attention's plan, the
        # mixers' plan (a host copy), PackedLayout.
        _check_runs(ids, given)
    ids = ids.expand(B, S)
    if padding is not None:
        if padding.dim() != 2:
            raise ValueError(
                f"flexpack attention takes a 2-D (B, S) padding attention_mask, got shape "
                f"{tuple(padding.shape)}; pass doc_ids for packed rows instead of a 4-D mask."
            )
        ids = torch.where(padding[:, -S:].to(device=ids.device, dtype=torch.bool), ids, -1)
    return ids.contiguous()


class _Placement(NamedTuple):
    """Where the documents of rows built from per-row seqlens land (all numpy, int64)."""

    doc_local: np.ndarray  # (N,) index of the document within its row
    dest: np.ndarray  # (T,) flat (B * S,) position of every real token, ascending
    offset_in_doc: np.ndarray  # (T,) position of every real token within its document


def _placement(seqlens: np.ndarray, num_docs: np.ndarray, max_len: int) -> _Placement:
    """Index arithmetic for ``from_seqlens``: no Python loop over documents or tokens.
    seqlens (N,) >= 1, num_docs (B,) with sum N; rows must fit."""
    num_rows = num_docs.shape[0]
    n = seqlens.shape[0]
    doc_row = np.repeat(np.arange(num_rows, dtype=np.int64), num_docs)
    first_doc = np.cumsum(num_docs) - num_docs  # (B,) index of each row's first document
    doc_local = np.arange(n, dtype=np.int64) - np.repeat(first_doc, num_docs)
    csum = np.cumsum(seqlens)
    doc_first_token = csum - seqlens
    row_first_token = np.zeros(num_rows, dtype=np.int64)
    has_docs = num_docs > 0
    row_first_token[has_docs] = doc_first_token[first_doc[has_docs]]
    doc_col = doc_first_token - np.repeat(row_first_token, num_docs)
    total = int(csum[-1]) if n else 0
    offset_in_doc = np.arange(total, dtype=np.int64) - np.repeat(doc_first_token, seqlens)
    dest = np.repeat(doc_row * max_len + doc_col, seqlens) + offset_in_doc
    return _Placement(doc_local, dest, offset_in_doc)


def _first_past_int64(ids: np.ndarray) -> int | None:
    """Index of the first uint64 value of ``ids`` that int64 cannot hold (>= 2**63), or None."""
    if ids.dtype != np.uint64 or not ids.size:
        return None
    past = ids > np.iinfo(np.int64).max
    return int(np.argmax(past)) if bool(past.any()) else None


def _as_int64_ids(ids: np.ndarray, where: str) -> np.ndarray:
    """``ids`` as int64, or a ValueError naming ``where`` for a uint64 id >= 2**63 (which a cast
    would wrap to a negative id). The one check of every token reader (datasets, trees, CLI)."""
    j = _first_past_int64(ids)
    if j is not None:
        raise ValueError(
            f"{where}: element {j} is {int(ids[j])}, which does not fit int64; token ids must be "
            "below 2**63 (check the tokenizer output)."
        )
    return ids.astype(np.int64, copy=False)


def _as_int_tensor(x, name: str) -> Tensor:
    if isinstance(x, np.ndarray):
        if x.dtype == np.uint64:
            if x.size and int(x.max()) > np.iinfo(np.int64).max:
                raise ValueError(
                    f"{name} holds {int(x.max())}, past int64; use ids below 2**63 (any smaller "
                    "distinct integers name the same documents)."
                )
            x = x.astype(np.int64)
        x = torch.from_numpy(np.ascontiguousarray(x))
    if not isinstance(x, Tensor):
        try:
            x = torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(
                f"{name} must be a tensor or array of integers; got {type(x).__name__} ({e})"
            ) from None
    if x.dtype == torch.bool or x.is_floating_point() or x.is_complex():
        raise TypeError(
            f"{name} must hold integers; got dtype {x.dtype}. Convert with .long() first."
        )
    return x


@dataclass(frozen=True, eq=False)
class PackedLayout:
    """The layout of B packed rows of S tokens: which document each token belongs to.

    Build it with a constructor named by what you have: :meth:`from_seqlens` (per-row document
    lengths), :meth:`from_doc_ids`, :meth:`from_position_ids` or :meth:`from_cu_seqlens`. The
    views (``position_ids``, ``seqlens``, ``cu_seqlens``, ...) are computed on ``doc_ids``'s
    device on first use and cached.

    Args:
        doc_ids: (B, S) integers of any dtype and size; tokens of one document share a
            non-negative id and are contiguous within a row (an id names one run only); any
            negative value marks padding. The layout keeps a copy renumbered 0..n-1 per row, int32.

    Raises:
        ValueError: not 2-D, or an id names two separate runs of a row.

    Example:
        >>> layout = PackedLayout.from_seqlens([[3, 2], [4]], max_len=6)
        >>> layout.doc_ids
        tensor([[ 0,  0,  0,  1,  1, -1],
                [ 0,  0,  0,  0, -1, -1]], dtype=torch.int32)
        >>> layout.position_ids
        tensor([[0, 1, 2, 0, 1, 0],
                [0, 1, 2, 3, 0, 0]])
        >>> layout.cu_seqlens, layout.max_seqlen
        (tensor([0, 3, 5, 9], dtype=torch.int32), 4)
    """

    doc_ids: Tensor

    def __post_init__(self) -> None:
        d = _as_int_tensor(self.doc_ids, "doc_ids")
        if d.dim() != 2:
            raise ValueError(
                f"doc_ids must be 2-D (B, S); got shape {tuple(d.shape)}. "
                "Use doc_ids[None] for a single row."
            )
        object.__setattr__(self, "doc_ids", _canonical_doc_ids(d))

    @classmethod
    def _trusted(cls, doc_ids: Tensor) -> PackedLayout:
        """A layout of canonical (B, S) int32 doc ids (0..n-1 per row, -1 padding): no checks."""
        layout = object.__new__(cls)
        object.__setattr__(layout, "doc_ids", doc_ids)
        return layout

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_seqlens(
        cls,
        seqlens: Sequence[Sequence[int]],
        max_len: int | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> PackedLayout:
        """Rows from their document lengths, documents packed left, padding at the row ends.

        Args:
            seqlens: one sequence of positive document lengths per row (a row may be empty).
            max_len: S, the row length; ``None`` uses the fullest row.
            device: where the tensors go (default CPU).

        Raises:
            ValueError: a length is < 1, or a row holds more than ``max_len`` tokens.

        Inverse: :attr:`row_seqlens`.

        Example:
            >>> PackedLayout.from_seqlens([[2, 1], [3]]).doc_ids
            tensor([[0, 0, 1],
                    [0, 0, 0]], dtype=torch.int32)
        """
        if isinstance(seqlens, (str, bytes)) or not isinstance(seqlens, Sequence | np.ndarray):
            raise TypeError(
                "seqlens must be a sequence of per-row sequences of document lengths, e.g. "
                f"[[3, 2], [4]]; got {type(seqlens).__name__}"
            )
        rows = []
        for r, row in enumerate(seqlens):
            arr = np.asarray(row.tolist() if isinstance(row, Tensor) else row)
            if arr.size == 0:
                arr = np.zeros(0, dtype=np.int64)
            if arr.ndim != 1 or arr.dtype.kind not in "iu":
                raise TypeError(
                    f"seqlens[{r}] must be a 1-D sequence of integers; got {row!r}. Pass one "
                    "list of document lengths per row, e.g. [[3, 2], [4]]."
                )
            rows.append(arr.astype(np.int64, copy=False))
        num_docs = np.array([len(a) for a in rows], dtype=np.int64)
        flat = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
        if flat.size and flat.min() < 1:
            bad = int(np.argmax(flat < 1))
            raise ValueError(
                f"document lengths must be >= 1; got {int(flat[bad])} (document {bad}, "
                "row-major). Leave empty documents out."
            )
        row_tokens = np.array([int(a.sum()) for a in rows], dtype=np.int64)
        longest = int(row_tokens.max()) if row_tokens.size else 0
        if max_len is None:
            max_len = longest
        if isinstance(max_len, bool) or not isinstance(max_len, int | np.integer):
            raise TypeError(f"max_len must be an int; got {type(max_len).__name__}")
        max_len = int(max_len)
        if max_len < 0 or longest > max_len:
            r = int(np.argmax(row_tokens))
            raise ValueError(
                f"row {r} holds {longest} tokens but max_len={max_len}. "
                "Raise max_len or move documents to other rows."
            )
        return cls._from_placement(flat, num_docs, max_len, device=device)

    @classmethod
    def _from_placement(
        cls,
        seqlens: np.ndarray,
        num_docs: np.ndarray,
        max_len: int,
        *,
        device: torch.device | str | None = None,
    ) -> PackedLayout:
        """Fast path for validated input: builds doc_ids and fills the view caches at once."""
        p = _placement(seqlens, num_docs, max_len)
        num_rows = num_docs.shape[0]
        doc_ids = np.full(num_rows * max_len, -1, dtype=np.int32)
        doc_ids[p.dest] = np.repeat(p.doc_local, seqlens)
        position_ids = np.zeros(num_rows * max_len, dtype=np.int64)
        position_ids[p.dest] = p.offset_in_doc
        return cls._from_parts(
            doc_ids, position_ids, seqlens, num_docs, p.dest, max_len, device=device
        )

    @classmethod
    def _from_parts(
        cls,
        doc_ids: np.ndarray,
        position_ids: np.ndarray,
        seqlens: np.ndarray,
        num_docs: np.ndarray,
        indices: np.ndarray,
        max_len: int,
        *,
        device: torch.device | str | None = None,
    ) -> PackedLayout:
        """A layout whose views were computed together (flat numpy arrays): no recomputation.

        doc_ids (B * S,) int32, position_ids (B * S,) int64, seqlens (N,), num_docs (B,),
        indices (T,) int64 must describe the same canonical layout."""
        num_rows = num_docs.shape[0]
        cu = _cu_seqlens_of(seqlens)

        def t(a: np.ndarray) -> Tensor:
            x = torch.from_numpy(a)
            return x if device is None else x.to(device)

        layout = cls._trusted(t(doc_ids.reshape(num_rows, max_len)))
        cache = layout.__dict__
        cache["position_ids"] = t(position_ids.reshape(num_rows, max_len))
        cache["seqlens"] = t(seqlens.astype(np.int32))
        cache["cu_seqlens"] = t(cu)
        cache["indices"] = t(indices)
        cache["num_docs"] = t(num_docs.astype(np.int64, copy=True))
        cache["max_seqlen"] = int(seqlens.max()) if seqlens.size else 0
        return layout

    @classmethod
    def from_doc_ids(cls, doc_ids: Tensor | np.ndarray | Sequence) -> PackedLayout:
        """The layout of given document ids.

        Args:
            doc_ids: (B, S) or (S,) integers of any size; a document is a run of equal
                non-negative ids in a row, each id one run only; negative ids are padding. The
                layout renumbers the runs 0..n-1 per row (the same documents, as masks see them).

        Raises:
            ValueError: an id names two separate runs of a row (``[0, 0, 1, 0]``).

        Inverse: :attr:`doc_ids`.

        Example:
            >>> layout = PackedLayout.from_doc_ids([[7, 7, 2**40, -5]])
            >>> layout.doc_ids, layout.seqlens
            (tensor([[ 0,  0,  1, -1]], dtype=torch.int32), tensor([2, 1], dtype=torch.int32))
        """
        d = _as_int_tensor(doc_ids, "doc_ids")
        if d.dim() == 1:
            d = d[None]
        return cls(d)

    @classmethod
    def from_runs(cls, doc_ids: Tensor | np.ndarray | Sequence) -> PackedLayout:
        """The layout in which every run of ``doc_ids`` is its own document.

        Where an id names two separate runs of a row (``[0, 0, 1, 1, 0, 0]``), which
        :meth:`from_doc_ids` and every other entry point refuse, each run becomes a document of
        its own: the fix for ids that reuse a number for documents that are in fact separate.
        On ids whose every id is one run it equals :meth:`from_doc_ids`.

        Args:
            doc_ids: (B, S) or (S,) integers of any size; negative ids are padding.

        Inverse: :attr:`doc_ids` (the same runs, numbered 0..n-1 per row).

        Example:
            >>> PackedLayout.from_runs([[0, 0, 1, 1, 0, 0]]).doc_ids  # three documents
            tensor([[0, 0, 1, 1, 2, 2]], dtype=torch.int32)
        """
        d = _as_int_tensor(doc_ids, "doc_ids")
        if d.dim() == 1:
            d = d[None]
        if d.dim() != 2:
            raise ValueError(
                f"doc_ids must be (B, S) or (S,); got shape {tuple(d.shape)}. Flatten extra "
                "leading dimensions into B with doc_ids.reshape(-1, doc_ids.shape[-1])."
            )
        return cls._trusted(_canonical_doc_ids(d, one_run_each=False))

    @classmethod
    def from_position_ids(
        cls, position_ids: Tensor | np.ndarray | Sequence, attention_mask: Tensor | None = None
    ) -> PackedLayout:
        """The layout of position ids that restart at 0 for every document.

        This is what HF's ``DataCollatorWithFlattening`` emits. Padding cannot be told from a
        one-token document by position ids alone, so pass ``attention_mask`` when rows are padded.

        Args:
            position_ids: (B, S) or (S,) integers; a document starts wherever the value is 0.
            attention_mask: (B, S) bool or 0/1, true on real tokens (HF convention); default all.

        Inverse: :attr:`position_ids` (with ``attention_mask=layout.doc_ids >= 0``).

        Example:
            >>> PackedLayout.from_position_ids([[0, 1, 2, 0, 1, 0]],
            ...                                attention_mask=[[1, 1, 1, 1, 1, 0]]).doc_ids
            tensor([[ 0,  0,  0,  1,  1, -1]], dtype=torch.int32)
        """
        pos = _as_int_tensor(position_ids, "position_ids")
        if pos.dim() == 1:
            pos = pos[None]
        if pos.dim() != 2:
            raise ValueError(f"position_ids must be (B, S) or (S,); got shape {tuple(pos.shape)}")
        if attention_mask is None:
            real = torch.ones_like(pos, dtype=torch.bool)
        else:
            real = torch.as_tensor(attention_mask, device=pos.device)
            if real.dim() == 1:
                real = real[None]
            if real.shape != pos.shape:
                raise ValueError(
                    f"attention_mask has shape {tuple(real.shape)} but position_ids has "
                    f"{tuple(pos.shape)}; they must match."
                )
            real = real.bool()
        start = (pos == 0) & real
        start[:, 0] = real[:, 0]
        # A real token after padding starts a document even if its position is not 0.
        start[:, 1:] |= real[:, 1:] & ~real[:, :-1]
        doc = torch.cumsum(start.to(torch.int32), dim=1, dtype=torch.int32) - 1
        return cls._trusted(torch.where(real, doc, torch.full_like(doc, -1)))

    @classmethod
    def from_eos(cls, input_ids: Tensor | np.ndarray | Sequence, eos_id: int) -> PackedLayout:
        """The layout of token rows in which documents are concatenated with an EOS token.

        This is how pretraining pipelines (LitGPT, Megatron, nanoGPT, torchtitan) build rows: a
        stream of documents, each followed by EOS, cut into fixed-length chunks. A document ends
        at (and includes) each EOS token; whatever follows the last EOS of a row is a document
        of its own (the head of the next document in the stream). Rows have no padding.

        Args:
            input_ids: (B, S) or (S,) integer token ids.
            eos_id: the end-of-sequence token id.

        Raises:
            TypeError: ``input_ids`` are not integers, or ``eos_id`` is not an int.
            ValueError: ``eos_id`` cannot occur in ids of this dtype (-1 in uint8, 2**32 + 2 in
                int32): a comparison would wrap it onto another token.

        Example:
            >>> x = torch.tensor([[5, 6, 2, 7, 2, 8]])  # EOS = 2
            >>> PackedLayout.from_eos(x, eos_id=2).doc_ids
            tensor([[0, 0, 0, 1, 1, 2]], dtype=torch.int32)
            >>> from flexpack import document_causal_mask
            >>> mask = document_causal_mask(PackedLayout.from_eos(x, eos_id=2).doc_ids)
        """
        if isinstance(eos_id, bool) or not isinstance(eos_id, int | np.integer):
            raise TypeError(
                f"eos_id must be an int token id; got {eos_id!r} ({type(eos_id).__name__}). "
                "Pass tokenizer.eos_token_id."
            )
        ids = _as_int_tensor(input_ids, "input_ids")
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2:
            raise ValueError(f"input_ids must be (B, S) or (S,); got shape {tuple(ids.shape)}")
        info = torch.iinfo(ids.dtype)
        if not info.min <= int(eos_id) <= info.max:
            raise ValueError(
                f"eos_id={int(eos_id)} cannot occur in input_ids of dtype {ids.dtype} (values "
                f"{info.min}..{info.max}); comparing would wrap it onto another token id. Pass "
                f"the tokenizer's eos_token_id, or ids of a wider dtype (input_ids.long())."
            )
        if ids.dtype == torch.uint64:  # torch has no uint64 == on CPU: compare the int64 bits
            ids, eos_id = ids.view(torch.int64), int(eos_id) - (2**64 if eos_id >= 2**63 else 0)
        is_eos = (ids == int(eos_id)).to(torch.int32)
        # A token's document is the number of EOS tokens strictly before it in its row.
        doc = torch.cumsum(is_eos, dim=1, dtype=torch.int32) - is_eos
        return cls._trusted(doc)  # already canonical: runs 0..n-1 per row, no padding

    @classmethod
    def from_cu_seqlens(
        cls,
        cu_seqlens: Tensor | np.ndarray | Sequence,
        indices: Tensor | np.ndarray | Sequence | None = None,
        *,
        shape: tuple[int, int] | None = None,
    ) -> PackedLayout:
        """The layout of flash-attn varlen metadata: ``cu_seqlens`` over an unpadded token stream.

        Args:
            cu_seqlens: (N + 1,) int, starting at 0, non-decreasing; document i is tokens
                ``cu_seqlens[i]:cu_seqlens[i + 1]`` of the unpadded stream.
            indices: (T,) int64, ascending positions of those tokens in the flat (B * S,)
                padded stream (flash-attn ``unpad_input``); default: tokens fill rows from the
                left, so with ``shape=None`` all documents share one row of T tokens.
            shape: (B, S) of the padded batch; required with ``indices``.

        Raises:
            ValueError: ``cu_seqlens`` is not a valid prefix sum, ``indices`` do not match it,
                or a document would straddle two rows.

        Inverse: :attr:`cu_seqlens` and :attr:`indices`:
        ``from_cu_seqlens(l.cu_seqlens, l.indices, shape=l.shape) == l``.

        Example:
            >>> PackedLayout.from_cu_seqlens([0, 3, 5]).doc_ids
            tensor([[0, 0, 0, 1, 1]], dtype=torch.int32)
            >>> PackedLayout.from_cu_seqlens([0, 3, 5], [0, 1, 2, 4, 5], shape=(2, 3)).doc_ids
            tensor([[ 0,  0,  0],
                    [-1,  0,  0]], dtype=torch.int32)
        """
        cu = _as_int_tensor(cu_seqlens, "cu_seqlens").to(torch.int64)
        if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0:
            raise ValueError(
                f"cu_seqlens must be 1-D (N + 1,) starting at 0; got {cu.tolist()[:8]}"
                f"{'...' if cu.numel() > 8 else ''} of shape {tuple(cu.shape)}"
            )
        lengths = cu[1:] - cu[:-1]
        if bool((lengths < 0).any()):
            raise ValueError("cu_seqlens must be non-decreasing; it is a cumulative sum of seqlens")
        total = int(cu[-1])
        _check_int32_tokens(total)
        device = cu.device
        if shape is not None and (
            not isinstance(shape, Sequence)
            or len(shape) != 2
            or not all(isinstance(x, int | np.integer) and x >= 0 for x in shape)
        ):
            raise ValueError(
                f"shape must be (B, S), two non-negative ints (rows, tokens per row); got "
                f"{shape!r}. For one row of T tokens leave shape unset or pass (1, T)."
            )
        if indices is None:
            if shape is None:
                shape = (1, total)
            num_rows, max_len = shape
            if num_rows != 1 or max_len < total:
                raise ValueError(
                    f"without indices the documents fill one row, so shape must be (1, S >= "
                    f"{total}); got {shape}. Pass indices to place them in several rows."
                )
            idx = torch.arange(total, device=device)
        else:
            if shape is None:
                raise ValueError("indices need shape=(B, S) of the padded batch")
            num_rows, max_len = shape
            idx = _as_int_tensor(indices, "indices").to(device=device, dtype=torch.int64)
            if idx.dim() != 1 or idx.numel() != total:
                raise ValueError(
                    f"indices must be (T,) with T = cu_seqlens[-1] = {total}; got shape "
                    f"{tuple(idx.shape)}"
                )
            if total and (
                bool((idx[1:] <= idx[:-1]).any())
                or int(idx[0]) < 0
                or int(idx[-1]) >= num_rows * max_len
            ):
                raise ValueError(
                    f"indices must be strictly increasing positions in [0, {num_rows * max_len})"
                )
        nonempty = lengths > 0
        # number the non-empty documents only: an empty one (a repeated cu_seqlens value, as
        # fixed-size padded cu_seqlens have) must not leave a gap in a row's ids 0..n-1
        doc_num = torch.cumsum(nonempty, 0) - 1
        doc = torch.repeat_interleave(doc_num, lengths)
        row = idx // max(max_len, 1)
        if bool(nonempty.any()):
            first = cu[:-1][nonempty]
            last = cu[1:][nonempty] - 1
            if bool((row[first] != row[last]).any()):
                raise ValueError(
                    "a document straddles two rows: every document's tokens must lie in one row "
                    "of the (B, S) batch"
                )
        first_doc = torch.full((num_rows,), total + lengths.numel(), device=device)
        first_doc = first_doc.scatter_reduce(0, row, doc, reduce="amin")
        flat = torch.full((num_rows * max_len,), -1, dtype=torch.int32, device=device)
        flat[idx] = (doc - first_doc[row]).to(torch.int32)
        return cls._trusted(flat.reshape(num_rows, max_len))

    # ------------------------------------------------------------------ views
    @property
    def shape(self) -> tuple[int, int]:
        """(B, S): rows and tokens per row."""
        return tuple(self.doc_ids.shape)  # type: ignore[return-value]

    @property
    def device(self) -> torch.device:
        return self.doc_ids.device

    @cached_property
    def _starts(self) -> Tensor:
        """(B, S) bool: the token begins a document."""
        d = self.doc_ids
        real = d >= 0
        start = real.clone()
        start[:, 1:] &= d[:, 1:] != d[:, :-1]
        return start

    @cached_property
    def position_ids(self) -> Tensor:
        """(B, S) int64: position of each token within its document, 0 on padding."""
        start = self._starts
        _, width = self.shape
        col = torch.arange(width, device=self.device).expand_as(start)
        run_start = torch.where(start, col, torch.zeros_like(col)).cummax(dim=1).values
        return torch.where(self.doc_ids >= 0, col - run_start, torch.zeros_like(col))

    @cached_property
    def indices(self) -> Tensor:
        """(T,) int64: positions of the real tokens in the flat (B * S,) stream, ascending."""
        return torch.nonzero(self.doc_ids.reshape(-1) >= 0).reshape(-1)

    @cached_property
    def cu_seqlens(self) -> Tensor:
        """(N + 1,) int32: document boundaries in the unpadded stream (flash-attn varlen)."""
        _check_int32_tokens(self.indices.numel())
        starts = torch.nonzero(self._starts.reshape(-1)[self.indices]).reshape(-1)
        end = torch.tensor([self.indices.numel()], device=self.device)
        return torch.cat([starts, end]).to(torch.int32)

    @cached_property
    def seqlens(self) -> Tensor:
        """(N,) int32: length of every document, row-major."""
        cu = self.cu_seqlens
        return cu[1:] - cu[:-1]

    @cached_property
    def num_docs(self) -> Tensor:
        """(B,) int64: documents in each row."""
        return self._starts.sum(dim=1)

    @cached_property
    def max_seqlen(self) -> int:
        """Length of the longest document (0 if none): ``max_seqlen`` of varlen kernels."""
        s = self.seqlens
        return int(s.max()) if s.numel() else 0

    @property
    def num_tokens(self) -> int:
        """T, the number of real (non-padding) tokens."""
        return int(self.indices.numel())

    @property
    def row_seqlens(self) -> list[list[int]]:
        """Document lengths per row: the inverse of :meth:`from_seqlens`.

        Example:
            >>> PackedLayout.from_seqlens([[3, 2], [4]], 6).row_seqlens
            [[3, 2], [4]]
        """
        lens = self.seqlens.tolist()
        out, k = [], 0
        for n in self.num_docs.tolist():
            out.append(lens[k : k + n])
            k += n
        return out

    # ------------------------------------------------------------------ utilities
    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> PackedLayout:
        """The same layout on ``device`` (cached views move along).

        Example:
            >>> PackedLayout.from_seqlens([[2, 1]]).to("cpu").cu_seqlens
            tensor([0, 2, 3], dtype=torch.int32)
        """
        moved = PackedLayout._trusted(self.doc_ids.to(device, non_blocking=non_blocking))
        for name, value in self.__dict__.items():
            if name == "doc_ids":
                continue
            if isinstance(value, Tensor):
                value = value.to(device, non_blocking=non_blocking)
            moved.__dict__[name] = value
        return moved

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PackedLayout):
            return NotImplemented
        return self.shape == other.shape and torch.equal(
            self.doc_ids.cpu(), other.doc_ids.to("cpu")
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        b, s = self.shape
        return (
            f"PackedLayout(shape=({b}, {s}), docs={int(self.num_docs.sum())}, "
            f"tokens={self.num_tokens}, max_seqlen={self.max_seqlen}, device={self.device})"
        )
