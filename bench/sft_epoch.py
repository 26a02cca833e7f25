"""One SFT epoch as users run it: flexpack's ``SFTTrainer`` drop-in vs ``trl.SFTTrainer`` (CPU).

Three trainers on the same prompt-completion samples, the same model init (seed 0) and the same
``SFTConfig`` otherwise (TRL's defaults: bf16 autocast, completion-only loss, batch 8,
``max_length`` 1024; ``use_cpu=True``, one epoch):

- ``TRL default``: ``trl.SFTTrainer`` as installed, no packing: batches of 8 samples padded to
  the longest, the model's ``sdpa`` attention;
- ``TRL packing=True``: its BFD packing with padding-free rows on ``sdpa``. transformers refuses
  padding-free rows on hybrid models without the CUDA kernels (causal-conv1d, fla), so on CPU
  this column reads ``refused`` for Qwen3.5 and LFM2: TRL's best correct configuration there is
  its default;
- ``flexpack``: ``flexpack.integrations.trl.SFTTrainer`` (one import changed).

Time is ``train()``'s wall time (dataset preparation excluded, timed apart); tokens per second
count the epoch's real tokens (TRL's ``num_tokens``, padding excluded), the same on every side.
Models: Llama, Qwen3.5 (gated delta rule), LFM2 (short conv); ``tiny`` (hidden 256, 4 layers,
vocab 1024) and ``100m`` (hidden 768, 10 layers, vocab 16384: 90-100M parameters).

Run: ``PYTHONPATH=$PWD python bench/sft_epoch.py [--shape tiny|100m|both] [--only Llama]``
(tiny: about 4 minutes, 100m: about 12 minutes on a quiet 2-core CPU). Ratios are within one run;
the load average is printed at start and end.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _machine import describe
from sft import samples, tokenizer_of

MIXED = ["linear_attention"] * 3 + ["full_attention"]
FAMILIES = {  # name: (config class, kwargs for a 4-layer stack; layer types repeat per 4)
    "Llama": ("LlamaConfig", lambda n: {}),
    "Qwen3.5": ("Qwen3_5TextConfig", lambda n: dict(
        layer_types=(MIXED * n)[:n], linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4)),
    "LFM2": ("Lfm2Config", lambda n: dict(
        layer_types=(["conv"] * 3 + ["full_attention"]) * (n // 4) + ["conv"] * (n % 4),
        full_attn_idxs=[i for i in range(n) if i % 4 == 3], conv_L_cache=3)),
}  # fmt: skip
SHAPES = {  # name: (width, samples in the epoch)
    "tiny": (dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, vocab=1024), 384),
    "100m": (dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=10, vocab=16384), 64),
}


def _model(transformers, family: str, width: dict, attn: str):
    cls, kwargs = FAMILIES[family]
    vocab = width["vocab"]
    config = getattr(transformers, cls)(
        vocab_size=vocab, pad_token_id=vocab - 3, eos_token_id=vocab - 2, bos_token_id=None,
        hidden_size=width["hidden_size"], intermediate_size=width["intermediate_size"],
        num_hidden_layers=width["num_hidden_layers"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=width["hidden_size"] // 4,
        max_position_embeddings=2048, **kwargs(width["num_hidden_layers"]),
    )  # fmt: skip
    config._attn_implementation = attn
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_config(config)


def _epoch(trainer_cls, model, data, tokenizer, config) -> dict:
    from transformers.trainer_callback import PrinterCallback

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        try:
            trainer = trainer_cls(
                model=model, args=config, train_dataset=data, processing_class=tokenizer
            )
            trainer.remove_callback(PrinterCallback)  # no log lines between the table's rows
            prepare = time.perf_counter() - start
            start = time.perf_counter()
            trainer.train()
        except Exception as e:  # a configuration the installed stack refuses
            return {"refused": f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"}
        seconds = time.perf_counter() - start
    tokens = trainer.state.num_input_tokens_seen or max(
        (h.get("num_tokens", 0) for h in trainer.state.log_history), default=0
    )
    loss = [h["train_loss"] for h in trainer.state.log_history if "train_loss" in h]
    return {
        "prepare": prepare,
        "seconds": seconds,
        "tokens": int(tokens),
        "tokens_per_s": tokens / seconds,
        "steps": trainer.state.global_step,
        "loss": loss[-1] if loss else float("nan"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="tiny", choices=["tiny", "100m", "both"])
    parser.add_argument("--only", default="", help="keep the families whose name has this")
    parser.add_argument("--samples", type=int, default=None, help="samples in the epoch")
    args = parser.parse_args(argv)

    import datasets
    import transformers
    import trl

    from flexpack.integrations.trl import SFTTrainer

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    print(f"# {describe()}; torch {torch.__version__}, transformers {transformers.__version__}, "
          f"trl {trl.__version__}, {torch.get_num_threads()} threads; "
          f"load average {os.getloadavg()[0]:.1f} at start")  # fmt: skip
    out = tempfile.mkdtemp()
    shapes = ["tiny", "100m"] if args.shape == "both" else [args.shape]
    print("\n| model | shape | params | samples | real tokens | TRL default (s) "
          "| TRL packing=True (s) | flexpack (s) | flexpack tokens/s | vs TRL default "
          "| vs TRL packing=True | steps: default, packing, flexpack |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for shape in shapes:
        width, n = SHAPES[shape]
        n = args.samples or n
        tokenizer = tokenizer_of(transformers, width["vocab"])
        data = samples(datasets, n, width["vocab"])
        for family in FAMILIES:
            if args.only not in family:
                continue

            def config(name: str, where: str = f"{shape}-{family}", **kw):
                return trl.SFTConfig(
                    output_dir=os.path.join(out, f"{where}-{name}"), num_train_epochs=1,
                    use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
                    logging_steps=1, **kw,
                )  # fmt: skip

            runs = {}
            for name, cls, attn, kw in (
                ("default", trl.SFTTrainer, "sdpa", {}),
                ("packing", trl.SFTTrainer, "sdpa", {"packing": True}),
                ("flexpack", SFTTrainer, "sdpa", {}),
            ):
                model = _model(transformers, family, width, attn)
                runs[name] = _epoch(cls, model, data, tokenizer, config(name, **kw))
                print(f"  {family} {shape} {name}: {runs[name]}", file=sys.stderr, flush=True)
            params = sum(p.numel() for p in model.parameters()) / 1e6
            ours = runs["flexpack"]

            def cell(r):
                return "refused" if "refused" in r else f"{r['seconds']:.1f}"

            def vs(r, ours=ours):
                return "-" if "refused" in r or "refused" in ours else (
                    f"{r['seconds'] / ours['seconds']:.2f}x")  # fmt: skip

            steps = ", ".join(str(r.get("steps", "-")) for r in runs.values())
            tokens = runs["default"].get("tokens", 0)  # real tokens: the same on every side
            rate = tokens / ours["seconds"] if "seconds" in ours else 0
            print(f"| {family} | {shape} | {params:.0f}M | {n} | {tokens} | "
                  f"{cell(runs['default'])} | {cell(runs['packing'])} | {cell(ours)} | "
                  f"{rate:.0f} | {vs(runs['default'])} | "
                  f"{vs(runs['packing'])} | {steps} |", flush=True)  # fmt: skip
            for name, r in runs.items():
                if "refused" in r:
                    print(f"  ({family} {shape} {name}: {r['refused']})", flush=True)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
