"""Values derived from a tensor, kept while it is the same, unmodified tensor.

A model calls attention once per layer with one row's document ids, and builds a mask or two per
forward from them: what is derived from those ids (plans, order facts, snapshots, padded copies),
and the host syncs that derive it, should happen once. Entries hold a weak reference to the
tensor and its in-place version counter, so a freed or edited tensor is never served stale.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from torch import Tensor

_V = TypeVar("_V")


class PerTensor(Generic[_V]):
    """A small cache of ``build()`` per (tensor, key), oldest entry dropped past ``maxsize``.

    Example:
        >>> import torch
        >>> cache, t = PerTensor(), torch.tensor([1, 2])
        >>> cache.get(t, lambda: t.sum().item()), cache.get(t, lambda: -1)
        (3, 3)
        >>> _ = t.add_(1); cache.get(t, lambda: -1)  # edited in place: built again
        -1
    """

    def __init__(self, maxsize: int = 16) -> None:
        self.maxsize = maxsize
        self._entries: dict[tuple, tuple[weakref.ref, int, _V]] = {}

    def get(self, t: Tensor, build: Callable[[], _V], key: Hashable = ()) -> _V:
        try:
            version = t._version
        except RuntimeError:  # inference tensors have no version counter: do not cache
            return build()
        slot = (id(t), key)
        hit = self._entries.get(slot)
        if hit is not None and hit[0]() is t and hit[1] == version:
            return hit[2]
        value = build()
        self.put(t, value, key)
        return value

    def put(self, t: Tensor, value: _V, key: Hashable = ()) -> None:
        slot = (id(t), key)
        if slot not in self._entries and len(self._entries) >= self.maxsize:
            self._entries.pop(next(iter(self._entries)))
        self._entries[slot] = (weakref.ref(t), t._version, value)
