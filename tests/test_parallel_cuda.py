"""context_parallel_attention's CUDA branch on the faked device (tests/fake_cuda.py): the shard's
tensors stay on the ids' device, the (S_l, S) BlockMask is built there from the shard's ids, the
flex kernel (a recorder here: inductor's Triton kernels do not run on CPU) receives q in shard
order, k and v of the whole row in row order, on one device, and the result and gradients equal
flexpack.attention on the full row at the shard's positions. The BlockMask is built once per
shard: later layers make no host sync at all."""

from __future__ import annotations

import pytest
import torch
from fake_cuda import is_fake_cuda, to_cpu

import flexpack
from flexpack import _attention_flex
from flexpack.parallel import context_parallel_attention, shard_context
from flexpack.parallel.attention import _local_attention
from flexpack.testing.references import dense_mask


class FlexRecorder:
    """Stands for compiled flex_attention: checks its inputs, computes masked attention with
    plain torch ops from the BlockMask's dense twin (differentiable), records each call."""

    def __init__(self, gpu) -> None:
        self.calls: list[dict] = []
        self.gpu = gpu

    def __call__(self, q, k, v, block_mask, *, scale, enable_gqa, softcap=None):
        for x in (q, k, v, block_mask.kv_num_blocks, block_mask.kv_indices):
            assert is_fake_cuda(x), "every kernel input on the CUDA device"
        B, Hq, S_l, D = q.shape
        S = k.shape[2]
        assert block_mask.seq_lengths == (S_l, S)
        assert tuple(block_mask.BLOCK_SIZE) == (128, 128)  # what inductor's CUDA configs take
        self.calls.append(dict(q=tuple(q.shape), k=tuple(k.shape), block_mask=block_mask))
        with self.gpu.paused():  # the reference's syncs are not the library's
            allowed = dense_mask(block_mask, B, 1, S_l, S, device=q.device)  # (B, 1, S_l, S)
        if enable_gqa and k.shape[1] != Hq:
            k, v = (x.repeat_interleave(Hq // k.shape[1], dim=1) for x in (k, v))
        scores = q @ k.transpose(-2, -1) * (D**-0.5 if scale is None else scale)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~allowed, float("-inf"))
        some = allowed.any(-1, keepdim=True)
        probs = torch.softmax(scores.masked_fill(~some, 0.0), -1).masked_fill(~some, 0.0)
        return probs @ v


@pytest.fixture
def recorder(monkeypatch, fake_cuda):
    rec = FlexRecorder(fake_cuda)
    monkeypatch.setattr(_attention_flex, "flex", rec)
    return rec


def _doc_ids() -> torch.Tensor:
    lengths = torch.tensor([300, 37, 520, 90, 1, 60])  # 1008 tokens, then padding
    d = torch.full((2, 1024), -1)
    d[0, :1008] = torch.repeat_interleave(torch.arange(6), lengths)
    d[1, :700] = 0
    d[1, 700:1000] = 1
    return d


@pytest.mark.parametrize("world", [1, 2, 4])
def test_cuda_branch_hands_flex_the_rows_keys_and_matches_attention(fake_cuda, recorder, world):
    d_cpu = _doc_ids()
    B, S = d_cpu.shape
    g = torch.Generator().manual_seed(world)
    q, k, v = (torch.randn(B, h, S, 16, generator=g) for h in (4, 2, 2))
    grad_out = torch.randn(B, 4, S, 16, generator=g)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    mask = flexpack.masks.document(d_cpu) & flexpack.masks.causal()
    ref = flexpack.attention(*leaves, mask, enable_gqa=True)  # CPU reference
    ref_grads = torch.autograd.grad((ref * grad_out).sum(), leaves)

    d = d_cpu.to("cuda")
    qf, kf, vf, gf = (x.to("cuda") for x in (q, k, v, grad_out))
    k_grad, v_grad = torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(world):
        shard = shard_context(d, world, rank)
        for t in (shard.index, shard.doc_ids, shard.position_ids, shard.row_doc_ids):
            assert is_fake_cuda(t)
        ql = shard.take(qf, dim=2).requires_grad_()
        kl, vl = kf.clone().requires_grad_(), vf.clone().requires_grad_()
        if world == 1:  # the public call: no process group for one rank
            out = context_parallel_attention(ql, kl, vl, shard, enable_gqa=True)
        else:  # the local part of the call, k and v given whole (the gather is gloo-tested)
            out = _local_attention(ql, kl, vl, shard, mask="document_causal", scale=None,
                                   enable_gqa=True, softcap=None)  # fmt: skip
        assert is_fake_cuda(out) and out.shape == ql.shape
        with fake_cuda.count() as syncs:  # a second layer: the BlockMask is cached on the shard
            _local_attention(ql, kl, vl, shard, mask="document_causal", scale=None,
                             enable_gqa=True, softcap=None)  # fmt: skip
        assert syncs == [], syncs
        idx = to_cpu(shard.index)
        torch.testing.assert_close(to_cpu(out), _take(ref.detach(), idx), atol=1e-5, rtol=0)
        gq, gk, gv = torch.autograd.grad((out * shard.take(gf, dim=2)).sum(), (ql, kl, vl))
        torch.testing.assert_close(to_cpu(gq), _take(ref_grads[0], idx), atol=1e-5, rtol=0)
        k_grad, v_grad = k_grad + to_cpu(gk), v_grad + to_cpu(gv)
    torch.testing.assert_close(k_grad, ref_grads[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(v_grad, ref_grads[2], atol=1e-5, rtol=0)
    assert len(recorder.calls) == 2 * world
    # one BlockMask per shard, reused by the second layer
    assert recorder.calls[0]["block_mask"] is recorder.calls[1]["block_mask"]


def _take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """(B, H, S, D) at positions idx (B, S_l) -> (B, H, S_l, D)."""
    return torch.gather(x, 2, idx[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))


def test_shard_plan_syncs_once_per_batch(fake_cuda):
    """One device-to-host copy of the ids (the plan runs in numpy); the shard's tensors go back
    in one pinned, non-blocking copy, which does not sync."""
    d = _doc_ids().to("cuda")
    with fake_cuda.count() as syncs:
        shard = shard_context(d, 4, 1)
    assert len(syncs) == 1 and "device->host" in str(syncs[0]), syncs
    assert is_fake_cuda(shard.index) and shard.index.dtype == torch.int64


def test_float64_on_cuda_takes_sdpa_not_flex(fake_cuda, recorder):
    d = _doc_ids()[:, :256].to("cuda")
    shard = shard_context(d, 2, 0)
    q = torch.randn(2, 2, 128, 8, dtype=torch.float64).to("cuda")
    k = v = torch.randn(2, 2, 256, 8, dtype=torch.float64).to("cuda")
    out = _local_attention(q, k, v, shard, mask="document_causal", scale=None,
                           enable_gqa=False, softcap=None)  # fmt: skip
    assert is_fake_cuda(out) and recorder.calls == []
