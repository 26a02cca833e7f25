"""The proof: training the reference GPT on packed rows is training it on the separate samples.

For random packed batches (``flexpack.pack_sequences``), every document's logits equal those of the
same document run alone and unpadded (fp32, atol 1e-5), and one optimizer step on the packed batch
gives the loss, gradients and updated weights of the unpacked samples under the matching reduction.
The negative control drops the document mask (plain causal attention over the packed row, what a
packing collator without a mask gives) and checks that the same comparison fails by a wide margin.
Everything runs on CPU with grad, i.e. through ``flexpack.attention``'s SDPA path; one test runs
compiled flex_attention (``backend="flex"``, no grad) on CPU.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from _rows import documents

import flexpack
from flexpack.models import GPT, GPTConfig

MAX_LEN = 64
ATOL = 1e-5
CFG = GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32)


def random_samples(seed: int, *, n: int = 12, min_len: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, MAX_LEN + 1, (n,), generator=g).tolist()
    lengths[0] = MAX_LEN  # one document fills a whole row
    return [torch.randint(0, CFG.vocab_size, (length,), generator=g) for length in lengths]


def make_model(seed: int, config: GPTConfig = CFG) -> GPT:
    torch.manual_seed(seed)
    model = GPT(config)
    with torch.no_grad():  # larger weights than the 0.02 init, so a leak between documents shows
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    return model


def pack(samples):
    batch = flexpack.pack_sequences(samples, MAX_LEN)
    docs = documents(batch.doc_ids)
    # The packed documents are exactly the samples (a packer bug would void the comparison).
    packed = sorted(tuple(batch.input_ids[r, a:b].tolist()) for r, a, b in docs)
    assert packed == sorted(tuple(s.tolist()) for s in samples)
    assert any(
        sum(1 for r, _, _ in docs if r == row) > 1 for row in range(batch.input_ids.shape[0])
    ), "test needs a row holding several documents"
    return batch, docs


def unpacked_loss(model: GPT, batch, docs, reduction: str) -> torch.Tensor:
    """The objective on the samples run one at a time, unpadded, with the matching reduction."""
    sums, counts = [], []
    for r, a, b in docs:
        tokens = batch.input_ids[r, a:b][None]  # (1, L)
        logits = model(tokens)[0]  # (L, V): plain causal, positions 0..L-1
        sums.append(F.cross_entropy(logits[:-1], tokens[0, 1:], reduction="sum"))
        counts.append(b - a - 1)
    if reduction == "token":  # sum over every supervised token / their number
        return torch.stack(sums).sum() / sum(counts)
    # "document": mean per sample, then mean over the samples that supervise a token
    return torch.stack([s / c for s, c in zip(sums, counts, strict=True) if c > 0]).mean()


def assert_each_document_alone(model: GPT, batch, docs) -> None:
    packed = model(batch.input_ids, position_ids=batch.position_ids, doc_ids=batch.doc_ids)
    for r, a, b in docs:
        alone = model(batch.input_ids[r, a:b][None])[0]  # (L, V), no padding, no mask
        torch.testing.assert_close(packed[r, a:b], alone, atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_logits_equal_each_document_alone(seed):
    """With grad on CPU: flexpack.attention's SDPA path (what training runs)."""
    batch, docs = pack(random_samples(seed))
    assert_each_document_alone(make_model(seed), batch, docs)


@pytest.mark.compile
def test_packed_logits_equal_each_document_alone_flex():
    """Without grad, backend="flex": compiled flex_attention with the BlockMask, on CPU."""
    batch, docs = pack(random_samples(0))
    with torch.no_grad():
        assert_each_document_alone(make_model(0, replace(CFG, attn_backend="flex")), batch, docs)


@pytest.mark.parametrize("reduction", ["token", "document"])
def test_optimizer_step_matches_unpacked(reduction):
    samples = random_samples(3, min_len=1)
    batch, docs = pack(samples)
    model_p = make_model(3)
    model_u = copy.deepcopy(model_p)
    opt_p = torch.optim.SGD(model_p.parameters(), lr=0.5)
    opt_u = torch.optim.SGD(model_u.parameters(), lr=0.5)

    logits = model_p(batch.input_ids, position_ids=batch.position_ids, doc_ids=batch.doc_ids)
    loss_p = flexpack.packed_cross_entropy(logits, batch.labels, batch.doc_ids, reduction=reduction)
    loss_u = unpacked_loss(model_u, batch, docs, reduction)
    torch.testing.assert_close(loss_p, loss_u, atol=ATOL, rtol=0)

    loss_p.backward()
    loss_u.backward()
    for (name, p), u in zip(model_p.named_parameters(), model_u.parameters(), strict=True):
        torch.testing.assert_close(p.grad, u.grad, atol=ATOL, rtol=1e-4, msg=f"grad of {name}")
    opt_p.step()
    opt_u.step()
    for (name, p), u in zip(model_p.named_parameters(), model_u.parameters(), strict=True):
        torch.testing.assert_close(p, u, atol=ATOL, rtol=1e-4, msg=f"{name} after the step")

    # The updated models still agree, and the step moved them (the loss went down).
    logits = model_p(batch.input_ids, position_ids=batch.position_ids, doc_ids=batch.doc_ids)
    after_p = flexpack.packed_cross_entropy(
        logits, batch.labels, batch.doc_ids, reduction=reduction
    )
    after_u = unpacked_loss(model_u, batch, docs, reduction)
    torch.testing.assert_close(after_p, after_u, atol=ATOL, rtol=0)
    assert after_p < loss_p


def test_without_document_mask_the_comparison_fails():
    """Negative control: plain causal attention over the packed row leaks across documents."""
    samples = random_samples(4)
    batch, docs = pack(samples)
    model = make_model(4)
    leaky = model(batch.input_ids, position_ids=batch.position_ids)  # no doc_ids: causal
    masked = model(batch.input_ids, position_ids=batch.position_ids, doc_ids=batch.doc_ids)
    worst_leaky = worst_masked = 0.0
    for r, a, b in docs:
        alone = model(batch.input_ids[r, a:b][None])[0]
        worst_leaky = max(worst_leaky, (leaky[r, a:b] - alone).abs().max().item())
        worst_masked = max(worst_masked, (masked[r, a:b] - alone).abs().max().item())
    assert worst_masked <= ATOL
    assert worst_leaky > 1000 * ATOL, f"the leak should be large, got {worst_leaky:.2e}"

    # The losses differ too, and so do the gradients.
    model_u = copy.deepcopy(model)
    logits = model(batch.input_ids, position_ids=batch.position_ids)
    loss_leaky = flexpack.packed_cross_entropy(logits, batch.labels, batch.doc_ids)
    loss_u = unpacked_loss(model_u, batch, docs, "token")
    assert (loss_leaky - loss_u).abs() > 1000 * ATOL
    loss_leaky.backward()
    loss_u.backward()
    grad_gap = max(
        (p.grad - u.grad).abs().max().item()
        for p, u in zip(model.parameters(), model_u.parameters(), strict=True)
    )
    assert grad_gap > 1000 * ATOL


def test_mask_is_built_once_per_batch(monkeypatch):
    import flexpack.models.gpt as gpt
    from flexpack import masks

    calls, block_masks = [], []
    build = gpt.document
    monkeypatch.setattr(gpt, "document", lambda d: calls.append(d) or build(d))
    real_block_mask = masks.Mask.block_mask
    monkeypatch.setattr(
        masks.Mask, "block_mask", lambda m, **kw: block_masks.append(m) or real_block_mask(m, **kw)
    )
    batch, _ = pack(random_samples(5))
    model = make_model(5)
    out = model(batch.input_ids, doc_ids=batch.doc_ids)  # positions derived from doc_ids
    assert len(calls) == 1 and CFG.n_layer > 1
    assert block_masks == []  # the per-document SDPA path needs no BlockMask: none is built
    prebuilt = flexpack.document_causal_mask(batch.doc_ids)
    out_prebuilt = model(batch.input_ids, position_ids=batch.position_ids, mask=prebuilt)
    torch.testing.assert_close(out, out_prebuilt, atol=ATOL, rtol=0)


def test_flex_path_builds_one_block_mask_per_forward(monkeypatch):
    from torch._dynamo.testing import CompileCounter

    from flexpack import _attention_flex, masks

    monkeypatch.setattr(_attention_flex, "_BACKEND", CompileCounter())  # no inductor: fast
    _attention_flex.compiled_flex_attention.cache_clear()
    built = []
    real_block_mask = masks.Mask.block_mask
    monkeypatch.setattr(
        masks.Mask, "block_mask", lambda m, **kw: built.append(m) or real_block_mask(m, **kw)
    )
    batch, _ = pack(random_samples(6))
    model = make_model(6, replace(CFG, attn_backend="flex"))
    with torch.no_grad():
        out = model(batch.input_ids, doc_ids=batch.doc_ids)
        assert len(built) == 1 and CFG.n_layer > 1
        want = make_model(6)(batch.input_ids, doc_ids=batch.doc_ids)
    _attention_flex.compiled_flex_attention.cache_clear()
    torch.testing.assert_close(out, want, atol=1e-4, rtol=0)


def test_layout_gives_the_same_logits_as_doc_ids():
    batch, _ = pack(random_samples(7))
    model = make_model(7)
    by_ids = model(batch.input_ids, doc_ids=batch.doc_ids)
    by_layout = model(batch.input_ids, layout=batch.layout)
    torch.testing.assert_close(by_layout, by_ids, atol=ATOL, rtol=0)
    with pytest.raises(TypeError, match="PackedLayout"):
        model(batch.input_ids, layout=batch.doc_ids)


def test_bad_inputs_get_clear_errors():
    model = GPT(GPTConfig(n_layer=1, n_embd=32))
    ids = torch.randint(0, 256, (2, 8))
    with pytest.raises(TypeError, match="integer tensor"):
        model(ids.float())
    with pytest.raises(ValueError, match=r"\(B, S\)"):
        model(ids[0])
    with pytest.raises(ValueError, match="doc_ids must have the shape"):
        model(ids, doc_ids=torch.zeros(2, 7, dtype=torch.int32))
    with pytest.raises(ValueError, match="n_kv_head"):
        GPTConfig(n_head=4, n_kv_head=3)


def test_default_positions_match_the_layout():
    batch, _ = pack(random_samples(8))
    from flexpack.models.gpt import _positions_in_documents

    assert torch.equal(_positions_in_documents(batch.doc_ids), batch.position_ids)


def test_default_positions_follow_the_masks_documents():
    """A repeated id is one document to the masks (its runs see each other), so its positions
    continue across runs instead of restarting: the model agrees with its mask (issue 11)."""
    from flexpack.models.gpt import _positions_in_documents

    doc_ids = torch.tensor([[0, 0, 1, 1, 0, 0, -1], [5, 3, 3, 5, 5, 5, 3]])
    want = [[0, 1, 0, 1, 2, 3, 0], [0, 0, 1, 1, 2, 3, 2]]
    assert _positions_in_documents(doc_ids).tolist() == want
