"""Streaming packing: bounded buffer, best fit inside it, exact mid-epoch resume, ranks in step.

Shapes: every yielded row is a one-row ``PackedBatch``: ``input_ids`` (1, S) int64, ``labels``
(1, S) int64, ``doc_ids`` (1, S) int32 with -1 on padding, S = ``max_len``. A *piece* is
``(k, start, stop)``: tokens ``start:stop`` of stream item ``k``; the packer sees only pieces
(lengths), never tokens, which is what keeps ``state_dict()`` small and lets every rank plan the
same rows while building only its own.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import numbers
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from flexpack._packed_batch import _check_pad_id, _from_pieces
from flexpack.data._common import (
    HFSource,
    _check_list_type,
    _is_hf_dataset,
    _is_null_type,
    as_tokens,
    check_choice,
    check_label_length,
    check_positive_int,
)
from flexpack.data.dataset import _dist_default

_STRATEGIES = ("bfd", "greedy", "wrap")
_OVERFLOWS = ("error", "truncate", "split")
_STATE_VERSION = 1
_REQUIRED = {  # state key -> what it must be
    "strategy": "a str",
    "max_len": "an int >= 1",
    "buffer_size": "an int >= 1",
    "overflow": "a str",
    "reader": "an int >= 0",
    "num_readers": "an int >= 1",
    "position": "an int >= 0",
    "pending": "a list of [index, start, stop] int triples with 0 <= start < stop",
    "rows_emitted": "an int >= 0",
}
_COUNTS = ("rows_yielded", "padding_rows", "truncated", "truncated_samples")  # optional, >= 0
_HF_ITER_BATCH = 256  # rows per batch when reading a datasets.IterableDataset in a worker
_ARROW_CHUNK = 8192  # HF lengths are read this many rows at a time: bounded memory


@dataclasses.dataclass(frozen=True)
class StreamStats:
    """What one reader (rank x DataLoader worker) yielded so far in the current epoch.

    Attributes:
        rows: rows yielded, padding rows included.
        padding_rows: all-padding rows yielded (``sync_ranks=True`` only: they equalize the row
            counts of the ranks at the end of the stream; no token is repeated).
        truncated: tokens cut off by ``overflow="truncate"`` from the samples of these rows.
        truncated_samples: samples that lost tokens that way.
    """

    rows: int
    padding_rows: int
    truncated: int
    truncated_samples: int


class PackedIterableDataset(torch.utils.data.IterableDataset):
    """Packs a stream of token sequences into rows of ``max_len`` with bounded memory.

    Yields one-row ``PackedBatch`` es (``input_ids`` (1, max_len) int64, ``labels``, ``doc_ids``
    int32 with -1 padding); batch them with ``flexpack.data.collate``.

    Strategies (memory is at most ``buffer_size`` samples plus one row):

    - ``"bfd"``: samples wait in a buffer; when it holds ``buffer_size`` samples, one row is
      filled best-fit decreasing from it (the longest sample, then repeatedly the longest that
      still fits). At the end of the stream the buffer is flushed the same way: no sample is lost.
      Documents inside a row keep their stream order.
    - ``"greedy"``: next fit in stream order: a row is emitted when the next sample does not fit.
    - ``"wrap"``: the stream is concatenated and cut every ``max_len`` tokens (no padding but the
      last row; documents are split across rows, each piece is its own document).

    ``overflow`` decides about samples longer than ``max_len``, as in ``flexpack.pack``:
    ``"error"``, ``"truncate"`` (keep the first ``max_len`` tokens; with ``"wrap"`` the kept
    tokens are then wrapped like any sample; counted in ``stats.truncated``) or ``"split"``
    (pieces of ``max_len``, each its own document). ``"wrap"`` cuts samples at row ends by
    design, so there ``"error"`` and ``"split"`` change nothing. Empty samples are skipped.

    Splitting (``sync_ranks=False``, the default): with ``world_size`` ranks (default:
    ``torch.distributed``) and ``W`` DataLoader workers, reader ``g = rank * W + worker_id`` of
    ``n = world_size * W`` takes the samples whose stream index ``i`` has ``i % n == g`` and packs
    them on its own. The parts are disjoint and cover the stream, but ranks may end with
    different row counts, which hangs DDP/FSDP unless the loop stops all ranks together.

    ``sync_ranks=True`` keeps the ranks in step: every rank reads the lengths of the whole stream
    and runs the same deterministic packer over them, so all ranks plan the same global rows;
    global row ``t`` belongs to rank ``t % world_size`` (and, with ``W`` workers, to worker
    ``(t // world_size) % W``), and each rank builds only its own rows. At the end of the stream
    the ranks that are one row short get one all-padding row each (no tokens, labels all -100,
    counted in ``stats.padding_rows``; at most ``world_size - 1`` per epoch), so every rank
    yields the same number of rows, every epoch, and every token is still delivered once. Rows
    are those of a single-process run with the same ``buffer_size``. A Hugging Face
    ``datasets.Dataset`` is read through Arrow list offsets (lengths) and only the own rows'
    tokens are fetched; any other source is read in full by every rank and DataLoader worker (the
    tokens of at most ``buffer_size`` samples are held). Every rank must see the same stream:
    pass the whole dataset, not a per-rank split (``split_dataset_by_node``).

    Resume: ``state_dict()`` describes this reader's position after the last row it yielded
    (stream position plus the buffered samples as ``(index, start, stop)``, never tokens);
    ``load_state_dict(state)`` makes the next iteration continue with exactly the rows that would
    have followed. In-process (DataLoader ``num_workers=0``) call them on the dataset; with workers
    use ``torchdata.stateful_dataloader.StatefulDataLoader``, which calls them in every worker.

    Args:
        iterable: re-iterable of token sequences (or of dicts, with ``column``).
        max_len: row length S.
        buffer_size: samples held for best fit ("bfd"); must be >= 1.
        strategy: ``"bfd"``, ``"greedy"`` or ``"wrap"``.
        overflow: ``"error"``, ``"truncate"`` or ``"split"``.
        column: key of the token ids when the stream yields dicts (default ``"input_ids"``).
        labels_column: key of per-token labels (e.g. -100 on prompt tokens) in dict samples; a
            sample that has it keeps its labels (each document's first token is still -100), one
            without it is labelled by its tokens. ``None`` ignores labels in the stream.
        pad_id: token id of padding slots.
        rank, world_size: this process's data-parallel rank / world size.
        sync_ranks: give every rank the same number of rows (see above).

    Raises:
        ValueError: buffer_size <= 0, max_len <= 0, rank >= world_size, unknown strategy or
            overflow; while iterating: a too-long sample with overflow="error", labels whose
            length differs from their tokens.
        TypeError: a sample that is not a token sequence (raised while iterating).

    Example:
        >>> stream = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
        >>> ds = PackedIterableDataset(stream, max_len=5, buffer_size=4)
        >>> [row.input_ids.tolist() for row in ds]
        [[[6, 7, 8, 9, 10]], [[1, 2, 3, 4, 5]]]
        >>> kw = dict(buffer_size=4, world_size=3, sync_ranks=True)
        >>> ranks = [PackedIterableDataset(stream, 5, rank=r, **kw) for r in range(3)]
        >>> [[row.input_ids[0].tolist() for row in ds] for ds in ranks]  # rank 2: one padding row
        [[[6, 7, 8, 9, 10]], [[1, 2, 3, 4, 5]], [[0, 0, 0, 0, 0]]]
        >>> ranks[2].stats.padding_rows
        1
    """

    def __init__(
        self,
        iterable: Iterable[Any],
        max_len: int,
        *,
        buffer_size: int = 1024,
        strategy: str = "bfd",
        overflow: str = "error",
        column: str | None = None,
        labels_column: str | None = "labels",
        pad_id: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        sync_ranks: bool = False,
    ) -> None:
        if isinstance(iterable, (str, bytes)) or not hasattr(iterable, "__iter__"):
            raise TypeError(
                f"iterable is a {type(iterable).__name__}, expected a re-iterable of token "
                "sequences (list, datasets.Dataset, an object with __iter__)."
            )
        if isinstance(iterable, Iterator):
            raise TypeError(
                "iterable is a one-shot iterator; resume and multi-worker splitting need to "
                "iterate it again. Pass a list or an object whose __iter__ restarts the stream."
            )
        self.iterable = iterable
        self.max_len = check_positive_int("max_len", max_len)
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size <= 0:
            raise ValueError(
                f"buffer_size must be a positive int, got {buffer_size!r}; 1024 or more keeps "
                "padding low on typical length distributions (see docs/data.md)."
            )
        self.buffer_size = buffer_size
        self.strategy = check_choice("strategy", strategy, _STRATEGIES)
        self.overflow = check_choice("overflow", overflow, _OVERFLOWS)
        for name, value in (("column", column), ("labels_column", labels_column)):
            if value is not None and not isinstance(value, str):
                raise TypeError(
                    f"{name} must be a str or None, got {type(value).__name__} ({value!r:.60})."
                )
        if labels_column is not None and labels_column == (column or "input_ids"):
            raise ValueError(
                f"labels_column={labels_column!r} is also the token column; pass the column "
                "that holds the labels, or labels_column=None to label by the tokens."
            )
        if not isinstance(sync_ranks, bool):
            raise TypeError(f"sync_ranks must be True or False, got {sync_ranks!r}.")
        self.column = column
        self.labels_column = labels_column
        self.pad_id = _check_pad_id(pad_id)  # int(1.7) would write token 1 silently
        self.rank, self.world_size = _dist_default(rank, world_size)
        node = getattr(iterable, "_distributed", None)  # datasets' split_dataset_by_node marker
        if self.world_size > 1 and node is not None and _is_hf_dataset(iterable):
            raise ValueError(
                f"iterable is already split by datasets' split_dataset_by_node (rank "
                f"{getattr(node, 'rank', '?')} of {getattr(node, 'world_size', '?')}), and "
                f"PackedIterableDataset splits the stream among world_size={self.world_size} "
                "ranks itself: each rank would read a fraction of its share and the rest would "
                "be lost. Pass the whole dataset (flexpack splits it), or world_size=1, rank=0 "
                "to pack this rank's split as it is."
            )
        self.sync_ranks = sync_ranks
        self._resume: dict[str, Any] | None = None
        self._cursor: _Cursor | None = None

    # -- reader split ------------------------------------------------------------------------
    def _reader(self) -> tuple[int, int]:
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        return self.rank * workers + worker, self.world_size * workers

    def _samples(self, g: int, n: int, start: int) -> Iterator[tuple[int, Any]]:
        """(local index k, sample) for stream indices g + k*n, k >= start."""
        it = self.iterable
        if hasattr(it, "__getitem__") and hasattr(it, "__len__") and not isinstance(it, Mapping):
            for k in itertools.count(start):
                i = g + k * n
                if i >= len(it):
                    return
                yield k, it[i]
        else:
            stream = itertools.islice(_whole_stream(it), g + start * n, None, n)
            yield from zip(itertools.count(start), stream, strict=False)

    def _tokens(self, k: int, sample: Any, g: int, n: int) -> tuple[Any, Any]:
        """(token ids, per-sample labels or None) of stream item ``g + k * n``."""
        where = f"stream item {g + k * n}"
        labels = None
        if isinstance(sample, Mapping) and self.labels_column is not None:
            labels = sample.get(self.labels_column)
        if self.column is None and isinstance(sample, Mapping) and "input_ids" in sample:
            sample = sample["input_ids"]  # rows of a datasets.Dataset / tokenizer output
        elif self.column is not None:
            if not isinstance(sample, Mapping) or self.column not in sample:
                keys = list(sample) if isinstance(sample, Mapping) else type(sample).__name__
                raise ValueError(
                    f"stream item {g + k * n} has no column {self.column!r} (got {keys}); pass the "
                    "column that holds the token ids."
                )
            sample = sample[self.column]
        ids = as_tokens(sample, where)
        if labels is not None:
            labels = as_tokens(labels, f"labels of {where}")
            check_label_length(where, len(ids), len(labels), self.labels_column)
        return ids, labels

    # -- state -------------------------------------------------------------------------------
    @property
    def stats(self) -> StreamStats:
        """This reader's counts in the current (or last) epoch, padding rows included.

        Example:
            >>> ds = PackedIterableDataset([[1, 2, 3, 4, 5]], 4, overflow="truncate")
            >>> rows = list(ds)
            >>> ds.stats
            StreamStats(rows=1, padding_rows=0, truncated=1, truncated_samples=1)
        """
        state = self.state_dict()
        return StreamStats(
            rows=state["rows_yielded"],
            padding_rows=state["padding_rows"],
            truncated=state["truncated"],
            truncated_samples=state["truncated_samples"],
        )

    def state_dict(self) -> dict[str, Any]:
        """This reader's position after the last yielded row (small: indices, no tokens).

        Example:
            >>> ds = PackedIterableDataset([[1, 2], [3]], max_len=4, buffer_size=8)
            >>> ds.state_dict()["position"]
            0
        """
        c = self._cursor
        if c is not None:
            return self._make_state(c.g, c.n, c.position, c.pending(), c.rows, c.counts)
        if self._resume is not None:
            return {**self._resume, "pending": [list(p) for p in self._resume["pending"]]}
        g, n = self._reader()
        return self._make_state(g, n, 0, [], 0, dict.fromkeys(_COUNTS, 0))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume the next iteration from ``state`` (from ``state_dict()``).

        Raises:
            ValueError: not a state from ``state_dict()`` (a missing or malformed field, an
                unknown version), or a state from a different configuration (strategy, max_len,
                buffer_size, overflow, sync_ranks, world size).

        Example:
            >>> ds = PackedIterableDataset([[1, 2], [3]], max_len=4, buffer_size=8)
            >>> ds.load_state_dict(ds.state_dict())
        """
        state = _check_state(state)
        for key in ("strategy", "max_len", "buffer_size", "overflow", "sync_ranks"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"state was saved with {key}={state[key]!r} but this dataset has "
                    f"{key}={getattr(self, key)!r}; resume with the same configuration."
                )
        self._resume = state
        self._cursor = None

    def _make_state(
        self, g: int, n: int, position: int, pending: list, rows: int, counts: dict[str, int]
    ) -> dict:
        return {
            "version": _STATE_VERSION,
            "strategy": self.strategy,
            "max_len": self.max_len,
            "buffer_size": self.buffer_size,
            "overflow": self.overflow,
            "sync_ranks": self.sync_ranks,
            "world_size": self.world_size,
            "reader": g,
            "num_readers": n,
            "position": position,
            "pending": [list(p) for p in pending],
            "rows_emitted": rows,
            **counts,
        }

    # -- iteration ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        g, n = self._reader()
        position, pending, rows = 0, [], 0
        counts = dict.fromkeys(_COUNTS, 0)
        resume, self._resume = self._resume, None
        if resume is not None:
            saved = (resume["reader"], resume["num_readers"])
            if saved != (g, n) or resume["world_size"] not in (None, self.world_size):
                raise ValueError(
                    f"state is for reader {resume['reader']} of {resume['num_readers']} "
                    f"(world_size={resume['world_size']}) but this is reader {g} of {n} "
                    f"(world_size={self.world_size}; reader = rank * num_workers + worker); "
                    "resume with the same world size and number of DataLoader workers."
                )
            position, rows = resume["position"], resume["rows_emitted"]
            pending = [tuple(p) for p in resume["pending"]]
            counts = {key: resume[key] for key in _COUNTS}
        packer = _Packer(self.strategy, self.max_len, self.buffer_size)
        # Set now, not at the first next(): state_dict() right after iter() must see the resume.
        self._cursor = _Cursor(g, n, position, rows, packer, pending, counts)
        return self._run(self._cursor, pending)

    def _pieces(self, k: int, length: int) -> list[tuple[int, int, int]]:
        m = self.max_len
        if length == 0:
            return []
        if length <= m:
            return [(k, 0, length)]
        if self.overflow == "truncate":  # as flexpack.pack: cut to max_len, "wrap" included
            return [(k, 0, m)]
        if self.strategy == "wrap":  # cut at row ends anyway
            return [(k, 0, length)]
        if self.overflow == "error":
            raise ValueError(
                f"a sample of {length} tokens (stream item {self._where(k)}) does not fit "
                f"max_len={m}; pass overflow='truncate' or overflow='split', or raise max_len."
            )
        return [(k, s, min(s + m, length)) for s in range(0, length, m)]

    def _where(self, k: int) -> int:
        """Stream index of read index ``k`` (per-reader index unless sync_ranks)."""
        if self.sync_ranks or self._cursor is None:
            return k
        return self._cursor.g + k * self._cursor.n

    def _items(
        self, g: int, n: int, start: int, lazy: HFSource | None
    ) -> Iterator[tuple[int, int, Any, Any]]:
        """(read index k, length, tokens or None, labels or None) from read index ``start``."""
        if lazy is None:
            for k, sample in self._samples(g, n, start):
                tok, lab = self._tokens(k, sample, g, n)
                yield k, len(tok), tok, lab
            return
        yield from ((k, length, None, None) for k, length in _hf_lengths(lazy, start))

    def _run(self, cursor: _Cursor, pending: list) -> Iterator[Any]:
        g, n, position, packer = cursor.g, cursor.n, cursor.position, cursor.packer
        world, m = self.world_size, self.max_len
        if self.sync_ranks:  # every reader plans the whole stream; owns global rows by number
            workers = n // world
            worker = g - self.rank * workers
            rg, rn = 0, 1

            def mine(t: int) -> bool:
                return t % world == self.rank and (t // world) % workers == worker

        else:
            rg, rn = g, n

            def mine(t: int) -> bool:
                return True

        lazy, lazy_labels = None, None  # HF dataset under sync_ranks: fetch own rows' tokens only
        it = self.iterable
        if self.sync_ranks and _is_hf_dataset(it) and hasattr(it, "__len__"):  # map-style
            lazy = HFSource(self.iterable, self.column or "input_ids")
            names = self.iterable.column_names
            if self.labels_column is not None and self.labels_column in names:
                labels_type = self.iterable.data.column(self.labels_column).type
                if not _is_null_type(labels_type):  # all null: labelled by the tokens
                    _check_list_type(labels_type, f"column {self.labels_column!r}", labels=True)
                    lazy_labels = HFSource(self.iterable, self.labels_column)

        tokens: dict[int, Any] = {}
        labels: dict[int, Any] = {}  # per-sample labels of the samples in ``tokens`` that have them
        need = {p[0] for p in pending}
        if need and lazy is None:  # re-read the buffered samples of the saved state
            for k, sample in self._samples(rg, rn, min(need)):
                if k in need:
                    tokens[k], lab = self._tokens(k, sample, rg, rn)
                    if lab is not None:
                        labels[k] = lab
                    need.discard(k)
                if not need or k >= position:
                    break
            if need:
                raise ValueError(
                    f"the stream has fewer items than the saved state refers to (missing read "
                    f"indices {sorted(need)[:5]}); resume on the same stream."
                )
        live: dict[int, int] = {}  # "bfd": pieces of sample k still in the buffer

        def fetch(ks: list[int]) -> tuple[dict[int, Any], dict[int, Any]]:
            ks = sorted(set(ks))
            toks = dict(zip(ks, _take_lists(lazy, ks), strict=True))
            labs = {}
            if lazy_labels is not None:
                for k, lab in zip(ks, _take_lists(lazy_labels, ks), strict=True):
                    if lab is not None:  # a null labels row: labelled by its tokens
                        check_label_length(
                            f"stream item {k}", len(toks[k]), len(lab), self.labels_column
                        )
                        labs[k] = lab
            return toks, labs

        def build(row: list[tuple[int, int, int]]) -> Any:
            toks, labs = fetch([k for k, _, _ in row]) if lazy is not None else (tokens, labels)
            for k, _, e in row:  # a truncated sample is counted at its last piece, once
                cut = len(toks[k]) - m
                if self.overflow == "truncate" and cut > 0 and e == m:
                    cursor.counts["truncated"] += cut
                    cursor.counts["truncated_samples"] += 1
            pieces = [[toks[k][s:e] for k, s, e in row]]
            given = [[labs[k][s:e] if k in labs else None for k, s, e in row]]
            return _from_pieces(pieces, m, pad_id=self.pad_id, labels=given)

        def emit(row: list[tuple[int, int, int]]) -> Any:
            """The row as a batch if this reader owns it, else None; frees finished samples."""
            batch = build(row) if mine(cursor.rows) else None
            if lazy is None and self.strategy == "bfd":  # pieces are never cut further: count
                for k, _, _ in row:
                    live[k] -= 1
                    if not live[k]:
                        del live[k], tokens[k]
                        labels.pop(k, None)
            elif lazy is None:  # the open row and the queue hold the only pieces still needed
                keep = {k for k, _, _ in packer.pending()}
                for k in {k for k, _, _ in row} - keep:
                    del tokens[k]
                    labels.pop(k, None)
            cursor.rows += 1
            if batch is not None:
                cursor.counts["rows_yielded"] += 1
            return batch

        # Feeding the saved pieces again rebuilds the packer exactly (it is deterministic).
        if self.strategy == "bfd" and lazy is None:
            for k, _, _ in pending:
                live[k] = live.get(k, 0) + 1
        cursor.unfed = []  # from here on the packer holds the saved pieces
        for row in packer.push(pending):
            if (batch := emit(row)) is not None:
                yield batch
        for k, length, tok, lab in self._items(rg, rn, position, lazy):
            pieces = self._pieces(k, length)
            cursor.position = k + 1
            if pieces and lazy is None:
                tokens[k] = tok
                if lab is not None:
                    labels[k] = lab
                if self.strategy == "bfd":  # only "bfd" frees by count; kept for it alone
                    live[k] = len(pieces)
            for row in packer.push(pieces):
                if (batch := emit(row)) is not None:
                    yield batch
        for row in packer.flush():
            if (batch := emit(row)) is not None:
                yield batch
        while self.sync_ranks and cursor.rows % world:  # the short ranks: one empty row each
            own = mine(cursor.rows)
            cursor.rows += 1
            if own:
                cursor.counts["rows_yielded"] += 1
                cursor.counts["padding_rows"] += 1
                yield _from_pieces([[]], m, pad_id=self.pad_id)


def _whole_stream(it: Iterable[Any]) -> Iterator[Any]:
    """Every item of ``it``, in every DataLoader worker.

    A ``datasets.IterableDataset`` iterated inside a worker yields only the shards HF assigns to
    that worker; flexpack splits the stream itself (or, with ``sync_ranks``, needs all of it in
    every worker), so that would silently drop items. Its ``.iter(batch_size)`` reads the whole
    stream in the same order without the worker split.
    """
    hf = sys.modules.get("datasets")
    iterable_cls = getattr(hf, "IterableDataset", None) if hf is not None else None
    if (
        iterable_cls is None
        or not isinstance(it, iterable_cls)
        or torch.utils.data.get_worker_info() is None
    ):
        yield from it
        return
    for batch in it.iter(batch_size=_HF_ITER_BATCH):
        keys = list(batch)
        for j in range(len(batch[keys[0]]) if keys else 0):
            yield {k: batch[k][j] for k in keys}


def _hf_lengths(source: HFSource, start: int) -> Iterator[tuple[int, int]]:
    """(index, length) of a HF dataset column from ``start``, through Arrow list offsets."""
    import pyarrow.compute as pc

    for a in range(start, len(source.ds), _ARROW_CHUNK):
        col = source.ds[a : a + _ARROW_CHUNK].column(source.column)
        if col.null_count:
            first = a + int(np.flatnonzero(np.asarray(col.is_null()))[0])
            raise ValueError(
                f"stream item {first} has a null {source.column!r}; drop the null rows first "
                f"(dataset.filter(lambda x: x[{source.column!r}] is not None))."
            )
        lengths = np.asarray(pc.list_value_length(col), dtype=np.int64)
        yield from zip(range(a, a + len(lengths)), lengths.tolist(), strict=True)


def _take_lists(source: HFSource, ks: list[int]) -> list[np.ndarray | None]:
    """The token lists of rows ``ks`` (sorted) as int64 arrays; None for a null row (a sample
    without labels, in a labels column).

    ``pc.list_flatten`` reads only the taken rows' values: a take of one row is a slice whose
    ``.values`` is the whole column's buffer, which a conversion of ``.values`` would copy.
    """
    import pyarrow.compute as pc

    col = source.ds[ks].column(source.column)
    flat = pc.list_flatten(col)
    counts = pc.list_value_length(col)
    null_row = np.asarray(counts.is_null()) if col.null_count else None
    lengths = np.asarray(pc.fill_null(counts, 0), dtype=np.int64)
    if flat.null_count:
        nulls = np.flatnonzero(np.asarray(flat.is_null()))
        first = ks[int(np.searchsorted(np.cumsum(lengths), nulls[0], side="right"))]
        raise ValueError(
            f"stream item {first} has a null inside its {source.column!r} list; token ids must "
            "all be set: drop or fix that row first."
        )
    values = flat.to_numpy().astype(np.int64, copy=False)
    out = np.split(values, np.cumsum(lengths)[:-1])
    if null_row is None:
        return out
    return [None if null else x for x, null in zip(out, null_row.tolist(), strict=True)]


def _check_state(state: Any) -> dict[str, Any]:
    """A copy of a state from ``state_dict()``, or a ValueError that says what is wrong."""
    hint = "pass the dict that PackedIterableDataset.state_dict() returned"
    if not isinstance(state, Mapping):
        raise ValueError(
            f"state is a {type(state).__name__} ({state!r:.80}), expected a Mapping (dict) from "
            f"PackedIterableDataset.state_dict(); {hint}."
        )
    if state.get("version") != _STATE_VERSION:
        raise ValueError(
            f"state has version {state.get('version')!r}, expected {_STATE_VERSION} (a state from "
            f"this flexpack's PackedIterableDataset.state_dict()); {hint}."
        )
    missing = [key for key in _REQUIRED if key not in state]
    if missing:
        raise ValueError(
            f"state is missing {missing}; a state from PackedIterableDataset.state_dict() has "
            f"{list(_REQUIRED)}; {hint}."
        )

    def is_int(x: Any, low: int) -> bool:
        return isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= low

    def bad(key: str, expected: str) -> ValueError:
        return ValueError(
            f"state[{key!r}] is {state[key]!r:.80}, expected {expected} (as state_dict() "
            f"writes it); {hint}."
        )

    out = dict(state)
    for key in ("strategy", "overflow"):
        if not isinstance(state[key], str):
            raise bad(key, _REQUIRED[key])
    for key, low in (("max_len", 1), ("buffer_size", 1), ("num_readers", 1)):
        if not is_int(state[key], low):
            raise bad(key, _REQUIRED[key])
    for key in ("reader", "position", "rows_emitted"):
        if not is_int(state[key], 0):
            raise bad(key, _REQUIRED[key])
    pending = state["pending"]
    if isinstance(pending, (str, bytes)) or not isinstance(pending, (list, tuple)):
        raise bad("pending", _REQUIRED["pending"])
    for p in pending:
        ok = isinstance(p, (list, tuple)) and len(p) == 3 and all(is_int(x, 0) for x in p)
        if not ok or not p[1] < p[2]:
            raise bad("pending", _REQUIRED["pending"])
    out["pending"] = [tuple(int(x) for x in p) for p in pending]
    out.setdefault("sync_ranks", False)
    out.setdefault("world_size", None)
    if not isinstance(out["sync_ranks"], bool):
        raise bad("sync_ranks", "True or False")
    if out["world_size"] is not None and not is_int(out["world_size"], 1):
        raise bad("world_size", "an int >= 1")
    for key in _COUNTS:
        out.setdefault(key, 0 if key != "rows_yielded" else out["rows_emitted"])
        if not is_int(out[key], 0):
            raise bad(key, "an int >= 0")
    return out


class _Cursor:
    """Where a running iteration stands; read by state_dict() while the generator is paused."""

    def __init__(
        self,
        g: int,
        n: int,
        position: int,
        rows: int,
        packer: _Packer,
        unfed: list,
        counts: dict[str, int],
    ) -> None:
        self.g, self.n, self.position, self.rows, self.packer = g, n, position, rows, packer
        self.unfed = unfed  # saved pieces not yet fed to the packer (before the first next())
        self.counts = dict(counts)  # StreamStats fields, carried through state_dict()

    def pending(self) -> list[tuple[int, int, int]]:
        return [tuple(p) for p in self.unfed] + self.packer.pending()


class _Packer:
    """The packing state machine over pieces ``(k, start, stop)``; no tokens, only lengths."""

    def __init__(self, strategy: str, max_len: int, buffer_size: int) -> None:
        self.strategy, self.max_len, self.buffer_size = strategy, max_len, buffer_size
        self.buf: list[tuple[int, int, int, int]] = []  # "bfd": sorted (length, k, start, stop)
        self.row: list[tuple[int, int, int]] = []  # "greedy"/"wrap": the open row, in order
        self.fill = 0
        self.incoming: list[tuple[int, int, int]] = []  # pieces not placed yet

    def pending(self) -> list[tuple[int, int, int]]:
        if self.strategy == "bfd":
            return sorted((k, s, e) for _, k, s, e in self.buf)
        return self.row + self.incoming

    def push(self, pieces: list[tuple[int, int, int]]) -> Iterator[list[tuple[int, int, int]]]:
        m = self.max_len
        if self.strategy == "bfd":
            for k, s, e in pieces:
                bisect.insort(self.buf, (e - s, k, s, e))  # all in before any row goes out
            while len(self.buf) >= self.buffer_size:
                yield self._best_fit_row()
        else:
            # Queue first, so that a state taken while a row is out lists every unplaced piece.
            self.incoming.extend(tuple(p) for p in pieces)
            while self.incoming:
                k, s, e = self.incoming[0]
                if self.strategy == "greedy":
                    if self.fill + (e - s) > m:
                        row, self.row, self.fill = self.row, [], 0
                        yield row
                    self.incoming.pop(0)
                    self.row.append((k, s, e))
                    self.fill += e - s
                else:  # wrap
                    take = min(e - s, m - self.fill)
                    if take < e - s:
                        self.incoming[0] = (k, s + take, e)
                    else:
                        self.incoming.pop(0)
                    self.row.append((k, s, s + take))
                    self.fill += take
                    if self.fill == m:
                        row, self.row, self.fill = self.row, [], 0
                        yield row

    def _best_fit_row(self) -> list[tuple[int, int, int]]:
        length, k, s, e = self.buf.pop()  # the longest
        row, room = [(k, s, e)], self.max_len - length
        while room > 0 and self.buf:
            j = bisect.bisect_right(self.buf, (room, float("inf"))) - 1
            if j < 0:
                break
            length, k, s, e = self.buf.pop(j)
            row.append((k, s, e))
            room -= length
        return sorted(row)

    def flush(self) -> Iterator[list[tuple[int, int, int]]]:
        if self.strategy == "bfd":
            while self.buf:
                yield self._best_fit_row()
        elif self.row:
            row, self.row, self.fill = self.row, [], 0
            yield row
