"""Packed SFT steps on hybrid models: flexpack's packed rows vs the same samples padded (CPU).

One training step (forward + backward of the summed logits) over the same samples, three ways:

- ``padded, sdpa``: what a user without packing runs (TRL's ``packing=False``): each sample its
  own row, right-padded to the longest, an ``attention_mask``, the model's own ``sdpa``
  attention and torch mixers;
- ``flexpack, per group``: the samples packed into rows of ``ROW`` tokens by
  ``flexpack.pack_sequences``, ``attn_implementation=register()`` and ``packed_forward_kwargs``,
  with the recurrent / conv mixers run once per group of right-padded documents (the path
  every room has);
- ``flexpack, one pass``: the same, with the mixers that have one (the short conv, the gated
  delta rule, KDA, Mamba2, Mamba) run once over the whole rows with the documents kept apart
  inside.

Models: a Llama (attention only) for scale, LFM2 (short convs), Qwen3.5 (gated delta rule),
Bamba (Mamba2), Kimi Linear (KDA), Jamba (Mamba); hidden 256, 4 layers (3 mixers then
attention; Llama: 4 attention layers), fp32, torch's default threads. The ratio is real
tokens per second over the padded path's. Peak is the peak of live tensor bytes during one
step (torch's profiler).

Run: ``PYTHONPATH=$PWD python bench/hybrid_sft.py`` (about 6 minutes on a quiet 2-core CPU).
``--device cuda`` runs the same on a GPU (no fla / causal-conv1d / mamba_ssm needed: the
torch paths are what is timed; peak is ``torch.cuda.max_memory_allocated`` there), and a word
keeps only the models whose name has it (``--only Qwen``; Jamba, whose own torch scan takes one
Python step per token, runs only when asked: ``--only Jamba``).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _machine import describe, tensor_peak

import flexpack

WIDTH = dict(
    vocab_size=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_size=256,
    intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    max_position_embeddings=4096, num_hidden_layers=4,
)  # fmt: skip
MIXED = ["linear_attention"] * 3 + ["full_attention"]
FAMILIES = {  # name: (config class, kwargs)
    "Llama (attention)": ("LlamaConfig", {}),
    "LFM2 (short conv)": ("Lfm2Config", dict(
        layer_types=["conv"] * 3 + ["full_attention"], full_attn_idxs=[3], conv_L_cache=3)),
    "Qwen3.5 (gated delta rule)": ("Qwen3_5TextConfig", dict(
        layer_types=MIXED, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4)),
    "Bamba (Mamba2)": ("BambaConfig", dict(
        attn_layer_indices=[3], mamba_chunk_size=64, mamba_d_conv=4, mamba_expand=2,
        mamba_n_heads=8, mamba_d_head=64, mamba_d_state=32)),
    "Kimi Linear (KDA)": ("KimiLinearConfig", dict(
        layer_types=MIXED, num_experts=2, num_experts_per_token=1, moe_intermediate_size=128,
        first_k_dense_replace=4, q_lora_rank=None, kv_lora_rank=64, qk_rope_head_dim=32,
        qk_nope_head_dim=32, v_head_dim=64, num_key_value_heads=4, linear_head_dim=64,
        linear_num_heads=4)),
    "Jamba (Mamba)": ("JambaConfig", dict(
        attn_layer_period=4, attn_layer_offset=3, num_experts=1, mamba_d_conv=4,
        mamba_expand=2, mamba_d_state=16, mamba_dt_rank=16)),
}  # fmt: skip
ROW, ROWS, REPEATS = 2048, 2, 3
SLOW = {"Jamba (Mamba)"}  # run with --only Jamba


DEVICE = torch.device("cpu")


def _model(name: str, attn: str):
    import transformers

    cls, kwargs = FAMILIES[name]
    config = getattr(transformers, cls)(**{**WIDTH, **kwargs})
    config._attn_implementation = attn
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_config(config).to(DEVICE).train()


def _samples() -> list[torch.Tensor]:
    """SFT-like lengths (log-normal, 24 to 1,000 tokens) filling about ROWS rows."""
    g = torch.Generator().manual_seed(0)
    docs: list[torch.Tensor] = []
    while sum(len(d) for d in docs) < ROWS * ROW * 0.97:
        n = int(torch.empty(1).log_normal_(5.3, 0.7, generator=g).clamp(24, 1000))
        if sum(len(d) for d in docs) + n > ROWS * ROW:
            break
        docs.append(torch.randint(3, 1024, (n,), generator=g))
    return docs


def _padded(docs):
    longest = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), longest, dtype=torch.long)
    mask = torch.zeros(len(docs), longest, dtype=torch.long)
    for i, d in enumerate(docs):
        ids[i, : len(d)], mask[i, : len(d)] = d, 1
    return {"input_ids": ids.to(DEVICE), "attention_mask": mask.to(DEVICE), "use_cache": False}


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _timed(step) -> float:
    times = []
    for i in range(REPEATS + 1):
        _sync()
        t0 = time.perf_counter()
        step()
        _sync()
        if i:  # the first call warms up (and runs the one-pass self-checks)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _peak(step) -> int:
    if DEVICE.type != "cuda":
        return tensor_peak(step)
    torch.cuda.reset_peak_memory_stats()
    step()
    return torch.cuda.max_memory_allocated()


def _measure(model, kwargs) -> tuple[float, int]:
    def step():
        model.zero_grad(set_to_none=True)
        model(**kwargs).logits.float().sum().backward()

    seconds = _timed(step)
    return seconds, _peak(step)


def _one_pass_hooks():
    from flexpack.mixers import ROOMS

    return [r.one_pass for r in ROOMS if hasattr(r.one_pass, "verified")]


def main() -> None:
    import argparse

    from flexpack.integrations.transformers import packed_forward_kwargs, register

    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--only", default="", help="keep the models whose name has this")
    args = parser.parse_args()
    DEVICE = torch.device(args.device)
    docs = _samples()
    real = sum(len(d) for d in docs)
    batch = flexpack.pack_sequences(docs, max_len=ROW).to(DEVICE)
    padded = _padded(docs)
    slots = padded["input_ids"].numel()
    where = torch.cuda.get_device_name() if DEVICE.type == "cuda" else describe()
    print(f"{where}; torch {torch.__version__}; {len(docs)} samples, {real} tokens: "
          f"packed {tuple(batch.input_ids.shape)} ({real / batch.input_ids.numel():.0%} fill), "
          f"padded {tuple(padded['input_ids'].shape)} ({real / slots:.0%} real); forward + "
          f"backward, fp32, median of {REPEATS}")  # fmt: skip
    print()
    print("| model | padded, sdpa (s) | flexpack, per group (s) | flexpack, one pass (s) "
          "| one pass / padded, tokens/s | one pass / per group | peak MiB: padded, "
          "per group, one pass |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    names = [n for n in FAMILIES if args.only in n]
    if not args.only:  # Jamba's own torch scan steps token by token: minutes a step, on request
        names = [n for n in names if n not in SLOW]
    for name in names:
        pad_s, pad_peak = _measure(_model(name, "sdpa"), padded)
        model = _model(name, register())
        kwargs = packed_forward_kwargs(batch, model=model)
        hooks = _one_pass_hooks()
        saved = [dict(h.verified) for h in hooks]
        model(**kwargs)  # adapts the mixers, runs the self-checks
        classes = {type(m) for m in model.modules()}
        for h in hooks:  # per group: the path every room has
            h.verified.update({c: False for c in classes})
        group_s, group_peak = _measure(model, kwargs)
        for h, s in zip(hooks, saved, strict=True):
            h.verified.clear()
            h.verified.update(s)
        one_s, one_peak = _measure(model, kwargs)
        mib = 2**20
        print(f"| {name} | {pad_s:.3f} | {group_s:.3f} | {one_s:.3f} | "
              f"**{pad_s / one_s:.2f}x** | {group_s / one_s:.2f}x | {pad_peak / mib:.0f}, "
              f"{group_peak / mib:.0f}, {one_peak / mib:.0f} |", flush=True)  # fmt: skip
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
