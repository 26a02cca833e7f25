"""Values derived from a tensor, kept while it is the same, unmodified tensor.

A model calls attention once per layer with one row's document ids, and builds a mask or two per
forward from them: what is derived from those ids (plans, order facts, snapshots, padded copies),
and the host syncs that derive it, should happen once. An entry keeps a :class:`Stamp` of the
tensor it was derived from, and is served again only while the stamp still matches.

What a stamp sees, per kind of write a user can make between two calls:

==========================================  ======================  ======================
write                                       CPU tensor              CUDA tensor
==========================================  ======================  ======================
in-place op (``ids.add_(1)``, ``ids[0]=``)  version counter         version counter
``ids.data = other``                        storage pointer         storage pointer
a freed tensor, a new one at its ``id``     storage weak ref.       storage weak ref.
through numpy (``torch.from_numpy(buf)``)   content copy            (numpy cannot)
``ids.data[...] = ...`` (no version bump,   content copy            not seen (see below)
a tensor subclass too)
in place on an inference tensor (no         content copy            not seen (see below)
version counter)
==========================================  ======================  ======================

On CPU the stamp keeps a copy of the tensor's content and compares it on every reuse: doc ids are
B * S integers, nothing next to the mask or plan they save. On CUDA that comparison would be a
host sync per layer (the ``bool`` of a device comparison), which is the cost the cache exists to
remove, so a CUDA stamp trusts the version counter and the storage: a write through ``.data`` of
a CUDA tensor, or in place on a CUDA inference tensor, is not seen. Pass a new tensor (the usual
case: every collated batch is one) or call :func:`flexpack.clear_caches` after such a write.

A stamp holds a weak reference to its tensor's storage (torch's own, as the CUDA caching
allocator and multiprocessing use), not to the tensor: ``torch.utils.swap_tensors`` refuses a
tensor that has a Python weak reference, so a tensor flexpack has read (doc ids, position ids)
can be swapped. A new tensor at a freed one's ``id`` over a new storage does not match; over the
same live storage, in the same layout and version, it holds what the old one held.

State that lives in a user's objects survives what users do to them. A stamp never changes once
made: ``copy.copy`` and ``copy.deepcopy`` share it (copying its weak reference's raw handle would
free it twice), and a pickled stamp comes back expired (a weak reference means nothing in another
process). A cache copied or pickled comes back empty. Caches of one forward's derived values
(the masks of the ids a model's layers share) are kept per thread (:class:`PerThread`): two
models called from two threads never read each other's.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable, Iterable
from typing import Generic, TypeVar

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

_V = TypeVar("_V")


def version(t: Tensor) -> int | None:
    """``t``'s in-place version counter; None for an inference tensor, which has none."""
    try:
        return t._version
    except RuntimeError:  # "Inference tensors do not track version counter."
        return None


def _layout(t: Tensor) -> tuple:
    # data_ptr changes with `t.data = other`; a tensor subclass without storage reports 0, and a
    # traced (fake) tensor has none to report
    try:
        ptr = t.data_ptr()
    except RuntimeError:
        ptr = None
    return (ptr, t.storage_offset(), t.shape, t.stride(), t.dtype, t.device)


# A subclass whose content cannot be copied as a plain tensor (a wrapper without storage): its
# stamp never matches, so nothing derived from it is reused.
_UNCOPYABLE = object()


def _plain(t: Tensor) -> Tensor:
    """``t``'s data as a plain tensor (a subclass's too: ``.data`` writes on it are seen)."""
    t = t.detach()
    return t if type(t) is Tensor else t.as_subclass(Tensor)


def _content(t: Tensor) -> Tensor | object | None:
    """A copy to compare on reuse, where comparing needs no host sync (CPU tensors, subclasses
    included)."""
    if t.device.type != "cpu":
        return None
    if torch.compiler.is_compiling():  # a traced value has no content to copy
        return None
    try:
        return _plain(t).clone()
    except Exception:  # a wrapper subclass (no storage of its own): never reused
        return _UNCOPYABLE


def _cdata(t: Tensor) -> int | None:
    """The address of ``t``'s storage; None where it has none (a wrapper subclass, a trace)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None


def _storage(t: Tensor) -> tuple[StorageWeakRef, int] | None:
    """A weak reference to ``t``'s storage and its address; None where it has none (and for a
    traced value, whose storage is freed with the trace)."""
    if torch.compiler.is_compiling() or _cdata(t) is None:
        return None
    storage = t.untyped_storage()
    return StorageWeakRef(storage), storage._cdata


class Stamp:
    """What a tensor was when a value was derived from it: its storage (a weak reference),
    version counter and layout, and on CPU a copy of its content.

    Example:
        >>> import numpy as np, torch
        >>> buf = np.zeros(3, dtype=np.int64); t = torch.from_numpy(buf)
        >>> s = Stamp(t); s.matches(t)
        True
        >>> buf[:] = 1; s.matches(t)  # written through numpy: no version bump, seen anyway
        False
    """

    __slots__ = ("_content", "_layout", "_ref", "_storage", "_version")

    def __init__(self, t: Tensor) -> None:
        self._storage = _storage(t)
        # a tensor without a storage of its own (a wrapper subclass): a weak reference to it
        self._ref = weakref.ref(t) if self._storage is None else None
        self._version = version(t)
        self._layout = _layout(t)
        self._content = _content(t)

    def __copy__(self) -> Stamp:
        return self  # never changes once made

    def __deepcopy__(self, memo: dict) -> Stamp:
        return self  # a copy of the weak reference's handle would be freed twice

    def __reduce__(self) -> tuple:
        return (expired, ())  # a weak reference does not cross processes

    def matches(self, t: Tensor) -> bool:
        """Whether ``t`` is the stamped tensor, unmodified as far as the stamp can tell."""
        if self._storage is not None:
            ref, cdata = self._storage
            if ref.expired() or _cdata(t) != cdata:
                return False
        elif self._ref is None or self._ref() is not t:
            return False
        if version(t) != self._version or _layout(t) != self._layout:
            return False
        if self._content is _UNCOPYABLE:
            return False
        return self._content is None or torch.equal(self._content, _plain(t))


def expired() -> Stamp:
    """A stamp that matches no tensor (what a pickled stamp becomes)."""
    stamp = Stamp.__new__(Stamp)
    stamp._storage = stamp._ref = stamp._version = stamp._layout = stamp._content = None
    return stamp


def stamps(tensors: Iterable[Tensor | None]) -> tuple[Stamp | None, ...]:
    """One :class:`Stamp` per tensor (None stays None)."""
    return tuple(None if t is None else Stamp(t) for t in tensors)


def all_match(stamped: tuple[Stamp | None, ...] | None, tensors: Iterable[Tensor | None]) -> bool:
    """Whether ``tensors`` are, one for one, the unmodified tensors of ``stamped``."""
    if stamped is None:
        return False
    tensors = tuple(tensors)
    if len(tensors) != len(stamped):
        return False
    for s, t in zip(stamped, tensors, strict=True):
        if (s is None) != (t is None) or (s is not None and not s.matches(t)):
            return False
    return True


def make_room(entries: dict, maxsize: int) -> None:
    """Drop the oldest of ``entries`` until one more fits under ``maxsize`` (a module-level
    cache: another thread may be evicting or clearing it at the same time)."""
    while len(entries) >= maxsize:
        try:
            entries.pop(next(iter(entries)), None)
        except (StopIteration, RuntimeError):  # emptied, or resized, by another thread
            break


_CACHES: list[weakref.ref] = []


class PerTensor(Generic[_V]):
    """A small cache of ``build()`` per (tensor, key), oldest entry dropped past ``maxsize``.

    Example:
        >>> import torch
        >>> cache, t = PerTensor(), torch.tensor([1, 2])
        >>> cache.get(t, lambda: t.sum().item()), cache.get(t, lambda: -1)
        (3, 3)
        >>> _ = t.add_(1); cache.get(t, lambda: -1)  # edited in place: built again
        -1
        >>> t.data[0] = 7; cache.get(t, lambda: -2)  # a write the version counter misses
        -2
    """

    def __init__(self, maxsize: int = 16) -> None:
        self.maxsize = maxsize
        self._entries: dict[tuple, tuple[Stamp, _V]] = {}
        self._lock = threading.Lock()  # entries are read and written from any thread
        _CACHES.append(weakref.ref(self))

    def __deepcopy__(self, memo: dict) -> PerTensor[_V]:
        return PerTensor(self.maxsize)  # a copy starts empty

    def __reduce__(self) -> tuple:
        return (PerTensor, (self.maxsize,))

    def get(self, t: Tensor, build: Callable[[], _V], key: Hashable = ()) -> _V:
        with self._lock:
            hit = self._entries.get((id(t), key))
        if hit is not None and hit[0].matches(t):
            return hit[1]
        value = build()
        self.put(t, value, key)
        return value

    def put(self, t: Tensor, value: _V, key: Hashable = ()) -> None:
        slot, stamp = (id(t), key), Stamp(t)
        with self._lock:
            if slot not in self._entries and len(self._entries) >= self.maxsize:
                self._entries.pop(next(iter(self._entries)))
            self._entries[slot] = (stamp, value)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


# clear_caches() bumps it: every thread's PerThread dict is then stale.
_generation = 0


class PerThread:
    """A dict per thread, for what one forward derives and its layers share (the masks of one
    row's ids): a thread reads only what it wrote, so two models called from two threads never
    build from each other's ids. :func:`clear_caches` empties every thread's.

    Example:
        >>> cache = PerThread()
        >>> cache.get()["masks"] = 1; cache.get()
        {'masks': 1}
        >>> clear_caches(); cache.get()
        {}
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self) -> dict:
        """This thread's dict."""
        local = self._local
        if getattr(local, "generation", None) != _generation:
            local.generation, local.values = _generation, {}
        return local.values

    def __deepcopy__(self, memo: dict) -> PerThread:
        return PerThread()

    def __reduce__(self) -> tuple:
        return (PerThread, ())


_CLEARS: list[Callable[[], None]] = []


def on_clear(fn: Callable[[], None]) -> None:
    """Have :func:`clear_caches` call ``fn`` too (for caches kept outside a :class:`PerTensor`)."""
    _CLEARS.append(fn)


def clear_caches() -> None:
    """Forget every value flexpack derived from a tensor (masks, plans, snapshots).

    Only needed after a write no stamp sees: ``ids.data[...] = ...`` on a CUDA tensor, or an
    in-place write to a CUDA inference tensor, between two calls that pass that same tensor.

    Example:
        >>> import flexpack
        >>> flexpack.clear_caches()
    """
    global _generation
    _generation += 1
    for ref in _CACHES:
        cache = ref()
        if cache is not None:
            cache.clear()
    for fn in _CLEARS:
        fn()
