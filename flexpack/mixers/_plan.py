"""Where the documents of packed rows are: right-padded document batches and varlen boundaries.

Shapes: B rows of S tokens; N documents (runs of one id in a row; -1 marks padding); each group
holds n documents padded on the right to its longest, L tokens.

    doc_ids  [[0 0 0 1 1 -1]        group 0: index [[0 1 2]  valid [[T T T]
              [0 0 0 0 1  1]]                      [6 7 8]]        [T T T]]  ...

A causal token mixer (a recurrent scan, a causal conv) run on a group gives each document what
it gets alone: every document starts at position 0 of its own row of the group, and the right
padding comes after it, where causality keeps it out. Kernels with a varlen interface take the
same boundaries as ``cu_seqlens`` (int32, (N + 1,)) or ``seq_idx`` ((1, B * S) int32) over the
flattened rows instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flexpack.layout import _run_starts

__all__ = ["DocumentPlan"]

# A group's rows are padded to its longest document; documents (longest first) join the current
# group while its padded tokens stay within PAD_FACTOR times its real ones. Few groups matter:
# each is one call of the mixer, and the chunked torch scans loop over a group's chunks in Python.
# A room whose per-token work dominates its per-call cost sets a tighter factor (Room.pad_factor).
PAD_FACTOR = 2.0


@dataclass(frozen=True)
class DocumentPlan:
    """The documents of a (B, S) packed batch, as groups for per-document calls.

    Attributes:
        B: rows.
        S: tokens per row.
        single: True when every row is one document without padding (nothing to split).
        groups: per group ``(index, valid, take, dest)``: ``index`` (n, L) int64 positions into
            the flattened (B * S) tokens, ``valid`` (n, L) bool (False on the right padding),
            ``take`` (k,) int64 the valid entries' positions in the flattened (n * L) group and
            ``dest`` (k,) int64 their positions in the flattened rows (index tensors, so that
            splitting and merging never sync with the host).
        seq_idx: (1, B * S) int32, the segment of every flattened token (padding runs are
            segments of their own), for kernels' ``seq_idx``.
        cu_seqlens: (segments + 1,) int32 boundaries of the same segments, for ``cu_seqlens``.
        documents: number of real documents.
        one_per_row: True when no row holds more than one document (padding aside): prompts,
            which a module's own forward with a cache runs as they are.
    """

    B: int
    S: int
    single: bool
    groups: tuple[tuple[Tensor, Tensor, Tensor, Tensor], ...]
    seq_idx: Tensor
    cu_seqlens: Tensor
    documents: int
    one_per_row: bool = True

    @classmethod
    def from_doc_ids(cls, doc_ids: Tensor, pad_factor: float = PAD_FACTOR) -> DocumentPlan:
        """Plan the documents of ``doc_ids``: (B, S) integer ids, -1 on padding.

        One host copy of the ids (the group shapes are host numbers).

        Example:
            >>> import torch
            >>> from flexpack.mixers._plan import DocumentPlan
            >>> p = DocumentPlan.from_doc_ids(torch.tensor([[0, 0, 0, 1, 1, -1]]))
            >>> p.documents, p.cu_seqlens.tolist(), p.seq_idx.tolist()
            (2, [0, 3, 5, 6], [[0, 0, 0, 1, 1, 2]])
            >>> [g[0].tolist() for g in p.groups]  # one group: (2 documents, 3 tokens)
            [[[0, 1, 2], [3, 4, 3]]]
        """
        if doc_ids.dim() != 2:
            raise ValueError(f"doc_ids must be (B, S), got shape {tuple(doc_ids.shape)}.")
        B, S = doc_ids.shape
        device = doc_ids.device
        ids = doc_ids.detach().to("cpu", torch.int64)
        _run_starts(ids)  # an id in two runs of a row is refused (on the host copy: no sync)
        # a new segment wherever the id changes or a row starts
        change = torch.ones(B, S, dtype=torch.bool)
        change[:, 1:] = ids[:, 1:] != ids[:, :-1]
        flat_change = change.reshape(-1)
        starts = flat_change.nonzero().flatten()
        ends = torch.cat([starts[1:], torch.tensor([B * S])])
        lengths = ends - starts
        real = ids.reshape(-1)[starts] >= 0
        seg = flat_change.cumsum(0) - 1
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), ends])
        n_docs = int(real.sum())
        per_row = torch.bincount(starts[real] // max(S, 1), minlength=B) if B * S else None
        one_per_row = per_row is None or int(per_row.max()) <= 1
        single = n_docs == B and bool(real.all()) and len(starts) == B
        groups = []
        if not single:
            # host lists, not a 0-d tensor per document: a Python step each either way
            docs = [(s, n) for s, n, r in zip(starts.tolist(), lengths.tolist(), real.tolist(),
                                                strict=True) if r]  # fmt: skip
            docs.sort(key=lambda d: -d[1])
            i = 0
            while i < len(docs):
                longest = real_tokens = docs[i][1]
                j = i + 1
                while j < len(docs) and (j - i + 1) * longest <= pad_factor * (
                    real_tokens + docs[j][1]
                ):
                    real_tokens += docs[j][1]
                    j += 1
                chunk = docs[i:j]
                offsets = torch.arange(longest)
                start = torch.tensor([s for s, _ in chunk])[:, None]
                n = torch.tensor([k for _, k in chunk])[:, None]
                valid = offsets[None, :] < n
                index = torch.where(valid, start + offsets[None, :], start)  # pad: any real token
                take = valid.flatten().nonzero().flatten()
                groups.append(tuple(
                    t.to(device) for t in (index, valid, take, index.flatten()[take])
                ))  # fmt: skip
                i = j
        return cls(
            B=B,
            S=S,
            single=single,
            groups=tuple(groups),
            seq_idx=seg.to(torch.int32).reshape(1, B * S).to(device),
            cu_seqlens=cu.to(torch.int32).to(device),
            documents=n_docs,
            one_per_row=one_per_row,
        )

    def split(self, x: Tensor, group: int) -> Tensor:
        """(B, S, ...) -> the group's (n, L, ...) right-padded documents (zeros on the padding)."""
        index, valid, _, _ = self.groups[group]
        flat = x.reshape(self.B * self.S, *x.shape[2:])
        out = flat[index]
        return out * valid.view(*valid.shape, *([1] * (x.dim() - 2))).to(out.dtype)

    def merge(self, pieces: list[Tensor]) -> Tensor:
        """Inverse of :meth:`split` over all groups: (B, S, ...) with zeros on the padding, in
        the pieces' dtype (a mixer under autocast returns bf16 from fp32 inputs: so does this)."""
        flat = pieces[0].new_zeros(self.B * self.S, *pieces[0].shape[2:])
        for (_, _, take, dest), piece in zip(self.groups, pieces, strict=True):
            flat = flat.index_copy(0, dest, piece.flatten(0, 1)[take])
        return flat.view(self.B, self.S, *pieces[0].shape[2:])

    @functools.cached_property
    def real(self) -> Tensor:
        """(B, S) bool: True on the documents' tokens, False on padding (no host sync)."""
        device = self.seq_idx.device
        if self.single:
            return torch.ones(self.B, self.S, dtype=torch.bool, device=device)
        flat = torch.zeros(self.B * self.S, dtype=torch.bool, device=device)
        for _, _, _, dest in self.groups:
            flat = flat.index_fill(0, dest, True)
        return flat.view(self.B, self.S)

    @functools.cached_property
    def _taps(self) -> dict[int, Tensor]:
        return {}

    def shift(self, t: Tensor, j: int) -> Tensor:
        """(B, C, S) -> (B, C, S): each token's value ``j`` tokens back in its row, zeros before
        the row's start (across a document start where :meth:`taps` ``[j]`` is False: callers
        mask it; a tree's path: :meth:`flexpack.mixers._tree.TreePlan.shift`)."""
        return torch.nn.functional.pad(t[..., : t.shape[-1] - j], (j, 0)) if j else t

    def scan(self, fn: Callable[..., Tensor], *tensors: Tensor, **kwargs: Any) -> Tensor:
        """``fn(*tensors, segments, **kwargs)``: a segment-aware scan over the rows, ``segments``
        (B, S) a value per document (and padding run)."""
        return fn(*tensors, self.seq_idx.view(self.B, self.S), **kwargs)

    def taps(self, kernel: int) -> Tensor:
        """(kernel, B, S) bool: ``[j, b, t]`` is True where token t of row b is a document's and
        token t - j belongs to the same document: the taps of a causal window of ``kernel``
        tokens that stay inside a document (tap 0 is the token itself; padding has none).

        Example:
            >>> import torch
            >>> from flexpack.mixers._plan import DocumentPlan
            >>> p = DocumentPlan.from_doc_ids(torch.tensor([[0, 0, 0, 1, 1, -1]]))
            >>> p.taps(2).int().tolist()
            [[[1, 1, 1, 1, 1, 0]], [[0, 1, 1, 0, 1, 0]]]
        """
        found = self._taps.get(kernel)
        if found is None:
            segment = self.seq_idx.view(self.B, self.S)
            found = self.real[None].repeat(kernel, 1, 1)
            for j in range(1, min(kernel, self.S)):
                found[j, :, j:] &= segment[:, j:] == segment[:, :-j]
                found[j, :, :j] = False
            found[min(kernel, self.S) :] = False
            self._taps[kernel] = found
        return found
