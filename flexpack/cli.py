"""The ``flexpack`` command line: ``pack``, ``stats`` and ``demo``.

``flexpack pack INPUT --max-len N --out OUT.parquet`` packs token-id sequences read from JSONL
(one ``{"input_ids": [...]}`` object per line) or Parquet (a list column) into rows and writes them
as Parquet with the columns ``input_ids``, ``labels``, ``doc_ids`` and ``position_ids``.
``flexpack stats INPUT --max-len N`` prints what every strategy would give, writing nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flexpack.packing import OVERFLOWS, STRATEGIES, PackPlan, PackStats, pack

_ROWS_PER_CHUNK = 1024


class CliError(Exception):
    """A user error: printed as ``flexpack: error: ...`` with exit status 2."""


@dataclass(frozen=True)
class _Samples:
    """Token ids of all samples as one flat array plus offsets (no Python object per sample)."""

    ids: np.ndarray  # (T,) int64
    offsets: np.ndarray  # (n + 1,) int64
    labels: np.ndarray | None  # (T,) int64 or None

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def _progress(total: int | None, desc: str, enabled: bool, unit: str = "it") -> Any:
    """A tqdm bar when enabled and tqdm is installed, else a no-op stand-in."""
    if enabled:
        try:
            from tqdm import tqdm

            return tqdm(total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True)
        except ImportError:
            pass

    class _Null:
        def update(self, n: int = 1) -> None:
            pass

        def close(self) -> None:
            pass

    return _Null()


def _read_jsonl(path: Path, column: str, labels_column: str | None, bar: bool) -> _Samples:
    ids_parts: list[list[int]] = []
    label_parts: list[list[int]] = []
    progress = _progress(path.stat().st_size, f"read {path.name}", bar, unit="B")
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            progress.update(len(line))
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise CliError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or column not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise CliError(
                    f"{path}:{lineno}: no {column!r} field (found {keys}); pick the token column "
                    "with --column"
                )
            ids_parts.append(record[column])
            if labels_column is not None:
                if labels_column not in record:
                    raise CliError(f"{path}:{lineno}: no {labels_column!r} field for labels")
                label_parts.append(record[labels_column])
    progress.close()
    return _to_samples(ids_parts, label_parts if labels_column else None, str(path))


def _to_samples(ids_parts: list, label_parts: list | None, where: str) -> _Samples:
    for parts in (ids_parts, label_parts or []):
        for k, p in enumerate(parts):
            # np.fromiter below would silently truncate floats (and read bools as 0/1): every
            # value must be an int; set(map(type, ...)) checks them at C speed
            kinds = set(map(type, p)) if isinstance(p, list) else set()
            if not isinstance(p, list) or kinds - {int}:
                got = ", ".join(sorted(t.__name__ for t in kinds - {int}))
                raise CliError(
                    f"{where}: sample {k} must be a list of integer token ids; got "
                    f"{type(p).__name__}{' with ' + got if got else ''}"
                )
    lengths = np.fromiter((len(p) for p in ids_parts), np.int64, len(ids_parts))
    offsets = np.zeros(len(ids_parts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    labels = None
    try:
        ids = np.fromiter(itertools.chain.from_iterable(ids_parts), np.int64, int(offsets[-1]))
        if label_parts is not None:
            if any(len(a) != len(b) for a, b in zip(ids_parts, label_parts, strict=True)):
                raise CliError(f"{where}: a sample's labels and token ids differ in length")
            labels = np.fromiter(itertools.chain.from_iterable(label_parts), np.int64, ids.shape[0])
    except (TypeError, ValueError, OverflowError) as e:
        raise CliError(f"{where}: token ids must be lists of integers ({e})") from None
    return _Samples(ids, offsets, labels)


def _read_parquet(path: Path, column: str, labels_column: str | None) -> _Samples:
    pq = _import_pyarrow_parquet()
    import pyarrow as pa

    try:
        names = pq.read_schema(path).names
    except Exception as e:  # pyarrow raises its own error types for unreadable files
        raise CliError(f"{path}: cannot read as Parquet ({e})") from None
    wanted = [column] + ([labels_column] if labels_column else [])
    for name in wanted:
        if name not in names:
            raise CliError(f"{path}: no column {name!r} (columns: {names}); use --column")
    table = pq.read_table(path, columns=wanted)

    def flat(name: str) -> tuple[np.ndarray, np.ndarray]:
        col = table.column(name).combine_chunks()
        if not hasattr(col, "offsets") or not pa.types.is_integer(col.type.value_type):
            raise CliError(
                f"{path}: column {name!r} must be a list of integer token ids; got {col.type}. "
                "Tokenize it, or cast it to list<int64>."
            )
        offsets = col.offsets.to_numpy().astype(np.int64)
        values = col.values.to_numpy(zero_copy_only=False)
        values = values[offsets[0] : offsets[-1]].astype(np.int64, copy=False)
        return values, offsets - offsets[0]

    ids, offsets = flat(column)
    labels = None
    if labels_column:
        labels, label_offsets = flat(labels_column)
        if not np.array_equal(offsets, label_offsets):
            raise CliError(f"{path}: a sample's labels and token ids differ in length")
    return _Samples(ids, offsets, labels)


def _import_pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise CliError(
            "Parquet needs pyarrow: pip install 'flexpack[io]' (or pip install pyarrow)"
        ) from None
    return pq


def _read(path: str, column: str, labels_column: str | None, bar: bool) -> _Samples:
    p = Path(path)
    if not p.is_file():
        raise CliError(f"{path}: no such file")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return _read_jsonl(p, column, labels_column, bar)
    if suffix in (".parquet", ".pq"):
        return _read_parquet(p, column, labels_column)
    raise CliError(f"{path}: unknown format {suffix!r}; expected .jsonl or .parquet")


def _write_parquet(plan: PackPlan, samples: _Samples, out: str, pad_id: int, bar: bool) -> None:
    import pyarrow as pa

    from flexpack.batch import _assemble

    pq = _import_pyarrow_parquet()
    max_len = plan.max_len
    schema = pa.schema(
        [
            ("input_ids", pa.list_(pa.int64())),
            ("labels", pa.list_(pa.int64())),
            ("doc_ids", pa.list_(pa.int32())),
            ("position_ids", pa.list_(pa.int64())),
        ]
    )
    progress = _progress(plan.num_rows, "write rows", bar, unit="row")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with pq.ParquetWriter(out, schema) as writer:
        for first in range(0, plan.num_rows, _ROWS_PER_CHUNK):
            rows = np.arange(first, min(first + _ROWS_PER_CHUNK, plan.num_rows))
            seg, num_docs = plan._select(rows)
            batch = _assemble(
                seg,
                num_docs,
                max_len,
                samples.ids,
                samples.labels,
                samples.offsets[seg[:, 1]],
                pad_id=pad_id,
            )
            offsets = pa.array(np.arange(rows.size + 1, dtype=np.int32) * max_len)

            tensors = (batch.input_ids, batch.labels, batch.doc_ids, batch.position_ids)
            columns = [
                pa.ListArray.from_arrays(offsets, pa.array(t.numpy().reshape(-1))) for t in tensors
            ]
            writer.write_table(pa.table(columns, schema=schema))
            progress.update(rows.size)
    progress.close()


def _plot(plan: PackPlan, lengths: np.ndarray, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CliError("--plot needs matplotlib: pip install 'flexpack[viz]'") from None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.hist(lengths, bins=min(100, max(10, int(np.sqrt(lengths.size)))), color="tab:blue")
    left.axvline(plan.max_len, color="tab:red", ls="--", label=f"max_len={plan.max_len}")
    left.set(title="sample lengths", xlabel="tokens", ylabel="samples")
    left.legend()
    fill = plan.row_lengths() / plan.max_len
    right.hist(fill, bins=50, range=(0, 1), color="tab:green")
    right.set_yscale("log")  # the few underfilled rows matter; a linear axis hides them
    right.set(
        title=f"row fill ({plan.strategy}: {plan.num_rows} rows, {plan.efficiency:.2%} efficient)",
        xlabel="filled fraction of the row",
        ylabel="rows (log scale)",
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _summary(stats: PackStats, timings: dict[str, float]) -> str:
    over = stats.over_lower_bound
    lines = [
        f"samples     {stats.samples:,}",
        f"tokens      {stats.tokens:,} ({stats.placed:,} placed)",
        f"rows        {stats.rows:,} of {stats.max_len} tokens "
        f"(lower bound {stats.lower_bound_rows:,}, {over:+.2%})",
        f"efficiency  {stats.efficiency:.2%}",
        f"docs/row    mean {stats.docs_per_row.mean:.2f}, max {stats.docs_per_row.max}",
        f"split       {stats.split_samples:,} samples",
        f"truncated   {stats.truncated:,} tokens ({stats.truncated_samples:,} samples)",
        f"dropped     {stats.dropped:,} tokens ({stats.dropped_samples:,} samples)",
        "time        " + ", ".join(f"{k} {v:.2f} s" for k, v in timings.items()),
    ]
    return "\n".join(lines)


def _cmd_pack(args: argparse.Namespace) -> int:
    bar = not args.quiet and sys.stderr.isatty()
    t0 = time.perf_counter()
    samples = _read(args.input, args.column, args.labels_column, bar)
    t1 = time.perf_counter()
    plan = pack(
        samples.lengths,
        args.max_len,
        strategy=args.strategy,
        overflow=args.overflow,
        seed=args.seed,
        max_docs_per_row=args.max_docs_per_row,
    )
    t2 = time.perf_counter()
    _write_parquet(plan, samples, args.out, args.pad_id, bar)
    t3 = time.perf_counter()
    if args.plot:
        _plot(plan, samples.lengths, args.plot)
    if not args.quiet:
        print(_summary(plan.stats, {"read": t1 - t0, "pack": t2 - t1, "write": t3 - t2}))
        print(f"wrote       {args.out}" + (f" and {args.plot}" if args.plot else ""))
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    samples = _read(args.input, args.column, None, not args.quiet and sys.stderr.isatty())
    lengths = samples.lengths
    header = (
        f"{'strategy':<8} {'rows':>10} {'lower bound':>11} {'over':>8} {'efficiency':>10} "
        f"{'docs/row':>8} {'truncated':>10} {'dropped':>10} {'seconds':>8}"
    )
    print(
        f"{lengths.size:,} samples, {int(lengths.sum()):,} tokens, max_len {args.max_len}, "
        f"overflow {args.overflow!r}, {int((lengths > args.max_len).sum()):,} samples too long"
    )
    print(header)
    for strategy in STRATEGIES:
        t = time.perf_counter()
        stats = pack(lengths, args.max_len, strategy=strategy, overflow=args.overflow).stats
        dt = time.perf_counter() - t
        print(
            f"{strategy:<8} {stats.rows:>10,} {stats.lower_bound_rows:>11,} "
            f"{stats.over_lower_bound:>+8.2%} {stats.efficiency:>10.2%} "
            f"{stats.docs_per_row.mean:>8.2f} {stats.truncated:>10,} {stats.dropped:>10,} "
            f"{dt:>8.3f}"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexpack", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("input", help="token ids: .jsonl (one JSON object per line) or .parquet")
        p.add_argument("--max-len", type=int, required=True, help="tokens per packed row")
        p.add_argument("--column", default="input_ids", help="field holding the token ids")
        p.add_argument(
            "--overflow",
            choices=OVERFLOWS,
            default="error",
            help="samples longer than --max-len: error (default), split, truncate or drop",
        )
        p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")

    p_pack = sub.add_parser("pack", help="pack token sequences into rows, write Parquet")
    common(p_pack)
    p_pack.add_argument("--out", required=True, help="Parquet file to write")
    p_pack.add_argument("--strategy", choices=STRATEGIES, default="bfd")
    p_pack.add_argument("--labels-column", default=None, help="field with per-sample labels")
    p_pack.add_argument("--seed", type=int, default=0, help="seed of the row order (bfd, ffd)")
    p_pack.add_argument("--max-docs-per-row", type=int, default=None)
    p_pack.add_argument("--pad-id", type=int, default=0, help="token id on padding")
    p_pack.add_argument("--plot", default=None, help="also save a PNG of lengths and row fill")

    p_stats = sub.add_parser("stats", help="print what each strategy would give; write nothing")
    common(p_stats)

    demo = sub.add_parser("demo", help="pack the bundled corpus and prove packed == per-document")
    demo.add_argument("--out", default="flexpack-demo", help="folder for the PNGs it writes")
    demo.add_argument("--max-len", type=int, default=1024, help="tokens per packed row")
    demo.add_argument("--docs", type=int, default=None, help="use only the first N documents")
    return parser


def main(argv: list[str] | None = None) -> int:
    r"""Run the ``flexpack`` command line; returns the exit status (2 on a user error).

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "data.jsonl")
        >>> with open(path, "w") as f:
        ...     _ = f.write('{"input_ids": [1, 2, 3]}\n{"input_ids": [4, 5]}\n')
        >>> main(["stats", path, "--max-len", "8"])
        2 samples, 5 tokens, max_len 8, overflow 'error', 0 samples too long
        strategy ...
        bfd               1           1   +0.00%     62.50%     2.00 ...
        0
    """
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from flexpack.demo import main as demo_main

        return demo_main(out=args.out, max_len=args.max_len, num_docs=args.docs)
    try:
        if args.command == "pack":
            return _cmd_pack(args)
        if args.command == "stats":
            return _cmd_stats(args)
    except (CliError, ValueError, TypeError) as e:
        print(f"flexpack {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
