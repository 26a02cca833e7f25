"""Reference helpers shared by tests, independently of flexpack: read documents off doc ids, build
rows from document lengths, write dense masks from their spec, draw float64 inputs."""

import numpy as np
import torch


def docs_of(input_ids: torch.Tensor, doc_ids: torch.Tensor) -> list[tuple[int, ...]]:
    """The documents of (R, S) rows as token tuples."""
    out = []
    for ids, docs in zip(input_ids.tolist(), doc_ids.tolist(), strict=True):
        cur: dict[int, list[int]] = {}
        for t, d in zip(ids, docs, strict=True):
            if d >= 0:
                cur.setdefault(d, []).append(t)
        out.extend(tuple(v) for _, v in sorted(cur.items()))
    return out


def documents(doc_ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, stop) of every document, from (B, S) doc ids (-1 = padding)."""
    out = []
    for row, ids in enumerate(doc_ids.tolist()):
        start = 0
        for i in range(1, len(ids) + 1):
            if i == len(ids) or ids[i] != ids[start]:
                if ids[start] >= 0:
                    out.append((row, start, i))
                start = i
    return out


def layout_ids(rows: list[list[int]], length: int) -> torch.Tensor:
    """(len(rows), length) int64 doc ids of rows given as their documents' lengths, each row's
    documents numbered from 0 and right-padded with -1 (an empty row is all padding)."""
    ids = torch.full((len(rows), length), -1, dtype=torch.int64)
    for b, lengths in enumerate(rows):
        at = 0
        for j, n in enumerate(lengths):
            ids[b, at : at + n] = j
            at += n
    return ids


def random_rows(layout: list[list[int]], S: int, seed: int = 0):
    """(input_ids, doc_ids, docs, spans) of rows given as per-row document lengths: random tokens
    in [3, 64), int64 ids (B, S), int32 doc ids (B, S) numbered from 0 per row and right-padded
    with -1 (an empty row is all padding), each document's tokens, and its (row, start, stop)."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(3, 64, (n,), generator=g) for row in layout for n in row]
    ids = torch.zeros(len(layout), S, dtype=torch.long)
    doc_ids = torch.full((len(layout), S), -1, dtype=torch.int32)
    spans, k = [], 0
    for b, row in enumerate(layout):
        at = 0
        for j, n in enumerate(row):
            ids[b, at : at + n] = docs[k]
            doc_ids[b, at : at + n] = j
            spans.append((b, at, at + n))
            at, k = at + n, k + 1
    return ids, doc_ids, docs, spans


def dense_document_causal(d) -> torch.Tensor:
    """(B, 1, S, S) document-causal mask of (B, S) ids ``d`` (-1 = padding), from the spec."""
    d = np.asarray(d)
    S = d.shape[-1]
    dq, dkv = d[:, :, None], d[:, None, :]
    out = (dq == dkv) & (dq >= 0) & (np.arange(S)[:, None] >= np.arange(S)[None, :])
    return torch.from_numpy(out[:, None])


def qkv(B: int, S: int, H: int = 2, D: int = 8, seed: int = 0):
    """Seeded q, k, v, each (B, H, S, D) float64: inputs for float64 references."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, S, D, dtype=torch.float64, generator=g) for _ in range(3))
