"""flexpack.integrations.datasets.pack_dataset: global plan, Arrow streaming, disk round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

datasets = pytest.importorskip("datasets")

from flexpack import pack  # noqa: E402
from flexpack.data import PackedDataset, collate  # noqa: E402
from flexpack.integrations.datasets import pack_dataset  # noqa: E402


def make_samples(n: int, max_len: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len + 1, size=n)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return [list(range(int(s), int(s + k))) for s, k in zip(starts, lengths, strict=True)]


@pytest.fixture(scope="module")
def samples():
    return make_samples(300, 48, seed=1)


def test_rows_equal_the_global_plan(samples):
    ds = datasets.Dataset.from_dict({"input_ids": samples, "text": ["t"] * len(samples)})
    packed = pack_dataset(ds, 48, batch_size=64)
    ref = pack([len(s) for s in samples], 48).materialize(samples)
    assert packed.column_names == ["input_ids", "seqlens", "num_tokens"]  # unpadded
    assert packed.features["input_ids"].feature.dtype == "int32"  # stored narrow
    got = packed.with_format("numpy")[:]
    np.testing.assert_array_equal(got["num_tokens"], (ref.doc_ids >= 0).sum(1).numpy())
    assert [len(x) for x in got["input_ids"]] == got["num_tokens"].tolist()
    ref_seqlens = [ref.layout.row_seqlens[r] for r in range(len(ref))]
    assert [x.tolist() for x in got["seqlens"]] == [list(map(int, s)) for s in ref_seqlens]
    batch = collate(list(packed), max_len=48)
    for name in ("input_ids", "labels", "doc_ids", "position_ids", "cu_seqlens"):
        assert torch.equal(getattr(batch, name), getattr(ref, name)), name
    assert batch.input_ids.dtype == torch.int64
    torch_rows = collate(list(packed.with_format("torch").select(range(3))), max_len=48)
    assert torch.equal(torch_rows.input_ids, ref.input_ids[:3])
    # PackedDataset over the stored rows pads them on access, same rows
    served = PackedDataset(packed, 48)
    assert served.plan is None and len(served) == len(ref)
    np.testing.assert_array_equal(served.num_tokens, got["num_tokens"])
    rows = collate([served[i] for i in range(len(served))])
    assert torch.equal(rows.input_ids, ref.input_ids) and torch.equal(rows.labels, ref.labels)
    with pytest.raises(ValueError, match="max_len=47"):
        PackedDataset(packed, 47)
    table = PackedDataset(packed.data.table, 48)  # a pyarrow Table of stored rows too
    assert torch.equal(table[len(ref) - 1].input_ids, ref.input_ids[-1:])


def test_padded_rows_equal_the_global_plan(samples):
    ds = datasets.Dataset.from_dict({"input_ids": samples})
    packed = pack_dataset(ds, 48, batch_size=64, padded=True, pad_id=7)
    ref = pack([len(s) for s in samples], 48).materialize(samples, pad_id=7)
    got = packed.with_format("torch")[:]
    names = {"input_ids", "labels", "doc_ids", "position_ids", "num_tokens"}
    assert set(packed.column_names) == names
    assert torch.equal(got["num_tokens"], (ref.doc_ids >= 0).sum(1))
    for name in ("input_ids", "labels", "doc_ids", "position_ids"):
        assert torch.equal(got[name], getattr(ref, name)), name
    assert packed.features["input_ids"].feature.dtype == "int32"
    batch = collate([packed.with_format("torch")[i] for i in range(3)])
    assert torch.equal(batch.input_ids, ref.input_ids[:3])


def test_save_load_round_trip_disk_backed_and_num_proc(samples, tmp_path):
    src = datasets.Dataset.from_dict({"input_ids": samples, "labels": samples})
    src.save_to_disk(tmp_path / "src")
    src = datasets.load_from_disk(tmp_path / "src").select(range(len(samples) - 1, -1, -1))
    packed = pack_dataset(src, 48, num_proc=2, batch_size=32)
    assert packed.cache_files  # written to Arrow files, not held in memory
    assert packed.column_names == ["input_ids", "labels", "seqlens", "num_tokens"]
    packed.save_to_disk(tmp_path / "packed")
    again = datasets.load_from_disk(tmp_path / "packed")
    assert again.features == packed.features
    assert again[:] == packed[:]
    ref = pack([len(s) for s in samples[::-1]], 48).materialize(samples[::-1])
    batch = collate(list(again), max_len=48)
    assert torch.equal(batch.input_ids, ref.input_ids)
    assert torch.equal(batch.labels, ref.labels)
    served = PackedDataset(again.select(range(len(again) - 1, -1, -1)), 48)
    assert torch.equal(served[0].input_ids, ref.input_ids[-1:])
    # no indices mapping: workers read the memory-mapped buffers zero-copy, same rows
    plain = datasets.load_from_disk(tmp_path / "src")
    direct = pack_dataset(plain, 48, num_proc=2, batch_size=16)
    ref = pack([len(s) for s in samples], 48).materialize(samples)
    assert torch.equal(collate(list(direct), max_len=48).labels, ref.labels)


def test_no_more_rows_than_chunked_packing():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(300), 1.0, size=3000), 1, 4096).astype(int)
    plan = pack(lengths, 4096)
    chunked = sum(pack(lengths[i : i + 1000], 4096).num_rows for i in range(0, 3000, 1000))
    assert plan.num_rows <= chunked


def test_bad_input():
    ds = datasets.Dataset.from_dict({"tokens": [[1, 2]], "text": ["hi"]})
    with pytest.raises(ValueError, match="column 'input_ids' is not in the dataset"):
        pack_dataset(ds, 8)
    with pytest.raises(TypeError, match="expected list<int>"):
        pack_dataset(ds, 8, column="text")
    with pytest.raises(TypeError, match=r"expected a datasets\.Dataset"):
        pack_dataset([[1, 2]], 8)
    with pytest.raises(ValueError, match="max_len"):
        pack_dataset(ds, 0, column="tokens")


def test_empty_input_keeps_the_columns():
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int64"))})
    for rows in ([], [[], []]):
        ds = datasets.Dataset.from_dict({"input_ids": rows}, features=features)
        packed = pack_dataset(ds, 8)
        assert len(packed) == 0
        assert packed.column_names == ["input_ids", "seqlens", "num_tokens"]
        assert pack_dataset(ds, 8, padded=True).column_names == [
            "input_ids",
            "labels",
            "doc_ids",
            "position_ids",
            "num_tokens",
        ]


def test_packed_dataset_refuses_padded_packed_rows_with_a_clear_error():
    # pack_dataset(padded=True) rows given to PackedDataset failed with "tokenize it first"
    # (their fixed-size lists), which sends the user the wrong way.
    datasets = pytest.importorskip("datasets")
    from flexpack.data import PackedDataset, collate
    from flexpack.integrations.datasets import pack_dataset

    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6]]})
    padded = pack_dataset(ds, 4, padded=True)
    with pytest.raises(ValueError, match="padded=False"):
        PackedDataset(padded, 4)
    assert (
        collate(list(padded)).doc_ids.tolist()
        == collate(list(pack_dataset(ds, 4)), max_len=4).doc_ids.tolist()
    )


def _docs_of(batch):
    """(tokens, labels, positions) of every document of a PackedBatch, brute force per token."""
    out = []
    for r in range(batch.input_ids.shape[0]):
        d = batch.doc_ids[r].tolist()
        for doc in sorted({x for x in d if x >= 0}):
            pos = [i for i, x in enumerate(d) if x == doc]
            out.append(
                (
                    batch.input_ids[r, pos].tolist(),
                    batch.labels[r, pos].tolist(),
                    batch.position_ids[r, pos].tolist(),
                )
            )
    return out


@st.composite
def _labelled_samples(draw):
    max_len = draw(st.integers(2, 12))
    n = draw(st.integers(1, 12))
    ids = [
        draw(st.lists(st.integers(0, 2**31 + 5), min_size=1, max_size=max_len)) for _ in range(n)
    ]
    labels = [[t if draw(st.booleans()) else -100 for t in x] for x in ids]
    return max_len, ids, labels


@settings(deadline=None)
@given(_labelled_samples(), st.sampled_from(["none", "permute", "concat"]))
def test_every_pack_dataset_path_agrees_with_the_samples(case, view):
    """pack_dataset unpadded + collate, padded, PackedDataset over the source and over the
    packed rows: the same batch, and every document is one source sample with its labels."""
    datasets = pytest.importorskip("datasets")
    from flexpack.data import PackedDataset, collate
    from flexpack.integrations.datasets import pack_dataset

    max_len, ids, labels = case
    ds = datasets.Dataset.from_dict({"input_ids": ids, "labels": labels})
    if view == "permute":
        ds = ds.select(list(range(len(ids)))[::-1])
    elif view == "concat" and len(ids) > 1:
        half = len(ids) // 2
        ds = datasets.concatenate_datasets(
            [ds.select(range(half)), ds.select(range(half, len(ids)))]
        )
    ref = collate(list(pack_dataset(ds, max_len, seed=None)), max_len=max_len)
    packed = pack_dataset(ds, max_len, seed=None)
    others = [
        collate(list(pack_dataset(ds, max_len, seed=None, padded=True))),
        collate(list(PackedDataset(ds, max_len, seed=None))),
        collate(list(PackedDataset(packed, max_len))),
    ]
    for other in others:
        for field in ("input_ids", "labels", "doc_ids", "position_ids"):
            assert torch.equal(getattr(ref, field), getattr(other, field)), field
    got = sorted((t, lab) for t, lab, pos in _docs_of(ref) if pos == list(range(len(t))))
    want = sorted((x, [-100, *lab[1:]]) for x, lab in zip(ids, labels, strict=True))
    assert got == want


def test_pack_dataset_of_only_empty_samples_says_so():
    datasets = pytest.importorskip("datasets")
    from flexpack.integrations.datasets import pack_dataset

    ds = datasets.Dataset.from_dict({"input_ids": [[], []]})
    with pytest.raises(ValueError, match="every sample is empty"):
        pack_dataset(ds, max_len=8)
