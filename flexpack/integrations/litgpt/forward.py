"""A ``litgpt.GPT`` on packed rows: its forward rebuilt from its own modules, and the loss.

:func:`packed_forward` re-implements ``GPT.forward`` from the model's modules (embedding, each
block's norms, ``qkv`` / ``proj`` projections and MLP, final norm and head), with RoPE at
per-document positions and every layer's attention through :func:`flexpack.attention` under one
document-causal mask per forward (composed with LitGPT's sliding window where a layer uses it).
:func:`packed_loss` and :class:`PackedGPTLoss` take the loss from the hidden states chunk by
chunk; :class:`PackedGPT` is the module Fabric/DDP wrap. litgpt is imported inside the
functions.

Shapes: B rows, S tokens per row, C = n_embd, Hq = n_head, Hkv = n_query_groups, D = head_size,
V = padded_vocab_size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from flexpack import masks as _masks
from flexpack.attention import attention
from flexpack.models.gpt import _positions_in_documents


def _import_litgpt():
    try:
        import litgpt
        import litgpt.model
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "flexpack.integrations.litgpt needs litgpt; install it with "
            "`pip install -e '.[litgpt]'` (in a flexpack checkout) in its own virtual environment "
            "(litgpt 0.5 pins "
            "huggingface-hub<1.4, which conflicts with recent datasets/transformers)."
        ) from e
    return litgpt


# --------------------------------------------------------------------------------------- forward


@dataclass(frozen=True)
class _Masks:
    """The masks of one forward: ``full`` for global layers, ``local`` for sliding-window ones."""

    full: Any
    local: Any


def _build_masks(config: Any, doc_ids: Tensor, blocks: Sequence[nn.Module]) -> _Masks:
    """One document-causal mask per forward, and its sliding-window twin if a layer needs it.

    LitGPT's window lets query i see keys i - w + 1 .. i (w keys); ``flexpack.masks.
    sliding_window(n)`` allows ``q - kv <= n``, so LitGPT's w is ``sliding_window(w - 1)``. A
    window at least as long as the row never binds and is left out (the per-document path stays
    available). The masks stay descriptions: ``flexpack.attention`` builds a BlockMask only on
    the flex path, once per forward, and reuses its per-document (or varlen) plan across layers.
    """
    S = doc_ids.shape[1]
    full = _masks.document(doc_ids) & _masks.causal()
    local = None
    window = config.sliding_window_size
    if window is not None and any(b.attn.apply_sliding_window_attention for b in blocks):
        local = full if window >= S else full & _masks.sliding_window(int(window) - 1)
    return _Masks(full, local)


def _check_inputs(model: Any, input_ids: Tensor, doc_ids: Tensor, position_ids: Tensor | None):
    litgpt = _import_litgpt()
    if not isinstance(model, litgpt.model.GPT):
        raise TypeError(
            f"model must be a litgpt.GPT, got {type(model).__name__}; pass the model itself "
            "(for a Fabric-wrapped model, wrap the GPT in PackedGPT before fabric.setup)"
        )
    if model.config.latent_attention is not None:
        raise ValueError(
            f"model {model.config.name!r} uses multi-head latent attention "
            "(config.latent_attention), which packed_forward does not implement; use a model "
            "with CausalSelfAttention (Llama, Mistral, Gemma, Pythia, Phi, Qwen, ...)"
        )
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        got = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a (B, S) tensor, got {got}; for one row pass x[None]")
    for name, x in (("input_ids", input_ids), ("doc_ids", doc_ids), ("position_ids", position_ids)):
        if x is None:
            continue
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {x.dtype}")
        if x.dim() != 2 or x.shape != input_ids.shape:
            raise ValueError(
                f"{name} must be (B, S) like input_ids {tuple(input_ids.shape)}, got shape "
                f"{tuple(x.shape)}; for one row pass x[None]"
            )
        if x.device != input_ids.device:
            raise ValueError(
                f"{name} is on {x.device} but input_ids are on {input_ids.device}; move it with "
                f"{name}.to(input_ids.device)"
            )


def _attention_layer(
    attn: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, mask: Any, backend: str
) -> Tensor:
    """``CausalSelfAttention.forward`` without KV cache, attention through flexpack.

    x: (B, S, C); cos, sin: (B, S, rope_n_elem). Returns (B, S, C).
    """
    from litgpt.model import apply_rope, apply_rope_interleave

    cfg = attn.config
    D, Hq, Hkv = cfg.head_size, cfg.n_head, cfg.n_query_groups
    B, S, _ = x.shape
    q, k, v = attn.qkv(x).split((Hq * D, Hkv * D, Hkv * D), dim=-1)  # (B, S, H*D) each
    if cfg.norm_qk and cfg.norm_qk_type == "olmo2":
        q, k = attn.norm_q(q), attn.norm_k(k)
    q = q.view(B, S, Hq, D).transpose(1, 2)  # (B, Hq, S, D)
    k = k.view(B, S, Hkv, D).transpose(1, 2)  # (B, Hkv, S, D)
    v = v.view(B, S, Hkv, D).transpose(1, 2)  # (B, Hkv, S, D)
    if cfg.norm_qk and cfg.norm_qk_type == "default":
        q, k = attn.norm_q(q), attn.norm_k(k)
    n = cfg.rope_n_elem
    rope = apply_rope_interleave if cfg.rope_interleave else apply_rope
    q = torch.cat((rope(q[..., :n], cos, sin), q[..., n:]), dim=-1)
    k = torch.cat((rope(k[..., :n], cos, sin), k[..., n:]), dim=-1)
    # LitGPT's scale: 1/sqrt(attention_scores_scalar or head_size), times YaRN's mscale^2.
    scale = 1.0 / math.sqrt(cfg.attention_scores_scalar or D) * attn.mscale * attn.mscale
    y = attention(
        q, k, v, mask, scale=scale, enable_gqa=Hkv != Hq, backend=backend,
        softcap=cfg.attention_logit_softcapping,
    )  # fmt: skip
    y = y.transpose(1, 2).reshape(B, S, Hq * D)  # (B, S, Hq*D)
    return attn.proj(y)


def packed_forward(
    model: nn.Module,
    input_ids: Tensor,
    doc_ids: Tensor,
    *,
    position_ids: Tensor | None = None,
    backend: str = "auto",
) -> Tensor:
    """Logits of a ``litgpt.GPT`` on packed rows: every document as if it ran alone.

    Follows ``GPT.forward`` / ``Block.forward`` / ``CausalSelfAttention.forward`` (no KV cache)
    step by step with the model's own modules, so every config LitGPT's standard attention
    supports comes along: RoPE from the model's ``cos``/``sin`` cache at per-document positions
    (partial rotary, ``rope_indices`` with ``rope_local_base_freq``, interleaved RoPE),
    GQA/MQA, ``attention_scores_scalar``, ``norm_qk``, parallel residual and shared attention
    norm, post-attention/post-MLP norms, ``scale_embeddings``, the sliding window on the layers
    of ``sliding_window_indices``, attention-logit and final-logit softcapping. The masks are
    built once per call and shared by the layers. Nothing on ``model`` is modified.

    Args:
        model: a ``litgpt.GPT`` (not a Fabric wrapper: use :class:`PackedGPT` under Fabric).
        input_ids: (B, S) int token ids; any id on padding.
        doc_ids: (B, S) int document of each token within its row, -1 on padding (a
            ``PackedBatch``'s ``doc_ids``; for EOS-separated streams
            ``PackedLayout.from_eos(input_ids, eos_id).doc_ids``).
        position_ids: (B, S) int; default the per-document positions of the layout (0, 1, ...
            restarting at every document). Each must be < ``model.max_seq_length``.
        backend: passed to :func:`flexpack.attention` ("auto" picks per device and mask).

    Returns:
        (B, S, V) logits, V = ``model.config.padded_vocab_size``. At padding positions they
        are the head's output for a zero attention result: ignore them, as the loss does.

    Raises:
        TypeError: model is not a ``litgpt.GPT``; non-integer ids.
        ValueError: shapes or devices disagree; a position beyond the model's RoPE cache; a
            model with latent attention (not supported).

    Example (needs litgpt; the same check runs in tests/test_integrations_litgpt.py)::

            import torch, flexpack
            from litgpt import GPT, Config
            model = GPT(Config.from_name("pythia-14m"))
            batch = flexpack.pack_sequences([[1, 2, 3], [4, 5]], max_len=8)
            logits = packed_forward(model, batch.input_ids, batch.doc_ids)
            alone = model(batch.input_ids[:, 3:5])  # 2nd document alone
            torch.allclose(logits[0, 3:5], alone[0], atol=1e-5)
            # -> True
    """
    from litgpt.model import do_softcapping

    x = _packed_hidden(model, input_ids, doc_ids, position_ids, backend)
    logits = model.lm_head(x)  # (B, S, V)
    if model.config.final_logit_softcapping is not None:
        logits = do_softcapping(logits, model.config.final_logit_softcapping)
    return logits


def packed_loss(
    model: nn.Module,
    input_ids: Tensor,
    labels: Tensor,
    doc_ids: Tensor,
    *,
    position_ids: Tensor | None = None,
    backend: str = "auto",
    reduction: str = "token",
    chunk_size: int | None = None,
) -> Tensor:
    """The packed loss of a ``litgpt.GPT`` on packed rows, without the (B, S, V) logits.

    Equal to ``flexpack.packed_cross_entropy(packed_forward(model, input_ids, doc_ids, ...),
    labels, doc_ids, reduction=reduction)`` in value and gradients: the same forward up to the
    final norm, then :func:`flexpack.packed_linear_cross_entropy` with ``model.lm_head`` and the
    config's ``final_logit_softcapping``, chunk by chunk.

    Args:
        model, input_ids, doc_ids, position_ids, backend: as in :func:`packed_forward`.
        labels: (B, S) int64, unshifted; -100 marks positions without a target.
        reduction: "token" or "document", as in :func:`flexpack.packed_cross_entropy`.
        chunk_size: tokens per chunk of the head; None picks one from the shapes.

    Returns:
        0-d float32 tensor.

    Example (needs litgpt; tests/test_integrations_litgpt.py checks it)::

            loss = packed_loss(model, batch.input_ids, batch.labels, batch.doc_ids)
            loss.backward()
    """
    from flexpack.loss import packed_linear_cross_entropy

    x = _packed_hidden(model, input_ids, doc_ids, position_ids, backend)
    head = model.lm_head
    return packed_linear_cross_entropy(
        x, head.weight, labels, doc_ids, reduction=reduction, bias=head.bias,
        softcap=model.config.final_logit_softcapping, chunk_size=chunk_size,
    )  # fmt: skip


def _packed_hidden(
    model: nn.Module,
    input_ids: Tensor,
    doc_ids: Tensor,
    position_ids: Tensor | None,
    backend: str,
) -> Tensor:
    """(B, S, C): ``packed_forward`` up to and including the final norm ``ln_f``."""
    _check_inputs(model, input_ids, doc_ids, position_ids)
    cfg = model.config
    S = input_ids.shape[1]
    n_cached = model.cos.size(0)
    # Layout positions stay below S; positions given by the caller are checked (one host sync).
    check = position_ids is not None or S > n_cached
    if position_ids is None:  # per-document positions, computed on the device: no host sync
        position_ids = _positions_in_documents(doc_ids)
    position_ids = position_ids.long()
    if check and int(position_ids.max()) >= n_cached:
        raise ValueError(
            f"a document reaches position {int(position_ids.max())} but the model's RoPE cache "
            f"holds {n_cached} positions (model.max_seq_length={model.max_seq_length}); raise "
            f"model.max_seq_length (up to config.block_size={cfg.block_size}) or pack shorter "
            "documents"
        )
    blocks = list(model.transformer.h)
    masks = _build_masks(cfg, doc_ids, blocks)
    cos = model.cos[position_ids]  # (B, S, rope_n_elem), or (..., 2) with local base frequencies
    sin = model.sin[position_ids]

    x = model.transformer.wte(input_ids)  # (B, S, C)
    if cfg.scale_embeddings:
        x = x * torch.tensor(cfg.n_embd**0.5, dtype=x.dtype)
    for i, block in enumerate(blocks):
        if cfg.rope_indices is not None:
            c, s = cos[..., cfg.rope_indices[i]], sin[..., cfg.rope_indices[i]]
        else:
            c, s = cos, sin
        mask = masks.local if block.attn.apply_sliding_window_attention else masks.full
        # Block.forward
        x_normed = block.norm_1(x)
        h = _attention_layer(block.attn, x_normed, c, s, mask, backend)
        h = block.post_attention_norm(h)
        if cfg.parallel_residual:
            if not cfg.shared_attention_norm:
                x_normed = block.norm_2(x)
            x = h + x
        else:
            x = h + x
            x_normed = block.norm_2(x)
        x = block.post_mlp_norm(block.mlp(x_normed)) + x
    return model.transformer.ln_f(x)


class PackedGPT(nn.Module):
    """A ``litgpt.GPT`` whose ``forward`` is :func:`packed_forward`, for Fabric/DDP.

    ``fabric.setup`` wraps the module it is given; DDP synchronises gradients only through that
    module's ``forward``. Wrapping the GPT here (it stays ``self.model``, unchanged) lets the
    packed forward go through Fabric's precision context and DDP's hooks.

    Args:
        model: a ``litgpt.GPT``.
        backend: passed to :func:`flexpack.attention`.

    Example (inside a Fabric script; see docs/litgpt.md)::

            packed = fabric.setup(PackedGPT(model))
            ids, docs = batch["input_ids"], batch["doc_ids"]
            logits = packed(ids, docs, batch["position_ids"])
    """

    def __init__(self, model: nn.Module, *, backend: str = "auto") -> None:
        super().__init__()
        self.model = model
        self.backend = backend

    def forward(
        self, input_ids: Tensor, doc_ids: Tensor, position_ids: Tensor | None = None
    ) -> Tensor:
        return packed_forward(
            self.model, input_ids, doc_ids, position_ids=position_ids, backend=self.backend
        )


class PackedGPTLoss(PackedGPT):
    """A ``litgpt.GPT`` whose ``forward`` is :func:`packed_loss`, for Fabric/DDP.

    As :class:`PackedGPT`, but the forward takes the labels too and returns the packed loss,
    never the (B, S, V) logits: the head runs chunk by chunk inside the loss.

    Args:
        model: a ``litgpt.GPT``.
        backend: passed to :func:`flexpack.attention`.
        reduction: "token" or "document".
        chunk_size: tokens per chunk of the head; None picks one from the shapes.

    Example (inside a Fabric script; see docs/litgpt.md)::

            packed = fabric.setup(PackedGPTLoss(model))
            loss = packed(batch["input_ids"], batch["doc_ids"], batch["position_ids"],
                          batch["labels"])
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        backend: str = "auto",
        reduction: str = "token",
        chunk_size: int | None = None,
    ) -> None:
        super().__init__(model, backend=backend)
        self.reduction, self.chunk_size = reduction, chunk_size

    def forward(  # type: ignore[override]
        self, input_ids: Tensor, doc_ids: Tensor, position_ids: Tensor | None, labels: Tensor
    ) -> Tensor:
        return packed_loss(
            self.model, input_ids, labels, doc_ids, position_ids=position_ids,
            backend=self.backend, reduction=self.reduction, chunk_size=self.chunk_size,
        )  # fmt: skip
