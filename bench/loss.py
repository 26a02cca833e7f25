"""The packed loss from hidden states: the logits path vs the chunked one, memory and time.

One forward + backward of the next-token loss on one packed row of S tokens (documents of
lognormal lengths, every token supervised as in pre-training), hidden (1, S, C) and head (V, C)
in float32, gradients of both. Columns:

* "logits path": ``flexpack.packed_cross_entropy(F.linear(hidden, weight), labels, doc_ids)``,
  what a flexpack recipe wrote before: the (S, V) logits, their float32 softmax and gradient.
* "flexpack chunked": ``flexpack.packed_linear_cross_entropy(hidden, weight, labels, doc_ids)``
  at its default chunk, reduction "token" and "document".
* "torch F.linear_cross_entropy": torch 2.13's own chunked op with its default options
  (``options=torch.nn.LinearCrossEntropyOptions()``), a plain token mean over the shifted
  targets as a torch user writes it (it has no per-document reduction and does not stop at
  document boundaries: a peer for memory and time, not a substitute).

Peak: the most bytes of tensors live at once during the call, beyond the inputs (torch's CPU
profiler memory events; bench/_machine.py). Time: the same single call (the profiler's overhead
is per op: small beside these matmuls). The logits path is skipped where its logits alone would
pass ``--max-logits-gib``.

    python bench/loss.py [--threads 2] [--max-logits-gib 1.5] [--shape S,C,V ...]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from _machine import describe, tensor_peak  # bench/ is on sys.path when run as a script

import flexpack
from flexpack.loss import default_chunk_size

SHAPES = [(8192, 256, 32768), (16384, 64, 131072)]  # (S, C, V): 8K x 32K, then 16K x 128K


def row(S: int, V: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """labels (1, S) and doc_ids (1, S) of one row packed with lognormal documents."""
    rng = np.random.default_rng(seed)
    lengths, total = [], 0
    while total < S:
        n = int(min(max(rng.lognormal(6.0, 1.0), 8), S - total))
        lengths.append(n)
        total += n
    doc_ids = torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths)).int()[None]
    labels = torch.from_numpy(rng.integers(0, V, S))[None]
    labels[0, np.cumsum([0, *lengths[:-1]])] = -100  # a document's first token has no target
    return labels, doc_ids


def losses(hidden, weight, labels, doc_ids, flat_target) -> dict:
    """The loss callables of the table, by column name."""
    methods = {
        "logits path": lambda: flexpack.packed_cross_entropy(
            F.linear(hidden, weight), labels, doc_ids
        ),
        "flexpack chunked, token": lambda: flexpack.packed_linear_cross_entropy(
            hidden, weight, labels, doc_ids
        ),
        "flexpack chunked, document": lambda: flexpack.packed_linear_cross_entropy(
            hidden, weight, labels, doc_ids, reduction="document"
        ),
    }
    if hasattr(F, "linear_cross_entropy"):  # torch >= 2.13
        methods["torch F.linear_cross_entropy (token mean)"] = lambda: F.linear_cross_entropy(
            hidden[0, :-1], weight, flat_target, options=torch.nn.LinearCrossEntropyOptions()
        )
    return methods


def run(fn, hidden, weight):
    def step():
        hidden.grad = weight.grad = None
        fn().backward()

    t0 = time.perf_counter()
    peak = tensor_peak(step)
    return peak, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--max-logits-gib", type=float, default=1.5)
    parser.add_argument(
        "--shape", action="append", default=None, help="S,C,V (repeat for several; default: "
        + " ".join(",".join(map(str, s)) for s in SHAPES) + ")",
    )  # fmt: skip
    args = parser.parse_args()
    shapes = SHAPES if args.shape is None else [tuple(map(int, s.split(","))) for s in args.shape]
    torch.set_num_threads(args.threads)
    print(f"# {describe()}, torch {torch.__version__}, {args.threads} threads, float32")
    print(
        "| S | C | V | logits (S*V*4) | method | peak growth | vs logits path | time (s) | "
        "load avg |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for S, C, V in shapes:
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(1, S, C, generator=g).requires_grad_()
        weight = (torch.randn(V, C, generator=g) / C**0.5).requires_grad_()
        labels, doc_ids = row(S, V)
        flat_target = labels[0, 1:].masked_fill(doc_ids[0, 1:] != doc_ids[0, :-1], -100)
        methods = losses(hidden, weight, labels, doc_ids, flat_target)
        logits_gib = S * V * 4 / 2**30
        base = None
        for name, fn in methods.items():
            if name == "logits path" and logits_gib > args.max_logits_gib:
                print(
                    f"| {S} | {C} | {V} | {logits_gib:.2f} GiB | {name} | not run: logits alone "
                    f"> {args.max_logits_gib} GiB | | | {os.getloadavg()[0]:.1f} |"
                )
                continue
            peak, dt = run(fn, hidden, weight)
            if name == "logits path":
                base = peak
            ratio = f"{base / peak:.0f}x less" if base and name != "logits path" else ""
            print(
                f"| {S} | {C} | {V} | {logits_gib:.2f} GiB | {name} | {peak / 2**20:,.0f} MiB "
                f"| {ratio} | {dt:.2f} | {os.getloadavg()[0]:.1f} |",
                flush=True,
            )
        print(f"<!-- default chunk at S={S}, C={C}, V={V}: {default_chunk_size(S, C, V)} -->")


if __name__ == "__main__":
    main()
