"""Data-parallel balance by compute: shard_rows / DistributedPackedSampler with cost="flops"
against brute force (every row dealt once, per-step cost spread), the plan-derived sum of
squared document lengths, and the errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flexpack.data import DistributedPackedSampler, PackedDataset, shard_rows
from flexpack.data.dataset import flops_weights


@given(
    st.lists(st.integers(1, 500), min_size=1, max_size=40),
    st.integers(1, 5),
    st.booleans(),
    st.sampled_from(["drop", "pad"]),
    st.data(),
)
def test_flops_cost_deals_every_row_like_tokens(tokens, world, shuffle, remainder, data):
    if remainder == "drop" and len(tokens) < world:
        return
    sq = data.draw(st.lists(st.integers(0, 10**6), min_size=len(tokens), max_size=len(tokens)))
    a = shard_rows(tokens, world, shuffle=shuffle, remainder=remainder)
    b = shard_rows(tokens, world, shuffle=shuffle, remainder=remainder, cost="flops",
                   sum_sq=sq, flops=(100.0, 1.0))  # fmt: skip
    assert a.shape == b.shape
    if len(tokens) % world == 0:
        assert sorted(b.ravel().tolist()) == list(range(len(tokens)))
    # b = 0: the cost is a multiple of tokens, so the deal is tokens' deal
    c = shard_rows(tokens, world, shuffle=shuffle, remainder=remainder, cost="flops",
                   sum_sq=sq, flops=(3.0, 0.0))  # fmt: skip
    assert np.array_equal(a, c)


def test_tokens_is_the_default() -> None:
    tokens = [10, 50, 30, 40, 20, 60]
    assert np.array_equal(shard_rows(tokens, 2), shard_rows(tokens, 2, cost="tokens"))


def _per_step_spread(shards: np.ndarray, cost: np.ndarray) -> float:
    per = cost[shards]  # (W, steps)
    return float(np.mean(per.max(0) / per.mean(0)))


def test_flops_balance_evens_full_rows_of_different_documents() -> None:
    """Rows packed full (equal tokens) differ only by their documents: tokens cannot tell them
    apart, flops can."""
    rng = np.random.default_rng(0)
    R, S = 64, 8192
    sq = np.array([np.sum(_cut(S, rng) ** 2) for _ in range(R)], dtype=np.float64)
    tokens = np.full(R, S)
    a, b = flops_weights(params=1.2e9, layers=16, hidden=2048)
    cost = a * tokens + b * sq
    by_tokens = shard_rows(tokens, 4, shuffle=True)
    by_flops = shard_rows(tokens, 4, shuffle=True, cost="flops", sum_sq=sq, flops=(a, b))
    assert _per_step_spread(by_flops, cost) < _per_step_spread(by_tokens, cost)


def _cut(S: int, rng: np.random.Generator) -> np.ndarray:
    lengths = []
    median = rng.choice([128, 2048])
    while sum(lengths) < S:
        lengths.append(max(1, int(rng.lognormal(np.log(median), 1.0))))
    lengths[-1] -= sum(lengths) - S
    return np.array([x for x in lengths if x > 0], dtype=np.int64)


def test_sampler_reads_document_lengths_from_the_plan() -> None:
    rng = np.random.default_rng(1)
    samples = [[1] * int(n) for n in rng.integers(1, 60, size=40)]
    ds = PackedDataset(samples, max_len=64)
    sampler = DistributedPackedSampler(ds, num_replicas=2, rank=1, cost="flops", flops=(24.0, 1))
    want = np.array([
        sum((seg[3] - seg[2]) ** 2 for seg in ds.segments_of(i)) for i in range(len(ds))
    ])  # fmt: skip
    assert np.array_equal(sampler.sum_sq, want)
    sampler.set_epoch(3)
    rows = list(sampler)
    expected = shard_rows(ds.num_tokens, 2, shuffle=True, epoch=3, cost="flops", sum_sq=want,
                          flops=(24.0, 1))[1]  # fmt: skip
    assert rows == expected.tolist()
    shard = ds.shard(0, 2)  # a view: its rows' lengths
    s2 = DistributedPackedSampler(shard, num_replicas=1, rank=0, cost="flops", flops=(1, 1))
    assert np.array_equal(s2.sum_sq, want[shard.rows])


def test_flops_weights_ratio_matches_verl_at_hidden_2048() -> None:
    hidden, layers = 2048, 24
    params = 12 * layers * hidden**2  # attention + MLP weights of a plain decoder
    a, b = flops_weights(params=params, layers=layers, hidden=hidden)
    assert a / b == 24576


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cost="flops"), "needs sum_sq"),
        (dict(cost="flops", sum_sq=[1, 2]), "needs sum_sq"),
        (dict(cost="flops", sum_sq=[1], flops=(1, 1)), "sum_sq has 1 entries"),
        (dict(cost="flops", sum_sq=[1, 2], flops=3), "pair"),
        (dict(cost="time"), "cost must be one of"),
    ],
)
def test_bad_cost_input_says_what_and_how(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        shard_rows([5, 6], 2, **kwargs)


def test_sampler_without_plan_asks_for_sum_sq() -> None:
    with pytest.raises(ValueError, match="pass sum_sq"):
        DistributedPackedSampler(np.array([5, 6]), num_replicas=2, rank=0, cost="flops",
                                 flops=(1, 1))  # fmt: skip
