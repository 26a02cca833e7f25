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


def tiny_sliding(transformers, family: str, attn: str, *, hidden: int, layers: int, vocab: int):
    """A tiny Gemma 2 or Qwen3 whose layers alternate sliding-window and full attention.

    Gemma 2: its own defaults (softcap 50, a sliding layer every other layer), window 512.
    Qwen3: ``use_sliding_window=True`` with ``max_window_layers=layers // 2``, so transformers 5's
    ``layer_types`` make the upper half sliding (window 512), as its config derives them.
    """
    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=hidden // 4, pad_token_id=vocab - 3, eos_token_id=vocab - 2,
        sliding_window=512, initializer_range=0.02, attn_implementation=attn,
    )  # fmt: skip
    if family == "gemma2":
        config = transformers.Gemma2Config(query_pre_attn_scalar=hidden // 4, **common)
        cls = transformers.Gemma2ForCausalLM
    else:
        config = transformers.Qwen3Config(
            use_sliding_window=True, max_window_layers=layers // 2, **common
        )
        cls = transformers.Qwen3ForCausalLM
    assert "sliding_attention" in config.layer_types, config.layer_types
    torch.manual_seed(0)
    return cls(config)


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


def sft_data(args, transformers):
    import datasets

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
    return data, tok, vocab


def bench_sft(args, transformers, flexpack_name) -> list[tuple]:
    data, tok, vocab = sft_data(args, transformers)
    make = lambda attn: tiny_llama(
        transformers, attn, hidden=args.hidden, layers=args.layers, vocab=vocab
    )
    rows = [
        ("TRL SFTTrainer, packing=True, bf16", attn, *run_sft(args, make(attn), data, tok))
        for attn in ("sdpa", flexpack_name)
    ]
    rows.append(bench_trainer(args, transformers, flexpack_name, data, tok, vocab))
    return rows


def bench_sliding(args, transformers, flexpack_name) -> list[tuple]:
    """Gemma 2 and Qwen3 (sliding-window layers) through SFTTrainer: eager, sdpa, flexpack.

    Same samples, same packed rows (TRL's BFD packing), same seed; only ``attn_implementation``
    differs. Whole runs repeat ``--repeats`` times in turns (eager, sdpa, flexpack, eager, ...)
    so load changes on a shared machine hit all alike; the median per implementation is kept.
    """
    data, tok, vocab = sft_data(args, transformers)
    rows = []
    for family in args.sliding:
        runs: dict[str, list[tuple[float, float]]] = {}
        for _ in range(args.repeats):
            # transformers 5 has no sdpa for Gemma 2 (softcap): eager is what its users run.
            peers = ("eager",) if family == "gemma2" else ("eager", "sdpa")
            for attn in (*peers, flexpack_name):
                model = tiny_sliding(
                    transformers, family, attn, hidden=args.hidden, layers=args.layers,
                    vocab=vocab,
                )  # fmt: skip
                runs.setdefault(attn, []).append(run_sft(args, model, data, tok))
                print(f"# {family} {attn}: {runs[attn][-1][0]:.3f} s / step", flush=True)
        for attn, results in runs.items():
            step = sorted(r[0] for r in results)[len(results) // 2]
            tps = sorted(r[1] for r in results)[len(results) // 2]
            rows.append((family, attn, step, tps))
    return rows


def run_sft(args, model, data, tok) -> tuple[float, float]:
    """TRL SFTTrainer at its defaults but packing=True: (s / step, real tokens / s)."""
    import transformers
    import trl

    with tempfile.TemporaryDirectory() as out:
        config = trl.SFTConfig(
            output_dir=out, packing=True, max_length=args.max_len,
            per_device_train_batch_size=args.batch, max_steps=args.steps + 2,
            logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
            disable_tqdm=True,
        )  # fmt: skip
        trainer = trl.SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tok)
        clock = _Clock(transformers)
        trainer.add_callback(clock)
        trainer.train()
        times = clock.times
        logged = [h["num_tokens"] for h in trainer.state.log_history if "num_tokens" in h]
        tokens = [b - a for a, b in zip([0, *logged[:-1]], logged, strict=True)]
        # The first two steps warm up (allocations, the first mask); time the rest.
        t = sum(times[2:])
        return t / len(times[2:]), sum(tokens[2:]) / t


def bench_trainer(args, transformers, flexpack_name, data, tok, vocab) -> tuple:
    """Recipe 1: HF Trainer on pack_dataset rows of the same samples, bf16 like TRL's default."""
    import datasets

    from flexpack.data import collate
    from flexpack.integrations.datasets import pack_dataset
    from flexpack.integrations.transformers import packed_forward_kwargs

    samples = []
    for prompt, completion in zip(data["prompt"], data["completion"], strict=True):
        p, c = tok(prompt)["input_ids"], tok(completion)["input_ids"] + [tok.eos_token_id]
        samples.append({"input_ids": p + c, "labels": [-100] * len(p) + c})
    # TRL truncates samples longer than max_length; so does this.
    packed = pack_dataset(datasets.Dataset.from_list(samples), args.max_len, overflow="truncate")
    real = []

    def collate_rows(rows):
        batch = collate(rows, max_len=args.max_len)
        real.append(int((batch.doc_ids >= 0).sum()))
        return packed_forward_kwargs(batch, labels=True)

    with tempfile.TemporaryDirectory() as out:
        config = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=args.batch, max_steps=args.steps + 2,
            logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=True,
            remove_unused_columns=False, disable_tqdm=True,
        )  # fmt: skip
        model = tiny_llama(transformers, flexpack_name, hidden=args.hidden, layers=args.layers,
                           vocab=vocab)  # fmt: skip
        trainer = transformers.Trainer(
            model=model, args=config, train_dataset=packed, data_collator=collate_rows
        )
        clock = _Clock(transformers)
        trainer.add_callback(clock)
        trainer.train()
    t = sum(clock.times[2:])
    per_step = sum(real) / len(real)
    return ("HF Trainer on pack_dataset rows, bf16", flexpack_name, t / len(clock.times[2:]),
            per_step * len(clock.times[2:]) / t)  # fmt: skip


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


def print_sliding(rows: list[tuple], max_len: int) -> None:
    print(
        f"| model (sliding-window layers, bf16, TRL SFTTrainer packing=True, rows of {max_len}) "
        f"| attn_implementation | s / step | real tokens / s | eager s/step / this s/step "
        f"| sdpa s/step / this s/step |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for family, attn, step, tps in rows:
        base = {r[1]: r[2] for r in rows if r[0] == family}
        ratios = [f"{base[b] / step:.2f}x" if b in base else "n/a" for b in ("eager", "sdpa")]
        label = {"gemma2": "Gemma 2", "qwen3": "Qwen3"}[family]
        print(f"| {label} | {attn} | {step:.3f} | {tps:,.0f} | {' | '.join(ratios)} |")
    print()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (after 2 warm-up)")
    p.add_argument("--batch", type=int, default=2, help="per-device batch size (TRL)")
    p.add_argument("--max-len", type=int, default=1024, help="TRL max_length; longest sample")
    p.add_argument("--hidden", type=int, default=256, help="model hidden size")
    p.add_argument("--layers", type=int, default=4, help="Llama layers")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--tables", default="recipes,sliding", help="which tables: recipes, sliding (comma list)"
    )
    p.add_argument(
        "--sliding", default="gemma2,qwen3", help="sliding-window models for the sliding table"
    )
    p.add_argument("--repeats", type=int, default=3, help="runs per model in the sliding table")
    args = p.parse_args()
    args.sliding = args.sliding.split(",")
    tables = args.tables.split(",")
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
        f"# Llama / Gemma 2 / Qwen3 hidden {args.hidden}, {args.layers} layers, 4 q / 2 kv heads "
        f"(sliding window 512 on the sliding layers); "
        f"{args.steps} timed steps\n"
    )
    if "sliding" in tables:
        print_sliding(bench_sliding(args, transformers, name), args.max_len)
    if "recipes" not in tables:
        return
    rows = bench_sft(args, transformers, name) + bench_flattening(args, transformers, name)
    print(
        "| recipe | attn_implementation | s / step | real tokens / s | "
        "sdpa s/step / this s/step (TRL's sdpa run for the two trainers) |"
    )
    print("|---|---|---:|---:|---:|")
    for recipe, attn, step, tps in rows:
        # Baseline: the sdpa run of the same loop; for the HF Trainer recipe, TRL's own sdpa path
        # on the same samples.
        flat = recipe.startswith("DataCollatorWithFlattening")
        sdpa = next(r for r in rows if r[1] == "sdpa" and r[0].startswith("DataColl") == flat)
        speedup = sdpa[2] / step if attn == name else None
        ratio = (
            "" if speedup is None else f"{speedup:.2f}x" + (" (slower)" if speedup < 0.995 else "")
        )
        print(f"| {recipe} | {attn} | {step:.3f} | {tps:,.0f} | {ratio} |")
    print("\n| attn_implementation | call | max abs logit diff vs each document alone |")
    print("|---|---|---:|")
    for attn, what, diff in leak_table(transformers, name):
        print(f"| {attn} | {what} | {diff:.1e} |")


if __name__ == "__main__":
    main()
