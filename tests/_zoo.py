"""The model zoo: every decoder-only causal LM in the installed transformers, built tiny offline.

:func:`tiny_config` shrinks a model type's default config with the library's
:func:`flexpack.integrations._tiny.tiny_config` (hidden 64, 4 heads, small experts, state and
conv sizes, windows and chunks of 4 tokens, one layer of each kind it has; ``flexpack.check``
probes large models on the same twins). :func:`check` runs one packed row of three documents
through flexpack (``register()`` + ``packed_forward_kwargs``) and compares each document's logits
with the document run alone under ``eager``. Test tooling, not library API.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

import flexpack
from flexpack.integrations import _tiny

LENGTHS = (11, 14, 9)  # three documents, longer than every window and chunk
MAX_LEN = 40  # one row: 34 tokens and 6 of padding
ATOL = 1e-4


class Unbuildable(Exception):
    """The model type's tiny config or model cannot be built offline (the reason says why)."""


class NoAttentionSeam(Exception):
    """transformers itself cannot build the model with a registered attention function: its
    layers pick their attention class from a fixed dict (``KeyError: 'flexpack'``)."""


def tiny_config(model_type: str, attn_implementation: str = "eager"):
    """The tiny float32 config of ``model_type`` (its default config through
    :func:`flexpack.integrations._tiny.tiny_config`); raises :class:`Unbuildable` with the
    reason."""
    from transformers import AutoConfig

    try:
        default = AutoConfig.for_model(model_type)
    except Exception as e:
        raise Unbuildable(f"default config: {type(e).__name__}: {_first_line(e)}") from e
    try:
        return _tiny.tiny_config(default, attn_implementation)
    except Exception as e:
        raise Unbuildable(f"tiny config: {type(e).__name__}: {_first_line(e)}") from e


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else "")[:160]


# Image-text models whose language model flexpack packs (flexpack.integrations.multimodal):
# run here on text rows through their ForConditionalGeneration class.
IMAGE_TEXT = ("gemma3", "paligemma", "qwen2_vl", "qwen2_5_vl")


def _auto_class(model_type: str):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return transformers.AutoModelForCausalLM
    return transformers.AutoModelForImageTextToText


def build(model_type: str):
    """(flexpack model, eager reference) with the same random weights, in eval mode.

    The flexpack model is built with ``attn_implementation="flexpack"`` in its config (what
    ``from_pretrained(..., attn_implementation=register())`` does), the reference with
    ``"eager"``; both from the same seed, the weights then copied."""
    from flexpack.integrations.transformers import register

    auto = _auto_class(model_type)
    built = []
    for implementation in ("eager", register()):
        config = tiny_config(model_type, implementation)
        torch.manual_seed(0)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                built.append(auto.from_config(config, dtype=torch.float32).eval())
        except KeyError as e:
            if e.args != (implementation,) or implementation == "eager":
                raise Unbuildable(f"model: KeyError: {_first_line(e)}") from e
            raise NoAttentionSeam(f"KeyError: {_first_line(e)}") from e
        except Exception as e:
            raise Unbuildable(f"model: {type(e).__name__}: {_first_line(e)}") from e
    reference, model = built
    model.load_state_dict(reference.state_dict())
    return model, reference


def attends_ahead(model_type: str) -> bool:
    """Whether the tiny model at its default config lets a token see later ones (an encoder
    family's LM head: BERT, RoBERTa), told by what it does: the first token's logits change when
    only the last token does. ``config.is_decoder`` is not the test: GPT-NeoX and TrOCR say
    False and are causal. A model that cannot be built is left to :func:`check` (False)."""
    try:
        config = tiny_config(model_type)
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = _auto_class(model_type).from_config(config, dtype=torch.float32).eval()
        ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
        changed = ids.clone()
        changed[0, -1] = 11
        with torch.no_grad():
            a = model(input_ids=ids, use_cache=False).logits[0, 0]
            b = model(input_ids=changed, use_cache=False).logits[0, 0]
    except Exception:
        return False
    return not torch.equal(a, b)


def samples(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hi = min(vocab, 100)
    return [torch.randint(3, hi, (n,), generator=g) for n in LENGTHS]


@dataclass(frozen=True)
class Result:
    status: str  # "exact", "refused", "leak", "error", "skipped"
    detail: str  # the refusal's message, the leak's size, the error, or why it was skipped
    mixers: tuple[str, ...] = ()  # the kinds of token mixer the tiny model has
    # the same row through packed_forward_kwargs(batch) without model= (run first): its status
    without_model: str = ""
    cls: str = ""  # the model's class name (the verified table's key)


def mixer_kinds(model: torch.nn.Module) -> tuple[str, ...]:
    from flexpack.integrations import _mixers_check

    return tuple(sorted({kind for _, kind in _mixers_check.mixers_of(model)}))


def check(model_type: str) -> Result:
    """Run ``model_type`` packed and per document; classify what happens."""
    from flexpack.integrations.transformers import packed_forward_kwargs

    try:
        model, reference = build(model_type)
    except Unbuildable as e:
        return Result("skipped", str(e))
    except NoAttentionSeam as e:
        return _without_seam(model_type, str(e))
    kinds = mixer_kinds(model)
    batch = flexpack.pack_sequences(samples(model.config.get_text_config().vocab_size), MAX_LEN)
    spans = _spans(batch.doc_ids[0])
    try:  # the documents alone, under eager: the reference (a tiny config it cannot run is ours)
        alone = _alone(reference, batch, spans)
    except Exception as e:
        return Result("skipped", f"eager reference: {type(e).__name__}: {_first_line(e)}", kinds)
    # Without model= first (the model= call adapts the model's mixers), then with it.
    without = _run(model, packed_forward_kwargs, batch, spans, alone, None)
    status, detail = _run(model, packed_forward_kwargs, batch, spans, alone, model)
    # the kinds once adapted: a mixer flexpack.mixers adapts shows its room's name
    return Result(status, detail, mixer_kinds(model), without[0], type(model).__name__)


def _without_seam(model_type: str, error: str) -> Result:
    """A model transformers cannot load with flexpack's attention (loud: its own KeyError at
    construction). The same model loaded as users can (eager) must then be refused by
    ``packed_forward_kwargs(batch, model=model)``: a ValueError, never a silent leak."""
    from flexpack.integrations.transformers import packed_forward_kwargs

    config = tiny_config(model_type, "eager")
    torch.manual_seed(0)
    model = _auto_class(model_type).from_config(config, dtype=torch.float32).eval()
    batch = flexpack.pack_sequences(samples(config.get_text_config().vocab_size), MAX_LEN)
    spans = _spans(batch.doc_ids[0])
    alone = _alone(model, batch, spans)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "its attention is not flexpack's": the refusal follows
        status, detail = _run(model, packed_forward_kwargs, batch, spans, alone, model)
    detail = (
        f"{detail}; transformers itself raises {error} at "
        "construction with any registered attention, so run loaded with eager"
    )
    return Result(status, detail, mixer_kinds(model), status, type(model).__name__)


def _alone(model, batch, spans) -> list[torch.Tensor]:
    """The logits of each document of the row run alone, with the all-ones attention_mask a
    tokenizer gives: without one, transformers 5.17's Moshi builds no causal mask at all and
    its eager attention runs bidirectional (the zoo then called flexpack's causal rows a leak)."""
    with torch.no_grad():
        return [model(input_ids=batch.input_ids[:, a:b], use_cache=False,
                      attention_mask=torch.ones_like(batch.input_ids[:, a:b])).logits[0]
                for a, b in spans]  # fmt: skip


def _run(model, packed_forward_kwargs, batch, spans, alone, given) -> tuple[str, str]:
    try:
        with torch.no_grad():
            packed = model(**packed_forward_kwargs(batch, model=given)).logits
    except ValueError as e:  # the refused mixers, whole (without the advice that follows)
        text = " ".join(str(e).split())
        return "refused", text.split("others): ", 1)[-1].split(". Installed: transformers", 1)[0]
    except Exception as e:
        return "error", f"{type(e).__name__}: {_first_line(e)}"
    worst = max(
        (packed[0, a:b] - want).abs().max().item()
        for (a, b), want in zip(spans, alone, strict=True)
    )
    if worst <= ATOL:
        return "exact", f"max |diff| {worst:.1e}"
    return "leak", f"max |diff| {worst:.2e}"


def _spans(doc_ids: torch.Tensor) -> list[tuple[int, int]]:
    ids = doc_ids.tolist()
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[start]:
            if ids[start] >= 0:
                out.append((start, i))
            start = i
    return out


# The top of docs/supported_models.md: flexpack.check for a model of the reader's own (its
# code block runs in tests/test_docs.py), then the zoo's table under its own heading.
CHECK_OWN_MODEL = """
## Check your own model

<!-- docs-test: requires transformers -->

`flexpack.check(model)` answers for the model you have, the object itself: its modules, the
forwards patched on its classes or instances, its hooks, in the mode it is in (training or
eval). It packs documents into one row, runs the row through flexpack and each document alone
under `eager`, in float64 on CPU, and compares the output of every module. It returns a short
report when each document gets what it gets alone; otherwise it raises a `ValueError` with
flexpack's refusal, or naming the first module whose output differs.

- The probe borrows the model: float64 copies on CPU of the weights of the modules it runs,
  dropout set to 0 (training mode stays on, so code that mixes tokens only while training is
  seen), flexpack's attention set; then everything it touched is put back. Above 2e7
  parameters it runs the model's first layers (one of each kind, and every layer with code of
  its own) and the embedding rows its tokens use; on the meta device, a tiny model of its class
  (refused when the model carries code such a model would not have).
- The documents' lengths come from the config: a 1-token document, and one longer than every
  length-dependent rule up to 512 tokens (sliding window, attention chunk, scan chunk, and for
  scaled RoPE `max_position_embeddings` and `original_max_position_embeddings`); the report's
  `not_crossed` lists longer ones (`lengths=` crosses them).
- It also runs the path transformers' own padding-free training takes on the model as it is
  (one row, restarting `position_ids` and nothing else, as `DataCollatorWithFlattening` and
  TRL's `packing=True` hand it): `report.flattened` is `"exact"`, or names the module that mixes
  documents and the fix (`attn_implementation=register()`; `flexpack.mixers.adapt(model)` for
  recurrent / conv layers, which nothing of flexpack's reaches on that path).
- The verdict is kept per object until the object changes (a parameter replaced or written, a
  forward or hook added or removed, train / eval, a class's forward patched).
- flexpack's verified table (`flexpack/assets/verified_models.json`, from the zoo below)
  documents what was verified (`report.verified`); it never replaces the run.
- RoPE that transformers rescales per call by the call's longest position (`rope_type`
  `"dynamic"`, `"longrope"`) cannot be exact on packed rows: a packed call refuses it by name.

Needs transformers: `pip install -e '.[hf]'`.

```python
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import flexpack

config = LlamaConfig(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
model = LlamaForCausalLM(config)  # or AutoModelForCausalLM.from_pretrained(...)
report = flexpack.check(model)
print(report)


class RunningSum(torch.nn.Module):  # a token mixer flexpack has never seen
    def forward(self, x):
        return x.cumsum(dim=1)  # (B, S, H): runs across document boundaries


model.model.layers[1].mlp = RunningSum()
try:
    flexpack.check(model)
except ValueError as e:
    print(e)
```

prints (abridged)

```
LlamaForCausalLM: exact on packed rows (5 documents, 100 tokens, max |diff|
...
flexpack.check: LlamaForCausalLM is not exact on packed rows: the first module whose output
differs from the document alone is `model.layers.1.mlp` (RunningSum): by
...
Its input matches: this module mixes tokens across documents.
```

## Every family of transformers, tiny
"""


SEAMS = """
## Which transformers seam each family uses, and what an upgrade could break

- **Attention layers** (every family marked exact): `AttentionInterface.register("flexpack", ...)`;
  transformers calls `flexpack_attention_forward(module, q, k, v, attention_mask, **kwargs)` per
  layer. Read from the call: `doc_ids` / `seq_idx` / `position_ids` (the model must pass its
  `**kwargs` down to attention), `sliding_window`, `softcap`, `s_aux` (sinks, gpt-oss family),
  `is_causal`; from the module: `config.layer_types[layer_idx]` and
  `config.attention_chunk_size` (chunked layers, Llama 4), value width != q/k width (MLA). An
  upgrade that renames these keywords or attributes, or stops forwarding `**kwargs` to the
  attention call, turns a family's rows back into plain causal ones: this test catches it.
- **Masks**: `AttentionMaskInterface.register("flexpack", ...)`: whole rows get the (B, S) padding
  mask back (flexpack builds its own mask from document ids); with a KV cache, transformers'
  own `sdpa_mask`; when transformers' mask function carries an `or_masks` overlay (Gemma 3 image
  blocks, PaliGemma's prefix), that function rides on the padding mask and is composed with
  the documents. Depends on the `mask_function` keyword and on `or_masks` keeping its name.
- **Refusals** (`flexpack/integrations/_mixers_check.py`): run at the first forward from the
  attention or mask function, on the model found on the call stack; token mixers are told by
  module kind (class-name parts such as `GatedDeltaNet`, `Mamba`, `ShortConv`, `Indexer`,
  `Compressor`, parameters such as `A_log`, `sinks`, `Conv1d`s wider than one token) and by
  transformers' own `_can_set_attn_implementation()`. A renamed mixer class would fall through
  to the broad kinds (`linear_recurrence`, `causal_conv`) or, if it matches none, show up here
  as a new leak.
- **Not reachable from the model's forward**: a model that calls neither the attention nor the
  mask interface (pure SSMs such as Mamba; GPT-1, XLM and CPM-Ant, whose attention is their own
  code) never runs flexpack code during its forward, and transformers offers no per-model seam
  that does. `packed_forward_kwargs(batch, model=model)`, `packed_causal_lm_loss(model, batch)`
  (also on a collator's batch made without the model) and flexpack's trainers, which know
  their model, adapt or refuse them before the call; a bare
  `model(**packed_forward_kwargs(batch))` cannot, and is marked "without `model=`" above.
- **A causal mask for layers whose `is_causal` is False**: PaliGemma's Gemma (and any config
  with `use_bidirectional_attention=True` whose model still calls `create_causal_mask`) marks
  its layers non-causal, yet the model builds a causal mask and eager follows the mask. The
  mask function sees transformers' causal rule and tells the attention; an upgrade that
  renames `causal_mask_function` would make these rows bidirectional, which this test catches.
"""


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) if p.isdigit() else 0 for p in version.split("."))


def _per_release(verified: dict[str, dict[str, str]]) -> list[str]:
    """One line per transformers release the zoo ran on: its exact and refused classes."""
    by: dict[str, dict[str, int]] = {}
    for releases in verified.values():
        for version, verdict in releases.items():
            by.setdefault(version, {}).setdefault(verdict, 0)
            by[version][verdict] += 1
    if not by:
        return []
    lines = ["Verdicts per transformers release the zoo ran on (model classes; the table's "
             "column says which releases each was verified on):", ""]  # fmt: skip
    for version in sorted(by, key=_release):
        counts = by[version]
        lines.append(f"- {version}: {counts.get('exact', 0)} exact, "
                     f"{counts.get('refused', 0)} refused")  # fmt: skip
    return [*lines, ""]


def verdicts(results: dict[str, Result]) -> dict[str, dict[str, str]]:
    """{class name: {installed transformers version: verdict}} of the exact and refused models:
    what the verified table (flexpack/assets/verified_models.json) records of this run."""
    import transformers

    return {
        r.cls: {transformers.__version__: r.status}
        for r in results.values()
        if r.cls and r.status in ("exact", "refused")
    }


def table(
    results: dict[str, Result],
    not_decoder_only: dict[str, str],
    known: dict[str, str],
    verified: dict[str, dict[str, str]] | None = None,
) -> str:
    """docs/supported_models.md: the zoo's verdict per model type (``verified``: the verified
    table's ``models``, for the releases column)."""
    verified = verified or {}
    import transformers

    order = {"exact": 0, "refused": 1, "leak": 2, "error": 3, "skipped": 4}
    counts: dict[str, int] = {}
    for r in results.values():
        counts[r.status] = counts.get(r.status, 0) + 1
    lines = [
        "# Supported models",
        "",
        *CHECK_OWN_MODEL.strip("\n").splitlines(),
        "",
        "<!-- Generated by tests/test_model_zoo.py (a full run rewrites it); do not edit. -->",
        "",
        f"Every decoder-only causal LM `model_type` of transformers {transformers.__version__} "
        "(and the image-text models whose language model flexpack packs), built tiny with one "
        "layer of each kind it has (windows and chunks of 4 tokens), on one packed row of "
        f"three documents ({', '.join(map(str, LENGTHS))} tokens) through "
        "`attn_implementation=register()` + `packed_forward_kwargs(batch, model=model)`: "
        "**exact** means every "
        f"document's logits equal the document alone under `eager` (fp32, {ATOL:g}); "
        "**refused** means the first forward raises a ValueError naming what flexpack cannot "
        "keep exact yet (a family transformers cannot build with any registered attention, "
        "its own `KeyError` at construction, is run loaded with `eager`: "
        "`packed_forward_kwargs(batch, model=model)` must refuse it). "
        "A silent difference fails CI. The same row also runs through "
        "`packed_forward_kwargs(batch)` without `model=`: every family gives the same verdict "
        "there except the few whose forward never reaches flexpack's attention or mask "
        "function, marked below (pass `model=` for them).",
        "",
        "Totals: " + ", ".join(f"{counts[k]} {k}" for k in sorted(counts, key=order.get)) + ".",
        "",
        *_per_release(verified),
        "| model type | verdict | token mixers | verified on transformers | detail |",
        "|---|---|---|---|---|",
    ]
    for name in sorted(results, key=lambda n: (order[results[n].status], n)):
        r = results[name]
        detail = r.detail.replace("|", "\\|")
        if name in known:
            detail = f"{detail}; without `model=`: {r.without_model} ({known[name]})"
        mixers = ", ".join(r.mixers) or "attention"
        releases = verified.get(r.cls, {})
        on = ", ".join(f"{v} {releases[v]}" for v in sorted(releases, key=_release)) or "-"
        lines.append(f"| `{name}` | {r.status} | {mixers} | {on} | {detail} |")
    lines += _mixer_rooms()
    lines += ["", *SEAMS.strip("\n").splitlines()]
    lines += ["", "Not decoder-only (not run):", ""]
    lines += [f"- `{name}`: {why}" for name, why in sorted(not_decoder_only.items())]
    return "\n".join(lines) + "\n"


def _mixer_rooms() -> list[str]:
    """The rooms of flexpack.mixers: how each kind of recurrent / conv mixer is kept exact."""
    from flexpack import mixers

    lines = [
        "",
        "## Recurrent, SSM and conv token mixers",
        "",
        "Made exact by `flexpack.mixers` (adapted per model instance at the first forward under "
        "`register()`, or by `flexpack.mixers.adapt(model)` for models without attention); "
        "the seams each room relies on, and what a transformers upgrade could break, are in "
        "[mixers.md](mixers.md).",
        "",
        "| kind | recognised by | documents kept apart by |",
        "|---|---|---|",
    ]
    for room in mixers.ROOMS:
        found = ", ".join(f"`{f}`" for f in sorted(room.functions)) or room.recognised_by
        lines.append(f"| {room.name} | {found} | {room.how} |")
    return lines
