"""transformers integration: generation with a KV cache, and sliding windows on tree masks.

One model object trains packed and generates: under ``attn_implementation="flexpack"``, greedy
``generate()`` (left-padded prompts, a KV cache, sliding-window layers, soft-capping) gives the
tokens and logits of transformers' own ``sdpa`` (``eager`` for soft-capped Gemma 2). A tree mask
passed as ``flexpack_mask`` to a sliding-window model keeps the window, counted in positions
along each path: every rollout's log-probs equal those of the rollout run alone.
"""

from __future__ import annotations

import copy

import pytest
import torch

import flexpack

transformers = pytest.importorskip("transformers")

from flexpack.integrations.transformers import flexpack_attention_forward, register  # noqa: E402

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.2,
)


def build(kind: str, reference: str = "sdpa"):
    if kind == "llama":
        config = transformers.LlamaConfig(**SMALL)
        cls = transformers.LlamaForCausalLM
    elif kind == "mistral":
        config = transformers.MistralConfig(**SMALL, sliding_window=4)
        cls = transformers.MistralForCausalLM
    elif kind == "gemma3":  # per-layer windows and rope bases
        config = transformers.Gemma3TextConfig(
            **SMALL, head_dim=8, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        )  # fmt: skip
        cls = transformers.Gemma3ForCausalLM
    else:
        config = transformers.Gemma2Config(
            **SMALL, head_dim=8, sliding_window=4, attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,
        )  # fmt: skip
        cls = transformers.Gemma2ForCausalLM
    config.pad_token_id = config.eos_token_id = 0
    torch.manual_seed(0)
    ref = cls(config).eval()
    ref.set_attn_implementation(reference)
    model = copy.deepcopy(ref)
    model.set_attn_implementation(register())
    return model, ref


def left_padded(lengths, vocab=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = max(lengths)
    ids = torch.zeros(len(lengths), S, dtype=torch.long)
    mask = torch.zeros(len(lengths), S, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, S - n :] = torch.randint(1, vocab, (n,), generator=g)
        mask[i, S - n :] = 1
    return ids, mask


@pytest.mark.parametrize(
    ("kind", "reference"), [("llama", "sdpa"), ("mistral", "sdpa"), ("gemma2", "eager")]
)
def test_greedy_generate_matches_transformers(kind, reference):
    model, ref = build(kind, reference)
    ids, mask = left_padded([9, 5, 7])  # windows of 4: shorter than every prompt
    kw = dict(
        attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
        return_dict_in_generate=True, pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    with torch.no_grad():
        got = model.generate(ids, **kw)
        want = ref.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_direct_call_with_more_keys_than_queries_is_bottom_right_causal():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 3, 8)
    k, v = torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    pad = torch.ones(2, 7, dtype=torch.bool)
    pad[1, :2] = False  # row 1 is left-padded
    out, _ = flexpack_attention_forward(torch.nn.Module(), q, k, v, pad, sliding_window=5)
    ones = torch.ones(3, 7, dtype=torch.bool)
    allowed = ones.tril(4) & ~ones.tril(-1)  # query i sits at key 4 + i; window 5
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed[None, None] & pad[:, None, None, :], enable_gqa=True
    )
    torch.testing.assert_close(out.transpose(1, 2), want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["mistral", "gemma2", "gemma3"])
def test_tree_mask_keeps_the_sliding_window(kind):
    """Rollouts longer than the window: each path's log-probs equal the rollout run alone."""
    model, ref = build(kind, "eager")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, 96, (7,), generator=g).tolist()
    completions = [torch.randint(1, 96, (n,), generator=g).tolist() for n in (5, 2, 6)]
    batch = flexpack.pack_trees([(prompt, completions), [3, 4, 5, 6, 7, 8]], max_len=32)
    for grad in (True, False):  # training (SDPA per segment) and scoring (no_grad)
        with torch.set_grad_enabled(grad):
            logits = model(
                input_ids=batch.input_ids, position_ids=batch.position_ids,
                flexpack_mask=batch.mask().block_mask(block_size=16), use_cache=False,
            ).logits  # fmt: skip
        logps, valid = batch.gather_logps(logits.detach())
        for n, c in enumerate(completions):
            ids = torch.tensor([prompt + c])
            with torch.no_grad():
                alone = ref(input_ids=ids, use_cache=False).logits.log_softmax(-1)[0]
            want = alone[len(prompt) - 1 : -1].gather(-1, ids[0, len(prompt) :, None])[:, 0]
            torch.testing.assert_close(logps[n, : len(c)], want, atol=1e-5, rtol=0)
        assert valid.sum().item() == sum(map(len, completions))  # the document has none


def test_tree_mask_on_a_window_needs_position_ids():
    model, _ = build("mistral")
    batch = flexpack.pack_trees([([1, 2, 3], [[4], [5]])], max_len=8)
    attn = model.model.layers[0].self_attn
    q = k = v = torch.randn(1, 4, 8, 8)
    with pytest.raises(ValueError, match="position_ids"):
        flexpack_attention_forward(
            attn, q, k, v, None, flexpack_mask=batch.mask(), sliding_window=4
        )


def test_document_flexpack_mask_on_a_window_layer_keeps_the_window():
    """A prebuilt document mask (not a tree) gets document & causal & window, as doc_ids do
    (tests/test_hf_integration.py checks that path against each document alone)."""
    model, _ = build("mistral")
    doc_ids = torch.tensor([[0] * 9 + [1] * 7])
    ids = torch.randint(1, 96, (1, 16), generator=torch.Generator().manual_seed(3))
    pos = torch.cat([torch.arange(9), torch.arange(7)])[None]
    mask = flexpack.masks.document(doc_ids) & flexpack.masks.causal()
    # With grad: the SDPA paths (no flex compile on CPU).
    got = model(input_ids=ids, position_ids=pos, flexpack_mask=mask, use_cache=False).logits
    want = model(input_ids=ids, position_ids=pos, doc_ids=doc_ids, use_cache=False).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
