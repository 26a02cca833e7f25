"""BlockMasks built straight from document boundaries, without evaluating the mask per element.

``create_block_mask`` evaluates a mask_mod at every (q, kv) pair: O(B * S^2) work and, eagerly,
gigabytes of memory at 16K tokens. A document mask is fully described by per-block statistics of
the doc ids, so this module classifies every (q_block, kv_block) pair as empty, partial or full
from those statistics, combines the classifications of composed masks, and hands the result to
``BlockMask.from_kv_blocks``. Everything here is vectorized torch (no Python loop over documents
or blocks), so it runs on CPU and CUDA alike; memory is O(B * nq * nk), the size of the BlockMask.

Shape legend:
    B: batch rows of the doc ids (1 for masks that do not depend on them).
    S: sequence length (queries and keys alike).
    bs: block size; nq = ceil(Q_LEN / bs) query blocks, nk = ceil(KV_LEN / bs) key blocks.
    classes: (B, nq, nk) int8 with EMPTY = 0, PARTIAL = 1, FULL = 2.

The classes of a primitive describe the pairs that lie inside the sequence ("in range");
``build_block_mask`` then demotes FULL to PARTIAL on blocks that reach past the end, because
``create_block_mask`` pads the element mask with False there and never reports such a block full.
With those three values, composition is arithmetic: ``and`` is the element-wise minimum,
``or`` the maximum and ``not`` is ``2 - x``. That is exact whenever one factor decides the block
(empty or full) and conservative (PARTIAL) otherwise: never looser than exact.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexpack._tensor_cache import PerTensor

EMPTY, PARTIAL, FULL = 0, 1, 2

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "build_block_mask",
    "classify_causal",
    "classify_document",
    "classify_padding",
    "classify_prefix_lm",
    "classify_sliding_window",
    "classify_tree",
    "combine_and",
    "combine_not",
    "combine_or",
    "document_block_mask",
    "packed_layout",
]


def _num_blocks(length: int, block_size: int) -> int:
    return (length + block_size - 1) // block_size


def _block_bounds(length: int, block_size: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """First and last (inclusive) in-range position of each block: two (n,) int64 tensors."""
    start = torch.arange(_num_blocks(length, block_size), device=device) * block_size
    last = torch.clamp(start + block_size, max=length) - 1
    return start, last


def _classes(nonempty: Tensor, full: Tensor) -> Tensor:
    # full implies nonempty, so the sum is 0 (empty), 1 (partial) or 2 (full).
    return nonempty.to(torch.int8) + full.to(torch.int8)


def classify_causal(
    q_len: int, kv_len: int, block_size: int, device: torch.device | str | None = None
) -> Tensor:
    """Classes of the causal mask ``q_idx >= kv_idx``.

    Returns:
        (1, nq, nk) int8 classes.

    Example:
        >>> classify_causal(4, 4, 2)
        tensor([[[1, 0],
                 [2, 1]]], dtype=torch.int8)
    """
    qs, qe = _block_bounds(q_len, block_size, device)
    ks, ke = _block_bounds(kv_len, block_size, device)
    full = qs[:, None] >= ke[None, :]
    nonempty = qe[:, None] >= ks[None, :]
    return _classes(nonempty, full)[None]


def classify_sliding_window(
    window: int,
    q_len: int,
    kv_len: int,
    block_size: int,
    device: torch.device | str | None = None,
) -> Tensor:
    """Classes of the sliding-window mask ``q_idx - kv_idx <= window``.

    Returns:
        (1, nq, nk) int8 classes.

    Example:
        >>> classify_sliding_window(1, 6, 6, 2)
        tensor([[[2, 2, 2],
                 [1, 2, 2],
                 [0, 1, 2]]], dtype=torch.int8)
    """
    qs, qe = _block_bounds(q_len, block_size, device)
    ks, ke = _block_bounds(kv_len, block_size, device)
    full = (qe[:, None] - ks[None, :]) <= window
    nonempty = (qs[:, None] - ke[None, :]) <= window
    return _classes(nonempty, full)[None]


class _BlockStats:
    """Per-block statistics of (B, S) doc ids over the in-range tokens of each block.

    Attributes (all (B, nb)): ``any_real`` (a token >= 0), ``all_real`` (no negative token),
    ``lo``/``hi`` (min/max id over the real tokens; meaningless where not any_real).
    """

    def __init__(self, doc_ids: Tensor, block_size: int) -> None:
        d = _narrow(doc_ids)
        real = d >= 0
        # Out-of-range positions are neither real nor padding.
        pad_token = _blocked(~real, block_size, False)
        d, real = _blocked(d, block_size, -1), _blocked(real, block_size, False)
        big = torch.iinfo(d.dtype).max
        self.any_real = real.any(-1)
        self.all_real = ~pad_token.any(-1)
        self.lo = torch.where(real, d, big).amin(-1)
        self.hi = torch.where(real, d, -big).amax(-1)
        self.single = self.any_real & (self.lo == self.hi)


def _blocked(x: Tensor, block_size: int, fill: bool | int) -> Tensor:
    """(B, S) per-token values as (B, nb, width) blocks, the tail padded with ``fill``.

    One block covers the whole row when block_size >= S: width is min(block_size, S), so memory
    follows S and not block_size (block_size=2**40 is fine).

    The tail is a ``new_full`` of ``x``'s dtype, not ``F.pad(value=fill)``: pad takes its value
    as a float, which rounds integers past 2**53 and turns int64's max into its min (torch 2.13)
    or raises "cannot be converted to type int64_t without overflow" (torch 2.14).
    """
    B, S = x.shape
    nb = _num_blocks(S, block_size)
    width = min(block_size, S)
    tail = nb * width - S
    if tail:
        x = torch.cat([x, x.new_full((B, tail), fill)], dim=1)
    return x.view(B, nb, width)


def _narrow(doc_ids: Tensor) -> Tensor:
    """Doc ids as int32 when they fit the dtype (halves per-token temporaries), else int64."""
    return doc_ids if doc_ids.dtype == torch.int64 else doc_ids.to(torch.int32)


# The order facts of a doc_ids tensor, per tensor: a model that builds two masks from one row's ids
# (Gemma 2/3, Mistral-style configs: sliding and full layers) pays their host sync once per
# forward.
_ORDER: PerTensor[tuple[bool, bool, bool]] = PerTensor(16)


def _order_facts(doc_ids: Tensor) -> tuple[bool, bool, bool]:
    """(adjacent real tokens ordered, a real token right after padding, every real token equal to
    the running maximum before it), in one host sync per tensor."""
    return _ORDER.get(doc_ids, lambda: _compute_order_facts(doc_ids))


def _compute_order_facts(doc_ids: Tensor) -> tuple[bool, bool, bool]:
    d = _narrow(doc_ids)
    real = d >= 0
    both = real[:, 1:] & real[:, :-1]
    adjacent = torch.all(~both | (d[:, 1:] >= d[:, :-1]))
    gap = (real[:, 1:] & ~real[:, :-1]).any()
    running = torch.cummax(torch.where(real, d, -1), dim=-1).values
    monotone = torch.all(~real | (d == running))
    adjacent, gap, monotone = torch.stack([adjacent, gap, monotone]).tolist()  # one transfer
    return bool(adjacent), bool(gap), bool(monotone)


def _rows_sorted(doc_ids: Tensor) -> bool:
    """Whether the real (>= 0) ids of every row are non-decreasing (one host sync per tensor)."""
    # Adjacent real tokens ordered is the whole answer without a real token right after
    # padding (packer layouts: padding at the row end); otherwise every real token must equal
    # the running maximum before it.
    adjacent, gap, monotone = _order_facts(doc_ids)
    return adjacent and (not gap or monotone)


def _nonempty_generic(doc_ids: Tensor, block_size: int) -> Tensor:
    """(B, nb, nb) bool: whether q block i and kv block j share a real id, for arbitrary ids.

    Unique (row, block, id) triples are grouped by (row, id); every pair of blocks inside a group
    shares that id. Work is sum over groups of size^2: at most bs times the block matrix, and
    close to the number of non-empty block pairs for realistic layouts.
    """
    B, S = doc_ids.shape
    device = doc_ids.device
    nb = _num_blocks(S, block_size)
    out = torch.zeros(B * nb * nb, dtype=torch.bool, device=device)
    d = doc_ids.to(torch.int64).reshape(-1)
    pos = torch.arange(B * S, device=device)
    real = d >= 0
    d, pos = d[real], pos[real]
    if d.numel() == 0:
        return out.view(B, nb, nb)
    row = pos // S
    blk = (pos % S) // block_size
    _, rank = torch.unique(d, return_inverse=True)
    n_ids = int(rank.max()) + 1
    # One key per (row, id, block), sorted so that groups (row, id) are contiguous.
    key = torch.unique((row * n_ids + rank) * nb + blk)
    group = key // nb
    blk = key % nb
    row = group // n_ids
    _, sizes = torch.unique_consecutive(group, return_counts=True)
    starts = torch.cumsum(sizes, 0) - sizes
    size_of = torch.repeat_interleave(sizes, sizes)  # group size of every triple
    start_of = torch.repeat_interleave(starts, sizes)  # group start of every triple
    flat_left = row * nb + blk  # (row, q block) of every triple, pre-multiplied
    # Triple t pairs with the size_of[t] members of its group. Layouts where many ids span many
    # blocks make that up to bs times the block matrix, so the pairs go in bounded steps.
    ends = torch.cumsum(size_of, 0)
    steps = torch.arange(1, int(ends[-1]) // _PAIRS + 2, device=device) * _PAIRS
    bounds = torch.searchsorted(ends, steps)
    lo = 0
    for hi in [*bounds.tolist(), key.numel()]:
        hi = max(hi, lo + 1)
        if lo >= key.numel():
            break
        n = size_of[lo:hi]
        left = torch.repeat_interleave(torch.arange(lo, hi, device=device), n)
        first = torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
        right = start_of[left] + torch.arange(left.numel(), device=device) - first
        out[flat_left[left] * nb + blk[right]] = True
        lo = hi
    return out.view(B, nb, nb)


def _document_classes(stats: _BlockStats, nonempty: Tensor) -> Tensor:
    full = (
        (stats.single & stats.all_real)[:, :, None]
        & (stats.single & stats.all_real)[:, None, :]
        & (stats.lo[:, :, None] == stats.lo[:, None, :])
    )
    return _classes(nonempty, full)


def _document_nonempty(doc_ids: Tensor, stats: _BlockStats, block_size: int, sorted_: bool):
    if sorted_:
        # Real ids non-decreasing along the row: for blocks i < j every id of i is <= every id
        # of j, so the id ranges overlap exactly when the blocks share an id.
        return (
            stats.any_real[:, :, None]
            & stats.any_real[:, None, :]
            & (stats.lo[:, :, None] <= stats.hi[:, None, :])
            & (stats.lo[:, None, :] <= stats.hi[:, :, None])
        )
    return _nonempty_generic(doc_ids, block_size)


def classify_document(doc_ids: Tensor, block_size: int) -> Tensor:
    """Classes of the document mask ``doc[q] == doc[kv] >= 0``, exact for arbitrary ids.

    Args:
        doc_ids: (B, S) integer; negative values mark padding.
        block_size: tokens per block.

    Returns:
        (B, nb, nb) int8 classes, nb = ceil(S / block_size).

    Example:
        >>> classify_document(torch.tensor([[0, 0, 0, 1, 1, -1]]), 2)
        tensor([[[2, 1, 0],
                 [1, 1, 1],
                 [0, 1, 1]]], dtype=torch.int8)
    """
    stats = _BlockStats(doc_ids, block_size)
    nonempty = _document_nonempty(doc_ids, stats, block_size, _rows_sorted(doc_ids))
    return _document_classes(stats, nonempty)


def classify_padding(doc_ids: Tensor, block_size: int) -> Tensor:
    """Classes of the padding mask ``doc[q] >= 0 and doc[kv] >= 0``.

    Returns:
        (B, nb, nb) int8 classes.

    Example:
        >>> classify_padding(torch.tensor([[0, 0, 1, -1]]), 2)
        tensor([[[2, 1],
                 [1, 1]]], dtype=torch.int8)
    """
    stats = _BlockStats(doc_ids, block_size)
    side = _classes(stats.any_real, stats.all_real)  # (B, nb): one factor per block
    return torch.minimum(side[:, :, None], side[:, None, :])


def classify_prefix_lm(doc_ids: Tensor, in_prefix: Tensor, block_size: int) -> Tensor:
    """Classes of the prefix-LM mask ``doc[q] == doc[kv] >= 0 and (kv <= q or in_prefix[kv])``.

    Exact when every document is one contiguous run and its prefix its first tokens (what
    ``flexpack.masks.prefix_lm`` validates). Below the block diagonal every pair has kv < q, so
    the mask is the document mask; above it kv > q, and a pair is allowed only when both tokens
    lie in the prefix of the same document, i.e. the document mask of the "prefix doc ids"
    (doc id on prefix tokens, -1 elsewhere). On the diagonal the pair (t, t) is allowed for every
    real token t, and the block is full when it is one document without padding whose tokens
    after the first are all prefix (the causal part covers the rest).

    Args:
        doc_ids: (B, S) integer, 0..n-1 in order per row, negative for padding.
        in_prefix: (B, S) bool, True on the prefix tokens of each document.
        block_size: tokens per block.

    Returns:
        (B, nb, nb) int8 classes.

    Example:
        >>> d = torch.tensor([[0, 0, 0, 0, 1, 1]])
        >>> classify_prefix_lm(d, torch.tensor([[1, 1, 1, 0, 1, 0]]).bool(), 2)
        tensor([[[2, 1, 0],
                 [2, 1, 0],
                 [0, 0, 1]]], dtype=torch.int8)
    """
    S = doc_ids.shape[1]
    nb = _num_blocks(S, block_size)
    sorted_ = True  # validated by the caller: ids 0..n-1 in order
    stats = _BlockStats(doc_ids, block_size)
    doc = _document_classes(stats, _document_nonempty(doc_ids, stats, block_size, sorted_))
    pdoc_ids = torch.where(in_prefix, doc_ids, -1)
    pstats = _BlockStats(pdoc_ids, block_size)
    pdoc = _document_classes(pstats, _document_nonempty(pdoc_ids, pstats, block_size, sorted_))
    i = torch.arange(nb, device=doc_ids.device)
    lower = i[:, None] > i[None, :]
    out = torch.where(lower, doc, pdoc)
    # Diagonal: non-empty iff the block holds a real token (the pair (t, t)). Full iff one
    # document, no padding, and every token but the block's first in the prefix (those are
    # the keys some query of the block sees ahead of itself).
    block_start = (torch.arange(S, device=doc_ids.device) % block_size) == 0
    ok = _blocked(in_prefix | block_start, block_size, True)
    diag_full = stats.single & stats.all_real & ok.all(-1)
    diag = _classes(stats.any_real, diag_full)
    out[:, i, i] = diag
    return out


def combine_and(*classes: Tensor) -> Tensor:
    """Classes of the intersection: empty if any is empty, full if all are full.

    Example:
        >>> a = torch.tensor([[[0, 1, 2]]], dtype=torch.int8)
        >>> combine_and(a, torch.full_like(a, 1))
        tensor([[[0, 1, 1]]], dtype=torch.int8)
    """
    out = classes[0]
    for c in classes[1:]:
        out = torch.minimum(out, c)
    return out


def combine_or(*classes: Tensor) -> Tensor:
    """Classes of the union: full if any is full, empty if all are empty.

    Example:
        >>> a = torch.tensor([[[0, 1, 2]]], dtype=torch.int8)
        >>> combine_or(a, torch.full_like(a, 1))
        tensor([[[1, 1, 2]]], dtype=torch.int8)
    """
    out = classes[0]
    for c in classes[1:]:
        out = torch.maximum(out, c)
    return out


def combine_not(classes: Tensor) -> Tensor:
    """Classes of the complement: full and empty swap, partial stays.

    Example:
        >>> combine_not(torch.tensor([[[0, 1, 2]]], dtype=torch.int8))
        tensor([[[2, 1, 0]]], dtype=torch.int8)
    """
    return FULL - classes


_SERIAL_ELEMENTS = 1 << 15  # torch's intra-op grain size: smaller ops stay on one thread
_SERIAL_MAX_TOTAL = 1 << 20  # outputs up to this many entries are written serially
_PAIRS = 1 << 20  # block pairs per step of _nonempty_generic (~40 MB of temporaries)
_CHUNK = 1 << 18  # block-matrix entries per step of _ordered: bounds its temporaries (~4 MB)


def _ordered(classes: Tensor, value: int, transpose: bool) -> tuple[Tensor, Tensor]:
    """Counts and indices of the blocks in state ``value``, laid out as ``create_block_mask``.

    Args:
        classes: (B, n, m) int8 block states.
        value: the state to list (PARTIAL or FULL).
        transpose: list per column (the q_* tensors) instead of per row (the kv_* tensors).

    Returns:
        (B, 1, rows) int32 counts and (B, 1, rows, cols) int32 indices: per row, the matching
        columns in ascending order, then the others in ascending order (a stable descending
        sort of the 0/1 row, which is what create_block_mask stores).
    """
    if transpose:  # a 1-byte-per-entry copy: rows must be contiguous to flatten
        classes = classes.transpose(-2, -1)
    B, n, m = classes.shape
    classes = classes.reshape(B * n, m)
    device = classes.device
    num = torch.empty(B * n, dtype=torch.int32, device=device)
    indices = torch.empty(B * n, m, dtype=torch.int32, device=device)
    j = torch.arange(m, dtype=torch.int32, device=device)
    # Rows go in a few steps only to bound the temporaries (~17 bytes per entry of a step) to
    # a fraction of the output; each step is vectorized over its rows. Small block matrices go
    # in one step: there the per-op overhead, not memory, is the cost.
    rows = B * n
    step = rows if rows * m <= _CHUNK // 4 else max(1, min(_CHUNK // m, -(-rows // 4)))
    for r in range(0, B * n, step):
        hit = classes[r : r + step] == value  # (rows, m) bool
        cnt = hit.sum(-1, dtype=torch.int32)
        rank = torch.cumsum(hit, -1, dtype=torch.int32)  # 1-based rank among the hits
        # Destination of column j: rank - 1 for a hit; for a miss, after all cnt hits by its
        # rank among the misses: cnt + j - rank.
        dest = (cnt[:, None] + j).sub_(rank)
        torch.where(hit, rank.sub_(1), dest, out=dest)
        del rank, hit
        indices[r : r + step].scatter_(-1, dest.long(), j.expand_as(dest))
        num[r : r + step] = cnt
    return num.view(B, 1, n), indices.view(B, 1, n, m)


def packed_layout(doc_ids: Tensor) -> bool:
    """Whether every row is a packer layout: real ids non-decreasing, padding only at the end.

    One host sync per doc_ids tensor, shared with :func:`_rows_sorted`. Such rows admit
    :func:`document_block_mask`'s direct construction.

    Example:
        >>> packed_layout(torch.tensor([[0, 0, 1, -1]])), packed_layout(torch.tensor([[0, -1, 0]]))
        (True, False)
    """
    adjacent, gap, _ = _order_facts(doc_ids)  # shared with _rows_sorted: one sync per tensor
    return adjacent and not gap


def _document_runs(doc_ids: Tensor, block_size: int) -> tuple[Tensor, ...]:
    """Per block i of a packed layout: the kv blocks sharing a document, as two nested runs.

    Returns (a, c, d, b), each (B, nb) int64: blocks [a, b) share a document with block i
    (non-empty), blocks [c, d) are full (c == d == b when none). The document mask is
    symmetric, so the same runs describe the q blocks of kv block i.

    Every document is one run of tokens [start, end]: block i meets the documents of its first
    and last real tokens and those between, so its non-empty run goes from the block of the
    first one's start to the block of the last one's end. A block is full-capable when one
    document covers it; its full run is the blocks that document covers entirely. Only
    per-token scans and (B, nb) gathers: no sort, search or per-block reduction (those run
    multi-threaded on CPU even for small inputs, which costs more than the work).
    """
    B, S = doc_ids.shape
    device = doc_ids.device
    i32 = torch.int32  # positions and ranks fit (S < 2^31): half the bytes of int64
    real = doc_ids >= 0  # a prefix of each row
    opens = real.clone()  # the token opens a document
    opens[:, 1:] &= doc_ids[:, 1:] != doc_ids[:, :-1]
    rank = torch.cumsum(opens, 1, dtype=i32).sub_(1)  # (B, S): document 0..n-1, runs on
    # starts[b, r]: first token of document r; n_real for r >= the row's document count, so
    # that starts[b, r + 1] - 1 is the last token of document r. One flat table, S + 2 per
    # row; the last slot of each row takes the writes of the tokens that open nothing.
    width = S + 2
    n_real = real.sum(1, dtype=i32)  # (B,)
    starts = n_real.repeat_interleave(width, output_size=B * width)
    row0 = torch.arange(0, B * width, width, dtype=i32, device=device)[:, None]
    slot = torch.where(opens, rank, width - 1).add_(row0).view(-1).long()  # index_copy_: int64
    pos = torch.arange(S, dtype=i32, device=device)
    starts.index_copy_(0, slot, pos.expand(B, S).reshape(-1))
    starts = starts.view(B, width)
    first_pos = torch.arange(0, S, block_size, device=device)  # (nb,) each block's first token
    last_pos = torch.clamp(first_pos + block_size, max=S) - 1  # its last in-range token
    any_real = real[:, first_pos]  # (B, nb): padding only at the row end
    first = rank[:, first_pos].clamp_(min=0).long()  # document of the block's first token
    last = rank[:, last_pos].clamp_(min=0).long()  # of its last real token (rank runs on)
    first_start = torch.gather(starts, 1, first).long()
    last_end = torch.gather(starts, 1, last + 1).long() - 1
    a = first_start // block_size
    b = torch.where(any_real, last_end // block_size + 1, a)
    capable = any_real & (first == last) & real[:, last_pos]
    c = torch.where(capable, -(-first_start // block_size), b)
    d = torch.where(capable, (last_end + 1) // block_size, b)
    return a, c, d, b


def _document_runs_host(ids: np.ndarray, block_size: int) -> tuple[np.ndarray, ...]:
    """:func:`_document_runs` of a host array, in numpy: a search over the run starts.

    A torch op costs microseconds of dispatch, many times the work on a few thousand blocks, so
    on CPU the same runs come from numpy (equal where a block holds a real token; an all-padding
    block gets a == c == d == b, an empty run, as there).
    """
    B, S = ids.shape
    marks = np.empty((B, S), dtype=bool)  # the first token of every run: documents and padding
    marks[:, 0] = True
    np.not_equal(ids[:, 1:], ids[:, :-1], out=marks[:, 1:])
    bounds = np.append(np.flatnonzero(marks), B * S)  # flat run starts, then the end
    first_pos = np.arange(0, S, block_size)
    last_pos = np.minimum(first_pos + block_size, S) - 1
    row0 = np.arange(0, B * S, S)[:, None]
    k = np.searchsorted(bounds, first_pos + row0, "right") - 1  # run of a block's first token
    k_last = np.searchsorted(bounds, last_pos + row0, "right") - 1  # of its last token
    any_real = ids[:, first_pos] >= 0  # padding only at the row end
    last_real = ids[:, last_pos] >= 0
    first_start = bounds[k] - row0
    # The end of the document of the block's last real token: the next run starts after it, or
    # (the last token is padding) the padding run starts right after it.
    after = np.where(last_real, bounds[np.minimum(k_last + 1, bounds.size - 1)], bounds[k_last])
    last_end = after - row0 - 1
    a = first_start // block_size
    b = np.where(any_real, last_end // block_size + 1, a)
    capable = any_real & last_real & (k == k_last)
    c = np.where(capable, -(-first_start // block_size), b)
    d = np.where(capable, (last_end + 1) // block_size, b)
    return a, c, d, b


def _host_ids(doc_ids: Tensor) -> np.ndarray | None:
    """The CPU ids as a numpy array (no copy), or None where numpy cannot read them (a device,
    a tensor subclass, a fake tensor while compiling)."""
    if doc_ids.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    try:
        return doc_ids.detach().numpy()
    except (RuntimeError, TypeError):
        return None


def _run_indices(runs: Tensor | np.ndarray, m: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Counts and indices of rows whose hits are the runs [a, c) and [d, b), a <= c <= d <= b.

    Per row, the hits in ascending order, then the misses in ascending order (the layout of
    ``_ordered``), written without sorting: the index at position p is p plus an offset that
    changes at four breakpoints, so one scatter of the steps and a cumulative sum give it, in
    the output buffer itself (no temporaries of the output's size).

    Args:
        runs: (4, rows) int64, the rows' a, c, d, b: a tensor on ``device``, or a numpy array
            for a CPU output (the per-row arithmetic then runs in numpy).
        m: columns.
        device: where the output goes.

    Returns:
        (rows,) int32 counts and (rows, m) int32 indices.
    """
    xp = np if isinstance(runs, np.ndarray) else torch
    a, c, d, b = runs
    n1 = c - a
    cnt = n1 + (b - d)
    zero = xp.zeros_like(a)
    # Offset by segment: hits of run 1 -> a; of run 2 -> d - n1; misses before a -> -cnt;
    # misses in [c, d) -> c - a - cnt; past b -> 0 (the index is the position there).
    values = xp.stack((zero, a, d - n1, -cnt, c - a - cnt, zero), -1)
    starts = xp.stack((zero, n1, cnt, cnt + a, b), -1)
    # A segment starting at m adds nothing: park it on column 0 with a step of 0.
    inside = starts < m
    steps = torch.as_tensor(xp.where(inside, values[:, 1:] - values[:, :-1], 0), dtype=torch.int32)
    starts = torch.as_tensor(xp.where(inside, starts, 0), dtype=torch.int64)
    cnt = torch.as_tensor(cnt, dtype=torch.int32)
    rows = cnt.numel()
    out = torch.empty(rows, m, dtype=torch.int32, device=device)
    j = torch.arange(m, dtype=torch.int32, device=device)
    # On CPU, a small output is written in pieces below torch's intra-op grain size (32768
    # elements): each op then runs on the calling thread. A parallel region costs a thread
    # wake-up, which on a loaded machine (a descheduled worker) is milliseconds, many times
    # the work itself. Large outputs keep a few parallel pieces.
    total = rows * m
    piece = _SERIAL_ELEMENTS if total <= _SERIAL_MAX_TOTAL else max(total // 4, _SERIAL_ELEMENTS)
    step = rows if device.type != "cpu" else max(1, piece // m)
    for r in range(0, rows, step):
        o = out[r : r + step].zero_()
        o.scatter_add_(1, starts[r : r + step], steps[r : r + step])
        o.cumsum_(1)
        o.add_(j)
    return cnt, out


def document_block_mask(
    doc_ids: Tensor,
    *,
    causal: bool,
    block_size: int,
    mask_mod: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor],
    batch: int | None = None,
) -> BlockMask:
    """The document (or document-causal) BlockMask of a packed layout, written directly.

    For ids in order with padding at the row ends (:func:`packed_layout`), the kv blocks that
    share a document with a q block form one run, full in the middle and partial at its ends,
    and the q side mirrors it. The index tensors are written from those per-block runs, without
    classifying or ordering a (B, nq, nk) tensor: identical to ``create_block_mask``'s.

    Args:
        doc_ids: (B, S) integer, a packed layout (check with :func:`packed_layout`).
        causal: add ``q_idx >= kv_idx``.
        block_size: tokens per block.
        mask_mod: the element mask the kernel applies inside partial blocks.
        batch: expand B=1 doc ids to this many rows.

    Example:
        >>> d = torch.tensor([[0, 0, 0, 1, 1, -1]])
        >>> bm = document_block_mask(d, causal=True, block_size=2,
        ...                          mask_mod=lambda b, h, q, kv: q >= kv)
        >>> bm.kv_num_blocks.tolist(), bm.full_kv_num_blocks.tolist()
        ([[[1, 2, 2]]], [[[0, 0, 0]]])
    """
    B, S = doc_ids.shape
    nb = _num_blocks(S, block_size)
    ids = _host_ids(doc_ids)
    if ids is None:
        xp, i = torch, torch.arange(nb, device=doc_ids.device)
        a, c, d, b = _document_runs(doc_ids, block_size)
    else:  # the same arithmetic in numpy: on CPU, torch's dispatch costs more than the work
        xp, i = np, np.arange(nb)
        a, c, d, b = _document_runs_host(ids, block_size)
    if batch is not None and batch != B:
        a, c, d, b = (xp.broadcast_to(x, (batch, nb)) for x in (a, c, d, b))
        B = batch
    if S % block_size:  # the tail block reaches past S: never full (as create_block_mask)
        # As a column it is out of every full run already (d <= S // block_size); as a row,
        # its full run goes.
        d = xp.where(i == nb - 1, c, d)

    def side(a, c, d, b) -> list:  # partial runs [a, c) + [d, b), full run [c, d)
        empty = c >= d
        c, d = xp.where(empty, b, c), xp.where(empty, b, d)
        return [a, c, d, b, c, d, d, d]

    if causal:
        diag = int(block_size == 1)  # a diagonal block is full only for 1-token blocks
        bk = xp.minimum(b, i + 1)  # kv side, row = q block i: keys up to block i
        runs = side(xp.minimum(a, bk), c, xp.minimum(d, i + diag), bk)
        # q side, row = kv block i: queries from block i on (the mask is symmetric before
        # the causal cut, so the document runs serve both sides).
        runs += side(xp.minimum(xp.maximum(a, i), b), xp.maximum(c, i + 1 - diag), d, b)
    else:
        runs = side(a, c, d, b)
    stacked = xp.stack(runs).reshape(-1, 4, B * nb).swapaxes(0, 1).reshape(4, -1)
    num, idx = _run_indices(stacked, nb, doc_ids.device)
    num, idx = num.view(-1, B, 1, nb), idx.view(-1, B, 1, nb, nb)
    kv, q = (0, 1), (2, 3) if causal else (0, 1)
    return BlockMask(
        seq_lengths=(S, S),
        kv_num_blocks=num[kv[0]],
        kv_indices=idx[kv[0]],
        full_kv_num_blocks=num[kv[1]],
        full_kv_indices=idx[kv[1]],
        q_num_blocks=num[q[0]],
        q_indices=idx[q[0]],
        full_q_num_blocks=num[q[1]],
        full_q_indices=idx[q[1]],
        BLOCK_SIZE=(block_size, block_size),
        mask_mod=mask_mod,
    )


def build_block_mask(
    classes: Tensor,
    *,
    block_size: int,
    q_len: int,
    kv_len: int,
    mask_mod: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor],
    batch: int | None = None,
) -> BlockMask:
    """A BlockMask of shape (B, 1, q_len, kv_len) from in-range block classes.

    Blocks that reach past ``q_len`` or ``kv_len`` are demoted from full to partial, matching
    ``create_block_mask``.

    Args:
        classes: (B, nq, nk) int8 in {EMPTY, PARTIAL, FULL}.
        block_size: tokens per block, both sides.
        q_len, kv_len: sequence lengths.
        mask_mod: the element mask the kernel applies inside partial blocks.
        batch: expand a B=1 classification to this many rows.

    Example:
        >>> bm = build_block_mask(classify_causal(4, 4, 2), block_size=2, q_len=4, kv_len=4,
        ...                       mask_mod=lambda b, h, q, kv: q >= kv)
        >>> bm.kv_num_blocks.tolist(), bm.full_kv_num_blocks.tolist()
        ([[[1, 1]]], [[[0, 1]]])
    """
    if batch is not None and classes.shape[0] != batch:
        classes = classes.expand(batch, *classes.shape[1:])
    if q_len % block_size:
        classes = classes.clone()
        classes[:, -1] = torch.clamp(classes[:, -1], max=PARTIAL)
    if kv_len % block_size:
        if q_len % block_size == 0:
            classes = classes.clone()
        classes[:, :, -1] = torch.clamp(classes[:, :, -1], max=PARTIAL)
    kv_num, kv_idx = _ordered(classes, PARTIAL, transpose=False)
    full_kv_num, full_kv_idx = _ordered(classes, FULL, transpose=False)
    q_num, q_idx = _ordered(classes, PARTIAL, transpose=True)
    full_q_num, full_q_idx = _ordered(classes, FULL, transpose=True)
    return BlockMask(
        seq_lengths=(q_len, kv_len),
        kv_num_blocks=kv_num,
        kv_indices=kv_idx,
        full_kv_num_blocks=full_kv_num,
        full_kv_indices=full_kv_idx,
        q_num_blocks=q_num,
        q_indices=q_idx,
        full_q_num_blocks=full_q_num,
        full_q_indices=full_q_idx,
        BLOCK_SIZE=(block_size, block_size),
        mask_mod=mask_mod,
    )


def classify_tree(segment_ids: Tensor, ends: Tensor, block_size: int) -> Tensor:
    """Classes of the prefix-tree mask, exact, from per-block statistics: O(S + B * nb^2).

    Segments are numbered 0..n-1 depth-first and laid out in order, so the subtree of segment s
    is the run s..ends[s] - 1 and the pair (q, kv) is allowed iff ``kv <= q`` and
    ``seg[kv] <= seg[q] < ends[seg[kv]]``. For a key block j before a query block i every key
    precedes every query, so the block is non-empty iff its smallest query segment lies below
    the largest subtree end among its keys, and full iff both blocks are free of padding and
    its largest query segment lies below the smallest subtree end among its keys. A diagonal
    block holds (t, t) for each real t and is full only when it holds one position; blocks
    after the diagonal are empty.

    Args:
        segment_ids: (B, S) integer, 0..n-1 in contiguous depth-first order per row, negative
            for padding (as ``flexpack.masks.tree`` validates).
        ends: (B, W) integer subtree ends, W > the segment count (``flexpack.masks.tree`` keeps
            W = S + 1): segment s's subtree is s..ends[b, s] - 1; the last column, read by
            padding, is -1.
        block_size: tokens per block.

    Returns:
        (B, nb, nb) int8 classes, nb = ceil(S / block_size).

    Example:
        >>> seg = torch.tensor([[0, 0, 1, 1, 2, 2]])  # a root with two children
        >>> classify_tree(seg, torch.tensor([[3, 2, 3, -1]]), 2)
        tensor([[[1, 0, 0],
                 [2, 1, 0],
                 [2, 0, 1]]], dtype=torch.int8)
    """
    S = segment_ids.shape[1]
    nb = _num_blocks(S, block_size)
    stats = _BlockStats(segment_ids, block_size)
    seg = segment_ids.to(torch.int64)
    real = seg >= 0
    W = ends.shape[1]
    tok_end = torch.gather(ends.to(torch.int64), 1, torch.where(real, seg, W - 1))  # (B, S)
    big = torch.iinfo(torch.int64).max
    max_end = _blocked(torch.where(real, tok_end, -1), block_size, -1).amax(-1)  # (B, nb)
    min_end = _blocked(torch.where(real, tok_end, big), block_size, big).amin(-1)
    both = stats.any_real[:, :, None] & stats.any_real[:, None, :]  # (B, nq, nk)
    nonempty = both & (stats.lo.to(torch.int64)[:, :, None] < max_end[:, None, :])
    full = (
        both
        & (stats.all_real[:, :, None] & stats.all_real[:, None, :])
        & (stats.hi.to(torch.int64)[:, :, None] < min_end[:, None, :])
    )
    i = torch.arange(nb, device=segment_ids.device)
    lower = i[:, None] > i[None, :]
    out = torch.where(lower, _classes(nonempty, full), EMPTY).to(torch.int8)
    width = torch.clamp(S - i * block_size, max=block_size)  # in-range positions per block
    diag_full = stats.all_real & (width == 1)
    out[:, i, i] = _classes(stats.any_real, diag_full)
    return out
