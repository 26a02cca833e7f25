"""Differential tests: BlockMasks built from doc ids against eager ``create_block_mask``.

Primitive masks must match ``create_block_mask`` exactly (counts and index sets, including the
ordering of the index tensors); compositions must be exact per element and never looser than
exact per block. Small S only: create_block_mask is O(B * S^2).
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask

from flexpack import block_mask as bmod
from flexpack import masks
from flexpack.testing import strategies as fst

# ----------------------------------------------------------------------------- helpers


def _reference(mask: masks.Mask, block_size: int, S: int | None = None):
    d = mask.doc_ids
    B = 1 if d is None else d.shape[0]
    S = d.shape[1] if d is not None else S
    return create_block_mask(mask.mask_mod, B, 1, S, S, device="cpu", BLOCK_SIZE=block_size)


def _assert_identical(ours, ref) -> None:
    for name in (
        "kv_num_blocks",
        "kv_indices",
        "full_kv_num_blocks",
        "full_kv_indices",
        "q_num_blocks",
        "q_indices",
        "full_q_num_blocks",
        "full_q_indices",
    ):
        a, b = getattr(ours, name), getattr(ref, name)
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.shape, b.shape)
        assert torch.equal(a, b), f"{name} differs:\nours={a.tolist()}\nref ={b.tolist()}"
    assert ours.shape == ref.shape and ours.BLOCK_SIZE == ref.BLOCK_SIZE


def _states(bm) -> torch.Tensor:
    """(B, nq, nk) int8 block states (0 empty, 1 partial, 2 full) of a BlockMask."""
    B, _, nq, nk = bm.kv_indices.shape
    out = torch.zeros(B, nq, nk, dtype=torch.int8)
    for b in range(B):
        for i in range(nq):
            for j in bm.kv_indices[b, 0, i, : bm.kv_num_blocks[b, 0, i]].tolist():
                out[b, i, j] = 1
            for j in bm.full_kv_indices[b, 0, i, : bm.full_kv_num_blocks[b, 0, i]].tolist():
                out[b, i, j] = 2
    return out


def _packed_row(S: int, rng: random.Random) -> list[int]:
    """Doc ids 0..n-1 in order, padding at the end; lengths mixing one-token docs and long ones."""
    n_real = rng.choice([0, S, S, rng.randint(0, S)])
    row: list[int] = []
    doc = 0
    while len(row) < n_real:
        length = min(rng.choice([1, 1, 2, 3, rng.randint(1, S)]), n_real - len(row))
        row += [doc] * length
        doc += 1
    return row + [-1] * (S - n_real)


def _arbitrary_row(S: int, rng: random.Random) -> list[int]:
    """Ids out of order and of any size, padding between documents, each id one run (an id in
    two runs of a row is refused everywhere: tests/test_split_runs.py)."""
    row: list[int] = []
    fresh = rng.sample(range(10**6), S)  # distinct ids, unsorted
    while len(row) < S:
        doc = rng.choice([-1, -2, fresh.pop()])
        row += [doc] * min(rng.choice([1, 2, 3, rng.randint(1, S)]), S - len(row))
    return row


def _layout(B: int, S: int, rng: random.Random, arbitrary: bool = False) -> torch.Tensor:
    if arbitrary:  # out of order, interleaved padding: the generic classification
        return torch.tensor([_arbitrary_row(S, rng) for _ in range(B)])
    return torch.tensor([_packed_row(S, rng) for _ in range(B)], dtype=torch.int32)


def _prefix_lengths(d: torch.Tensor, rng: random.Random) -> torch.Tensor:
    n = max(int(d.max()) + 1, 1)
    out = torch.zeros(d.shape[0], n, dtype=torch.int64)
    for b in range(d.shape[0]):
        for k in range(n):
            out[b, k] = rng.randint(0, int((d[b] == k).sum()))
    return out


CASES = [(B, S, bs) for B in (1, 3) for S in (1, 7, 16, 37) for bs in (1, 4, 8, 16)]


# ----------------------------------------------------------------------------- primitives


@pytest.mark.parametrize(("B", "S", "bs"), CASES)
def test_primitives_identical_to_create_block_mask(B: int, S: int, bs: int) -> None:
    rng = random.Random(B * 1000 + S * 10 + bs)
    for trial in range(3):
        d = _layout(B, S, rng)
        factories = [
            masks.document(d),
            masks.document(d) & masks.causal(),
            masks.padding(d),
            masks.prefix_lm(d, _prefix_lengths(d, rng)),
        ]
        if trial == 0:
            d_arb = _layout(B, S, rng, arbitrary=True)
            factories += [masks.document(d_arb), masks.causal() & masks.document(d_arb)]
        for m in factories:
            _assert_identical(m.block_mask(block_size=bs), _reference(m, bs))
    for m in (masks.causal(), masks.sliding_window(rng.randint(0, S + 2))):
        _assert_identical(m.block_mask(block_size=bs, Q_LEN=S, KV_LEN=S), _reference(m, bs, S))


@pytest.mark.parametrize(
    "row",
    [
        [0] * 24,  # one document fills the row
        list(range(24)),  # one-token documents
        [-1] * 24,  # all padding
        [0] * 10 + [-1] * 14,
        [9] * 5 + [5] * 7 + [7] * 3 + [2] * 9,  # ids out of order
        [3] * 8 + [-1] * 8 + [1] * 8,  # padding between documents
        [0] * 23 + [1],
    ],
)
@pytest.mark.parametrize("bs", [4, 5, 8, 128])
def test_document_edge_layouts(row: list[int], bs: int) -> None:
    d = torch.tensor(row)
    for m in (masks.document(d), masks.document(d) & masks.causal(), masks.padding(d)):
        _assert_identical(m.block_mask(block_size=bs), _reference(m, bs))


def test_prefix_lm_edge_cases() -> None:
    d = torch.tensor([[0] * 8 + [1] * 8 + [2] * 5 + [-1] * 3, [0] * 24])
    for pl in ([[8, 8, 5], [24, 0, 0]], [[0, 0, 0], [0, 0, 0]], [[1, 7, 4], [13, 0, 0]]):
        m = masks.prefix_lm(d, torch.tensor(pl))
        for bs in (1, 3, 4, 8):
            _assert_identical(m.block_mask(block_size=bs), _reference(m, bs))


def test_arbitrary_ids_large_block_count() -> None:
    # Sorted and generic code paths must agree with the reference on the same structure.
    rng = random.Random(7)
    d = _layout(2, 96, rng, arbitrary=True)
    m = masks.document(d)
    _assert_identical(m.block_mask(block_size=4), _reference(m, 4))
    sorted_d = torch.sort(d, dim=-1).values
    m = masks.document(sorted_d) & masks.causal()
    _assert_identical(m.block_mask(block_size=4), _reference(m, 4))


# ----------------------------------------------------------------------------- compositions


def _random_mask(d: torch.Tensor, rng: random.Random, depth: int = 0) -> masks.Mask:
    leaves = [
        lambda: masks.document(d),
        lambda: masks.causal(),
        lambda: masks.padding(d),
        lambda: masks.sliding_window(rng.randint(0, 9)),
        lambda: masks.prefix_lm(d, _prefix_lengths(d, rng)),
    ]
    if depth >= 2 or rng.random() < 0.3:
        return rng.choice(leaves)()
    op = rng.choice(["and", "or", "not"])
    a = _random_mask(d, rng, depth + 1)
    if op == "not":
        return ~a
    b = _random_mask(d, rng, depth + 1)
    return a & b if op == "and" else a | b


def _dense(mask: masks.Mask, B: int, S: int) -> torch.Tensor:
    i = torch.arange(S)
    b = torch.arange(B)[:, None, None]
    return mask.mask_mod(b, torch.zeros((), dtype=torch.long), i[None, :, None], i[None, None, :])


def test_compositions_never_looser_than_exact() -> None:
    rng = random.Random(3)
    for _ in range(60):
        B, S, bs = rng.randint(1, 2), rng.randint(1, 30), rng.choice([1, 3, 4, 8])
        d = _layout(B, S, rng)
        m = _random_mask(d, rng)
        ours = m.block_mask(block_size=bs, Q_LEN=S, KV_LEN=S, B=B)
        ref = _reference(m, bs, S)
        got, exact = _states(ours), _states(ref).expand(B, -1, -1)
        assert not ((got == 2) & (exact != 2)).any(), (m, d, got, exact)  # never wrongly full
        assert not ((got == 0) & (exact != 0)).any(), (m, d, got, exact)  # never skipped


def test_composition_element_level_matches_components() -> None:
    rng = random.Random(5)
    d = _layout(2, 20, rng)
    pl = _prefix_lengths(d, rng)
    doc = _dense(masks.document(d), 2, 20)
    cau = _dense(masks.causal(), 2, 20)
    win = _dense(masks.sliding_window(3), 2, 20)
    pad = _dense(masks.padding(d), 2, 20)
    pre = _dense(masks.prefix_lm(d, pl), 2, 20)
    m = (masks.document(d) & masks.sliding_window(3) & masks.causal()) | ~masks.padding(d)
    assert torch.equal(_dense(m, 2, 20), (doc & win & cau) | ~pad)
    m = masks.prefix_lm(d, pl) | (masks.causal() & masks.padding(d))
    assert torch.equal(_dense(m, 2, 20), pre | (cau & pad))


def test_block_mask_expands_batch_and_demotes_tail() -> None:
    bm = masks.causal().block_mask(block_size=4, Q_LEN=10, KV_LEN=10, B=3)
    assert bm.shape == (3, 1, 10, 10)
    # The tail block (positions 8, 9) is never full, as with create_block_mask.
    assert bm.full_kv_num_blocks[0, 0].tolist() == [0, 1, 0]
    c = bmod.classify_causal(10, 10, 4)
    assert c[0, 2, 2].item() == bmod.PARTIAL and c[0, 2, 0].item() == bmod.FULL


def test_generic_ids_in_bounded_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every id in every block: pair enumeration is bs times the block matrix, done in steps.
    monkeypatch.setattr(bmod, "_PAIRS", 7)
    rng = random.Random(11)
    for d in (torch.arange(40)[None].flip(-1), _layout(2, 33, rng, arbitrary=True)):
        m = masks.document(d)
        _assert_identical(m.block_mask(block_size=4), _reference(m, 4))


@pytest.mark.parametrize("block_size", [2**27, 2**40])
def test_memory_follows_s_not_block_size(block_size: int) -> None:
    """Issue 11: block_size=2**27 took 2.6 GB for 3 tokens and 2**40 failed to allocate; one
    block covering the row is now classified from its S tokens."""
    d = torch.tensor([0, 0, 1])
    small = masks.document_causal_mask(d, block_size=4)
    big = masks.document_causal_mask(d, block_size=block_size)
    assert big.BLOCK_SIZE == (block_size, block_size)
    assert big.kv_num_blocks.tolist() == small.kv_num_blocks.tolist() == [[[1]]]
    assert big.full_kv_num_blocks.tolist() == small.full_kv_num_blocks.tolist() == [[[0]]]
    one = masks.document(torch.tensor([2, 2, 2]))
    big, small = one.block_mask(block_size=block_size), one.block_mask(block_size=4)
    assert big.full_kv_num_blocks.tolist() == small.full_kv_num_blocks.tolist()
    pl = masks.prefix_lm_mask(d, torch.tensor([2, 1]), block_size=block_size)
    assert pl.kv_num_blocks.tolist() == [[[1]]]


@pytest.mark.parametrize("fill", [2**63 - 1, -(2**63), 2**53 + 1, -1])
def test_block_tail_keeps_integer_fill_exact(fill: int) -> None:
    """Issue 35: the tail of the last block was F.pad(value=fill), which goes through a float:
    int64's max came back as its min (torch 2.13) or raised an overflow RuntimeError (torch
    2.14), so tree masks whose row length is not a multiple of the block size failed."""
    x = torch.tensor([[5, 6, 7], [8, 9, 10]])
    out = bmod._blocked(x, 2, fill)
    assert out.dtype == torch.int64 and out.shape == (2, 2, 2)
    assert out[:, 1, 1].tolist() == [fill, fill]
    assert out.reshape(2, 4)[:, :3].tolist() == x.tolist()
    seg = torch.tensor([[0, 0, -1, 1, 1, -1, 2]])  # padding between segments, S % 3 == 1
    m = masks.tree(seg, torch.tensor([[-1, 0, 0]]))
    _assert_identical(m.block_mask(block_size=3), _reference(m, 3))


# ----------------------------------------------------------------------------- direct path


@settings(max_examples=60, deadline=None)
@given(
    d=fst.doc_ids(max_batch_size=3, max_seq_len=70, block_size=8, allow_empty_rows=True),
    bs=st.sampled_from([1, 2, 3, 8, 16, 128]),
    causal=st.booleans(),
)
def test_document_block_mask_identical_to_create_block_mask(d, bs: int, causal: bool) -> None:
    # The direct construction from per-block runs (packer layouts) against create_block_mask.
    assert bmod.packed_layout(d)
    m = masks.document(d) & masks.causal() if causal else masks.document(d)
    ours = bmod.document_block_mask(d, causal=causal, block_size=bs, mask_mod=m.mask_mod)
    _assert_identical(ours, _reference(m, bs))
    _assert_identical(m.block_mask(block_size=bs), ours)


def test_document_block_mask_expands_batch() -> None:
    d = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, -1]])
    m = masks.document(d) & masks.causal()
    ours = m.block_mask(block_size=4, B=3)
    ref = create_block_mask(m.mask_mod, 3, 1, 10, 10, device="cpu", BLOCK_SIZE=4)
    _assert_identical(ours, ref)


@pytest.mark.parametrize(
    ("row", "packed"),
    [
        ([0, 0, 1, 1, -1, -1], True),
        ([-1, -1, -1], True),
        ([0, 1, 1, 3, 3], True),  # gaps in the ids are fine: only the order matters
        ([0, -1, 1], False),  # padding between documents: not the packer's layout
        ([1, 1, 0], False),
    ],
)
def test_packed_layout_gates_the_direct_path(row: list[int], packed: bool) -> None:
    d = torch.tensor([row])
    assert bmod.packed_layout(d) is packed
    m = masks.document(d)
    _assert_identical(m.block_mask(block_size=2), _reference(m, 2))


@pytest.mark.parametrize(
    "row",
    [
        [-(2**31), 2**31 - 1],  # padding then the largest int32 id: not a packer layout
        [0, 2**31 - 1, 2**31 - 1, -(2**31)],
    ],
)
def test_document_block_mask_with_extreme_ids(row: list[int]) -> None:
    for dtype in (torch.int32, torch.int64):
        d = torch.tensor([row], dtype=dtype)
        for m in (masks.document(d), masks.document(d) & masks.causal()):
            _assert_identical(m.block_mask(block_size=2), _reference(m, 2))
    big = torch.tensor([[0, 2**62, 2**63 - 1, -1]])  # 2 * id would overflow int64
    for m in (masks.document(big), masks.document(big) & masks.causal()):
        _assert_identical(m.block_mask(block_size=1), _reference(m, 1))


def test_document_block_mask_written_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    # Small outputs are written in pieces below torch's grain size; force many pieces.
    monkeypatch.setattr(bmod, "_SERIAL_ELEMENTS", 8)
    rng = random.Random(3)
    d = _layout(3, 37, rng)
    for m in (masks.document(d), masks.document(d) & masks.causal()):
        _assert_identical(m.block_mask(block_size=4), _reference(m, 4))
