"""pack(): strategies, overflow policies, stats and errors on hand-checked examples."""

import math

import numpy as np
import pytest
import torch

from flexpack import PackPlan, PackStats, pack
from flexpack.packing import OVERFLOWS, STRATEGIES


def _rows(plan: PackPlan) -> list[list[tuple[int, int, int]]]:
    out = [[] for _ in range(plan.num_rows)]
    for row, sample, start, stop in plan.segments.tolist():
        out[row].append((sample, start, stop))
    return out


def test_bfd_best_fit_choice():
    # 6 opens row A (2 free), 5 opens row B (3 free); 3 goes to B (fits exactly), 2 to A.
    plan = pack([6, 5, 3, 2], max_len=8, seed=None)
    assert _rows(plan) == [[(0, 0, 6), (3, 0, 2)], [(1, 0, 5), (2, 0, 3)]]


def test_bfd_and_ffd_differ():
    # 6 and 3 open rows 0 and 1, the second 3 joins row 1: both rows then have 2 free. ffd puts
    # the 1 in the first row that fits (row 0); bfd in a tightest one, here the later row 1.
    lengths = [6, 3, 3, 1]
    assert _rows(pack(lengths, 8, strategy="ffd", seed=None)) == [
        [(0, 0, 6), (3, 0, 1)],
        [(1, 0, 3), (2, 0, 3)],
    ]
    assert _rows(pack(lengths, 8, seed=None)) == [[(0, 0, 6)], [(1, 0, 3), (2, 0, 3), (3, 0, 1)]]


def test_greedy_keeps_order():
    plan = pack([3, 4, 2, 5, 1], max_len=8, strategy="greedy")
    assert _rows(plan) == [[(0, 0, 3), (1, 0, 4)], [(2, 0, 2), (3, 0, 5), (4, 0, 1)]]


def test_wrap_cuts_at_row_ends():
    plan = pack([5, 6, 2], max_len=4, strategy="wrap")
    assert plan.segments.tolist() == [
        [0, 0, 0, 4],
        [1, 0, 4, 5],
        [1, 1, 0, 3],
        [2, 1, 3, 6],
        [2, 2, 0, 1],
        [3, 2, 1, 2],
    ]
    assert plan.num_rows == 4 and plan.stats.placed == 13


@pytest.mark.parametrize("strategy", ["bfd", "ffd", "greedy"])
def test_overflow_policies(strategy):
    lengths = [10, 3]
    with pytest.raises(ValueError, match=r"1 of 2 samples are longer than max_len=4") as e:
        pack(lengths, 4, strategy=strategy)
    for option in ("'split'", "'truncate'", "'drop'"):
        assert option in str(e.value)

    split = pack(lengths, 4, strategy=strategy, overflow="split")
    pieces = sorted(tuple(s[1:]) for s in split.segments.tolist())
    assert pieces == [(0, 0, 4), (0, 4, 8), (0, 8, 10), (1, 0, 3)]
    assert split.stats.placed == 13 and split.stats.split_samples == 1

    trunc = pack(lengths, 4, strategy=strategy, overflow="truncate")
    assert sorted(tuple(s[1:]) for s in trunc.segments.tolist()) == [(0, 0, 4), (1, 0, 3)]
    assert (trunc.stats.truncated, trunc.stats.truncated_samples, trunc.stats.placed) == (6, 1, 7)

    drop = pack(lengths, 4, strategy=strategy, overflow="drop")
    assert drop.segments.tolist() == [[0, 1, 0, 3]]
    assert (drop.stats.dropped, drop.stats.dropped_samples, drop.stats.placed) == (10, 1, 3)


def test_wrap_overflow():
    assert pack([10], 4, strategy="wrap").num_rows == 3  # "error" never fires: wrap cuts anyway
    assert pack([10, 2], 4, strategy="wrap", overflow="truncate").segments.tolist() == [
        [0, 0, 0, 4],
        [1, 1, 0, 2],
    ]
    assert pack([10, 2], 4, strategy="wrap", overflow="drop").segments.tolist() == [[0, 1, 0, 2]]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_max_docs_per_row(strategy):
    plan = pack([1] * 10, 8, strategy=strategy, max_docs_per_row=3)
    assert np.bincount(plan.segments[:, 0]).max() == 3
    assert plan.num_rows == 4
    assert plan.stats.docs_per_row.max == 3 and plan.stats.docs_per_row.min == 1


def test_stats():
    plan = pack([3, 5, 2, 4, 7, 0], max_len=8)
    s = plan.stats
    assert isinstance(s, PackStats)
    assert (s.samples, s.tokens, s.placed, s.truncated, s.dropped) == (6, 21, 21, 0, 0)
    assert s.lower_bound_rows == 3 == plan.num_rows == s.rows
    assert plan.efficiency == pytest.approx(21 / 24)
    assert s.over_lower_bound == 0.0
    assert s.docs_per_row.mean == pytest.approx(5 / 3)
    with pytest.raises(AttributeError):
        s.rows = 4  # frozen
    assert plan.row_lengths().sum() == 21
    assert "PackPlan(strategy='bfd'" in repr(plan)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_empty_input(strategy):
    for lengths in ([], [0, 0], np.zeros(0, dtype=np.int32)):
        plan = pack(lengths, 16, strategy=strategy)
        assert plan.num_rows == 0 and plan.segments.shape == (0, 4)
        assert plan.efficiency == 0.0 and plan.stats.lower_bound_rows == 0
        assert plan.layout().shape == (0, 16)


def test_seeded_row_order():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 200, 500)
    a, b = pack(lengths, 256, seed=3), pack(lengths, 256, seed=3)
    assert np.array_equal(a.segments, b.segments)
    c = pack(lengths, 256, seed=4)
    assert c.num_rows == a.num_rows and not np.array_equal(a.segments, c.segments)
    unshuffled = pack(lengths, 256, seed=None)
    # Sorted packers fill their first rows with the largest samples; shuffled rows mix them.
    first = unshuffled.segments[unshuffled.segments[:, 0] < 5, 1]
    assert lengths[first].max() == lengths.max()


def test_inputs_accepted():
    expected = pack([3, 4, 5], 8).segments
    for lengths in (
        (3, 4, 5),
        np.array([3, 4, 5], dtype=np.int16),
        torch.tensor([3, 4, 5]),
        np.array([3, 4, 5], dtype=np.uint8),
    ):
        assert np.array_equal(pack(lengths, 8).segments, expected)
    assert pack([3], np.int64(8)).num_rows == 1


def test_plan_arrays_read_only():
    lengths = np.array([3, 4])
    plan = pack(lengths, 8)
    with pytest.raises(ValueError):
        plan.segments[0, 0] = 1
    lengths[0] = 1  # the plan keeps its own copy
    assert plan.lengths.tolist() == [3, 4]


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"lengths": [3, -1]}, ValueError, "got -1 at index 1"),
        ({"lengths": [3.5, 1]}, TypeError, "integers"),
        ({"lengths": [True, False]}, TypeError, "integers"),
        ({"lengths": [[1, 2]]}, ValueError, "1-D"),
        ({"lengths": "abc"}, TypeError, "integers"),
        ({"max_len": 0}, ValueError, "max_len must be >= 1"),
        ({"max_len": 8.0}, TypeError, "max_len must be an int"),
        ({"max_len": True}, TypeError, "max_len"),
        ({"strategy": "best"}, ValueError, "unknown strategy 'best'; choose one of bfd"),
        ({"overflow": "cut"}, ValueError, "unknown overflow 'cut'"),
        ({"max_docs_per_row": 0}, ValueError, "max_docs_per_row"),
        ({"seed": "x"}, TypeError, "seed"),
        ({"seed": -1, "lengths": [5, 5, 5]}, ValueError, "seed must be >= 0; got -1"),
        ({"seed": -1, "strategy": "greedy"}, ValueError, "seed must be >= 0; got -1"),
    ],
)
def test_bad_input(kwargs, exc, match):
    args = {"lengths": [3, 4], "max_len": 8, **kwargs}
    with pytest.raises(exc, match=match):
        pack(args.pop("lengths"), args.pop("max_len"), **args)


def test_select_rows():
    plan = pack([3, 5, 2, 4], max_len=8, seed=None)
    assert plan.layout([1, 0]).row_seqlens == [[2, 4], [3, 5]]
    assert plan.layout(slice(1, None)).row_seqlens == [[2, 4]]
    assert plan.layout(np.array([], dtype=np.int64)).shape == (0, 8)
    with pytest.raises(ValueError, match="rows must lie in"):
        plan.layout([2])
    with pytest.raises(TypeError, match="rows must be"):
        plan.layout([0.5])


@pytest.mark.parametrize("overflow", OVERFLOWS[1:])
def test_large_random_is_lossless(overflow):
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 700, 3000)
    for strategy in STRATEGIES:
        plan = pack(lengths, 512, strategy=strategy, overflow=overflow)
        seg = plan.segments
        fill = np.bincount(seg[:, 0], weights=seg[:, 3] - seg[:, 2], minlength=plan.num_rows)
        assert fill.max() <= 512
        s = plan.stats
        assert s.placed + s.truncated + s.dropped == s.tokens == lengths.sum()
        assert fill.sum() == s.placed
        assert plan.num_rows >= math.ceil(s.placed / 512)


def test_huge_max_len():
    """ffd switches to a comparison sort when max_len dwarfs the input; bfd refuses clearly."""
    plan = pack([5, 3, 10**9], 2**31, strategy="ffd", seed=None)
    assert plan.num_rows == 1 and plan.segments[:, 1].tolist() == [0, 1, 2]
    assert pack([5, 3], 2**31, strategy="greedy").num_rows == 1
    with pytest.raises(ValueError, match="use strategy='ffd'"):
        pack([5, 3], 2**31)


@pytest.mark.parametrize("overflow", ["drop", "truncate"])
def test_stats_never_wrap_int64(overflow):
    """Issue 11: pack([2**62] * 3, 8, overflow="drop").stats had negative tokens and dropped."""
    s = pack([2**62] * 3, 8, overflow=overflow).stats
    assert s.tokens == 3 * 2**62
    assert s.tokens == s.placed + s.truncated + s.dropped
    assert min(s.tokens, s.placed, s.truncated, s.dropped) >= 0


@pytest.mark.parametrize("lengths", [np.array([3, 2**63], dtype=np.uint64), [3, 2**63], [3, 2**64]])
def test_lengths_past_int64_are_refused(lengths):
    """Issue 11: uint64 lengths >= 2**63 became negative ("lengths must be >= 0; got -922...")."""
    with pytest.raises(ValueError, match=r"lengths\[1\] = \d+ does not fit int64"):
        pack(lengths, 8, overflow="drop")
