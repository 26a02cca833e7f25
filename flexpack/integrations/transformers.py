"""Hugging Face transformers: flexpack attention as an ``attn_implementation``.

``register()`` adds an attention function to transformers' ``AttentionInterface`` (and a
pass-through mask function to its ``AttentionMaskInterface``) under the name ``"flexpack"``; no
transformers code is patched. A model built with ``attn_implementation="flexpack"`` then runs on
packed rows:

    >>> import torch, flexpack                                                  # doctest: +SKIP
    >>> from transformers import LlamaConfig, LlamaForCausalLM                  # doctest: +SKIP
    >>> from flexpack.integrations.transformers import register, packed_forward_kwargs
    >>> name = register()                                                       # doctest: +SKIP
    >>> model = LlamaForCausalLM(LlamaConfig(..., attn_implementation=name))   # doctest: +SKIP
    >>> batch = flexpack.pack_sequences(samples, max_len=4096)                  # doctest: +SKIP
    >>> out = model(**packed_forward_kwargs(batch, labels=True))                # doctest: +SKIP

Each layer's attention reads the documents of the row from, in this order: a ``doc_ids`` keyword
of the model call (flexpack rows; -1 marks padding), a ``seq_idx`` keyword
(``DataCollatorWithFlattening(return_seq_idx=True)``), or the ``position_ids`` (a new document
wherever the position does not go up by one, transformers' own packed-sequence rule, so
``DataCollatorWithFlattening`` batches work too). A 2-D ``attention_mask`` marks padding. The mask
is built once per forward and shared by the layers. transformers is imported lazily, inside the
functions (extra ``hf``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flexpack.integrations import multimodal
from flexpack.integrations.multimodal import collate_multimodal, pack_multimodal

NAME = "flexpack"

__all__ = [
    "NAME",
    "collate_multimodal",
    "flexpack_attention_forward",
    "pack_multimodal",
    "packed_forward_kwargs",
    "register",
]

# Every layer of a forward receives the same doc_ids/position_ids tensors, so the document ids are
# derived for the first layer and reused by the others (and by the next forward on the same
# tensors). Holding the tensors keeps their ids from being reused; `_version` sees in-place edits.
# Masks are kept per (is_causal, window) for those ids: models that alternate sliding and full
# layers (Gemma, Mistral-style configs) then build each mask once, not once per layer.
_cache: dict[str, Any] = {}


def _import_transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "flexpack.integrations.transformers needs transformers; install it with "
            "`pip install 'flexpack[hf]'` (or `pip install transformers`)."
        ) from e
    return transformers


def register(name: str = NAME) -> str:
    """Register flexpack attention with transformers under ``name``; return the name.

    Registers :func:`flexpack_attention_forward` in ``transformers.AttentionInterface`` and a mask
    function in ``transformers.AttentionMaskInterface`` that hands a 2-D padding ``attention_mask``
    through unchanged (flexpack builds its own mask from document ids). Calling it again is
    harmless.

    Args:
        name: the ``attn_implementation`` to use in ``from_pretrained``/``from_config``/a config.

    Returns:
        ``name``.

    Raises:
        ImportError: transformers is not installed, or older than 4.53.

    Example:
        >>> from flexpack.integrations.transformers import register
        >>> register()  # then: LlamaConfig(..., attn_implementation="flexpack")
        'flexpack'
    """
    transformers = _import_transformers()
    mask_interface = getattr(transformers, "AttentionMaskInterface", None)
    if mask_interface is None:
        raise ImportError(
            f"flexpack's transformers integration needs transformers.AttentionMaskInterface "
            f"(transformers >= 4.53), got transformers {transformers.__version__}; upgrade with "
            "`pip install -U transformers`."
        )
    transformers.AttentionInterface.register(name, flexpack_attention_forward)
    mask_interface.register(name, _pass_padding_mask)
    return name


def _pass_padding_mask(*, attention_mask: Tensor | None = None, **_: Any) -> Tensor | None:
    """AttentionMaskInterface entry: the (B, KV) bool padding mask or None, never an (S, S) mask."""
    return attention_mask


def packed_forward_kwargs(batch: Any, *, labels: bool = False) -> dict[str, Any]:
    """Keyword arguments for a transformers model call on a flexpack ``PackedBatch``.

    Args:
        batch: a ``PackedBatch`` (or anything with ``input_ids``, ``position_ids`` and ``doc_ids``,
            each (R, S)).
        labels: also pass ``batch.labels`` (HF-style unshifted, -100 on padding and on the first
            token of every document), so the model's own loss is the mean over supervised tokens.

    Returns:
        ``{"input_ids": (R, S) int64, "position_ids": (R, S) int64, "doc_ids": (R, S) int32,
        "use_cache": False}`` plus ``"labels"`` when asked; use as ``model(**kwargs)``.

    Raises:
        TypeError: ``batch`` lacks one of the tensors.

    Example:
        >>> import types, torch
        >>> from flexpack.integrations.transformers import packed_forward_kwargs
        >>> b = types.SimpleNamespace(input_ids=torch.tensor([[5, 6, 7, 0]]),
        ...     position_ids=torch.tensor([[0, 1, 0, 0]]), doc_ids=torch.tensor([[0, 0, 1, -1]]))
        >>> sorted(packed_forward_kwargs(b))
        ['doc_ids', 'input_ids', 'position_ids', 'use_cache']
    """
    names = ["input_ids", "position_ids", "doc_ids"] + (["labels"] if labels else [])
    missing = [n for n in names if not isinstance(getattr(batch, n, None), Tensor)]
    if missing:
        raise TypeError(
            f"packed_forward_kwargs needs a PackedBatch (tensors {names}); got a "
            f"{type(batch).__name__} without {missing}. Build one with flexpack.pack_sequences."
        )
    kwargs: dict[str, Any] = {
        "input_ids": batch.input_ids.long(),
        "position_ids": batch.position_ids.long(),
        "doc_ids": batch.doc_ids,
        "use_cache": False,
    }
    if labels:
        kwargs["labels"] = batch.labels.long()
    return kwargs


def flexpack_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The attention function transformers calls per layer under ``attn_implementation="flexpack"``.

    Args:
        module: the attention module (its ``is_causal`` is read; default True).
        query: (B, Hq, S, D).
        key: (B, Hkv, S, D); Hkv may divide Hq (GQA).
        value: (B, Hkv, S, D).
        attention_mask: None or a (B, S) padding mask (True = real token), from ``register``'s mask
            function.
        scaling: softmax scale; default ``D ** -0.5``.
        dropout: must be 0 (flexpack attention has no dropout).
        **kwargs: the model call's keywords; read: ``doc_ids`` (B, S) int, ``seq_idx`` (B, S) int,
            ``position_ids`` (B or 1, S) int, ``is_causal``, ``sliding_window``, ``softcap``
            (attention-logit soft-capping, Gemma 2), and ``flexpack_mask``: a prebuilt flexpack
            Mask or BlockMask used as is by every layer (e.g. ``flexpack.pack_trees(...).mask()
            .block_mask()``, with the batch's ``position_ids``), and ``image_span_ids`` (B, S)
            (Gemma 3 rows of ``pack_multimodal``: one image's tokens attend both ways). Calls
            from a vision tower (module with a vision config) run as transformers' ``sdpa``.

    Returns:
        ``(attn_output, None)``, attn_output (B, S, Hq, D) as transformers expects.

    Raises:
        ValueError: a KV cache (query and key lengths differ), dropout, attention sinks, a 4-D
            mask, or document ids of the wrong shape.

    Example:
        >>> import torch
        >>> from flexpack.integrations.transformers import flexpack_attention_forward
        >>> q = k = v = torch.randn(1, 2, 6, 8, requires_grad=True)  # two documents of 3:
        >>> out, _ = flexpack_attention_forward(torch.nn.Module(), q, k, v, None,
        ...     position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]))
        >>> out.shape  # (B, S, Hq, D)
        torch.Size([1, 6, 2, 8])
    """
    from flexpack.attention import attention

    if multimodal._vision_call(module, query, kwargs):  # a vision tower's own per-image blocks
        return multimodal._vision_attention(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
            kwargs=kwargs,
        )  # fmt: skip
    B, Hq, S, _ = query.shape
    if key.shape[2] != S:
        raise ValueError(
            f"flexpack attention computes whole rows, but got {S} queries against {key.shape[2]} "
            "keys (a KV cache, i.e. generation). Generate with another implementation: "
            "model.set_attn_implementation('sdpa')."
        )
    if dropout and module.training:
        raise ValueError(
            f"flexpack attention has no dropout, got dropout={dropout}; set the config's "
            "attention_dropout to 0.0 (or call model.eval())."
        )
    for unsupported in ("s_aux", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(
                f"flexpack attention does not support `{unsupported}` (this model passes it); "
                "use attn_implementation='flex_attention' or 'eager' for this model."
            )
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    mask = kwargs.get("flexpack_mask")  # a prebuilt mask (e.g. a TreeBatch's) wins
    if mask is None and kwargs.get("image_span_ids") is not None:  # Gemma 3 pack_multimodal rows
        mask = multimodal._image_span_mask(
            query.device, B, S, attention_mask, kwargs, bool(is_causal)
        )
    if mask is None:
        mask = _mask_for(
            query.device,
            B,
            S,
            attention_mask,
            kwargs.get("doc_ids"),
            kwargs.get("seq_idx"),
            kwargs.get("position_ids"),
            bool(is_causal),
            kwargs.get("sliding_window"),
        )
    out = attention(
        query, key, value, mask, scale=scaling, enable_gqa=key.shape[1] != Hq,
        softcap=kwargs.get("softcap"),
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None  # (B, S, Hq, D)


def _mask_for(
    device: torch.device,
    B: int,
    S: int,
    padding: Tensor | None,
    doc_ids: Tensor | None,
    seq_idx: Tensor | None,
    position_ids: Tensor | None,
    is_causal: bool,
    sliding_window: int | None,
):
    """The flexpack mask of this forward, built once per (is_causal, window) for all layers."""
    sources = (padding, doc_ids, seq_idx, position_ids)
    # The cache holds the source tensors themselves: identity plus their in-place version
    # counters say whether this forward's inputs are the cached ones.
    key = (tuple(_version(t) for t in sources), device, B, S)
    if _cache.get("key") != key or not all(
        a is b for a, b in zip(_cache["sources"], sources, strict=True)
    ):
        ids = _doc_ids(B, S, padding, doc_ids, seq_idx, position_ids).to(device)
        _cache.clear()
        _cache.update(key=key, sources=sources, ids=ids, masks={})
    masks = _cache["masks"]
    mask_key = (is_causal, sliding_window)
    if mask_key not in masks:
        masks[mask_key] = _build_mask(_cache["ids"], is_causal, sliding_window)
    return masks[mask_key]


def _version(t: Tensor | None) -> int:
    return -1 if t is None else t._version


def _doc_ids(
    B: int,
    S: int,
    padding: Tensor | None,
    doc_ids: Tensor | None,
    seq_idx: Tensor | None,
    position_ids: Tensor | None,
) -> Tensor:
    """(B, S) integer document ids, -1 on padding, from the first source that is given.

    Signed ids keep their dtype (an int64 id of 2**32 stays itself: a cast to int32 would merge it
    with document 0); unsigned ids become int64 so that -1 fits, and the mask refuses uint64 ids
    past int64 (``flexpack.masks.document``)."""
    for name, ids in (("doc_ids", doc_ids), ("seq_idx", seq_idx)):
        if ids is not None:
            if not isinstance(ids, Tensor) or tuple(ids.shape) not in ((B, S), (1, S)):
                got = tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__
                raise ValueError(
                    f"{name} must be a (B, S) = {(B, S)} integer tensor like input_ids, got {got}."
                )
            break
    else:
        if position_ids is None:
            ids = torch.zeros(1, S, dtype=torch.int64)  # one sequence per row: plain causal
        else:
            # transformers' packed-sequence rule: a new sequence wherever positions don't step by 1
            step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
            ids = (step != 1).cumsum(-1)
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise TypeError(
            f"document ids must be an integer tensor like input_ids, got dtype {ids.dtype}; "
            "convert with .long()."
        )
    if not ids.dtype.is_signed:
        from flexpack.masks import _as_doc_ids

        ids = _as_doc_ids(ids)  # refuses uint64 ids past int64, else int64
    ids = ids.expand(B, S)
    if padding is not None:
        if padding.dim() != 2:
            raise ValueError(
                f"flexpack attention takes a 2-D (B, S) padding attention_mask, got shape "
                f"{tuple(padding.shape)}; pass doc_ids for packed rows instead of a 4-D mask."
            )
        ids = torch.where(padding[:, -S:].to(device=ids.device, dtype=torch.bool), ids, -1)
    return ids.contiguous()


def _build_mask(doc_ids: Tensor, is_causal: bool, sliding_window: int | None):
    """The flexpack Mask (a description: ``flexpack.attention`` builds a BlockMask only on the
    flex path, once per forward, and never for varlen or per-document SDPA)."""
    from flexpack import masks

    mask = masks.document(doc_ids)
    if sliding_window is None:
        return mask & masks.causal() if is_causal else mask
    if not is_causal:
        raise ValueError(
            f"flexpack attention got a sliding window ({sliding_window}) on a non-causal layer; "
            "only causal sliding windows (Mistral-style) are supported."
        )
    # transformers' sliding window keeps kv_idx > q_idx - sliding_window, i.e. q - kv <= window - 1
    return mask & masks.causal() & masks.sliding_window(int(sliding_window) - 1)
