"""Reference helpers shared by tests: read documents off doc ids, independently of flexpack."""

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
