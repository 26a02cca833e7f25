"""Per-segment SDPA path of ``flexpack.attention`` for prefix-tree masks, any device, with backward.

Under a tree mask a segment's queries see the whole of its ancestor segments and themselves
causally, and nothing else. So attention splits into one SDPA call per segment: its queries
against the keys of its root-to-segment path (ancestors concatenated, then its own), with the
mask ``[all ancestors | causal]``, or plain ``is_causal`` for a root segment (an ordinary
document is one). Work is the sum over segments of ``L_s * (A_s + L_s)`` (A_s: tokens of its
ancestors), exactly what each rollout would cost alone minus the repeated prompts, instead of
``S^2``; no (S, S) mask is built.

Shape legend: B rows, Hq query heads, Hkv key/value heads, S tokens per row, D head dim;
L_s tokens of segment s, A_s tokens of its ancestors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from flexpack._attention_sdpa import sdpa


@dataclass(frozen=True)
class _Piece:
    """A run of a row: one segment, or padding (``path`` empty)."""

    length: int
    path: tuple[int, ...]  # piece indices of the ancestors (root first), then of this segment
    mask: Tensor | None  # (L_s, A_s + L_s) bool for a non-root segment; None otherwise


def spans_of(mask: object) -> list[list[_Piece]]:
    """:func:`tree_pieces` of a ``flexpack.masks.tree`` Mask, computed once and kept on the mask
    (every layer of a forward passes the same Mask)."""
    pieces = getattr(mask, "_spans", None)
    if pieces is None:
        pieces = tree_pieces(mask.doc_ids, mask._tree_ends)
        mask._spans = pieces
    return pieces


def tree_pieces(segment_ids: Tensor, ends: Tensor) -> list[list[_Piece]]:
    """The runs of every row (segments and padding) with each segment's path (host syncs).

    Args:
        segment_ids: (Bm, S) int, validated by ``flexpack.masks.tree``.
        ends: (Bm, W) int subtree ends (segment s's subtree is s..ends[s] - 1), W > the number
            of segments (``flexpack.masks.tree`` keeps W = S + 1).
    """
    device = segment_ids.device
    out = []
    for seg_row, ends_row in zip(segment_ids, ends.tolist(), strict=True):
        # Maximal runs of equal ids: each segment is one run, padding runs between them.
        ids, lengths = torch.unique_consecutive(seg_row, return_counts=True)
        runs = list(zip(ids.tolist(), lengths.tolist(), strict=True))  # (id, length)
        piece_of: dict[int, int] = {}
        stack: list[int] = []  # the current root-to-segment path, as segment ids
        pieces = []
        for i, (s, length) in enumerate(runs):
            if s < 0:
                pieces.append(_Piece(length, (), None))
                continue
            piece_of[s] = i
            while stack and not (stack[-1] <= s < ends_row[stack[-1]]):
                stack.pop()  # not an ancestor of s: its subtree is done
            path = (*(piece_of[a] for a in stack), i)
            stack.append(s)
            mask = None
            if len(path) > 1:
                A = sum(runs[p][1] for p in path[:-1])
                # Every ancestor key (A columns), then its own keys causally.
                mask = torch.ones(length, A + length, dtype=torch.bool, device=device).tril(A)
            pieces.append(_Piece(length, path, mask))
        out.append(pieces)
    return out


def per_tree_sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pieces: list[list[_Piece]],
    *,
    scale: float | None,
    enable_gqa: bool,
    softcap: float | None = None,
) -> Tensor:
    """Tree-masked attention as one SDPA call per segment.

    Args:
        q: (B, Hq, S, D); k, v: (B, Hkv, S, D).
        pieces: :func:`tree_pieces` of the mask, one list per row (a single list serves every
            row).
        softcap: attention-logit soft-capping (``flexpack._attention_sdpa.softcap_sdpa``); None
            for none.

    Returns:
        (B, Hq, S, Dv), 0 on padding tokens.
    """
    Hq = q.shape[1]
    Dv = v.shape[-1]
    rows = []
    # One unbind and one split per tensor and row: their backwards are single stacks / cats
    # (slicing per segment would zero-fill a full-size gradient per slice).
    for b, (qb, kb, vb) in enumerate(zip(q.unbind(0), k.unbind(0), v.unbind(0), strict=True)):
        row = pieces[b if len(pieces) > 1 else 0]
        sizes = [p.length for p in row]
        qs, ks, vs = qb.split(sizes, dim=1), kb.split(sizes, dim=1), vb.split(sizes, dim=1)
        outs = []
        for i, piece in enumerate(row):
            if not piece.path:  # padding
                outs.append(q.new_zeros(Hq, piece.length, Dv))
                continue
            if piece.mask is None:  # a root: plain causal over itself
                keys, values, causal = ks[i], vs[i], True
            else:  # ancestors, then itself
                keys = torch.cat([ks[p] for p in piece.path], dim=1)
                values = torch.cat([vs[p] for p in piece.path], dim=1)
                causal = False
            out = sdpa(
                qs[i][None],
                keys[None],
                values[None],
                attn_mask=piece.mask,
                is_causal=causal,
                scale=scale,
                enable_gqa=enable_gqa,
                softcap=softcap,
            )
            outs.append(out[0])
        rows.append(torch.cat(outs, dim=1) if len(outs) > 1 else outs[0])
    out = torch.stack(rows)
    if not any(piece.path for row in pieces for piece in row):
        # All padding: keep the graph so that backward still runs (gradients are 0).
        out = out + 0.0 * (q.sum() + k.sum() + v.sum())
    return out
