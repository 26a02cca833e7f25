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

The package: ``forward`` (:func:`packed_forward`, :func:`packed_loss`, :class:`PackedGPT`,
:class:`PackedGPTLoss`), ``data`` (:class:`PackedDataModule`), and ``finetune``, the command
line (:func:`lr_schedule`, :func:`main`; ``__main__`` runs it). ``finetune`` imports the other
two; the library never imports the command line.
"""

from flexpack.integrations.litgpt.data import PackedDataModule
from flexpack.integrations.litgpt.finetune import lr_schedule, main
from flexpack.integrations.litgpt.forward import (
    PackedGPT,
    PackedGPTLoss,
    packed_forward,
    packed_loss,
)

__all__ = [
    "PackedDataModule",
    "PackedGPT",
    "PackedGPTLoss",
    "lr_schedule",
    "main",
    "packed_forward",
    "packed_loss",
]
