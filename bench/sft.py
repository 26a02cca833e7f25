"""Packed SFT, timed: flexpack's ``SFTTrainer`` drop-in vs TRL's own packing, same data.

- TRL: ``trl.SFTTrainer`` with ``packing=True, padding_free=True`` (BFD per ``map`` batch; each
  micro-batch is one padding-free row of ``per_device_train_batch_size`` packed rows), the model
  on ``attn_implementation="sdpa"`` (what a TRL user without flash-attn runs); the rest at TRL's
  defaults (bf16 autocast, gradient checkpointing, completion-only loss).
- flexpack: ``flexpack.integrations.trl.SFTTrainer``, the same ``SFTConfig`` (one BFD plan over
  the whole dataset; each micro-batch (R, max_length) rows on flexpack attention).

Same tiny Qwen3 from the same seed, same prompt-completion samples (20-200 tokens each), same
steps. A step's time is from Trainer's ``on_step_begin`` to ``on_step_end`` (the forward,
backward and optimizer step of one micro-batch); the first step of each run is dropped
(warm-up). tokens/s counts real tokens (TRL's ``num_tokens``), not padding.

    python bench/sft.py [--samples 200] [--max-length 512] [--steps 8] [--threads 2] [--fp32]

CPU times are ratios within this run only; the load average is printed at start and end.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _machine import describe


def tokenizer_of(transformers, vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"t{i}": i for i in range(vocab - 3)}
    words |= {"<pad>": vocab - 3, "</s>": vocab - 2, "<unk>": vocab - 1}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


def samples(datasets, n: int, vocab: int, seed: int = 0):
    """Prompt-completion pairs of 20-200 tokens in all (EOS included), a third of it prompt."""
    g = torch.Generator().manual_seed(seed)

    def text(k: int) -> str:
        return " ".join(f"t{i}" for i in torch.randint(0, vocab - 3, (k,), generator=g).tolist())

    prompts, completions = [], []
    for total in torch.randint(19, 200, (n,), generator=g).tolist():
        p = max(1, total // 3)
        prompts.append(text(p))
        completions.append(" " + text(total - p))
    return datasets.Dataset.from_dict({"prompt": prompts, "completion": completions})


def tiny_qwen3(transformers, attn: str, *, hidden: int, layers: int, vocab: int):
    config = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=hidden // 4, pad_token_id=vocab - 3, eos_token_id=vocab - 2,
        attn_implementation=attn,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(config)


def run(trainer_cls, model, data, tokenizer, config) -> dict:
    import transformers

    times: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *_a, **_k):
            self.t = time.perf_counter()

        def on_step_end(self, *_a, **_k):
            times.append(time.perf_counter() - self.t)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        trainer = trainer_cls(
            model=model, args=config, train_dataset=data, processing_class=tokenizer,
            callbacks=[Clock()],
        )  # fmt: skip
        prepare = time.perf_counter() - start
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    tokens = [b["num_tokens"] - a["num_tokens"] for a, b in itertools.pairwise(logs)]
    first = logs[0]["num_tokens"]
    timed = times[1:]  # the first step warms up
    rows = len(trainer.train_dataset)
    return {
        "prepare": prepare,
        "rows": rows,
        "step": statistics.median(timed),
        "tokens_per_step": sum(tokens) / len(tokens),
        "tokens_per_s": sum(tokens) / sum(timed),
        "first_tokens": first,
        "loss": logs[-1]["loss"],
        "stats": getattr(trainer, "flexpack_stats", None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2, help="per_device_train_batch_size")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--fp32", action="store_true", help="bf16=False (TRL's default is True)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import datasets
    import transformers
    import trl

    from flexpack.integrations.trl import SFTTrainer

    print(f"# {describe()}; torch {torch.__version__}, transformers {transformers.__version__}, "
          f"trl {trl.__version__}, {args.threads} threads")  # fmt: skip
    tokenizer = tokenizer_of(transformers, args.vocab)
    data = samples(datasets, args.samples, args.vocab)
    size = dict(hidden=args.hidden, layers=args.layers, vocab=args.vocab)
    out = tempfile.mkdtemp()

    def config(name: str, **kw):
        return trl.SFTConfig(
            output_dir=os.path.join(out, name), max_length=args.max_length,
            per_device_train_batch_size=args.batch, max_steps=args.steps, logging_steps=1,
            use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
            **({"bf16": False} if args.fp32 else {}), **kw,
        )  # fmt: skip

    trl_run = run(
        trl.SFTTrainer, tiny_qwen3(transformers, "sdpa", **size), data, tokenizer,
        config("trl", packing=True, padding_free=True),
    )  # fmt: skip
    ours = run(
        SFTTrainer, tiny_qwen3(transformers, "sdpa", **size), data, tokenizer, config("flexpack")
    )
    end = os.getloadavg()[0]

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x"

    rows = [
        ("packed rows in the dataset", trl_run["rows"], ours["rows"], ""),
        ("real tokens per step", f"{trl_run['tokens_per_step']:.0f}",
         f"{ours['tokens_per_step']:.0f}", ""),
        ("time per step (median, s)", f"{trl_run['step']:.3f}", f"{ours['step']:.3f}",
         ratio(trl_run["step"], ours["step"])),
        ("tokens/s", f"{trl_run['tokens_per_s']:.0f}", f"{ours['tokens_per_s']:.0f}",
         ratio(ours["tokens_per_s"], trl_run["tokens_per_s"])),
        ("dataset preparation (s)", f"{trl_run['prepare']:.2f}", f"{ours['prepare']:.2f}", ""),
        ("last loss", f"{trl_run['loss']:.3f}", f"{ours['loss']:.3f}", ""),
    ]  # fmt: skip
    precision = "fp32" if args.fp32 else "bf16 autocast"
    print(f"\n{args.samples} samples of 20-200 tokens, max_length {args.max_length}, "
          f"{args.batch} rows per step, {args.steps} steps, tiny Qwen3 (hidden {args.hidden}, "
          f"{args.layers} layers, vocab {args.vocab}), {precision}\n")  # fmt: skip
    head = "TRL packing=True, padding_free=True (sdpa) | flexpack SFTTrainer | flexpack speed-up"
    print(f"| | {head} |")
    print("|---|---:|---:|---:|")
    for name, a, b, r in rows:
        print(f"| {name} | {a} | {b} | {r} |")
    s = ours["stats"]
    print(f"\nflexpack_stats: {s.rows} rows, fill {s.fill:.3f}, {s.tokens} tokens, "
          f"{s.padding_removed} padding tokens removed vs unpacked batches")  # fmt: skip
    print(f"# load average at end: {end:.1f}")


if __name__ == "__main__":
    main()
