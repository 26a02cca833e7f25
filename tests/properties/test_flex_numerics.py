"""flex_attention with flexpack BlockMasks against the float64 reference, on CPU.

What flex_attention returns for a fully masked query row (a padding token, or a row of
``~causal()``): exactly 0 (its log-sum-exp is -inf), eager and compiled alike, never NaN;
``reference_attention`` gives the same 0, so the comparison covers those rows too.

Eager flex runs on random layouts and random composed masks. Compiled flex runs at two FIXED
shapes (``dynamic=False``): it compiles once per (shape, mask kind) and is reused across
layouts, so these tests stay within their time budget; automatic-dynamic recompiles on CPU hit a
torch 2.13 CppCompileError with masks that index captured tensors.
"""

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import flex_attention

from flexpack import masks as fm
from flexpack.testing import reference_attention
from flexpack.testing import strategies as fst

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

RTOL = ATOL = 1e-5  # float32 kernel against float64 reference


def qkv(B, Hq, Hkv, S, D, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, S, D, generator=g)
    k = torch.randn(B, Hkv, S, D, generator=g)
    v = torch.randn(B, Hkv, S, D, generator=g)
    return q, k, v


def check(out, q, k, v, mask, *, enable_gqa=False):
    assert not bool(out.isnan().any())
    ref = reference_attention(q.double(), k.double(), v.double(), mask, enable_gqa=enable_gqa)
    torch.testing.assert_close(out.double(), ref, rtol=RTOL, atol=ATOL)
    return ref


# ------------------------------------------------------------------------------------ eager


@settings(max_examples=12)
@given(data=st.data())
def test_eager_flex_matches_reference_on_random_layouts_and_masks(data):
    d = data.draw(
        st.one_of(
            fst.doc_ids(max_seq_len=100, block_size=32, allow_empty_rows=True),
            fst.doc_ids(max_seq_len=100, block_size=32, contiguous=False),
        )
    )
    mask = data.draw(fst.masks(d, max_depth=2))
    block_size = data.draw(st.sampled_from([16, 32, 128]))
    B, S = d.shape
    Hkv, groups = data.draw(st.sampled_from([(2, 1), (1, 2)]))
    q, k, v = qkv(B, Hkv * groups, Hkv, S, 8, seed=data.draw(st.integers(0, 2**16)))
    bm = mask.block_mask(block_size=block_size, Q_LEN=S, KV_LEN=S)
    out = flex_attention(q, k, v, block_mask=bm, enable_gqa=groups > 1)
    check(out, q, k, v, mask, enable_gqa=groups > 1)


def test_eager_flex_gives_zero_on_padding_rows():
    d = torch.tensor([[0, 0, 1, 1, 1, -1, -1, -1], [-1] * 8])
    mask = fm.document(d) & fm.causal()
    q, k, v = qkv(2, 2, 2, 8, 4, seed=0)
    out = flex_attention(q, k, v, block_mask=mask.block_mask(block_size=4))
    ref = check(out, q, k, v, mask)
    assert torch.equal(out[0, :, 5:], torch.zeros_like(out[0, :, 5:]))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(ref[1], torch.zeros_like(ref[1]))


# --------------------------------------------------------------------------------- compiled


@functools.cache
def compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


# Two fixed shapes. S is not a multiple of the block size in either.
SHAPE_A = {"B": 2, "Hq": 2, "Hkv": 2, "S": 200, "D": 16, "block_size": 128}
SHAPE_B = {"B": 1, "Hq": 4, "Hkv": 2, "S": 130, "D": 32, "block_size": 64}


@pytest.mark.compile
@settings(max_examples=4)
@given(
    d=fst.doc_ids(batch_size=SHAPE_A["B"], seq_len=SHAPE_A["S"], allow_empty_rows=True),
    seed=st.integers(0, 2**16),
)
def test_compiled_flex_document_causal_at_a_fixed_shape(d, seed):
    s = SHAPE_A
    mask = fm.document(d) & fm.causal()
    q, k, v = qkv(s["B"], s["Hq"], s["Hkv"], s["S"], s["D"], seed)
    out = compiled_flex()(q, k, v, block_mask=mask.block_mask(block_size=s["block_size"]))
    check(out, q, k, v, mask)


@pytest.mark.compile
def test_compiled_flex_padding_rows_are_zero_not_nan():
    s = SHAPE_A
    S = s["S"]
    d = torch.tensor([[0] * 70 + [1] * 60 + [-1] * (S - 130), [-1] * S])
    mask = fm.document(d) & fm.causal()
    q, k, v = qkv(s["B"], s["Hq"], s["Hkv"], S, s["D"], seed=1)
    out = compiled_flex()(q, k, v, block_mask=mask.block_mask(block_size=s["block_size"]))
    check(out, q, k, v, mask)
    assert torch.equal(out[0, :, 130:], torch.zeros_like(out[0, :, 130:]))
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.compile
@settings(max_examples=4)
@given(data=st.data())
def test_compiled_flex_prefix_lm_with_gqa_at_a_fixed_shape(data):
    s = SHAPE_B
    d = data.draw(fst.doc_ids(batch_size=s["B"], seq_len=s["S"], max_docs=6))
    mask = fm.prefix_lm(d, data.draw(fst.prefix_lengths(d)))
    q, k, v = qkv(s["B"], s["Hq"], s["Hkv"], s["S"], s["D"], data.draw(st.integers(0, 2**16)))
    bm = mask.block_mask(block_size=s["block_size"])
    out = compiled_flex()(q, k, v, block_mask=bm, enable_gqa=True)
    check(out, q, k, v, mask, enable_gqa=True)
