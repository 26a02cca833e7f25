"""The model zoo: every decoder-only causal LM in the installed transformers, built tiny offline.

:func:`tiny_config` shrinks a model type's default config (hidden 64, 4 heads, small experts,
state and conv sizes, windows and chunks of 4 tokens) and keeps one layer of each kind it has
(``layer_types`` and the other per-layer fields; the families whose defaults hide a kind get it
back from ``PATTERNS``). :func:`check` runs one packed row of three documents through flexpack
(``register()`` + ``packed_forward_kwargs``) and compares each document's logits with the
document run alone under ``eager``. Test tooling, not library API.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

import flexpack

LENGTHS = (11, 14, 9)  # three documents, longer than every window and chunk
MAX_LEN = 40  # one row: 34 tokens and 6 of padding
ATOL = 1e-4
SMALL = 4  # sliding windows, attention chunks, SSM chunks: shorter than the documents

# Sizes for the config fields that set the model's width. Only fields the config has are set.
SIZES: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "d_model": 64,
    "n_embd": 64,
    "intermediate_size": 96,
    "ffn_hidden_size": 96,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rotary_dim": 8,  # GPT-J, CodeGen: rotary part of the 16-wide heads (64 by default)
    "attention_head_dim": 16,
    "global_head_dim": 16,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "num_expert_group": 1,
    "linear_head_dim": 16,
    "linear_num_heads": 4,
    "layer_group_size": 2,
    "moe_k": 2,
    "moe_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 0,
    # MLA: v_head_dim (8) != the q/k head dim (8 + 8 = 16)
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "index_topk": 8,
    # linear attention / SSM / conv mixers
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "state_size": 8,
    "ssm_state_size": 8,
    "mamba_d_state": 8,
    "mamba_d_conv": 4,
    "conv_kernel": 4,
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "mamba_head_dim": 16,
    "mamba_n_groups": 1,
    "n_groups": 1,
    "time_step_rank": 8,
    "chunk_size": SMALL,
    "mamba_chunk_size": SMALL,
    "lru_width": 64,
    "conv_L_cache": 3,
    "block_size": SMALL,
    "num_nextn_predict_layers": 0,
    "vocab_size_per_layer_input": 128,  # Gemma 3n / 4's per-layer embeddings
    "hidden_size_per_layer_input": 16,
    "encoder_hash_byte_group_vocab": 512,  # BLT's hash embeddings (500,002 rows by default)
    "initializer_range": 0.1,  # large enough that a leak between documents shows
    "attention_dropout": 0.0,
    "hidden_dropout": 0.0,
    "dropout": 0.0,
}
# Per-layer overrides (Gemma 4's wider global layers): wider than SIZES, as in the real configs.
PER_LAYER_SIZES: dict[str, Any] = {"head_dim": 32, "global_head_dim": 32}
# Windows and chunks: set where the config has one (not None), so they are shorter than documents.
WINDOWS = ("sliding_window", "attention_chunk_size", "attention_window_size")
# Families whose default config hides a kind of layer they ship with (e.g. LFM2's default has
# attention layers only, real checkpoints interleave short convs): the fields that bring it back.
PATTERNS: dict[str, dict[str, Any]] = {
    "lfm2": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "jamba": {
        "num_hidden_layers": 2,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
    },
    "bamba": {"num_hidden_layers": 2, "attn_layer_indices": [1]},
    "zamba2": {
        "num_hidden_layers": 2,
        "layers_block_type": ["linear_attention", "hybrid"],  # mamba2, then shared attention
        "hybrid_layer_ids": [1],
        "attention_hidden_size": 128,  # derived at init (2 x hidden), kept by to_dict
        "attention_head_dim": 32,
        "mamba_headdim": 16,  # mamba_expand x hidden / n_mamba_heads
        "kv_channels": 16,
        "num_query_groups": 4,
        "adapter_rank": 8,
    },
    "rwkv": {"num_hidden_layers": 2, "attention_hidden_size": 64},  # its init divides by L - 1
    "xlstm": {"num_hidden_layers": 2, "num_blocks": 2, "embedding_dim": 64},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "num_hidden_layers": 2},
    # configs whose width and depth go by other names (each took 23-61 s at default size)
    "longcat_flash": {
        "num_layers": 1,
        "expert_ffn_hidden_size": 32,
        "zero_expert_num": 2,
        "moe_topk": 2,
    },
    "xlm": {"emb_dim": 64, "n_layers": 2},
}

# Sub-configs that need more than SIZES, merged in last (the per-layer reduction still runs):
# Qwen2-VL's text config has no mrope_section (the model's default, [16, 24, 24], fits head dim
# 128, not 16), and its vision tower's depth and widths go by names of their own (at default
# size it took 35 s and 2.6 GB to build).
OVERRIDES: dict[str, dict[str, Any]] = {
    "qwen2_vl_text": {"rope_parameters": {"mrope_section": [2, 3, 3]}},
    "qwen2_5_vl_text": {"rope_parameters": {"mrope_section": [2, 3, 3]}},
    "qwen2_vl_vision": {"depth": 2, "embed_dim": 64},
    "qwen2_5_vl_vision": {"depth": 2, "out_hidden_size": 64, "fullatt_block_indexes": [1]},
    # defaults that do not build (None where a number is needed) or a layer list to keep whole
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    "dots1": {"n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2},
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 2,
    },
    "zamba": {
        "num_hidden_layers": 4,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "layers_block_type": ["linear_attention", "hybrid"] * 2,  # the shared block, twice
        "attention_hidden_size": 128,
        "mamba_dt_rank": 4,
    },
    "cohere_compass_text": {
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    },
    "xlnet": {"d_head": 16, "n_layer": 2, "d_inner": 128},
    "zaya": {"num_experts_per_tok": 1},
}


class Unbuildable(Exception):
    """The model type's tiny config or model cannot be built offline (the reason says why)."""


class NoAttentionSeam(Exception):
    """transformers itself cannot build the model with a registered attention function: its
    layers pick their attention class from a fixed dict (``KeyError: 'flexpack'``)."""


def _per_layer_fields(d: dict[str, Any], L: int) -> list[str]:
    return [
        k
        for k, v in d.items()
        if k != "layer_types" and isinstance(v, (list, str)) and len(v) == L and L > 1
        and not k.endswith(("_token", "_name_or_path", "architectures"))
    ]  # fmt: skip


def _shrink(d: dict[str, Any], model_type: str | None) -> dict[str, Any]:
    """One config dict (and its sub-config dicts) made tiny, one layer of each kind kept."""
    d = dict(d)
    for key, value in d.items():
        if isinstance(value, dict) and "model_type" in value:
            d[key] = _shrink(value, value.get("model_type"))
    for key, value in SIZES.items():
        if key in d and d[key] is not None and not isinstance(d[key], (list, dict)):
            d[key] = value
    for key in WINDOWS:
        if d.get(key) is not None:
            d[key] = SMALL
    # None that means "derive it from the default widths" (Ministral, HunYuan, Nemotron), not off
    for key in ("head_dim", "num_key_value_heads"):
        if key in d and d[key] is None:
            d[key] = SIZES[key]
    experts = ("n_routed_experts", "num_experts", "num_local_experts")
    if (
        "num_experts_per_tok" in d
        and d["num_experts_per_tok"] is None
        and any(isinstance(d.get(k), int) for k in experts)
    ):  # DeepSeek-V2's default leaves its routed experts' top-k unset
        d["num_experts_per_tok"] = SIZES["num_experts_per_tok"]
    if isinstance(d.get("qk_rope_head_dim"), int) and "head_dim" in d:
        d["head_dim"] = d["qk_rope_head_dim"]  # MLA: the rotary part is the config's head_dim
    if isinstance(d.get("kv_lora_rank"), int) and "num_key_value_heads" in d:
        d["num_key_value_heads"] = d["num_attention_heads"]  # MLA: one key head per query head
    if "qk_head_dim" in d and isinstance(d.get("qk_rope_head_dim"), int):
        d["qk_head_dim"] = d["qk_rope_head_dim"] + d["qk_nope_head_dim"]  # derived at init
    d.update(PATTERNS.get(model_type or "", {}))
    if model_type in PATTERNS and isinstance(d.get("layer_types"), list):
        d["num_hidden_layers"] = len(d["layer_types"])
    L = d.get("num_hidden_layers")
    if isinstance(L, int) and L > 1 and model_type not in PATTERNS:
        kinds = d.get("layer_types")
        fields = _per_layer_fields(d, L)
        keys = [tuple([kinds[i]] if isinstance(kinds, list) else []) + tuple(
            d[f][i] for f in fields) for i in range(L)]  # fmt: skip
        first: dict[tuple, int] = {}
        for i, k in enumerate(keys):
            first.setdefault(k, i)
        # one layer of each distinct kind, at most 4, the layer kinds first
        by_kind: dict[Any, int] = {}
        for i, k in enumerate(keys):
            by_kind.setdefault(k[:1], i)
        keep = sorted(set(by_kind.values()) | set(list(first.values())[:4]))[:6]
        if isinstance(kinds, list):
            d["layer_types"] = [kinds[i] for i in keep]
        for f in fields:
            v = d[f]
            d[f] = "".join(v[i] for i in keep) if isinstance(v, str) else [v[i] for i in keep]
            if f in SIZES and all(isinstance(x, int) for x in d[f]):
                d[f] = [SIZES[f]] * len(keep)  # per-layer widths (Gemma 3n's intermediate_size)
        d["num_hidden_layers"] = len(keep)
        for key in ("mlp_only_layers", "moe_layers", "full_attn_idxs"):
            if isinstance(d.get(key), list):
                d[key] = [j for j, i in enumerate(keep) if i in d[key]]
        if isinstance(d.get("num_kv_shared_layers"), int) and d["num_kv_shared_layers"] > 0:
            # Gemma 3n / 4 reuse the K/V of earlier layers in their last layers: keep the
            # sharing, with producers and users of each kind in the kept layers
            d["num_kv_shared_layers"] = len(keep) // 2
        if isinstance(d.get("per_layer_config"), dict):  # Gemma 4: {"05": {"head_dim": 512}}
            per = {int(k): v for k, v in d["per_layer_config"].items()}
            d["per_layer_config"] = {
                str(j): {k: PER_LAYER_SIZES.get(k, v) for k, v in per[i].items()}
                for j, i in enumerate(keep) if i in per
            }  # fmt: skip
    elif isinstance(L, int) and L == 1:
        pass
    _mamba_heads(d)
    rope = d.get("rope_parameters") or d.get("rope_scaling")
    if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list):
        rope["mrope_section"] = [2, 3, 3]  # mRoPE sections of head_dim 16: 16 / 2 rotary pairs
    for key, value in OVERRIDES.get(model_type or "", {}).items():
        d[key] = {**d[key], **value} if isinstance(d.get(key), dict) else value
    vocab = d.get("vocab_size")
    if isinstance(vocab, int):
        for key, value in list(d.items()):
            if key.endswith(("_token_id", "_token_index")) and isinstance(value, int):
                if value >= vocab:
                    d[key] = vocab - 1 - len(key) % 8  # distinct, inside the vocabulary
    return d


def _mamba_heads(d: dict[str, Any]) -> None:
    """Mamba2 heads that fill the inner width: heads * head dim == expand * hidden."""
    hidden = d.get("hidden_size")
    if isinstance(d.get("mamba_d_ssm"), int) and isinstance(d.get("mamba_expand"), int):
        d["mamba_d_ssm"] = d["mamba_expand"] * hidden
    names = (
        ("expand", "num_heads", "head_dim"),
        ("mamba_expand", "mamba_n_heads", "mamba_d_head"),
        ("mamba_expand", "mamba_n_heads", "mamba_head_dim"),
    )
    for expand, heads, head_dim in names:
        if all(isinstance(d.get(k), int) for k in (expand, heads, head_dim)) and hidden:
            d[heads] = int(d[expand]) * hidden // d[head_dim]


def tiny_config(model_type: str, attn_implementation: str = "eager"):
    """The tiny float32 config of ``model_type``; raises :class:`Unbuildable` with the reason."""
    from transformers import AutoConfig

    try:
        default = AutoConfig.for_model(model_type)
    except Exception as e:
        raise Unbuildable(f"default config: {type(e).__name__}: {_first_line(e)}") from e
    d = _shrink(default.to_dict(), model_type)
    d.pop("transformers_version", None)
    d.pop("model_type", None)
    d.pop("dtype", None)
    try:
        config = type(default).from_dict(d)
    except Exception as e:
        raise Unbuildable(f"tiny config: {type(e).__name__}: {_first_line(e)}") from e
    config._attn_implementation = attn_implementation
    return config


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
    return Result(status, detail, mixer_kinds(model), without[0])


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
    return Result(status, detail, mixer_kinds(model), status)


def _alone(model, batch, spans) -> list[torch.Tensor]:
    """The logits of each document of the row run alone."""
    with torch.no_grad():
        return [model(input_ids=batch.input_ids[:, a:b], use_cache=False).logits[0]
                for a, b in spans]  # fmt: skip


def _run(model, packed_forward_kwargs, batch, spans, alone, given) -> tuple[str, str]:
    try:
        with torch.no_grad():
            packed = model(**packed_forward_kwargs(batch, model=given)).logits
    except ValueError as e:  # the refused mixers, whole (without the advice that follows)
        text = " ".join(str(e).split())
        return "refused", text.split("others): ", 1)[-1].split(". Run this model", 1)[0]
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


def table(
    results: dict[str, Result], not_decoder_only: dict[str, str], known: dict[str, str]
) -> str:
    """docs/supported_models.md: the zoo's verdict per model type."""
    import transformers

    order = {"exact": 0, "refused": 1, "leak": 2, "error": 3, "skipped": 4}
    counts: dict[str, int] = {}
    for r in results.values():
        counts[r.status] = counts.get(r.status, 0) + 1
    lines = [
        "# Supported models",
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
        "| model type | verdict | token mixers | detail |",
        "|---|---|---|---|",
    ]
    for name in sorted(results, key=lambda n: (order[results[n].status], n)):
        r = results[name]
        detail = r.detail.replace("|", "\\|")
        if name in known:
            detail = f"{detail}; without `model=`: {r.without_model} ({known[name]})"
        mixers = ", ".join(r.mixers) or "attention"
        lines.append(f"| `{name}` | {r.status} | {mixers} | {detail} |")
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
