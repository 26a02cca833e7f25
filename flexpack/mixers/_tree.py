"""Where the segments of prefix-tree rows are, for the recurrent and convolutional mixers.

A tree row (:func:`flexpack.pack_trees`) holds segments in depth-first order, a parent before
its children: a GRPO prompt, then its completions. A token's past is its root-to-leaf path: its
own segment's earlier tokens, then every ancestor segment. A mixer's state at the end of a shared
segment seeds every branch below it:

- a causal conv's taps follow the path back (a branch's first token sees its parent's last
  tokens, a grandparent's when the parent is shorter than the window): :meth:`TreePlan.taps`
  marks them, :meth:`TreePlan.tap_index` says where each one is;
- a scan runs by :meth:`TreePlan.scan`: a scan with a tree form of its own (``fn.tree``: the
  delta rules, Mamba2's SSD and Mamba's selective scan fork their chunked state over
  :meth:`TreePlan.chunk_layout`, where every segment starts a chunk and a branch's first chunk
  reads its parent's end state) runs it; any other runs once over every root-to-leaf path laid
  out as a row of its own, and each token takes its output from the first path that holds it
  (a shared segment's scan run once per branch below it).

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
from typing import Any

import torch
from torch import Tensor

__all__ = ["TreePlan"]


class TreePlan:
    """The segments of (B, S) tree rows, as mixers need them (see the module docstring).

    Built on the host from the tree mask's tables, once per forward (the mixers of all layers
    share it).

    Attributes:
        B, S: rows and tokens per row.
        documents: real segments.
        real: (B, S) bool, True on the segments' tokens.
        seq_idx: (1, B * S) int32, every segment (and padding run) a value of its own.

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
        device = segment_ids.device
        pred = torch.full((B, S), -1, dtype=torch.int64)
        paths: list[list[int]] = []  # flat token positions of each root-to-leaf path
        # every token's slot in the paths' rows (row * S_paths + offset; a path is at most as
        # long as its tree, so at most S): the first path that holds it
        S_paths = S
        pick = torch.full((B * S,), -1, dtype=torch.int64)
        longest, documents = 0, 0
        self._spans: list[list[tuple[int, int]]] = []  # per row, each segment's [start, end)
        self._parents = parents
        for b in range(B):
            row = seg[b]
            n = len(parents[b])
            documents += n
            positions = (row >= 0).nonzero().flatten()
            ids = row[positions]
            bounds = torch.searchsorted(ids, torch.arange(n + 1))
            spans = [
                (int(positions[bounds[j]]), int(positions[bounds[j + 1] - 1]) + 1) for j in range(n)
            ]
            self._spans.append(spans)
            has_child = [False] * n
            for j in range(n):
                start, end = spans[j]
                pred[b, start + 1 : end] = torch.arange(start, end - 1)
                p = parents[b][j]
                if p >= 0:
                    pred[b, start] = spans[p][1] - 1
                    has_child[p] = True
            # every token's slot: the first path (depth-first, so the first leaf below its
            # segment) that holds it; segments are visited in order, so a segment is placed by
            # the path of the first leaf after it
            placed = [False] * n
            for leaf in range(n):
                if has_child[leaf]:
                    continue
                chain = [leaf]
                while parents[b][chain[-1]] >= 0:
                    chain.append(parents[b][chain[-1]])
                flat: list[int] = []
                for j in reversed(chain):
                    start, end = spans[j]
                    if not placed[j]:  # slot: path row, offset in it
                        offsets = torch.arange(end - start) + len(flat)
                        pick[b * S + start : b * S + end] = len(paths) * S_paths + offsets
                        placed[j] = True
                    flat.extend(range(b * S + start, b * S + end))
                paths.append(flat)
                longest = max(longest, len(flat))
        self.documents = documents
        self._pred = pred
        self._device = device
        L = max(longest, 1)
        index = torch.full((max(len(paths), 1), L), B * S, dtype=torch.int64)  # B * S: a zero
        for i, flat in enumerate(paths):
            index[i, : len(flat)] = torch.tensor(flat, dtype=torch.int64)
        real = pick >= 0
        slot = torch.div(pick, S_paths, rounding_mode="floor") * L + pick % S_paths
        self._expand = index.to(device)
        self._collapse = torch.where(real, slot, 0).to(device)
        self.real = real.view(B, S).to(device)
        self._path_rows = len(paths)
        change = torch.ones(B, S, dtype=torch.bool)
        change[:, 1:] = seg[:, 1:] != seg[:, :-1]
        self.seq_idx = (change.reshape(-1).cumsum(0) - 1).to(torch.int32).view(1, -1).to(device)

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
            at = torch.arange(self.S).expand(self.B, self.S)
            real = self.real.cpu()
            at = torch.where(real, at, -1)
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

    @functools.cached_property
    def _layouts(self) -> dict[int, tuple[Tensor, Tensor, Tensor, list[list[int]]]]:
        return {}

    def chunk_layout(self, chunk: int) -> tuple[Tensor, Tensor, Tensor, list[list[int]]]:
        """The rows laid out for a chunked scan that forks its state: every segment starts a
        chunk of ``chunk`` tokens (its last chunk filled with zeros), so a chunk holds one
        segment and the state entering it is one chunk's end state.

        Returns:
            index: (B, N * chunk) int64, the row position of each laid-out token, S (a zero
                token) on the filling.
            back: (B, S) int64, each token's laid-out position (0 on padding).
            segment: (B, N * chunk) int64, the segment of each laid-out token (its filling
                too), -1 in chunks past the row's segments.
            sources: per row, per chunk, the chunk whose end state enters it: the previous one
                inside a segment, the parent's last at a segment's start, -1 for a root (a
                zero state) and past the row's segments.
        """
        found = self._layouts.get(chunk)
        if found is not None:
            return found
        rows = []
        for b in range(self.B):
            index, segment, sources, last = [], [], [], {}
            for j, (start, end) in enumerate(self._spans[b]):
                parent = self._parents[b][j]
                n = -(-(end - start) // chunk)
                for i in range(n):
                    if i:
                        sources.append(len(sources) - 1)
                    else:
                        sources.append(last[parent] if parent >= 0 else -1)
                    lo = start + i * chunk
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
        found = (index.to(self._device), back.to(self._device), segment.to(self._device), sources)
        self._layouts[chunk] = found
        return found

    def expand(self, t: Tensor) -> Tensor:
        """(B, S, ...) -> (P, L, ...): every root-to-leaf path as a row, zeros after its end."""
        flat = t.reshape(self.B * self.S, *t.shape[2:])
        flat = torch.cat([flat, flat.new_zeros(1, *t.shape[2:])])
        return flat[self._expand]

    def collapse(self, t: Tensor) -> Tensor:
        """(P, L, ...) -> (B, S, ...): each token from the first path that holds it, zeros on
        padding."""
        flat = t.reshape(-1, *t.shape[2:])[self._collapse]
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
        P, L = self._expand.shape
        segments = torch.zeros(P, L, dtype=torch.int64, device=self._expand.device)
        return self.collapse(fn(*expanded, segments, **kwargs))
