"""``PackedBatch``: the per-token tensors of packed rows, and :func:`pack_sequences` (``pack`` then
``materialize``). The class and the gather that fills it live beneath :mod:`flexpack.packing`
(in ``flexpack._packed_batch``, which :meth:`flexpack.PackPlan.materialize` calls); this module is
their public home.

A packed row, torchtune-style (``max_len=8``, documents ``[5, 6, 7]`` and ``[8, 9]``, pad id 0)::

    input_ids     5     6     7     8     9     0     0     0
    labels     -100     6     7  -100     9  -100  -100  -100
    doc_ids       0     0     0     1     1    -1    -1    -1
    position_ids  0     1     2     0     1     0     0     0

Labels are HF-style unshifted (``labels[t]`` is the token at ``t``; the model shifts), so the
first token of every document, which would be predicted from the previous document, is -100.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torch import Tensor

from flexpack._packed_batch import PackedBatch, _check_pad_id, _split_item
from flexpack.packing import pack

__all__ = ["IGNORE_INDEX", "PackedBatch", "pack_sequences"]

IGNORE_INDEX = -100


def _length_of(item: Any, index: int) -> int:
    ids, _ = _split_item(item)
    if isinstance(ids, str | bytes):  # len() is its characters: refuse before packing by it
        raise TypeError(
            f"sequence {index} is a {type(ids).__name__} ({ids!r:.40}); flexpack packs token ids "
            "and does not tokenize: pass tokenizer(text)['input_ids'] instead."
        )
    if isinstance(ids, Tensor | np.ndarray) and ids.ndim != 1:
        raise TypeError(
            f"sequence {index} must be 1-D token ids; got shape {tuple(ids.shape)}. "
            "Pass one sequence per sample."
        )
    try:
        return len(ids)
    except TypeError:
        raise TypeError(
            f"sequence {index} must be a sequence of token ids or a dict with 'input_ids'; got "
            f"{type(ids).__name__}"
        ) from None


def pack_sequences(
    sequences: Sequence[Any], max_len: int, *, pad_id: int = 0, **pack_kwargs: Any
) -> PackedBatch:
    """Pack token sequences into rows of ``max_len`` and gather them: ``pack`` + ``materialize``.

    Args:
        sequences: token sequences (lists, numpy arrays, 1-D tensors) or dicts with
            ``"input_ids"`` and optional ``"labels"``.
        max_len: tokens per row.
        pad_id: token id on padding.
        **pack_kwargs: ``strategy``, ``overflow``, ``seed``, ``max_docs_per_row`` of
            :func:`flexpack.pack`.

    Raises:
        TypeError: a sample is not token ids (``[1, "a"]``, ``None``, ``[1, [2]]``: the error
            names the sample and the element; flexpack does not tokenize), or ``pad_id`` is not
            an int.
        ValueError: a negative token id or ``pad_id`` (refused as the CLI refuses them; labels
            may hold -100), one past int64, or what :func:`flexpack.pack` rejects.

    Example:
        >>> batch = pack_sequences([{"input_ids": [1, 2, 3], "labels": [-100, -100, 3]},
        ...                         [4, 5]], max_len=6, strategy="greedy")
        >>> batch.labels
        tensor([[-100, -100,    3, -100,    5, -100]])
    """
    _check_pad_id(pad_id)  # before the packing work
    try:
        n = len(sequences)
    except TypeError:
        raise TypeError(
            f"sequences must be a sized, indexable collection; got {type(sequences).__name__}. "
            "Wrap an iterator in list(...)."
        ) from None
    lengths = np.fromiter((_length_of(sequences[i], i) for i in range(n)), np.int64, n)
    plan = pack(lengths, max_len, **pack_kwargs)
    return plan.materialize(sequences, pad_id=pad_id)
