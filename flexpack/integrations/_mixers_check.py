"""Which token mixers of a transformers model flexpack keeps exact on packed rows; refuse the rest.

flexpack's attention function makes attention layers see one document at a time. A model can
also mix tokens elsewhere: recurrent or convolutional layers (gated delta rule, Mamba scans,
short convs) whose state runs across the whole row, or attention features the document mask
alone does not cover. :func:`check` finds those from the model's modules (the kind of each token
mixer, never the ``model_type``) and raises a ``ValueError`` naming the module and what is
missing, unless a registered kind says flexpack makes it exact. It runs at the model's first
forward under ``attn_implementation="flexpack"`` (see
:func:`flexpack.integrations.transformers.flexpack_attention_forward`) and can be called directly:

    >>> import torch
    >>> from flexpack.integrations import _mixers_check
    >>> class ToyScan(torch.nn.Module):  # a recurrent layer: its state crosses documents
    ...     pass
    >>> _ = _mixers_check.register_kind("toy_scan", lambda m: isinstance(m, ToyScan),
    ...                                 exact=False, why="its state crosses documents")
    >>> _mixers_check.mixers_of(torch.nn.Sequential(ToyScan()))
    [('0', 'toy_scan')]
    >>> _mixers_check._KINDS.pop(0).name  # (tidy up the doctest)
    'toy_scan'

A module that makes a kind exact registers it with :func:`register_kind` (``exact=True``); the
first matching kind wins, and kinds registered later are tried first, so a precise exact kind
overrides the broad refused one it refines. An exact kind may share its name with the refused
one (flexpack.mixers' "mamba" matches adapted Mamba mixers only): both stay registered, so a
mixer that was never adapted is still refused.
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "VERIFIED_TRANSFORMERS",
    "MixerKind",
    "check",
    "has_attention",
    "kinds",
    "mixers_of",
    "refusal",
    "register_kind",
    "unsupported",
]


@dataclass(frozen=True)
class MixerKind:
    """One kind of token mixer (or attention feature) and whether flexpack keeps it exact.

    Attributes:
        name: short name used in errors and in docs/supported_models.md ("mamba", "sinks").
        matches: ``matches(module) -> bool`` on one module of the model.
        exact: True when packed rows give every document what it gets alone.
        why: for a refused kind, what is missing (the error says it); for an exact kind, how
            flexpack makes it exact (the docs say it).
    """

    name: str
    matches: Callable[[torch.nn.Module], bool]
    exact: bool
    why: str


_KINDS: list[MixerKind] = []  # tried in order; register_kind puts new kinds first


def register_kind(
    name: str, matches: Callable[[torch.nn.Module], bool], *, exact: bool, why: str
) -> MixerKind:
    """Add (or replace) a kind of token mixer; later registrations are tried first.

    Args:
        name: the kind's name; a kind of the same name and the same ``exact`` is replaced.
        matches: predicate on one module.
        exact: whether flexpack makes this kind exact on packed rows.
        why: what is missing (refused) or how it is exact.

    Returns:
        The registered :class:`MixerKind`.

    Example:
        >>> from flexpack.integrations._mixers_check import register_kind, kinds
        >>> _ = register_kind("toy", lambda m: type(m).__name__ == "Toy", exact=False,
        ...                   why="its state crosses documents")
        >>> kinds()[0].name
        'toy'
        >>> _KINDS.pop(0).name  # (tidy up the doctest)
        'toy'
    """
    kind = MixerKind(name, matches, exact, why)
    _KINDS[:] = [kind] + [k for k in _KINDS if (k.name, k.exact) != (name, exact)]
    _checked.clear()
    _attention.clear()
    return kind


def kinds() -> list[MixerKind]:
    """The registered kinds, in the order they are tried."""
    return list(_KINDS)


def _name(m: torch.nn.Module) -> str:
    return type(m).__name__


def _container(m: torch.nn.Module) -> bool:
    # whole models and decoder layers hold mixers; the mixer module itself is what is named
    name = _name(m)
    return (hasattr(m, "config") and hasattr(m, "base_model_prefix")) or name.endswith(
        ("DecoderLayer", "Layer", "Block", "Model", "ForCausalLM", "ForConditionalGeneration")
    )


def _name_has(*parts: str) -> Callable[[torch.nn.Module], bool]:
    lowered = tuple(p.lower() for p in parts)
    return lambda m: not _container(m) and any(p in _name(m).lower() for p in lowered)


def _sequence_conv(m: torch.nn.Module) -> bool:
    """A Conv1d wider than one token: in a decoder-only LM's layers (towers are left out) it runs
    over the sequence, whether padded by the module (Mamba's conv1d) or by the model's code (ZAYA's
    q/k convolutions, padded with ``F.pad`` and ``padding=0``)."""
    return isinstance(m, torch.nn.Conv1d) and m.kernel_size[0] > 1


def _has_param(name: str) -> Callable[[torch.nn.Module], bool]:
    return lambda m: isinstance(m._parameters.get(name), torch.nn.Parameter)


def _v_head_dim_differs(m: torch.nn.Module) -> bool:
    v, qk = getattr(m, "v_head_dim", None), getattr(m, "qk_head_dim", None)
    return isinstance(v, int) and isinstance(qk, int) and v != qk


def _layer_kind(m: torch.nn.Module) -> str | None:
    config, idx = getattr(m, "config", None), getattr(m, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    if isinstance(idx, int) and isinstance(types, (list, tuple)) and idx < len(types):
        return types[idx]
    return getattr(m, "layer_type", None)


def _chunked_attention(m: torch.nn.Module) -> bool:
    chunk = getattr(getattr(m, "config", None), "attention_chunk_size", None)
    return chunk is not None and _layer_kind(m) == "chunked_attention"


def _norm(m: torch.nn.Module) -> bool:
    return "norm" in _name(m).lower()  # MambaRMSNorm: a layer of the block, not its mixer


def _ssm(m: torch.nn.Module) -> bool:
    # a selective scan: its decay A_log beside a causal conv1d (Mamba, Mamba2 and their kin)
    return _has_param("A_log")(m) and isinstance(getattr(m, "conv1d", None), torch.nn.Conv1d)


# inspect.getsource parses the class's file (linecache, ast): two threads' first forwards at once
# raised a SystemError from it.
_SOURCE_LOCK = threading.Lock()


def _source(cls: type) -> str | None:
    """``cls``'s source, or None where it has none."""
    with _SOURCE_LOCK:
        try:
            return inspect.getsource(cls)
        except (OSError, TypeError):
            return None


@functools.cache
def _computes_own_attention(cls: type) -> bool:
    """Whether ``cls.forward`` writes its softmax attention out instead of calling transformers'
    AttentionInterface (transformers' own test for ``set_attn_implementation``, per class)."""
    if "forward" not in cls.__dict__:
        return False
    source = _source(cls)  # the class: its forward may call a helper (`_attn`)
    if source is None:
        return False
    return "softmax" in source and not any(
        s in source
        for s in ("ALL_ATTENTION_FUNCTIONS", "attention_interface", "_attention_forward")
    )


def _own_attention(m: torch.nn.Module) -> bool:
    # transformers' own verdict first: a model class it cannot switch to another attention,
    # unless what it took for attention is a recurrence (RWKV's RwkvSelfAttention), which its
    # own kind answers for (adapted, or refused as linear_recurrence)
    can_set = getattr(type(m), "_can_set_attn_implementation", None)
    if callable(can_set) and hasattr(m, "config") and not can_set():
        named = [s for s in m.modules() if "attention" in _name(s).lower() and not _container(s)]
        return not (named and all(_recurrent_fallback(s) for s in named))
    return (
        "attention" in _name(m).lower() and not _container(m) and _computes_own_attention(type(m))
    )


def _recurrent_fallback(m: torch.nn.Module) -> bool:
    # State-space and linear-recurrence parameters (Mamba's A_log, RG-LRU's recurrent gate)
    return any(
        isinstance(m._parameters.get(p), torch.nn.Parameter)
        for p in ("A_log", "recurrent_param", "time_decay")
    )


# Broad kinds first in this list (the loop below registers them in reverse, so the most specific
# ends up first): each refused until a module of flexpack's makes it exact.
for _kind in reversed(
    [
        MixerKind("gated_delta_rule", _name_has("GatedDeltaNet", "GatedDeltaRule"), False,
                  "the gated delta rule's recurrent state and its causal conv run across "
                  "document boundaries"),
        MixerKind("kda", _name_has("DeltaAttention"), False,
                  "Kimi delta attention's recurrent state and conv run across document "
                  "boundaries"),
        MixerKind("lightning_attention", _name_has("LightningAttention"), False,
                  "lightning attention's recurrent state runs across document boundaries"),
        MixerKind("mamba", lambda m: _ssm(m) or (_name_has("Mamba")(m) and not _norm(m)), False,
                  "the Mamba scan's state and its causal conv run across document boundaries"),
        MixerKind("short_conv", _name_has("ShortConv"), False,
                  "the short convolution's window runs across document boundaries"),
        MixerKind("linear_recurrence",
                  lambda m: _recurrent_fallback(m)
                  or (_name_has("RecurrentBlock", "Rglru", "Rwkv", "xLSTMBackend", "mLSTM",
                                "sLSTM")(m) and not _norm(m)),
                  False, "a recurrent state runs across document boundaries"),
        MixerKind("causal_conv", _sequence_conv, False,
                  "a causal convolution's window runs across document boundaries"),
        MixerKind("sparse_indexer", _name_has("Indexer"), False,
                  "a lightning indexer picks each query's keys by its own scores over the row "
                  "(DeepSeek sparse attention), from a mask flexpack does not build"),
        MixerKind("kv_compressor", _name_has("Compressor"), False,
                  "a compressor pools keys over blocks of the row, across document boundaries"),
        MixerKind("own_attention", _own_attention, False,
                  "its attention is written out in the model's code instead of going through "
                  "transformers' AttentionInterface, so flexpack's attention never runs"),
        MixerKind("attention_sinks", _has_param("sinks"), True,
                  "the sink logit (`s_aux`) joins each softmax: o * sigmoid(lse - sink) on "
                  "flex, a sink column on the dense paths (flexpack._attention_sinks)"),
        MixerKind("mla_head_dims", _v_head_dim_differs, True,
                  "values zero-padded to the q/k head dim (or q, k to v's), the output cut back"),
        MixerKind("chunked_attention", _chunked_attention, True,
                  "each (document, chunk) piece is a document of its own, chunks counted from "
                  "the document's start"),
    ]
):  # fmt: skip
    _KINDS.insert(0, _kind)


def _towers(model: torch.nn.Module) -> set[int]:
    """ids of the modules inside a vision or audio tower (their own sequences, not the rows)."""
    skip: set[int] = set()
    for path, m in model.named_modules():
        key = getattr(getattr(m, "config", None), "base_config_key", None)
        tower = key in ("vision_config", "audio_config") or any(
            part in ("vision_tower", "visual", "audio_tower", "audio", "vision_model")
            or part.startswith(("audio_", "vision_", "image_"))
            for part in path.split(".")
        )
        if tower and id(m) not in skip:
            skip.update(id(s) for s in m.modules())
    return skip


def _matches(model: torch.nn.Module) -> list[tuple[str, MixerKind]]:
    towers = _towers(model)
    found: list[tuple[str, MixerKind]] = []
    inside: list[str] = []
    for path, m in model.named_modules():
        if id(m) in towers or any(path.startswith(p + ".") for p in inside):
            continue
        for kind in _KINDS:
            if kind.matches(m):
                found.append((path, kind))
                # features of attention (sinks, MLA, chunks) do not hide the module's children
                if kind.name not in ("attention_sinks", "mla_head_dims", "chunked_attention"):
                    inside.append(path)
                break
    return found


def mixers_of(model: torch.nn.Module) -> list[tuple[str, str]]:
    """(module path, kind name) of every module that matches a registered kind.

    A matched module's own submodules are not classified again (a Mamba mixer's conv is part of
    the mixer). Modules in vision and audio towers are left out.

    Args:
        model: any ``torch.nn.Module`` (a transformers model).

    Returns:
        The matches in module order.
    """
    return [(path, kind.name) for path, kind in _matches(model)]


def unsupported(model: torch.nn.Module) -> list[str]:
    """One sentence per kind of token mixer that flexpack cannot make exact in ``model``."""
    paths: dict[MixerKind, list[str]] = {}
    for path, kind in _matches(model):
        if not kind.exact:
            paths.setdefault(kind, []).append(path)
    return [_sentence(model, kind, where) for kind, where in paths.items()]


def _sentence(model: torch.nn.Module, kind: MixerKind, where: list[str]) -> str:
    more = f" and {len(where) - 1} more" if len(where) > 1 else ""
    cls = type(model.get_submodule(where[0])).__name__
    at = f"`{where[0]}`" if where[0] else "the model's root"
    return f"{kind.name} ({cls} at {at}{more}): {kind.why}"


# The transformers releases flexpack's seams were verified on (the model zoo runs each family on
# the oldest and newest of them in CI; docs/supported_models.md lists the verdicts per release).
# Outside this range an unknown seam is refused, never guessed: the refusal says so.
VERIFIED_TRANSFORMERS = ("5.17.0", "5.25.0")

# The kinds whose state runs along the row (flexpack.mixers adapts them or they are refused).
STATEFUL_KINDS = frozenset({"gated_delta_rule", "kda", "lightning_attention", "mamba",
                            "short_conv", "linear_recurrence", "causal_conv"})  # fmt: skip


def transformers_version() -> str:
    """The installed transformers version ("not installed" without it)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def refusal(model: torch.nn.Module, problems: list[str]) -> str:
    """The refusal's words: what cannot be kept exact, the installed transformers release, the
    range flexpack was verified on, and the ways out."""
    low, high = VERIFIED_TRANSFORMERS
    return (
        f"flexpack cannot keep {type(model).__name__} exact on packed rows (each document would "
        "see the others): " + "; ".join(problems) + f". Installed: transformers "
        f"{transformers_version()}; flexpack's seams are verified on transformers {low} to "
        f"{high}. If docs/supported_models.md lists this family as exact, this release moved a "
        f"seam: install transformers<={high} (and report it), or run flexpack.check(model) to "
        "test your model. Otherwise run it unpacked (one sample per row, padded) with "
        "attn_implementation='sdpa'."
    )


_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check(model: torch.nn.Module) -> None:
    """Raise a ValueError naming every token mixer of ``model`` flexpack cannot make exact.

    The answer is kept per model (a model's modules do not change kind between forwards).

    Raises:
        ValueError: the model has a refused kind of token mixer; the message names the kind,
            the module class and path, the installed transformers version, the versions
            flexpack was verified on, and what to do instead.
    """
    problems = _checked.get(model)
    if problems is None:
        problems = _checked[model] = unsupported(model)
        if not problems and not _probing and outside_verified() and hasattr(model, "config"):
            problems = _checked[model] = _probe_unverified(model)
    if problems:
        raise ValueError(refusal(model, problems))


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit()) or "0"
        parts.append(int(digits))
        if not piece.isdigit():  # "25rc1", "0.dev0": what follows does not count
            break
    return tuple(parts)


def outside_verified(version: str | None = None) -> bool:
    """Whether ``version`` (the installed transformers by default) lies outside
    ``VERIFIED_TRANSFORMERS``: then each model flexpack sees is run through :func:`flexpack.check`
    at its first forward, since a seam flexpack reads may have moved."""
    version = transformers_version() if version is None else version
    if version == "not installed":
        return False
    low, high = (_version(v) for v in VERIFIED_TRANSFORMERS)
    return not low <= _version(version) <= high


_probing = False  # flexpack.check's own probe forwards check their twin: not again


def _probe_unverified(model: torch.nn.Module) -> list[str]:
    """On a transformers release flexpack was not verified on, the model's verdict comes from
    running it: flexpack.check on a float64 probe (once per kind of model and release)."""
    global _probing
    import flexpack

    _probing = True
    try:
        flexpack.check(model)
    except ValueError as e:
        return [f"flexpack.check found a difference on transformers {transformers_version()}, "
                f"outside the verified range: {e}"]  # fmt: skip
    except RuntimeError as e:  # no probe could be built: unverified is refused, not guessed
        return [f"flexpack.check could not probe it on transformers {transformers_version()}, "
                f"outside the verified range: {e}"]  # fmt: skip
    finally:
        _probing = False
    return []


def stateful_left(model: torch.nn.Module, adapted: Callable[[torch.nn.Module], bool]) -> list[str]:
    """:func:`unsupported`'s sentences for the recurrent / conv mixers of ``model`` for which
    ``adapted(module)`` is False (flexpack.mixers.adapt found no room for them)."""

    def inside_adapted(path: str) -> bool:  # the module or one that holds it (ZAYA's conv)
        parts = path.split(".") if path else []
        return any(adapted(model.get_submodule(".".join(parts[:i])))
                   for i in range(len(parts), -1, -1))  # fmt: skip

    return [
        _sentence(model, kind, [path])
        for path, kind in _matches(model)
        if not kind.exact and kind.name in STATEFUL_KINDS and not inside_adapted(path)
    ]


_attention: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> has_attention

# What a module's class calls when it attends: transformers' AttentionInterface (and the
# functions behind it), or torch's and flash-attn's kernels directly.
_ATTENTION_CALLS = ("ALL_ATTENTION_FUNCTIONS", "attention_interface", "_attention_forward",
                    "scaled_dot_product_attention", "flash_attn")  # fmt: skip


@functools.cache
def _calls_attention(cls: type) -> bool:
    """Whether the class that gives ``cls`` its ``forward`` calls an attention function."""
    owner = next((c for c in cls.__mro__ if "forward" in c.__dict__), None)
    if owner is None or owner.__module__.startswith("torch."):
        return False
    source = _source(owner)
    if source is None:
        return False
    return any(s in source for s in _ATTENTION_CALLS)


def _stateful(m: torch.nn.Module) -> bool:
    # a recurrent / conv mixer by its structure, adapted by flexpack.mixers or not
    return any(k.matches(m) for k in _KINDS if not k.exact and k.name in STATEFUL_KINDS)


def has_attention(model: torch.nn.Module) -> bool:
    """Whether ``model`` mixes tokens by attention anywhere outside its vision / audio towers:
    a module that calls an attention function (transformers' AttentionInterface, SDPA), one
    named attention that no recurrent kind claims, or attention written out in the model's
    code (``own_attention``). RWKV's ``RwkvSelfAttention`` is a recurrence (its kind claims
    it): RWKV, Mamba, Mamba2, Falcon-Mamba and xLSTM have no attention. Kept per model.

    Example:
        >>> import torch
        >>> has_attention(torch.nn.Sequential(torch.nn.MultiheadAttention(4, 1)))
        True
        >>> has_attention(torch.nn.Sequential(torch.nn.Linear(4, 4)))
        False
    """
    found = _attention.get(model)
    if found is None:
        towers, inside, found = _towers(model), [], False
        for path, m in model.named_modules():
            if id(m) in towers or any(path.startswith(p + ".") for p in inside):
                continue
            if _stateful(m):  # what it holds is part of the recurrence
                inside.append(path)
            elif (
                _calls_attention(type(m))
                or (not _container(m) and "attention" in _name(m).lower())
                or _own_attention(m)
            ):
                found = True
                break
        _attention[model] = found
    return found


_seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # attention module -> ref(model)


def check_call(module: torch.nn.Module | None) -> None:
    """:func:`check` the model an attention (or mask) call comes from.

    transformers hands the attention function its attention module, not the model; the model
    is the outermost ``torch.nn.Module`` with a ``config`` on the call stack (the one the user
    called), found once per attention module (mask calls, one or two per forward, look it up
    each time). Under ``torch.compile`` nothing is looked up (the eager first forward, or
    :func:`check` called directly, does it).
    """
    if torch.compiler.is_compiling():
        return
    ref = None if module is None else _seen.get(module)
    model = None if ref is None else ref()
    if model is None:
        model = _outermost_model(module)
        if model is None:
            return
        if module is not None:  # a weak reference: the module lives inside the model
            _seen[module] = weakref.ref(model)
    check(model)


def _outermost_model(module: torch.nn.Module | None) -> torch.nn.Module | None:
    import sys

    found = module
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and hasattr(owner, "config"):
            found = owner
        frame = frame.f_back
    return found
