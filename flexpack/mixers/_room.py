"""What a room of flexpack.mixers declares: which modules are its kind of token mixer, and how
its document boundaries reach the kernels transformers maps its functions to.

transformers 5.x routes every recurrent or convolutional token mixer's heavy functions through
``use_kernel_func_from_hub_with_fallback(name, package)``: a module-level function of the
modeling file (``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``, ``mamba2_chunk_scan``,
...) that calls the package's kernel when it imported (fla, causal_conv1d, mamba_ssm), else the
torch reference. The mixer's methods call those functions by name, so a room recognises its kind
by the names its class's methods reference (never by ``model_type``), and tells from the
wrapper's closure (``is_new_implementation``) whether the kernel or the torch path will run.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from flexpack.mixers._plan import PAD_FACTOR

__all__ = ["Room", "hub_functions", "uses_kernels"]


@functools.cache
def _hub_functions_of(cls: type) -> tuple[tuple[str, Callable], ...]:
    found: dict[str, Callable] = {}
    for klass in cls.__mro__:
        if klass is torch.nn.Module or klass is object:
            continue
        for attr in vars(klass).values():
            fn = inspect.unwrap(attr) if callable(attr) else attr
            if getattr(fn, "__code__", None) is not None:
                _collect(fn, found, depth=0, seen=set())
    return tuple(sorted(found.items()))


def _function_of(g: object) -> Callable | None:
    """The Python function behind a global a method calls: the function itself, or (transformers
    5.25 with the ``kernels`` package) the function an ``nn.Module`` wrapper's forward closes
    over (``use_kernel_forward_from_hub`` turns a function into a module instance)."""
    if isinstance(g, torch.nn.Module):
        forward = getattr(type(g), "forward", None)
        for cell in getattr(forward, "__closure__", None) or ():
            try:
                inner = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if callable(inner) and getattr(inner, "__code__", None) is not None:
                return inner
        return None
    return g if callable(g) and getattr(g, "__code__", None) is not None else None


def _collect(fn: Callable, found: dict[str, Callable], *, depth: int, seen: set[int]) -> None:
    """Add the hub-kernel wrappers ``fn``'s code calls by name, following the modeling file's own
    helpers (5.25's ``causal_conv1d_forward`` calls ``causal_conv1d_fn``; 5.24's mixers called it
    directly): what a mixer does, whichever layer of its file names the kernel."""
    owner = getattr(fn, "__globals__", None)
    if owner is None or id(fn) in seen or depth > 3:
        return
    seen.add(id(fn))
    for name in fn.__code__.co_names:  # the globals the code looks up by name
        inner = _function_of(owner.get(name))
        if inner is None:
            continue
        nonlocals = _closure(inner)
        if nonlocals is not None:
            found.setdefault(name, inner)
            # and under the kernel's own name, which outlives a rename of the torch function
            kernel = nonlocals.get("func_name")
            if isinstance(kernel, str):
                found.setdefault(kernel, inner)
        elif getattr(inner, "__globals__", None) is owner:  # a helper of the same modeling file
            _collect(inspect.unwrap(inner), found, depth=depth + 1, seen=seen)


def _closure(fn: Callable) -> dict | None:
    """The nonlocals of a transformers hub-kernel wrapper (None for any other callable)."""
    if getattr(fn, "__wrapped__", None) is None:
        return None
    try:
        nonlocals = inspect.getclosurevars(fn).nonlocals
    except (TypeError, ValueError):
        return None
    return nonlocals if "is_new_implementation" in nonlocals else None


def hub_functions(module: torch.nn.Module) -> dict[str, Callable]:
    """The kernel-mapped functions (``use_kernel_func_from_hub_with_fallback``) that the
    methods of ``module``'s class call by name: ``{name: function}``."""
    return dict(_hub_functions_of(type(module)))


def uses_kernels(module: torch.nn.Module) -> bool:
    """True when every kernel-mapped function ``module`` calls runs a package's kernel (fla,
    causal_conv1d, mamba_ssm), none the torch reference."""
    fns = hub_functions(module).values()
    return bool(fns) and all(_closure(f)["is_new_implementation"] for f in fns)


@dataclass(frozen=True)
class Room:
    """One kind of token mixer.

    Attributes:
        name: the kind's name (the model zoo's table and the refusal registry use it).
        functions: names of kernel-mapped functions; a module whose class calls any of them is
            this kind (``matches`` decides instead when given).
        varlen: keywords the mixer forwards to its kernels, each to the boundary it carries:
            ``"cu_seqlens"`` ((segments + 1,) int32) or ``"seq_idx"`` ((1, B * S) int32). Empty:
            the kernels have no varlen argument, documents run apart even on the kernel path.
        how: a sentence for the docs: how the room keeps documents apart.
        matches: optional predicate on a module, for mixers without kernel-mapped functions.
        excludes: names whose presence means a more specific room owns the module.
        pad_factor: how much right padding a group of documents may carry (padded tokens over
            real ones) on the torch path: fewer, larger groups (fewer calls) against fewer
            padded tokens (see :mod:`flexpack.mixers._plan`).
        recognised_by: for a room with ``matches``, what it looks for (the docs say it).
        all_outputs: the module returns a tuple of per-token tensors (a q, k, v projection),
            every one of them merged back; otherwise only the first output is (the others,
            caches or states of the whole row, come back as None).
        one_pass: optional ``(module, own, x, plan, kwargs) -> output or None``: the module's
            output on the whole packed (B, S, ...) rows at once, documents kept apart, for the
            torch path (no kernel hand-off); ``own`` is the class's forward bound to the module
            (for a behavioural self-check), ``kwargs`` the call's other keywords. None: not this
            module or this call (the per-group calls run instead).
        keeps_cache: the module keeps its cache in its own attributes when its call's
            ``use_cache`` is true (also when the call leaves it to the module's default):
            such a call is a cached call (RecurrentGemma's recurrent block).
    """

    name: str
    functions: frozenset[str] = frozenset()
    varlen: dict[str, str] = field(default_factory=dict)
    how: str = ""
    matches: Callable[[torch.nn.Module], bool] | None = None
    excludes: frozenset[str] = frozenset()
    pad_factor: float = PAD_FACTOR
    recognised_by: str = ""
    all_outputs: bool = False
    one_pass: Callable[..., object] | None = None
    keeps_cache: bool = False

    def owns(self, module: torch.nn.Module) -> bool:
        if self.matches is not None:
            return self.matches(module)
        names = set(hub_functions(module))
        return bool(names & self.functions) and not names & self.excludes
