"""Attention with sinks (gpt-oss's ``s_aux``): one extra per-head logit in every softmax.

A sink is a key that every query sees, with logit ``sinks[h]`` and a zero value: it takes
probability mass without adding to the output. With ``o`` the attention output over the real
keys and ``lse`` their log-sum-exp, the output with a sink is

    o * exp(lse) / (exp(lse) + exp(sink)) = o * sigmoid(lse - sink)

so a path that returns the LSE needs one multiply (compiled flex on CUDA). The other paths write
the softmax out with the sink as an extra column (transformers' eager formula), per row of the
mask's dense twin. A query with no allowed key gets 0 either way (all mass on the sink).

Shape legend: B rows, Hq query heads, Hkv key/value heads, Q queries, KV keys, D head dim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["dense_sink_attention", "sink_attention"]


def dense_sink_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor,
    sinks: Tensor,
    *,
    scale: float | None,
    softcap: float | None = None,
) -> Tensor:
    """Softmax attention with a sink column, under a dense bool mask.

    Args:
        q: (B, Hq, Q, D).
        k, v: (B, Hkv, KV, D); Hkv divides Hq (repeated here).
        allowed: (B or 1, Hq or 1, Q, KV) bool, True where q may attend kv.
        sinks: (Hq,) the sink logit of each head.
        scale: softmax scale; default ``D ** -0.5``.
        softcap: Gemma-2 style logit cap (before the mask), or None.

    Returns:
        (B, Hq, Q, D) in q's dtype.

    Example:
        >>> import torch
        >>> q = k = v = torch.randn(1, 2, 3, 4)
        >>> allowed = torch.ones(3, 3, dtype=torch.bool).tril()[None, None]
        >>> dense_sink_attention(q, k, v, allowed, torch.full((2,), -1e9), scale=None).shape
        torch.Size([1, 2, 3, 4])
    """
    Hq, Hkv = q.shape[1], k.shape[1]
    if Hkv != Hq:
        k, v = (x.repeat_interleave(Hq // Hkv, dim=1) for x in (k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2)).float() * scale  # (B, Hq, Q, KV)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.float().view(1, Hq, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return (probs.to(v.dtype) @ v).to(q.dtype)


def sink_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Any,
    sinks: Tensor,
    *,
    scale: float | None,
    enable_gqa: bool,
    softcap: float | None = None,
    backend: str = "auto",
) -> Tensor:
    """:func:`flexpack.attention` with attention sinks, for whole rows (Q = KV = S).

    Args:
        q: (B, Hq, S, D); k, v: (B, Hkv, S, D).
        mask: a flexpack Mask (document, document & causal, windows, trees, ...) or a
            BlockMask built from one.
        sinks: (Hq,) sink logits (gpt-oss's ``self.sinks``, passed as ``s_aux``).
        scale, enable_gqa, softcap: as in :func:`flexpack.attention`.
        backend: "flex" (and "auto" on CUDA) runs flex with its LSE (compiled on CUDA, eager
            elsewhere: CPU inductor's flex returns no LSE); otherwise the dense twin of the
            mask with the sink column.

    Returns:
        (B, Hq, S, D).
    """
    from torch.nn.attention.flex_attention import BlockMask

    from flexpack import masks as _masks

    Hq, S = q.shape[1], q.shape[2]
    block_mask = mask if isinstance(mask, BlockMask) else None
    if block_mask is not None:
        mask = _masks.mask_of(block_mask)
        if mask is None:
            raise ValueError(
                "attention sinks need a flexpack Mask (or a BlockMask built from one) to build "
                "the dense twin; got a foreign BlockMask. Pass a flexpack Mask as flexpack_mask."
            )
    if backend == "flex" or (q.device.type == "cuda" and backend == "auto"):
        from torch.nn.attention.flex_attention import AuxRequest

        from flexpack._attention_flex import softcap_score_mod

        if q.device.type == "cuda":  # compiled, padded to buckets as flexpack.attention's
            from flexpack.attention import flex_with_lse

            out, lse = flex_with_lse(
                q, k, v, mask, scale=scale, enable_gqa=enable_gqa, softcap=softcap,
            )  # fmt: skip
        else:  # eager flex: CPU inductor's flex returns no LSE
            from torch.nn.attention.flex_attention import flex_attention

            if block_mask is None:
                block_mask = mask.block_mask()
            score_mod = None if softcap is None else softcap_score_mod(softcap, q.device)
            out, aux = flex_attention(
                q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                enable_gqa=enable_gqa, return_aux=AuxRequest(lse=True),
            )  # fmt: skip
            lse = aux.lse
        # lse is -inf for a query with no allowed key: sigmoid gives 0, and so does the output
        weight = torch.sigmoid(lse - sinks.float().view(1, Hq, 1))  # (B, Hq, S)
        return (out * weight.unsqueeze(-1).to(out.dtype)).to(q.dtype)
    from flexpack._attention_sdpa import dense_mask_from_mod

    Bm = mask.doc_ids.shape[0] if getattr(mask, "doc_ids", None) is not None else 1
    allowed = dense_mask_from_mod(mask.mask_mod, Bm, 1, S, q.device)
    return dense_sink_attention(q, k, v, allowed, sinks, scale=scale, softcap=softcap)
