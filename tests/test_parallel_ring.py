"""The ring (pass-KV) schedule of context_parallel_attention under gloo at 2 and 4 CPU
processes: each rank's output and its q, k, v gradients equal single-process flexpack.attention
on the full rows at that rank's positions (float64 to 1e-9, float32 to 1e-5; GQA, softcap and
the non-causal document mask too), the stats say which schedule ran and how many bytes moved;
and ranks that disagree on the batch (different doc_ids, different S) raise a ValueError naming
what differs on every rank, instead of running wrong or aborting inside gloo."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _doc_ids(S: int = 48) -> torch.Tensor:
    """Two rows: lengths that divide nothing, padding, ids out of order."""
    lengths = [[17, 5, 19, 7], [3, 29, 11]]
    rows = []
    for row in lengths:
        ids = torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row))
        rows.append(torch.cat([ids, torch.full((48 - len(ids),), -1)]))
    d = torch.stack(rows)
    d[1, 40:44] = 7  # row 1: an id out of order after other documents
    return d[:, :S]


def _check(rank, world, dtype, atol, *, Hq=2, Hkv=2, softcap=None, causal=True,
           balance="work", block_size=4):  # fmt: skip
    import flexpack
    from flexpack.parallel import context_parallel_attention, shard_context

    d = _doc_ids()
    g = torch.Generator().manual_seed(world + Hq)
    B, S = d.shape
    q, k, v = (torch.randn(B, h, S, 8, dtype=dtype, generator=g) for h in (Hq, Hkv, Hkv))
    grad_out = torch.randn(B, Hq, S, 8, dtype=dtype, generator=g)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    mask = flexpack.masks.document(d)
    mask = mask & flexpack.masks.causal() if causal else mask
    ref = flexpack.attention(*leaves, mask, enable_gqa=Hq != Hkv, softcap=softcap)
    ref_grads = torch.autograd.grad((ref * grad_out).sum(), leaves)

    shard = shard_context(d, world, rank, balance=balance, block_size=block_size)
    ql, kl, vl = (shard.take(x, dim=2).requires_grad_() for x in (q, k, v))
    out = context_parallel_attention(
        ql, kl, vl, shard, enable_gqa=Hq != Hkv, softcap=softcap, schedule="ring",
        mask="document_causal" if causal else "document",
    )  # fmt: skip
    torch.testing.assert_close(out, shard.take(ref.detach(), dim=2), atol=atol, rtol=0)
    (out * shard.take(grad_out, dim=2)).sum().backward()
    for got, want in zip((ql, kl, vl), ref_grads, strict=True):
        torch.testing.assert_close(got.grad, shard.take(want, dim=2), atol=atol, rtol=0)
    stats = shard.stats
    assert stats.schedule == "ring" and stats.calls == {"ring": 1}
    block = 2 * B * (S // world) * Hkv * 8 * q.element_size()  # k and v of one rank
    # forward: W - 1 passes of k, v; backward: W - 1 of k, v and W of their gradients
    assert stats.bytes_sent == ((world - 1) * 2 + world) * block


def _check_disagree(rank, world):
    from flexpack.parallel import context_parallel_attention, shard_context

    d = _doc_ids()
    if rank == world - 1:
        d = d.clone()
        d[0, :3] = 9  # one rank read another batch
    shard = shard_context(d, world, rank)
    q = torch.randn(2, 2, 48 // world, 8)
    for schedule in ("ring", "all_gather"):
        with pytest.raises(ValueError, match="different doc_ids") as info:
            context_parallel_attention(q, q, q, shard, schedule=schedule)
        assert f"rank {world - 1}" in str(info.value) or rank == world - 1
    # a different S: the check is a fixed-size collective, so no rank aborts inside gloo
    S = 24 if rank == 0 else 48
    shard = shard_context(_doc_ids(S), world, rank)
    with pytest.raises(ValueError, match="S \\(tokens per row\\)"):
        shard.gather(torch.randn(2, S // world))


def _worker(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),  # a rank that fails early fails, not hangs
    )  # fmt: skip
    try:
        torch.set_num_threads(1)
        _check(rank, world, torch.float64, 1e-9)
        _check(rank, world, torch.float32, 1e-5, Hq=4, Hkv=2)
        _check(rank, world, torch.float64, 1e-9, Hq=2, Hkv=1, softcap=2.0, balance="head_tail")
        _check(rank, world, torch.float64, 1e-9, causal=False, block_size=3)
        _check_disagree(rank, world)
        dist.barrier()  # no rank tears gloo down while another is still in a collective
    finally:
        dist.destroy_process_group()


# 4 ranks already pass k, v through every hop kind (first, middle, last); 8 processes on CI's
# 2 cores cost 25 s for no new schedule.
@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_is_exact_across_gloo_ranks(world, tmp_path) -> None:
    mp.spawn(_worker, args=(world, str(tmp_path / "init")), nprocs=world, join=True)
