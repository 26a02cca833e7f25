"""Shared test setup: hypothesis profiles and one dynamo setting.

Pick one with ``FLEXPACK_HYPOTHESIS_PROFILE``: "ci" (default; few examples, derandomized, so CI
is reproducible and fits its time budget) or "dev" (many random examples, for hunting bugs
locally: ``FLEXPACK_HYPOTHESIS_PROFILE=dev python -m pytest tests/properties``).
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=300,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("FLEXPACK_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True, scope="session")
def _room_for_every_test_shape():
    """The suite compiles flex_attention at more fixed shapes than dynamo's default limit of 8.

    A model does not (it feeds one row length), and flexpack.attention raises RecompileLimitError
    when it would. One process running the whole suite (no xdist) would hit the limit through the
    sum of the tests' shapes, so it is raised here; the test of the limit patches its own.
    """
    with torch._dynamo.config.patch(recompile_limit=64):
        yield


@pytest.fixture
def fake_cuda():
    """A faked CUDA device (tests/fake_cuda.py): tensors report cuda:0, compute on CPU, refuse
    mixed-device inputs where CUDA kernels do, and count host syncs. Yields the open
    ``FakeCuda``; ``fake_cuda.count()`` collects the syncs of a block."""
    import importlib

    from fake_cuda import FakeCuda

    from flexpack import _attention_flex

    _attention_flex.varlen_available.cache_clear()
    with FakeCuda() as gpu:
        yield gpu
    # Caches keyed by a device that no longer exists (and holding fake tensors).
    _attention_flex.varlen_available.cache_clear()
    importlib.import_module("flexpack.attention")._BLOCK_MASKS.clear()
