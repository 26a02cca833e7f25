"""What differs between the torch releases flexpack runs on (2.11 to 2.13), probed once.

Each probe looks at the API itself (a keyword in a signature, a module that imports), never at
``torch.__version__``, the first time something needs it, and caches the answer; nothing is
probed at import. Where a release lacks a feature, the fallback gives the same results:

======================================  ==========================  ==========================
feature                                 present (2.13 here)         absent (2.11, 2.12)
======================================  ==========================  ==========================
``torch.compile(isolate_recompiles=)``  one dynamo cache and        a fresh copy of the code
                                        recompile count per         object per wrapper: dynamo
                                        wrapper                     keeps both on the code
                                                                    object, so again per wrapper
``varlen_attn(enable_gqa=)``            passed                      not passed (2.11): k and v
                                                                    keep their fewer heads;
                                                                    FlashAttention's varlen
                                                                    kernel groups them itself
======================================  ==========================  ==========================

:func:`describe` lists what this torch has, for logs and ``bench/gpu.py``.

Example:
    >>> import torch
    >>> from torch.nn.attention.flex_attention import flex_attention
    >>> from flexpack import _compat
    >>> fn = _compat.compile_isolated(flex_attention, backend="eager", fullgraph=True)
    >>> callable(fn), isinstance(compile_isolates_recompiles(), bool)
    (True, True)
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import platform
import types
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "compile_isolated",
    "compile_isolates_recompiles",
    "describe",
    "fresh_code_copy",
    "varlen_attn_function",
    "varlen_takes_enable_gqa",
]


def _has_parameter(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


@functools.cache
def compile_isolates_recompiles() -> bool:
    """Whether ``torch.compile`` takes ``isolate_recompiles`` (torch 2.13; not 2.11 or 2.12)."""
    return _has_parameter(torch.compile, "isolate_recompiles")


def fresh_code_copy(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` with a code object of its own: the same behaviour, a dynamo cache of its own.

    Dynamo keeps a function's compiled entries, and counts them against
    ``torch._dynamo.config.recompile_limit``, on its code object (``co_extra``); every
    ``torch.compile(fn)`` of one function shares them. A copy of the code object starts with
    none, so a compiled copy counts only its own recompiles, as ``isolate_recompiles=True`` does.
    The copy keeps the globals, defaults, closure, name and attributes of ``fn``.

    Example:
        >>> def f(x, *, y=2):
        ...     return x * y
        >>> g = fresh_code_copy(f)
        >>> g(3), g.__code__ is f.__code__, g.__name__
        (6, False, 'f')
    """
    copy = types.FunctionType(
        fn.__code__.replace(),  # a new object, equal in content
        fn.__globals__,
        fn.__name__,
        fn.__defaults__,
        fn.__closure__,
    )
    copy.__kwdefaults__ = None if fn.__kwdefaults__ is None else dict(fn.__kwdefaults__)
    copy.__qualname__ = fn.__qualname__
    copy.__module__ = fn.__module__
    copy.__doc__ = fn.__doc__
    copy.__annotations__ = dict(getattr(fn, "__annotations__", {}))
    copy.__dict__.update({k: v for k, v in fn.__dict__.items() if k != "__wrapped__"})
    return copy


def compile_isolated(fn: types.FunctionType, **kwargs: Any) -> Callable:
    """``torch.compile(fn, **kwargs)`` with its own dynamo cache and recompile count.

    ``isolate_recompiles=True`` where ``torch.compile`` takes it, else the compile of a
    :func:`fresh_code_copy` of ``fn``. Either way the wrapper's recompiles count against
    ``torch._dynamo.config.recompile_limit`` (read at call time) by themselves, not with every
    other compile of ``fn``, and past it ``fail_on_recompile_limit_hit`` raises for this wrapper.
    """
    if compile_isolates_recompiles():
        return torch.compile(fn, isolate_recompiles=True, **kwargs)
    return torch.compile(fresh_code_copy(fn), **kwargs)


def varlen_attn_function() -> Callable | None:
    """``torch.nn.attention.varlen.varlen_attn`` as it is now (tests swap it), or None before
    torch 2.10, which has no such module."""
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    return getattr(varlen, "varlen_attn", None)


@functools.lru_cache(maxsize=16)
def varlen_takes_enable_gqa(fn: Callable) -> bool:
    """Whether this ``varlen_attn`` takes ``enable_gqa`` (torch 2.12 and 2.13; not 2.11).

    Without it, k and v are passed with their fewer heads as they are: 2.11's ``varlen_attn``
    hands them to FlashAttention's varlen kernel unchanged, which attends query head ``h`` to
    key/value head ``h // (Hq // Hkv)`` (Hkv dividing Hq), what ``enable_gqa=True`` asks.
    """
    return _has_parameter(fn, "enable_gqa")


def _package_version(*names: str) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def describe() -> list[str]:
    """Lines naming this torch and triton and which fallbacks flexpack uses on it.

    Example:
        >>> lines = describe()
        >>> lines[0].startswith("torch ")
        True
    """
    cuda = torch.version.cuda or "none"
    lines = [
        f"torch {torch.__version__} (CUDA {cuda}), triton "
        f"{_package_version('triton', 'pytorch-triton')}, python {platform.python_version()}"
    ]
    if compile_isolates_recompiles():
        lines.append("torch.compile(isolate_recompiles=True): native")
    else:
        lines.append(
            "torch.compile has no isolate_recompiles: fallback, each compiled flex_attention "
            "configuration compiles a fresh copy of its code object (its own dynamo cache)"
        )
    fn = varlen_attn_function()
    if fn is None:
        lines.append("varlen_attn: absent (torch.nn.attention.varlen): varlen path off")
    elif varlen_takes_enable_gqa(fn):
        lines.append("varlen_attn(enable_gqa=): native")
    else:
        lines.append(
            "varlen_attn has no enable_gqa: fallback, k/v passed with their fewer heads "
            "(FlashAttention's varlen kernel groups them)"
        )
    return lines
