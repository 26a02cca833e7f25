"""Every CUDA-bound path of flexpack, run on the faked CUDA device (tests/fake_cuda.py).

The kernels that exist on CUDA only (inductor's flex kernels, FlashAttention's varlen) are
replaced by recorders: each checks what reaches it (devices, dtypes, contiguity, int32
``cu_seqlens``, Python-int ``max_seqlen``, 128-multiple block sizes, head dim >= 16 for flex,
D % 8 for varlen) and computes the float64 reference on the fake tensors, so results are compared
with CPU references and autograd runs. Host syncs are counted per call: none per layer, at most
one per forward (none with a ``PackedLayout``).
"""

from __future__ import annotations

import itertools
import math
import os
import re
import types
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from fake_cuda import FakeCudaTensor, is_fake_cuda, to_cpu

import flexpack
from flexpack import _attention_flex, masks
from flexpack.masks import mask_of
from flexpack.testing import references

# ----------------------------------------------------------------------------- recorders


@dataclass
class Call:
    kernel: str
    syncs_before: int  # fake_cuda.syncs count when the kernel was called
    info: dict = field(default_factory=dict)


@dataclass
class Recorder:
    """The CUDA-only kernels, replaced: checks on every call, reference math on fake tensors."""

    gpu: object
    calls: list[Call] = field(default_factory=list)

    def kernels(self, kind: str) -> list[Call]:
        return [c for c in self.calls if c.kernel == kind]

    # -- flex ------------------------------------------------------------------------------

    def flex(self, config):
        def compiled(
            q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
            kernel_options=None, return_aux=None,
        ):  # fmt: skip
            lse = return_aux is not None and return_aux.lse
            info = {"config": config, "S": q.shape[2], "kernel_options": kernel_options,
                    "lse": lse}  # fmt: skip
            self.calls.append(Call("flex", len(self.gpu.syncs), info))
            for name, x in (("q", q), ("k", k), ("v", v)):
                assert is_fake_cuda(x), f"flex got {name} on {x.device} ({type(x).__name__})"
                assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), x.dtype
                assert x.dtype == q.dtype
            assert q.shape[-1] >= 16, f"flex on CUDA needs head dim >= 16, got {q.shape[-1]}"
            assert q.shape[-1] <= 256, q.shape
            bq, bkv = block_mask.BLOCK_SIZE
            assert bq % 128 == 0 and bkv % 128 == 0, block_mask.BLOCK_SIZE
            assert block_mask.seq_lengths == (q.shape[2], k.shape[2])
            for t in block_mask.as_tuple()[2:-1]:
                if isinstance(t, torch.Tensor):
                    assert is_fake_cuda(t) and t.dtype == torch.int32, (t.device, t.dtype)
            behind = mask_of(block_mask)
            if behind is not None:
                for t in behind._tensors():
                    assert is_fake_cuda(t), f"the mask_mod reads a tensor on {t.device}"
            for cell in getattr(score_mod, "__closure__", None) or ():
                if isinstance(cell.cell_contents, torch.Tensor):
                    assert is_fake_cuda(cell.cell_contents), "score_mod reads a CPU tensor"
            with self.gpu.paused():
                dense = references.dense_mask(block_mask, q.shape[0], q.shape[1])
                out = _reference(q, k, v, dense, scale, enable_gqa, score_mod)
                if not lse:
                    return out
                return out, types.SimpleNamespace(
                    lse=_reference_lse(q, k, dense, scale, enable_gqa, score_mod)
                )

        return compiled

    # -- varlen ----------------------------------------------------------------------------

    def varlen_attn(self, q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, **kw):
        window = kw.get("window_size", (-1, -1))
        self.calls.append(Call("varlen", len(self.gpu.syncs), {"window": window}))
        for name, x in (("q", q), ("k", k), ("v", v)):
            assert is_fake_cuda(x), f"varlen got {name} on {x.device}"
            assert x.dim() == 3 and x.stride(-1) == 1, (name, x.shape, x.stride())
            assert x.dtype in (torch.float16, torch.bfloat16), x.dtype
            assert x.shape[-1] % 8 == 0 and x.shape[-1] <= 256, x.shape
        for name, cu in (("cu_seq_q", cu_q), ("cu_seq_k", cu_k)):
            assert is_fake_cuda(cu) and cu.dtype == torch.int32 and cu.dim() == 1, (name, cu)
        for name, m in (("max_q", max_q), ("max_k", max_k)):
            assert type(m) is int, f"{name} must be a Python int, got {type(m).__name__}"
        assert window in ((-1, -1), (-1, 0)) or (window[0] >= 0 and window[1] == 0), window
        gqa = kw.get("enable_gqa", False) or k.shape[1] != q.shape[1]
        with self.gpu.paused():
            bounds = cu_q.tolist()
            assert (
                bounds[-1] == q.shape[0]
                and max(b - a for a, b in itertools.pairwise(bounds)) == max_q
            )
            out = torch.zeros_like(q)
            pieces = []
            for a, b in itertools.pairwise(bounds):
                x = [t[a:b].transpose(0, 1)[None] for t in (q, k, v)]  # (1, H, L, D)
                mask = None
                if window[1] == 0:  # causal, and (W, 0): at most W keys before the query
                    mask = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).tril()
                    if window[0] >= 0:
                        mask = mask.triu(-window[0])
                o = _reference(*x, mask, scale, gqa, None)
                pieces.append(o[0].transpose(0, 1))
            out = torch.cat(pieces) if pieces else out
        return out


def _reference_lse(q, k, dense, scale, enable_gqa, score_mod):
    """(B, Hq, S) float32 log-sum-exp of the masked scores (-inf where no key is allowed)."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = (
        q.double()
        @ k.double().transpose(-1, -2)
        * (q.shape[-1] ** -0.5 if scale is None else scale)
    )
    if score_mod is not None:
        s = score_mod(s, None, None, None, None)
    if dense is not None:
        s = s.masked_fill(~dense, float("-inf"))
    return torch.logsumexp(s, dim=-1).float()


def _reference(q, k, v, dense, scale, enable_gqa, score_mod):
    """Masked softmax attention computed in float64 on q's (fake) device, differentiable."""
    Hq, Hkv = q.shape[1], k.shape[1]
    if Hkv != Hq:
        assert enable_gqa
        k = k.repeat_interleave(Hq // Hkv, dim=1)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
    qd, kd, vd = (x.to(torch.float64) for x in (q, k, v))
    s = qd @ kd.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if score_mod is not None:
        s = score_mod(s, None, None, None, None)
    if dense is not None:
        s = s.masked_fill(~dense, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p @ vd).to(q.dtype)


@pytest.fixture
def kernels(fake_cuda, monkeypatch):
    """The recorders in place of compiled flex and varlen_attn (fresh compile caches)."""
    import torch.nn.attention.varlen as varlen_module

    rec = Recorder(fake_cuda)
    _attention_flex.compiled_flex_attention.cache_clear()
    monkeypatch.setattr(_attention_flex, "compiled_flex_attention", rec.flex)
    monkeypatch.setattr(varlen_module, "varlen_attn", rec.varlen_attn)
    return rec


# ----------------------------------------------------------------------------- masks


def _layouts():
    torch.manual_seed(0)
    S = 200
    sorted_ids = torch.tensor([[0] * 70 + [1] * 90 + [2] * 30 + [-1] * 10])
    unsorted = torch.tensor([[1] * 40 + [0] * 60 + [3] * 50 + [-1] * 20 + [2] * 30])
    seg = torch.tensor([[0] * 60 + [1] * 50 + [2] * 40 + [3] * 30 + [-1] * 20])
    parents = torch.tensor([[-1, 0, 1, 0]])
    prefix = torch.tensor([[20, 30, 10]])
    assert sorted_ids.shape[1] == unsorted.shape[1] == seg.shape[1] == S
    return sorted_ids, unsorted, seg, parents, prefix


MASKS = {
    "document": lambda d, u, s, p, pl: masks.document(d),
    "document_causal": lambda d, u, s, p, pl: masks.document(d) & masks.causal(),
    "document unsorted": lambda d, u, s, p, pl: masks.document(u),
    "document_causal unsorted": lambda d, u, s, p, pl: masks.document(u) & masks.causal(),
    "causal": lambda d, u, s, p, pl: masks.causal(),
    "padding": lambda d, u, s, p, pl: masks.padding(d),
    "prefix_lm": lambda d, u, s, p, pl: masks.prefix_lm(d, pl),
    "sliding window": lambda d, u, s, p, pl: (
        masks.document(d) & masks.causal() & masks.sliding_window(17)
    ),
    "or": lambda d, u, s, p, pl: (masks.document(d) & masks.causal()) | masks.prefix_lm(d, pl),
    "not": lambda d, u, s, p, pl: ~masks.padding(d) & masks.document(d),
    "tree": lambda d, u, s, p, pl: masks.tree(s, p),
    "tree & window": lambda d, u, s, p, pl: masks.tree(s, p) & masks.sliding_window(9),
}


def _on(fake_cuda, name):
    cpu = MASKS[name](*_layouts())
    gpu = MASKS[name](*(fake_cuda.to(t) for t in _layouts()))
    return cpu, gpu


@pytest.mark.parametrize("name", list(MASKS))
def test_block_masks_build_on_the_device_of_their_ids(fake_cuda, name):
    cpu, gpu = _on(fake_cuda, name)
    kw = {"Q_LEN": 200, "KV_LEN": 200} if gpu.doc_ids is None else {}
    with fake_cuda.count() as syncs:
        bm = gpu.block_mask(device="cuda", **kw) if gpu.doc_ids is None else gpu.block_mask()
    if "unsorted" not in name:  # at most one per forward: the mask is built once
        assert len(syncs) <= 1, syncs
    # Unsorted (repeated) ids take the generic classification, whose sizes depend on the data:
    # a handful of syncs, once per forward. The packer never emits such ids.
    want = cpu.block_mask(**kw)
    for got, ref in zip(bm.as_tuple()[2:-1], want.as_tuple()[2:-1], strict=True):
        if isinstance(ref, torch.Tensor):
            assert is_fake_cuda(got) and torch.equal(to_cpu(got), ref)
    assert all(is_fake_cuda(t) for t in mask_of(bm)._tensors())
    # The dense twin evaluates where asked: on the GPU, or on the CPU (the mask is moved).
    with fake_cuda.paused():
        on_gpu = references.dense_mask(gpu, 1, 1, 200, 200, device="cuda")
        on_cpu = references.dense_mask(gpu, 1, 1, 200, 200, device="cpu")
        from_bm = references.dense_mask(bm, device="cpu")
    ref = references.dense_mask(cpu, 1, 1, 200, 200)
    assert is_fake_cuda(on_gpu) and torch.equal(to_cpu(on_gpu), ref)
    assert not is_fake_cuda(on_cpu) and torch.equal(on_cpu, ref)
    assert torch.equal(from_bm, ref)


def test_mask_to_and_block_mask_to_move_to_the_device(fake_cuda, kernels):
    cpu = masks.tree(*_layouts()[2:4]) & masks.sliding_window(5)
    moved = cpu.to("cuda")
    assert all(is_fake_cuda(t) for t in moved._tensors())
    assert cpu.to("cuda") is moved  # cached
    q = torch.randn(1, 2, 200, 64, device="cuda", dtype=torch.bfloat16)
    out = flexpack.attention(q, q, q, moved)  # (tree & window: flex on CUDA)
    # BlockMask.to moves the tables only; attention reads the mask's tensors on q's device.
    bm = cpu.block_mask(block_size=128).to("cuda")
    assert is_fake_cuda(bm.kv_num_blocks)
    out2 = flexpack.attention(q, q, q, bm)
    torch.testing.assert_close(to_cpu(out2), to_cpu(out))
    ref = references.reference_attention(
        to_cpu(q), to_cpu(q), to_cpu(q), references.dense_mask(cpu, 1, 1, 200, 200)
    )
    torch.testing.assert_close(to_cpu(out).float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert [c.kernel for c in kernels.calls] == ["flex", "flex"]


# ----------------------------------------------------------------------------- attention


CASES = [  # (mask, backend, dtype, D, expected kernel or None for SDPA)
    *((n, "auto", torch.bfloat16, 64) for n in MASKS),
    *((n, "flex", torch.bfloat16, 64) for n in MASKS),
    *((n, "flex", torch.float32, 8) for n in ("document_causal", "tree", "sliding window")),
    ("document", "varlen", torch.bfloat16, 64),
    ("document_causal", "varlen", torch.float16, 128),
    ("document_causal unsorted", "varlen", torch.bfloat16, 64),
    ("document_causal", "auto", torch.float32, 64),  # fp32: flex
    ("document_causal", "auto", torch.float64, 64),  # fp64: SDPA per document
    ("sliding window", "auto", torch.bfloat16, 320),  # D > 256: SDPA
    ("tree", "auto", torch.float64, 64),
]


def _expected_kernel(name, backend, dtype, D):
    if backend == "varlen":
        return "varlen"
    if backend == "flex":
        return "flex"
    document = name.startswith("document")
    if dtype == torch.float64 or D > 256:
        return None
    if (document or name == "sliding window") and dtype != torch.float32 and D % 8 == 0:
        return "varlen"  # (a window over contiguous documents: varlen's window_size)
    if name == "causal":
        return None
    return "flex"


@pytest.mark.parametrize(("name", "backend", "dtype", "D"), CASES)
def test_attention_on_cuda_reaches_kernels_with_what_they_take(
    fake_cuda, kernels, name, backend, dtype, D
):
    cpu_mask, gpu_mask = _on(fake_cuda, name)
    torch.manual_seed(1)
    qc, kc, vc = torch.randn(1, 4, 200, D), torch.randn(1, 2, 200, D), torch.randn(1, 2, 200, D)
    q, k, v = (fake_cuda.to(x.to(dtype)).requires_grad_() for x in (qc, kc, vc))
    with fake_cuda.count() as first:
        out = flexpack.attention(q, k, v, gpu_mask, backend=backend, enable_gqa=True)
    with fake_cuda.count() as second:  # the next layer: plans and BlockMasks are reused
        out2 = flexpack.attention(q, k, v, gpu_mask, backend=backend, enable_gqa=True)
    want = _expected_kernel(name, backend, dtype, D)
    if want is not None and not ("unsorted" in name and want == "flex"):
        assert len(first) <= 1, first  # the BlockMask or the varlen plan, once per forward
    # (The SDPA fallbacks, float64 and D > 256 on CUDA, plan per document or segment on the
    # host: a few syncs on the first layer, none after.)
    assert second == [], second  # every later layer: none
    assert [c.kernel for c in kernels.calls] == ([want] * 2 if want else [])
    assert is_fake_cuda(out) and out.dtype == dtype and out.shape == q.shape
    with fake_cuda.paused():
        out.float().sum().backward()
    assert is_fake_cuda(q.grad) and q.grad.shape == q.shape
    ref = references.reference_attention(
        qc.to(dtype), kc.to(dtype), vc.to(dtype), references.dense_mask(cpu_mask, 1, 1, 200, 200),
        enable_gqa=True,
    )  # fmt: skip
    tol = {torch.float64: 1e-7, torch.float32: 1e-4}.get(dtype, 2e-2)
    torch.testing.assert_close(to_cpu(out2).double(), ref.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_flex_layers_make_no_sync_softcap_included(fake_cuda, kernels, softcap):
    _, gpu_mask = _on(fake_cuda, "sliding window")
    q = torch.randn(2, 4, 200, 64, device="cuda", dtype=torch.bfloat16)
    with fake_cuda.count() as forward:
        for _ in range(6):  # six layers of one forward
            flexpack.attention(q, q, q, gpu_mask.to("cuda"), softcap=softcap, backend="flex")
    assert len(forward) <= 1, forward
    # Every layer after the first: not one sync (the cap is no new host-to-device copy).
    assert all(c.syncs_before == kernels.calls[0].syncs_before for c in kernels.calls)
    assert len(kernels.kernels("flex")) == 6


@pytest.mark.parametrize("window", [0, 9, 40, 500])
def test_windowed_documents_run_varlen_with_its_window_size(fake_cuda, kernels, window):
    # document_causal & sliding_window(W) over contiguous documents: varlen's window_size=(W, 0)
    # (a window longer than every document is plain causal), exact against float64.
    d = torch.tensor([[0] * 70 + [1] * 90 + [2] * 30 + [-1] * 10, [0] * 150 + [1] * 50])
    cpu = masks.document(d) & masks.causal() & masks.sliding_window(window)
    gpu = masks.document(fake_cuda.to(d)) & masks.sliding_window(window) & masks.causal()
    torch.manual_seed(0)
    qc, kc = torch.randn(2, 4, 200, 64), torch.randn(2, 2, 200, 64)
    q, k = (fake_cuda.to(x.to(torch.bfloat16)).requires_grad_() for x in (qc, kc))
    with fake_cuda.count() as syncs:
        out = flexpack.attention(q, k, k, gpu, enable_gqa=True)
    assert len(syncs) <= 1, syncs
    assert [c.kernel for c in kernels.calls] == ["varlen"]
    assert kernels.calls[0].info["window"] == ((window, 0) if window < 149 else (-1, 0))
    ref = references.reference_attention(
        qc.bfloat16(), kc.bfloat16(), kc.bfloat16(), references.dense_mask(cpu), enable_gqa=True
    )
    torch.testing.assert_close(to_cpu(out).double(), ref.double(), atol=2e-2, rtol=2e-2)
    with fake_cuda.paused():
        out.float().sum().backward()
    assert is_fake_cuda(q.grad)


def test_windowed_documents_cut_into_runs_are_refused(fake_cuda, kernels):
    # An id in two runs of a row (one document or two?): refused by every entry point. On the
    # GPU the mask is built without the check's sync; the call refuses with its plan's.
    d = torch.tensor([[0] * 40 + [1] * 60 + [0] * 50 + [-1] * 20 + [2] * 30])
    m = masks.document(fake_cuda.to(d)) & masks.causal() & masks.sliding_window(17)
    q = fake_cuda.to(torch.randn(1, 2, 200, 64).to(torch.bfloat16))
    for backend in ("auto", "varlen", "flex"):
        with pytest.raises(ValueError, match="doc id 0 names two separate runs of row 0"):
            flexpack.attention(q, q, q, m, backend=backend)
    assert kernels.calls == []


@pytest.mark.parametrize("D", [128, 256])
def test_wide_heads_train_flex_with_backward_blocks_that_fit_registers(fake_cuda, kernels, D):
    # Gemma 2 (head dim 256, softcap: flex): the backward gets 32-row blocks; D=128 the defaults.
    _, gpu_mask = _on(fake_cuda, "document_causal")
    q = torch.randn(1, 2, 200, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    flexpack.attention(q, q, q, gpu_mask, softcap=50.0).float().sum().backward()
    with torch.no_grad():
        flexpack.attention(q, q, q, gpu_mask, softcap=50.0)  # no backward: no options
    grad, no_grad = (c.info["kernel_options"] for c in kernels.calls)
    assert no_grad is None
    if D == 128:
        assert grad is None
    else:
        assert grad == _attention_flex.WIDE_HEAD_BWD_OPTIONS
        assert all(v % 32 == 0 and 128 % v == 0 for k, v in grad.items() if "BLOCK" in k)


def test_softcap_makes_its_tensor_once_per_device(fake_cuda):
    a = _attention_flex.softcap_score_mod(50.0, torch.device("cuda"))
    with fake_cuda.count() as syncs:
        b = _attention_flex.softcap_score_mod(50.0, torch.device("cuda"))
    assert a is b and syncs == []
    cap = next(c.cell_contents for c in a.__closure__ if isinstance(c.cell_contents, torch.Tensor))
    assert is_fake_cuda(cap) and float(to_cpu(cap)) == 50.0


def test_variable_row_lengths_pad_to_buckets_on_cuda(fake_cuda, kernels):
    lengths = [100, 130, 170, 200, 230, 250, 300, 400, 500, 510, 700, 1000]  # 12 of them
    for S in lengths:
        d = fake_cuda.to(torch.cat([torch.zeros(S // 2), torch.ones(S - S // 2)]).long()[None])
        m = masks.document(d) & masks.causal() & masks.sliding_window(32)
        q = torch.randn(1, 2, S, 64, device="cuda", dtype=torch.bfloat16)
        out = flexpack.attention(q, q, q, m, backend="flex")  # (auto: varlen)
        assert out.shape == q.shape
    from flexpack.attention import flex_row_length

    shapes = {c.info["S"] for c in kernels.calls}  # the shapes it compiles for
    assert shapes == {flex_row_length(S) for S in lengths} == {128, 256, 512, 1024}
    # One compiled wrapper per bucket (its own recompile count), one bucket per wrapper.
    assert len({c.info["config"] for c in kernels.calls}) == len(shapes)
    assert {c.info["config"][-1] for c in kernels.calls} == {(1, S) for S in shapes}


def test_random_batch_shapes_reach_flex_in_buckets_on_cuda(fake_cuda, kernels):
    # Rows and lengths both vary: flex sees bucket shapes only, exact on the real rows.
    from flexpack.attention import flex_row_length

    g = torch.Generator().manual_seed(0)
    rows, lengths = (
        torch.randint(1, 7, (20,), generator=g),
        torch.randint(30, 250, (20,), generator=g),
    )
    shapes = list(zip(rows.tolist(), lengths.tolist(), strict=True))
    for i, (B, S) in enumerate(shapes):
        d = torch.randint(0, 3, (B, S), generator=g).sort(dim=1).values
        d[:, S - S // 4 :] = -1
        m = masks.document(fake_cuda.to(d)) & masks.causal() & masks.sliding_window(16)
        qc = torch.randn(B, 1, S, 16, generator=g).to(torch.bfloat16)
        q = fake_cuda.to(qc)
        with fake_cuda.count() as syncs:
            out = flexpack.attention(q, q, q, m, backend="flex")
        assert len(syncs) <= 1, syncs
        assert is_fake_cuda(out) and out.shape == q.shape
        if i < 3:
            cpu = masks.document(d) & masks.causal() & masks.sliding_window(16)
            ref = references.reference_attention(qc, qc, qc, references.dense_mask(cpu))
            torch.testing.assert_close(to_cpu(out).double(), ref.double(), atol=2e-2, rtol=2e-2)
    want = {(_attention_flex.flex_batch_rows(B), flex_row_length(S)) for B, S in shapes}
    seen = {c.info["config"][-1] for c in kernels.calls}
    assert seen == want and len(want) < len(set(shapes))
    assert all(c.info["config"][-1][1] == c.info["S"] for c in kernels.calls)


def test_sinks_on_cuda_run_bucketed_compiled_flex_with_its_lse(fake_cuda, kernels):
    """gpt-oss's sinks on CUDA: compiled flex with return_aux (lse), padded to the same buckets
    as flexpack.attention (three row lengths, one graph), equal to the dense sink formula."""
    from flexpack._attention_sinks import dense_sink_attention, sink_attention

    g = torch.Generator().manual_seed(0)
    sinks = torch.randn(4, generator=g)
    for S in (37, 50, 90):
        d = torch.tensor([[0] * (S // 3) + [1] * (S - S // 3 - 5) + [-1] * 5])
        cpu = masks.document(d) & masks.causal() & masks.sliding_window(8)
        qc, kc, vc = (torch.randn(1, n, S, 16, generator=g) for n in (4, 2, 2))
        m = masks.document(fake_cuda.to(d)) & masks.causal() & masks.sliding_window(8)
        q, k, v, s = (fake_cuda.to(x) for x in (qc, kc, vc, sinks))
        with fake_cuda.count() as syncs:
            out = sink_attention(q, k, v, m, s, scale=None, enable_gqa=True)
        assert len(syncs) <= 1, syncs
        allowed = references.dense_mask(cpu, 1, 1)
        want = dense_sink_attention(qc, kc, vc, allowed, sinks, scale=None)
        torch.testing.assert_close(to_cpu(out), want, atol=1e-5, rtol=1e-5)
    calls = kernels.kernels("flex")
    assert len(calls) == 3 and all(c.info["lse"] for c in calls)
    assert {c.info["S"] for c in calls} == {128} and len({c.info["config"] for c in calls}) == 1


# ----------------------------------------------------------------------------- models


def test_reference_gpt_on_cuda_syncs_at_most_once_per_forward(fake_cuda, kernels):
    from flexpack.batch import pack_sequences
    from flexpack.models import GPT, GPTConfig

    torch.manual_seed(0)
    docs = [torch.randint(0, 256, (n,)) for n in (50, 90, 30, 70, 40)]
    batch = pack_sequences(docs, max_len=128)
    cfg = GPTConfig(n_layer=3, n_head=4, n_kv_head=2, n_embd=256)  # D=64
    model = GPT(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        want = model(batch.input_ids, doc_ids=batch.doc_ids)
    model.to("cuda")
    gpu_batch = batch.to("cuda")
    with torch.no_grad():
        with fake_cuda.count() as by_ids:
            got = model(gpu_batch.input_ids, doc_ids=gpu_batch.doc_ids.clone())
        with fake_cuda.count() as by_layout:
            got2 = model(gpu_batch.input_ids, layout=gpu_batch.layout)
    assert len(by_ids) <= 1, by_ids
    assert by_layout == [], by_layout
    assert [c.kernel for c in kernels.calls] == ["varlen"] * 6
    torch.testing.assert_close(to_cpu(got).float(), want.float(), atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(to_cpu(got2).float(), want.float(), atol=5e-2, rtol=5e-2)
    # Training: the backward runs on the device and makes no sync either.
    model.train()
    logits = model(gpu_batch.input_ids, layout=gpu_batch.layout)
    with fake_cuda.count() as backward:
        logits.float().logsumexp(-1).mean().backward()
    assert backward == [] and all(is_fake_cuda(p.grad) for p in model.parameters())


def test_trees_and_logps_on_cuda(fake_cuda, kernels):
    from flexpack.models import GPT, GPTConfig
    from flexpack.trees import pack_trees

    torch.manual_seed(0)

    def tokens(n):
        return torch.randint(0, 256, (n,)).tolist()

    groups = [
        (tokens(40), [tokens(20), tokens(30)]),
        (tokens(25), [tokens(15), tokens(10), tokens(12)]),
    ]
    batch = pack_trees(groups, max_len=256)
    cfg = GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=256)
    model = GPT(cfg).to(torch.bfloat16).eval()
    mask_cpu = batch.mask()
    with torch.no_grad():
        logits_cpu = model(batch.input_ids, position_ids=batch.position_ids, mask=mask_cpu)
    model.to("cuda")
    gb = fake_cuda.to(batch)
    with torch.no_grad(), fake_cuda.count() as syncs:
        logits = model(gb.input_ids, position_ids=gb.position_ids, mask=gb.mask())
        logps, valid = gb.gather_logps(logits)
    assert len(syncs) <= 1, syncs
    assert is_fake_cuda(logps) and is_fake_cuda(valid)
    want_logps, want_valid = batch.gather_logps(logits_cpu)
    assert torch.equal(to_cpu(valid), want_valid)
    torch.testing.assert_close(to_cpu(logps).float(), want_logps.float(), atol=0.3, rtol=0.1)
    torch.testing.assert_close(to_cpu(logits).float(), logits_cpu.float(), atol=5e-2, rtol=5e-2)
    assert {c.kernel for c in kernels.calls} == {"flex"}


def test_fake_tensor_type_is_what_the_recorders_see(fake_cuda):
    x = torch.zeros(2, device="cuda")
    assert isinstance(x, FakeCudaTensor)
    assert F.pad(x, (0, 2)).device.type == "cuda"


# ----------------------------------------------------------------------------- bench/gpu.py


def _gpu_bench():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "gpu.py"
    spec = importlib.util.spec_from_file_location("flexpack_bench_gpu_fake", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_gpu_bench_correctness_passes_on_cuda(fake_cuda, kernels):
    # The GPU benchmark's correctness section, on the device it is written for (kernels
    # recorded): every path it checks reaches its kernel with what the kernel takes.
    gpu = _gpu_bench()
    checks = gpu.correctness(torch.device("cuda"), S=150, dry_run=False)
    assert checks.failed == 0, "\n".join(checks.lines)
    assert len(checks.lines) == 16
    assert {"flex", "varlen"} <= {c.kernel for c in kernels.calls}
    windows = [c.info["window"] for c in kernels.kernels("varlen")]
    assert (150 // 7, 0) in windows  # "auto sliding window": varlen's window_size


class _Clock:
    """A clock that moves only when told: budgets judged on it do not depend on load."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def bench_on_fake_clock(fake_cuda, kernels, monkeypatch):
    gpu = _gpu_bench()
    clock = _Clock()
    monkeypatch.setattr(gpu, "_CLOCK", clock)  # (and no alarm: it would use the real clock)
    # A triton kernel needs a real GPU (the torch 2.11 leg has triton, and no GPU)
    monkeypatch.setattr(
        gpu, "probe_triton", lambda device, seconds: gpu.Probe("triton kernel", "skip", "faked")
    )
    real_timer = gpu.make_timer
    monkeypatch.setattr(
        gpu, "make_timer", lambda device, **kw: real_timer(device, min_reps=1, budget_s=0)
    )
    return gpu, clock


def test_gpu_bench_quick_survives_failures_and_its_budget(
    bench_on_fake_clock, monkeypatch, tmp_path
):
    gpu, _ = bench_on_fake_clock
    real = gpu.flexpack.attention

    def attention(*args, backend="auto", **kw):  # one backend broken: its lines fail, not the run
        if backend == "sdpa":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(*args, backend=backend, **kw)

    monkeypatch.setattr(gpu.flexpack, "attention", attention)
    out = tmp_path / "quick.md"
    small = ["--dims", "16", "--check-size", "150"]  # what the fake device computes in seconds
    status = gpu.main(["--quick", "--sizes", "256", *small, "--out", str(out)])
    report = out.read_text()
    assert status == 1  # a check failed ...
    assert "FAIL sdpa   bfloat16: RuntimeError: CUDA error" in report
    for row in (  # ... and every row was timed, the dense-mask SDPA row too (mem_get_info)
        "| 256 | 16 | document_causal | flexpack flex | ",
        "| 256 | 16 | document_causal | varlen_attn | ",
        "| 256 | 16 | document_causal | SDPA + dense mask | ",
        "| 256 | 16 | tree | flexpack flex | ",
        "| 256 | 16 | window | varlen_attn | ",
    ):
        line = next(x for x in report.splitlines() if x.startswith(row))
        assert "failed" not in line and "skipped" not in line and " — " not in line, line
    assert "Skipped (budget): none" in report
    assert (tmp_path / "quick.log").read_text().count("FAIL sdpa   bfloat16") >= 1  # the log
    # A budget too small for a compile: steps are skipped and named, the run ends cleanly.
    monkeypatch.setattr(gpu.flexpack, "attention", real)
    status = gpu.main(["--quick", "--sizes", "128", *small, "--out", str(out), "--budget", "20"])
    report = out.read_text()
    assert "Skipped (budget): " in report and "Skipped (budget): none" not in report
    assert "skip flex   bfloat16: skipped: budget (27 s needed, 20 s left)" in report
    assert "| 128 | 16 | document_causal | varlen_attn | " in report  # what fits still runs
    # no correctness check failed (the speed-target rows judge fake timings: PASS or FAIL)
    assert not re.search(r"^\s*FAIL ", report, re.M) and status == 0


@pytest.mark.parametrize("wrapper", ["InternalTorchDynamoError", "plain"])
def test_gpu_bench_budget_stop_inside_a_compile_is_a_stop(
    bench_on_fake_clock, monkeypatch, tmp_path, wrapper
):
    # The alarm fires inside torch.compile: dynamo wraps the stop (or loses it); once the
    # budget is spent, whatever comes out is the budget's stop, never a FAIL.
    gpu, clock = bench_on_fake_clock
    real = gpu.flexpack.attention

    def attention(*args, backend="auto", **kw):
        if backend == "flex":
            clock.t = 1000.0  # the budget is spent while compiling
            err = getattr(torch._dynamo.exc, wrapper, RuntimeError)
            raise err("compile interrupted")
        return real(*args, backend=backend, **kw)

    monkeypatch.setattr(gpu.flexpack, "attention", attention)
    out = tmp_path / "gpu.md"
    argv = ["--sizes", "128", "--dims", "16", "--check-size", "150", "--budget", "300"]
    status = gpu.main([*argv, "--out", str(out)])
    report = out.read_text()
    assert status == 0 and not re.search(r"^\s*FAIL ", report, re.M), report
    assert "skip flex   bfloat16: stopped, the time budget ran out" in report
    assert "skip auto   sliding window: skipped: budget" in report  # nothing after it ran


def test_gpu_bench_budget_stop_is_found_through_dynamo_wrappers():
    gpu = _gpu_bench()
    exc = torch._dynamo.exc
    wrappers = [
        lambda inner: exc.InternalTorchDynamoError("wrapped"),
        lambda inner: exc.TorchRuntimeError("wrapped"),
        lambda inner: exc.BackendCompilerFailed(lambda *a: None, inner, None),
    ]
    for wrap in wrappers:
        try:
            try:
                raise gpu.OutOfTime("the run's time budget ran out during this step")
            except gpu.OutOfTime as inner:
                raise wrap(inner) from inner
        except Exception as err:
            assert not isinstance(err, gpu.OutOfTime) and gpu.budget_stop(err), type(err)
    assert not gpu.budget_stop(RuntimeError("a real failure"))  # no budget running
    with gpu.Budget(10.0) as budget:
        assert not gpu.budget_stop(RuntimeError("a real failure"))
        budget.fired = True
        assert gpu.budget_stop(RuntimeError("anything, once the alarm fired"))


def test_gpu_bench_writes_under_out_by_default(monkeypatch, tmp_path):
    gpu = _gpu_bench()
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu.default_out(dry_run=False, quick=False) == tmp_path / "gpu.md"
    assert gpu.default_out(dry_run=False, quick=True) == tmp_path / "gpu.md"
    dry = gpu.default_out(dry_run=True, quick=False)
    assert "flexpack-gpu-dry-run-" in str(dry) and "bench/results" not in str(dry)
    monkeypatch.delenv("OUT")
    assert gpu.default_out(dry_run=False, quick=True).parts[-3:] == (
        "bench",
        "results",
        "gpu-quick.md",
    )


def _compile_failure(gpu):
    """A flex compile failing as dynamo reports it: BackendCompilerFailed raised ``from None``
    around the compiler's error, whose own cause is the C compiler's exit status."""
    import subprocess

    def inductor():
        pass

    try:
        try:
            raise subprocess.CalledProcessError(1, ["gcc", "cuda_utils.c", "-o", "cuda_utils.so"])
        except subprocess.CalledProcessError as cause:
            raise RuntimeError("triton could not build its launcher") from cause
    except RuntimeError as inner:
        return torch._dynamo.exc.BackendCompilerFailed(inductor, inner, None)


def test_gpu_bench_exception_chain_reaches_dynamos_inner_exception():
    gpu = _gpu_bench()
    try:
        raise _compile_failure(gpu) from None
    except Exception as err:
        chain, line = gpu.exception_chain(err), gpu.summary(err)
    assert "BackendCompilerFailed" in chain and "triton could not build its launcher" in chain
    assert "CalledProcessError" in chain and "direct cause" in chain  # the inner one's chain
    assert line == (
        "BackendCompilerFailed: backend='inductor' raised: RuntimeError: triton could not build "
        "its launcher"
    )


def test_gpu_bench_logs_the_whole_chain_of_a_failed_compile_and_fd_2(
    bench_on_fake_clock, monkeypatch, tmp_path
):
    # A failed flex compile read "BackendCompilerFailed: backend='inductor' raised:" and nothing
    # else, and the C compiler's message (written to fd 2 by gcc, not through Python) was lost.
    gpu, _ = bench_on_fake_clock
    real = gpu.flexpack.attention

    def attention(*args, backend="auto", **kw):
        if backend == "flex":
            os.write(2, b"cuda_utils.c:1:10: fatal error: Python.h: No such file or directory\n")
            raise _compile_failure(gpu) from None
        return real(*args, backend=backend, **kw)

    monkeypatch.setattr(gpu.flexpack, "attention", attention)
    out = tmp_path / "gpu.md"
    argv = ["--quick", "--sizes", "128", "--dims", "16", "--check-size", "150"]
    assert gpu.main([*argv, "--out", str(out)]) == 1
    report, log = out.read_text(), (tmp_path / "gpu.log").read_text()
    why = "BackendCompilerFailed: backend='inductor' raised: RuntimeError: triton could not build"
    assert f"FAIL flex   bfloat16: {why}" in report
    assert f"| 128 | 16 | document_causal | flexpack flex | — | — | — | — | failed: {why}" in report
    assert "fatal error: Python.h: No such file or directory" in log  # fd 2
    for name in ("flex   bfloat16", "S=128 D=16 document_causal flexpack flex"):
        start = log.index(f"----- FAIL {name}: the exception chain")
        chain = log[start : log.index(f"----- end of {name}", start)]
        assert "CalledProcessError: Command '['gcc'" in chain, chain
        assert "The above exception was the direct cause" in chain
        assert "BackendCompilerFailed" in chain
    assert os.fstat(2)  # fd 2 is back (and pytest's capture still works after)


def test_gpu_bench_failed_preflight_times_varlen_and_sdpa_in_order_then_os_exit(
    bench_on_fake_clock, kernels, monkeypatch, tmp_path
):
    # No C compiler: the preflight fails in no time, no flex compile is attempted, and the
    # budget goes to the varlen and SDPA rows; the rows come in the plan's order of value; the
    # command ends with os._exit after the last write, the report and the log fsynced.
    gpu, _ = bench_on_fake_clock
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(gpu.shutil, "which", lambda name, *a, **kw: None)
    monkeypatch.setattr(gpu, "DENSE_MAX_S", 128)  # S=256 plays 128K: no dense mask
    out = tmp_path / "gpu.md"
    synced, exits = [], []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    class Exited(Exception):
        pass

    def exit_now(status):
        exits.append((status, out.read_text(), list(synced), gpu._LOG))
        raise Exited  # (os._exit does not return)

    monkeypatch.setattr(gpu.os, "fsync", fsync)
    monkeypatch.setattr(gpu.os, "_exit", exit_now)
    argv = ["--sizes", "128", "256", "--dims", "32", "16", "--check-size", "150"]
    with pytest.raises(Exited):
        gpu.main([*argv, "--out", str(out)], hard_exit=True)
    [(status, report, synced, log_open)] = exits
    assert status == 0 and log_open is None
    assert synced[-2:] == [str(out.resolve()), str(out.with_suffix(".log").resolve())]
    assert report == out.read_text() and "Correctness: 7/7 checks passed" in report
    lines = report.splitlines()
    assert lines[1].startswith("Preflight (") and "FAILED: no flex compile" in lines[1]
    assert lines[2].startswith("  FAIL C compiler") and "install gcc or set CC" in lines[2]
    assert kernels.kernels("flex") == []  # not one flex call
    assert kernels.kernels("varlen")
    assert "skip flex   bfloat16: skipped: the preflight failed" in report
    rows = [x.split(" | ")[:4] for x in lines if re.match(r"\| \d+ \| \d+ \| \w+ \| [a-zS]", x)]
    hybrid = [x for x in lines if x.startswith("| 128 | 32 | hybrid |")]
    # every mixer timed (its TFLOP/s cells are dashes: no FLOP count for a mixer)
    assert len(hybrid) == 12 and not any("failed" in x for x in hybrid), hybrid
    assert all(x.split(" | ")[4] != "—" and x.split(" | ")[6] != "—" for x in hybrid), hybrid
    assert [" ".join(r)[2:] for r in rows] == [
        *(f"128 32 document_causal {m}" for m in gpu.METHODS),
        "128 32 tree flexpack flex",
        "128 32 tree flexpack sdpa (per segment)",
        *(f"128 32 window {m}" for m in gpu.MASK_METHODS["window"]),
        *(f"128 32 hybrid {m}" for m in gpu.MASK_METHODS["hybrid"]),  # no flex: all run
        "128 16 document_causal flexpack flex",
        "128 16 document_causal varlen_attn",
        *(f"256 32 document_causal {m}" for m in gpu.METHODS if m != "SDPA + dense mask"),
    ]
    for line in lines:
        if line.startswith("| ") and "flexpack flex" in line:
            assert line.endswith(f"| {gpu.NO_FLEX} |"), line
        elif re.match(r"\| \d+ \| \d+ \| \w+ \| (varlen_attn|flexpack auto|SDPA causal)", line):
            assert " — " not in line and "failed" not in line, line


def test_gpu_bench_plan_runs_in_order_of_value():
    # At ~40 s a compile the budget cuts what comes last: tree, window and 128K used to.
    gpu = _gpu_bench()
    checks = gpu.correctness_plan(
        torch.device("cpu"), S=150, dry_run=False, checks=gpu.Checks()
    )  # fmt: skip
    stages = gpu.run_plan(
        sizes=[8192, 32768, 131072], dims=[128, 64], checks=checks, H=16, dry_run=False
    )
    assert [st.name for st in stages] == [
        "checks",
        "time S=8192 D=128",
        "time S=32768 D=128",
        "time S=32768 D=128 tree",
        "time S=32768 D=128 window",
        "checks (sinks, recompiles)",
        "time S=8192 hybrid mixers",
        "time S=8192 D=64",
        "time S=32768 D=64",
        "time S=131072 D=128",
        "checks (fp32, head dim 8, 64-token blocks)",
    ]
    assert [c.name for c in stages[0].checks][:4] == [
        f"{b:<6} bfloat16" for b in ("varlen", "auto", "sdpa", "flex")
    ]
    assert sum(st.compiles() for st in stages) == 13  # 6 checks, 7 rows
    no_flex = gpu.run_plan(
        sizes=[8192], dims=[128], checks=checks, H=16, dry_run=False, flex=False
    )  # fmt: skip
    assert sum(st.compiles() for st in no_flex) == 0


def test_gpu_bench_compile_estimate_is_the_second_compile(capsys):
    gpu = _gpu_bench()
    budget = gpu.Budget(100.0)
    budget.measured_compile(70.0, 1)  # inductor's warm-up included: not the estimate
    assert budget.compile_s == gpu.COMPILE_S
    budget.measured_compile(0.0, 0)  # a step that compiled nothing measures nothing
    budget.measured_compile(80.0, 2)
    assert budget.compile_s == 40.0
    budget.measured_compile(10.0, 1)
    assert budget.compile_s == 40.0
    assert "second flex compile measured: ~40 s" in capsys.readouterr().out


def test_gpu_bench_times_auto_and_varlen_interleaved():
    gpu = _gpu_bench()
    calls = []

    def fn(name):
        return lambda: calls.append(name)

    def broken():
        raise RuntimeError("no such kernel")

    timer = gpu.make_timer(torch.device("cpu"), min_reps=3, budget_s=0)
    a, b, c = timer(fn("a"), broken, fn("b"))
    assert isinstance(b, RuntimeError) and a.reps == c.reps == 3
    assert calls[:2] == ["a", "b"] and calls[-6:] == ["a", "b"] * 3  # call for call


def test_gpu_bench_sink_tolerance_bounds_a_bf16_emulation():
    # The error model's bound holds for the roundings it names, emulated in float64 (P, o, w
    # and the product rounded to bf16), and its reference is the float64 sink attention's.
    from flexpack._attention_sinks import dense_sink_attention

    gpu = _gpu_bench()
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, S, D = 1, 4, 2, 96, 32
    q, k, v = (
        torch.randn(B, h, S, D, generator=g).bfloat16().double() for h in (Hq, Hkv, Hkv)
    )  # fmt: skip
    sinks = torch.randn(Hq, generator=g, dtype=torch.float64)
    cot = torch.randn(B, Hq, S, D, generator=g, dtype=torch.float64)
    allowed = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
    tols = gpu.sink_tolerances(q, k, v, allowed, sinks, cot)
    assert set(tols) == {"out", "dv"} and tols["out"] >= 4 * gpu.BF16_U

    def bf16(x):
        return x.bfloat16().double()

    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = (q @ kr.transpose(-1, -2) * D**-0.5).masked_fill(~allowed, -math.inf)
    p = s.softmax(-1)
    lse = s.logsumexp(-1, keepdim=True)
    o = bf16(bf16(p) @ vr)
    got = bf16(o * bf16(torch.sigmoid(lse - sinks.view(1, Hq, 1, 1))))
    vv = v.clone().requires_grad_()
    want = dense_sink_attention(q, k, vv, allowed, sinks, scale=None)
    assert gpu.rel_err(got, want) < tols["out"]
    (dv,) = torch.autograd.grad((want * cot).sum(), vv)
    assert gpu.rel_err(bf16(dv), dv) < tols["dv"]


# ----------------------------------------------------------------------------- integrations


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_transformers_on_cuda_syncs_at_most_once_per_forward(fake_cuda, kernels, model_type):
    # Llama (D=64 bf16: varlen) and Gemma 2 (softcap and sliding windows: flex) on packed rows.
    transformers = pytest.importorskip("transformers")
    from flexpack.integrations.transformers import packed_forward_kwargs, register

    common = dict(
        vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        attn_implementation=register(),
    )  # fmt: skip
    if model_type == "llama":
        config = transformers.LlamaConfig(**common)
        model_cls = transformers.LlamaForCausalLM
    else:
        config = transformers.Gemma2Config(
            **common, head_dim=64, sliding_window=32, attn_logit_softcapping=50.0
        )
        model_cls = transformers.Gemma2ForCausalLM
    torch.manual_seed(0)
    model = model_cls(config).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 256, (n,), generator=g) for n in (60, 90, 40, 70, 30)]
    batch = flexpack.pack_sequences(docs, max_len=160)
    with torch.no_grad():
        want = model(**packed_forward_kwargs(batch)).logits
    model.to("cuda")
    kwargs = packed_forward_kwargs(batch)
    kwargs = {k: fake_cuda.to(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with torch.no_grad(), fake_cuda.count() as syncs:
        got = model(**kwargs).logits
    # transformers' own packed-sequence detection (masking_utils) syncs once; flexpack's part:
    # one per forward, though Gemma 2 builds two masks (its sliding layers' and its full layers')
    ours = [s for s in syncs if "transformers/masking_utils" not in s.where]
    assert len(ours) <= 1, ours
    kinds = {c.kernel for c in kernels.calls}
    assert kinds == ({"varlen"} if model_type == "llama" else {"flex"})
    # Per layer nothing: after each mask's first layer, the sync count never moves again.
    assert len(kernels.calls) == 4
    assert len({c.syncs_before for c in kernels.calls}) <= (1 if model_type == "llama" else 2)
    torch.testing.assert_close(to_cpu(got).float(), want.float(), atol=6e-2, rtol=6e-2)
