"""Families whose forward never reaches flexpack's attention or mask function, and layers whose
``is_causal`` disagrees with the mask their model builds.

``packed_forward_kwargs(batch, model=model)`` adapts pure SSMs (Mamba) and refuses models whose
attention is their own code (GPT-1); a config with
``use_bidirectional_attention=True`` whose model still builds a causal mask (PaliGemma's Gemma,
Gemma) runs causal, as on eager. References: each document alone under ``eager``.
"""

from __future__ import annotations

import pytest
import torch

import flexpack

transformers = pytest.importorskip("transformers")

import _zoo  # noqa: E402

from flexpack import mixers  # noqa: E402
from flexpack.integrations import _mixers_check  # noqa: E402
from flexpack.integrations.transformers import packed_forward_kwargs  # noqa: E402

transformers.logging.set_verbosity_error()


def _worst(model, reference, kwargs, batch) -> float:
    with torch.no_grad():
        packed = model(**kwargs).logits[0]
        return max(
            (packed[a:b] - reference(input_ids=batch.input_ids[:, a:b], use_cache=False).logits[0])
            .abs()
            .max()
            .item()
            for a, b in _zoo._spans(batch.doc_ids[0])
        )


def _batch(model):
    return flexpack.pack_sequences(_zoo.samples(model.config.get_text_config().vocab_size), 40)


def test_an_unadapted_mamba_is_refused_and_model_kwarg_adapts_it():
    """The mixers' exact "mamba" kind matches adapted modules only: the refused "mamba" kind of
    the same name still names a Mamba mixer nobody adapted."""
    model, reference = _zoo.build("mamba")
    with pytest.raises(ValueError, match=r"mamba \(MambaMixer at `backbone\.layers\.0\.mixer"):
        _mixers_check.check(model)
    batch = _batch(model)
    assert _worst(model, reference, packed_forward_kwargs(batch), batch) > 1e-2  # never reached
    assert _worst(model, reference, packed_forward_kwargs(batch, model=model), batch) < 1e-4
    assert mixers.is_adapted(model.backbone.layers[0].mixer)
    _mixers_check.check(model)  # adapted: nothing refused
    mixers.restore(model)
    with pytest.raises(ValueError, match="mamba"):
        _mixers_check.check(model)


def test_model_kwarg_refuses_a_model_with_its_own_attention():
    model, _ = _zoo.build("openai-gpt")
    with pytest.raises(ValueError, match="own_attention"):
        packed_forward_kwargs(_batch(model), model=model)


def test_the_loss_helper_prepares_the_model_a_collator_never_saw():
    """A Trainer batch is made without the model (a collator's ``packed_forward_kwargs(batch)``);
    packed_causal_lm_loss knows the model, so it adapts a Mamba and refuses GPT-1 itself."""
    from flexpack.integrations.transformers import packed_causal_lm_loss

    model, reference = _zoo.build("mamba")
    batch = _batch(model)
    kwargs = packed_forward_kwargs(batch, labels=True)  # no model=: what a collator makes
    got = packed_causal_lm_loss(model, kwargs)
    assert mixers.is_adapted(model.backbone.layers[0].mixer)
    with torch.no_grad():
        alone = torch.cat(
            [reference(input_ids=batch.input_ids[:, a:b], use_cache=False).logits[0]
             for a, b in _zoo._spans(batch.doc_ids[0])]
        )  # fmt: skip
    real = batch.doc_ids[0] >= 0
    want = flexpack.packed_cross_entropy(alone[None], batch.labels[:, real], batch.doc_ids[:, real])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    gpt, _ = _zoo.build("openai-gpt")
    with pytest.raises(ValueError, match="own_attention"):
        packed_causal_lm_loss(gpt, packed_forward_kwargs(_batch(gpt), labels=True))


@pytest.mark.parametrize("model_type", ["mamba", "lfm2"])
def test_the_loss_helper_reads_this_calls_documents_not_the_last_forwards(model_type):
    """packed_causal_lm_loss runs the backbone alone; its mixers must see this call's documents,
    not those the model's own forward saw last (another layout)."""
    from flexpack.integrations.transformers import packed_causal_lm_loss

    model, _ = _zoo.build(model_type)
    batch = _batch(model)
    other = flexpack.pack_sequences([batch.input_ids[0, :5], batch.input_ids[0, 5:37]], 40)
    model(**packed_forward_kwargs(other, model=model))  # the last forward: another layout
    got = packed_causal_lm_loss(model, packed_forward_kwargs(batch, labels=True))
    with torch.no_grad():
        logits = model(**packed_forward_kwargs(batch, model=model)).logits
    want = flexpack.packed_cross_entropy(logits, batch.labels, batch.doc_ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_paligemma_without_token_types_is_causal_as_on_eager():
    """PaliGemma's text config has use_bidirectional_attention=True (its layers' is_causal is
    False) but, without token_type_ids, the model builds a causal mask; packed rows follow it."""
    model, reference = _zoo.build("paligemma")
    assert model.config.text_config.use_bidirectional_attention
    batch = _batch(model)
    assert _worst(model, reference, packed_forward_kwargs(batch), batch) < 1e-4


def test_bidirectional_flag_with_a_causal_mask_runs_causal():
    """Gemma's layers read is_causal = not use_bidirectional_attention, but GemmaModel builds a
    causal mask all the same; eager follows the mask, and so does flexpack."""
    from transformers import GemmaConfig, GemmaForCausalLM

    from flexpack.integrations.transformers import register

    config = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  use_bidirectional_attention=True)  # fmt: skip
    torch.manual_seed(0)
    reference = GemmaForCausalLM(GemmaConfig(**config, attn_implementation="eager")).eval()
    model = GemmaForCausalLM(GemmaConfig(**config, attn_implementation=register())).eval()
    model.load_state_dict(reference.state_dict())
    assert not model.model.layers[0].self_attn.is_causal
    batch = _batch(model)
    assert _worst(model, reference, packed_forward_kwargs(batch), batch) < 1e-4


def test_gemma3_bidirectional_refusal_names_the_flag_not_a_window():
    transformers = pytest.importorskip("transformers")
    from flexpack.integrations.transformers import packed_forward_kwargs, register

    config = transformers.Gemma3TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
        use_bidirectional_attention=True, attn_implementation=register(),
    )  # fmt: skip
    model = transformers.Gemma3ForCausalLM(config).eval()
    batch = flexpack.pack_sequences([[1, 2, 3], [4, 5]], max_len=8)
    with pytest.raises(ValueError, match="use_bidirectional_attention=True") as e:
        model(**packed_forward_kwargs(batch))
    assert "(3)" not in str(e.value)


def test_adapt_fails_closed_on_a_mixer_no_room_recognises(monkeypatch):
    """transformers 5.25 moved the seam the rooms read (kernel functions became module
    instances): every room then matched nothing and adapt() returned a leaking Mamba. A stateful
    mixer that no room takes is refused, naming the module and the transformers versions."""
    from flexpack.mixers import ssm

    model, _ = _zoo.build("mamba")
    blind = tuple(r for r in mixers.ROOMS if r is not ssm.MAMBA)
    monkeypatch.setattr(mixers, "ROOMS", blind)  # the Mamba room no longer recognises it
    with pytest.raises(ValueError) as err:
        mixers.adapt(model)
    words = str(err.value)
    assert "MambaMixer at `backbone.layers.0.mixer`" in words
    assert f"transformers {transformers.__version__}" in words
    assert "verified on transformers 5.17.0 to 5.25.0" in words
    assert not mixers.is_adapted(model.backbone.layers[0].mixer)  # left as it was
    monkeypatch.undo()
    assert mixers.adapt(model) is model and mixers.is_adapted(model.backbone.layers[0].mixer)


def test_rooms_recognise_hub_functions_behind_module_wrappers():
    """5.25 with the kernels package wraps each kernel-mapped function in an nn.Module and
    reaches causal_conv1d_fn through causal_conv1d_forward: both wrappers are looked through."""
    from flexpack.mixers._room import hub_functions

    model, _ = _zoo.build("mamba")
    names = set(hub_functions(model.backbone.layers[0].mixer))
    assert {"causal_conv1d_fn", "mamba_selective_scan"} <= names
