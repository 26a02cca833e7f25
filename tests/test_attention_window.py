"""Sliding-window document masks on CPU: each document's own band, per document.

``document(d) & causal() & sliding_window(w)`` runs one SDPA call per document (or per length)
with ``is_causal`` where the document fits in the window, a banded mask, or query chunks against
their window of keys for long documents. Checked against the float64 reference on the dense mask
and against the dense-mask SDPA path it replaces, outputs and q/k/v gradients.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flexpack
from flexpack import _attention_sdpa, masks
from flexpack.attention import _choose_path, _mask_spec
from flexpack.testing import dense_mask, reference_attention
from flexpack.testing import strategies as fst


@contextlib.contextmanager
def chunk(size: int):
    """Small query chunks, so short test documents take the chunked branch too."""
    old = _attention_sdpa._WINDOW_CHUNK
    _attention_sdpa._WINDOW_CHUNK = size
    _attention_sdpa._BANDS.clear()
    try:
        yield
    finally:
        _attention_sdpa._WINDOW_CHUNK = old
        _attention_sdpa._BANDS.clear()


def qkv(B, Hq, Hkv, S, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, S, D, generator=g).to(dtype).requires_grad_() for h in (Hq, Hkv, Hkv)]


def check(q, k, v, mask, *, gqa, softcap=None, tol=1e-5):
    """Output and gradients against float64 on the dense mask, and against dense SDPA."""
    assert _choose_path(q, k, v, _mask_spec(mask, q), "auto", softcap) == "sdpa_document_window"
    out = flexpack.attention(q, k, v, mask, enable_gqa=gqa, softcap=softcap)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = reference_attention(*leaves, mask, enable_gqa=gqa, softcap=softcap)
    dense = dense_mask(mask, B=q.shape[0], H=1, Q_LEN=q.shape[2], KV_LEN=q.shape[2])
    twin = _attention_sdpa.dense_sdpa(q, k, v, dense, scale=None, enable_gqa=gqa, softcap=softcap)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * cot).sum(), (q, k, v))
    grads_want = torch.autograd.grad((want * cot).sum(), leaves)
    grads_twin = torch.autograd.grad((twin.double() * cot).sum(), (q, k, v))
    for got, ref, other in zip(
        (out, *grads), (want, *grads_want), (twin, *grads_twin), strict=True
    ):
        assert torch.isfinite(got).all()
        scale = ref.abs().max().clamp(min=1.0)  # inputs are O(1); 0 references get abs tol
        assert ((got.double() - ref).abs().max() / scale).item() < tol
        assert ((got.double() - other.double()).abs().max() / scale).item() < 2 * tol


@settings(max_examples=20, deadline=None)
@given(
    doc_ids=st.one_of(
        fst.doc_ids(max_seq_len=70, allow_empty_rows=True),
        # ids repeated in separate runs: a window counts row positions, so these go dense
        fst.doc_ids(max_seq_len=70, contiguous=False, allow_empty_rows=True),
    ),
    window=st.integers(0, 40),
    chunk_size=st.sampled_from([1, 4, 128]),
    gqa=st.booleans(),
    softcap=st.sampled_from([None, 5.0]),
    order=st.booleans(),
)
def test_property_window_path_matches_references(doc_ids, window, chunk_size, gqa, softcap, order):
    mask = masks.document(doc_ids) & masks.causal()
    mask = mask & masks.sliding_window(window) if order else masks.sliding_window(window) & mask
    q, k, v = qkv(doc_ids.shape[0], 4, 2 if gqa else 4, doc_ids.shape[1], 8)
    with chunk(chunk_size):
        check(q, k, v, mask, gqa=gqa, softcap=softcap)


@pytest.mark.parametrize(
    ("lens", "window"),
    [
        ([300, 7, 1], 20),  # long document: query chunks
        ([50, 50, 50], 30),  # windows shorter than documents: banded masks (batched by length)
        ([100, 60], 512),  # the window holds every document: is_causal
    ],
    ids=["chunked", "banded", "causal"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_branches_and_dtypes(lens, window, dtype):
    S = sum(lens) + 3
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)] + [torch.full((3,), -1)])
    mask = masks.document(doc_ids[None]) & masks.causal() & masks.sliding_window(window)
    q, k, v = qkv(2, 4, 2, S, 16, dtype)
    with chunk(16):
        check(q, k, v, mask, gqa=True, tol=1e-5 if dtype == torch.float32 else 2e-2)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # SDPA's autocast contract holds
            out = flexpack.attention(q.float(), k.float(), v.float(), mask, enable_gqa=True)
        assert out.dtype == torch.bfloat16


def test_dispatch():
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, -1]])
    q, k, v = qkv(1, 2, 2, 6, 8)
    window = masks.sliding_window(2)
    either = window & masks.causal() & masks.document(doc_ids)
    for mask in (masks.document(doc_ids) & masks.causal() & window, either):
        spec = _mask_spec(mask, q)
        assert _choose_path(q, k, v, spec, "auto") == "sdpa_document_window"
        assert _choose_path(q, k, v, spec, "sdpa") == "sdpa_document_window"
        with torch.no_grad():  # per document beats compiled flex on CPU without grad too
            assert _choose_path(q, k, v, spec, "auto") == "sdpa_document_window"
    # Not this path: a window without causal (it lets queries see future keys), or a third factor.
    third = masks.document(doc_ids) & masks.causal() & window & masks.padding(doc_ids)
    for mask in (masks.document(doc_ids) & window, third):
        assert _choose_path(q, k, v, _mask_spec(mask, q), "auto") == "sdpa_document_masked"
