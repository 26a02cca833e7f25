"""Where the segments of prefix-tree rows are, for the recurrent and convolutional mixers.

A tree row (:func:`flexpack.pack_trees`) holds segments in depth-first order, a parent before
its children: a GRPO prompt, then its completions. A token's past is its root-to-leaf path: its
own segment's earlier tokens, then every ancestor segment. A mixer's state at the end of a shared
segment seeds every branch below it:

- a causal conv's taps follow the path back (a branch's first token sees its parent's last
  tokens, a grandparent's when the parent is shorter than the window): :meth:`TreePlan.taps`
  marks them, :meth:`TreePlan.shift` reads them;
- a scan runs by :meth:`TreePlan.scan`: a scan with a tree form of its own (``fn.tree``: the
  delta rules, Mamba2's SSD and Mamba's selective scan fork their chunked state through
  :meth:`TreePlan.chunked`, where every segment starts a chunk and a branch's first chunk
  reads its parent's end state, :func:`fork`) runs it; any other runs once over every
  root-to-leaf path laid out as a row of its own, and each token takes its output from the
  first path that holds it (a shared segment's scan run once per branch below it).

Either way every token's output is the one its path gets alone, and gradients reach a shared
segment from every branch. Shapes: B rows of S tokens; P paths of at most L tokens.

    segment_ids   0  0  0  1  1  2  -1        parents  -1  0  0
    paths         [0 1 2 3 4]  [0 1 2 5]      (flat token positions; leaves 1 and 2)
    tap_index(2)  [[0 1 2 3 4 5 6]            tap 0: the token itself
                   [- 0 1 2 3 2 -]]           tap 1: its predecessor on the path
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["ChunkLayout", "TreePlan", "fork"]


class ChunkLayout(NamedTuple):
    """Tree rows laid out for a chunked scan that forks its state (:meth:`TreePlan.chunk_layout`):
    every segment starts a chunk (its last chunk filled with zero tokens), so a chunk holds one
    segment and the state entering it is one chunk's end state. N chunks of C tokens per row.

    Attributes:
        index: (B, N * C) int64, the row position of each laid-out token, S (a zero token) on
            the filling.
        back: (B, S) int64, each token's laid-out position (0 on padding).
        segment: (B, N * C) int64, the segment of each laid-out token (its filling too), -1 in
            chunks past the row's segments.
        sources: per row, per chunk (host lists), the chunk whose end state enters it: the
            previous one inside a segment, the parent's last at a segment's start, -1 for a
            root (a zero state) and past the row's segments.
        entered: (B, N) bool, on the rows' device: the chunk enters with a state (source >= 0).
    """

    index: Tensor
    back: Tensor
    segment: Tensor
    sources: list[list[int]]
    entered: Tensor


def fork(ends: list[Tensor], sources: list[list[int]], n: int, zero: Tensor) -> Tensor | None:
    """The state entering chunk ``n`` of a chunked scan over a :class:`ChunkLayout`: row b's is
    the end state of chunk ``sources[b][n]`` (``ends``: the end states, (B, ...), of the chunks
    so far), ``zero``'s row where that is -1; None when every row continues from chunk n - 1
    (the scan keeps its running state)."""
    if n and all(row[n] == n - 1 for row in sources):
        return None
    return torch.stack(
        [ends[row[n]][b] if row[n] >= 0 else zero[b] for b, row in enumerate(sources)]
    )


def _with_zero(t: Tensor, dim: int) -> Tensor:
    """``t`` with one zero entry appended along ``dim`` (what an index past the end reads)."""
    shape = list(t.shape)
    shape[dim] = 1
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


class TreePlan:
    """The segments of (B, S) tree rows, as mixers need them (see the module docstring).

    Built on the host from the tree mask's tables, once per forward (the mixers of all layers
    share it); the per-path tables only for a scan without a tree form.

    Attributes:
        B, S: rows and tokens per row.
        real: (B, S) bool, True on the segments' tokens.

    Example:
        >>> import torch
        >>> from flexpack.mixers._tree import TreePlan
        >>> seg = torch.tensor([[0, 0, 0, 1, 1, 2, -1]])
        >>> plan = TreePlan.from_parents(seg, torch.tensor([[-1, 0, 0]]))
        >>> plan.tap_index(2)[1].tolist(), plan.taps(2)[1].int().tolist()
        ([[0, 0, 1, 2, 3, 2, 0]], [[0, 1, 1, 1, 1, 1, 0]])
    """

    def __init__(self, segment_ids: Tensor, parents: list[list[int]]) -> None:
        seg = segment_ids.detach().to("cpu", torch.int64)
        B, S = seg.shape
        self.B, self.S = B, S
        self._device = segment_ids.device
        self._parents = parents
        self._spans: list[list[tuple[int, int]]] = []  # per row, each segment's [start, end)
        pred = torch.full((B, S), -1, dtype=torch.int64)  # each token's predecessor on its path
        for b in range(B):
            row, n = seg[b], len(parents[b])
            positions = (row >= 0).nonzero().flatten()
            bounds = torch.searchsorted(row[positions], torch.arange(n + 1))
            spans = [
                (int(positions[bounds[j]]), int(positions[bounds[j + 1] - 1]) + 1) for j in range(n)
            ]
            self._spans.append(spans)
            for j, (start, end) in enumerate(spans):
                pred[b, start + 1 : end] = torch.arange(start, end - 1)
                if parents[b][j] >= 0:
                    pred[b, start] = spans[parents[b][j]][1] - 1
        self._pred = pred
        self._real = seg >= 0  # on the host, for the tap tables
        self.real = self._real.to(self._device)

    @classmethod
    def from_parents(cls, segment_ids: Tensor, parents: Tensor) -> TreePlan:
        """From :func:`flexpack.pack_trees`' layout: ``segment_ids`` (B, S) (-1 on padding),
        ``parents`` (B, M) (-1 for a root and past a row's segments)."""
        seg = segment_ids.detach().to("cpu", torch.int64)
        count = (seg.max(dim=1).values + 1).clamp(min=0).tolist()
        par = parents.detach().to("cpu", torch.int64)
        if par.dim() == 1:
            par = par[None].expand(seg.shape[0], -1)
        return cls(segment_ids, [par[b, : count[b]].tolist() for b in range(seg.shape[0])])

    @classmethod
    def from_ends(cls, segment_ids: Tensor, ends: Tensor) -> TreePlan:
        """From a tree mask's tables: ``ends`` (B, S + 1), segment k's descendants are
        k..ends[k] - 1 (-1 past a row's segments); the parent of k is the last segment before it
        whose subtree holds it."""
        table = ends.detach().to("cpu", torch.int64).tolist()
        parents = []
        for row in table:
            stack: list[int] = []
            found: list[int] = []
            for k, end in enumerate(row):
                if end < 0:
                    break
                while stack and row[stack[-1]] <= k:
                    stack.pop()
                found.append(stack[-1] if stack else -1)
                stack.append(k)
            parents.append(found)
        return cls(segment_ids, parents)

    @functools.cached_property
    def _tap_tables(self) -> dict[int, tuple[Tensor, Tensor]]:
        return {}

    def _taps_of(self, kernel: int) -> tuple[Tensor, Tensor]:
        found = self._tap_tables.get(kernel)
        if found is None:
            at = torch.where(self._real, torch.arange(self.S), -1)
            index, valid = [], []
            for _ in range(kernel):
                valid.append(at >= 0)
                index.append(at.clamp(min=0))
                at = torch.where(at >= 0, self._pred.gather(1, at.clamp(min=0)), -1)
            found = (
                torch.stack(index).to(self._device),
                torch.stack(valid).to(self._device),
            )
            self._tap_tables[kernel] = found
        return found

    def taps(self, kernel: int) -> Tensor:
        """(kernel, B, S) bool: ``[j, b, t]`` True where token t has a j-th predecessor on its
        root-to-leaf path (tap 0 is the token itself; padding has none)."""
        return self._taps_of(kernel)[1]

    def tap_index(self, kernel: int) -> Tensor:
        """(kernel, B, S) int64: the position in its row of token t's j-th predecessor on its
        path (0 where :meth:`taps` is False)."""
        return self._taps_of(kernel)[0]

    def shift(self, t: Tensor, j: int) -> Tensor:
        """(B, C, S) -> (B, C, S): each token's value ``j`` tokens back along its root-to-leaf
        path (arbitrary where :meth:`taps` ``[j]`` is False: callers mask it)."""
        if j == 0:
            return t
        built = max(self._tap_tables, default=0)  # a window's table holds every shorter one
        index = self.tap_index(max(j + 1, built))[j]  # (B, S)
        return t.gather(-1, index[:, None, :].expand_as(t))

    @functools.cached_property
    def _layouts(self) -> dict[int, ChunkLayout]:
        return {}

    def chunk_layout(self, chunk: int) -> ChunkLayout:
        """The rows laid out in chunks of ``chunk`` tokens for a scan that forks its state
        (:class:`ChunkLayout`), built once per chunk size."""
        found = self._layouts.get(chunk)
        if found is not None:
            return found
        rows = []
        for b in range(self.B):
            index, segment, sources, last = [], [], [], {}
            for j, (start, end) in enumerate(self._spans[b]):
                parent = self._parents[b][j]
                for lo in range(start, end, chunk):
                    if lo > start:
                        sources.append(len(sources) - 1)
                    else:
                        sources.append(last[parent] if parent >= 0 else -1)
                    hi = min(lo + chunk, end)
                    index.extend(range(lo, hi))
                    index.extend([self.S] * (chunk - (hi - lo)))
                    segment.extend([j] * chunk)
                last[j] = len(sources) - 1
            rows.append((index, segment, sources))
        N = max(1, max(len(r[2]) for r in rows))
        index = torch.full((self.B, N * chunk), self.S, dtype=torch.int64)
        segment = torch.full((self.B, N * chunk), -1, dtype=torch.int64)
        back = torch.zeros(self.B, self.S, dtype=torch.int64)
        sources = []
        for b, (ix, sg, src) in enumerate(rows):
            index[b, : len(ix)] = torch.tensor(ix, dtype=torch.int64)
            segment[b, : len(sg)] = torch.tensor(sg, dtype=torch.int64)
            placed = index[b] < self.S
            back[b, index[b][placed]] = placed.nonzero().flatten()
            sources.append(src + [-1] * (N - len(src)))
        found = ChunkLayout(
            index.to(self._device), back.to(self._device), segment.to(self._device), sources,
            (torch.tensor(sources) >= 0).to(self._device),
        )  # fmt: skip
        self._layouts[chunk] = found
        return found

    def chunked(self, fn: Callable[..., Tensor], chunk: int, *tensors: Tensor) -> Tensor:
        """``fn(*laid, layout)`` on ``tensors`` ((B, S, ...) per token) laid out in the
        :meth:`chunk_layout` of ``chunk`` tokens (zeros on the filling), its (B, N * C, ...)
        output read back to (B, S, ...), zeros on padding: a chunked scan's tree form."""
        layout = self.chunk_layout(chunk)
        rows = torch.arange(self.B, device=layout.index.device)[:, None]
        out = fn(*(_with_zero(t, 1)[rows, layout.index] for t in tensors), layout)
        out = out[rows, layout.back]
        return out * self.real.view(self.B, self.S, *([1] * (out.dim() - 2))).to(out.dtype)

    @functools.cached_property
    def _paths(self) -> tuple[Tensor, Tensor]:
        """(P, L) flat token positions of every root-to-leaf path (B * S, a zero token, after
        its end) and (B * S,) each token's slot in them: the first path that holds it (the
        first leaf below its segment, leaves taken depth-first)."""
        paths: list[list[int]] = []
        slots: list[tuple[int, int, int, int]] = []  # per segment: flat start, end, path, offset
        for b, (spans, parents) in enumerate(zip(self._spans, self._parents, strict=True)):
            leaves = set(range(len(spans))) - set(parents)
            placed = set()
            for leaf in sorted(leaves):
                chain = [leaf]
                while parents[chain[-1]] >= 0:
                    chain.append(parents[chain[-1]])
                flat: list[int] = []
                for j in reversed(chain):
                    start, end = (b * self.S + i for i in spans[j])
                    if j not in placed:
                        placed.add(j)
                        slots.append((start, end, len(paths), len(flat)))
                    flat.extend(range(start, end))
                paths.append(flat)
        L = max([len(p) for p in paths] + [1])
        index = torch.full((max(len(paths), 1), L), self.B * self.S, dtype=torch.int64)
        collapse = torch.zeros(self.B * self.S, dtype=torch.int64)
        for i, flat in enumerate(paths):
            index[i, : len(flat)] = torch.tensor(flat, dtype=torch.int64)
        for start, end, path, offset in slots:
            collapse[start:end] = path * L + offset + torch.arange(end - start)
        return index.to(self._device), collapse.to(self._device)

    def expand(self, t: Tensor) -> Tensor:
        """(B, S, ...) -> (P, L, ...): every root-to-leaf path as a row, zeros after its end."""
        return _with_zero(t.reshape(self.B * self.S, *t.shape[2:]), 0)[self._paths[0]]

    def collapse(self, t: Tensor) -> Tensor:
        """(P, L, ...) -> (B, S, ...): each token from the first path that holds it, zeros on
        padding."""
        flat = t.reshape(-1, *t.shape[2:])[self._paths[1]]
        keep = self.real.reshape(-1, *([1] * (t.dim() - 2))).to(flat.dtype)
        return (flat * keep).view(self.B, self.S, *t.shape[2:])

    def scan(self, fn: Callable[..., Tensor], *tensors: Tensor, **kwargs: Any) -> Tensor:
        """``fn(*tensors, segments, **kwargs)`` over the trees: ``fn.tree(*tensors, plan,
        **kwargs)`` where the scan has a tree form, else ``fn`` over the paths (each a one-
        segment row) with the outputs gathered back. ``tensors`` are (B, S, ...) per token."""
        tree = getattr(fn, "tree", None)
        if tree is not None:
            return tree(*tensors, self, **kwargs)
        expanded = [self.expand(t) for t in tensors]
        segments = torch.zeros(expanded[0].shape[:2], dtype=torch.int64, device=self._device)
        return self.collapse(fn(*expanded, segments, **kwargs))
