"""Composable attention masks for packed rows, and the top-level mask shortcuts.

A :class:`Mask` pairs an element-level ``mask_mod`` (the plain ``(b, h, q_idx, kv_idx) -> bool``
callable every torch API takes) with a block-level description that builds a ``BlockMask``
straight from the document boundaries (:mod:`flexpack.block_mask`), without evaluating the mask
at every (q, kv) pair as ``create_block_mask`` does. Masks compose with ``&``, ``|`` and ``~``.

Shape legend:
    B: rows of the packed batch; S: tokens per row (queries and keys alike).
    doc_ids: (S,) or (B, S) integer tensor; any negative value marks padding, which attends to
        nothing and is attended by nothing; each id names one run of its row (``[0, 0, 1, 0]``
        is refused, see :func:`document`). (S,) is treated as (1, S). A mask keeps its own copy,
        taken when it is built: every path (BlockMask, flex, SDPA, dense) reads that copy, so
        changing the tensor afterwards changes no mask, and editing ``mask.doc_ids`` in place
        is refused at the next use. Build a new mask for a new layout. uint64 ids must lie
        below 2**63.
    prefix_lengths: (num_docs,) for (S,) doc ids, (B, max_docs) for (B, S) doc ids.
    segment_ids, parents: the prefix-tree layout of :func:`tree`: (S,) or (B, S) segment of each
        token (-1 on padding), and (n,) or (B, max_segments) parent of each segment (-1 a root).

Example:
    >>> import torch
    >>> from flexpack import masks
    >>> doc_ids = torch.tensor([[0, 0, 0, 1, 1, -1]])
    >>> m = masks.document(doc_ids) & masks.causal()
    >>> m.kind, m.mask_mod.__name__
    ('document_causal', 'document_causal')
    >>> m.block_mask(block_size=2).shape
    (1, 1, 6, 6)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexpack import block_mask as _bm
from flexpack._tensor_cache import PerTensor, Stamp, all_match, stamps
from flexpack.layout import _as_doc_ids, _check_runs

__all__ = [
    "Mask",
    "causal",
    "document",
    "document_causal_mask",
    "document_mask",
    "mask_of",
    "padding",
    "prefix_lm",
    "prefix_lm_mask",
    "sliding_window",
    "tree",
]

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

_KINDS = (
    "causal",
    "document",
    "document_causal",
    "prefix_lm",
    "sliding_window",
    "padding",
    "tree",
    "and",
    "or",
    "not",
)


# ----------------------------------------------------------------------------- validation


# The snapshots _as_doc_ids made, per source tensor. Masks built from one unmodified tensor (a
# model's sliding and full layers' masks, from one row's ids) share one snapshot, so what is
# computed per tensor (block order facts, varlen and SDPA plans, with their host syncs) is computed
# once for all of them. A snapshot edited itself (through mask.doc_ids) is replaced.
_SNAPSHOTS: PerTensor[tuple[Tensor, Stamp]] = PerTensor(16)


def _shared_doc_ids(doc_ids: Any, name: str = "doc_ids") -> Tensor:
    """:func:`_as_doc_ids`, reusing the snapshot of an unmodified source tensor."""
    if not isinstance(doc_ids, Tensor):
        return _as_doc_ids(doc_ids, name)

    def snap() -> tuple[Tensor, Stamp]:
        snapshot = _as_doc_ids(doc_ids, name)
        return snapshot, Stamp(snapshot)

    snapshot, stamp = _SNAPSHOTS.get(doc_ids, snap)
    if not stamp.matches(snapshot):
        snapshot, stamp = snap()
        _SNAPSHOTS.put(doc_ids, (snapshot, stamp))
    return snapshot


def _document_ids(doc_ids: Any) -> Tensor:
    """:func:`_shared_doc_ids` for a factory that groups tokens by document: on the host, ids
    naming two separate runs of a row are refused here (flexpack.layout's one rule). On an
    accelerator that check would be a host sync per new tensor, a model's forward one more, so
    it waits for the sync the mask's first use makes anyway (:func:`_check_documents`, the
    attention plans)."""
    d = _shared_doc_ids(doc_ids)
    if d.device.type == "cpu":
        _check_runs(d)
    return d


def _documents_of(mask: Mask) -> list[Tensor]:
    """The doc ids of ``mask``'s document and document_causal factors (those that group tokens
    by document; prefix_lm's refuse split runs when built, padding reads no documents)."""
    if mask.children:
        return [d for c in mask.children for d in _documents_of(c)]
    return [mask.doc_ids] if mask.kind in ("document", "document_causal") else []


def _check_documents(mask: Mask) -> None:
    """Refuse a mask whose documents name an id for two runs of a row, with the host sync its
    block mask makes anyway: packer rows (ids non-decreasing, padding at the end: the block
    mask's order facts, one sync per tensor) cannot split a run, and other rows take the
    generic classification, whose syncs dwarf the check's one."""
    for d in _documents_of(mask):
        if not _bm.packed_layout(d):
            _check_runs(d)


def _check_block_size(block_size: Any) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(
            f"block_size must be a positive int, got {block_size!r} of type "
            f"{type(block_size).__name__}; the usual value is 128."
        )
    if block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size}; try 128.")
    return block_size


def _check_window(window: Any) -> int:
    if isinstance(window, bool) or not isinstance(window, int):
        raise TypeError(
            f"window must be a non-negative int, got {window!r} of type {type(window).__name__}."
        )
    if window < 0:
        raise ValueError(
            f"window must be >= 0 (q_idx - kv_idx <= window), got {window}; window=0 keeps only "
            f"the diagonal and the future."
        )
    return window


def _moved_to(t: Tensor | None, device: torch.device) -> Tensor | None:
    """``t`` on ``device``; a 0-d host tensor (a window limit) is filled there instead of
    copied (on CUDA a pageable host-to-device copy is a stream sync)."""
    if t is None:
        return None
    if t.dim() == 0 and t.device.type == "cpu" and device.type != "cpu":
        return torch.full((), t.item(), dtype=t.dtype, device=device)
    return t.to(device)


def _same_device(want: torch.device, have: torch.device) -> bool:
    """Whether ``want`` names ``have``'s device: no index means any ("cuda" for "cuda:0")."""
    if want.type != have.type:
        return False
    return want.type == "cpu" or want.index is None or want.index == have.index


def _prefix_flags(doc_ids: Tensor, prefix_lengths: Any) -> Tensor:
    """Validate prefix-LM inputs and return (B, S) bool: token lies in its document's prefix."""
    if not isinstance(prefix_lengths, Tensor):
        raise TypeError(
            f"prefix_lengths must be a torch.Tensor of integers, got "
            f"{type(prefix_lengths).__name__}; use torch.as_tensor(prefix_lengths)."
        )
    if prefix_lengths.dtype == torch.bool or prefix_lengths.is_floating_point():
        raise TypeError(
            f"prefix_lengths must hold integer token counts, got dtype {prefix_lengths.dtype}."
        )
    if prefix_lengths.device != doc_ids.device:
        raise ValueError(
            f"prefix_lengths is on {prefix_lengths.device} but doc_ids on {doc_ids.device}; "
            f"move one of them, e.g. prefix_lengths.to(doc_ids.device)."
        )
    B, S = doc_ids.shape
    d = doc_ids.to(torch.int64)
    real = d >= 0
    # Ids must be 0..n-1 in order, each document one contiguous run: every real token either
    # continues the document of the token just before it or opens the next id.
    prev = torch.nn.functional.pad(d[:, :-1], (1, 0), value=-1)
    best = torch.cummax(torch.where(real, d, -1), dim=-1).values
    best_before = torch.nn.functional.pad(best[:, :-1], (1, 0), value=-1)
    ok = ~real | (d == best_before + 1) | ((d == best_before) & (prev == d))
    if not bool(ok.all()):
        _check_runs(d)  # an id in two runs: the refusal every entry point gives
        bad_row = int((~ok).any(-1).nonzero()[0])
        raise ValueError(
            f"prefix_lm needs doc ids 0..n-1 in order with each document contiguous in its row "
            f"(what the packer emits); row {bad_row} is {doc_ids[bad_row].tolist()[:64]}. "
            f"Renumber the rows with flexpack.PackedLayout.from_doc_ids(doc_ids).doc_ids (runs "
            f"numbered 0..n-1 per row; prefix_lengths then follow that order), or use "
            f"document(...) for arbitrary ids."
        )
    num_docs = best[:, -1] + 1  # (B,)
    max_docs = int(num_docs.max())
    pl = prefix_lengths if prefix_lengths.dim() == 2 else prefix_lengths[None]
    expected = f"({max_docs},)" if B == 1 else f"({B}, >= {max_docs})"
    if (
        prefix_lengths.dim() not in (1, 2)
        or pl.shape[0] != B
        or pl.shape[1] < max_docs
        or (prefix_lengths.dim() == 1 and pl.shape[1] != max_docs)
    ):
        raise ValueError(
            f"prefix_lengths must have shape {expected} (one entry per document of each row), "
            f"got {tuple(prefix_lengths.shape)}."
        )
    pl = pl.to(torch.int64)
    n = pl.shape[1]
    lengths = torch.zeros(B, n + 1, dtype=torch.int64, device=d.device)
    lengths.scatter_add_(1, torch.where(real, d, n), torch.ones_like(d))
    lengths = lengths[:, :n]
    if bool((pl < 0).any()) or bool((pl > lengths).any()):
        b, k = (((pl < 0) | (pl > lengths)).nonzero()[0]).tolist()
        raise ValueError(
            f"prefix_lengths[{b}, {k}] = {int(pl[b, k])} but document {k} of row {b} has "
            f"{int(lengths[b, k])} tokens; a prefix length must lie in 0..len(document) "
            f"(0 for absent documents)."
        )
    pos = torch.arange(S, device=d.device).expand(B, S)
    starts = real & (d != prev)
    doc_start = torch.cummax(torch.where(starts, pos, 0), dim=-1).values
    # Padding reads the extra 0 column, which also keeps the gather valid when n == 0.
    limit = torch.gather(torch.nn.functional.pad(pl, (0, 1)), 1, torch.where(real, d, n))
    return real & ((pos - doc_start) < limit)


def _same_layout(masks: tuple[Mask, ...]) -> Tensor | None:
    first = None
    for m in masks:
        for d in m._all_doc_ids():
            if first is None:
                first = d
            elif d.shape != first.shape or d.device != first.device:
                raise ValueError(
                    f"cannot compose masks built from doc_ids of shape {tuple(first.shape)} on "
                    f"{first.device} and of shape {tuple(d.shape)} on {d.device}; build every "
                    f"factor from doc ids of the same (B, S) shape on the same device."
                )
    return first


# ----------------------------------------------------------------------------- mask_mods


def _row_lookup(table: Tensor) -> Callable[[Tensor, Tensor], Tensor]:
    """``lookup(b, idx) -> table[b, idx]`` that is safe for any idx >= 0.

    The (B, S) table is flattened with one padding slot per row (value taken from ``table``'s
    pad) and indices are clamped into it, so flex_attention may evaluate positions past S (the
    tail of the last block) and gets padding there. Flat 1-D indexing also keeps the compiled
    CPU kernel happy.
    """
    B, S = table.shape
    pad_value = -1 if table.dtype != torch.bool else False
    flat = torch.nn.functional.pad(table, (0, 1), value=pad_value).reshape(-1)
    if B == 1:

        def lookup(b: Tensor, idx: Tensor) -> Tensor:
            return flat[torch.clamp(idx, max=S)]

    else:

        def lookup(b: Tensor, idx: Tensor) -> Tensor:
            return flat[b * (S + 1) + torch.clamp(idx, max=S)]

    return lookup


def _version_of(t: Tensor | None) -> int | None:
    """``t``'s in-place version counter; None for no tensor or an inference tensor."""
    try:
        return None if t is None else t._version
    except RuntimeError:  # inference tensors have no version counter (nor in-place edits)
        return None


def _named(fn: MaskMod, name: str) -> MaskMod:
    fn.__name__ = name
    fn.__qualname__ = name
    return fn


def _causal_mod() -> MaskMod:
    def causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return q_idx >= kv_idx

    return causal


def _window_mod(window: int, limit: Tensor) -> MaskMod:
    # ``limit`` is ``window`` as a 0-d tensor: a compiled graph reads it as an input, so a new
    # window at the same shape reuses the compiled kernel (a Python int would be baked into the
    # graph and recompile, 7-18 s each on CPU, against dynamo's recompile limit).
    def sliding_window(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return q_idx - kv_idx <= limit

    return _named(sliding_window, f"sliding_window_{window}")


def _document_mod(doc_ids: Tensor, causal: bool) -> MaskMod:
    doc = _row_lookup(doc_ids)
    if causal:

        def document_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            dq = doc(b, q_idx)
            return (dq == doc(b, kv_idx)) & (dq >= 0) & (q_idx >= kv_idx)

        return document_causal

    def document(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        dq = doc(b, q_idx)
        return (dq == doc(b, kv_idx)) & (dq >= 0)

    return document


def _padding_mod(doc_ids: Tensor) -> MaskMod:
    doc = _row_lookup(doc_ids)

    def padding(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (doc(b, q_idx) >= 0) & (doc(b, kv_idx) >= 0)

    return padding


def _prefix_lm_mod(doc_ids: Tensor, in_prefix: Tensor) -> MaskMod:
    doc = _row_lookup(doc_ids)
    prefix = _row_lookup(in_prefix)

    def prefix_lm(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        dq = doc(b, q_idx)
        same = (dq == doc(b, kv_idx)) & (dq >= 0)
        return same & ((kv_idx <= q_idx) | prefix(b, kv_idx))

    return prefix_lm


def _and_mod(mods: tuple[MaskMod, ...], name: str) -> MaskMod:
    def and_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        out = mods[0](b, h, q_idx, kv_idx)
        for mod in mods[1:]:
            out = out & mod(b, h, q_idx, kv_idx)
        return out

    return _named(and_mask, name)


def _or_mod(mods: tuple[MaskMod, ...], name: str) -> MaskMod:
    def or_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        out = mods[0](b, h, q_idx, kv_idx)
        for mod in mods[1:]:
            out = out | mod(b, h, q_idx, kv_idx)
        return out

    return _named(or_mask, name)


def _not_mod(mod: MaskMod, name: str) -> MaskMod:
    def not_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return ~mod(b, h, q_idx, kv_idx)

    return _named(not_mask, name)


# ----------------------------------------------------------------------------- Mask


class Mask:
    """An attention mask with an element-level ``mask_mod`` and a direct BlockMask builder.

    Build masks with the factories (:func:`causal`, :func:`document`, :func:`prefix_lm`,
    :func:`sliding_window`, :func:`padding`, :func:`tree`) and compose them with ``&``, ``|`` and
    ``~``; ``document(d) & causal()`` (either order) normalizes to kind ``"document_causal"``.

    Attributes:
        kind: one of "causal", "document", "document_causal", "prefix_lm", "sliding_window",
            "padding", "tree", "and", "or", "not".
        mask_mod: plain ``(b, h, q_idx, kv_idx) -> bool Tensor`` callable with a stable
            ``__name__`` (e.g. ``"and(document_causal, sliding_window_256)"``); works with
            ``create_block_mask``, ``and_masks``, ``or_masks`` and ``flex_attention``.
        doc_ids: (B, S) integer tensor, the mask's own copy of the ids it was built from (for
            compositions, that of the first factor that has one), or None. Read it, do not edit
            it: every path (mask_mod, BlockMask, SDPA) must see the same ids, so after an
            in-place edit every use of the mask raises; build a new mask instead.
        window: the window of a sliding_window mask, else None.
        children: the factors of an and/or/not mask, else ().

    Example:
        >>> import torch
        >>> d = torch.tensor([0, 0, 1, 1])
        >>> m = document(d) & sliding_window(1) | ~padding(d)
        >>> m.kind, m.mask_mod.__name__
        ('or', 'or(and(document, sliding_window_1), not(padding))')
    """

    __slots__ = (
        "_doc_ids",
        "_doc_version",
        "_in_prefix",
        "_moved",
        "_window_t",
        "children",
        "kind",
        "mask_mod",
        "window",
    )

    def __init__(
        self,
        kind: str,
        mask_mod: MaskMod,
        *,
        doc_ids: Tensor | None = None,
        window: int | None = None,
        children: tuple[Mask, ...] = (),
        in_prefix: Tensor | None = None,
        window_t: Tensor | None = None,
    ) -> None:
        assert kind in _KINDS, kind
        self.kind = kind
        self.mask_mod = mask_mod
        self._doc_ids = doc_ids
        self._doc_version = _version_of(doc_ids)
        self.window = window
        self.children = children
        self._in_prefix = in_prefix
        self._window_t = window_t  # 0-d int64 twin of ``window``, read by the mask_mod
        # .to(device) results, one per device, with the versions of the tensors they copied.
        self._moved: dict[torch.device, tuple[tuple[Stamp | None, ...], Mask]] = {}
        # Lets mask_of() find the Mask behind a BlockMask (the mask_mod travels with it).
        mask_mod._flexpack_mask = self  # type: ignore[attr-defined]

    @property
    def doc_ids(self) -> Tensor | None:
        """(B, S) the ids every path of this mask reads; raises once they were edited in place.

        The mask_mod reads a padded copy taken at build time while SDPA and the BlockMask read
        this tensor, and tree/prefix masks derive tables from it: an in-place edit would split
        them, so it is refused (the version counter says whether the tensor was written).
        """
        d = self._doc_ids
        if d is not None and self._doc_version is not None and d._version != self._doc_version:
            raise ValueError(
                f"the doc_ids of mask {self.name!r} were modified in place after the mask was "
                f"built; a mask's ids are fixed (its mask_mod, BlockMask and SDPA paths must "
                f"read the same ids). Build a new mask from the edited ids instead, e.g. "
                f"ids = mask.doc_ids.clone(); edit ids; flexpack.masks.document(ids)."
            )
        return d

    @property
    def name(self) -> str:
        """The mask_mod's ``__name__``."""
        return self.mask_mod.__name__

    def __repr__(self) -> str:
        shape = "" if self.doc_ids is None else f", doc_ids={tuple(self.doc_ids.shape)}"
        return f"Mask({self.name}{shape})"

    def _tensors(self) -> list[Tensor]:
        """Every tensor the mask_mod reads (doc ids, prefix flags, window limits)."""
        if self.children:
            return [t for c in self.children for t in c._tensors()]
        own = (self.doc_ids, self._in_prefix, self._window_t, getattr(self, "_tree_ends", None))
        return [t for t in own if t is not None]

    def to(self, device: torch.device | str) -> Mask:
        """This mask with every tensor its mask_mod reads on ``device``.

        A mask_mod reads its doc ids (and window, prefix flags) from the tensors it closes over,
        so moving a BlockMask with ``BlockMask.to`` leaves the mask_mod on the old device. Move
        the Mask instead and build the BlockMask there: ``mask.to("cuda").block_mask()``.
        Returns ``self`` when everything is already there; the moved mask is cached per device
        (until a tensor is modified in place), so calling ``.to`` in every layer copies once.

        Example:
            >>> import torch
            >>> m = document(torch.tensor([0, 0, 1])) & sliding_window(4)
            >>> m.to("cpu") is m, m.to("meta").doc_ids.device.type
            (True, 'meta')
        """
        dev = torch.device(device)
        if all(_same_device(dev, t.device) for t in self._tensors()):
            return self
        tensors = self._tensors()
        hit = self._moved.get(dev)  # stale once a tensor was written (see _tensor_cache)
        if hit is not None and all_match(hit[0], tensors):
            return hit[1]
        moved = self._rebuilt(lambda t: _moved_to(t, dev))
        self._moved[dev] = (stamps(tensors), moved)
        return moved

    def _rebuilt(self, move: Callable[[Tensor | None], Tensor | None]) -> Mask:
        """The same mask over ``move``'s result for each of its tensors."""
        return self if self.kind == "causal" else _from_parts(self._parts(), move)

    def _parts(self) -> tuple:
        """(kind, window, tensors, children's parts): what rebuilds this mask."""
        if self.children:
            return (self.kind, None, (), tuple(c._parts() for c in self.children))
        tensors = {
            "causal": (),
            "sliding_window": (self._window_t,),
            "tree": (self.doc_ids, getattr(self, "_tree_ends", None)),
            "prefix_lm": (self.doc_ids, self._in_prefix),
        }.get(self.kind, (self.doc_ids,))
        return (self.kind, self.window, tensors, ())

    # A mask never changes once built. A deep copy is the same mask over copies of its tensors,
    # with its own mask_mod and an empty device cache (the cache's stamps hold weak references
    # that a copy must not share); a pickled mask is rebuilt from its tensors.
    def __copy__(self) -> Mask:
        return self

    def __deepcopy__(self, memo: dict) -> Mask:
        import copy

        return self._rebuilt(lambda t: copy.deepcopy(t, memo))

    def __reduce__(self) -> tuple:
        return (_from_parts, (self._parts(),))

    def _all_doc_ids(self) -> list[Tensor]:
        if self.children:
            return [d for c in self.children for d in c._all_doc_ids()]
        return [] if self.doc_ids is None else [self.doc_ids]

    # -- composition -------------------------------------------------------------------------

    def __and__(self, other: Mask) -> Mask:
        if not isinstance(other, Mask):
            return NotImplemented
        return _compose("and", (self, other))

    def __or__(self, other: Mask) -> Mask:
        if not isinstance(other, Mask):
            return NotImplemented
        return _compose("or", (self, other))

    def __invert__(self) -> Mask:
        doc_ids = _same_layout((self,))
        return Mask(
            "not", _not_mod(self.mask_mod, f"not({self.name})"), doc_ids=doc_ids, children=(self,)
        )

    # -- block level -------------------------------------------------------------------------

    def _classes(self, block_size: int, q_len: int, kv_len: int, device: torch.device) -> Tensor:
        """(B or 1, nq, nk) int8 in-range block classes (see flexpack.block_mask)."""
        k = self.kind
        if k == "causal":
            return _bm.classify_causal(q_len, kv_len, block_size, device)
        if k == "sliding_window":
            return _bm.classify_sliding_window(self.window, q_len, kv_len, block_size, device)
        if k == "document":
            return _bm.classify_document(self.doc_ids, block_size)
        if k == "document_causal":
            return _bm.combine_and(
                _bm.classify_document(self.doc_ids, block_size),
                _bm.classify_causal(q_len, kv_len, block_size, device),
            )
        if k == "padding":
            return _bm.classify_padding(self.doc_ids, block_size)
        if k == "prefix_lm":
            return _bm.classify_prefix_lm(self.doc_ids, self._in_prefix, block_size)
        parts = [c._classes(block_size, q_len, kv_len, device) for c in self.children]
        if k == "and":
            return _bm.combine_and(*parts)
        if k == "or":
            return _bm.combine_or(*parts)
        return _bm.combine_not(parts[0])

    def block_mask(
        self,
        *,
        block_size: int = 128,
        B: int | None = None,
        Q_LEN: int | None = None,
        KV_LEN: int | None = None,
        device: torch.device | str | None = None,
    ) -> BlockMask:
        """Build the BlockMask from document boundaries, without a per-element evaluation.

        Primitive masks give exactly ``create_block_mask``'s block structure; compositions are
        exact at element level and never looser than exact at block level.

        Args:
            block_size: tokens per block (queries and keys).
            B: batch size; defaults to the doc ids' rows (1 for masks without doc ids). A B=1
                mask may be expanded to any B.
            Q_LEN, KV_LEN: sequence lengths; default S of the doc ids and must equal it for
                masks with doc ids; required for masks without.
            device: defaults to the doc ids' device (the default device without doc ids).

        Returns:
            BlockMask of shape (B, 1, Q_LEN, KV_LEN).

        Raises:
            TypeError/ValueError: unusable block_size, B, lengths or device.

        Example:
            >>> import torch
            >>> bm = document(torch.tensor([0, 0, 1, 1, 1])).block_mask(block_size=2)
            >>> bm.shape, bm.kv_num_blocks.tolist(), bm.full_kv_num_blocks.tolist()
            ((1, 1, 5, 5), [[[0, 1, 2]]], [[[1, 1, 0]]])
        """
        block_size = _check_block_size(block_size)
        doc_ids = _same_layout((self,))
        if doc_ids is not None:
            rows, S = doc_ids.shape
            for name, value in (("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
                if value is not None and value != S:
                    raise ValueError(
                        f"{name}={value} but the mask's doc_ids have S={S} tokens; leave {name} "
                        f"unset or pass doc ids covering all {value} positions (-1 for padding)."
                    )
            q_len = kv_len = S
            if device is not None and not _same_device(torch.device(device), doc_ids.device):
                raise ValueError(
                    f"device={device} but the mask's doc_ids live on {doc_ids.device}; move the "
                    f"doc ids (doc_ids.to(device)) before building the mask."
                )
            dev = doc_ids.device
        else:
            if Q_LEN is None or KV_LEN is None:
                raise ValueError(
                    f"mask {self.name!r} has no doc_ids, so Q_LEN and KV_LEN are required, got "
                    f"Q_LEN={Q_LEN}, KV_LEN={KV_LEN}."
                )
            q_len, kv_len, rows = int(Q_LEN), int(KV_LEN), 1
            if q_len <= 0 or kv_len <= 0:
                raise ValueError(f"Q_LEN and KV_LEN must be positive, got {q_len}, {kv_len}.")
            dev = torch.device(device) if device is not None else torch.get_default_device()
        src = self.to(dev)  # the mask_mod reads its window limits on the BlockMask's device
        if B is not None and (isinstance(B, bool) or not isinstance(B, int) or B < 1):
            raise ValueError(
                f"B must be a positive int (the batch size), got {B!r}; leave B unset to use "
                f"the doc ids' rows."
            )
        if B is not None and B != rows and rows != 1:
            raise ValueError(
                f"B={B} but the mask's doc_ids have {rows} rows; leave B unset or pass B={rows}."
            )
        if not torch.compiler.is_compiling():
            _check_documents(self)
        if self.kind in ("document", "document_causal") and _bm.packed_layout(doc_ids):
            # The packer's layout: index tensors written straight from per-block runs.
            return _bm.document_block_mask(
                doc_ids,
                causal=self.kind == "document_causal",
                block_size=block_size,
                mask_mod=self.mask_mod,
                batch=B if B is not None else rows,
            )
        classes = self._classes(block_size, q_len, kv_len, dev)
        return _bm.build_block_mask(
            classes,
            block_size=block_size,
            q_len=q_len,
            kv_len=kv_len,
            mask_mod=src.mask_mod,
            batch=B if B is not None else classes.shape[0],
        )


def _from_parts(parts: tuple, move: Callable[[Tensor | None], Tensor | None] = lambda t: t) -> Mask:
    """The mask ``Mask._parts`` describes, each tensor through ``move``."""
    kind, window, tensors, children = parts
    if kind in ("and", "or"):
        return _compose(kind, tuple(_from_parts(c, move) for c in children))
    if kind == "not":
        return ~_from_parts(children[0], move)
    if kind == "causal":
        return causal()
    tensors = tuple(move(t) for t in tensors)
    if kind == "sliding_window":
        return _sliding_window(window, tensors[0])
    if kind == "tree":
        return _tree_from_tables(*tensors)
    if kind == "prefix_lm":
        d, flags = tensors
        return Mask("prefix_lm", _named(_prefix_lm_mod(d, flags), "prefix_lm"), doc_ids=d,
                    in_prefix=flags)  # fmt: skip
    builder = {"document": document, "document_causal": _document_causal, "padding": padding}
    return builder[kind](tensors[0])


def _compose(op: str, masks: tuple[Mask, ...]) -> Mask:
    doc_ids = _same_layout(masks)
    if doc_ids is not None:  # window limits follow the doc ids (one device per mask_mod)
        masks = tuple(m.to(doc_ids.device) for m in masks)
    flat: list[Mask] = []
    for m in masks:  # a & (b & c) -> and(a, b, c)
        flat.extend(m.children if m.kind == op else (m,))
    if op == "and":
        flat = _merge_document_causal(flat)
        if len(flat) == 1:
            return flat[0]
    name = f"{op}({', '.join(m.name for m in flat)})"
    mods = tuple(m.mask_mod for m in flat)
    mod = _and_mod(mods, name) if op == "and" else _or_mod(mods, name)
    return Mask(op, mod, doc_ids=doc_ids, children=tuple(flat))


def _merge_document_causal(factors: list[Mask]) -> list[Mask]:
    """Fuse the first document factor with a causal factor into one document_causal mask."""
    kinds = [m.kind for m in factors]
    if "document" not in kinds or "causal" not in kinds:
        return factors
    i, j = kinds.index("document"), kinds.index("causal")
    fused = _document_causal(factors[i].doc_ids)
    out = [m for n, m in enumerate(factors) if n not in (i, j)]
    out.insert(min(i, j), fused)
    return out


# ----------------------------------------------------------------------------- factories


def causal() -> Mask:
    """Causal mask: query q attends key kv iff ``kv <= q``.

    Returns:
        Mask of kind "causal" (no doc_ids; give Q_LEN/KV_LEN to ``.block_mask``).

    Example:
        >>> causal().block_mask(block_size=2, Q_LEN=4, KV_LEN=4).kv_num_blocks.tolist()
        [[[1, 1]]]
    """
    return Mask("causal", _causal_mod())


def sliding_window(window: int) -> Mask:
    """Sliding window: q attends kv iff ``q - kv <= window`` (future keys are not excluded).

    Combine with :func:`causal` for flash-attn's ``window_size=(window, 0)``. The mask_mod reads
    the window from a 0-d tensor (``window`` stays the int), so compiled flex_attention reuses its
    kernel when only the window changes; the tensor follows the doc ids of the masks it is
    composed with, or the ``device`` of ``.block_mask``.

    Args:
        window: non-negative int.

    Raises:
        TypeError: window not an int. ValueError: window < 0.

    Example:
        >>> m = causal() & sliding_window(256)
        >>> m.mask_mod.__name__, m.children[1].window
        ('and(causal, sliding_window_256)', 256)
    """
    window = _check_window(window)
    return _sliding_window(window, torch.tensor(window, dtype=torch.int64))


def _sliding_window(window: int, limit: Tensor) -> Mask:
    mod = _window_mod(window, limit)
    return Mask("sliding_window", mod, window=window, window_t=limit)


def document(doc_ids: Tensor) -> Mask:
    """Document mask: q attends kv iff ``doc_ids[q] == doc_ids[kv] >= 0`` (bidirectional).

    Ids may be any integers, in any order (``[7, 7, 2, 2**40]``), but each id one run of its
    row: ``[0, 0, 1, 1, 0, 0]`` (one document or two?) is refused, as by every entry point
    that reads doc ids; ``flexpack.PackedLayout.from_runs(doc_ids).doc_ids`` gives each run its
    own id. On the host the check runs here; on an accelerator, with the host sync of the
    mask's first use (its block mask, or the plan of ``flexpack.attention``).

    Args:
        doc_ids: (S,) or (B, S) integer tensor; negative marks padding.

    Raises:
        TypeError: doc_ids not an integer tensor. ValueError: rank not 1 or 2, or empty; an id
            names two separate runs of a row.

    Example:
        >>> import torch
        >>> m = document(torch.tensor([0, 0, 1, -1]))
        >>> m.mask_mod(torch.tensor(0), torch.tensor(0), torch.tensor(1), torch.tensor(0))
        tensor(True)
    """
    d = _document_ids(doc_ids)
    return Mask("document", _named(_document_mod(d, causal=False), "document"), doc_ids=d)


def _document_causal(d: Tensor) -> Mask:
    return Mask(
        "document_causal", _named(_document_mod(d, causal=True), "document_causal"), doc_ids=d
    )


def padding(doc_ids: Tensor) -> Mask:
    """Padding mask: q attends kv iff both are real tokens (``doc_ids >= 0``).

    It reads which tokens are real, not which document they belong to, so any ids serve (an id
    naming two runs of a row too, which :func:`document` refuses).

    Args:
        doc_ids: (S,) or (B, S) integer tensor; negative marks padding.

    Raises:
        TypeError: doc_ids not an integer tensor. ValueError: rank not 1 or 2, or empty.

    Example:
        >>> import torch
        >>> padding(torch.tensor([0, 1, -1])).block_mask(block_size=1).kv_num_blocks.tolist()
        [[[0, 0, 0]]]
    """
    d = _shared_doc_ids(doc_ids)
    return Mask("padding", _named(_padding_mod(d), "padding"), doc_ids=d)


def prefix_lm(doc_ids: Tensor, prefix_lengths: Tensor) -> Mask:
    """Prefix-LM mask per document.

    Inside each document, its first ``prefix_lengths[doc]`` tokens attend to each other
    bidirectionally; every other token attends causally and to the whole prefix of its own
    document. Nothing crosses a document boundary; padding attends to nothing.

    Args:
        doc_ids: (S,) or (B, S) integer tensor, ids 0..n-1 in order per row (each document
            contiguous), negative for padding.
        prefix_lengths: (num_docs,) integer for (S,) doc ids; (B, max_docs) for (B, S), with
            0 in the columns of documents a row does not have.

    Raises:
        TypeError: non-integer inputs. ValueError: bad shapes, a prefix longer than its
            document or negative, doc ids not 0..n-1 in order, inputs on different devices.

    Example:
        >>> import torch
        >>> m = prefix_lm(torch.tensor([0, 0, 0, 1, 1]), torch.tensor([2, 0]))
        >>> q, kv = torch.tensor(0), torch.tensor(1)
        >>> bool(m.mask_mod(q, q, q, kv)), bool(m.mask_mod(q, q, q, torch.tensor(2)))
        (True, False)
    """
    d = _shared_doc_ids(doc_ids)
    in_prefix = _prefix_flags(d, prefix_lengths)
    return Mask(
        "prefix_lm",
        _named(_prefix_lm_mod(d, in_prefix), "prefix_lm"),
        doc_ids=d,
        in_prefix=in_prefix,
    )


def mask_of(block_mask: BlockMask) -> Mask | None:
    """The flexpack Mask a BlockMask was built from, or None for foreign BlockMasks.

    Example:
        >>> import torch
        >>> bm = document_causal_mask(torch.tensor([0, 0, 1]))
        >>> mask_of(bm).kind
        'document_causal'
    """
    mod = getattr(block_mask, "mask_mod", None)
    mod = getattr(mod, "fn", mod)  # torch may wrap the mask_mod
    mask = getattr(mod, "_flexpack_mask", None)
    return mask if isinstance(mask, Mask) else None


# ----------------------------------------------------------------------------- shortcuts


def document_mask(doc_ids: Tensor, *, block_size: int = 128) -> BlockMask:
    """BlockMask where q attends kv iff ``doc_ids[q] == doc_ids[kv]`` and both are >= 0.

    Args:
        doc_ids: (S,) or (B, S) integer tensor; negative marks padding.
        block_size: tokens per block.

    Returns:
        BlockMask of shape (B or 1, 1, S, S) on doc_ids' device.

    Raises:
        TypeError/ValueError: see :func:`document`; unusable block_size.

    Example:
        >>> import torch
        >>> document_mask(torch.tensor([0, 0, 1, 1]), block_size=2).kv_num_blocks.tolist()
        [[[0, 0]]]
    """
    return document(doc_ids).block_mask(block_size=block_size)


def document_causal_mask(doc_ids: Tensor, *, block_size: int = 128) -> BlockMask:
    """BlockMask where q attends kv iff ``doc_ids[q] == doc_ids[kv] >= 0`` and ``kv <= q``.

    Args:
        doc_ids: (S,) or (B, S) integer tensor; negative marks padding.
        block_size: tokens per block.

    Returns:
        BlockMask of shape (B or 1, 1, S, S) on doc_ids' device.

    Raises:
        TypeError/ValueError: see :func:`document`; unusable block_size.

    Example:
        >>> import torch
        >>> bm = document_causal_mask(torch.tensor([[0, 0, 1, 1], [0, 0, 0, -1]]), block_size=2)
        >>> bm.shape, bm.full_kv_num_blocks.tolist()
        ((2, 1, 4, 4), [[[0, 0]], [[0, 0]]])
    """
    return _document_causal(_document_ids(doc_ids)).block_mask(block_size=block_size)


def prefix_lm_mask(doc_ids: Tensor, prefix_lengths: Tensor, *, block_size: int = 128) -> BlockMask:
    """BlockMask of :func:`prefix_lm`: bidirectional prefix, causal rest, per document.

    Args:
        doc_ids: (S,) or (B, S) integer, ids 0..n-1 in order per row, negative for padding.
        prefix_lengths: (num_docs,) for (S,) doc ids, (B, max_docs) for (B, S).
        block_size: tokens per block.

    Returns:
        BlockMask of shape (B or 1, 1, S, S) on doc_ids' device.

    Raises:
        TypeError/ValueError: see :func:`prefix_lm`; unusable block_size.

    Example:
        >>> import torch
        >>> prefix_lm_mask(torch.tensor([0, 0, 0, 1]), torch.tensor([3, 1])).shape
        (1, 1, 4, 4)
    """
    return prefix_lm(doc_ids, prefix_lengths).block_mask(block_size=block_size)


# ----------------------------------------------------------------------------- trees


def _tree_ends(segment_ids: Tensor, parents: Any) -> Tensor:
    """Validate a forest layout; return (B, S + 1) int64 subtree ends.

    Segment k of row b (numbered depth-first, a parent before its children) has the descendants
    k..ends[b, k] - 1 (itself included); columns past the row's segments, and the last one, read
    by padding, are -1.
    """
    if not isinstance(parents, Tensor):
        raise TypeError(
            f"parents must be a torch.Tensor of integer segment numbers, got "
            f"{type(parents).__name__}; use torch.as_tensor(parents)."
        )
    if parents.dtype == torch.bool or parents.is_floating_point() or parents.is_complex():
        raise TypeError(
            f"parents must hold integer segment numbers (-1 for a root), got dtype {parents.dtype}."
        )
    if parents.device != segment_ids.device:
        raise ValueError(
            f"parents is on {parents.device} but segment_ids on {segment_ids.device}; move one "
            f"of them, e.g. parents.to(segment_ids.device)."
        )
    B = segment_ids.shape[0]
    seg = segment_ids.to(torch.int64).cpu()
    real = seg >= 0
    # Segment ids 0..n-1 in order, each one contiguous run (what pack_trees emits).
    prev = torch.nn.functional.pad(seg[:, :-1], (1, 0), value=-1)
    best = torch.cummax(torch.where(real, seg, -1), dim=-1).values
    best_before = torch.nn.functional.pad(best[:, :-1], (1, 0), value=-1)
    ok = ~real | (seg == best_before + 1) | ((seg == best_before) & (prev == seg))
    if not bool(ok.all()):
        bad = int((~ok).any(-1).nonzero()[0])
        raise ValueError(
            f"tree needs segment ids 0..n-1 in depth-first order with each segment one "
            f"contiguous run of its row (what flexpack.pack_trees emits); row {bad} is "
            f"{segment_ids[bad].tolist()[:64]}."
        )
    num = (best[:, -1] + 1).tolist()  # segments per row
    M = max(num)
    par = parents if parents.dim() == 2 else parents[None]
    if parents.dim() not in (1, 2) or par.shape[0] != B or par.shape[1] < M:
        expected = f"({M},) or (1, >= {M})" if B == 1 else f"({B}, >= {M})"
        raise ValueError(
            f"parents must have shape {expected} (the parent segment of every segment of each "
            f"row, -1 for a root), got {tuple(parents.shape)}."
        )
    par = par[:, :M].to(torch.int64).cpu()
    k = torch.arange(M)
    live = k[None, :] < torch.tensor(num)[:, None]  # (B, M): columns past a row's segments
    bad = live & ((par < -1) | (par >= k[None, :]))
    if bool(bad.any()):
        b, j = bad.nonzero()[0].tolist()
        allowed = f"-1 (a root) or an earlier segment 0..{j - 1}" if j else "-1: it is a root"
        raise ValueError(
            f"parents[{b}, {j}] = {int(par[b, j])}, but the parent of segment {j} must be "
            f"{allowed}; segments are numbered depth-first, a parent before its children."
        )
    # Subtree ends and sizes, children folded into parents from the last segment up: O(M) steps
    # vectorized over rows. Depth-first numbering holds iff every subtree fills k..end - 1.
    ends = (k + 1).expand(B, M).clone()
    sizes = torch.ones(B, M, dtype=torch.int64)
    up = torch.where(live & (par >= 0), par, M)  # roots and dead columns fold into a spare column
    ends = torch.nn.functional.pad(ends, (0, 1))
    sizes = torch.nn.functional.pad(sizes, (0, 1))
    rows = torch.arange(B)
    for j in range(M - 1, 0, -1):
        p = up[:, j]
        ends[rows, p] = torch.maximum(ends[rows, p], ends[:, j])
        sizes[rows, p] += sizes[:, j]
    ends, sizes = ends[:, :M], sizes[:, :M]
    bad = live & (sizes != ends - k)
    if bool(bad.any()):
        b, j = bad.nonzero()[0].tolist()
        raise ValueError(
            f"segments of row {b} are not numbered depth-first: the subtree of segment {j} is "
            f"not the run {j}..{int(ends[b, j]) - 1} (parents {par[b].tolist()[:64]}). Number "
            f"a parent before its children and a whole subtree before the next sibling."
        )
    ends = torch.where(live, ends, -1)
    # S + 1 columns whatever the segment count (M <= S: a segment holds a token at least), so
    # the tables a compiled flex kernel reads have shapes that depend on S only: a batch with
    # another number of segments (every GRPO step) reuses the graph.
    S = segment_ids.shape[1]
    return torch.nn.functional.pad(ends, (0, S + 1 - M), value=-1).to(segment_ids.device)


def _tree_mod(segment_ids: Tensor, ends: Tensor) -> MaskMod:
    seg = _row_lookup(segment_ids)
    B, W = ends.shape
    flat_end = ends.reshape(-1)

    def tree(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        sq, sk = seg(b, q_idx), seg(b, kv_idx)
        col = torch.where(sk >= 0, sk, W - 1)  # padding reads end -1: sees nothing
        end = flat_end[col] if B == 1 else flat_end[b * W + col]
        # kv's segment is an ancestor of (or is) q's: q's segment lies in kv's subtree.
        return (sk <= sq) & (sq < end) & (kv_idx <= q_idx)

    return tree


class _TreeMask(Mask):
    """A Mask of kind "tree": keeps its own forest tables for the block-level classification."""

    __slots__ = ("_spans", "_tree_ends")  # _spans: flexpack._attention_tree; segments: doc_ids

    def _classes(self, block_size: int, q_len: int, kv_len: int, device: torch.device) -> Tensor:
        return _bm.classify_tree(self.doc_ids, self._tree_ends, block_size)


def tree(segment_ids: Tensor, parents: Tensor) -> Mask:
    """Prefix-tree mask: a token attends causally to its segment and to all of its ancestors.

    A row holds trees of segments (a prompt, its completions, their continuations); ordinary
    documents are one-segment trees. Query q attends key kv iff kv's segment is q's segment or
    one of its ancestors, and ``kv <= q``; padding attends to nothing and is attended by nothing
    (the mask includes the padding mask). Every root-to-leaf path so sees exactly the keys it
    would see run alone. Build rows with :func:`flexpack.pack_trees`.

    Args:
        segment_ids: (S,) or (B, S) integer; per row the segments are numbered 0..n-1 in
            depth-first order (a parent before its children, a whole subtree before the next
            sibling), each segment one contiguous run; negative marks padding.
        parents: (n,) for (S,) segment ids, (B, >= max n) for (B, S): the parent segment of each
            segment, -1 for a root; columns past a row's segments are ignored.

    Returns:
        Mask of kind "tree" (``doc_ids`` holds the segment ids), composable with the others.

    Raises:
        TypeError: non-integer inputs. ValueError: bad shapes, segment ids not 0..n-1 in
            contiguous order, parents not a depth-first numbering, inputs on two devices.

    Example:
        >>> import torch
        >>> seg = torch.tensor([0, 0, 1, 1, 2, -1])  # a prompt (0) with two completions
        >>> m = tree(seg, torch.tensor([-1, 0, 0]))
        >>> q, kv = torch.tensor(4), torch.tensor([0, 1, 2, 3, 4, 5])
        >>> m.mask_mod(torch.tensor(0), torch.tensor(0), q, kv).tolist()  # second completion
        [True, True, False, False, True, False]
    """
    seg = _as_doc_ids(segment_ids, "segment_ids")
    return _tree_from_tables(seg, _tree_ends(seg, parents))


def _tree_from_tables(seg: Tensor, ends: Tensor) -> Mask:
    mask = _TreeMask("tree", _named(_tree_mod(seg, ends), "tree"), doc_ids=seg)
    mask._tree_ends = ends
    mask._spans = None
    return mask
