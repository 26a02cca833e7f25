"""Context-parallel attention: this rank's queries against the whole row's keys.

:func:`context_parallel_attention` checks its inputs, picks a schedule ("auto": see
:func:`_auto_schedule`) and runs it: the ring (:mod:`flexpack.parallel.ring`) or the all-gather
of k and v (:mod:`flexpack.parallel.sharding`) followed by local attention, compiled flex with
:func:`shard_block_mask` on CUDA, one SDPA call per run of a document's queries elsewhere.

Shape legend: B rows, S tokens per row, W world size, S_l = S // W tokens per rank, Hq / Hkv
query / key-value heads, D head dimension.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from flexpack.parallel.planning import _token_work
from flexpack.parallel.ring import _RingAttention
from flexpack.parallel.sharding import (
    ContextShard,
    _all_gather,
    _along,
    _cached,
    _check_agree,
    _group_size_rank,
    _heads,
    shard_context,  # noqa: F401  (the examples below call it)
)

_MASKS = ("document_causal", "document")
Schedule = Literal["auto", "all_gather", "ring"]
_SCHEDULES = ("auto", "all_gather", "ring")


_RING_MIN_BYTES = 16 << 20  # CPU: the ring from 16 MiB of gathered K/V per layer
_RING_MIN_BYTES_CUDA = 1 << 30  # CUDA: from 1 GiB (the all-gather runs compiled flex there)


def _auto_schedule(q: Tensor, k: Tensor, shard: ContextShard) -> str:
    """The schedule ``schedule="auto"`` runs: "all_gather" on one or two ranks (one collective
    beats W steps, and the ring would save at most half of the K/V) and while the gathered K/V
    of a layer (2 * B * S * Hkv * D elements) is small; "ring" from three ranks once it passes
    16 MiB on CPU, 1 GiB on CUDA, where that O(S) per layer and rank is the memory wall (on
    CUDA the all-gather path runs compiled flex, the ring its tile loop)."""
    W = shard.world_size
    if W <= 2:
        return "all_gather"
    B, S = shard.shape
    gathered = 2 * B * S * k.shape[1] * k.shape[3] * k.element_size()
    limit = _RING_MIN_BYTES_CUDA if q.device.type == "cuda" else _RING_MIN_BYTES
    return "ring" if gathered >= limit else "all_gather"


# ---------------------------------------------------------------------------------------------
# Local attention: this rank's queries against the whole row's keys (original order)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _SegmentPlan:
    """How the CPU path cuts this rank's queries into SDPA calls.

    Keys are regrouped by document (``key_perm``: (T,) positions of the real tokens in the
    flattened (B * S,) rows, by row, id, position), so a document is the run ``doc_start[g] ..
    doc_start[g] + doc_len[g]`` of the key stream. Queries are regrouped the same way
    (``query_perm``: (Tq,) positions in the flattened (B * S_l,) shard) and cut into segments:
    runs of one document at consecutive positions in it. A segment of m queries starting at
    position r0 of document g sees keys 0 .. r0 + m - 1 of it (causal: bottom-right aligned).
    """

    key_perm: Tensor
    query_perm: Tensor
    doc_sizes: list[int]  # key-stream length of each document, in order
    segments: list[tuple[int, int, int, int]]  # (document, m, r0, doc length)


def _segment_plan(shard: ContextShard, device: torch.device) -> _SegmentPlan:
    d = shard.row_doc_ids.cpu().numpy()
    B, S = d.shape
    idx = shard.index.cpu().numpy()
    S_l = idx.shape[1]
    key_perm, query_perm, doc_sizes, segments = [], [], [], []
    n_docs = 0
    for b in range(B):
        real = np.flatnonzero(d[b] >= 0)
        ids = d[b][real]
        order = np.argsort(ids, kind="stable")
        key_perm.append(b * S + real[order])
        uniq, counts = np.unique(ids, return_counts=True)
        doc_sizes.extend(counts.tolist())
        _, pos = _token_work(d[b])
        q_ids = d[b][idx[b]]
        q_real = np.flatnonzero(q_ids >= 0)
        g = np.searchsorted(uniq, q_ids[q_real])  # document number in this row
        r = pos[idx[b][q_real]]
        qo = np.lexsort((r, g))
        g, r = g[qo], r[qo]
        query_perm.append(b * S_l + q_real[qo])
        if g.size:
            cut = np.flatnonzero((g[1:] != g[:-1]) | (r[1:] != r[:-1] + 1)) + 1
            starts = np.concatenate([[0], cut])
            ends = np.concatenate([cut, [g.size]])
            for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
                gi = int(g[s])
                segments.append((n_docs + gi, e - s, int(r[s]), int(counts[gi])))
        n_docs += len(uniq)

    def t(parts: list[np.ndarray]) -> Tensor:
        a = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return torch.from_numpy(a.astype(np.int64)).to(device)

    return _SegmentPlan(t(key_perm), t(query_perm), doc_sizes, segments)


def _sdpa_segments(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    shard: ContextShard,
    *,
    causal: bool,
    scale: float | None,
    enable_gqa: bool,
    softcap: float | None,
) -> Tensor:
    """This rank's queries q (B, Hq, S_l, D) against k, v (B, Hkv, S, D) in row order."""
    from flexpack._attention_sdpa import sdpa

    B, Hq, S_l, D = q.shape
    plan = _cached(shard, ("segments", str(q.device)), lambda: _segment_plan(shard, q.device))
    qh = _heads(q).index_select(1, plan.query_perm)  # (Hq, Tq, D), segments in order
    kh, vh = (_heads(x).index_select(1, plan.key_perm) for x in (k, v))  # (Hkv, T, D)
    # One split per tensor (its backward is one cat), then a narrow inside the document.
    kd, vd = (torch.split(x, plan.doc_sizes, dim=1) for x in (kh, vh))
    qs = torch.split(qh, [m for _, m, _, _ in plan.segments], dim=1)
    outs = []
    for qi, (g, m, r0, L) in zip(qs, plan.segments, strict=True):
        n = r0 + m if causal else L
        ki, vi = kd[g][:, :n], vd[g][:, :n]
        mask = None
        if causal and r0:  # bottom-right causal: query i sees keys 0 .. r0 + i
            mask = (
                torch.arange(n, device=q.device) <= (r0 + torch.arange(m, device=q.device))[:, None]
            )
        o = sdpa(
            qi[None], ki[None], vi[None], attn_mask=mask, is_causal=causal and not r0,
            scale=scale, enable_gqa=enable_gqa, softcap=softcap,
        )  # fmt: skip
        outs.append(o[0])
    out = q.new_zeros(Hq, B * S_l, D)
    if outs:
        out = out.index_copy(1, plan.query_perm, torch.cat(outs, dim=1))
    else:  # no real query: keep the graph so that backward runs (gradients are 0)
        out = out + 0.0 * (qh.sum() + kh.sum() + vh.sum())
    return out.reshape(Hq, B, S_l, D).transpose(0, 1)


def shard_block_mask(shard: ContextShard, *, causal: bool = True, block_size: int = 128) -> Any:
    """The (S_l, S) BlockMask of this rank's queries against the whole row's keys.

    Built from per-block statistics, O(S + B * nq * nk) (the size of the BlockMask): a pair
    of blocks is empty when their id ranges do not meet or (causal) every key follows every
    query, full when both blocks are one document without padding and (causal) every key
    precedes every query, partial otherwise. The mask_mod reads the query's row position from
    ``shard.index`` and both ids from the shard, so it is document-causal in row positions.
    """
    from flexpack import block_mask as bm

    q_doc, q_pos, k_doc = shard.doc_ids, shard.index, shard.row_doc_ids
    S = k_doc.shape[1]
    S_l = q_doc.shape[1]
    qs, ks = bm._BlockStats(q_doc, block_size), bm._BlockStats(k_doc, block_size)
    lo_q, hi_q = qs.lo.long()[:, :, None], qs.hi.long()[:, :, None]
    lo_k, hi_k = ks.lo.long()[:, None, :], ks.hi.long()[:, None, :]
    nonempty = qs.any_real[:, :, None] & ks.any_real[:, None, :] & (lo_q <= hi_k) & (lo_k <= hi_q)
    whole_q, whole_k = qs.single & qs.all_real, ks.single & ks.all_real
    full = whole_q[:, :, None] & whole_k[:, None, :] & (lo_q == lo_k)
    classes = bm._classes(nonempty, full)
    if causal:
        big = torch.iinfo(torch.int64).max
        q_min = bm._blocked(q_pos, block_size, big).amin(-1)  # (B, nq)
        q_max = bm._blocked(q_pos, block_size, -1).amax(-1)
        k_min, k_max = bm._block_bounds(S, block_size, k_doc.device)
        causal_cls = bm._classes(
            q_max[:, :, None] >= k_min[None, None, :], q_min[:, :, None] >= k_max[None, None, :]
        )
        classes = bm.combine_and(classes, causal_cls)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        dq = q_doc[b, q_idx]
        ok = (dq == k_doc[b, kv_idx]) & (dq >= 0)
        return ok & (q_pos[b, q_idx] >= kv_idx) if causal else ok

    mask_mod.__name__ = "context_document_causal" if causal else "context_document"
    return bm.build_block_mask(
        classes, block_size=block_size, q_len=S_l, kv_len=S, mask_mod=mask_mod
    )


def _local_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    shard: ContextShard,
    *,
    mask: str,
    scale: float | None,
    enable_gqa: bool,
    softcap: float | None,
) -> Tensor:
    """q (B, Hq, S_l, D) in shard order against k, v (B, Hkv, S, D) in row order."""
    from flexpack.attention import _FLEX_CUDA_MAX_HEAD_DIM

    causal = mask == "document_causal"
    # flex on CUDA has no float64 kernel and no head dims above 256: those take SDPA, as in
    # flexpack.attention.
    flex_ok = q.dtype != torch.float64 and q.shape[-1] <= _FLEX_CUDA_MAX_HEAD_DIM
    if q.device.type == "cuda" and flex_ok:
        from flexpack import _attention_flex

        bs = _attention_flex.CUDA_BLOCK_MULTIPLE
        block_mask = _cached(
            shard,
            ("block_mask", causal, bs, str(q.device)),
            lambda: shard_block_mask(_on(shard, q.device), causal=causal, block_size=bs),
        )
        return _attention_flex.flex(
            q, k, v, block_mask, scale=scale, enable_gqa=enable_gqa, softcap=softcap
        )
    return _sdpa_segments(
        q, k, v, shard, causal=causal, scale=scale, enable_gqa=enable_gqa, softcap=softcap
    )


def _on(shard: ContextShard, device: torch.device) -> ContextShard:
    if shard.index.device == device:
        return shard
    names = ("index", "doc_ids", "position_ids", "gathered_index", "row_doc_ids")
    return replace(shard, **{name: getattr(shard, name).to(device) for name in names})


def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    shard: ContextShard,
    *,
    group: Any = None,
    mask: Literal["document_causal", "document"] = "document_causal",
    scale: float | None = None,
    enable_gqa: bool = False,
    softcap: float | None = None,
    schedule: Schedule = "auto",
) -> Tensor:
    """Attention of this rank's queries to the whole row's keys, under the document mask.

    Two schedules, the same result: this rank's queries attend the keys their documents
    allow, in row positions: a query at position p sees the keys of its document at positions
    <= p (``mask="document_causal"``) or all of them (``"document"``). The result equals
    ``flexpack.attention`` on the full rows at ``shard.index``, forward and backward.

    - ``"all_gather"``: k and v are all-gathered across ``group`` (one collective each,
      differentiable: the backward reduce-scatters their gradients, so each key's gradient
      lands on the rank that holds it) and put back in row order. On CUDA the local attention
      is compiled flex_attention with an (S_l, S) BlockMask built from the shard's ids
      (:func:`shard_block_mask`, once per shard); elsewhere (and on CUDA for float64 or head
      dims above 256, which flex does not take) one SDPA call per run of a document's queries.
      Keeps the whole row's k and v (O(S) per rank) for the backward.
    - ``"ring"``: k and v travel around the group in W - 1 point-to-point passes (isend /
      irecv of the next block while the current one is computed); each block's partial output
      merges by its log-sum-exp; the backward passes k, v and their gradient accumulators
      around again. Keeps this rank's k and v only (O(S / W)); sends 1.5-1.75x the bytes.
      Tiles run through torch's CPU flash kernel (the matmul path with softcap or on CUDA);
      blocks whose documents meet none of this rank's queries are skipped.
    - ``"auto"`` (default): the all-gather on one or two ranks and while a layer's gathered k
      and v are under 16 MiB (1 GiB on CUDA), the ring otherwise.

    ``shard.stats`` reports the schedule that ran, the bytes sent and the blocks skipped. The
    first collective on a shard checks (one small all-gather, once) that every rank built its
    shard from the same batch.

    Args:
        q: (B, Hq, S_l, D) this rank's queries, in ``shard.index`` order (``shard.take``).
        k, v: (B, Hkv, S_l, D) this rank's keys and values, same order.
        shard: this rank's :class:`ContextShard` (from :func:`shard_context`).
        group: the context-parallel process group (default: the whole world). A shard of
            ``world_size == 1`` (the whole row) gathers nothing and needs no process group.
        mask: "document_causal" (default) or "document".
        scale: softmax scale; default ``1 / sqrt(D)``.
        enable_gqa: allow Hkv < Hq (grouped-query attention; k and v are gathered at Hkv).
        softcap: attention-logit soft-capping as in Gemma 2 (``flexpack.attention``'s).
        schedule: "auto" (default), "all_gather" or "ring".

    Returns:
        (B, Hq, S_l, D) in q's dtype (the autocast dtype inside ``torch.autocast``); 0 on
        padding queries.

    Raises:
        TypeError: q, k, v not floating tensors of one dtype; shard not a ContextShard.
        ValueError: shapes that do not match the shard, an unknown mask or schedule, a group
            whose size or rank differs from the shard's, no process group for a multi-rank
            shard, or ranks whose shards differ (doc_ids, S, B or the plan's arguments).

    Example:
        >>> import flexpack
        >>> doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, -1]])
        >>> shard = shard_context(doc_ids, 1, 0)  # one rank: no process group needed
        >>> q = k = v = torch.randn(1, 2, 8, 4)
        >>> out = context_parallel_attention(q, k, v, shard)
        >>> mask = flexpack.masks.document(doc_ids) & flexpack.masks.causal()
        >>> torch.allclose(out, flexpack.attention(q, k, v, mask), atol=1e-6)
        True
    """
    from flexpack.attention import _autocast, _autocast_dtype, _check_inputs

    if not isinstance(shard, ContextShard):
        raise TypeError(
            f"shard must be a ContextShard (from flexpack.parallel.shard_context), got "
            f"{type(shard).__name__}"
        )
    if mask not in _MASKS:
        raise ValueError(f"mask must be one of {_MASKS}, got {mask!r}")
    if isinstance(q, Tensor):
        dtype = _autocast_dtype(q.device.type)
        if dtype is not None:
            q, k, v = (_autocast(x, dtype) for x in (q, k, v))
            with torch.autocast(q.device.type, enabled=False):
                return context_parallel_attention(
                    q, k, v, shard, group=group, mask=mask, scale=scale,
                    enable_gqa=enable_gqa, softcap=softcap,
                )  # fmt: skip
    _check_inputs(q, k, v, enable_gqa)
    B, S_l = shard.index.shape
    if q.shape[0] != B or q.shape[2] != S_l:
        raise ValueError(
            f"q has shape {tuple(q.shape)} but the shard holds {S_l} tokens of {B} rows; "
            f"expected ({B}, H, {S_l}, D): this rank's tokens, e.g. shard.take(x) before the "
            "projections"
        )
    if softcap is not None:
        # numbers.Real takes numpy and Python scalars alike (np.float32(50.0) from a config)
        if isinstance(softcap, bool | np.bool_) or not isinstance(softcap, numbers.Real):
            raise TypeError(
                f"softcap must be a float or None, got {softcap!r} of type "
                f"{type(softcap).__name__}; pass a Python number, e.g. softcap=float(x)."
            )
        if not 0 < softcap < math.inf:
            raise ValueError(
                f"softcap must be a positive finite number (Gemma 2 uses 50.0), got {softcap}; "
                "pass None for no soft-capping"
            )
    if schedule not in _SCHEDULES:
        raise ValueError(f"schedule must be one of {_SCHEDULES}, got {schedule!r}")
    if schedule == "auto":
        schedule = _auto_schedule(q, k, shard)
    stats = shard.stats
    stats.schedule = schedule
    stats.calls[schedule] = stats.calls.get(schedule, 0) + 1
    if schedule == "ring":
        if _group_size_rank(group, shard) is not None:
            _check_agree(shard, group, q.device)
        D = q.shape[-1]
        return _RingAttention.apply(
            q, k, v, shard, group, mask == "document_causal",
            D**-0.5 if scale is None else float(scale),
            None if softcap is None else float(softcap), stats,
        )  # fmt: skip
    k_all, v_all = (_all_gather(x, 2, group, shard, stats) for x in (k, v))  # (B, Hkv, S, D)
    if shard.world_size > 1:
        inverse = shard._inverse(q.device)
        k_all, v_all = (torch.gather(x, 2, _along(inverse, x, 2)) for x in (k_all, v_all))
    return _local_attention(
        q, k_all, v_all, shard, mask=mask, scale=scale, enable_gqa=enable_gqa,
        softcap=None if softcap is None else float(softcap),
    )  # fmt: skip
