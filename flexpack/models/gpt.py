"""A small GPT in plain PyTorch that trains on packed rows (nanoGPT / gpt-fast style).

Token embedding, pre-norm blocks (RMSNorm, grouped-query attention with rotary embeddings computed
from ``position_ids``, a GELU MLP), a final RMSNorm and a tied (or untied) head. On packed rows the
forward builds the mask ``document(doc_ids) & causal()`` once per batch and every layer calls
``flexpack.attention`` with it, so no token attends across a document boundary. The mask is a
description, not a BlockMask: the varlen and per-document SDPA paths never need one, and the flex
path builds it on the first layer and reuses it. Given a ``PackedLayout`` (``layout=batch.layout``)
the varlen path takes the packer's host-side ``cu_seqlens`` / ``indices`` / ``max_seqlen``: no
host sync at all. Without ``doc_ids`` it is a plain causal model
(``scaled_dot_product_attention(is_causal=True)``), the reference that each document run alone is
compared against.

Shapes: B batch rows, S tokens per row, V vocabulary, C = n_embd, Hq query heads, Hkv key/value
heads, D = C // Hq head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flexpack import _attention_flex
from flexpack.attention import attention
from flexpack.layout import PackedLayout
from flexpack.masks import causal, document

__all__ = ["GPT", "GPTConfig"]


@dataclass(frozen=True)
class GPTConfig:
    """Hyper-parameters of :class:`GPT`; the defaults are a byte-level toy model (~0.1M params).

    Attributes:
        vocab_size: V, 256 for bytes.
        n_layer: number of blocks.
        n_head: Hq, query heads.
        n_kv_head: Hkv, key/value heads; must divide ``n_head`` (GQA when smaller, MQA when 1).
        n_embd: C, model width; ``n_embd // n_head`` must be even (rotary pairs).
        mlp_ratio: hidden width of the MLP as a multiple of C.
        rope_base: rotary embedding base (theta).
        norm_eps: RMSNorm epsilon.
        tie_embeddings: share the token embedding with the output head.
        attn_backend: ``backend`` passed to ``flexpack.attention`` on packed rows.

    Example:
        >>> GPTConfig(n_head=4, n_kv_head=2, n_embd=64).head_dim
        16
    """

    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2
    n_embd: int = 64
    mlp_ratio: int = 4
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    attn_backend: str = "auto"

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(
                f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                "choose n_embd as a multiple of n_head."
            )
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}; "
                "grouped-query attention shares every key/value head by as many query heads."
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head dim n_embd // n_head = {self.head_dim} is odd; rotary embeddings rotate "
                "pairs of channels, so choose an even head dim."
            )

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_cos_sin(position_ids: Tensor, head_dim: int, base: float) -> tuple[Tensor, Tensor]:
    """cos, sin of the rotary angles, each (B, 1, S, D // 2) float32, from (B, S) positions."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=position_ids.device) / head_dim)
    angles = position_ids[:, None, :, None].float() * inv_freq  # (B, 1, S, D/2)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs (i, i + D/2) of x (B, H, S, D) by the angles; same shape out."""
    x1, x2 = x.float().chunk(2, dim=-1)  # (B, H, S, D/2) each
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        D = cfg.head_dim
        self.wq = nn.Linear(cfg.n_embd, cfg.n_head * D, bias=False)
        self.wk = nn.Linear(cfg.n_embd, cfg.n_kv_head * D, bias=False)
        self.wv = nn.Linear(cfg.n_embd, cfg.n_kv_head * D, bias=False)
        self.wo = nn.Linear(cfg.n_head * D, cfg.n_embd, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: object | None) -> Tensor:
        B, S, C = x.shape
        cfg, D = self.cfg, self.cfg.head_dim
        q = self.wq(x).view(B, S, cfg.n_head, D).transpose(1, 2)  # (B, Hq, S, D)
        k = self.wk(x).view(B, S, cfg.n_kv_head, D).transpose(1, 2)  # (B, Hkv, S, D)
        v = self.wv(x).view(B, S, cfg.n_kv_head, D).transpose(1, 2)  # (B, Hkv, S, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        gqa = cfg.n_kv_head != cfg.n_head
        if mask is None:  # one sequence per row: plain causal
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:  # packed rows: the document mask keeps every document to itself
            y = attention(q, k, v, mask, enable_gqa=gqa, backend=cfg.attn_backend)  # (B, Hq, S, D)
        y = y.transpose(1, 2).reshape(B, S, C)  # (B, S, C)
        return self.wo(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: object | None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """A decoder-only transformer whose forward takes packed rows.

    Args:
        config: the hyper-parameters; ``GPTConfig()`` is a byte-level toy model.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> model = GPT(GPTConfig(n_layer=1, n_embd=32))
        >>> model(torch.randint(0, 256, (2, 16))).shape
        torch.Size([2, 16, 256])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}.")
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self,
        input_ids: Tensor,
        *,
        position_ids: Tensor | None = None,
        doc_ids: Tensor | None = None,
        mask: object | None = None,
        layout: PackedLayout | None = None,
        _hidden: bool = False,
    ) -> Tensor:
        """Logits for every token (:meth:`loss` gives the packed loss without them).

        Args:
            input_ids: (B, S) int64 token ids.
            position_ids: (B, S) or (1, S) int, positions for the rotary embeddings. Default:
                restart at 0 per document when ``doc_ids`` is given, else ``0..S-1``.
            doc_ids: (B, S) int32, document of each token in packed rows, -1 on padding. Given, the
                forward builds ``flexpack.document_causal_mask(doc_ids)`` once and every layer
                attends through ``flexpack.attention``; None, the attention is plain causal.
            mask: a prebuilt flexpack ``Mask`` or ``BlockMask`` of shape (B or 1, 1, S, S) to use
                instead of building one from ``doc_ids`` (e.g. the ``block_mask`` of
                ``flexpack.data.collate_with_mask``, built in a DataLoader worker: Masks and
                BlockMasks themselves do not pickle).

        Returns:
            (B, S, V) logits, in the dtype of the parameters.

        Raises:
            TypeError: ``input_ids`` or ``doc_ids`` is not an integer tensor.
            ValueError: a shape disagrees with ``input_ids``.

        Example:
            >>> _ = torch.manual_seed(0)
            >>> model = GPT(GPTConfig(n_layer=1, n_embd=32))
            >>> ids = torch.randint(0, 256, (1, 8))
            >>> doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, -1]])  # 2 documents, 1 padding
            >>> packed = model(ids, doc_ids=doc_ids)  # (1, 8, 256)
            >>> alone = model(ids[:, 3:7])  # the second document on its own: (1, 4, 256)
            >>> torch.allclose(packed[:, 3:7], alone, atol=1e-5)
            True
        """
        _check_int("input_ids", input_ids)
        if input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must be (B, S), got shape {tuple(input_ids.shape)}; "
                "add a batch dimension with input_ids[None]."
            )
        B, S = input_ids.shape
        if layout is not None:
            if not isinstance(layout, PackedLayout):
                raise TypeError(f"layout must be a PackedLayout, got {type(layout).__name__}.")
            if doc_ids is not None and doc_ids is not layout.doc_ids:
                raise ValueError("pass doc_ids or layout, not both; layout carries the doc ids.")
            doc_ids = layout.doc_ids
            if position_ids is None and "position_ids" in layout.__dict__:
                position_ids = layout.position_ids
        if doc_ids is not None:
            _check_int("doc_ids", doc_ids)
            if tuple(doc_ids.shape) != (B, S):
                raise ValueError(
                    f"doc_ids must have the shape of input_ids {(B, S)}, "
                    f"got {tuple(doc_ids.shape)}."
                )
            if mask is None:  # once per batch, shared by every layer
                mask = document(doc_ids) & causal()
                if layout is not None:  # the varlen plan from the layout's host-side views
                    _attention_flex.use_layout(layout, mask.doc_ids)
        if position_ids is None:
            if doc_ids is not None:
                position_ids = _positions_in_documents(doc_ids)  # restart per doc, no host sync
            else:
                position_ids = torch.arange(S, device=input_ids.device)[None]
        _check_int("position_ids", position_ids)
        if (
            position_ids.dim() != 2
            or position_ids.shape[1] != S
            or position_ids.shape[0] not in (1, B)
        ):
            raise ValueError(
                f"position_ids must be (B, S) or (1, S) with B={B}, S={S}, "
                f"got shape {tuple(position_ids.shape)}."
            )

        x = self.tok_emb(input_ids)  # (B, S, C)
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_base)
        for block in self.blocks:
            x = block(x, cos, sin, mask)  # (B, S, C)
        x = self.norm(x)
        return x if _hidden else self.head(x)  # (B, S, C) or (B, S, V)

    def loss(
        self,
        input_ids: Tensor,
        labels: Tensor,
        *,
        doc_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        mask: object | None = None,
        layout: PackedLayout | None = None,
        reduction: str = "token",
        chunk_size: int | None = None,
    ) -> Tensor:
        """The packed next-token loss, from the final hidden states: no (B, S, V) logits.

        Equal to ``flexpack.packed_cross_entropy(self(input_ids, ...), labels, doc_ids,
        reduction=reduction)`` in value and gradients; the head runs chunk by chunk inside
        :func:`flexpack.packed_linear_cross_entropy`. Arguments as in :meth:`forward`, plus
        ``labels`` (B, S) int64 (unshifted, -100 without a target), ``reduction`` ("token" or
        "document") and ``chunk_size`` (tokens per chunk; None picks one from the shapes).
        Without ``doc_ids`` (nor ``layout``) each row is one document.

        Example:
            >>> import flexpack
            >>> _ = torch.manual_seed(0)
            >>> model = GPT(GPTConfig(n_layer=1, n_embd=32))
            >>> batch = flexpack.pack_sequences([torch.arange(9), torch.arange(5)], max_len=16)
            >>> kw = {"doc_ids": batch.doc_ids}
            >>> loss = model.loss(batch.input_ids, batch.labels, **kw)
            >>> logits = model(batch.input_ids, **kw)  # (1, 16, 256): what loss() never builds
            >>> want = flexpack.packed_cross_entropy(logits, batch.labels, batch.doc_ids)
            >>> torch.allclose(loss, want)
            True
        """
        from flexpack.loss import packed_linear_cross_entropy

        hidden = self.forward(
            input_ids, position_ids=position_ids, doc_ids=doc_ids, mask=mask, layout=layout,
            _hidden=True,
        )  # fmt: skip
        if layout is not None:
            doc_ids = layout.doc_ids
        if doc_ids is None:
            doc_ids = torch.zeros_like(input_ids)
        return packed_linear_cross_entropy(
            hidden, self.head.weight, labels, doc_ids.to(hidden.device), reduction=reduction,
            bias=self.head.bias, chunk_size=chunk_size,
        )  # fmt: skip


def _positions_in_documents(doc_ids: Tensor) -> Tensor:
    """(B, S) int64: position of each token among the earlier tokens of its document, 0 on padding.

    A document is what the masks say it is: every token of a row sharing one id (so a repeated id,
    ``[0, 0, 1, 1, 0]``, continues its positions where the mask lets its runs see each other).
    For packer layouts this is ``PackedLayout.position_ids``, without its validation's host syncs
    (a forward on CUDA stays sync-free).
    """
    ids = doc_ids.long()
    B, S = ids.shape
    sorted_ids, order = torch.sort(ids, dim=1, stable=True)  # by (id, position) within a row
    col = torch.arange(S, device=ids.device).expand(B, S)
    start = torch.ones_like(sorted_ids, dtype=torch.bool)
    start[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    first = torch.where(start, col, 0).cummax(dim=1).values  # where each id's group begins
    positions = torch.empty_like(ids).scatter_(1, order, col - first)
    return torch.where(ids >= 0, positions, 0)


def _check_int(name: str, t: object) -> None:
    if not isinstance(t, Tensor) or t.dtype.is_floating_point or t.dtype == torch.bool:
        got = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise TypeError(f"{name} must be an integer tensor, got {got}; convert with .long().")
