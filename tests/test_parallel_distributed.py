"""context_parallel_attention under a real torch.distributed group (gloo, 2 and 4 CPU processes):
each rank's output and its q, k, v gradients equal single-process flexpack.attention on the full
rows at that rank's positions (float64 to 1e-9, float32 to 1e-5, GQA and softcap too), with
the keys' gradients summed across ranks by the backward's reduce-scatter; ContextShard.gather
restores rows differentiably; and torch's own context-parallel sharding
(``_context_parallel_shard`` / ``context_parallel_unshard`` on a CPU DeviceMesh) takes the
shard's load balancer and hands every rank the same tokens as ``shard.take``."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _doc_ids() -> torch.Tensor:
    """Two rows of 48 tokens: lengths that divide nothing, padding, ids out of order."""
    lengths = [[17, 5, 19, 7], [3, 29, 11]]
    rows = []
    for row in lengths:
        ids = torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row))
        rows.append(torch.cat([ids, torch.full((48 - len(ids),), -1)]))
    d = torch.stack(rows)
    d[1, 40:44] = 7  # row 1: an id out of order after other documents
    return d


def _reference(d, dtype, Hq, Hkv, softcap, seed):
    import flexpack

    g = torch.Generator().manual_seed(seed)
    B, S = d.shape
    q, k, v = (torch.randn(B, h, S, 8, dtype=dtype, generator=g) for h in (Hq, Hkv, Hkv))
    grad_out = torch.randn(B, Hq, S, 8, dtype=dtype, generator=g)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    mask = flexpack.masks.document(d) & flexpack.masks.causal()
    out = flexpack.attention(*leaves, mask, enable_gqa=Hq != Hkv, softcap=softcap)
    grads = torch.autograd.grad((out * grad_out).sum(), leaves)
    return (q, k, v), grad_out, out.detach(), grads


def _check(rank, world, dtype, atol, Hq=2, Hkv=2, softcap=None, balance="work"):
    from flexpack.parallel import context_parallel_attention, shard_context

    d = _doc_ids()
    (q, k, v), grad_out, ref, ref_grads = _reference(d, dtype, Hq, Hkv, softcap, seed=world)
    shard = shard_context(d, world, rank, balance=balance, block_size=4)
    ql, kl, vl = (shard.take(x, dim=2).requires_grad_() for x in (q, k, v))
    out = context_parallel_attention(ql, kl, vl, shard, enable_gqa=Hq != Hkv, softcap=softcap)
    torch.testing.assert_close(out, shard.take(ref, dim=2), atol=atol, rtol=0)
    (out * shard.take(grad_out, dim=2)).sum().backward()
    for got, want in zip((ql, kl, vl), ref_grads, strict=True):
        torch.testing.assert_close(got.grad, shard.take(want, dim=2), atol=atol, rtol=0)


def _check_gather(rank, world):
    from flexpack.parallel import shard_context

    d = _doc_ids()
    shard = shard_context(d, world, rank)
    x = torch.arange(d.numel() * 3, dtype=torch.float64).reshape(*d.shape, 3)
    local = shard.take(x).requires_grad_()
    full = shard.gather(local)
    assert torch.equal(full, x)
    (full * (rank + 1)).sum().backward()  # every rank's loss reaches every share
    assert torch.equal(local.grad, torch.full_like(local, world * (world + 1) / 2))


def _check_torch_cp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._context_parallel import (
        _context_parallel_shard,
        context_parallel_unshard,
    )

    from flexpack.parallel import shard_context

    d = _doc_ids()
    shard = shard_context(d, world, rank)
    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(d.shape[0], d.shape[1], 5, generator=torch.Generator().manual_seed(3))
    (local,) = _context_parallel_shard(mesh, [x], [1], load_balancer=shard.load_balancer())
    assert torch.equal(local, shard.take(x))
    (back,) = context_parallel_unshard(mesh, [local], [1], load_balancer=shard.load_balancer())
    assert torch.equal(back, x)


def _worker(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),  # a rank that fails early fails, not hangs
    )
    try:
        _check(rank, world, torch.float64, 1e-9)
        _check(rank, world, torch.float64, 1e-9, balance="head_tail")
        _check(rank, world, torch.float32, 1e-5, Hq=4, Hkv=2)
        _check(rank, world, torch.float64, 1e-9, Hq=2, Hkv=1, softcap=2.0)
        _check_gather(rank, world)
        _check_torch_cp(rank, world)
        # no rank tears gloo down while another is still in a collective (that aborted a rank
        # with "terminate called without an active exception" under load)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_attention_is_exact_across_gloo_ranks(world, tmp_path) -> None:
    mp.spawn(_worker, args=(world, str(tmp_path / "init")), nprocs=world, join=True)
