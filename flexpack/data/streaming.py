"""Streaming packing: bounded buffer, best fit inside it, exact mid-epoch resume."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from flexpack.batch import _from_pieces
from flexpack.data._common import as_tokens, check_choice, check_positive_int
from flexpack.data.dataset import _dist_default

_STRATEGIES = ("bfd", "greedy", "wrap")
_OVERFLOWS = ("error", "truncate", "split")
_STATE_VERSION = 1


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

    ``overflow`` decides about samples longer than ``max_len`` ("bfd"/"greedy"): ``"error"``,
    ``"truncate"`` (keep the first ``max_len`` tokens) or ``"split"`` (pieces of ``max_len``,
    each its own document). Empty samples are skipped.

    Splitting: with ``world_size`` ranks (default: ``torch.distributed``) and ``W`` DataLoader
    workers, reader ``g = rank * W + worker_id`` of ``n = world_size * W`` takes the samples whose
    stream index ``i`` has ``i % n == g``, so the parts are disjoint and cover the stream. Each
    reader iterates the whole stream and skips the others' samples (an indexable ``iterable``,
    e.g. a list or ``datasets.Dataset``, is indexed directly instead). Ranks may end up with
    different row counts: stop at the minimum across ranks (e.g. an all-reduce of a "done" flag),
    or use the map-style ``PackedDataset`` whose sampler guarantees equal counts.

    Resume: ``state_dict()`` describes this reader's position after the last row it yielded
    (stream position plus the buffered samples as ``(index, start, stop)``, never tokens);
    ``load_state_dict(state)`` makes the next iteration continue with exactly the rows that would
    have followed. In-process (DataLoader ``num_workers=0``) call them on the dataset; with workers
    use ``torchdata.stateful_dataloader.StatefulDataLoader``, which calls them in every worker.

    Args:
        iterable: re-iterable of token sequences (or of dicts, with ``column``; a dict's
            ``"labels"``, e.g. -100 on prompt tokens, are kept as given).
        max_len: row length S.
        buffer_size: samples held for best fit ("bfd"); must be >= 1.
        column: key of the token ids when the stream yields dicts (default ``"input_ids"``).
        rank, world_size: this process's data-parallel rank / world size.

    Raises:
        ValueError: buffer_size <= 0, max_len <= 0, rank >= world_size, unknown strategy or
            overflow, a too-long sample with overflow="error".
        TypeError: a sample that is not a token sequence (raised while iterating).

    Example:
        >>> stream = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
        >>> ds = PackedIterableDataset(stream, max_len=5, buffer_size=4)
        >>> [row.input_ids.tolist() for row in ds]
        [[[6, 7, 8, 9, 10]], [[1, 2, 3, 4, 5]]]
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
        pad_id: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
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
        self.column = column
        self.pad_id = int(pad_id)
        self.rank, self.world_size = _dist_default(rank, world_size)
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
            stream = itertools.islice(iter(it), g + start * n, None, n)
            yield from zip(itertools.count(start), stream, strict=False)

    def _tokens(self, k: int, sample: Any, g: int, n: int) -> tuple[Any, Any]:
        """(token ids, per-sample labels or None) of stream item ``g + k * n``."""
        where = f"stream item {g + k * n}"
        labels = sample.get("labels") if isinstance(sample, Mapping) else None
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
            if len(labels) != len(ids):
                raise ValueError(
                    f"{where} has {len(ids)} input_ids but {len(labels)} labels; they must have "
                    "the same length."
                )
        return ids, labels

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This reader's position after the last yielded row (small: indices, no tokens).

        Example:
            >>> ds = PackedIterableDataset([[1, 2], [3]], max_len=4, buffer_size=8)
            >>> ds.state_dict()["position"]
            0
        """
        c = self._cursor
        if c is not None:
            return self._make_state(c.g, c.n, c.position, c.pending(), c.rows)
        if self._resume is not None:
            return dict(self._resume)
        g, n = self._reader()
        return self._make_state(g, n, 0, [], 0)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume the next iteration from ``state`` (from ``state_dict()``).

        Raises:
            ValueError: a state from a different configuration (strategy, max_len, buffer_size,
                number of readers) or an unknown version.

        Example:
            >>> ds = PackedIterableDataset([[1, 2], [3]], max_len=4, buffer_size=8)
            >>> ds.load_state_dict(ds.state_dict())
        """
        if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"expected a state from PackedIterableDataset.state_dict() (version "
                f"{_STATE_VERSION}), got {state!r:.200}"
            )
        for key in ("strategy", "max_len", "buffer_size", "overflow"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"state was saved with {key}={state[key]!r} but this dataset has "
                    f"{key}={getattr(self, key)!r}; resume with the same configuration."
                )
        self._resume = {**state, "pending": [tuple(p) for p in state["pending"]]}
        self._cursor = None

    def _make_state(self, g: int, n: int, position: int, pending: list, rows: int) -> dict:
        return {
            "version": _STATE_VERSION,
            "strategy": self.strategy,
            "max_len": self.max_len,
            "buffer_size": self.buffer_size,
            "overflow": self.overflow,
            "reader": g,
            "num_readers": n,
            "position": position,
            "pending": [list(p) for p in pending],
            "rows_emitted": rows,
        }

    # -- iteration ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        g, n = self._reader()
        position, pending, rows = 0, [], 0
        resume, self._resume = self._resume, None
        if resume is not None:
            if (resume["reader"], resume["num_readers"]) != (g, n):
                raise ValueError(
                    f"state is for reader {resume['reader']} of {resume['num_readers']} but this "
                    f"is reader {g} of {n} (rank * num_workers + worker); resume with the same "
                    "world size and number of DataLoader workers."
                )
            position, rows = resume["position"], resume["rows_emitted"]
            pending = [tuple(p) for p in resume["pending"]]
        packer = _Packer(self.strategy, self.max_len, self.buffer_size)
        # Set now, not at the first next(): state_dict() right after iter() must see the resume.
        self._cursor = _Cursor(g, n, position, rows, packer, pending)
        return self._run(self._cursor, pending)

    def _pieces(self, k: int, tok: Any) -> list[tuple[int, int, int]]:
        m, length = self.max_len, len(tok)
        if length == 0:
            return []
        if length <= m or self.strategy == "wrap":
            return [(k, 0, length)]
        if self.overflow == "error":
            raise ValueError(
                f"a sample of {length} tokens does not fit max_len={m}; pass overflow='truncate' "
                "or overflow='split', or raise max_len."
            )
        if self.overflow == "truncate":
            return [(k, 0, m)]
        return [(k, s, min(s + m, length)) for s in range(0, length, m)]

    def _run(self, cursor: _Cursor, pending: list) -> Iterator[Any]:
        g, n, position, packer = cursor.g, cursor.n, cursor.position, cursor.packer
        tokens: dict[int, Any] = {}
        labels: dict[int, Any] = {}  # per-sample labels of the samples in ``tokens`` that have them
        need = {p[0] for p in pending}
        if need:  # re-read the buffered samples of the saved state
            for k, sample in self._samples(g, n, min(need)):
                if k in need:
                    tokens[k], lab = self._tokens(k, sample, g, n)
                    if lab is not None:
                        labels[k] = lab
                    need.discard(k)
                if not need or k >= position:
                    break
            if need:
                raise ValueError(
                    f"the stream has fewer items than the saved state refers to (missing local "
                    f"indices {sorted(need)[:5]}); resume on the same stream."
                )
        live: dict[int, int] = {}  # "bfd": pieces of sample k still in the buffer

        def emit(row: list[tuple[int, int, int]]) -> Any:
            pieces = [[tokens[k][s:e] for k, s, e in row]]
            given = [[labels[k][s:e] if k in labels else None for k, s, e in row]]
            batch = _from_pieces(pieces, self.max_len, pad_id=self.pad_id, labels=given)
            if self.strategy == "bfd":  # pieces are never cut further: count them
                for k, _, _ in row:
                    live[k] -= 1
                    if not live[k]:
                        del live[k], tokens[k]
                        labels.pop(k, None)
            else:  # the open row and the queue hold the only pieces still needed
                keep = {k for k, _, _ in packer.pending()}
                for k in {k for k, _, _ in row} - keep:
                    del tokens[k]
                    labels.pop(k, None)
            cursor.rows += 1
            return batch

        # Feeding the saved pieces again rebuilds the packer exactly (it is deterministic).
        if self.strategy == "bfd":
            for k, _, _ in pending:
                live[k] = live.get(k, 0) + 1
        cursor.unfed = []  # from here on the packer holds the saved pieces
        for row in packer.push(pending):
            yield emit(row)
        for k, sample in self._samples(g, n, position):
            tok, lab = self._tokens(k, sample, g, n)
            pieces = self._pieces(k, tok)
            cursor.position = k + 1
            if pieces:
                tokens[k] = tok
                if lab is not None:
                    labels[k] = lab
                if self.strategy == "bfd":  # only "bfd" frees by count; kept for it alone
                    live[k] = len(pieces)
            for row in packer.push(pieces):
                yield emit(row)
        for row in packer.flush():
            yield emit(row)


class _Cursor:
    """Where a running iteration stands; read by state_dict() while the generator is paused."""

    def __init__(
        self, g: int, n: int, position: int, rows: int, packer: _Packer, unfed: list
    ) -> None:
        self.g, self.n, self.position, self.rows, self.packer = g, n, position, rows, packer
        self.unfed = unfed  # saved pieces not yet fed to the packer (before the first next())

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
