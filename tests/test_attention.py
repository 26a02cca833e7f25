"""flexpack.attention against a float64 per-document reference: outputs and q/k/v gradients.

The reference below is the definition of packed attention: every document run alone, in float64,
its output written back at its tokens; padding gets 0. Compositions without a per-document form
(prefix-LM, sliding windows, ...) are checked against flexpack.testing's dense float64 reference.
"""

from __future__ import annotations

import math
import re
import sys

import numpy as np
import pytest
import torch
from _rows import dense_document_causal as _twin
from _rows import qkv as _qkv
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask

import flexpack
from flexpack import masks
from flexpack import masks as fm
from flexpack.attention import RecompileLimitError, _choose_path, _mask_spec
from flexpack.testing import dense_mask, reference_attention
from flexpack.testing import strategies as fst

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def per_document_reference(q, k, v, doc_ids, *, causal, scale=None):
    """Each document alone in float64. q (B, Hq, S, D); k, v (B, Hkv, S, D); doc_ids (B|1, S)."""
    B, Hq, S, D = q.shape
    rep = Hq // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scale = 1 / math.sqrt(D) if scale is None else scale
    doc_ids = doc_ids.expand(B, S)
    rows = []
    for b in range(B):
        row = q[b].double() * 0  # (Hq, S, D); stays 0 on padding, connected to the graph
        for d in doc_ids[b].unique().tolist():
            if d < 0:
                continue
            idx = torch.nonzero(doc_ids[b] == d).squeeze(1)  # positions, in order
            qd, kd, vd = (x[b][:, idx].double() for x in (q, k, v))  # (Hq, L, D)
            s = qd @ kd.transpose(-1, -2) * scale
            if causal:
                n = idx.numel()
                s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
            row = row.index_copy(1, idx, s.softmax(-1) @ vd)
        rows.append(row)
    return torch.stack(rows)


def rel_err(got, want):
    """max |got - want| relative to max |want|, floored at 0.1 (inputs are O(1)): a reference
    that is exactly 0, as dq and dk of a one-token document, gets an absolute tolerance."""
    return ((got.double() - want).abs().max() / want.abs().max().clamp(min=0.1)).item()


def make_qkv(B, Hq, Hkv, S, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, S, D, generator=g).to(dtype).requires_grad_()
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype).requires_grad_()
    return q, k, v


def check_against(reference, q, k, v, mask, *, enable_gqa=False, backend="auto", pad=None):
    """Output and q/k/v gradients of attention vs ``reference(q64, k64, v64)``, rel. error."""
    tol = TOL[q.dtype]
    out = flexpack.attention(q, k, v, mask, enable_gqa=enable_gqa, backend=backend)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = reference(*leaves)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, want) < tol, rel_err(out, want)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * cot).sum(), (q, k, v))
    grads_want = torch.autograd.grad(
        (want * cot).sum(), leaves, allow_unused=True, materialize_grads=True
    )
    for name, g, gw in zip("qkv", grads, grads_want, strict=True):
        assert torch.isfinite(g).all(), f"d{name} has NaN/inf"
        assert rel_err(g, gw) < tol, (name, rel_err(g, gw))
    if pad is not None:  # padding tokens (B|1, S): output 0, and no gradient flows through them
        pad = pad.expand(q.shape[0], -1)
        for x in (out, *grads):
            assert (x.transpose(1, 2)[pad] == 0).all()
    return out


# Two rows: packer layout with padding at the end; arbitrary unsorted ids (each one run of its
# row: an id in two runs is refused, tests/test_split_runs.py), padding in the middle.
DOC_IDS = torch.tensor(
    [
        [0] * 9 + [1] * 17 + [2] * 1 + [3] * 5 + [-1] * 5,
        [7] * 3 + [2] * 6 + [5] * 10 + [-1] * 2 + [9] * 15 + [-3] * 1,
    ],
    dtype=torch.int32,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_per_document_sdpa_matches_reference(dtype, causal, heads):
    Hq, Hkv = heads
    B, S = DOC_IDS.shape
    mask = masks.document(DOC_IDS) & masks.causal() if causal else masks.document(DOC_IDS)
    q, k, v = make_qkv(B, Hq, Hkv, S, 16, dtype)
    assert _choose_path(q, k, v, _mask_spec(mask, q), "auto") == "sdpa_document"
    ref = lambda q, k, v: per_document_reference(q, k, v, DOC_IDS, causal=causal)
    check_against(ref, q, k, v, mask, enable_gqa=Hq != Hkv, pad=DOC_IDS < 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_mask_from_flexpack_takes_the_per_document_path(dtype):
    # A BlockMask built by flexpack carries its Mask: the CPU backward uses the per-document path.
    block_mask = flexpack.document_causal_mask(DOC_IDS)
    q, k, v = make_qkv(2, 2, 2, DOC_IDS.shape[1], 8, dtype)
    assert _choose_path(q, k, v, _mask_spec(block_mask, q), "auto") == "sdpa_document"
    ref = lambda q, k, v: per_document_reference(q, k, v, DOC_IDS, causal=True)
    check_against(ref, q, k, v, block_mask, pad=DOC_IDS < 0)


@pytest.mark.parametrize(
    ("doc_ids", "strategy"),
    [
        (DOC_IDS[:1], "split"),  # the packer's layout: one SDPA call per document, on views
        (DOC_IDS, "split"),  # row 1: unsorted ids, padding between documents: still runs
        # many short documents of few lengths: batched per length
        (torch.arange(60).repeat_interleave(torch.tensor([1, 2, 3] * 20))[None], "gather"),
    ],
    ids=["packer", "unsorted_ids", "many_short"],
)
def test_both_per_document_strategies(doc_ids, strategy):
    from flexpack._attention_sdpa import _sdpa_plan

    B, S = doc_ids.shape
    assert _sdpa_plan(doc_ids).strategy == strategy
    q, k, v = make_qkv(B, 4, 2, S, 8, torch.float32)
    ref = lambda q, k, v: per_document_reference(q, k, v, doc_ids, causal=True)
    mask = masks.document(doc_ids) & masks.causal()
    check_against(ref, q, k, v, mask, enable_gqa=True, pad=doc_ids < 0)


def test_masked_per_document_blocks_of_a_mask_mod_that_does_not_broadcast():
    # transformers' rules and users' mask_mods are written for vmap; one that refuses broadcast
    # index tensors gets the dense mask, cut to the same blocks.
    from flexpack._attention_sdpa import per_document_sdpa

    B, S = DOC_IDS.shape
    spans = (torch.arange(S) % 5 == 0).expand(B, S)

    def scalar_only(b, h, q_idx, kv_idx):
        if q_idx.dim() != 0:
            raise RuntimeError("scalars only")
        return (kv_idx <= q_idx) | spans[b, kv_idx]

    broadcasting = lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) | spans[b, kv_idx]
    q, k, v = make_qkv(B, 2, 2, S, 8, torch.float32)
    kw = dict(causal=False, scale=None, enable_gqa=False)
    mods = (scalar_only, broadcasting)
    got, want = (per_document_sdpa(q, k, v, DOC_IDS, mask_mod=mod, **kw) for mod in mods)
    pos = torch.arange(S)
    rule = (pos[None, :] <= pos[:, None]) | spans[:, None, None, :]  # (B, 1, S, S)
    allowed = dense_mask(masks.document(DOC_IDS), B, 1, S, S) & rule
    ref = reference_attention(q.double(), k.double(), v.double(), allowed)
    assert rel_err(want, ref) < 1e-5 and torch.equal(got, want)


def test_one_row_mask_broadcasts_over_the_batch():
    doc_ids = torch.tensor([0, 0, 1, 1, 1, 2, -1])
    q, k, v = make_qkv(3, 2, 2, 7, 8, torch.float32)
    ref = lambda q, k, v: per_document_reference(q, k, v, doc_ids[None], causal=True)
    check_against(ref, q, k, v, masks.document(doc_ids) & masks.causal(), pad=doc_ids[None] < 0)


def test_a_one_row_mask_broadcasts_over_the_batch_as_documented():
    import inspect

    doc = " ".join(inspect.getdoc(flexpack.attention).split())
    assert "A mask of batch size 1 is broadcast" in doc
    q, k, v = _qkv(3, 4)
    d = torch.tensor([[0, 0, 1, 1]])
    got = flexpack.attention(q, k, v, fm.document(d) & fm.causal())
    torch.testing.assert_close(got, reference_attention(q, k, v, _twin(d.expand(3, 4))))


@settings(max_examples=15, deadline=None)
@given(
    doc_ids=fst.doc_ids(max_seq_len=70, contiguous=False, allow_empty_rows=True),
    causal=st.booleans(),
    gqa=st.booleans(),
)
def test_property_per_document_path(doc_ids, causal, gqa):
    B, S = doc_ids.shape
    q, k, v = make_qkv(B, 4, 2 if gqa else 4, S, 8, torch.float32)
    mask = masks.document(doc_ids) & masks.causal() if causal else masks.document(doc_ids)
    ref = lambda q, k, v: per_document_reference(q, k, v, doc_ids, causal=causal)
    check_against(ref, q, k, v, mask, enable_gqa=gqa, pad=doc_ids < 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_per_document_path_equals_per_document_path_on_the_same_mask(dtype):
    # document & causal & padding is the document-causal mask again, but as an "and" composition
    # it takes the masked per-document path (its mask_mod on each block): both must agree with
    # the per-document reference.
    mask = masks.document(DOC_IDS) & masks.causal() & masks.padding(DOC_IDS)
    q, k, v = make_qkv(2, 4, 2, DOC_IDS.shape[1], 16, dtype)
    assert _choose_path(q, k, v, _mask_spec(mask, q), "auto") == "sdpa_document_masked"
    ref = lambda q, k, v: per_document_reference(q, k, v, DOC_IDS, causal=True)
    check_against(ref, q, k, v, mask, enable_gqa=True, pad=DOC_IDS < 0)


@pytest.mark.parametrize(
    "doc_ids",
    [
        DOC_IDS[:1],  # split: one call per document, on views
        DOC_IDS,  # unsorted ids, padding between documents (row positions matter)
        torch.arange(60).repeat_interleave(torch.tensor([1, 2, 3] * 20))[None],  # batched
    ],
    ids=["packer", "unsorted_ids", "many_short"],
)
def test_masked_per_document_path_matches_dense_reference(doc_ids):
    # Gemma 3's shape of mask: documents & (causal | same span) & a window, plus a user's own
    # mask_mod that reads row positions; each block's mask is evaluated at its row positions.
    B, S = doc_ids.shape
    block = torch.arange(S) // 4  # an image span of 4 tokens, one run each, after text
    spans = torch.where(block % 3 == 0, -1, block).expand(B, S).contiguous()  # -1: text
    image = masks.document(doc_ids) & (masks.causal() | masks.document(spans))
    made = [
        image,
        image & masks.sliding_window(3),
        masks.document(doc_ids) & masks.causal() & masks.sliding_window(2),
    ]
    for mask in made:
        q, k, v = make_qkv(B, 4, 2, S, 8, torch.float32)
        spec = _mask_spec(mask, q)
        if _choose_path(q, k, v, spec, "auto") != "sdpa_document_window":  # contiguous: bands
            assert _choose_path(q, k, v, spec, "auto") == "sdpa_document_masked"
        with torch.no_grad():  # without grad on CPU too: compiles nothing, as per document
            assert _choose_path(q, k, v, spec, "auto") != "flex"
        check_against(_dense_ref(mask, B, S, True), q, k, v, mask, enable_gqa=True)


def _dense_ref(mask, B, S, enable_gqa=False):
    dense = dense_mask(mask, B, 1, S, S)
    return lambda q, k, v: reference_attention(q, k, v, dense, enable_gqa=enable_gqa)


@pytest.mark.parametrize(
    "make_mask",
    [
        lambda d: masks.document(d) & masks.causal() & masks.sliding_window(4),
        lambda d: masks.prefix_lm(d, torch.tensor([[3, 0, 1, 5]])),
        lambda d: masks.padding(d),  # padding rows are fully masked
        lambda d: ~(masks.document(d) & masks.causal()),
        lambda d: masks.causal(),
        lambda d: masks.sliding_window(2),
    ],
    ids=["doc_causal_window", "prefix_lm", "padding", "not", "causal", "window"],
)
def test_general_masks_match_dense_reference(make_mask):
    doc_ids = DOC_IDS[:1]
    mask = make_mask(doc_ids)
    q, k, v = make_qkv(1, 4, 2, doc_ids.shape[1], 16, torch.float32)
    check_against(_dense_ref(mask, 1, doc_ids.shape[1], True), q, k, v, mask, enable_gqa=True)


@settings(max_examples=12, deadline=None)
@given(data=st.data(), doc_ids=fst.doc_ids(max_seq_len=40, max_batch_size=2))
def test_property_any_composed_mask_matches_dense_reference(data, doc_ids):
    # Whatever path "auto" picks with grad on CPU (per-document, causal or dense), the result is
    # the dense float64 reference, gradients included.
    mask = data.draw(fst.masks(doc_ids, max_depth=2))
    B, S = doc_ids.shape
    q, k, v = make_qkv(B, 2, 1, S, 8, torch.float32, seed=data.draw(st.integers(0, 99)))
    dense = dense_mask(mask, B, 1, S, S)
    ref = lambda q, k, v: reference_attention(q, k, v, dense, enable_gqa=True)
    check_against(ref, q, k, v, mask, enable_gqa=True)


def test_foreign_block_mask_runs_on_sdpa_through_its_dense_twin():
    S = DOC_IDS.shape[1]

    def every_other_document(b, h, q_idx, kv_idx):  # a user's own mask_mod
        return (DOC_IDS[b, q_idx] == DOC_IDS[b, kv_idx]) & (DOC_IDS[b, q_idx] % 2 == 0)

    block_mask = create_block_mask(every_other_document, 2, None, S, S, device="cpu", BLOCK_SIZE=8)
    q, k, v = make_qkv(2, 2, 2, S, 8, torch.float32)
    assert _mask_spec(block_mask, q).kind is None
    assert _choose_path(q, k, v, _mask_spec(block_mask, q), "auto") == "sdpa_dense"
    ref = _dense_ref(every_other_document, 2, S)
    check_against(ref, q, k, v, block_mask, backend="sdpa")
    with pytest.raises(ValueError, match="document and document_causal masks"):
        flexpack.attention(q, k, v, block_mask, backend="varlen")


def test_all_padding_gives_zero_output_and_gradients():
    doc_ids = torch.full((2, 5), -1)
    q, k, v = make_qkv(2, 2, 2, 5, 4, torch.float32)
    for mask in (masks.document(doc_ids) & masks.causal(), masks.padding(doc_ids)):
        out = flexpack.attention(q, k, v, mask)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert (out == 0).all()
        assert all((g == 0).all() for g in grads)


def test_grouping_is_cached_per_doc_ids_tensor_and_never_stale():
    from flexpack._attention_sdpa import _sdpa_plan, cached_plan

    doc_ids = torch.tensor([[0, 0, 1, 1, 1, -1]])
    plan = cached_plan("sdpa", doc_ids, 2, _sdpa_plan)
    assert cached_plan("sdpa", doc_ids, 2, _sdpa_plan) is plan  # next layer: reused
    assert cached_plan("sdpa", doc_ids.clone(), 2, _sdpa_plan) is not plan
    doc_ids[0, -1] = 1  # modified in place: rebuilt
    fresh = cached_plan("sdpa", doc_ids, 2, _sdpa_plan)
    assert fresh is not plan and fresh.sizes == [2, 4, 2, 4] and fresh.is_doc == [True] * 4


def test_varlen_plan_unpads_like_flash_attn():
    # varlen_attn itself needs CUDA; its unpadding plan is plain torch.
    from flexpack._attention_flex import _varlen_plan

    plan = _varlen_plan(torch.tensor([[0, 0, 1, -1], [0, 1, 1, 1]]))
    assert plan.order.tolist() == [0, 1, 2, 4, 5, 6, 7]  # flash-attn's unpad_input indices
    assert plan.cu_seqlens.tolist() == [0, 2, 3, 4, 7] and plan.cu_seqlens.dtype == torch.int32
    assert plan.max_seqlen == 3 and not plan.identity
    full = _varlen_plan(torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]]))
    assert full.identity  # no padding, documents in order: no gather, no scatter
    assert not _varlen_plan(torch.tensor([[1, 1, 0, 0]])).identity  # ids out of order


def test_scale_is_honoured():
    q, k, v = make_qkv(2, 2, 2, DOC_IDS.shape[1], 8, torch.float32)
    ref = lambda q, k, v: per_document_reference(q, k, v, DOC_IDS, causal=True, scale=0.3)
    out = flexpack.attention(q, k, v, masks.document(DOC_IDS) & masks.causal(), scale=0.3)
    assert rel_err(out, ref(q, k, v)) < 1e-5


def test_dispatch_on_cpu():
    mask = masks.document(DOC_IDS) & masks.causal()
    q, k, v = make_qkv(2, 2, 2, DOC_IDS.shape[1], 8, torch.float32)
    spec = _mask_spec(mask, q)
    assert _choose_path(q, k, v, spec, "auto") == "sdpa_document"
    assert _choose_path(q, k, v, spec, "sdpa") == "sdpa_document"
    with torch.no_grad():  # per-document SDPA beats compiled flex on CPU even without grad
        assert _choose_path(q, k, v, spec, "auto") == "sdpa_document"
        assert _choose_path(q, k, v, spec, "flex") == "flex"
    causal_spec = _mask_spec(masks.causal(), q)
    assert _choose_path(q, k, v, causal_spec, "auto") == "sdpa_causal"
    # document_causal & sliding_window: each document's own band (tests/test_attention_window.py)
    window_spec = _mask_spec(mask & masks.sliding_window(3), q)
    assert _choose_path(q, k, v, window_spec, "auto") == "sdpa_document_window"
    # Other masks inside documents: the mask on each document's block, with or without grad.
    inside_spec = _mask_spec(masks.document(DOC_IDS) & masks.sliding_window(3), q)
    assert _choose_path(q, k, v, inside_spec, "auto") == "sdpa_document_masked"
    qd, kd, vd = (x.detach() for x in (q, k, v))
    assert _choose_path(qd, kd, vd, inside_spec, "auto") == "sdpa_document_masked"
    # Masks across documents: compiled flex without grad (block sparsity), dense SDPA with grad.
    other_spec = _mask_spec(masks.padding(DOC_IDS) & masks.sliding_window(3), q)
    assert _choose_path(q, k, v, other_spec, "auto") == "sdpa_dense"
    assert _choose_path(qd, kd, vd, other_spec, "auto") == "flex"
    assert _choose_path(qd, kd, vd, other_spec, "sdpa") == "sdpa_dense"


def test_backend_errors_name_the_fix():
    mask = masks.document(DOC_IDS) & masks.causal()
    q, k, v = make_qkv(2, 2, 2, DOC_IDS.shape[1], 8, torch.float32)
    with pytest.raises(ValueError, match=r"no CPU backward.*backend='auto' or 'sdpa'"):
        flexpack.attention(q, k, v, mask, backend="flex")
    with pytest.raises(ValueError, match=r"CUDA only.*float16 or bfloat16"):
        flexpack.attention(q, k, v, mask, backend="varlen")
    with pytest.raises(ValueError, match="document and document_causal masks"):
        flexpack.attention(q, k, v, masks.causal(), backend="varlen")
    with pytest.raises(ValueError, match="backend must be one of"):
        flexpack.attention(q, k, v, mask, backend="flash")


def _bad_inputs():
    S = DOC_IDS.shape[1]
    q = torch.randn(2, 4, S, 8)
    kv2 = torch.randn(2, 2, S, 8)
    kv3 = torch.randn(2, 3, S, 8)
    mask = masks.document(DOC_IDS)
    return [
        ((q, kv2, kv2, mask), {}, ValueError, "pass enable_gqa=True"),
        ((q, kv3, kv3, mask), {"enable_gqa": True}, ValueError, "multiple of the key/value"),
        ((q, kv2[:, :0], kv2[:, :0], mask), {"enable_gqa": True}, ValueError, r"heads \(0\)"),
        ((q[0], q[0], q[0], mask), {}, ValueError, r"must be 4-D \(B, H, S, D\)"),
        ((q, q[:, :, :5], q[:, :, :5], mask), {}, ValueError, "expected k and v of shape"),
        ((q.long(), q.long(), q.long(), mask), {}, TypeError, "floating-point"),
        ((q, q.double(), q, mask), {}, TypeError, "share a dtype"),
        ((q, q, q, DOC_IDS), {}, TypeError, "mask must be a flexpack Mask.*got Tensor"),
        ((q[:, :, :10], q[:, :, :10], q[:, :, :10], mask), {}, ValueError, "sequence length 10"),
        ((q, q, q, flexpack.document_mask(DOC_IDS[:, :10])), {}, ValueError, "sequence length"),
        ((q[:1], q[:1], q[:1], mask), {}, ValueError, "batch size 1"),
        ((q, q, q, mask), {"scale": "0.1"}, TypeError, "scale must be a float"),
        ((q, q, q, masks.document(DOC_IDS.to("meta"))), {}, ValueError, "on meta but q is on cpu"),
    ]


@pytest.mark.parametrize(("args", "kwargs", "error", "match"), _bad_inputs())
def test_bad_input(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        flexpack.attention(*args, **kwargs)


def test_attention_with_q_in_bshd_says_to_transpose():
    # q in (B, S, H, D): the message said to rebuild the mask; the mask was right, q was not.
    d = torch.tensor([[0, 0, 0, 1, 1, 1]])
    m = fm.document(d) & fm.causal()
    q, k, v = (x.transpose(1, 2) for x in _qkv(1, 6, H=2))  # (B, S, H, D)
    for mask in (m, m.block_mask(block_size=2)):
        with pytest.raises(ValueError, match=r"\(B, H, S, D\).*transpose\(1, 2\)"):
            flexpack.attention(q, k, v, mask)


@pytest.mark.parametrize("name", ["scale", "softcap"])
def test_attention_takes_numpy_scalars(name):
    q, k, v = _qkv(1, 4)
    mask = fm.document(torch.tensor([[0, 0, 1, 1]])) & fm.causal()
    want = flexpack.attention(q, k, v, mask, **{name: 0.5})
    got = flexpack.attention(q, k, v, mask, **{name: np.float32(0.5)})
    torch.testing.assert_close(got, want)
    with pytest.raises(TypeError, match=rf"{name} must be a float or None, got 'x'"):
        flexpack.attention(q, k, v, mask, **{name: "x"})


# ----------------------------------------------------------------------------- compiled flex
# Compiling flex_attention on CPU costs seconds: few tests, fixed shapes, one shape shared.

FLEX_B, FLEX_H, FLEX_S, FLEX_D = 2, 2, 200, 16


def _random_layout(seed, S=FLEX_S):
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randint(1, S, (6,), generator=g).sort().values
    doc_ids = torch.bucketize(torch.arange(S), cuts, right=True).to(torch.int32)
    doc_ids[S - 1 - int(torch.randint(0, 20, (1,), generator=g)) :] = -1
    return torch.stack([doc_ids, doc_ids.flip(0).clamp(min=-1)])


@pytest.mark.compile
def test_compiled_flex_matches_reference_without_recompiling_for_new_layouts():
    from torch._dynamo.utils import counters

    q, k, v = (x.detach() for x in make_qkv(FLEX_B, FLEX_H, FLEX_H, FLEX_S, FLEX_D, torch.float32))
    compiles = []
    with torch.no_grad():
        for seed in range(3):
            doc_ids = _random_layout(seed)
            block_mask = flexpack.document_causal_mask(doc_ids)
            out = flexpack.attention(q, k, v, block_mask, backend="flex")
            want = per_document_reference(q, k, v, doc_ids, causal=True)
            assert rel_err(out, want) < 1e-5
            assert (out.transpose(1, 2)[doc_ids < 0] == 0).all()
            compiles.append(counters["stats"]["unique_graphs"])
        # Masks (not BlockMasks) run at the bucket length 256 (one graph), whatever the layout.
        for seed in (3, 6):
            doc_ids = _random_layout(seed)
            mask = masks.document(doc_ids) & masks.causal()
            out = flexpack.attention(q, k, v, mask, backend="flex")
            assert rel_err(out, per_document_reference(q, k, v, doc_ids, causal=True)) < 1e-5
            compiles.append(counters["stats"]["unique_graphs"])
    assert compiles[1:3] == [compiles[0]] * 2, f"recompiled for a new layout: {compiles}"
    assert compiles[4] == compiles[3], f"recompiled for a new layout: {compiles}"

    # A foreign BlockMask (the user's own mask_mod) runs on flex too.
    doc_ids = _random_layout(4)

    def same_doc_but_first_token(b, h, q_idx, kv_idx):
        return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx > 0) & (doc_ids[b, q_idx] >= 0)

    block_mask = create_block_mask(same_doc_but_first_token, FLEX_B, None, FLEX_S, FLEX_S, "cpu")
    assert _choose_path(q, k, v, _mask_spec(block_mask, q), "auto") == "flex"
    out = flexpack.attention(q, k, v, block_mask)
    dense = dense_mask(same_doc_but_first_token, FLEX_B, 1, FLEX_S, FLEX_S)
    want = reference_attention(q.double(), k.double(), v.double(), dense)
    assert rel_err(out, want) < 1e-5


@pytest.mark.compile
def test_flex_under_no_grad_accepts_inputs_that_require_grad():
    # flex_attention rejects CPU inputs with requires_grad even under no_grad (no graph is built
    # there): evaluating with leaf tensors must not crash. Same shape as above: no new compile.
    q, k, v = make_qkv(FLEX_B, FLEX_H, FLEX_H, FLEX_S, FLEX_D, torch.float32)
    doc_ids = _random_layout(5)
    with torch.no_grad():
        out = flexpack.attention(q, k, v, flexpack.document_causal_mask(doc_ids), backend="flex")
    want = per_document_reference(q.detach(), k.detach(), v.detach(), doc_ids, causal=True)
    assert rel_err(out, want) < 1e-5 and not out.requires_grad


@pytest.mark.compile
def test_recompile_limit_raises_instead_of_running_eagerly():
    # With a limit of 1 compiled variant, the second distinct shape (at the latest) must raise
    # rather than fall back to eager flex_attention. Shapes unused elsewhere in the suite.
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1):
        # BlockMasks run at their own length (a Mask would pad both to 128); block size 8 gives
        # a compiled wrapper of its own.
        match = r"recompile_limit=1.*row length S changed.*Fix: .*feed rows"
        with pytest.raises(RecompileLimitError, match=match):
            for S in (40, 48):
                q = torch.randn(1, 1, S, 8)
                mask = masks.document(torch.zeros(1, S, dtype=torch.int32))
                flexpack.attention(q, q, q, mask.block_mask(block_size=8), backend="flex")


# ----------------------------------------------------------------------------- bench/gpu.py
# The GPU benchmark cannot run in CI (no GPU): its --dry-run runs the same code on CPU.


def _load_gpu_bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "gpu.py"
    spec = importlib.util.spec_from_file_location("flexpack_bench_gpu", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_gpu_bench_targets_compare_the_right_numbers():
    gpu = _load_gpu_bench()
    R = gpu.Result
    results = [
        R(8192, "flexpack flex", fwd=1.0, fwd_bwd=3.0),
        R(8192, "flexpack auto", fwd=0.9, fwd_bwd=2.9),
        R(8192, "varlen_attn", fwd=0.9, fwd_bwd=2.8),  # bwd: 1.9 vs flex 2.0
        R(8192, "SDPA + dense mask", note="skipped"),
        R(8192, "SDPA causal (no doc mask)", fwd=0.1, fwd_bwd=0.2),  # not exact: never "best"
    ]
    got = {name: (round(value, 3), ok) for _, name, value, _, ok in gpu.targets(results)}
    assert got == {
        "flex fwd / varlen fwd": (0.9, True),
        "flex bwd / varlen bwd": (0.95, True),
        "auto fwd / best exact": (1.0, True),
        "auto fwd+bwd / best exact": (round(2.8 / 2.9, 3), False),
    }


@pytest.mark.compile
def test_gpu_bench_dry_run_runs_on_cpu(capsys, tmp_path):
    gpu = _load_gpu_bench()
    # its own --out: the default, bench/results/gpu-dry-run.md, is tracked
    assert gpu.main(["--dry-run", "--out", str(tmp_path / "gpu.md")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"Correctness: (\d+)/\1 checks passed", out)
    assert (
        "| 256 | 16 | document_causal | flexpack auto |" in out
        and "| 256 | 16 | document_causal | varlen_attn | — | — | — | — | CUDA only |" in out
    )
    assert "| 256 | 16 | tree | flexpack sdpa (per segment) |" in out
    assert "PASS" not in out and "FAIL" not in out  # CPU timings are not judged
