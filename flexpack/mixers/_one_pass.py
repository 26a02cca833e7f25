"""The one-pass hook a room gives its kind: the module's forward over whole packed rows at once
(documents kept apart inside the computation), used where a self-check found it equal to the
module's own forward run per group of documents.

A room's one-pass function recomputes the module's forward from its submodules and parameters;
a class whose structure or behaviour differs (another release, another family of the same kind)
must not take it. So each module class is probed once, on a small random packed batch, against
its own forward per group of right-padded documents; a class that differs, or raises, keeps the
per-group path. A call with a cache, a padding mask or another keyword the one pass leaves out
keeps it too.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from flexpack.mixers._plan import DocumentPlan

# keywords of a module's forward that would change what a one pass computes: a cache (its names
# across releases), a padding mask, a conv's activation or state
CHANGES_THE_PASS = ("cache", "cache_params", "past_key_values", "layer_past", "attention_mask",
                    "activation", "state_idx")  # fmt: skip
# document ids of the self-check's rows: documents of 1 to 9 tokens, one longer than a chunk of
# 8 (the scans' chunking: a document crossing chunks, one starting mid-chunk), padding
PROBE = [
    [0, 1, 1, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 4, -1],
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, -1, -1, -1, -1, -1],
    [-1] * 16,
]

OnePass = Callable[[torch.nn.Module, Tensor, DocumentPlan], Tensor]


def _alone(own: Callable) -> Callable[[Tensor], Any]:
    """``own`` called with hidden states only, each row one document: parameters it requires
    besides them get None (MiniMax's ``position_embeddings`` and ``attention_mask``, which
    lightning attention does not use), a required ``position_ids`` each row's positions from 0
    (RecurrentGemma's RG-LRU restarts where they are 0), and ``use_cache`` False (a module
    that keeps its cache in its own attributes leaves them alone)."""
    try:
        params = list(inspect.signature(own).parameters.values())[1:]
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return own
    required = {
        p.name
        for p in params
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    no_cache = {"use_cache": False} if any(p.name == "use_cache" for p in params) else {}

    def call(x: Tensor) -> Any:
        given = dict.fromkeys(required)
        if "position_ids" in required:
            given["position_ids"] = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        return own(x, **given, **no_cache)

    return call


def per_group(
    own: Callable, x: Tensor, plan: DocumentPlan, *, all_outputs: bool = False
) -> Tensor | tuple[Tensor, ...]:
    """The module's own forward, once per group of right-padded documents, merged back (every
    output of a tuple with ``all_outputs``: a q, k, v projection)."""
    own = _alone(own)
    outs = [own(plan.split(x, g)) for g in range(len(plan.groups))]
    if all_outputs:
        return tuple(plan.merge([o[i] for o in outs]) for i in range(len(outs[0])))
    return plan.merge([o[0] if isinstance(o, tuple) else o for o in outs])


def self_check(
    module: torch.nn.Module,
    own: Callable,
    fn: OnePass,
    width: int,
    probe: list[list[int]],
    all_outputs: bool = False,
) -> bool:
    """Does ``fn`` give the module's own forward (run per group of documents) on a random
    packed probe (``probe``: its document ids) of ``width`` features? Every real token within
    1e-5 of its output's norm, in the module's parameters' dtype and device with autocast off
    (bf16 / fp16: 16 rounding steps; a state or tap across a boundary moves a token's output by
    tens of percent)."""
    param = next(module.parameters(), None)
    if param is None:
        return False
    device, dtype = param.device, param.dtype
    try:
        plan = DocumentPlan.from_doc_ids(torch.tensor(probe, device=device))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(plan.B, plan.S, width, generator=g).to(device, dtype)
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            want = per_group(own, x, plan, all_outputs=all_outputs)
            got = fn(module, x, plan)
        if not all_outputs:
            got, want = (got,), (want,)
        if len(got) != len(want):
            return False
        tol = 1e-5 if torch.finfo(dtype).bits >= 32 else 16 * torch.finfo(dtype).eps
        for g, w in zip(got, want, strict=True):
            if g.shape != w.shape or g.dtype != w.dtype:
                return False
            g, w = g.reshape(*g.shape[:2], -1).double(), w.reshape(*w.shape[:2], -1).double()
            if not bool(((g - w).norm(dim=-1) <= tol * w.norm(dim=-1)).all()):  # (B, S)
                return False
        return True
    except Exception:  # anything unexpected: the per-group calls, which run the module itself
        return False


def hook(
    fn: OnePass,
    fits: Callable[[torch.nn.Module, Tensor], bool],
    *,
    probe: Callable[[torch.nn.Module], list[list[int]]] = lambda _: PROBE,
    changes: tuple[str, ...] = CHANGES_THE_PASS,
    outputs: int = 1,
    all_outputs: bool = False,
) -> Callable[..., Any]:
    """A ``Room.one_pass`` hook: ``fn`` on the whole (B, S, H) rows ``x`` where the module
    ``fits`` them (its structure, their width and dtype), the call's keywords hold none of
    ``changes``, and the module's class passed :func:`self_check` on ``probe(module)``'s ids
    (once, at its first call outside compilation). ``hook(...).verified`` maps each probed
    class to its verdict, ``hook(...).fn`` is ``fn``. ``outputs`` > 1: the module returns a
    tuple (the per-token output, then ``outputs - 1`` others the one pass gives as None);
    ``all_outputs``: ``fn`` returns the module's whole tuple of per-token outputs, each checked."""
    verified: dict[type, bool] = {}

    def one_pass(module, own, x: Tensor, plan: DocumentPlan, kwargs: dict[str, Any]):
        if x.dim() != 3 or not fits(module, x):
            return None
        if any(kwargs.get(k) is not None for k in changes):
            return None
        ok = verified.get(type(module))
        if ok is None:
            if torch.compiler.is_compiling():
                return None
            ok = self_check(module, own, one_pass.fn, x.shape[-1], probe(module), all_outputs)
            verified[type(module)] = ok
        if not ok:
            return None
        out = one_pass.fn(module, x, plan)
        return out if outputs == 1 else (out, *([None] * (outputs - 1)))

    one_pass.verified = verified  # type: ignore[attr-defined]
    one_pass.fn = fn  # type: ignore[attr-defined]  # what it runs (tests count its calls)
    return one_pass
