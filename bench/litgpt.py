"""LitGPT fine-tuning: LitGPT's padded batches vs flexpack's packed rows, same model and samples.

The bundled corpus (flexpack/assets/corpus.jsonl) becomes an instruction data set (instruction:
"Continue the text from <source>", output: the text) read by LitGPT's ``JSON`` data module with a
byte-level tokenizer and a randomly initialised tiny Llama-shaped LitGPT model (no download).

* LitGPT: ``JSON(...).train_dataloader()`` as ``litgpt finetune_full`` uses it (its SFT collate
  pads each micro-batch to its longest sample), ``model(input_ids)`` and LitGPT's
  ``chunked_cross_entropy``; at ``--train.micro_batch_size`` 1 (finetune_full's default: one
  sample per step, no padding) and 4 (padded to the longest of 4).
* flexpack: ``PackedDataModule`` over the same ``JSON`` module (rows of ``--max-len``),
  ``packed_forward`` and ``packed_cross_entropy``, one row per step.

Each does one epoch of AdamW steps over the same samples; batches are built before the clock
starts, so the times are forward + backward + optimizer step. Columns: rows (model inputs),
token slots (rows x row length), padding share, real tokens/s and the ratio to flexpack.

    python bench/litgpt.py [--max-len 1024] [--limit 0] [--threads 1] [--repeats 2]

Needs the ``litgpt`` extra (its own virtual environment, see docs/litgpt.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from _machine import describe  # bench/ is on sys.path when run as a script

# This file is named litgpt.py: take bench/ off the path so that `import litgpt` finds LitGPT.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import flexpack  # noqa: E402
from flexpack.integrations.litgpt import PackedDataModule, packed_forward  # noqa: E402
from flexpack.testing.litgpt import BYTE_VOCAB_SIZE, tiny_checkpoint  # noqa: E402

CORPUS = Path(flexpack.__file__).parent / "assets" / "corpus.jsonl"


def write_data(path: Path, limit: int) -> int:
    samples = []
    with open(CORPUS, encoding="utf-8") as f:
        for line in f:
            doc = json.loads(line)
            samples.append(
                {
                    "instruction": f"Continue the text from {doc['source']}.",
                    "input": "",
                    "output": doc["text"],
                }
            )
    if limit:
        samples = samples[:limit]
    path.write_text(json.dumps(samples))
    return len(samples)


def json_module(path: Path):
    from litgpt.data import JSON

    # val_split_fraction as small as LitGPT allows: (nearly) every sample trains.
    return JSON(path, val_split_fraction=0.01, mask_prompt=False, num_workers=0)


def train_epoch(model, batches, step_fn, device) -> float:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for batch in batches:
        loss = step_fn(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--limit", type=int, default=0, help="use the first N documents (0: all)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=2, help="epochs per method; best kept")
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (fp32 either way)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from importlib.metadata import version

    from litgpt import GPT, Config, Tokenizer
    from litgpt.utils import chunked_cross_entropy

    machine = describe()
    tmp = Path(tempfile.mkdtemp(prefix="flexpack-bench-litgpt-"))
    n = write_data(tmp / "data.json", args.limit)
    config = Config(
        name="tiny-llama", block_size=args.max_len, vocab_size=BYTE_VOCAB_SIZE,
        padding_multiple=64, n_layer=2, n_head=4, n_query_groups=2, n_embd=64,
        rotary_percentage=1.0, parallel_residual=False, bias=False, norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP", intermediate_size=128,
    )  # fmt: skip
    ckpt = tiny_checkpoint(tmp / "ckpt", config, init_std=0.02)
    tokenizer = Tokenizer(ckpt)
    state = torch.load(ckpt / "lit_model.pth")

    def fresh_model() -> GPT:
        model = GPT(config)
        model.load_state_dict(state)
        return model

    device = torch.device(args.device)

    def to_device(batches):
        return [
            {k: v.to(device) for k, v in b.items() if isinstance(v, torch.Tensor)} for b in batches
        ]

    def lit_step(model, batch):
        logits = model(batch["input_ids"])
        return chunked_cross_entropy(logits[..., :-1, :], batch["labels"][..., 1:])

    def packed_step(model, batch):
        logits = packed_forward(model, batch["input_ids"], batch["doc_ids"],
                                position_ids=batch["position_ids"])  # fmt: skip
        return flexpack.packed_cross_entropy(logits, batch["labels"], batch["doc_ids"])

    runs = []  # one dict per layout; every layout trains a fresh copy of the same weights
    for mbs in args.micro_batch_sizes:
        t0 = time.perf_counter()
        data = json_module(tmp / "data.json")
        data.connect(tokenizer, batch_size=mbs, max_seq_length=args.max_len)
        data.setup()
        batches = list(data.train_dataloader())
        setup_s = time.perf_counter() - t0
        model = fresh_model().to(device)
        model.max_seq_length = max(b["input_ids"].shape[1] for b in batches)
        runs.append(
            dict(
                label=f"LitGPT padded, micro_batch_size={mbs}",
                rows=sum(b["input_ids"].shape[0] for b in batches),
                slots=sum(b["input_ids"].numel() for b in batches),
                real=sum(int(b["token_counts"]["raw_plus_prompt_template"].sum()) for b in batches),
                setup_s=setup_s, model=model, batches=to_device(batches), step=lit_step,
            )
        )  # fmt: skip

    t0 = time.perf_counter()
    data = PackedDataModule(json_module(tmp / "data.json"), args.max_len, shuffle=True)
    data.connect(tokenizer, batch_size=1, max_seq_length=args.max_len)
    data.setup()
    batches = list(data.train_dataloader())
    setup_s = time.perf_counter() - t0
    runs.append(
        dict(
            label=f"flexpack packed, rows of {args.max_len}",
            rows=sum(b["input_ids"].shape[0] for b in batches),
            slots=sum(b["input_ids"].numel() for b in batches),
            real=sum(int((b["doc_ids"] >= 0).sum()) for b in batches),
            setup_s=setup_s, model=fresh_model().to(device), batches=to_device(batches),
            step=packed_step,
        )
    )  # fmt: skip

    # Layouts take turns, epoch by epoch, so that load changes on a shared machine hit all alike.
    for _ in range(args.repeats):
        for run in runs:
            secs = train_epoch(run["model"], run["batches"], run["step"], device)
            run["secs"] = min(run.get("secs", float("inf")), secs)
    results = [
        (r["label"], r["rows"], r["slots"], r["real"], r["secs"], r["setup_s"]) for r in runs
    ]

    packed_tps = results[-1][3] / results[-1][4]
    print(
        f"# LitGPT fine-tuning, padded vs packed ({datetime.date.today()}; {machine}; "
        f"litgpt {version('litgpt')}, torch {torch.__version__}, {torch.get_num_threads()} "
        f"threads)\n"
    )
    print(
        f"{n} corpus documents as instruction samples, byte tokenizer, 2-layer width-64 Llama, "
        f"{args.device} fp32, one epoch of AdamW steps (best of {args.repeats}, layouts "
        "taking turns).\n"
    )
    print(
        "| layout | rows | token slots | padding | real tokens | train s | real tokens/s "
        "| flexpack speed-up | data setup s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, rows, slots, real, secs, setup_s in results:
        tps = real / secs
        print(
            f"| {label} | {rows:,} | {slots:,} | {1 - real / slots:.1%} | {real:,} | "
            f"{secs:.2f} | {tps:,.0f} | {packed_tps / tps:.2f}x | {setup_s:.2f} |"
        )


if __name__ == "__main__":
    main()
