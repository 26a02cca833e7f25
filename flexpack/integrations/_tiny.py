"""Tiny twins of transformers configs: the same model class, a few layers, narrow widths.

:func:`tiny_config` shrinks a config (hidden 64, 4 heads, small experts, state and conv sizes,
windows and chunks of 4 tokens) and keeps one layer of each kind it has (``layer_types`` and the
other per-layer fields; the families whose configs hide a kind get it back from ``PATTERNS``).
A model built from it has the model's classes and token mixers at a size that runs in well
under a second on a CPU: :func:`flexpack.check` probes a model too large to copy on it, and the
model zoo (``tests/_zoo.py``) builds every family of transformers from it.

Every field name here is one transformers' configs use; the tables grow with the families.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OVERRIDES", "PATTERNS", "SIZES", "SMALL", "WINDOWS", "shrink_dict", "tiny_config"]

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
    # a causal LM only as a decoder: its default says is_decoder=False and the LM head asserts
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [32, 32], "axial_pos_shape": [8, 8]},
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


def _per_layer_fields(d: dict[str, Any], L: int) -> list[str]:
    return [
        k
        for k, v in d.items()
        if k != "layer_types" and isinstance(v, (list, str)) and len(v) == L and L > 1
        and not k.endswith(("_token", "_name_or_path", "architectures"))
    ]  # fmt: skip


def shrink_dict(d: dict[str, Any], model_type: str | None) -> dict[str, Any]:
    """One config dict (and its sub-config dicts) made tiny, one layer of each kind kept."""
    d = dict(d)
    for key, value in d.items():
        if isinstance(value, dict) and "model_type" in value:
            d[key] = shrink_dict(value, value.get("model_type"))
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


def tiny_config(config: Any, attn_implementation: str | None = None) -> Any:
    """A tiny config of ``config``'s class: same kinds of layers, narrow widths, few layers.

    Args:
        config: a transformers ``PretrainedConfig`` (a composite one keeps its sub-configs,
            each shrunk).
        attn_implementation: set on the new config when given ("eager", ``register()``'s name).

    Returns:
        A new config of ``type(config)``; ``config`` is left as it is.

    Raises:
        Whatever the config class raises on the shrunk fields (a family the tables do not
        cover yet).

    Example:
        >>> from transformers import LlamaConfig
        >>> from flexpack.integrations._tiny import tiny_config
        >>> tiny = tiny_config(LlamaConfig())  # 32 layers, hidden 4096 by default
        >>> tiny.num_hidden_layers, tiny.hidden_size, tiny.vocab_size
        (1, 64, 128)
    """
    d = shrink_dict(config.to_dict(), getattr(config, "model_type", None))
    # quantization_config: a tiny twin is built with plain float weights
    for key in (
        "transformers_version",
        "model_type",
        "dtype",
        "torch_dtype",
        "quantization_config",
    ):
        d.pop(key, None)
    tiny = type(config).from_dict(d)
    if attn_implementation is not None:
        tiny._attn_implementation = attn_implementation
    return tiny
