"""CUDA decisions, tested on CPU: compile counts, mask devices, dispatch with the device faked.

No GPU runs these tests. What they check is plain Python: which path a call takes, which guard a
recompile names, which tensors a mask reads and where, and how many host syncs a call makes.
Compiles use dynamo's ``CompileCounter`` backend (no inductor), so they take milliseconds.
"""

from __future__ import annotations

import torch
from torch._dynamo.testing import CompileCounter
from torch.nn.attention.flex_attention import flex_attention

from flexpack import masks
from flexpack.testing import references

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
