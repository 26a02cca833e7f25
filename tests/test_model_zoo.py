"""Packed == unpacked on every decoder-only causal LM of the installed transformers, or refused.

For each ``model_type`` in transformers' causal-LM auto mapping (plus the image-text models whose
language model flexpack packs, see ``flexpack.integrations.multimodal``), ``tests/_zoo.py``
builds a tiny model with one layer of each kind it has and runs a packed row of three documents
through ``register()`` + ``packed_forward_kwargs``. Every model must be either exact (each
document's logits equal the document run alone under ``eager``, fp32, 1e-4) or refused with a
ValueError naming what flexpack cannot keep exact; a silent difference or a raw error fails.
Model types whose tiny config cannot be built offline are skipped with the reason.

A full run writes the table to docs/supported_models.md (``FLEXPACK_ZOO_WRITE=0`` turns that
off); the table is generated here, never written by hand.
"""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import _zoo  # noqa: E402

import flexpack  # noqa: E402
from flexpack.integrations import _mixers_check  # noqa: E402
from flexpack.integrations.transformers import packed_forward_kwargs  # noqa: E402

transformers.logging.set_verbosity_error()

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "supported_models.md"


def _decoder_only() -> tuple[list[str], dict[str, str]]:
    """(model types to run, {model type: why it is not a decoder-only LM})."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(_zoo.IMAGE_TEXT))
    run, other = [], {}
    for name in names:
        try:
            config = AutoConfig.for_model(name)
        except Exception:
            run.append(name)  # check() reports why it cannot be built
            continue
        if getattr(config, "is_encoder_decoder", False):
            other[name] = "encoder-decoder (its causal LM is the decoder half)"
        else:
            run.append(name)  # is_decoder=False is asked of the model itself (attends_ahead)
    return run, other


MODEL_TYPES, NOT_DECODER_ONLY = _decoder_only()

# The families that leak through packed_forward_kwargs(batch) without model= (their forward never
# reaches flexpack's attention or mask function); with model= they are exact or refused. The test
# fails when one of them no longer leaks without model= (drop it from here) and on any other
# family that does (a new silent leak).
KNOWN_LEAKS: dict[str, str] = {
    "mamba": "pure SSM: never calls the attention or mask interface",
    "falcon_mamba": "pure SSM: never calls the attention or mask interface",
    "mamba2": "pure SSM: never calls the attention or mask interface",
    "cpmant": "its own attention code and masks: never calls the attention or mask interface",
    "openai-gpt": "its own attention code and masks: never calls the attention or mask interface",
    "xlm": "its own attention code and masks: never calls the attention or mask interface",
    "xlnet": "its own attention code and masks: never calls the attention or mask interface",
    "reformer": "its own (LSH / local) attention code: never calls the attention or mask interface",
    "rwkv": "its own recurrent (WKV) code: never calls the attention or mask interface",
    "xlstm": "pure recurrent (mLSTM): never calls the attention or mask interface",
}

_results: dict[str, _zoo.Result] = {}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_packed_row_is_exact_or_refused(model_type):
    from transformers import AutoConfig

    try:
        mislabelled = getattr(AutoConfig.for_model(model_type), "is_decoder", None) is False
    except Exception:
        mislabelled = False
    if mislabelled and _zoo.attends_ahead(model_type):
        NOT_DECODER_ONLY[model_type] = "encoder family (a causal LM only with is_decoder=True)"
        _results.pop(model_type, None)
        pytest.skip("an encoder family: its tokens see later ones at its default config")
    result = _zoo.check(model_type)
    _results[model_type] = result
    if result.status == "skipped":
        pytest.skip(result.detail)
    if model_type in KNOWN_LEAKS:
        assert result.without_model == "leak", (
            f"{model_type} is {result.without_model} without model= now: drop it from KNOWN_LEAKS"
        )
    else:
        assert result.without_model == result.status, (
            f"{model_type}: {result.without_model} without model=, {result.status} with it"
        )
    assert result.status in ("exact", "refused"), (
        f"{model_type}: {result.status}: {result.detail} (mixers: {result.mixers})"
    )
    if result.status == "refused":
        refused = [k.name for k in _mixers_check.kinds() if not k.exact]
        assert any(name in result.detail for name in refused) or "flexpack" in result.detail


# One model per kind of token mixer flexpack keeps exact: the gradients of every weight match
# the documents run alone (the loss is a fixed random projection of the logits).
GRAD_MODELS = {
    "full attention": "qwen3",
    "sliding-window attention": "gemma3_text",
}


@pytest.mark.parametrize("kind", sorted(GRAD_MODELS))
def test_gradients_match_each_document_alone(kind):
    model, reference = _zoo.build(GRAD_MODELS[kind])
    model.train()
    reference.train()
    batch = flexpack.pack_sequences(_zoo.samples(128), _zoo.MAX_LEN)
    vocab = model.config.get_text_config().vocab_size
    w = torch.randn(_zoo.MAX_LEN, vocab, generator=torch.Generator().manual_seed(1))
    logits = model(**packed_forward_kwargs(batch)).logits[0]  # (S, V)
    loss, want = 0.0, 0.0
    for a, b in _zoo._spans(batch.doc_ids[0]):
        loss = loss + (logits[a:b] * w[a:b]).sum()
        alone = reference(input_ids=batch.input_ids[:, a:b], use_cache=False).logits[0]
        want = want + (alone * w[a:b]).sum()
    loss.backward()
    want.backward()
    torch.testing.assert_close(loss, want, atol=1e-3, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        if p.grad is None and q.grad is None:
            continue
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=f"grad of {name}")


def test_refusal_names_the_module():
    """The error names the kind, the module class and where it sits: a gated delta net that
    flexpack.mixers has not adapted (the first forward adapts it, then it is exact)."""
    model, _ = _zoo.build("qwen3_next")
    with pytest.raises(ValueError, match=r"\(Qwen3NextGatedDeltaNet at `model"):
        _mixers_check.check(model)
    batch = flexpack.pack_sequences(_zoo.samples(128), _zoo.MAX_LEN)
    with torch.no_grad():
        model(**packed_forward_kwargs(batch))  # adapted by the mask function: exact, no error
    _mixers_check.check(model)


def test_registering_an_exact_kind_lifts_the_refusal():
    """The mixers' rooms register their kind as exact; then check() lets the model through."""
    model, _ = _zoo.build("qwen3_next")
    before = _mixers_check.kinds()
    try:
        _mixers_check.register_kind(
            "gated_delta_rule", lambda m: type(m).__name__.endswith("GatedDeltaNet"), exact=True,
            why="test",
        )  # fmt: skip
        _mixers_check.check(model)
    finally:
        _mixers_check._KINDS[:] = before
        _mixers_check._checked.clear()
    with pytest.raises(ValueError):
        _mixers_check.check(model)


def test_write_supported_models_table():
    """Runs last (file order), when every model type ran: merges this release's verdicts into
    the verified table, and on the newest verified release writes docs/supported_models.md."""
    if set(_results) | set(NOT_DECODER_ONLY) != set(MODEL_TYPES) | set(NOT_DECODER_ONLY) or (
        os.environ.get("FLEXPACK_ZOO_WRITE") == "0"
    ):
        pytest.skip("the table is written by a full run of this file")
    table = importlib.import_module("flexpack.check")  # the module (flexpack.check: the function)
    # the verdicts of this transformers release join those of the others the zoo ran on
    table.write_verified(table._TABLE, _zoo.verdicts(_results))
    import transformers

    if transformers.__version__ != _mixers_check.VERIFIED_TRANSFORMERS[-1]:
        return  # the page describes the newest verified release (an older run left it as was)
    models = json.loads(table._TABLE.read_text())["models"]
    DOC.write_text(_zoo.table(_results, NOT_DECODER_ONLY, KNOWN_LEAKS, models))


def test_model_built_with_flexpack_in_its_config_is_refused_too():
    """from_config(attn_implementation="flexpack") (no set_attn_implementation): a model whose
    attention is its own code is refused at the first forward, through the mask function."""
    from transformers import AutoModelForCausalLM

    config = _zoo.tiny_config(
        "bloom", attn_implementation=flexpack.integrations.transformers.register()
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config).eval()
    batch = flexpack.pack_sequences(_zoo.samples(128), _zoo.MAX_LEN)
    with pytest.raises(ValueError, match="own_attention"), torch.no_grad():
        model(**packed_forward_kwargs(batch))


def test_a_conv_the_model_pads_itself_is_refused():
    """ZAYA pads its q/k convolutions with F.pad and builds them with padding=0: the window
    still runs across documents, so any Conv1d wider than one token is refused (not only
    those padded by the module, as Mamba's)."""

    class Projection(torch.nn.Module):  # ZAYA's CCA projection, reduced to its conv
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv1d(8, 8, kernel_size=2, groups=4, padding=0)

    model = torch.nn.Sequential(Projection(), torch.nn.Conv1d(8, 8, kernel_size=1))
    assert _mixers_check.mixers_of(model) == [("0.conv", "causal_conv")]  # 1-wide: a Linear
    with pytest.raises(ValueError, match=r"causal_conv \(Conv1d at `0.conv`\)"):
        _mixers_check.check(model)
