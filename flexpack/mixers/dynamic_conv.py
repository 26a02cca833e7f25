"""Dynamic short convolutions (Inkling2's key / value ``sconv``): a window that restarts per
document, with per-token taps.

``Inkling2DynamicShortConvolution`` convolves its (B, S, C) input over a causal window of K
tokens whose taps are static per-channel weights (``static_weight`` (K, C), tap j weighting the
token j steps back) plus per-token weights projected from a second input (``weight_proj`` of
``dynamic_input`` (B, S, D), one set of K taps per head, shared by the head's channels), adds
the input back and scales by 1 / sqrt(2K + 1), in float32. Left alone its window reads the
previous document's last K - 1 tokens. flexpack runs it once over the whole packed rows from its
parameters (:func:`dynamic_conv_one_pass`), every tap that would cross a document start masked
out (``plan.taps``), so on prefix trees it follows each root-to-leaf path (``plan.shift``); a
class whose structure or behaviour differs, and a call with a cache or a ``conv_mask``, run once
per group of right-padded documents instead, ``dynamic_input`` cut like the rows. No kernel
mapping: the kind is recognised by its parts, not by its class name.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from flexpack.mixers import _one_pass
from flexpack.mixers._plan import DocumentPlan
from flexpack.mixers._room import Room
from flexpack.mixers._tree import TreePlan


def _dynamic(module: torch.nn.Module) -> bool:
    """A ``static_weight`` (K, C) parameter, a ``weight_proj`` Linear, ``conv_kernel_size`` and
    ``num_heads``."""
    weight = module._parameters.get("static_weight")
    kernel, heads = getattr(module, "conv_kernel_size", None), getattr(module, "num_heads", None)
    return (
        isinstance(weight, torch.nn.Parameter)
        and weight.dim() == 2
        and isinstance(getattr(module, "weight_proj", None), torch.nn.Linear)
        and isinstance(kernel, int)
        and isinstance(heads, int)
    )


def _fits(module: torch.nn.Module, x: Tensor, dynamic_input: Any) -> bool:
    """Inkling2's structure: K taps of C channels in ``num_heads`` heads, ``weight_proj``
    giving K taps per head from ``dynamic_input`` (B, S, D), rows of C features."""
    if not _dynamic(module) or x.dim() != 3 or not isinstance(dynamic_input, Tensor):
        return False
    K, heads = module.conv_kernel_size, module.num_heads
    C, proj = x.shape[-1], module.weight_proj
    return (
        K > 0
        and heads > 0
        and tuple(module.static_weight.shape) == (K, C)
        and C % heads == 0
        and proj.out_features == heads * K
        and tuple(dynamic_input.shape) == (*x.shape[:2], proj.in_features)
        and getattr(module, "_hf_hook", None) is None  # accelerate moves its weights
    )


def dynamic_conv_one_pass(
    module: torch.nn.Module, x: Tensor, dynamic_input: Tensor, plan: DocumentPlan | TreePlan
) -> Tensor:
    """A dynamic short conv's forward over packed rows (or prefix trees), documents kept apart,
    in one pass.

    As ``Inkling2DynamicShortConvolution.forward`` without a cache (transformers 5.25): taps
    ``static_weight.T + weight_proj(dynamic_input)`` per head, the window of token t reading
    t - j only inside t's document (its path on a tree), ``(window . taps + x) / sqrt(2K + 1)``
    in float32; padding gives zeros.

    Args:
        module: a dynamic short conv (:func:`_fits` accepts its structure).
        x: (B, S, C) hidden states of packed rows.
        dynamic_input: (B, S, D) the input the per-token taps are projected from.
        plan: the rows' documents (or trees).

    Returns:
        (B, S, C), in ``x``'s dtype.
    """
    B, S, C = x.shape
    K, heads = module.conv_kernel_size, module.num_heads
    dynamic = module.weight_proj(dynamic_input).float().view(B, S, heads, 1, K)
    weights = module.static_weight.float().T.view(heads, -1, K) + dynamic  # (B, S, h, C/h, K)
    h = x.float()
    u = h.transpose(1, 2)  # (B, C, S)
    taps = plan.taps(K)  # (K, B, S)
    lags = [
        plan.shift(u, j) * taps[j, :, None].to(u.dtype) if j < S else torch.zeros_like(u)
        for j in range(K)
    ]  # lags[j]: each token's value j tokens back in its document, zeros before its start
    windows = torch.stack(lags, dim=-1).transpose(1, 2)  # (B, S, C, K), as the module's unfold
    windows = windows.reshape(B, S, heads, -1, K)
    y = (windows * weights).sum(-1).reshape(B, S, C)
    out = (y + h) / math.sqrt(2 * K + 1)
    return (out * plan.real[..., None].to(out.dtype)).to(x.dtype)


# keywords that change what the one pass computes: a cache, a padding mask of the conv's input
_CHANGES = (*_one_pass.CHANGES_THE_PASS, "conv_mask")


def _hook() -> Any:
    """The room's ``one_pass``: :func:`dynamic_conv_one_pass` where the module fits, the call
    has neither cache nor ``conv_mask``, and the module's class passed
    :func:`flexpack.mixers._one_pass.self_check` (its own forward per group of documents, with
    ``dynamic_input`` cut like the rows: the probe's features are the hidden states and the
    dynamic input side by side). ``.verified`` maps each probed class to its verdict."""
    verified: dict[type, bool] = {}

    def one_pass(module, own, x: Tensor, plan, kwargs: dict[str, Any]):
        dynamic_input = kwargs.get("dynamic_input")
        if not _fits(module, x, dynamic_input):
            return None
        if any(kwargs.get(k) is not None for k in _CHANGES):
            return None
        ok = verified.get(type(module))
        if ok is None:
            if torch.compiler.is_compiling():
                return None
            C = x.shape[-1]

            def alone(xd: Tensor) -> Tensor:  # (n, L, C + D) -> the module's own forward
                return own(xd[..., :C], xd[..., C:])

            def fn(m: torch.nn.Module, xd: Tensor, p: DocumentPlan) -> Tensor:
                return one_pass.fn(m, xd[..., :C], xd[..., C:], p)

            width = C + dynamic_input.shape[-1]
            ok = _one_pass.self_check(module, alone, fn, width, _one_pass.PROBE)
            verified[type(module)] = ok
        if not ok:
            return None
        return one_pass.fn(module, x, dynamic_input, plan)

    one_pass.verified = verified  # type: ignore[attr-defined]
    one_pass.fn = dynamic_conv_one_pass  # type: ignore[attr-defined]  # tests count its calls
    return one_pass


DYNAMIC_SHORT_CONV = Room(
    "dynamic_short_conv",
    matches=_dynamic,
    recognised_by="a `static_weight` (K, C) parameter beside a `weight_proj` Linear, "
    "`conv_kernel_size` and `num_heads` (Inkling2's key / value convolution)",
    how="the window and its per-token taps restart per document: one pass over the rows with "
    "the taps across document starts masked (torch, Inkling2's structure), else documents run "
    "apart with their dynamic input (no kernel mapping)",
    one_pass=_hook(),
)

ROOMS = (DYNAMIC_SHORT_CONV,)
