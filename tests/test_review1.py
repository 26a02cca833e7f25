"""Red-team review: regressions for bugs found in the data pipeline and layout (review1)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpack import PackedLayout
from flexpack.data import PackedIterableDataset


def test_from_cu_seqlens_empty_document_keeps_ids_dense():
    # An empty document (a repeated cu_seqlens value, as fixed-size padded cu_seqlens have) used
    # to leave a gap in the row's ids ([0, 0, 2, 2]), so the layout differed from the same
    # documents built any other way.
    layout = PackedLayout.from_cu_seqlens([0, 2, 2, 4])
    assert layout.doc_ids.tolist() == [[0, 0, 1, 1]]
    assert layout == PackedLayout.from_seqlens([[2, 2]])
    assert layout == PackedLayout.from_doc_ids(layout.doc_ids)
    two_rows = PackedLayout.from_cu_seqlens([0, 0, 2, 2, 3, 4, 4], [0, 1, 3, 4], shape=(2, 3))
    assert two_rows.doc_ids.tolist() == [[0, 0, -1], [0, 1, -1]]
    assert two_rows == PackedLayout.from_seqlens([[2], [1, 1]], 3)
    assert two_rows.doc_ids.dtype == torch.int32


def _rows(batches):
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
        expected = _rows(PackedIterableDataset(stream, 8, world_size=1, rank=0, **kw))
    else:  # worker w reads stream items w, w + 2, ...: as rank w of 2 with one worker
        expected = _rows(
            b for r in (0, 1) for b in PackedIterableDataset(stream, 8, world_size=2, rank=r, **kw)
        )
    loader = torch.utils.data.DataLoader(
        PackedIterableDataset(stream, 8, world_size=1, rank=0, **kw), batch_size=None, num_workers=2
    )
    got = _rows(loader)
    assert sum(sum(d >= 0 for d in r[2]) for r in got) == sum(map(len, ids))
    assert got == expected


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


def test_sync_ranks_hf_dataset_with_a_null_labels_row_matches_the_unsynced_stream():
    # A sample whose labels are None is labelled by its tokens when streaming; with
    # sync_ranks=True (the HF dataset read through Arrow) the null row became a garbage length
    # cast and a "3 input_ids but 0 labels" error.
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict(
        {"input_ids": [[1, 2, 3], [4, 5], [6, 7]], "labels": [None, [-100, 5], None]}
    )
    plain = _rows(PackedIterableDataset(ds, 8, buffer_size=4))
    synced = _rows(PackedIterableDataset(ds, 8, buffer_size=4, sync_ranks=True, world_size=1))
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
