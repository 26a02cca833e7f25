"""Compiled inner loops of the packers (numba).

Imported lazily by :mod:`flexpack.packing`: importing flexpack never imports numba, and each
kernel compiles on its first call (``cache=True`` keeps the machine code on disk for the next
process). Every kernel works on plain int64 numpy arrays and returns numpy arrays; the public
checks (types, ranges, overflow policy) live in :mod:`flexpack.packing`.

Vocabulary: a *piece* is the contiguous slice ``[start, stop)`` of one sample that is placed as
one document (a whole sample, its first ``max_len`` tokens, or one ``max_len`` chunk of it).
"""

from __future__ import annotations

import numpy as np
from numba import njit

# Overflow codes shared with flexpack.packing.
SPLIT = 1
TRUNCATE = 2
DROP = 3


@njit(cache=True, nogil=True)
def make_pieces(lengths, max_len, mode):
    """Cut samples into pieces of at most ``max_len`` tokens under an overflow policy.

    lengths: (n,) int64, >= 0. mode: SPLIT, TRUNCATE or DROP (applies to samples > max_len).
    Returns (sample, start, stop) int64 arrays in sample order; empty samples give no piece.
    """
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


@njit(cache=True, nogil=True)
def order_by_size_desc(sizes, max_len):
    """Stable counting sort: indices of ``sizes`` (each in 0..max_len) from largest to smallest."""
    n = sizes.shape[0]
    counts = np.zeros(max_len + 1, np.int64)
    for i in range(n):
        counts[sizes[i]] += 1
    pos = np.empty(max_len + 1, np.int64)
    acc = 0
    for v in range(max_len, -1, -1):
        pos[v] = acc
        acc += counts[v]
    order = np.empty(n, np.int64)
    for i in range(n):
        v = sizes[i]
        order[pos[v]] = i
        pos[v] += 1
    return order


# Presence tree over remaining capacities 0..max_len: leaf c is 1 while some open row has exactly c
# tokens free. "Smallest capacity >= s" is one walk up and one walk down: O(log max_len).


@njit(cache=True, nogil=True, inline="always")
def _tree_set(tree, size, c):
    node = c + size
    while node >= 1 and tree[node] == 0:
        tree[node] = 1
        node >>= 1


@njit(cache=True, nogil=True, inline="always")
def _tree_clear(tree, size, c):
    node = c + size
    tree[node] = 0
    node >>= 1
    while node >= 1:
        v = tree[2 * node] | tree[2 * node + 1]
        if v == tree[node]:
            break
        tree[node] = v
        node >>= 1


@njit(cache=True, nogil=True, inline="always")
def _tree_first_at_least(tree, size, s):
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


@njit(cache=True, nogil=True)
def _sorted_desc(sizes, max_len):
    if max_len > 4 * sizes.shape[0] + 65536:
        # a counting sort's table would dwarf the input: sort by comparison (stable)
        order = np.argsort(-sizes, kind="mergesort")
    else:
        order = order_by_size_desc(sizes, max_len)
    n = sizes.shape[0]
    sorted_sizes = np.empty(n, np.int64)
    for k in range(n):
        sorted_sizes[k] = sizes[order[k]]
    return order, sorted_sizes


@njit(cache=True, nogil=True)
def _unsort(order, values):
    out = np.empty(order.shape[0], np.int64)
    for k in range(order.shape[0]):
        out[order[k]] = values[k]
    return out


@njit(cache=True, nogil=True)
def best_fit_decreasing(sizes, max_len, max_docs):
    """Best-fit decreasing: each piece, largest first, goes to the open row it fills most.

    sizes: (n,) int64 in 1..max_len. max_docs: a row closes once it holds that many pieces.
    Returns (row_of, num_rows): row_of (n,) int64, rows numbered in the order they were opened.
    Open rows are kept in buckets by free capacity (a stack of row ids per capacity, linked
    through ``nxt``) with a presence tree over capacities: O(n log max_len) in all. The main loop
    walks the pieces in sorted order and writes sequentially (random access only where the data
    structure needs it): at 10M pieces, cache misses dominate.
    """
    n = sizes.shape[0]
    order, sorted_sizes = _sorted_desc(sizes, max_len)
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
        c = _tree_first_at_least(tree, size, s)
        if c < 0:
            r = num_rows
            num_rows += 1
            free = max_len
        else:
            r = head[c]
            head[c] = nxt[r]
            if head[c] < 0:
                _tree_clear(tree, size, c)
            free = c
        row_sorted[k] = r
        left = free - s
        if limited:
            docs[r] += 1
            if docs[r] >= max_docs:
                left = 0
        if left > 0:
            if head[left] < 0:
                _tree_set(tree, size, left)
            nxt[r] = head[left]
            head[left] = r
    return _unsort(order, row_sorted), num_rows


@njit(cache=True, nogil=True)
def first_fit_decreasing(sizes, max_len, max_docs):
    """First-fit decreasing: each piece, largest first, goes to the lowest-numbered row it fits.

    A max-tree over rows holds each row's free capacity; rows not opened yet read as empty
    (max_len free), so the first fit is an opened row or the next new one. O(n log n).
    """
    n = sizes.shape[0]
    order, sorted_sizes = _sorted_desc(sizes, max_len)
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
    return _unsort(order, row_sorted), num_rows


@njit(cache=True, nogil=True)
def next_fit(sizes, max_len, max_docs):
    """Next-fit in the given order: a piece that does not fit closes the row and opens the next."""
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


@njit(cache=True, nogil=True)
def _wrap_pass(lengths, max_len, max_docs, segments, write):
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


@njit(cache=True, nogil=True)
def wrap(lengths, max_len, max_docs):
    """Concatenate the samples and cut the stream every ``max_len`` tokens.

    lengths: (n,) int64 >= 0, in stream order. A row also closes (padded) after ``max_docs``
    pieces. Returns segments (m, 4) int64 (row, sample, start, stop) in row order, and num_rows.
    """
    count, _ = _wrap_pass(lengths, max_len, max_docs, np.empty((0, 4), np.int64), False)
    segments = np.empty((count, 4), np.int64)
    _, num_rows = _wrap_pass(lengths, max_len, max_docs, segments, True)
    return segments, num_rows


@njit(cache=True, nogil=True)
def emit_segments(row_of, new_row, num_rows, sample, start, stop):
    """Group pieces by row (stable counting sort): segments (m, 4) int64 ordered by row, then by
    the pieces' given order within the row, and the (num_rows,) count of pieces per row.

    Piece k goes to row ``new_row[row_of[k]]`` (the seeded shuffle; pass an empty ``new_row``
    to keep the packer's numbering)."""
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


@njit(cache=True, nogil=True)
def assemble_rows(
    segments, num_docs, max_len, flat_ids, flat_labels, seg_source, pad_id, with_tokens
):
    """Write packed rows in one pass over the segments.

    segments: (m, 4) int64 (row, sample, start, stop), rows 0..R-1 in order; num_docs: (R,)
    segments per row. With ``with_tokens``, token t of segment j is ``flat_ids[seg_source[j] +
    start + t]`` (labels likewise from ``flat_labels`` when it is non-empty, else the ids).
    Returns flat (R * max_len,) input_ids, labels (both empty without tokens), doc_ids (int32),
    position_ids, and indices (T,) of the real tokens.
    """
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
