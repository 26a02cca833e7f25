"""flexpack.parallel: context parallelism for packed rows, balanced by the work the mask implies.

A packed row too long for one device is split along the sequence across the ranks of a
context-parallel group. Each rank holds ``S // world_size`` tokens of every row; attention
either gathers the keys and values of the whole row (one all-gather per layer) or passes them
around the group in blocks (a ring: K/V memory O(S / W) per rank, partial results merged by
their log-sum-exp), and each rank attends its own queries to the keys their documents allow,
exactly: the result is the single-process ``flexpack.attention`` on the full row, at this
rank's positions.

The split decides the speed. Under a document-causal mask a query at position ``i`` of its
document sees ``i + 1`` keys, so a contiguous split leaves the rank holding the end of a long
document with most of the work. :func:`shard_context` deals the row out in blocks of tokens so
that every rank holds exactly ``S // world_size`` tokens and the number of (query, key) pairs the
mask allows is as even as the blocks permit (``balance="work"``), with any document lengths and
padding.

Shape legend: B rows, S tokens per row, W world size (ranks of the context-parallel group),
S_l = S // W tokens per rank, H heads, D head dimension.

- :func:`shard_context`: this rank's :class:`ContextShard` of a (B, S) ``doc_ids`` batch:
  positions, ids and work; ``take`` / ``put`` / ``gather`` move (B, S, ...) tensors to and from
  its order; ``load_balancer()`` hands the plan to torch's experimental context parallelism.
- :func:`context_parallel_attention`: this rank's queries against the whole row's keys,
  forward and backward (the gradient of each key and value lands on the rank that holds it).
- :func:`shard_block_mask`: the (S_l, S) BlockMask of a shard, which the CUDA path runs flex
  with.
- :class:`ContextStats` (``shard.stats``): which schedule ran ("all_gather" or "ring"), the
  bytes this rank sent, the ring blocks it skipped.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from flexpack.layout import _check_runs

__all__ = [
    "ContextShard",
    "ContextStats",
    "ShardBalancer",
    "context_parallel_attention",
    "shard_block_mask",
    "shard_context",
]

Balance = Literal["work", "head_tail", "contiguous"]
_BALANCES = ("work", "head_tail", "contiguous")
_MASKS = ("document_causal", "document")
Schedule = Literal["auto", "all_gather", "ring"]
_SCHEDULES = ("auto", "all_gather", "ring")


# ---------------------------------------------------------------------------------------------
# Planning: who holds which tokens (numpy, on the host; the same on every rank)
# ---------------------------------------------------------------------------------------------


def _token_work(d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per token of one row: (keys it sees under the document-causal mask, position in doc).

    ``d``: (S,) int ids, negative on padding, each id one run (checked by the callers with
    flexpack.layout's rule). Returns two (S,) int64 arrays: ``pos + 1`` and ``pos`` for real
    tokens (``pos`` = earlier tokens of its run), 0 and 0 on padding.
    """
    S = d.shape[0]
    real = d >= 0
    starts = np.flatnonzero(np.r_[True, d[1:] != d[:-1]]) if S else np.zeros(0, np.int64)
    lengths = np.diff(np.r_[starts, S])
    pos = np.arange(S, dtype=np.int64) - np.repeat(starts, lengths)
    pos[~real] = 0
    return np.where(real, pos + 1, 0), pos


def _unit(per_rank: int, block_size: int) -> int:
    """Tokens per dealt block: the largest divisor of ``per_rank`` that is <= ``block_size``."""
    for u in range(min(block_size, per_rank), 0, -1):
        if per_rank % u == 0:
            return u
    return 1


_SWAP_TOLERANCE = 2e-4


def _deal_by_work(unit_work: np.ndarray, loads: np.ndarray) -> np.ndarray:
    """Assign U units to W ranks, U / W each, minimizing the largest load; updates ``loads``.

    Greedy, then local search: units go in rounds of W, heaviest first, the heaviest of a round
    to the rank with the least load so far (every rank gets one unit per round, so the counts
    stay equal); then the most loaded rank swaps one unit with another rank while that lowers
    the larger of the two loads. Returns (U,) int64 owners.
    """
    W = loads.shape[0]
    U = unit_work.shape[0]
    order = np.argsort(-unit_work, kind="stable")
    owner = np.empty(U, dtype=np.int64)
    for r in range(U // W):
        items = order[r * W : (r + 1) * W]  # descending work
        ranks = np.argsort(loads, kind="stable")  # lightest first
        owner[items] = ranks
        loads[ranks] += unit_work[items]
    if W == 1:
        return owner
    for _ in range(4 * U):  # each pass strictly lowers max(loads) or stops
        if loads.max() * W <= loads.sum() * (1 + _SWAP_TOLERANCE):
            break  # even enough: the rest would cost more plan time than it saves
        m = int(np.argmax(loads))
        mine = np.flatnonzero(owner == m)
        best = None  # (new pair max, unit of m, unit of other)
        for o in np.argsort(loads, kind="stable"):
            if o == m:
                continue
            gap = loads[m] - loads[o]
            if gap <= 0:
                break
            theirs = np.flatnonzero(owner == o)
            tw = unit_work[theirs]
            srt = np.argsort(tw, kind="stable")
            tw_sorted = tw[srt]
            # Moving delta = w_mine - w_theirs from m to o: best delta is gap / 2.
            target = unit_work[mine] - gap / 2.0
            j = np.clip(np.searchsorted(tw_sorted, target), 0, len(tw_sorted) - 1)
            for cand in (j, np.clip(j - 1, 0, len(tw_sorted) - 1)):
                delta = unit_work[mine] - tw_sorted[cand]
                ok = (delta > 0) & (delta < gap)
                if not ok.any():
                    continue
                new_max = np.maximum(loads[m] - delta, loads[o] + delta)
                new_max = np.where(ok, new_max, np.iinfo(np.int64).max)
                i = int(np.argmin(new_max))
                if best is None or new_max[i] < best[0]:
                    best = (int(new_max[i]), int(mine[i]), int(theirs[srt[cand[i]]]), int(o))
        if best is None or best[0] >= loads[m]:
            break
        _, a, b, o = best
        delta = unit_work[a] - unit_work[b]
        owner[a], owner[b] = o, m
        loads[m] -= delta
        loads[o] += delta
    return owner


@dataclass(frozen=True)
class _Plan:
    gathered: np.ndarray  # (B, S) int64: every rank's positions, rank 0's first
    position_ids: np.ndarray  # (B, S) int64, position of each token in its document
    rank_work: tuple[int, ...]


_BALANCE_TARGET = 1.02  # finer blocks are dealt while the deal is further from even
_MIN_UNIT = 8
_PLANS: OrderedDict[tuple, _Plan] = OrderedDict()  # per layout: the last few plans
_PLAN_CACHE_SIZE = 8


def _plan(d: np.ndarray, world: int, balance: str, block_size: int, key: tuple) -> _Plan:
    """The plan of a (B, S) batch, cached per layout (``key``: its fingerprint)."""
    plan = _PLANS.get(key)
    if plan is not None:
        _PLANS.move_to_end(key)
        return plan
    per_row = [_token_work(row) for row in d]
    work = np.stack([w for w, _ in per_row]) if per_row else d.astype(np.int64)
    pos = np.stack([p for _, p in per_row]) if per_row else d.astype(np.int64)
    if balance != "work":
        plan = _plan_one(work, pos, world, balance, block_size)
    else:
        # The greedy deal is a heuristic: on tiny rows a plain split can beat it; on short rows
        # 128-token blocks are too few to even out (4 per rank at S = 4K, W = 8): halve them
        # while the deal is more than 2% off. Keep the best.
        plans = [_plan_one(work, pos, world, b, block_size) for b in ("head_tail", "contiguous")]
        per = d.shape[1] // world
        unit = _unit(per, block_size)
        while True:
            plans.append(_plan_one(work, pos, world, "work", unit))
            if _imbalance(plans[-1].rank_work) <= _BALANCE_TARGET or unit <= _MIN_UNIT:
                break
            finer = _unit(per, unit // 2)
            if finer == unit:
                break
            unit = finer
        plan = min(plans, key=lambda p: max(p.rank_work))
    _PLANS[key] = plan
    while len(_PLANS) > _PLAN_CACHE_SIZE:
        _PLANS.popitem(last=False)
    return plan


def _imbalance(rank_work: tuple[int, ...]) -> float:
    mean = sum(rank_work) / len(rank_work)
    return max(rank_work) / mean if mean else 1.0


def _plan_one(work: np.ndarray, pos: np.ndarray, world: int, balance: str, unit: int) -> _Plan:
    """work, pos: (B, S) from :func:`_token_work`; ``unit`` tokens per dealt block ("work").

    Every strategy deals whole units of the row (contiguous: S_l tokens, head-tail: S_l / 2),
    so the all-gather order is built from the U unit owners, not by sorting S tokens."""
    B, S = work.shape
    per = S // world
    gathered = np.empty((B, S), dtype=np.int64)
    loads = np.zeros(world, dtype=np.int64)
    ranks = np.arange(world)
    for b in range(B):
        if balance == "contiguous":
            unit, owner = per, ranks
        elif balance == "head_tail" and per % 2 == 0:
            unit, owner = per // 2, np.r_[ranks, ranks[::-1]]
        elif balance == "head_tail":  # an odd share: heads of per // 2, tails of per // 2 + 1
            h = per // 2
            unit, owner = 1, np.r_[np.repeat(ranks, h), np.repeat(ranks[::-1], per - h)]
        else:
            unit = _unit(per, unit)
            owner = _deal_by_work(work[b].reshape(-1, unit).sum(1), loads.copy())
        # Every rank's units in ascending order, ranks one after the other.
        order = np.argsort(owner, kind="stable")
        gathered[b] = (order[:, None] * unit + np.arange(unit)).reshape(-1)
        loads += np.bincount(owner, weights=work[b].reshape(-1, unit).sum(1), minlength=world
                             ).astype(np.int64)  # fmt: skip
    return _Plan(gathered, pos, tuple(int(x) for x in loads))


# ---------------------------------------------------------------------------------------------
# The shard
# ---------------------------------------------------------------------------------------------


def _along(index: Tensor, x: Tensor, dim: int) -> Tensor:
    """(B, n) index broadcast to x's shape with n at ``dim`` (for gather / scatter)."""
    shape = [1] * x.dim()
    shape[0], shape[dim] = index.shape
    size = list(x.shape)
    size[dim] = index.shape[1]
    return index.view(shape).expand(size)


def _seq_dim(x: Tensor, dim: int, name: str) -> int:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if x.dim() < 2:
        raise ValueError(f"{name} must be (B, S, ...) with the rows first, got {tuple(x.shape)}")
    d = dim % x.dim()
    if d == 0:
        raise ValueError("dim=0 is the batch dimension; pass the sequence dimension (dim=1)")
    return d


@dataclass(frozen=True, eq=False)
class ContextShard:
    """The tokens one rank of a context-parallel group holds, in the order it holds them.

    Built by :func:`shard_context`; every rank of the group builds the same plan from the same
    ``doc_ids`` and keeps its own part.

    Attributes:
        index: (B, S_l) int64 positions of the full row this rank holds, ascending; every
            position of the row is on exactly one rank.
        doc_ids: (B, S_l) int64 document ids of those tokens (-1 on padding).
        position_ids: (B, S_l) int64 position of each token in its document (0 on padding):
            what rotary embeddings need.
        work: (query, key) pairs the document-causal mask allows for this rank's queries,
            summed over the rows.
        rank, world_size: this rank, and the group's size.
        balance: the strategy that dealt the tokens ("work", "head_tail", "contiguous").
        rank_work: ``work`` of every rank, ``(W,)``; ``max / mean`` is :attr:`imbalance`.
        gathered_index: (B, S) int64 positions in all-gather order: rank 0's ``index``, then
            rank 1's, ... (what torch's ``_LoadBalancer._generate_indices()`` returns).
        row_doc_ids: (B, S) int64 document ids of the whole rows (the keys' side).
        fingerprint: (S, B, world_size, balance, block_size, 56-bit hash of doc_ids): what
            the ranks of a group check they agree on (once, at the first collective).
    """

    index: Tensor
    doc_ids: Tensor
    position_ids: Tensor
    work: int
    rank: int
    world_size: int
    balance: str
    rank_work: tuple[int, ...]
    gathered_index: Tensor
    row_doc_ids: Tensor
    block_size: int = field(default=128, repr=False)
    fingerprint: tuple[int, ...] = field(default=(), repr=False)

    @property
    def imbalance(self) -> float:
        """Largest rank work over the mean (1.0 is perfect; 1.0 when there is no work)."""
        mean = sum(self.rank_work) / len(self.rank_work)
        return max(self.rank_work) / mean if mean else 1.0

    @property
    def stats(self) -> ContextStats:
        """What :func:`context_parallel_attention` ran with this shard: the schedule ("ring"
        or "all_gather"), bytes sent, ring blocks skipped (a :class:`ContextStats`)."""
        return _cached(self, ("stats",), ContextStats)

    @property
    def shape(self) -> tuple[int, int]:
        """(B, S) of the full rows."""
        return tuple(self.row_doc_ids.shape)

    def _index_on(self, device: torch.device) -> Tensor:
        return self.index if self.index.device == device else self.index.to(device)

    def take(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's tokens of a full (B, S, ...) tensor: (B, S_l, ...), in ``index`` order.

        Example:
            >>> s = shard_context(torch.tensor([[0, 0, 0, 0, 1, 1]]), 2, 1, balance="contiguous")
            >>> s.take(torch.arange(6)[None] * 10)
            tensor([[30, 40, 50]])
        """
        dim = _seq_dim(x, dim, "x")
        B, S = self.shape
        if x.shape[0] != B or x.shape[dim] != S:
            raise ValueError(
                f"x has shape {tuple(x.shape)}; expected {B} rows and {S} tokens at dim {dim} "
                "(the full rows the shard was built from)"
            )
        return torch.gather(x, dim, _along(self._index_on(x.device), x, dim))

    def put(self, local: Tensor, out: Tensor, dim: int = 1) -> Tensor:
        """``out`` (B, S, ...) with this rank's positions replaced by ``local`` (B, S_l, ...).

        The inverse of :meth:`take` on this rank's positions: ``put(take(x), y)`` equals ``x``
        there and ``y`` elsewhere. Returns a new tensor (``out`` is not modified).

        Example:
            >>> s = shard_context(torch.tensor([[0, 0, 0, 0, 1, 1]]), 2, 0, balance="contiguous")
            >>> s.put(torch.tensor([[1, 2, 3]]), torch.zeros(1, 6, dtype=torch.long))
            tensor([[1, 2, 3, 0, 0, 0]])
        """
        dim = _seq_dim(local, dim, "local")
        B, S = self.shape
        want = list(local.shape)
        want[dim] = S
        if local.shape[0] != B or local.shape[dim] != self.index.shape[1]:
            raise ValueError(
                f"local has shape {tuple(local.shape)}; expected {B} rows and "
                f"{self.index.shape[1]} tokens at dim {dim} (this rank's share)"
            )
        if list(out.shape) != want:
            raise ValueError(f"out has shape {tuple(out.shape)}; expected {tuple(want)}")
        return out.scatter(dim, _along(self._index_on(out.device), local, dim), local)

    def next_token_targets(self, labels: Tensor) -> Tensor:
        """This rank's next-token targets: (B, S_l) int64, ``labels[:, p + 1]`` for the token at
        row position p when p + 1 is in the same document, else -100.

        The shift happens on the full (B, S) row before sharding, since a token's target may
        sit on another rank; the targets then go with the token, in ``index`` order, as
        ``packed_cross_entropy``'s labels would after its own shift.

        Example:
            >>> d = torch.tensor([[0, 0, 0, 1, 1, -1]])
            >>> s = shard_context(d, 2, 1, balance="contiguous")  # positions 3, 4, 5
            >>> s.next_token_targets(torch.tensor([[-100, 11, 12, -100, 14, -100]]))
            tensor([[  14, -100, -100]])
        """
        if not isinstance(labels, Tensor) or labels.is_floating_point():
            got = labels.dtype if isinstance(labels, Tensor) else type(labels).__name__
            raise TypeError(f"labels must be an integer tensor, got {got}")
        if tuple(labels.shape) != self.shape:
            raise ValueError(
                f"labels has shape {tuple(labels.shape)}; expected the full rows {self.shape} "
                "(the targets are shifted before sharding)"
            )
        d = self.row_doc_ids.to(labels.device)
        same = (d[:, 1:] == d[:, :-1]) & (d[:, 1:] >= 0)
        target = torch.full(self.shape, -100, dtype=torch.int64, device=labels.device)
        target[:, :-1] = labels[:, 1:].long().masked_fill(~same, -100)
        return self.take(target)

    def gather(self, local: Tensor, dim: int = 1, *, group: Any = None) -> Tensor:
        """The full (B, S, ...) tensor from every rank's (B, S_l, ...) share, in row order.

        A collective (every rank of ``group`` calls it), differentiable: the gradient of the
        result flows back to each rank's ``local``. With ``world_size == 1`` and no process
        group it is :meth:`put` into an empty tensor.
        """
        dim = _seq_dim(local, dim, "local")
        if local.shape[0] != self.shape[0] or local.shape[dim] != self.index.shape[1]:
            raise ValueError(
                f"local has shape {tuple(local.shape)}; expected {self.shape[0]} rows and "
                f"{self.index.shape[1]} tokens at dim {dim} (this rank's share)"
            )
        gathered = _all_gather(local, dim, group, self)
        inverse = self._inverse(local.device)
        return torch.gather(gathered, dim, _along(inverse, gathered, dim))

    def _inverse(self, device: torch.device) -> Tensor:
        """(B, S) int64: where each row position sits in all-gather order."""
        build = lambda: torch.argsort(self.gathered_index, dim=1).to(device)
        return _cached(self, ("inverse", str(device)), build)

    def load_balancer(self) -> ShardBalancer:
        """This plan as a load balancer for torch's experimental context parallelism.

        ``torch.distributed.tensor.experimental._context_parallel._context_parallel_shard(mesh,
        buffers, seq_dims, load_balancer=shard.load_balancer())`` then gives every rank the
        tokens this plan gives it (the same as :meth:`take`), and ``context_parallel_unshard``
        restores the rows. See docs/context_parallel.md.
        """
        return ShardBalancer(self.gathered_index)


class ShardBalancer:
    """Duck-types torch's ``_LoadBalancer`` (``_generate_indices(restore=False)``).

    ``_generate_indices()`` is the (B, S) all-gather order of a :class:`ContextShard` (rank r's
    positions are columns ``r * S_l .. (r + 1) * S_l - 1``); ``restore=True`` its inverse, so
    ``x.gather(1, idx).gather(1, restore_idx) == x``.
    """

    def __init__(self, gathered_index: Tensor) -> None:
        self.gathered_index = gathered_index

    def _generate_indices(self, restore: bool = False) -> Tensor:
        idx = self.gathered_index
        return torch.argsort(idx, dim=1) if restore else idx


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


def shard_context(
    doc_ids: Tensor,
    world_size: int,
    rank: int,
    *,
    balance: Balance = "work",
    block_size: int = 128,
) -> ContextShard:
    """Deal the tokens of packed rows to the ranks of a context-parallel group.

    Every rank holds exactly ``S // world_size`` tokens of each row. ``balance`` picks how:

    - ``"work"`` (default): the row is cut into blocks of ``block_size`` tokens (the largest
      divisor of ``S // world_size`` up to it), each weighed by the (query, key) pairs the
      document-causal mask allows its queries (a query at position i of its document: i + 1);
      blocks are dealt heaviest first to the least-loaded rank, one per rank per round, then
      swapped pairwise while that lowers the largest load (and the plain splits below are
      taken instead where they happen to be more even: tiny rows). Where 128-token blocks are
      too few to even out (4 per rank at S = 4K over 8 ranks), blocks of half the size are
      dealt while the deal is more than 2% off, down to 8 tokens. Within 0.1% of the mean on
      32K and 128K rows of lognormal documents with one long one, at 2-8 ranks, where a
      contiguous split is 1.2-4.2x and head-tail 1.2-2.6x, and within 3% on every 4K and 8K
      row of the bundled corpus (bench/context_parallel.py). Rows are dealt in turn with the
      loads carried over, so the batch balances as a whole.
    - ``"head_tail"``: rank r holds chunk r and chunk 2W - 1 - r of 2W equal chunks (torch's
      ``_HeadTailLoadBalancer``; balanced for one causal document, not for many).
    - ``"contiguous"``: rank r holds tokens ``r * S_l .. (r + 1) * S_l - 1``.

    The plan is computed on the host (one device-to-host copy of ``doc_ids``) and is the same
    on every rank: call it with the same ``doc_ids`` everywhere (the first collective on the
    shard checks that, once: ranks that disagree raise a ValueError). The last few plans are
    cached per layout (a hash of ``doc_ids`` and the arguments), so a layout seen again costs
    the hash alone.

    Args:
        doc_ids: (B, S) or (S,) int; -1 (any negative) marks padding. A document is a run of
            one id in a row, any length; an id naming two separate runs of a row is refused (as
            by ``flexpack.masks.document``; ``flexpack.PackedLayout.from_runs(doc_ids).doc_ids``
            numbers the runs).
        world_size: ranks in the context-parallel group; ``S % world_size == 0``.
        rank: this rank, in [0, world_size).
        balance: "work", "head_tail" or "contiguous".
        block_size: tokens per dealt block with ``balance="work"``; 128 (flex's block) keeps
            each rank's queries whole blocks of the row, so its BlockMask stays as sparse as
            the full row's.

    Returns:
        a :class:`ContextShard` (its tensors on ``doc_ids``'s device).

    Raises:
        TypeError: doc_ids not an integer tensor; non-int world_size, rank or block_size.
        ValueError: a shape other than (B, S) / (S,), S not a multiple of world_size, rank out
            of range, an unknown balance, an id naming two separate runs of a row.

    Example:
        >>> doc_ids = torch.tensor([[0] * 6 + [1] * 2])  # a 6-token and a 2-token document
        >>> [shard_context(doc_ids, 2, r, balance="contiguous").work for r in range(2)]
        [10, 14]
        >>> s = shard_context(doc_ids, 2, 0, block_size=1)
        >>> s.rank_work, s.index.tolist()
        ((12, 12), [[0, 1, 2, 5]])
    """
    if not isinstance(doc_ids, Tensor):
        try:
            doc_ids = torch.as_tensor(np.asarray(doc_ids))
        except (TypeError, ValueError):  # ragged rows: numpy's "inhomogeneous shape"
            try:
                got = f"rows of lengths {[len(row) for row in doc_ids]}"
            except TypeError:
                got = f"a {type(doc_ids).__name__} that is not a rectangle of ints"
            raise ValueError(
                f"doc_ids must be (B, S) or (S,) integers, every row S long; got {got}. Pad "
                "the shorter rows with -1 (padding) to the longest row's length."
            ) from None
    if doc_ids.is_floating_point() or doc_ids.is_complex() or doc_ids.dtype == torch.bool:
        raise TypeError(f"doc_ids must be an integer tensor, got {doc_ids.dtype}")
    if doc_ids.dim() == 1:
        doc_ids = doc_ids.unsqueeze(0)
    if doc_ids.dim() != 2:
        raise ValueError(f"doc_ids must be (B, S) or (S,), got shape {tuple(doc_ids.shape)}")
    world_size = _check_int("world_size", world_size, 1)
    rank = _check_int("rank", rank, 0)
    block_size = _check_int("block_size", block_size, 1)
    if rank >= world_size:
        raise ValueError(
            f"rank={rank} is not in [0, world_size={world_size}); pass the rank in the "
            "context-parallel group, e.g. torch.distributed.get_rank(group)"
        )
    if balance not in _BALANCES:
        raise ValueError(f"balance must be one of {_BALANCES}, got {balance!r}")
    B, S = doc_ids.shape
    if S % world_size:
        raise ValueError(
            f"rows of {S} tokens do not split into world_size={world_size} equal shares; pack "
            f"to a max_len that is a multiple of {world_size} (e.g. "
            f"{-(-S // world_size) * world_size}), padding the rows"
        )
    device = doc_ids.device
    d = doc_ids.detach().cpu().numpy().astype(np.int64)  # the one host sync
    _check_runs(torch.from_numpy(d))  # on the host copy: no sync
    fingerprint = _fingerprint(d, world_size, balance, block_size)
    plan = _plan(d, world_size, balance, block_size, fingerprint)
    per = S // world_size
    mine = plan.gathered[:, rank * per : (rank + 1) * per]
    rows = np.arange(B)[:, None]
    work = int(np.where(d[rows, mine] >= 0, plan.position_ids[rows, mine] + 1, 0).sum())

    parts = [
        mine,
        np.where(d[rows, mine] >= 0, d[rows, mine], -1),
        plan.position_ids[rows, mine],
        plan.gathered,
        np.where(d >= 0, d, -1),
    ]
    index, shard_ids, position_ids, gathered, row_ids = _to_device(parts, device)
    return ContextShard(
        index=index,
        doc_ids=shard_ids,
        position_ids=position_ids,
        work=work,
        rank=rank,
        world_size=world_size,
        balance=balance,
        rank_work=plan.rank_work,
        gathered_index=gathered,
        row_doc_ids=row_ids,
        block_size=block_size,
        fingerprint=fingerprint,
    )


def _to_device(parts: list[np.ndarray], device: torch.device) -> list[Tensor]:
    """int64 arrays as tensors on ``device``: on an accelerator one pinned, non-blocking copy
    of them all (no host sync), then views."""
    flat = torch.from_numpy(np.concatenate([a.reshape(-1) for a in parts]).astype(np.int64))
    if device.type != "cpu":
        if torch.cuda.is_available():
            flat = flat.pin_memory()
        flat = flat.to(device, non_blocking=True)
    out, start = [], 0
    for a in parts:
        out.append(flat[start : start + a.size].view(a.shape))
        start += a.size
    return out


# ---------------------------------------------------------------------------------------------
# Collectives with autograd
# ---------------------------------------------------------------------------------------------


def _group_size_rank(group: Any, shard: ContextShard) -> tuple[int, int] | None:
    """(size, rank) of the group, checked against the shard; None for a single process."""
    dist = torch.distributed
    initialized = dist.is_available() and dist.is_initialized()
    if shard.world_size == 1 and (group is None or not initialized):
        return None  # one rank holds the whole row: nothing to gather, whatever runs around it
    if not initialized:
        raise ValueError(
            f"the shard is rank {shard.rank} of {shard.world_size} but torch.distributed is not "
            "initialized; call torch.distributed.init_process_group first (or build the shard "
            "with world_size=1 for one process)"
        )
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if (size, rank) != (shard.world_size, shard.rank):
        raise ValueError(
            f"the shard is rank {shard.rank} of {shard.world_size} but this process is rank "
            f"{rank} of {size} in the group; build it with shard_context(doc_ids, "
            f"world_size={size}, rank={rank}) for this group"
        )
    return size, rank


def _gather_into(out: Tensor, x: Tensor, group: Any) -> None:
    fn = getattr(torch.distributed, "all_gather_single", None)  # torch >= 2.13
    if fn is None:
        fn = torch.distributed.all_gather_into_tensor
    fn(out, x, group=group)


def _reduce_scatter_into(out: Tensor, x: Tensor, group: Any) -> None:
    fn = getattr(torch.distributed, "reduce_scatter_single", None)  # torch >= 2.13
    if fn is None:
        fn = torch.distributed.reduce_scatter_tensor
    fn(out, x, group=group)


class _AllGatherSeq(torch.autograd.Function):
    """All-gather along ``dim`` (rank order); backward: reduce-scatter of the gradient.

    Every rank's loss depends on every rank's keys, so the gradient of a rank's share is the
    sum over ranks of their gradients at its positions: exactly a reduce-scatter.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: Any, world: int, stats: Any) -> Tensor:
        ctx.dim, ctx.group, ctx.world, ctx.stats = dim, group, world, stats
        xs = x.movedim(dim, 0).contiguous()  # ranks' shares concatenate along dim 0
        out = xs.new_empty((world * xs.shape[0], *xs.shape[1:]))
        _gather_into(out, xs, group)
        if stats is not None:
            stats.bytes_sent += (world - 1) * xs.numel() * xs.element_size()
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        gs = grad.movedim(ctx.dim, 0).contiguous()
        out = gs.new_empty((gs.shape[0] // ctx.world, *gs.shape[1:]))
        _reduce_scatter_into(out, gs, ctx.group)
        if ctx.stats is not None:
            ctx.stats.bytes_sent += (ctx.world - 1) * out.numel() * out.element_size()
        return out.movedim(0, ctx.dim), None, None, None, None


def _all_gather(
    x: Tensor, dim: int, group: Any, shard: ContextShard, stats: ContextStats | None = None
) -> Tensor:
    """(.., S_l, ..) on each rank -> (.., S, ..) in all-gather order, differentiable."""
    sizes = _group_size_rank(group, shard)
    if sizes is None:
        return x
    _check_agree(shard, group, x.device)
    return _AllGatherSeq.apply(x, dim, group, sizes[0], stats)


# ---------------------------------------------------------------------------------------------
# Checking that the ranks agree (once per shard and group)
# ---------------------------------------------------------------------------------------------

_FINGERPRINT = ("S (tokens per row)", "B (rows)", "world_size", "balance", "block_size",
                "doc_ids")  # fmt: skip


def _fingerprint(d: np.ndarray, world: int, balance: str, block_size: int) -> tuple[int, ...]:
    """What every rank of a group must agree on: the shape, the plan's knobs, a hash of ids."""
    digest = hashlib.blake2b(np.ascontiguousarray(d).tobytes(), digest_size=7).digest()
    B, S = d.shape
    return (S, B, world, _BALANCES.index(balance), block_size, int.from_bytes(digest, "little"))


def _check_agree(shard: ContextShard, group: Any, device: torch.device) -> None:
    """All-gather the shard's fingerprint (8 int64 per rank) and raise a ValueError on every
    rank when they differ: ranks with different S would abort inside the collective (gloo
    SIGABRT) and ranks with different doc_ids would run with wrong keys, silently."""
    key = ("agreed", id(group))
    if _cached(shard, key, lambda: False):
        return
    W = shard.world_size
    mine = torch.tensor(shard.fingerprint, dtype=torch.int64, device=device)
    every = mine.new_empty(W * mine.numel())
    _gather_into(every, mine, group)
    every = every.view(W, -1).cpu().tolist()
    for r, theirs in enumerate(every):
        if tuple(theirs) == shard.fingerprint:
            continue
        i = next(
            i for i, (a, b) in enumerate(zip(shard.fingerprint, theirs, strict=True)) if a != b
        )
        what, me = _FINGERPRINT[i], shard.rank
        if what == "doc_ids":
            detail = f"rank {r} and rank {me} passed different doc_ids of one shape {shard.shape}"
        elif what == "balance":
            detail = (f"rank {r} has balance={_BALANCES[theirs[i]]!r}, rank {me} has "
                      f"{shard.balance!r}")  # fmt: skip
        else:
            detail = f"rank {r} has {what} = {theirs[i]}, rank {me} has {shard.fingerprint[i]}"
        raise ValueError(
            f"the ranks of the context-parallel group built their shards from different "
            f"batches: {detail}; every rank of a CP group must call shard_context with the same "
            "doc_ids (the group reads one batch: broadcast it from one rank, or seed the data "
            "loader by the data-parallel rank only) and the same world_size, balance and "
            "block_size"
        )
    shard.__dict__["_cache"][key] = True


# ---------------------------------------------------------------------------------------------
# The ring (pass-KV) schedule: K/V blocks travel, queries stay; partial results merge by LSE
# ---------------------------------------------------------------------------------------------


@dataclass
class ContextStats:
    """What :func:`context_parallel_attention` ran with one shard (counters, this rank).

    Attributes:
        schedule: the last call's schedule, "all_gather" or "ring" (None before any call).
        calls: calls per schedule.
        bytes_sent: bytes of keys, values and their gradients this rank sent, forward and
            backward (an all-gather or reduce-scatter counts ``(W - 1) / W`` of its tensor:
            what each rank sends in a ring all-gather).
        blocks_skipped: ring steps (forward or backward) whose K/V block met none of this
            rank's queries, so no attention ran for it.
    """

    schedule: str | None = None
    calls: dict[str, int] = field(default_factory=dict)
    bytes_sent: int = 0
    blocks_skipped: int = 0


@dataclass(frozen=True)
class _RingPlan:
    """Tiles of one rank's ring: its queries and every source rank's keys regrouped by
    (row, document, position); tile (q0, q1, k0, k1, masked) of source s attends queries
    q0:q1 (of ``query_perm``) to keys k0:k1 (of ``key_perm[s]``), with the causal mask
    ``key_pos <= query_pos`` where ``masked`` (else every pair is allowed)."""

    query_perm: Tensor  # (Tq,) positions in the flattened (B * S_l,) local queries
    query_pos: Tensor  # (Tq,) position of each in its document
    key_perm: list[Tensor]  # per source rank: (Tk_s,) positions in its (B * S_l,) keys
    key_pos: list[Tensor]
    tiles: list[list[tuple[int, int, int, int, bool]]]  # per source rank
    heads: int = 1


_TILE_ROWS = 256  # queries per causal tile: bounds its mask to 256 x (keys between them)
_TILE_ELEMENTS = 1 << 19  # score elements per step of the math path (softcap, not CPU)


def _groups(b: np.ndarray, doc: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, ...]:
    """Real tokens sorted by (row, doc, pos): the order and each (row, doc) run's bounds."""
    order = np.lexsort((pos, doc, b))
    key = b[order] * (1 << 40) + doc[order]
    start = np.flatnonzero(np.r_[True, key[1:] != key[:-1]]) if key.size else np.zeros(0, int)
    end = np.r_[start[1:], key.size].astype(np.int64)
    return order, key[start] if key.size else key, start, end


def _ring_plan(shard: ContextShard, causal: bool, heads: int, device: torch.device) -> _RingPlan:
    d = shard.row_doc_ids.cpu().numpy()
    _check_runs(torch.from_numpy(d), "shard.row_doc_ids")  # a shard built by hand: the host copy
    gathered = shard.gathered_index.cpu().numpy()
    B, S = d.shape
    W, per = shard.world_size, S // shard.world_size
    pos_rows = np.stack([_token_work(d[b])[1] for b in range(B)]) if B else d
    rows = np.arange(B)[:, None]

    def side(rank: int):
        idx = gathered[:, rank * per : (rank + 1) * per]
        ids, pos = d[rows, idx].reshape(-1), pos_rows[rows, idx].reshape(-1)
        b = np.repeat(np.arange(B), per)
        real = np.flatnonzero(ids >= 0)
        order, keys, start, end = _groups(b[real], ids[real], pos[real])
        return real[order], pos[real][order], keys, start, end

    q_perm, q_pos, q_keys, q_start, q_end = side(shard.rank)
    key_perm, key_pos, tiles = [], [], []
    for src in range(W):
        k_perm, k_pos, k_keys, k_start, k_end = side(src)
        key_perm.append(torch.from_numpy(k_perm.astype(np.int64)).to(device))
        key_pos.append(torch.from_numpy(k_pos.astype(np.int64)).to(device))
        found = np.searchsorted(k_keys, q_keys)
        mine = []
        for g in range(q_keys.size):
            j = found[g]
            if j >= k_keys.size or k_keys[j] != q_keys[g]:
                continue  # this document has no key on rank src
            k0, k1 = int(k_start[j]), int(k_end[j])
            kp = k_pos[k0:k1]
            q0, q1 = int(q_start[g]), int(q_end[g])
            if not causal:
                mine.append((q0, q1, k0, k1, False))
                continue
            for a in range(q0, q1, _TILE_ROWS):
                b_ = min(a + _TILE_ROWS, q1)
                n = int(np.searchsorted(kp, q_pos[b_ - 1], side="right"))  # keys <= last query
                full = int(np.searchsorted(kp, q_pos[a], side="right"))  # keys <= first query
                if full:  # every query of the chunk sees these: no mask
                    mine.append((a, b_, k0, k0 + full, False))
                if n > full:  # the few keys between the chunk's queries: masked
                    mine.append((a, b_, k0 + full, k0 + n, True))
        tiles.append(mine)
    as_t = lambda a: torch.from_numpy(a.astype(np.int64)).to(device)
    return _RingPlan(as_t(q_perm), as_t(q_pos), key_perm, key_pos, tiles, heads)


def _tile_scores(qt: Tensor, kt: Tensor, scale: float, softcap: float | None):
    """qt (Hkv, G*m, D), kt (Hkv, n, D) -> scores (Hkv, G*m, n) and tanh for softcap."""
    s = torch.matmul(qt, kt.transpose(-1, -2)) * scale
    if softcap is None:
        return s, None
    t = torch.tanh(s / softcap)
    return t * softcap, t


def _tile_allowed(plan: _RingPlan, src: int, tile: tuple) -> Tensor:
    """(m, n) bool: the causal mask of a masked tile (key position <= query position)."""
    q0, q1, k0, k1, _ = tile
    return plan.key_pos[src][None, k0:k1] <= plan.query_pos[q0:q1, None]


def _fold(x: Tensor, Hkv: int) -> Tensor:
    """(Hq, m, D) -> (Hkv, G * m, D): query heads of one kv head side by side."""
    Hq, m, D = x.shape
    return x.reshape(Hkv, (Hq // Hkv) * m, D)


def _unfold(x: Tensor, Hq: int) -> Tensor:
    Hkv, Gm, D = x.shape
    return x.reshape(Hq, Gm * Hkv // Hq, D)


def _use_kernel(x: Tensor, softcap: float | None) -> bool:
    """The CPU flash kernel returns the LSE and has a backward that takes it: the ring's tiles
    run through it (memory-efficient, in C++) except with softcap, which it does not take."""
    return x.device.type == "cpu" and softcap is None and _cpu_flash() is not None


def _cpu_flash():
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _kernel_tile(qh, kh, vh, plan, src, tile, G):
    """Inputs of the CPU flash kernel for one tile: (1, Hq, m, D) q, (1, Hq, n, D) k, v (kv
    heads repeated for GQA) and the additive mask or None."""
    q0, q1, k0, k1, masked = tile
    qt = qh[None, :, q0:q1]
    kt, vt = kh[None, :, k0:k1], vh[None, :, k0:k1]
    if G > 1:
        kt, vt = kt.repeat_interleave(G, dim=1), vt.repeat_interleave(G, dim=1)
    mask = None
    if masked:
        allowed = _tile_allowed(plan, src, tile)
        mask = torch.zeros(allowed.shape, dtype=qh.dtype, device=qh.device)
        mask.masked_fill_(~allowed, -math.inf)
    return qt, kt, vt, mask


def _merge(acc: Tensor, lse: Tensor, q0: int, q1: int, o: Tensor, t_lse: Tensor) -> None:
    """Merge a partial (Hq, m, D) output and its (Hq, m) LSE into rows q0:q1, in place."""
    old = lse[:, q0:q1]
    new = torch.logaddexp(old, t_lse)
    new_safe = torch.where(torch.isfinite(new), new, 0.0)
    a, b = torch.exp(old - new_safe), torch.exp(t_lse - new_safe)
    acc[:, q0:q1] = acc[:, q0:q1] * a[..., None] + o * b[..., None]
    lse[:, q0:q1] = new


def _ring_block_forward(qh, kv, plan, src, acc, lse, *, scale, softcap) -> bool:
    """Merge this rank's queries' attention to one K/V block into (acc, lse) by LSE.

    qh (Hq, Tq, D) permuted queries; kv (2, Hkv, B * S_l, D) the block in its rank's order;
    acc (Hq, Tq, D), lse (Hq, Tq) accumulators (compute dtype), updated in place. Returns
    False when no tile of this block meets the queries."""
    tiles = plan.tiles[src]
    if not tiles:
        return False
    Hq, Hkv = qh.shape[0], kv.shape[1]
    G = Hq // Hkv
    kh, vh = (kv[i].index_select(1, plan.key_perm[src]) for i in range(2))  # (Hkv, Tk, D)
    kernel = _use_kernel(qh, softcap)
    for tile in tiles:
        q0, q1, k0, k1, masked = tile
        if kernel:
            qt, kt, vt, mask = _kernel_tile(qh, kh, vh, plan, src, tile, G)
            o, t_lse = _cpu_flash()(qt, kt, vt, 0.0, False, attn_mask=mask, scale=scale)
            o, t_lse = o[0], t_lse[0]
            if masked:  # the kernel gives rows with no allowed key LSE 0, not -inf
                sees = plan.key_pos[src][k0] <= plan.query_pos[q0:q1]
                t_lse = torch.where(sees, t_lse, -math.inf)
            _merge(acc, lse, q0, q1, o, t_lse)
            continue
        step = max(1, _TILE_ELEMENTS // max(1, Hq * (k1 - k0)))
        for a in range(q0, q1, step):
            sub = (a, min(a + step, q1), k0, k1, masked)
            s, _ = _tile_scores(_fold(qh[:, sub[0] : sub[1]], Hkv), kh[:, k0:k1], scale, softcap)
            if masked:
                s = s.masked_fill(~_tile_allowed(plan, src, sub).repeat(G, 1), -math.inf)
            t_lse = torch.logsumexp(s, dim=-1)  # (Hkv, G*m); -inf on rows with no key here
            safe = torch.where(torch.isfinite(t_lse), t_lse, 0.0)
            o = torch.matmul(torch.exp(s - safe[..., None]), vh[:, k0:k1])  # (Hkv, G*m, D)
            _merge(acc, lse, sub[0], sub[1], _unfold(o, Hq), _unfold(t_lse[..., None], Hq)[..., 0])
    return True


def _ring_block_backward(qh, doh, acc, lse, delta, kv, plan, src, dq, *, scale, softcap):
    """Gradients of this rank's loss w.r.t. one K/V block (and its part of dq, in place).

    qh, doh, acc (Hq, Tq, D): queries, output gradient and merged output; lse, delta (Hq, Tq)
    of the merged forward; kv (2, Hkv, B*S_l, D). Returns (2, Hkv, B*S_l, D) dk, dv in the
    block's own order, or None (no tile)."""
    tiles = plan.tiles[src]
    if not tiles:
        return None
    Hq, Hkv = qh.shape[0], kv.shape[1]
    G = Hq // Hkv
    perm = plan.key_perm[src]
    kh, vh = (kv[i].index_select(1, perm) for i in range(2))
    dk, dv = torch.zeros_like(kh), torch.zeros_like(vh)
    kernel = _use_kernel(qh, softcap)
    backward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    for tile in tiles:
        q0, q1, k0, k1, masked = tile
        if kernel:
            qt, kt, vt, mask = _kernel_tile(qh, kh, vh, plan, src, tile, G)
            gq, gk, gv = backward(
                doh[None, :, q0:q1], qt, kt, vt, acc[None, :, q0:q1], lse[None, :, q0:q1],
                0.0, False, attn_mask=mask, scale=scale,
            )  # fmt: skip
            dq[:, q0:q1] += gq[0]
            n = k1 - k0
            dk[:, k0:k1] += gk[0].view(Hkv, G, n, -1).sum(1)
            dv[:, k0:k1] += gv[0].view(Hkv, G, n, -1).sum(1)
            continue
        step = max(1, _TILE_ELEMENTS // max(1, Hq * (k1 - k0)))
        for a in range(q0, q1, step):
            sub = (a, min(a + step, q1), k0, k1, masked)
            r0, r1 = sub[0], sub[1]
            qt, dot = _fold(qh[:, r0:r1], Hkv), _fold(doh[:, r0:r1], Hkv)
            s, t = _tile_scores(qt, kh[:, k0:k1], scale, softcap)
            p = torch.exp(s - _fold(lse[:, r0:r1, None], Hkv))  # (Hkv, G*m, n)
            if masked:
                p = p.masked_fill(~_tile_allowed(plan, src, sub).repeat(G, 1), 0.0)
            dv[:, k0:k1] += torch.matmul(p.transpose(-1, -2), dot)
            dp = torch.matmul(dot, vh[:, k0:k1].transpose(-1, -2))
            ds = p * (dp - _fold(delta[:, r0:r1, None], Hkv))
            if t is not None:
                ds = ds * (1 - t * t)
            ds = ds * scale
            dq[:, r0:r1] += _unfold(torch.matmul(ds, kh[:, k0:k1]), Hq)
            dk[:, k0:k1] += torch.matmul(ds.transpose(-1, -2), qt)
    out = torch.zeros_like(kv)
    out[0].index_copy_(1, perm, dk)
    out[1].index_copy_(1, perm, dv)
    return out


class _Ring:
    """Point-to-point passes around the group: send to rank + 1, receive from rank - 1, with
    the next block in flight while the current one is computed (isend / irecv)."""

    def __init__(self, group: Any, shard: ContextShard, stats: ContextStats) -> None:
        W, r = shard.world_size, shard.rank
        to_global = lambda x: x if group is None else torch.distributed.get_global_rank(group, x)
        self.next, self.prev = to_global((r + 1) % W), to_global((r - 1) % W)
        self.group, self.stats = group, stats

    def start(self, send: Tensor, tag: int) -> tuple[Tensor, list]:
        recv = torch.empty_like(send)
        dist = torch.distributed
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]  # fmt: skip
        self.stats.bytes_sent += send.numel() * send.element_size()
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works: list) -> None:
        for w in works:
            w.wait()


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


_RING_MIN_BYTES = 16 << 20  # CPU: the ring from 16 MiB of gathered K/V per layer
_RING_MIN_BYTES_CUDA = 1 << 30  # CUDA: from 1 GiB (the all-gather runs compiled flex there)


def _auto_schedule(q: Tensor, k: Tensor, shard: ContextShard) -> str:
    """The schedule ``schedule="auto"`` runs: "all_gather" on one or two ranks (one collective
    beats W steps, and the ring would save at most half of the K/V) and while the gathered K/V
    of a layer (2 * B * S * Hkv * D elements) is small; "ring" from three ranks once it passes
    16 MiB on CPU, 1 GiB on CUDA, where that O(S) per layer and rank is the memory wall (on
    CUDA the all-gather path runs compiled flex, the ring its tile loop)."""
    W = shard.world_size
    if W <= 2:
        return "all_gather"
    B, S = shard.shape
    gathered = 2 * B * S * k.shape[1] * k.shape[3] * k.element_size()
    limit = _RING_MIN_BYTES_CUDA if q.device.type == "cuda" else _RING_MIN_BYTES
    return "ring" if gathered >= limit else "all_gather"


class _RingAttention(torch.autograd.Function):
    """Ring attention of this rank's queries: K/V blocks pass W - 1 times around the group.

    Forward: at step i this rank holds the block of rank (r - i) mod W, sends it on to r + 1
    while attending its queries to it, and merges the partial outputs by their log-sum-exp.
    Backward (as ring-flash-attention and torch's context parallel do): the blocks travel
    again with their gradient accumulators; each rank adds its queries' share to the block's
    dk, dv and passes them on, so after W passes each block's gradient is back home. Saved
    for backward: this rank's q, k, v, output and LSE only, O(S / W).
    """

    @staticmethod
    def forward(ctx, q, k, v, shard, group, causal, scale, softcap, stats):
        B, Hq, S_l, D = q.shape
        cd = _compute_dtype(q.dtype)
        plan = _cached(shard, ("ring", causal, Hq, str(q.device)),
                       lambda: _ring_plan(shard, causal, Hq, q.device))  # fmt: skip
        qh = _heads(q).to(cd).index_select(1, plan.query_perm)  # (Hq, Tq, D)
        kv = torch.stack([_heads(k), _heads(v)]).to(cd)  # (2, Hkv, B * S_l, D)
        acc = qh.new_zeros(qh.shape)
        lse = qh.new_full(qh.shape[:2], -math.inf)
        W, r = shard.world_size, shard.rank
        ring = _Ring(group, shard, stats) if W > 1 else None
        for i in range(W):
            works = []
            if i < W - 1:
                nxt, works = ring.start(kv, tag=0)
            if not _ring_block_forward(qh, kv, plan, (r - i) % W, acc, lse,
                                       scale=scale, softcap=softcap):  # fmt: skip
                stats.blocks_skipped += 1
            if works:
                _Ring.wait(works)
                kv = nxt
        out = q.new_zeros(Hq, B * S_l, D, dtype=cd).index_copy(1, plan.query_perm, acc)
        ctx.save_for_backward(q, k, v, acc, lse)
        ctx.shard, ctx.group, ctx.causal, ctx.scale = shard, group, causal, scale
        ctx.softcap, ctx.stats, ctx.plan = softcap, stats, plan
        return out.reshape(Hq, B, S_l, D).transpose(0, 1).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, acc, lse = ctx.saved_tensors
        shard, plan, stats = ctx.shard, ctx.plan, ctx.stats
        B, Hq, S_l, D = q.shape
        cd = acc.dtype
        qh = _heads(q).to(cd).index_select(1, plan.query_perm)
        doh = _heads(grad).to(cd).index_select(1, plan.query_perm)
        delta = (doh * acc).sum(-1)  # (Hq, Tq): rowsum(dO * O) of the merged output
        dq = torch.zeros_like(qh)
        kv = torch.stack([_heads(k), _heads(v)]).to(cd)
        W, r = shard.world_size, shard.rank
        ring = _Ring(ctx.group, shard, stats) if W > 1 else None
        kw = dict(scale=ctx.scale, softcap=ctx.softcap)
        d_in, d_works = None, []  # the gradient accumulator arriving from rank r - 1
        for i in range(W):
            src = (r - i) % W
            works = []
            if i < W - 1:
                nxt, works = ring.start(kv, tag=1)
            mine = _ring_block_backward(qh, doh, acc, lse, delta, kv, plan, src, dq, **kw)
            if mine is None:
                stats.blocks_skipped += 1
                mine = torch.zeros_like(kv)
            if d_works:
                _Ring.wait(d_works)
                mine += d_in
            if W > 1:
                d_in, d_works = ring.start(mine, tag=2)  # on to the next holder
            else:
                d_in = mine
            if works:
                _Ring.wait(works)
                kv = nxt
        _Ring.wait(d_works)  # rank r - 1's last step: this rank's own block, complete
        dq_rows = torch.zeros(Hq, B * S_l, D, dtype=cd, device=q.device)
        dq_rows.index_copy_(1, plan.query_perm, dq)

        def back(x: Tensor, like: Tensor) -> Tensor:
            H = x.shape[0]
            return x.reshape(H, B, S_l, D).transpose(0, 1).to(like.dtype)

        return (back(dq_rows, q), back(d_in[0], k), back(d_in[1], v),
                None, None, None, None, None, None)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Local attention: this rank's queries against the whole row's keys (original order)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _SegmentPlan:
    """How the CPU path cuts this rank's queries into SDPA calls.

    Keys are regrouped by document (``key_perm``: (T,) positions of the real tokens in the
    flattened (B * S,) rows, by row, id, position), so a document is the run ``doc_start[g] ..
    doc_start[g] + doc_len[g]`` of the key stream. Queries are regrouped the same way
    (``query_perm``: (Tq,) positions in the flattened (B * S_l,) shard) and cut into segments:
    runs of one document at consecutive positions in it. A segment of m queries starting at
    position r0 of document g sees keys 0 .. r0 + m - 1 of it (causal: bottom-right aligned).
    """

    key_perm: Tensor
    query_perm: Tensor
    doc_sizes: list[int]  # key-stream length of each document, in order
    segments: list[tuple[int, int, int, int]]  # (document, m, r0, doc length)


def _segment_plan(shard: ContextShard, device: torch.device) -> _SegmentPlan:
    d = shard.row_doc_ids.cpu().numpy()
    B, S = d.shape
    idx = shard.index.cpu().numpy()
    S_l = idx.shape[1]
    key_perm, query_perm, doc_sizes, segments = [], [], [], []
    n_docs = 0
    for b in range(B):
        real = np.flatnonzero(d[b] >= 0)
        ids = d[b][real]
        order = np.argsort(ids, kind="stable")
        key_perm.append(b * S + real[order])
        uniq, counts = np.unique(ids, return_counts=True)
        doc_sizes.extend(counts.tolist())
        _, pos = _token_work(d[b])
        q_ids = d[b][idx[b]]
        q_real = np.flatnonzero(q_ids >= 0)
        g = np.searchsorted(uniq, q_ids[q_real])  # document number in this row
        r = pos[idx[b][q_real]]
        qo = np.lexsort((r, g))
        g, r = g[qo], r[qo]
        query_perm.append(b * S_l + q_real[qo])
        if g.size:
            cut = np.flatnonzero((g[1:] != g[:-1]) | (r[1:] != r[:-1] + 1)) + 1
            starts = np.concatenate([[0], cut])
            ends = np.concatenate([cut, [g.size]])
            for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
                gi = int(g[s])
                segments.append((n_docs + gi, e - s, int(r[s]), int(counts[gi])))
        n_docs += len(uniq)

    def t(parts: list[np.ndarray]) -> Tensor:
        a = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return torch.from_numpy(a.astype(np.int64)).to(device)

    return _SegmentPlan(t(key_perm), t(query_perm), doc_sizes, segments)


def _cached(shard: ContextShard, key: tuple, build: Any) -> Any:
    cache = shard.__dict__.setdefault("_cache", {})
    if key not in cache:
        cache[key] = build()
    return cache[key]


def _heads(x: Tensor) -> Tensor:
    """(B, H, S, D) -> (H, B * S, D)."""
    B, H, S, D = x.shape
    return x.transpose(0, 1).reshape(H, B * S, D)


def _sdpa_segments(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    shard: ContextShard,
    *,
    causal: bool,
    scale: float | None,
    enable_gqa: bool,
    softcap: float | None,
) -> Tensor:
    """This rank's queries q (B, Hq, S_l, D) against k, v (B, Hkv, S, D) in row order."""
    from flexpack._attention_sdpa import sdpa

    B, Hq, S_l, D = q.shape
    plan = _cached(shard, ("segments", str(q.device)), lambda: _segment_plan(shard, q.device))
    qh = _heads(q).index_select(1, plan.query_perm)  # (Hq, Tq, D), segments in order
    kh, vh = (_heads(x).index_select(1, plan.key_perm) for x in (k, v))  # (Hkv, T, D)
    # One split per tensor (its backward is one cat), then a narrow inside the document.
    kd, vd = (torch.split(x, plan.doc_sizes, dim=1) for x in (kh, vh))
    qs = torch.split(qh, [m for _, m, _, _ in plan.segments], dim=1)
    outs = []
    for qi, (g, m, r0, L) in zip(qs, plan.segments, strict=True):
        n = r0 + m if causal else L
        ki, vi = kd[g][:, :n], vd[g][:, :n]
        mask = None
        if causal and r0:  # bottom-right causal: query i sees keys 0 .. r0 + i
            mask = (
                torch.arange(n, device=q.device) <= (r0 + torch.arange(m, device=q.device))[:, None]
            )
        o = sdpa(
            qi[None], ki[None], vi[None], attn_mask=mask, is_causal=causal and not r0,
            scale=scale, enable_gqa=enable_gqa, softcap=softcap,
        )  # fmt: skip
        outs.append(o[0])
    out = q.new_zeros(Hq, B * S_l, D)
    if outs:
        out = out.index_copy(1, plan.query_perm, torch.cat(outs, dim=1))
    else:  # no real query: keep the graph so that backward runs (gradients are 0)
        out = out + 0.0 * (qh.sum() + kh.sum() + vh.sum())
    return out.reshape(Hq, B, S_l, D).transpose(0, 1)


def shard_block_mask(shard: ContextShard, *, causal: bool = True, block_size: int = 128) -> Any:
    """The (S_l, S) BlockMask of this rank's queries against the whole row's keys.

    Built from per-block statistics, O(S + B * nq * nk) (the size of the BlockMask): a pair
    of blocks is empty when their id ranges do not meet or (causal) every key follows every
    query, full when both blocks are one document without padding and (causal) every key
    precedes every query, partial otherwise. The mask_mod reads the query's row position from
    ``shard.index`` and both ids from the shard, so it is document-causal in row positions.
    """
    from flexpack import block_mask as bm

    q_doc, q_pos, k_doc = shard.doc_ids, shard.index, shard.row_doc_ids
    S = k_doc.shape[1]
    S_l = q_doc.shape[1]
    qs, ks = bm._BlockStats(q_doc, block_size), bm._BlockStats(k_doc, block_size)
    lo_q, hi_q = qs.lo.long()[:, :, None], qs.hi.long()[:, :, None]
    lo_k, hi_k = ks.lo.long()[:, None, :], ks.hi.long()[:, None, :]
    nonempty = qs.any_real[:, :, None] & ks.any_real[:, None, :] & (lo_q <= hi_k) & (lo_k <= hi_q)
    whole_q, whole_k = qs.single & qs.all_real, ks.single & ks.all_real
    full = whole_q[:, :, None] & whole_k[:, None, :] & (lo_q == lo_k)
    classes = bm._classes(nonempty, full)
    if causal:
        big = torch.iinfo(torch.int64).max
        q_min = bm._blocked(q_pos, block_size, big).amin(-1)  # (B, nq)
        q_max = bm._blocked(q_pos, block_size, -1).amax(-1)
        k_min, k_max = bm._block_bounds(S, block_size, k_doc.device)
        causal_cls = bm._classes(
            q_max[:, :, None] >= k_min[None, None, :], q_min[:, :, None] >= k_max[None, None, :]
        )
        classes = bm.combine_and(classes, causal_cls)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        dq = q_doc[b, q_idx]
        ok = (dq == k_doc[b, kv_idx]) & (dq >= 0)
        return ok & (q_pos[b, q_idx] >= kv_idx) if causal else ok

    mask_mod.__name__ = "context_document_causal" if causal else "context_document"
    return bm.build_block_mask(
        classes, block_size=block_size, q_len=S_l, kv_len=S, mask_mod=mask_mod
    )


def _local_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    shard: ContextShard,
    *,
    mask: str,
    scale: float | None,
    enable_gqa: bool,
    softcap: float | None,
) -> Tensor:
    """q (B, Hq, S_l, D) in shard order against k, v (B, Hkv, S, D) in row order."""
    from flexpack.attention import _FLEX_CUDA_MAX_HEAD_DIM

    causal = mask == "document_causal"
    # flex on CUDA has no float64 kernel and no head dims above 256: those take SDPA, as in
    # flexpack.attention.
    flex_ok = q.dtype != torch.float64 and q.shape[-1] <= _FLEX_CUDA_MAX_HEAD_DIM
    if q.device.type == "cuda" and flex_ok:
        from flexpack import _attention_flex

        bs = _attention_flex.CUDA_BLOCK_MULTIPLE
        block_mask = _cached(
            shard,
            ("block_mask", causal, bs, str(q.device)),
            lambda: shard_block_mask(_on(shard, q.device), causal=causal, block_size=bs),
        )
        return _attention_flex.flex(
            q, k, v, block_mask, scale=scale, enable_gqa=enable_gqa, softcap=softcap
        )
    return _sdpa_segments(
        q, k, v, shard, causal=causal, scale=scale, enable_gqa=enable_gqa, softcap=softcap
    )


def _on(shard: ContextShard, device: torch.device) -> ContextShard:
    if shard.index.device == device:
        return shard
    names = ("index", "doc_ids", "position_ids", "gathered_index", "row_doc_ids")
    return replace(shard, **{name: getattr(shard, name).to(device) for name in names})


def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    shard: ContextShard,
    *,
    group: Any = None,
    mask: Literal["document_causal", "document"] = "document_causal",
    scale: float | None = None,
    enable_gqa: bool = False,
    softcap: float | None = None,
    schedule: Schedule = "auto",
) -> Tensor:
    """Attention of this rank's queries to the whole row's keys, under the document mask.

    Two schedules, the same result: this rank's queries attend the keys their documents
    allow, in row positions: a query at position p sees the keys of its document at positions
    <= p (``mask="document_causal"``) or all of them (``"document"``). The result equals
    ``flexpack.attention`` on the full rows at ``shard.index``, forward and backward.

    - ``"all_gather"``: k and v are all-gathered across ``group`` (one collective each,
      differentiable: the backward reduce-scatters their gradients, so each key's gradient
      lands on the rank that holds it) and put back in row order. On CUDA the local attention
      is compiled flex_attention with an (S_l, S) BlockMask built from the shard's ids
      (:func:`shard_block_mask`, once per shard); elsewhere (and on CUDA for float64 or head
      dims above 256, which flex does not take) one SDPA call per run of a document's queries.
      Keeps the whole row's k and v (O(S) per rank) for the backward.
    - ``"ring"``: k and v travel around the group in W - 1 point-to-point passes (isend /
      irecv of the next block while the current one is computed); each block's partial output
      merges by its log-sum-exp; the backward passes k, v and their gradient accumulators
      around again. Keeps this rank's k and v only (O(S / W)); sends 1.5-1.75x the bytes.
      Tiles run through torch's CPU flash kernel (the matmul path with softcap or on CUDA);
      blocks whose documents meet none of this rank's queries are skipped.
    - ``"auto"`` (default): the all-gather on one or two ranks and while a layer's gathered k
      and v are under 16 MiB (1 GiB on CUDA), the ring otherwise.

    ``shard.stats`` reports the schedule that ran, the bytes sent and the blocks skipped. The
    first collective on a shard checks (one small all-gather, once) that every rank built its
    shard from the same batch.

    Args:
        q: (B, Hq, S_l, D) this rank's queries, in ``shard.index`` order (``shard.take``).
        k, v: (B, Hkv, S_l, D) this rank's keys and values, same order.
        shard: this rank's :class:`ContextShard` (from :func:`shard_context`).
        group: the context-parallel process group (default: the whole world). A shard of
            ``world_size == 1`` (the whole row) gathers nothing and needs no process group.
        mask: "document_causal" (default) or "document".
        scale: softmax scale; default ``1 / sqrt(D)``.
        enable_gqa: allow Hkv < Hq (grouped-query attention; k and v are gathered at Hkv).
        softcap: attention-logit soft-capping as in Gemma 2 (``flexpack.attention``'s).
        schedule: "auto" (default), "all_gather" or "ring".

    Returns:
        (B, Hq, S_l, D) in q's dtype (the autocast dtype inside ``torch.autocast``); 0 on
        padding queries.

    Raises:
        TypeError: q, k, v not floating tensors of one dtype; shard not a ContextShard.
        ValueError: shapes that do not match the shard, an unknown mask or schedule, a group
            whose size or rank differs from the shard's, no process group for a multi-rank
            shard, or ranks whose shards differ (doc_ids, S, B or the plan's arguments).

    Example:
        >>> import flexpack
        >>> doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, -1]])
        >>> shard = shard_context(doc_ids, 1, 0)  # one rank: no process group needed
        >>> q = k = v = torch.randn(1, 2, 8, 4)
        >>> out = context_parallel_attention(q, k, v, shard)
        >>> mask = flexpack.masks.document(doc_ids) & flexpack.masks.causal()
        >>> torch.allclose(out, flexpack.attention(q, k, v, mask), atol=1e-6)
        True
    """
    from flexpack.attention import _autocast, _autocast_dtype, _check_inputs

    if not isinstance(shard, ContextShard):
        raise TypeError(
            f"shard must be a ContextShard (from flexpack.parallel.shard_context), got "
            f"{type(shard).__name__}"
        )
    if mask not in _MASKS:
        raise ValueError(f"mask must be one of {_MASKS}, got {mask!r}")
    if isinstance(q, Tensor):
        dtype = _autocast_dtype(q.device.type)
        if dtype is not None:
            q, k, v = (_autocast(x, dtype) for x in (q, k, v))
            with torch.autocast(q.device.type, enabled=False):
                return context_parallel_attention(
                    q, k, v, shard, group=group, mask=mask, scale=scale,
                    enable_gqa=enable_gqa, softcap=softcap,
                )  # fmt: skip
    _check_inputs(q, k, v, enable_gqa)
    B, S_l = shard.index.shape
    if q.shape[0] != B or q.shape[2] != S_l:
        raise ValueError(
            f"q has shape {tuple(q.shape)} but the shard holds {S_l} tokens of {B} rows; "
            f"expected ({B}, H, {S_l}, D): this rank's tokens, e.g. shard.take(x) before the "
            "projections"
        )
    if softcap is not None:
        # numbers.Real takes numpy and Python scalars alike (np.float32(50.0) from a config)
        if isinstance(softcap, bool | np.bool_) or not isinstance(softcap, numbers.Real):
            raise TypeError(
                f"softcap must be a float or None, got {softcap!r} of type "
                f"{type(softcap).__name__}; pass a Python number, e.g. softcap=float(x)."
            )
        if not 0 < softcap < math.inf:
            raise ValueError(
                f"softcap must be a positive finite number (Gemma 2 uses 50.0), got {softcap}; "
                "pass None for no soft-capping"
            )
    if schedule not in _SCHEDULES:
        raise ValueError(f"schedule must be one of {_SCHEDULES}, got {schedule!r}")
    if schedule == "auto":
        schedule = _auto_schedule(q, k, shard)
    stats = shard.stats
    stats.schedule = schedule
    stats.calls[schedule] = stats.calls.get(schedule, 0) + 1
    if schedule == "ring":
        if _group_size_rank(group, shard) is not None:
            _check_agree(shard, group, q.device)
        D = q.shape[-1]
        return _RingAttention.apply(
            q, k, v, shard, group, mask == "document_causal",
            D**-0.5 if scale is None else float(scale),
            None if softcap is None else float(softcap), stats,
        )  # fmt: skip
    k_all, v_all = (_all_gather(x, 2, group, shard, stats) for x in (k, v))  # (B, Hkv, S, D)
    if shard.world_size > 1:
        inverse = shard._inverse(q.device)
        k_all, v_all = (torch.gather(x, 2, _along(inverse, x, 2)) for x in (k_all, v_all))
    return _local_attention(
        q, k_all, v_all, shard, mask=mask, scale=scale, enable_gqa=enable_gqa,
        softcap=None if softcap is None else float(softcap),
    )  # fmt: skip
