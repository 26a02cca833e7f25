"""flexpack: packed-sequence training for PyTorch.

Packing (``pack``, ``pack_sequences``, ``PackedLayout``) assigns variable-length samples to rows of
``max_len``; masks (``document_causal_mask`` and friends) keep every document to itself in
FlexAttention; ``attention`` runs them on any device; ``packed_cross_entropy`` keeps the loss
unbiased (``packed_linear_cross_entropy`` from the hidden states, never building the whole
logits); ``pack_trees`` forwards shared prompts once (GRPO groups, DPO pairs); ``check(model)``
tells whether a transformers model is exact on packed rows, or names the module that is not.

The names below load on first use (PEP 562), so ``import flexpack`` and the ``flexpack`` command's
``--help`` do not import torch until something needs it.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from flexpack._version import __version__ as __version__

if TYPE_CHECKING:
    from flexpack.attention import RecompileLimitError, attention
    from flexpack.batch import PackedBatch, pack_sequences
    from flexpack.check import CheckReport, check
    from flexpack.layout import PackedLayout
    from flexpack.loss import packed_cross_entropy, packed_linear_cross_entropy
    from flexpack.masks import document_causal_mask, document_mask, prefix_lm_mask
    from flexpack.packing import PackPlan, PackStats, pack
    from flexpack.trees import TreeBatch, pack_trees

_EXPORTS = {
    "CheckReport": "flexpack.check",
    "PackPlan": "flexpack.packing",
    "PackStats": "flexpack.packing",
    "PackedBatch": "flexpack.batch",
    "PackedLayout": "flexpack.layout",
    "RecompileLimitError": "flexpack.attention",
    "TreeBatch": "flexpack.trees",
    "attention": "flexpack.attention",
    "check": "flexpack.check",
    "clear_caches": "flexpack._tensor_cache",
    "document_causal_mask": "flexpack.masks",
    "document_mask": "flexpack.masks",
    "pack": "flexpack.packing",
    "pack_sequences": "flexpack.batch",
    "pack_trees": "flexpack.trees",
    "packed_cross_entropy": "flexpack.loss",
    "packed_linear_cross_entropy": "flexpack.loss",
    "prefix_lm_mask": "flexpack.masks",
}

__all__ = [
    "CheckReport",
    "PackPlan",
    "PackStats",
    "PackedBatch",
    "PackedLayout",
    "RecompileLimitError",
    "TreeBatch",
    "attention",
    "check",
    "clear_caches",
    "document_causal_mask",
    "document_mask",
    "pack",
    "pack_sequences",
    "pack_trees",
    "packed_cross_entropy",
    "packed_linear_cross_entropy",
    "prefix_lm_mask",
]
assert sorted(_EXPORTS) == __all__


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    else:
        try:  # flexpack.masks, flexpack.testing, ...: submodules load on first use too
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


# What dir(flexpack) and tab completion show: the public names, the submodules already loaded,
# and the module's own dunders; not the helpers this file imports (Any, importlib, sys, ...).
_HELPERS = frozenset({"Any", "TYPE_CHECKING", "annotations", "importlib", "sys", "types"})


def __dir__() -> list[str]:
    shown = (n for n in globals() if n.startswith("__") or not (n in _HELPERS or n[0] == "_"))
    return sorted({*_EXPORTS, *shown})


class _Package(types.ModuleType):
    """Keeps ``flexpack.attention`` the function: importing the submodule of the same name would
    otherwise rebind the attribute to the module (``import flexpack.attention`` still works)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
