"""The segment-aware causal conv every kind of mixer shares: short convs, the gated delta rule's
and KDA's, Mamba's and Mamba2's, RecurrentGemma's.

Each kind runs a causal depthwise ``Conv1d`` before its own mixing; on packed rows its taps
must stop at a document start (or follow a prefix tree's path). The kinds import it from here,
so that no kind imports another for it.

Shapes: B rows of S tokens, C channels, a window of K taps; ``plan`` is a
:class:`~flexpack.mixers._plan.DocumentPlan` or a :class:`~flexpack.mixers._tree.TreePlan`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from flexpack.mixers._plan import DocumentPlan
    from flexpack.mixers._tree import TreePlan


def _depthwise(module: torch.nn.Module) -> torch.nn.Conv1d | None:
    """The module's ``conv`` when its structure is the short conv's: ``in_proj`` and
    ``out_proj`` submodules beside a causal depthwise ``Conv1d`` (groups == channels, stride
    and dilation 1, zero padding of kernel - 1) whose weights are not offloaded."""
    conv = getattr(module, "conv", None)
    if not (
        isinstance(conv, torch.nn.Conv1d)
        and isinstance(getattr(module, "in_proj", None), torch.nn.Module)
        and isinstance(getattr(module, "out_proj", None), torch.nn.Module)
    ):
        return None
    channels, kernel = conv.in_channels, conv.kernel_size[0]
    if (
        conv.out_channels != channels
        or conv.groups != channels
        or conv.stride != (1,)
        or conv.dilation != (1,)
        or conv.padding_mode != "zeros"
        or conv.padding != (kernel - 1,)
        or getattr(conv, "_hf_hook", None) is not None  # accelerate moves its weights
    ):
        return None
    return conv


def _masked_conv(conv: torch.nn.Conv1d, u: Tensor, plan: DocumentPlan | TreePlan) -> Tensor:
    """``conv`` over ``u`` (B, C, S) as ``causal_conv1d_fn`` computes it, with each tap that
    ``plan.taps`` (K, B, S) bool marks False left out: sum over j of u[t - j] * w[K - 1 - j];
    on tree rows u[t - j] is t's j-th predecessor on its path (``plan.shift``)."""
    weight = conv.weight[:, 0]  # (C, K)
    K, S = weight.shape[-1], u.shape[-1]
    taps = plan.taps(K)
    v = u.to(weight.dtype)  # as causal_conv1d_fn: the weights' dtype, back to u's at the end
    y = v * weight[:, K - 1, None] * taps[0, :, None].to(v.dtype)
    for j in range(1, min(K, S)):
        y = y + plan.shift(v, j) * weight[:, K - 1 - j, None] * taps[j, :, None].to(v.dtype)
    if conv.bias is not None:
        y = y + conv.bias[:, None]
    return y.to(u.dtype)
