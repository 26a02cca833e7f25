"""Kernel paths of ``flexpack.attention``: compiled flex_attention, torch's FlashAttention varlen.

Compilation is lazy and cached (nothing compiles at import). Shapes are fixed
(``dynamic=False``): a new (B, H, S, D) compiles once more, a new document layout at the same shape
does not. Dynamo keeps at most ``torch._dynamo.config.recompile_limit`` compiled variants per
function and then silently runs flex_attention eagerly, which materializes the whole score matrix
(one peer's users lost 5x that way). Here that case raises instead, with the fix.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from flexpack._attention_sdpa import _tokens, _untokens, cached_plan, document_groups


class RecompileLimitError(RuntimeError):
    """Compiled flex_attention hit dynamo's recompile limit and would run eagerly (slowly)."""


@functools.cache
def compiled_flex_attention(device_type: str, dtype: torch.dtype, dynamic: bool = False):
    """``torch.compile(flex_attention)`` for one (device type, dtype, options), built once.

    ``device_type`` and ``dtype`` only key the cache: one compiled wrapper per configuration keeps
    each configuration's guards apart and makes the compile count easy to reason about.
    """
    del device_type, dtype
    return torch.compile(flex_attention, dynamic=dynamic, fullgraph=True)


def _recompile_limit() -> int:
    cfg = torch._dynamo.config
    return int(getattr(cfg, "recompile_limit", getattr(cfg, "cache_size_limit", 8)))


def softcap_score_mod(softcap: float, device: torch.device):
    """The flex ``score_mod`` of attention-logit soft-capping: ``cap * tanh(score / cap)``.

    The cap is a 0-d tensor the closure reads, not a Python number baked into the graph, so a new
    value (or a new closure per call) reuses the compiled kernel instead of recompiling.
    """
    cap = torch.tensor(float(softcap), device=device)

    def softcap_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return cap * torch.tanh(score / cap)

    return softcap_mod


def flex(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    block_mask: BlockMask,
    *,
    scale: float | None,
    enable_gqa: bool,
    softcap: float | None = None,
) -> Tensor:
    """Compiled flex_attention; raises :class:`RecompileLimitError` instead of an eager fallback."""
    fn = compiled_flex_attention(q.device.type, q.dtype)
    score_mod = None if softcap is None else softcap_score_mod(softcap, q.device)
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            return fn(
                q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                enable_gqa=enable_gqa,
            )  # fmt: skip
    except torch._dynamo.exc.FailOnRecompileLimitHit as err:
        raise RecompileLimitError(
            f"compiled flex_attention hit torch._dynamo.config.recompile_limit="
            f"{_recompile_limit()}: it has been compiled for that many distinct input shapes "
            f"(this call: q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, "
            f"block size {block_mask.BLOCK_SIZE}). Dynamo would now run flex_attention eagerly, "
            "which materializes the full score matrix and is many times slower. Fix: feed rows "
            "of a fixed length (pack to max_len and keep the padding; a few bucket lengths at "
            "most), or raise torch._dynamo.config.recompile_limit if you really need more shapes."
        ) from err


@functools.cache
def varlen_available(device: torch.device) -> bool:
    """Whether ``varlen_attn`` runs on ``device``: torch >= 2.10 ships it, and its FlashAttention
    kernels need a CUDA GPU of compute capability 8.0 (Ampere) or newer. Probed on first use."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


VARLEN_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class _VarlenPlan:
    """Unpadding for varlen: order (T,), cu_seqlens (N + 1,) int32, max_seqlen, and whether the
    order is the identity (no padding, documents in order: no gather or scatter needed)."""

    order: Tensor
    cu_seqlens: Tensor
    max_seqlen: int
    identity: bool


def _varlen_plan(doc_ids: Tensor) -> _VarlenPlan:
    groups = document_groups(doc_ids)
    order, T = groups.order, groups.order.numel()
    identity = T == doc_ids.numel() and bool((order == torch.arange(T, device=order.device)).all())
    max_seqlen = int(groups.seqlens.max()) if T else 0
    return _VarlenPlan(order, groups.cu_seqlens, max_seqlen, identity)


def varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    doc_ids: Tensor,
    *,
    causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> Tensor:
    """torch's FlashAttention varlen kernel over the documents of ``doc_ids`` (B or 1, S).

    Tokens are unpadded flash-attn style (``indices`` / ``cu_seqlens``), attended per document
    and scattered back; padding gets 0. The plan (one host sync for ``max_seqlen``) is computed
    once per doc_ids tensor and reused across layers. Rows without padding whose documents are in
    order skip the gather and scatter; with q, k, v laid out (B, S, H, D) underneath, as models
    produce them before ``transpose(1, 2)``, no copy is made at all.
    """
    from torch.nn.attention.varlen import varlen_attn

    B, Hq, S, D = q.shape
    plan = cached_plan("varlen", doc_ids, B, _varlen_plan)
    if plan.identity:
        qs, ks, vs = (_tokens(x) for x in (q, k, v))  # (B * S, H, D)
    else:
        qs, ks, vs = (_tokens(x).index_select(0, plan.order) for x in (q, k, v))  # (T, H, D)
    if plan.max_seqlen == 0:  # all padding: zeros, still connected to the graph
        return _untokens(q.new_zeros(B * S, Hq, D) + 0.0 * (qs.sum() + ks.sum() + vs.sum()), B, S)
    o = varlen_attn(
        qs,
        ks,
        vs,
        plan.cu_seqlens,
        plan.cu_seqlens,
        plan.max_seqlen,
        plan.max_seqlen,
        scale=scale,
        window_size=(-1, 0) if causal else (-1, -1),
        enable_gqa=enable_gqa,
    )
    if plan.identity:
        return _untokens(o, B, S)
    return _untokens(q.new_zeros(B * S, Hq, D).index_copy(0, plan.order, o), B, S)
