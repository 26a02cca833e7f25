"""A CUDA device that is not there: tensors say ``cuda:0``, compute on CPU, keep CUDA's rules.

No GPU runs the CPU suite, yet most of flexpack's bugs on CUDA are of two kinds a CPU run never
sees: a kernel handed tensors on two devices (a CPU ``torch.arange`` next to GPU doc ids), and a
host sync hidden in a layer (``.item()``, ``.tolist()``, a pageable host-to-device copy of a
Python number). This module fakes the device so that CI catches both:

- :class:`FakeCudaTensor` wraps a CPU tensor. ``.device`` is ``cuda:0``, ``.is_cuda`` is True,
  ``.numpy()`` raises as it does on CUDA; every aten op runs on the wrapped CPU tensors (so
  results are exact and autograd works) and returns fake CUDA tensors.
- Mixed devices raise exactly where a CUDA kernel would: a CPU tensor with at least one dimension
  next to a fake CUDA tensor is refused (``RuntimeError: Expected all tensors to be on the same
  device``), except a 0-d CPU tensor (CUDA takes those as scalars), the CPU index tensors of
  ``x[idx]`` / ``x[idx] = y`` (CUDA copies them over, a pageable copy: counted as a sync), and
  ``copy_`` between devices.
- Host syncs are counted on the active :class:`FakeCuda`: ``.item()`` / ``bool()`` / ``int()`` /
  ``float()`` (``_local_scalar_dense``), ``.tolist()``, ``nonzero`` (also ``argwhere``,
  ``masked_select``, ``unique*``, ``bincount``, ``equal``), boolean-mask indexing,
  ``repeat_interleave`` without ``output_size``, device-to-host copies (``.cpu()``,
  ``.to("cpu")``) and host-to-device copies from pageable memory (``.to("cuda")``,
  ``torch.tensor(..., device="cuda")``, CPU index tensors), the latter two unless the host side
  is pinned (``.pin_memory()``) and ``non_blocking=True``. Each :class:`Sync` names the op and the
  line of non-torch code that caused it.
- Inside the context, ``torch.cuda.is_available()`` is True, ``get_device_capability()`` is
  ``capability`` (default ``(9, 0)``, an H100/H200), factory calls with ``device="cuda"`` make
  fake tensors, and ``torch.cuda.synchronize`` / ``empty_cache`` / ``Event`` / memory statistics
  / ``mem_get_info`` work (events time on the host clock; the memory is an H200's, 141 GiB with
  ``free_memory`` free) -- everything bench/gpu.py reads, so each of its rows is rehearsed.

What it does not fake: kernels that exist on CUDA only (FlashAttention varlen, inductor's Triton
flex kernels). Tests replace those with recorders (see tests/test_fake_cuda_paths.py) that check
what reaches them and compute the reference on the fake tensors. SDPA runs its CPU kernels. CUDA
autocast does not cast (the ops dispatch as CPU ops underneath): cast inputs yourself.

How tests use it
----------------
The ``fake_cuda`` fixture (tests/conftest.py) yields an active :class:`FakeCuda`::

    def test_my_path_on_cuda(fake_cuda):
        doc_ids = fake_cuda.tensor([[0, 0, 1, -1]])  # or to_fake_cuda(cpu_tensor), or .to("cuda")
        mask = flexpack.masks.document(doc_ids)
        with fake_cuda.count() as syncs:  # the syncs of this block only
            bm = mask.block_mask()
        assert syncs == []  # or: len(syncs) <= 1; each entry says op and file:line
        assert bm.kv_num_blocks.device.type == "cuda"

Outside pytest: ``with FakeCuda() as gpu: ...``. ``FakeCuda(syncs="error")`` raises
:class:`HostSyncError` at the first sync instead (as ``torch.cuda.set_sync_debug_mode("error")``
does on a GPU); ``gpu.paused()`` stops counting for a block (a recorder computing a reference).
``to_fake_cuda(x)`` wraps a tensor (or a module's parameters and buffers, in place) and
``to_cpu(x)`` unwraps without counting. ``torch.cuda._lazy_init`` is patched while a context is
open; afterwards real CUDA calls on this CPU build fail with another message than before
("Could not run ... 'CUDA' backend" instead of "Torch not compiled with CUDA"), nothing else.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = [
    "FakeCuda",
    "FakeCudaTensor",
    "HostSyncError",
    "MixedDeviceError",
    "Sync",
    "active",
    "is_fake_cuda",
    "to_cpu",
    "to_fake_cuda",
]

aten = torch.ops.aten
CUDA = torch.device("cuda", 0)
_CPU = torch.device("cpu")


class MixedDeviceError(RuntimeError):
    """An op got a fake CUDA tensor and a CPU tensor where a CUDA kernel would refuse them."""


class HostSyncError(RuntimeError):
    """A host sync under ``FakeCuda(syncs="error")``."""


@dataclass(frozen=True)
class Sync:
    """One host sync: what caused it (``op``) and the first line outside torch that did."""

    op: str
    where: str

    def __repr__(self) -> str:
        return f"Sync({self.op} at {self.where})"


# ----------------------------------------------------------------------------- the tensor


def _unwrap(x: Any) -> Any:
    return x._elem if isinstance(x, FakeCudaTensor) else x


class FakeCudaTensor(Tensor):
    """A CPU tensor that reports ``cuda:0``. Build with :func:`to_fake_cuda` or inside
    :class:`FakeCuda` with ``device="cuda"``; ``_elem`` is the CPU tensor underneath."""

    _elem: Tensor
    __slots__ = ("_elem",)
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, elem: Tensor, requires_grad: bool | None = None) -> FakeCudaTensor:
        assert type(elem) is Tensor or isinstance(elem, torch.nn.Parameter), type(elem)
        assert elem.device.type == "cpu", elem.device
        r = Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=elem.device,  # autograd and dispatch run as CPU underneath
            requires_grad=elem.requires_grad if requires_grad is None else requires_grad,
        )
        r._elem = elem
        return r

    # What Python code reads of a device.
    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return CUDA

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False

    def get_device(self) -> int:
        return 0

    def is_pinned(self, device: Any = None) -> bool:
        return False

    def cuda(self, device: Any = None, non_blocking: bool = False, **kw: Any) -> Tensor:
        return self

    def cpu(self, memory_format: torch.memory_format = torch.preserve_format) -> Tensor:
        return self.to(_CPU)

    def numpy(self, *, force: bool = False) -> Any:
        raise TypeError(
            "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the "
            "tensor to host memory first. (fake_cuda)"
        )

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        return self.numpy()

    def type(self, dtype: Any = None, non_blocking: bool = False, **kw: Any) -> Any:
        if dtype is None:
            return self._elem.type().replace("torch.", "torch.cuda.", 1)
        if isinstance(dtype, str):  # "torch.cuda.BFloat16Tensor", as type_as(other) passes
            on_cuda = ".cuda." in dtype
            dtype = torch.empty(0).type(dtype.replace("torch.cuda.", "torch.")).dtype
            return self.to(dtype) if on_cuda else self.to(_CPU).to(dtype)
        return self.to(dtype)

    def tolist(self) -> Any:
        _record("tolist")
        with _paused():
            return self._elem.tolist()

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        with _paused():
            text = repr(self._elem.detach())
        if text.endswith(")"):
            return text[:-1] + ", device='cuda:0')"
        return text

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


def is_fake_cuda(x: Any) -> bool:
    """Whether ``x`` is a fake CUDA tensor."""
    return isinstance(x, FakeCudaTensor)


def to_cpu(x: Any) -> Any:
    """The CPU tensor under a fake one (no copy, no sync counted); anything else as is."""
    return x._elem if isinstance(x, FakeCudaTensor) else x


class _ToFake(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return FakeCudaTensor(x.detach().clone())

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return to_cpu(grad)


def _convert(t: Tensor, dtype: torch.dtype | None, fake: bool | None) -> Tensor:
    """``t`` in ``dtype`` (floating tensors only, as ``Module.to``) on the fake device (True),
    on CPU (False) or where it is (None); no sync counted."""
    x = to_cpu(t).detach()
    if dtype is not None and x.is_floating_point():
        x = x.to(dtype)
    on_fake = isinstance(t, FakeCudaTensor) if fake is None else fake
    if x is to_cpu(t).detach() and isinstance(t, FakeCudaTensor) == on_fake:
        return t  # nothing to do
    if not on_fake:
        return x.clone() if x.data_ptr() == to_cpu(t).data_ptr() else x
    return FakeCudaTensor(x.clone() if x.data_ptr() == to_cpu(t).data_ptr() else x)


def _move_module(module: torch.nn.Module, dtype: torch.dtype | None, fake: bool | None):
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                moved = _convert(p, dtype, fake)
                if moved is not p:
                    m._parameters[name] = torch.nn.Parameter(moved, p.requires_grad)
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = _convert(b, dtype, fake)
    return module


class _ToCpu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return to_cpu(x).detach().clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return FakeCudaTensor(grad)


def to_fake_cuda(x: Any) -> Any:
    """A fake CUDA copy of a CPU tensor (counts no sync: test setup), or a module moved in place.

    A module's parameters and buffers are replaced by fake ones (parameters stay parameters);
    the module is returned. A fake tensor is returned as is.
    """
    if isinstance(x, torch.nn.Module):
        return _move_module(x, None, True)
    if isinstance(x, FakeCudaTensor):
        return x
    if not isinstance(x, Tensor):
        raise TypeError(f"to_fake_cuda takes a tensor or a module, got {type(x).__name__}")
    if x.device.type != "cpu":
        raise ValueError(f"to_fake_cuda takes CPU tensors, got one on {x.device}")
    if x.requires_grad:
        return _ToFake.apply(x)
    return FakeCudaTensor(x.detach().clone())


# ----------------------------------------------------------------------------- dispatch

# Ops whose result size depends on tensor values: on CUDA the host waits for the device.
_SYNCING = {
    aten._local_scalar_dense.default: "item",
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten._unique2.default: "unique",
    aten.unique_consecutive.default: "unique_consecutive",
    aten.unique_dim.default: "unique_dim",
    aten.bincount.default: "bincount",
    aten.equal.default: "equal",
    aten.is_nonzero.default: "bool",
}
# Ops that take CPU index tensors next to a CUDA self (CUDA copies the indices over).
_INDEX_OPS = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
}
_COPIES = {aten.copy_.default, aten._copy_from.default, aten._copy_from_and_resize.default}
# index_fill_ as ``x[index] = number`` reaches it (dim, index, value): see _setitem_fills.
_FILL_OPS = {aten.index_fill_.int_Scalar, aten.index_fill.int_Scalar}


@functools.cache
def _setitem_fills() -> bool:
    """Whether this torch turns ``x[index] = number`` into ``index_fill_`` (torch 2.15; 2.13 and
    2.14 call ``index_put_``).

    torch takes that shortcut only for an index on self's device; a fake tensor is a CPU tensor
    underneath, so with a CPU index it gets ``index_fill_`` where real CUDA gets ``index_put_``,
    which copies the indices over. Where this is True, a CPU index of ``index_fill_`` is taken as
    such an assignment (an explicit ``index_fill_`` with a CPU index, which CUDA refuses, then
    goes unnoticed: neither flexpack nor its tests call one).
    """
    seen: list[Any] = []

    class _Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x = torch.zeros(2)
    with _Ops():
        x[torch.tensor([0])] = 1
    return any(f in _FILL_OPS for f in seen)


def _is_bool_index(i: Any) -> bool:
    return isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8)


def _is_cuda(device: Any) -> bool:
    if device is None or isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    return torch.device(device).type == "cuda"


def _where_cpu(x: Tensor) -> str:
    return f"a CPU tensor of shape {tuple(x.shape)} ({x.dtype})"


def _in_backward() -> bool:
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _check_devices(func, args, kwargs) -> bool:
    """Raise where CUDA would; return whether the op touches a fake tensor (or makes one)."""
    flat, _ = tree_flatten((args, kwargs))
    fakes = any(isinstance(x, FakeCudaTensor) for x in flat)
    makes = _is_cuda(kwargs.get("device"))
    if not (fakes or makes):
        return False
    if func in _COPIES:
        return True
    allowed: set[int] = set()
    if func in _INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        for i in indices or ():
            if isinstance(i, Tensor) and not isinstance(i, FakeCudaTensor):
                allowed.add(id(i))
                if i.dim() > 0:
                    _record(f"{func.__name__} with CPU indices (pageable host->device copy)")
    elif func in _FILL_OPS and _setitem_fills():
        index = args[2] if len(args) > 2 else kwargs.get("index")
        if isinstance(index, Tensor) and not isinstance(index, FakeCudaTensor):
            allowed.add(id(index))  # x[cpu_index] = number: index_put_ on CUDA, see above
            if index.dim() > 0:
                _record("index_put_ with CPU indices (pageable host->device copy)")
    if _in_backward():
        # Backward formulas make their temporaries from ``grad.options()``, whose device is
        # the CPU underneath a fake gradient (on a GPU they would be on the GPU): a CPU tensor
        # next to a fake one in a backward is such a temporary, and the result is fake.
        return True
    for x in flat:
        if not isinstance(x, Tensor) or isinstance(x, FakeCudaTensor) or id(x) in allowed:
            continue
        if x.dim() == 0 and x.device.type == "cpu":
            continue  # a CPU scalar: CUDA kernels take it as a number
        raise MixedDeviceError(
            "Expected all tensors to be on the same device, but found at least two devices, "
            f"cuda:0 and {x.device}! (fake_cuda: {func} got {_where_cpu(x)} next to a cuda "
            "tensor)"
        )
    return True


def _count_syncs(func, args, kwargs) -> None:
    name = _SYNCING.get(func)
    if name is not None:
        _record(name)
        return
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        _record("repeat_interleave without output_size")
    elif func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
        if any(_is_bool_index(i) for i in (args[1] or ())):
            _record(f"boolean-mask {'indexing' if func is aten.index.Tensor else 'assignment'}")
    elif func is aten.copy_.default:
        dst, src = args[0], args[1]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        if isinstance(src, FakeCudaTensor) and not isinstance(dst, FakeCudaTensor):
            if not (non_blocking and _pinned(dst)):
                _record("device->host copy")
        elif isinstance(dst, FakeCudaTensor) and isinstance(src, Tensor):
            if not isinstance(src, FakeCudaTensor) and src.dim() > 0:
                if not (non_blocking and _pinned(src)):
                    _record("host->device copy from pageable memory")


def _dispatch(func, args, kwargs):
    if not _check_devices(func, args, kwargs):
        return func(*args, **kwargs)
    _count_syncs(func, args, kwargs)
    wrappers = {
        id(x._elem): x for x in tree_flatten((args, kwargs))[0] if isinstance(x, FakeCudaTensor)
    }
    # ``_to_copy(fake, device=cpu)`` reaching here comes from C++ (a backward's
    # ``grad.to(self.options())``, whose device is the CPU underneath): it stays on the fake
    # device. Copies to the host made in Python go through the patched ``Tensor.to``.
    if func is aten._to_copy.default:
        kwargs = {**kwargs, "device": _CPU}
    elif _is_cuda(kwargs.get("device")):
        kwargs = {**kwargs, "device": _CPU}
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
    cpu_dst = func is aten.copy_.default and not isinstance(args[0], FakeCudaTensor)
    with _paused():
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
    if cpu_dst:
        return out

    def wrap(x: Any) -> Any:
        if not isinstance(x, Tensor):
            return x
        same = wrappers.get(id(x))
        return same if same is not None else FakeCudaTensor(x)

    return tree_map(wrap, out)


class _Mode(TorchDispatchMode):
    """Sends ops that make or take fake tensors through :func:`_dispatch` (factories included)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


# ----------------------------------------------------------------------------- counting

_STATE = threading.local()
_HERE = os.path.abspath(__file__)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def active() -> FakeCuda | None:
    """The innermost open :class:`FakeCuda`, or None."""
    stack = getattr(_STATE, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def _paused() -> Iterator[None]:
    depth = getattr(_STATE, "paused", 0)
    _STATE.paused = depth + 1
    try:
        yield
    finally:
        _STATE.paused = depth


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != _HERE and not path.startswith(_TORCH) and "contextlib" not in path:
            return f"{os.path.relpath(path)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def _record(op: str) -> None:
    gpu = active()
    if gpu is None or getattr(_STATE, "paused", 0):
        return
    sync = Sync(op, _caller())
    if gpu.mode == "error":
        raise HostSyncError(f"host sync on the (fake) GPU: {sync}")
    for log in gpu._logs:
        log.append(sync)


def _pinned(x: Tensor) -> bool:
    return getattr(x, "_fake_pinned", False) is True


# ----------------------------------------------------------------------------- the context


class _Event:
    """``torch.cuda.Event`` on the host clock."""

    def __init__(self, enable_timing: bool = False, **kw: Any) -> None:
        self.t: float | None = None

    def record(self, stream: Any = None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _Event) -> float:
        return (end.t - self.t) * 1e3


def _parse_to(args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """(device, dtype) asked of ``Tensor.to``: None where not given."""
    device = kwargs.get("device")
    dtype = kwargs.get("dtype")
    for a in args:
        if isinstance(a, bool) or a is None:  # non_blocking / copy, or Module.to's device=None
            continue
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, str | torch.device | int):
            device = a
        elif isinstance(a, Tensor):
            device, dtype = a.device, a.dtype
    return device, dtype


class FakeCuda:
    """Opens the fake device: see the module docstring.

    Args:
        capability: what ``torch.cuda.get_device_capability()`` reports; (9, 0) by default.
        syncs: "count" (default) records every host sync in :attr:`syncs`; "error" raises
            :class:`HostSyncError` at the first one.
        name: what ``torch.cuda.get_device_name()`` reports.
        free_memory: the free bytes ``torch.cuda.mem_get_info()`` reports (of 141 GiB; default
            130 GiB, an H200 with a CUDA context): a bench row that sizes itself by free memory
            (the dense-mask SDPA row) takes the path it takes on the GPU.
    """

    def __init__(
        self,
        capability: tuple[int, int] = (9, 0),
        syncs: str = "count",
        name: str = "Fake H200",
        free_memory: int = 130 * 2**30,
    ) -> None:
        if syncs not in ("count", "error"):
            raise ValueError(f"syncs must be 'count' or 'error', got {syncs!r}")
        self.capability = capability
        self.free_memory = free_memory
        self.mode = syncs
        self.name = name
        self.syncs: list[Sync] = []
        self._logs: list[list[Sync]] = [self.syncs]
        self._undo: list[tuple[Any, str, Any]] = []
        self._dispatch_mode: _Mode | None = None

    # -- helpers for tests

    def tensor(self, data: Any, **kw: Any) -> Tensor:
        """``torch.tensor(data, **kw)`` as a fake CUDA tensor, counting nothing (test setup)."""
        return to_fake_cuda(torch.tensor(data, **{k: v for k, v in kw.items() if k != "device"}))

    def to(self, x: Any) -> Any:
        """:func:`to_fake_cuda`: tensors, modules, and dataclasses/dicts/lists of tensors."""
        if isinstance(x, Tensor | torch.nn.Module):
            return to_fake_cuda(x)
        if hasattr(x, "to") and not isinstance(x, type):
            with _paused():
                return x.to(CUDA)
        return tree_map(lambda t: to_fake_cuda(t) if isinstance(t, Tensor) else t, x)

    @contextlib.contextmanager
    def count(self) -> Iterator[list[Sync]]:
        """The syncs of a block (also appended to :attr:`syncs`)."""
        log: list[Sync] = []
        self._logs.append(log)
        try:
            yield log
        finally:
            self._logs = [x for x in self._logs if x is not log]

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """A block whose syncs are not counted (a recorder's reference computation)."""
        return _paused()

    # -- the patches

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._undo.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, value)

    def __enter__(self) -> FakeCuda:
        real_to = Tensor.to
        real_tensor = torch.tensor
        real_as_tensor = torch.as_tensor
        real_pin = Tensor.pin_memory
        real_is_pinned = Tensor.is_pinned
        real_cuda = Tensor.cuda
        props = SimpleNamespace(
            name=self.name,
            major=self.capability[0],
            minor=self.capability[1],
            total_memory=141 * 2**30,
            multi_processor_count=132,
        )

        def to(t: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            device, dtype = _parse_to(args, kwargs)
            if isinstance(t, FakeCudaTensor) and device is not None and not _is_cuda(device):
                # The device to host copy (underneath the tensor is on CPU already: torch's own
                # .to would return it unchanged).
                if not kwargs.get("non_blocking"):
                    _record("device->host copy")
                out = _ToCpu.apply(t)
                return out if dtype is None else real_to(out, dtype)
            if not _is_cuda(device):
                return real_to(t, *args, **kwargs)
            if isinstance(t, FakeCudaTensor):  # already there: at most a dtype change
                if dtype is None or dtype == t.dtype:
                    return t.clone() if kwargs.get("copy") else t
                return real_to(t, dtype)
            # A CPU tensor to the fake device: a host-to-device copy.
            if not (kwargs.get("non_blocking") and _pinned(t)):
                _record("host->device copy from pageable memory")
            x = t if dtype is None else real_to(t, dtype)
            return to_fake_cuda(x)

        def cuda(t: Tensor, device: Any = None, non_blocking: bool = False, **kw: Any) -> Tensor:
            if isinstance(t, FakeCudaTensor):
                return t
            return to(t, CUDA, non_blocking=non_blocking)

        def tensor(data: Any, *args: Any, device: Any = None, **kwargs: Any) -> Tensor:
            if not _is_cuda(device):
                return real_tensor(data, *args, device=device, **kwargs)
            if isinstance(data, FakeCudaTensor):
                return to_fake_cuda(to_cpu(data).clone())
            _record("torch.tensor(..., device='cuda') (pageable host->device copy)")
            return to_fake_cuda(real_tensor(to_cpu(data), *args, **kwargs))

        def as_tensor(data: Any, dtype: Any = None, device: Any = None) -> Tensor:
            if isinstance(data, FakeCudaTensor):
                x = data if dtype is None else data.to(dtype)
                return x if device is None or _is_cuda(device) else x.to(device)
            if not _is_cuda(device):
                return real_as_tensor(data, dtype=dtype, device=device)
            _record("torch.as_tensor(..., device='cuda') (pageable host->device copy)")
            return to_fake_cuda(real_as_tensor(data, dtype=dtype))

        def pin_memory(t: Tensor, device: Any = None) -> Tensor:
            if isinstance(t, FakeCudaTensor):
                raise RuntimeError("cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors")
            out = t.clone()
            out._fake_pinned = True
            return out

        def is_pinned(t: Tensor, device: Any = None) -> bool:
            return _pinned(t) or real_is_pinned(t)

        def synchronize(device: Any = None) -> None:
            _record("torch.cuda.synchronize")

        real_module_to = torch.nn.Module.to

        def module_to(module: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
            device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
            fakes = any(isinstance(t, FakeCudaTensor) for t in module.state_dict().values())
            if device is None and not fakes:
                return real_module_to(module, *args, **kwargs)
            fake = None if device is None else _is_cuda(device)
            return _move_module(module, dtype, fake)

        def module_cuda(module: torch.nn.Module, device: Any = None) -> torch.nn.Module:
            return _move_module(module, None, True)

        del real_pin, real_cuda
        self._patch(torch.nn.Module, "to", module_to)
        self._patch(torch.nn.Module, "cuda", module_cuda)
        cuda_mod = torch.cuda
        self._patch(Tensor, "to", to)
        self._patch(Tensor, "cuda", cuda)
        self._patch(Tensor, "pin_memory", pin_memory)
        self._patch(Tensor, "is_pinned", is_pinned)
        self._patch(torch, "tensor", tensor)
        self._patch(torch, "as_tensor", as_tensor)
        self._patch(cuda_mod, "_lazy_init", lambda: None)
        self._patch(cuda_mod, "is_available", lambda: True)
        self._patch(cuda_mod, "device_count", lambda: 1)
        self._patch(cuda_mod, "current_device", lambda: 0)
        self._patch(cuda_mod, "get_device_capability", lambda device=None: self.capability)
        self._patch(cuda_mod, "get_device_name", lambda device=None: self.name)
        self._patch(cuda_mod, "get_device_properties", lambda device=None: props)
        self._patch(cuda_mod, "is_bf16_supported", lambda *a, **k: True)
        self._patch(cuda_mod, "synchronize", synchronize)
        self._patch(cuda_mod, "empty_cache", lambda: None)
        self._patch(cuda_mod, "Event", _Event)
        for stat in (
            "max_memory_allocated",
            "memory_allocated",
            "max_memory_reserved",
            "memory_reserved",
        ):
            self._patch(cuda_mod, stat, lambda device=None: 0)
        self._patch(
            cuda_mod, "mem_get_info", lambda device=None: (self.free_memory, props.total_memory)
        )
        self._patch(cuda_mod, "reset_peak_memory_stats", lambda device=None: None)
        stack = getattr(_STATE, "stack", None)
        if stack is None:
            stack = _STATE.stack = []
        stack.append(self)
        self._dispatch_mode = _Mode()
        self._dispatch_mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._dispatch_mode is not None
        self._dispatch_mode.__exit__(*exc)
        self._dispatch_mode = None
        _STATE.stack.remove(self)
        for owner, name, old in reversed(self._undo):
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        self._undo.clear()


_MISSING = object()
