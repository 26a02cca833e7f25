"""CUDA decisions, tested on CPU: compile counts, mask devices, dispatch with the device faked.

No GPU runs these tests. What they check is plain Python: which path a call takes, which guard a
recompile names, which tensors a mask reads and where, and how many host syncs a call makes.
Compiles use dynamo's ``CompileCounter`` backend (no inductor), so they take milliseconds.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from torch._dynamo.testing import CompileCounter
from torch.nn.attention.flex_attention import flex_attention
from torch.utils._python_dispatch import TorchDispatchMode

from flexpack import _attention_flex, _compat, masks
from flexpack._attention_flex import RecompileLimitError
from flexpack._attention_sdpa import document_groups
from flexpack.attention import _choose_path, _flex_block_mask, _kv_for_causal_sdpa, _mask_spec
from flexpack.layout import PackedLayout
from flexpack.masks import mask_of
from flexpack.testing import references
from flexpack.testing import strategies as fst

aten = torch.ops.aten

# ----------------------------------------------------------------------------- mask parameters


def _counted():
    cnt = CompileCounter()
    # A dynamo cache of its own: counts only this test's compiles (isolate_recompiles on torch
    # 2.13, a fresh code object on 2.11 and 2.12).
    fn = _compat.compile_isolated(flex_attention, backend=cnt, fullgraph=True, dynamic=False)
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

    def window_mod(w: int):
        # A closure, not a default argument: torch 2.11's dynamo does not guard a mask_mod's
        # __defaults__ (a new default reuses the old graph, silently wrong); 2.13's does.
        def mod(b, h, qi, kv):
            return qi - kv <= w

        return mod

    for window in (1, 5):
        fn(q, q, q, block_mask=create_block_mask(window_mod(window), 1, 1, 64, 64, device="cpu"))
    assert cnt.frame_count == 2


def test_mask_to_moves_a_tree_mask() -> None:
    seg = torch.tensor([[0, 0, 1, 1, 2, -1]])
    m = masks.tree(seg, torch.tensor([-1, 0, 0])) & masks.sliding_window(2)
    moved = m.to("meta")
    assert moved.children[0].kind == "tree" and len(moved._tensors()) == 3
    assert {t.device.type for t in moved._tensors()} == {"meta"}


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


# ----------------------------------------------------------------------------- host syncs


class SyncCounter(TorchDispatchMode):
    """Counts the ops that make the host wait for the device on CUDA, seen on CPU.

    ``item``/``bool``/``int`` (``_local_scalar_dense``), ``nonzero``, ``masked_select``, boolean
    indexing, ``unique``, ``repeat_interleave`` without ``output_size`` and ``tolist``. On a GPU,
    ``torch.cuda.set_sync_debug_mode("error")`` checks the same thing for real.
    """

    SYNCING: ClassVar[set] = {
        aten._local_scalar_dense.default,
        aten.nonzero.default,
        aten.masked_select.default,
        aten._unique2.default,
        aten.unique_consecutive.default,
        aten.unique_dim.default,
    }

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []
        self.paused = False
        self.active = False

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused:
            bool_index = func is aten.index.Tensor and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
            )
            unsized = func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None
            if func in self.SYNCING or bool_index or unsized:
                self.syncs.append(str(func))
        return func(*args, **kwargs)


@pytest.fixture
def sync_counter(monkeypatch):
    counter = SyncCounter()
    real_tolist = torch.Tensor.tolist

    def tolist(t):
        if counter.active and not counter.paused:
            counter.syncs.append("tolist")
        return real_tolist(t)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    return counter


def test_varlen_plan_syncs_once_and_a_layout_plan_never(sync_counter):
    layout = PackedLayout.from_seqlens([[3, 2, 4], [5, 1]], max_len=10)  # views cached
    with sync_counter:
        _attention_flex._varlen_plan(layout.doc_ids)
    assert sync_counter.syncs == ["tolist"]
    sync_counter.syncs.clear()
    with sync_counter:
        plan = _attention_flex.layout_varlen_plan(layout)
    assert sync_counter.syncs == [] and plan.max_seqlen == 5


def _fake_varlen_attn(counter: SyncCounter):
    """torch's varlen_attn (CUDA only) as per-document SDPA on CPU, uncounted."""

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size, enable_gqa):
        counter.paused = True
        try:
            out = torch.empty_like(q)
            bounds = cu_q.tolist()
            for a, b in itertools.pairwise(bounds):
                x = [t[a:b].transpose(0, 1) for t in (q, k, v)]  # (H, L, D)
                out[a:b] = F.scaled_dot_product_attention(
                    *x, is_causal=window_size == (-1, 0), scale=scale, enable_gqa=enable_gqa
                ).transpose(0, 1)
            return out
        finally:
            counter.paused = False

    return varlen_attn


def test_gpt_forward_on_the_varlen_path_syncs_at_most_once(sync_counter, monkeypatch):
    import torch.nn.attention.varlen as varlen_module

    from flexpack.batch import pack_sequences
    from flexpack.models import GPT, GPTConfig

    monkeypatch.setattr(varlen_module, "varlen_attn", _fake_varlen_attn(sync_counter))
    attention_module = sys.modules["flexpack.attention"]  # the package exports the function
    monkeypatch.setattr(attention_module, "_choose_path", lambda *a, **k: "varlen")
    torch.manual_seed(0)
    docs = [torch.randint(0, 256, (n,)) for n in (5, 9, 3, 7, 4)]
    batch = pack_sequences(docs, max_len=16)
    model = GPT(GPTConfig(n_layer=3, n_embd=32)).eval()
    with torch.no_grad():
        want = model(batch.input_ids, position_ids=batch.position_ids, doc_ids=batch.doc_ids)
        doc_ids = batch.doc_ids.clone()  # a fresh tensor: no cached plan
        with sync_counter:
            by_ids = model(batch.input_ids, doc_ids=doc_ids)
        assert sync_counter.syncs == ["tolist"]  # the plan, on the first layer only
        sync_counter.syncs.clear()
        with sync_counter:
            by_layout = model(batch.input_ids, layout=batch.layout)
        assert sync_counter.syncs == []  # the packer's host-side plan: no sync at all
    torch.testing.assert_close(by_ids, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(by_layout, want, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- dispatch, faked


def _fake(dtype=torch.bfloat16, D=64, H=4, device="cuda"):
    """What _choose_path reads of a tensor, on a device this machine does not have."""
    return SimpleNamespace(
        device=torch.device(device), dtype=dtype, requires_grad=True, shape=(1, H, 32, D)
    )


DOC = torch.tensor([[0] * 12 + [1] * 16 + [-1] * 4])


@pytest.mark.parametrize(
    ("D", "path"),
    [(64, "varlen"), (8, "varlen"), (256, "varlen"), (12, "flex"), (264, "sdpa_document")],
)
def test_varlen_only_for_head_dims_flash_attention_takes(monkeypatch, D, path):
    monkeypatch.setattr(_attention_flex, "varlen_available", lambda device: True)
    spec = _mask_spec(masks.document(DOC) & masks.causal(), torch.empty(1, 4, 32, D))
    q = _fake(D=D)
    assert _choose_path(q, q, q, spec, "auto") == path  # above 256: past flex's kernels too
    if path != "varlen":
        with pytest.raises(ValueError, match=f"multiples of 8 up to 256 \\(q has {D}\\)"):
            _choose_path(q, q, q, spec, "varlen")


def test_fp32_gqa_causal_sdpa_on_cuda_repeats_kv():
    k, v = torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16)
    k2, v2, gqa = _kv_for_causal_sdpa(_fake(torch.float32, D=16, H=6), k, v, True)
    assert not gqa and k2.shape == v2.shape == (1, 6, 32, 16)
    assert torch.equal(k2[:, 3], k[:, 1]) and torch.equal(v2[:, 2], v[:, 0])  # head h -> h // 3
    for q in (_fake(torch.bfloat16, D=16, H=6), _fake(torch.float32, D=16, H=6, device="cpu")):
        assert _kv_for_causal_sdpa(q, k, v, True) == (k, v, True)  # flash / CPU take GQA


def test_flex_block_masks_on_cuda_are_multiples_of_128():
    m = masks.document(torch.tensor([[0] * 100 + [1] * 150 + [-1] * 6])) & masks.causal()
    cuda = torch.device("cuda")
    q = torch.empty(1, 1, 256, 16)
    small = _mask_spec(m.block_mask(block_size=64), q)
    rebuilt = _flex_block_mask(small, 256, cuda)
    assert rebuilt.BLOCK_SIZE == (128, 128) and mask_of(rebuilt).kind == "document_causal"
    same = references.dense_mask(rebuilt)
    assert torch.equal(same, references.dense_mask(m))
    assert _flex_block_mask(small, 256, torch.device("cpu")).BLOCK_SIZE == (64, 64)
    big = _mask_spec(m.block_mask(block_size=256), q)
    assert _flex_block_mask(big, 256, cuda) is big.block_mask
    from torch.nn.attention.flex_attention import create_block_mask

    foreign = create_block_mask(lambda b, h, qi, kv: qi >= kv, 1, 1, 256, 256, "cpu", 64)
    with pytest.raises(ValueError, match=r"BLOCK_SIZE=\(64, 64\).*BLOCK_SIZE=128"):
        _flex_block_mask(_mask_spec(foreign, q), 256, cuda)


def test_a_mask_description_becomes_one_block_mask_per_forward():
    spec = _mask_spec(masks.document(DOC) & masks.sliding_window(5), torch.empty(1, 1, 32, 16))
    first = _flex_block_mask(spec, 32, torch.device("cpu"))
    assert _flex_block_mask(spec, 32, torch.device("cpu")) is first  # the next layers
    spec.mask.doc_ids[0, -1] = 1  # the mask's own ids edited in place: refused, never stale
    with pytest.raises(ValueError, match="modified in place"):
        _flex_block_mask(spec, 32, torch.device("cpu"))


def test_a_block_mask_moved_with_to_reads_its_tensors_on_the_new_device():
    m = masks.document(DOC) & masks.causal() & masks.sliding_window(3)
    moved = m.block_mask(block_size=16).to("meta")  # BlockMask.to: tables only
    spec = _mask_spec(moved, torch.empty(1, 1, 32, 16, device="meta"))
    assert {t.device.type for t in mask_of(spec.block_mask)._tensors()} == {"meta"}
    assert spec.block_mask.kv_indices is moved.kv_indices  # no copy of the tables


def test_a_block_mask_on_another_device_says_how_to_rebuild_it():
    bm = (masks.document(DOC) & masks.causal()).block_mask(block_size=16)
    with pytest.raises(ValueError, match=r"mask_of\(block_mask\)\.to\('meta'\)\.block_mask\(\)"):
        _mask_spec(bm, torch.empty(1, 1, 32, 16, device="meta"))


# ----------------------------------------------------------------------------- bench/gpu.py


def _gpu_bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "gpu.py"
    spec = importlib.util.spec_from_file_location("flexpack_bench_gpu_cuda", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_gpu_bench_survives_a_failing_method_and_reports_each_row(monkeypatch):
    gpu = _gpu_bench()
    real = gpu.flexpack.attention

    def attention(*args, backend="auto", **kw):
        if backend == "flex":
            raise RuntimeError("Q and KV block size must be divisible by BLOCK_M and BLOCK_N")
        return real(*args, backend=backend, **kw)

    monkeypatch.setattr(gpu.flexpack, "attention", attention)
    monkeypatch.setattr(gpu, "DENSE_MAX_S", 128)  # S=256 counts as "above 32K" here
    seen, flops = [], {}
    results, _ = gpu.speed(
        torch.device("cpu"), 256, H=1, D=16, median=32, dry_run=True, flops=flops,
        on_result=seen.append,
    )  # fmt: skip
    assert [r.method for r in seen] == [r.method for r in results]  # reported as they finish
    by = {r.method: r for r in results}
    assert by["flexpack flex"].note.startswith("failed: RuntimeError: Q and KV block size")
    assert by["flexpack auto"].reps >= 2 and by["flexpack auto"].fwd > 0  # the others ran
    assert by["SDPA + dense mask"].note.startswith("skipped: S > 0K")
    assert "SDPA backend: " in by["SDPA causal (no doc mask)"].note
    report = gpu.markdown(results, flops, gpu.Checks(), "CPU", [])
    assert "| 256 | 16 | document_causal | flexpack flex | — | — | — | — | failed: " in report
    assert gpu.targets(results[:1]) == []  # partial rows: no KeyError


def test_sdpa_backend_names_the_kernel():
    gpu = _gpu_bench()
    q = torch.randn(1, 2, 16, 8)
    assert gpu.sdpa_backend(lambda: F.scaled_dot_product_attention(q, q, q)) == "flash (CPU)"
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        assert gpu.sdpa_backend(lambda: F.scaled_dot_product_attention(q, q, q)) == "math"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpt_forward_syncs_on_cuda():  # pragma: no cover - runs where a GPU exists
    import warnings

    from flexpack.batch import pack_sequences
    from flexpack.models import GPT, GPTConfig

    torch.manual_seed(0)
    docs = [torch.randint(0, 256, (n,)) for n in (50, 90, 30, 70, 40)]
    batch = pack_sequences(docs, max_len=128).to("cuda")
    cfg = GPTConfig(n_layer=3, n_head=4, n_kv_head=2, n_embd=256)  # D=64: varlen in bf16
    model = GPT(cfg).to("cuda", torch.bfloat16).eval()

    def syncs(**kw) -> int:
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen, torch.no_grad():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                model(batch.input_ids, **kw)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return sum("synchroniz" in str(w.message) for w in seen)

    assert syncs(doc_ids=batch.doc_ids.clone()) <= 1  # the varlen plan, first layer only
    assert syncs(layout=batch.layout) == 0  # the packer's host-side plan


def test_mask_to_sees_in_place_edits():
    d = torch.tensor([[0, 0, 1, 1]])
    m = masks.document(d)
    first = m.to("meta")
    assert m.to("meta") is first
    d[0, 0] = 1  # the caller's tensor: the mask keeps its own copy, so nothing changes
    assert m.to("meta") is first
    m.doc_ids[0, 0] = 1  # the mask's own copy edited in place: refused, never stale
    with pytest.raises(ValueError, match="modified in place"):
        m.to("meta")


# ----------------------------------------------------------------------- recompiles (issue 17)


def _star_tree(S: int, n: int, rows: int = 1):
    """Rows of one prompt and n - 1 completions (n segments), then 3 padding tokens."""
    prompt = S - 3 - 2 * (n - 1)
    row = [0] * prompt + [s for s in range(1, n) for _ in range(2)] + [-1] * 3
    seg = torch.tensor([row] * rows)
    parents = torch.tensor([[-1] + [0] * (n - 1)] * rows)
    return masks.tree(seg, parents)


def test_tree_masks_of_1_to_16_segments_at_one_length_compile_once(counted_flex):
    # The tables the mask_mod reads are (B, S + 1) whatever the segment count: one graph.
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    with torch.no_grad():
        for n in range(1, 17):
            m = _star_tree(64, n)
            out = _attention_flex.flex(
                q, k, v, m.block_mask(block_size=16), scale=None, enable_gqa=False
            )
            if n in (1, 7, 16):
                ref = references.reference_attention(q, k, v, references.dense_mask(m))
                torch.testing.assert_close(out, ref.float(), atol=2e-5, rtol=1e-4)
    assert counted_flex.frame_count == 1


def test_trees_on_cpu_without_grad_compile_nothing(counted_flex):
    # The reference / old-policy pass of an RL step: new row and segment counts every step.
    import flexpack

    torch.manual_seed(0)
    with torch.no_grad():
        for rows, n in itertools.product((1, 3, 5), (2, 9, 12)):
            m = _star_tree(48, n, rows)
            q, k, v = (torch.randn(rows, 2, 48, 16) for _ in range(3))
            out = flexpack.attention(q, k, v, m)
            ref = references.reference_attention(q, k, v, references.dense_mask(m))
            torch.testing.assert_close(out, ref.float(), atol=2e-5, rtol=1e-4)
    assert counted_flex.frame_count == 0


def test_twelve_row_lengths_compile_one_graph_per_bucket(counted_flex):
    # DataCollatorWithFlattening-style rows of a new length every batch, on the flex path.
    import flexpack
    from flexpack.attention import flex_row_length

    torch.manual_seed(0)
    lengths = [37, 64, 100, 128, 129, 150, 200, 256, 300, 333, 400, 500]
    with torch.no_grad():
        for S in lengths:
            d = torch.zeros(1, S, dtype=torch.long)
            d[:, S // 3 :] = 1
            m = masks.document(d) & masks.causal() & masks.sliding_window(8)
            q, k, v = (torch.randn(1, 2, S, 16) for _ in range(3))
            out = flexpack.attention(q, k, v, m, backend="flex")
            if S in (37, 300):
                ref = references.reference_attention(q, k, v, references.dense_mask(m))
                torch.testing.assert_close(out, ref.float(), atol=2e-5, rtol=1e-4)
    buckets = {flex_row_length(S) for S in lengths}
    assert buckets == {128, 256, 512}
    assert counted_flex.frame_count == len(buckets)


def test_recompile_hint_names_a_row_count_change(counted_flex):
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1):
        for B in (1, 2):
            d = torch.zeros(B, 32, dtype=torch.int32)
            q = torch.randn(B, 2, 32, 16)
            bm = masks.document(d).block_mask(block_size=16)
            if B == 1:
                _attention_flex.flex(q, q, q, bm, scale=None, enable_gqa=False)
                continue
            with pytest.raises(RecompileLimitError) as err:
                _attention_flex.flex(q, q, q, bm, scale=None, enable_gqa=False)
    msg = str(err.value)
    assert "size mismatch at index 0" in msg and "The number of rows B changed" in msg
    assert "feed rows of a fixed length" not in msg  # the hint for S, which did not change


def test_float64_and_wide_heads_on_cuda_leave_flex():
    spec = _mask_spec(masks.document(DOC) & masks.sliding_window(4), torch.empty(1, 4, 32, 64))
    for q in (_fake(torch.float64, D=64), _fake(torch.bfloat16, D=320)):
        assert _choose_path(q, q, q, spec, "auto") == "sdpa_document_masked"
        with pytest.raises(ValueError, match="backend='flex' cannot run"):
            _choose_path(q, q, q, spec, "flex")


# ----------------------------------------------------------------------------- (B, S) buckets


def _random_shapes(n: int, seed: int, max_rows: int = 6, max_len: int = 256):
    g = torch.Generator().manual_seed(seed)
    B = torch.randint(1, max_rows + 1, (n,), generator=g).tolist()
    S = torch.randint(20, max_len + 1, (n,), generator=g).tolist()
    return list(zip(B, S, strict=True))


def _buckets(shapes) -> set[tuple[int, int]]:
    from flexpack.attention import flex_row_length

    return {(_attention_flex.flex_batch_rows(B), flex_row_length(S)) for B, S in shapes}


def test_random_batch_shapes_compile_one_graph_per_bucket(counted_flex):
    # Rows and lengths both vary (dynamic batching, a last short batch): one graph per (B, S)
    # bucket, each in a wrapper of its own, so a limit of 1 recompile is never reached.
    import flexpack

    shapes = _random_shapes(20, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1):
        for i, (B, S) in enumerate(shapes):
            d = torch.randint(0, 4, (B, S), generator=g).sort(dim=1).values
            d[:, S - S // 5 :] = -1
            m = masks.document(d) & masks.causal()
            q, k, v = (torch.randn(B, 2, S, 16, generator=g) for _ in range(3))
            out = flexpack.attention(q, k, v, m, backend="flex")
            assert out.shape == q.shape
            if i < 3:
                ref = references.reference_attention(q, k, v, references.dense_mask(m))
                torch.testing.assert_close(out, ref.float(), atol=2e-5, rtol=1e-4)
    assert counted_flex.frame_count == len(_buckets(shapes)) < len(set(shapes))


def test_one_row_masks_padded_to_a_bucket_of_rows_stay_exact(counted_flex):
    # A mask of one row (or none) broadcast over B rows: the padding rows get ids -1 (their
    # blocks are empty); the real rows see exactly the mask.
    import flexpack

    torch.manual_seed(0)
    d = torch.tensor([[0] * 40 + [1] * 50 + [-1] * 10])
    cases = [
        masks.document(d) & masks.causal() & masks.sliding_window(7),
        masks.causal() & masks.sliding_window(5),
        masks.prefix_lm(d, torch.tensor([[10, 20]])),
    ]
    with torch.no_grad():
        for m in cases:
            q, k, v = (torch.randn(3, 2, 100, 16) for _ in range(3))
            out = flexpack.attention(q, k, v, m, backend="flex")
            ref = references.reference_attention(q, k, v, references.dense_mask(m, 3, 1, 100, 100))
            torch.testing.assert_close(out, ref.float(), atol=2e-5, rtol=1e-4)


def test_rl_trees_with_a_varying_row_count_never_reach_the_recompile_limit(counted_flex):
    # GRPO: pack_padded sizes rows by the largest tree, so rows and length change every step.
    from flexpack.models import GPT, GPTConfig
    from flexpack.trees import pack_padded

    g = torch.Generator().manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_kv_head=1, n_embd=32, attn_backend="flex")
    model, twin = GPT(cfg).eval(), GPT(dataclasses.replace(cfg, attn_backend="sdpa")).eval()
    twin.load_state_dict(model.state_dict())
    shapes = []
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1):
        for step in range(20):
            prompts, gens = int(torch.randint(1, 5, (1,), generator=g)), 2
            P, C = int(torch.randint(4, 30, (1,), generator=g)), 20
            prompt = torch.randint(1, 256, (prompts, P), generator=g).repeat_interleave(gens, 0)
            pmask = torch.ones_like(prompt)
            pmask[:, : int(torch.randint(0, P // 2, (1,), generator=g))] = 0  # left padding
            comp = torch.randint(1, 256, (prompts * gens, C), generator=g)
            lens = torch.randint(1, C + 1, (prompts * gens, 1), generator=g)
            cmask = (torch.arange(C)[None] < lens).long()
            trees = pack_padded(prompt, pmask, comp, cmask)
            tb = trees.batch
            logits = model(tb.input_ids, position_ids=tb.position_ids, mask=tb.mask())
            assert logits.shape[:2] == tb.input_ids.shape
            shapes.append(tuple(tb.input_ids.shape))
            if step < 2:  # the rollouts' logits equal the per-segment SDPA path's
                want = twin(tb.input_ids, position_ids=tb.position_ids, mask=tb.mask())
                keep = tb.segment_ids >= 0
                torch.testing.assert_close(logits[keep], want[keep], atol=1e-4, rtol=1e-4)
    assert len({B for B, _ in shapes}) > 1 and len(set(shapes)) > len(_buckets(shapes))
    # Two layers share each bucket's graph; each bucket compiles once.
    assert counted_flex.frame_count == len(_buckets(shapes))


def test_gpt_flex_path_with_dynamic_batching_compiles_per_bucket(counted_flex):
    from flexpack.models import GPT, GPTConfig

    g = torch.Generator().manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_kv_head=1, n_embd=32, attn_backend="flex"))
    model.eval()
    shapes = _random_shapes(20, seed=3)
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1):
        for B, S in shapes:
            ids = torch.randint(0, 256, (B, S), generator=g)
            doc_ids = (torch.arange(S) * 3 // S).expand(B, S).contiguous()
            model(ids, doc_ids=doc_ids)
    assert counted_flex.frame_count == len(_buckets(shapes))
