"""Per-document state for the recurrent and convolutional token mixers of transformers models.

A packed row holds several documents; attention keeps them apart through flexpack's mask, but a
gated delta rule, a Mamba scan, a lightning-attention state or a short causal conv carries its
state along the row, from one document into the next. :func:`adapt` makes every such mixer of a
model start each document afresh, per model instance and reversibly (:func:`restore`):

- each mixer module gets an instance-level ``forward`` (its class is untouched) that reads the
  documents of the call (``doc_ids``, ``seq_idx`` or restarting ``position_ids`` and a 2-D
  padding ``attention_mask``, the sources flexpack's attention reads) and runs the module's own
  forward on them: once per group of right-padded documents (the torch paths, CPU or CUDA), or,
  where the module's kernel-mapped functions run fla / causal-conv1d / mamba_ssm kernels on a
  GPU, once on the flattened rows with the boundaries in the kernels' varlen keywords
  (``cu_seqlens``, ``seq_idx``);
- the model gets a forward pre-hook that records the call's document sources for mixers whose
  decoder layer does not forward the call's keywords (Jamba).

One room per kind: :mod:`~flexpack.mixers.delta` (gated delta rule, KDA),
:mod:`~flexpack.mixers.ssm` (Mamba2, Mamba), :mod:`~flexpack.mixers.conv` (short convs, ZAYA's
convolutional q/k/v projection), :mod:`~flexpack.mixers.linear` (lightning attention),
:mod:`~flexpack.mixers.rglru` (RecurrentGemma's conv + RG-LRU block),
:mod:`~flexpack.mixers.rwkv` (RWKV's WKV time mix and token shifts),
:mod:`~flexpack.mixers.xlstm` (xLSTM's mLSTM layer). Calls with a cache (``generate()``) run the
module's own forward unchanged: a prompt is one document per row (packed rows with a cache are
exact but leave the cache without their state, with a warning).
``flexpack.integrations.transformers.register()``'s models are adapted at their first forward.

Shapes: hidden_states (B, S, H); doc_ids (B, S) int, -1 on padding.

    >>> import torch
    >>> from transformers import Lfm2Config, Lfm2ForCausalLM                    # doctest: +SKIP
    >>> import flexpack.mixers                                                  # doctest: +SKIP
    >>> model = flexpack.mixers.adapt(Lfm2ForCausalLM(Lfm2Config(...)))         # doctest: +SKIP
    >>> flexpack.mixers.mixers_of(model)                                        # doctest: +SKIP
    [('model.layers.0.conv', 'short_conv'), ...]
"""

from __future__ import annotations

import inspect
import sys
import threading
import warnings
import weakref
from typing import Any

import torch
from torch import Tensor

from flexpack._tensor_cache import all_match, on_clear, stamps
from flexpack.layout import _doc_ids_from_sources
from flexpack.mixers import conv, delta, dynamic_conv, linear, rglru, rwkv, ssm, xlstm
from flexpack.mixers._plan import DocumentPlan
from flexpack.mixers._room import Room, uses_kernels
from flexpack.mixers._tree import TreePlan

__all__ = [
    "ROOMS",
    "DocumentPlan",
    "Room",
    "TreeRefused",
    "adapt",
    "adapt_caller",
    "call_sources",
    "is_adapted",
    "mixers_of",
    "restore",
    "set_sources",
    "uses_kernels",
]

# Most specific first: a gated delta net also calls causal_conv1d_fn.
ROOMS: tuple[Room, ...] = (
    *delta.ROOMS,
    *ssm.ROOMS,
    *linear.ROOMS,
    *rglru.ROOMS,
    *rwkv.ROOMS,
    *xlstm.ROOMS,
    *dynamic_conv.ROOMS,
    *conv.ROOMS,
)

_ROOMS_BY_NAME = {room.name: room for room in ROOMS}

_CACHE_NAMES = ("cache", "cache_params", "past_key_values", "layer_past", "state")
# Boundary keywords of the call that the per-document calls must not see (their rows are single
# documents; the torch fallbacks refuse cu_seqlens / seq_idx).
_BOUNDARY_KEYS = ("doc_ids", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens",
                  "max_length_q", "max_length_k", "flexpack_mask")  # fmt: skip

# What the model call hands the mixers' plan (and the tree mask they refuse): read from the
# model's own call, since not every decoder layer passes its keywords down (LFM2 on 5.17).
_SOURCES = ("doc_ids", "seq_idx", "position_ids", "attention_mask", "flexpack_mask")

# Where the state lives: on the objects it describes, so that it travels with them. A model's
# ``__dict__`` holds its _Adapted (hooks, mixers, the call context), each of its modules the
# _Call they share, each adapted mixer its _MixerForward. ``copy.deepcopy(model)`` thus gives a
# copy whose hooks and mixers run on the copy's own modules and weights, with a fresh _Call
# (empty caches); ``pickle`` / ``torch.save`` round-trip the same way.
_ADAPTED = "_flexpack_adapted"  # on the model: its _Adapted
_CALL = "_flexpack_call"  # on every module of an adapted model: the model's _Call
_ROOM = "_flexpack_room"  # on an adapted mixer: its room's name

_calls: weakref.WeakSet = weakref.WeakSet()  # every live _Call (clear_caches empties them)
# adapt() / restore() of two threads at once (two first forwards) would adapt a model twice
_ADAPT_LOCK = threading.RLock()


class _Call:
    """The document sources of the model's current call and the plan derived from them, shared
    by every adapted mixer of the model (the plan is built once per forward).

    Gradient checkpointing replays a layer in backward, possibly after later forwards replaced
    ``sources``: each checkpointed layer's input tensor is remembered with the sources of its
    forward (``replay``), and a replayed layer finds its input on the call stack (the
    checkpoint holds that same tensor object to replay it: torch's non-reentrant checkpoint,
    transformers' default; the reentrant one keeps it in its saved tensors)."""

    def __init__(self) -> None:
        self.clear()
        _calls.add(self)

    def clear(self) -> None:
        """Forget the sources of the latest call and everything derived from them."""
        self.sources: dict[str, Any] = {}
        self.replay: dict[int, tuple[weakref.ref, dict[str, Any]]] = {}
        self.plan_key: tuple | None = None
        self.stamped: tuple | None = None
        self.ids: Tensor | None = None
        self.plans: dict[float, DocumentPlan] = {}  # by the room's pad factor
        self.tree: tuple[Any, TreePlan] | None = None  # the latest tree mask and its plan

    def __deepcopy__(self, memo: dict) -> _Call:
        return _Call()  # a copied model starts with no call and empty caches

    def __reduce__(self) -> tuple:
        return (_Call, ())

    def remember(self, layer_input: Tensor) -> None:
        """A checkpointed layer starts its forward on ``layer_input`` with this call's sources."""
        key, replay = id(layer_input), self.replay
        ref = weakref.ref(layer_input, lambda _, key=key: replay.pop(key, None))
        replay[key] = (ref, self.sources)

    def current(self) -> dict[str, Any]:
        """The sources of the forward running now: the latest call's, or, inside a checkpointed
        layer (its forward or its replay in backward), the sources its forward had."""
        if not self.replay or torch.compiler.is_compiling():
            return self.sources
        frame = sys._getframe(1)
        for _ in range(64):  # the layer's frames (its input, or the checkpoint's args) are near
            if frame is None:
                break
            for value in frame.f_locals.values():
                for t in value if isinstance(value, tuple) else (value,):
                    hit = self.replay.get(id(t)) if isinstance(t, Tensor) else None
                    if hit is not None and hit[0]() is t:
                        return hit[1]
            frame = frame.f_back
        return self.sources

    def tree_plan_for(self, mask: Any) -> TreePlan:
        """The :class:`TreePlan` of a tree mask's rows, built once per mask (every layer of a
        forward shares the mask object)."""
        held = self.tree
        if held is not None and held[0] is mask:
            return held[1]
        plan = TreePlan.from_ends(mask.doc_ids, mask._tree_ends)
        self.tree = (mask, plan)  # masks take no weak reference (slots); the next one replaces
        return plan

    def plan_for(
        self, B: int, S: int, kwargs: dict[str, Any], device, pad_factor: float
    ) -> DocumentPlan:
        sources = self.current()
        own = {k: kwargs.get(k) for k in ("doc_ids", "seq_idx")}
        src = own if any(v is not None for v in own.values()) else sources
        doc_ids, seq_idx = src.get("doc_ids"), src.get("seq_idx")
        position_ids = sources.get("position_ids")
        padding = sources.get("attention_mask")
        if not (isinstance(padding, Tensor) and padding.dim() == 2):
            padding = None
        _refuse_split_rows(S, doc_ids, seq_idx, position_ids)
        if isinstance(position_ids, Tensor) and position_ids.shape[-1] != S:
            position_ids = None  # not this sequence's positions
        if padding is not None and padding.shape[-1] < S:
            padding = None
        tensors = tuple(t if isinstance(t, Tensor) else None for t in
                        (doc_ids, seq_idx, position_ids, padding))  # fmt: skip
        # Stamps, not (id, _version): they see writes through numpy and .data, and inference
        # tensors (no version counter) too.
        if self.plan_key != (B, S) or not all_match(self.stamped, tensors):
            ids = _doc_ids_from_sources(B, S, padding, doc_ids, seq_idx, position_ids)
            self.ids = ids.to(device)
            self.plans = {}
            self.plan_key = (B, S)
            self.stamped = stamps(tensors)
        plan = self.plans.get(pad_factor)
        if plan is None:
            plan = self.plans[pad_factor] = DocumentPlan.from_doc_ids(self.ids, pad_factor)
        return plan


def _refuse_split_rows(S: int, *sources: Any) -> None:
    """A mixer called on a piece of the call's rows (xLSTM in eval splits rows longer than its
    config's ``max_inference_chunksize`` and carries its state between the pieces through a
    cache) cannot tell where the piece's documents start: refused when the rows are packed."""
    rows = [t for t in sources if isinstance(t, Tensor) and t.dim() >= 1 and t.shape[-1] > S]
    if not rows:
        return
    doc_ids, seq_idx, position_ids = sources
    packed = any(t is doc_ids or t is seq_idx for t in rows) or bool(
        (position_ids[..., 1:] == 0).any()  # restarting positions: packed documents
    )
    if packed:
        raise ValueError(
            f"a recurrent / conv layer was called on {S} tokens of rows of "
            f"{rows[0].shape[-1]}: the model splits its rows into pieces (xLSTM does in eval, "
            "past config.max_inference_chunksize) and carries its state from piece to piece, "
            "across the documents of a packed row. Pack rows no longer than that size, or "
            "raise it (config.max_inference_chunksize) above the rows' length."
        )


class _Adapted:
    """The hooks that give an adapted model's mixers the document sources of each call.

    A pre-hook on the model reads its forward's arguments. Code that runs the backbone alone
    (``model.base_model(**kwargs)``, as ``packed_causal_lm_loss`` does to skip the logits)
    never enters the model's forward, so the backbone gets a pre-hook too; it reads its own
    arguments only when the model's forward is not running (inside it, the model's arguments
    stand: its doc_ids may not be passed down)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.call = _Call()
        self.modules: list[torch.nn.Module] = []
        self.outer_running = False
        self.hooks = [
            model.register_forward_pre_hook(_Capture(self, model, outer=True), with_kwargs=True),
            model.register_forward_hook(self._leave, always_call=True),
        ]
        backbone = getattr(model, "base_model", None)
        if isinstance(backbone, torch.nn.Module) and backbone is not model:
            self.hooks.append(
                backbone.register_forward_pre_hook(
                    _Capture(self, backbone, outer=False), with_kwargs=True
                )
            )
        # layers transformers can checkpoint (GradientCheckpointingLayer): their hooks run at
        # the forward only (the checkpoint wraps `forward`), which is when the sources are known
        for module in model.modules():
            if (
                module is not model
                and module is not backbone
                and (hasattr(module, "gradient_checkpointing"))
            ):
                self.hooks.append(
                    module.register_forward_pre_hook(self._remember_input, with_kwargs=True)
                )

    def _remember_input(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not (module.training and module.gradient_checkpointing and torch.is_grad_enabled()):
            return
        if torch.compiler.is_compiling():
            return
        x = args[0] if args else kwargs.get("hidden_states")
        if isinstance(x, Tensor):
            self.call.remember(x)

    def _leave(self, *_: Any) -> None:
        self.outer_running = False

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


class _Capture:
    """The forward pre-hook that records a call's document sources (a class, not a closure: a
    copied model's hook records into the copy's call)."""

    def __init__(self, adapted: _Adapted, module: torch.nn.Module, *, outer: bool) -> None:
        self.adapted, self.module, self.outer = adapted, module, outer
        self._signature: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_signature": None}  # rebuilt from the copy's own forward

    def signature(self) -> inspect.Signature | None:
        if self._signature is None:
            try:
                self._signature = inspect.signature(self.module.forward)
            except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
                self._signature = False
        return self._signature or None

    def __call__(self, _module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        adapted = self.adapted
        if not self.outer and adapted.outer_running:
            return
        adapted.outer_running = self.outer
        sources = dict(kwargs)
        signature = self.signature() if args else None
        if signature is not None:
            try:
                bound = signature.bind_partial(*args, **kwargs).arguments
            except TypeError:
                pass
            else:  # the keywords a **kwargs parameter took, beside the named ones
                sources = {}
                for name, value in bound.items():
                    kind = signature.parameters[name].kind
                    if kind is inspect.Parameter.VAR_KEYWORD:
                        sources.update(value)
                    else:
                        sources[name] = value
        adapted.call.sources = {k: sources.get(k) for k in _SOURCES}


def _clear_plans() -> None:
    """flexpack.clear_caches(): forget every model's plan."""
    for call in list(_calls):
        call.clear()


on_clear(_clear_plans)


def _towers(model: torch.nn.Module) -> set[int]:
    """ids of modules inside vision / audio towers (their own sequences, never packed rows)."""
    skip: set[int] = set()
    for m in model.modules():
        key = getattr(getattr(m, "config", None), "base_config_key", None)
        if key in ("vision_config", "audio_config"):
            skip.update(id(s) for s in m.modules())
    return skip


def _room_of(module: torch.nn.Module) -> Room | None:
    for room in ROOMS:
        if room.owns(module):
            return room
    return None


def mixers_of(model: torch.nn.Module) -> list[tuple[str, str]]:
    """(module path, room name) of every token mixer of ``model`` that flexpack.mixers adapts.

    Example:
        >>> import torch, flexpack.mixers
        >>> flexpack.mixers.mixers_of(torch.nn.Linear(2, 2))
        []
    """
    towers = _towers(model)
    return [
        (path, room.name)
        for path, m in model.named_modules()
        if id(m) not in towers and (room := _room_of(m)) is not None
    ]


def call_sources(module: torch.nn.Module) -> dict[str, Any] | None:
    """The document sources (``doc_ids``, ``seq_idx``, ``position_ids``, ``attention_mask``)
    of the current call of the model ``module`` belongs to, as its pre-hook recorded them; None
    for a module of no recorded model. flexpack's attention falls back to them when its own
    keywords carry none (Llama 4's decoder layer and ZAYA's model never pass position_ids on).
    """
    call = module.__dict__.get(_CALL)
    return None if call is None else call.current()


def set_sources(module: torch.nn.Module, **sources: Any) -> None:
    """Set the document sources (keys of ``doc_ids``, ``seq_idx``, ``position_ids``,
    ``attention_mask``, ``flexpack_mask``; the others None) of the current call of the
    :func:`adapt`-ed model ``module`` belongs to, for a forward whose own arguments do not carry
    them (a prefix-tree forward: the backbone called with ``flexpack_mask`` inside the model's
    forward). Nothing for a module of no adapted model."""
    call = module.__dict__.get(_CALL)
    if call is not None:
        call.sources = {k: sources.get(k) for k in _SOURCES}


def is_adapted(module: torch.nn.Module) -> bool:
    """True for a mixer module :func:`adapt` has given a per-document forward."""
    return _ROOM in module.__dict__


def _adapted(model: torch.nn.Module) -> _Adapted | None:
    return model.__dict__.get(_ADAPTED)


def adapt(model: torch.nn.Module) -> torch.nn.Module:
    """Give every recurrent / convolutional token mixer of ``model`` a per-document state.

    Per instance and reversible (:func:`restore`); calling it again is harmless. Models without
    such mixers get only the forward pre-hook that records each call's document sources (for
    attention layers whose decoder layer drops ``position_ids``: :func:`call_sources`).

    Args:
        model: a transformers model (any ``torch.nn.Module``; its mixers are found by the
            kernel-mapped functions their classes call, see :mod:`flexpack.mixers._room`).

    Returns:
        ``model``.

    Raises:
        ValueError: ``model`` has a recurrent or convolutional token mixer that no room
            recognises (a family flexpack does not know, or a transformers release that moved
            the seam a room reads): its state would run across documents. The message names
            the module, the installed transformers version and the versions flexpack was
            verified on; ``model`` is left unadapted.

    Example:
        >>> import torch, flexpack.mixers
        >>> m = flexpack.mixers.adapt(torch.nn.Linear(2, 2))  # nothing to adapt
        >>> flexpack.mixers.restore(m) is m
        True
    """
    with _ADAPT_LOCK:
        if _adapted(model) is not None:
            return model
        from flexpack.integrations import _mixers_check  # torch only; the refusal registry

        found = [(model.get_submodule(p), name) for p, name in mixers_of(model)]
        state = _Adapted(model)
        for module, name in found:
            _install(module, _ROOMS_BY_NAME[name], state.call)
            state.modules.append(module)
        for module in model.modules():
            module.__dict__.setdefault(_CALL, state.call)
        model.__dict__[_ADAPTED] = state
        if found:
            _forget_checks(model)
        # Fail closed: a mixer with a state along the row that no room took would leak silently.
        left = _mixers_check.stateful_left(model, is_adapted)
        if left:
            restore(model)
            raise ValueError(_mixers_check.refusal(model, left))
        return model


def _forget_checks(model: torch.nn.Module) -> None:
    """The refusal registry's answer for ``model`` (kept per model) changes with adapt/restore."""
    import sys

    registry = sys.modules.get("flexpack.integrations._mixers_check")
    if registry is not None:
        registry._checked.pop(model, None)


def restore(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`adapt`: the mixers' class forwards and no pre-hook again. Returns ``model``."""
    with _ADAPT_LOCK:
        state = model.__dict__.pop(_ADAPTED, None)
        if state is not None:
            state.remove()
            for module in state.modules:
                module.__dict__.pop("forward", None)
                module.__dict__.pop(_ROOM, None)
            for module in model.modules():
                if module.__dict__.get(_CALL) is state.call:
                    del module.__dict__[_CALL]
            if state.modules:
                _forget_checks(model)
    return model


# id(config) -> a weak reference to it (configs are unhashable dataclasses)
_seen_configs: dict[int, weakref.ref] = {}


def adapt_caller(config: Any) -> torch.nn.Module | None:
    """:func:`adapt` the model whose forward is running now (called by flexpack's mask function
    at the start of a model's forward, before its first layer; once per config). Returns the
    model the first time, None on later calls (and when no model is found).

    transformers hands the mask function the model's config, not the model: the model is the
    outermost ``torch.nn.Module`` with a ``config`` on the call stack (the one the user called).
    Its forward's arguments are this call's document sources (the pre-hook :func:`adapt`
    installs sees the next calls). Under ``torch.compile`` nothing is looked up.
    """
    import sys

    if torch.compiler.is_compiling():
        return None
    if config is None:
        return None
    seen = _seen_configs.get(id(config))
    if seen is not None and seen() is config:
        return None
    key = id(config)
    try:
        _seen_configs[key] = weakref.ref(config, lambda _: _seen_configs.pop(key, None))
    except TypeError:  # pragma: no cover - a config without weak references
        return None
    model, frame_locals = None, None
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and hasattr(owner, "config"):
            model, frame_locals = owner, frame.f_locals
        frame = frame.f_back
    if model is None:
        return None
    fresh = _adapted(model) is None  # adapted before: its pre-hooks recorded this call's sources
    adapt(model)
    state = _adapted(model)
    if fresh and state is not None and frame_locals is not None:
        found = dict(frame_locals.get("kwargs") or {})
        found.update({k: v for k, v in frame_locals.items() if k != "kwargs"})
        state.call.sources = {k: found.get(k) for k in _SOURCES}
    return model


class _MixerForward:
    """The forward :func:`adapt` gives a mixer module, as an instance attribute (its class is
    untouched): the module's own forward, run per document. An object that names its module,
    not a closure over it, so that a copied model's mixer runs the copy's weights."""

    def __init__(self, module: torch.nn.Module, room: Room, call: _Call) -> None:
        params = inspect.signature(type(module).forward.__get__(module)).parameters
        self.module, self.room, self.call = module, room.name, call
        self.cache_name = next((n for n in _CACHE_NAMES if n in params), None)
        self.positional = [
            n for n, p in params.items()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]  # fmt: skip

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        own = type(module).forward.__get__(module)  # the class's forward, bound
        bound = dict(zip(self.positional, args, strict=False))
        bound.update(kwargs)
        return _forward(module, own, _ROOMS_BY_NAME[self.room], self.call, self.cache_name, bound)


def _install(module: torch.nn.Module, room: Room, call: _Call) -> None:
    module.__dict__["forward"] = _MixerForward(module, room, call)
    module.__dict__[_ROOM] = room.name


def _forward(module, own, room: Room, call: _Call, cache_name, bound: dict[str, Any]) -> Any:
    x = bound.pop("hidden_states", None)
    if x is None:  # first positional argument under another name
        first = next(iter(bound))
        x = bound.pop(first)
    B, S = x.shape[:2]
    cache = bound.get(cache_name) if cache_name else None
    if room.keeps_cache and bound.get("use_cache", True):
        cache = True  # its cache is the module's own attributes
    mask = bound.get("flexpack_mask")
    if mask is None:
        mask = call.current().get("flexpack_mask")
    if mask is not None:  # prefix trees (whole rows, never decoding: a cache gets nothing)
        _drop_cache(bound, cache_name, room)
        return _tree_forward(module, own, room, call, mask, x, bound)
    if cache is not None:
        if S == 1 or call.plan_for(B, S, bound, x.device, room.pad_factor).one_per_row:
            # decoding, or prompts: no row holds two documents (a count of documents against
            # rows would let two documents share a state beside a padding-only row)
            return own(x, **bound)
        warnings.warn(
            f"{type(module).__name__} got packed rows (several documents per row) together with "
            "a cache: each document's outputs are exact, but the cache gets no recurrent state "
            "for this layer, so generation cannot continue from these rows. Pass "
            "use_cache=False for packed rows (flexpack's packed_forward_kwargs does).",
            stacklevel=3,
        )
        _drop_cache(bound, cache_name, room)
    plan = call.plan_for(B, S, bound, x.device, room.pad_factor)
    if plan.single:
        return own(x, **{k: v for k, v in bound.items() if k not in _BOUNDARY_KEYS})
    rest = {k: v for k, v in bound.items() if k not in _BOUNDARY_KEYS}
    if "attention_mask" in rest:
        rest["attention_mask"] = None  # padding is left out of the documents
    if plan.documents == 0:
        # all padding (a data-parallel rank's filler batch): zeros, from one call of the module
        # on zeros, so that backward still reaches its parameters (DDP waits for their grads)
        out = own(x * 0, **rest)
        if not isinstance(out, tuple):
            return out * 0
        if room.all_outputs:
            return tuple(o * 0 for o in out)
        return (out[0] * 0, *([None] * (len(out) - 1)))
    if room.varlen and x.device.type != "cpu" and uses_kernels(module):
        boundaries = {"cu_seqlens": plan.cu_seqlens, "seq_idx": plan.seq_idx}
        handed = {key: boundaries[what] for key, what in room.varlen.items()}
        out = own(x.reshape(1, B * S, *x.shape[2:]), **_take(rest, plan, None), **handed)
        first, others = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
        first = first.reshape(B, S, *first.shape[2:])
        return (first, *(None for _ in others)) if others is not None else first
    if room.one_pass is not None:  # the whole rows at once, where the room can (torch path)
        out = room.one_pass(module, own, x, plan, rest)
        if out is not None:
            return out
    outs = [own(plan.split(x, g), **_take(rest, plan, g)) for g in range(len(plan.groups))]
    if not isinstance(outs[0], tuple):
        return plan.merge(outs)
    if room.all_outputs:  # q, k, v: every output is per token
        return tuple(plan.merge([o[i] for o in outs]) for i in range(len(outs[0])))
    return (plan.merge([o[0] for o in outs]), *([None] * (len(outs[0]) - 1)))


def _drop_cache(bound: dict[str, Any], cache_name: str | None, room: Room) -> None:
    """The call's keywords without a cache (packed or tree rows leave it alone)."""
    if cache_name:
        bound[cache_name] = None
    if room.keeps_cache:
        bound["use_cache"] = False


class TreeRefused(ValueError):
    """A mixer cannot run the prefix-tree rows it was given (a custom mask, a class without a
    one-pass form, a call keyword the one pass leaves out): the RL trainers fall back to TRL's
    padded path on it."""


def _tree_forward(module, own, room: Room, call: _Call, mask, x: Tensor, bound: dict) -> Any:
    """The mixer over tree rows (``mask``: a tree ``flexpack_mask``): the room's one pass with a
    :class:`~flexpack.mixers._tree.TreePlan`, the state at the end of each shared segment
    seeding every branch below it."""
    name = type(module).__name__
    ends = getattr(mask, "_tree_ends", None)
    if getattr(mask, "kind", None) != "tree" or ends is None:
        raise TreeRefused(
            f"{name} keeps a recurrent / convolutional state along the row, which cannot follow "
            f"a flexpack_mask of kind {getattr(mask, 'kind', type(mask).__name__)!r} (only a "
            "prefix tree's, flexpack.pack_trees); run this model on document rows (doc_ids / "
            "position_ids)."
        )
    if tuple(mask.doc_ids.shape) != tuple(x.shape[:2]):
        raise TreeRefused(
            f"{name} got rows of shape {tuple(x.shape[:2])} but the tree flexpack_mask "
            f"describes {tuple(mask.doc_ids.shape)}; pass the mask of these rows."
        )
    rest = {k: v for k, v in bound.items() if k not in _BOUNDARY_KEYS}
    if "attention_mask" in rest:
        rest["attention_mask"] = None  # padding is left out of the segments
    out = None
    if room.one_pass is not None:
        out = room.one_pass(module, own, x, call.tree_plan_for(mask), rest)
    if out is None:
        raise TreeRefused(
            f"{name} ({room.name}) has no one-pass form here (its structure, its dtype or a "
            "keyword of the call), so its state cannot branch along a prefix tree; run this "
            "model on document rows (doc_ids / position_ids), e.g. TRL's own trainers' path."
        )
    return out


def _take(kwargs: dict[str, Any], plan: DocumentPlan, group: int | None) -> dict[str, Any]:
    """The per-token tensors among ``kwargs`` ((B or 1, S, ...): positions, rotary tables) cut
    as the documents are (group ``None``: flattened to one row)."""

    def cut(v: Any) -> Any:
        if isinstance(v, tuple):
            return tuple(cut(t) for t in v)
        if isinstance(v, Tensor) and v.dim() >= 2 and v.shape[1] == plan.S and v.shape[0] in (
            1, plan.B,
        ):  # fmt: skip
            full = v.expand(plan.B, *v.shape[1:])
            if group is None:
                return full.reshape(1, plan.B * plan.S, *v.shape[2:])
            return plan.split(full, group)
        return v

    return {k: cut(v) for k, v in kwargs.items()}
