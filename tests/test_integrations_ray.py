"""flexpack.integrations.ray.pack_ray_dataset on a local Ray instance (optional extra ``ray``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from flexpack import pack  # noqa: E402
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


def test_global_plan_rows_match_materialize_and_errors(local_ray):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 33, size=120)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    samples = [list(range(int(s), int(s + k))) for s, k in zip(starts, lengths, strict=True)]
    ds = ray.data.from_items([{"input_ids": s, "meta": i} for i, s in enumerate(samples)])
    ds = ds.repartition(3)  # several blocks: the plan must still be global
    out = sorted(pack_ray_dataset(ds, 32, overflow="split").take_all(), key=lambda r: r["row"])
    ref = pack(lengths, 32, overflow="split").materialize(samples)
    assert [r["row"] for r in out] == list(range(ref.input_ids.shape[0]))
    for name in ("input_ids", "labels", "doc_ids", "position_ids"):
        got = torch.as_tensor(np.stack([r[name] for r in out]))
        assert torch.equal(got.long(), getattr(ref, name).long()), name
    assert [r["num_tokens"] for r in out] == (ref.doc_ids >= 0).sum(1).tolist()

    with pytest.raises(ValueError, match="column 'tokens' is not in the dataset"):
        pack_ray_dataset(ds, 32, column="tokens")
    with pytest.raises(TypeError, match=r"expected a ray\.data\.Dataset"):
        pack_ray_dataset(samples, 32)
    with pytest.raises(Exception, match="expected list<int>"):
        pack_ray_dataset(ds, 32, column="meta")
