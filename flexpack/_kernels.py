"""Inner loops of the packers, twice: numpy for small inputs, numba kernels for large ones.

Imported lazily by :mod:`flexpack.packing` and ``flexpack._packed_batch``; importing this module
imports numpy only. Each public function below (``make_pieces``, the packers, ``wrap``,
``emit_segments``, ``assemble_rows``) has two implementations that return identical arrays
(``tests/properties/test_kernel_paths.py`` checks them against each other):

- a numpy twin (``_np_*``), for inputs of fewer than :data:`SMALL` samples, pieces or segments
  (``assemble_rows``: also fewer than :data:`SMALL_TOKENS` tokens). Nothing to compile: the
  first ``pack`` of a process costs milliseconds, where compiling the kernels costs 10-90 s on
  a busy 2-core machine.
- a numba kernel (``_nb_*``), compiled on the first call that needs it and cached on disk
  (numba's ``cache=True``: ``NUMBA_CACHE_DIR`` if set, else the package's ``__pycache__``, else
  the user-wide cache folder; where none can be written, as in a read-only install with a
  read-only home, it compiles in memory, once per process). A compile that runs past a second
  says so on stderr, once per kernel. Once a kernel is loaded in a process it serves every
  size, small ones too: its load is paid, and it is the faster of the two.

Every function works on plain int64 numpy arrays and returns numpy arrays; the public checks
(types, ranges, overflow policy) live in :mod:`flexpack.packing`.

Vocabulary: a *piece* is the contiguous slice ``[start, stop)`` of one sample that is placed as
one document (a whole sample, its first ``max_len`` tokens, or one ``max_len`` chunk of it).
"""

from __future__ import annotations

import bisect
import contextlib
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

# Overflow codes shared with flexpack.packing.
SPLIT = 1
TRUNCATE = 2
DROP = 3

# Below these sizes the numpy twins run: their cost (a Python loop over the pieces for bfd and
# greedy, O(n^2) vectorized for ffd, a few temporaries per token for assemble_rows) stays in the
# tens of milliseconds, under what even loading cached kernels costs (importing numba, ~0.5 s).
SMALL = 4096
SMALL_TOKENS = 1 << 21

_FORCED: str | None = None  # "numpy" or "numba": forced(), for the tests and the CLI's warm-up


@contextlib.contextmanager
def forced(path: str) -> Iterator[None]:
    """Run every kernel on one path (``"numpy"`` or ``"numba"``) inside the block, whatever the
    sizes: the tests compare the two, the CLI loads the compiled kernels before it times them."""
    global _FORCED
    if path not in ("numpy", "numba"):
        raise ValueError(f"path must be 'numpy' or 'numba'; got {path!r}")
    before, _FORCED = _FORCED, path
    try:
        yield
    finally:
        _FORCED = before


def compiled_for(name: str, size: int) -> bool:
    """Whether kernel ``name`` (a public function of this module) runs compiled for an input of
    ``size`` samples, pieces or segments: forced, large, or already loaded in this process."""
    if _FORCED is not None:
        return _FORCED == "numba"
    if size >= SMALL:
        return True
    loaded = _LOADED
    return loaded is not None and bool(getattr(loaded, "_nb_" + name).signatures)


# ----------------------------------------------------------------------------- the public calls


def make_pieces(
    lengths: np.ndarray, max_len: int, mode: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut samples into pieces of at most ``max_len`` tokens under an overflow policy.

    lengths: (n,) int64, >= 0. mode: SPLIT, TRUNCATE or DROP (applies to samples > max_len).
    Returns (sample, start, stop) int64 arrays in sample order; empty samples give no piece.
    """
    if compiled_for("make_pieces", lengths.shape[0]):
        return _call("make_pieces", lengths, max_len, mode)
    return _np_make_pieces(lengths, max_len, mode)


def best_fit_decreasing(sizes: np.ndarray, max_len: int, max_docs: int) -> tuple[np.ndarray, int]:
    """Best-fit decreasing: each piece, largest first, goes to the open row it fills most (of
    several, the one that reached that free space last).

    sizes: (n,) int64 in 1..max_len. max_docs: a row closes once it holds that many pieces.
    Returns (row_of, num_rows): row_of (n,) int64, rows numbered in the order they were opened.
    """
    if compiled_for("best_fit_decreasing", sizes.shape[0]):
        return _call("best_fit_decreasing", sizes, max_len, max_docs)
    return _np_best_fit_decreasing(sizes, max_len, max_docs)


def first_fit_decreasing(sizes: np.ndarray, max_len: int, max_docs: int) -> tuple[np.ndarray, int]:
    """First-fit decreasing: each piece, largest first, goes to the lowest-numbered row it fits.

    Arguments and result as :func:`best_fit_decreasing`.
    """
    if compiled_for("first_fit_decreasing", sizes.shape[0]):
        return _call("first_fit_decreasing", sizes, max_len, max_docs)
    return _np_first_fit_decreasing(sizes, max_len, max_docs)


def next_fit(sizes: np.ndarray, max_len: int, max_docs: int) -> tuple[np.ndarray, int]:
    """Next-fit in the given order: a piece that does not fit closes the row and opens the next.

    Arguments and result as :func:`best_fit_decreasing`.
    """
    if compiled_for("next_fit", sizes.shape[0]):
        return _call("next_fit", sizes, max_len, max_docs)
    return _np_next_fit(sizes, max_len, max_docs)


def wrap(lengths: np.ndarray, max_len: int, max_docs: int) -> tuple[np.ndarray, int]:
    """Concatenate the samples and cut the stream every ``max_len`` tokens.

    lengths: (n,) int64 >= 0, in stream order. A row also closes (padded) after ``max_docs``
    pieces. Returns segments (m, 4) int64 (row, sample, start, stop) in row order, and num_rows.
    """
    n = lengths.shape[0]
    # m <= n + rows: each row boundary cuts at most one sample; a max_docs limit adds none
    # (it closes a row at a piece boundary). Python ints: a token sum may pass int64.
    pieces = n + (sum(lengths.tolist()) // max_len if n < SMALL else 0)
    if compiled_for("wrap", pieces):
        return _call("wrap", lengths, max_len, max_docs)
    return _np_wrap(lengths, max_len, max_docs)


def emit_segments(
    row_of: np.ndarray,
    new_row: np.ndarray,
    num_rows: int,
    sample: np.ndarray,
    start: np.ndarray,
    stop: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Group pieces by row (stable): segments (m, 4) int64 ordered by row, then by the pieces'
    given order within the row, and the (num_rows,) count of pieces per row.

    Piece k goes to row ``new_row[row_of[k]]`` (the seeded shuffle; pass an empty ``new_row``
    to keep the packer's numbering)."""
    if compiled_for("emit_segments", row_of.shape[0]):
        return _call("emit_segments", row_of, new_row, num_rows, sample, start, stop)
    return _np_emit_segments(row_of, new_row, num_rows, sample, start, stop)


def assemble_rows(
    segments: np.ndarray,
    num_docs: np.ndarray,
    max_len: int,
    flat_ids: np.ndarray,
    flat_labels: np.ndarray,
    seg_source: np.ndarray,
    pad_id: int,
    with_tokens: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Write packed rows in one pass over the segments.

    segments: (m, 4) int64 (row, sample, start, stop), rows 0..R-1 in order; num_docs: (R,)
    segments per row. With ``with_tokens``, token t of segment j is ``flat_ids[seg_source[j] +
    start + t]`` (labels likewise from ``flat_labels`` when it is non-empty, else the ids).
    Returns flat (R * max_len,) input_ids, labels (both empty without tokens), doc_ids (int32),
    position_ids, and indices (T,) of the real tokens.
    """
    tokens = int((segments[:, 3] - segments[:, 2]).sum())
    size = segments.shape[0] if tokens < SMALL_TOKENS else SMALL  # numpy: a few (T,) temporaries
    args = (segments, num_docs, max_len, flat_ids, flat_labels, seg_source, pad_id, with_tokens)
    if compiled_for("assemble_rows", size):
        return _call("assemble_rows", *args)
    return _np_assemble_rows(*args)


# ----------------------------------------------------------------------------- the numpy twins
# Each returns what its kernel returns, array for array: same choices, same tie-breaks.


def _np_make_pieces(lengths, max_len, mode):
    if mode == SPLIT:
        counts = -(-lengths // max_len)  # ceil; 0 for an empty sample
    elif mode == TRUNCATE:
        counts = (lengths > 0).astype(np.int64)
    else:
        counts = ((lengths > 0) & (lengths <= max_len)).astype(np.int64)
    sample = np.repeat(np.arange(lengths.shape[0], dtype=np.int64), counts)
    # k: the piece's number within its sample (0 unless split)
    k = np.arange(sample.shape[0], dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    start = k * max_len
    stop = np.minimum(start + max_len, lengths[sample])
    return sample, start, stop


def _np_sorted_desc(sizes):
    """Indices of ``sizes`` from largest to smallest, ties in index order (the kernels' stable
    counting sort), and the sizes in that order as Python ints."""
    order = np.argsort(-sizes, kind="stable")
    return order, sizes[order].tolist()


def _np_unsort(order, values):
    out = np.empty(order.shape[0], np.int64)
    out[order] = values
    return out


def _np_best_fit_decreasing(sizes, max_len, max_docs):
    order, sorted_sizes = _np_sorted_desc(sizes)
    free_sizes: list[int] = []  # sorted distinct free capacities of the open rows
    rows_with: dict[int, list[int]] = {}  # capacity -> open rows with it, last arrived on top
    docs: list[int] = []
    row_sorted = [0] * len(sorted_sizes)
    for k, s in enumerate(sorted_sizes):
        j = bisect.bisect_left(free_sizes, s)  # the smallest capacity that holds s
        if j == len(free_sizes):
            r, free = len(docs), max_len
            docs.append(0)
        else:
            free = free_sizes[j]
            stack = rows_with[free]
            r = stack.pop()
            if not stack:
                del free_sizes[j], rows_with[free]
        row_sorted[k] = r
        docs[r] += 1
        left = 0 if docs[r] >= max_docs else free - s
        if left > 0:
            if left not in rows_with:
                bisect.insort(free_sizes, left)
                rows_with[left] = []
            rows_with[left].append(r)
    return _np_unsort(order, row_sorted), len(docs)


def _np_first_fit_decreasing(sizes, max_len, max_docs):
    order, sorted_sizes = _np_sorted_desc(sizes)
    n = len(sorted_sizes)
    free = np.full(n, max_len, np.int64)  # rows not opened yet read as empty
    docs = np.zeros(n, np.int64)
    row_sorted = [0] * n
    num_rows = 0
    for k, s in enumerate(sorted_sizes):
        r = int(np.argmax(free >= s))  # row k at the latest: at most k rows are open
        num_rows = max(num_rows, r + 1)
        row_sorted[k] = r
        docs[r] += 1
        free[r] = 0 if docs[r] >= max_docs else free[r] - s
    return _np_unsort(order, row_sorted), num_rows


def _np_next_fit(sizes, max_len, max_docs):
    row_of = []
    r, fill, docs = -1, max_len, 0
    for s in sizes.tolist():
        if fill + s > max_len or docs >= max_docs:
            r, fill, docs = r + 1, 0, 0
        row_of.append(r)
        fill += s
        docs += 1
    return np.array(row_of, dtype=np.int64), r + 1


def _np_wrap(lengths, max_len, max_docs):
    segments = []
    r = fill = docs = 0
    for i, length in enumerate(lengths.tolist()):
        start = 0
        while start < length:
            if fill == max_len or docs == max_docs:
                r, fill, docs = r + 1, 0, 0
            take = min(length - start, max_len - fill)
            segments.append((r, i, start, start + take))
            fill, docs, start = fill + take, docs + 1, start + take
    out = np.array(segments, dtype=np.int64).reshape(-1, 4)
    return out, (r + 1 if segments else 0)


def _np_emit_segments(row_of, new_row, num_rows, sample, start, stop):
    rows = new_row[row_of] if new_row.shape[0] else row_of
    order = np.argsort(rows, kind="stable")
    segments = np.stack([rows, sample, start, stop], axis=1)[order]
    return segments, np.bincount(rows, minlength=num_rows).astype(np.int64)


def _np_assemble_rows(
    segments, num_docs, max_len, flat_ids, flat_labels, seg_source, pad_id, with_tokens
):
    num_rows, m = num_docs.shape[0], segments.shape[0]
    size = num_rows * max_len
    start = segments[:, 2]
    n = segments[:, 3] - start  # (m,) tokens per segment
    begin = np.cumsum(n) - n  # (m,) where each segment starts in all segments back to back
    row_first = np.repeat(np.cumsum(num_docs) - num_docs, num_docs)  # (m,) its row's first seg
    col = np.repeat(np.arange(num_rows, dtype=np.int64) * max_len, num_docs)
    col += begin - begin[row_first]  # (m,) flat position of each segment's first token
    seg = np.repeat(np.arange(m, dtype=np.int64), n)  # (T,) segment of each token
    k = np.arange(seg.shape[0], dtype=np.int64) - begin[seg]  # (T,) position in its document
    indices = col[seg] + k  # (T,) flat position of each token
    doc_ids = np.full(size, -1, np.int32)
    doc_ids[indices] = (np.arange(m, dtype=np.int64) - row_first)[seg]
    position_ids = np.zeros(size, np.int64)
    position_ids[indices] = k
    if not with_tokens:
        empty = np.empty(0, np.int64)
        return empty, empty.copy(), doc_ids, position_ids, indices
    src = (seg_source + start)[seg] + k  # (T,) where each token comes from
    input_ids = np.full(size, pad_id, np.int64)
    input_ids[indices] = flat_ids[src]
    labels = np.full(size, -100, np.int64)
    inner = k > 0  # a document's first token is never predicted
    labels[indices[inner]] = (flat_labels if flat_labels.shape[0] else flat_ids)[src[inner]]
    return input_ids, labels, doc_ids, position_ids, indices


# ----------------------------------------------------------------------------- the numba kernels
# Plain Python functions until _compiled() runs: numba is imported on the first call that needs
# a kernel, not when flexpack is.

_KERNELS: dict[str, tuple[Callable, dict[str, Any]]] = {}
_LOADED: types.SimpleNamespace | None = None  # the dispatchers, once _compiled() has run
_LOCK = threading.Lock()


def _kernel(**options: Any) -> Callable[[Callable], Callable]:
    """Register a numba kernel (``njit`` options beyond ``cache`` and ``nogil``)."""

    def register(func: Callable) -> Callable:
        _KERNELS[func.__name__] = (func, options)
        return func

    return register


def _compiled() -> types.SimpleNamespace:
    """numba dispatchers of every kernel (nothing compiles yet: each compiles on its first call,
    or loads from numba's on-disk cache)."""
    global _LOADED
    with _LOCK:
        if _LOADED is None:
            from numba import njit

            dispatchers = {}
            for name, (func, options) in _KERNELS.items():
                try:
                    dispatchers[name] = njit(cache=True, nogil=True, **options)(func)
                except RuntimeError:  # numba found no folder it can write its cache in
                    dispatchers[name] = njit(nogil=True, **options)(func)
            # The kernels call each other by module-level name, resolved when numba compiles the
            # caller: from here on those names must be the dispatchers.
            globals().update(dispatchers)
            _LOADED = types.SimpleNamespace(**dispatchers)
    return _LOADED


_NOTICE_AFTER = 1.0  # seconds a first call may take before it says it is compiling


def _call(name: str, *args: Any) -> Any:
    """Run kernel ``name`` compiled; its first call in a process that compiles for more than a
    second prints one line to stderr, so that the wait is never silent."""
    kernel = getattr(_compiled(), "_nb_" + name)
    if kernel.signatures:  # loaded in this process: the common case
        return kernel(*args)
    said = threading.Event()

    def say() -> None:
        path = getattr(getattr(kernel, "_cache", None), "cache_path", None)
        where = (
            f"cached in {path}"
            if path
            else "not cached: no writable cache folder; set NUMBA_CACHE_DIR to keep it"
        )
        print(
            f"flexpack: compiling the {name} kernel (numba, the first run after an install; "
            f"{where}) ...",
            end="",
            file=sys.stderr,
            flush=True,
        )
        said.set()

    timer = threading.Timer(_NOTICE_AFTER, say)
    timer.daemon = True
    started = time.perf_counter()
    timer.start()
    try:
        return kernel(*args)
    finally:
        timer.cancel()
        if said.is_set():
            print(f" done in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)


@_kernel()
def _nb_make_pieces(lengths, max_len, mode):
    """Kernel of :func:`make_pieces`: one pass counts the pieces, a second writes them."""
    n = lengths.shape[0]
    count = 0
    for i in range(n):
        length = lengths[i]
        if length == 0:
            continue
        if length <= max_len:
            count += 1
        elif mode == SPLIT:
            count += (length + max_len - 1) // max_len
        elif mode == TRUNCATE:
            count += 1
    sample = np.empty(count, np.int64)
    start = np.empty(count, np.int64)
    stop = np.empty(count, np.int64)
    k = 0
    for i in range(n):
        length = lengths[i]
        if length == 0:
            continue
        if length <= max_len:
            sample[k] = i
            start[k] = 0
            stop[k] = length
            k += 1
        elif mode == SPLIT:
            s = 0
            while s < length:
                sample[k] = i
                start[k] = s
                stop[k] = min(s + max_len, length)
                s += max_len
                k += 1
        elif mode == TRUNCATE:
            sample[k] = i
            start[k] = 0
            stop[k] = max_len
            k += 1
    return sample, start, stop


# Presence tree over remaining capacities 0..max_len: leaf c is 1 while some open row has exactly c
# tokens free. "Smallest capacity >= s" is one walk up and one walk down: O(log max_len).


@_kernel(inline="always")
def _nb_tree_set(tree, size, c):
    node = c + size
    while node >= 1 and tree[node] == 0:
        tree[node] = 1
        node >>= 1


@_kernel(inline="always")
def _nb_tree_clear(tree, size, c):
    node = c + size
    tree[node] = 0
    node >>= 1
    while node >= 1:
        v = tree[2 * node] | tree[2 * node + 1]
        if v == tree[node]:
            break
        tree[node] = v
        node >>= 1


@_kernel(inline="always")
def _nb_tree_first_at_least(tree, size, s):
    node = s + size
    if tree[node]:
        return s
    while node > 1:
        if (node & 1) == 0 and tree[node + 1]:
            node += 1
            while node < size:
                node = 2 * node if tree[2 * node] else 2 * node + 1
            return node - size
        node >>= 1
    return -1


@_kernel()
def _nb_ranked_desc(sizes, max_len):
    """Sizes from largest to smallest (stable), and the place of each piece in that order.

    A histogram gives both without an order array: the sorted sizes are runs of equal values,
    and piece i's place is its size's next free slot, read in input order (sequential writes
    only). A counting sort's table would dwarf a short input of huge sizes: there, a stable
    comparison sort.
    """
    n = sizes.shape[0]
    sorted_sizes = np.empty(n, np.int64)
    rank = np.empty(n, np.int64)
    if max_len > 4 * n + 65536:
        order = np.argsort(-sizes, kind="mergesort")
        for k in range(n):
            sorted_sizes[k] = sizes[order[k]]
            rank[order[k]] = k
        return sorted_sizes, rank
    counts = np.zeros(max_len + 1, np.int64)
    for i in range(n):
        counts[sizes[i]] += 1
    slot = np.empty(max_len + 1, np.int64)
    acc = 0
    for v in range(max_len, -1, -1):
        slot[v] = acc
        sorted_sizes[acc : acc + counts[v]] = v
        acc += counts[v]
    for i in range(n):
        v = sizes[i]
        rank[i] = slot[v]
        slot[v] += 1
    return sorted_sizes, rank


@_kernel()
def _nb_best_fit_decreasing(sizes, max_len, max_docs):
    """Kernel of :func:`best_fit_decreasing`.

    Open rows are kept in buckets by free capacity (a stack of row ids per capacity, linked
    through ``nxt``) with a presence tree over capacities: O(n log max_len) in all. The main loop
    walks the pieces in sorted order and writes sequentially (random access only where the data
    structure needs it): at 10M pieces, cache misses dominate. Each piece then reads its row
    from its place in the sorted order.
    """
    n = sizes.shape[0]
    sorted_sizes, rank = _nb_ranked_desc(sizes, max_len)
    size = 1
    while size < max_len + 1:
        size *= 2
    tree = np.zeros(2 * size, np.uint8)
    head = np.full(max_len + 1, -1, np.int64)
    nxt = np.empty(n, np.int64)
    limited = max_docs < n
    docs = np.zeros(n if limited else 0, np.int64)
    row_sorted = np.empty(n, np.int64)
    num_rows = 0
    for k in range(n):
        s = sorted_sizes[k]
        c = _nb_tree_first_at_least(tree, size, s)
        if c < 0:
            r = num_rows
            num_rows += 1
            free = max_len
        else:
            r = head[c]
            head[c] = nxt[r]
            if head[c] < 0:
                _nb_tree_clear(tree, size, c)
            free = c
        row_sorted[k] = r
        left = free - s
        if limited:
            docs[r] += 1
            if docs[r] >= max_docs:
                left = 0
        if left > 0:
            if head[left] < 0:
                _nb_tree_set(tree, size, left)
            nxt[r] = head[left]
            head[left] = r
    row_of = np.empty(n, np.int64)
    for i in range(n):
        row_of[i] = row_sorted[rank[i]]
    return row_of, num_rows


@_kernel()
def _nb_first_fit_decreasing(sizes, max_len, max_docs):
    """Kernel of :func:`first_fit_decreasing`.

    A max-tree over rows holds each row's free capacity; rows not opened yet read as empty
    (max_len free), so the first fit is an opened row or the next new one. O(n log n).
    """
    n = sizes.shape[0]
    sorted_sizes, rank = _nb_ranked_desc(sizes, max_len)
    size = 1
    while size < max(n, 1):
        size *= 2
    tree = np.full(2 * size, max_len, np.int64)
    limited = max_docs < n
    docs = np.zeros(size if limited else 0, np.int64)
    row_sorted = np.empty(n, np.int64)
    num_rows = 0
    for k in range(n):
        s = sorted_sizes[k]
        node = 1
        while node < size:
            node = 2 * node if tree[2 * node] >= s else 2 * node + 1
        r = node - size
        if r >= num_rows:
            num_rows = r + 1
        row_sorted[k] = r
        free = tree[node] - s
        if limited:
            docs[r] += 1
            if docs[r] >= max_docs:
                free = 0
        tree[node] = free
        node >>= 1
        while node >= 1:
            v = max(tree[2 * node], tree[2 * node + 1])
            if tree[node] == v:
                break
            tree[node] = v
            node >>= 1
    row_of = np.empty(n, np.int64)
    for i in range(n):
        row_of[i] = row_sorted[rank[i]]
    return row_of, num_rows


@_kernel()
def _nb_next_fit(sizes, max_len, max_docs):
    """Kernel of :func:`next_fit`."""
    n = sizes.shape[0]
    row_of = np.empty(n, np.int64)
    r = -1
    fill = max_len
    docs = 0
    for i in range(n):
        s = sizes[i]
        if fill + s > max_len or docs >= max_docs:
            r += 1
            fill = 0
            docs = 0
        row_of[i] = r
        fill += s
        docs += 1
    return row_of, r + 1


@_kernel()
def _nb_wrap_pass(lengths, max_len, max_docs, segments, write):
    k = 0
    r = 0
    fill = 0
    docs = 0
    for i in range(lengths.shape[0]):
        start = 0
        length = lengths[i]
        while start < length:
            if fill == max_len or docs == max_docs:
                r += 1
                fill = 0
                docs = 0
            take = min(length - start, max_len - fill)
            if write:
                segments[k, 0] = r
                segments[k, 1] = i
                segments[k, 2] = start
                segments[k, 3] = start + take
            k += 1
            fill += take
            docs += 1
            start += take
    return k, (r + 1 if k > 0 else 0)


@_kernel()
def _nb_wrap(lengths, max_len, max_docs):
    """Kernel of :func:`wrap`: one pass counts the segments, a second writes them."""
    count, _ = _nb_wrap_pass(lengths, max_len, max_docs, np.empty((0, 4), np.int64), False)
    segments = np.empty((count, 4), np.int64)
    _, num_rows = _nb_wrap_pass(lengths, max_len, max_docs, segments, True)
    return segments, num_rows


@_kernel()
def _nb_emit_segments(row_of, new_row, num_rows, sample, start, stop):
    """Kernel of :func:`emit_segments`: a stable counting sort by row."""
    m = row_of.shape[0]
    relabel = new_row.shape[0] > 0
    counts = np.zeros(num_rows + 1, np.int64)
    for k in range(m):
        r = new_row[row_of[k]] if relabel else row_of[k]
        counts[r + 1] += 1
    per_row = counts[1:].copy()
    for r in range(num_rows):
        counts[r + 1] += counts[r]
    segments = np.empty((m, 4), np.int64)
    for k in range(m):
        r = new_row[row_of[k]] if relabel else row_of[k]
        j = counts[r]
        counts[r] = j + 1
        segments[j, 0] = r
        segments[j, 1] = sample[k]
        segments[j, 2] = start[k]
        segments[j, 3] = stop[k]
    return segments, per_row


@_kernel()
def _nb_assemble_rows(
    segments, num_docs, max_len, flat_ids, flat_labels, seg_source, pad_id, with_tokens
):
    """Kernel of :func:`assemble_rows`: one pass over the segments writes every array."""
    num_rows = num_docs.shape[0]
    m = segments.shape[0]
    total = 0
    for j in range(m):
        total += segments[j, 3] - segments[j, 2]
    size = num_rows * max_len
    doc_ids = np.full(size, -1, np.int32)
    position_ids = np.zeros(size, np.int64)
    indices = np.empty(total, np.int64)
    with_labels = flat_labels.shape[0] > 0
    if with_tokens:
        input_ids = np.full(size, pad_id, np.int64)
        labels = np.full(size, -100, np.int64)
    else:
        input_ids = np.empty(0, np.int64)
        labels = np.empty(0, np.int64)
    j = 0
    t = 0
    for r in range(num_rows):
        col = r * max_len
        for d in range(num_docs[r]):
            start = segments[j, 2]
            n = segments[j, 3] - start
            for k in range(n):
                p = col + k
                doc_ids[p] = d
                position_ids[p] = k
                indices[t] = p
                t += 1
            if with_tokens and n > 0:
                src = seg_source[j] + start
                for k in range(n):
                    input_ids[col + k] = flat_ids[src + k]
                if with_labels:
                    for k in range(1, n):
                        labels[col + k] = flat_labels[src + k]
                else:
                    for k in range(1, n):
                        labels[col + k] = flat_ids[src + k]
                # labels[col] stays -100: a document's first token is never predicted
            col += n
            j += 1
    return input_ids, labels, doc_ids, position_ids, indices
