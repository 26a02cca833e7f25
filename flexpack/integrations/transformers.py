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
    >>> out = model(**packed_forward_kwargs(batch, labels=True, model=model))   # doctest: +SKIP

Each layer's attention reads the documents of the row from, in this order: a ``doc_ids`` keyword
of the model call (flexpack rows; -1 marks padding), a ``seq_idx`` keyword
(``DataCollatorWithFlattening(return_seq_idx=True)``), or the ``position_ids`` (a new document
wherever the position does not go up by one, transformers' own packed-sequence rule, so
``DataCollatorWithFlattening`` batches work too). A 2-D ``attention_mask`` marks padding. The mask
is built once per forward and shared by the layers. ``generate()`` works too: with a KV cache the
queries meet transformers' own cache mask, so decoding gives ``sdpa``'s tokens. transformers is
imported lazily, inside the functions (extra ``hf``).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from torch import Tensor

from flexpack import mixers
from flexpack._tensor_cache import PerThread, Stamp, all_match, stamps
from flexpack.integrations import _mixers_check, multimodal
from flexpack.integrations.multimodal import collate_multimodal, pack_multimodal
from flexpack.layout import _doc_ids_from_sources

NAME = "flexpack"

__all__ = [
    "NAME",
    "collate_multimodal",
    "flexpack_attention_forward",
    "pack_multimodal",
    "packed_causal_lm_loss",
    "packed_forward_kwargs",
    "register",
]

# Every layer of a forward receives the same doc_ids/position_ids tensors, so the document ids are
# derived for the first layer and reused by the others (and by the next forward on the same,
# unmodified tensors: flexpack._tensor_cache.Stamp says which writes are seen).
# Masks are kept per (is_causal, window) for those ids: models that alternate sliding and full
# layers (Gemma, Mistral-style configs) then build each mask once, not once per layer. One per
# thread: two models called from two threads never build from each other's ids.
_cache = PerThread()


def _adapted_as(name: str, module: torch.nn.Module) -> bool:
    return module.__dict__.get("_flexpack_room") == name


def _register_mixer_kinds() -> None:
    """The kinds flexpack.mixers makes exact (once adapted: the mask function adapts a model
    before its first layer), ahead of the refused kinds they refine."""
    import functools

    for room in mixers.ROOMS:
        _mixers_check.register_kind(
            room.name, functools.partial(_adapted_as, room.name), exact=True, why=room.how
        )


_register_mixer_kinds()


def _import_transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "flexpack.integrations.transformers needs transformers; install it with "
            "`pip install transformers` (or `pip install -e '.[hf]'` in a flexpack checkout)."
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


def _pass_padding_mask(
    *,
    attention_mask: Tensor | None = None,
    q_length: int | None = None,
    kv_length: int | None = None,
    q_offset: int = 0,
    kv_offset: int = 0,
    **kwargs: Any,
) -> Tensor | None:
    """AttentionMaskInterface entry: the (B, KV) padding mask or None for whole rows.

    With a KV cache (queries against more or shifted keys: decoding, a prefill after a cached
    prefix, a sliding-window cache) it returns transformers' own (B, 1, Q, KV) bool mask (its
    ``sdpa_mask``, with the layer's causal or sliding-window rule and the cache offsets), which
    :func:`flexpack_attention_forward` then applies as is: generation matches ``sdpa``.
    """
    model = mixers.adapt_caller(kwargs.get("config"))  # per-document state for mixers
    if model is not None:  # the model's first forward
        _warn_router_aux_loss(model, mixers.call_sources(model))
    _mixers_check.check_call(None)  # models whose attention never calls flexpack's are refused here
    whole_rows = q_length is None or (q_length == kv_length and not q_offset and not kv_offset)
    if whole_rows:
        rule = kwargs.get("mask_function")
        if rule is not None and _has_overlay(rule):
            # transformers' own rule lets some tokens see later ones (Gemma 3's image blocks,
            # PaliGemma's prefix, bidirectional configs): the attention composes it with the
            # documents instead of re-deriving it. The rule rides on a (B, S) padding mask of
            # our own (a plain tensor to transformers, which may hand it on to an inner model).
            return _marked_padding(attention_mask, kv_length, kwargs, _flexpack_rule=rule)
        if hasattr(attention_mask, "_flexpack_rule") or hasattr(attention_mask, "_flexpack_causal"):
            return attention_mask  # an outer model's mask function already said (PaliGemma's)
        bidirectional = getattr(kwargs.get("config"), "use_bidirectional_attention", False)
        if bidirectional and _calls(rule, "causal"):
            # a causal mask for layers whose is_causal is False (PaliGemma's Gemma without
            # token types, Gemma configs with the flag): transformers' mask wins, as on eager
            return _marked_padding(attention_mask, kv_length, kwargs, _flexpack_causal=True)
        return attention_mask
    from transformers.masking_utils import sdpa_mask

    kwargs.pop("allow_is_causal_skip", None)
    return sdpa_mask(
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        allow_is_causal_skip=False,  # always a tensor: the forward tells caches by its 4 dims
        **kwargs,
    )


def _marked_padding(
    attention_mask: Tensor | None, kv_length: int, kwargs: dict[str, Any], **marks: Any
) -> Tensor:
    """A (B, KV) bool padding mask of our own carrying ``marks`` as attributes for the
    attention (transformers hands it on as a plain tensor)."""
    if attention_mask is None:
        B, device = kwargs.get("batch_size"), kwargs.get("device")
        pad = torch.ones(B, kv_length, dtype=torch.bool, device=device)
    else:
        pad = attention_mask.to(dtype=torch.bool, copy=True)
    for name, value in marks.items():
        setattr(pad, name, value)
    return pad


def _wraps(fn: Any, found: Any, depth: int = 0) -> bool:
    """Whether ``found(qualname)`` holds for transformers' mask function ``fn`` or a function
    its closures hold (``and_masks`` / ``or_masks`` wrap theirs), six levels deep at most."""
    if depth > 6 or not callable(fn):
        return False
    if found(getattr(fn, "__qualname__", "")):
        return True
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            inner = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        items = inner if isinstance(inner, (tuple, list)) else (inner,)
        if any(_wraps(x, found, depth + 1) for x in items):
            return True
    return False


def _calls(fn: Any, word: str) -> bool:
    """Whether transformers' mask function is, or wraps, one whose name has ``word`` and not
    "bidirectional" (``causal_mask_function``, ``sliding_window_causal_mask_function``)."""
    return _wraps(fn, lambda name: word in name and "bidirectional" not in name)


def _has_overlay(fn: Any) -> bool:
    """Whether transformers' mask function has an ``or_masks`` overlay (anything that lets a
    query see beyond causal/sliding/chunked: image blocks, a bidirectional prefix)."""
    return _wraps(fn, lambda name: "or_masks" in name)


def _rule_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    doc_ids: Tensor,
    rule: Any,
    *,
    scale: float | None,
    softcap: float | None,
    sinks: Tensor | None,
) -> Tensor:
    """transformers' mask rule & the documents, one SDPA call per document.

    The rule is evaluated on row indices (as transformers does for the row), on each document's
    own block only: a document costs its L x L, in the rule's evaluation as in the attention.

    Returns:
        (B, Hq, S, D); padding queries give 0.
    """
    from flexpack._attention_sdpa import per_document_sdpa

    attend = None
    if sinks is not None:
        from flexpack._attention_sinks import dense_sink_attention

        def attend(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
            return dense_sink_attention(q, k, v, allowed, sinks, scale=scale, softcap=softcap)

    return per_document_sdpa(
        query, key, value, doc_ids, causal=False, scale=scale,
        enable_gqa=key.shape[1] != query.shape[1], softcap=softcap, mask_mod=rule, attend=attend,
    )  # fmt: skip


def packed_forward_kwargs(batch: Any, *, labels: bool = False, model: Any = None) -> dict[str, Any]:
    """Keyword arguments for a transformers model call on a flexpack ``PackedBatch`` or
    ``TreeBatch``.

    Args:
        batch: a ``PackedBatch`` (or anything with ``input_ids``, ``position_ids`` and ``doc_ids``,
            each (R, S)), or a ``TreeBatch`` of prefix trees (``flexpack.pack_trees``; anything
            with ``segment_ids`` and a ``mask()``): its rows go with their tree ``flexpack_mask``.
        labels: also pass ``batch.labels`` (HF-style unshifted, -100 on padding and on the first
            token of every document), so the model's own loss is the mean over supervised tokens.
            Document rows only (a ``TreeBatch`` scores rollouts with ``gather_logps``).
        model: the model the kwargs are for (recommended; needed for trees). With it, flexpack
            can see models whose forward never reaches its attention or mask function: pure SSMs
            and recurrences (RWKV, Mamba, Mamba2, Falcon-Mamba, xLSTM) get their mixers adapted
            (:func:`flexpack.mixers.adapt`), so they read the rows' documents or trees, models
            whose attention is their own code (GPT-1, XLM, CPM-Ant) are refused with a
            ValueError. Without it those families see the documents of a row run into each
            other (docs/supported_models.md lists them). A model with attention that is not
            flexpack's (any other ``attn_implementation`` ignores ``doc_ids`` and
            ``flexpack_mask``): a ``UserWarning`` on document rows, a ValueError on trees. Load
            it with ``attn_implementation=register()``.

    Returns:
        Document rows: ``{"input_ids": (R, S) int64, "position_ids": (R, S) int64, "doc_ids":
        (R, S) int32, "use_cache": False}`` plus ``"labels"`` when asked, and
        ``"attention_mask"`` (R, S) int64 (1 = real token) for a ``model`` whose forward adds an
        MoE router loss (so it leaves padding out, as unpacked training does). Trees:
        ``{"input_ids": (R, S) int64, "position_ids": (R, S) int64, "flexpack_mask":
        batch.mask(), "use_cache": False}`` (a ``Mask``: attention builds its ``BlockMask``
        once per forward, and recurrent mixers read the tree from it). Use as
        ``model(**kwargs)``.

    Raises:
        TypeError: ``batch`` lacks one of the tensors, or ``labels=True`` for a ``TreeBatch``.
        ValueError: ``model`` has a token mixer flexpack cannot keep exact on packed rows
            (the message names it); a ``TreeBatch`` for a ``model`` with attention that is not
            flexpack's (it would ignore the tree: each rollout would see its siblings).

    Example:
        >>> import types, torch
        >>> from flexpack.integrations.transformers import packed_forward_kwargs
        >>> b = types.SimpleNamespace(input_ids=torch.tensor([[5, 6, 7, 0]]),
        ...     position_ids=torch.tensor([[0, 1, 0, 0]]), doc_ids=torch.tensor([[0, 0, 1, -1]]))
        >>> sorted(packed_forward_kwargs(b))
        ['doc_ids', 'input_ids', 'position_ids', 'use_cache']
        >>> import flexpack
        >>> trees = flexpack.pack_trees([([5, 6, 7], [[8, 9], [4]])], max_len=8)
        >>> sorted(packed_forward_kwargs(trees))
        ['flexpack_mask', 'input_ids', 'position_ids', 'use_cache']
    """
    if _is_tree_batch(batch):
        return _tree_forward_kwargs(batch, labels=labels, model=model)
    if model is not None:
        multimodal.warn_without_flexpack_attention(model, "packed_forward_kwargs")
        _prepare(model)
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
    if model is not None and _aux_loss_on(model):  # the router's loss leaves padding out
        kwargs["attention_mask"] = (batch.doc_ids >= 0).long()
    return kwargs


def _is_tree_batch(batch: Any) -> bool:
    """A ``TreeBatch`` (or its duck): prefix-tree rows, no ``doc_ids``."""
    return isinstance(getattr(batch, "segment_ids", None), Tensor) and callable(
        getattr(batch, "mask", None)
    )


def _tree_forward_kwargs(batch: Any, *, labels: bool, model: Any) -> dict[str, Any]:
    """:func:`packed_forward_kwargs` for prefix-tree rows: refuse a model that would ignore
    their mask, adapt its recurrent / conv mixers (they read the tree from the model call's
    ``flexpack_mask``), then the kwargs."""
    if labels:
        raise TypeError(
            "packed_forward_kwargs(labels=True) needs document rows with labels; got a "
            f"{type(batch).__name__} of prefix trees, which has none. Score its rollouts from "
            "the logits with batch.gather_logps(logits) (and flexpack.trees.grpo_loss / "
            "sequence_logps)."
        )
    if model is not None:
        _refuse_unread_tree(model)
        _prepare(model)
    names = ["input_ids", "position_ids"]
    missing = [n for n in names if not isinstance(getattr(batch, n, None), Tensor)]
    if missing:
        raise TypeError(
            f"packed_forward_kwargs needs a TreeBatch (tensors {names} and mask()); got a "
            f"{type(batch).__name__} without {missing}. Build one with flexpack.pack_trees."
        )
    return {
        "input_ids": batch.input_ids.long(),
        "position_ids": batch.position_ids.long(),
        # A Mask, not a BlockMask: recurrent mixers read the tree from it, and the attention
        # builds its BlockMask once per forward (padded to a bucket length on the flex path).
        "flexpack_mask": batch.mask(),
        "use_cache": False,
    }


def _refuse_unread_tree(model: Any) -> None:
    """A tree ``flexpack_mask`` reaches a model's attention only through flexpack's attention
    function; any other implementation takes it into its ``**kwargs`` and attends causally
    across the whole row (each rollout sees its siblings, silently). Models without attention
    (RWKV, Mamba, xLSTM) read it through their adapted mixers instead."""
    inner = _inner_model(model)
    if multimodal._runs_flexpack_attention(inner) is not False:
        return  # flexpack's attention, or not a transformers model (flexpack cannot tell)
    if isinstance(inner, torch.nn.Module) and not _mixers_check.has_attention(inner):
        return
    config = inner.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    raise ValueError(
        f"packed_forward_kwargs: this {type(inner).__name__} runs "
        f"attn_implementation={text._attn_implementation!r}, which ignores flexpack_mask: each "
        "rollout of the tree rows would attend to its siblings (log-probs silently wrong). Load "
        "it with attn_implementation=flexpack.integrations.transformers.register(), or switch "
        "this instance with model.set_attn_implementation(register()) before the call."
    )


def _inner_model(model: Any) -> Any:
    """The transformers model inside DDP / FSDP1 (``.module``) and PEFT wrappers."""
    inner = getattr(model, "module", model)  # DDP / FSDP1 wrappers
    base = getattr(inner, "get_base_model", None)  # PEFT
    return base() if callable(base) else inner


def _prepare(model: Any) -> None:
    """What ``packed_forward_kwargs(model=...)`` does to the model before its rows run: adapt
    its recurrent / conv mixers, refuse what cannot be exact."""
    inner = _inner_model(model)
    if isinstance(inner, torch.nn.Module):
        mixers.adapt(inner)
        _mixers_check.check(inner)


_aux_warned: weakref.WeakSet = weakref.WeakSet()


def _packed(sources: dict[str, Any] | None) -> bool:
    """Whether a call's sources describe packed rows (doc_ids, seq_idx or restarting positions)."""
    if sources is None:
        return False
    if any(isinstance(sources.get(k), Tensor) for k in ("doc_ids", "seq_idx")):
        return True
    pos = sources.get("position_ids")
    if not isinstance(pos, Tensor) or pos.shape[-1] < 2:
        return False
    pos = pos[0] if pos.dim() == 3 else pos
    return bool((pos[..., 1:] - pos[..., :-1] != 1).any())


def _aux_loss_on(model: Any) -> bool:
    """Whether ``model``'s forward adds the router's load-balancing loss (MoE models)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "output_router_logits", False):
        return False
    coef = getattr(text, "router_aux_loss_coef", None)
    return coef is None or bool(float(coef))


def _warn_router_aux_loss(model: torch.nn.Module, sources: dict[str, Any] | None) -> None:
    """Once per model: an MoE model whose forward adds the router's load-balancing loss
    (``output_router_logits``) on packed rows without an ``attention_mask`` marking their
    padding pools the padding tokens into it."""
    if model in _aux_warned or not model.training or not _aux_loss_on(model):
        return
    if not _packed(sources) or isinstance(sources.get("attention_mask"), Tensor):
        return  # padding marked: the loss is over the rows' real tokens, as unpacked
    _aux_warned.add(model)
    warnings.warn(
        f"flexpack: {type(model).__name__} returns an MoE auxiliary loss "
        "(config.output_router_logits=True): transformers computes the router's "
        "load-balancing loss over every token of the packed rows, their padding included, "
        "where unpacked training leaves padding out (the language-model loss is exact). Pass "
        "attention_mask=(doc_ids >= 0).long() with the rows (packed_forward_kwargs(batch, "
        "model=model) and flexpack's SFTTrainer do), or set output_router_logits=False (or "
        "router_aux_loss_coef=0) to train without it.",
        UserWarning,
        stacklevel=3,
    )


def packed_causal_lm_loss(
    model: Any,
    inputs: Any,
    *,
    reduction: str = "token",
    chunk_size: int | None = None,
) -> Tensor:
    """The packed loss of a transformers causal LM, without its (B, S, V) logits.

    Runs the model's backbone (``model.base_model``) to the last hidden states and hands them
    with the LM head (``model.get_output_embeddings()``: weight and bias) and the config's
    ``final_logit_softcapping`` to :func:`flexpack.packed_linear_cross_entropy`. Equal to
    ``flexpack.packed_cross_entropy(model(**inputs).logits, labels, doc_ids)`` (and, for
    ``reduction="token"`` on flexpack rows, to the model's own ``loss``), gradients included.
    The documents come from the inputs as the attention finds them: ``doc_ids``, ``seq_idx``,
    or the ``position_ids`` rule, with a 2-D ``attention_mask`` marking padding.

    Use it where the loss is computed: a training loop (``loss = packed_causal_lm_loss(model,
    batch)``), or a Trainer subclass's ``compute_loss`` (docs/loss.md). A PEFT model works (its
    adapters stay active); a DDP/FSDP wrapper must be unwrapped by the caller's own forward
    (its gradient hooks run only through the wrapper's ``forward``), so it is refused.

    Args:
        model: a ``...ForCausalLM`` (or PEFT model of one) built with
            ``attn_implementation=register()``.
        inputs: a ``PackedBatch``, or the model call's keyword arguments with ``labels`` (e.g.
            ``packed_forward_kwargs(batch, labels=True)``, a Trainer/TRL batch).
        reduction: "token" (mean over supervised tokens) or "document" (mean of per-document
            means).
        chunk_size: tokens per chunk of the head; None picks one from the shapes.

    Returns:
        0-d float32 tensor (float64 for a float64 model).

    Raises:
        TypeError: no ``labels``, or a model without a backbone and an output head.
        ValueError: a model that scales its logits (``logit_scale``, ``logits_scaling``, ...),
            a DDP/FSDP wrapper, or what :func:`flexpack.packed_linear_cross_entropy` rejects.

    Example:
        >>> from flexpack.integrations.transformers import packed_causal_lm_loss
        >>> import flexpack, transformers                                      # doctest: +SKIP
        >>> model = transformers.LlamaForCausalLM(config)                      # doctest: +SKIP
        >>> batch = flexpack.pack_sequences(samples, max_len=4096)             # doctest: +SKIP
        >>> packed_causal_lm_loss(model, batch).backward()                     # doctest: +SKIP
    """
    from flexpack.loss import packed_linear_cross_entropy

    if not isinstance(inputs, dict):
        inputs = packed_forward_kwargs(inputs, labels=True)
    inputs = dict(inputs)
    labels = inputs.pop("labels", None)
    if not isinstance(labels, Tensor):
        raise TypeError(
            f"packed_causal_lm_loss needs labels: a PackedBatch or the model's keyword arguments "
            f"with a 'labels' tensor, got keys {sorted(inputs)}; use "
            "packed_forward_kwargs(batch, labels=True)."
        )
    for name in ("num_items_in_batch", "return_dict", "logits_to_keep"):
        inputs.pop(name, None)
    wrapper = next(
        (c.__name__ for c in type(model).__mro__
         if c.__name__ in ("DistributedDataParallel", "FullyShardedDataParallel")),
        None,
    )  # fmt: skip
    if wrapper is not None:
        raise ValueError(
            f"packed_causal_lm_loss got a {wrapper}; its gradient hooks run only through the "
            "wrapper's own forward. Pass model.module inside a forward the wrapper runs, or train "
            "without the wrapper (FSDP2's fully_shard keeps the model itself: pass it)."
        )
    # The model is known here, even when the inputs came from a collator that never saw it:
    # adapt its mixers, refuse what cannot be exact (pure SSMs, GPT-1 / XLM / CPM-Ant).
    _prepare(model)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    backbone = getattr(inner, "base_model", None)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if backbone is None or backbone is inner or head is None:
        raise TypeError(
            f"packed_causal_lm_loss needs a transformers causal LM with a backbone "
            f"(base_model) and an output head (get_output_embeddings()), got "
            f"{type(model).__name__}; compute the logits and use flexpack.packed_cross_entropy."
        )
    config = inner.config.get_text_config()
    for name in ("logit_scale", "logits_scaling", "output_multiplier", "lm_head_multiplier"):
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise ValueError(
                f"{type(inner).__name__} scales its logits ({name}={getattr(config, name)}), "
                "which packed_causal_lm_loss does not apply; compute the logits and use "
                "flexpack.packed_cross_entropy."
            )
    inputs["use_cache"] = False
    hidden = backbone(**inputs).last_hidden_state  # (B, S, C)
    B, S = hidden.shape[:2]
    doc_ids = _doc_ids_from_sources(
        B, S, inputs.get("attention_mask"), inputs.get("doc_ids"), inputs.get("seq_idx"),
        inputs.get("position_ids"),
    ).to(hidden.device)  # fmt: skip
    return packed_linear_cross_entropy(
        hidden, head.weight, labels.to(hidden.device).long(), doc_ids, reduction=reduction,
        bias=head.bias, softcap=getattr(config, "final_logit_softcapping", None),
        chunk_size=chunk_size,
    )  # fmt: skip


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
        key: (B, Hkv, KV, D); Hkv may divide Hq (GQA). KV = S for whole rows (training); with
            a KV cache (generation) KV >= S and the queries are the last S positions.
        value: (B, Hkv, KV, D).
        attention_mask: None, a (B, S) padding mask (True = real token) from ``register``'s mask
            function, or with a KV cache transformers' own (B, 1, S, KV) mask (applied as is,
            so decoding matches ``sdpa``).
        scaling: softmax scale; default ``D ** -0.5``.
        dropout: must be 0 (flexpack attention has no dropout).
        **kwargs: the model call's keywords; read: ``doc_ids`` (B, S) int, ``seq_idx`` (B, S) int,
            ``position_ids`` (B or 1, S) int, ``is_causal``, ``sliding_window``, ``softcap``
            (attention-logit soft-capping, Gemma 2), ``flexpack_backend`` (the
            ``flexpack.attention`` backend, default "auto"), ``flexpack_mask``: a prebuilt
            flexpack Mask or BlockMask used by every layer (e.g. ``flexpack.pack_trees(...)
            .mask().block_mask()``, with the batch's ``position_ids``); on a sliding-window
            layer the window is composed with it (for a tree, in positions along each path),
            and ``image_span_ids`` (B, S) (Gemma 3 rows of ``pack_multimodal``: one image's
            tokens attend both ways), ``s_aux`` (Hq,) attention-sink logits (gpt-oss). Calls
            from a vision tower (module with a vision config) run as transformers' ``sdpa``.
            Value heads of another width than q/k heads (MLA) are padded to the same width;
            chunked-attention layers (Llama 4's ``attention_chunk_size``) get document &
            causal & same chunk, chunks counted from each document's start.

    Returns:
        ``(attn_output, None)``, attn_output (B, S, Hq, D) as transformers expects.

    Raises:
        ValueError: ``flexpack_mask`` with a KV cache, a tree ``flexpack_mask`` on a
            sliding-window layer without ``position_ids``, a foreign BlockMask on a
            sliding-window layer, dropout, document ids of the wrong shape, or a model flexpack
            cannot keep exact on packed rows (a recurrent, conv or sparse-indexer token mixer,
            its own attention code or a 4-D attention bias: see ``_mixers_check``).

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
    _mixers_check.check_call(module)  # refuse, by name, what packed rows cannot keep exact
    _refuse_length_dependent_rope(module, query.shape[2], kwargs)
    if value.shape[-1] != query.shape[-1]:  # MLA: value heads of another width than q/k heads
        return _mla_attention(module, query, key, value, attention_mask, scaling, dropout, kwargs)
    B, Hq, S, _ = query.shape
    if dropout and module.training:
        raise ValueError(
            f"flexpack attention has no dropout, got dropout={dropout}; set the config's "
            f"{_dropout_field(module, dropout)} to 0.0 (or call model.eval())."
        )
    for unsupported in ("position_bias",):
        if kwargs.get(unsupported) is not None:
            raise ValueError(
                f"flexpack attention does not support `{unsupported}` (this model passes it); "
                "use attn_implementation='flex_attention' or 'eager' for this model."
            )
    rule = getattr(attention_mask, "_flexpack_rule", None)  # see _pass_padding_mask
    _refuse_attention_bias(module, attention_mask, key.shape[2] == S)
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if getattr(attention_mask, "_flexpack_causal", False):
        is_causal = True  # the model built a causal mask (see flexpack's mask function)
    window = kwargs.get("sliding_window")
    config = getattr(module, "config", None)
    if window is not None and not is_causal and getattr(config, "use_bidirectional_attention", 0):
        # transformers derives this window from the config's (sliding_window // 2 + 1 for
        # Gemma 3), so the number would match nothing the user set: name the flag instead
        raise ValueError(
            f"this {type(module).__name__} runs bidirectional sliding-window attention "
            "(the config has use_bidirectional_attention=True), which flexpack does not "
            "support: only causal sliding windows are. Load the model with "
            "use_bidirectional_attention=False, or with attn_implementation='sdpa'."
        )
    softcap = kwargs.get("softcap")
    mask = kwargs.get("flexpack_mask")  # a prebuilt mask (e.g. a TreeBatch's) wins
    cached = key.shape[2] != S or (isinstance(attention_mask, Tensor) and attention_mask.dim() == 4)
    if cached:
        if mask is not None:
            raise ValueError(
                f"flexpack_mask describes whole rows, but got {S} queries against "
                f"{key.shape[2]} keys (a KV cache); drop flexpack_mask (or use_cache=False)."
            )
        out = _cache_attention(query, key, value, attention_mask, scaling, bool(is_causal),
                               window, softcap, kwargs.get("s_aux"))  # fmt: skip
        return out.transpose(1, 2).contiguous(), None  # (B, S, Hq, D)
    backend = kwargs.get("flexpack_backend", "auto")
    if mask is not None and window is not None:
        # the layer's positions, else the model call's (RecurrentGemma's attention hands none)
        positions = kwargs.get("position_ids")
        positions = positions if positions is not None else _sources(module, S, kwargs)[2]
        mask = _windowed(mask, int(window), positions, query.device)
        if isinstance(mask, _WindowedTree) and kwargs.get("s_aux") is not None:
            out = _windowed_tree_sinks(query, key, value, mask, kwargs["s_aux"], scaling, softcap)
            return out.transpose(1, 2).contiguous(), None
        if isinstance(mask, _WindowedTree):
            out = _windowed_tree_attention(
                query, key, value, mask, scale=scaling, enable_gqa=key.shape[1] != Hq,
                softcap=softcap, backend=backend,
            )  # fmt: skip
            return out.transpose(1, 2).contiguous(), None
    # Gemma 3 rows of pack_multimodal: the span mask carries the layer's window itself
    if mask is None and kwargs.get("image_span_ids") is not None:
        mask = multimodal._image_span_mask(
            query.device, B, S, attention_mask, kwargs, bool(is_causal)
        )
    doc_ids, seq_idx, position_ids = _sources(module, S, kwargs)
    if mask is None and rule is not None:
        ids = _doc_ids_from_sources(B, S, attention_mask, doc_ids, seq_idx, position_ids)
        ids = ids.to(query.device)
        out = _rule_attention(query, key, value, ids, rule, scale=scaling, softcap=softcap,
                              sinks=kwargs.get("s_aux"))  # fmt: skip
        return out.transpose(1, 2).contiguous(), None
    if mask is None:
        chunk = _attention_chunk(module)
        mask = _mask_for(
            query.device,
            B,
            S,
            attention_mask,
            doc_ids,
            seq_idx,
            position_ids,
            bool(is_causal),
            kwargs.get("sliding_window"),
            chunk,
        )
    sinks = kwargs.get("s_aux")
    if sinks is not None:  # gpt-oss: one sink logit per head in every softmax
        from flexpack._attention_sinks import sink_attention

        out = sink_attention(
            query, key, value, mask, sinks, scale=scaling, enable_gqa=key.shape[1] != Hq,
            softcap=softcap, backend=backend,
        )  # fmt: skip
        return out.transpose(1, 2).contiguous(), None
    out = attention(
        query, key, value, mask, scale=scaling, enable_gqa=key.shape[1] != Hq,
        softcap=softcap, backend=backend,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None  # (B, S, Hq, D)


# RoPE types whose frequencies transformers picks per call from max(position_ids) + 1
# (modeling_rope_utils.dynamic_rope_update): on a packed row, from its longest document.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def length_dependent_rope(config: Any) -> str | None:
    """The config's RoPE type when transformers rescales it per call by the call's longest
    position ("dynamic" and the types named after it, "longrope"), else None."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict):
        return None
    found = [v for v in rope.values() if isinstance(v, dict)] or [rope]  # per layer type
    for params in found:
        kind = params.get("rope_type", params.get("type"))
        if isinstance(kind, str) and any(k in kind for k in LENGTH_DEPENDENT_ROPE):
            return kind
    return None


def _refuse_length_dependent_rope(module: torch.nn.Module, S: int, kwargs: dict[str, Any]) -> None:
    """A packed call of a model whose RoPE depends on the call's longest position: a short
    document packed beside a long one would get other rotary frequencies than alone."""
    config = getattr(module, "config", None)
    kind = length_dependent_rope(config)
    if kind is None:
        return
    doc_ids, seq_idx, position_ids = _sources(module, S, kwargs)
    if not _packed({"doc_ids": doc_ids, "seq_idx": seq_idx, "position_ids": position_ids}):
        return
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    limit = rope.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None
    ) or getattr(config, "max_position_embeddings", None)  # fmt: skip
    raise ValueError(
        f"flexpack cannot keep this {getattr(config, 'model_type', type(module).__name__)} model "
        f"exact on packed rows: its RoPE is rope_type={kind!r}, which transformers rescales for a "
        "whole call from its longest position (max(position_ids) + 1), so a document packed "
        f"beside one longer than {limit} tokens gets other rotary frequencies than it gets "
        "alone. Load it with a RoPE fixed per model (rope_type 'default', 'linear' or 'yarn'), "
        "or train it unpacked (one sample per row) with attn_implementation='sdpa'."
    )


def _sources(module: torch.nn.Module, S: int, kwargs: dict[str, Any]) -> tuple:
    """(doc_ids, seq_idx, position_ids) of this layer's call: its own keywords, or, when they
    carry none, the model call's (recorded by flexpack.mixers' pre-hook: Llama 4's decoder layer
    and ZAYA's model never hand ``position_ids`` to attention). Sources of another length than
    the queries' S are not this sequence's and are left out."""
    own = tuple(kwargs.get(k) for k in ("doc_ids", "seq_idx", "position_ids"))
    if any(v is not None for v in own):
        return own
    found = mixers.call_sources(module)
    if found is None:  # a forward that never called the mask function (5.17's Moshi without an
        # attention_mask): the model on the call stack gets its pre-hook now, and this call's
        # sources from its frame
        mixers.adapt_caller(getattr(module, "config", None))
        found = mixers.call_sources(module)
    found = found or {}
    picked = []
    for name in ("doc_ids", "seq_idx", "position_ids"):
        t = found.get(name)
        picked.append(t if isinstance(t, Tensor) and t.dim() >= 1 and t.shape[-1] == S else None)
    return tuple(picked)


_DROPOUT_FIELDS = (
    "attention_dropout",
    "attn_pdrop",
    "attention_probs_dropout_prob",
    "attn_dropout",
)


def _dropout_field(module: Any, dropout: float) -> str:
    """The config field that holds this module's attention dropout (GPT-2: attn_pdrop)."""
    config = getattr(module, "config", None)
    for name in _DROPOUT_FIELDS:
        if getattr(config, name, None) == dropout:
            return name
    return next((n for n in _DROPOUT_FIELDS if hasattr(config, n)), "attention dropout")


def _refuse_attention_bias(module: torch.nn.Module, mask: Tensor | None, whole_rows: bool) -> None:
    """A 4-D float mask on whole rows that is more than allowed / not allowed (0 / -inf) is a
    bias the model computed itself (Doge's dynamic mask, ALiBi): flexpack's masks cannot carry
    it, so it would be dropped."""
    if not (whole_rows and isinstance(mask, Tensor) and mask.dim() == 4):
        return
    if mask.is_floating_point() and bool(
        ((mask != 0) & (mask > torch.finfo(mask.dtype).min / 2)).any()
    ):
        raise ValueError(
            f"{type(module).__name__} passes flexpack attention its own 4-D attention bias (values "
            "other than 0 and -inf, e.g. a dynamic mask or ALiBi); flexpack attention cannot add "
            "it, so packed rows would not be exact. Run this model unpacked with "
            "attn_implementation='sdpa'."
        )


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
    chunk: int | None = None,
):
    """The flexpack mask of this forward, built once per (is_causal, window, chunk) for all
    layers."""
    sources = (padding, doc_ids, seq_idx, position_ids)
    # Stamps of the source tensors (identity, version, storage, CPU content: see _tensor_cache)
    # say whether this forward's inputs are the cached ones.
    key, cache = (device, B, S), _cache.get()
    if cache.get("key") != key or not all_match(cache.get("sources"), sources):
        ids = _doc_ids_from_sources(B, S, padding, doc_ids, seq_idx, position_ids).to(device)
        cache.clear()
        cache.update(key=key, sources=stamps(sources), ids=ids, masks={})
    masks = cache["masks"]
    mask_key = (is_causal, sliding_window) if chunk is None else (is_causal, sliding_window, chunk)
    if mask_key not in masks:
        ids = cache["ids"] if chunk is None else _chunk_ids(cache["ids"], chunk)
        masks[mask_key] = _build_mask(ids, is_causal, sliding_window)
    return masks[mask_key]


def _attention_chunk(module: torch.nn.Module) -> int | None:
    """The chunk size of a chunked-attention layer (Llama 4's ``attention_chunk_size`` on its
    ``"chunked_attention"`` layers), else None."""
    if not _mixers_check._chunked_attention(module):
        return None
    return int(module.config.attention_chunk_size)


def _chunk_ids(doc_ids: Tensor, chunk: int) -> Tensor:
    """(B, S) ids of the (document, chunk) pieces: Llama 4's chunked attention keeps a query on
    the keys of its own chunk, chunks counted from the document's start (as the document alone
    sees them). Each piece is then a document of its own: document & causal, per-piece kernels.
    """
    from flexpack.models.gpt import _positions_in_documents

    ids = doc_ids.long()
    pieces = ids.shape[1] // chunk + 2  # chunks per document, at most
    within = _positions_in_documents(ids) // chunk
    return torch.where(ids >= 0, ids * pieces + within, -1)


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


# ----------------------------------------------------------------------------- KV caches


def _cache_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None,
    is_causal: bool,
    window: int | None,
    softcap: float | None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Attention of Q queries against KV >= Q cached keys (generation), as transformers' sdpa.

    The mask is transformers' own (B, 1, Q, KV) mask from :func:`_pass_padding_mask` when the
    model built one; otherwise (a direct call) the queries are the last Q positions of the keys:
    causal with that offset, a 2-D (B, KV) padding mask and the sliding window applied.

    Returns:
        (B, Hq, Q, D); queries with no allowed key (left padding) give 0.
    """
    from flexpack._attention_sdpa import dense_sdpa

    Hq, Q = query.shape[1], query.shape[2]
    KV = key.shape[2]
    if isinstance(attention_mask, Tensor) and attention_mask.dim() == 4:
        allowed = attention_mask
        if allowed.dtype != torch.bool:  # an additive float mask: 0 where allowed
            allowed = allowed > torch.finfo(allowed.dtype).min / 2
        allowed = allowed[..., -KV:]
    else:
        q_pos = torch.arange(KV - Q, KV, device=query.device)[:, None]  # (Q, 1)
        k_pos = torch.arange(KV, device=query.device)[None, :]  # (1, KV)
        allowed = (k_pos <= q_pos) if is_causal else torch.ones_like(k_pos <= q_pos)
        if window is not None:  # transformers' rule: kv > q - window
            allowed = allowed & (q_pos - k_pos < int(window))
        allowed = allowed[None, None]  # (1, 1, Q, KV)
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[-1] < KV:
                raise ValueError(
                    f"flexpack attention with a KV cache takes a (B, >= {KV}) padding "
                    f"attention_mask or transformers' 4-D mask, got {tuple(attention_mask.shape)}."
                )
            pad = attention_mask[:, -KV:].to(device=query.device, dtype=torch.bool)
            allowed = allowed & pad[:, None, None, :]
    if sinks is not None:
        from flexpack._attention_sinks import dense_sink_attention

        return dense_sink_attention(
            query, key, value, allowed.to(query.device), sinks, scale=scaling, softcap=softcap
        )
    return dense_sdpa(
        query, key, value, allowed.to(query.device), scale=scaling,
        enable_gqa=key.shape[1] != Hq, softcap=softcap,
    )  # fmt: skip


def _mla_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> tuple[Tensor, None]:
    """Multi-head latent attention (DeepSeek-V3, Kimi K2): values Dv wide, queries and keys Dqk.

    Zero columns do not change a dot product or a weighted sum: the narrower of (q, k) and v is
    zero-padded to the wider, the call runs with equal head dims on any path, and the output
    keeps its first Dv columns. The scale stays Dqk's."""
    Dqk, Dv = query.shape[-1], value.shape[-1]
    scaling = Dqk**-0.5 if scaling is None else scaling
    if Dv < Dqk:
        value = torch.nn.functional.pad(value, (0, Dqk - Dv))
    else:
        query, key = (torch.nn.functional.pad(x, (0, Dv - Dqk)) for x in (query, key))
    out, _ = flexpack_attention_forward(
        module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
    )
    return out[..., :Dv], None


# ------------------------------------------------------------- windows on prebuilt masks


class _WindowedTree:
    """A tree mask and a sliding window counted in positions along each root-to-leaf path.

    transformers' sliding window keeps keys with ``q_idx - kv_idx < window`` on the indices of the
    sequence run alone; in a tree those indices are the ``position_ids`` (a segment starts where
    its parent ends), so a token sees the ancestors and own tokens within ``window`` positions.
    """

    def __init__(self, tree: Any, window: int, position_ids: Tensor) -> None:
        self.tree, self.window, self.position_ids = tree, window, position_ids
        self.stamp = Stamp(position_ids)  # reused while the same, unmodified position_ids
        self.pieces: Any = None  # per-segment SDPA pieces with the window, built on first use
        self.block_mask: Any = None  # the flex BlockMask, built on first use


_window_caches = PerThread()


def _windowed(mask: Any, window: int, position_ids: Tensor | None, device: torch.device) -> Any:
    """A prebuilt ``flexpack_mask`` composed with the layer's sliding window."""
    from torch.nn.attention.flex_attention import BlockMask

    from flexpack import masks

    recovered = masks.mask_of(mask) if isinstance(mask, BlockMask) else mask
    if recovered is None or not hasattr(recovered, "kind"):
        raise ValueError(
            f"this layer has a sliding window ({window}) but flexpack_mask is a "
            f"{type(mask).__name__} that flexpack cannot compose a window with; pass a flexpack "
            "Mask (e.g. flexpack.pack_trees(...).mask()) or a BlockMask built from one."
        )
    if recovered.kind != "tree":
        # Document masks: positions step by one inside a document, so raw indices serve. Built
        # once per (mask, window): every sliding layer of the forward shares it.
        _window_cache = _window_caches.get()
        key = ("document", id(recovered), window)
        hit = _window_cache.get(key)
        if hit is None or hit[0] is not recovered:
            if len(_window_cache) > 8:
                _window_cache.clear()
            hit = _window_cache[key] = (recovered, recovered & masks.sliding_window(window - 1))
        return hit[1]
    if not isinstance(position_ids, Tensor):
        raise ValueError(
            f"a tree flexpack_mask on a sliding-window layer (window {window}) needs the rows' "
            "position_ids (the window counts positions along each path): pass "
            "position_ids=batch.position_ids to the model call."
        )
    _window_cache = _window_caches.get()
    key = (id(recovered), window, id(position_ids), device)
    hit = _window_cache.get(key)
    if hit is None or hit.tree is not recovered or not hit.stamp.matches(position_ids):
        if len(_window_cache) > 8:  # one forward has a window or two; old masks go
            _window_cache.clear()
        hit = _window_cache[key] = _WindowedTree(recovered, window, position_ids)
    return hit


def _windowed_tree_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: _WindowedTree,
    *,
    scale: float | None,
    enable_gqa: bool,
    softcap: float | None,
    backend: str,
) -> Tensor:
    """Tree & position window: compiled flex on CUDA, one SDPA call per segment elsewhere."""
    from flexpack import _attention_tree
    from flexpack.attention import attention

    B, _, S, _ = q.shape
    pos = mask.position_ids.to(q.device)
    if q.device.type == "cuda" and backend != "sdpa":
        if mask.block_mask is None:
            from torch.nn.attention.flex_attention import create_block_mask

            tree_mod = mask.tree.mask_mod
            rows = pos.expand(B, S).contiguous()
            limit = torch.tensor(mask.window, device=q.device)

            def tree_window(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
                near = rows[b, q_idx] - rows[b, kv_idx] < limit
                return tree_mod(b, h, q_idx, kv_idx) & near

            mask.block_mask = create_block_mask(tree_window, B, None, S, S, device=q.device)
        return attention(
            q, k, v, mask.block_mask, scale=scale, enable_gqa=enable_gqa, softcap=softcap,
            backend="flex",
        )  # fmt: skip
    if mask.pieces is None:
        mask.pieces = _window_pieces(_attention_tree.spans_of(mask.tree), pos, mask.window, B)
    return _attention_tree.per_tree_sdpa(
        q, k, v, mask.pieces, scale=scale, enable_gqa=enable_gqa, softcap=softcap
    )


def _windowed_tree_sinks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: _WindowedTree,
    sinks: Tensor,
    scale: float | None,
    softcap: float | None,
) -> Tensor:
    """Tree & position window with attention sinks: the dense twin with a sink column."""
    from flexpack._attention_sdpa import dense_mask_from_mod
    from flexpack._attention_sinks import dense_sink_attention

    B, _, S, _ = q.shape
    pos = mask.position_ids.to(q.device).expand(B, S)
    near = pos[:, None, :, None] - pos[:, None, None, :] < mask.window  # (B, 1, S, S)
    allowed = dense_mask_from_mod(mask.tree.mask_mod, B, 1, S, q.device) & near
    return dense_sink_attention(q, k, v, allowed, sinks, scale=scale, softcap=softcap)


def _window_pieces(pieces: list, position_ids: Tensor, window: int, B: int) -> list:
    """The per-segment SDPA pieces of a tree with each piece's mask cut to the window."""
    from flexpack._attention_tree import _Piece

    rows = max(len(pieces), position_ids.shape[0] if position_ids.dim() == 2 else 1)
    pos = position_ids.reshape(-1, position_ids.shape[-1]).expand(rows, -1)
    out = []
    for b in range(rows):
        row = pieces[b if len(pieces) > 1 else 0]
        starts = [0]
        for p in row:
            starts.append(starts[-1] + p.length)
        new = []
        for i, p in enumerate(row):
            if not p.path:
                new.append(p)
                continue
            keys = torch.cat([torch.arange(starts[j], starts[j] + row[j].length) for j in p.path])
            keys = keys.to(pos.device)
            pq = pos[b, starts[i] : starts[i] + p.length][:, None]  # (L_s, 1)
            pk = pos[b, keys][None, :]  # (1, A_s + L_s)
            base = p.mask
            if base is None:  # a root: causal over itself
                base = torch.ones(p.length, p.length, dtype=torch.bool, device=pos.device).tril()
            new.append(_Piece(p.length, p.path, base.to(pos.device) & (pq - pk < window)))
        out.append(new)
    return out
