"""The proof for prefix-tree packing: a packed tree is each of its rollouts run alone.

Through the reference GPT (and a transformers Llama under ``attn_implementation="flexpack"``),
on rows packed by ``flexpack.pack_trees`` from GRPO groups, DPO pairs, branching multi-turn
rollouts and plain documents: ``TreeBatch.gather_logps`` equals, rollout by rollout, the
log-probs of the rollout's tokens computed on the rollout alone (prompt + completion, one
sequence, plain causal; fp32, atol 1e-5), and the gradients of a sum of rollout log-probs (and
of the GRPO loss) equal the unpacked ones. A negative control (a document mask instead of the
tree mask) fails the same comparison. Also: bf16 within bf16 noise, compiled flex on CPU, the
tree-mask errors and the loss helpers against their unpacked formulas.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import flexpack
from flexpack import masks as fm
from flexpack.models import GPT, GPTConfig
from flexpack.trees import grpo_loss, sequence_logps

MAX_LEN = 64
ATOL = 1e-5
CFG = GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32)


def toks(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist()


def make_groups(seed: int) -> list:
    """A GRPO group, a DPO pair, a branching multi-turn rollout and plain documents."""
    g = torch.Generator().manual_seed(seed)
    grpo = (toks(g, 20), [toks(g, n) for n in (1, 7, 3, 9)])
    dpo = (toks(g, 11), [toks(g, 6), toks(g, 2)])
    turns = (toks(g, 8), [(toks(g, 5), [toks(g, 4), (toks(g, 3), [toks(g, 2)])]), toks(g, 6)])
    docs = [toks(g, 17), toks(g, 1)]
    return [grpo, dpo, turns, *docs]


def rollouts(node, prefix=()):
    """Root-to-leaf paths (lists of segments), depth-first: the definition, not flexpack's."""
    if isinstance(node, tuple):
        tokens, children = node
        for child in children:
            yield from rollouts(child, (*prefix, tokens))
    else:
        yield [*prefix, node]


def make_model(seed: int, config: GPTConfig = CFG) -> GPT:
    torch.manual_seed(seed)
    model = GPT(config)
    with torch.no_grad():  # larger weights than the 0.02 init, so a leak between segments shows
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    return model


def alone_logps(model, groups) -> list[torch.Tensor]:
    """Per rollout: log p of every token after the root segment, the rollout run alone."""
    out = []
    for group in groups:
        for path in rollouts(group):
            tokens = torch.tensor([t for seg in path for t in seg])
            logits = model(tokens[None])[0]  # (L, V): plain causal, positions 0..L-1
            lp = F.log_softmax(logits[:-1].float(), -1).gather(-1, tokens[1:, None])[:, 0]
            out.append(lp[len(path[0]) - 1 :])
    return out


def packed_logps(model, batch, mask=None):
    mask = batch.mask() if mask is None else mask
    logits = model(batch.input_ids, position_ids=batch.position_ids, mask=mask)
    return batch.gather_logps(logits)


def assert_grads_close(packed, unpacked) -> None:
    """Gradients equal up to fp32 round-off: 1e-5 relative to each tensor's largest entry."""
    for (name, p), u in zip(packed.named_parameters(), unpacked.parameters(), strict=True):
        tol = ATOL * max(1.0, u.grad.abs().max().item())
        torch.testing.assert_close(p.grad, u.grad, atol=tol, rtol=0, msg=f"grad of {name}")


def test_layout_of_a_group():
    batch = flexpack.pack_trees([([5, 6, 7], [[8, 9], [4]])], max_len=8)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 4, 0, 0]]
    assert batch.segment_ids.tolist() == [[0, 0, 0, 1, 1, 2, -1, -1]]
    assert batch.parents.tolist() == [[-1, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 0, 0]]
    assert (batch.num_tokens, batch.num_rollouts) == (6, 2)


def test_tokens_as_tensors_and_arrays():
    import numpy as np

    group = (torch.tensor([5, 6, 7]), [np.array([8, 9]), (4,)])
    batch = flexpack.pack_trees([group], max_len=8)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 4, 0, 0]]
    assert batch.parents.tolist() == [[-1, 0, 0]]


def test_several_trees_share_rows_and_every_token_is_placed():
    groups = make_groups(0)
    batch = flexpack.pack_trees(groups, MAX_LEN)
    sizes = [len(t) for g in groups for path in rollouts(g) for t in path]  # with repeats
    assert batch.num_tokens == int((batch.segment_ids >= 0).sum()) < sum(sizes)
    assert batch.input_ids.shape[0] < len(groups)  # rows hold several trees
    assert batch.rollout_groups.tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 2, 3, 4]
    assert batch.rollout_lengths.tolist() == [1, 7, 3, 9, 6, 2, 9, 10, 6, 0, 0]


@pytest.mark.parametrize("seed", [0, 1])
def test_gather_logps_equals_each_rollout_alone(seed):
    """With grad on CPU: flexpack.attention's SDPA path, the one training runs."""
    groups = make_groups(seed)
    model = make_model(seed)
    batch = flexpack.pack_trees(groups, MAX_LEN, seed=seed)
    logps, valid = packed_logps(model, batch)
    want = alone_logps(model, groups)
    assert logps.shape[0] == len(want)
    for r, ref in enumerate(want):
        n = ref.shape[0]
        assert valid[r].tolist() == [True] * n + [False] * (valid.shape[1] - n)
        torch.testing.assert_close(logps[r, :n], ref, atol=ATOL, rtol=0)


def test_gradients_equal_unpacked():
    groups = make_groups(2)
    model_p = make_model(2)
    model_u = copy.deepcopy(model_p)
    batch = flexpack.pack_trees(groups, MAX_LEN)
    logps, valid = packed_logps(model_p, batch)
    want = alone_logps(model_u, groups)
    loss_p = sequence_logps(logps, valid).sum()
    loss_u = torch.stack([ref.sum() for ref in want]).sum()
    torch.testing.assert_close(loss_p, loss_u, atol=ATOL, rtol=0)
    loss_p.backward()
    loss_u.backward()
    assert_grads_close(model_p, model_u)


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean"])
def test_grpo_loss_and_gradients_equal_unpacked(reduction):
    groups = make_groups(3)
    model_p = make_model(3)
    model_u = copy.deepcopy(model_p)
    batch = flexpack.pack_trees(groups, MAX_LEN)
    adv = torch.randn(batch.num_rollouts, generator=torch.Generator().manual_seed(3))
    logps, valid = packed_logps(model_p, batch)
    old = (logps + 0.3 * torch.randn_like(logps)).detach()  # off-policy: ratios clip
    loss_p = grpo_loss(logps, valid, adv, old_logps=old, reduction=reduction)

    # The unpacked formula, rollout by rollout.
    terms, counts = [], []
    for r, lp in enumerate(alone_logps(model_u, groups)):
        ratio = torch.exp(lp - old[r, : lp.shape[0]])
        t = -torch.minimum(ratio * adv[r], ratio.clamp(0.8, 1.2) * adv[r])
        terms.append(t.sum())
        counts.append(lp.shape[0])
    if reduction == "token_mean":
        loss_u = torch.stack(terms).sum() / sum(counts)
    else:
        loss_u = torch.stack([t / c for t, c in zip(terms, counts, strict=True) if c]).mean()
    torch.testing.assert_close(loss_p, loss_u, atol=ATOL, rtol=0)
    loss_p.backward()
    loss_u.backward()
    assert_grads_close(model_p, model_u)


def test_document_mask_instead_of_tree_fails():
    """Negative control: each segment as its own document loses the prompt, by a wide margin."""
    groups = make_groups(4)
    model = make_model(4)
    batch = flexpack.pack_trees(groups, MAX_LEN)
    logps, _ = packed_logps(model, batch, mask=fm.document(batch.segment_ids) & fm.causal())
    worst = max(
        (logps[r, : ref.shape[0]] - ref).abs().max().item()
        for r, ref in enumerate(alone_logps(model, groups))
        if ref.numel()
    )
    assert worst > 1000 * ATOL


def test_bf16_within_noise():
    """bf16 packed vs fp32 alone errs no more than bf16 alone vs fp32 alone (plus slack)."""
    groups = make_groups(5)
    model = make_model(5)
    ref = alone_logps(model, groups)
    model16 = copy.deepcopy(model).to(torch.bfloat16)
    alone16 = alone_logps(model16, groups)
    batch = flexpack.pack_trees(groups, MAX_LEN)
    logps, _ = packed_logps(model16, batch)
    err_packed = max(
        (logps[r, : w.shape[0]] - w).abs().max().item() for r, w in enumerate(ref) if w.numel()
    )
    err_alone = max(
        (a - w).abs().max().item() for a, w in zip(alone16, ref, strict=True) if w.numel()
    )
    assert err_packed <= 2 * err_alone + 0.05, (err_packed, err_alone)


@pytest.mark.compile
def test_flex_path_equals_each_rollout_alone():
    """Without grad, backend="flex": compiled flex_attention with the tree BlockMask, on CPU."""
    groups = make_groups(6)
    model = make_model(6, replace(CFG, attn_backend="flex"))
    batch = flexpack.pack_trees(groups, MAX_LEN)
    with torch.no_grad():
        block_mask = batch.mask().block_mask(block_size=16)
        logps, _ = packed_logps(model, batch, mask=block_mask)
        want = alone_logps(model, groups)
    for r, ref in enumerate(want):
        torch.testing.assert_close(logps[r, : ref.shape[0]], ref, atol=ATOL, rtol=0)


def test_transformers_llama_equals_each_rollout_alone():
    transformers = pytest.importorskip("transformers")
    from flexpack.integrations.transformers import register

    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LEN,
        initializer_range=0.2,
        attn_implementation=register(),
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    groups = make_groups(7)
    batch = flexpack.pack_trees(groups, MAX_LEN)
    out = model(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        flexpack_mask=batch.mask(),
        use_cache=False,
    )
    logps, valid = batch.gather_logps(out.logits)
    want = alone_logps(lambda ids: reference(input_ids=ids, use_cache=False).logits, groups)
    for r, ref in enumerate(want):
        torch.testing.assert_close(logps[r, : ref.shape[0]], ref, atol=ATOL, rtol=0)
    # Gradients of the summed rollout log-probs match too.
    sequence_logps(logps, valid).sum().backward()
    torch.stack([w.sum() for w in want]).sum().backward()
    assert_grads_close(model, reference)


# ----------------------------------------------------------------------------- errors


def test_pack_trees_errors():
    with pytest.raises(ValueError, match=r"groups\[1\] has 9 tokens, more than max_len=8"):
        flexpack.pack_trees([[1, 2], ([1, 2, 3], [[4, 5, 6], [7, 8, 9]])], max_len=8)
    with pytest.raises(ValueError, match=r"groups\[0\]\[1\]\[1\] has no tokens"):
        flexpack.pack_trees([([1, 2], [[3], []])], max_len=8)
    with pytest.raises(TypeError, match="sequence of int token ids"):
        flexpack.pack_trees([[1.5, 2.0]], max_len=8)
    with pytest.raises(TypeError, match=r"groups\[0\] must be .* ragged nesting"):
        flexpack.pack_trees([[[1, 2], [3]]], max_len=8)
    with pytest.raises(TypeError, match=r"groups\[0\]\[1\]\[0\] must be .* shape \(1, 2\)"):
        flexpack.pack_trees([([1], [[[1, 2]]])], max_len=8)
    with pytest.raises(ValueError, match="groups is empty"):
        flexpack.pack_trees([], max_len=8)
    with pytest.raises(ValueError, match="wrap"):
        flexpack.pack_trees([[1]], max_len=8, strategy="wrap")
    batch = flexpack.pack_trees([[1, 2]], max_len=4)
    with pytest.raises(ValueError, match=r"\(R, S, V\) = \(1, 4, V\)"):
        batch.gather_logps(torch.zeros(1, 5, 8))


@pytest.mark.parametrize("token", [-1, 16])
def test_gather_logps_names_a_token_outside_the_vocabulary(token):
    # A negative token silently read vocabulary entry V - 1; a token >= V was a raw IndexError.
    # pack_trees refuses a negative one already; gather_logps still checks the range.
    if token < 0:
        with pytest.raises(ValueError, match="token id -1; token ids are vocabulary indices"):
            flexpack.pack_trees([([5, 6, 7], [[8, token], [4]])], max_len=8)
        return
    b = flexpack.pack_trees([([5, 6, 7], [[8, token], [4]])], max_len=8)
    with pytest.raises(ValueError, match=rf"token {token} .*\[0, 16\)"):
        b.gather_logps(torch.zeros(1, 8, 16))


def test_pack_trees_refuses_negative_token_and_pad_ids_as_pack_sequences_does():
    with pytest.raises(ValueError, match=r"groups\[0\].*token id -3"):
        flexpack.pack_trees([([1, 2], [[3, -3]])], 8)
    with pytest.raises(ValueError, match="pad_id must be a token id"):
        flexpack.pack_trees([([1, 2], [[3]])], 8, pad_id=-1)
    with pytest.raises(ValueError, match="pad_id must be a token id"):
        flexpack.pack_sequences([[1, 2]], 8, pad_id=-1)


def test_tree_mask_errors():
    seg = torch.tensor([[0, 0, 1, 2, -1]])
    with pytest.raises(ValueError, match="depth-first order"):
        fm.tree(torch.tensor([[0, 1, 0]]), torch.tensor([[-1, 0]]))
    with pytest.raises(ValueError, match=r"parents must have shape \(3,\) or \(1, >= 3\)"):
        fm.tree(seg, torch.tensor([[-1, 0]]))
    with pytest.raises(ValueError, match=r"parents\[0, 1\] = 2"):
        fm.tree(seg, torch.tensor([[-1, 2, 0]]))
    # 0 -> 1, 0 -> 2, 1 -> 3: segment 2 splits the subtree of 1 (not depth-first).
    with pytest.raises(ValueError, match="not numbered depth-first"):
        fm.tree(torch.tensor([0, 1, 2, 3]), torch.tensor([-1, 0, 0, 1]))
    with pytest.raises(TypeError, match="integer segment numbers"):
        fm.tree(seg, torch.tensor([[-1.0, 0.0, 0.0]]))
    with pytest.raises(TypeError, match=r"segment_ids must be a torch\.Tensor"):
        fm.tree([0, 1], torch.tensor([-1, 0]))


def test_tree_parent_of_segment_zero_names_no_empty_range():
    # "an earlier segment 0..-1" for segment 0.
    with pytest.raises(ValueError, match=r"parent of segment 0 must be -1: it is a root") as e:
        fm.tree(torch.tensor([0, 0, 1]), torch.tensor([0, 0]))
    assert "0..-1" not in str(e.value)
    with pytest.raises(ValueError, match=r"an earlier segment 0\.\.0"):
        fm.tree(torch.tensor([0, 0, 1]), torch.tensor([-1, 1]))


def test_tree_mask_of_a_forest_without_children_is_document_causal():
    seg = torch.tensor([[0, 0, 1, 1, 1, 2, -1, -1]])
    tree = fm.tree(seg, torch.tensor([[-1, -1, -1]]))
    doc = fm.document(seg) & fm.causal()
    from flexpack.testing import dense_mask

    assert torch.equal(dense_mask(tree), dense_mask(doc))
    a, b = tree.block_mask(block_size=2), doc.block_mask(block_size=2)
    assert torch.equal(a.kv_num_blocks, b.kv_num_blocks)
    assert torch.equal(a.full_kv_num_blocks, b.full_kv_num_blocks)


def test_padding_between_segments_and_a_broadcast_mask():
    """masks.tree accepts padding between segments; a (1, S) mask serves a batch of 2."""
    from flexpack.testing import assert_block_mask_matches, dense_tree_mask, reference_attention

    seg = torch.tensor([0, 0, -1, 1, 1, -1, 2, 3, 3, -1])
    par = torch.tensor([-1, 0, -1, 2])
    m = fm.tree(seg, par)
    want = dense_tree_mask(seg, par)
    assert_block_mask_matches(m.block_mask(block_size=3), want, exact=True)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 10, 4, generator=g, requires_grad=True) for _ in range(3))
    out = flexpack.attention(q, k, v, m)
    torch.testing.assert_close(out, reference_attention(q, k, v, want), atol=1e-6, rtol=0)
    assert bool((out[:, :, [2, 5, 9]] == 0).all())
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_softcap_per_segment_equals_dense_path():
    seg = torch.tensor([[0, 0, 0, 1, 1, 2, 3, 3, 4, -1]])
    par = torch.tensor([[-1, 0, 0, -1, 3]])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 10, 4, generator=g, requires_grad=True) for _ in range(3))
    tree = fm.tree(seg, par)
    dense = tree & fm.padding(seg)  # a composition: the dense-mask SDPA path
    out = flexpack.attention(q, k, v, tree, softcap=2.0)
    assert tree._spans is not None  # the per-segment path ran
    torch.testing.assert_close(out, flexpack.attention(q, k, v, dense, softcap=2.0))


def test_tree_mask_all_padding_still_has_a_backward():
    # The per-segment SDPA path returned fresh zeros with no graph when every token is padding,
    # so backward raised "does not require grad" (the per-document path keeps its graph).
    seg = torch.full((2, 4), -1)
    m = fm.tree(seg, torch.full((2, 1), -1))
    q, k, v = (torch.randn(2, 2, 4, 8, requires_grad=True) for _ in range(3))
    out = flexpack.attention(q, k, v, m)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    for x in (q, k, v):
        assert torch.equal(x.grad, torch.zeros_like(x))
