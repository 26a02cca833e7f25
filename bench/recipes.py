"""The training recipes of docs/integrations.md, timed: flexpack attention vs TRL's own sdpa path.

One run, same data, same tiny Llama, same steps; only ``attn_implementation`` differs:

- TRL ``SFTTrainer``, its defaults (``packing=True`` BFD, padding-free rows, ``bf16=True``
  autocast, completion-only loss), ``attn_implementation="sdpa"`` (what a TRL user without
  flash-attn runs) vs ``register()`` (flexpack).
- ``DataCollatorWithFlattening`` batches in a plain loop (fp32), sdpa vs flexpack.

And the leak check behind docs/integrations.md's claims: the largest |logit difference| of packed
rows against each document alone, for transformers' sdpa and flexpack, under the calls users make:
a Trainer-style call (``use_cache=False``, no ``attention_mask``, as Trainer and SFTTrainer do),
a raw call with ``use_cache`` left at its default, and a call with a 2-D ``attention_mask``.

    python bench/recipes.py [--steps 20] [--threads N]

CPU times are ratios within this run only.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import tempfile
import time

import torch


def tiny_llama(transformers, attn: str, *, hidden: int, layers: int, vocab: int, init=0.02):
    config = transformers.LlamaConfig(
        initializer_range=init,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=vocab - 3,
        eos_token_id=vocab - 2,
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def word_tokenizer(transformers):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(256)} | {"<pad>": 256, "</s>": 257, "<unk>": 258}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    return tok, len(vocab)


def lognormal(g: torch.Generator, n: int, median: float, hi: int) -> list[int]:
    x = torch.exp(torch.randn(n, generator=g) * 0.8) * median
    return x.round().clamp(1, hi).long().tolist()


def _Clock(transformers):
    """A TrainerCallback that records each optimizer step's wall time."""

    class Clock(transformers.TrainerCallback):
        times: list[float]

        def on_step_begin(self, *args, **kwargs):
            self.t = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            self.times.append(time.perf_counter() - self.t)

    clock = Clock()
    clock.times = []
    return clock


def bench_sft(args, transformers, flexpack_name) -> list[tuple]:
    import datasets
    import trl

    tok, vocab = word_tokenizer(transformers)
    g = torch.Generator().manual_seed(0)

    def text(n):
        return " ".join(f"t{i}" for i in torch.randint(0, 256, (n,), generator=g).tolist())

    n = args.steps * args.batch * 6
    data = datasets.Dataset.from_dict(
        {
            "prompt": [text(k) for k in lognormal(g, n, 120, 400)],
            "completion": [" " + text(k) for k in lognormal(g, n, 60, 200)],
        }
    )
    rows = []
    for attn in ("sdpa", flexpack_name):
        with tempfile.TemporaryDirectory() as out:
            config = trl.SFTConfig(
                output_dir=out, packing=True, max_length=args.max_len,
                per_device_train_batch_size=args.batch, max_steps=args.steps + 2,
                logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                disable_tqdm=True,
            )  # fmt: skip
            model = tiny_llama(
                transformers, attn, hidden=args.hidden, layers=args.layers, vocab=vocab
            )
            trainer = trl.SFTTrainer(
                model=model, args=config, train_dataset=data, processing_class=tok
            )
            clock = _Clock(transformers)
            trainer.add_callback(clock)
            trainer.train()
            times = clock.times
            logged = [h["num_tokens"] for h in trainer.state.log_history if "num_tokens" in h]
            tokens = [b - a for a, b in zip([0, *logged[:-1]], logged, strict=True)]
            # The first two steps warm up (allocations, the first mask); time the rest.
            t = sum(times[2:])
            rows.append(
                (
                    "TRL SFTTrainer, packing=True, bf16",
                    attn,
                    t / len(times[2:]),
                    sum(tokens[2:]) / t,
                )
            )
    return rows


def bench_flattening(args, transformers, flexpack_name) -> list[tuple]:
    from torch.utils.data import DataLoader

    g = torch.Generator().manual_seed(1)
    samples = []
    for k in lognormal(g, args.steps * args.batch * 4 + 8, 180, args.max_len):
        ids = torch.randint(0, 256, (k,), generator=g).tolist()
        samples.append({"input_ids": ids, "labels": [-100] * (k // 3) + ids[k // 3 :]})
    rows = []
    for attn in ("sdpa", flexpack_name):
        model = tiny_llama(transformers, attn, hidden=args.hidden, layers=args.layers, vocab=259)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = DataLoader(
            samples, batch_size=args.batch * 4,
            collate_fn=transformers.DataCollatorWithFlattening(return_seq_idx=True),
        )  # fmt: skip
        times, tokens = [], []
        for _, batch in zip(range(args.steps + 2), loader, strict=False):
            t = time.perf_counter()
            model(**batch, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t)
            tokens.append(batch["input_ids"].numel())
        t = sum(times[2:])
        rows.append(
            ("DataCollatorWithFlattening loop, fp32", attn, t / len(times[2:]), sum(tokens[2:]) / t)
        )
    return rows


def leak_table(transformers, flexpack_name) -> list[tuple]:
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, 256, (n,), generator=g) for n in (200, 60, 300, 140)]
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    # initializer_range 0.2: large enough weights that a leak between documents shows.
    base = tiny_llama(transformers, "sdpa", hidden=64, layers=2, vocab=259, init=0.2).eval()
    out = []
    for attn in ("sdpa", flexpack_name):
        model = copy.deepcopy(base)
        model.set_attn_implementation(attn)
        ref = copy.deepcopy(base)
        ref.set_attn_implementation("sdpa")
        with torch.no_grad():
            alone = torch.cat([ref(input_ids=d[None], use_cache=False).logits[0] for d in docs])
            calls = {
                "Trainer-style: use_cache=False, no attention_mask": dict(use_cache=False),
                "raw call, use_cache default": {},
                "2-D attention_mask (all ones)": dict(attention_mask=torch.ones_like(ids)),
            }
            for what, kw in calls.items():
                got = model(input_ids=ids, position_ids=pos, **kw).logits[0]
                out.append((attn, what, (got - alone).abs().max().item()))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (after 2 warm-up)")
    p.add_argument("--batch", type=int, default=2, help="per-device batch size (TRL)")
    p.add_argument("--max-len", type=int, default=1024, help="TRL max_length; longest sample")
    p.add_argument("--hidden", type=int, default=256, help="Llama hidden size")
    p.add_argument("--layers", type=int, default=4, help="Llama layers")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers
    import trl

    from flexpack.integrations.transformers import register

    name = register()
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"load {os.getloadavg()[0]:.1f}, torch {torch.__version__}, threads "
        f"{torch.get_num_threads()}, transformers {transformers.__version__}, trl {trl.__version__}"
    )
    print(
        f"# Llama hidden {args.hidden}, {args.layers} layers, 4 q / 2 kv heads; "
        f"{args.steps} timed steps\n"
    )
    rows = bench_sft(args, transformers, name) + bench_flattening(args, transformers, name)
    print("| recipe | attn_implementation | s / step | tokens / s | sdpa time / flexpack time |")
    print("|---|---|---:|---:|---:|")
    for i, (recipe, attn, step, tps) in enumerate(rows):
        speedup = rows[i - 1][2] / step if attn == name else None
        ratio = "" if speedup is None else f"{speedup:.2f}x" + (" (slower)" if speedup < 1 else "")
        print(f"| {recipe} | {attn} | {step:.3f} | {tps:,.0f} | {ratio} |")
    print("\n| attn_implementation | call | max abs logit diff vs each document alone |")
    print("|---|---|---:|")
    for attn, what, diff in leak_table(transformers, name):
        print(f"| {attn} | {what} | {diff:.1e} |")


if __name__ == "__main__":
    main()
