"""Property suite for flexpack.masks, built on flexpack.testing.

Two independent checks for every mask:
- element level: ``mask_mod`` evaluated on the full grid equals a numpy twin written here from the
  spec in the issue (not from flexpack's code);
- block level: ``.block_mask()`` and the top-level shortcuts pass ``assert_block_mask_matches``,
  exactly (create_block_mask's structure) for primitives, never looser than exact for compositions.
"""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flexpack
from flexpack import masks as fm
from flexpack.testing import assert_block_mask_matches, dense_mask
from flexpack.testing import strategies as fst

# Block sizes around the sizes drawn for S (<= 130), so S is often not a multiple of them.
block_sizes = st.sampled_from([2, 3, 8, 16, 128])
packed = fst.doc_ids(max_seq_len=130, block_size=16, allow_empty_rows=True)
arbitrary = fst.doc_ids(max_seq_len=130, block_size=16, contiguous=False, allow_empty_rows=True)

# ------------------------------------------------------------------------------ numpy twins


def np_prefix_flags(d: np.ndarray, p: np.ndarray) -> np.ndarray:
    """in_prefix[b, t]: token t is among the first p[b, doc] tokens of its document."""
    flags = np.zeros(d.shape, dtype=bool)
    for b in range(d.shape[0]):
        pos, prev = 0, None
        for t in range(d.shape[1]):
            doc = int(d[b, t])
            pos = pos + 1 if doc == prev else 0
            prev = doc
            flags[b, t] = doc >= 0 and pos < int(p[b, doc])
    return flags


def np_twin(spec: tuple, d: np.ndarray) -> np.ndarray:
    """(B, S, S) bool: the mask described by ``spec`` over doc ids ``d`` (B, S)."""
    B, S = d.shape
    q = np.arange(S)[None, :, None]
    kv = np.arange(S)[None, None, :]
    dq, dkv = d[:, :, None], d[:, None, :]
    kind = spec[0]
    if kind == "causal":
        out = q >= kv
    elif kind == "sliding_window":
        out = q - kv <= spec[1]
    elif kind == "document":
        out = (dq == dkv) & (dq >= 0)
    elif kind == "document_causal":
        out = (dq == dkv) & (dq >= 0) & (q >= kv)
    elif kind == "padding":
        out = (dq >= 0) & (dkv >= 0)
    elif kind == "prefix_lm":
        in_prefix = np_prefix_flags(d, spec[1].reshape(B, -1).numpy())
        out = (dq == dkv) & (dq >= 0) & ((kv <= q) | in_prefix[:, None, :])
    elif kind == "and":
        out = np_twin(spec[1], d) & np_twin(spec[2], d)
    elif kind == "or":
        out = np_twin(spec[1], d) | np_twin(spec[2], d)
    elif kind == "not":
        out = ~np_twin(spec[1], d)
    else:
        raise AssertionError(kind)
    return np.broadcast_to(out, (B, S, S))


def build(spec: tuple, doc_ids: torch.Tensor) -> fm.Mask:
    """The flexpack Mask described by ``spec``."""
    kind = spec[0]
    if kind == "causal":
        return fm.causal()
    if kind == "sliding_window":
        return fm.sliding_window(spec[1])
    if kind == "document":
        return fm.document(doc_ids)
    if kind == "document_causal":
        return fm.document(doc_ids) & fm.causal()
    if kind == "padding":
        return fm.padding(doc_ids)
    if kind == "prefix_lm":
        return fm.prefix_lm(doc_ids, spec[1])
    if kind == "not":
        return ~build(spec[1], doc_ids)
    left, right = build(spec[1], doc_ids), build(spec[2], doc_ids)
    return left & right if kind == "and" else left | right


PRIMITIVES = ["causal", "sliding_window", "document", "document_causal", "padding", "prefix_lm"]


@st.composite
def leaf_specs(draw, doc_ids, kinds=PRIMITIVES):
    kind = draw(st.sampled_from(kinds))
    if kind == "sliding_window":
        return (kind, draw(st.integers(0, doc_ids.shape[-1])))
    if kind == "prefix_lm":
        return (kind, draw(fst.prefix_lengths(doc_ids)))
    return (kind,)


@st.composite
def specs(draw, doc_ids, depth=2, kinds=PRIMITIVES):
    op = draw(st.sampled_from(["leaf", "and", "or", "not"])) if depth > 0 else "leaf"
    if op == "leaf":
        return draw(leaf_specs(doc_ids, kinds))
    if op == "not":
        return ("not", draw(specs(doc_ids, depth - 1, kinds)))
    return (op, draw(specs(doc_ids, depth - 1, kinds)), draw(specs(doc_ids, depth - 1, kinds)))


def twin_tensor(spec: tuple, d: torch.Tensor) -> torch.Tensor:
    """The numpy twin as a (B, 1, S, S) bool tensor, the kit's dense-mask layout."""
    return torch.from_numpy(np_twin(spec, d.numpy()).copy())[:, None]


def element_mask(mask: fm.Mask, d: torch.Tensor) -> np.ndarray:
    B, S = d.shape
    return dense_mask(mask, B, 1, S, S)[:, 0].numpy()


def build_block_mask(mask: fm.Mask, S: int, block_size: int):
    return mask.block_mask(block_size=block_size, Q_LEN=S, KV_LEN=S)


# ------------------------------------------------------------------------- element level


@pytest.mark.parametrize("kind", PRIMITIVES)
@given(data=st.data())
def test_each_factory_matches_its_numpy_twin(kind, data):
    kinds = [kind]
    if kind == "prefix_lm":
        d = data.draw(packed)
    else:
        d = data.draw(st.one_of(packed, arbitrary))
    spec = data.draw(leaf_specs(d, kinds))
    np.testing.assert_array_equal(element_mask(build(spec, d), d), np_twin(spec, d.numpy()))


@given(data=st.data())
def test_compositions_match_their_numpy_twins(data):
    d = data.draw(packed)
    spec = data.draw(specs(d, depth=3))
    np.testing.assert_array_equal(element_mask(build(spec, d), d), np_twin(spec, d.numpy()))


@given(data=st.data())
def test_compositions_over_arbitrary_ids_match_their_numpy_twins(data):
    d = data.draw(arbitrary)
    spec = data.draw(specs(d, depth=2, kinds=[k for k in PRIMITIVES if k != "prefix_lm"]))
    np.testing.assert_array_equal(element_mask(build(spec, d), d), np_twin(spec, d.numpy()))


def test_document_and_causal_normalize_in_either_order():
    d = torch.tensor([[0, 0, 1, 1, 1, -1]])
    for m in (fm.document(d) & fm.causal(), fm.causal() & fm.document(d)):
        assert m.kind == "document_causal"
        np.testing.assert_array_equal(element_mask(m, d), np_twin(("document_causal",), d.numpy()))


def test_prefix_lm_over_padding_only():
    # A batch with no document at all: prefix_lengths is (B, 0); the mask allows nothing.
    d = torch.full((2, 5), -1)
    m = fm.prefix_lm(d, torch.zeros(2, 0, dtype=torch.int64))
    assert not bool(dense_mask(m).any())


# --------------------------------------------------------------------------- block level


@pytest.mark.parametrize("kind", PRIMITIVES)
@given(data=st.data())
def test_each_primitive_block_mask_is_exactly_create_block_masks(kind, data):
    d = data.draw(packed if kind == "prefix_lm" else st.one_of(packed, arbitrary))
    spec = data.draw(leaf_specs(d, [kind]))
    block_size = data.draw(block_sizes)
    mask = build(spec, d)
    S = d.shape[-1]
    bm = build_block_mask(mask, S, block_size)
    assert bm.BLOCK_SIZE == (block_size, block_size) and bm.seq_lengths == (S, S)
    expected = twin_tensor(spec, d)
    # Against the independent twin, and through the kit's view of the Mask itself.
    assert_block_mask_matches(bm, expected, exact=True)
    assert_block_mask_matches(bm, mask, exact=True)


@given(d=st.one_of(packed, arbitrary), block_size=block_sizes)
def test_top_level_shortcuts(d, block_size):
    S = d.shape[-1]
    cases = [
        (flexpack.document_mask(d, block_size=block_size), ("document",)),
        (flexpack.document_causal_mask(d, block_size=block_size), ("document_causal",)),
    ]
    for bm, spec in cases:
        assert bm.shape == (d.shape[0], 1, S, S)
        expected = twin_tensor(spec, d)
        assert_block_mask_matches(bm, expected, exact=True)


@given(data=st.data())
def test_prefix_lm_shortcut(data):
    d = data.draw(packed)
    p = data.draw(fst.prefix_lengths(d))
    block_size = data.draw(block_sizes)
    bm = flexpack.prefix_lm_mask(d, p, block_size=block_size)
    assert_block_mask_matches(bm, twin_tensor(("prefix_lm", p), d), exact=True)


@given(data=st.data())
def test_one_dimensional_doc_ids_give_a_shared_block_mask(data):
    d = data.draw(fst.doc_ids(batch_size=1, max_seq_len=130, block_size=16))[0]
    block_size = data.draw(block_sizes)
    bm = flexpack.document_causal_mask(d, block_size=block_size)
    S = d.shape[0]
    assert bm.shape == (1, 1, S, S)
    assert_block_mask_matches(bm, twin_tensor(("document_causal",), d[None])[0, 0], exact=True)


@given(data=st.data())
def test_composed_block_masks_are_exact_elementwise_and_never_looser(data):
    d = data.draw(st.one_of(packed, arbitrary))
    mask = data.draw(fst.masks(d, max_depth=3))
    block_size = data.draw(block_sizes)
    S = d.shape[-1]
    bm = build_block_mask(mask, S, block_size)
    assert_block_mask_matches(bm, mask)


@given(data=st.data())
def test_composed_block_masks_against_numpy_twins(data):
    d = data.draw(packed)
    spec = data.draw(specs(d, depth=2))
    block_size = data.draw(block_sizes)
    bm = build_block_mask(build(spec, d), d.shape[-1], block_size)
    expected = twin_tensor(spec, d)
    assert_block_mask_matches(bm, expected)
