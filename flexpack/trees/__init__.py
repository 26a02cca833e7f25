"""Prefix-tree packing: shared prompts forwarded once (GRPO groups, DPO pairs, multi-turn rollouts).

A GRPO group is a prompt with G completions; a DPO pair a prompt with a chosen and a rejected
answer; a multi-turn rollout shares whole earlier turns. Forwarded one rollout per document they
cost ``G * (P + R)`` tokens; as a tree, ``P + G * R``. :func:`pack_trees` lays whole trees into rows
of ``max_len`` (a parent before its children, depth-first), :func:`flexpack.masks.tree` lets each
token see its own segment causally and every token of its ancestors, and position ids continue
along the path, so every root-to-leaf path sees exactly the positions, keys and values it would
see run alone. :meth:`TreeBatch.gather_logps` reads the log-probs back per rollout.

One group (prompt ``[5, 6, 7]``, completions ``[8, 9]`` and ``[4]``), ``max_len=8``, pad id 0::

    input_ids     5   6   7   8   9   4   0   0
    segment_ids   0   0   0   1   1   2  -1  -1       parents  -1   0   0
    position_ids  0   1   2   3   4   3   0   0

    rollout 0: log p(8 | 5 6 7), log p(9 | 5 6 7 8)     (targets of segment 1)
    rollout 1: log p(4 | 5 6 7)                         (target of segment 2)

Shape legend:
    R: packed rows; S = max_len tokens per row; V vocabulary; M: most segments in a row.
    N: rollouts (root-to-leaf paths); L: most targets of a rollout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from flexpack import masks as _masks
from flexpack.layout import _as_int64_ids
from flexpack.packing import pack

__all__ = [
    "PaddedTrees",
    "RolloutLogps",
    "TreeBatch",
    "grpo_loss",
    "pack_padded",
    "pack_trees",
    "rollout_logps",
    "sequence_logps",
]


@dataclass(frozen=True, eq=False)
class TreeBatch:
    """Packed rows of prefix trees, what :func:`pack_trees` returns.

    Attributes:
        input_ids: (R, S) int64; the pad id on padding.
        segment_ids: (R, S) int32; segment of each token, numbered 0..n-1 per row depth-first
            (a parent before its children), -1 on padding.
        parents: (R, M) int64; parent segment of each segment, -1 for a root and past a row's
            segments.
        position_ids: (R, S) int64; depth of each token on its root-to-leaf path (a segment
            starts where its parent ends), 0 on padding.
        num_tokens: real tokens stored (every token of every tree, once).
        rollout_groups: (N,) int64; the group (index into ``groups``) of each rollout.
        rollout_lengths: (N,) int64; targets of each rollout (its tokens after the root segment).

    Example:
        >>> b = pack_trees([([5, 6, 7], [[8, 9], [4]])], max_len=8)
        >>> b.input_ids, b.segment_ids, b.parents
        (tensor([[5, 6, 7, 8, 9, 4, 0, 0]]), tensor([[ 0,  0,  0,  1,  1,  2, -1, -1]],
               dtype=torch.int32), tensor([[-1,  0,  0]]))
        >>> b.position_ids, b.num_tokens, b.rollout_lengths
        (tensor([[0, 1, 2, 3, 4, 3, 0, 0]]), 6, tensor([2, 1]))
    """

    input_ids: Tensor
    segment_ids: Tensor
    parents: Tensor
    position_ids: Tensor
    num_tokens: int
    rollout_groups: Tensor
    rollout_lengths: Tensor
    # Flat (R * S) positions of every target token (each non-root token once) and of the logits
    # that predict it; per rollout, its targets as indices into those lists (T past its end).
    _targets: Tensor = field(repr=False)
    _sources: Tensor = field(repr=False)
    _rollout_targets: Tensor = field(repr=False)
    _rollout_valid: Tensor = field(repr=False)
    # (R, S + 1) subtree ends of flexpack.masks.tree, computed on the host when the batch moves
    # (the validation reads the layout on the host): mask() on the device then syncs nothing.
    _tree_ends: Tensor | None = field(default=None, repr=False)

    @property
    def shape(self) -> tuple[int, int]:
        """(R, S)."""
        return (int(self.input_ids.shape[0]), int(self.input_ids.shape[1]))

    @property
    def num_rollouts(self) -> int:
        """N, the root-to-leaf paths of all groups."""
        return int(self.rollout_groups.shape[0])

    def mask(self) -> _masks.Mask:
        """The tree mask of the rows (it includes the padding mask), for ``flexpack.attention``.

        Example:
            >>> pack_trees([([1, 2], [[3], [4]])], max_len=4).mask().kind
            'tree'
        """
        if self._tree_ends is not None and self._tree_ends.device == self.segment_ids.device:
            return _masks._tree_from_tables(self.segment_ids.clone(), self._tree_ends)
        return _masks.tree(self.segment_ids, self.parents)

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> TreeBatch:
        """The same batch on ``device``.

        Example:
            >>> pack_trees([[1, 2]], max_len=4).to("cpu").input_ids.device
            device(type='cpu')
        """
        moved = {
            name: getattr(self, name).to(device, non_blocking=non_blocking)
            for name in (
                "input_ids",
                "segment_ids",
                "parents",
                "position_ids",
                "rollout_groups",
                "rollout_lengths",
                "_targets",
                "_sources",
                "_rollout_targets",
                "_rollout_valid",
            )
        }
        ends = self._tree_ends
        if ends is None and self.segment_ids.device.type == "cpu":
            ends = self.mask()._tree_ends  # validated here, on the host, once
        if ends is not None:
            ends = ends.to(device, non_blocking=non_blocking)
        return TreeBatch(num_tokens=self.num_tokens, **moved, _tree_ends=ends)

    def gather_logps(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """Per-rollout log-probs of the rollout tokens from the logits of the packed rows.

        Rollout n is the n-th root-to-leaf path, groups in the order given and paths in
        depth-first order within a group. Its row holds log p(token) for every token of the path
        after the root segment, in order: the first token of a segment is predicted from the last
        token of its parent, every other token from the one before it, as in the rollout run
        alone. A segment shared by several rollouts gives its log-probs to each of them.

        Args:
            logits: (R, S, V) float logits of a model on ``input_ids`` (any float dtype; the
                log-softmax runs in float32, float64 for float64 logits).

        Returns:
            ``(logps, valid)``: (N, L) float32 (float64) log-probs, 0 past each rollout's end,
            and (N, L) bool, True on the ``rollout_lengths[n]`` first entries of row n.

        Raises:
            ValueError: logits not (R, S, V) for this batch, or on another device; a rollout
                token outside [0, V).

        Example:
            >>> b = pack_trees([([5, 6, 7], [[8, 9], [4]])], max_len=8)
            >>> logps, valid = b.gather_logps(torch.zeros(1, 8, 16))
            >>> logps.shape, valid.tolist()
            (torch.Size([2, 2]), [[True, True], [True, False]])
        """
        R, S = self.shape
        if not isinstance(logits, Tensor) or not logits.is_floating_point():
            got = logits.dtype if isinstance(logits, Tensor) else type(logits).__name__
            raise ValueError(f"gather_logps needs float logits of shape (R, S, V), got {got}.")
        if logits.dim() != 3 or tuple(logits.shape[:2]) != (R, S):
            raise ValueError(
                f"gather_logps needs logits of shape (R, S, V) = ({R}, {S}, V) for this batch, "
                f"got {tuple(logits.shape)}; pass the model's logits on batch.input_ids "
                f"(model(...).logits for transformers)."
            )
        if logits.device != self._targets.device:
            raise ValueError(
                f"logits are on {logits.device} but the batch on {self._targets.device}; move the "
                f"batch with batch.to(logits.device)."
            )
        flat = logits.reshape(R * S, -1)  # (R * S, V)
        tokens = self.input_ids.reshape(-1)[self._targets]  # (T,)
        V = logits.shape[-1]
        bad = (tokens < 0) | (tokens >= V)  # a negative id would read entry V - 1 silently
        if bool(bad.any()):
            raise ValueError(
                f"gather_logps: rollout token {int(tokens[bad][0])} is not a token id in "
                f"[0, {V}) (the logits' vocabulary size); check the vocabulary size of the model "
                f"against the tokenizer."
            )
        if logits.dtype in (torch.float32, torch.float64):
            # No (T, V) copy: the log-normalizer of every position, then one entry per target.
            lse = torch.logsumexp(logits, dim=-1).reshape(-1)  # (R * S,)
            lp = flat[self._sources, tokens] - lse[self._sources]  # (T,)
        else:  # half precision: the predicting positions only, normalized in float32
            src = flat[self._sources].float()  # (T, V)
            lp = src.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(src, dim=-1)
        # Entries past a rollout's end index the spare 0 appended here.
        logps = torch.nn.functional.pad(lp, (0, 1))[self._rollout_targets]  # (N, L)
        return logps, self._rollout_valid

    def token_counts(self) -> Tensor:
        """(R, S) int64: how many rollouts' root-to-leaf paths hold each token, 0 on padding.

        A prompt shared by G rollouts counts G, each completion token 1: the times the token
        appears in the padded rows the trees replace (a statistic over those rows, such as an
        MoE router's load-balancing loss, weighs tree tokens by it). No host sync on the
        batch's device.

        Example:
            >>> pack_trees([([5, 6], [[8, 9], [4]])], max_len=6).token_counts()
            tensor([[2, 2, 1, 1, 1, 0]])
        """
        R, S = self.shape
        seg = self.segment_ids.long()
        device = seg.device
        N = self.num_rollouts
        # each rollout's last target: the leaf segment its path ends in
        last = (self.rollout_lengths.to(device) - 1).clamp(min=0)[:, None]
        flat = self._targets.to(device)[self._rollout_targets.to(device).gather(1, last)[:, 0]]
        leaves = torch.zeros(R, S + 1, dtype=torch.int64, device=device)
        leaves.index_put_(
            (flat // S, seg.reshape(-1)[flat]), torch.ones(N, dtype=torch.int64, device=device),
            accumulate=True,
        )  # fmt: skip
        # segment k's subtree is segments k .. ends[k] - 1 (depth-first numbering)
        ends = self._tree_ends if self._tree_ends is not None else _masks._tree_ends(
            self.segment_ids, self.parents
        )  # fmt: skip
        ends = ends.to(device)
        before = torch.nn.functional.pad(leaves.cumsum(1), (1, 0))  # (R, S + 2)
        k = torch.arange(S + 1, device=device).expand(R, S + 1)
        below = before.gather(1, ends.clamp(min=0)) - before.gather(1, k)  # (R, S + 1)
        below = torch.where(ends >= 0, below, 0)
        return torch.where(seg >= 0, below.gather(1, seg.clamp(min=0)), 0)


# ----------------------------------------------------------------------------- parsing


def _is_tokens(x: Any) -> bool:
    if isinstance(x, Tensor | np.ndarray):
        return x.ndim == 1
    return isinstance(x, Sequence) and not isinstance(x, str | bytes)


def _as_tokens(x: Any, where: str) -> np.ndarray:
    if isinstance(x, Tensor):
        x = x.detach().cpu().numpy()
    try:
        arr = np.asarray(x)
    except ValueError:  # ragged nesting
        arr = None
    if arr is None or arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
        got = "ragged nesting" if arr is None else f"shape {arr.shape} and dtype {arr.dtype}"
        raise TypeError(
            f"{where} must be a sequence of int token ids, got {type(x).__name__} of {got}; a "
            f"node is a token sequence (a leaf) or a pair (tokens, [children])."
        )
    if arr.size == 0:
        raise ValueError(
            f"{where} has no tokens; every segment of a tree needs at least one (drop empty "
            f"completions, or give them an end-of-sequence token)."
        )
    arr = _as_int64_ids(arr, where)
    if int(arr.min()) < 0:  # as pack_sequences and the CLI refuse them
        raise ValueError(
            f"{where} holds token id {int(arr[np.argmax(arr < 0)])}; token ids are vocabulary "
            "indices, >= 0 (an embedding would read a negative id from the end of the table). "
            "Map or drop that segment."
        )
    return arr


def _split_node(node: Any, where: str) -> tuple[np.ndarray, list[Any]]:
    """(tokens, children) of a node: a pair (tokens, [children]) or a bare token sequence."""
    if (
        isinstance(node, tuple | list)
        and len(node) == 2
        and _is_tokens(node[0])
        and isinstance(node[1], list | tuple)
        and all(not isinstance(c, int | np.integer) for c in node[1])
    ):
        return _as_tokens(node[0], where), list(node[1])
    return _as_tokens(node, where), []


def _flatten(group: Any, g: int) -> tuple[list[np.ndarray], list[int], list[list[int]]]:
    """Depth-first segments of one tree: tokens, parent (-1 root) and the root-to-leaf paths."""
    segments: list[np.ndarray] = []
    parents: list[int] = []
    paths: list[list[int]] = []
    stack: list[tuple[Any, int, list[int], str]] = [(group, -1, [], f"groups[{g}]")]
    while stack:
        node, parent, path, where = stack.pop()
        tokens, children = _split_node(node, where)
        k = len(segments)
        segments.append(tokens)
        parents.append(parent)
        path = [*path, k]
        if not children:
            paths.append(path)
        # Reversed onto the stack, so the first child comes out (and is numbered) first.
        for c in reversed(range(len(children))):
            stack.append((children[c], k, path, f"{where}[1][{c}]"))
    return segments, parents, paths


# ----------------------------------------------------------------------------- packing


def pack_trees(
    groups: Sequence[Any],
    max_len: int,
    *,
    strategy: str = "bfd",
    seed: int | None = 0,
    pad_id: int = 0,
) -> TreeBatch:
    """Pack prefix trees (GRPO groups, DPO pairs, multi-turn rollouts) whole into rows.

    A node is a pair ``(tokens, [children])`` or a bare token sequence (a leaf; an ordinary
    document is a one-node tree). Each tree is laid out depth-first (a parent before its
    children, a whole subtree before the next sibling) and trees are assigned to rows by
    :func:`flexpack.pack` on their sizes (best-fit decreasing by default), never split.

    Args:
        groups: the trees, e.g. ``[(prompt, [completion_1, ..., completion_G]), ...]``; tokens
            are sequences of ints (lists, numpy arrays, 1-D tensors).
        max_len: S, tokens per row; every tree must fit in one row.
        strategy: the :func:`flexpack.pack` strategy over tree sizes ("bfd", "ffd", "greedy").
        seed: shuffles the rows (see :func:`flexpack.pack`); None keeps the packer's order.
        pad_id: token id written on padding.

    Returns:
        A :class:`TreeBatch`; ``batch.mask()`` is its attention mask and
        ``batch.gather_logps(logits)`` reads the rollouts' log-probs back.

    Raises:
        TypeError: a node that is neither a token sequence nor a (tokens, [children]) pair.
        ValueError: no groups, an empty segment, a negative token id or ``pad_id``, a tree
            longer than ``max_len`` (named), or a strategy that cuts samples ("wrap").

    Example:
        >>> dpo = ([1, 2, 3], [[4, 5], [6]])  # prompt, chosen, rejected
        >>> b = pack_trees([dpo, [7, 8]], max_len=6, seed=None)
        >>> b.input_ids.tolist(), b.segment_ids.tolist()
        ([[1, 2, 3, 4, 5, 6], [7, 8, 0, 0, 0, 0]], [[0, 0, 0, 1, 1, 2], [0, 0, -1, -1, -1, -1]])
        >>> b.num_rollouts, b.rollout_groups.tolist(), b.rollout_lengths.tolist()
        (3, [0, 0, 1], [2, 1, 0])
    """
    if isinstance(groups, str | bytes) or not isinstance(groups, Sequence):
        raise TypeError(
            f"groups must be a list of trees, got {type(groups).__name__}; wrap one tree as [tree]."
        )
    if len(groups) == 0:
        raise ValueError("groups is empty; pack_trees needs at least one tree.")
    if strategy == "wrap":
        raise ValueError(
            "strategy='wrap' cuts samples at row ends, but a tree must stay whole in its row; "
            "use 'bfd' (default), 'ffd' or 'greedy'."
        )
    from flexpack._packed_batch import _check_pad_id

    pad_id = _check_pad_id(pad_id)  # an int in 0..2**63 - 1, as pack_sequences takes it
    trees = [_flatten(group, g) for g, group in enumerate(groups)]
    sizes = np.array([sum(len(s) for s in segs) for segs, _, _ in trees], dtype=np.int64)
    if isinstance(max_len, int) and not isinstance(max_len, bool) and max_len >= 1:
        too_long = np.flatnonzero(sizes > max_len)
        if too_long.size:
            g = int(too_long[0])
            raise ValueError(
                f"groups[{g}] has {int(sizes[g])} tokens, more than max_len={max_len}; a tree is "
                f"packed whole into one row, so raise max_len to at least {int(sizes.max())} or "
                f"split the tree ({too_long.size} of {len(groups)} trees are too long)."
            )
    plan = pack(sizes, max_len, strategy=strategy, seed=seed)
    R, S = plan.num_rows, plan.max_len

    input_ids = np.full((R, S), pad_id, dtype=np.int64)
    segment_ids = np.full((R, S), -1, dtype=np.int32)
    position_ids = np.zeros((R, S), dtype=np.int64)
    row_parents: list[list[int]] = [[] for _ in range(R)]
    targets: list[np.ndarray] = []
    sources: list[np.ndarray] = []
    seg_targets: list[list[tuple[int, int]]] = [[] for _ in groups]  # per tree, per segment
    num_targets = 0
    fill = np.zeros(R, dtype=np.int64)
    for row, g, _, _ in plan.segments.tolist():
        segs, pars, _ = trees[g]
        base = len(row_parents[row])  # segment numbers of this tree continue the row's
        starts = np.zeros(len(segs), dtype=np.int64)
        pos0 = np.zeros(len(segs), dtype=np.int64)
        for k, (tokens, p) in enumerate(zip(segs, pars, strict=True)):
            c, n = int(fill[row]), len(tokens)
            starts[k] = c
            pos0[k] = 0 if p < 0 else pos0[p] + len(segs[p])
            input_ids[row, c : c + n] = tokens
            segment_ids[row, c : c + n] = base + k
            position_ids[row, c : c + n] = np.arange(pos0[k], pos0[k] + n)
            row_parents[row].append(-1 if p < 0 else base + p)
            fill[row] += n
            if p < 0:
                seg_targets[g].append((num_targets, num_targets))
                continue
            flat = row * S + c + np.arange(n)
            prev = flat - 1
            prev[0] = row * S + starts[p] + len(segs[p]) - 1  # the parent's last token
            targets.append(flat)
            sources.append(prev)
            seg_targets[g].append((num_targets, num_targets + n))
            num_targets += n

    rollout_groups: list[int] = []
    rollout_targets: list[np.ndarray] = []
    for g, (_, _, paths) in enumerate(trees):
        for path in paths:
            rollout_groups.append(g)
            rollout_targets.append(
                np.concatenate(
                    [np.arange(*seg_targets[g][k]) for k in path] or [np.zeros(0, np.int64)]
                )
            )
    lengths = np.array([len(t) for t in rollout_targets], dtype=np.int64)
    L = max(1, int(lengths.max()))
    index = np.full((len(lengths), L), num_targets, dtype=np.int64)  # past the end: a spare 0
    valid = np.arange(L)[None, :] < lengths[:, None]
    index[valid] = np.concatenate(rollout_targets) if num_targets else np.zeros(0, np.int64)
    M = max(len(p) for p in row_parents)
    parents = np.full((R, M), -1, dtype=np.int64)
    for row, p in enumerate(row_parents):
        parents[row, : len(p)] = p

    def cat(parts: list[np.ndarray]) -> Tensor:
        return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64))

    return TreeBatch(
        input_ids=torch.from_numpy(input_ids),
        segment_ids=torch.from_numpy(segment_ids),
        parents=torch.from_numpy(parents),
        position_ids=torch.from_numpy(position_ids),
        num_tokens=int(sizes.sum()),
        rollout_groups=torch.tensor(rollout_groups, dtype=torch.int64),
        rollout_lengths=torch.from_numpy(lengths),
        _targets=cat(targets),
        _sources=cat(sources),
        _rollout_targets=torch.from_numpy(index),
        _rollout_valid=torch.from_numpy(valid),
    )


# ----------------------------------------------------------------------------- losses


def sequence_logps(logps: Tensor, valid: Tensor, *, reduction: str = "sum") -> Tensor:
    """Per-rollout log-prob of its tokens: the DPO / reward-model input, from ``gather_logps``.

    Unpacked equivalent, for rollout n with completion tokens ``y`` after prompt ``x``:
    ``sum_t log p(y_t | x, y_<t)`` ("sum") or that divided by ``len(y)`` ("mean").

    Args:
        logps: (N, L) float, from :meth:`TreeBatch.gather_logps`.
        valid: (N, L) bool, from the same call.
        reduction: "sum" or "mean" (0 for a rollout without targets).

    Returns:
        (N,) tensor in logps' dtype.

    Example:
        >>> sequence_logps(torch.tensor([[-1.0, -2.0], [-3.0, 0.0]]),
        ...                torch.tensor([[True, True], [True, False]]), reduction="mean")
        tensor([-1.5000, -3.0000])
    """
    _check_pair(logps, valid)
    total = torch.where(valid, logps, 0.0).sum(-1)
    if reduction == "sum":
        return total
    if reduction == "mean":
        return total / valid.sum(-1).clamp(min=1)
    raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}.")


def grpo_loss(
    logps: Tensor,
    valid: Tensor,
    advantages: Tensor,
    *,
    old_logps: Tensor | None = None,
    epsilon: float = 0.2,
    reduction: str = "token_mean",
) -> Tensor:
    """The clipped GRPO / PPO policy loss over rollouts, from ``gather_logps``.

    Per token: ``ratio = exp(logp - old_logp)`` and
    ``loss_t = -min(ratio * A_n, clip(ratio, 1 - epsilon, 1 + epsilon) * A_n)``, where ``A_n``
    is the advantage of the token's rollout. ``old_logps=None`` is the on-policy step
    (``old_logp = logp.detach()``: ratio 1, gradient ``-A_n * grad logp``).

    Unpacked equivalent, rollouts run one per sequence with the same per-token terms:
    "token_mean" is ``sum_n sum_t loss_{n,t} / sum_n len_n`` (every token weighs the same, as
    DAPO and TRL's default); "sequence_mean" is ``mean_n (sum_t loss_{n,t} / len_n)``, the
    original GRPO normalization. Rollouts without targets count for nothing.

    Args:
        logps: (N, L) float, from :meth:`TreeBatch.gather_logps`.
        valid: (N, L) bool, from the same call.
        advantages: (N,) float, one per rollout (e.g. rewards normalized within each group of
            ``batch.rollout_groups``).
        old_logps: (N, L) log-probs of the sampling policy, or None.
        epsilon: clipping range.
        reduction: "token_mean" or "sequence_mean".

    Returns:
        A scalar tensor.

    Example:
        >>> logps = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
        >>> valid = torch.tensor([[True, True], [True, False]])
        >>> loss = grpo_loss(logps, valid, torch.tensor([1.0, -1.0]))
        >>> loss.backward(); logps.grad  # -A_n / (3 tokens) on every valid token
        tensor([[-0.3333, -0.3333],
                [ 0.3333,  0.0000]])
    """
    _check_pair(logps, valid)
    if not isinstance(advantages, Tensor) or tuple(advantages.shape) != (logps.shape[0],):
        got = tuple(advantages.shape) if isinstance(advantages, Tensor) else type(advantages)
        raise ValueError(
            f"advantages must be a ({logps.shape[0]},) tensor, one per rollout, got {got}."
        )
    old = logps.detach() if old_logps is None else old_logps
    if tuple(old.shape) != tuple(logps.shape):
        raise ValueError(
            f"old_logps must have the shape of logps {tuple(logps.shape)}, got {tuple(old.shape)}."
        )
    ratio = torch.exp(torch.where(valid, logps - old, 0.0))
    adv = advantages.to(logps.dtype)[:, None]
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - epsilon, 1 + epsilon) * adv)
    per_token = torch.where(valid, per_token, 0.0)
    if reduction == "token_mean":
        return per_token.sum() / valid.sum().clamp(min=1)
    if reduction == "sequence_mean":
        n = valid.sum(-1)
        has = n > 0
        per_rollout = per_token.sum(-1) / n.clamp(min=1)
        return per_rollout[has].sum() / has.sum().clamp(min=1)
    raise ValueError(f"reduction must be 'token_mean' or 'sequence_mean', got {reduction!r}.")


def _check_pair(logps: Tensor, valid: Tensor) -> None:
    if not isinstance(logps, Tensor) or not isinstance(valid, Tensor):
        raise TypeError("logps and valid must be the tensors TreeBatch.gather_logps returns.")
    if logps.shape != valid.shape or valid.dtype != torch.bool:
        raise ValueError(
            f"logps and valid must have one shape (N, L) and valid be bool, got "
            f"{tuple(logps.shape)} and {tuple(valid.shape)} {valid.dtype}; pass both results of "
            f"TreeBatch.gather_logps."
        )


# ----------------------------------------------------------------------------- padded RL batches


@dataclass(frozen=True, eq=False)
class PaddedTrees:
    """A TRL-style padded batch packed as prefix trees, what :func:`pack_padded` returns.

    Attributes:
        batch: the :class:`TreeBatch`; its rollouts are the rows that have completion tokens.
        row_rollout: (B,) int64; the rollout of each padded row, -1 for a row without completion
            tokens (its results scatter as zeros).
        completion_mask: (B, C) bool; the real completion tokens of the padded layout.

    Example:
        >>> t = pack_padded(torch.tensor([[0, 5, 6], [0, 5, 6]]), torch.tensor([[0, 1, 1]] * 2),
        ...                 torch.tensor([[7, 8], [9, 0]]), torch.tensor([[1, 1], [1, 0]]))
        >>> t.batch.input_ids.tolist(), t.row_rollout.tolist()  # the prompt [5, 6] once
        ([[5, 6, 7, 8, 9]], [0, 1])
    """

    batch: TreeBatch
    row_rollout: Tensor
    completion_mask: Tensor

    def scatter(self, values: Tensor) -> Tensor:
        """Per-rollout values, (N, L) as from :meth:`TreeBatch.gather_logps`, in the (B, C) layout.

        Entry ``[b, j]`` is the value of the j-th real completion token of row b (its j-th target),
        0 on completion padding and on rows without completion tokens.

        Example:
            >>> t = pack_padded(torch.tensor([[1, 2]]), torch.tensor([[1, 1]]),
            ...                 torch.tensor([[3, 0]]), torch.tensor([[1, 0]]))
            >>> t.scatter(torch.tensor([[-0.5]]))
            tensor([[-0.5000,  0.0000]])
        """
        N = self.batch.num_rollouts
        if not isinstance(values, Tensor) or values.dim() < 2 or values.shape[0] != N:
            got = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
            raise ValueError(f"scatter needs (N, L) = ({N}, L) per-rollout values, got {got}.")
        B, C = self.completion_mask.shape
        out = values.new_zeros((B, C, *values.shape[2:]))
        has = self.row_rollout >= 0
        if not bool(has.any()):
            return out + 0 * values.sum()  # still in the graph
        rows = values[self.row_rollout.clamp(min=0)]  # (B, L)
        L = rows.shape[1]
        j = torch.cumsum(self.completion_mask, dim=1) - 1  # target index of each real token
        take = self.completion_mask & has[:, None] & (j < L)
        src = rows.gather(1, j.clamp(0, max(L - 1, 0)).to(torch.int64))
        return torch.where(take.reshape(B, C, *[1] * (values.dim() - 2)), src, out)

    def gather(self, values: Tensor) -> Tensor:
        """The inverse of :meth:`scatter`: (B, C) values read back as (N, L) per rollout.

        Example:
            >>> t = pack_padded(torch.tensor([[1, 2]]), torch.tensor([[1, 1]]),
            ...                 torch.tensor([[3, 4]]), torch.tensor([[1, 1]]))
            >>> t.gather(torch.tensor([[0.25, 0.5]]))
            tensor([[0.2500, 0.5000]])
        """
        B, C = self.completion_mask.shape
        if not isinstance(values, Tensor) or tuple(values.shape[:2]) != (B, C):
            got = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
            raise ValueError(f"gather needs (B, C) = ({B}, {C}) values, got {got}.")
        valid = self.batch._rollout_valid.to(values.device)
        N, L = valid.shape
        out = values.new_zeros((N, L, *values.shape[2:]))
        mask = self.completion_mask.to(values.device)
        rollout = self.row_rollout.to(values.device)
        take = mask & (rollout >= 0)[:, None]  # (B, C)
        j = torch.cumsum(mask, dim=1) - 1  # target index of each real completion token
        n = rollout[:, None].expand(B, C)
        out[n[take], j[take]] = values[take]
        return out


def _suffix_run(mask: Tensor) -> bool:
    """Every row is 0...0 1...1 (left padding)."""
    return bool((mask[:, 1:] >= mask[:, :-1]).all())


def pack_padded(
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    max_len: int | None = None,
    pad_id: int = 0,
) -> PaddedTrees:
    """Pack a padded RL batch (TRL's layout) as prefix trees: rows that share a prompt, once.

    The rollout of row b is its prompt's real tokens then its completion's real tokens. Rows
    whose real prompt tokens are equal form one tree (a group need not be contiguous, nor of one
    size); a row without completion tokens gets no rollout. Per-token results of the trees
    (``TreeBatch.gather_logps``, :func:`rollout_logps`) go back to the (B, C) completion layout
    with :meth:`PaddedTrees.scatter`.

    Args:
        prompt_ids: (B, P) int; left-padded prompts (GRPO's ``prompt_ids``).
        prompt_mask: (B, P) int or bool; 1 on real prompt tokens, a suffix of each row.
        completion_ids: (B, C) int; right-padded completions.
        completion_mask: (B, C) int or bool; 1 on real completion tokens, a prefix of each row.
        max_len: tokens per packed row; default the largest tree (so one tree fits each row).
        pad_id: token id written on padding.

    Returns:
        :class:`PaddedTrees`.

    Raises:
        ValueError: shapes that disagree, a row without prompt tokens, masks that are not
            left-padded prompts / right-padded completions (holes), or a tree over ``max_len``.

    Example:
        >>> prompts = torch.tensor([[0, 5, 6], [9, 9, 9], [0, 5, 6]])  # rows 0 and 2 share one
        >>> pmask = (prompts != 0).long()
        >>> completions = torch.tensor([[7, 0], [1, 2], [8, 4]])
        >>> t = pack_padded(prompts, pmask, completions, (completions != 0).long())
        >>> t.batch.num_tokens, t.row_rollout.tolist()  # (2 + 1 + 2) + (3 + 2) tokens, not 12
        (10, [0, 2, 1])
    """
    tensors = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
    }
    for name, t in tensors.items():
        if not isinstance(t, Tensor) or t.dim() != 2 or t.is_floating_point():
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 2-D integer or bool tensor, got {got}.")
    B, P = prompt_ids.shape
    C = completion_ids.shape[1]
    for name, t, want in (
        ("prompt_mask", prompt_mask, (B, P)),
        ("completion_ids", completion_ids, (B, C)),
        ("completion_mask", completion_mask, (B, C)),
    ):
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must have shape {want} like its ids, got {tuple(t.shape)}.")
    pmask = prompt_mask.detach().cpu().bool()
    cmask = completion_mask.detach().cpu().bool()
    if not _suffix_run(pmask):
        raise ValueError(
            "prompt_mask must mark a suffix of every row (left-padded prompts, as TRL pads "
            "them); got a row with a hole or right padding."
        )
    if not _suffix_run(cmask.flip(1)):
        raise ValueError(
            "completion_mask must mark a prefix of every row (right-padded completions); got a "
            "row with a hole or left padding: apply per-token weights after scatter instead."
        )
    plen = pmask.sum(1).tolist()
    clen = cmask.sum(1).tolist()
    if min(plen) == 0:
        raise ValueError(
            f"row {plen.index(0)} has no prompt tokens; every rollout needs at least one (its "
            "first completion token is predicted from the prompt's last)."
        )
    pids = prompt_ids.detach().cpu().numpy()
    cids = completion_ids.detach().cpu().numpy()
    group_of: dict[bytes, int] = {}
    groups: list[tuple[np.ndarray, list[np.ndarray]]] = []
    members: list[list[int]] = []
    for b in range(B):
        if clen[b] == 0:
            continue
        prompt = pids[b, P - plen[b] :].astype(np.int64)
        g = group_of.setdefault(prompt.tobytes(), len(groups))
        if g == len(groups):
            groups.append((prompt, []))
            members.append([])
        groups[g][1].append(cids[b, : clen[b]].astype(np.int64))
        members[g].append(b)
    row_rollout = torch.full((B,), -1, dtype=torch.int64)
    if not groups:  # no completion tokens anywhere: one tiny tree keeps the shapes valid
        groups = [(pids[0, P - plen[0] :].astype(np.int64), [])]
    n = 0
    for rows in members:  # rollouts: groups in order, children in order (depth-first)
        for b in rows:
            row_rollout[b] = n
            n += 1
    if max_len is None:
        max_len = max(len(p) + sum(len(c) for c in cs) for p, cs in groups)
    trees = [(p, cs) if cs else p for p, cs in groups]
    batch = pack_trees(trees, max_len, seed=None, pad_id=pad_id)
    device = completion_ids.device
    return PaddedTrees(
        batch=batch.to(device) if device.type != "cpu" else batch,
        row_rollout=row_rollout.to(device),
        completion_mask=completion_mask.bool(),
    )


@dataclass(frozen=True, eq=False)
class RolloutLogps:
    """Per-rollout results of :func:`rollout_logps`, each (N, L) float32, 0 past a rollout's end.

    Attributes:
        logps: log p(target) of every rollout token.
        valid: (N, L) bool, True on the ``rollout_lengths[n]`` first entries of row n.
        entropies: entropy of the predicting distribution, or None when not asked.
        mean_logits: mean (transformed) logit over the vocabulary, or None when not asked.
        is_top1: (N, L) bool, the target is the argmax (the first maximum), or None.
        aux_loss: () the MoE router's load-balancing loss over the trees' tokens, each weighed
            by the rollouts that hold it (``TreeBatch.token_counts``), as over the padded rows;
            None when not asked (``flexpack.integrations.trl.tree_logps(router_aux_loss=True)``).
    """

    logps: Tensor
    valid: Tensor
    entropies: Tensor | None = None
    mean_logits: Tensor | None = None
    is_top1: Tensor | None = None
    aux_loss: Tensor | None = None


def _logits(h: Tensor, weight: Tensor, bias: Tensor | None, tf: tuple) -> tuple[Tensor, Tensor]:
    """(z, dz/dy) of one chunk: y = h @ W.T + b in the compute dtype, z its float32 transform."""
    logit_scale, softcap, inv_t, compute_dtype = tf
    with torch.autocast(h.device.type, enabled=False):
        b = None if bias is None else bias.to(compute_dtype)
        y = torch.nn.functional.linear(h.to(compute_dtype), weight.to(compute_dtype), b)
    u = y.to(torch.promote_types(y.dtype, torch.float32)) * logit_scale  # (n, V) per chunk
    if softcap is None:
        return u * inv_t, None
    t = torch.tanh(u / softcap)
    return softcap * t * inv_t, (1 - t * t) * (logit_scale * inv_t)


class _ChunkedHead(torch.autograd.Function):
    """log p(target) and entropy of ``transform(h @ W.T + b)`` per row, ``chunk`` rows at a
    time; backward recomputes each chunk's logits, so only (chunk, V) tensors ever exist."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, tf, chunk, extra):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        T = hidden.shape[0]
        acc = torch.promote_types(tf[3], torch.float32)  # float32 (float64 for float64)
        lp = hidden.new_zeros(T, dtype=acc)
        ent, mean, top1 = torch.zeros_like(lp), torch.zeros_like(lp), torch.zeros_like(lp)
        for a in range(0, T, chunk):
            z, _ = _logits(hidden[a : a + chunk], weight, bias, tf)
            tok = tokens[a : a + chunk]
            log_z = torch.logsumexp(z, dim=-1)
            target = z.gather(-1, tok[:, None])[:, 0]
            lp[a : a + chunk] = target - log_z
            want_entropy, want_mean, want_top1 = extra  # (zeros where not asked for)
            if want_entropy:
                ent[a : a + chunk] = log_z - (torch.softmax(z, dim=-1) * z).sum(-1)
            if want_mean:
                mean[a : a + chunk] = z.mean(-1)
            if want_top1:
                top1[a : a + chunk] = (z.argmax(-1) == tok).to(acc)
        ctx.save_for_backward(hidden, weight, bias, tokens)
        ctx.tf, ctx.chunk = tf, chunk
        ctx.mark_non_differentiable(mean, top1)
        return lp, ent, mean, top1

    @staticmethod
    def backward(ctx, g_lp, g_ent, _g_mean, _g_top1):  # type: ignore[override]
        hidden, weight, bias, tokens = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc = torch.promote_types(ctx.tf[3], torch.float32)  # gradients accumulate in float32
        gh = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
        gw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        gb = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        T, chunk = hidden.shape[0], ctx.chunk
        for a in range(0, T, chunk):
            h = hidden[a : a + chunk]
            z, dz = _logits(h, weight, bias, ctx.tf)
            p = torch.softmax(z, dim=-1)
            g = torch.zeros_like(z)
            if g_lp is not None:  # d log p_t / dz = onehot(t) - p
                gl = g_lp[a : a + chunk, None].to(acc)
                g = g - gl * p
                g.scatter_add_(-1, tokens[a : a + chunk, None], gl)
            if g_ent is not None:  # dH / dz = -p * (z - E_p[z])
                ez = (p * z).sum(-1, keepdim=True)
                g = g - g_ent[a : a + chunk, None].to(acc) * p * (z - ez)
            if dz is not None:
                g = g * dz
            else:
                g = g * (ctx.tf[0] * ctx.tf[2])
            if gh is not None:
                gh[a : a + chunk] = g @ weight.to(acc)
            if gw is not None:
                gw += g.t() @ h.to(acc)
            if gb is not None:
                gb += g.sum(0)
        return (
            None if gh is None else gh.to(hidden.dtype),
            None if gw is None else gw.to(weight.dtype),
            None if gb is None else gb.to(bias.dtype),
            None,
            None,
            None,
            None,
        )


def rollout_logps(
    batch: TreeBatch,
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    entropy: bool = False,
    mean_logits: bool = False,
    is_top1: bool = False,
    chunk_size: int = 1024,
) -> RolloutLogps:
    """Per-rollout log-probs (and entropies) from a model's last hidden states, in chunks.

    The LM head runs on the hidden states of the predicting positions only (one per target, the
    last prompt token once per completion), ``chunk_size`` of them at a time, and backward
    recomputes each chunk: no (R, S, V) nor (T, V) logits tensor exists, only (chunk_size, V)
    ones (the gradient reaches ``hidden``, ``weight`` and ``bias``). Logits are transformed as
    TRL's fused LM head does, ``z = softcap * tanh(logit_scale * (h @ W.T + b) / softcap) /
    temperature``, in float32 after a projection in the autocast dtype (or the hidden states'
    dtype; float64 stays float64).

    Args:
        batch: the :class:`TreeBatch` the model ran on.
        hidden: (R, S, H) float last hidden states of the model on ``batch.input_ids``.
        weight: (V, H) the LM head's weight; bias: (V,) or None.
        temperature, logit_scale, softcap: the logit transform (TRL's ``temperature``).
        entropy, mean_logits, is_top1: also return these per token.
        chunk_size: predicting positions per LM-head call.

    Returns:
        :class:`RolloutLogps`.

    Raises:
        ValueError: hidden not (R, S, H) for this batch, or a weight of another width.

    Example:
        >>> b = pack_trees([([5, 6, 7], [[8, 9], [4]])], max_len=8)
        >>> r = rollout_logps(b, torch.zeros(1, 8, 4), torch.zeros(16, 4), entropy=True)
        >>> r.logps[0], r.entropies[1]  # uniform over 16 tokens
        (tensor([-2.7726, -2.7726]), tensor([2.7726, 0.0000]))
    """
    R, S = batch.shape
    if not isinstance(hidden, Tensor) or hidden.dim() != 3 or tuple(hidden.shape[:2]) != (R, S):
        got = tuple(hidden.shape) if isinstance(hidden, Tensor) else type(hidden).__name__
        raise ValueError(
            f"rollout_logps needs hidden states of shape (R, S, H) = ({R}, {S}, H), got {got}; "
            "pass the model's last_hidden_state on batch.input_ids."
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[2]:
        raise ValueError(
            f"weight must be (V, H) with H = {hidden.shape[2]}, got {tuple(weight.shape)}."
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}.")
    device = hidden.device
    sources = batch._sources.to(device)
    tokens = batch.input_ids.to(device).reshape(-1)[batch._targets.to(device)]  # (T,)
    flat = hidden.reshape(R * S, -1)
    compute_dtype = (
        torch.get_autocast_dtype(device.type)
        if torch.is_autocast_enabled(device.type)
        else hidden.dtype
    )
    tf = (float(logit_scale), softcap, 1.0 / temperature, compute_dtype)
    extra = (bool(entropy), bool(mean_logits), bool(is_top1))
    cols = _ChunkedHead.apply(flat[sources], weight, bias, tokens, tf, chunk_size, extra)
    index = batch._rollout_targets.to(device)
    valid = batch._rollout_valid.to(device)

    def per_rollout(col: Tensor) -> Tensor:
        return torch.nn.functional.pad(col, (0, 1))[index]  # past the end: the spare 0

    lp, ent, mean, top1 = cols
    logps = per_rollout(lp)
    ent = per_rollout(ent) if entropy else None
    mean = per_rollout(mean) if mean_logits else None
    top1 = per_rollout(top1).bool() & valid if is_top1 else None
    return RolloutLogps(logps=logps, valid=valid, entropies=ent, mean_logits=mean, is_top1=top1)
