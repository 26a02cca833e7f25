"""Property tests of packing and layouts against brute-force references (hypothesis).

Every token is placed exactly once or counted; rows never overflow; the packers make the choices
their definitions say (replayed decision by decision, or compared with a plain-Python packer);
bfd/ffd stay within their worst-case bound of the exhaustive optimum; the layout constructors
invert their views; materialized labels never cross a document boundary.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flexpack import PackedLayout, pack
from flexpack.packing import STRATEGIES

SPLITTERS = ("split", "truncate", "drop")


@st.composite
def packing_inputs(draw, *, max_items=40, max_max_len=64):
    max_len = draw(st.integers(1, max_max_len))
    lengths = draw(st.lists(st.integers(0, 3 * max_len), max_size=max_items))
    return lengths, max_len


# ---------------------------------------------------------------- plain-Python reference packers
def _pieces(lengths, max_len, overflow):
    """(sample, start, stop) in sample order, as pack() cuts them."""
    out = []
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        if n <= max_len:
            out.append((i, 0, n))
        elif overflow == "split":
            out.extend((i, s, min(s + max_len, n)) for s in range(0, n, max_len))
        elif overflow == "truncate":
            out.append((i, 0, max_len))
    return out


def _decreasing(pieces):
    return sorted(range(len(pieces)), key=lambda k: -(pieces[k][2] - pieces[k][1]))  # stable


def reference_ffd(pieces, max_len, max_docs):
    free, docs, row_of = [], [], [None] * len(pieces)
    for k in _decreasing(pieces):
        s = pieces[k][2] - pieces[k][1]
        r = next((r for r in range(len(free)) if free[r] >= s and docs[r] < max_docs), None)
        if r is None:
            r = len(free)
            free.append(max_len)
            docs.append(0)
        free[r] -= s
        docs[r] += 1
        row_of[k] = r
    return row_of


def reference_next_fit(pieces, max_len, max_docs):
    row_of, r, fill, docs = [], -1, max_len, max_docs
    for _, a, b in pieces:
        if fill + (b - a) > max_len or docs >= max_docs:
            r, fill, docs = r + 1, 0, 0
        row_of.append(r)
        fill += b - a
        docs += 1
    return row_of


def reference_wrap(lengths, max_len, max_docs):
    segments, r, fill, docs = [], 0, 0, 0
    for i, n in enumerate(lengths):
        start = 0
        while start < n:
            if fill == max_len or docs == max_docs:
                r, fill, docs = r + 1, 0, 0
            take = min(n - start, max_len - fill)
            segments.append([r, i, start, start + take])
            fill, docs, start = fill + take, docs + 1, start + take
    return segments


def _segments_from(pieces, row_of):
    order = sorted(range(len(pieces)), key=lambda k: (row_of[k], k))
    return [[row_of[k], *pieces[k]] for k in order]


def optimal_rows(sizes, max_len):
    """Exhaustive bin packing: the fewest rows of max_len holding all sizes (tiny inputs)."""
    sizes = tuple(sorted(sizes, reverse=True))

    @cache
    def solve(i, free):  # free: sorted tuple of open rows' free capacities
        if i == len(sizes):
            return len(free)
        s = sizes[i]
        best = math.inf
        for f in set(free):  # rows with equal free space are interchangeable
            if f >= s:
                rest = list(free)
                rest.remove(f)
                best = min(best, solve(i + 1, tuple(sorted([*rest, f - s]))))
        return min(best, solve(i + 1, tuple(sorted([*free, max_len - s]))))

    return solve(0, ())


# ---------------------------------------------------------------- lossless, bounded, ordered
@given(
    packing_inputs(),
    st.sampled_from(STRATEGIES),
    st.sampled_from(SPLITTERS),
    st.one_of(st.none(), st.integers(1, 5)),
    st.integers(0, 3),
)
def test_every_token_placed_once_or_counted(inp, strategy, overflow, max_docs, seed):
    lengths, max_len = inp
    plan = pack(
        lengths, max_len, strategy=strategy, overflow=overflow, seed=seed, max_docs_per_row=max_docs
    )
    seg = plan.segments
    assert seg.dtype == np.int64 and seg.shape[1] == 4
    # ordered by row; every row used and within max_len; document count limit kept
    assert np.all(np.diff(seg[:, 0]) >= 0)
    assert set(seg[:, 0].tolist()) == set(range(plan.num_rows))
    fill = np.bincount(seg[:, 0], weights=seg[:, 3] - seg[:, 2], minlength=plan.num_rows)
    assert np.all(fill <= max_len)
    if max_docs is not None and plan.num_rows:
        assert np.bincount(seg[:, 0]).max() <= max_docs
    assert np.all(seg[:, 3] > seg[:, 2])
    # per sample: its pieces tile exactly the kept prefix, in order
    truncated = dropped = 0
    for i, n in enumerate(lengths):
        mine = seg[seg[:, 1] == i]
        pieces = sorted(map(tuple, mine[:, 2:].tolist()))
        if n > max_len and overflow == "drop":
            kept, dropped = 0, dropped + n
        elif n > max_len and overflow == "truncate":
            kept, truncated = max_len, truncated + n - max_len
        else:
            kept = n
        cursor = 0
        for start, stop in pieces:
            assert start == cursor
            cursor = stop
        assert cursor == kept
    s = plan.stats
    assert (s.tokens, s.truncated, s.dropped) == (sum(lengths), truncated, dropped)
    assert s.placed == int(fill.sum()) == s.tokens - truncated - dropped
    assert s.samples == len(lengths) and s.rows == plan.num_rows
    assert s.lower_bound_rows == math.ceil(s.placed / max_len) <= plan.num_rows


@given(packing_inputs(), st.sampled_from(["greedy", "wrap"]), st.sampled_from(SPLITTERS))
def test_order_preserving_strategies_keep_sample_order(inp, strategy, overflow):
    lengths, max_len = inp
    seg = pack(lengths, max_len, strategy=strategy, overflow=overflow).segments
    stream = [(s, a) for _, s, a, _ in seg.tolist()]
    assert stream == sorted(stream)


@given(packing_inputs(), st.sampled_from(STRATEGIES), st.integers(0, 2**32))
def test_same_input_and_seed_same_plan(inp, strategy, seed):
    lengths, max_len = inp
    a = pack(lengths, max_len, strategy=strategy, overflow="split", seed=seed)
    b = pack(
        np.array(lengths, dtype=np.int64), max_len, strategy=strategy, overflow="split", seed=seed
    )
    assert np.array_equal(a.segments, b.segments)
    # Another seed only reorders rows.
    c = pack(lengths, max_len, strategy=strategy, overflow="split", seed=seed + 1)

    def rows(plan):
        return sorted(
            tuple(map(tuple, plan.segments[plan.segments[:, 0] == r, 1:].tolist()))
            for r in range(plan.num_rows)
        )

    assert rows(a) == rows(c)


# ---------------------------------------------------------------- each packer does what it says
@given(packing_inputs(), st.sampled_from(SPLITTERS), st.one_of(st.none(), st.integers(1, 4)))
def test_ffd_greedy_wrap_match_references(inp, overflow, max_docs):
    lengths, max_len = inp
    limit = max_docs if max_docs is not None else math.inf
    pieces = _pieces(lengths, max_len, overflow)
    ffd = pack(
        lengths, max_len, strategy="ffd", overflow=overflow, seed=None, max_docs_per_row=max_docs
    )
    assert ffd.segments.tolist() == _segments_from(pieces, reference_ffd(pieces, max_len, limit))
    greedy = pack(lengths, max_len, strategy="greedy", overflow=overflow, max_docs_per_row=max_docs)
    assert greedy.segments.tolist() == _segments_from(
        pieces, reference_next_fit(pieces, max_len, limit)
    )
    kept = [min(n, max_len) if overflow == "truncate" else n for n in lengths]
    if overflow == "drop":
        kept = [0 if n > max_len else n for n in lengths]
    wrap = pack(lengths, max_len, strategy="wrap", overflow=overflow, max_docs_per_row=max_docs)
    assert wrap.segments.tolist() == reference_wrap(kept, max_len, limit)


@given(packing_inputs(max_items=60), st.one_of(st.none(), st.integers(1, 4)))
def test_bfd_replay_every_choice_is_a_best_fit(inp, max_docs):
    """Replay bfd's decisions (rows in the order opened, seed=None): each piece, largest first,
    went to a fullest open row it fits in, or opened a row when none fits."""
    lengths, max_len = inp
    limit = max_docs if max_docs is not None else math.inf
    plan = pack(lengths, max_len, overflow="split", seed=None, max_docs_per_row=max_docs)
    pieces = _pieces(lengths, max_len, "split")
    where = {(s, a): r for r, s, a, _ in plan.segments.tolist()}
    free, docs = [], []
    for k in _decreasing(pieces):
        sample, start, stop = pieces[k]
        size, r = stop - start, where[(sample, start)]
        fits = [f for f, d in zip(free, docs, strict=True) if f >= size and d < limit]
        if not fits:
            assert r == len(free), "opened a row although one fits, or skipped a number"
            free.append(max_len)
            docs.append(0)
        else:
            assert r < len(free) and free[r] == min(fits) and docs[r] < limit
        free[r] -= size
        docs[r] += 1


@given(
    st.integers(2, 20).flatmap(
        lambda m: st.tuples(st.lists(st.integers(1, m), max_size=8), st.just(m))
    )
)
def test_bfd_ffd_within_worst_case_bound_of_optimum(inp):
    """FFD and BFD never use more than 11/9 OPT + 6/9 rows (Dósa 2007); exhaustive OPT."""
    sizes, max_len = inp
    opt = optimal_rows(sizes, max_len)
    for strategy in ("bfd", "ffd"):
        rows = pack(sizes, max_len, strategy=strategy).num_rows
        assert opt <= rows <= 11 / 9 * opt + 6 / 9, (strategy, sizes, max_len, rows, opt)


# ---------------------------------------------------------------- layouts: each view inverts
@st.composite
def layouts(draw, *, max_rows=4, max_len=12):
    width = draw(st.integers(1, max_len))
    rows = []
    for _ in range(draw(st.integers(0, max_rows))):
        row, room = [], width
        while room and draw(st.booleans()):
            n = draw(st.integers(1, room))
            row.append(n)
            room -= n
        rows.append(row)
    return PackedLayout.from_seqlens(rows, width), rows


@given(layouts())
def test_layout_round_trips(case):
    layout, rows = case
    assert layout.row_seqlens == rows
    assert PackedLayout.from_seqlens(layout.row_seqlens, layout.shape[1]) == layout
    assert PackedLayout.from_doc_ids(layout.doc_ids) == layout
    mask = layout.doc_ids >= 0
    assert PackedLayout.from_position_ids(layout.position_ids, attention_mask=mask) == layout
    back = PackedLayout.from_cu_seqlens(layout.cu_seqlens, layout.indices, shape=layout.shape)
    assert back == layout
    # the views agree with each other
    assert layout.cu_seqlens[-1] == layout.num_tokens == int(mask.sum())
    assert layout.seqlens.tolist() == [n for row in rows for n in row]
    assert layout.max_seqlen == max([n for row in rows for n in row], default=0)


def _runs(row):
    """[(id, start, stop)] of the maximal runs of equal non-negative ids of a row."""
    out = []
    for t, d in enumerate(row):
        if d >= 0 and (t == 0 or row[t - 1] != d):
            out.append([d, t, t + 1])
        elif d >= 0:
            out[-1][2] = t + 1
    return out


@given(
    st.integers(1, 3).flatmap(
        lambda b: st.lists(
            st.lists(st.integers(-1, 3), min_size=6, max_size=6), min_size=b, max_size=b
        )
    ),
    st.integers(0, 2**62),
)
def test_arbitrary_doc_ids_have_a_canonical_twin(raw, offset):
    """Any doc_ids (-1 padding anywhere): an id naming two runs of a row is refused (issue 11);
    otherwise, with ids of any size, the views equal a direct per-token reading, the document
    mask of the layout's renumbered ids equals that of the ids given, and from_cu_seqlens gives
    the same runs relabelled 0..n-1."""
    if any(len({r[0] for r in _runs(row)}) < len(_runs(row)) for row in raw):
        with pytest.raises(ValueError, match="two separate runs"):
            PackedLayout.from_doc_ids(raw)
    # The same runs, each under its own (large) id.
    doc_ids = [list(row) for row in raw]
    for row in doc_ids:
        for k, (_, a, b) in enumerate(_runs(row)):
            row[a:b] = [offset + 3 * k] * (b - a)
    layout = PackedLayout.from_doc_ids(doc_ids)
    pos, lens = [], []
    for row in doc_ids:
        p = []
        for t, d in enumerate(row):
            start = d >= 0 and (t == 0 or row[t - 1] != d)
            if start:
                lens.append(0)
            if d >= 0:
                lens[-1] += 1
            p.append(0 if d < 0 or start else p[-1] + 1)
        pos.append(p)
    assert layout.position_ids.tolist() == pos
    assert layout.seqlens.tolist() == lens
    given_ids = torch.tensor(doc_ids)
    same = lambda d: (d[:, :, None] == d[:, None, :]) & (d[:, :, None] >= 0)
    assert torch.equal(same(given_ids), same(layout.doc_ids.long()))
    twin = PackedLayout.from_cu_seqlens(layout.cu_seqlens, layout.indices, shape=layout.shape)
    assert torch.equal(twin.position_ids, layout.position_ids)
    assert torch.equal(twin.doc_ids >= 0, layout.doc_ids >= 0)


# ---------------------------------------------------------------- materialized tensors
@given(
    packing_inputs(max_items=25, max_max_len=24),
    st.sampled_from(STRATEGIES),
    st.sampled_from(SPLITTERS),
    st.booleans(),
)
def test_materialized_rows_agree_with_segments(inp, strategy, overflow, prompt_labels):
    lengths, max_len = inp
    # token value encodes (sample, position): every token can be traced back
    seqs = [[1000 * (i + 1) + t for t in range(n)] for i, n in enumerate(lengths)]
    if prompt_labels:
        seqs = [
            {"input_ids": s, "labels": [-100 if t < 2 else v for t, v in enumerate(s)]}
            for s in seqs
        ]
    plan = pack(lengths, max_len, strategy=strategy, overflow=overflow)
    batch = plan.materialize(seqs, pad_id=7)
    ids, labels = batch.input_ids.tolist(), batch.labels.tolist()
    docs, pos = batch.doc_ids.tolist(), batch.position_ids.tolist()
    assert batch.layout == plan.layout()
    fill = [0] * plan.num_rows
    ndoc = [0] * plan.num_rows
    for row, sample, start, stop in plan.segments.tolist():
        for k, t in enumerate(range(start, stop)):
            c = fill[row] + k
            assert ids[row][c] == 1000 * (sample + 1) + t
            assert docs[row][c] == ndoc[row]
            assert pos[row][c] == k  # restarts at 0 for every document
            kept = -100 if prompt_labels and t < 2 else ids[row][c]  # per-sample labels kept
            assert labels[row][c] == (-100 if k == 0 else kept)
        fill[row] += stop - start
        ndoc[row] += 1
    for r in range(plan.num_rows):
        for c in range(max_len):
            if c >= fill[r]:
                assert (ids[r][c], labels[r][c], docs[r][c], pos[r][c]) == (7, -100, -1, 0)
            elif labels[r][c] != -100:
                # a label is the token itself, predicted from its own document only
                assert labels[r][c] == ids[r][c]
                assert c > 0 and docs[r][c - 1] == docs[r][c]
            if c < fill[r] and pos[r][c] == 0:
                assert labels[r][c] == -100
    cu = batch.cu_seqlens.tolist()
    assert cu == [0, *np.cumsum(plan.segments[:, 3] - plan.segments[:, 2]).tolist()]
