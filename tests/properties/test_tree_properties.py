"""Property suite for the prefix-tree mask and pack_trees, built on flexpack.testing.

- element level: ``masks.tree`` evaluated on the full grid equals ``dense_tree_mask``, which walks
  the parents from the definition, on random forests (chains, stars, flat rows, random trees);
- block level: ``.block_mask()`` has exactly ``create_block_mask``'s block structure, and
  compositions (``& sliding_window``, ``| causal``...) are exact at element level, never looser
  at block level;
- pack_trees: every token is placed once, each rollout's path reads back its own tokens, and
  positions continue along the path.
"""

import torch
from hypothesis import given
from hypothesis import strategies as st

import flexpack
from flexpack import masks as fm
from flexpack.testing import assert_block_mask_matches, dense_mask, dense_tree_mask
from flexpack.testing import strategies as fst

block_sizes = st.sampled_from([1, 2, 3, 8, 16, 128])
forests = fst.forests(max_seq_len=130, block_size=16)


@given(forests)
def test_tree_mask_equals_dense_twin(forest):
    seg, par = forest
    want = dense_tree_mask(seg, par)
    got = dense_mask(fm.tree(seg, par))
    assert torch.equal(got, want)


@given(forests, block_sizes)
def test_tree_block_mask_equals_create_block_mask(forest, block_size):
    seg, par = forest
    m = fm.tree(seg, par)
    assert_block_mask_matches(m.block_mask(block_size=block_size), m, exact=True)


@given(forests, block_sizes, st.integers(0, 40), st.sampled_from(["window", "or", "padding"]))
def test_tree_compositions(forest, block_size, window, how):
    seg, par = forest
    want = dense_tree_mask(seg, par)
    S = seg.shape[-1]
    if how == "window":
        m = fm.tree(seg, par) & fm.sliding_window(window)
        q, kv = torch.arange(S)[:, None], torch.arange(S)[None, :]
        want = want & (q - kv <= window)
    elif how == "padding":
        m = fm.padding(seg) & fm.tree(seg, par)
    else:
        m = fm.tree(seg, par) | ~fm.padding(seg)
        real = seg >= 0
        want = want | ~(real[:, None, :, None] & real[:, None, None, :])
    assert torch.equal(dense_mask(m), want)
    assert_block_mask_matches(m.block_mask(block_size=block_size), want)


# ------------------------------------------------------------------------------ pack_trees


@st.composite
def nodes(draw, depth=3):
    """A random tree of token lists (a bare list is a leaf)."""
    tokens = draw(st.lists(st.integers(1, 50), min_size=1, max_size=6))
    if depth == 0 or draw(st.booleans()):
        return tokens
    children = draw(st.lists(nodes(depth - 1), min_size=1, max_size=3))
    return (tokens, children)


def paths(node, prefix=()):
    """Root-to-leaf token lists and their depth-first order, from the definition."""
    if isinstance(node, tuple):
        tokens, children = node
        for child in children:
            yield from paths(child, (*prefix, list(tokens)))
        if not children:
            yield [*prefix, list(tokens)]
    else:
        yield [*prefix, list(node)]


@given(st.lists(nodes(), min_size=1, max_size=6), st.integers(24, 64))
def test_pack_trees_reads_back_every_rollout(groups, max_len):
    sizes = []
    for g in groups:
        stack, n = [g], 0
        while stack:
            x = stack.pop()
            toks, kids = x if isinstance(x, tuple) else (x, [])
            n += len(toks)
            stack.extend(kids)
        sizes.append(n)
    groups = [g for g, n in zip(groups, sizes, strict=True) if n <= max_len]
    if not groups:
        return
    batch = flexpack.pack_trees(groups, max_len)
    real = batch.segment_ids >= 0
    assert batch.num_tokens == int(real.sum()) == sum(n for n in sizes if n <= max_len)
    rollouts = [p for g in groups for p in paths(g)]
    assert batch.num_rollouts == len(rollouts)
    # Logits that depend only on the token at the source position: the log-prob of target y
    # read from a position holding x is table[x, y], so every rollout row must hold
    # table[prev, next] over the consecutive pairs of its path, from the second segment on.
    V = 64
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    logits = table[batch.input_ids]  # (R, S, V)
    logps, valid = batch.gather_logps(logits)
    ref = table.log_softmax(-1)
    assert logps.shape == valid.shape and logps.shape[0] == len(rollouts)
    for r, path in enumerate(rollouts):
        flat = [t for seg in path for t in seg]
        skip = len(path[0])
        want = [float(ref[flat[i - 1], flat[i]]) for i in range(skip, len(flat))]
        n = len(want)
        assert valid[r].tolist() == [True] * n + [False] * (valid.shape[1] - n)
        assert torch.allclose(logps[r, :n], torch.tensor(want, dtype=logps.dtype))
        assert bool((logps[r, n:] == 0).all())
    # Positions continue along the path: each token's position is its depth on the path.
    ids = batch.input_ids
    for row in range(ids.shape[0]):
        seg, pos, par = batch.segment_ids[row], batch.position_ids[row], batch.parents[row]
        for t in range(ids.shape[1]):
            s = int(seg[t])
            if s < 0:
                continue
            first = t == 0 or int(seg[t - 1]) != s
            if not first:
                assert int(pos[t]) == int(pos[t - 1]) + 1
            elif int(par[s]) < 0:
                assert int(pos[t]) == 0
            else:
                last_of_parent = int((seg == par[s]).nonzero().max())
                assert int(pos[t]) == int(pos[last_of_parent]) + 1


# ------------------------------------------------------------------------------ attention


@given(forests, st.booleans(), st.sampled_from(["auto", "sdpa"]))
def test_attention_equals_float64_reference(forest, gqa, backend):
    """flexpack.attention with grad on CPU (one SDPA call per segment) vs float64 attention."""
    from flexpack import _attention_tree
    from flexpack.testing import reference_attention

    seg, par = forest
    B, S = seg.shape
    g = torch.Generator().manual_seed(S)
    Hkv = 1 if gqa else 2
    q = torch.randn(B, 2, S, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hkv, S, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Hkv, S, 8, generator=g, dtype=torch.float64, requires_grad=True)
    mask = fm.tree(seg, par)
    out = flexpack.attention(q, k, v, mask, enable_gqa=gqa, backend=backend)
    assert mask._spans is not None  # the per-tree path ran
    assert all(sum(p.length for p in row) == S for row in _attention_tree.spans_of(mask))
    want = reference_attention(q, k, v, dense_tree_mask(seg, par), enable_gqa=gqa)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=0)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref = torch.autograd.grad((want * w).sum(), (q, k, v))
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


# ------------------------------------------------------------------------------ losses


@given(
    st.lists(st.integers(0, 6), min_size=1, max_size=6),
    st.sampled_from(["token_mean", "sequence_mean"]),
    st.floats(0.05, 0.5),
    st.integers(0, 2**16),
)
def test_loss_helpers_equal_their_per_rollout_formulas(lengths, reduction, epsilon, seed):
    from flexpack.trees import grpo_loss, sequence_logps

    g = torch.Generator().manual_seed(seed)
    N, L = len(lengths), max(1, max(lengths))
    valid = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
    logps = torch.where(valid, -torch.rand(N, L, generator=g, dtype=torch.float64), 0.0)
    old = logps + 0.5 * torch.randn(N, L, generator=g, dtype=torch.float64)
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    rows = [logps[n, : lengths[n]] for n in range(N)]
    sums = sequence_logps(logps, valid)
    means = sequence_logps(logps, valid, reduction="mean")
    for n, row in enumerate(rows):
        assert torch.isclose(sums[n], row.sum())
        assert torch.isclose(means[n], row.mean() if len(row) else torch.tensor(0.0).double())
    terms = []
    for n, row in enumerate(rows):
        ratio = torch.exp(row - old[n, : lengths[n]])
        clipped = ratio.clamp(1 - epsilon, 1 + epsilon)
        terms.append(-torch.minimum(ratio * adv[n], clipped * adv[n]))
    if reduction == "token_mean":
        want = torch.cat(terms).sum() / max(1, sum(lengths))
    else:
        per = [t.mean() for t in terms if t.numel()]
        want = torch.stack(per).mean() if per else torch.tensor(0.0).double()
    got = grpo_loss(logps, valid, adv, old_logps=old, epsilon=epsilon, reduction=reduction)
    assert torch.isclose(got, want), (got, want)
