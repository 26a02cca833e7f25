"""PackedLayout: constructors, views and their inverses on hand-checked examples."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flexpack
from flexpack import PackedLayout


def test_from_seqlens_views():
    layout = PackedLayout.from_seqlens([[3, 2], [4], []], max_len=6)
    assert layout.shape == (3, 6)
    assert layout.doc_ids.dtype == torch.int32
    assert layout.doc_ids.tolist() == [
        [0, 0, 0, 1, 1, -1],
        [0, 0, 0, 0, -1, -1],
        [-1] * 6,
    ]
    assert layout.position_ids.tolist() == [
        [0, 1, 2, 0, 1, 0],
        [0, 1, 2, 3, 0, 0],
        [0] * 6,
    ]
    assert layout.position_ids.dtype == torch.int64
    assert layout.seqlens.tolist() == [3, 2, 4]
    assert layout.seqlens.dtype == torch.int32
    assert layout.cu_seqlens.tolist() == [0, 3, 5, 9]
    assert layout.cu_seqlens.dtype == torch.int32
    assert layout.indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9]
    assert layout.indices.dtype == torch.int64
    assert layout.max_seqlen == 4
    assert layout.num_docs.tolist() == [2, 1, 0]
    assert layout.num_tokens == 9
    assert layout.row_seqlens == [[3, 2], [4], []]


def test_cached_views_match_computed_views():
    """from_seqlens pre-fills the caches; a layout built from doc_ids computes them: same values."""
    fast = PackedLayout.from_seqlens([[1, 4, 1], [2], [6]], max_len=6)
    slow = PackedLayout(fast.doc_ids.clone())
    for name in ("position_ids", "seqlens", "cu_seqlens", "indices", "num_docs", "max_seqlen"):
        a, b = getattr(fast, name), getattr(slow, name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype, name
            assert torch.equal(a, b), name
        else:
            assert a == b, name


def test_from_doc_ids_renumbers_runs_per_row():
    layout = PackedLayout.from_doc_ids([[7, 7, 3, 3, 3, -1], [5, -1, 6, 6, -1, -2]])
    assert layout.doc_ids.tolist() == [[0, 0, 1, 1, 1, -1], [0, -1, 1, 1, -1, -1]]
    assert layout.seqlens.tolist() == [2, 3, 1, 2]
    assert layout.position_ids.tolist()[1] == [0, 0, 0, 1, 0, 0]
    one_row = PackedLayout.from_doc_ids(torch.tensor([0, 0, 1]))
    assert one_row.shape == (1, 3)


@pytest.mark.parametrize("big", [2**31, 2**32, 2**62])
def test_ids_past_int32_keep_their_documents(big):
    """Issue 11: int64 ids were cast to int32, merging documents (2**32 -> 0) or making
    padding (2**31 -> negative)."""
    ids = torch.tensor([[0, 0, big, big, big + 1, -1]])
    layout = PackedLayout.from_doc_ids(ids)
    assert layout.seqlens.tolist() == [2, 2, 1]
    assert layout.doc_ids.tolist() == [[0, 0, 1, 1, 2, -1]]
    assert PackedLayout(ids) == layout
    from_numpy = PackedLayout.from_doc_ids(np.array([[big, big, 1]], dtype=np.uint64))
    assert from_numpy.seqlens.tolist() == [2, 1]


@pytest.mark.parametrize(
    "dtype", [torch.uint8, torch.int8, torch.int16, torch.uint16, torch.uint32, torch.uint64]
)
def test_every_integer_dtype(dtype):
    assert PackedLayout(torch.tensor([[1, 1, 2, 0]]).to(dtype)).seqlens.tolist() == [2, 1, 1]


def test_layout_owns_a_copy_of_doc_ids():
    ids = torch.tensor([[0, 0, 1, 1]], dtype=torch.int32)
    layout = PackedLayout(ids)
    ids.fill_(-1)
    assert layout.seqlens.tolist() == [2, 2]


@pytest.mark.parametrize(
    "row",
    [[0, 0, 1, 1, 0, 0], [5, -1, 5, 5], [3, 4, 3]],
)
def test_an_id_naming_two_runs_is_refused(row):
    """Issue 11: the layout counted [0, 0, 1, 1, 0, 0] as three documents with restarted
    positions while masks, attention and loss (equality semantics) saw one: refuse it."""
    with pytest.raises(ValueError, match="two separate runs of row 0"):
        PackedLayout.from_doc_ids([row])
    with pytest.raises(ValueError, match="contiguous run"):
        PackedLayout(torch.tensor([row]))


def test_cu_seqlens_refuse_to_wrap_past_int32():
    """Issue 11: cu_seqlens were cumsummed into int32 and wrapped past 2**31 - 1 tokens."""
    from flexpack.layout import _cu_seqlens_of

    assert _cu_seqlens_of(np.array([2**31 - 2, 1])).tolist() == [0, 2**31 - 2, 2**31 - 1]
    with pytest.raises(ValueError, match="int32"):
        _cu_seqlens_of(np.array([2**31 - 1, 1]))
    with pytest.raises(ValueError, match="int32"):
        PackedLayout.from_cu_seqlens([0, 2**31], shape=(1, 2**31))


def test_from_position_ids():
    pos = [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]
    mask = [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    layout = PackedLayout.from_position_ids(pos, attention_mask=mask)
    assert layout.doc_ids.tolist() == [[0, 0, 0, 1, 1, -1], [0, 0, 0, 0, 0, 0]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]
    # Without a mask every token is real: the trailing 0 is a one-token document.
    assert PackedLayout.from_position_ids(pos[0]).seqlens.tolist() == [3, 2, 1]


def test_from_cu_seqlens_one_row_and_with_indices():
    assert PackedLayout.from_cu_seqlens(torch.tensor([0, 3, 5])).doc_ids.tolist() == [
        [0, 0, 0, 1, 1]
    ]
    padded = PackedLayout.from_cu_seqlens([0, 3, 5], shape=(1, 7))
    assert padded.doc_ids.tolist() == [[0, 0, 0, 1, 1, -1, -1]]
    layout = PackedLayout.from_seqlens([[3, 2], [4], [1]], max_len=6)
    back = PackedLayout.from_cu_seqlens(layout.cu_seqlens, layout.indices, shape=layout.shape)
    assert back == layout


def test_equality_and_to():
    a = PackedLayout.from_seqlens([[2, 1]], 4)
    b = PackedLayout.from_doc_ids([[0, 0, 1, -1]])
    assert a == b
    assert a != PackedLayout.from_seqlens([[1, 2]], 4)
    moved = a.to("cpu")
    assert moved == a and moved.cu_seqlens.tolist() == [0, 2, 3]
    assert "PackedLayout(shape=(1, 4)" in repr(a)


def test_empty_layouts():
    empty = PackedLayout.from_seqlens([], max_len=8)
    assert empty.shape == (0, 8)
    assert empty.cu_seqlens.tolist() == [0]
    assert empty.max_seqlen == 0
    assert PackedLayout(torch.full((2, 3), -1)).cu_seqlens.tolist() == [0]


def test_accepts_numpy_and_other_int_dtypes():
    layout = PackedLayout.from_doc_ids(np.array([[0, 0, 1]], dtype=np.int64))
    assert layout.doc_ids.dtype == torch.int32
    assert PackedLayout.from_seqlens([np.array([2, 1])], 3).seqlens.tolist() == [2, 1]


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: PackedLayout.from_seqlens([[3, 4]], max_len=6), ValueError, "holds 7 tokens"),
        (lambda: PackedLayout.from_seqlens([[0, 2]], max_len=6), ValueError, ">= 1"),
        (lambda: PackedLayout.from_seqlens([[1.5]], max_len=6), TypeError, "integers"),
        (lambda: PackedLayout.from_seqlens(5, max_len=6), TypeError, "per-row"),
        (
            lambda: PackedLayout.from_doc_ids(torch.zeros(2, 2, 2, dtype=torch.int64)),
            ValueError,
            "2-D",
        ),
        (lambda: PackedLayout.from_doc_ids([[0.0, 1.0]]), TypeError, "integers"),
        (lambda: PackedLayout.from_cu_seqlens([1, 3]), ValueError, "starting at 0"),
        (lambda: PackedLayout.from_cu_seqlens([0, 3, 2]), ValueError, "non-decreasing"),
        (lambda: PackedLayout.from_cu_seqlens([0, 3], [0, 1, 2]), ValueError, "shape"),
        (lambda: PackedLayout.from_cu_seqlens([0, 3], shape=(1,)), ValueError, "two non-neg"),
        (
            lambda: PackedLayout.from_cu_seqlens([0, 3], [0, 1, 2], shape=(3,)),
            ValueError,
            r"\(B, S\)",
        ),
        (
            lambda: PackedLayout.from_cu_seqlens([0, 3], [1, 2, 3], shape=(2, 2)),
            ValueError,
            "straddles",
        ),
        (
            lambda: PackedLayout.from_cu_seqlens([0, 3], [0, 1], shape=(1, 4)),
            ValueError,
            "indices must be",
        ),
        (
            lambda: PackedLayout.from_position_ids([[0, 1]], attention_mask=[[1]]),
            ValueError,
            "must match",
        ),
    ],
)
def test_bad_input_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def _loss_per_document(logits, labels, runs):
    """Reference "document" loss: mean over documents (row, start, stop) of their token mean."""
    import torch.nn.functional as F

    per_doc = [
        F.cross_entropy(logits[b, a : c - 1], labels[b, a + 1 : c]) for b, a, c in runs if c - a > 1
    ]
    return torch.stack(per_doc).mean()


def test_layout_masks_attention_and_loss_agree_on_documents():
    """Issue 11: one meaning of "document" for the layout, the masks (both attention paths) and
    the loss. Ids of any size work; an id naming two runs is refused by the layout, the masks and
    the loss alike (issue 43; tests/test_split_runs.py pins every entry point)."""
    import flexpack
    from flexpack import masks
    from flexpack._attention_sdpa import document_groups

    ids = torch.tensor([[7, 7, 2**40, 2**40, 2**40, -1], [2**33, 2**33, 2**33, 2**33, 1, 1]])
    layout = PackedLayout.from_doc_ids(ids)
    mask = masks.document(ids) & masks.causal()
    groups = document_groups(mask.doc_ids).seqlens.tolist()  # ordered by id within a row
    assert sorted(groups[:2]) + sorted(groups[2:]) == sorted(layout.seqlens.tolist()[:2]) + sorted(
        layout.seqlens.tolist()[2:]
    )
    q, k, v = torch.randn(3, 2, 2, 6, 4, dtype=torch.float64).unbind(0)
    by_layout = masks.document(layout.doc_ids) & masks.causal()
    torch.testing.assert_close(
        flexpack.attention(q, k, v, mask), flexpack.attention(q, k, v, by_layout)
    )
    logits = torch.randn(2, 6, 5, dtype=torch.float64)
    labels = torch.randint(0, 5, (2, 6))
    runs = [(0, 0, 2), (0, 2, 5), (1, 0, 4), (1, 4, 6)]
    want = _loss_per_document(logits, labels, runs)
    for d in (ids, layout.doc_ids):
        got = flexpack.packed_cross_entropy(logits, labels, d, reduction="document")
        torch.testing.assert_close(got, want)

    repeated = torch.tensor([[0, 0, 1, 1, 0, 0]])
    with pytest.raises(ValueError, match="two separate runs"):
        PackedLayout.from_doc_ids(repeated)
    with pytest.raises(ValueError, match="two separate runs"):
        masks.document(repeated)
    with pytest.raises(ValueError, match="two separate runs"):
        flexpack.packed_cross_entropy(logits[:1], labels[:1], repeated, reduction="document")


def test_every_cu_seqlens_maker_refuses_to_wrap(monkeypatch):
    """Issue 11: the int32 guard is on every path that builds cu_seqlens (layout view, packer
    fast path, attention's document grouping); shown with the limit lowered to 4 tokens."""
    from flexpack import layout as layout_mod
    from flexpack._attention_sdpa import document_groups

    monkeypatch.setattr(layout_mod, "_INT32_MAX", 4)
    ids = torch.tensor([[0, 0, 0, 1, 1]])
    with pytest.raises(ValueError, match="int32"):
        _ = PackedLayout(ids).cu_seqlens
    with pytest.raises(ValueError, match="int32"):
        PackedLayout.from_seqlens([[3, 2]])
    with pytest.raises(ValueError, match="int32"):
        document_groups(ids)
    assert PackedLayout.from_seqlens([[3, 1]]).cu_seqlens.tolist() == [0, 3, 4]


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


@pytest.mark.parametrize(
    ("dtype", "eos_id"),
    [(torch.int32, 2**32 + 2), (torch.uint8, 258), (torch.uint8, -1), (torch.int64, 2**64 + 2)],
)
def test_from_eos_refuses_an_eos_id_the_dtype_cannot_hold(dtype, eos_id):
    # The comparison wrapped: int32 ids and 2**32 + 2 split at token 2 (uint8 and 258, -1 and
    # 255 likewise); 2**64 + 2 was a bare OverflowError.
    x = torch.tensor([[5, 2, 7, 255, 8]]).to(dtype)
    with pytest.raises(ValueError, match=rf"eos_id={eos_id} cannot occur in input_ids of dtype"):
        flexpack.PackedLayout.from_eos(x, eos_id)
    ref = flexpack.PackedLayout.from_eos(x.long(), 2).doc_ids
    assert torch.equal(flexpack.PackedLayout.from_eos(x, 2).doc_ids, ref)


_INT_DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]


@given(data=st.data())
def test_property_from_eos_matches_a_python_reference_or_refuses(data):
    # The reference counts, in Python ints (no wrapping), the EOS tokens strictly before each
    # token; an eos_id the dtype cannot hold is refused instead of compared with wrapping.
    dtype = data.draw(st.sampled_from(_INT_DTYPES))
    info = torch.iinfo(dtype)
    row = data.draw(st.lists(st.integers(info.min, info.max), min_size=1, max_size=12))
    eos = data.draw(
        st.one_of(st.sampled_from(row), st.integers(-(2**65), 2**65), st.integers(-3, 300))
    )
    x = torch.tensor([row], dtype=torch.int64).to(dtype)
    if not info.min <= eos <= info.max:
        with pytest.raises(ValueError, match="cannot occur in input_ids"):
            flexpack.PackedLayout.from_eos(x, eos)
        return
    want, seen = [], 0
    for t in row:
        want.append(seen)
        seen += t == eos
    assert flexpack.PackedLayout.from_eos(x, eos).doc_ids.tolist() == [want]
