"""CUDA decisions, tested on CPU: compile counts, mask devices, dispatch with the device faked.

No GPU runs these tests. What they check is plain Python: which path a call takes, which guard a
recompile names, which tensors a mask reads and where, and how many host syncs a call makes.
Compiles use dynamo's ``CompileCounter`` backend (no inductor), so they take milliseconds.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from torch._dynamo.testing import CompileCounter
from torch.nn.attention.flex_attention import flex_attention

from flexpack import _attention_flex, masks
from flexpack._attention_flex import RecompileLimitError
from flexpack._attention_sdpa import document_groups
from flexpack.layout import PackedLayout
from flexpack.testing import references
from flexpack.testing import strategies as fst

# ----------------------------------------------------------------------------- mask parameters


def _counted():
    cnt = CompileCounter()
    fn = torch.compile(
        flex_attention, backend=cnt, fullgraph=True, dynamic=False, isolate_recompiles=True
    )
    return cnt, fn


def test_window_change_does_not_recompile() -> None:
    # The window is a 0-d tensor the mask_mod reads: one graph for every window at one shape.
    torch.manual_seed(0)
    d = torch.tensor([[0] * 40 + [1] * 50 + [-1] * 6])
    q, k, v = (torch.randn(1, 2, 96, 16) for _ in range(3))
    cnt, fn = _counted()
    for window in (1, 5, 12, 33):
        m = masks.document(d) & masks.causal() & masks.sliding_window(window)
        out = fn(q, k, v, block_mask=m.block_mask(block_size=32))
        ref = references.reference_attention(q, k, v, references.dense_mask(m))
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert cnt.frame_count == 1


def test_python_int_in_a_mask_mod_recompiles() -> None:
    # The counter sees recompiles: a window baked in as a Python int recompiles per value.
    q = torch.randn(1, 1, 64, 16)
    cnt, fn = _counted()
    from torch.nn.attention.flex_attention import create_block_mask

    for window in (1, 5):

        def mod(b, h, qi, kv, w=window):
            return qi - kv <= w

        fn(q, q, q, block_mask=create_block_mask(mod, 1, 1, 64, 64, device="cpu"))
    assert cnt.frame_count == 2


def test_mask_to_moves_every_tensor_the_mask_mod_reads() -> None:
    d = torch.tensor([[0, 0, 1, 1, -1]])
    pl = torch.tensor([[1, 2]])
    m = (masks.document(d) & masks.causal() & masks.sliding_window(2)) | masks.prefix_lm(d, pl)
    assert m.to("cpu") is m
    moved = m.to("meta")
    assert moved.kind == m.kind and moved.name == m.name
    assert {t.device.type for t in moved._tensors()} == {"meta"}
    assert len(moved._tensors()) == len(m._tensors()) == 4
    assert m.to("meta") is moved  # cached: one copy per device


def test_window_follows_the_doc_ids_device() -> None:
    d = torch.zeros(1, 8, dtype=torch.int32, device="meta")
    m = masks.document(d) & masks.sliding_window(3)
    assert {t.device.type for t in m._tensors()} == {"meta"}
    # Without doc ids the window goes to the device the BlockMask is built for.
    w = masks.sliding_window(3)
    assert w._window_t.device.type == "cpu" and w.window == 3


# ----------------------------------------------------------------------------- compile caches


@pytest.fixture
def counted_flex(monkeypatch):
    """Compiled wrappers on dynamo's CompileCounter backend (no inductor), fresh per test."""
    cnt = CompileCounter()
    monkeypatch.setattr(_attention_flex, "_BACKEND", cnt)
    _attention_flex.compiled_flex_attention.cache_clear()
    yield cnt
    _attention_flex.compiled_flex_attention.cache_clear()


def _flex_call(S: int, dtype: torch.dtype, **kw):
    q = torch.randn(1, 2, S, 16, dtype=dtype)
    bm = masks.document(torch.zeros(1, S, dtype=torch.int32)).block_mask(block_size=16)
    return _attention_flex.flex(q, q, q, bm, scale=None, enable_gqa=False, **kw)


def test_each_configuration_has_its_own_recompile_count(counted_flex):
    # Shared cache (before): two fp32 shapes used up a limit of 2 and a bf16 call then raised,
    # blaming shapes. Isolated wrappers: dtype, grad, scale and softcap each count apart.
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=2):
        _flex_call(32, torch.float32)
        _flex_call(48, torch.float32)
        _flex_call(32, torch.bfloat16)
        _flex_call(32, torch.float32, softcap=20.0)
        _flex_call(32, torch.float32, softcap=30.0)  # the cap is a tensor: no recompile
        assert counted_flex.frame_count == 4
        with pytest.raises(RecompileLimitError, match=r"recompile_limit=2") as err:
            _flex_call(64, torch.float32)
    # The message names the guard dynamo reported (a size of q), not a guess.
    assert "guard that failed" in str(err.value) and "size" in str(err.value)


def test_recompile_message_without_a_reason_says_how_to_find_it():
    q = torch.zeros(1, 1, 16, 8)
    bm = masks.causal().block_mask(block_size=16, Q_LEN=16, KV_LEN=16)
    msg = _attention_flex.recompile_limit_message(None, q, q, bm)
    assert "TORCH_LOGS=recompiles" in msg and "(1, 1, 16, 8)" in msg and "Fix:" in msg


# ----------------------------------------------------------------------------- head dim < 16


def test_small_head_dims_are_padded_to_16_on_cuda_only():
    assert _attention_flex.flex_head_dim(torch.device("cuda"), 8) == 16
    assert _attention_flex.flex_head_dim(torch.device("cuda"), 16) == 16
    assert _attention_flex.flex_head_dim(torch.device("cuda"), 24) == 24
    assert _attention_flex.flex_head_dim(torch.device("cpu"), 8) == 8


def test_padded_head_dim_is_exact(counted_flex, monkeypatch):
    # Run the CUDA padding on CPU: zero channels change no score; the scale stays 1/sqrt(8).
    monkeypatch.setattr(_attention_flex, "flex_head_dim", lambda device, d: 16)
    torch.manual_seed(0)
    d = torch.tensor([[0] * 20 + [1] * 10 + [-1] * 2])
    q, k, v = (torch.randn(1, 2, 32, 8) for _ in range(3))
    m = masks.document(d) & masks.causal()
    with torch.no_grad():
        out = _attention_flex.flex(
            q, k, v, m.block_mask(block_size=16), scale=None, enable_gqa=False
        )
    assert out.shape == (1, 2, 32, 8)
    want = references.reference_attention(q, k, v, references.dense_mask(m))
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- varlen plans


@settings(max_examples=40, deadline=None)
@given(d=fst.doc_ids(max_batch_size=3, max_seq_len=40, contiguous=False, allow_empty_rows=True))
def test_varlen_plan_matches_document_groups(d):
    plan = _attention_flex._varlen_plan(d)
    groups = document_groups(d)
    assert torch.equal(plan.order, groups.order)
    assert torch.equal(plan.cu_seqlens, groups.cu_seqlens)
    assert plan.max_seqlen == (int(groups.seqlens.max()) if groups.seqlens.numel() else 0)
    T = groups.order.numel()
    assert plan.identity == (T == d.numel() and torch.equal(groups.order, torch.arange(T)))


@settings(max_examples=40, deadline=None)
@given(d=fst.doc_ids(max_batch_size=3, max_seq_len=40, allow_empty_rows=True))
def test_layout_plan_equals_the_computed_plan(d):
    layout = PackedLayout.from_doc_ids(d)
    assert _attention_flex.layout_varlen_plan(layout) is None  # views not computed: no syncs
    _ = layout.indices, layout.cu_seqlens, layout.max_seqlen  # what the packer fills in
    plan, want = _attention_flex.layout_varlen_plan(layout), _attention_flex._varlen_plan(d)
    assert torch.equal(plan.order, want.order) and torch.equal(plan.cu_seqlens, want.cu_seqlens)
    assert (plan.max_seqlen, plan.identity) == (want.max_seqlen, want.identity)
