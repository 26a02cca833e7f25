"""What the one-pass mixer tests share (tests/test_mixers_onepass_{ssm,mamba}.py): each
document through the plain module, optionally with its scan swapped for a float64 recurrence;
a tolerance relative to the output's scale; inputs; counters of the one pass and of the
per-group split."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import torch
from _rows import documents

from flexpack.mixers._plan import DocumentPlan


def each_alone(mixer, x, doc_ids, *, seam: str | None = None, scan: Callable | None = None) -> dict:
    """Each document through the plain module: {(row, start, end): (1, n, H)}; with ``seam``,
    the modeling file's function of that name replaced by ``scan`` meanwhile (skipped on a
    transformers release without it)."""
    modeling = sys.modules[type(mixer).__module__]
    if seam is not None and not hasattr(modeling, seam):  # transformers before 5.25
        pytest.skip(f"{modeling.__name__} has no {seam} for the float64 reference")
    with pytest.MonkeyPatch.context() as patch:
        if seam is not None:
            patch.setattr(modeling, seam, scan)
        return {(b, a, e): mixer(x[b : b + 1, a:e]) for b, a, e in documents(doc_ids)}


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Every element within ``tol`` of the largest of ``want`` (float32 rounds each sum)."""
    scale = max(want.abs().max().item(), 1e-3)
    error = (got - want).abs().max().item()
    assert error <= tol * scale, f"{error:.3g} > {tol:g} * {scale:.3g}"


def inputs(model, doc_ids, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Random rows (B, S, H) and random weights of the same shape for a scalar loss."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*doc_ids.shape, model.config.hidden_size, generator=g, dtype=dtype)
    weights = torch.randn(*doc_ids.shape, model.config.hidden_size, generator=g, dtype=dtype)
    return x, weights


def count(monkeypatch, room) -> dict[str, int]:
    """Calls of ``room``'s one pass and of the per-group split, from now on."""
    calls = {"one_pass": 0, "split": 0}
    one_pass, split = room.one_pass.fn, DocumentPlan.split

    def counted_one_pass(*args, **kwargs):
        calls["one_pass"] += 1
        return one_pass(*args, **kwargs)

    def counted_split(*args, **kwargs):
        calls["split"] += 1
        return split(*args, **kwargs)

    monkeypatch.setattr(room.one_pass, "fn", counted_one_pass)
    monkeypatch.setattr(DocumentPlan, "split", counted_split)
    return calls
