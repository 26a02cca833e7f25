"""Who holds which tokens: the plan of a context-parallel split (numpy, on the host).

Every rank of a context-parallel group computes the same plan from the same ``doc_ids``: the
work of each token under the document-causal mask (:func:`_token_work`), the deal of blocks of
tokens to ranks (``balance``: "work", "head_tail", "contiguous"), cached per layout, and the
fingerprint the ranks check they agree on. Imports numpy and torch only.

Shape legend: B rows, S tokens per row, W world size, S_l = S // W tokens per rank, U units
(dealt blocks) per row.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

import numpy as np

Balance = Literal["work", "head_tail", "contiguous"]
_BALANCES = ("work", "head_tail", "contiguous")


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


_FINGERPRINT = ("S (tokens per row)", "B (rows)", "world_size", "balance", "block_size",
                "doc_ids")  # fmt: skip


def _fingerprint(d: np.ndarray, world: int, balance: str, block_size: int) -> tuple[int, ...]:
    """What every rank of a group must agree on: the shape, the plan's knobs, a hash of ids."""
    digest = hashlib.blake2b(np.ascontiguousarray(d).tobytes(), digest_size=7).digest()
    B, S = d.shape
    return (S, B, world, _BALANCES.index(balance), block_size, int.from_bytes(digest, "little"))
