"""packed_cross_entropy against an unpacked reference: each sample's own F.cross_entropy."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import flexpack
from flexpack import packed_cross_entropy

V = 11


def make_samples(lengths, *, seed, prompt_frac=0.3):
    """Per-sample leaves: logits (L, V) requiring grad and labels (L,) with some -100 prompts."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for n in lengths:
        logits = torch.randn(n, V, generator=g, dtype=torch.float64).requires_grad_()
        labels = torch.randint(0, V, (n,), generator=g)
        prompt = int(n * prompt_frac)
        labels[:prompt] = -100  # a prompt without targets, as in SFT
        samples.append((logits, labels))
    return samples


def pack_rows(samples, rows, max_len):
    """Pack samples (row assignment given) the way the packer does: -100 on first tokens."""
    B = len(rows)
    pad_logits = torch.randn(B, max_len, V, dtype=torch.float64) * 100  # must never count
    logits_rows, labels, doc_ids = [], torch.full((B, max_len), -100), torch.full((B, max_len), -1)
    for r, members in enumerate(rows):
        parts, pos = [], 0
        for doc, i in enumerate(members):
            lg, lb = samples[i]
            n = len(lb)
            parts.append(lg)
            labels[r, pos : pos + n] = lb
            labels[r, pos] = -100
            doc_ids[r, pos : pos + n] = doc
            pos += n
        parts.append(pad_logits[r, pos:])
        logits_rows.append(torch.cat(parts))
    return torch.stack(logits_rows), labels, doc_ids.to(torch.int32)


def reference(samples, reduction):
    """Unpacked: each sample alone, F.cross_entropy on its own shifted labels."""
    sums, counts = [], []
    for logits, labels in samples:
        target = labels[1:]
        n = int((target != -100).sum())
        if n == 0:
            continue
        sums.append(F.cross_entropy(logits[:-1], target, ignore_index=-100, reduction="sum"))
        counts.append(n)
    if reduction == "token":
        return torch.stack(sums).sum() / sum(counts)
    return torch.stack([s / c for s, c in zip(sums, counts, strict=True)]).mean()


def check_against_reference(lengths, rows, max_len, reduction, seed=0):
    samples = make_samples(lengths, seed=seed)
    logits, labels, doc_ids = pack_rows(samples, rows, max_len)
    got = packed_cross_entropy(logits, labels, doc_ids, reduction=reduction)
    want = reference(samples, reduction)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    leaves = [lg for lg, _ in samples]
    grads_got = torch.autograd.grad(got, leaves, allow_unused=True, materialize_grads=True)
    grads_want = torch.autograd.grad(want, leaves, allow_unused=True, materialize_grads=True)
    for a, b in zip(grads_got, grads_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("reduction", ["token", "document"])
def test_matches_unpacked_reference(reduction):
    lengths = [5, 1, 9, 3, 7, 2, 12, 4]
    rows = [[0, 1, 2], [3, 4, 5], [6], [7]]
    check_against_reference(lengths, rows, max_len=16, reduction=reduction)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 10), min_size=1, max_size=8),
    per_row=st.integers(1, 4),
    reduction=st.sampled_from(["token", "document"]),
    seed=st.integers(0, 2**16),
)
def test_property_matches_unpacked_reference(lengths, per_row, reduction, seed):
    rows = [list(range(i, min(i + per_row, len(lengths)))) for i in range(0, len(lengths), per_row)]
    max_len = max(sum(lengths[i] for i in r) for r in rows) + (seed % 3)
    samples = make_samples(lengths, seed=seed)
    if all(int((lb[1:] != -100).sum()) == 0 for _, lb in samples):
        got = packed_cross_entropy(*pack_rows(samples, rows, max_len), reduction=reduction)
        assert got.item() == 0.0
        return
    check_against_reference(lengths, rows, max_len, reduction, seed=seed)


def test_document_reduction_weighs_documents_equally():
    # A long document with loss ~0 and a short one with loss log(V): "document" gives the plain
    # mean of the two per-document means; "token" is dominated by the long one.
    logits = torch.zeros(1, 12, V)
    labels = torch.full((1, 12), -100)
    labels[0, 1:10] = 3
    logits[0, 0:9, 3] = 100.0  # tokens 0..8 predict 3 perfectly
    labels[0, 11] = 5  # document 1: tokens 10, 11, uniform prediction
    doc_ids = torch.tensor([[0] * 10 + [1] * 2])
    token = packed_cross_entropy(logits, labels, doc_ids, reduction="token")
    document = packed_cross_entropy(logits, labels, doc_ids, reduction="document")
    assert math.isclose(token.item(), math.log(V) / 10, rel_tol=1e-5)
    assert math.isclose(document.item(), math.log(V) / 2, rel_tol=1e-5)


def test_never_predicts_across_a_boundary_even_with_labels_there():
    # Labels from elsewhere may have a target on a document's first token: it must not count.
    logits = torch.randn(1, 6, V)
    labels = torch.tensor([[-100, 1, 2, 3, 4, 5]])
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, -1]])
    got = packed_cross_entropy(logits, labels, doc_ids)
    want = F.cross_entropy(logits[0, [0, 1, 3]], torch.tensor([1, 2, 4]))
    torch.testing.assert_close(got, want)


def test_arbitrary_repeated_ids_are_documents_per_row():
    # Ids need not be 0..n-1: row 0 uses 7 and 3, row 1 reuses 7 for another document.
    logits = torch.randn(2, 4, V, dtype=torch.float64)
    labels = torch.tensor([[-100, 1, -100, 2], [-100, 3, 4, 5]])
    doc_ids = torch.tensor([[7, 7, 3, 3], [7, 7, 7, 7]])
    got = packed_cross_entropy(logits, labels, doc_ids, reduction="document")
    d0 = F.cross_entropy(logits[0, 0:1], labels[0, 1:2])
    d1 = F.cross_entropy(logits[0, 2:3], labels[0, 3:4])
    d2 = F.cross_entropy(logits[1, 0:3], labels[1, 1:4])
    torch.testing.assert_close(got.double(), (d0 + d1 + d2) / 3)


@pytest.mark.parametrize("reduction", ["token", "document"])
def test_no_supervised_token_gives_zero_with_gradient(reduction):
    logits = torch.randn(2, 5, V, requires_grad=True)
    labels = torch.full((2, 5), -100)
    doc_ids = torch.zeros(2, 5, dtype=torch.int32)
    loss = packed_cross_entropy(logits, labels, doc_ids, reduction=reduction)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(logits.grad) == 0


def test_bf16_logits_are_upcast():
    logits = torch.randn(2, 8, V)
    labels = torch.randint(0, V, (2, 8))
    doc_ids = torch.zeros(2, 8, dtype=torch.int64)
    got = packed_cross_entropy(logits.bfloat16(), labels, doc_ids)
    want = packed_cross_entropy(logits.bfloat16().float(), labels, doc_ids)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    ("logits", "labels", "doc_ids", "kwargs", "error", "match"),
    [
        (torch.randn(2, 4), torch.zeros(2, 4).long(), torch.zeros(2, 4).long(), {}, ValueError,
         "logits must be a floating-point"),
        (torch.randn(2, 4, V), torch.zeros(2, 4), torch.zeros(2, 4).long(), {}, TypeError,
         "labels must be an integer"),
        (torch.randn(2, 4, V), torch.zeros(2, 4).long(), torch.zeros(2, 4).bool(), {}, TypeError,
         "doc_ids must be an integer"),
        (torch.randn(2, 4, V), torch.zeros(2, 3).long(), torch.zeros(2, 4).long(), {}, ValueError,
         r"labels must have shape \(B, S\) = \(2, 4\)"),
        (torch.randn(2, 4, V), torch.zeros(2, 4).long(), torch.zeros(4).long(), {}, ValueError,
         "doc_ids must have shape"),
        (torch.randn(2, 4, V), torch.full((2, 4), V), torch.zeros(2, 4).long(), {}, ValueError,
         rf"in \[0, {V}\) or -100.*got {V}"),
        (torch.randn(2, 4, V), torch.full((2, 4), -1), torch.zeros(2, 4).long(), {}, ValueError,
         "got -1"),
        (torch.randn(2, 4, V), torch.zeros(2, 4).long(), torch.zeros(2, 4).long(),
         {"reduction": "mean"}, ValueError, "reduction must be one of"),
        (torch.randn(2, 4, V), [[0] * 4] * 2, torch.zeros(2, 4).long(), {}, TypeError,
         "labels must be a torch.Tensor"),
        (torch.randn(2, 4, V), torch.zeros(2, 4, device="meta").long(), torch.zeros(2, 4).long(),
         {}, ValueError, "labels is on meta"),
    ],
)  # fmt: skip
def test_bad_input(logits, labels, doc_ids, kwargs, error, match):
    with pytest.raises(error, match=match):
        packed_cross_entropy(logits, labels, doc_ids, **kwargs)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint32, torch.uint64])
def test_packed_cross_entropy_takes_unsigned_doc_ids(dtype):
    # uint32/uint64 doc ids were a NotImplementedError ("ge_cpu") from inside torch.
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 6, 5, generator=g)
    labels = torch.tensor([[-100, 1, 2, -100, 3, 4]])
    d = torch.tensor([[0, 0, 0, 7, 7, 7]])
    for reduction in ("token", "document"):
        want = flexpack.packed_cross_entropy(logits, labels, d, reduction=reduction)
        got = flexpack.packed_cross_entropy(logits, labels, d.to(dtype), reduction=reduction)
        torch.testing.assert_close(got, want)
    if dtype == torch.uint64:
        with pytest.raises(ValueError, match=r"2\*\*63"):
            flexpack.packed_cross_entropy(logits, labels, torch.full((1, 6), 2**63, dtype=dtype))
