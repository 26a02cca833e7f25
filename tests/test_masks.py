"""The Mask layer: names, kinds, element semantics against dense twins, shortcuts, bad input."""

from __future__ import annotations

import pytest
import torch
from _rows import qkv as _qkv
from torch.nn.attention.flex_attention import and_masks, create_block_mask, or_masks

import flexpack
from flexpack import masks
from flexpack import masks as fm
from flexpack.testing import assert_block_mask_matches
from flexpack.testing.references import dense_mask, reference_attention

D = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1], [0, 1, 1, 1, 1, 1, 1, -1]], dtype=torch.int32)


def _dense(mod, B: int, S: int) -> torch.Tensor:
    i = torch.arange(S)
    b = torch.arange(B)[:, None, None]
    out = mod(b, torch.zeros((), dtype=torch.long), i[None, :, None], i[None, None, :])
    return out.expand(B, S, S)


def _twin_document(d: torch.Tensor) -> torch.Tensor:
    """(B, S, S) dense document mask written without flexpack."""
    return (d[:, :, None] == d[:, None, :]) & (d[:, :, None] >= 0)


# ----------------------------------------------------------------------------- semantics


def test_factories_match_dense_twins() -> None:
    B, S = D.shape
    q = torch.arange(S)[:, None]
    kv = torch.arange(S)[None, :]
    doc = _twin_document(D)
    real = D >= 0
    assert torch.equal(_dense(masks.document(D).mask_mod, B, S), doc)
    assert torch.equal(_dense(masks.causal().mask_mod, B, S), (q >= kv).expand(B, S, S))
    assert torch.equal(
        _dense(masks.sliding_window(2).mask_mod, B, S), (q - kv <= 2).expand(B, S, S)
    )
    assert torch.equal(_dense(masks.padding(D).mask_mod, B, S), real[:, :, None] & real[:, None, :])
    assert torch.equal(_dense((masks.document(D) & masks.causal()).mask_mod, B, S), doc & (q >= kv))
    pl = torch.tensor([[2, 1, 0], [1, 3, 0]])
    # Hand-written prefix twin: token position in its document < its prefix length.
    in_prefix = torch.tensor([[1, 1, 0, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    expected = doc & ((kv <= q) | in_prefix[:, None, :])
    assert torch.equal(_dense(masks.prefix_lm(D, pl).mask_mod, B, S), expected)


def test_one_dimensional_doc_ids_give_batch_one() -> None:
    d = torch.tensor([0, 0, 1, 1, -1])
    m = masks.document(d)
    assert m.doc_ids.shape == (1, 5)
    assert m.block_mask(block_size=2).shape == (1, 1, 5, 5)
    assert flexpack.document_causal_mask(d, block_size=2).shape == (1, 1, 5, 5)
    assert flexpack.document_mask(D).shape == (2, 1, 8, 8)


def test_mask_mod_is_safe_past_the_sequence_end() -> None:
    # flex_attention evaluates the tail of the last block past S; that must read as padding.
    for m in (
        masks.document(D),
        masks.padding(D),
        masks.prefix_lm(D, torch.tensor([[3, 2, 1], [1, 2, 0]])),
    ):
        out = m.mask_mod(torch.tensor(1), torch.tensor(0), torch.tensor(200), torch.tensor(130))
        assert out.item() is False
        out = m.mask_mod(torch.tensor(0), torch.tensor(0), torch.tensor(0), torch.tensor(8))
        assert out.item() is False


def test_names_and_kinds() -> None:
    d = masks.document(D)
    assert (d & masks.causal()).kind == "document_causal"
    assert (masks.causal() & d).kind == "document_causal"
    assert (masks.causal() & d).mask_mod.__name__ == "document_causal"
    m = d & masks.sliding_window(256)
    assert m.kind == "and" and m.mask_mod.__name__ == "and(document, sliding_window_256)"
    m = d & masks.sliding_window(4) & masks.causal()
    assert m.mask_mod.__name__ == "and(document_causal, sliding_window_4)"
    assert (~masks.padding(D)).mask_mod.__name__ == "not(padding)"
    assert (masks.causal() | d).kind == "or"
    assert masks.sliding_window(5).window == 5 and masks.sliding_window(5).doc_ids is None
    assert masks.causal().doc_ids is None
    assert torch.equal(m.doc_ids, D)
    assert masks.prefix_lm(D, torch.tensor([[3, 2, 1], [1, 2, 0]])).kind == "prefix_lm"


def test_mask_mod_works_with_torch_combinators() -> None:
    d = masks.document(D).mask_mod
    combined = and_masks(d, masks.causal().mask_mod)
    ref = (masks.document(D) & masks.causal()).block_mask(block_size=2)
    got = create_block_mask(combined, 2, 1, 8, 8, device="cpu", BLOCK_SIZE=2)
    assert torch.equal(got.kv_num_blocks, ref.kv_num_blocks)
    assert torch.equal(got.full_kv_num_blocks, ref.full_kv_num_blocks)
    create_block_mask(or_masks(d, masks.padding(D).mask_mod), 2, 1, 8, 8, device="cpu")


def test_mask_of_round_trip() -> None:
    m = masks.document(D) & masks.causal()
    assert masks.mask_of(m.block_mask(block_size=4)) is m
    assert masks.mask_of(flexpack.document_causal_mask(D)).kind == "document_causal"
    foreign = create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 8, 8, device="cpu")
    assert masks.mask_of(foreign) is None


def test_mask_of_a_batch_slice_is_foreign() -> None:
    # torch wraps the mask_mod of a batch slice (bm[1:2]) with a row offset; the flexpack Mask
    # behind it holds every row's doc ids, so flexpack.attention must treat the slice as foreign
    # rather than take a per-document path over the wrong rows.
    d = torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2], [0, 1, 2, 3, 4, 5, 6, 7]])
    bm = flexpack.document_causal_mask(d, block_size=4)
    assert masks.mask_of(bm) is not None
    assert masks.mask_of(bm[1:2]) is None


def test_shortcuts_live_on_doc_ids_device_and_dtype_free() -> None:
    for dtype in (torch.int8, torch.int16, torch.int32, torch.int64):
        bm = flexpack.document_mask(D.to(dtype), block_size=4)
        assert bm.kv_indices.device == D.device
    bm = flexpack.prefix_lm_mask(torch.tensor([0, 0, 1]), torch.tensor([1, 1]), block_size=2)
    assert bm.shape == (1, 1, 3, 3)


def test_unsigned_doc_ids_are_ids_like_any_other() -> None:
    # Unsigned ids cannot mark padding, but are valid ids (equality semantics).
    d = torch.tensor([[0, 0, 7, 7, 200]])
    for dtype in (torch.uint8, torch.uint16, torch.uint32):
        m = masks.document(d.to(dtype)) & masks.causal()
        assert_block_mask_matches(m.block_mask(block_size=2), masks.document(d) & masks.causal())


def test_mask_factories_refuse_uint64_doc_ids_past_int64():
    # uint64 ids >= 2**63 wrapped to negative int64, i.e. padding; PackedLayout refuses them.
    d = torch.tensor([0, 2**63, 2**63], dtype=torch.uint64)
    for make in (fm.document, fm.padding, lambda x: fm.tree(x, torch.tensor([-1]))):
        with pytest.raises(ValueError, match=r"2\*\*63"):
            make(d)
    ok = fm.document(torch.tensor([0, 5, 5], dtype=torch.uint64))
    assert ok.doc_ids.dtype == torch.int64 and ok.doc_ids.tolist() == [[0, 5, 5]]


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("bad", "exc", "words"),
    [
        (torch.zeros(4), TypeError, "float32"),
        (torch.zeros(4, dtype=torch.bool), TypeError, "bool"),
        ([0, 0, 1], TypeError, "torch.Tensor"),
        (torch.zeros(2, 3, 4, dtype=torch.int32), ValueError, "3 dimensions"),
        (torch.tensor(3), ValueError, "0 dimensions"),
        (torch.zeros(0, dtype=torch.int32), ValueError, "empty"),
        (torch.zeros(2, 0, dtype=torch.int32), ValueError, "empty"),
    ],
)
def test_bad_doc_ids(bad, exc, words) -> None:
    for factory in (masks.document, masks.padding, flexpack.document_mask):
        with pytest.raises(exc, match=words):
            factory(bad)
    with pytest.raises(exc, match=words):
        flexpack.document_causal_mask(bad)


@pytest.mark.parametrize(
    ("block_size", "exc"),
    [(0, ValueError), (-128, ValueError), (1.5, TypeError), (True, TypeError)],
)
def test_bad_block_size(block_size, exc) -> None:
    with pytest.raises(exc, match="block_size"):
        flexpack.document_mask(D, block_size=block_size)


def test_bad_window() -> None:
    with pytest.raises(ValueError, match="window"):
        masks.sliding_window(-1)
    with pytest.raises(TypeError, match="window"):
        masks.sliding_window(2.0)


def test_bad_prefix_lengths() -> None:
    d = torch.tensor([0, 0, 0, 1, 1])
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        masks.prefix_lm(d, torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="shape"):
        masks.prefix_lm(D, torch.tensor([1, 1, 1]))  # (B, S) doc ids need (B, max_docs)
    with pytest.raises(ValueError, match="has 2 tokens"):
        masks.prefix_lm(d, torch.tensor([1, 3]))
    with pytest.raises(ValueError, match=r"0\.\.len"):
        masks.prefix_lm(d, torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="absent"):
        masks.prefix_lm(D, torch.tensor([[1, 1, 1, 0], [1, 1, 0, 1]]))
    with pytest.raises(TypeError, match="integer"):
        masks.prefix_lm(d, torch.tensor([1.0, 1.0]))
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        masks.prefix_lm(d, [1, 1])


@pytest.mark.parametrize(
    ("row", "why"),
    [
        ([1, 1, 0, 0], r"0\.\.n-1 in order"),
        ([0, 0, 2, 2], r"0\.\.n-1 in order"),
        ([0, 1, 0, 1], "two separate runs"),  # an id in two runs: every entry point's refusal
        ([0, -1, 0, 1], "two separate runs"),
        ([5, 5, 5, 5], r"0\.\.n-1 in order"),
    ],
)
def test_prefix_lm_rejects_unordered_doc_ids(row, why) -> None:
    with pytest.raises(ValueError, match=why):
        flexpack.prefix_lm_mask(torch.tensor(row), torch.tensor([1, 1, 1, 1, 1, 1][: max(row) + 1]))


def test_mismatched_devices_and_layouts() -> None:
    meta = torch.zeros(5, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="meta"):
        masks.prefix_lm(torch.tensor([0, 0, 1, 1, 1]), torch.tensor([1, 1], device="meta"))
    with pytest.raises(ValueError, match="same"):
        masks.document(torch.zeros(5, dtype=torch.int32)) & masks.padding(meta)
    with pytest.raises(ValueError, match="same"):
        masks.document(torch.zeros(5, dtype=torch.int32)) | masks.padding(D)
    with pytest.raises(ValueError, match="device"):
        masks.document(D).block_mask(device="meta")
    # The same device spelled without (or with) an index is the same device ("cuda" = "cuda:0").
    assert masks.document(D).block_mask(device="cpu:0").kv_num_blocks.device == D.device


def test_bad_block_mask_arguments() -> None:
    with pytest.raises(ValueError, match="Q_LEN"):
        masks.causal().block_mask()
    with pytest.raises(ValueError, match="Q_LEN=9"):
        masks.document(D).block_mask(Q_LEN=9)
    with pytest.raises(ValueError, match="B=3"):
        masks.document(D).block_mask(B=3)
    for bad_B in (0, -1, 2.0):  # silently gave a (0, ...) or a (1, ...) BlockMask
        with pytest.raises(ValueError, match="B must be a positive int"):
            masks.document(D[:1]).block_mask(B=bad_B)
    with pytest.raises(TypeError):
        masks.document(D) & flexpack.document_mask(D)


def test_a_mask_keeps_its_own_copy_of_doc_ids() -> None:
    """Issue 11: the flex path read a snapshot while the SDPA path read the live tensor, so
    after doc.copy_(...) they disagreed (max diff 1.24). Every path now reads the mask's copy."""
    live = D.clone()
    m = masks.document(live) & masks.causal()
    bm = m.block_mask(block_size=2)
    live.copy_(torch.tensor([[0] * 8, [-1] * 8]))  # a new layout written into the same tensor
    assert torch.equal(m.doc_ids, D)
    want = masks.document(D.clone()) & masks.causal()
    torch.testing.assert_close(
        _dense(m.mask_mod, 2, 8), _dense(want.mask_mod, 2, 8), rtol=0, atol=0
    )
    assert bm.kv_num_blocks.tolist() == want.block_mask(block_size=2).kv_num_blocks.tolist()
    q, k, v = torch.randn(3, 2, 2, 8, 4).unbind(0)
    for backend in ("sdpa", "auto"):
        got = flexpack.attention(q, k, v, m, backend=backend)
        torch.testing.assert_close(got, flexpack.attention(q, k, v, want, backend=backend))
    dense = flexpack.attention(q, k, v, m | ~masks.padding(D), backend="sdpa")  # dense path
    ref = flexpack.attention(q, k, v, want | ~masks.padding(D), backend="sdpa")
    torch.testing.assert_close(dense, ref)


@pytest.mark.parametrize("kind", ["document_causal", "tree"])
def test_mask_doc_ids_edited_in_place_is_refused_on_every_path(kind):
    # mask.doc_ids was public and writable: SDPA and the BlockMask tables read the edit while
    # mask_mod read a snapshot (max diff 2.1). Now an edit is refused wherever the ids are read.
    d = torch.tensor([[0, 0, 0, 1, 1, 1]])
    if kind == "tree":
        m = fm.tree(d, torch.tensor([[-1, 0]]))
    else:
        m = fm.document(d) & fm.causal()
    q, k, v = _qkv(1, 6)
    before = flexpack.attention(q, k, v, m)
    torch.testing.assert_close(before, reference_attention(q, k, v, m))
    m.doc_ids[0, 2] = 1
    for use in (
        lambda: flexpack.attention(q, k, v, m),
        lambda: m.block_mask(block_size=2),
        lambda: dense_mask(m),
        lambda: m.doc_ids,
    ):
        with pytest.raises(ValueError, match="in place"):
            use()
    with pytest.raises(AttributeError):
        m.doc_ids = d


def test_attention_on_an_empty_batch_is_empty() -> None:
    """Issue 11: B=0 raised "torch.cat(): expected a non-empty list of Tensors"."""
    q = torch.randn(0, 2, 4, 8, requires_grad=True)
    mask = masks.document(torch.tensor([0, 0, 1, 1])) & masks.causal()
    out = flexpack.attention(q, q, q, mask)
    assert out.shape == (0, 2, 4, 8)
    out.sum().backward()
    assert q.grad.shape == q.shape


def test_prefix_lm_hint_names_a_renumbering_that_works() -> None:
    """Issue 11: the hint said from_doc_ids renumbers, which it did not; now it does, and the
    message names the exact call."""
    ids = torch.tensor([[3, 3, 5, 5, 5, -1]])
    prefix = torch.tensor([1, 2])
    with pytest.raises(ValueError, match=r"PackedLayout\.from_doc_ids\(doc_ids\)\.doc_ids"):
        masks.prefix_lm(ids, prefix)
    fixed = flexpack.PackedLayout.from_doc_ids(ids).doc_ids
    assert fixed.tolist() == [[0, 0, 1, 1, 1, -1]]
    assert masks.prefix_lm(fixed, prefix).kind == "prefix_lm"
