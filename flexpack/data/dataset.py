"""Map-style packed dataset and the rank sharding that keeps data-parallel ranks in step."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from flexpack._packed_batch import PackedBatch, _check_pad_id
from flexpack.data._common import (
    _is_arrow,
    _is_hf_dataset,
    as_source,
    check_choice,
    check_positive_int,
)
from flexpack.layout import PackedLayout

_REMAINDERS = ("drop", "pad", "error")


def shard_rows(
    num_tokens: Any,
    world_size: int,
    *,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
    remainder: str = "drop",
    cost: str = "tokens",
    sum_sq: Any = None,
    flops: tuple[float, float] | None = None,
) -> np.ndarray:
    """Deal rows to ``world_size`` ranks: equal counts, balanced cost (real tokens) per step.

    Rows are sorted by cost and cut into groups of ``world_size`` neighbours; each
    group is dealt out one row per rank (snake order, or a seeded random order when ``shuffle``),
    and with ``shuffle`` the order of the groups is a seeded permutation of ``(seed, epoch)``.
    Column ``j`` of the result is one group, so the rows that ranks process at the same step
    differ only by the spread inside a group of similar rows.

    The remainder (``len(num_tokens) % world_size`` rows) is handled by ``remainder``:
    ``"drop"`` leaves those rows out of this epoch (chosen at random per epoch when ``shuffle``,
    else the rows last in sorted order, i.e. the emptiest); ``"pad"`` repeats rows (random ones
    when ``shuffle``, else the fullest) so that every row is seen and a few twice; ``"error"``
    raises unless the rows divide evenly.

    The cost of a row is ``cost="tokens"`` (default): its real tokens; or ``cost="flops"``:
    ``a * tokens + b * sum_sq``, the matmul term plus the attention term of its documents
    (``sum_sq``: the sum over the row's documents of length squared), with ``(a, b) = flops``.
    Rows packed full have nearly equal tokens but attention work that differs many-fold (one
    8K document vs. thirty 256-token ones): "flops" keeps those apart, so that each step's
    ranks carry similar compute. :func:`flops_weights` gives ``(a, b)`` from model dims; verl's
    heuristic ``24576 * s + s^2`` is ``flops=(24576, 1)`` (a model of hidden size 2048).

    Args:
        num_tokens: (R,) int, real (non-padding) tokens per row.
        world_size: number of data-parallel ranks.
        cost: "tokens" or "flops".
        sum_sq: (R,) int, sum of squared document lengths per row (``cost="flops"``).
        flops: ``(a, b)`` (``cost="flops"``), e.g. ``flops_weights(params=..., layers=...,
            hidden=...)``.

    Returns:
        (world_size, R // world_size or ceil(R / world_size)) int64 row indices; row ``r`` of it
        lists rank ``r``'s rows in order.

    Raises:
        ValueError: world_size < 1, an unknown remainder or cost, remainder="error" with rows that
            do not divide, fewer rows than ranks with remainder="drop", or cost="flops" without
            ``sum_sq`` (of R entries) and ``flops``.

    Example:
        >>> shard_rows([10, 50, 30, 40, 20], 2, remainder="drop")  # 50+20 and 40+30 tokens
        array([[1, 4],
               [3, 2]])
        >>> # 4 full rows: two of one 64-token document, two of sixteen 4-token ones
        >>> shard_rows([64] * 4, 2, cost="flops", sum_sq=[4096, 256, 4096, 256], flops=(24, 1))
        array([[0, 3],
               [2, 1]])
    """
    world_size = check_positive_int("world_size", world_size)
    check_choice("remainder", remainder, _REMAINDERS)
    for name, value in (("seed", seed), ("epoch", epoch)):  # numpy's message names neither
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}; pass e.g. {name}=0.")
    tokens = _row_cost(_token_counts(num_tokens), cost, sum_sq, flops)
    n = len(tokens)
    rng = np.random.default_rng([int(seed), int(epoch)])
    order = rng.permutation(n) if shuffle else np.arange(n)
    k = n % world_size
    if k:
        if remainder == "error":
            raise ValueError(
                f"{n} rows do not divide among world_size={world_size} ranks ({k} left over); "
                'pass remainder="drop" (skip them this epoch) or remainder="pad" (repeat rows).'
            )
        if remainder == "drop":
            if n < world_size:
                raise ValueError(
                    f"{n} rows for world_size={world_size} ranks: remainder='drop' would leave "
                    "every rank empty; pass remainder='pad' or pack fewer, fuller rows."
                )
            if not shuffle:  # drop the emptiest rows
                order = order[np.argsort(-tokens[order], kind="stable")]
            order = order[: n - k]
        else:  # pad
            if n == 0:
                raise ValueError("no rows to shard; the dataset is empty.")
            if not shuffle:  # repeat the fullest rows
                order = order[np.argsort(-tokens[order], kind="stable")]
            order = np.concatenate([order, np.resize(order, world_size - k)])
    keyed = order[np.argsort(-tokens[order], kind="stable")]
    groups = keyed.reshape(-1, world_size)  # (G, W): each row one group of similar rows
    if shuffle:
        groups = groups[rng.permutation(len(groups))]
        groups = rng.permuted(groups, axis=1)
    else:
        groups = groups.copy()
        groups[1::2] = groups[1::2, ::-1]  # snake: no rank always gets the fullest row
    return np.ascontiguousarray(groups.T, dtype=np.int64)


_COSTS = ("tokens", "flops")


def flops_weights(*, params: float, layers: int, hidden: int) -> tuple[float, float]:
    """``(a, b)`` of ``shard_rows(cost="flops")``: training FLOPs of a row = ``a * tokens + b *
    sum(len^2)`` over its documents, for a decoder of ``params`` (non-embedding) parameters,
    ``layers`` layers of width ``hidden`` under a document-causal mask.

    Forward and backward take ~6 FLOPs per parameter per token (``a = 6 * params``); per layer,
    ``q @ k^T`` and ``p @ v`` take 2 * hidden FLOPs per (query, key) pair each, over ``len^2 / 2``
    causal pairs, three times for forward and backward: ``b = 6 * layers * hidden``. Only the
    ratio matters for the balance; ``a / b = params / (layers * hidden)``, about ``12 * hidden``
    (verl's 24576 is ``hidden = 2048``).

    Example:
        >>> flops_weights(params=7e9, layers=32, hidden=4096)  # Llama-2 7B
        (42000000000.0, 786432.0)
    """
    for name, value in (("params", params), ("layers", layers), ("hidden", hidden)):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer)) or value <= 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    return 6.0 * float(params), 6.0 * float(layers) * float(hidden)


def _token_counts(num_tokens: Any) -> np.ndarray:
    """(R,) int64 real tokens per row; floats are refused, not rounded (1.5 is not a count)."""
    if isinstance(num_tokens, torch.Tensor):
        num_tokens = num_tokens.detach().cpu().numpy()
    try:
        arr = np.asarray(num_tokens)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"num_tokens must be a 1-D array-like of ints (real tokens per row); got "
            f"{type(num_tokens).__name__} ({e})"
        ) from None
    if arr.size and (arr.dtype.kind not in "iu" or arr.dtype == np.bool_):
        raise TypeError(
            f"num_tokens must be integers (real tokens per row); got dtype {arr.dtype} (first "
            f"values {arr.reshape(-1)[:3].tolist()}). Pass e.g. "
            "[int((row.doc_ids >= 0).sum()) for row in rows], or dataset.num_tokens."
        )
    return arr.astype(np.int64).reshape(-1)


def _row_cost(tokens: np.ndarray, cost: str, sum_sq: Any, flops: Any) -> np.ndarray:
    """(R,) cost of each row: int64 tokens, or float64 ``a * tokens + b * sum_sq``."""
    check_choice("cost", cost, _COSTS)
    if cost == "tokens":
        return tokens
    if sum_sq is None or flops is None:
        raise ValueError(
            'cost="flops" needs sum_sq (per row, the sum of its document lengths squared) and '
            "flops=(a, b); e.g. flops=flexpack.data.dataset.flops_weights(params=7e9, "
            "layers=32, hidden=4096), or flops=(24576, 1) for verl's heuristic."
        )
    sq = np.asarray(sum_sq, dtype=np.float64).reshape(-1)
    if sq.shape != tokens.shape:
        raise ValueError(
            f"sum_sq has {sq.shape[0]} entries but num_tokens has {tokens.shape[0]}; pass one "
            "per row."
        )
    try:
        a, b = (float(x) for x in flops)
    except (TypeError, ValueError):
        raise ValueError(f"flops must be a pair (a, b) of numbers, got {flops!r}") from None
    return a * tokens + b * sq


def _dataset_sum_sq(dataset: Any) -> np.ndarray:
    """(R,) float64 sum of squared document lengths of each row a PackedDataset serves."""
    if hasattr(dataset, "sum_sq"):
        return np.asarray(dataset.sum_sq, dtype=np.float64).reshape(-1)
    plan = getattr(dataset, "plan", None)
    if plan is None:
        raise ValueError(
            "cost=\"flops\" reads each row's document lengths from the dataset's pack plan, and "
            f"{type(dataset).__name__} has none (rows read packed already, or an array of "
            "token counts); pass sum_sq= (per row, the sum of its document lengths squared)."
        )
    seg = plan.segments
    lengths = (seg[:, 3] - seg[:, 2]).astype(np.float64)
    per_row = np.bincount(seg[:, 0], weights=lengths**2, minlength=plan.num_rows)
    return per_row[dataset.rows]


class PackedDataset(torch.utils.data.Dataset):
    """Map-style dataset of packed rows: plans once from the lengths, builds rows on access.

    ``samples`` is any indexable of token sequences: a list of lists, a numpy object array (or a
    2-D integer array), a Hugging Face ``datasets.Dataset`` (tokens in ``column``, default
    ``"input_ids"``), a pyarrow ``Table`` (with ``column``) or ``list<int>`` Array/ChunkedArray.
    Lengths are read once (Arrow list offsets for tables, no per-row Python); ``flexpack.pack``
    plans all rows; ``ds[i]`` fetches only the samples of row ``i`` and returns a one-row
    ``PackedBatch``: ``input_ids`` (1, max_len) int64, ``labels`` (1, max_len) int64 (-100 on
    padding and on each document's first token), ``layout.doc_ids`` (1, max_len) int32.
    Batch rows with ``flexpack.data.collate`` (pass it as the DataLoader's ``collate_fn``).
    A list of dicts works too: tokens under ``column`` (default ``"input_ids"``).

    Labels: where a sample has per-token labels in ``labels_column`` (a column of the table, a
    key of a dict sample), they are kept (-100 on prompt tokens stays -100), else the tokens are
    the labels; either way each document's first token is -100. ``labels_column=None`` ignores
    them.

    Rows that are already packed (``pack_dataset``'s output: a ``datasets.Dataset`` or
    ``pyarrow.Table`` with ``input_ids`` and ``seqlens`` per row) are served as they are, each
    padded to ``max_len`` on access; there is no plan (``plan`` is None, ``lengths`` are the
    rows' token counts).

    Indexing takes an int (``ds[i]``); for several rows at once ``ds.__getitems__([i, j])``
    (a slice is refused: rows are ``PackedBatch`` es, batch them with ``collate``).

    Args:
        samples: the token sequences (see above); N samples.
        max_len: row length S.
        column: token column for a ``datasets.Dataset`` or ``pyarrow.Table``, or key of dicts.
        labels_column: column (or dict key) of per-token labels, used where present.
        strategy, overflow, seed, max_docs_per_row: passed to ``flexpack.pack``.
        pad_id: token id written on padding.

    Raises:
        TypeError: samples that are not token sequences (text, scalars, dicts without column=).
        ValueError: a missing column, max_len <= 0, or what ``flexpack.pack`` rejects.

    Example:
        >>> ds = PackedDataset([[1, 2, 3], [4, 5], [6, 7, 8, 9]], max_len=5)
        >>> len(ds), ds[0].input_ids.shape
        (2, torch.Size([1, 5]))
    """

    def __init__(
        self,
        samples: Any,
        max_len: int,
        *,
        column: str | None = None,
        labels_column: str | None = "labels",
        strategy: str = "bfd",
        overflow: str = "error",
        seed: int = 0,
        pad_id: int = 0,
        max_docs_per_row: int | None = None,
    ) -> None:
        from flexpack.packing import pack

        self.max_len = check_positive_int("max_len", max_len)
        self.pad_id = _check_pad_id(pad_id)  # int(1.7) would write token 1 silently
        self._stored: _StoredRows | None = None
        if _StoredRows.holds(samples, column):
            self._stored = _StoredRows(samples, self.max_len, labels_column)
            self.plan = None
            self.lengths = self._row_tokens = self._stored.num_tokens
            self._rows = np.arange(len(self.lengths), dtype=np.int64)
            return
        names = getattr(samples, "column_names", None) or ()
        if "doc_ids" in names and "input_ids" in names and column in (None, "input_ids"):
            raise ValueError(
                f"samples has columns {list(names)}: rows packed already and padded "
                "(pack_dataset(..., padded=True)); packing them again would merge each row's "
                "documents into one. Batch them as they are with flexpack.data.collate "
                "(DataLoader(rows, collate_fn=collate)), or pack with padded=False (unpadded "
                "rows, which PackedDataset serves)."
            )
        self._source = as_source(samples, column, labels_column)
        self.lengths = self._source.lengths()
        self.plan = pack(
            self.lengths,
            self.max_len,
            strategy=strategy,
            overflow=overflow,
            seed=seed,
            max_docs_per_row=max_docs_per_row,
        )
        segments = self.plan.segments  # (n, 4) row, sample, start, stop; ordered by row
        self._row_tokens = np.asarray(self.plan.row_lengths(), dtype=np.int64)
        self._row_ptr = self.plan.row_offsets
        self._segments = segments
        self._rows = np.arange(self.plan.num_rows, dtype=np.int64)  # this view's rows of the plan

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def rows(self) -> np.ndarray:
        """(len(self),) int64: the plan rows this dataset (or shard) serves, in order."""
        return self._rows

    @property
    def num_tokens(self) -> np.ndarray:
        """(len(self),) int64: real (non-padding) tokens of each row."""
        return self._row_tokens[self._rows]

    def segments_of(self, index: int) -> np.ndarray:
        """(k, 4) int64 ``(row, sample, start, stop)`` segments of row ``index`` in order."""
        if self._stored is not None:
            raise ValueError("rows read from a packed dataset have no plan, hence no segments.")
        row = self._rows[index]
        return self._segments[self._row_ptr[row] : self._row_ptr[row + 1]]

    def __getitem__(self, index: int) -> Any:
        if isinstance(index, slice):
            raise TypeError(
                f"PackedDataset rows are indexed by int, got the slice {index}; for several rows "
                f"use ds.__getitems__(list(range(len(ds)))[{_slice_str(index)}]) and batch them "
                "with flexpack.data.collate, or a DataLoader with collate_fn=collate."
            )
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """Rows ``indices`` as one-row PackedBatches, reading all their samples in one take.

        The DataLoader calls this for a whole batch of indices at once.
        """
        rows = []
        for index in indices:
            if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
                raise TypeError(
                    f"row index {index!r} is a {type(index).__name__}, expected an int in "
                    f"[-{len(self)}, {len(self)})."
                )
            if not -len(self) <= index < len(self):
                raise IndexError(f"row index {index} out of range for {len(self)} rows")
            rows.append(int(self._rows[index]))
        if not rows:  # one result per index: none (a 0-row batch would be one result)
            return []
        if self._stored is not None:
            batch = self._stored.read(rows, self.pad_id)
            return _split_rows(batch) if len(rows) > 1 else [batch]
        need = np.unique(
            np.concatenate(
                [self._segments[self._row_ptr[r] : self._row_ptr[r + 1], 1] for r in rows]
                or [np.zeros(0, np.int64)]
            )
        )
        tokens = dict(zip(need.tolist(), self._source.take_items(need), strict=True))
        fetched = _Fetched(len(self.lengths), tokens)
        batch = self.plan.materialize(fetched, rows, pad_id=self.pad_id)  # one gather for all
        return _split_rows(batch) if len(rows) > 1 else [batch]

    def shard(self, rank: int, world_size: int, *, remainder: str = "drop") -> PackedDataset:
        """This rank's share of the rows: equal counts per rank, balanced tokens per step.

        A static split (same every epoch) by ``shard_rows``; for per-epoch shuffling that keeps
        the balance use ``DistributedPackedSampler``. ``remainder`` says what happens to the
        ``len(self) % world_size`` left-over rows: ``"drop"`` (skipped: the emptiest rows),
        ``"pad"`` (some rows repeated on the short ranks) or ``"error"``.

        Returns:
            a PackedDataset view of ``len(self) // world_size`` rows (``ceil`` with "pad").

        Raises:
            ValueError: rank not in [0, world_size), or see ``shard_rows``.

        Example:
            >>> ds = PackedDataset([[1] * 3, [2] * 2, [3] * 4, [4] * 1, [5] * 5], max_len=5)
            >>> [len(ds.shard(r, 2)) for r in range(2)]
            [1, 1]
        """
        rank = _check_rank(rank, world_size)
        out = copy.copy(self)
        out._rows = self._rows[shard_rows(self.num_tokens, world_size, remainder=remainder)[rank]]
        return out


def _slice_str(index: slice) -> str:
    parts = ["" if v is None else str(v) for v in (index.start, index.stop, index.step)]
    return ":".join(parts[:2]) + (f":{parts[2]}" if index.step is not None else "")


def _split_rows(batch: PackedBatch) -> list[PackedBatch]:
    return [
        PackedBatch(
            batch.input_ids[i : i + 1].clone(),
            batch.labels[i : i + 1].clone(),
            PackedLayout.from_doc_ids(batch.doc_ids[i : i + 1].clone()),
        )
        for i in range(len(batch))
    ]


class _StoredRows:
    """Rows packed earlier (``pack_dataset``'s unpadded output), read by Arrow take and padded
    by ``collate``'s compiled pass."""

    @staticmethod
    def holds(samples: Any, column: str | None) -> bool:
        names = getattr(samples, "column_names", None)
        arrowish = _is_hf_dataset(samples) or _is_arrow(samples)
        stored = names is not None and "seqlens" in names and "input_ids" in names
        return bool(arrowish and stored and column in (None, "input_ids"))

    def __init__(self, samples: Any, max_len: int, labels_column: str | None) -> None:
        import pyarrow.compute as pc

        self.labels = labels_column if labels_column in samples.column_names else None
        cols = ["input_ids", "seqlens"] + ([self.labels] if self.labels else [])
        if _is_hf_dataset(samples):
            self.table = None
            self.ds = samples.with_format("arrow", columns=cols)
            parts = [  # batches follow a select()/shuffle() indices mapping; offsets only
                np.asarray(pc.list_value_length(t.column("input_ids")), dtype=np.int64)
                for t in self.ds.iter(batch_size=1 << 16)
            ]
            self.num_tokens = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        else:
            self.table = samples.select(cols)
            ids = self.table.column("input_ids")
            self.num_tokens = np.asarray(pc.list_value_length(ids), dtype=np.int64)
        longest = int(self.num_tokens.max()) if len(self.num_tokens) else 0
        if longest > max_len:
            raise ValueError(
                f"the packed rows hold up to {longest} tokens, more than max_len={max_len}; pass "
                "the max_len they were packed to."
            )
        self.max_len = max_len

    def read(self, rows: list[int], pad_id: int) -> PackedBatch:
        from flexpack.data._common import flat_list_array
        from flexpack.data.collate import rows_from_flat

        idx = np.asarray(rows, dtype=np.int64)
        tbl = self.table.take(idx) if self.table is not None else self.ds[idx.tolist()]
        ids_off, ids = flat_list_array(tbl.column("input_ids"))
        seq_off, seqlens = flat_list_array(tbl.column("seqlens"))
        labels = flat_list_array(tbl.column(self.labels))[1] if self.labels else None
        # every row's seqlens must sum to its tokens: the compiled pass trusts them
        sums = np.concatenate([[0], np.cumsum(seqlens)])[seq_off]
        bad_labels = labels is not None and len(labels) != len(ids)
        if (sums != ids_off).any() or (seqlens <= 0).any() or bad_labels:
            raise ValueError(
                f"stored rows {rows} do not match their seqlens (they must be positive and sum "
                "to each row's tokens, labels as many as tokens); repack with pack_dataset."
            )
        return rows_from_flat(ids, labels, seqlens, np.diff(seq_off), self.max_len, pad_id=pad_id)


class _Fetched:
    """The few samples a row needs, indexable by sample number like the full dataset."""

    def __init__(self, n: int, tokens: dict[int, np.ndarray]) -> None:
        self.n, self.tokens = n, tokens

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens[int(i)]


def _check_rank(rank: Any, world_size: Any) -> int:
    world_size = check_positive_int("world_size", world_size)
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
        raise TypeError(f"rank must be an int, got {type(rank).__name__}")
    if not 0 <= rank < world_size:
        raise ValueError(
            f"rank={rank} is not in [0, world_size={world_size}); pass the process's rank, "
            "e.g. torch.distributed.get_rank()."
        )
    return int(rank)


def _dist_default(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if world_size is None:
        dist = torch.distributed
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if rank is None:
        dist = torch.distributed
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return _check_rank(rank, world_size), int(world_size)


class DistributedPackedSampler(torch.utils.data.Sampler[int]):
    """Per-rank row sampler for packed rows: same length on every rank, tokens balanced per step.

    Every epoch, ``shard_rows(dataset.num_tokens, num_replicas, shuffle=shuffle, seed=seed,
    epoch=epoch, remainder=remainder)`` deals the rows out; this rank iterates its share. With
    ``remainder="pad"`` every row is seen each epoch (a few twice); with ``"drop"`` the left-over
    rows (fewer than ``num_replicas``) skip the epoch (different ones each epoch when shuffled);
    ``"error"`` refuses a row count that does not divide. Call ``set_epoch(e)`` before each epoch.
    With a DataLoader ``batch_size=b``, global step ``t`` is groups ``t*b .. t*b+b-1``: each rank
    holds one row from each group of similar rows, so real tokens are balanced across ranks.

    ``cost="flops"`` balances training compute instead of tokens (see ``shard_rows``): each
    row costs ``a * tokens + b * sum(len^2)`` over its documents, ``(a, b) = flops`` (e.g.
    ``flops_weights(params=..., layers=..., hidden=...)``); document lengths come from a
    ``PackedDataset``'s plan, or pass ``sum_sq``.

    Args:
        dataset: anything with ``num_tokens`` (R,) int (a ``PackedDataset``), or that array itself.
        num_replicas, rank: default to ``torch.distributed`` (1 and 0 when not initialized).
        cost: "tokens" (default) or "flops".
        sum_sq: (R,) sum of squared document lengths per row; default: from the dataset's plan.
        flops: ``(a, b)`` for ``cost="flops"``.

    Example:
        >>> ds = PackedDataset([[1] * 3, [2] * 2, [3] * 4, [4] * 1, [5] * 5], max_len=5)
        >>> sampler = DistributedPackedSampler(ds, num_replicas=2, rank=0, remainder="pad")
        >>> sampler.set_epoch(1)
        >>> len(sampler), len(list(sampler))
        (2, 2)
    """

    def __init__(
        self,
        dataset: Any,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        remainder: str = "drop",
        cost: str = "tokens",
        sum_sq: Any = None,
        flops: tuple[float, float] | None = None,
    ) -> None:
        tokens = getattr(dataset, "num_tokens", dataset)
        self.num_tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        self.cost = check_choice("cost", cost, _COSTS)
        if cost == "flops" and sum_sq is None:
            sum_sq = _dataset_sum_sq(dataset)
        self.sum_sq, self.flops = sum_sq, flops
        self.rank, self.num_replicas = _dist_default(rank, num_replicas)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.remainder = check_choice("remainder", remainder, _REMAINDERS)
        self.epoch = 0
        self._shard()  # fail early on a bad remainder / too few rows

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's permutation (same on every rank for the same epoch)."""
        self.epoch = int(epoch)

    def _shard(self) -> np.ndarray:
        return shard_rows(
            self.num_tokens,
            self.num_replicas,
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=self.epoch,
            remainder=self.remainder,
            cost=self.cost,
            sum_sq=self.sum_sq,
            flops=self.flops,
        )[self.rank]

    def __iter__(self) -> Iterator[int]:
        return iter(self._shard().tolist())

    def __len__(self) -> int:
        n, w = len(self.num_tokens), self.num_replicas
        return n // w if self.remainder != "pad" else -(-n // w)
