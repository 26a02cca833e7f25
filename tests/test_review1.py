"""Red-team review: regressions for bugs found in the data pipeline and layout (review1)."""

import torch

from flexpack import PackedLayout


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
