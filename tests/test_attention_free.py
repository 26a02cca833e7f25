"""Models without attention (RWKV, Mamba, Mamba2, Falcon-Mamba, xLSTM) on packed rows.

Their token mixers are recurrences flexpack.mixers adapts, so the attention implementation they
were loaded with (eager) says nothing about packing: ``packed_forward_kwargs(batch, model=...)``
does not warn that "documents would attend to each other", and each document of the packed row
gets the logits it gets alone. A model with attention loaded eager still warns. References are
the tiny models run on each document alone, before flexpack adapted them.
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flexpack  # noqa: E402
from flexpack.integrations._mixers_check import has_attention  # noqa: E402
from flexpack.integrations._tiny import tiny_config  # noqa: E402
from flexpack.integrations.transformers import packed_forward_kwargs  # noqa: E402

ATTENTION_FREE = {"rwkv": "RwkvConfig", "mamba": "MambaConfig", "mamba2": "Mamba2Config",
                  "falcon_mamba": "FalconMambaConfig", "xlstm": "xLSTMConfig"}  # fmt: skip
# plain attention, attention beside Mamba layers, attention written out in the model's code
WITH_ATTENTION = {"llama": "LlamaConfig", "jamba": "JambaConfig", "openai-gpt": "OpenAIGPTConfig"}


def tiny(config_name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_config(getattr(transformers, config_name)(), "eager")
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def documents() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 60, (n,), generator=g) for n in (11, 14, 9)]


@pytest.mark.parametrize("kind", sorted(ATTENTION_FREE))
def test_attention_free_eager_model_packs_without_a_warning_as_each_document_alone(kind):
    """Three documents and padding in one row of an eager-loaded model without attention: no
    warning at all (warnings are errors here), each document's logits equal it run alone."""
    model = tiny(ATTENTION_FREE[kind])
    assert model.config._attn_implementation == "eager" and not has_attention(model)
    docs = documents()
    with torch.no_grad():
        alone = [model(input_ids=d[None], use_cache=False).logits[0] for d in docs]
    batch = flexpack.pack_sequences(docs, max_len=40, strategy="greedy")  # 34 tokens, 6 padding
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        packed = model(**packed_forward_kwargs(batch, model=model)).logits[0]
    start = 0
    for d, want in zip(docs, alone, strict=True):
        torch.testing.assert_close(packed[start : start + len(d)], want, atol=1e-5, rtol=0)
        start += len(d)


def test_eager_model_with_attention_still_warns():
    """Llama loaded eager ignores doc_ids: packing for it warns that its documents would attend
    to each other."""
    model = tiny("LlamaConfig")
    batch = flexpack.pack_sequences(documents(), max_len=40, strategy="greedy")
    with pytest.warns(UserWarning, match="attend to each other"):
        packed_forward_kwargs(batch, model=model)


@pytest.mark.parametrize(
    "kind, attends", [(k, False) for k in ATTENTION_FREE] + [(k, True) for k in WITH_ATTENTION]
)
def test_has_attention_tells_recurrences_from_attention(kind, attends):
    """RWKV's RwkvSelfAttention is a recurrence (no attention); a hybrid's attention layers and
    GPT-1's attention written out in its own code are attention."""
    config = {**ATTENTION_FREE, **WITH_ATTENTION}[kind]
    assert has_attention(tiny(config)) is attends


@pytest.mark.parametrize("one_pass", [True, False], ids=["one pass", "per group"])
def test_xlstm_with_its_default_cache_warns_and_each_document_is_exact(one_pass, monkeypatch):
    """xLSTM's model makes a cache when ``use_cache`` is left at its default and copies the
    state each layer returns into it: on packed rows flexpack warns that the cache gets no
    state (naming the layer), hands the model an empty one, and each document's logits equal
    it run alone, by the one pass and by the per-group calls (a class that failed its
    self-check). Before: transformers' ``TypeError: 'NoneType' object is not subscriptable``."""
    from flexpack.mixers import xlstm

    model = tiny(ATTENTION_FREE["xlstm"])
    docs = documents()
    with torch.no_grad():
        alone = [model(input_ids=d[None], use_cache=False).logits[0] for d in docs]
    batch = flexpack.pack_sequences(docs, max_len=40, strategy="greedy")
    kwargs = packed_forward_kwargs(batch, model=model)
    del kwargs["use_cache"]  # the model's default: a cache
    assert model.config.use_cache
    if not one_pass:
        layer_type = type(model.backbone.blocks[0].mlstm_layer)
        monkeypatch.setitem(xlstm.MLSTM.one_pass.verified, layer_type, False)
    with pytest.warns(UserWarning, match="xLSTMLayer got packed rows .* with a cache"):
        with torch.no_grad():
            out = model(**kwargs)
    start = 0
    for d, want in zip(docs, alone, strict=True):
        torch.testing.assert_close(out.logits[0, start : start + len(d)], want, atol=1e-5, rtol=0)
        start += len(d)
    for C, n, m in out.cache.rnn_state.values():  # the cache kept no row's state
        assert not (C.any() or n.any() or m.any())


@pytest.mark.parametrize("kind", ["rwkv", "xlstm", "mamba2"])
def test_adapted_attention_free_model_on_flattened_rows_equals_each_document_alone(kind):
    """transformers' own padding-free rows (``DataCollatorWithFlattening``: position_ids only,
    what HF ``Trainer`` and TRL's ``SFTTrainer(packing=True)`` feed): a model without attention
    reads them once ``flexpack.mixers.adapt(model)`` has run, whatever its
    ``attn_implementation`` (``register()`` alone reaches nothing of its forward: no attention
    or mask function is called; docs/mixers.md says to adapt it), and each document's logits
    and the loss equal the documents' own."""
    import flexpack.mixers as fm
    from flexpack.integrations.transformers import register

    torch.manual_seed(0)
    config = tiny_config(getattr(transformers, ATTENTION_FREE[kind])(), register())
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    docs = documents()
    with torch.no_grad():
        alone = [model(input_ids=d[None], labels=d[None], use_cache=False) for d in docs]
    collate = transformers.DataCollatorWithFlattening()
    rows = collate([{"input_ids": d.tolist()} for d in docs])
    assert sorted(rows) == ["input_ids", "labels", "position_ids"]
    fm.adapt(model)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        packed = model(**rows, use_cache=False)
    start = 0
    for d, want in zip(docs, alone, strict=True):
        got = packed.logits[0, start : start + len(d)]
        torch.testing.assert_close(got, want.logits[0], atol=1e-5, rtol=0)
        start += len(d)
    supervised = [len(d) - 1 for d in docs]
    mean = sum(a.loss * n for a, n in zip(alone, supervised, strict=True)) / sum(supervised)
    torch.testing.assert_close(packed.loss, mean, atol=1e-5, rtol=0)


@pytest.mark.parametrize("source", ["doc_ids", "position_ids"])
def test_xlstm_cutting_packed_rows_into_inference_chunks_is_refused(source):
    """In eval, xLSTM's model cuts rows longer than config.max_inference_chunksize into pieces
    carried through a cache: its layers cannot see where a piece's documents start, so packed
    rows longer than that are refused by name (position_ids alone ran the documents together;
    doc_ids raised about their shape)."""
    model = tiny(ATTENTION_FREE["xlstm"])
    model.config.max_inference_chunksize = 16
    batch = flexpack.pack_sequences(documents(), max_len=40, strategy="greedy")
    kwargs = packed_forward_kwargs(batch, model=model)
    if source == "position_ids":
        kwargs = {k: kwargs[k] for k in ("input_ids", "position_ids", "use_cache") if k in kwargs}
    with pytest.raises(ValueError, match="max_inference_chunksize"), torch.no_grad():
        model(**kwargs)
    model.config.max_inference_chunksize = 64  # above the row: exact again
    with torch.no_grad():
        model(**packed_forward_kwargs(batch, model=model))
