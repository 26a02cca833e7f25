"""Odd inputs to the map-style data path: each gives the right rows or a clear error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flexpack.data import PackedDataset, collate

pa = pytest.importorskip("pyarrow")


def test_null_token_inside_an_arrow_list_names_the_row():
    col = pa.array([[1, 2], [3, None, 5], [6]], pa.list_(pa.int64()))
    with pytest.raises(ValueError, match=r"row 1 .*null token"):
        PackedDataset(col, 8)
    with pytest.raises(ValueError, match=r"row 1 .*null token"):
        PackedDataset(pa.table({"input_ids": col}), 8)


def test_null_row_names_the_row():
    datasets = pytest.importorskip("datasets")
    hf = datasets.Dataset.from_dict({"input_ids": [[1, 2], None, [3]]})
    with pytest.raises(ValueError, match=r"row 1 is null"):
        PackedDataset(hf, 8)
    col = pa.chunked_array([[[1, 2]], [[3], None]], pa.list_(pa.int64()))
    with pytest.raises(ValueError, match=r"row 2 is null"):
        PackedDataset(col, 8)


def test_null_token_in_hf_dataset_names_the_row():
    datasets = pytest.importorskip("datasets")
    hf = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3], [4, None]]})
    with pytest.raises(ValueError, match=r"row 2 .*null token"):
        PackedDataset(hf, 8)


def test_pack_dataset_null_and_wide_ids():
    datasets = pytest.importorskip("datasets")
    from flexpack.integrations.datasets import pack_dataset

    with pytest.raises(ValueError, match=r"row 0 .*null token"):
        pack_dataset(datasets.Dataset.from_dict({"input_ids": [[1, None], [3]]}), 8)
    with pytest.raises(ValueError, match=r"row 1 is null"):
        pack_dataset(datasets.Dataset.from_dict({"input_ids": [[1, 2], None]}), 8)
    wide = [[2**31, 2**40 + 1], [5, 2**62]]
    for padded in (False, True):
        out = pack_dataset(
            datasets.Dataset.from_dict({"input_ids": wide}), 4, padded=padded, seed=None
        )
        rows = out.with_format("numpy")[:]["input_ids"]
        got = sorted(int(t) for row in rows for t in row)
        want = sorted(t for s in wide for t in s)
        assert got[-4:] == want if not padded else sorted(got)[-4:] == want


def test_slice_indexing_says_what_to_do():
    ds = PackedDataset([[1, 2, 3], [4, 5], [6, 7, 8, 9]], 5)
    with pytest.raises(TypeError, match=r"__getitems__|list\(range"):
        ds[0:2]
    with pytest.raises(TypeError, match="int"):
        ds["a"]
    rows = ds.__getitems__(list(range(2)))
    assert len(rows) == 2


def test_collate_keeps_wide_doc_ids_distinct():
    rows = [
        {
            "input_ids": [1, 2, 3, 4, 5],
            "labels": [-100, 2, -100, 4, -100],
            "doc_ids": [0, 0, 2**32, 2**32, 2**32 + 1],
        }
    ]
    b = collate(rows)
    assert b.seqlens.tolist() == [2, 2, 1]  # three documents, none merged
    assert (b.doc_ids >= 0).all()
    rows[0]["doc_ids"] = [0, 2**31, 2**31, -1, -1]
    b = collate(rows)
    assert b.seqlens.tolist() == [1, 2]
    assert b.doc_ids.tolist() == [[0, 1, 1, -1, -1]]
    assert torch.equal(collate([{**rows[0], "doc_ids": [0, 1, 1, -1, -1]}]).doc_ids, b.doc_ids)


def test_uint64_ids_past_int64_are_refused():
    col = pa.array([[1, 2**63 + 5]], pa.list_(pa.uint64()))
    with pytest.raises(ValueError, match="2\\*\\*63"):
        PackedDataset(col, 8)


def test_numpy_object_row_with_none_names_the_sample():
    src = np.empty(2, dtype=object)
    src[:] = [[1, 2], [3, None]]
    with pytest.raises(TypeError, match=r"samples\[1\]"):
        PackedDataset(src, 8)[0]


def test_stored_rows_with_inconsistent_seqlens_are_refused():
    table = pa.table({"input_ids": [[1, 2, 3], [4, 5]], "seqlens": [[2, 1], [3]]})
    ds = PackedDataset(table, 4)
    assert ds[0].seqlens.tolist() == [2, 1]
    with pytest.raises(ValueError, match="do not match their seqlens"):
        ds[1]


def test_collate_with_mask_pads_unpadded_rows():
    from flexpack import document_causal_mask
    from flexpack.data import collate_with_mask

    rows = [{"input_ids": [1, 2, 3], "seqlens": [2, 1]}, {"input_ids": [4], "seqlens": [1]}]
    out = collate_with_mask(rows, block_size=2, max_len=4)
    assert out.batch.doc_ids.tolist() == [[0, 0, 1, -1], [0, -1, -1, -1]]
    ref = document_causal_mask(out.batch.doc_ids, block_size=2)
    assert torch.equal(out.block_mask.kv_num_blocks, ref.kv_num_blocks)
    ds = PackedDataset([[1, 2, 3], [4, 5]], 4)
    with pytest.raises(ValueError, match="not max_len=8"):
        collate([ds[0]], max_len=8)
    with pytest.raises(ValueError, match="not max_len=8"):
        collate([{"input_ids": [1, 0], "labels": [-100, -100], "doc_ids": [0, -1]}], max_len=8)
