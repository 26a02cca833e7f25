"""transformers integration: attention sinks, MLA head dims and chunked attention on packed rows.

Each variant against a per-document reference: transformers' own eager attention (gpt-oss's
sink formula) on each document alone, the tiny models of tests/_zoo.py run per document, and
greedy ``generate()`` with a KV cache against the same model under ``eager``. Trees (a prompt
shared by rollouts) against each rollout alone.
"""

from __future__ import annotations

import pytest
import torch

import flexpack

transformers = pytest.importorskip("transformers")

import _zoo  # noqa: E402

from flexpack._attention_sinks import dense_sink_attention, sink_attention  # noqa: E402
from flexpack.integrations.transformers import (  # noqa: E402
    flexpack_attention_forward,
    packed_forward_kwargs,
)

transformers.logging.set_verbosity_error()


class _Attn(torch.nn.Module):
    is_causal = True

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.training = False


def _eager_sinks(q, k, v, sinks, scale, window=None):
    """gpt-oss's own eager attention on one document (transformers' formula)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    L = q.shape[2]
    i = torch.arange(L)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed &= i[:, None] - i[None, :] < window
    bias = torch.zeros(L, L).masked_fill(~allowed, float("-inf"))[None, None]
    module = _Attn(q.shape[1] // k.shape[1])
    module.sinks = sinks
    out, _ = eager_attention_forward(module, q, k, v, bias, scaling=scale, dropout=0.0)
    return out  # (1, L, Hq, D)


@pytest.mark.parametrize("window", [None, 3])
def test_sinks_equal_gpt_oss_eager_per_document(window):
    g = torch.Generator().manual_seed(0)
    doc_ids = torch.tensor([[0] * 7 + [1] * 5 + [2] * 6 + [-1] * 2, [0] * 20])
    B, S, Hq, Hkv, D = 2, 20, 4, 2, 8
    q = torch.randn(B, Hq, S, D, generator=g, requires_grad=True)
    k = torch.randn(B, Hkv, S, D, generator=g, requires_grad=True)
    v = torch.randn(B, Hkv, S, D, generator=g, requires_grad=True)
    sinks = torch.randn(Hq, generator=g, requires_grad=True)
    out, _ = flexpack_attention_forward(
        _Attn(2), q, k, v, None, scaling=0.3, s_aux=sinks, doc_ids=doc_ids,
        sliding_window=window,
    )  # fmt: skip
    w = torch.randn(out.shape, generator=g)
    (out * w).sum().backward()
    got = [x.grad.clone() for x in (q, k, v, sinks)]
    for x in (q, k, v, sinks):
        x.grad = None
    total = 0.0
    for r, a, b in _zoo_docs(doc_ids):
        want = _eager_sinks(q[r : r + 1, :, a:b], k[r : r + 1, :, a:b], v[r : r + 1, :, a:b],
                            sinks, 0.3, window)  # fmt: skip
        torch.testing.assert_close(out[r : r + 1, a:b], want, atol=1e-5, rtol=0)
        total = total + (want * w[r : r + 1, a:b]).sum()
    assert out[0, -2:].abs().max() == 0  # padding gives 0
    total.backward()
    for name, a, x in zip("qkvs", got, (q, k, v, sinks), strict=True):
        torch.testing.assert_close(a, x.grad, atol=1e-5, rtol=1e-4, msg=f"grad of {name}")


def _zoo_docs(doc_ids):
    out = []
    for r in range(doc_ids.shape[0]):
        out += [(r, a, b) for a, b in _zoo._spans(doc_ids[r])]
    return out


@pytest.mark.compile
def test_sinks_through_flex_lse_equal_the_dense_path():
    """The flex path: out * sigmoid(lse - sink) (compiled flex on CPU, no grad)."""
    g = torch.Generator().manual_seed(1)
    doc_ids = torch.tensor([[0] * 50 + [1] * 40 + [2] * 38])  # 128: one flex block
    q, k, v = (torch.randn(1, 2, 128, 16, generator=g) for _ in range(3))
    sinks = torch.randn(2, generator=g)
    mask = flexpack.masks.document(doc_ids) & flexpack.masks.causal()
    with torch.no_grad():
        flex = sink_attention(q, k, v, mask, sinks, scale=None, enable_gqa=False, backend="flex")
        dense = sink_attention(q, k, v, mask, sinks, scale=None, enable_gqa=False, backend="sdpa")
    torch.testing.assert_close(flex, dense, atol=2e-5, rtol=0)


def test_dense_sinks_give_zero_on_rows_without_keys():
    q = k = v = torch.randn(1, 2, 3, 4)
    allowed = torch.zeros(1, 1, 3, 3, dtype=torch.bool)
    out = dense_sink_attention(q, k, v, allowed, torch.zeros(2), scale=None)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize(
    "model_type",
    ["gpt_oss", "deepseek_v3", "llama4_text"],  # sinks (+ sliding), MLA, chunked (+ full)
)
def test_variant_models_train_exactly(model_type):
    """Logits and every weight's gradient equal the documents run alone."""
    model, reference = _zoo.build(model_type)
    model.train()
    reference.train()
    batch = flexpack.pack_sequences(_zoo.samples(128), _zoo.MAX_LEN)
    w = torch.randn(_zoo.MAX_LEN, 128, generator=torch.Generator().manual_seed(1))
    logits = model(**packed_forward_kwargs(batch)).logits[0]
    loss, want = 0.0, 0.0
    for a, b in _zoo._spans(batch.doc_ids[0]):
        alone = reference(input_ids=batch.input_ids[:, a:b], use_cache=False).logits[0]
        torch.testing.assert_close(logits[a:b], alone, atol=1e-4, rtol=0)
        loss = loss + (logits[a:b] * w[a:b]).sum()
        want = want + (alone * w[a:b]).sum()
    loss.backward()
    want.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        if p.grad is None and q.grad is None:
            continue
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=f"grad of {name}")


@pytest.mark.parametrize("model_type", ["gpt_oss", "deepseek_v3", "llama4_text"])
def test_greedy_generate_matches_eager(model_type):
    """generate() with a KV cache, left-padded prompts longer than windows and chunks."""
    model, reference = _zoo.build(model_type)
    for m in (model, reference):
        m.generation_config.pad_token_id = 0
        m.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(2)
    lengths = (9, 6)
    S = max(lengths)
    ids = torch.zeros(len(lengths), S, dtype=torch.long)
    mask = torch.zeros(len(lengths), S, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, S - n :] = torch.randint(3, 100, (n,), generator=g)
        mask[i, S - n :] = 1
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
              return_dict_in_generate=True)  # fmt: skip
    with torch.no_grad():
        got = model.generate(ids, **kw)
        want = reference.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_gpt_oss_on_a_tree_equals_each_rollout_alone():
    """A prompt shared by rollouts (flexpack.pack_trees) on gpt-oss: sinks and sliding layers
    (window 4, shorter than the rollouts) on the tree mask."""
    model, reference = _zoo.build("gpt_oss")
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 100, (7,), generator=g).tolist()
    completions = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (5, 2, 6)]
    batch = flexpack.pack_trees([(prompt, completions)], max_len=32)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            logits = model(
                input_ids=batch.input_ids, position_ids=batch.position_ids,
                flexpack_mask=batch.mask(), use_cache=False,
            ).logits  # fmt: skip
        logps, _ = batch.gather_logps(logits.detach())
        for n, c in enumerate(completions):
            ids = torch.tensor([prompt + c])
            with torch.no_grad():
                alone = reference(input_ids=ids, use_cache=False).logits.log_softmax(-1)[0]
            want = alone[len(prompt) - 1 : -1].gather(-1, ids[0, len(prompt) :, None])[:, 0]
            torch.testing.assert_close(logps[n, : len(c)], want, atol=1e-5, rtol=0)


def test_chunks_count_from_each_document_start():
    """A document starting mid-chunk of the row still gets its own chunks (Llama 4)."""
    from flexpack.integrations.transformers import _chunk_ids

    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, -1]])
    assert _chunk_ids(ids, 2).tolist()[0][:3] == [0, 0, 1]
    pieces = _chunk_ids(ids, 2)[0].tolist()
    assert pieces[3] == pieces[4] != pieces[5] == pieces[6] != pieces[7] and pieces[8] == -1


def _token_types(batch):
    tt = torch.zeros_like(batch.input_ids)
    for a, _ in _zoo._spans(batch.doc_ids[0]):
        tt[0, a + 2 : a + 7] = 1  # an image block (Gemma 3) / prefix tokens (PaliGemma)
    return tt


@pytest.mark.parametrize("model_type", ["gemma3", "paligemma"])
def test_token_type_rules_compose_with_the_documents(model_type):
    """transformers' own token-type rule (Gemma 3 image blocks attend both ways, PaliGemma's
    prefix is bidirectional) & the document mask, in a plain call with grad."""
    model, reference = _zoo.build(model_type)
    batch = flexpack.pack_sequences(_zoo.samples(128), _zoo.MAX_LEN)
    tt = _token_types(batch)
    logits = model(**packed_forward_kwargs(batch), token_type_ids=tt).logits[0]
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(4))
    loss, want = (logits * w).sum() * 0, 0.0
    for a, b in _zoo._spans(batch.doc_ids[0]):
        alone = reference(input_ids=batch.input_ids[:, a:b], token_type_ids=tt[:, a:b],
                          use_cache=False).logits[0]  # fmt: skip
        causal = reference(input_ids=batch.input_ids[:, a:b], use_cache=False).logits[0]
        assert (alone - causal).abs().max() > 1e-2  # the rule matters here
        torch.testing.assert_close(logits[a:b], alone, atol=1e-4, rtol=0)
        loss = loss + (logits[a:b] * w[a:b]).sum()
        want = want + (alone * w[a:b]).sum()
    loss.backward()
    want.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        if p.grad is not None or q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=name)


def test_token_type_rule_in_generate_prefill():
    """generate() with token_type_ids: the prefill composes the rule, decoding uses the cache."""
    model, reference = _zoo.build("gemma3")
    for m in (model, reference):
        m.generation_config.pad_token_id = 0
        m.generation_config.eos_token_id = None
    ids = torch.randint(3, 100, (1, 10), generator=torch.Generator().manual_seed(5))
    tt = torch.zeros_like(ids)
    tt[0, 2:6] = 1
    kw = dict(token_type_ids=tt, max_new_tokens=5, do_sample=False, output_logits=True,
              return_dict_in_generate=True)  # fmt: skip
    with torch.no_grad():
        got = model.generate(ids, **kw)
        want = reference.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
