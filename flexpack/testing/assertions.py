"""``assert_block_mask_matches``: compare a BlockMask with the mask it should implement."""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexpack.testing.references import (
    EMPTY,
    FULL,
    PARTIAL,
    _block_counts,
    _expand_dims,
    dense_mask,
)

__all__ = ["assert_block_mask_matches", "expected_block_states"]

_STATE_NAMES = {EMPTY: "empty (skipped)", PARTIAL: "partial", FULL: "full"}
_MAX_LISTED = 5  # problems listed one by one before "... and N more"
_WINDOW = 8  # half-size of the ASCII picture around the first element mismatch
_MAX_BLOCK_PICTURE = 24  # block pictures are drawn only up to this many blocks per side


def expected_block_states(
    dense: Tensor, block_size: int | tuple[int, int], *, exact: bool = True
) -> Tensor:
    """Block states implied by a dense mask: 0 empty, 1 partial, 2 full.

    Args:
        dense: (B, H, Q_LEN, KV_LEN) bool tensor.
        block_size: int or (q_block, kv_block).
        exact: True gives ``create_block_mask``'s classification, which pads the last,
            incomplete blocks with False, so an incomplete block is never full. False only looks
            at real elements (an incomplete block whose real pairs are all allowed is full).

    Returns:
        (B, H, ceil(Q_LEN / bq), ceil(KV_LEN / bkv)) int8 tensor.

    Example:
        >>> import torch
        >>> dense = torch.ones(1, 1, 3, 3, dtype=torch.bool).tril()
        >>> expected_block_states(dense, 2)[0, 0]
        tensor([[1, 0],
                [1, 1]], dtype=torch.int8)
        >>> expected_block_states(dense, 2, exact=False)[0, 0]
        tensor([[1, 0],
                [2, 2]], dtype=torch.int8)
    """
    bq, bkv = (block_size, block_size) if isinstance(block_size, int) else block_size
    B, H, Q, KV = dense.shape
    nq, nkv = math.ceil(Q / bq), math.ceil(KV / bkv)
    pad = (0, nkv * bkv - KV, 0, nq * bq - Q)
    allowed = torch.nn.functional.pad(dense.to(torch.int32), pad, value=0)
    allowed = allowed.view(B, H, nq, bq, nkv, bkv).sum(dim=(3, 5))
    if exact:
        size = torch.full_like(allowed, bq * bkv)
    else:
        real = torch.nn.functional.pad(torch.ones_like(dense, dtype=torch.int32), pad, value=0)
        size = real.view(B, H, nq, bq, nkv, bkv).sum(dim=(3, 5))
    states = torch.where(allowed > 0, PARTIAL, EMPTY)
    states = torch.where(allowed == size, FULL, states)
    return states.to(torch.int8)


def _expected_dense(block_mask: BlockMask, mask_or_dense: object) -> Tensor:
    Bm, Hm, Q, KV = block_mask.shape
    device = block_mask.kv_num_blocks.device
    if isinstance(mask_or_dense, Tensor):
        d = mask_or_dense
        if d.dtype != torch.bool:
            raise TypeError(
                f"assert_block_mask_matches expected a bool dense mask, got {d.dtype}; pass "
                "mask.bool() (True = attend)."
            )
        if d.dim() == 2:
            d = d[None, None]
        if d.dim() != 4 or tuple(d.shape[-2:]) != (Q, KV):
            raise ValueError(
                f"assert_block_mask_matches got a dense mask of shape {tuple(mask_or_dense.shape)}"
                f" for a BlockMask of shape {(Bm, Hm, Q, KV)}; expected (Q_LEN, KV_LEN) or "
                "(B, H, Q_LEN, KV_LEN)."
            )
        return d.to(device)
    B = Bm
    if Bm == 1:
        # A BlockMask shared by the batch (B=1) must match every row of a per-row mask.
        doc_ids = getattr(mask_or_dense, "doc_ids", None)
        if isinstance(doc_ids, Tensor) and doc_ids.dim() == 2:
            B = int(doc_ids.shape[0])
    return dense_mask(mask_or_dense, B, Hm, Q, KV, device=device)


def _fmt_problems(title: str, problems: list[str]) -> list[str]:
    if not problems:
        return []
    lines = [f"{title}: {len(problems)} problem(s)"]
    lines += [f"  {p}" for p in problems[:_MAX_LISTED]]
    if len(problems) > _MAX_LISTED:
        lines.append(f"  ... and {len(problems) - _MAX_LISTED} more")
    return lines


def _element_picture(exp: Tensor, got: Tensor, q0: int, kv0: int, bq: int, bkv: int) -> list[str]:
    """ASCII picture of one (Q, KV) slice around (q0, kv0), with block boundaries marked."""
    Q, KV = exp.shape
    q_start = max(0, min(q0 - _WINDOW, Q - 2 * _WINDOW))
    kv_start = max(0, min(kv0 - _WINDOW, KV - 2 * _WINDOW))
    qs = range(q_start, min(Q, q_start + 2 * _WINDOW))
    ks = range(kv_start, min(KV, kv_start + 2 * _WINDOW))
    e, g = exp[qs.start : qs.stop, ks.start : ks.stop], got[qs.start : qs.stop, ks.start : ks.stop]
    lines = [
        f"  picture of q {qs.start}..{qs.stop - 1} (rows) x kv {ks.start}..{ks.stop - 1} "
        "(columns): '#' allowed as expected, '.' masked as expected,",
        "  'x' expected allowed but masked, '!' expected masked but allowed, '|' and '-' block "
        "edges; '>' marks the first mismatch's row",
    ]
    for i, q in enumerate(qs):
        if q != qs.start and q % bq == 0:
            sep = "".join(("+-" if k % bkv == 0 and k != ks.start else "-") for k in ks)
            lines.append("    " + sep)
        row = []
        for j, k in enumerate(ks):
            if k != ks.start and k % bkv == 0:
                row.append("|")
            ev, gv = bool(e[i, j]), bool(g[i, j])
            row.append("#" if ev and gv else "." if not ev and not gv else "x" if ev else "!")
        marker = ">" if q == q0 else " "
        lines.append(f"  {marker} " + "".join(row) + f"   q={q}")
    return lines


def _block_picture(exp: Tensor, got: Tensor) -> list[str]:
    """Expected and found block states of one (batch, head) side by side."""
    nq, nkv = exp.shape
    if nq > _MAX_BLOCK_PICTURE or nkv > _MAX_BLOCK_PICTURE:
        return []
    sym = {EMPTY: ".", PARTIAL: "p", FULL: "F"}
    lines = ["  blocks (q-block rows x kv-block columns; '.' empty, 'p' partial, 'F' full):"]
    lines.append("    " + "expected".ljust(max(nkv, 8)) + "   found")
    for r in range(nq):
        e = "".join(sym[int(x)] for x in exp[r])
        g = "".join(sym[int(x)] for x in got[r])
        flag = "   <- differs" if e != g else ""
        lines.append("    " + e.ljust(max(nkv, 8)) + "   " + g + flag)
    return lines


def assert_block_mask_matches(
    block_mask: BlockMask,
    mask_or_dense: object,
    *,
    check_block_structure: bool = True,
    exact: bool = False,
) -> None:
    """Assert that a BlockMask implements a mask exactly, with a readable diff if it does not.

    Checks, in order:

    1. Element mask: what flex_attention computes with ``block_mask`` (skipped blocks masked,
       full blocks allowed, ``block_mask.mask_mod`` on partial blocks) equals the expected mask
       at every (b, h, q, kv).
    2. Block structure (``check_block_structure``): indices in range and no block listed twice;
       no block holding an allowed pair is skipped; no block marked full holds a masked pair.
       With ``exact=True``, every block's state (empty / partial / full) equals
       ``create_block_mask``'s (which never marks an incomplete last block full).

    Args:
        block_mask: torch ``BlockMask`` of shape (Bm, Hm, Q_LEN, KV_LEN).
        mask_or_dense: the expected mask: a bool tensor (Q_LEN, KV_LEN) or (B, H, Q_LEN, KV_LEN)
            (batch/head dims of size 1 broadcast), a flexpack ``Mask`` or a mask_mod callable
            (evaluated with :func:`dense_mask` on the BlockMask's grid; a Mask with 2-D
            ``doc_ids`` is evaluated for all its rows).
        check_block_structure: also check the block lists (step 2).
        exact: require create_block_mask's exact block classification.

    Raises:
        AssertionError: the BlockMask does not match; the message names the first mismatching
            batch / head / q-block / kv-block, what was expected and what was found, and draws
            the elements around the first mismatch.
        TypeError, ValueError: arguments of the wrong kind or shape.

    Example:
        >>> from torch.nn.attention.flex_attention import create_block_mask
        >>> causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
        >>> bm = create_block_mask(causal, 1, 1, 5, 5, device="cpu", BLOCK_SIZE=2)
        >>> assert_block_mask_matches(bm, causal, exact=True)
        >>> off_by_one = lambda b, h, q_idx, kv_idx: q_idx > kv_idx
        >>> assert_block_mask_matches(bm, off_by_one)
        Traceback (most recent call last):
        ...
        AssertionError: BlockMask does not match the expected mask ...
    """
    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            "assert_block_mask_matches expected a BlockMask first, got "
            f"{type(block_mask).__name__}."
        )
    expected = _expected_dense(block_mask, mask_or_dense)
    Bm, Hm, Q, KV = block_mask.shape
    B, H = max(Bm, expected.shape[0]), max(Hm, expected.shape[1])
    expected = _expand_dims(expected, B, H, "the expected mask")
    found = dense_mask(block_mask, B, H, Q, KV, device=expected.device)
    bq, bkv = block_mask.BLOCK_SIZE

    lines: list[str] = []
    first_block: tuple[int, int, int, int] | None = None
    diff = expected != found
    if bool(diff.any()):
        n_missing = int((diff & expected).sum())
        n_extra = int((diff & found).sum())
        b, h, q, kv = (int(x) for x in diff.nonzero()[0])
        first_block = (b, h, q // bq, kv // bkv)
        lines.append(
            f"element mask: {int(diff.sum())} of {diff.numel()} (b, h, q, kv) pairs differ "
            f"({n_missing} expected allowed but masked, {n_extra} expected masked but allowed)"
        )
        lines.append(
            f"  first at b={b}, h={h}, q={q}, kv={kv} (q-block {q // bq}, kv-block {kv // bkv}): "
            f"expected {'allowed' if expected[b, h, q, kv] else 'masked'}, found "
            f"{'allowed' if found[b, h, q, kv] else 'masked'}"
        )
        lines += _element_picture(expected[b, h], found[b, h], q, kv, bq, bkv)

    if check_block_structure:
        counts = _block_counts(block_mask)
        problems = list(counts.out_of_range)
        partial = _expand_dims(counts.partial.to(expected.device), B, H, "the BlockMask")
        full = _expand_dims(counts.full.to(expected.device), B, H, "the BlockMask")
        for what, where in (
            ("listed more than once as partial", partial > 1),
            ("listed more than once as full", full > 1),
            ("listed both as partial and as full", (partial > 0) & (full > 0)),
        ):
            for b, h, r, c in where.nonzero().tolist()[:_MAX_LISTED]:
                problems.append(f"b={b} h={h} q-block {r} kv-block {c}: {what}")
        got_states = torch.where(partial > 0, PARTIAL, EMPTY)
        got_states = torch.where(full > 0, FULL, got_states).to(torch.int8)
        loose = expected_block_states(expected, (bq, bkv), exact=False)
        want = expected_block_states(expected, (bq, bkv), exact=True) if exact else loose
        rules = [
            ("holds allowed pairs but is skipped", (loose != EMPTY) & (got_states == EMPTY)),
            ("is marked full but holds masked pairs", (got_states == FULL) & (loose != FULL)),
        ]
        if exact:
            rules.append(("differs from create_block_mask's classification", want != got_states))
        seen: set[tuple[int, ...]] = set()
        for what, where in rules:
            for b, h, r, c in where.nonzero().tolist():
                if (b, h, r, c) in seen:
                    continue
                seen.add((b, h, r, c))
                problems.append(
                    f"b={b} h={h} q-block {r} kv-block {c}: {what} (expected "
                    f"{_STATE_NAMES[int(want[b, h, r, c])]}, found "
                    f"{_STATE_NAMES[int(got_states[b, h, r, c])]})"
                )
                if first_block is None:
                    first_block = (b, h, r, c)
        lines += _fmt_problems("block structure", problems)
        if problems and first_block is not None:
            b, h = first_block[:2]
            lines += _block_picture(want[b, h], got_states[b, h])

    if lines:
        header = (
            f"BlockMask does not match the expected mask (BlockMask shape {(Bm, Hm, Q, KV)}, "
            f"BLOCK_SIZE {(bq, bkv)}, compared as B={B}, H={H})"
        )
        raise AssertionError("\n".join([header, *lines]))
