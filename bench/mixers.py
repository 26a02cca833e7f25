"""Packed rows through hybrid models on CPU: flexpack.mixers vs the family's own torch path.

For each kind of recurrent / conv token mixer, one small model of a family that has it (two
layers: the mixer, then full attention), a training step (forward + backward) on the same
packed rows:

- ``own``: the model as a user of transformers runs packed rows (``attn_implementation="sdpa"``,
  ``position_ids`` restarting per document, transformers' packed-sequence rule for attention,
  its torch mixer over the whole row: the documents' states leak, the number is its speed only);
- ``flexpack``: ``attn_implementation=register()`` with ``packed_forward_kwargs`` (the mixers
  adapted, run per group of documents; attention per document).

Run: ``PYTHONPATH=$PWD python bench/mixers.py`` (about 1 minute on a quiet 2-core CPU; a word
after it keeps only the families whose name has it, e.g. ``ZAYA``). Prints a markdown table;
the ratio is own / flexpack (above 1: flexpack faster).
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
    "lightning_attention (MiniMax)": ("MiniMaxConfig", dict(
        layer_types=["linear_attention", "full_attention"], block_size=64,
        num_local_experts=1, num_experts_per_tok=1)),
    "short_conv (LFM2)": ("Lfm2Config", dict(
        layer_types=["conv", "full_attention"], full_attn_idxs=[1], conv_L_cache=3)),
    "cca_projection (ZAYA)": ("ZayaConfig", dict(
        layer_types=["hybrid", "hybrid"], num_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=64, router_hidden_size=32, cca_time0=2, cca_time1=2)),
}  # fmt: skip
ROWS, MAX_LEN = 2, 512
REPEATS = 3


def _model(kind: str, attn: str):
    import transformers

    name, kwargs = FAMILIES[kind]
    config = getattr(transformers, name)(**{**WIDTH, **kwargs}, num_hidden_layers=2)
    config._attn_implementation = attn
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_config(config).train()


def _rows():
    g = torch.Generator().manual_seed(0)
    docs = []
    while sum(len(d) for d in docs) < ROWS * MAX_LEN * 0.95:
        docs.append(torch.randint(3, 512, (int(torch.randint(32, 160, (1,), generator=g)),)))
    batch = flexpack.pack_sequences(docs, max_len=MAX_LEN)
    return batch


def _step_time(model, kwargs) -> float:
    times = []
    for i in range(REPEATS + 1):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        model(**kwargs).logits.float().sum().backward()
        if i:  # the first call warms up
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    from flexpack.integrations.transformers import packed_forward_kwargs, register

    torch.set_num_threads(torch.get_num_threads())  # torch's default threads
    batch = _rows()
    real = int((batch.doc_ids >= 0).sum())
    print(f"{describe()}; torch {torch.__version__}; {batch.input_ids.shape[0]} rows x "
          f"{MAX_LEN}, {real} real tokens in {len(batch.seqlens)} documents; "
          f"forward + backward, median of {REPEATS}")  # fmt: skip
    print()
    print("| mixer (family) | own torch path, sdpa (s) | flexpack (s) | own / flexpack |")
    print("|---|---|---|---|")
    own_kwargs = {"input_ids": batch.input_ids.long(), "position_ids": batch.position_ids.long(),
                  "use_cache": False}  # fmt: skip
    only = sys.argv[1] if len(sys.argv) > 1 else ""
    for kind in [k for k in FAMILIES if only in k]:
        own = _step_time(_model(kind, "sdpa"), own_kwargs)
        ours = _step_time(_model(kind, register()), packed_forward_kwargs(batch))
        print(f"| {kind} | {own:.3f} | {ours:.3f} | {own / ours:.2f}x |", flush=True)
    print(f"\nload average at the end: {__import__('os').getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
