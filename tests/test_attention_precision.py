"""flexpack.attention under mixed precision (autocast) and with attention-logit soft-capping.

References: ``flexpack.testing.reference_attention`` in float64 (with ``softcap``), evaluated on the
inputs the kernel actually sees (bf16-rounded under autocast), and SDPA's own autocast behaviour.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flexpack
from flexpack import masks
from flexpack.attention import _choose_path, _mask_spec
from flexpack.layout import PackedLayout
from flexpack.testing import dense_mask, reference_attention
from flexpack.testing import strategies as fst

DOC = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, -1, -1, -1]])  # (1, 12), padding at the end
S = DOC.shape[1]


def mask_cases():
    """(name, mask) pairs covering every CPU path of ``auto`` and ``sdpa``."""
    return [
        ("document_causal", masks.document(DOC) & masks.causal()),  # per-document SDPA
        ("document", masks.document(DOC)),  # per-document SDPA, not causal
        ("causal", masks.causal()),  # SDPA is_causal
        ("window", masks.document(DOC) & masks.causal() & masks.sliding_window(2)),  # dense
    ]


def qkv(dtype, *, Hq=4, Hkv=2, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(1, h, S, D, generator=g) * 2).to(dtype).requires_grad_()
        for h in (Hq, Hkv, Hkv)
    ]


def reference(q, k, v, mask, **kw):
    dense = dense_mask(mask, B=1, H=1, Q_LEN=S, KV_LEN=S)
    return reference_attention(q.double(), k.double(), v.double(), dense, enable_gqa=True, **kw)


# ----------------------------------------------------------------------------- autocast


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
@pytest.mark.parametrize("name,mask", mask_cases())
def test_autocast_casts_to_the_autocast_dtype_and_grads_reach_fp32_leaves(backend, name, mask):
    q, k, v = qkv(torch.float32)
    vb = v.detach().bfloat16().requires_grad_()  # as a transformers Llama hands them under autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = flexpack.attention(q, k, vb, mask, enable_gqa=True, backend=backend)
    assert out.dtype == torch.bfloat16
    # The kernel saw bf16-rounded inputs: compare against those, in float64.
    want = reference(q.bfloat16(), k.bfloat16(), vb, mask)
    assert (out.double() - want).abs().max().item() < 2e-2
    out.float().square().sum().backward()
    for x in (q, k, vb):
        assert x.grad is not None and x.grad.dtype == x.dtype and torch.isfinite(x.grad).all()
    assert q.grad.abs().sum() > 0


def test_autocast_matches_sdpa_contract():
    """Same casts as SDPA's: float32 and half inputs go to the autocast dtype, float64 stays."""
    q, k, v = qkv(torch.float32, Hq=2, Hkv=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = flexpack.attention(q, k, v, masks.causal())
        theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    torch.testing.assert_close(ours, theirs)
    q64, k64, v64 = qkv(torch.float64, Hq=2, Hkv=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = flexpack.attention(q64, k64, v64, masks.document(DOC) & masks.causal())
    assert out.dtype == torch.float64


def test_bf16_weights_without_autocast():
    q, k, v = qkv(torch.bfloat16)
    mask = masks.document(DOC) & masks.causal()
    out = flexpack.attention(q, k, v, mask, enable_gqa=True)
    assert out.dtype == torch.bfloat16
    assert (out.double() - reference(q, k, v, mask)).abs().max().item() < 2e-2


def test_mixed_dtypes_outside_autocast_name_autocast_as_the_fix():
    q, k, v = qkv(torch.float32)
    with pytest.raises(TypeError, match=r"torch\.autocast"):
        flexpack.attention(q, k, v.bfloat16(), masks.causal(), enable_gqa=True)


# ----------------------------------------------------------------------------- softcap


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
@pytest.mark.parametrize("name,mask", mask_cases())
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-6), (torch.float32, 1e-4)])
def test_softcap_forward_and_backward_match_float64_reference(backend, name, mask, dtype, tol):
    cap = 1.5  # small enough that capping changes the scores a lot (|scores| reach ~10)
    q, k, v = qkv(dtype)
    out = flexpack.attention(q, k, v, mask, enable_gqa=True, backend=backend, softcap=cap)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = reference(q64, k64, v64, mask, softcap=cap)
    assert (out.double() - want).abs().max().item() < tol
    uncapped = reference(q64, k64, v64, mask)
    assert (uncapped - want).abs().max().item() > 0.05  # the cap matters at these inputs
    g = torch.randn_like(want)
    out.backward(g.to(dtype))
    want.backward(g)
    for x, x64 in ((q, q64), (k, k64), (v, v64)):
        assert (x.grad.double() - x64.grad).abs().max().item() < tol * 10


@given(
    doc_ids=fst.doc_ids(batch_size=1, max_seq_len=24),
    cap=st.floats(0.25, 30.0),
    causal=st.booleans(),
)
def test_softcap_per_document_property(doc_ids, cap, causal):
    """Any packed layout: the per-document path with softcap equals the dense float64 reference."""
    S_ = doc_ids.shape[1]
    mask = masks.document(doc_ids) & masks.causal() if causal else masks.document(doc_ids)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, S_, 8, generator=g, dtype=torch.float64) * 3 for _ in range(3))
    out = flexpack.attention(q, k, v, mask, softcap=cap)
    dense = dense_mask(mask, B=1, H=1, Q_LEN=S_, KV_LEN=S_)
    torch.testing.assert_close(out, reference_attention(q, k, v, dense, softcap=cap))


@pytest.mark.compile
def test_softcap_on_compiled_flex_without_recompiling_for_a_new_cap():
    from torch._dynamo.utils import counters

    q, k, v = (x.detach() for x in qkv(torch.float32, D=16))
    mask = masks.document(DOC) & masks.causal() & masks.sliding_window(3)
    block_mask = mask.block_mask(B=1, Q_LEN=S, KV_LEN=S)
    graphs = []
    with torch.no_grad():
        for cap in (1.5, 4.0):
            out = flexpack.attention(q, k, v, block_mask, enable_gqa=True, softcap=cap)
            assert (out.double() - reference(q, k, v, mask, softcap=cap)).abs().max() < 1e-4
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[1]  # the cap is a tensor the score_mod reads, not a constant


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan")])
def test_softcap_must_be_positive_and_finite(bad):
    q, k, v = qkv(torch.float32)
    with pytest.raises(ValueError, match="softcap must be a positive finite number"):
        flexpack.attention(q, k, v, masks.causal(), enable_gqa=True, softcap=bad)


@pytest.mark.parametrize("bad", ["50", True])
def test_softcap_must_be_a_number(bad):
    q, k, v = qkv(torch.float32)
    with pytest.raises(TypeError, match="softcap must be a float"):
        flexpack.attention(q, k, v, masks.causal(), enable_gqa=True, softcap=bad)


def test_softcap_on_cuda_leaves_varlen_and_is_causal_for_flex(monkeypatch):
    """Dispatch is plain Python: fake a bf16 CUDA tensor to check the choice."""
    from flexpack import _attention_flex

    monkeypatch.setattr(_attention_flex, "varlen_available", lambda device: True)
    fake = SimpleNamespace(
        device=torch.device("cuda"), dtype=torch.bfloat16, requires_grad=True, shape=(1, 4, S, 16)
    )
    doc_causal = _mask_spec(masks.document(DOC) & masks.causal(), torch.empty(1, 4, S, 16))
    causal = _mask_spec(masks.causal(), torch.empty(1, 4, S, 16))
    assert _choose_path(fake, fake, fake, doc_causal, "auto") == "varlen"
    assert _choose_path(fake, fake, fake, doc_causal, "auto", 50.0) == "flex"
    assert _choose_path(fake, fake, fake, causal, "auto") == "sdpa_causal"
    assert _choose_path(fake, fake, fake, causal, "auto", 50.0) == "flex"
    with pytest.raises(ValueError, match="softcap"):
        _choose_path(fake, fake, fake, doc_causal, "varlen", 50.0)


# ----------------------------------------------------------------------------- from_eos


def eos_reference(row: list[int], eos: int) -> list[int]:
    doc, out = 0, []
    for t in row:
        out.append(doc)
        doc += t == eos
    return out


@given(rows=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=20), min_size=1, max_size=4))
def test_from_eos_matches_a_loop(rows):
    S_ = max(len(r) for r in rows)
    rows = [r + [1] * (S_ - len(r)) for r in rows]
    layout = PackedLayout.from_eos(torch.tensor(rows), eos_id=0)
    assert layout.doc_ids.tolist() == [eos_reference(r, 0) for r in rows]
    # Every document but a row's last ends with EOS; positions restart after each EOS.
    for r, pos in zip(rows, layout.position_ids.tolist(), strict=True):
        for t in range(1, S_):
            assert pos[t] == (0 if r[t - 1] == 0 else pos[t - 1] + 1)


def test_from_eos_mask_is_the_pretraining_doc_mask():
    x = torch.tensor([5, 6, 2, 7, 2, 8, 9])
    doc = PackedLayout.from_eos(x, eos_id=2).doc_ids
    assert doc.tolist() == [[0, 0, 0, 1, 1, 2, 2]]
    mask = flexpack.document_causal_mask(doc)
    dense = dense_mask(mask, B=1, H=1, Q_LEN=7, KV_LEN=7)[0, 0]
    assert dense[3].tolist() == [False, False, False, True, False, False, False]


@pytest.mark.parametrize("bad", [None, 2.0, True, "2"])
def test_from_eos_rejects_a_non_int_eos(bad):
    with pytest.raises(TypeError, match="eos_id must be an int"):
        PackedLayout.from_eos(torch.tensor([[1, 2]]), eos_id=bad)


# ------------------------------------------------------------------ float64 on CPU


def test_auto_float64_without_grad_on_cpu_runs_off_flex():
    # flex_attention on CPU has no float64 kernel: "auto" used to pick it for non-document masks
    # under no_grad and crash in inductor; float64 (the dtype of references) must run on SDPA.
    d = torch.tensor([[0, 0, 1, -1]])
    m = masks.document(d) & masks.sliding_window(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, dtype=torch.float64, generator=g) for _ in range(3))
    with torch.no_grad():
        out = flexpack.attention(q, k, v, m)
    torch.testing.assert_close(out, reference_attention(q, k, v, m))


def test_flex_backend_float64_on_cpu_names_the_fix():
    # Used to surface as a long inductor lowering dump from inside torch.compile.
    q = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    m = masks.document(torch.tensor([[0, 0, 1, 1]]))
    with torch.no_grad(), pytest.raises(ValueError, match="backend='auto' or 'sdpa'"):
        flexpack.attention(q, q, q, m, backend="flex")
