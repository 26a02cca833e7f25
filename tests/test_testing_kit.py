"""The testing kit tested on plain torch objects: references, the block-mask assertion, strategies.

Nothing here needs flexpack.masks: the kit must be right before the mask suite can lean on it.
"""

import itertools
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, noop_mask

from flexpack.testing import (
    assert_block_mask_matches,
    block_states,
    dense_mask,
    expected_block_states,
    reference_attention,
)
from flexpack.testing import strategies as fst


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def off_by_one_causal(b, h, q_idx, kv_idx):
    return q_idx > kv_idx


def doc_mod(doc):
    """An independent document-causal mask_mod over a (B, S) tensor."""

    def mod(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (doc[b, q_idx] >= 0) & (q_idx >= kv_idx)

    return mod


def brute_force(fn, B, H, Q, KV):
    out = torch.zeros(B, H, Q, KV, dtype=torch.bool)
    for b, h, q, kv in itertools.product(range(B), range(H), range(Q), range(KV)):
        out[b, h, q, kv] = bool(
            fn(torch.tensor(b), torch.tensor(h), torch.tensor(q), torch.tensor(kv))
        )
    return out


def from_states(states, mask_mod, seq_len, block_size):
    """A BlockMask with the given (nq, nkv) block states: 0 skipped, 1 partial, 2 full."""
    states = torch.as_tensor(states)

    def lists(which):
        num = (states == which).sum(-1).to(torch.int32)
        # Stable sort puts the listed kv blocks first, in ascending order.
        idx = torch.argsort((states != which).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return num[None, None], idx[None, None]

    kv_num, kv_idx = lists(1)
    full_num, full_idx = lists(2)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod,
        seq_lengths=(seq_len, seq_len),
    )


# ---------------------------------------------------------------------------------------------
# dense_mask


def test_dense_mask_of_callable_matches_brute_force():
    doc = torch.tensor([[0, 0, 1, 1, 1, -1], [0, 1, 1, 2, -1, -1]])
    mod = doc_mod(doc)
    assert torch.equal(dense_mask(mod, 2, 2, 6, 6), brute_force(mod, 2, 2, 6, 6))


@pytest.mark.parametrize("S, block", [(7, 2), (9, 4), (8, 8), (5, 128)])
def test_dense_mask_of_block_mask_is_its_mask_mod(S, block):
    doc = torch.tensor([[0] * (S // 2) + [1] * (S - S // 2 - 1) + [-1], list(range(S))])
    mod = doc_mod(doc)
    bm = create_block_mask(mod, 2, 1, S, S, device="cpu", BLOCK_SIZE=block)
    want = dense_mask(mod, 2, 1, S, S)
    assert torch.equal(dense_mask(bm), want)
    # Refines to_dense: the element mask is allowed only inside computed blocks.
    blocks = bm.to_dense().bool()
    elem_blocks = blocks[..., torch.arange(S) // block, :][..., torch.arange(S) // block]
    assert not bool((want & ~elem_blocks).any())


def test_dense_mask_of_block_mask_uses_block_structure():
    # A partial block with noop mask_mod is fully allowed; a skipped block is masked even
    # though noop_mask allows it.
    bm = from_states([[1, 0], [2, 1]], noop_mask, 4, 2)
    want = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(dense_mask(bm)[0, 0], want)


def test_dense_mask_broadcasts_a_shared_block_mask_over_batch_and_heads():
    # A (1, 1) BlockMask used for B=2, H=3: its mask_mod sees the real b.
    per_b = torch.tensor([[True] * 4, [False] * 4])

    def mod(b, h, q_idx, kv_idx):
        return per_b[b, q_idx] & (q_idx >= kv_idx)

    bm = create_block_mask(causal, 1, 1, 4, 4, device="cpu", BLOCK_SIZE=2)
    bm = BlockMask.from_kv_blocks(
        bm.kv_num_blocks,
        bm.kv_indices,
        bm.full_kv_num_blocks,
        bm.full_kv_indices,
        BLOCK_SIZE=2,
        mask_mod=mod,
        seq_lengths=(4, 4),
    )
    out = dense_mask(bm, 2, 3, 4, 4)
    assert out.shape == (2, 3, 4, 4)
    assert torch.equal(out[0, 2], torch.ones(4, 4, dtype=torch.bool).tril())
    # Row 1's mask_mod allows nothing, but full blocks never call mask_mod.
    full_block = torch.zeros(4, 4, dtype=torch.bool)
    full_block[2:, :2] = True
    assert torch.equal(out[1], full_block.expand(3, 4, 4))


def test_dense_mask_errors_say_what_to_do():
    with pytest.raises(ValueError, match="Q_LEN and KV_LEN"):
        dense_mask(causal)
    with pytest.raises(TypeError, match="already a dense mask"):
        dense_mask(torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(TypeError, match="got int"):
        dense_mask(3, 1, 1, 2, 2)
    bm = create_block_mask(causal, 2, 1, 4, 4, device="cpu", BLOCK_SIZE=2)
    with pytest.raises(ValueError, match="broadcast"):
        dense_mask(bm, 3, 1, 4, 4)
    with pytest.raises(ValueError, match="seq_lengths"):
        dense_mask(bm, 2, 1, 5, 4)


# ---------------------------------------------------------------------------------------------
# reference_attention


def test_reference_attention_matches_sdpa_and_zeroes_fully_masked_rows():
    torch.manual_seed(0)
    B, H, S, D = 2, 3, 9, 8
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    doc = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1, -1], [0] * 9])
    allowed = dense_mask(doc_mod(doc), B, H, S, S)
    out = reference_attention(q, k, v, allowed)
    assert out.dtype == torch.float32
    rows = allowed.any(-1)  # (B, H, S)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=allowed)
    torch.testing.assert_close(out[rows], ref[rows].float(), rtol=1e-6, atol=1e-6)
    assert torch.equal(out[~rows], torch.zeros_like(out[~rows]))
    assert not bool(out.isnan().any())


def test_reference_attention_gqa_scale_and_mask_kinds():
    torch.manual_seed(1)
    q = torch.randn(1, 4, 5, 8, dtype=torch.bfloat16)
    k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 6)
    k, v = k.bfloat16(), v.bfloat16()
    allowed = torch.ones(5, 5, dtype=torch.bool).tril()
    out = reference_attention(q, k, v, allowed, scale=0.3, enable_gqa=True)
    assert out.shape == (1, 4, 5, 6) and out.dtype == torch.bfloat16
    ref = F.scaled_dot_product_attention(
        q.double(),
        k.double().repeat_interleave(2, 1),
        v.double().repeat_interleave(2, 1),
        is_causal=True,
        scale=0.3,
    )
    torch.testing.assert_close(out, ref.bfloat16())
    # A mask_mod or a BlockMask is turned into its dense mask.
    bm = create_block_mask(causal, 1, 1, 5, 5, device="cpu", BLOCK_SIZE=2)
    assert torch.equal(reference_attention(q, k, v, causal, scale=0.3, enable_gqa=True), out)
    assert torch.equal(reference_attention(q, k, v, bm, scale=0.3, enable_gqa=True), out)


def test_reference_attention_errors():
    q = torch.randn(1, 4, 5, 8)
    k = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="enable_gqa"):
        reference_attention(q, k, k, torch.ones(5, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool mask"):
        reference_attention(q, q, q, torch.zeros(5, 5))
    with pytest.raises(ValueError, match="broadcast"):
        reference_attention(q, q, q, torch.ones(4, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\(B, H, L, E\)"):
        reference_attention(q[0], q, q, torch.ones(5, 5, dtype=torch.bool))


# ---------------------------------------------------------------------------------------------
# block states and assert_block_mask_matches


@st.composite
def random_grids(draw):
    """A random dense (B, 1, S, S) mask and a block size that often does not divide S."""
    B = draw(st.integers(1, 2))
    S = draw(st.integers(1, 12))
    block = draw(st.sampled_from([1, 2, 3, 4, 8]))
    density = draw(st.sampled_from(["sparse", "dense", "random"]))
    flat = st.lists(st.booleans(), min_size=B * S * S, max_size=B * S * S)
    bits = torch.tensor(draw(flat), dtype=torch.bool).view(B, 1, S, S)
    if density == "sparse":
        bits &= torch.ones(S, S, dtype=torch.bool).tril()
    elif density == "dense":
        bits |= torch.ones(S, S, dtype=torch.bool).tril()
    return bits, block


@given(random_grids())
def test_expected_block_states_reproduce_create_block_mask(grid):
    dense, block = grid
    B, _, S, _ = dense.shape

    def mod(b, h, q_idx, kv_idx):
        return dense[b, 0, q_idx, kv_idx]

    bm = create_block_mask(mod, B, 1, S, S, device="cpu", BLOCK_SIZE=block)
    assert torch.equal(block_states(bm), expected_block_states(dense, block, exact=True))
    assert torch.equal(dense_mask(bm), dense)
    assert_block_mask_matches(bm, mod, exact=True)
    assert_block_mask_matches(bm, dense, exact=True)


def test_passes_on_create_block_mask_with_shared_batch():
    doc = torch.tensor([[0, 0, 0, 1, 1, -1, -1]])
    bm = create_block_mask(doc_mod(doc), 1, 1, 7, 7, device="cpu", BLOCK_SIZE=2)
    assert_block_mask_matches(bm, doc_mod(doc), exact=True)
    assert_block_mask_matches(bm, dense_mask(doc_mod(doc), 1, 1, 7, 7)[0, 0])


def _failure(block_mask, expected, **kw):
    with pytest.raises(AssertionError) as info:
        assert_block_mask_matches(block_mask, expected, **kw)
    return str(info.value)


def test_fails_on_off_by_one_causal_with_a_readable_diff():
    bm = create_block_mask(off_by_one_causal, 1, 1, 10, 10, device="cpu", BLOCK_SIZE=4)
    msg = _failure(bm, causal)
    assert "10 of 100 (b, h, q, kv) pairs differ" in msg
    assert "10 expected allowed but masked" in msg
    assert "first at b=0, h=0, q=0, kv=0 (q-block 0, kv-block 0): expected allowed" in msg
    assert "found masked" in msg
    # The picture marks the missing diagonal with 'x'.
    picture = [line for line in msg.splitlines() if re.search(r"q=\d+$", line)]
    assert picture[0].strip().startswith("> x")
    assert all("x" in line for line in picture)


def test_fails_on_a_block_wrongly_marked_full():
    # Causal, 3 blocks of 2: the diagonal block (1, 1) is partial, here marked full.
    bm = from_states([[1, 0, 0], [2, 2, 0], [2, 2, 1]], causal, 6, 2)
    msg = _failure(bm, causal)
    assert "q=2, kv=3 (q-block 1, kv-block 1): expected masked, found allowed" in msg
    assert "b=0 h=0 q-block 1 kv-block 1: is marked full but holds masked pairs" in msg
    assert "(expected partial, found full)" in msg
    assert "FF.   <- differs" in msg  # the block picture, found side


def test_fails_on_a_skipped_block():
    bm = from_states([[1, 0, 0], [0, 1, 0], [2, 2, 1]], causal, 6, 2)
    msg = _failure(bm, causal)
    assert "q=2, kv=0 (q-block 1, kv-block 0): expected allowed, found masked" in msg
    assert "q-block 1 kv-block 0: holds allowed pairs but is skipped" in msg
    assert "(expected full, found empty (skipped))" in msg


def test_exact_flags_a_looser_but_correct_structure():
    # Full blocks stored as partial: right at element level, slower, not create_block_mask's.
    bm = from_states([[1, 0, 0], [1, 1, 0], [1, 1, 1]], causal, 6, 2)
    assert_block_mask_matches(bm, causal)
    msg = _failure(bm, causal, exact=True)
    assert "differs from create_block_mask's classification (expected full, found partial)" in msg
    assert "element mask" not in msg
    assert_block_mask_matches(bm, causal, check_block_structure=False)


def test_incomplete_last_block_may_be_full_unless_exact():
    # S=5, block 2: the last block holds one real pair, allowed; full is right but not exact.
    bm = from_states([[2, 0, 0], [2, 2, 0], [2, 2, 2]], lambda b, h, q, kv: q // 2 >= kv // 2, 5, 2)
    assert_block_mask_matches(bm, lambda b, h, q, kv: q // 2 >= kv // 2)
    assert "differs from create_block_mask" in _failure(
        bm, lambda b, h, q, kv: q // 2 >= kv // 2, exact=True
    )


def test_fails_on_inconsistent_block_lists():
    bm = from_states([[1, 0], [2, 1]], causal, 4, 2)
    # List block (1, 0) both as partial and full, and an index past the last kv block.
    bad = BlockMask.from_kv_blocks(
        torch.tensor([[[1, 2]]], dtype=torch.int32),
        torch.tensor([[[[0, 5], [1, 0]]]], dtype=torch.int32),
        bm.full_kv_num_blocks,
        bm.full_kv_indices,
        BLOCK_SIZE=2,
        mask_mod=causal,
        seq_lengths=(4, 4),
    )
    msg = _failure(bad, causal)
    assert "listed both as partial and as full" in msg


def test_fails_on_out_of_range_index():
    bad = BlockMask.from_kv_blocks(
        torch.tensor([[[2, 1]]], dtype=torch.int32),
        torch.tensor([[[[0, 7], [1, 0]]]], dtype=torch.int32),
        BLOCK_SIZE=2,
        mask_mod=causal,
        seq_lengths=(4, 4),
        compute_q_blocks=False,
    )
    msg = _failure(bad, causal)
    assert "kv_indices[0, 0, 0, 1] = 7 is outside the 2 kv blocks" in msg


def test_assertion_argument_errors():
    bm = create_block_mask(causal, 1, 1, 4, 4, device="cpu", BLOCK_SIZE=2)
    with pytest.raises(TypeError, match="bool dense mask"):
        assert_block_mask_matches(bm, torch.ones(4, 4))
    with pytest.raises(ValueError, match=r"\(Q_LEN, KV_LEN\)"):
        assert_block_mask_matches(bm, torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="BlockMask first"):
        assert_block_mask_matches(causal, bm)


# ---------------------------------------------------------------------------------------------
# strategies


def reach(strategy, condition):
    """Show that ``strategy`` draws an example satisfying ``condition`` (no shrinking: fast)."""
    return find(
        strategy,
        condition,
        settings=settings(max_examples=1000, phases=[Phase.generate], database=None),
    )


def _runs(row):
    """(id, length) runs of one row."""
    return [(k, len(list(g))) for k, g in itertools.groupby(row.tolist())]


def test_doc_ids_reach_every_edge_case():
    strategy = fst.doc_ids(max_seq_len=300)
    cases = {
        "padding": lambda d: bool((d < 0).any()),
        "B > 1": lambda d: d.shape[0] > 1,
        "one-token document": lambda d: any(n == 1 and k >= 0 for r in d for k, n in _runs(r)),
        "one document filling a row": lambda d: any(bool((r == 0).all()) for r in d),
        "S not a multiple of 128, above it": lambda d: d.shape[1] > 128 and d.shape[1] % 128,
        "S = 129": lambda d: d.shape[1] == 129,
    }
    for name, condition in cases.items():
        reach(strategy, condition)  # raises NoSuchExample if unreachable
        del name


def test_non_contiguous_doc_ids_go_out_of_order_and_pad_inside():
    strategy = fst.doc_ids(max_seq_len=40, contiguous=False)

    def out_of_order(d):
        return any((lambda ids: ids != sorted(ids))([k for k, _ in _runs(r) if k >= 0]) for r in d)

    reach(strategy, out_of_order)
    reach(strategy, lambda d: any(bool((r[:-1] < 0).any() & (r[-1] >= 0)) for r in d))
    reach(strategy, lambda d: bool((d < -1).any()))


@given(fst.doc_ids(max_seq_len=70, block_size=16, allow_empty_rows=True))
def test_contiguous_doc_ids_are_packer_style(d):
    assert d.dtype == torch.int32 and d.dim() == 2 and 1 <= d.shape[1] <= 70
    for row in d:
        runs = _runs(row)
        ids = [k for k, _ in runs]
        real = [k for k in ids if k >= 0]
        assert real == list(range(len(real)))
        assert all(k == -1 for k in ids[len(real) :])


@given(st.data())
def test_fixed_shapes_and_bounds(data):
    d = data.draw(fst.doc_ids(batch_size=2, seq_len=33, max_docs=3, allow_padding=False))
    assert d.shape == (2, 33)
    assert bool((d >= 0).all()) and int(d.max()) <= 2
    rows = data.draw(fst.seqlens(max_len=20, batch_size=3, allow_padding=False))
    assert [sum(r) for r in rows] == [20, 20, 20]
    assert all(n >= 1 for r in rows for n in r)


@given(st.data())
def test_prefix_lengths_fit_their_documents(data):
    d = data.draw(fst.doc_ids(max_seq_len=40))
    p = data.draw(fst.prefix_lengths(d))
    assert p.dtype == torch.int64 and p.shape[0] == d.shape[0]
    for row, pl in zip(d, p, strict=True):
        lengths = torch.bincount(row[row >= 0].long()).tolist() if bool((row >= 0).any()) else []
        assert p.shape[1] >= len(lengths)
        assert all(0 <= int(pl[i]) <= n for i, n in enumerate(lengths))
        assert bool((pl[len(lengths) :] == 0).all())
    p1 = data.draw(fst.prefix_lengths(d[0]))
    assert p1.dim() == 1


def test_strategy_argument_errors():
    with pytest.raises(ValueError, match="packer-style"):
        find(fst.prefix_lengths(torch.tensor([1, 0])), lambda p: True)
    with pytest.raises(ValueError, match="max_len"):
        find(fst.seqlens(max_len=0), lambda p: True)
    with pytest.raises(ValueError, match="integer dtype"):
        find(fst.doc_ids(dtype=torch.float32), lambda p: True)


@given(rows=fst.seqlens(max_len=40, allow_empty_rows=True))
def test_seqlens_feed_packed_layout(rows):
    # The strategy speaks PackedLayout's language: per-row document lengths for from_seqlens.
    from flexpack import PackedLayout

    layout = PackedLayout.from_seqlens(rows, 40)
    assert layout.doc_ids.shape == (len(rows), 40)
    assert layout.seqlens.tolist() == [n for row in rows for n in row]


def test_doc_ids_strategy_refuses_dtypes_that_would_wrap():
    # The strategy wrote int64 ids and cast them: uint8 turned padding -1 into document 255 and
    # int8 turned ids past 127 into negative ids (padding) even with allow_padding=False.
    from flexpack.testing.strategies import doc_ids

    with pytest.raises(ValueError, match="cannot hold -1"):
        doc_ids(seq_len=6, dtype=torch.uint8).example()
    with pytest.raises(ValueError, match="holds ids up to 127"):
        doc_ids(seq_len=200, dtype=torch.int8, allow_padding=False).example()
    d = doc_ids(seq_len=6, dtype=torch.uint8, allow_padding=False).example()
    assert d.dtype == torch.uint8 and int(d.max()) < 6
