"""Shared test setup: hypothesis profiles.

Pick one with ``FLEXPACK_HYPOTHESIS_PROFILE``: "ci" (default; few examples, derandomized, so CI
is reproducible and fits its time budget) or "dev" (many random examples, for hunting bugs
locally: ``FLEXPACK_HYPOTHESIS_PROFILE=dev python -m pytest tests/properties``).
"""

import os

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
