"""transformers integration: a randomly initialised Llama on flexpack rows equals it per document.

The model is built from a small config (no download) with ``attn_implementation="flexpack"``; the
reference is the same weights under transformers' own ``sdpa`` implementation, one document at a
time, unpadded.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from _rows import documents
from _rows import qkv as _qkv

import flexpack
from flexpack import masks as fm
from flexpack.testing.references import reference_attention

transformers = pytest.importorskip("transformers")

from flexpack.integrations.transformers import (  # noqa: E402
    flexpack_attention_forward,
    packed_forward_kwargs,
    register,
)

MAX_LEN = 64
ATOL = 1e-5


def llama(seed: int = 0, **overrides):
    name = register()
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LEN,
        initializer_range=0.2,  # large enough that a leak between documents shows
        attn_implementation=name,
        **overrides,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    return model, reference


def samples(seed: int, n: int = 10) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, MAX_LEN + 1, (n,), generator=g).tolist()
    return [torch.randint(0, 256, (length,), generator=g) for length in lengths]


def alone(reference, tokens: torch.Tensor) -> torch.Tensor:
    return reference(input_ids=tokens[None], use_cache=False).logits[0]  # (L, V)


@pytest.mark.parametrize("seed", [0, 1])
def test_llama_on_packed_rows_matches_each_document_alone(seed):
    model, reference = llama(seed)
    batch = flexpack.pack_sequences(samples(seed), MAX_LEN)
    docs = documents(batch.doc_ids)
    assert len(docs) > batch.input_ids.shape[0], "test needs rows holding several documents"
    with torch.no_grad():
        packed = model(**packed_forward_kwargs(batch)).logits  # (R, S, V)
        for r, a, b in docs:
            want = alone(reference, batch.input_ids[r, a:b])
            torch.testing.assert_close(packed[r, a:b], want, atol=ATOL, rtol=0)
        # Negative control: the same rows through plain causal attention (no document ids,
        # positions 0..S-1) leak between documents.
        leaky = model(input_ids=batch.input_ids, use_cache=False).logits
    gap = max(
        (leaky[r, a:b] - alone(reference, batch.input_ids[r, a:b])).abs().max() for r, a, b in docs
    )
    assert gap > 1000 * ATOL


def test_packed_rows_stay_exact_with_a_cache_or_a_padding_mask():
    """transformers 5.x drops its own packed-sequence mask when use_cache is on (the config
    default) or an attention_mask is passed; flexpack reads doc_ids, so neither matters."""
    model, reference = llama(6)
    batch = flexpack.pack_sequences(samples(6), MAX_LEN)
    kwargs = packed_forward_kwargs(batch)
    del kwargs["use_cache"]
    with torch.no_grad():
        with_cache = model(**kwargs).logits
        padded = model(**kwargs, attention_mask=(batch.doc_ids >= 0).long()).logits
        for r, a, b in documents(batch.doc_ids):
            want = alone(reference, batch.input_ids[r, a:b])
            torch.testing.assert_close(with_cache[r, a:b], want, atol=ATOL, rtol=0)
            torch.testing.assert_close(padded[r, a:b], want, atol=ATOL, rtol=0)


def test_mistral_sliding_window_on_packed_rows():
    """A model that passes sliding_window gets document & causal & window (window 8 < documents)."""
    config = transformers.MistralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=8,
        initializer_range=0.2,
        attn_implementation=register(),
    )
    torch.manual_seed(7)
    model = transformers.MistralForCausalLM(config).eval()
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    batch = flexpack.pack_sequences(samples(7), MAX_LEN)
    docs = documents(batch.doc_ids)
    assert max(b - a for _, a, b in docs) > 2 * config.sliding_window
    with torch.no_grad():
        packed = model(**packed_forward_kwargs(batch)).logits
        for r, a, b in docs:
            want = alone(reference, batch.input_ids[r, a:b])
            torch.testing.assert_close(packed[r, a:b], want, atol=ATOL, rtol=0)


def test_hf_loss_and_gradients_match_unpacked():
    model, reference = llama(2)
    model.train()
    reference.train()
    batch = flexpack.pack_sequences(samples(2), MAX_LEN)
    docs = documents(batch.doc_ids)
    loss = model(**packed_forward_kwargs(batch, labels=True)).loss  # mean over supervised tokens
    total, count = 0.0, 0
    for r, a, b in docs:
        tokens = batch.input_ids[r, a:b][None]
        out = reference(input_ids=tokens, labels=tokens, use_cache=False)
        total = total + out.loss * (b - a - 1) if b - a > 1 else total
        count += b - a - 1
    want = total / count
    torch.testing.assert_close(loss, want, atol=ATOL, rtol=0)
    loss.backward()
    want.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=ATOL, rtol=1e-4, msg=f"grad of {name}")


def test_data_collator_with_flattening_batches_work():
    """Without doc_ids, documents come from position_ids (transformers' packed-sequence rule)."""
    model, reference = llama(3)
    seqs = samples(3, n=5)
    collate = transformers.DataCollatorWithFlattening(return_tensors="pt")
    features = collate([{"input_ids": s.tolist()} for s in seqs])  # one (1, T) row
    with torch.no_grad():
        packed = model(
            input_ids=features["input_ids"],
            position_ids=features["position_ids"],
            use_cache=False,
        ).logits[0]
        start = 0
        for s in seqs:
            want = alone(reference, s)
            torch.testing.assert_close(packed[start : start + len(s)], want, atol=ATOL, rtol=0)
            start += len(s)


def test_left_padded_batch_with_attention_mask():
    model, reference = llama(4)
    seqs = samples(4, n=3)
    S = max(len(s) for s in seqs)
    input_ids = torch.zeros(len(seqs), S, dtype=torch.long)
    attention_mask = torch.zeros(len(seqs), S, dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, S - len(s) :] = s
        attention_mask[i, S - len(s) :] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        ).logits
        for i, s in enumerate(seqs):
            torch.testing.assert_close(out[i, S - len(s) :], alone(reference, s), atol=ATOL, rtol=0)


def test_clear_errors():
    model, _ = llama(5)
    q = torch.randn(1, 4, 1, 16)
    k = v = torch.randn(1, 2, 5, 16)
    attn = model.model.layers[0].self_attn
    with pytest.raises(ValueError, match="KV cache"):  # a cache (generation) with a row mask
        flexpack_attention_forward(attn, q, k, v, None, flexpack_mask=object())
    q = torch.randn(1, 4, 5, 16)
    with pytest.raises(ValueError, match="doc_ids must be"):
        flexpack_attention_forward(
            attn, q, k, v, None, doc_ids=torch.zeros(1, 4, dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="position_bias"):
        flexpack_attention_forward(attn, q, k, v, None, position_bias=torch.zeros(4))
    with pytest.raises(TypeError, match="PackedBatch"):
        packed_forward_kwargs({"input_ids": q})
    assert register() == "flexpack"
    assert "flexpack" in transformers.AttentionInterface._global_mapping


@pytest.mark.parametrize("big", [2**31, 2**32])
def test_transformers_forward_keeps_int64_doc_ids(big):
    # _doc_ids cast to int32: 2**32 merged with document 0, 2**31 wrapped negative (padding).
    from flexpack.integrations.transformers import flexpack_attention_forward

    d = torch.tensor([[0, 0, big, big, big, 1]])  # (an id in two runs is refused: 1, not 0)
    q, k, v = _qkv(1, 6)
    out, _ = flexpack_attention_forward(torch.nn.Module(), q, k, v, None, doc_ids=d)
    ref = reference_attention(q, k, v, fm.document(d) & fm.causal())
    torch.testing.assert_close(out.transpose(1, 2), ref)


def test_gpt2_dropout_refusal_names_attn_pdrop():
    transformers = pytest.importorskip("transformers")
    from flexpack.integrations.transformers import packed_forward_kwargs, register

    config = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=16, attn_pdrop=0.1,
        attn_implementation=register(),
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).train()
    batch = flexpack.pack_sequences([[1, 2, 3], [4, 5]], max_len=8)
    with pytest.raises(ValueError, match=r"set the config's attn_pdrop to 0\.0"):
        model(**packed_forward_kwargs(batch))


def test_mask_cache_keeps_one_mask_per_causal_and_window(monkeypatch):
    """Alternating sliding and full layers (Gemma, Mistral-style) build each mask once."""
    from flexpack.integrations import transformers as hf

    built = []
    real = hf._build_mask
    monkeypatch.setattr(hf, "_build_mask", lambda *a: built.append(a[1:]) or real(*a))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]])
    layers = [(True, None), (True, 4), (True, None), (True, 4), (False, None)]
    got = [hf._mask_for(pos.device, 1, 8, None, None, None, pos, c, w) for c, w in layers * 2]
    assert built == [(True, None), (True, 4), (False, None)]
    assert got[0] is got[2] is got[5] and got[1] is got[3] and got[0] is not got[1]
    pos.add_(0)  # an in-place edit (new version) invalidates the cache
    hf._mask_for(pos.device, 1, 8, None, None, None, pos, True, None)
    assert len(built) == 4


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    from flexpack.integrations.transformers import register

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        attn_implementation=register(),
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_transformers_position_ids_written_through_numpy_are_seen():
    model = _tiny_llama()
    input_ids = torch.arange(1, 9)[None]
    first, second = np.array([[0, 1, 2, 3, 4, 5, 6, 7]]), np.array([[0, 1, 2, 0, 1, 2, 3, 4]])
    buf = first.copy()
    pos = torch.from_numpy(buf)
    with torch.no_grad():
        model(input_ids, position_ids=pos)
        buf[:] = second
        got = model(input_ids, position_ids=pos).logits
        want = model(input_ids, position_ids=torch.from_numpy(second.copy())).logits
        pos.data[:] = torch.from_numpy(first)
        got_first = model(input_ids, position_ids=pos).logits
        want_first = model(input_ids, position_ids=torch.from_numpy(first.copy())).logits
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_first, want_first)


def test_transformers_forward_and_generate_under_inference_mode():
    model = _tiny_llama()
    input_ids = torch.arange(1, 9)[None]
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    with torch.no_grad():
        want = model(input_ids, position_ids=pos).logits
        want_gen = model.generate(input_ids[:, :3], max_new_tokens=3, do_sample=False)
    with torch.inference_mode():
        got = model(input_ids, position_ids=pos).logits
        got_gen = model.generate(input_ids[:, :3], max_new_tokens=3, do_sample=False)
    torch.testing.assert_close(got, want)
    assert torch.equal(got_gen, want_gen)


def test_packed_forward_kwargs_given_a_model_warns_without_flexpack_attention():
    transformers = pytest.importorskip("transformers")
    import warnings

    from flexpack.integrations.transformers import packed_forward_kwargs

    batch = flexpack.pack_sequences([[1, 2, 3], [4, 5]], max_len=8)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, attn_implementation="sdpa",
    )  # fmt: skip
    sdpa = transformers.LlamaForCausalLM(config)
    with pytest.warns(UserWarning, match="packed_forward_kwargs: .*'sdpa'.*attend to each other"):
        packed_forward_kwargs(batch, model=sdpa)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        packed_forward_kwargs(batch, model=_tiny_llama())
        packed_forward_kwargs(batch)  # no model: nothing to check
