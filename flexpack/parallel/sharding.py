"""A rank's share of packed rows (:class:`ContextShard`, :func:`shard_context`) and the
collectives that move tensors between the shares, with autograd.

:func:`shard_context` plans with :mod:`flexpack.parallel.planning` and keeps this rank's part;
``take`` / ``put`` / ``gather`` move (B, S, ...) tensors to and from its order; the all-gather of
the sequence dimension (backward: a reduce-scatter) and the once-per-shard check that the ranks
of a group built their shards from one batch live here, below both attention schedules.

Shape legend: B rows, S tokens per row, W world size, S_l = S // W tokens per rank, H heads,
D head dimension.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from flexpack.layout import _check_runs
from flexpack.parallel.planning import (
    _BALANCES,
    _FINGERPRINT,
    Balance,
    _fingerprint,
    _plan,
)

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


def _cached(shard: ContextShard, key: tuple, build: Any) -> Any:
    cache = shard.__dict__.setdefault("_cache", {})
    if key not in cache:
        cache[key] = build()
    return cache[key]


def _heads(x: Tensor) -> Tensor:
    """(B, H, S, D) -> (H, B * S, D)."""
    B, H, S, D = x.shape
    return x.transpose(0, 1).reshape(H, B * S, D)
