"""flexpack.data map-style pipeline: PackedDataset, shard / sampler, collate."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from _rows import docs_of
from hypothesis import given, settings
from hypothesis import strategies as st

import flexpack
from flexpack.data import DistributedPackedSampler, PackedDataset, collate, shard_rows


def make_samples(n: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """n samples with globally unique token ids, lengths in [1, max_len]."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len + 1, size=n)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return [list(range(int(s), int(s + n_))) for s, n_ in zip(starts, lengths, strict=True)]


def test_rows_hold_every_sample_once_with_contract_fields():
    samples = make_samples(60, 16)
    ds = PackedDataset(samples, 16)
    docs = []
    for i in range(len(ds)):
        row = ds[i]
        assert row.input_ids.shape == (1, 16) and row.input_ids.dtype == torch.int64
        pad = row.doc_ids < 0
        assert (row.labels[pad] == -100).all()
        # labels: unshifted copy with -100 on each document's first token
        first = torch.ones_like(pad)
        first[:, 1:] = row.doc_ids[:, 1:] != row.doc_ids[:, :-1]
        real = ~pad
        assert (row.labels[real & first] == -100).all()
        assert (row.labels[real & ~first] == row.input_ids[real & ~first]).all()
        docs += docs_of(row.input_ids, row.doc_ids)
    assert Counter(docs) == Counter(tuple(s) for s in samples)


def test_matches_plan_materialize():
    samples = make_samples(40, 12, seed=3)
    ds = PackedDataset(samples, 12)
    try:
        ref = ds.plan.materialize(samples)
    except NotImplementedError:  # pragma: no cover - until the packer lands
        pytest.skip("PackPlan.materialize not implemented yet")
    got = collate([ds[i] for i in range(len(ds))])
    assert torch.equal(got.input_ids, ref.input_ids)
    assert torch.equal(got.labels, ref.labels)
    assert torch.equal(got.doc_ids.int(), ref.doc_ids.int())


@pytest.mark.parametrize("kind", ["numpy_object", "numpy_2d", "arrow", "arrow_table", "tensors"])
def test_accepts_indexables(kind):
    pa = pytest.importorskip("pyarrow")
    samples = make_samples(30, 8, seed=1)
    if kind == "numpy_object":
        src = np.empty(len(samples), dtype=object)
        src[:] = [np.asarray(s, dtype=np.int32) for s in samples]
    elif kind == "numpy_2d":
        samples = [list(range(i * 4, i * 4 + 4)) for i in range(10)]
        src = np.asarray(samples, dtype=np.int64)
    elif kind == "arrow":
        src = pa.chunked_array([samples[:10], samples[10:]], type=pa.list_(pa.int32()))
    elif kind == "arrow_table":
        src = pa.table({"input_ids": samples})
    else:
        src = [torch.tensor(s) for s in samples]
    ds = PackedDataset(src, 8)
    docs = [d for i in range(len(ds)) for d in docs_of(ds[i].input_ids, ds[i].doc_ids)]
    assert Counter(docs) == Counter(tuple(s) for s in samples)


def test_hf_dataset_column_lengths_and_rows():
    datasets = pytest.importorskip("datasets")
    samples = make_samples(50, 10, seed=2)
    hf = datasets.Dataset.from_dict({"input_ids": samples, "text": ["x"] * 50})
    hf = hf.select(range(49, -1, -1))  # an indices mapping: lengths must follow it
    ds = PackedDataset(hf, 10)
    np.testing.assert_array_equal(ds.lengths, [len(s) for s in samples[::-1]])
    docs = [d for i in range(len(ds)) for d in docs_of(ds[i].input_ids, ds[i].doc_ids)]
    assert Counter(docs) == Counter(tuple(s) for s in samples)


def test_bad_input_errors():
    with pytest.raises(TypeError, match="tokenize"):
        PackedDataset(["some text", "more"], 8)
    with pytest.raises(TypeError, match="sequence of token"):
        PackedDataset([3, 4], 8)
    with pytest.raises(TypeError, match="integer"):
        PackedDataset([np.array([0.5, 1.5])], 8)
    # a list of dicts works: tokens under column (default "input_ids")
    assert len(PackedDataset([{"input_ids": [1, 2]}], 8)) == 1
    with pytest.raises(ValueError, match="column=<key of the token ids>"):
        PackedDataset([{"tokens": [1, 2]}], 8)
    with pytest.raises(TypeError, match="drop column="):
        PackedDataset([[1, 2]], 8, column="tokens")
    with pytest.raises(ValueError, match="max_len"):
        PackedDataset([[1]], 0)
    datasets = pytest.importorskip("datasets")
    hf = datasets.Dataset.from_dict({"tokens": [[1, 2]]})
    with pytest.raises(ValueError, match="has columns \\['tokens'\\]"):
        PackedDataset(hf, 8)
    ds = PackedDataset(make_samples(10, 4), 4)
    with pytest.raises(ValueError, match="rank=2 is not in"):
        ds.shard(2, 2)
    with pytest.raises(ValueError, match="rank=-1"):
        DistributedPackedSampler(ds, num_replicas=2, rank=-1)
    with pytest.raises(ValueError, match="remainder"):
        ds.shard(0, 2, remainder="keep")


# uint64 token ids >= 2**63: every reader refuses them with the one shared check, as
# pack_sequences does (they wrapped to negative ids: PackedDataset, PackedIterableDataset,
# pack_trees; the CLI's Parquet reader is tested in test_cli.py).
_BIG = np.array([3, 2**63 + 5, 4], dtype=np.uint64)


@pytest.mark.parametrize(
    "read",
    [
        lambda s: flexpack.data.PackedDataset(s, max_len=4)[0],
        lambda s: list(flexpack.data.PackedIterableDataset(s, max_len=4, buffer_size=2)),
        lambda s: flexpack.pack_trees([(s[0], [s[0]])], max_len=8),
        lambda s: flexpack.pack_sequences(s, max_len=4),
    ],
    ids=["PackedDataset", "PackedIterableDataset", "pack_trees", "pack_sequences"],
)
@pytest.mark.parametrize("as_tensor", [False, True])
def test_uint64_token_ids_past_int64_are_refused(read, as_tensor):
    big = torch.from_numpy(_BIG) if as_tensor else _BIG
    with pytest.raises(ValueError, match=rf"element 1 is {2**63 + 5}, which does not fit int64"):
        read([big])
    fits = np.array([3, 2**63 - 1, 4], dtype=np.uint64)
    row = flexpack.data.PackedDataset([fits], max_len=4)[0]
    assert row.input_ids.tolist() == [[3, 2**63 - 1, 4, 0]]


def test_getitems_of_no_indices_is_no_rows():
    # __getitems__([]) returned one empty batch: one result for zero indices.
    ds = flexpack.data.PackedDataset([[1, 2], [3]], max_len=4)
    assert ds.__getitems__([]) == []
    assert len(ds.__getitems__([0, 0])) == 2


@pytest.mark.parametrize("name", ["world_size", "num_replicas"])
def test_world_size_zero_says_ranks_not_4096(name):
    # world_size=0 suggested "world_size=4096", a row length.
    ds = flexpack.data.PackedDataset([[1, 2], [3]], max_len=4)
    if name == "world_size":
        call = lambda: ds.shard(0, 0)
    else:
        call = lambda: flexpack.data.DistributedPackedSampler(ds, num_replicas=0, rank=0)
    with pytest.raises(ValueError, match=r"number of ranks.*get_world_size\(\)") as e:
        call()
    assert "4096" not in str(e.value)


@pytest.mark.parametrize("pad_id", [1.7, True, "0"])
def test_datasets_refuse_a_pad_id_that_is_not_an_int(pad_id):
    # pad_id=1.7 was truncated to 1 by int(); pack_sequences refuses it.
    with pytest.raises(TypeError, match="pad_id must be an int token id"):
        flexpack.data.PackedDataset([[1, 2]], max_len=4, pad_id=pad_id)
    with pytest.raises(TypeError, match="pad_id must be an int token id"):
        flexpack.data.PackedIterableDataset([[1, 2]], max_len=4, pad_id=pad_id)
    ds = flexpack.data.PackedDataset([[1, 2]], max_len=4, pad_id=np.int64(7))
    assert ds[0].input_ids.tolist() == [[1, 2, 7, 7]]


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 100), min_size=1, max_size=60),
    world=st.integers(1, 7),
    shuffle=st.booleans(),
    epoch=st.integers(0, 3),
)
def test_shard_rows_counts_and_coverage(tokens, world, shuffle, epoch):
    n = len(tokens)
    for remainder in ("drop", "pad", "error"):
        if remainder == "error" and n % world:
            with pytest.raises(ValueError, match="do not divide"):
                shard_rows(tokens, world, remainder=remainder)
            continue
        if remainder == "drop" and n < world:
            with pytest.raises(ValueError, match="every rank empty"):
                shard_rows(tokens, world, remainder=remainder)
            continue
        a = shard_rows(tokens, world, shuffle=shuffle, epoch=epoch, remainder=remainder)
        assert a.shape == (world, n // world if remainder == "drop" else -(-n // world))
        counts = Counter(a.ravel().tolist())
        if remainder == "pad":
            assert set(counts) == set(range(n))  # every row at least once
            assert sum(c - 1 for c in counts.values()) == a.size - n
        else:
            assert max(counts.values()) == 1  # never twice
            assert len(counts) == n - n % world


def test_shard_rows_remainder_without_shuffle_is_the_documented_rows():
    tokens = [1, 2, 3, 100, 200]
    # "drop" leaves out the emptiest rows, "pad" repeats the fullest (as documented)
    dropped = set(range(5)) - set(shard_rows(tokens, 3, remainder="drop").ravel().tolist())
    assert dropped == {0, 1}
    padded = Counter(shard_rows(tokens, 3, remainder="pad").ravel().tolist())
    assert [r for r, c in padded.items() if c > 1] == [4]


@pytest.mark.parametrize(("kwargs", "match"), [({"seed": -1}, "seed"), ({"epoch": -1}, "epoch")])
def test_shard_rows_negative_seed_or_epoch_names_itself(kwargs, match):
    with pytest.raises(ValueError, match=f"{match} must be an int >= 0, got -1"):
        shard_rows([1, 2, 3, 4], 2, shuffle=True, **kwargs)
    with pytest.raises(ValueError, match=f"{match} must be an int >= 0"):
        shard_rows([1, 2, 3, 4], 2, shuffle=True, **{match: 1.5})


def test_shard_rows_refuses_float_counts():
    from flexpack.data.dataset import shard_rows

    with pytest.raises(TypeError, match=r"num_tokens must be integers.*float64.*\[1.5, 2.0\]"):
        shard_rows([1.5, 2], 1)
    assert shard_rows(np.array([3, 2], dtype=np.uint8), 1).tolist() == [[0, 1]]


def test_sampler_every_row_once_equal_counts_epochs_differ():
    samples = make_samples(203, 32, seed=4)
    ds = PackedDataset(samples, 32)
    world = 4
    orders = []
    for epoch in range(2):
        seen, per_rank = [], []
        for rank in range(world):
            s = DistributedPackedSampler(ds, num_replicas=world, rank=rank, remainder="pad")
            s.set_epoch(epoch)
            idx = list(s)
            per_rank.append(len(idx))
            assert len(idx) == len(s)
            seen += idx
        assert len(set(per_rank)) == 1
        assert set(seen) == set(range(len(ds)))
        orders.append(seen)
    assert orders[0] != orders[1]
    # tokens: every sample exactly once over the epoch's rows with remainder="error"-able shapes
    shards = [ds.shard(r, world, remainder="drop") for r in range(world)]
    assert len({len(s) for s in shards}) == 1
    rows = np.concatenate([s.rows for s in shards])
    assert len(set(rows.tolist())) == len(rows) == len(ds) - len(ds) % world


def test_sampler_balances_tokens_per_step():
    rng = np.random.default_rng(0)
    tokens = rng.integers(100, 4096, size=4000)
    world, batch = 8, 4
    a = shard_rows(tokens, world, shuffle=True, seed=1, remainder="drop")
    steps = a.shape[1] // batch
    per_step = tokens[a[:, : steps * batch]].reshape(world, steps, batch).sum(-1)
    spread = (per_step.max(0) - per_step.min(0)).mean()
    naive = rng.permutation(len(tokens))[: a.size].reshape(world, -1)
    naive_step = tokens[naive[:, : steps * batch]].reshape(world, steps, batch).sum(-1)
    naive_spread = (naive_step.max(0) - naive_step.min(0)).mean()
    assert spread < naive_spread / 10


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_with_sampler_and_collate(workers):
    samples = make_samples(80, 16, seed=5)
    ds = PackedDataset(samples, 16)
    docs = []
    for rank in range(2):
        sampler = DistributedPackedSampler(ds, num_replicas=2, rank=rank, remainder="pad")
        loader = torch.utils.data.DataLoader(
            ds, batch_size=3, sampler=sampler, collate_fn=collate, num_workers=workers
        )
        for batch in loader:
            assert batch.input_ids.shape[1] == 16 and batch.input_ids.shape[0] <= 3
            docs += docs_of(batch.input_ids, batch.doc_ids)
    assert set(docs) == {tuple(s) for s in samples}


def test_collate_dict_rows_and_errors():
    rows = [
        {"input_ids": [1, 2, 0], "labels": [-100, 2, -100], "doc_ids": [0, 0, -1]},
        {"input_ids": [3, 4, 5], "labels": [-100, -100, 5], "doc_ids": [0, 1, 1]},
    ]
    b = collate(rows)
    assert b.input_ids.shape == (2, 3) and b.doc_ids.dtype == torch.int32
    with pytest.raises(ValueError, match="missing \\['doc_ids'\\]"):
        collate([{"input_ids": [1], "labels": [1]}])
    with pytest.raises(ValueError, match="different lengths"):
        collate([rows[0], {k: v[:2] for k, v in rows[1].items()}])
    with pytest.raises(TypeError, match="expected a PackedBatch"):
        collate([[1, 2, 3]])
    with pytest.raises(ValueError, match="no rows"):
        collate([])


@pytest.mark.parametrize("workers", [0, 2])
def test_collate_with_mask_in_workers(workers):
    import functools
    import pickle

    from flexpack import document_causal_mask
    from flexpack.data import collate_with_mask
    from flexpack.masks import mask_of
    from flexpack.testing import dense_mask

    ds = PackedDataset(make_samples(40, 24, seed=7), 24)
    fn = functools.partial(collate_with_mask, block_size=8)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=fn)
    for out in loader:
        out = pickle.loads(pickle.dumps(out))  # what a worker sends
        ref = document_causal_mask(out.batch.doc_ids, block_size=8)
        assert mask_of(out.block_mask).kind == "document_causal"
        assert torch.equal(out.block_mask.kv_num_blocks, ref.kv_num_blocks)
        assert torch.equal(out.block_mask.full_kv_indices, ref.full_kv_indices)
        r, s = out.batch.input_ids.shape
        moved = out.to("cpu")
        assert torch.equal(dense_mask(moved.block_mask, r, 1, s, s), dense_mask(ref, r, 1, s, s))
    with pytest.raises(ValueError, match="mask must be one of"):
        collate_with_mask([ds[0]], mask="causal")
