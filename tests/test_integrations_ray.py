"""flexpack.integrations.ray.pack_ray_dataset on a local Ray instance (optional extra ``ray``)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from flexpack import pack  # noqa: E402
from flexpack.data import collate  # noqa: E402
from flexpack.integrations.ray import pack_ray_dataset  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    yield ray
    if started:
        ray.shutdown()


@contextlib.contextmanager
def _sort_shuffle():
    """Ray's sort-based shuffle: its tasks reuse the warm workers, where the default hash
    shuffle starts aggregator actors per pipeline (~10 s each here). The rows do not depend on
    the strategy; the null-labels test below runs one pipeline under each."""
    from ray.data.context import ShuffleStrategy

    ctx = ray.data.DataContext.get_current()
    before, ctx.shuffle_strategy = ctx.shuffle_strategy, ShuffleStrategy.SORT_SHUFFLE_PULL_BASED
    try:
        yield
    finally:
        ctx.shuffle_strategy = before


@pytest.fixture
def sort_shuffle(local_ray):
    with _sort_shuffle():
        yield


def test_global_plan_rows_match_materialize_and_errors(sort_shuffle):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 33, size=120)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    samples = [list(range(int(s), int(s + k))) for s, k in zip(starts, lengths, strict=True)]
    labels = [[-100 if t % 3 == 0 else t for t in s] for s in samples]
    items = [
        {"input_ids": s, "labels": lab, "meta": i}
        for i, (s, lab) in enumerate(zip(samples, labels, strict=True))
    ]
    ds = ray.data.from_items(items).repartition(3)  # several blocks: the plan must be global
    plan = pack(lengths, 32, overflow="split")
    ref = plan.materialize(
        [{"input_ids": s, "labels": lab} for s, lab in zip(samples, labels, strict=True)]
    )
    out = sorted(pack_ray_dataset(ds, 32, overflow="split").take_all(), key=lambda r: r["row"])
    assert [r["row"] for r in out] == list(range(ref.input_ids.shape[0]))
    assert set(out[0]) == {"row", "input_ids", "labels", "seqlens", "num_tokens"}
    batch = collate(
        [{k: r[k] for k in ("input_ids", "labels", "seqlens")} for r in out], max_len=32
    )
    for name in ("input_ids", "labels", "doc_ids", "position_ids"):
        assert torch.equal(getattr(batch, name), getattr(ref, name)), name
    assert [r["num_tokens"] for r in out] == (ref.doc_ids >= 0).sum(1).tolist()

    padded = pack_ray_dataset(ds, 32, overflow="split", padded=True, labels_column=None)
    out = sorted(padded.take_all(), key=lambda r: r["row"])
    ref = plan.materialize(samples)
    for name in ("input_ids", "labels", "doc_ids", "position_ids"):
        got = torch.as_tensor(np.stack([r[name] for r in out]))
        assert torch.equal(got.long(), getattr(ref, name).long()), name

    with pytest.raises(ValueError, match="column 'tokens' is not in the dataset"):
        pack_ray_dataset(ds, 32, column="tokens")
    with pytest.raises(TypeError, match=r"expected a ray\.data\.Dataset"):
        pack_ray_dataset(samples, 32)
    with pytest.raises(Exception, match="expected list<int>"):
        pack_ray_dataset(ds, 32, column="meta")
    bad = [dict(it) for it in items]
    bad[100]["labels"] = bad[100]["labels"][:-1]
    bad_ds = ray.data.from_items(bad).repartition(3)
    with pytest.raises(ValueError, match="sample 100 has"):
        pack_ray_dataset(bad_ds, 32, overflow="split")


def test_a_null_labels_row_is_labelled_by_its_tokens(local_ray):
    # The rule of every flexpack path (docs/data.md): pack_ray_dataset refused null labels rows.
    # Three blocks: some null rows, all null (Arrow type null), none null.
    ids = [[1, 2, 3], [4, 5], [6, 7, 8], [9, 10], [11, 12, 13], [14]]
    labels = [[-100, 2, 3], None, None, None, [-100, 12, 13], [-100]]
    explicit = [ids[i] if lab is None else lab for i, lab in enumerate(labels)]

    # The reference: the same plan materialized with the null rows' labels written out. One Ray
    # pipeline per mode: the unpadded one under Ray's default (hash) shuffle, as users run it, the
    # padded one under the sort shuffle (the rows do not depend on it; the hash shuffle's actors
    # cost ~10 s per pipeline here).
    ref = pack([len(s) for s in ids], 8).materialize(
        [{"input_ids": s, "labels": lab} for s, lab in zip(ids, explicit, strict=True)]
    )
    items = [{"input_ids": s, "labels": lab} for s, lab in zip(ids, labels, strict=True)]
    ds = ray.data.from_items(items).repartition(3)
    for padded, strategy in ((False, contextlib.nullcontext), (True, _sort_shuffle)):
        with strategy():
            out = pack_ray_dataset(ds, 8, padded=padded).take_all()
        rows = sorted(out, key=lambda r: r["row"])
        want = [
            row[: int(n)] if not padded else row
            for row, n in zip(ref.labels.tolist(), (ref.doc_ids >= 0).sum(1), strict=True)
        ]
        assert [np.asarray(r["labels"]).tolist() for r in rows] == want, padded
