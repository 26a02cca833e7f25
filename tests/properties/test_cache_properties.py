"""The per-tensor caches (flexpack._tensor_cache) against every write a user can make.

One tensor of document ids is rewritten between calls, each time by one of the writes a training
loop makes (a collate buffer refilled through numpy, ``.data`` writes and reassignment, in-place
ops, a freed tensor whose ``id`` a new one takes, inference tensors written inside
``torch.inference_mode``), and every mask, BlockMask and attention output built from it after the
write must equal the dense reference of the ids it holds now: never those of an earlier batch.
"""

from __future__ import annotations

import gc
import itertools

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flexpack
from flexpack import masks as fm
from flexpack.testing import strategies as fst
from flexpack.testing.references import dense_mask, reference_attention

WRITES = ("numpy", "data_setitem", "data_assign", "in_place", "same_id", "inference")


def _twin(d: np.ndarray, causal: bool) -> torch.Tensor:
    """(B, 1, S, S): q attends kv iff same real document (and kv <= q when causal)."""
    S = d.shape[-1]
    out = (d[:, :, None] == d[:, None, :]) & (d[:, :, None] >= 0)
    if causal:
        out &= np.arange(S)[:, None] >= np.arange(S)[None, :]
    return torch.from_numpy(out[:, None])


def _check(ids: torch.Tensor, want: np.ndarray, qkv) -> None:
    q, k, v = qkv
    for causal in (True, False):
        mask = fm.document(ids) & fm.causal() if causal else fm.document(ids)
        ref = _twin(want, causal)
        assert torch.equal(dense_mask(mask), ref)
        assert torch.equal(dense_mask(mask.block_mask(block_size=4)), ref)
        if causal:
            out = flexpack.attention(q, k, v, mask)
            torch.testing.assert_close(out, reference_attention(q, k, v, ref))


@settings(max_examples=15)
@given(
    first=fst.doc_ids(max_batch_size=2, max_seq_len=12, contiguous=False, dtype=torch.int64),
    data=st.data(),
)
def test_every_write_between_calls_is_seen(first, data):
    B, S = first.shape
    g = torch.Generator().manual_seed(0)
    qkv = tuple(torch.randn(B, 2, S, 4, dtype=torch.float64, generator=g) for _ in range(3))
    later = fst.doc_ids(batch_size=B, seq_len=S, contiguous=False, dtype=torch.int64)
    writes = data.draw(st.lists(st.sampled_from(WRITES), min_size=1, max_size=4), label="writes")
    buf = first.numpy().copy()
    ids = torch.from_numpy(buf)  # a collate buffer, as DataLoader workers hand out
    _check(ids, buf, qkv)
    for step, how in zip(itertools.count(), writes):
        new = data.draw(later, label=f"ids {step} ({how})").numpy()
        if how == "numpy":
            if not np.shares_memory(ids.numpy(), buf):
                buf = ids.numpy()
            buf[:] = new
        elif how == "data_setitem":
            ids.data[...] = torch.from_numpy(new)
        elif how == "data_assign":
            ids.data = torch.from_numpy(new.copy())
        elif how == "in_place":
            ids.copy_(torch.from_numpy(new))
        elif how == "same_id":
            del ids
            gc.collect()
            ids = torch.from_numpy(new.copy())  # often at the freed tensor's id
        else:
            with torch.inference_mode():
                ids = torch.from_numpy(new.copy()).clone()  # an inference tensor
                _check(ids, new, qkv)
                ids[...] = torch.from_numpy(new[:, ::-1].copy())  # written in place
                new = new[:, ::-1]
                _check(ids, new, qkv)
            ids = torch.from_numpy(new.copy())
        _check(ids, new, qkv)
