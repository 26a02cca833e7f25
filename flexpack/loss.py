"""packed_cross_entropy: next-token loss on packed rows, without cross-document or packing bias."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from flexpack.batch import IGNORE_INDEX
from flexpack.masks import _as_doc_ids

__all__ = ["packed_cross_entropy"]

_REDUCTIONS = ("token", "document")


def _check(logits: Tensor, labels: Tensor, doc_ids: Tensor, reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    for name, x in (("logits", logits), ("labels", labels), ("doc_ids", doc_ids)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if logits.dim() != 3 or not logits.is_floating_point():
        raise ValueError(
            f"logits must be a floating-point (B, S, V) tensor, got {logits.dtype} of shape "
            f"{tuple(logits.shape)}"
        )
    B, S, _ = logits.shape
    for name, x in (("labels", labels), ("doc_ids", doc_ids)):
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {x.dtype}")
        if tuple(x.shape) != (B, S):
            raise ValueError(
                f"{name} must have shape (B, S) = ({B}, {S}) like logits[..., 0], got "
                f"{tuple(x.shape)}"
            )
        if x.device != logits.device:
            raise ValueError(
                f"{name} is on {x.device} but logits are on {logits.device}; move it with "
                f"{name}.to(logits.device)"
            )


def packed_cross_entropy(
    logits: Tensor,
    labels: Tensor,
    doc_ids: Tensor,
    *,
    reduction: Literal["token", "document"] = "token",
) -> Tensor:
    r"""Next-token cross-entropy on packed rows, never across a document boundary.

    Labels are Hugging Face style, unshifted: the shift happens here, ``logits[:, t]`` predicts
    ``labels[:, t + 1]``. A pair (t, t + 1) is supervised iff ``labels[:, t + 1] != -100`` and
    both tokens belong to the same document (``doc_ids[:, t] == doc_ids[:, t + 1] >= 0``); the
    packer already puts -100 on each document's first token, the doc_ids check makes that safe
    for labels from elsewhere. With :math:`\ell_t = -\log \mathrm{softmax}(z_t)[y_{t+1}]` over
    the supervised set :math:`P`, and :math:`P_d` its part in document d (a (row, id) pair):

    - ``"token"``: :math:`\frac{1}{|P|}\sum_{t \in P} \ell_t`, the mean over every supervised
      token of the batch (HF's default for causal LMs).
    - ``"document"``: :math:`\frac{1}{|D|}\sum_{d \in D} \frac{1}{|P_d|}\sum_{t \in P_d}\ell_t`
      over the documents D with :math:`|P_d| \ge 1`: each sample weighs the same however long it
      is, which is the objective of an unpacked batch with a per-sample mean.

    Half-precision logits are upcast to float32 for the softmax (as transformers does). With no
    supervised token at all the result is 0 (still differentiable), not NaN.

    Args:
        logits: (B, S, V) float, the model's outputs for every position.
        labels: (B, S) int64 token ids, unshifted; -100 marks positions without a target.
        doc_ids: (B, S) int, document of each token; negative values mark padding. Arbitrary
            (non-contiguous, repeated) ids are allowed; a document is a (row, id) pair.
        reduction: "token" or "document".

    Returns:
        0-d tensor, float32 (float64 for float64 logits).

    Raises:
        TypeError: a non-tensor, float labels or doc_ids.
        ValueError: logits not (B, S, V) float; labels or doc_ids not (B, S) or on another device;
            a label outside [0, V) that is not -100; an unknown reduction.

    Example:
        >>> import torch, flexpack
        >>> logits = torch.zeros(1, 5, 4)  # (B, S, V): uniform predictions, loss log(4) each
        >>> labels = torch.tensor([[-100, 1, 2, -100, 3]])  # two documents: tokens 0-2, 3-4
        >>> doc_ids = torch.tensor([[0, 0, 0, 1, 1]])
        >>> loss = flexpack.packed_cross_entropy(logits, labels, doc_ids)
        >>> round(loss.item(), 4), round(torch.log(torch.tensor(4.0)).item(), 4)
        (1.3863, 1.3863)
    """
    _check(logits, labels, doc_ids, reduction)
    if not doc_ids.dtype.is_signed:  # torch compares no uint32/uint64 on CPU: int64 ids
        doc_ids = _as_doc_ids(doc_ids)  # refuses uint64 ids >= 2**63 (they would wrap)
    B, S, V = logits.shape
    labels = labels.long()
    bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= V))
    if bool(bad.any()):
        value = int(labels[bad][0])
        raise ValueError(
            f"labels must be token ids in [0, {V}) or {IGNORE_INDEX} (ignored), got {value}; "
            "check the vocabulary size of the model against the tokenizer"
        )
    target = labels[:, 1:]  # (B, S-1)
    doc_q, doc_t = doc_ids[:, :-1], doc_ids[:, 1:]
    supervised = (target != IGNORE_INDEX) & (doc_q == doc_t) & (doc_t >= 0)
    target = target.masked_fill(~supervised, IGNORE_INDEX)
    losses = F.cross_entropy(
        logits[:, :-1].reshape(-1, V).to(torch.promote_types(logits.dtype, torch.float32)),
        target.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )  # (B * (S-1),), 0 where not supervised
    supervised = supervised.reshape(-1)
    if reduction == "token":
        return losses.sum() / supervised.sum().clamp(min=1)

    # "document": a document is a (row, id) pair; number the supervised ones 0..n_docs-1.
    rows = torch.arange(B, device=logits.device).unsqueeze(1).expand(B, S - 1).reshape(-1)
    keys = torch.stack([rows, doc_t.reshape(-1).long()], dim=1)[supervised]  # (P, 2)
    if keys.shape[0] == 0:
        return losses.sum() * 0.0
    docs, doc_index = torch.unique(keys, dim=0, return_inverse=True)  # (n_docs, 2), (P,)
    n_docs = docs.shape[0]
    per_doc = losses.new_zeros(n_docs).index_add(0, doc_index, losses[supervised])
    counts = torch.bincount(doc_index, minlength=n_docs).to(per_doc.dtype)
    return (per_doc / counts).mean()
