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


def test_tree_mask_all_padding_still_has_a_backward():
    # The per-segment SDPA path returned fresh zeros with no graph when every token is padding,
    # so backward raised "does not require grad" (the per-document path keeps its graph).
    seg = torch.full((2, 4), -1)
    m = fm.tree(seg, torch.full((2, 1), -1))
    q, k, v = (torch.randn(2, 2, 4, 8, requires_grad=True) for _ in range(3))
    out = flexpack.attention(q, k, v, m)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    for x in (q, k, v):
        assert torch.equal(x.grad, torch.zeros_like(x))


def test_doc_ids_strategy_refuses_dtypes_that_would_wrap():
    # The strategy wrote int64 ids and cast them: uint8 turned padding -1 into document 255 and
    # int8 turned ids past 127 into negative ids (padding) even with allow_padding=False.
    import pytest

    from flexpack.testing.strategies import doc_ids

    with pytest.raises(ValueError, match="cannot hold -1"):
        doc_ids(seq_len=6, dtype=torch.uint8).example()
    with pytest.raises(ValueError, match="holds ids up to 127"):
        doc_ids(seq_len=200, dtype=torch.int8, allow_padding=False).example()
    d = doc_ids(seq_len=6, dtype=torch.uint8, allow_padding=False).example()
    assert d.dtype == torch.uint8 and int(d.max()) < 6


def test_flex_backend_float64_on_cpu_names_the_fix():
    # Used to surface as a long inductor lowering dump from inside torch.compile.
    import pytest

    q = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    m = fm.document(torch.tensor([[0, 0, 1, 1]]))
    with torch.no_grad(), pytest.raises(ValueError, match="backend='auto' or 'sdpa'"):
        flexpack.attention(q, q, q, m, backend="flex")
