"""packed_linear_cross_entropy against the logits path: packed_cross_entropy(hidden @ W.T + b)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import flexpack
import flexpack.loss
from flexpack import packed_cross_entropy, packed_linear_cross_entropy

C, V = 8, 37


def packed_rows(lengths, *, max_len, seed, prompt_frac=0.3):
    """A PackedBatch of random samples with prompt-masked labels (-100 on the first third)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for n in lengths:
        ids = torch.randint(0, V, (n,), generator=g)
        labels = ids.clone()
        labels[: int(n * prompt_frac)] = -100
        samples.append({"input_ids": ids, "labels": labels})
    return flexpack.pack_sequences(samples, max_len=max_len, strategy="greedy")


def leaves(B, S, *, dtype, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, C, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(V, C, generator=g, dtype=dtype).requires_grad_()
    b = torch.randn(V, generator=g, dtype=dtype).requires_grad_() if bias else None
    return hidden, weight, b


def logits_path(hidden, weight, bias, labels, doc_ids, *, reduction, softcap):
    logits = F.linear(hidden, weight, bias)  # (B, S, V)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return packed_cross_entropy(logits, labels, doc_ids, reduction=reduction)


def assert_same(hidden, weight, bias, labels, doc_ids, *, reduction, softcap=None,
                chunk_size=None, rtol, atol):  # fmt: skip
    params = [p for p in (hidden, weight, bias) if p is not None]
    want = logits_path(hidden, weight, bias, labels, doc_ids, reduction=reduction, softcap=softcap)
    got = packed_linear_cross_entropy(
        hidden, weight, labels, doc_ids, reduction=reduction, bias=bias, softcap=softcap,
        chunk_size=chunk_size,
    )  # fmt: skip
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    grads_want = torch.autograd.grad(want, params)
    grads_got = torch.autograd.grad(got, params)
    for p, a, b in zip(params, grads_got, grads_want, strict=True):
        assert a.dtype == p.dtype and a.shape == p.shape
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


TOL = {torch.float64: {"rtol": 1e-10, "atol": 1e-12}, torch.float32: {"rtol": 1e-5, "atol": 1e-6}}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("reduction", ["token", "document"])
@pytest.mark.parametrize("softcap", [None, 4.0])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_size", [None, 5])
def test_matches_the_logits_path(dtype, reduction, softcap, bias, chunk_size):
    batch = packed_rows([5, 1, 9, 3, 7, 2, 12, 4, 16], max_len=16, seed=0)  # padding, 1-doc rows
    assert (batch.doc_ids == -1).any() and (batch.labels == -100).any()
    hidden, weight, b = leaves(*batch.labels.shape, dtype=dtype, seed=1, bias=bias)
    assert_same(hidden, weight, b, batch.labels, batch.doc_ids, reduction=reduction,
                softcap=softcap, chunk_size=chunk_size, **TOL[dtype])  # fmt: skip


def test_labels_from_elsewhere_never_cross_a_boundary():
    # Targets on first tokens and on padding, repeated and non-contiguous ids: the same rules.
    labels = torch.tensor([[-100, 1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13]])
    doc_ids = torch.tensor([[7, 7, 3, 3, 3, -1, -1], [0, 0, 0, 0, 0, 0, 0]])
    for reduction in ("token", "document"):
        hidden, weight, b = leaves(2, 7, dtype=torch.float64, seed=2)
        assert_same(hidden, weight, b, labels, doc_ids, reduction=reduction, softcap=2.0,
                    chunk_size=2, **TOL[torch.float64])  # fmt: skip


@pytest.mark.parametrize("reduction", ["token", "document"])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_bf16_autocast_matches_the_autocast_logits_path(reduction, softcap):
    # Autocast runs F.linear in bf16 (hidden, weight and bias cast) and the loss upcasts to
    # float32: the chunks do the same, so the loss and the hidden gradient agree to float32
    # rounding; weight/bias gradients sum over tokens, in bf16 in the reference and in float32
    # here, so they agree to bf16 rounding.
    batch = packed_rows([30, 9, 50, 21, 17, 40], max_len=64, seed=3)
    hidden, weight, bias = leaves(*batch.labels.shape, dtype=torch.float32, seed=4)
    params = [hidden, weight, bias]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(hidden, weight, bias)
        assert logits.dtype == torch.bfloat16
        if softcap is not None:
            logits = softcap * torch.tanh(logits.float() / softcap)
        want = packed_cross_entropy(logits, batch.labels, batch.doc_ids, reduction=reduction)
        got = packed_linear_cross_entropy(
            hidden, weight, batch.labels, batch.doc_ids, reduction=reduction, bias=bias,
            softcap=softcap, chunk_size=16,
        )  # fmt: skip
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    grads_want = torch.autograd.grad(want, params)
    grads_got = torch.autograd.grad(got, params)
    for p, a, b, tol in zip(params, grads_got, grads_want, (1e-5, 1e-2, 1e-2), strict=True):
        assert a.dtype == p.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item())


def test_bf16_parameters_keep_the_loss_in_float32():
    batch = packed_rows([30, 9, 50, 21], max_len=64, seed=5)
    hidden, weight, bias = leaves(*batch.labels.shape, dtype=torch.bfloat16, seed=6)
    got = packed_linear_cross_entropy(hidden, weight, batch.labels, batch.doc_ids, bias=bias)
    want = packed_cross_entropy(F.linear(hidden, weight, bias), batch.labels, batch.doc_ids)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.backward()
    assert hidden.grad.dtype == weight.grad.dtype == bias.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("reduction", ["token", "document"])
def test_no_supervised_token_gives_zero_with_zero_gradients(reduction):
    hidden, weight, b = leaves(2, 5, dtype=torch.float32, seed=7)
    labels = torch.full((2, 5), -100)
    loss = packed_linear_cross_entropy(
        hidden, weight, labels, torch.zeros(2, 5, dtype=torch.int32), reduction=reduction, bias=b
    )
    loss.backward()
    assert loss.item() == 0.0
    for p in (hidden, weight, b):
        assert torch.count_nonzero(p.grad) == 0


def test_without_grad_gives_the_same_loss_and_a_second_backward_is_refused():
    batch = packed_rows([5, 9, 3, 7], max_len=16, seed=8)
    hidden, weight, _ = leaves(*batch.labels.shape, dtype=torch.float64, seed=9)
    loss = packed_linear_cross_entropy(hidden, weight, batch.labels, batch.doc_ids)
    with torch.no_grad():
        again = packed_linear_cross_entropy(hidden, weight, batch.labels, batch.doc_ids)
    assert again.item() == loss.item() and not again.requires_grad
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def test_scaled_loss_scales_the_gradients():  # gradient accumulation: loss / steps
    batch = packed_rows([5, 9, 3, 7], max_len=16, seed=10)
    hidden, weight, _ = leaves(*batch.labels.shape, dtype=torch.float64, seed=11)
    got = packed_linear_cross_entropy(hidden, weight, batch.labels, batch.doc_ids) / 4
    want = logits_path(hidden, weight, None, batch.labels, batch.doc_ids, reduction="token",
                       softcap=None) / 4  # fmt: skip
    for a, b in zip(torch.autograd.grad(got, [hidden, weight]),
                    torch.autograd.grad(want, [hidden, weight]), strict=True):  # fmt: skip
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.skipif(not hasattr(F, "linear_cross_entropy"), reason="torch < 2.13")
@pytest.mark.parametrize("reduction", ["token", "document"])
def test_torch_fused_path_weighs_per_token_losses_the_same(monkeypatch, reduction):
    # On CUDA (float32/float64, no softcap) torch's F.linear_cross_entropy gives the per-token
    # losses; here it is forced on CPU to check what flexpack does with them.
    monkeypatch.setattr(flexpack.loss, "_torch_fused", lambda *args: True)
    batch = packed_rows([5, 1, 9, 3, 7, 2, 12, 4], max_len=16, seed=12)
    hidden, weight, b = leaves(*batch.labels.shape, dtype=torch.float64, seed=13)
    assert_same(hidden, weight, b, batch.labels, batch.doc_ids, reduction=reduction,
                chunk_size=4, **TOL[torch.float64])  # fmt: skip


def test_torch_fused_path_is_chosen_only_where_it_reduces_the_same():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    fused = hasattr(F, "linear_cross_entropy")
    assert flexpack.loss._torch_fused(cuda, torch.float32, None) is fused
    assert not flexpack.loss._torch_fused(cuda, torch.bfloat16, None)  # bf16 per-token losses
    assert not flexpack.loss._torch_fused(cuda, torch.float32, 30.0)  # no soft-capping there
    assert not flexpack.loss._torch_fused(cpu, torch.float32, None)


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=8),
    max_len=st.integers(12, 20),
    reduction=st.sampled_from(["token", "document"]),
    softcap=st.sampled_from([None, 0.5, 3.0]),
    bias=st.booleans(),
    chunk_size=st.one_of(st.none(), st.integers(1, 40)),
    prompt_frac=st.sampled_from([0.0, 0.3, 0.9]),
    seed=st.integers(0, 2**16),
)
def test_property_matches_the_logits_path(
    lengths, max_len, reduction, softcap, bias, chunk_size, prompt_frac, seed
):
    batch = packed_rows(lengths, max_len=max_len, seed=seed, prompt_frac=prompt_frac)
    hidden, weight, b = leaves(*batch.labels.shape, dtype=torch.float64, seed=seed, bias=bias)
    assert_same(hidden, weight, b, batch.labels, batch.doc_ids, reduction=reduction,
                softcap=softcap, chunk_size=chunk_size, **TOL[torch.float64])  # fmt: skip


def tensor_peak(fn) -> int:
    """Peak of live tensor bytes during fn(), from the CPU profiler's allocation events (as
    bench/_machine.py measures it)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def test_memory_grows_by_a_small_fraction_of_the_logits():
    # fwd + bwd at the default chunk: a few (chunk, V) buffers and the gradients, never (S, V).
    B, S, Cm, Vm = 1, 4096, 16, 16384
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, S, Cm, generator=g).requires_grad_()
    weight = (torch.randn(Vm, Cm, generator=g) * 0.1).requires_grad_()
    labels = torch.randint(0, Vm, (B, S), generator=g)
    doc_ids = torch.zeros(B, S, dtype=torch.int32)

    def step():
        packed_linear_cross_entropy(hidden, weight, labels, doc_ids).backward()

    logits_bytes = B * S * Vm * 4  # 256 MiB in float32, before its gradient
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many small kernels: spare a loaded machine's thread barriers
    try:
        growth = tensor_peak(step)
    finally:
        torch.set_num_threads(threads)
    assert growth < 0.1 * logits_bytes, (growth, logits_bytes)
    assert flexpack.loss.default_chunk_size(S, Cm, Vm) == 64


def test_default_chunk_follows_the_shapes():
    chunk = flexpack.loss.default_chunk_size
    assert chunk(8192, 512, 32768) == 128  # logits chunk ~ hidden: 4M elements
    assert chunk(131072, 4096, 152064) == 2**26 // 152064  # capped at 256 MiB in float32
    assert chunk(10, 8, 37) == 10  # never more than the tokens
    assert chunk(0, 8, 37) == 1


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"hidden": "x"}, TypeError, "hidden must be a torch.Tensor"),
        ({"hidden": torch.ones(2, 6, C, dtype=torch.long)}, TypeError, "floating-point"),
        ({"hidden": torch.randn(6, C)}, ValueError, r"\(B, S, C\).*hidden\[None\]"),
        ({"weight": torch.randn(C, V)}, ValueError, r"\(V, C\).*not its transpose"),
        ({"bias": torch.randn(V + 1)}, ValueError, r"bias must have shape \(V,\)"),
        ({"weight": torch.randn(V, C, dtype=torch.float64)}, TypeError, "share a dtype"),
        ({"labels": torch.zeros(2, 5, dtype=torch.long)}, ValueError, r"labels must have shape"),
        ({"labels": torch.zeros(2, 6)}, TypeError, "labels must be an integer"),
        ({"labels": torch.full((2, 6), V)}, ValueError, rf"\[0, {V}\) or -100"),
        ({"doc_ids": [[0] * 6] * 2}, TypeError, "doc_ids must be a torch.Tensor"),
        ({"reduction": "mean"}, ValueError, "reduction must be one of"),
        ({"softcap": 0.0}, ValueError, "softcap must be a positive number"),
        ({"softcap": "30"}, TypeError, "softcap must be a number"),
        ({"chunk_size": 0}, ValueError, "chunk_size must be a positive"),
        ({"chunk_size": 2.5}, ValueError, "whole number"),
    ],
)
def test_bad_inputs_say_what_was_expected(change, error, match):
    args = {
        "hidden": torch.randn(2, 6, C),
        "weight": torch.randn(V, C),
        "labels": torch.zeros(2, 6, dtype=torch.long),
        "doc_ids": torch.zeros(2, 6, dtype=torch.int32),
    } | change
    with pytest.raises(error, match=match):
        packed_linear_cross_entropy(**args)


def test_exported_from_flexpack_and_flexpack_loss():
    assert flexpack.packed_linear_cross_entropy is flexpack.loss.packed_linear_cross_entropy
    assert "packed_linear_cross_entropy" in flexpack.__all__
    assert "packed_linear_cross_entropy" in flexpack.loss.__all__


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_on_cuda_one_device_and_few_host_syncs(fake_cuda, dtype):
    # On (faked) CUDA: float32 goes through torch's F.linear_cross_entropy where it exists,
    # bf16 through the chunks; no CPU tensor meets a CUDA one, the syncs are the label check,
    # the supervised tokens' count and (for "document") the documents' count, none per chunk.
    from fake_cuda import to_cpu, to_fake_cuda

    batch = packed_rows([5, 1, 9, 3, 7, 2, 12, 4], max_len=16, seed=14)
    hidden, weight, b = leaves(*batch.labels.shape, dtype=dtype, seed=15)
    want = logits_path(hidden, weight, b, batch.labels, batch.doc_ids, reduction="document",
                       softcap=None)  # fmt: skip
    cuda = [to_fake_cuda(t.detach()).requires_grad_() for t in (hidden, weight, b)]
    labels, doc_ids = to_fake_cuda(batch.labels), to_fake_cuda(batch.doc_ids)
    with fake_cuda.count() as syncs:
        got = packed_linear_cross_entropy(
            cuda[0], cuda[1], labels, doc_ids, bias=cuda[2], reduction="document", chunk_size=4
        )
        got.backward()
    assert got.device.type == "cuda" and cuda[1].grad.device.type == "cuda"
    assert len(syncs) <= 3, syncs
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(to_cpu(got), want.detach(), **tol)
