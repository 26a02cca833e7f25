"""flexpack/_compat: the torch features it probes, and each fallback against the native path.

Every torch release runs both halves: the fallbacks are forced here (monkeypatched probes, a fake
``varlen_attn`` with torch 2.11's signature), so CI's torch 2.13 leg tests the 2.11 code paths
too, and the torch 2.11 leg runs them for real. Compiles use dynamo's ``CompileCounter`` backend
(no inductor): milliseconds.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounter
from torch.nn.attention.flex_attention import flex_attention

from flexpack import _attention_flex, _compat, masks
from flexpack._attention_flex import RecompileLimitError
from flexpack.testing import references
from flexpack.testing import strategies as fst


@pytest.fixture(params=["native", "fallback"])
def isolation(request, monkeypatch):
    """Runs a test with torch.compile's isolate_recompiles (where torch has it) and without."""
    if request.param == "native":
        if not _compat.compile_isolates_recompiles():
            pytest.skip("this torch.compile has no isolate_recompiles")
    else:
        monkeypatch.setattr(_compat, "compile_isolates_recompiles", lambda: False)
    _attention_flex.compiled_flex_attention.cache_clear()
    yield request.param
    _attention_flex.compiled_flex_attention.cache_clear()


# ----------------------------------------------------------------------------- fresh code


@settings(max_examples=25, deadline=None)
@given(x=st.integers(-100, 100), y=st.one_of(st.none(), st.integers(-5, 5)))
def test_fresh_code_copy_behaves_as_the_original(x, y):
    def f(a, b=3, *, c=2):
        return a * b + c

    g = _compat.fresh_code_copy(f)
    kw = {} if y is None else {"c": y}
    assert g(x, **kw) == f(x, **kw)
    assert g.__code__ is not f.__code__ and g.__code__ == f.__code__
    assert (g.__name__, g.__qualname__, g.__module__) == (f.__name__, f.__qualname__, f.__module__)
    assert g.__kwdefaults__ == f.__kwdefaults__ and g.__kwdefaults__ is not f.__kwdefaults__


def test_fresh_code_copy_of_flex_attention_keeps_its_globals_and_defaults():
    g = _compat.fresh_code_copy(flex_attention)
    assert g.__globals__ is flex_attention.__globals__
    assert g.__defaults__ == flex_attention.__defaults__
    assert g.__kwdefaults__ == flex_attention.__kwdefaults__
    assert not hasattr(g, "__wrapped__")


# ----------------------------------------------------------------------------- recompile counts


def _shape_call(fn, S: int):
    q = torch.randn(1, 1, S, 16)
    bm = masks.document(torch.zeros(1, S, dtype=torch.int32)).block_mask(block_size=16)
    return fn(q, q, q, block_mask=bm)


def test_isolated_wrappers_count_their_own_recompiles(isolation):
    # Two wrappers of one function: each has a limit of 2 shapes of its own. Sharing one cache
    # (plain torch.compile) would raise on b's first shape, a's two having used the limit up.
    a_count, b_count = CompileCounter(), CompileCounter()
    a = _compat.compile_isolated(flex_attention, backend=a_count, fullgraph=True, dynamic=False)
    b = _compat.compile_isolated(flex_attention, backend=b_count, fullgraph=True, dynamic=False)
    with (
        torch.no_grad(),
        torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True),
    ):
        _shape_call(a, 32)
        _shape_call(a, 48)
        _shape_call(b, 32)
        _shape_call(b, 48)
        _shape_call(a, 32)  # cached: no compile
        assert (a_count.frame_count, b_count.frame_count) == (2, 2)
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
            _shape_call(a, 64)


def test_each_flex_configuration_counts_apart_and_the_limit_names_the_guard(isolation, monkeypatch):
    # The same check as test_cuda_dispatch's, with and without isolate_recompiles.
    cnt = CompileCounter()
    monkeypatch.setattr(_attention_flex, "_BACKEND", cnt)

    def call(S, dtype, **kw):
        q = torch.randn(1, 2, S, 16, dtype=dtype)
        bm = masks.document(torch.zeros(1, S, dtype=torch.int32)).block_mask(block_size=16)
        return _attention_flex.flex(q, q, q, bm, scale=None, enable_gqa=False, **kw)

    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=2):
        call(32, torch.float32)
        call(48, torch.float32)
        call(32, torch.bfloat16)
        call(32, torch.float32, softcap=20.0)
        assert cnt.frame_count == 4
        with pytest.raises(RecompileLimitError, match=r"recompile_limit=2") as err:
            call(64, torch.float32)
    assert "guard that failed" in str(err.value) and "size" in str(err.value)


def test_compiled_flex_matches_the_reference_either_way(isolation, monkeypatch):
    monkeypatch.setattr(_attention_flex, "_BACKEND", CompileCounter())
    torch.manual_seed(0)
    d = torch.tensor([[0] * 20 + [1] * 30 + [-1] * 14])
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    m = masks.document(d) & masks.causal()
    with torch.no_grad():
        out = _attention_flex.flex(
            q, k, v, m.block_mask(block_size=16), scale=None, enable_gqa=False
        )
    want = references.reference_attention(q, k, v, references.dense_mask(m))
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- varlen GQA


def _per_document_sdpa(q, k, v, cu_q, scale, window_size, enable_gqa):
    out = torch.empty_like(q)
    for a, b in itertools.pairwise(cu_q.tolist()):
        x = [t[a:b].transpose(0, 1) for t in (q, k, v)]  # (H, L, D)
        out[a:b] = F.scaled_dot_product_attention(
            *x, is_causal=window_size == (-1, 0), scale=scale, enable_gqa=enable_gqa
        ).transpose(0, 1)
    return out


def varlen_attn_2_11(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
    window_size=(-1, -1),
):  # fmt: skip
    """torch 2.11's varlen_attn signature, on CPU: FlashAttention's varlen kernel takes k/v with
    fewer heads (Hkv dividing Hq) and groups them, query head h to kv head h // (Hq // Hkv)."""
    Hq, Hkv = query.shape[1], key.shape[1]
    if Hq % Hkv:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")
    return _per_document_sdpa(query, key, value, cu_seq_q, scale, window_size, Hq != Hkv)


def varlen_attn_2_13(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
):  # fmt: skip
    """torch 2.13's varlen_attn signature, on CPU: heads must match unless enable_gqa."""
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError("Try setting enable_gqa=True for GQA.")
    return _per_document_sdpa(query, key, value, cu_seq_q, scale, window_size, enable_gqa)


def test_the_probe_reads_the_signature():
    assert not _compat.varlen_takes_enable_gqa(varlen_attn_2_11)
    assert _compat.varlen_takes_enable_gqa(varlen_attn_2_13)
    real = _compat.varlen_attn_function()
    if real is not None:  # torch >= 2.10
        import inspect

        want = "enable_gqa" in inspect.signature(real).parameters
        assert _compat.varlen_takes_enable_gqa(real) == want


@settings(max_examples=20, deadline=None)
@given(
    d=fst.doc_ids(max_batch_size=2, max_seq_len=40, contiguous=False, allow_empty_rows=True),
    groups=st.sampled_from([1, 2, 4]),
    causal=st.booleans(),
    signature=st.sampled_from(["2.11", "2.13"]),
)
def test_varlen_gqa_matches_the_reference_with_either_signature(d, groups, causal, signature):
    import torch.nn.attention.varlen as varlen_module

    fake = varlen_attn_2_11 if signature == "2.11" else varlen_attn_2_13
    B, S = d.shape
    Hkv = 2
    g = torch.Generator().manual_seed(S)
    q = torch.randn(B, Hkv * groups, S, 8, generator=g)
    k, v = (torch.randn(B, Hkv, S, 8, generator=g) for _ in range(2))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(varlen_module, "varlen_attn", fake)
        out = _attention_flex.varlen(
            q, k, v, d.clone(), causal=causal, scale=None, enable_gqa=groups > 1
        )
    m = masks.document(d) & masks.causal() if causal else masks.document(d)
    want = references.reference_attention(q, k, v, references.dense_mask(m), enable_gqa=groups > 1)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- describe


def test_describe_names_torch_triton_and_each_fallback(monkeypatch):
    lines = _compat.describe()
    assert lines[0].startswith(f"torch {torch.__version__}") and "triton" in lines[0]
    assert len(lines) == 3
    monkeypatch.setattr(_compat, "compile_isolates_recompiles", lambda: False)
    monkeypatch.setattr(_compat, "varlen_attn_function", lambda: varlen_attn_2_11)
    text = "\n".join(_compat.describe())
    assert "no isolate_recompiles: fallback" in text and "no enable_gqa: fallback" in text
    monkeypatch.setattr(_compat, "compile_isolates_recompiles", lambda: True)
    monkeypatch.setattr(_compat, "varlen_attn_function", lambda: varlen_attn_2_13)
    text = "\n".join(_compat.describe())
    assert "isolate_recompiles=True): native" in text and "enable_gqa=): native" in text
