"""Dense references: the slow, obviously-correct twins of masks and attention.

``dense_mask`` turns a flexpack ``Mask``, a plain ``mask_mod`` callable or a ``BlockMask`` into a
``(B, H, Q_LEN, KV_LEN)`` bool tensor; ``reference_attention`` computes masked softmax attention
in float64 from such a tensor. Both materialize O(B * H * Q_LEN * KV_LEN) memory: they are for
tests and debugging at small sizes, never for training.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_mask

__all__ = ["block_states", "dense_mask", "dense_tree_mask", "reference_attention"]

# Block states, as stored by ``block_states``.
EMPTY, PARTIAL, FULL = 0, 1, 2


def _is_flexpack_mask(obj: object) -> bool:
    # Duck-typed so this module never imports flexpack.masks (the kit must work on plain torch
    # objects, and flexpack.masks may itself use the kit in its doctests).
    return hasattr(obj, "mask_mod") and hasattr(obj, "kind") and not isinstance(obj, BlockMask)


def _default_device(mask: object) -> torch.device:
    if isinstance(mask, BlockMask):
        return mask.kv_num_blocks.device
    doc_ids = getattr(mask, "doc_ids", None)
    if isinstance(doc_ids, Tensor):
        return doc_ids.device
    return torch.device("cpu")


def _on_device(mask: object, device: torch.device) -> object:
    """A flexpack mask with every tensor its mask_mod reads on ``device`` (``Mask.to``)."""
    to = getattr(mask, "to", None)
    return mask if to is None else to(device)


def _mask_shape_defaults(mask: object) -> tuple[int | None, int | None, int | None, int | None]:
    """(B, H, Q_LEN, KV_LEN) implied by ``mask`` itself; None where it implies nothing."""
    if isinstance(mask, BlockMask):
        B, H, Q, KV = mask.shape
        return B, H, Q, KV
    doc_ids = getattr(mask, "doc_ids", None)
    if _is_flexpack_mask(mask) and isinstance(doc_ids, Tensor):
        S = int(doc_ids.shape[-1])
        return (int(doc_ids.shape[0]) if doc_ids.dim() == 2 else 1), 1, S, S
    return None, 1, None, None


def dense_mask(
    mask: object,
    B: int | None = None,
    H: int | None = None,
    Q_LEN: int | None = None,
    KV_LEN: int | None = None,
    *,
    device: torch.device | str | None = None,
) -> Tensor:
    """Evaluate a mask at every (b, h, q, kv): the dense twin of a flexpack mask or a BlockMask.

    Args:
        mask: a flexpack ``Mask`` (anything with ``.mask_mod`` and ``.kind``), a plain
            ``mask_mod(b, h, q_idx, kv_idx) -> bool Tensor`` callable, or a ``BlockMask``. For a
            BlockMask the result is what flex_attention computes with it: False on skipped
            blocks, True on full blocks, ``block_mask.mask_mod`` on partial blocks.
        B, H, Q_LEN, KV_LEN: the grid. ``None`` takes them from the mask where it knows them
            (a BlockMask's ``shape``; a Mask's ``doc_ids`` (B, S) gives B and S, and H=1); a plain
            callable needs Q_LEN and KV_LEN. A BlockMask with batch or head size 1 broadcasts to a
            larger B or H (its mask_mod then sees the real b and h, as in flex_attention).
        device: where to evaluate; defaults to the mask's device (its doc_ids or block
            tensors), else CPU. A flexpack Mask (also the one behind a flexpack BlockMask) is
            evaluated on a copy of it on ``device`` (``mask.to(device)``: every tensor its
            mask_mod reads moves); a plain callable must read tensors on ``device`` itself.

    Returns:
        (B, H, Q_LEN, KV_LEN) bool tensor, True where query q may attend to key kv.

    Raises:
        TypeError: ``mask`` is none of the accepted kinds.
        ValueError: the grid is missing (plain callable without Q_LEN/KV_LEN), or does not fit a
            BlockMask's shape (only size-1 batch/head dims broadcast).

    Example:
        >>> import torch
        >>> causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
        >>> dense_mask(causal, 1, 1, 3, 3)[0, 0].int()
        tensor([[1, 0, 0],
                [1, 1, 0],
                [1, 1, 1]], dtype=torch.int32)
    """
    if isinstance(mask, Tensor):
        raise TypeError(
            "dense_mask expected a flexpack Mask, a mask_mod callable or a BlockMask, got a "
            f"Tensor of shape {tuple(mask.shape)}; a bool tensor is already a dense mask."
        )
    if not (isinstance(mask, BlockMask) or _is_flexpack_mask(mask) or callable(mask)):
        raise TypeError(
            "dense_mask expected a flexpack Mask, a mask_mod callable "
            f"(b, h, q_idx, kv_idx) -> bool Tensor, or a BlockMask; got {type(mask).__name__}."
        )
    dB, dH, dQ, dKV = _mask_shape_defaults(mask)
    B = dB if B is None else B
    H = dH if H is None else H
    Q_LEN = dQ if Q_LEN is None else Q_LEN
    KV_LEN = dKV if KV_LEN is None else KV_LEN
    if Q_LEN is None or KV_LEN is None:
        raise ValueError(
            f"dense_mask needs Q_LEN and KV_LEN for a plain mask_mod callable, got Q_LEN={Q_LEN}, "
            f"KV_LEN={KV_LEN}; pass them, e.g. dense_mask(mask_mod, B, H, S, S)."
        )
    B = 1 if B is None else B
    H = 1 if H is None else H
    for name, value in (("B", B), ("H", H), ("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"dense_mask needs {name} to be a positive int, got {value!r}.")
    device = torch.device(device) if device is not None else _default_device(mask)

    if isinstance(mask, BlockMask):
        return _block_mask_to_dense(mask, B, H, Q_LEN, KV_LEN, device)
    mask_mod = _on_device(mask, device).mask_mod if _is_flexpack_mask(mask) else mask
    out = create_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=device)
    return out.to(torch.bool).expand(B, H, Q_LEN, KV_LEN).contiguous()


@dataclass(frozen=True)
class _BlockCounts:
    partial: Tensor  # (Bm, Hm, nq, nkv) int32: times each block is listed as partial
    full: Tensor  # (Bm, Hm, nq, nkv) int32: times each block is listed as full
    out_of_range: list[str]  # readable problems with indices outside the grid


def _count_listed(
    num_blocks: Tensor, indices: Tensor, n_q: int, n_kv: int, what: str
) -> tuple[Tensor, list[str]]:
    Bm, Hm, R, C = indices.shape
    problems: list[str] = []
    if R < n_q:
        problems.append(
            f"{what} indices cover {R} query blocks, but the mask has {n_q} query blocks"
        )
    rows = min(R, n_q)
    num = num_blocks[..., :rows].to(torch.long)
    idx = indices[..., :rows, :].to(torch.long)
    listed = torch.arange(C, device=idx.device) < num.unsqueeze(-1)  # (Bm, Hm, rows, C)
    bad = listed & ((idx < 0) | (idx >= n_kv))
    if bool((num > C).any()):
        problems.append(f"{what}_num_blocks exceeds the width {C} of {what}_indices")
    if bool(bad.any()):
        b, h, r, c = (int(x) for x in bad.nonzero()[0])
        problems.append(
            f"{what}_indices[{b}, {h}, {r}, {c}] = {int(idx[b, h, r, c])} is outside the "
            f"{n_kv} kv blocks"
        )
    use = listed & ~bad
    counts = torch.zeros(Bm, Hm, n_q, n_kv + 1, dtype=torch.int32, device=idx.device)
    target = torch.where(use, idx, torch.full_like(idx, n_kv))  # unused slots -> dump column
    counts[:, :, :rows].scatter_add_(-1, target, use.to(torch.int32))
    return counts[..., :n_kv], problems


def _block_counts(block_mask: BlockMask) -> _BlockCounts:
    Q_LEN, KV_LEN = block_mask.seq_lengths
    bq, bkv = block_mask.BLOCK_SIZE
    n_q, n_kv = math.ceil(Q_LEN / bq), math.ceil(KV_LEN / bkv)
    partial, problems = _count_listed(
        block_mask.kv_num_blocks, block_mask.kv_indices, n_q, n_kv, "kv"
    )
    if block_mask.full_kv_num_blocks is not None:
        full, more = _count_listed(
            block_mask.full_kv_num_blocks, block_mask.full_kv_indices, n_q, n_kv, "full_kv"
        )
        problems += more
    else:
        full = torch.zeros_like(partial)
    return _BlockCounts(partial, full, problems)


def block_states(block_mask: BlockMask) -> Tensor:
    """Per-block state of a BlockMask: 0 skipped (empty), 1 partial (mask_mod applied), 2 full.

    Args:
        block_mask: a torch ``BlockMask`` of shape (Bm, Hm, Q_LEN, KV_LEN) and block size
            (bq, bkv). Blocks listed both as partial and as full count as full.

    Returns:
        (Bm, Hm, ceil(Q_LEN / bq), ceil(KV_LEN / bkv)) int8 tensor on the mask's device.

    Raises:
        TypeError: block_mask is not a BlockMask.

    Example:
        >>> from torch.nn.attention.flex_attention import create_block_mask
        >>> causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
        >>> bm = create_block_mask(causal, 1, 1, 6, 6, device="cpu", BLOCK_SIZE=2)
        >>> block_states(bm)[0, 0]
        tensor([[1, 0, 0],
                [2, 1, 0],
                [2, 2, 1]], dtype=torch.int8)
    """
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_states expected a BlockMask, got {type(block_mask).__name__}.")
    counts = _block_counts(block_mask)
    states = torch.where(counts.partial > 0, PARTIAL, EMPTY)
    states = torch.where(counts.full > 0, FULL, states)
    return states.to(torch.int8)


def _expand_dims(t: Tensor, B: int, H: int, what: str) -> Tensor:
    """Broadcast the leading (batch, head) dims of a BlockMask-derived tensor to (B, H)."""
    Bm, Hm = t.shape[:2]
    if Bm not in (1, B) or Hm not in (1, H):
        raise ValueError(
            f"{what} has batch/head dims ({Bm}, {Hm}) that do not broadcast to the requested "
            f"(B={B}, H={H}); pass B and H equal to the mask's, or 1-sized dims to broadcast."
        )
    return t.expand(B, H, *t.shape[2:])


def _block_mask_to_dense(
    block_mask: BlockMask, B: int, H: int, Q_LEN: int, KV_LEN: int, device: torch.device
) -> Tensor:
    mQ, mKV = block_mask.seq_lengths
    if (Q_LEN, KV_LEN) != (mQ, mKV):
        raise ValueError(
            f"dense_mask got Q_LEN={Q_LEN}, KV_LEN={KV_LEN} for a BlockMask of seq_lengths "
            f"{(mQ, mKV)}; pass the BlockMask's own lengths (or None)."
        )
    states = _expand_dims(block_states(block_mask).to(device), B, H, "the BlockMask")
    mask_mod = block_mask.mask_mod
    flexpack_mask = getattr(mask_mod, "_flexpack_mask", None)  # flexpack.masks.mask_of
    if flexpack_mask is not None:
        mask_mod = _on_device(flexpack_mask, device).mask_mod
    bq, bkv = block_mask.BLOCK_SIZE
    q_block = torch.arange(Q_LEN, device=device) // bq
    kv_block = torch.arange(KV_LEN, device=device) // bkv
    elem_states = states[:, :, q_block][:, :, :, kv_block]  # (B, H, Q_LEN, KV_LEN)
    out = elem_states == FULL
    if bool((elem_states == PARTIAL).any()):
        mod = create_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=device)
        out |= (elem_states == PARTIAL) & mod.to(torch.bool).expand(B, H, Q_LEN, KV_LEN)
    return out


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dense_mask: Tensor | object,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
    softcap: float | None = None,
) -> Tensor:
    """Masked softmax attention in float64, the reference flex_attention is tested against.

    Args:
        q: (B, Hq, L, E) float tensor.
        k: (B, Hkv, S, E) float tensor; Hkv == Hq, or Hkv divides Hq with ``enable_gqa``.
        v: (B, Hkv, S, Ev) float tensor.
        dense_mask: bool tensor broadcastable to (B, Hq, L, S), True where q may attend kv; a
            flexpack Mask, mask_mod callable or BlockMask is turned into one with
            :func:`dense_mask`.
        scale: score scale; defaults to 1 / sqrt(E).
        enable_gqa: let each group of Hq / Hkv query heads share one kv head (as in
            ``scaled_dot_product_attention``: query head h uses kv head h // (Hq // Hkv)).
        softcap: attention-logit soft-capping (Gemma 2): scores become
            ``softcap * tanh(scores / softcap)`` after ``scale``, before masking.

    Returns:
        (B, Hq, L, Ev) tensor in q's dtype. Query rows with no allowed key are exactly 0 (never
        NaN), as flex_attention returns them.

    Raises:
        ValueError: ranks, batch sizes, head counts or lengths that do not fit together, or a
            mask that does not broadcast.
        TypeError: a non-bool mask tensor.

    Example:
        >>> import torch
        >>> q = k = v = torch.eye(2).reshape(1, 1, 2, 2)
        >>> allowed = torch.tensor([[True, False], [False, False]])
        >>> reference_attention(q, k, v, allowed)[0, 0]
        tensor([[1., 0.],
                [0., 0.]])
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(
                f"reference_attention expected {name} of shape (B, H, L, E), got {got}."
            )
    B, Hq, L, E = q.shape
    Bk, Hkv, S, Ek = k.shape
    if k.shape[:3] != v.shape[:3] or Bk != B or Ek != E:
        raise ValueError(
            f"reference_attention got q {tuple(q.shape)}, k {tuple(k.shape)}, v "
            f"{tuple(v.shape)}; expected q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev)."
        )
    if Hkv != Hq:
        if not enable_gqa or Hq % Hkv != 0:
            raise ValueError(
                f"reference_attention got {Hq} query heads and {Hkv} kv heads; they must be equal, "
                "or pass enable_gqa=True with Hkv dividing Hq."
            )
        k = k.repeat_interleave(Hq // Hkv, dim=1)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
    if not isinstance(dense_mask, Tensor):
        dense_mask = _dense_mask_fn(dense_mask, None, None, L, S, device=q.device)
    if dense_mask.dtype != torch.bool:
        raise TypeError(
            f"reference_attention expected a bool mask (True = attend), got {dense_mask.dtype}; "
            "convert with mask.bool() (float additive masks are not accepted)."
        )
    try:
        allowed = dense_mask.to(q.device).expand(B, Hq, L, S)
    except RuntimeError as err:
        raise ValueError(
            f"reference_attention got a mask of shape {tuple(dense_mask.shape)} that does not "
            f"broadcast to (B, Hq, L, S) = {(B, Hq, L, S)}."
        ) from err
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    scores = q.double() @ k.double().transpose(-2, -1) * scale  # (B, Hq, L, S)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    any_allowed = allowed.any(dim=-1, keepdim=True)  # (B, Hq, L, 1)
    # Fully masked rows would be softmax(-inf, ..., -inf) = NaN; give them 0 instead.
    scores = torch.where(any_allowed, scores, torch.zeros_like(scores))
    probs = torch.softmax(scores, dim=-1) * any_allowed
    return (probs @ v.double()).to(q.dtype)


_dense_mask_fn: Callable[..., Tensor] = dense_mask


def dense_tree_mask(segment_ids: Tensor, parents: Tensor) -> Tensor:
    """The prefix-tree mask written out from its definition: the dense twin of ``masks.tree``.

    Query q attends key kv iff both are real tokens, ``kv <= q`` and kv's segment is q's segment
    or an ancestor of it, found by walking q's segment up through ``parents`` (a plain Python
    loop, independent of flexpack's subtree intervals).

    Args:
        segment_ids: (S,) or (B, S) integer, segment of each token, negative for padding.
        parents: (n,) or (B, n) integer, parent segment of each segment, -1 for a root.

    Returns:
        (B, 1, S, S) bool tensor on CPU.

    Example:
        >>> import torch
        >>> m = dense_tree_mask(torch.tensor([0, 1, 2]), torch.tensor([-1, 0, 0]))
        >>> m[0, 0].int()
        tensor([[1, 0, 0],
                [1, 1, 0],
                [1, 0, 1]], dtype=torch.int32)
    """
    seg = segment_ids if segment_ids.dim() == 2 else segment_ids[None]
    par = parents if parents.dim() == 2 else parents[None]
    B, S = seg.shape
    out = torch.zeros(B, 1, S, S, dtype=torch.bool)
    for b in range(B):
        row, up = seg[b].tolist(), par[b].tolist()
        for q in range(S):
            if row[q] < 0:
                continue
            path, s = set(), row[q]
            while s >= 0:
                path.add(s)
                s = up[s]
            for kv in range(q + 1):
                out[b, 0, q, kv] = row[kv] >= 0 and row[kv] in path
    return out
