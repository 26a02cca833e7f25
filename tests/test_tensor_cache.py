"""The per-tensor caches (flexpack._tensor_cache) on the writes a user makes between two calls.

One tensor of document ids is written between two calls (through a numpy view, through ``.data``,
by reassigning ``.data``, in place under ``torch.inference_mode``, on a tensor subclass), and the
masks, BlockMasks and attention built from it after the write must be those of the ids it holds
now: the dense twin of those ids and float64 attention under it. On CUDA a stamp compares no
content (that would be a host sync per layer). tests/properties/test_cache_properties.py draws
the writes at random.
"""

from __future__ import annotations

import numpy as np
import torch
from _rows import dense_document_causal as _twin
from _rows import qkv as _qkv

import flexpack
from flexpack import masks as fm
from flexpack.testing.references import dense_mask, reference_attention


def _check(ids: torch.Tensor, want_ids) -> None:
    """The mask and attention built from ``ids`` now are those of ``want_ids``."""
    B, S = ids.shape
    mask = fm.document(ids) & fm.causal()
    want = _twin(want_ids)
    assert torch.equal(dense_mask(mask), want)
    assert torch.equal(dense_mask(mask.block_mask(block_size=2)), want)
    q, k, v = _qkv(B, S)
    got = flexpack.attention(q, k, v, mask)
    torch.testing.assert_close(got, reference_attention(q, k, v, want))


# ----------------------------------------------------------------------------- stale caches

FIRST, SECOND = [[0, 0, 0, 0]], [[0, 0, 1, 1]]


def test_a_write_through_a_numpy_view_is_seen():
    # A collate buffer reused through numpy: token 2 attended to document 0.
    buf = np.array(FIRST)
    ids = torch.from_numpy(buf)
    _check(ids, FIRST)
    buf[:] = SECOND
    _check(ids, SECOND)


def test_a_write_through_dot_data_is_seen():
    ids = torch.tensor(FIRST)
    _check(ids, FIRST)
    ids.data[:, 2:] = 1  # .data has its own version counter: ids._version stays
    _check(ids, SECOND)


def test_dot_data_reassignment_is_seen():
    ids = torch.tensor(FIRST)
    _check(ids, FIRST)
    ids.data = torch.tensor(SECOND)
    _check(ids, SECOND)


def test_block_mask_functions_see_numpy_writes():
    from flexpack.block_mask import packed_layout

    buf = np.array([[0, 0, 1, 1]])
    ids = torch.from_numpy(buf)
    assert packed_layout(ids)
    buf[:] = [[0, 1, 0, 1]]  # no longer a packed layout: the order facts must be derived again
    assert not packed_layout(ids)


def test_every_mask_builds_and_runs_under_inference_mode():
    # RuntimeError: Inference tensors do not track version counter.
    with torch.inference_mode():
        ids = torch.tensor([[0, 0, 1, 1, -1]])
        _check(ids, ids.tolist())
        m = fm.document(ids) & fm.sliding_window(1) | ~fm.padding(ids)
        assert m.to("meta").doc_ids.device.type == "meta"
        assert torch.equal(dense_mask(m.block_mask(block_size=2)), dense_mask(m))
        flexpack.document_causal_mask(ids, block_size=2)
        ids[0, 1] = 1  # inference tensors can be written in place inside inference mode
        _check(ids, [[0, 1, 1, 1, -1]])


def test_mask_to_sees_a_numpy_write():
    buf = np.array([[0, 0, 1, 1]])
    m = fm.document(torch.from_numpy(buf.copy()))
    src = m.doc_ids
    moved = m.to("meta")
    src.data[0, 0] = 5  # the snapshot itself, written without a version bump
    assert m.to("meta") is not moved


def test_clear_caches_forgets_everything():
    ids = torch.tensor(FIRST)
    _check(ids, FIRST)
    flexpack.clear_caches()
    _check(ids, FIRST)


class _Ids(torch.Tensor):
    """A tensor subclass a data pipeline might hand over as doc ids."""


def test_a_write_through_data_on_a_tensor_subclass_is_seen():
    """The cached mask was reused after ``ids.data[...] = ...`` on a subclass (0.79 off)."""
    from flexpack.integrations.transformers import flexpack_attention_forward
    from flexpack.testing.references import reference_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64, generator=g) for _ in range(3))
    ids = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 0]]).as_subclass(_Ids)
    module = torch.nn.Module()
    flexpack_attention_forward(module, q, k, v, None, doc_ids=ids)
    ids.data[0, 4:] = 1  # no version bump
    got, _ = flexpack_attention_forward(module, q, k, v, None, doc_ids=ids)
    d = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    allowed = (d[:, None] == d[None, :]) & torch.ones(8, 8, dtype=torch.bool).tril()
    want = reference_attention(q, k, v, allowed[None, None])
    torch.testing.assert_close(got.transpose(1, 2), want)


# ----------------------------------------------------------------------------- CUDA stamps


def test_stamps_of_cuda_tensors_make_no_host_sync(fake_cuda):
    # On CUDA a content comparison would be a sync per layer: stamps trust version and storage.
    from flexpack._tensor_cache import PerTensor

    ids = torch.tensor([[0, 0, 1, 1]], device="cuda")
    cache = PerTensor()
    with fake_cuda.count() as syncs:
        first = cache.get(ids, lambda: object())
        assert cache.get(ids, lambda: object()) is first
        ids.add_(1)  # an in-place op bumps the version: seen without a sync
        assert cache.get(ids, lambda: object()) is not first
    assert syncs == []  # (`.data = other` is seen by data_ptr, which the fake reports as 0)
