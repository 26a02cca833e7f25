"""Building prefix-tree batches: :func:`pack_trees` lays trees whole into rows
(:class:`TreeBatch`), :func:`pack_padded` reads a TRL-style padded RL batch as trees
(:class:`PaddedTrees`).

The public names are those of :mod:`flexpack.trees`, whose docstring draws the layout. The
log-probs and losses computed on these batches (``flexpack/trees/_logps.py``) import this module,
never the reverse.

Shape legend:
    R: packed rows; S = max_len tokens per row; V vocabulary; M: most segments in a row.
    N: rollouts (root-to-leaf paths); L: most targets of a rollout.
    B: padded rows; P: prompt tokens per padded row; C: completion tokens per padded row.
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
