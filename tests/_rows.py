"""Helpers shared by the data-pipeline tests."""

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
