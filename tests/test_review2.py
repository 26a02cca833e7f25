"""Red-team regressions (review2): each test pins a bug found against an independent reference."""

from __future__ import annotations

import torch

import flexpack
from flexpack import masks as fm
from flexpack.testing.references import reference_attention


def test_auto_float64_without_grad_on_cpu_runs_off_flex():
    # flex_attention on CPU has no float64 kernel: "auto" used to pick it for non-document masks
    # under no_grad and crash in inductor; float64 (the dtype of references) must run on SDPA.
    d = torch.tensor([[0, 0, 1, -1]])
    m = fm.document(d) & fm.sliding_window(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, dtype=torch.float64, generator=g) for _ in range(3))
    with torch.no_grad():
        out = flexpack.attention(q, k, v, m)
    torch.testing.assert_close(out, reference_attention(q, k, v, m))
