"""Streaming with ranks in step: PackedIterableDataset sync_ranks vs per-rank streaming vs the
global plan, on the lognormal benchmark.

    python bench/streaming.py --write bench/results/streaming.md
    python bench/streaming.py --samples 20000 --world-size 4     # quicker

Lengths are lognormal (median 300, sigma 1.0, rounded, clipped to [1, 4096]), max_len 4096, as in
bench/packing.py. Every mode is run to the end on every simulated rank (``rank=r,
world_size=W``), rows are counted as the ranks yield them:

- global plan: ``flexpack.pack`` over all lengths (bfd), rows dealt out by
  ``DistributedPackedSampler(remainder="pad")`` (the map-style path; repeats a few rows).
- per-rank streaming: ``PackedIterableDataset`` default (each rank packs its own 1/W of the
  stream); ranks end with different row counts, so a DDP loop must stop all ranks at the
  shortest: the rows past it are not trained this epoch (column "tokens not trained").
- sync_ranks: ``PackedIterableDataset(sync_ranks=True)``; every rank plans the whole stream, builds
  its own rows, and the short ranks get one all-padding row at the end.

Efficiency = real tokens / (rows x max_len), over all rows of all ranks. The time column is the
wall time of rank 0 to yield all its rows, as a ratio to per-rank streaming at the same buffer
(CPU, shared machine: only the ratios count).
"""

from __future__ import annotations

import argparse
import datetime
import time

import numpy as np
from _machine import describe  # bench/ is on sys.path when run as a script

MAX_LEN = 4096


def lognormal_lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(300), 1.0, n)), 1, MAX_LEN).astype(np.int64)


class LazySamples:
    """An indexable stream whose samples are made on access (bounded memory: only the rows a
    rank builds hold tokens); stands for a list of tokenized samples."""

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return np.ones(int(self.lengths[i]), dtype=np.int64)

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def hf_dataset(lengths: np.ndarray):
    """An in-memory datasets.Dataset with an ``input_ids`` list column of these lengths."""
    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable

    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = pa.array(np.ones(int(offsets[-1]), dtype=np.int32))
    column = pa.ListArray.from_arrays(pa.array(offsets), values)
    return datasets.Dataset(InMemoryTable(pa.table({"input_ids": column})))


def run_ranks(source, world: int, **kw) -> tuple[list[int], list[int], int, float]:
    """Rows per rank, real tokens per rank, padding rows, rank 0's wall seconds."""
    from flexpack.data import PackedIterableDataset

    rows, tokens, padding, wall = [], [], 0, float("inf")
    for rank in range(world):
        ds = PackedIterableDataset(source, MAX_LEN, rank=rank, world_size=world, **kw)
        for _ in range(2 if rank == 0 else 1):  # rank 0: min of two epochs
            t0 = time.perf_counter()
            counts = [int((row.doc_ids >= 0).sum()) for row in ds]
            wall = min(wall, time.perf_counter() - t0) if rank == 0 else wall
        rows.append(len(counts))
        tokens.append(counts)
        padding += ds.stats.padding_rows
    return rows, tokens, padding, wall


def fmt_int(x: int) -> str:
    return f"{x:,}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--buffers", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--write", help="also write the markdown report here")
    args = parser.parse_args()

    from flexpack import pack
    from flexpack.data import DistributedPackedSampler

    machine = describe()
    lengths = lognormal_lengths(args.samples)
    total, world = int(lengths.sum()), args.world_size
    lower = -(-total // MAX_LEN)
    header = (
        "| mode | buffer | source | rows (all ranks) | rows per rank (min-max) | efficiency "
        "| padding rows added | rows repeated | tokens not trained | rank 0 time vs per-rank |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]

    def add(mode, buffer, source, per_rank, real, padding, repeated, lost, ratio):
        n_rows = sum(per_rank)
        eff = 100.0 * real / (n_rows * MAX_LEN)
        lines.append(
            f"| {mode} | {buffer} | {source} | {fmt_int(n_rows)} | "
            f"{fmt_int(min(per_rank))}-{fmt_int(max(per_rank))} | {eff:.2f}% | {padding} | "
            f"{repeated} | {fmt_int(lost)} ({100.0 * lost / total:.2f}%) | {ratio} |"
        )
        print(lines[-1], flush=True)

    print(header)
    plan = pack(lengths, MAX_LEN, strategy="bfd")
    per_row = np.zeros(plan.num_rows, dtype=np.int64)
    np.add.at(per_row, plan.segments[:, 0], plan.segments[:, 3] - plan.segments[:, 2])
    dealt = [
        list(DistributedPackedSampler(per_row, num_replicas=world, rank=r, remainder="pad"))
        for r in range(world)
    ]
    shares = [len(d) for d in dealt]
    repeated = sum(shares) - plan.num_rows
    # repeated rows train their tokens twice: efficiency counts those slots as used
    real_slots = int(sum(per_row[d].sum() for d in dealt))
    add(
        "global plan (pack + sampler, pad)",
        "all",
        "lengths",
        shares,
        real_slots,
        0,
        repeated,
        0,
        "",
    )

    lazy = LazySamples(lengths)
    hf = hf_dataset(lengths)
    for source in (LazySamples(lengths[:50]), hf_dataset(lengths[:50])):  # load compiled kernels
        run_ranks(source, 2, buffer_size=4, sync_ranks=True)
    for buffer in args.buffers:
        rows, toks, _, base = run_ranks(lazy, world, buffer_size=buffer)
        stop = min(rows)  # every rank stops at the shortest rank's count
        lost = sum(sum(t[stop:]) for t in toks)
        add("per-rank streaming", buffer, "list", rows, total, 0, 0, lost, "1.00x")
        for name, source in (("list", lazy), ("HF Arrow", hf)):
            rows, toks, padding, wall = run_ranks(
                source, world, buffer_size=buffer, sync_ranks=True
            )
            assert sum(map(sum, toks)) == total and len(set(rows)) == 1
            add("sync_ranks", buffer, name, rows, total, padding, 0, 0, f"{wall / base:.2f}x")

    notes = [
        f"Lower bound ceil(tokens / max_len) = {lower:,} rows; {args.samples:,} samples, "
        f"{total:,} tokens, world_size {world}.",
        "",
        '"rows (all ranks)" counts what the ranks yield, padding and repeated rows included; '
        "efficiency = real tokens / (those rows x max_len).",
        "",
        '"tokens not trained": per-rank streaming gives the ranks different row counts; a DDP/FSDP '
        "loop that stops every rank at the shortest rank (the documented all-reduce of a done "
        "flag) leaves the longer ranks' last rows out of the epoch. sync_ranks and the global "
        "plan train every token (the plan's sampler repeats a few rows instead, counted in "
        '"rows repeated"; its efficiency counts the repeated tokens as used slots).',
        "",
        "sync_ranks rows equal a single-process stream's rows with the same buffer (tested), so "
        "its "
        "efficiency is the streaming efficiency of that buffer; every rank plans the whole stream, "
        "which is what its time ratio pays for (a list is read in full by every rank; a HF "
        "dataset only reads its lengths from the Arrow offsets and fetches its own rows).",
    ]
    print("\n".join(notes))
    if args.write:
        today = datetime.date.today().isoformat()
        report = [
            "# Streaming: ranks in step (sync_ranks) vs per-rank streaming vs the global plan",
            "",
            f"Date: {today}. Machine: {machine} (shared with other jobs); ratios are measured "
            "within one run.",
            f"Command: `python bench/streaming.py --write {args.write}`",
            "",
            *lines,
            "",
            *notes,
            "",
        ]
        with open(args.write, "w") as f:
            f.write("\n".join(report))


if __name__ == "__main__":
    main()
