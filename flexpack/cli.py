"""The ``flexpack`` command line: ``pack``, ``stats`` and ``demo``.

``flexpack pack INPUT --max-len N --out OUT.parquet`` packs token-id sequences read from JSONL
(one ``{"input_ids": [...]}`` object, or one bare ``[...]`` list, per line) or Parquet (a list
column) into rows and writes them as Parquet with the columns ``input_ids``, ``labels``,
``doc_ids`` and ``position_ids``. ``flexpack stats INPUT --max-len N`` prints what every strategy
would give, writing nothing. ``flexpack demo`` packs a bundled corpus and checks packed ==
per-document on a small GPT.

Only the standard library loads at import: ``--help`` and argument errors are instant. numpy
loads when a command reads its input and torch only once the input has passed every check (and
never for ``stats``), so an error in the input comes back in well under a second. Every error is
one line, ``flexpack CMD: error: ...`` (a bad flag adds a line naming ``--help``), exit status 2,
no traceback; optional dependencies are checked before any input is read.

The files (reading the input, checking the paths, writing the rows and the plot) are
``flexpack._cli_files``, beneath this module; here are the parser, the commands and ``main``.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from flexpack import __version__
from flexpack._choices import OVERFLOWS, STRATEGIES
from flexpack._cli_files import (
    _INT64,
    CliError,
    _check_input,
    _check_plot,
    _import_pyarrow_parquet,
    _plot,
    _read,
    _Samples,
    _writable_file,
    _writable_folder,
    _write_parquet,
)

if TYPE_CHECKING:
    from flexpack.packing import PackStats


# Library messages name Python arguments; on the command line they are flags.
_FLAG_WORDS = [
    (re.compile(r"\boverflow='(\w+)'"), r"--overflow \1"),
    (re.compile(r"\bstrategy='(\w+)'"), r"--strategy \1"),
    (re.compile(r"\bmax_len=(\d+)"), r"--max-len \1"),
    (re.compile(r"\bmax_docs_per_row\b"), "--max-docs-per-row"),
    (re.compile(r"\bpad_id\b"), "--pad-id"),
    (re.compile(r"\bnum_docs\b"), "--docs"),
    (re.compile(r"\bmax_len\b"), "--max-len"),
]


def _cli_words(message: str) -> str:
    """``overflow='split'`` -> ``--overflow split``, ``max_len`` -> ``--max-len``, ..."""
    for pattern, repl in _FLAG_WORDS:
        message = pattern.sub(repl, message)
    return message


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
        f"empty       {stats.empty_samples:,} samples (no tokens: in no row)",
        "time        " + ", ".join(f"{k} {v:.2f} s" for k, v in timings.items()),
    ]
    return "\n".join(lines)


def _check_overflow(samples: _Samples, max_len: int, overflow: str, strategy: str) -> None:
    """The pack error for too-long samples, worded for the command line; it names the first as
    every per-sample error does (a JSONL line from 1, a Parquet row as pyarrow counts it)."""
    lengths = samples.lengths
    long = lengths > max_len
    if overflow == "error" and strategy != "wrap" and bool(long.any()):
        raise CliError(
            f"{int(long.sum()):,} of {lengths.size:,} samples are longer than --max-len "
            f"{max_len} (longest {int(lengths.max()):,} tokens; the first is "
            f"{samples.where(int(long.argmax()))}). Pass --overflow split (cut them into "
            "--max-len pieces, each its own document), --overflow truncate, --overflow drop, or "
            "raise --max-len."
        )


_KERNEL_OF = {
    "bfd": "best_fit_decreasing",
    "ffd": "first_fit_decreasing",
    "greedy": "next_fit",
    "wrap": "wrap",
}


def _load_packer(strategy: str, n_samples: int, *, rows: bool = False) -> float | None:
    """Seconds of the one-time load (and, on a fresh install, compile) of the kernels that pack
    ``n_samples`` samples with ``strategy`` (and, with ``rows``, write the rows), or None where
    numpy packs them: nothing to load."""
    from flexpack import _kernels
    from flexpack.packing import pack

    if not _kernels.compiled_for(_KERNEL_OF[strategy], n_samples):
        return None
    t = time.perf_counter()
    with _kernels.forced("numba"):
        plan = pack([1], 1, strategy=strategy)
        if rows:
            plan.layout()
    return time.perf_counter() - t


def _cmd_pack(args: argparse.Namespace) -> int:
    bar = not args.quiet and sys.stderr.isatty()
    t0 = time.perf_counter()
    samples = _read(args.input, args.column, args.labels_column, bar)
    _check_overflow(samples, args.max_len, args.overflow, args.strategy)
    from flexpack.packing import pack  # numpy (and numba for a large input), not torch

    t1 = time.perf_counter()
    load = _load_packer(args.strategy, samples.lengths.size, rows=True)
    t2 = time.perf_counter()
    plan = pack(
        samples.lengths,
        args.max_len,
        strategy=args.strategy,
        overflow=args.overflow,
        seed=args.seed,
        max_docs_per_row=args.max_docs_per_row,
    )
    t3 = time.perf_counter()
    _write_parquet(plan, samples, args.out, args.pad_id, bar)
    t4 = time.perf_counter()
    if args.plot:
        _plot(plan, samples.lengths, args.plot)
    if not args.quiet:
        timings = {"read": t1 - t0}
        if load is not None:
            timings["packer load (once)"] = load
        timings["pack" if load is not None else "pack (numpy)"] = t3 - t2
        timings["write"] = t4 - t3
        print(_summary(plan.stats, timings))
        wrote = [str(Path(args.out).resolve())]
        wrote += [str(Path(args.plot).resolve())] if args.plot else []
        print("wrote       " + " and ".join(wrote))
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    samples = _read(args.input, args.column, None, not args.quiet and sys.stderr.isatty())
    lengths = samples.lengths
    for strategy in STRATEGIES:  # the overflow error before any packing
        if strategy != "wrap":
            _check_overflow(samples, args.max_len, args.overflow, strategy)
    from flexpack import _kernels
    from flexpack.packing import pack  # numpy (and numba for a large input), never torch

    loads: dict[str, float] = {}
    lines = []
    for strategy in STRATEGIES:  # all of it first: nothing is printed if one fails
        load = _load_packer(strategy, lengths.size)
        if load is not None:
            loads[strategy] = load
        t = time.perf_counter()
        stats = pack(lengths, args.max_len, strategy=strategy, overflow=args.overflow).stats
        dt = time.perf_counter() - t
        lines.append(
            f"{strategy:<8} {stats.rows:>10,} {stats.lower_bound_rows:>11,} "
            f"{stats.over_lower_bound:>+8.2%} {stats.efficiency:>10.2%} "
            f"{stats.docs_per_row.mean:>8.2f} {stats.truncated:>10,} {stats.dropped:>10,} "
            f"{dt:>8.3f}"
        )
    print(
        f"{lengths.size:,} samples, {int(lengths.sum()):,} tokens, --max-len {args.max_len}, "
        f"--overflow {args.overflow}, {int((lengths > args.max_len).sum()):,} samples too long"
    )
    print(
        f"{'strategy':<8} {'rows':>10} {'lower bound':>11} {'over':>8} {'efficiency':>10} "
        f"{'docs/row':>8} {'truncated':>10} {'dropped':>10} {'pack s':>8}"
    )
    print("\n".join(lines))
    if loads:
        print(
            "pack s: packing alone. Loading the compiled packers once per process (compiling "
            "them on the first run after an install) took "
            + ", ".join(f"{k} {v:.2f} s" for k, v in loads.items())
            + ", not included."
        )
    else:
        print(
            f"pack s: packing alone, by numpy: under {_kernels.SMALL:,} samples that beats "
            "loading the compiled packers (nothing to compile)."
        )
    return 0


# ----------------------------------------------------------------------------- arguments


def _int_type(lo: int, hi: int, what: str) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse


_POSITIVE = _int_type(1, _INT64[1], "a positive integer")
_SEED = _int_type(0, _INT64[1], "a non-negative integer")
_TOKEN_ID = _int_type(0, _INT64[1], "a token id: an integer in 0..2**63 - 1")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the help (except None and False, said in words), descriptions as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return action.help or ""
        return super()._get_help_string(action)


_DESCRIPTION = """\
Pack variable-length token sequences into fixed-length rows for training.

  flexpack pack data.jsonl --max-len 2048 --out packed.parquet
  flexpack stats data.jsonl --max-len 2048
  flexpack demo

Input: JSONL with one {"input_ids": [...]} object (or one bare [...] list) of token ids per line,
or Parquet with a list<int> column. flexpack does not tokenize: write token ids first.
pack and the Parquet input need pyarrow, --plot needs matplotlib:
  pip install 'flexpack[cli]'        (in a flexpack checkout: pip install -e '.[cli]')
"""


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line and a hint, not the usage block first."""

    def error(self, message: str) -> NoReturn:
        hint = f"{self.prog} --help lists the options"
        self.exit(2, f"{self.prog}: error: {message}\n{hint}\n")

    def fail(self, message: str) -> NoReturn:
        """A bad value (a path, a missing extra): its one line, which says the fix."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="flexpack", description=_DESCRIPTION, formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"flexpack {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("input", help="token ids: .jsonl (one JSON value per line) or .parquet")
        p.add_argument(
            "--max-len", type=_POSITIVE, required=True, help="tokens per packed row (required)"
        )
        p.add_argument(
            "--column",
            default=None,
            help="field or column with the token ids (default: input_ids; bare-list lines are "
            "the token ids)",
        )
        p.add_argument(
            "--overflow",
            choices=OVERFLOWS,
            default="error",
            help="what to do with samples longer than --max-len: stop with an error, split them "
            "into --max-len pieces (each its own document), truncate or drop them",
        )
        p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")

    kw = dict(formatter_class=_Formatter)
    p_pack = sub.add_parser("pack", help="pack token sequences into rows, write Parquet", **kw)
    common(p_pack)
    p_pack.add_argument(
        "--out",
        required=True,
        help="Parquet file to write, ending in .parquet, in an existing folder (required)",
    )
    p_pack.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="bfd",
        help="bfd: best-fit decreasing; ffd: first-fit decreasing; greedy: next-fit in input "
        "order; wrap: concatenate and cut at row ends",
    )
    p_pack.add_argument(
        "--labels-column", default=None, help="field with per-sample labels (default: none)"
    )
    p_pack.add_argument(
        "--seed", type=_SEED, default=0, help="seed of the row order of bfd and ffd"
    )
    p_pack.add_argument(
        "--max-docs-per-row",
        type=_POSITIVE,
        default=None,
        help="most documents in one row (default: no limit)",
    )
    p_pack.add_argument("--pad-id", type=_TOKEN_ID, default=0, help="token id written on padding")
    p_pack.add_argument(
        "--plot", default=None, help="also save a PNG of sample lengths and row fill to this path"
    )

    p_stats = sub.add_parser(
        "stats", help="print what each strategy would give; write nothing", **kw
    )
    common(p_stats)

    sub.add_parser(
        "litgpt-finetune",
        help="fine-tune a LitGPT checkpoint on packed rows, as `litgpt finetune_full` does "
        "(needs the litgpt extra in its own venv; `flexpack litgpt-finetune --help` lists the "
        "options; docs/litgpt.md)",
        add_help=False,
        **kw,
    )
    demo = sub.add_parser(
        "demo", help="pack the bundled corpus and check packed == per-document", **kw
    )
    demo.add_argument(
        "--out",
        default="flexpack-demo",
        metavar="DIR",
        help="folder for the mask PNGs it draws, created if missing; a relative path is in the "
        "current folder",
    )
    demo.add_argument(
        "--max-len",
        type=_POSITIVE,
        default=1024,
        help="tokens per packed row; longer documents are split into pieces",
    )
    demo.add_argument(
        "--docs",
        type=_POSITIVE,
        default=None,
        help="use only the first N documents (default: all 601)",
    )
    return parser


def _subparser(parser: argparse.ArgumentParser, command: str) -> _Parser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    return parser


def _litgpt_finetune(argv: list[str]) -> int:
    """``flexpack litgpt-finetune ...``: the LitGPT entry point, its options unchanged."""
    try:
        from flexpack.integrations.litgpt import main as litgpt_main
    except ImportError as e:
        print(f"flexpack litgpt-finetune: error: {e}", file=sys.stderr)
        return 2
    return litgpt_main(argv)


def main(argv: list[str] | None = None) -> int:
    r"""Run the ``flexpack`` command line; returns the exit status (2 on a user error).

    Bad arguments, paths and missing extras exit with ``SystemExit(2)``; bad input files return
    2. Both print one ``flexpack CMD: error: ...`` line (a bad flag adds a line naming
    ``--help``), never the usage block or a traceback.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "data.jsonl")
        >>> with open(path, "w") as f:
        ...     _ = f.write('{"input_ids": [1, 2, 3]}\n[4, 5]\n')
        >>> main(["stats", path, "--max-len", "8"])
        2 samples, 5 tokens, --max-len 8, --overflow error, 0 samples too long
        strategy ...
        bfd               1           1   +0.00%     62.50%     2.00 ...
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["litgpt-finetune"]:
        return _litgpt_finetune(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    sub = _subparser(parser, args.command)
    try:  # values that argparse cannot check alone: paths and installed extras
        if args.command in ("pack", "stats"):
            _check_input(args.input)
        if args.command == "pack":
            _writable_file(args.out, "--out", suffixes=(".parquet", ".pq"))
            _import_pyarrow_parquet("flexpack pack writes Parquet, which")
            if args.plot:
                _check_plot(args.plot)
                _writable_file(args.plot, "--plot")
        elif args.command == "demo":
            _writable_folder(Path(args.out), f"--out {args.out}")
    except CliError as e:
        sub.fail(str(e))  # one line, exit status 2
    try:
        if args.command == "demo":
            from flexpack.demo import main as demo_main

            return demo_main(out=args.out, max_len=args.max_len, num_docs=args.docs)
        if args.command == "pack":
            return _cmd_pack(args)
        return _cmd_stats(args)
    except (CliError, ValueError, TypeError) as e:
        print(f"flexpack {args.command}: error: {_cli_words(str(e))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
