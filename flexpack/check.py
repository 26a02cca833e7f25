"""Is this model exact on packed rows? Run it and see: a packed row against each document alone.

flexpack keeps every transformers family it knows exact on packed rows or refuses it by name
(docs/supported_models.md); :func:`check` asks the model itself. It packs a few documents into
one row, runs the row through flexpack (``attn_implementation=register()``, mixers adapted by
``packed_forward_kwargs(batch, model=...)``) and each document alone under ``eager``, in float64
on CPU, on a probe of the model (a deep copy, or for a large model a tiny model of the same
class built from a shrunk copy of its config), and compares the output of every module,
document by document. A module that mixes tokens across documents, even one flexpack has never
seen, is named: the first module (in the order calls finish) whose packed output differs from
its output on the document alone.

Shapes: the probe's row is (1, S) tokens, S = sum(lengths) + 6 (the 6 are padding); a module's
output is compared on the axis of size S in the row and L (the document's length) alone, e.g.
hidden states (1, S, H) against (1, L, H), or (S, H) for the flattened tokens of an MoE layer.
:func:`check`'s docstring runs a tiny Llama; on a model of your own::

    print(flexpack.check(model))
    # LlamaForCausalLM: exact on packed rows (3 documents, 34 tokens, max |diff| 4.7e-07 ...)

Verdicts are kept per process (a second call on the same kind of model costs nothing;
``flexpack.clear_caches()`` forgets them). :func:`verified` reads the table shipped with
flexpack (``flexpack/assets/verified_models.json``, written by :func:`write_verified`): a
transformers class listed there as exact on the installed transformers release is reported
without running anything unless ``force=True``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["COPY_LIMIT", "CheckReport", "check", "verified", "write_verified"]

# Models with at most this many parameters are probed on a float64 deep copy (two copies: 8
# bytes a parameter each); larger ones, and models whose weights are on the meta device or
# quantized, on a tiny model of the same class (flexpack.integrations._tiny).
COPY_LIMIT = 20_000_000
LENGTHS = (11, 14, 9)  # longer than the tiny twins' windows and chunks (4 tokens)
PADDING = 6  # padding at the end of the probe's row: padding must stay out of the documents
VERDICTS = ("exact", "refused")
_TABLE = Path(__file__).resolve().parent / "assets" / "verified_models.json"


@dataclass(frozen=True)
class CheckReport:
    """:func:`check`'s verdict on a model that is exact on packed rows.

    Attributes:
        model: the model's class name ("LlamaForCausalLM").
        transformers: the installed transformers version.
        flexpack: the installed flexpack version.
        probe: what ran: "copy" (a float64 deep copy of the model), "tiny" (a float64 model of
            the same class built from a shrunk copy of its config) or "table" (nothing: flexpack's
            verified table lists the class as exact on this transformers release).
        max_abs_diff: the largest |packed - alone| of the model's output (the logits) over the
            documents; None for "table".
        documents: documents in the probe's packed row (0 for "table").
        tokens: their tokens, padding left out (0 for "table").
        seconds: wall time of this call.
        cached: the verdict of an earlier call in this process, nothing run again.
    """

    model: str
    transformers: str
    flexpack: str
    probe: str
    max_abs_diff: float | None
    documents: int
    tokens: int
    seconds: float
    cached: bool

    def __str__(self) -> str:
        versions = f"transformers {self.transformers}, flexpack {self.flexpack}"
        if self.probe == "table":
            return (
                f"{self.model}: exact on packed rows (flexpack's verified table for {versions}; "
                "nothing run, force=True runs the probe)"
            )
        what = "a float64 copy" if self.probe == "copy" else "a tiny float64 twin"
        cached = ", cached" if self.cached else ""
        return (
            f"{self.model}: exact on packed rows ({self.documents} documents, {self.tokens} "
            f"tokens, max |diff| {self.max_abs_diff:.1e} against each document alone on {what}; "
            f"{versions}; {self.seconds:.2f} s{cached})"
        )


# key -> CheckReport, or the ValueError message of a model that is not exact
_verdicts: dict[tuple, CheckReport | str] = {}


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
    lengths: Sequence[int] = LENGTHS,
) -> CheckReport:
    """Whether ``model`` gives each document of a packed row what it gets alone; else which
    module does not.

    Packs ``lengths`` random documents into one row of S = sum(lengths) + 6 tokens (the rest is
    padding), runs the row through flexpack (``attn_implementation=register()`` and
    ``packed_forward_kwargs(batch, model=...)``, which adapts recurrent and conv mixers) and each
    document alone under ``eager``, in float64 on CPU, with a forward hook on every module. Every
    module output that has the row's tokens on one axis ((1, S, H) in the row, (1, L, H) alone,
    or flattened (S, H)) is compared document by document; outputs of another layout (an
    adapted mixer's per-document calls inside it, router statistics) are left out. ``model``
    itself is not changed: the probe is a copy.

    Args:
        model: a transformers model (``...ForCausalLM``, a backbone, an image-text model run on
            text), or a PEFT / DDP wrapper of one; any attention implementation.
        atol, rtol: a module output differs when max |packed - alone| > atol + rtol * max |alone|
            on a document's tokens. The probe runs in float64, but transformers computes norms
            and rotary tables in float32 inside: rounding differences of ~1e-7 relative pass
            (rtol), a token mixer that runs across documents (differences of the size of the
            output) does not.
        probe: "copy" (a float64 deep copy: catches anything, costs two copies of the weights),
            "tiny" (a model of the same class from :func:`flexpack.integrations._tiny.tiny_config`:
            one layer of each kind, hidden 64; module classes added to ``model`` after it was
            built are not in it, with a warning) or "auto": "copy" up to ``COPY_LIMIT``
            (2e7) floating-point parameters off the meta device, else "tiny".
        force: run the probe even if an earlier call or flexpack's verified table already has
            the verdict.
        lengths: the documents' lengths, at least 2 (the probe's row).

    Returns:
        A :class:`CheckReport`; ``str(report)`` reads as a sentence.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module`` with a transformers ``config``.
        ValueError: the model is not exact on packed rows: flexpack refuses one of its token
            mixers by name (the refusal's own message), or a module's packed output differs
            from its output on a document alone by more than the tolerance (the message names
            the first such module's path and class, the document and the difference); also for
            bad ``atol`` / ``rtol`` / ``probe`` / ``lengths``. Kept as a verdict: the next call
            raises it again without running.
        RuntimeError: no tiny model of the class could be built from its config (pass
            ``probe="copy"``).

    Example:
        >>> import torch, flexpack
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> model = LlamaForCausalLM(config)
        >>> report = flexpack.check(model, force=True)  # force: run it, not the verified table
        >>> report.probe, report.documents, report.tokens, report.max_abs_diff < 1e-5
        ('copy', 3, 34, True)
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

    import flexpack

    versions = (transformers.__version__, flexpack.__version__)
    cls = type(inner)
    kind = _probe_kind(inner) if probe == "auto" else probe
    classes = tuple(sorted({_qualname(type(m)) for m in inner.modules()}))
    setting = (kind, atol, rtol, tuple(lengths))  # what the verdict was reached with
    key = (_qualname(cls), *versions, classes, _fingerprint(inner.config), setting)
    if not force:
        known = _verdicts.get(key)
        if isinstance(known, str):
            raise ValueError(known)
        if known is not None:
            return dataclasses.replace(known, seconds=time.perf_counter() - start, cached=True)
        if verified(cls.__name__, versions[0]) == "exact" and _from_transformers(inner):
            return CheckReport(cls.__name__, *versions, "table", None, 0, 0,
                               time.perf_counter() - start, False)  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only wait for each other (seconds on a busy CPU)
    try:
        diff, documents, tokens = _probe(inner, kind, (atol, rtol), tuple(lengths))
    except _NotExact as e:
        _verdicts[key] = str(e)
        raise ValueError(str(e)) from None
    finally:
        torch.set_num_threads(threads)
    report = CheckReport(cls.__name__, *versions, kind, diff, documents, tokens,
                         time.perf_counter() - start, False)  # fmt: skip
    _verdicts[key] = report
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


def _check_arguments(atol: float, rtol: float, probe: str, lengths: Sequence[int]) -> None:
    for name, tol in (("atol", atol), ("rtol", rtol)):
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
            raise ValueError(f"{name} must be a number >= 0, got {tol!r}.")
    if probe not in ("auto", "copy", "tiny"):
        raise ValueError(f"probe must be 'auto', 'copy' or 'tiny', got {probe!r}.")
    if (
        isinstance(lengths, (str, bytes))
        or len(lengths) < 2
        or not all(isinstance(n, int) and n >= 1 for n in lengths)
    ):
        raise ValueError(
            f"lengths must be at least 2 document lengths >= 1 (a packed row), got {lengths!r}."
        )


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _fingerprint(config: Any) -> str:
    """A hash of the config's fields (widths, layer kinds, windows), names and dtypes left out:
    the same class configured otherwise (a window, bidirectional layers) is checked again."""
    fields = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k not in (
        "transformers_version", "architectures", "dtype", "torch_dtype", "attn_implementation",
    )}  # fmt: skip
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _probe_kind(model: torch.nn.Module) -> str:
    params = list(model.parameters())
    copyable = all(p.is_floating_point() and p.device.type != "meta" for p in params)
    return "copy" if copyable and sum(p.numel() for p in params) <= COPY_LIMIT else "tiny"


def _from_transformers(model: torch.nn.Module) -> bool:
    """Whether the model is transformers' own class made of transformers' and torch's modules
    only (the verified table speaks for those, not for a class of the same name or a module
    added after loading)."""
    import transformers

    if getattr(transformers, type(model).__name__, None) is not type(model):
        return False
    return all(type(m).__module__.startswith(("transformers.", "torch.")) for m in model.modules())


# ----------------------------------------------------------------------------- the probe


def _probe(
    model: torch.nn.Module, kind: str, tol: tuple[float, float], lengths: tuple[int, ...]
) -> tuple[float, int, int]:
    """(max |diff| of the output, documents, tokens); raises _NotExact."""
    import flexpack
    from flexpack.integrations.transformers import packed_forward_kwargs, register

    packed, failed = _float64_twin(model, kind), None
    reference = copy.deepcopy(packed)
    _set_attention(reference, "eager")
    try:
        _set_attention(packed, register())
    except Exception as e:  # the probe then runs the other attention: its leak is named
        failed = f"{type(e).__name__}: {e}"
    config = packed.config.get_text_config()
    batch = flexpack.pack_sequences(_documents(config, lengths), sum(lengths) + PADDING)
    spans = _spans(batch.doc_ids[0].tolist())
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "its attention is not flexpack's": the verdict says
        row = _Recorder(packed)
        try:  # refused by name (before the row or in an attention call): a verdict too
            packed(**packed_forward_kwargs(batch, model=packed))
        except ValueError as e:
            raise _NotExact(str(e)) from None
        finally:
            row.remove()
        alone = []
        for a, b in spans:
            calls = _Recorder(reference)
            try:
                reference(input_ids=batch.input_ids[:, a:b], use_cache=False)
            finally:
                calls.remove()
            alone.append(calls)
    S = batch.input_ids.shape[1]
    diff = _compare(type(model).__name__, kind, row, alone, spans, S, tol, failed)
    return diff, len(spans), sum(b - a for a, b in spans)


def _float64_twin(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    """The model in float64 on CPU in eval mode: a deep copy, or a tiny model of its class with
    random weights (its own seed; the caller's random state is left as it was)."""
    if kind == "copy":
        twin = copy.deepcopy(model)
    else:
        from flexpack.integrations._tiny import tiny_config

        cls = type(model)
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
                f"({type(e).__name__}: {e}); pass probe='copy' to check a float64 copy of the "
                "model itself (two copies of its weights in memory)."
            ) from e
        lost = sorted(
            {type(m).__name__ for m in model.modules()} - {type(m).__name__ for m in twin.modules()}
        )
        foreign = [n for n in lost if not _is_library_class(model, n)]
        if foreign:
            warnings.warn(
                f"flexpack.check probes {cls.__name__} on a tiny model built from its config, "
                f"which has none of the modules {foreign} (added to the model after it was "
                "built?): they are not checked. Pass probe='copy' to check them.",
                stacklevel=4,
            )
    return twin.to(device="cpu", dtype=torch.float64).eval()


def _is_library_class(model: torch.nn.Module, name: str) -> bool:
    module = next(type(m).__module__ for m in model.modules() if type(m).__name__ == name)
    return module.startswith(("transformers.", "torch."))


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
    probe = "a float64 copy of the model" if kind == "copy" else (
        "a tiny float64 model of the same class (layer numbers are the tiny model's)"
    )  # fmt: skip
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
    import flexpack

    table = _load(str(_TABLE if path is None else path))
    if table.get("flexpack") != flexpack.__version__:
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
    release it ran on. Only verdicts the zoo proved belong here: :func:`check` skips its probe
    for a class listed as "exact" on the installed release.

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
    import flexpack

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
        if old.get("flexpack") == flexpack.__version__:
            models = {k: dict(v) for k, v in old.get("models", {}).items()}
    for name, by_version in verdicts.items():
        models.setdefault(name, {}).update(by_version)
    table = {"flexpack": flexpack.__version__, "models": models}
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    _load.cache_clear()


def _register_clear() -> None:
    from flexpack._tensor_cache import on_clear

    on_clear(_forget)


_register_clear()
