"""Is this model exact on packed rows? Run it and see: a packed row against each document alone.

flexpack keeps every transformers family it knows exact on packed rows or refuses it by name
(docs/supported_models.md); :func:`check` asks the model itself, the object it is handed: its
own modules, the forwards patched on its instances or classes, its hooks, in the mode it is in
(training or eval). It packs a few documents into one row, runs the row through flexpack
(``attn_implementation=register()``, mixers adapted by ``packed_forward_kwargs(batch,
model=...)``) and each document alone under ``eager``, in float64 on CPU, and compares the
output of every module, document by document. A module that mixes tokens across documents,
even one flexpack has never seen, is named: the first module (in the order calls finish) whose
packed output differs from its output on the document alone.

The probe borrows the model: for the few calls it runs, the parameters and buffers of the
modules it runs are float64 copies on CPU, dropout is 0 (training mode stays on: a module that
mixes tokens only while training is seen), flexpack's attention is set; then every parameter,
buffer, attribute, hook, config field and flexpack registry entry it touched is put back. A
model above ``FULL_LIMIT`` parameters runs its first layers only (up to one of each kind and
every layer that carries code of its own) and the rows of its embeddings the probe's tokens
use; a model on the meta device (no weights to run) is probed on a tiny model of its class,
and refused with a RuntimeError when it carries anything such a model would not have.

The documents' lengths come from the config so that every length-dependent rule is crossed:
a 1-token document, one longer than the sliding window, attention chunk, scan chunk (64, or
the config's) and, for scaled RoPE, ``max_position_embeddings`` and
``original_max_position_embeddings``, up to ``LONGEST`` tokens (rules above it are listed in
``CheckReport.not_crossed``).

Shapes: the probe's row is (1, S) tokens, S = sum(lengths) + 6 (the 6 are padding); a module's
output is compared on the axis of size S in the row and L (the document's length) alone, e.g.
hidden states (1, S, H) against (1, L, H), or (S, H) for the flattened tokens of an MoE layer.
:func:`check`'s docstring runs a tiny Llama; on a model of your own::

    print(flexpack.check(model))
    # LlamaForCausalLM: exact on packed rows (5 documents, 100 tokens, max |diff| 4.7e-07 ...)

A verdict is kept per model object (a ``WeakKeyDictionary``) and dropped as soon as the object
changes in a way a user can change it: a parameter or buffer replaced, re-assigned or written,
a forward or hook added or removed on any module, a class's forward patched, train / eval mode,
the config (``flexpack.clear_caches()`` forgets them all). :func:`verified` reads the table
shipped with flexpack (``flexpack/assets/verified_models.json``, written by
:func:`write_verified` from the model zoo): it documents which classes were verified on which
transformers release (``CheckReport.verified``); it never stands in for running the model.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import re
import time
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from flexpack._version import __version__

__all__ = ["FULL_LIMIT", "LONGEST", "CheckReport", "check", "verified", "write_verified"]

# Models with at most this many floating-point parameters run every layer in the probe (float64
# copies of their weights: 8 bytes a parameter); larger ones their first layers only.
FULL_LIMIT = 20_000_000
LONGEST = 513  # the longest probe document: rules up to 512 tokens (windows, chunks) are crossed
SCAN_CHUNK = 64  # chunked scans whose chunk is no config field (the gated delta rule's 64)
SHORT = (11, 14, 1, 9)  # beside the long document: a 1-token one, and lengths under every rule
PADDING = 6  # padding at the end of the probe's row: padding must stay out of the documents
VERDICTS = ("exact", "refused")
PROBES = ("auto", "model", "layers", "tiny")
_TABLE = Path(__file__).resolve().parent / "assets" / "verified_models.json"
# config fields of length-dependent rules: a document longer than each is in the probe
_RULES = ("sliding_window", "attention_chunk_size", "attention_window_size", "chunk_size",
          "mamba_chunk_size")  # fmt: skip
# config fields and attributes that make a training forward random (set to 0 while probing)
_RANDOM = re.compile(r"dropout|pdrop|drop_prob|drop_rate|layerdrop|jitter")


@dataclass(frozen=True)
class CheckReport:
    """:func:`check`'s verdict on a model that is exact on packed rows.

    Attributes:
        model: the model's class name ("LlamaForCausalLM").
        transformers: the installed transformers version.
        flexpack: the installed flexpack version.
        probe: what ran: "model" (the model itself, every layer), "layers" (the model itself,
            its first ``layers`` layers: the others repeat their kinds) or "tiny" (a model of the
            same class built from a shrunk copy of its config: the model's weights are on the
            meta device).
        max_abs_diff: the largest |packed - alone| of the model's output (the logits) over the
            documents.
        documents: documents in the probe's packed row.
        tokens: their tokens, padding left out.
        seconds: wall time of this call.
        cached: the verdict of an earlier call on this same, unchanged object; nothing run.
        lengths: the documents' lengths.
        training: whether the probe ran in training mode (the model's mode).
        layers: the decoder layers that ran ("layers": a prefix of the model's; else all of
            the probed model's).
        not_crossed: the length-dependent rules of the config longer than ``LONGEST`` tokens,
            which no probe document crosses ("sliding_window=4096"); pass ``lengths=`` to
            cross them.
        verified: flexpack's verified table's verdict for the class on this transformers
            release ("exact", "refused" or None): what the model zoo verified, for the record.
        flattened: the verdict on the path transformers' own padding-free training takes,
            run on the model as it is (its attention implementation, its mixers adapted or
            not): the documents concatenated into one row with restarting ``position_ids``
            and nothing else, as ``DataCollatorWithFlattening`` and TRL's ``packing=True``
            hand them. "exact", or a sentence that starts "not exact" and names the module
            and the fix, or one that starts "not run" (e.g. a kernel the CPU lacks).
    """

    model: str
    transformers: str
    flexpack: str
    probe: str
    max_abs_diff: float
    documents: int
    tokens: int
    seconds: float
    cached: bool
    lengths: tuple[int, ...] = ()
    training: bool = False
    layers: int | None = None
    not_crossed: tuple[str, ...] = ()
    verified: str | None = None
    flattened: str = "exact"

    def __str__(self) -> str:
        versions = f"transformers {self.transformers}, flexpack {self.flexpack}"
        what = {
            "model": "the model itself",
            "layers": f"the model itself, its first {self.layers} layers",
            "tiny": "a tiny model of its class (its weights are on the meta device)",
        }[self.probe]
        mode = "training" if self.training else "eval"
        missed = f"; not crossed: {', '.join(self.not_crossed)}" if self.not_crossed else ""
        cached = ", cached" if self.cached else ""
        return (
            f"{self.model}: exact on packed rows ({self.documents} documents, {self.tokens} "
            f"tokens, max |diff| {self.max_abs_diff:.1e} against each document alone, run on "
            f"{what} in float64, {mode} mode{missed}; {versions}; {self.seconds:.2f} s{cached})"
            f". Flattened rows (position_ids only: DataCollatorWithFlattening, TRL's "
            f"packing=True), as the model is: {self.flattened}"
        )


class _Verdict:
    """A verdict and the state of the object it was reached on."""

    def __init__(self, setting: tuple, state: _State, result: CheckReport | str) -> None:
        self.setting, self.state, self.result = setting, state, result


# model -> its last _Verdict (a CheckReport, or the ValueError message of a model not exact)
_verdicts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _forget() -> None:
    _verdicts.clear()
    _load.cache_clear()


def check(
    model: torch.nn.Module,
    *,
    atol: float = 1e-8,
    rtol: float = 1e-5,
    probe: str = "auto",
    force: bool = False,
    lengths: Sequence[int] | None = None,
) -> CheckReport:
    """Whether ``model`` gives each document of a packed row what it gets alone; else which
    module does not.

    Packs documents of ``lengths`` (by default chosen from the config: see the module's
    docstring) into one row of S = sum(lengths) + 6 tokens (the rest is padding), runs the row
    through flexpack (``attn_implementation=register()`` and ``packed_forward_kwargs(batch,
    model=...)``, which adapts recurrent and conv mixers) and each document alone under
    ``eager``, on ``model`` itself (its parameters borrowed as float64 copies on CPU, in the
    mode it is in, dropout 0), with a forward hook on every module. Every module output that
    has the row's tokens on one axis ((1, S, H) in the row, (1, L, H) alone, or flattened
    (S, H)) is compared document by document; outputs of another layout (an adapted mixer's
    per-document calls inside it, router statistics) are left out. ``model`` is left as it
    was: every state the probe touched is put back.

    Args:
        model: a transformers model (``...ForCausalLM``, a backbone, an image-text model run on
            text), or a PEFT / DDP wrapper of one; any attention implementation, any device.
        atol, rtol: a module output differs when max |packed - alone| > atol + rtol * max |alone|
            on a document's tokens. The probe runs in float64, but transformers computes norms
            and rotary tables in float32 inside: rounding differences of ~1e-7 relative pass
            (rtol), a token mixer that runs across documents (differences of the size of the
            output) does not.
        probe: "model" (every layer), "layers" (the first layers: one of each kind and every
            layer with code of its own; the embeddings' rows the probe uses), "tiny" (a model of
            the class from :func:`flexpack.integrations._tiny.tiny_config`, for weights on the
            meta device) or "auto": "tiny" on the meta device, else "model" up to
            ``FULL_LIMIT`` (2e7) floating-point parameters, else "layers".
        force: run the probe even if this object's verdict is kept.
        lengths: the documents' lengths, at least 2; default from the config.

    Returns:
        A :class:`CheckReport`; ``str(report)`` reads as a sentence.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module`` with a transformers ``config``.
        ValueError: the model is not exact on packed rows: flexpack refuses one of its token
            mixers (or its length-dependent RoPE) by name (the refusal's own message), or a
            module's packed output differs from its output on a document alone by more than the
            tolerance (the message names the first such module's path and class, the document
            and the difference); also for bad ``atol`` / ``rtol`` / ``probe`` / ``lengths``.
            Kept as the object's verdict: the next call on it, unchanged, raises it again.
        RuntimeError: the model cannot be run in float64 (quantized weights), or its weights
            are on the meta device and it has code or modules a model built from its config
            would not have.

    Example:
        >>> import torch, flexpack
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> model = LlamaForCausalLM(config)
        >>> report = flexpack.check(model)
        >>> report.probe, report.lengths, report.max_abs_diff < 1e-5
        ('model', (11, 65, 14, 1, 9), True)
        >>> class RunningSum(torch.nn.Module):  # a token mixer flexpack has never seen
        ...     def forward(self, x):
        ...         return x.cumsum(dim=1)  # (B, S, H): runs across document boundaries
        >>> model.model.layers[1].mlp = RunningSum()
        >>> flexpack.check(model)
        Traceback (most recent call last):
        ...
        ValueError: flexpack.check: ... is `model.layers.1.mlp` (RunningSum): by ...
    """
    start = time.perf_counter()
    inner = _unwrap(model)
    _check_arguments(atol, rtol, probe, lengths)
    import transformers

    versions = (transformers.__version__, __version__)
    kind = _probe_kind(inner, probe)
    setting = (kind, atol, rtol, None if lengths is None else tuple(lengths))
    known = _verdicts.get(inner)
    if not force and known is not None and known.setting == setting and known.state.matches(inner):
        if isinstance(known.result, str):
            raise ValueError(known.result)
        return dataclasses.replace(known.result, seconds=time.perf_counter() - start, cached=True)
    threads = torch.get_num_threads()
    if kind != "layers":
        torch.set_num_threads(1)  # tiny ops: threads only wait for each other on a busy CPU
    try:
        found = _probe(inner, kind, (atol, rtol), lengths)
    except _NotExact as e:
        _verdicts[inner] = _Verdict(setting, _State(inner), str(e))
        raise ValueError(str(e)) from None
    finally:
        torch.set_num_threads(threads)
    report = CheckReport(
        type(inner).__name__, *versions, kind, found.diff, found.documents, found.tokens,
        time.perf_counter() - start, False, found.lengths, inner.training, found.layers,
        found.not_crossed, verified(type(inner).__name__, versions[0]), found.flattened,
    )  # fmt: skip
    _verdicts[inner] = _Verdict(setting, _State(inner), report)
    return report


class _NotExact(Exception):
    """The probe's verdict: not exact (a refusal or a module that mixes documents)."""


def _unwrap(model: Any) -> torch.nn.Module:
    inner = getattr(model, "module", model)  # DDP / FSDP1 wrappers
    base = getattr(inner, "get_base_model", None)  # PEFT
    inner = base() if callable(base) else inner
    module = isinstance(inner, torch.nn.Module)
    if not module or not hasattr(getattr(inner, "config", None), "to_dict"):
        got = f"a {type(model).__name__} without a transformers config" if module else (
            type(model).__name__
        )  # fmt: skip
        raise TypeError(
            f"flexpack.check takes a transformers model (a torch.nn.Module with a config, e.g. "
            f"AutoModelForCausalLM.from_pretrained(...)), got {got}. For a model of your own, "
            "run its packed rows against each document alone as docs/own_model.md shows."
        )
    return inner


def _check_arguments(atol: float, rtol: float, probe: str, lengths: Sequence[int] | None) -> None:
    for name, tol in (("atol", atol), ("rtol", rtol)):
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
            raise ValueError(f"{name} must be a number >= 0, got {tol!r}.")
    if probe not in PROBES:
        raise ValueError(f"probe must be one of {PROBES}, got {probe!r}.")
    if lengths is not None and (
        isinstance(lengths, (str, bytes))
        or len(lengths) < 2
        or not all(isinstance(n, int) and n >= 1 for n in lengths)
    ):
        raise ValueError(
            f"lengths must be at least 2 document lengths >= 1 (a packed row), got {lengths!r}."
        )


def _probe_kind(model: torch.nn.Module, probe: str) -> str:
    params = list(model.parameters())
    meta = any(p.device.type == "meta" for p in params)
    if meta and probe in ("model", "layers"):
        raise RuntimeError(
            f"flexpack.check cannot run {type(model).__name__} with probe={probe!r}: its "
            "weights are on the meta device. Load them, or pass probe='tiny'."
        )
    if meta or probe == "tiny":
        return "tiny"
    quantized = sorted({str(p.dtype) for p in params if not p.is_floating_point()})
    if quantized:
        raise RuntimeError(
            f"flexpack.check runs the model in float64 and cannot cast its {quantized} "
            "(quantized) weights. Check the same model unquantized (from_pretrained without "
            "quantization_config), or built on the meta device (a tiny model of its class runs)."
        )
    if probe != "auto":
        return probe
    return "model" if sum(p.numel() for p in params) <= FULL_LIMIT else "layers"


# ----------------------------------------------------------------------------- the object's state


def _version(t: Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter
        return -1


def _hooks() -> tuple:
    from torch.nn.modules import module

    names = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
             "_global_backward_pre_hooks")  # fmt: skip
    return tuple(tuple(getattr(module, n, {})) for n in names)


class _State:
    """What a user can change on a model, cheaply read: per module its class, its instance and
    class forwards, its hooks' keys, its mode, and each parameter and buffer (the object, its
    version counter, where its data lives); the config's fields and torch's global hooks.
    Objects are held by weak reference (an id can be reused once its object is gone)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.plain, self.objects = self._read(model)
        self.refs = [None if o is None else weakref.ref(o) for o in self.objects]

    @staticmethod
    def _read(model: torch.nn.Module) -> tuple[tuple, list]:
        plain: list[Any] = [_config_hash(model.config), _hooks()]
        objects: list[Any] = []
        for m in model.modules():
            d = m.__dict__
            plain.append((
                type(m), m.training,
                *(tuple(d.get(n) or ()) for n in ("_forward_hooks", "_forward_pre_hooks",
                                                   "_backward_hooks", "_backward_pre_hooks")),
                tuple(d.get("_parameters", {})), tuple(d.get("_buffers", {})),
                tuple(d.get("_modules", {})),
            ))  # fmt: skip
            objects += [m, d.get("forward"), getattr(type(m), "forward", None)]
            for t in (*d.get("_parameters", {}).values(), *d.get("_buffers", {}).values()):
                objects.append(t)
                if t is not None:
                    plain.append((_version(t), t.data_ptr() if t.device.type != "meta" else 0,
                                  t.dtype, t.device, tuple(t.shape)))  # fmt: skip
        return tuple(plain), objects

    def matches(self, model: torch.nn.Module) -> bool:
        plain, objects = self._read(model)
        return (
            plain == self.plain
            and len(objects) == len(self.refs)
            and all((r is None and o is None) or (r is not None and r() is o)
                    for r, o in zip(self.refs, objects, strict=True))
        )  # fmt: skip


def _config_hash(config: Any) -> str:
    """A hash of the config's fields, names and dtypes left out."""
    fields = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k not in (
        "transformers_version", "architectures", "dtype", "torch_dtype",
    )}  # fmt: skip
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _own_code(m: torch.nn.Module) -> bool:
    """Whether ``m`` carries code of its own instance: a forward set on it, or a hook (flexpack's
    own adaptation left out)."""
    from flexpack import mixers

    forward = m.__dict__.get("forward")
    if forward is not None and not mixers.is_adapted(m):
        return True
    for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
        for hook in (m.__dict__.get(name) or {}).values():
            if not getattr(hook, "__module__", "").startswith("flexpack"):
                return True
    return False


# ----------------------------------------------------------------------------- the probe


@dataclass(frozen=True)
class _Found:
    diff: float
    documents: int
    tokens: int
    lengths: tuple[int, ...]
    layers: int | None
    not_crossed: tuple[str, ...]
    flattened: str


def _probe(
    model: torch.nn.Module, kind: str, tol: tuple[float, float], lengths: Sequence[int] | None
) -> _Found:
    """Run the probe on ``model`` (kind "model" / "layers") or a tiny model of its class
    ("tiny"); raises _NotExact."""
    target = _tiny_twin(model) if kind == "tiny" else model
    config = target.config.get_text_config()
    if lengths is None:
        lengths, not_crossed = _lengths(config)
    else:
        lengths, not_crossed = tuple(lengths), ()
    documents = _documents(config, lengths)
    rows = 1 + max(int(d.max()) for d in documents)  # the embeddings' rows the probe reads
    with _Borrowed(target) as borrowed:
        layers = borrowed.first_layers() if kind == "layers" else None
        borrowed.to_float64(rows if kind == "layers" else None)
        borrowed.deterministic()
        # first, as the model is: flexpack's run below sets its attention and adapts it
        flattened = _run_flattened(target, type(model).__name__, kind, tol, documents)
        diff, spans = _run(target, type(model).__name__, kind, tol, documents)
    if layers is None:
        layers = _layer_count(target)
    tokens = sum(b - a for a, b in spans)
    return _Found(diff, len(spans), tokens, lengths, layers, not_crossed, flattened)


def _lengths(config: Any) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The probe's documents: a long one that crosses every length-dependent rule of the config
    up to ``LONGEST`` tokens (after a short one, so that it starts off any chunk grid of the
    row), then ``SHORT`` (under every rule; a 1-token document among them). Returns (lengths,
    the rules not crossed)."""
    d = config.to_dict()
    rules = {"scan chunk": SCAN_CHUNK}
    rules.update({k: d[k] for k in _RULES if _positive(d.get(k))})
    for rope in _rope_parameters(config):
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            for key in ("max_position_embeddings", "original_max_position_embeddings"):
                value = rope.get(key, d.get(key))
                if _positive(value):
                    rules[key] = value
    crossed = [v for v in rules.values() if v + 1 <= LONGEST]
    missed = tuple(f"{k}={v}" for k, v in rules.items() if v + 1 > LONGEST)
    return (SHORT[0], max(crossed) + 1, *SHORT[1:]), missed


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _rope_parameters(config: Any) -> list[dict]:
    """The config's RoPE parameter dicts: one, or one per layer type (Gemma 3)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict):
        return []
    if any(isinstance(v, dict) for v in rope.values()):
        return [v for v in rope.values() if isinstance(v, dict)]
    return [rope]


def _decoder_layers(model: torch.nn.Module) -> tuple[torch.nn.Module, str] | None:
    """(parent, name) of the text model's decoder-layer ModuleList (as long as the text
    config's num_hidden_layers), or None."""
    n = getattr(model.config.get_text_config(), "num_hidden_layers", None)
    found = [
        (model.get_submodule(path.rpartition(".")[0]), path.rpartition(".")[2], path)
        for path, m in model.named_modules()
        if isinstance(m, torch.nn.ModuleList) and len(m) == n and path
    ]
    found = [f for f in found if not re.search(r"vision|visual|audio|encoder", f[2])]
    return (found[0][0], found[0][1]) if found else None


def _layer_count(model: torch.nn.Module) -> int | None:
    at = _decoder_layers(model)
    return None if at is None else len(at[0]._modules[at[1]])


class _Borrowed:
    """The model, borrowed for the probe: what the probe changes and puts back on exit (every
    module's attributes, parameters' data, buffers, hooks, child modules; every config's fields;
    flexpack's registries about the model; torch's random state)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __enter__(self) -> _Borrowed:
        from flexpack import mixers
        from flexpack.integrations import _mixers_check
        from flexpack.integrations import transformers as hf

        model = self.model
        self.modules = [(m, _shallow(m.__dict__)) for m in model.modules()]
        self.configs = [(c, _shallow(c.__dict__)) for c in _configs(model)]
        self.data: list[tuple[Tensor, Tensor]] = []  # (parameter, its own data)
        self.was_adapted = mixers._adapted(model) is not None or any(
            mixers.is_adapted(m) for m in model.modules()
        )
        registries = (_mixers_check._checked, _mixers_check._attention, hf._aux_warned)
        self.registries = [(r, model in r) for r in registries]
        self.seen_configs = set(mixers._seen_configs)
        self.probing = _mixers_check._probing
        _mixers_check._probing = True  # its attention's check runs no probe of its own
        self.rng = torch.random.fork_rng(devices=[])
        self.rng.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        from flexpack import mixers
        from flexpack.integrations import _mixers_check

        try:
            if not self.was_adapted:
                mixers.restore(self.model)
        finally:
            for p, data in self.data:
                p.data = data
            for c, saved in self.configs:
                _put_back(c.__dict__, saved)
            for m, saved in self.modules:
                _put_back(m.__dict__, saved)
            for registry, had in self.registries:
                if not had and self.model in registry:
                    if isinstance(registry, weakref.WeakSet):
                        registry.discard(self.model)
                    else:
                        del registry[self.model]
            seen = mixers._seen_configs
            for key in set(seen) - self.seen_configs:
                seen.pop(key, None)
            _mixers_check._probing = self.probing
            self.rng.__exit__(None, None, None)

    def first_layers(self) -> int | None:
        """Leave out the decoder layers after the first ones that hold one layer of each kind
        (its ``layer_types`` entry, per-layer config fields, its modules' classes) and every
        layer with code of its own; returns how many run. A prefix: index i stays layer i."""
        at = self._layers()
        if at is None:
            return None
        parent, name, layers = at
        config = self.model.config.get_text_config()
        d = config.to_dict()
        per_layer = [k for k, v in d.items() if isinstance(v, list) and len(v) == len(layers)]
        seen, last = set(), 0
        for i, layer in enumerate(layers):
            kind = (tuple(d[k][i] for k in per_layer),
                    tuple(type(m).__qualname__ for m in layer.modules()))  # fmt: skip
            if kind not in seen or any(_own_code(m) for m in layer.modules()):
                seen.add(kind)
                last = i
        parent._modules[name] = torch.nn.ModuleList(list(layers)[: last + 1])
        return last + 1

    def _layers(self) -> tuple[torch.nn.Module, str, torch.nn.ModuleList] | None:
        at = _decoder_layers(self.model)
        return None if at is None else (*at, at[0]._modules[at[1]])

    def to_float64(self, rows: int | None) -> None:
        """Float64 copies on CPU of the parameters and buffers of the modules that run (and
        CPU copies of tensors kept as plain attributes); with ``rows``, only that many rows of
        the input and output embeddings."""
        vocab: set[int] = set()
        if rows is not None:
            for get in ("get_input_embeddings", "get_output_embeddings"):
                try:
                    embedding = getattr(self.model, get)()
                except (AttributeError, NotImplementedError):
                    continue
                if embedding is not None:
                    vocab.update(id(p) for p in embedding.parameters(recurse=False))
        done: set[int] = set()
        for m in self.model.modules():
            for p in m._parameters.values():
                if p is None or id(p) in done:
                    continue
                done.add(id(p))
                self.data.append((p, p.data))
                data = p.data[:rows] if id(p) in vocab and p.shape[0] > rows else p.data
                p.data = _cpu64(data)
            for name, b in list(m._buffers.items()):
                if b is not None:
                    m._buffers[name] = _cpu64(b)
            for name, value in list(m.__dict__.items()):
                if isinstance(value, Tensor) and value.device.type != "cpu":
                    m.__dict__[name] = value.cpu()

    def deterministic(self) -> None:
        """Training mode stays on; what makes a training forward random is set to 0 (dropout
        rates on modules and configs, LayerDrop, router jitter), and every run starts from the
        same seed."""
        for m in self.model.modules():
            if isinstance(m, torch.nn.modules.dropout._DropoutNd):
                m.p = 0.0
            for name, value in list(m.__dict__.items()):
                if _random_rate(name, value):
                    m.__dict__[name] = 0.0
        for c, _ in self.configs:
            for name, value in list(c.__dict__.items()):
                if _random_rate(name, value):
                    c.__dict__[name] = 0.0


def _random_rate(name: str, value: Any) -> bool:
    return isinstance(value, float) and value != 0.0 and _RANDOM.search(name.lower()) is not None


def _cpu64(t: Tensor) -> Tensor:
    t = t.detach()
    if t.is_complex():
        return t.to("cpu", torch.complex128, copy=True)
    if t.is_floating_point():
        return t.to("cpu", torch.float64, copy=True)
    return t.to("cpu", copy=True)


def _shallow(d: dict) -> dict:
    """A copy of an object's ``__dict__`` and of the dicts in it (parameters, buffers, child
    modules, hooks, rope parameters): what :func:`_put_back` restores."""
    return {k: (v, dict(v) if isinstance(v, dict) else None) for k, v in d.items()}


def _put_back(d: dict, saved: dict) -> None:
    for key in [k for k in d if k not in saved]:
        del d[key]
    for key, (value, inner) in saved.items():
        d[key] = value
        if inner is not None:
            value.clear()
            value.update(inner)


def _configs(model: torch.nn.Module) -> list[Any]:
    """Every transformers config the model's modules hold, and their sub-configs."""
    found: dict[int, Any] = {}
    todo = [m.__dict__.get("config") for m in model.modules()]
    while todo:
        c = todo.pop()
        if c is None or not hasattr(c, "to_dict") or id(c) in found:
            continue
        found[id(c)] = c
        todo += [
            v for v in c.__dict__.values() if hasattr(v, "to_dict") and hasattr(v, "model_type")
        ]
    return list(found.values())


def _tiny_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 model of ``model``'s class from a tiny copy of its config, in its mode (random
    weights, its own seed; the caller's random state is left as it was). Raises RuntimeError
    when ``model`` carries code the twin would not run: a forward or hook set on a module, a
    module class the twin does not have."""
    from flexpack.integrations._tiny import tiny_config

    cls = type(model)
    own = [p or "the model" for p, m in model.named_modules() if _own_code(m)]
    try:
        config = tiny_config(model.config, "eager")
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            build = getattr(cls, "_from_config", None)
            twin = build(config) if callable(build) else cls(config)
    except Exception as e:
        raise RuntimeError(
            f"flexpack.check could not build a tiny {cls.__name__} from its config "
            f"({type(e).__name__}: {e}); load the model's weights (not on the meta device) so "
            "that the model itself runs."
        ) from e
    lost = sorted(
        {type(m).__name__ for m in model.modules()} - {type(m).__name__ for m in twin.modules()}
    )
    if own or lost:
        what = ([f"code of its own on {own[:3]}"] if own else []) + (
            [f"modules a model built from its config has not: {lost}"] if lost else []
        )  # fmt: skip
        raise RuntimeError(
            f"flexpack.check cannot run {cls.__name__} (its weights are on the meta device) and "
            f"a tiny model of its class would not run what it has: {'; '.join(what)}. Load its "
            "weights (or build it on the CPU) and check it again: the model itself then runs."
        )
    return twin.to(device="cpu", dtype=torch.float64).train(model.training)


def _set_attention(model: torch.nn.Module, name: str) -> None:
    experts = getattr(model, "set_experts_implementation", None)
    if callable(experts) and getattr(model.config, "_experts_implementation", None) not in (
        None, "eager",
    ):  # fmt: skip
        experts("eager")  # grouped_mm has no float64 kernel; experts are per token either way
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(name)
    else:
        model.config._attn_implementation = name


def _run(
    model: torch.nn.Module,
    name: str,
    kind: str,
    tol: tuple[float, float],
    documents: list[Tensor],
) -> tuple[float, list[tuple[int, int]]]:
    """The packed row through flexpack, each document alone under eager, on the borrowed model:
    (max |diff| of the output, the documents' spans); raises _NotExact."""
    from flexpack.batch import pack_sequences
    from flexpack.integrations.transformers import packed_forward_kwargs, register

    failed = None
    lengths = [len(d) for d in documents]
    batch = pack_sequences(documents, sum(lengths) + PADDING)
    spans = _spans(batch.doc_ids[0].tolist())
    with torch.no_grad(), torch.autocast("cpu", enabled=False), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "its attention is not flexpack's": the verdict says
        try:
            _set_attention(model, register())
        except Exception as e:  # the probe then runs the other attention: its leak is named
            failed = f"{type(e).__name__}: {e}"
        row = _Recorder(model)
        try:  # refused by name (before the row or in an attention call): a verdict too
            torch.manual_seed(0)
            model(**packed_forward_kwargs(batch, model=model))
        except ValueError as e:
            raise _NotExact(str(e)) from None
        finally:
            row.remove()
        _set_attention(model, "eager")
        alone = [_recorded(model, input_ids=batch.input_ids[:, a:b], use_cache=False)
                 for a, b in spans]  # fmt: skip
    S = batch.input_ids.shape[1]
    return _compare(name, kind, row, alone, spans, S, tol, failed), spans


def _run_flattened(
    model: torch.nn.Module,
    name: str,
    kind: str,
    tol: tuple[float, float],
    documents: list[Tensor],
) -> str:
    """The documents as transformers' padding-free collators hand them (one row, restarting
    ``position_ids``, no ``attention_mask``, no ``doc_ids``) through the model as it is,
    against each document alone through the same model: the verdict for
    :attr:`CheckReport.flattened`."""
    row_ids = torch.cat(documents)[None]
    positions = torch.cat([torch.arange(len(d)) for d in documents])[None]
    ends = list(itertools.accumulate(len(d) for d in documents))
    spans = list(zip([0, *ends[:-1]], ends, strict=True))
    with torch.no_grad(), torch.autocast("cpu", enabled=False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            row = _recorded(model, input_ids=row_ids, position_ids=positions, use_cache=False)
            alone = [_recorded(model, input_ids=row_ids[:, a:b], use_cache=False)
                     for a, b in spans]  # fmt: skip
        except Exception as e:  # a kernel the CPU lacks (flash-attn), a refusal by name
            first = str(e).split(". ")[0]
            return f"not run here ({type(e).__name__}: {first})"
    try:
        _compare(name, kind, row, alone, spans, ends[-1], tol, None)
    except _NotExact as e:
        return "not exact: " + _flattened_fix(model) + " " + str(e).split(": ", 1)[1]
    except RuntimeError as e:
        return f"not run here ({e})"
    return "exact"


def _flattened_fix(model: torch.nn.Module) -> str:
    """What makes the flattened path exact on ``model``."""
    from flexpack import mixers
    from flexpack.integrations._mixers_check import has_attention
    from flexpack.integrations.transformers import register

    fixes = []
    if has_attention(model) and getattr(model.config, "_attn_implementation", None) != register():
        fixes.append("load it with attn_implementation=flexpack.integrations.transformers."
                     "register() (or set_attn_implementation)")  # fmt: skip
    if any(not mixers.is_adapted(model.get_submodule(p)) for p, _ in mixers.mixers_of(model)):
        fixes.append("call flexpack.mixers.adapt(model) before training (nothing of flexpack's "
                     "runs in this path to adapt its recurrent / conv layers)")  # fmt: skip
    if not fixes:
        return "(flexpack's own kwargs, packed_forward_kwargs(batch, model=model), are exact)."
    return "to fix it, " + " and ".join(fixes) + "."


def _layers_note(kind: str) -> str:
    return {
        "model": "the model itself (float64 copies of its weights)",
        "layers": "the model itself, its first layers (float64 copies of their weights)",
        "tiny": "a tiny float64 model of the same class (layer numbers are the tiny model's)",
    }[kind]


def _documents(config: Any, lengths: tuple[int, ...]) -> list[Tensor]:
    """Random token ids below 103, none of the config's special tokens (a model may treat its
    pad or BOS token specially)."""
    vocab = int(getattr(config, "vocab_size", None) or 128)
    special: set[Any] = set()
    for key, value in config.to_dict().items():
        if key.endswith("_token_id"):  # an id, None, or a list of ids (several EOS tokens)
            special.update(value if isinstance(value, (list, tuple)) else [value])
    pool = torch.tensor([i for i in range(3, min(vocab, 103)) if i not in special])
    g = torch.Generator().manual_seed(0)
    return [pool[torch.randint(len(pool), (n,), generator=g)] for n in lengths]


def _spans(doc_ids: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each document of the row, padding (-1) left out."""
    out, start = [], 0
    for i in range(1, len(doc_ids) + 1):
        if i == len(doc_ids) or doc_ids[i] != doc_ids[start]:
            if doc_ids[start] >= 0:
                out.append((start, i))
            start = i
    return out


def _first_tensor(value: Any) -> Tensor | None:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, dict):  # a ModelOutput: logits / last_hidden_state first
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return next((v for v in value if isinstance(v, Tensor)), None)
    return None


class _Recorder:
    """Forward hooks on every module: the first tensor of each call's input and output, and the
    order in which the calls finished (a module finishes after the modules it calls)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.outputs: dict[str, list[Tensor | None]] = {}
        self.inputs: dict[str, list[Tensor | None]] = {}
        self.order: list[tuple[str, int]] = []
        self.classes: dict[str, str] = {}
        self.handles = []
        for path, module in model.named_modules():
            self.classes[path] = type(module).__name__
            hook = functools.partial(self._record, path)
            self.handles.append(module.register_forward_hook(hook, with_kwargs=True))

    def _record(self, path: str, _module, args, kwargs, output) -> None:
        first = _first_tensor(args)
        if first is None:
            first = kwargs.get("hidden_states")
            first = first if isinstance(first, Tensor) else _first_tensor(list(kwargs.values()))
        out = _first_tensor(output)
        calls = self.outputs.setdefault(path, [])
        self.order.append((path, len(calls)))
        # clones: a later in-place op (a residual `+=`) must not change what was seen
        calls.append(None if out is None else out.detach().clone())
        self.inputs.setdefault(path, []).append(None if first is None else first.detach().clone())

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _recorded(model: torch.nn.Module, **kwargs: Any) -> _Recorder:
    """One call of ``model`` (seeded: dropout-free runs stay comparable) under a
    :class:`_Recorder`."""
    calls = _Recorder(model)
    try:
        torch.manual_seed(0)
        model(**kwargs)
    finally:
        calls.remove()
    return calls


def _difference(
    row: Tensor | None, alone: Tensor | None, a: int, L: int, S: int
) -> tuple[float, float] | None:
    """(max |row - alone|, max |alone|) on the document's tokens, or None when the two are not
    the same layout with the row's S tokens on one axis and the document's L on the same axis."""
    if row is None or alone is None or row.dim() != alone.dim():
        return None
    axes = [d for d in range(row.dim()) if row.shape[d] != alone.shape[d]]
    if len(axes) != 1 or row.shape[axes[0]] != S or alone.shape[axes[0]] != L:
        return None
    got = row.narrow(axes[0], a, L)
    wide = torch.complex128 if got.is_complex() or alone.is_complex() else torch.float64
    got, want = got.to(wide), alone.to(wide)
    same = (got == want) | (got.isnan() & want.isnan())  # equal infinities, NaN on both sides
    if not got.numel():
        return 0.0, 0.0
    gap = torch.where(same, torch.zeros((), dtype=torch.float64), (got - want).abs().real)
    scale = want.abs().real.nan_to_num(posinf=0.0, neginf=0.0).max()
    return float(gap.max()), float(scale)


def _beyond(found: tuple[float, float] | None, tol: tuple[float, float]) -> bool:
    return found is not None and found[0] > tol[0] + tol[1] * found[1]


def _compare(
    name: str,
    kind: str,
    row: _Recorder,
    alone: list[_Recorder],
    spans: list[tuple[int, int]],
    S: int,
    tol: tuple[float, float],
    failed: str | None,
) -> float:
    """The output's max |diff| over the documents; raises _NotExact naming the first module
    (in the order calls finished in the row) whose output differs on some document."""
    compared = 0
    for path, k in row.order:
        worst = None  # ((diff, scale), document)
        for i, ((a, b), doc) in enumerate(zip(spans, alone, strict=True)):
            if len(doc.outputs.get(path, ())) != len(row.outputs[path]):
                continue  # called another number of times (an adapted mixer's insides)
            found = _difference(row.outputs[path][k], doc.outputs[path][k], a, b - a, S)
            compared += found is not None
            if _beyond(found, tol) and (worst is None or found[0] > worst[0][0]):
                worst = (found, i)
        if worst is not None:
            raise _NotExact(_leak_message(name, kind, row, alone, spans, S, tol, path, k, worst,
                                          failed))  # fmt: skip
    if not compared:
        raise RuntimeError(
            f"flexpack.check found no module output of {name} laid out by token (B, S, ...) to "
            "compare; it checks transformers models whose forward takes input_ids."
        )
    out = [_difference(row.outputs[""][-1], doc.outputs[""][-1], a, b - a, S)
           for (a, b), doc in zip(spans, alone, strict=True)]  # fmt: skip
    return max((d[0] for d in out if d is not None), default=0.0)


def _leak_message(name, kind, row, alone, spans, S, tol, path, k, worst, failed) -> str:
    (diff, scale), i = worst
    a, b = spans[i]
    where = f"`{path}` ({row.classes[path]})" if path else f"the model's own forward ({name})"
    probe = _layers_note(kind)
    message = (
        f"flexpack.check: {name} is not exact on packed rows: the first module whose output "
        f"differs from the document alone is {where}: by {diff:.2e} on document {i + 1} of "
        f"{len(spans)} (tokens {a} to {b - 1} of a {S}-token row; |output| up to {scale:.2e}, "
        f"allowed atol {tol[0]:g} + rtol {tol[1]:g} x that), probed on {probe}."
    )
    row_in = row.inputs[path][k]
    doc_in = alone[i].inputs.get(path, [])
    before = _difference(row_in, doc_in[k] if k < len(doc_in) else None, a, b - a, S)
    parent = path.rpartition(".")[0]
    if _beyond(before, tol):
        owner = f"`{parent}` ({row.classes[parent]})" if parent else f"{name}'s forward"
        message += (
            f" Its input already differs ({before[0]:.2e}): code of {owner} that runs before "
            "it (not a module of its own) mixes tokens across documents."
        )
    else:
        message += " Its input matches: this module mixes tokens across documents."
    if failed is not None:
        message += f" (flexpack's attention could not be set on the probe: {failed}.)"
    return message + (
        " Make it restart at each document (see docs/mixers.md), or train this model unpacked "
        "(one sample per row) with attn_implementation='sdpa'."
    )


# ----------------------------------------------------------------------------- verified table


@functools.cache
def _load(path: str) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}


def verified(
    model_class_name: str, transformers_version: str, *, path: str | Path | None = None
) -> str | None:
    """flexpack's verified verdict for a transformers class on a transformers release.

    Args:
        model_class_name: ``type(model).__name__``, e.g. "LlamaForCausalLM".
        transformers_version: e.g. ``transformers.__version__``.
        path: the table to read; default the one shipped with flexpack
            (``flexpack/assets/verified_models.json``).

    Returns:
        "exact" or "refused"; None when the table has no verdict for the pair, or was written
        for another flexpack version.

    Example:
        >>> from flexpack.check import verified
        >>> verified("NoSuchModelForCausalLM", "5.25.0") is None
        True
    """
    table = _load(str(_TABLE if path is None else path))
    if table.get("flexpack") != __version__:
        return None
    return table.get("models", {}).get(model_class_name, {}).get(transformers_version)


def write_verified(
    path: str | Path, verdicts: dict[str, dict[str, str]], *, merge: bool = True
) -> None:
    """Write a verified table (what :func:`verified` and :func:`check` read).

    The format, sorted for stable diffs::

        {"flexpack": "<version>",
         "models": {"<ModelClassName>": {"<transformers version>": "exact" | "refused"}}}

    Regenerate ``flexpack/assets/verified_models.json`` from the model zoo
    (``tests/test_model_zoo.py``): one entry per model class the zoo ran, on the transformers
    release it ran on. Only verdicts the zoo proved belong here. The table documents them
    (:func:`check` reports the class's entry as ``CheckReport.verified``); it never stands in
    for running a model: a model of a listed class can carry code of its own.

    Args:
        path: the JSON file.
        verdicts: ``{class name: {transformers version: "exact" | "refused"}}``.
        merge: keep the verdicts already in ``path`` for other classes and releases (those of
            the same flexpack version; a table of another version is replaced).

    Raises:
        ValueError: a verdict other than "exact" or "refused", or a malformed ``verdicts``.

    Example:
        >>> import pathlib, tempfile
        >>> from flexpack.check import verified, write_verified
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "verified.json"
        >>> write_verified(path, {"LlamaForCausalLM": {"5.25.0": "exact"}})
        >>> verified("LlamaForCausalLM", "5.25.0", path=path)
        'exact'
    """
    for name, by_version in verdicts.items():
        if not isinstance(name, str) or not isinstance(by_version, dict):
            raise ValueError(
                "verdicts must be {class name: {transformers version: verdict}}, got "
                f"{name!r}: {by_version!r}."
            )
        for version, verdict in by_version.items():
            if verdict not in VERDICTS or not isinstance(version, str):
                raise ValueError(
                    f"{name} on transformers {version!r}: the verdict must be one of "
                    f"{VERDICTS}, got {verdict!r}."
                )
    models: dict[str, dict[str, str]] = {}
    path = Path(path)
    if merge and path.exists():
        old = json.loads(path.read_text())
        if old.get("flexpack") == __version__:
            models = {k: dict(v) for k, v in old.get("models", {}).items()}
    for name, by_version in verdicts.items():
        models.setdefault(name, {}).update(by_version)
    table = {"flexpack": __version__, "models": models}
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    _load.cache_clear()


def _register_clear() -> None:
    from flexpack._tensor_cache import on_clear

    on_clear(_forget)


_register_clear()
