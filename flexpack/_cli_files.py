"""The files of the ``flexpack`` command line: the token ids it reads, the rows and plot it writes.

Input: JSONL (one ``{"input_ids": [...]}`` object, or one bare ``[...]`` list, per line) or
Parquet (a list column), read into ``_Samples``, the token ids of all samples back to back:

    ids:     (T,) int64          the token ids of every sample, one after another
    offsets: (n + 1,) int64      sample k is ids[offsets[k]:offsets[k + 1]]
    labels:  (T,) int64 or None  per-token labels, -100 where no loss (--labels-column)

Output: a Parquet file of rows of ``max_len`` tokens with the columns ``input_ids``,
``labels``, ``doc_ids`` and ``position_ids``, and the ``--plot`` PNG. The checks of the paths
(``_check_input``, ``_writable_file``, ``_writable_folder``, ``_check_plot``) run before any
input is read.

Only the standard library loads at import, as for ``flexpack.cli`` above it: numpy and pyarrow
load inside the functions that need them, and torch only after a file has passed its checks (the
one exception: a uint64 Parquet column is checked by ``flexpack.layout``), so an error in the
input comes back before torch loads. Every user error is a ``CliError``, which the command line
prints as one line. This module never imports ``flexpack.cli`` (imports flow down).
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from flexpack.packing import PackPlan


_ROWS_PER_CHUNK = 1024
_INT64 = (-(2**63), 2**63 - 1)
_INSTALL = "pip install 'flexpack[cli]' (in a flexpack checkout: pip install -e '.[cli]')"
_TOKENIZE_HINT = (
    "flexpack packs token ids and does not tokenize. Tokenize first, e.g. with transformers: "
    "tok = AutoTokenizer.from_pretrained(NAME); then write one "
    "json.dumps({'input_ids': tok(record['text'])['input_ids']}) line per record"
)


class CliError(Exception):
    """A user error: printed as ``flexpack CMD: error: ...`` with exit status 2."""


@dataclass(frozen=True)
class _Samples:
    """Token ids of all samples as one flat array plus offsets (no Python object per sample)."""

    ids: np.ndarray  # (T,) int64
    offsets: np.ndarray  # (n + 1,) int64
    labels: np.ndarray | None  # (T,) int64 or None
    where: Callable[[int], str]  # names sample k in errors as the file does: "f.jsonl:7" (1-based)

    @property
    def lengths(self) -> np.ndarray:
        import numpy as np

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


def _read_jsonl(path: Path, column: str | None, labels_column: str | None, bar: bool) -> _Samples:
    """Samples of a JSONL file; ``column`` None: the default field, and bare lists allowed."""
    given, column = column is not None, column or "input_ids"
    ids_parts: list[list[int]] = []
    label_parts: list[list[int] | None] = []
    lines: list[int] = []  # the 1-based line of each sample, for the errors that name one
    progress = _progress(path.stat().st_size, f"read {path.name}", bar, unit="B")
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            progress.update(len(raw))
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise CliError(
                    f"{path}:{lineno}: not UTF-8 text (byte {raw[e.start]:#04x} at column "
                    f"{e.start + 1}); JSONL must be UTF-8, one JSON value per line"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise CliError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if isinstance(record, list):  # a bare list of token ids
                for flag, name in (("--column", column if given else None),
                                   ("--labels-column", labels_column)):  # fmt: skip
                    if name is not None:
                        raise CliError(
                            f"{path}:{lineno}: a bare list has no {name!r} field for {flag}; "
                            f'write objects ({{"{column}": [...], "{labels_column or "labels"}": '
                            f"[...]}}), or drop {flag} (a bare list is the token ids)"
                        )
                ids_parts.append(record)
                lines.append(lineno)
                continue
            if not isinstance(record, dict) or column not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                hint = (
                    f". {_TOKENIZE_HINT}" if isinstance(record, dict) and "text" in record else ""
                )
                raise CliError(
                    f"{path}:{lineno}: no {column!r} field (found {keys}); pick the token column "
                    f"with --column, or write one bare list of token ids per line{hint}"
                )
            ids_parts.append(record[column])
            lines.append(lineno)
            if labels_column is not None:  # no labels field: labelled by its tokens, as a null
                label_parts.append(record.get(labels_column))
    progress.close()
    if not ids_parts:
        raise CliError(f"{path}: no samples (the file is empty or has only blank lines)")
    return _to_samples(
        ids_parts, label_parts if labels_column else None, lambda k: f"{path}:{lines[k]}"
    )


def _to_samples(ids_parts: list, label_parts: list | None, where: Callable[[int], str]) -> _Samples:
    """The samples as flat arrays; ``where(k)`` names sample k in errors (``file:line``).

    A null labels field (None) labels its sample by its tokens, the rule of every flexpack path.
    """
    import numpy as np

    if label_parts is not None:
        label_parts = [
            p if lab is None else lab for p, lab in zip(ids_parts, label_parts, strict=True)
        ]
    for what, parts in (("token ids", ids_parts), ("labels", label_parts or [])):
        for k, p in enumerate(parts):
            # np.fromiter below would silently truncate floats (and read bools as 0/1): every
            # value must be an int; set(map(type, ...)) checks them at C speed
            kinds = set(map(type, p)) if isinstance(p, list) else set()
            if not isinstance(p, list) or kinds - {int}:
                got = ", ".join(sorted(t.__name__ for t in kinds - {int}))
                hint = f". {_TOKENIZE_HINT}" if isinstance(p, str) or str in kinds else ""
                raise CliError(
                    f"{where(k)}: {what} must be a list of integer {what}; got "
                    f"{type(p).__name__}{' with ' + got if got else ''}{hint}"
                )
    if label_parts is not None:
        for k, (a, b) in enumerate(zip(ids_parts, label_parts, strict=True)):
            if len(a) != len(b):
                raise CliError(
                    f"{where(k)}: {len(a)} token ids but {len(b)} labels; give one label per "
                    "token (-100 where no loss), or drop --labels-column"
                )
    lengths = np.fromiter((len(p) for p in ids_parts), np.int64, len(ids_parts))
    offsets = np.zeros(len(ids_parts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = _flat_int64(ids_parts, int(offsets[-1]), "token ids", where)
    _check_token_ids(ids, offsets, where)
    labels = None
    if label_parts is not None:
        labels = _flat_int64(label_parts, ids.shape[0], "labels", where)
    return _Samples(ids, offsets, labels, where)


def _flat_int64(parts: list[list[int]], total: int, what: str, where: Callable[[int], str]):
    """The lists back to back as one int64 array; an int past int64 names its sample."""
    import numpy as np

    try:
        return np.fromiter(itertools.chain.from_iterable(parts), np.int64, total)
    except OverflowError:  # the slow search runs only on the error path
        k, big = next(
            (k, x) for k, p in enumerate(parts) for x in p if not _INT64[0] <= x <= _INT64[1]
        )
        raise CliError(
            f"{where(k)}: {what} hold {big}, which does not fit int64; token ids lie in "
            "0..2**63 - 1 (check the tokenizer output)"
        ) from None


def _check_token_ids(ids: np.ndarray, offsets: np.ndarray, where: Callable[[int], str]) -> None:
    """Refuse a negative token id (no tokenizer writes one; -1 often marks padding elsewhere)."""
    import numpy as np

    if ids.size and int(ids.min()) < 0:
        at = int(np.argmax(ids < 0))
        k = int(np.searchsorted(offsets, at, side="right")) - 1
        raise CliError(
            f"{where(k)}: token id {int(ids[at])} is negative; token ids are >= 0 (a "
            "tokenizer's vocabulary indices). Map or drop that sample; padding is --pad-id"
        )


def _read_parquet(path: Path, column: str | None, labels_column: str | None) -> _Samples:
    import numpy as np

    pq = _import_pyarrow_parquet("reading Parquet")
    import pyarrow as pa

    try:
        names = pq.read_schema(path).names
    except Exception as e:  # pyarrow raises its own error types for unreadable files
        raise CliError(f"{path}: cannot read as Parquet ({e})") from None
    column = column or "input_ids"
    wanted = [column] + ([labels_column] if labels_column else [])
    for name in wanted:
        if name not in names:
            raise CliError(f"{path}: no column {name!r} (columns: {names}); use --column")
    table = pq.read_table(path, columns=wanted)

    def flat(name: str, labels: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(values int64, offsets from 0, null rows or None); a labels row may be null."""
        col = table.column(name).combine_chunks()
        null_rows = None
        if labels and col.null_count:  # a null labels row: labelled by its tokens
            null_rows = col.is_null().to_numpy(zero_copy_only=False)
            col = col.fill_null(pa.scalar([], col.type))
        if not hasattr(col, "offsets") or not pa.types.is_integer(col.type.value_type):
            hint = f" {_TOKENIZE_HINT}" if pa.types.is_string(col.type) else ""
            raise CliError(
                f"{path}: column {name!r} must be a list of integer token ids; got {col.type}. "
                f"Tokenize it, or cast it to list<int64>.{hint}"
            )
        if col.null_count:
            row = col.is_null().to_numpy(zero_copy_only=False).argmax()
            raise CliError(f"{path}: row {row} of column {name!r} is null; drop or fill it")
        offsets = col.offsets.to_numpy().astype(np.int64)
        values = col.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
        if values.null_count:
            at = int(values.is_null().to_numpy(zero_copy_only=False).argmax()) + offsets[0]
            row = int(np.searchsorted(offsets, at, side="right")) - 1
            raise CliError(
                f"{path}: row {row} of column {name!r} holds a null token id; drop or fill it"
            )
        values = values.to_numpy(zero_copy_only=False)
        at = None
        if values.dtype == np.uint64:  # only then: flexpack.layout imports torch
            from flexpack.layout import _first_past_int64

            at = _first_past_int64(values)  # the shared check of every token reader
        if at is not None:
            row = int(np.searchsorted(offsets - offsets[0], at, side="right")) - 1
            raise CliError(
                f"{path}: row {row} of column {name!r} holds {int(values[at])}, which does not "
                "fit int64; token ids lie in 0..2**63 - 1 (check the tokenizer output)"
            )
        return values.astype(np.int64, copy=False), offsets - offsets[0], null_rows

    def where(k: int) -> str:
        return f"{path}: row {k} of column {column!r}"

    ids, offsets, _ = flat(column)
    if len(offsets) == 1:
        raise CliError(f"{path}: no samples (column {column!r} has 0 rows)")
    _check_token_ids(ids, offsets, where)
    labels = None
    if labels_column:
        labels, label_offsets, null_rows = flat(labels_column, labels=True)
        if null_rows is not None:  # rebuild with each null row's tokens as its labels
            lens = np.diff(label_offsets)
            lens[null_rows] = np.diff(offsets)[null_rows]
            parts = np.split(labels, label_offsets[1:-1])
            tokens = np.split(ids, offsets[1:-1])
            labels = np.concatenate(
                [t if n else p for t, p, n in zip(tokens, parts, null_rows.tolist(), strict=True)]
            )
            label_offsets = np.concatenate([[0], np.cumsum(lens)])
        bad = np.flatnonzero(np.diff(offsets) != np.diff(label_offsets))
        if bad.size:
            k = int(bad[0])
            raise CliError(
                f"{path}: row {k}: {int(np.diff(offsets)[k])} token ids in {column!r} but "
                f"{int(np.diff(label_offsets)[k])} labels in {labels_column!r}; give one label "
                "per token (-100 where no loss), or drop --labels-column"
            )
    return _Samples(ids, offsets, labels, where)


def _import_pyarrow_parquet(why: str) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise CliError(f"{why} needs pyarrow: {_INSTALL} (or pip install pyarrow)") from None
    return pq


def _check_input(path: str) -> Path:
    """The input file, its format known and its reader's dependencies installed."""
    p = Path(path)
    if p.is_dir():
        raise CliError(f"{path} is a directory; pass a .jsonl or .parquet file")
    if not p.is_file():
        raise CliError(f"{path}: no such file")
    suffix = p.suffix.lower()
    if suffix in (".parquet", ".pq"):
        _import_pyarrow_parquet(f"reading {p.name}")
    elif suffix not in (".jsonl", ".json", ".ndjson"):
        raise CliError(f"{path}: unknown format {suffix!r}; expected .jsonl or .parquet")
    if not os.access(p, os.R_OK):
        raise CliError(f"{path}: not readable (permission denied)")
    return p


def _read(path: str, column: str | None, labels_column: str | None, bar: bool) -> _Samples:
    p = _check_input(path)
    if p.suffix.lower() in (".parquet", ".pq"):
        return _read_parquet(p, column, labels_column)
    return _read_jsonl(p, column, labels_column, bar)


def _writable_file(path: str, flag: str, suffixes: tuple[str, ...] = ()) -> str:
    """Refuse an output path that is a directory, not a regular file (/dev/full), has none of
    ``suffixes``, or that cannot really be written.

    Writing is tried, not asked: ``os.access`` says yes to root (Docker, CI) even in /proc or
    /sys. An existing file is opened for appending (its content untouched); otherwise a
    temporary file is created and removed in the nearest existing folder.
    """
    p = Path(path)
    if p.is_dir():
        raise CliError(f"{flag} {path} is a directory; give a file name, e.g. {p / 'out'}")
    if suffixes and p.suffix.lower() not in suffixes:
        raise CliError(
            f"{flag} {path}: expected a file name ending in {' or '.join(suffixes)} (the file "
            f"is written as {suffixes[0][1:].capitalize()}), e.g. {p.with_suffix(suffixes[0])}"
        )
    if p.exists() and not p.is_file():
        raise CliError(
            f"{flag} {path} exists and is not a regular file (a device, pipe or socket); give "
            "the name of a file in a folder"
        )
    if not p.parent.exists():  # refused, not created: a typo in the path would make folders
        raise CliError(
            f"{flag} {path}: the folder {p.parent} does not exist; create it first "
            f"(mkdir -p {p.parent}) or write to an existing folder"
        )
    _writable_folder(p.parent, f"{flag} {path}")
    if p.exists():
        try:
            open(p, "ab").close()
        except OSError as e:
            raise CliError(f"{flag} {path}: the file exists and cannot be written ({e})") from None
    return path


def _writable_folder(folder: Path, what: str) -> None:
    import tempfile

    if folder.exists() and not folder.is_dir():
        raise CliError(f"{what}: {folder} is a file, not a folder")
    existing = folder
    while not existing.exists():  # the folder is created later: its nearest existing parent
        existing = existing.parent
    if not existing.is_dir():
        raise CliError(f"{what}: {existing} is a file, not a folder")
    try:  # try it: os.access says yes to root even where nothing can be written (/proc, /sys)
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".flexpack-check-"):
            pass
    except OSError as e:
        reason = "permission denied" if isinstance(e, PermissionError) else e.strerror or e
        raise CliError(f"{what}: cannot write in {existing} ({reason})") from None


def _check_plot(path: str) -> None:
    """matplotlib installed and ``path``'s extension one of its image formats, before any work."""
    try:
        import matplotlib  # noqa: F401  (first: its submodules may be imported already)
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise CliError(f"--plot needs matplotlib: {_INSTALL} (or pip install matplotlib)") from None
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    suffix = Path(path).suffix.lower()[1:]
    if suffix not in formats:
        what = f"has the unknown image format .{suffix}" if suffix else "has no file extension"
        raise CliError(
            f"--plot {path} {what}; name the image with one of "
            f"{', '.join('.' + f for f in formats)}, e.g. {Path(path).with_suffix('.png')}"
        )


def _write_parquet(plan: PackPlan, samples: _Samples, out: str, pad_id: int, bar: bool) -> None:
    import numpy as np
    import pyarrow as pa

    from flexpack._packed_batch import _assemble

    pq = _import_pyarrow_parquet("writing Parquet")
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
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.hist(lengths, bins=min(100, max(10, int(np.sqrt(lengths.size)))), color="tab:blue")
    left.axvline(plan.max_len, color="tab:red", ls="--", label=f"max_len={plan.max_len}")
    left.set(title="sample lengths", xlabel="tokens", ylabel="samples")
    left.legend()
    fill = plan.row_lengths() / plan.max_len
    right.hist(fill, bins=50, range=(0, 1), color="tab:green")
    right.set_yscale("log")  # the few underfilled rows matter; a linear axis hides them
    # From 1 row (a bar of 1 stands half a decade tall): autoscale started at the decade below the
    # smallest bar (10 when every bar held 10 rows or more), as if no bar could be shorter.
    right.set_ylim(bottom=0.5)
    right.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    right.set(
        title=f"row fill ({plan.strategy}: {plan.num_rows} rows, {plan.efficiency:.2%} efficient)",
        xlabel="filled fraction of the row",
        ylabel="rows (log scale)",
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
