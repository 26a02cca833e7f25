"""labels_column: per-token labels survive PackedDataset and pack_dataset, token by token."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flexpack
from flexpack import PackedBatch, PackedLayout, pack
from flexpack.data import PackedDataset, collate

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")

from flexpack.integrations.datasets import pack_dataset  # noqa: E402


def reference_rows(ids, labels, plan, pad_id=0):
    """Brute force: rows token by token from the plan's segments (labels None: the ids)."""
    r, s = plan.num_rows, plan.max_len
    out_ids = [[pad_id] * s for _ in range(r)]
    out_lab = [[-100] * s for _ in range(r)]
    fill = [0] * r
    for row, sample, start, stop in plan.segments.tolist():
        src = ids[sample] if labels is None or labels[sample] is None else labels[sample]
        for k, t in enumerate(range(start, stop)):
            out_ids[row][fill[row]] = ids[sample][t]
            out_lab[row][fill[row]] = -100 if k == 0 else src[t]
            fill[row] += 1
    return torch.tensor(out_ids), torch.tensor(out_lab)


def make(n, max_len, seed=0, long=False):
    rng = np.random.default_rng(seed)
    hi = 2 * max_len if long else max_len
    lengths = rng.integers(1, hi + 1, size=n)
    ids = [rng.integers(0, 1000, size=k).tolist() for k in lengths]
    labels = [[-100 if rng.random() < 0.3 else t for t in x] for x in ids]
    return ids, labels


def rows_of(ds):
    if len(ds) == 0:
        return PackedBatch(
            torch.zeros(0, ds.max_len, dtype=torch.int64),
            torch.zeros(0, ds.max_len, dtype=torch.int64),
            PackedLayout.from_seqlens([], ds.max_len),
        )
    return collate([ds[i] for i in range(len(ds))])


@pytest.mark.parametrize("kind", ["dicts", "hf", "table"])
def test_packed_dataset_keeps_labels(kind):
    ids, labels = make(40, 12, seed=1)
    dicts = [{"input_ids": a, "labels": b} for a, b in zip(ids, labels, strict=True)]
    src = {
        "dicts": dicts,
        "hf": datasets.Dataset.from_list(dicts),
        "table": pa.Table.from_pylist(dicts),
    }[kind]
    ds = PackedDataset(src, 12, column="input_ids")
    plan = pack([len(x) for x in ids], 12)
    want_ids, want_lab = reference_rows(ids, labels, plan)
    got = rows_of(ds)
    assert torch.equal(got.input_ids, want_ids)
    assert torch.equal(got.labels, want_lab)
    ignored = rows_of(PackedDataset(src, 12, labels_column=None))
    assert torch.equal(ignored.labels, reference_rows(ids, None, plan)[1])


def test_list_of_dicts_with_other_column_names():
    ids, labels = make(20, 10, seed=2)
    dicts = [{"tok": a, "lab": b, "text": "x"} for a, b in zip(ids, labels, strict=True)]
    ds = PackedDataset(dicts, 10, column="tok", labels_column="lab")
    plan = pack([len(x) for x in ids], 10)
    want_ids, want_lab = reference_rows(ids, labels, plan)
    got = rows_of(ds)
    assert torch.equal(got.input_ids, want_ids) and torch.equal(got.labels, want_lab)
    # dicts without the labels key use their ids, per sample
    mixed = [d if i % 2 else {"tok": d["tok"]} for i, d in enumerate(dicts)]
    mixed_labels = [lab if i % 2 else None for i, lab in enumerate(labels)]
    got = rows_of(PackedDataset(mixed, 10, column="tok", labels_column="lab"))
    assert torch.equal(got.labels, reference_rows(ids, mixed_labels, plan)[1])


def test_issue_example_pack_dataset_keeps_prompt_masking():
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3, 4]], "labels": [[-100, -100, 3, 4]]})
    row = collate(list(pack_dataset(ds, 8)), max_len=8)
    assert row.labels.tolist() == [[-100, -100, 3, 4, -100, -100, -100, -100]]
    padded = pack_dataset(ds, 8, padded=True)
    assert padded[0]["labels"] == [-100, -100, 3, 4, -100, -100, -100, -100]
    ignored = collate(list(pack_dataset(ds, 8, labels_column=None)), max_len=8)
    assert ignored.labels.tolist() == [[-100, 2, 3, 4, -100, -100, -100, -100]]


def test_label_length_mismatch_names_the_sample():
    dicts = [{"input_ids": [1, 2], "labels": [1, 2]}, {"input_ids": [3, 4, 5], "labels": [3]}]
    with pytest.raises(ValueError, match=r"sample 1 has 3 input_ids but 1 labels"):
        PackedDataset(dicts, 8)
    with pytest.raises(ValueError, match=r"sample 1 has 3 input_ids but 1 labels"):
        PackedDataset(datasets.Dataset.from_list(dicts), 8)
    with pytest.raises(ValueError, match=r"sample 1 has 3 input_ids but 1 labels"):
        PackedDataset(pa.Table.from_pylist(dicts), 8)
    with pytest.raises(ValueError, match=r"sample 1 has 3 input_ids but 1 labels"):
        pack_dataset(datasets.Dataset.from_list(dicts), 8)
    with pytest.raises(ValueError, match="labels_column=None"):
        pack_dataset(datasets.Dataset.from_list(dicts), 8)


@given(
    data=st.lists(
        st.lists(st.tuples(st.integers(0, 50), st.booleans()), min_size=0, max_size=20),
        min_size=1,
        max_size=25,
    ),
    max_len=st.integers(1, 16),
    overflow=st.sampled_from(["split", "truncate", "drop"]),
    padded=st.booleans(),
)
def test_property_labels_token_by_token(data, max_len, overflow, padded):
    ids = [[t for t, _ in s] for s in data]
    labels = [[-100 if m else t for t, m in s] for s in data]
    plan = pack([len(x) for x in ids], max_len, overflow=overflow)
    want_ids, want_lab = reference_rows(ids, labels, plan)
    dicts = [{"input_ids": a, "labels": b} for a, b in zip(ids, labels, strict=True)]
    got = rows_of(PackedDataset(dicts, max_len, overflow=overflow))
    assert torch.equal(got.input_ids.reshape(-1, max_len), want_ids.reshape(-1, max_len))
    assert torch.equal(got.labels.reshape(-1, max_len), want_lab.reshape(-1, max_len))
    features = datasets.Features(
        {k: datasets.List(datasets.Value("int64")) for k in ("input_ids", "labels")}
    )
    hf = datasets.Dataset.from_dict({"input_ids": ids, "labels": labels}, features=features)
    out = pack_dataset(hf, max_len, overflow=overflow, padded=padded, keep_in_memory=True)
    assert len(out) == plan.num_rows
    if plan.num_rows:
        got = collate(list(out.with_format("numpy")), max_len=max_len)
        assert torch.equal(got.input_ids, want_ids)
        assert torch.equal(got.labels, want_lab)


@given(
    rows=st.lists(
        # token ids and pad ids >= 0: negative ones are refused, as the CLI refuses them
        st.lists(st.lists(st.integers(0, 2**40), min_size=1, max_size=5), max_size=4),
        min_size=1,
        max_size=5,
    ),
    extra=st.integers(0, 3),
    pad_id=st.integers(0, 3),
    with_labels=st.booleans(),
)
def test_property_collate_unpadded_rows(rows, extra, pad_id, with_labels):
    """collate of unpadded rows == padding each row by hand, field by field."""
    longest = max(sum(len(d) for d in docs) for docs in rows)
    max_len = max(longest, 1) + extra
    dicts, want = [], {k: [] for k in ("input_ids", "labels", "doc_ids", "position_ids")}
    for docs in rows:
        flat = [t for d in docs for t in d]
        lab = [t * 2 if with_labels else t for t in flat]
        row = {"input_ids": flat, "seqlens": [len(d) for d in docs]}
        if with_labels:
            row["labels"] = lab
        dicts.append(row)
        ids, labs, dids, pos = [], [], [], []
        k = 0
        for j, d in enumerate(docs):
            for p in range(len(d)):
                ids.append(flat[k])
                labs.append(-100 if p == 0 else lab[k])
                dids.append(j)
                pos.append(p)
                k += 1
        pad = max_len - len(ids)
        want["input_ids"].append(ids + [pad_id] * pad)
        want["labels"].append(labs + [-100] * pad)
        want["doc_ids"].append(dids + [-1] * pad)
        want["position_ids"].append(pos + [0] * pad)
    got = collate(dicts, max_len=max_len, pad_id=pad_id)
    for name, value in want.items():
        assert getattr(got, name).tolist() == value, name
    assert collate(dicts, pad_id=pad_id).input_ids.shape == (len(rows), max(longest, 1))


def test_a_scalar_labels_column_says_to_pass_none():
    hf = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]], "labels": [0, 1]})
    with pytest.raises(TypeError, match="labels_column=None"):
        PackedDataset(hf, 4)
    with pytest.raises(TypeError, match="labels_column=None"):
        pack_dataset(hf, 4)
    assert len(pack_dataset(hf, 4, labels_column=None)) == 1
    with pytest.raises(TypeError, match="labels_column=None"):
        PackedDataset(pa.table({"input_ids": [[1, 2]], "labels": [0]}), 4)


# Null labels rows: one rule on every path, "a sample whose labels row is null is labelled by its
# tokens" (as a dict sample without the labels key). PackedDataset and pack_dataset refused
# them while streaming labelled them; an all-null column failed only with sync_ranks=True.
def _null_label_paths():
    from flexpack.data import PackedDataset, PackedIterableDataset, collate
    from flexpack.integrations.datasets import pack_dataset

    def rows(batches):
        return [b.labels[0].tolist() for b in batches]

    return {
        "PackedDataset": lambda ds: rows(PackedDataset(ds, 8)[i] for i in range(len(ds) and 1)),
        "PackedDataset(table)": lambda ds: rows([PackedDataset(ds.data.table, 8)[0]]),
        "stream": lambda ds: rows(PackedIterableDataset(ds, 8, buffer_size=8)),
        "stream sync": lambda ds: rows(
            PackedIterableDataset(ds, 8, buffer_size=8, sync_ranks=True, world_size=1, rank=0)
        ),
        "pack_dataset": lambda ds: collate(list(pack_dataset(ds, 8)), max_len=8).labels.tolist(),
        "pack_dataset shuffled": lambda ds: collate(
            list(pack_dataset(ds.select([1, 0, 2]).select([1, 0, 2]), 8)), max_len=8
        ).labels.tolist(),
        "pack_dataset padded": lambda ds: [r["labels"] for r in pack_dataset(ds, 8, padded=True)],
    }


@pytest.mark.parametrize("path", list(_null_label_paths()))
@pytest.mark.parametrize("nulls", [(1,), (2,), (0, 1, 2)], ids=["middle", "last", "all"])
def test_a_null_labels_row_is_labelled_by_its_tokens_on_every_path(path, nulls):
    datasets = pytest.importorskip("datasets")
    ids = [[1, 2, 3], [4, 5], [6, 7, 8]]
    labels = [[-100, 2, 3], [-100, 5], [-100, -100, 8]]
    given = [None if i in nulls else lab for i, lab in enumerate(labels)]
    explicit = [ids[i] if i in nulls else lab for i, lab in enumerate(labels)]  # the reference
    run = _null_label_paths()[path]
    if path == "PackedDataset(table)" and len(nulls) == 3:
        pytest.skip("an all-null column of a Table built from a Dataset is the same Table")
    got = run(datasets.Dataset.from_dict({"input_ids": ids, "labels": given}))
    want = run(datasets.Dataset.from_dict({"input_ids": ids, "labels": explicit}))
    assert got == want


def test_a_null_label_inside_a_labels_list_is_still_refused():
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3, 4]], "labels": [None, [1, None]]})
    with pytest.raises(ValueError, match="row 1 holds a null"):
        flexpack.data.PackedDataset(ds, 8)
