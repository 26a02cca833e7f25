"""Packed rows through hybrid models on CPU: flexpack.mixers vs the family's own torch path.

For each kind of recurrent / conv token mixer, one small model of a family that has it (two
layers: the mixer, then full attention), a training step (forward + backward) on the same
packed rows:

- ``own``: the model as a user of transformers runs packed rows (``attn_implementation="sdpa"``,
  or its default for RWKV and xLSTM, which have no attention; ``position_ids`` restarting per
  document, transformers' packed-sequence rule for attention, its torch mixer over the whole
  row: the documents' states leak, the number is its speed only);
- ``flexpack``: ``attn_implementation=register()`` with ``packed_forward_kwargs`` (the mixers
  adapted; attention per document; the attention-free families handed over as ``model=``),
  twice: with every one pass declined (``per group``: the module's own forward once per group
  of right-padded documents) and as it runs (``one pass``: the whole rows at once, documents
  kept apart inside the computation).

A second table splits the short conv (LFM2) three ways: its own torch path over the whole rows
(leaking), flexpack's per-group calls of the module (the path every room has) and flexpack's
one pass over the rows with the taps across document starts masked out (what the short-conv
room runs now), for the whole model's step and for the conv layer alone.

Run: ``PYTHONPATH=$PWD python bench/mixers.py`` (a few minutes on a quiet 2-core CPU, RWKV's
own token loop the longest; a word after it keeps only the families whose name has it, e.g.
``ZAYA``). Prints a markdown table; the ratios are own / one pass and per group / one pass
(above 1: the one pass faster).
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _machine import describe

import flexpack

WIDTH = dict(
    vocab_size=512, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_size=128,
    intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    max_position_embeddings=4096,
)  # fmt: skip
FAMILIES = {  # kind: (config class, kwargs)
    "gated_delta_rule (Qwen3.5)": ("Qwen3_5TextConfig", dict(
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4)),
    "kda (Kimi Linear)": ("KimiLinearConfig", dict(
        layer_types=["linear_attention", "full_attention"], num_experts=2,
        num_experts_per_token=1, moe_intermediate_size=64, first_k_dense_replace=2,
        q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=32, num_key_value_heads=4, linear_head_dim=32, linear_num_heads=4)),
    "mamba2 (Bamba)": ("BambaConfig", dict(
        attn_layer_indices=[1], mamba_chunk_size=64, mamba_d_conv=4, mamba_expand=2,
        mamba_n_heads=8, mamba_d_head=32, mamba_d_state=16)),
    "mamba (Jamba)": ("JambaConfig", dict(
        attn_layer_period=2, attn_layer_offset=1, num_experts=1, mamba_d_conv=4,
        mamba_expand=2, mamba_d_state=16, mamba_dt_rank=8)),
    "mamba (Zamba, multi-head)": ("ZambaConfig", dict(
        n_mamba_heads=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
        layers_block_type=["linear_attention", "hybrid"] * 2, num_hidden_layers=4,
        attention_hidden_size=256, attention_head_dim=64)),  # its shared block ties 2 layers
    "lightning_attention (MiniMax)": ("MiniMaxConfig", dict(
        layer_types=["linear_attention", "full_attention"], block_size=64,
        num_local_experts=1, num_experts_per_tok=1)),
    "short_conv (LFM2)": ("Lfm2Config", dict(
        layer_types=["conv", "full_attention"], full_attn_idxs=[1], conv_L_cache=3)),
    "rg_lru (RecurrentGemma)": ("RecurrentGemmaConfig", dict(
        block_types=["recurrent", "attention"], lru_width=128, conv1d_width=4,
        attention_window_size=512)),
    "gated_delta_rule (Qwen3-Next)": ("Qwen3NextConfig", dict(
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, num_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=64, shared_expert_intermediate_size=64)),
    "gated_delta_rule (OLMo hybrid)": ("OlmoHybridConfig", dict(
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4)),
    "wkv + token shift (RWKV)": ("RwkvConfig", dict(attention_hidden_size=128)),
    "mlstm (xLSTM)": ("xLSTMConfig", dict(embedding_dim=128, num_heads=4, num_blocks=2)),
    "cca_projection (ZAYA)": ("ZayaConfig", dict(
        layer_types=["hybrid", "hybrid"], num_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=64, router_hidden_size=32, cca_time0=2, cca_time1=2)),
}  # fmt: skip
ROWS, MAX_LEN = 2, 512
REPEATS = 3


# families without attention: transformers loads them with its default (eager) implementation
# only, and flexpack adapts their mixers when handed the model (packed_forward_kwargs(model=))
NO_ATTENTION = ("RWKV", "xLSTM")


def _model(kind: str, attn: str):
    import transformers

    name, kwargs = FAMILIES[kind]
    config = getattr(transformers, name)(**{**WIDTH, "num_hidden_layers": 2, **kwargs})
    if not any(n in kind for n in NO_ATTENTION):
        config._attn_implementation = attn
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_config(config).train()


def _flexpack_kwargs(model, batch) -> dict:
    """``packed_forward_kwargs`` for ``model``: the model handed over (its mixers adapted; the
    keywords its forward takes) where it has no attention."""
    from flexpack.integrations.transformers import packed_forward_kwargs

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if getattr(model.config, "_attn_implementation", None) in (None, "eager"):
            return packed_forward_kwargs(batch, model=model)
        return packed_forward_kwargs(batch)


def _rows():
    g = torch.Generator().manual_seed(0)
    docs = []
    while sum(len(d) for d in docs) < ROWS * MAX_LEN * 0.95:
        docs.append(torch.randint(3, 512, (int(torch.randint(32, 160, (1,), generator=g)),)))
    batch = flexpack.pack_sequences(docs, max_len=MAX_LEN)
    return batch


def _timed(step, repeats: int = REPEATS) -> float:
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        step()
        if i:  # the first call warms up
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _step_time(model, kwargs) -> float:
    def step():
        model.zero_grad(set_to_none=True)
        model(**kwargs).logits.float().sum().backward()

    return _timed(step)


def _per_group_step(model, kwargs) -> float:
    """The model's step with every one pass declined (each class's self-check verdict set to
    False meanwhile): the per-group calls every room has."""
    from flexpack import mixers

    model(**kwargs)  # adapted, and each class checked, at its first forward
    verdicts = [room.one_pass.verified for room in mixers.ROOMS if room.one_pass is not None]
    saved = [dict(v) for v in verdicts]
    for v in verdicts:
        v.update(dict.fromkeys(v, False))
    try:
        return _step_time(model, kwargs)
    finally:
        for v, old in zip(verdicts, saved, strict=True):
            v.update(old)


def short_conv_paths(batch, own_kwargs) -> None:
    """The short conv's own torch path, flexpack's per-group calls and its one pass: the
    model's step, and the conv layer alone (forward + backward on the rows' hidden states)."""
    from flexpack.integrations.transformers import packed_forward_kwargs, register
    from flexpack.mixers import conv

    kind = "short_conv (LFM2)"
    own_model, model = _model(kind, "sdpa"), _model(kind, register())
    kwargs = packed_forward_kwargs(batch)
    model(**kwargs)  # adapted at its first forward
    mixer = model.get_submodule("model.layers.0.conv")
    cls = type(mixer)
    x = torch.randn(*batch.doc_ids.shape, model.config.hidden_size, requires_grad=True)

    def layer(call):
        def step():
            x.grad = None
            call().sum().backward()

        return _timed(step, 10 * REPEATS)

    rows = {
        "own torch path over the rows (leaks)": (
            _step_time(own_model, own_kwargs),
            layer(lambda: cls.forward(mixer, x)),
        )
    }
    checked = conv.SHORT_CONV.one_pass.verified
    verified = checked.get(cls)
    checked[cls] = False  # what the room ran before the one pass: per-group calls
    try:
        rows["flexpack, per group of documents"] = (
            _step_time(model, kwargs),
            layer(lambda: mixer(x, doc_ids=batch.doc_ids)),
        )
    finally:
        checked[cls] = verified if verified is not None else True
    rows["flexpack, one pass (masked taps)"] = (
        _step_time(model, kwargs),
        layer(lambda: mixer(x, doc_ids=batch.doc_ids)),
    )
    base_step, base_layer = rows["flexpack, per group of documents"]
    print()
    print("| short conv (LFM2) path | model step (s) | per group / this | conv layer (ms) "
          "| per group / this |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name, (step, alone) in rows.items():
        print(f"| {name} | {step:.3f} | {base_step / step:.2f}x | {alone * 1e3:.2f} "
              f"| {base_layer / alone:.2f}x |")  # fmt: skip


def main() -> None:
    from flexpack.integrations.transformers import register

    torch.set_num_threads(torch.get_num_threads())  # torch's default threads
    batch = _rows()
    real = int((batch.doc_ids >= 0).sum())
    print(f"{describe()}; torch {torch.__version__}; {batch.input_ids.shape[0]} rows x "
          f"{MAX_LEN}, {real} real tokens in {len(batch.seqlens)} documents; "
          f"forward + backward, median of {REPEATS}")  # fmt: skip
    print()
    print("| mixer (family) | own torch path, sdpa (s) | flexpack per group (s) | flexpack "
          "one pass (s) | own / one pass | per group / one pass |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    own_kwargs = {"input_ids": batch.input_ids.long(), "position_ids": batch.position_ids.long(),
                  "use_cache": False}  # fmt: skip
    only = sys.argv[1] if len(sys.argv) > 1 else ""
    for kind in [k for k in FAMILIES if only in k]:
        own_model = _model(kind, "sdpa")
        own_call = {k: v for k, v in own_kwargs.items() if k != "position_ids"} if any(
            n in kind for n in NO_ATTENTION
        ) else own_kwargs  # fmt: skip
        own = _step_time(own_model, own_call)
        model = _model(kind, register())
        kwargs = _flexpack_kwargs(model, batch)
        grouped = _per_group_step(model, kwargs)
        ours = _step_time(model, kwargs)
        print(f"| {kind} | {own:.3f} | {grouped:.3f} | {ours:.3f} | {own / ours:.2f}x "
              f"| {grouped / ours:.2f}x |", flush=True)  # fmt: skip
    if "short_conv (LFM2)" in [k for k in FAMILIES if only in k]:
        short_conv_paths(batch, own_kwargs)
    print(f"\nload average at the end: {__import__('os').getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
