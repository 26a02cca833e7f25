"""The ring (pass-KV) schedule of :func:`flexpack.parallel.context_parallel_attention`.

K/V blocks travel around the group in W - 1 point-to-point passes while the queries stay; each
block's partial output merges by its log-sum-exp, and the backward passes the blocks again with
their gradient accumulators (:class:`_RingAttention`, its own autograd Function). K/V memory
O(S / W) per rank. Tiles come from the shard's plan (:func:`_ring_plan`, per source rank) and
run through torch's CPU flash kernel, or the matmul path (softcap, CUDA).

Shape legend: B rows, S tokens per row, W world size, S_l = S // W tokens per rank, Hq / Hkv
query / key-value heads, G = Hq // Hkv, D head dimension, Tq / Tk real queries / keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from flexpack.layout import _check_runs
from flexpack.parallel.planning import _token_work
from flexpack.parallel.sharding import ContextShard, ContextStats, _cached, _heads


@dataclass(frozen=True)
class _RingPlan:
    """Tiles of one rank's ring: its queries and every source rank's keys regrouped by
    (row, document, position); tile (q0, q1, k0, k1, masked) of source s attends queries
    q0:q1 (of ``query_perm``) to keys k0:k1 (of ``key_perm[s]``), with the causal mask
    ``key_pos <= query_pos`` where ``masked`` (else every pair is allowed)."""

    query_perm: Tensor  # (Tq,) positions in the flattened (B * S_l,) local queries
    query_pos: Tensor  # (Tq,) position of each in its document
    key_perm: list[Tensor]  # per source rank: (Tk_s,) positions in its (B * S_l,) keys
    key_pos: list[Tensor]
    tiles: list[list[tuple[int, int, int, int, bool]]]  # per source rank
    heads: int = 1


_TILE_ROWS = 256  # queries per causal tile: bounds its mask to 256 x (keys between them)
_TILE_ELEMENTS = 1 << 19  # score elements per step of the math path (softcap, not CPU)


def _groups(b: np.ndarray, doc: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, ...]:
    """Real tokens sorted by (row, doc, pos): the order and each (row, doc) run's bounds."""
    order = np.lexsort((pos, doc, b))
    key = b[order] * (1 << 40) + doc[order]
    start = np.flatnonzero(np.r_[True, key[1:] != key[:-1]]) if key.size else np.zeros(0, int)
    end = np.r_[start[1:], key.size].astype(np.int64)
    return order, key[start] if key.size else key, start, end


def _ring_plan(shard: ContextShard, causal: bool, heads: int, device: torch.device) -> _RingPlan:
    d = shard.row_doc_ids.cpu().numpy()
    _check_runs(torch.from_numpy(d), "shard.row_doc_ids")  # a shard built by hand: the host copy
    gathered = shard.gathered_index.cpu().numpy()
    B, S = d.shape
    W, per = shard.world_size, S // shard.world_size
    pos_rows = np.stack([_token_work(d[b])[1] for b in range(B)]) if B else d
    rows = np.arange(B)[:, None]

    def side(rank: int):
        idx = gathered[:, rank * per : (rank + 1) * per]
        ids, pos = d[rows, idx].reshape(-1), pos_rows[rows, idx].reshape(-1)
        b = np.repeat(np.arange(B), per)
        real = np.flatnonzero(ids >= 0)
        order, keys, start, end = _groups(b[real], ids[real], pos[real])
        return real[order], pos[real][order], keys, start, end

    q_perm, q_pos, q_keys, q_start, q_end = side(shard.rank)
    key_perm, key_pos, tiles = [], [], []
    for src in range(W):
        k_perm, k_pos, k_keys, k_start, k_end = side(src)
        key_perm.append(torch.from_numpy(k_perm.astype(np.int64)).to(device))
        key_pos.append(torch.from_numpy(k_pos.astype(np.int64)).to(device))
        found = np.searchsorted(k_keys, q_keys)
        mine = []
        for g in range(q_keys.size):
            j = found[g]
            if j >= k_keys.size or k_keys[j] != q_keys[g]:
                continue  # this document has no key on rank src
            k0, k1 = int(k_start[j]), int(k_end[j])
            kp = k_pos[k0:k1]
            q0, q1 = int(q_start[g]), int(q_end[g])
            if not causal:
                mine.append((q0, q1, k0, k1, False))
                continue
            for a in range(q0, q1, _TILE_ROWS):
                b_ = min(a + _TILE_ROWS, q1)
                n = int(np.searchsorted(kp, q_pos[b_ - 1], side="right"))  # keys <= last query
                full = int(np.searchsorted(kp, q_pos[a], side="right"))  # keys <= first query
                if full:  # every query of the chunk sees these: no mask
                    mine.append((a, b_, k0, k0 + full, False))
                if n > full:  # the few keys between the chunk's queries: masked
                    mine.append((a, b_, k0 + full, k0 + n, True))
        tiles.append(mine)
    as_t = lambda a: torch.from_numpy(a.astype(np.int64)).to(device)
    return _RingPlan(as_t(q_perm), as_t(q_pos), key_perm, key_pos, tiles, heads)


def _tile_scores(qt: Tensor, kt: Tensor, scale: float, softcap: float | None):
    """qt (Hkv, G*m, D), kt (Hkv, n, D) -> scores (Hkv, G*m, n) and tanh for softcap."""
    s = torch.matmul(qt, kt.transpose(-1, -2)) * scale
    if softcap is None:
        return s, None
    t = torch.tanh(s / softcap)
    return t * softcap, t


def _tile_allowed(plan: _RingPlan, src: int, tile: tuple) -> Tensor:
    """(m, n) bool: the causal mask of a masked tile (key position <= query position)."""
    q0, q1, k0, k1, _ = tile
    return plan.key_pos[src][None, k0:k1] <= plan.query_pos[q0:q1, None]


def _fold(x: Tensor, Hkv: int) -> Tensor:
    """(Hq, m, D) -> (Hkv, G * m, D): query heads of one kv head side by side."""
    Hq, m, D = x.shape
    return x.reshape(Hkv, (Hq // Hkv) * m, D)


def _unfold(x: Tensor, Hq: int) -> Tensor:
    Hkv, Gm, D = x.shape
    return x.reshape(Hq, Gm * Hkv // Hq, D)


def _use_kernel(x: Tensor, softcap: float | None) -> bool:
    """The CPU flash kernel returns the LSE and has a backward that takes it: the ring's tiles
    run through it (memory-efficient, in C++) except with softcap, which it does not take."""
    return x.device.type == "cpu" and softcap is None and _cpu_flash() is not None


def _cpu_flash():
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _kernel_tile(qh, kh, vh, plan, src, tile, G):
    """Inputs of the CPU flash kernel for one tile: (1, Hq, m, D) q, (1, Hq, n, D) k, v (kv
    heads repeated for GQA) and the additive mask or None."""
    q0, q1, k0, k1, masked = tile
    qt = qh[None, :, q0:q1]
    kt, vt = kh[None, :, k0:k1], vh[None, :, k0:k1]
    if G > 1:
        kt, vt = kt.repeat_interleave(G, dim=1), vt.repeat_interleave(G, dim=1)
    mask = None
    if masked:
        allowed = _tile_allowed(plan, src, tile)
        mask = torch.zeros(allowed.shape, dtype=qh.dtype, device=qh.device)
        mask.masked_fill_(~allowed, -math.inf)
    return qt, kt, vt, mask


def _merge(acc: Tensor, lse: Tensor, q0: int, q1: int, o: Tensor, t_lse: Tensor) -> None:
    """Merge a partial (Hq, m, D) output and its (Hq, m) LSE into rows q0:q1, in place."""
    old = lse[:, q0:q1]
    new = torch.logaddexp(old, t_lse)
    new_safe = torch.where(torch.isfinite(new), new, 0.0)
    a, b = torch.exp(old - new_safe), torch.exp(t_lse - new_safe)
    acc[:, q0:q1] = acc[:, q0:q1] * a[..., None] + o * b[..., None]
    lse[:, q0:q1] = new


def _ring_block_forward(qh, kv, plan, src, acc, lse, *, scale, softcap) -> bool:
    """Merge this rank's queries' attention to one K/V block into (acc, lse) by LSE.

    qh (Hq, Tq, D) permuted queries; kv (2, Hkv, B * S_l, D) the block in its rank's order;
    acc (Hq, Tq, D), lse (Hq, Tq) accumulators (compute dtype), updated in place. Returns
    False when no tile of this block meets the queries."""
    tiles = plan.tiles[src]
    if not tiles:
        return False
    Hq, Hkv = qh.shape[0], kv.shape[1]
    G = Hq // Hkv
    kh, vh = (kv[i].index_select(1, plan.key_perm[src]) for i in range(2))  # (Hkv, Tk, D)
    kernel = _use_kernel(qh, softcap)
    for tile in tiles:
        q0, q1, k0, k1, masked = tile
        if kernel:
            qt, kt, vt, mask = _kernel_tile(qh, kh, vh, plan, src, tile, G)
            o, t_lse = _cpu_flash()(qt, kt, vt, 0.0, False, attn_mask=mask, scale=scale)
            o, t_lse = o[0], t_lse[0]
            if masked:  # the kernel gives rows with no allowed key LSE 0, not -inf
                sees = plan.key_pos[src][k0] <= plan.query_pos[q0:q1]
                t_lse = torch.where(sees, t_lse, -math.inf)
            _merge(acc, lse, q0, q1, o, t_lse)
            continue
        step = max(1, _TILE_ELEMENTS // max(1, Hq * (k1 - k0)))
        for a in range(q0, q1, step):
            sub = (a, min(a + step, q1), k0, k1, masked)
            s, _ = _tile_scores(_fold(qh[:, sub[0] : sub[1]], Hkv), kh[:, k0:k1], scale, softcap)
            if masked:
                s = s.masked_fill(~_tile_allowed(plan, src, sub).repeat(G, 1), -math.inf)
            t_lse = torch.logsumexp(s, dim=-1)  # (Hkv, G*m); -inf on rows with no key here
            safe = torch.where(torch.isfinite(t_lse), t_lse, 0.0)
            o = torch.matmul(torch.exp(s - safe[..., None]), vh[:, k0:k1])  # (Hkv, G*m, D)
            _merge(acc, lse, sub[0], sub[1], _unfold(o, Hq), _unfold(t_lse[..., None], Hq)[..., 0])
    return True


def _ring_block_backward(qh, doh, acc, lse, delta, kv, plan, src, dq, *, scale, softcap):
    """Gradients of this rank's loss w.r.t. one K/V block (and its part of dq, in place).

    qh, doh, acc (Hq, Tq, D): queries, output gradient and merged output; lse, delta (Hq, Tq)
    of the merged forward; kv (2, Hkv, B*S_l, D). Returns (2, Hkv, B*S_l, D) dk, dv in the
    block's own order, or None (no tile)."""
    tiles = plan.tiles[src]
    if not tiles:
        return None
    Hq, Hkv = qh.shape[0], kv.shape[1]
    G = Hq // Hkv
    perm = plan.key_perm[src]
    kh, vh = (kv[i].index_select(1, perm) for i in range(2))
    dk, dv = torch.zeros_like(kh), torch.zeros_like(vh)
    kernel = _use_kernel(qh, softcap)
    backward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    for tile in tiles:
        q0, q1, k0, k1, masked = tile
        if kernel:
            qt, kt, vt, mask = _kernel_tile(qh, kh, vh, plan, src, tile, G)
            gq, gk, gv = backward(
                doh[None, :, q0:q1], qt, kt, vt, acc[None, :, q0:q1], lse[None, :, q0:q1],
                0.0, False, attn_mask=mask, scale=scale,
            )  # fmt: skip
            dq[:, q0:q1] += gq[0]
            n = k1 - k0
            dk[:, k0:k1] += gk[0].view(Hkv, G, n, -1).sum(1)
            dv[:, k0:k1] += gv[0].view(Hkv, G, n, -1).sum(1)
            continue
        step = max(1, _TILE_ELEMENTS // max(1, Hq * (k1 - k0)))
        for a in range(q0, q1, step):
            sub = (a, min(a + step, q1), k0, k1, masked)
            r0, r1 = sub[0], sub[1]
            qt, dot = _fold(qh[:, r0:r1], Hkv), _fold(doh[:, r0:r1], Hkv)
            s, t = _tile_scores(qt, kh[:, k0:k1], scale, softcap)
            p = torch.exp(s - _fold(lse[:, r0:r1, None], Hkv))  # (Hkv, G*m, n)
            if masked:
                p = p.masked_fill(~_tile_allowed(plan, src, sub).repeat(G, 1), 0.0)
            dv[:, k0:k1] += torch.matmul(p.transpose(-1, -2), dot)
            dp = torch.matmul(dot, vh[:, k0:k1].transpose(-1, -2))
            ds = p * (dp - _fold(delta[:, r0:r1, None], Hkv))
            if t is not None:
                ds = ds * (1 - t * t)
            ds = ds * scale
            dq[:, r0:r1] += _unfold(torch.matmul(ds, kh[:, k0:k1]), Hq)
            dk[:, k0:k1] += torch.matmul(ds.transpose(-1, -2), qt)
    out = torch.zeros_like(kv)
    out[0].index_copy_(1, perm, dk)
    out[1].index_copy_(1, perm, dv)
    return out


class _Ring:
    """Point-to-point passes around the group: send to rank + 1, receive from rank - 1, with
    the next block in flight while the current one is computed (isend / irecv)."""

    def __init__(self, group: Any, shard: ContextShard, stats: ContextStats) -> None:
        W, r = shard.world_size, shard.rank
        to_global = lambda x: x if group is None else torch.distributed.get_global_rank(group, x)
        self.next, self.prev = to_global((r + 1) % W), to_global((r - 1) % W)
        self.group, self.stats = group, stats

    def start(self, send: Tensor, tag: int) -> tuple[Tensor, list]:
        recv = torch.empty_like(send)
        dist = torch.distributed
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]  # fmt: skip
        self.stats.bytes_sent += send.numel() * send.element_size()
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works: list) -> None:
        for w in works:
            w.wait()


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _RingAttention(torch.autograd.Function):
    """Ring attention of this rank's queries: K/V blocks pass W - 1 times around the group.

    Forward: at step i this rank holds the block of rank (r - i) mod W, sends it on to r + 1
    while attending its queries to it, and merges the partial outputs by their log-sum-exp.
    Backward (as ring-flash-attention and torch's context parallel do): the blocks travel
    again with their gradient accumulators; each rank adds its queries' share to the block's
    dk, dv and passes them on, so after W passes each block's gradient is back home. Saved
    for backward: this rank's q, k, v, output and LSE only, O(S / W).
    """

    @staticmethod
    def forward(ctx, q, k, v, shard, group, causal, scale, softcap, stats):
        B, Hq, S_l, D = q.shape
        cd = _compute_dtype(q.dtype)
        plan = _cached(shard, ("ring", causal, Hq, str(q.device)),
                       lambda: _ring_plan(shard, causal, Hq, q.device))  # fmt: skip
        qh = _heads(q).to(cd).index_select(1, plan.query_perm)  # (Hq, Tq, D)
        kv = torch.stack([_heads(k), _heads(v)]).to(cd)  # (2, Hkv, B * S_l, D)
        acc = qh.new_zeros(qh.shape)
        lse = qh.new_full(qh.shape[:2], -math.inf)
        W, r = shard.world_size, shard.rank
        ring = _Ring(group, shard, stats) if W > 1 else None
        for i in range(W):
            works = []
            if i < W - 1:
                nxt, works = ring.start(kv, tag=0)
            if not _ring_block_forward(qh, kv, plan, (r - i) % W, acc, lse,
                                       scale=scale, softcap=softcap):  # fmt: skip
                stats.blocks_skipped += 1
            if works:
                _Ring.wait(works)
                kv = nxt
        out = q.new_zeros(Hq, B * S_l, D, dtype=cd).index_copy(1, plan.query_perm, acc)
        ctx.save_for_backward(q, k, v, acc, lse)
        ctx.shard, ctx.group, ctx.causal, ctx.scale = shard, group, causal, scale
        ctx.softcap, ctx.stats, ctx.plan = softcap, stats, plan
        return out.reshape(Hq, B, S_l, D).transpose(0, 1).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, acc, lse = ctx.saved_tensors
        shard, plan, stats = ctx.shard, ctx.plan, ctx.stats
        B, Hq, S_l, D = q.shape
        cd = acc.dtype
        qh = _heads(q).to(cd).index_select(1, plan.query_perm)
        doh = _heads(grad).to(cd).index_select(1, plan.query_perm)
        delta = (doh * acc).sum(-1)  # (Hq, Tq): rowsum(dO * O) of the merged output
        dq = torch.zeros_like(qh)
        kv = torch.stack([_heads(k), _heads(v)]).to(cd)
        W, r = shard.world_size, shard.rank
        ring = _Ring(ctx.group, shard, stats) if W > 1 else None
        kw = dict(scale=ctx.scale, softcap=ctx.softcap)
        d_in, d_works = None, []  # the gradient accumulator arriving from rank r - 1
        for i in range(W):
            src = (r - i) % W
            works = []
            if i < W - 1:
                nxt, works = ring.start(kv, tag=1)
            mine = _ring_block_backward(qh, doh, acc, lse, delta, kv, plan, src, dq, **kw)
            if mine is None:
                stats.blocks_skipped += 1
                mine = torch.zeros_like(kv)
            if d_works:
                _Ring.wait(d_works)
                mine += d_in
            if W > 1:
                d_in, d_works = ring.start(mine, tag=2)  # on to the next holder
            else:
                d_in = mine
            if works:
                _Ring.wait(works)
                kv = nxt
        _Ring.wait(d_works)  # rank r - 1's last step: this rank's own block, complete
        dq_rows = torch.zeros(Hq, B * S_l, D, dtype=cd, device=q.device)
        dq_rows.index_copy_(1, plan.query_perm, dq)

        def back(x: Tensor, like: Tensor) -> Tensor:
            H = x.shape[0]
            return x.reshape(H, B, S_l, D).transpose(0, 1).to(like.dtype)

        return (back(dq_rows, q), back(d_in[0], k), back(d_in[1], v),
                None, None, None, None, None, None)  # fmt: skip
