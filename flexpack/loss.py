"""The next-token loss on packed rows, without cross-document or packing bias.

- ``packed_cross_entropy(logits, labels, doc_ids)``: from (B, S, V) logits.
- ``packed_linear_cross_entropy(hidden, weight, labels, doc_ids)``: from the last hidden states
  and the output head, never holding more than a chunk of the logits: at S = 128K and a 152K
  vocabulary the (B, S, V) float32 logits alone take 80 GB, before their gradient.

Shapes: B rows, S tokens per row, C hidden width, V vocabulary, N = B * S tokens, P the
supervised ones (a target, and the next token in the same document).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from flexpack.batch import IGNORE_INDEX
from flexpack.layout import _as_doc_ids, _check_runs, _has_split_run

__all__ = ["packed_cross_entropy", "packed_linear_cross_entropy"]

_REDUCTIONS = ("token", "document")


def _check(logits: Tensor, labels: Tensor, doc_ids: Tensor, reduction: str) -> None:
    _check_reduction(reduction)
    if not isinstance(logits, Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 3 or not logits.is_floating_point():
        raise ValueError(
            f"logits must be a floating-point (B, S, V) tensor, got {logits.dtype} of shape "
            f"{tuple(logits.shape)}"
        )
    _check_targets(labels, doc_ids, logits, "logits", "logits[..., 0]")


def _check_reduction(reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def _check_targets(labels: Tensor, doc_ids: Tensor, like: Tensor, name: str, view: str) -> None:
    """labels and doc_ids: (B, S) integer tensors on the device of ``like`` (B, S, ...)."""
    B, S = like.shape[:2]
    for what, x in (("labels", labels), ("doc_ids", doc_ids)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"{what} must be an integer tensor, got {x.dtype}")
        if tuple(x.shape) != (B, S):
            raise ValueError(
                f"{what} must have shape (B, S) = ({B}, {S}) like {view}, got {tuple(x.shape)}"
            )
        if x.device != like.device:
            raise ValueError(
                f"{what} is on {x.device} but {name} is on {like.device}; move it with "
                f"{what}.to({name}.device)"
            )


def _supervised(labels: Tensor, doc_ids: Tensor, V: int) -> tuple[Tensor, Tensor]:
    """The shifted targets (B, S-1) int64, -100 where not supervised, and the supervised mask.

    ``[:, t]`` is the target of the prediction made at token t: ``labels[:, t + 1]``, kept iff it
    is not -100 and tokens t and t + 1 belong to the same document (not padding).

    Raises ValueError for a label outside [0, V), and for doc ids that name an id for two runs
    of a row (flexpack.layout's one refusal), both read back in one host sync.
    """
    if not doc_ids.dtype.is_signed:  # torch compares no uint32/uint64 on CPU: int64 ids
        doc_ids = _as_doc_ids(doc_ids)  # refuses uint64 ids >= 2**63 (they would wrap)
    labels = labels.long()
    bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= V))
    if not torch.compiler.is_compiling():
        split, any_bad = torch.stack([_has_split_run(doc_ids), bad.any()]).tolist()
        if split:
            _check_runs(doc_ids)  # raises with the id and its positions
    else:
        any_bad = bool(bad.any())
    if any_bad:
        value = int(labels[bad][0])
        raise ValueError(
            f"labels must be token ids in [0, {V}) or {IGNORE_INDEX} (ignored), got {value}; "
            "check the vocabulary size of the model against the tokenizer"
        )
    target = labels[:, 1:]  # (B, S-1)
    doc_q, doc_t = doc_ids[:, :-1], doc_ids[:, 1:]
    supervised = (target != IGNORE_INDEX) & (doc_q == doc_t) & (doc_t >= 0)
    return target.masked_fill(~supervised, IGNORE_INDEX), supervised


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
        doc_ids: (B, S) int, document of each token; negative values mark padding. Ids may
            be any integers in any order, each id one run of its row (a document is a (row,
            id) pair): ``[0, 0, 1, 1, 0, 0]`` is refused, as by every entry point that reads
            doc ids; ``flexpack.PackedLayout.from_runs(doc_ids).doc_ids`` numbers its runs.
        reduction: "token" or "document".

    Returns:
        0-d tensor, float32 (float64 for float64 logits).

    Raises:
        TypeError: a non-tensor, float labels or doc_ids.
        ValueError: logits not (B, S, V) float; labels or doc_ids not (B, S) or on another device;
            a label outside [0, V) that is not -100; an unknown reduction; an id naming two
            separate runs of a row.

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
    B, S, V = logits.shape
    target, supervised = _supervised(labels, doc_ids, V)
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
    doc_t = doc_ids[:, 1:].reshape(-1).long()
    keys = torch.stack([rows, doc_t], dim=1)[supervised]  # (P, 2)
    if keys.shape[0] == 0:
        return losses.sum() * 0.0
    docs, doc_index = torch.unique(keys, dim=0, return_inverse=True)  # (n_docs, 2), (P,)
    n_docs = docs.shape[0]
    per_doc = losses.new_zeros(n_docs).index_add(0, doc_index, losses[supervised])
    counts = torch.bincount(doc_index, minlength=n_docs).to(per_doc.dtype)
    return (per_doc / counts).mean()


# --------------------------------------------------------------- from hidden states: chunked

# A chunk's logits hold about as many elements as the hidden states (torch's "aspect ratio" rule
# for F.linear_cross_entropy), at least 2**20 (4 MiB in float32) and 32 rows (kernels big enough
# to run at speed: each chunk costs a dozen kernel launches) and at most 2**26 elements (256 MiB):
# a few such buffers live at a time, a small fraction of the (N, V) logits whenever V >> C.
_CHUNK_MIN_ELEMENTS = 2**20
_CHUNK_MIN_ROWS = 32
_CHUNK_MAX_ELEMENTS = 2**26


def default_chunk_size(tokens: int, hidden_size: int, vocab_size: int) -> int:
    """Tokens per chunk of :func:`packed_linear_cross_entropy` when ``chunk_size`` is None.

    A chunk's (chunk, V) logits hold about as many elements as the (tokens, C) hidden states,
    clamped to [2**20, 2**26] elements (4-256 MiB in float32), at least 32 rows, and never more
    than ``tokens``.

    Example:
        >>> default_chunk_size(8192, 512, 32768)  # 4M hidden elements: 128 rows of 32K logits
        128
    """
    budget = min(max(tokens * hidden_size, _CHUNK_MIN_ELEMENTS), _CHUNK_MAX_ELEMENTS)
    return max(1, min(tokens, max(budget // max(vocab_size, 1), _CHUNK_MIN_ROWS)))


def _torch_fused(device: torch.device, compute_dtype: torch.dtype, softcap: float | None) -> bool:
    """Whether torch's chunked ``F.linear_cross_entropy`` computes this loss the same way.

    Its per-token losses (``reduction="none"``, which flexpack then weighs per token or per
    document) come back in the input dtype: exact for float32/float64, but rounded to bf16 under
    autocast, where the logits path keeps the loss in float32. It has no soft-capping. It runs
    on CUDA (on CPU, torch picks its slow "accurate" policy; flexpack's own chunks are as fast).
    """
    return (
        device.type == "cuda"
        and softcap is None
        and compute_dtype in (torch.float32, torch.float64)
        and hasattr(F, "linear_cross_entropy")
        and hasattr(torch.nn, "LinearCrossEntropyOptions")
    )


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_i w_i * CE(softcap(hidden[rows[i]] @ weight.T + bias), target[i]), chunk by chunk.

    The gradients of hidden, weight and bias are computed in the forward, chunk by chunk, while
    each chunk's logits are at hand (a second pass over the logits in the backward would cost a
    matmul more); the backward scales them by the incoming gradient. The matmuls run in the
    dtype of hidden/weight (bf16 under autocast), the softmax and the loss in float32 (float64
    for float64 inputs), the weight and bias gradients accumulate in that dtype too.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,  # (N, C)
        weight: Tensor,  # (V, C)
        bias: Tensor | None,  # (V,)
        rows: Tensor,  # (P,) int64 indices into hidden
        target: Tensor,  # (P,) int64 in [0, V)
        token_weight: Tensor,  # (P,) float32/float64
        softcap: float | None,
        chunk: int,
        needs: tuple[bool, bool, bool],
    ) -> Tensor:
        acc = token_weight.dtype
        need_h, need_w, need_b = needs
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = weight.new_zeros(weight.shape, dtype=acc) if need_w else None
        grad_b = weight.new_zeros(weight.shape[0], dtype=acc) if need_b else None
        loss = token_weight.new_zeros(())
        for start in range(0, rows.shape[0], chunk):
            r = rows[start : start + chunk]
            y = target[start : start + chunk, None]  # (n, 1)
            w = token_weight[start : start + chunk, None]  # (n, 1)
            h = hidden.index_select(0, r)  # (n, C)
            z = F.linear(h, weight, bias).to(acc)  # (n, V): the only logits alive
            if softcap is not None:
                tanh = torch.tanh(z / softcap)
                z = tanh * softcap
            lse = torch.logsumexp(z, dim=-1, keepdim=True)  # (n, 1)
            loss += ((lse - z.gather(1, y)) * w).sum()
            if not (need_h or need_w or need_b):
                continue
            g = z.sub_(lse).exp_()  # softmax, in place of the logits
            g.scatter_add_(1, y, -torch.ones_like(w))  # - one_hot(y)
            g.mul_(w)  # dloss/dz
            if softcap is not None:
                g.mul_(1 - tanh * tanh)  # d(c * tanh(x / c))/dx
                del tanh
            if need_b:
                grad_b += g.sum(0)
            g = g.to(weight.dtype)
            if need_h:
                grad_h.index_copy_(0, r, g @ weight)  # (n, C): each row once
            if need_w and grad_w.dtype == g.dtype:
                grad_w.addmm_(g.t(), h)  # (V, C), in place: no (V, C) temporary
            elif need_w:  # bf16 products, accumulated in float32
                grad_w += g.t() @ h
        ctx.grads = (grad_h, grad_w, grad_b)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        if ctx.grads is None:
            raise RuntimeError(
                "packed_linear_cross_entropy computes its gradients in the forward and hands "
                "them to the first backward; a second backward through the same loss (retain_graph"
                "=True) is not supported: recompute the loss instead."
            )
        grad_h, grad_w, grad_b = ctx.grads
        ctx.grads = None
        w_dtype, b_dtype = ctx.dtypes
        if grad_h is not None:
            grad_h = grad_h.mul_(grad_loss.to(grad_h.dtype))
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_loss).to(w_dtype)
        if grad_b is not None:
            grad_b = grad_b.mul_(grad_loss).to(b_dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def packed_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    doc_ids: Tensor,
    *,
    reduction: Literal["token", "document"] = "token",
    bias: Tensor | None = None,
    softcap: float | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    r""":func:`packed_cross_entropy` of the head's logits, never holding more than a chunk of them.

    Equal to ``packed_cross_entropy(z, labels, doc_ids, reduction=reduction)`` with
    ``z = hidden @ weight.T + bias``, soft-capped to ``softcap * tanh(z / softcap)`` when
    ``softcap`` is given (Gemma 2's ``final_logit_softcapping``): the same label shift, document
    boundaries, -100 targets and reductions, in value and in the gradients of ``hidden``,
    ``weight`` and ``bias``. Only the supervised tokens are projected, ``chunk_size`` at a time;
    each chunk's loss and gradients are computed while its logits exist, so memory grows by a few
    (chunk, V) buffers and the gradients' own size, not by (B, S, V).

    Precision follows the logits path: the matmuls run in the dtype of ``hidden`` and ``weight``
    (under autocast, in the autocast dtype, as ``F.linear`` would), the softmax, the soft-cap and
    the loss in float32 (float64 for float64 inputs). On CUDA without soft-capping in float32 or
    float64, torch's own chunked ``F.linear_cross_entropy`` (torch >= 2.13, ``reduction="none"``)
    computes the per-token losses; flexpack weighs them. It returns bf16 losses, so under bf16 the
    chunks here run instead.

    Args:
        hidden: (B, S, C) float, the last hidden states (after the final norm).
        weight: (V, C) float, the output head (``lm_head.weight``, or the tied embedding).
        labels: (B, S) int64 token ids, unshifted; -100 marks positions without a target.
        doc_ids: (B, S) int, document of each token; negative values mark padding; each id
            one run of its row, as in :func:`packed_cross_entropy`.
        reduction: "token" (mean over supervised tokens) or "document" (mean of per-document
            means), as in :func:`packed_cross_entropy`.
        bias: (V,) float or None, the head's bias.
        softcap: None, or a positive float: final-logit soft-capping.
        chunk_size: tokens per chunk; None picks :func:`default_chunk_size` from the shapes.

    Returns:
        0-d tensor, float32 (float64 for float64 inputs); 0 (with zero gradients) when no token
        is supervised.

    Raises:
        TypeError: a non-tensor, float labels or doc_ids, hidden and weight of different dtypes
            outside autocast, a non-numeric softcap or chunk_size.
        ValueError: shapes that disagree, tensors on two devices, a label outside [0, V) that
            is not -100, an unknown reduction, a softcap or chunk_size <= 0, an id naming two
            separate runs of a row.

    Example:
        >>> import torch, flexpack
        >>> hidden, weight = torch.randn(1, 5, 8), torch.randn(16, 8)  # (B, S, C), (V, C)
        >>> labels = torch.tensor([[-100, 1, 2, -100, 3]])  # two documents: tokens 0-2, 3-4
        >>> doc_ids = torch.tensor([[0, 0, 0, 1, 1]])
        >>> loss = flexpack.packed_linear_cross_entropy(hidden, weight, labels, doc_ids)
        >>> logits = hidden @ weight.T  # (1, 5, 16): what it never builds whole
        >>> torch.allclose(loss, flexpack.packed_cross_entropy(logits, labels, doc_ids))
        True
    """
    _check_reduction(reduction)
    _check_linear(hidden, weight, bias, softcap, chunk_size)
    _check_targets(labels, doc_ids, hidden, "hidden", "hidden[..., 0]")
    B, S, C = hidden.shape
    V = weight.shape[0]
    target, supervised = _supervised(labels, doc_ids, V)
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):  # what autocast does to F.linear: cast all three
        compute = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(compute), weight.to(compute)
        bias = None if bias is None else bias.to(compute)
    elif hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        got = f"hidden {hidden.dtype}, weight {weight.dtype}" + (
            "" if bias is None else f", bias {bias.dtype}"
        )
        raise TypeError(
            f"hidden, weight and bias must share a dtype outside autocast (as F.linear needs), got "
            f"{got}; cast one, e.g. hidden.to(weight.dtype), or run under torch.autocast"
        )
    compute = weight.dtype
    acc = torch.promote_types(compute, torch.float32)
    flat = hidden.reshape(B * S, C)
    index = supervised.nonzero()  # (P, 2): row, position (one host sync, as the label check)
    rows = index[:, 0] * S + index[:, 1]  # (P,) into the (B * S) tokens
    y = target[index[:, 0], index[:, 1]]  # (P,); a gather, where a boolean mask would sync
    P = rows.shape[0]
    if reduction == "token":
        token_weight = torch.full((P,), 1.0 / max(P, 1), dtype=acc, device=hidden.device)
    else:
        token_weight = _document_weights(index, doc_ids[index[:, 0], index[:, 1] + 1], acc)
    chunk = default_chunk_size(P, C, V) if chunk_size is None else int(chunk_size)
    with torch.autocast(device_type, enabled=False):
        if _torch_fused(hidden.device, compute, softcap):
            per_token = F.linear_cross_entropy(
                flat.index_select(0, rows), weight, y, linear_bias=bias, reduction="none",
                options=torch.nn.LinearCrossEntropyOptions(batch_chunk_size=max(chunk, 1)),
            )  # fmt: skip
            return (per_token.to(acc) * token_weight).sum()
        grad = torch.is_grad_enabled()
        needs = (
            grad and flat.requires_grad,
            grad and weight.requires_grad,
            grad and bias is not None and bias.requires_grad,
        )
        return _ChunkedLinearCrossEntropy.apply(
            flat, weight, bias, rows, y, token_weight, softcap, max(chunk, 1), needs
        )


def _document_weights(index: Tensor, doc_t: Tensor, dtype: torch.dtype) -> Tensor:
    """(P,) weight of each supervised token under "document": 1 / (n_docs * tokens of its doc).

    index: (P, 2) row and position of each supervised token; doc_t: (P,) its document id.
    """
    if index.shape[0] == 0:
        return torch.empty(0, dtype=dtype, device=index.device)
    keys = torch.stack([index[:, 0], doc_t.long()], dim=1)  # a document is a (row, id) pair
    docs, doc_index = torch.unique(keys, dim=0, return_inverse=True)  # (n_docs, 2), (P,)
    ones = torch.ones(doc_index.shape, dtype=dtype, device=doc_index.device)
    counts = ones.new_zeros(docs.shape[0]).index_add_(0, doc_index, ones)  # (n_docs,), no sync
    return 1.0 / (counts[doc_index] * docs.shape[0])


def _check_linear(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    softcap: float | None,
    chunk_size: int | None,
) -> None:
    for name, x in (("hidden", hidden), ("weight", weight), ("bias", bias)):
        if x is None and name == "bias":
            continue
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if hidden.dim() != 3:
        raise ValueError(
            f"hidden must be the (B, S, C) last hidden states, got shape {tuple(hidden.shape)}; "
            "add a batch dimension with hidden[None]"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[2]:
        raise ValueError(
            f"weight must be the (V, C) output head with C = hidden.shape[-1] = "
            f"{hidden.shape[2]}, got shape {tuple(weight.shape)}; pass lm_head.weight (not its "
            "transpose)"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(
            f"bias must have shape (V,) = ({weight.shape[0]},) like weight[:, 0], got "
            f"{tuple(bias.shape)}"
        )
    for name, x in (("weight", weight), ("bias", bias)):
        if x is not None and x.device != hidden.device:
            raise ValueError(
                f"{name} is on {x.device} but hidden is on {hidden.device}; move it with "
                f"{name}.to(hidden.device)"
            )
    for name, value in (("softcap", softcap), ("chunk_size", chunk_size)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number or None, got {type(value).__name__}")
        if not value > 0 or not math.isfinite(value):
            raise ValueError(f"{name} must be a positive number or None, got {value!r}")
    if chunk_size is not None and not float(chunk_size).is_integer():
        raise ValueError(f"chunk_size must be a whole number of tokens, got {chunk_size!r}")
