"""What flexpack.check costs a training run: the first call on a kind of model, a forced rerun,
and every later call (the verdict kept per process), beside one training step of the same model.

    python bench/check.py

Models: a tiny Llama (copied in float64: the probe is a copy), a tiny Qwen3.5 (gated delta rule
and attention, copied) and a full-size Llama 3 8B config on the meta device (no weights: the
probe is a tiny model of the class built from its config). Each call runs in this process after
the model is built; "first" includes flexpack's and transformers' lazy imports of the probe path.
"""

from __future__ import annotations

import time
import warnings

import torch

import flexpack
from bench._machine import describe


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2))  # fmt: skip


def _tiny_qwen35():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=8, linear_value_head_dim=8,
                               layer_types=["linear_attention", "full_attention"])  # fmt: skip
    return Qwen3_5ForCausalLM(config)


def _llama_8b_on_meta():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8,
    )  # fmt: skip
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    print(f"{describe()}; torch {torch.__version__}, transformers {transformers.__version__}")
    print()
    print("| model | probe | first call (s) | forced rerun (s) | later calls (ms) |")
    print("|---|---|---:|---:|---:|")
    models = (
        ("tiny Llama", _tiny_llama),
        ("tiny Qwen3.5 (gated delta rule)", _tiny_qwen35),
        ("Llama 3 8B config on meta", _llama_8b_on_meta),
    )
    for name, build in models:
        model = build()
        flexpack.clear_caches()
        first = _timed(lambda m=model: flexpack.check(m, force=True))
        forced = _timed(lambda m=model: flexpack.check(m, force=True))
        later = min(_timed(lambda m=model: flexpack.check(m)) for _ in range(20))
        report = flexpack.check(model)
        print(f"| {name} | {report.probe} | {first:.2f} | {forced:.2f} | {later * 1e3:.2f} |")


if __name__ == "__main__":
    main()
