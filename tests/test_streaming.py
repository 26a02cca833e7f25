"""flexpack.data.PackedIterableDataset: bounded buffer, exactly-once splits, exact resume."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from _rows import docs_of
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpack.data import PackedIterableDataset, collate


def make_samples(n: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """n samples with globally unique token ids, lengths in [1, max_len]."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len + 1, size=n)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return [list(range(int(s), int(s + k))) for s, k in zip(starts, lengths, strict=True)]


class Stream:
    """A re-iterable, non-indexable stream (like a file reader)."""

    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return iter(self.items)


def rows_of(ds) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return [(tuple(r.input_ids[0].tolist()), tuple(r.doc_ids[0].tolist())) for r in ds]


def tokens_of(rows) -> Counter:
    c: Counter = Counter()
    for ids, docs in rows:
        c.update(t for t, d in zip(ids, docs, strict=True) if d >= 0)
    return c


@pytest.mark.parametrize("strategy", ["bfd", "greedy", "wrap"])
@pytest.mark.parametrize("source", [list, Stream])
def test_every_sample_once_and_rows_fit(strategy, source):
    samples = make_samples(120, 24, seed=1)
    ds = PackedIterableDataset(source(samples), 24, buffer_size=16, strategy=strategy)
    rows = list(ds)
    assert all(r.input_ids.shape == (1, 24) for r in rows)
    if strategy == "wrap":
        flat = [t for ids, docs in rows_of(rows) for t, d in zip(ids, docs, strict=True) if d >= 0]
        assert flat == [t for s in samples for t in s]  # stream order, cut every max_len
    else:
        docs = [d for r in rows for d in docs_of(r.input_ids, r.doc_ids)]
        assert Counter(docs) == Counter(tuple(s) for s in samples)


@pytest.mark.parametrize("overflow", ["split", "truncate"])
def test_overflow(overflow):
    samples = [list(range(10)), [20, 21], list(range(30, 55))]
    rows = rows_of(PackedIterableDataset(samples, 8, buffer_size=2, overflow=overflow))
    got = tokens_of(rows)
    if overflow == "split":
        assert got == Counter(t for s in samples for t in s)
    else:
        assert got == Counter(t for s in samples for t in s[:8])
    with pytest.raises(ValueError, match="overflow='split'"):
        list(PackedIterableDataset(samples, 8, buffer_size=2))


def test_bfd_buffer_improves_fill_and_bounds_memory():
    rng = np.random.default_rng(0)
    samples = [list(range(int(k))) for k in rng.integers(1, 64, size=400)]
    fills = {}
    for b in (1, 64):
        ds = PackedIterableDataset(samples, 64, buffer_size=b)
        n_rows = 0
        for _ in ds:
            n_rows += 1
            assert len(ds.state_dict()["pending"]) < b  # bounded buffer
        fills[b] = n_rows
    assert fills[64] < 0.9 * fills[1]


@pytest.mark.parametrize(
    ("strategy", "sync"), [("greedy", False), ("wrap", False), ("bfd", True), ("wrap", True)]
)
def test_memory_stays_bounded_over_a_long_stream(strategy, sync):
    # A bookkeeping entry per sample seen, never freed, once made memory grow with the stream.
    import tracemalloc

    class Stream:  # re-iterable, makes its samples on the fly: only the packer's memory counts
        def __iter__(self):
            return ([7, 8, 9] for _ in range(30_000))

    kw = dict(rank=1, world_size=2, sync_ranks=True) if sync else {}
    ds = PackedIterableDataset(Stream(), 64, strategy=strategy, buffer_size=256, **kw)
    it = iter(ds)
    next(it)
    tracemalloc.start()
    try:
        for _ in it:
            pass
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 512 * 1024, f"{peak} bytes traced while streaming 30k samples"


def _split_rows(world: int, workers: int, samples, strategy: str):
    out = []
    for rank in range(world):
        ds = PackedIterableDataset(
            samples, 32, buffer_size=8, strategy=strategy, rank=rank, world_size=world
        )
        loader = torch.utils.data.DataLoader(
            ds, batch_size=4, num_workers=workers, collate_fn=collate
        )
        out.append([(b.input_ids, b.doc_ids) for b in loader])
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_ranks_and_workers_disjoint_and_complete(workers):
    samples = make_samples(150, 32, seed=2)
    per_rank = _split_rows(2, workers, samples, "bfd")
    docs = [d for batches in per_rank for ids, dd in batches for d in docs_of(ids, dd)]
    assert Counter(docs) == Counter(tuple(s) for s in samples)
    # wrap with ranks x workers: tokens exactly once
    per_rank = _split_rows(2, workers, samples, "wrap")
    toks = Counter(
        t
        for batches in per_rank
        for ids, dd in batches
        for t, d in zip(ids.ravel().tolist(), dd.ravel().tolist(), strict=True)
        if d >= 0
    )
    assert toks == Counter(t for s in samples for t in s)


@settings(max_examples=25, deadline=None)
@given(
    strategy=st.sampled_from(["bfd", "greedy", "wrap"]),
    indexable=st.booleans(),
    stop=st.integers(0, 40),
    buffer_size=st.integers(1, 12),
    seed=st.integers(0, 3),
)
def test_resume_gives_identical_remaining_stream(strategy, indexable, stop, buffer_size, seed):
    samples = make_samples(60, 16, seed=seed)
    samples.insert(7, [])  # empty samples are skipped, also across a resume
    src = samples if indexable else Stream(samples)
    kw = dict(buffer_size=buffer_size, strategy=strategy, overflow="split")
    full = rows_of(PackedIterableDataset(src, 16, **kw))
    ds = PackedIterableDataset(src, 16, **kw)
    it = iter(ds)
    head = [next(it) for _ in range(min(stop, len(full)))]
    state = ds.state_dict()
    fresh = PackedIterableDataset(src, 16, **kw)
    fresh.load_state_dict(state)
    assert rows_of(head) + rows_of(fresh) == full
    assert rows_of(fresh) == full  # a later iteration starts the stream again


def test_resume_through_dataloader_num_workers_0():
    samples = make_samples(90, 16, seed=5)
    kw = dict(buffer_size=8)
    loader = lambda ds: torch.utils.data.DataLoader(ds, batch_size=3, collate_fn=collate)
    full = [b.input_ids for b in loader(PackedIterableDataset(samples, 16, **kw))]
    ds = PackedIterableDataset(samples, 16, **kw)
    it = iter(loader(ds))
    head = [next(it).input_ids for _ in range(4)]
    again = PackedIterableDataset(samples, 16, **kw)
    again.load_state_dict(ds.state_dict())
    rest = [b.input_ids for b in loader(again)]
    assert len(head) + len(rest) == len(full)
    assert all(torch.equal(a, b) for a, b in zip(head + rest, full, strict=True))


@pytest.mark.parametrize("sync", [False, True])
def test_resume_with_two_workers_stateful_dataloader(sync):
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    samples = make_samples(120, 16, seed=6)
    kw = dict(batch_size=2, num_workers=2, collate_fn=collate)
    ranks = dict(rank=1, world_size=2, sync_ranks=True) if sync else {}
    make = lambda: PackedIterableDataset(samples, 16, buffer_size=8, **ranks)
    full = [b.input_ids for b in sdl.StatefulDataLoader(make(), **kw)]
    loader = sdl.StatefulDataLoader(make(), **kw)
    it = iter(loader)
    head = [next(it).input_ids for _ in range(5)]
    state = loader.state_dict()
    del it
    again = sdl.StatefulDataLoader(make(), **kw)
    again.load_state_dict(state)
    rest = [b.input_ids for b in again]
    assert all(torch.equal(a, b) for a, b in zip(head + rest, full, strict=True))
    assert len(head) + len(rest) == len(full)


def test_bad_input_errors():
    with pytest.raises(ValueError, match="buffer_size must be a positive int, got 0"):
        PackedIterableDataset([[1]], 8, buffer_size=0)
    with pytest.raises(ValueError, match="buffer_size"):
        PackedIterableDataset([[1]], 8, buffer_size=-3)
    with pytest.raises(ValueError, match="rank=2 is not in \\[0, world_size=2\\)"):
        PackedIterableDataset([[1]], 8, rank=2, world_size=2)
    with pytest.raises(ValueError, match="strategy"):
        PackedIterableDataset([[1]], 8, strategy="best")
    with pytest.raises(TypeError, match="one-shot iterator"):
        PackedIterableDataset(iter([[1]]), 8)
    with pytest.raises(TypeError, match="tokenize"):
        list(PackedIterableDataset(["a sentence"], 8))
    with pytest.raises(ValueError, match="no column 'input_ids'"):
        list(PackedIterableDataset([{"tokens": [1, 2]}], 8, column="input_ids"))
    rows = list(PackedIterableDataset([{"input_ids": [1, 2]}], 8))  # the default key
    assert rows[0].input_ids[0, :2].tolist() == [1, 2]
    with pytest.raises(TypeError, match="column="):
        list(PackedIterableDataset([{"tokens": [1, 2]}], 8))
    ds = PackedIterableDataset([[1, 2]], 8, buffer_size=4)
    with pytest.raises(ValueError, match="buffer_size=2"):
        ds.load_state_dict(PackedIterableDataset([[1, 2]], 8, buffer_size=2).state_dict())
    state = PackedIterableDataset([[1, 2]], 8, buffer_size=4, rank=1, world_size=2).state_dict()
    ds.load_state_dict(state)
    with pytest.raises(ValueError, match="reader 1 of 2"):
        list(ds)


def test_hf_dataset_as_stream_two_ranks():
    datasets = pytest.importorskip("datasets")
    samples = make_samples(40, 16, seed=8)
    hf = datasets.Dataset.from_dict({"input_ids": samples, "text": ["t"] * 40})
    docs = []
    for rank in range(2):
        ds = PackedIterableDataset(hf, 16, buffer_size=4, rank=rank, world_size=2)
        docs += [d for r in ds for d in docs_of(r.input_ids, r.doc_ids)]
    assert Counter(docs) == Counter(tuple(s) for s in samples)


def test_state_right_after_iter_is_the_loaded_state():
    samples = make_samples(30, 16, seed=9)
    ds = PackedIterableDataset(samples, 16, buffer_size=5)
    it = iter(ds)
    for _ in range(3):
        next(it)
    state = ds.state_dict()
    again = PackedIterableDataset(samples, 16, buffer_size=5)
    again.load_state_dict(state)
    iter(again)  # not started yet: the state is still the loaded one
    assert again.state_dict() == state


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=0, max_size=50),
    strategy=st.sampled_from(["bfd", "greedy", "wrap"]),
    buffer_size=st.integers(1, 10),
    world=st.integers(1, 4),
)
def test_readers_cover_the_stream_exactly_once(lengths, strategy, buffer_size, world):
    starts = np.cumsum([0, *lengths])[:-1].tolist()
    samples = [list(range(s, s + k)) for s, k in zip(starts, lengths, strict=True)]
    got: Counter = Counter()
    for rank in range(world):
        ds = PackedIterableDataset(
            Stream(samples),
            16,
            buffer_size=buffer_size,
            strategy=strategy,
            overflow="split",
            rank=rank,
            world_size=world,
        )
        for row in ds:
            assert (row.doc_ids >= 0).sum() > 0  # no empty rows
            got.update(tokens_of(rows_of([row])))
    assert got == Counter(t for s in samples for t in s)


@pytest.mark.parametrize("strategy", ["bfd", "greedy", "wrap"])
def test_per_sample_labels_are_kept(strategy):
    # {"input_ids", "labels"} samples (e.g. -100 on the prompt) keep their labels, as
    # pack_sequences does; they were silently replaced by the token ids (loss on the prompt).
    samples = [
        {"input_ids": [1, 2, 3, 4, 5, 6], "labels": [-100, -100, 3, 4, 5, 6]},
        {"input_ids": [7, 8, 9], "labels": [-100, 8, 9]},
        {"input_ids": [10, 11], "labels": [-100, -100]},
    ]
    ds = PackedIterableDataset(samples, 4, buffer_size=2, strategy=strategy, overflow="split")
    label_of = {t: lab for s in samples for t, lab in zip(s["input_ids"], s["labels"], strict=True)}
    seen = 0
    for row in ds:
        ids, labels, doc = row.input_ids[0], row.labels[0], row.doc_ids[0]
        for j in range(4):
            if doc[j] < 0:
                continue
            first = j == 0 or doc[j - 1] != doc[j]
            assert labels[j] == (-100 if first else label_of[int(ids[j])])
            seen += 1
    assert seen == 11
    with pytest.raises(ValueError, match="labels"):
        list(PackedIterableDataset([{"input_ids": [1, 2], "labels": [1]}], 4, buffer_size=1))


def test_wrap_truncate_matches_pack():
    # strategy="wrap" ignored overflow="truncate" (the whole sample was wrapped) while
    # flexpack.pack cuts each sample to max_len first, then wraps. One meaning for both.
    from flexpack import pack_sequences

    samples = [list(range(10)), [20, 21], list(range(30, 55)), [60, 61, 62]]
    ds = PackedIterableDataset(samples, 8, strategy="wrap", overflow="truncate")
    got = [(r.input_ids[0].tolist(), r.doc_ids[0].tolist()) for r in ds]
    ref = pack_sequences(samples, 8, strategy="wrap", overflow="truncate")
    want = list(zip(ref.input_ids.tolist(), ref.doc_ids.tolist(), strict=True))
    assert got == want
    assert tokens_of(rows_of(ds)) == Counter(t for s in samples for t in s[:8])


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"version": 1}, "missing"),
        ({"version": 99}, "version"),
        ("not a state", "Mapping|dict"),
        (None, "Mapping|dict"),
    ],
)
def test_malformed_state_is_a_clear_error(state, match):
    ds = PackedIterableDataset([[1, 2], [3]], 4, buffer_size=2)
    with pytest.raises(ValueError, match=match) as info:
        ds.load_state_dict(state)
    assert "state_dict()" in str(info.value)


def test_malformed_state_fields_are_clear_errors():
    ds = PackedIterableDataset([[1, 2], [3]], 4, buffer_size=2)
    good = ds.state_dict()
    for key, value in [
        ("position", -1),
        ("position", "3"),
        ("pending", [[0, 1]]),
        ("pending", 5),
        ("rows_emitted", None),
    ]:
        with pytest.raises(ValueError, match=key):
            ds.load_state_dict({**good, key: value})


# -- sync_ranks: every rank the same number of rows, every token once ---------------------------


def _sync_ranks(src, world: int, **kw) -> list[list]:
    """Rows of every simulated rank (rank=r, world_size=world), as rows_of tuples."""
    return [
        rows_of(PackedIterableDataset(src, 16, rank=r, world_size=world, sync_ranks=True, **kw))
        for r in range(world)
    ]


def _interleave(per_rank: list[list]) -> list:
    """Global rows back in plan order: row t is rank t % W's row t // W."""
    world = len(per_rank)
    return [per_rank[t % world][t // world] for t in range(sum(map(len, per_rank)))]


@pytest.mark.parametrize("strategy", ["bfd", "greedy", "wrap"])
@pytest.mark.parametrize("source", [list, Stream])
@pytest.mark.parametrize("world", [1, 3, 4])
def test_sync_ranks_equal_rows_every_token_once(strategy, source, world):
    samples = make_samples(61, 16, seed=3)
    kw = dict(buffer_size=8, strategy=strategy, overflow="split")
    per_rank = _sync_ranks(source(samples), world, **kw)
    assert len({len(rows) for rows in per_rank}) == 1  # the point: ranks stay in step
    flat = _interleave(per_rank)
    single = rows_of(PackedIterableDataset(samples, 16, **kw))
    # the global plan is the single-process plan, plus at most world - 1 empty rows at the end
    assert flat[: len(single)] == single
    empty = (tuple([0] * 16), tuple([-1] * 16))
    assert flat[len(single) :] == [empty] * ((-len(single)) % world)
    assert tokens_of(flat) == Counter(t for s in samples for t in s)


def test_sync_ranks_padding_rows_are_counted_and_epochs_repeat():
    samples = make_samples(10, 16, seed=4)
    single = len(list(PackedIterableDataset(samples, 16, buffer_size=4)))
    world = 4
    assert single % world  # the tail needs padding rows
    sets = [
        PackedIterableDataset(samples, 16, buffer_size=4, rank=r, world_size=world, sync_ranks=True)
        for r in range(world)
    ]
    for _ in range(2):  # epoch after epoch
        counts = [len(list(ds)) for ds in sets]
        assert counts == [-(-single // world)] * world
        assert sum(ds.stats.padding_rows for ds in sets) == (-single) % world
        assert [ds.stats.rows for ds in sets] == counts
    ranks_empty = [
        PackedIterableDataset([], 16, rank=r, world_size=world, sync_ranks=True)
        for r in range(world)
    ]
    assert [len(list(ds)) for ds in ranks_empty] == [0] * world


def test_sync_ranks_hf_dataset_reads_lengths_from_arrow_and_keeps_labels():
    datasets = pytest.importorskip("datasets")
    samples = make_samples(40, 24, seed=8)
    labels = [[-100] * (len(s) // 2) + s[len(s) // 2 :] for s in samples]
    hf = datasets.Dataset.from_dict({"input_ids": samples, "labels": labels, "text": ["t"] * 40})
    kw = dict(buffer_size=4, overflow="split")
    per_rank = _sync_ranks(hf, 3, **kw)
    assert len({len(rows) for rows in per_rank}) == 1
    single = rows_of(PackedIterableDataset(samples, 16, **kw))
    assert _interleave(per_rank)[: len(single)] == single
    label_of = {
        t: lab for s, ls in zip(samples, labels, strict=True) for t, lab in zip(s, ls, strict=True)
    }
    for r in range(3):
        ds = PackedIterableDataset(hf, 16, rank=r, world_size=3, sync_ranks=True, **kw)
        for row in ds:
            ids, lab, doc = row.input_ids[0].tolist(), row.labels[0].tolist(), row.doc_ids[0]
            for j in range(16):
                if doc[j] >= 0 and j and doc[j - 1] == doc[j]:
                    assert lab[j] == label_of[ids[j]]
    ds = PackedIterableDataset(hf, 16, rank=1, world_size=3, sync_ranks=True, **kw)
    it = iter(ds)
    head = [next(it) for _ in range(3)]
    again = PackedIterableDataset(hf, 16, rank=1, world_size=3, sync_ranks=True, **kw)
    again.load_state_dict(ds.state_dict())
    assert rows_of(head) + rows_of(again) == per_rank[1]
    nulls = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3, None, 5]]})
    with pytest.raises(ValueError, match="stream item 1 has a null inside"):
        list(PackedIterableDataset(nulls, 16, rank=0, world_size=2, sync_ranks=True))
    nulls = datasets.Dataset.from_dict({"input_ids": [[1, 2], None]})
    with pytest.raises(ValueError, match="stream item 1 has a null 'input_ids'"):
        list(PackedIterableDataset(nulls, 16, rank=0, world_size=2, sync_ranks=True))
    bad = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]], "labels": [[1, 2]]})
    with pytest.raises(ValueError, match="stream item 0 has 3 input_ids but 2 labels"):
        list(PackedIterableDataset(bad, 16, rank=0, world_size=2, sync_ranks=True))


@pytest.mark.parametrize("workers", [0, 2])
def test_sync_ranks_dataloader_workers_equal_steps(workers):
    samples = make_samples(70, 32, seed=2)
    steps, toks = [], Counter()
    for rank in range(3):
        ds = PackedIterableDataset(
            samples, 32, buffer_size=8, rank=rank, world_size=3, sync_ranks=True
        )
        loader = torch.utils.data.DataLoader(
            ds, batch_size=2, num_workers=workers, collate_fn=collate
        )
        batches = list(loader)
        steps.append(len(batches))
        for b in batches:
            for ids, dd in zip(b.input_ids.tolist(), b.doc_ids.tolist(), strict=True):
                toks.update(t for t, d in zip(ids, dd, strict=True) if d >= 0)
    assert len(set(steps)) == 1
    assert toks == Counter(t for s in samples for t in s)


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=0, max_size=40),
    strategy=st.sampled_from(["bfd", "greedy", "wrap"]),
    buffer_size=st.integers(1, 10),
    world=st.integers(1, 4),
    indexable=st.booleans(),
    data=st.data(),
)
def test_sync_ranks_property(lengths, strategy, buffer_size, world, indexable, data):
    starts = np.cumsum([0, *lengths])[:-1].tolist()
    samples = [list(range(s, s + k)) for s, k in zip(starts, lengths, strict=True)]
    src = samples if indexable else Stream(samples)
    kw = dict(buffer_size=buffer_size, strategy=strategy, overflow="split")
    per_rank = _sync_ranks(src, world, **kw)
    assert len({len(rows) for rows in per_rank}) == 1
    assert tokens_of(_interleave(per_rank)) == Counter(t for s in samples for t in s)
    # a resume in the middle of one rank gives the same continuation
    rank = data.draw(st.integers(0, world - 1), label="rank")
    stop = data.draw(st.integers(0, len(per_rank[rank])), label="stop")
    make = lambda: PackedIterableDataset(
        src, 16, rank=rank, world_size=world, sync_ranks=True, **kw
    )
    ds = make()
    it = iter(ds)
    head = [next(it) for _ in range(stop)]
    again = make()
    again.load_state_dict(ds.state_dict())
    assert rows_of(head) + rows_of(again) == per_rank[rank]
    assert again.stats.rows == len(per_rank[rank])


def test_sync_ranks_state_checks():
    state = PackedIterableDataset([[1]], 8, rank=0, world_size=2, sync_ranks=True).state_dict()
    with pytest.raises(ValueError, match="sync_ranks=True"):
        PackedIterableDataset([[1]], 8, rank=0, world_size=2).load_state_dict(state)
    other = PackedIterableDataset([[1]], 8, rank=0, world_size=1, sync_ranks=True)
    other.load_state_dict({**state, "num_readers": 1})
    with pytest.raises(ValueError, match="world_size=2"):
        list(other)


def test_labels_column_names_the_labels_and_none_ignores_them():
    samples = [
        {"input_ids": [1, 2, 3, 4], "target": [-100, -100, 3, 4], "labels": [9, 9, 9, 9]},
        {"input_ids": [5, 6, 7]},  # no labels: labelled by its tokens
    ]

    def labels(**kw):
        (row,) = list(PackedIterableDataset(samples, 8, **kw))
        return row.labels[0].tolist()

    assert labels(labels_column="target") == [-100, -100, 3, 4, -100, 6, 7, -100]
    assert labels() == [-100, 9, 9, 9, -100, 6, 7, -100]  # default "labels"
    assert labels(labels_column=None) == [-100, 2, 3, 4, -100, 6, 7, -100]
    with pytest.raises(ValueError, match="also the token column"):
        PackedIterableDataset(samples, 8, labels_column="input_ids")
    with pytest.raises(TypeError, match="labels_column must be a str or None"):
        PackedIterableDataset(samples, 8, labels_column=3)
    bad = [[1], {"input_ids": [1, 2, 3], "target": [1, 2]}]
    with pytest.raises(ValueError, match="stream item 1 has 3 input_ids but 2 labels"):
        list(PackedIterableDataset(bad, 8, labels_column="target"))
    with pytest.raises(ValueError, match="stream item 1 has 3 input_ids but 2 labels"):
        list(PackedIterableDataset(bad, 8, labels_column="target", rank=1, world_size=2))


def test_truncate_is_counted_in_stats():
    samples = [list(range(10)), [20, 21], list(range(30, 55))]
    for strategy in ("bfd", "greedy", "wrap"):
        ds = PackedIterableDataset(
            samples, 8, buffer_size=2, strategy=strategy, overflow="truncate"
        )
        rows = rows_of(ds)
        assert sum(tokens_of(rows).values()) + ds.stats.truncated == 37
        assert (ds.stats.truncated, ds.stats.truncated_samples) == (2 + 17, 2)


# ------------------------------------------------------- Hugging Face streams


def _row_tuples(batches):
    return sorted(
        (tuple(b.input_ids[0].tolist()), tuple(b.labels[0].tolist()), tuple(b.doc_ids[0].tolist()))
        for b in batches
    )


@pytest.mark.parametrize("sync_ranks", [False, True])
@pytest.mark.parametrize("shards", [1, 3])
def test_hf_iterable_dataset_with_dataloader_workers_keeps_every_token(sync_ranks, shards):
    # A datasets.IterableDataset iterated inside a DataLoader worker yields only that worker's
    # shards; flexpack then split the stream again, so about half the tokens were silently lost
    # with num_workers=2 (and, with sync_ranks, workers planned different rows).
    datasets = pytest.importorskip("datasets")
    ids = [[i + 1] * (i % 3 + 1) for i in range(40)]
    labels = [[-100, *x[1:]] for x in ids]
    source = datasets.Dataset.from_dict({"input_ids": ids, "labels": labels})
    stream = source.to_iterable_dataset(num_shards=shards)
    kw = dict(buffer_size=4, sync_ranks=sync_ranks)
    if sync_ranks:  # the rows of one process, dealt to the workers
        expected = _row_tuples(PackedIterableDataset(stream, 8, world_size=1, rank=0, **kw))
    else:  # worker w reads stream items w, w + 2, ...: as rank w of 2 with one worker
        expected = _row_tuples(
            b for r in (0, 1) for b in PackedIterableDataset(stream, 8, world_size=2, rank=r, **kw)
        )
    loader = torch.utils.data.DataLoader(
        PackedIterableDataset(stream, 8, world_size=1, rank=0, **kw), batch_size=None, num_workers=2
    )
    got = _row_tuples(loader)
    assert sum(sum(d >= 0 for d in r[2]) for r in got) == sum(map(len, ids))
    assert got == expected


def test_sync_ranks_hf_dataset_with_a_null_labels_row_matches_the_unsynced_stream():
    # A sample whose labels are None is labelled by its tokens when streaming; with
    # sync_ranks=True (the HF dataset read through Arrow) the null row became a garbage length
    # cast and a "3 input_ids but 0 labels" error.
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict(
        {"input_ids": [[1, 2, 3], [4, 5], [6, 7]], "labels": [None, [-100, 5], None]}
    )
    plain = _row_tuples(PackedIterableDataset(ds, 8, buffer_size=4))
    synced = _row_tuples(PackedIterableDataset(ds, 8, buffer_size=4, sync_ranks=True, world_size=1))
    assert synced == plain
    assert plain[0][1] == (-100, 2, 3, -100, 5, -100, 7, -100)


def test_stream_already_split_by_node_is_refused_when_flexpack_splits_again():
    # split_dataset_by_node (HF's DDP recipe) + PackedIterableDataset's own rank split kept
    # 1/world of each rank's share: half the data silently lost at world_size=2.
    datasets = pytest.importorskip("datasets")
    from datasets.distributed import split_dataset_by_node

    source = datasets.Dataset.from_dict({"input_ids": [[i + 1] * 2 for i in range(10)]})
    part = split_dataset_by_node(source.to_iterable_dataset(num_shards=2), rank=1, world_size=2)
    with pytest.raises(ValueError, match="split_dataset_by_node"):
        PackedIterableDataset(part, 4, rank=1, world_size=2)
    rows = list(PackedIterableDataset(part, 4, rank=0, world_size=1))  # this rank's split as is
    assert sum(int((r.doc_ids >= 0).sum()) for r in rows) == 10
