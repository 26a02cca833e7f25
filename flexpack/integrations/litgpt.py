"""LitGPT: train ``litgpt.GPT`` models on packed rows, with no change to LitGPT and no patch.

LitGPT pads every fine-tuning sample to the longest of its micro-batch, and its pretraining
concatenates documents with no document mask (``scaled_dot_product_attention`` loses its fast
kernels when a mask is passed). This module gives a LitGPT model packed rows with an exact
document mask:

- :func:`packed_forward` runs a ``litgpt.GPT`` on packed rows. It re-implements ``GPT.forward``
  from the model's own modules (embedding, each block's norms, ``qkv``/``proj`` projections and
  MLP, final norm and head), with RoPE at per-document positions and every layer's attention
  through :func:`flexpack.attention` under one document-causal mask per forward (composed with
  LitGPT's sliding window on the layers that use it). The model object is untouched: its own
  ``forward`` is unchanged and still runs unpacked batches.
- :class:`PackedGPT` wraps a model so that Fabric/DDP see one module whose ``forward`` is
  :func:`packed_forward`.
- :class:`PackedDataModule` wraps a LitGPT ``DataModule`` (``Alpaca``, ``JSON``, ``Dolly``...)
  and packs its SFT samples (prompt masks kept) into rows of ``max_len``: one global plan,
  equal rows per rank.
- ``python -m flexpack.integrations.litgpt finetune CHECKPOINT_DIR --data JSON
  --data.json_path data.json --max-len 2048 --out_dir out/packed``: full fine-tuning as
  ``litgpt finetune_full`` does it (Lightning Fabric, AdamW, warmup + cosine), on packed rows;
  it saves a checkpoint that ``litgpt`` loads (see :func:`main`).

Shapes: B rows, S tokens per row, C = n_embd, Hq = n_head, Hkv = n_query_groups, D = head_size,
V = padded_vocab_size.

Pretraining data (LitGPT's ``TinyStories``/``TextFiles`` streams: documents joined by EOS) gets
its doc ids from the EOS tokens: ``flexpack.PackedLayout.from_eos(input_ids, eos_id).doc_ids``.

litgpt and lightning are imported inside the functions (extra ``litgpt``; it pins
``huggingface-hub<1.4``, so install it in its own virtual environment, see docs/litgpt.md).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from flexpack import masks as _masks
from flexpack.attention import attention
from flexpack.models.gpt import _positions_in_documents

__all__ = [
    "PackedDataModule",
    "PackedGPT",
    "PackedGPTLoss",
    "lr_schedule",
    "main",
    "packed_forward",
    "packed_loss",
]


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


# ------------------------------------------------------------------------------------------ data


class _PackedRows(torch.utils.data.Dataset):
    """Rows of a plan over in-memory samples (dicts with ``input_ids`` and ``labels``)."""

    def __init__(self, plan: Any, samples: list[dict[str, np.ndarray]], pad_id: int) -> None:
        self.plan, self.samples, self.pad_id = plan, samples, pad_id
        self.num_tokens = np.asarray(plan.row_lengths(), dtype=np.int64)

    def __len__(self) -> int:
        return self.plan.num_rows

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Tensor]]:
        batch = self.plan.materialize(self.samples, [int(i) for i in indices], pad_id=self.pad_id)
        cols = {
            "input_ids": batch.input_ids,
            "labels": batch.labels,
            "doc_ids": batch.doc_ids,
            "position_ids": batch.position_ids,
        }
        return [{k: v[i] for k, v in cols.items()} for i in range(len(indices))]


def _stack_rows(rows: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def _sample_arrays(item: Any, where: str) -> dict[str, np.ndarray]:
    if not isinstance(item, dict) or "input_ids" not in item:
        got = sorted(item) if isinstance(item, dict) else type(item).__name__
        raise TypeError(
            f"{where} is {got}, expected a dict with 'input_ids' (and 'labels'), as LitGPT's "
            "SFTDataset yields; wrap a LitGPT SFT DataModule (Alpaca, JSON, Dolly, ...). For "
            "pretraining token streams (TinyStories, TextFiles) take the doc ids from the EOS "
            "tokens instead: flexpack.PackedLayout.from_eos (docs/litgpt.md)"
        )
    ids = torch.as_tensor(item["input_ids"]).reshape(-1).long().numpy()
    labels = item.get("labels")
    labels = ids if labels is None else torch.as_tensor(labels).reshape(-1).long().numpy()
    if len(labels) != len(ids):
        raise ValueError(
            f"{where} has {len(ids)} input_ids but {len(labels)} labels; they must match"
        )
    return {"input_ids": ids, "labels": labels}


class PackedDataModule:
    """A LitGPT ``DataModule`` whose loaders yield packed rows.

    Wraps any LitGPT SFT data module (``Alpaca``, ``JSON``, ``Dolly``, ``LIMA``, ...) with the
    same ``connect`` / ``prepare_data`` / ``setup`` / ``train_dataloader`` / ``val_dataloader``
    interface. ``setup`` tokenizes every sample once through the wrapped module's own datasets
    (its prompt style, prompt masking and truncation), plans all of them with
    :func:`flexpack.pack` (one global plan), and the loaders serve rows of ``max_len`` tokens::

        input_ids     (b, max_len) int64   pad id on padding
        labels        (b, max_len) int64   the sample's labels (-100 on masked prompts), -100 on
                                           each document's first token and on padding
        doc_ids       (b, max_len) int32   -1 on padding
        position_ids  (b, max_len) int64   restart at 0 in every document

    b is ``batch_size`` rows (given to ``connect``). Rows are dealt to ranks by
    :class:`flexpack.data.DistributedPackedSampler`: every rank gets the same number of rows
    (``remainder="pad"`` repeats a few rows, so every sample is seen each epoch), rows of
    similar size side by side, reshuffled every epoch from ``seed`` (call ``set_epoch``). Under
    Fabric pass ``use_distributed_sampler=False`` to ``fabric.setup_dataloaders``: the sampler
    already shards.

    Args:
        data: a LitGPT ``DataModule`` whose datasets yield dicts with ``input_ids`` and
            ``labels`` (LitGPT's ``SFTDataset``).
        max_len: S, tokens per row. Samples longer than this are truncated to it (as LitGPT's
            ``max_seq_length`` does).
        strategy: packing strategy of :func:`flexpack.pack` ("bfd" default).
        seed: seeds the plan's row order and the per-epoch shuffles.
        shuffle: reshuffle the training rows every epoch.
        pad_id: token id on padding (LitGPT's collate uses 0).
        remainder: what the sampler does with rows that do not divide among ranks ("pad",
            "drop", "error"; see ``flexpack.data.shard_rows``).
        num_workers: DataLoader workers.
        world_size, rank: data-parallel ranks and this one; default ``torch.distributed``'s (1
            and 0 when it is not initialized), read when a loader is made.

    Attributes:
        train_plan, val_plan: the :class:`flexpack.PackPlan` of each split (``.stats`` has rows,
            padding and efficiency), after ``setup``.

    Example (needs litgpt; tested in tests/test_integrations_litgpt.py)::

            from litgpt.data import JSON
            inner = JSON(Path("data.json"), val_split_fraction=0.1)
            data = PackedDataModule(inner, max_len=2048)
            data.connect(tokenizer, batch_size=2)
            data.setup()
            batch = next(iter(data.train_dataloader()))
            sorted(batch)
            # -> ['doc_ids', 'input_ids', 'labels', 'position_ids']
    """

    def __init__(
        self,
        data: Any,
        max_len: int,
        *,
        strategy: str = "bfd",
        seed: int = 0,
        shuffle: bool = True,
        pad_id: int = 0,
        remainder: str = "pad",
        num_workers: int = 0,
        world_size: int | None = None,
        rank: int | None = None,
    ) -> None:
        from flexpack.data._common import check_choice, check_positive_int
        from flexpack.packing import STRATEGIES

        for method in ("connect", "setup", "train_dataloader", "val_dataloader"):
            if not callable(getattr(data, method, None)):
                raise TypeError(
                    f"data must be a LitGPT DataModule (Alpaca, JSON, ...), got "
                    f"{type(data).__name__} without a {method}() method"
                )
        self.data = data
        self.max_len = check_positive_int("max_len", max_len)
        self.strategy = check_choice("strategy", strategy, STRATEGIES)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.pad_id = int(pad_id)
        self.remainder = check_choice("remainder", remainder, ("pad", "drop", "error"))
        self.num_workers = int(num_workers)
        self.world_size, self.rank = world_size, rank
        self.batch_size = 1
        self.train_plan = self.val_plan = None
        self._train = self._val = None
        self._epoch = 0

    def __repr__(self) -> str:
        return f"PackedDataModule({self.data!r}, max_len={self.max_len})"

    @property
    def prompt_style(self) -> Any:
        """The wrapped module's prompt style (LitGPT saves it beside a fine-tuned checkpoint)."""
        return getattr(self.data, "prompt_style", None)

    def connect(
        self,
        tokenizer: Any = None,
        batch_size: int = 1,
        max_seq_length: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Settings known only at run time, as on a LitGPT DataModule.

        Args:
            tokenizer: a ``litgpt.Tokenizer``.
            batch_size: packed rows per loader batch (per rank).
            max_seq_length: truncate samples to this many tokens (at most ``max_len``).
        """
        from flexpack.data._common import check_positive_int

        self.batch_size = check_positive_int("batch_size", batch_size)
        limit = self.max_len if max_seq_length is None else min(int(max_seq_length), self.max_len)
        self.data.connect(tokenizer=tokenizer, batch_size=1, max_seq_length=limit, **kwargs)

    def prepare_data(self) -> None:
        """The wrapped module's ``prepare_data`` (downloads, if it has any)."""
        prepare = getattr(self.data, "prepare_data", None)
        if callable(prepare):
            prepare()

    def setup(self, stage: str = "") -> None:
        """Tokenize every sample of both splits once and plan its rows."""
        from flexpack.packing import pack

        self.data.setup(stage)
        splits = {}
        for name in ("train", "val"):
            # Only the wrapped loader's dataset is used: its workers never start, so torch's
            # warning about their number (LitGPT's default is 4) does not apply.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*worker processes in total.*")
                dataset = getattr(self.data, f"{name}_dataloader")().dataset
            samples = [
                _sample_arrays(dataset[i], f"{name} sample {i}") for i in range(len(dataset))
            ]
            lengths = np.array([len(s["input_ids"]) for s in samples], dtype=np.int64)
            plan = pack(
                lengths, self.max_len, strategy=self.strategy, overflow="truncate", seed=self.seed
            )
            splits[name] = _PackedRows(plan, samples, self.pad_id)
        self._train, self._val = splits["train"], splits["val"]
        self.train_plan, self.val_plan = self._train.plan, self._val.plan

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's row shuffle for loaders made after this call (same on all ranks)."""
        self._epoch = int(epoch)

    def _loader(self, rows: _PackedRows | None, shuffle: bool) -> torch.utils.data.DataLoader:
        from flexpack.data import DistributedPackedSampler

        if rows is None:
            raise RuntimeError("call setup() before asking for a dataloader")
        if len(rows) == 0:  # an empty split (e.g. no validation samples): an empty loader
            return torch.utils.data.DataLoader(rows, batch_size=self.batch_size)
        sampler = DistributedPackedSampler(
            rows,
            num_replicas=self.world_size,
            rank=self.rank,
            shuffle=shuffle,
            seed=self.seed,
            remainder=self.remainder,
        )
        sampler.set_epoch(self._epoch)
        return torch.utils.data.DataLoader(
            rows,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            collate_fn=_stack_rows,
        )

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        """Packed training rows, this rank's share, shuffled per epoch."""
        return self._loader(self._train, self.shuffle)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        """Packed validation rows, this rank's share, in plan order."""
        return self._loader(self._val, False)


# ------------------------------------------------------------------------------------ fine-tuning


def lr_schedule(
    optimizer: torch.optim.Optimizer, warmup_steps: int, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup then cosine decay to 0 at ``max_steps``, as ``litgpt finetune_full``.

    LitGPT's warmup starts at a learning rate of 0 (its first step does nothing); here step t of
    the warmup uses ``(t + 1) / warmup_steps`` of the rate. ``warmup_steps=0`` starts the cosine
    at once.

    Example:
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        >>> sched = lr_schedule(opt, warmup_steps=2, max_steps=6)
        >>> rates = []
        >>> for _ in range(6):
        ...     rates.append(round(sched.get_last_lr()[0], 3))
        ...     opt.step(); sched.step()
        >>> rates
        [0.5, 1.0, 1.0, 0.854, 0.5, 0.146]
    """
    warmup_steps, max_steps = int(warmup_steps), int(max_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(max_steps - warmup_steps, 1)
        return 0.5 * (1.0 + math.cos(math.pi * min(step - warmup_steps, span) / span))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class _UserError(Exception):
    """A problem with the command's input: printed as ``error: ...``, exit status 2."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer, got {value}; leave --max-len out for the model's "
            "block_size"
        )
    return value


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flexpack.integrations.litgpt finetune",
        description=(
            "Full fine-tuning of a LitGPT checkpoint on packed rows (flexpack): the loop of "
            "`litgpt finetune_full`, with samples packed into rows of --max-len tokens, a "
            "document-causal mask and the packed token-mean loss. Saves OUT_DIR/final, a "
            "LitGPT checkpoint directory."
        ),
    )
    p.add_argument("checkpoint_dir", type=Path, help="LitGPT checkpoint directory to fine-tune")
    p.add_argument(
        "--out_dir",
        "--out",
        dest="out_dir",
        type=Path,
        default=Path("out/finetune/packed"),
        help="where logs and checkpoints go",
    )
    p.add_argument(
        "--max-len",
        "--max_len",
        dest="max_len",
        type=_positive_int,
        default=None,
        help="tokens per packed row (default: the model's block_size); above block_size is "
        "fine: samples are truncated to block_size and attend only within themselves",
    )
    p.add_argument(
        "--precision",
        default=None,
        help='"32-true", "bf16-true", "bf16-mixed", ... (default: LitGPT\'s choice)',
    )
    p.add_argument("--devices", type=int, default=1, help="data-parallel processes (DDP)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument(
        "--data",
        default="Alpaca",
        help="a litgpt.data class: Alpaca, JSON, Dolly, LIMA, ... (default Alpaca)",
    )
    p.add_argument("--data.json_path", dest="json_path", type=Path, default=None)
    p.add_argument("--data.val_split_fraction", dest="val_split_fraction", type=float, default=None)
    p.add_argument("--data.mask_prompt", dest="mask_prompt", type=_bool, default=None)
    p.add_argument("--data.prompt_style", dest="prompt_style", default=None)
    p.add_argument(
        "--data.strategy",
        dest="strategy",
        default="bfd",
        help="packing strategy of flexpack.pack (bfd, ffd, greedy)",
    )
    p.add_argument(
        "--train.micro_batch_size",
        dest="micro_batch_size",
        type=int,
        default=1,
        help="packed rows per iteration and process",
    )
    p.add_argument(
        "--train.global_batch_size",
        dest="global_batch_size",
        type=int,
        default=None,
        help="rows per optimizer step over all processes (default: no accumulation)",
    )
    p.add_argument("--train.epochs", dest="epochs", type=int, default=1)
    p.add_argument("--train.max_steps", dest="max_steps", type=int, default=None)
    p.add_argument("--train.lr_warmup_steps", dest="lr_warmup_steps", type=int, default=100)
    p.add_argument("--train.log_interval", dest="log_interval", type=int, default=1)
    p.add_argument("--train.save_interval", dest="save_interval", type=int, default=None)
    p.add_argument("--train.max_norm", dest="max_norm", type=float, default=None)
    p.add_argument(
        "--train.loss",
        dest="loss",
        choices=("token", "document"),
        default="token",
        help="packed_cross_entropy reduction (token: mean over all supervised tokens)",
    )
    p.add_argument(
        "--train.chunked_loss",
        dest="chunked_loss",
        type=_bool,
        default=True,
        help="compute the loss from the hidden states chunk by chunk (never the whole logits); "
        "false: the logits, then packed_cross_entropy",
    )
    p.add_argument("--optimizer.lr", dest="lr", type=float, default=2e-5)
    p.add_argument("--optimizer.weight_decay", dest="weight_decay", type=float, default=0.02)
    p.add_argument("--eval.final_validation", dest="final_validation", type=_bool, default=True)
    p.add_argument("--progress", type=_bool, default=True, help="show a progress bar")
    return p


def _make_data(args: argparse.Namespace) -> Any:
    import litgpt.data

    cls = getattr(litgpt.data, args.data, None)
    if not isinstance(cls, type):
        names = sorted(n for n in dir(litgpt.data) if n[:1].isupper() and n != "DataModule")
        raise ValueError(f"--data {args.data!r} is not a litgpt.data class; choose one of {names}")
    kwargs = {}
    for name in ("json_path", "val_split_fraction", "mask_prompt", "prompt_style"):
        value = getattr(args, name)
        if value is not None:
            kwargs[name] = value
    return cls(**kwargs)


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors (exit status 2, no traceback) for what can be checked before any work."""
    if args.data == "JSON" and args.json_path is None:
        parser.error("--data JSON needs --data.json_path PATH (a .json/.jsonl file or a folder)")
    if args.json_path is not None and not Path(args.json_path).exists():
        parser.error(
            f"--data.json_path {args.json_path}: no such file or folder; pass a .json/.jsonl "
            "file of {instruction, input, output} records, or a folder with train.json and "
            "val.json"
        )


def _prepare(data: Any, args: argparse.Namespace) -> None:
    """``data.prepare_data()``; a failed download (offline, no ``requests``) says what to do."""
    try:
        data.prepare_data()
    except (OSError, ImportError) as e:
        inner = getattr(data, "data", data)
        url = getattr(inner, "file_url", None)
        folder = getattr(inner, "download_dir", None)
        where = f" from {url}" if url else ""
        to = f" into {folder}" if folder is not None else ""
        raise _UserError(
            f"--data {args.data} downloads its data on first use{where}{to}, and that failed "
            f"({type(e).__name__}: {e}). Offline, download the file elsewhere and copy it there, "
            "or train on a local file: --data JSON --data.json_path FILE.json"
        ) from e


def _validate(
    fabric: Any, packed: nn.Module, loader: Any, reduction: str, chunked: bool = False
) -> float:
    from flexpack.loss import packed_cross_entropy

    packed.eval()
    total, count = torch.zeros((), device=fabric.device), torch.zeros((), device=fabric.device)
    with torch.no_grad():
        for batch in loader:
            ids, docs, pos = batch["input_ids"], batch["doc_ids"], batch["position_ids"]
            if chunked:  # a PackedGPTLoss
                loss = packed(ids, docs, pos, batch["labels"])
            else:
                loss = packed_cross_entropy(
                    packed(ids, docs, pos), batch["labels"], docs, reduction=reduction
                )
            total += loss.float()
            count += 1
    packed.train()
    total = fabric.all_reduce(total, reduce_op="sum")
    count = fabric.all_reduce(count, reduce_op="sum")
    return float(total / count.clamp(min=1))


def _save(fabric: Any, model: nn.Module, directory: Path, checkpoint_dir: Path, data: Any, args):
    """A LitGPT checkpoint directory: lit_model.pth ({"model": state dict}, as finetune_full
    writes it), the config and tokenizer files, the prompt style and the hyperparameters."""
    import yaml
    from litgpt.prompts import save_prompt_style
    from litgpt.utils import copy_config_files

    directory.mkdir(parents=True, exist_ok=True)
    fabric.save(directory / "lit_model.pth", {"model": model})
    if fabric.global_rank == 0:
        copy_config_files(checkpoint_dir, directory)
        if data.prompt_style is not None:
            save_prompt_style(data.prompt_style, directory)
        hparams = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        (directory / "hyperparameters.yaml").write_text(yaml.safe_dump(hparams, sort_keys=True))


def _sum_over_ranks(fabric: Any, *counts: int) -> list[int]:
    """The ``counts`` summed over the data-parallel ranks (one all_reduce; a no-op on one)."""
    if fabric.world_size == 1:
        return list(counts)
    t = torch.tensor(counts, dtype=torch.int64, device=fabric.device)
    return [int(x) for x in fabric.all_reduce(t, reduce_op="sum").tolist()]


def finetune(args: argparse.Namespace) -> dict[str, Any]:
    """Run the fine-tuning that :func:`main` parsed; returns the final metrics."""
    _import_litgpt()
    import lightning as L
    from lightning.fabric.loggers import CSVLogger
    from litgpt import GPT, Config, Tokenizer
    from litgpt.utils import check_valid_checkpoint_dir, get_default_supported_precision
    from litgpt.utils import load_checkpoint as lit_load_checkpoint

    from flexpack.loss import packed_cross_entropy

    checkpoint_dir = Path(args.checkpoint_dir)
    check_valid_checkpoint_dir(checkpoint_dir)
    config = Config.from_file(checkpoint_dir / "model_config.yaml")
    max_len = args.max_len or config.block_size
    precision = args.precision or get_default_supported_precision(training=True)
    out_dir = Path(args.out_dir)
    logger = CSVLogger(root_dir=out_dir, name="logs", flush_logs_every_n_steps=1)
    fabric = L.Fabric(
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        precision=precision,
        loggers=logger,
    )
    fabric.launch()
    fabric.seed_everything(args.seed)

    tokenizer = Tokenizer(checkpoint_dir)
    data = PackedDataModule(_make_data(args), max_len, strategy=args.strategy, seed=args.seed)
    # No document may outrun the model's context: truncate samples as LitGPT would.
    data.connect(
        tokenizer, batch_size=args.micro_batch_size, max_seq_length=min(max_len, config.block_size)
    )
    with fabric.rank_zero_first():
        _prepare(data, args)
    data.setup()
    stats = data.train_plan.stats
    fabric.print(
        f"Packed {stats.samples:,} training samples into {stats.rows:,} rows of {max_len} "
        f"tokens ({stats.efficiency:.1%} tokens, lower bound {stats.lower_bound_rows:,} rows)"
    )
    if max_len > config.block_size:
        fabric.print(
            f"Rows of {max_len} tokens exceed the model's block_size ({config.block_size}): "
            f"fine, each sample is truncated to {config.block_size} tokens and attends only "
            "within itself with positions from 0, so the model never sees a longer context; "
            "a row only holds more samples."
        )

    with fabric.init_module(empty_init=fabric.world_size > 1):
        model = GPT(config)
    model.max_seq_length = min(max_len, config.block_size)
    lit_load_checkpoint(fabric, model, checkpoint_dir / "lit_model.pth")
    wrapper = PackedGPTLoss(model, reduction=args.loss) if args.chunked_loss else PackedGPT(model)
    packed = fabric.setup(wrapper)
    optimizer = torch.optim.AdamW(packed.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    optimizer = fabric.setup_optimizers(optimizer)

    rows_per_step = args.global_batch_size or args.micro_batch_size * fabric.world_size
    accum = rows_per_step // (args.micro_batch_size * fabric.world_size)
    if accum < 1 or rows_per_step % (args.micro_batch_size * fabric.world_size):
        raise ValueError(
            f"--train.global_batch_size={rows_per_step} must be a multiple of "
            f"--train.micro_batch_size x devices = {args.micro_batch_size * fabric.world_size}"
        )
    iters_per_epoch = len(data.train_dataloader())
    max_steps = args.epochs * (iters_per_epoch // accum)
    if args.max_steps is not None:
        max_steps = min(max_steps, args.max_steps)
    scheduler = lr_schedule(optimizer, args.lr_warmup_steps, max_steps)

    bar = None
    if args.progress and fabric.is_global_zero:
        from tqdm.auto import tqdm

        bar = tqdm(total=max_steps, desc="finetune (packed)", unit="step", file=sys.stderr)
    step = iteration = 0
    tokens_seen = mine = 0  # real tokens: of all ranks (at each log), of this rank
    metrics: dict[str, Any] = {}
    start = time.perf_counter()
    epoch = 0
    while step < max_steps and epoch < args.epochs:
        data.set_epoch(epoch)
        loader = fabric.setup_dataloaders(data.train_dataloader(), use_distributed_sampler=False)
        for batch in loader:
            if step >= max_steps:
                break
            iteration += 1
            t0 = time.perf_counter()
            accumulating = iteration % accum != 0
            with fabric.no_backward_sync(packed, enabled=accumulating):
                ids, docs, pos = batch["input_ids"], batch["doc_ids"], batch["position_ids"]
                if args.chunked_loss:  # PackedGPTLoss: the loss without the (B, S, V) logits
                    loss = packed(ids, docs, pos, batch["labels"])
                else:
                    loss = packed_cross_entropy(
                        packed(ids, docs, pos), batch["labels"], docs, reduction=args.loss
                    )
                fabric.backward(loss / accum)
            if not accumulating:
                if args.max_norm is not None:
                    fabric.clip_gradients(packed, optimizer, max_norm=args.max_norm)
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
                step += 1
            real = int((batch["doc_ids"] >= 0).sum())  # this rank's
            mine += real
            dt = time.perf_counter() - t0
            if iteration % args.log_interval == 0:
                # Ranks hold different rows: sum their counts (every rank logs at this iteration).
                real, tokens_seen = _sum_over_ranks(fabric, real, mine)
                metrics = {
                    "loss": loss.item(),
                    "iter": iteration,
                    "step": step,
                    "epoch": epoch,
                    "iter_time": dt,
                    "tokens": tokens_seen,
                    "tokens_per_sec": real / dt,
                    "learning_rate": scheduler.get_last_lr()[0],
                }
                fabric.log_dict(metrics, step=iteration)
                if bar is not None:
                    bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{real / dt:,.0f}")
            if bar is not None and not accumulating:
                bar.update(1)
            if args.save_interval and not accumulating and step % args.save_interval == 0:
                _save(fabric, model, out_dir / f"step-{step:06d}", checkpoint_dir, data, args)
        epoch += 1
    if bar is not None:
        bar.close()
    _, tokens_seen = _sum_over_ranks(fabric, 0, mine)
    elapsed = time.perf_counter() - start
    fabric.print(
        f"Trained {step} steps on {tokens_seen:,} real tokens in {elapsed:.1f} s "
        f"({tokens_seen / max(elapsed, 1e-9):,.0f} tokens/s)"
    )
    if args.final_validation and len(data.val_dataloader()):
        val_loader = fabric.setup_dataloaders(data.val_dataloader(), use_distributed_sampler=False)
        val_loss = _validate(fabric, packed, val_loader, args.loss, args.chunked_loss)
        metrics = {**metrics, "val_loss": val_loss}
        fabric.log_dict({"val_loss": val_loss}, step=iteration)
        fabric.print(
            f"Final evaluation | val loss: {val_loss:.3f} | val ppl: {math.exp(val_loss):.3f}"
        )
    final = out_dir / "final"
    _save(fabric, model, final, checkpoint_dir, data, args)
    fabric.print(f"Saved the fine-tuned checkpoint to {str(final)!r}")
    for lg in fabric.loggers:
        lg.finalize("success")
    return metrics


def main(argv: list[str] | None = None) -> int:
    """``python -m flexpack.integrations.litgpt finetune CHECKPOINT_DIR ...``; returns 0, or 2.

    2 is a user error (a failed data download), printed as ``error: ...`` without a traceback.

    ``argv`` are the arguments after the command (a leading ``"finetune"`` or
    ``"litgpt-finetune"`` is accepted, so ``flexpack litgpt-finetune`` can forward its argv); see
    ``--help`` for the options, named as in ``litgpt finetune_full`` (``--data JSON
    --data.json_path ...``, ``--train.micro_batch_size``, ``--optimizer.lr``, ...), plus
    ``--max-len``, the tokens per packed row. ``--train.micro_batch_size`` counts packed rows.

    Example (needs litgpt; a 20-step run is tested in tests/test_integrations_litgpt.py)::

            main(["finetune", "checkpoints/tiny", "--data", "JSON",
                  "--data.json_path", "data.json", "--max-len", "512", "--out", "out/tiny"])
            # -> 0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("finetune", "litgpt-finetune"):
        argv = argv[1:]
    parser = _parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    try:
        finetune(args)
    except _UserError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
