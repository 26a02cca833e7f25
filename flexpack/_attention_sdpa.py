"""SDPA paths of ``flexpack.attention``: per-document and dense-mask, on any device, with backward.

flex_attention has no CPU backward in torch 2.13, so training on CPU goes through
``scaled_dot_product_attention`` instead. Two exact paths:

- per-document (``document`` / ``document_causal`` masks, and ``document_causal`` with a
  ``sliding_window``): one SDPA call per document on views of the token stream when documents
  are contiguous runs (the packer's layout) and few; else tokens are gathered by document,
  documents of equal length run as one batched SDPA call, and outputs are scattered back. Work
  is the sum over documents of ``L_i^2`` instead of ``S^2``, and no (S, S) mask is ever built.
  A sliding window is each document's own band: ``is_causal`` where the document fits in the
  window, else a banded (L, L) mask, or, for documents much longer than the window, query
  chunks of at least ``window + 1`` tokens against their ``window`` keys before (O(L * window)).
- per-document with a mask (any other mask inside the documents: prefix-LM, Gemma 3's image
  spans, a window over documents cut into runs): the same calls, each with the mask evaluated
  on its document's own (L, L) block at the document's row positions.
- dense (every other mask): the mask is evaluated into a (B, H, S, S) bool tensor and handed to
  SDPA. Rows with no allowed key are computed against all keys (so no NaN appears anywhere) and
  then zeroed, which also zeroes their gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_mask

from flexpack._tensor_cache import PerTensor, make_room
from flexpack.layout import _check_int32_tokens


@dataclass(frozen=True)
class DocumentGroups:
    """Tokens of a (B, S) ``doc_ids`` grouped by document.

    A document is a pair (row, id) with id >= 0; its tokens need not be contiguous (arbitrary and
    repeated ids are valid). Tokens are ordered by row, then id, then position, so inside a
    document the order is the position order and causal masking stays correct.

    Attributes:
        order: (T,) int64 positions of the non-padding tokens in the flattened (B * S,) stream,
            grouped by document. For packer layouts (ids 0..n-1 in order, padding at the row ends)
            this is exactly flash-attn's ``unpad_input`` ``indices``.
        seqlens: (N,) int64 length of each document, in the order of ``order``.
        cu_seqlens: (N + 1,) int32 offsets of the documents in ``order``.
        max_seqlen: the longest document (0 when there is none).
        in_order: ``order`` is ``0..B*S-1``: no padding, documents in order (no gather needed).
        contiguous: every document is one run of consecutive tokens (the packer's layout), so
            a sliding window over row positions is each document's own band.
    """

    order: Tensor
    seqlens: Tensor
    cu_seqlens: Tensor
    max_seqlen: int
    in_order: bool
    contiguous: bool = True


def document_groups(doc_ids: Tensor) -> DocumentGroups:
    """Group the tokens of ``doc_ids`` (B, S) int by document (see :class:`DocumentGroups`).

    One host sync: the four counts that size the outputs are read back together, and
    ``nonzero_static`` takes the place of boolean indexing and ``nonzero`` (a sync each), so the
    varlen path on CUDA pays one sync per layout.
    """
    B, S = doc_ids.shape
    device = doc_ids.device
    ids, idx = torch.sort(doc_ids.long(), dim=1, stable=True)  # padding (< 0) first per row
    keep = (ids >= 0).reshape(-1)  # (B * S,)
    ids = ids.reshape(-1)
    pos = torch.arange(B * S, device=device)
    start = keep.clone()  # a kept token that opens a document (new id, or a new row)
    start[1:] &= (ids[1:] != ids[:-1]) | (pos[1:] % S == 0)
    run_start = torch.where(start, pos, 0).cummax(0).values
    longest = torch.where(keep, pos - run_start + 1, 0).amax() if B * S else pos.sum()
    in_order = keep.all() & (idx == torch.arange(S, device=device)).all()
    raw = doc_ids.long()
    opens = raw >= 0  # a token that opens a run of one document, in position order
    opens[:, 1:] &= raw[:, 1:] != raw[:, :-1]
    T, N, max_seqlen, identity, runs = torch.stack(
        (keep.sum(), start.sum(), longest, in_order.long(), opens.sum())
    ).tolist()  # the one host sync
    _check_int32_tokens(T)  # cu_seqlens below are int32: refuse rather than wrap
    flat = (idx + torch.arange(B, device=device)[:, None] * S).reshape(-1)
    order = flat.index_select(0, torch.nonzero_static(keep, size=T).squeeze(1))
    rank = torch.cumsum(keep, 0, dtype=torch.int32) - 1  # position in the unpadded stream
    cu_seqlens = torch.empty(N + 1, dtype=torch.int32, device=device)
    cu_seqlens[:N] = rank.index_select(0, torch.nonzero_static(start, size=N).squeeze(1))
    cu_seqlens[N] = T
    seqlens = torch.diff(cu_seqlens).long()
    return DocumentGroups(
        order, seqlens, cu_seqlens, int(max_seqlen), bool(identity), contiguous=runs == N
    )


_Plan = TypeVar("_Plan")
_PLANS: PerTensor = PerTensor(16)


def cached_plan(kind: str, doc_ids: Tensor, B: int, build: Callable[[Tensor], _Plan]) -> _Plan:
    """``build(doc_ids.expand(B, S))``, reused while ``doc_ids`` is the same unmodified tensor.

    A model calls attention once per layer with the same mask: the grouping (sorts, and the host
    syncs that size the kernel calls) is computed on the first layer only. The cache holds a
    weak reference and the tensor's version counter, so a freed or in-place-modified doc_ids is
    never served stale; it keeps at most 16 plans.
    """
    return _PLANS.get(doc_ids, lambda: build(doc_ids.expand(B, doc_ids.shape[-1])), (kind, B))


@dataclass(frozen=True)
class _SdpaPlan:
    """How the per-document path cuts a (B, S) layout into SDPA calls.

    Two strategies, both exact:

    - "split" (documents are contiguous runs, and not many): the head-major token stream is cut
      into consecutive runs with one ``torch.split``; each document is one SDPA call on a view
      and padding runs become zeros. No gather, no scatter. ``sizes`` are the run lengths in
      stream order and ``is_doc`` tells documents from padding.
    - "gather" (otherwise): documents are reordered by length with one gather (``perm``, (T,)
      positions in the flattened (B * S,) stream) so that equal lengths form one batched call per
      (length, count) in ``runs``; one index_copy scatters the outputs back.
    """

    strategy: str
    sizes: list[int]
    is_doc: list[bool]
    perm: Tensor | None
    runs: list[tuple[int, int]]
    contiguous: bool  # every document is one run of consecutive tokens


# Below this many documents per call, one SDPA call per document (views, no copies) beats
# gathering documents of equal length into batched calls (measured on CPU, bench/attention.py).
_SPLIT_MAX_DOCS = 32


def _sdpa_plan(doc_ids: Tensor) -> _SdpaPlan:
    groups = document_groups(doc_ids)
    n_docs = groups.seqlens.numel()
    # Runs of the flattened stream: a new run starts at each row start and wherever the id
    # changes (all negative ids are one kind, padding).
    ids = doc_ids.long().clamp(min=-1).reshape(-1)
    S = doc_ids.shape[1]
    start = torch.ones_like(ids, dtype=torch.bool)
    start[1:] = ids[1:] != ids[:-1]
    start[::S] = True
    starts = torch.nonzero(start).squeeze(1)
    sizes = torch.diff(starts, append=starts.new_full((1,), ids.numel()))
    is_doc = ids[starts] >= 0
    contiguous = int(is_doc.sum()) == n_docs  # every document is exactly one run
    lens_sorted, doc_perm = torch.sort(groups.seqlens, stable=True)
    run_lens, run_counts = torch.unique_consecutive(lens_sorted, return_counts=True)
    if contiguous and (n_docs <= _SPLIT_MAX_DOCS or n_docs <= 2 * run_lens.numel()):
        return _SdpaPlan("split", sizes.tolist(), is_doc.tolist(), None, [], True)
    # Reorder the documents by length so that documents of equal length are adjacent: then one
    # gather (index_select) puts every token where its batched SDPA call wants it, the calls take
    # contiguous slices, and one index_copy scatters the outputs back. (Gathering per call instead
    # costs a full-size zero-fill + scatter per call in the backward.)
    starts_sorted = groups.cu_seqlens[:-1].long()[doc_perm]
    before = torch.cumsum(lens_sorted, 0) - lens_sorted  # new start of each document
    T = groups.order.numel()
    within = torch.arange(T, device=doc_ids.device) - torch.repeat_interleave(before, lens_sorted)
    perm = groups.order[torch.repeat_interleave(starts_sorted, lens_sorted) + within]  # (T,)
    runs = list(zip(run_lens.tolist(), run_counts.tolist(), strict=True))
    return _SdpaPlan("gather", [], [], perm, runs, contiguous)


def contiguous_documents(doc_ids: Tensor, B: int) -> bool:
    """Every document of ``doc_ids`` (B or 1, S) is one run of consecutive tokens (the packer's
    layout). A sliding window counts positions in the row, so only then is it each document's
    own band. Reads the grouping :func:`per_document_sdpa` caches (no extra work)."""
    return cached_plan("sdpa", doc_ids, B, _sdpa_plan).contiguous


def softcap_sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None,
    enable_gqa: bool,
    softcap: float,
) -> Tensor:
    """``scaled_dot_product_attention`` with attention-logit soft-capping (Gemma 2).

    ``softmax(mask(softcap * tanh(q @ k^T * scale / softcap))) @ v``: the cap applies after the
    scale and before masking. Scores and softmax run in float32 for half inputs (as SDPA's fused
    kernels accumulate), and the output comes back in q's dtype.

    Args:
        q: (N, Hq, L, D); k, v: (N, Hkv, L, D), Hq a multiple of Hkv with ``enable_gqa``.
        attn_mask: bool, broadcastable to (N, Hq, L, L), True where q may attend kv. Every row
            must allow at least one key (callers zero fully masked rows themselves).
        is_causal: also mask keys after the query.

    Returns:
        (N, Hq, L, D) in q's dtype.
    """
    Hq, Hkv, L, D = q.shape[-3], k.shape[-3], q.shape[-2], q.shape[-1]
    if Hkv != Hq:
        k, v = (x.repeat_interleave(Hq // Hkv, dim=-3) for x in (k, v))
    acc = torch.promote_types(q.dtype, torch.float32)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    scores = q.to(acc) @ k.to(acc).transpose(-2, -1) * scale  # (N, Hq, L, L)
    scores = softcap * torch.tanh(scores / softcap)
    if is_causal:
        causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v.to(acc)).to(q.dtype)


def sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None,
    enable_gqa: bool,
    softcap: float | None = None,
) -> Tensor:
    """``F.scaled_dot_product_attention``, or :func:`softcap_sdpa` when ``softcap`` is set."""
    if softcap is not None:
        return softcap_sdpa(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa, softcap=softcap,
        )  # fmt: skip
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
    )


# Queries per chunk of a long document under a sliding window, at least window + 1 (so only the
# first chunk reaches before the document's start).
_WINDOW_CHUNK = 128
_BANDS: dict[tuple, Tensor] = {}
_MAX_BANDS = 32


def _band(key: tuple, build: Callable[[], Tensor]) -> Tensor:
    """Band masks depend only on (length, window, chunk, device): built once each, kept few."""
    hit = _BANDS.get(key)
    if hit is None:
        make_room(_BANDS, _MAX_BANDS)
        hit = _BANDS[key] = build()
    return hit


def causal_window_sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int | None,
    *,
    scale: float | None,
    enable_gqa: bool,
    softcap: float | None = None,
) -> Tensor:
    """Causal attention over whole sequences with a sliding window: q attends kv iff
    ``0 <= q - kv <= window`` (``window=None``: plain causal).

    Args:
        q: (N, Hq, L, D); k, v: (N, Hkv, L, D), each of the N sequences one document.
        window: non-negative int, or None.

    Returns:
        (N, Hq, L, D). Every query allows its own key, so no row is fully masked.
    """
    N, Hq, L, D = q.shape
    kw = dict(scale=scale, enable_gqa=enable_gqa, softcap=softcap)
    if window is None or L <= window + 1:  # the window holds the whole document
        return sdpa(q, k, v, is_causal=True, **kw)
    w = window
    c = max(w + 1, _WINDOW_CHUNK)  # queries per chunk
    n = -(-L // c)
    dev = q.device
    if n * c * (c + w) >= L * L:  # chunks would do no less work than one banded (L, L) mask
        band = _band(("band", L, w, dev), lambda: _banded(L, L, w, 0, dev))
        return sdpa(q, k, v, attn_mask=band, **kw)
    # Chunk i holds queries [i*c, (i+1)*c) and keys [i*c - w, (i+1)*c): k and v padded with w
    # zero keys in front (masked) and the queries' tail padding behind, cut with one strided
    # unfold. Work: n * c * (c + w) instead of L^2.
    P = n * c - L
    qc = F.pad(q, (0, 0, 0, P)).reshape(N, Hq, n, c, D).transpose(1, 2).reshape(N * n, Hq, c, D)
    kc, vc = (
        F.pad(x, (0, 0, w, P))
        .unfold(2, c + w, c)  # (N, Hkv, n, D, c + w)
        .permute(0, 2, 1, 4, 3)
        .reshape(N * n, x.shape[1], c + w, D)
        for x in (k, v)
    )

    def chunk_band() -> Tensor:
        band = _banded(c, c + w, w, w, dev).expand(n, 1, c, c + w).clone()
        band[0, :, :, :w] = False  # the first chunk's front keys are padding
        return band

    band = _band(("chunks", n, c, w, dev), chunk_band)  # (n, 1, c, c + w)
    attn_mask = band.expand(N, n, 1, c, c + w).reshape(N * n, 1, c, c + w)
    out = sdpa(qc, kc, vc, attn_mask=attn_mask, **kw)  # (N * n, Hq, c, D)
    return out.reshape(N, n, Hq, c, D).transpose(1, 2).reshape(N, Hq, n * c, D)[:, :, :L]


def _banded(Lq: int, Lk: int, w: int, offset: int, device: torch.device) -> Tensor:
    """(Lq, Lk) bool: query i (at position i + offset among the keys) attends key j iff
    ``0 <= i + offset - j <= w``."""
    d = torch.arange(Lq, device=device)[:, None] + offset - torch.arange(Lk, device=device)
    return (d >= 0) & (d <= w)


def _tokens(x: Tensor) -> Tensor:
    """(B, H, S, D) -> (B * S, H, D), the flash-attn token-major layout."""
    B, H, S, D = x.shape
    return x.transpose(1, 2).reshape(B * S, H, D)


def _heads(x: Tensor) -> Tensor:
    """(B, H, S, D) -> (H, B * S, D), head-major; a view when B == 1."""
    B, H, S, D = x.shape
    return x.transpose(0, 1).reshape(H, B * S, D)


def _untokens(x: Tensor, B: int, S: int) -> Tensor:
    """(B * S, H, D) -> (B, H, S, D)."""
    return x.reshape(B, S, x.shape[1], x.shape[2]).transpose(1, 2)


def per_document_sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    doc_ids: Tensor,
    *,
    causal: bool,
    scale: float | None,
    enable_gqa: bool,
    softcap: float | None = None,
    window: int | None = None,
    mask_mod: Callable[..., Tensor] | None = None,
    attend: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor] | None = None,
) -> Tensor:
    """Attention restricted to each document: one SDPA call per document, or per length.

    Args:
        q: (B, Hq, S, D); k, v: (B, Hkv, S, D).
        doc_ids: (B, S) or (1, S) int on q's device; negative values mark padding. Pass the
            mask's own tensor (not a fresh view) so the grouping is reused across layers.
        causal: also mask keys after the query (in position order inside the document).
        softcap: attention-logit soft-capping (see :func:`softcap_sdpa`); None for none.
        window: with ``causal``, a sliding window: q attends kv iff ``q - kv <= window``
            (``document_causal & sliding_window(window)``); documents must be contiguous runs
            (:func:`contiguous_documents`), where the distance in the row is the distance in
            the document.
        mask_mod: instead of ``causal`` / ``window``, any mask that allows no pair across the
            documents of ``doc_ids`` (a flexpack ``document(d) & ...`` composition, or
            transformers' rule & the documents): evaluated on each document's own block at its
            row positions (documents cut into several runs included), so the work and the
            mask are the sum of ``L_i^2``, never ``S^2``. Fully masked queries give 0.
        attend: with ``mask_mod``, the attention of one batch of blocks,
            ``attend(q, k, v, allowed) -> (n, Hq, L, D)`` with ``allowed`` (n, 1, L, L) bool
            (default :func:`dense_sdpa`; gpt-oss passes its sink attention).

    Returns:
        (B, Hq, S, D), 0 on padding tokens.
    """
    B, Hq, S, D = q.shape
    assert window is None or causal, "a sliding window is only routed here with causal"
    assert mask_mod is None or not causal, "a mask_mod carries its own causality"
    plan = cached_plan("sdpa", doc_ids, B, _sdpa_plan)

    def run(qd: Tensor, kd: Tensor, vd: Tensor, pos: Tensor | None) -> Tensor:
        # (n, H, L, D) documents; pos: (n, L) int64 flat positions (b * S + s), with mask_mod
        if mask_mod is not None:
            allowed = _blocks_of(mask_mod, pos, B, S)
            if attend is not None:
                return attend(qd, kd, vd, allowed)
            return dense_sdpa(
                qd, kd, vd, allowed, scale=scale, enable_gqa=enable_gqa, softcap=softcap
            )
        if causal:
            return causal_window_sdpa(
                qd, kd, vd, window, scale=scale, enable_gqa=enable_gqa, softcap=softcap
            )
        return sdpa(qd, kd, vd, scale=scale, enable_gqa=enable_gqa, softcap=softcap)

    # Head-major (H, B * S, D): free for B == 1, and every (document, head) block is a
    # contiguous (L, D) matrix after the gather, the layout SDPA's CPU kernel is fastest on.
    qh, kh, vh = (_heads(x) for x in (q, k, v))
    outs = []
    if plan.strategy == "split":
        # One split per tensor: its backward is a single cat (slicing per call would zero-fill
        # a full-size gradient per call).
        start = 0
        for qd, kd, vd, is_doc, size in zip(
            *(torch.split(x, plan.sizes, dim=1) for x in (qh, kh, vh)), plan.is_doc, plan.sizes,
            strict=True,
        ):  # fmt: skip
            if is_doc:
                pos = None
                if mask_mod is not None:
                    pos = torch.arange(start, start + size, device=q.device)[None]
                outs.append(run(qd[None], kd[None], vd[None], pos)[0])
            else:
                outs.append(qd.new_zeros(qd.shape))
            start += size
        out = torch.cat(outs, dim=1)
        if not any(plan.is_doc):  # all padding: keep the graph, gradients are 0
            out = out + 0.0 * (qh.sum() + kh.sum() + vh.sum())
        return out.reshape(Hq, B, S, D).transpose(0, 1)

    qs, ks, vs = (x.index_select(1, plan.perm) for x in (qh, kh, vh))  # (H, T, D)
    sizes = [length * count for length, count in plan.runs]
    perms = torch.split(plan.perm, sizes)
    for (length, count), qd, kd, vd, pd in zip(
        plan.runs, *(torch.split(x, sizes, dim=1) for x in (qs, ks, vs)), perms, strict=True
    ):
        qd, kd, vd = (
            x.reshape(x.shape[0], count, length, D).transpose(0, 1) for x in (qd, kd, vd)
        )  # (n, H, L, D)
        od = run(qd, kd, vd, pd.reshape(count, length))
        outs.append(od.transpose(0, 1).reshape(Hq, count * length, D))
    out = q.new_zeros(Hq, B * S, D)
    if outs:
        out = out.index_copy(1, plan.perm, torch.cat(outs, dim=1))
    else:  # no real token at all: keep the graph so backward still runs (gradients are 0)
        out = out + 0.0 * (qs.sum() + ks.sum() + vs.sum())
    return out.reshape(Hq, B, S, D).transpose(0, 1)


def _blocks_of(mask_mod: Callable[..., Tensor], pos: Tensor, B: int, S: int) -> Tensor:
    """``mask_mod`` on the blocks of documents at flat positions ``pos`` (n, L) of a (B, S) row
    stream: (n, 1, L, L) bool, from broadcast indices (the n rows, their positions in the row).
    Mask mods that do not broadcast get the dense (B, 1, S, S) mask, cut to the blocks."""
    n, L = pos.shape
    b, s = pos[:, :1] // S, pos % S  # (n, 1), (n, L): a document lies in one row
    try:
        allowed = mask_mod(
            b.view(n, 1, 1, 1), torch.zeros_like(b).view(n, 1, 1, 1),
            s.view(n, 1, L, 1), s.view(n, 1, 1, L),
        )  # fmt: skip
        return torch.broadcast_to(allowed, (n, 1, L, L)).to(torch.bool)
    except (RuntimeError, IndexError, TypeError):
        dense = create_mask(mask_mod, B, 1, S, S, device=pos.device).to(torch.bool)
        return dense[b.view(n, 1, 1), 0, s.view(n, L, 1), s.view(n, 1, L)].unsqueeze(1)


def dense_mask_from_mod(
    mask_mod: Callable[..., Tensor], B: int, H: int, S: int, device: torch.device
) -> Tensor:
    """Evaluate ``mask_mod`` on the whole (B, H, S, S) grid; returns a bool tensor.

    Broadcast index tensors first: (B, 1, 1, 1), (1, H, 1, 1), (1, 1, S, 1), (1, 1, 1, S) give
    one S x S comparison per factor without the (S, S) integer intermediates that vmap makes.
    Mask mods that do not broadcast (rare) fall back to torch's vmap-based ``create_mask``.
    """
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    qi = torch.arange(S, device=device).view(1, 1, S, 1)
    kv = torch.arange(S, device=device).view(1, 1, 1, S)
    try:
        dense = mask_mod(b, h, qi, kv)
        return torch.broadcast_to(dense, (B, H, S, S)).to(torch.bool)
    except (RuntimeError, IndexError, TypeError):
        return create_mask(mask_mod, B, H, S, S, device=device).to(torch.bool)


def dense_mask_from_block_mask(block_mask: BlockMask, B: int, device: torch.device) -> Tensor:
    """What flex_attention computes with ``block_mask`` on a batch of B: (B, H, S, S) bool.

    False on skipped blocks, True on full blocks, ``mask_mod`` on partial blocks, evaluated at
    the real batch index as flex does when a batch-1 BlockMask is broadcast (H stays the
    BlockMask's: head-dependent mask_mods need a BlockMask built with every head).
    """
    Bm, Hm = block_mask.kv_num_blocks.shape[:2]
    Q_LEN, KV_LEN = block_mask.seq_lengths
    bq, bkv = block_mask.BLOCK_SIZE
    n_q, n_kv = math.ceil(Q_LEN / bq), math.ceil(KV_LEN / bkv)

    def blocks(num: Tensor | None, indices: Tensor | None) -> Tensor:
        dense = torch.zeros(Bm, Hm, n_q, n_kv + 1, dtype=torch.bool, device=device)
        if num is None or indices is None:
            return dense[..., :n_kv]
        num, indices = num[..., :n_q].to(device), indices[..., :n_q, :].to(device)
        used = torch.arange(indices.shape[-1], device=device) < num.unsqueeze(-1)
        cols = torch.where(used, indices.long(), n_kv)  # unused slots write a spare column
        dense.scatter_(-1, cols, True)
        return dense[..., :n_kv]

    def expand(block: Tensor) -> Tensor:
        return block.repeat_interleave(bq, dim=2)[:, :, :Q_LEN].repeat_interleave(bkv, dim=3)[
            ..., :KV_LEN
        ]

    assert Q_LEN == KV_LEN, block_mask.seq_lengths  # checked by flexpack.attention
    partial = expand(blocks(block_mask.kv_num_blocks, block_mask.kv_indices))
    full = expand(blocks(block_mask.full_kv_num_blocks, block_mask.full_kv_indices))
    elementwise = dense_mask_from_mod(block_mask.mask_mod, B, Hm, Q_LEN, device)
    return full | (partial & elementwise)  # (Bm, ...) blocks broadcast to B


def dense_sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dense: Tensor,
    *,
    scale: float | None,
    enable_gqa: bool,
    softcap: float | None = None,
) -> Tensor:
    """SDPA with a (B or 1, H or 1, S, S) bool mask; rows with no allowed key give exactly 0.

    A fully masked row would make softmax 0/0. Such rows attend to every key instead (finite
    values, finite gradients) and are zeroed afterwards, which zeroes their gradients too.
    """
    row_ok = dense.any(dim=-1, keepdim=True)  # (B, H, S, 1)
    out = sdpa(
        q, k, v, attn_mask=dense | ~row_ok, scale=scale, enable_gqa=enable_gqa, softcap=softcap
    )
    return out.masked_fill(~row_ok, 0.0)
