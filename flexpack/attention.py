"""flexpack.attention: masked attention for packed rows, on every device, forward and backward.

One call picks the path that can run the mask on the inputs' device:

========  ==========================================================================
device    path (``backend="auto"``)
========  ==========================================================================
CUDA      document / document_causal masks in fp16/bf16, head dim a multiple of 8 up to 256:
          torch's varlen FlashAttention (document_causal & sliding_window(W) too, with its
          ``window_size=(W, 0)``: every document is one run of its row); causal alone:
          SDPA ``is_causal`` (fp32 with GQA: k, v repeated, so SDPA stays off its O(S^2) math
          kernel); float64 or head dims above 256:
          SDPA (per document, per segment for trees, else a dense mask); any other mask:
          compiled flex_attention, with a BlockMask of 128-token blocks built once per forward
          (head dims below 16 zero-padded to 16; rows padded to a bucket length, see below)
CPU       document / document_causal masks: SDPA per document (2.6-3.8x faster than compiled
          flex in the forward in bench/attention.py; flex has no CPU backward); causal alone: SDPA
          ``is_causal``; tree masks: SDPA per segment (compiles nothing); any other mask inside
          documents (prefix_lm, ``document(d) & ...``): SDPA per document with the mask
          evaluated on the document's own block; other masks: compiled flex_attention without
          grad (float64, which CPU flex lacks, stays on SDPA), SDPA with a dense mask with grad
========  ==========================================================================

Every path computes the same function: query q attends key kv iff the mask allows (q, kv);
a query with no allowed key (padding) gets 0, never NaN, in the output and in the gradients.

Mixed precision follows SDPA's autocast contract: inside ``torch.autocast(device_type, dtype)``,
q, k and v (float32 or half) are cast to the autocast dtype and the output is in it; gradients
flow back to the original tensors. With ``softcap`` (Gemma 2's attention-logit soft-capping) the
varlen and ``is_causal`` kernels, which cannot cap, give way to flex on CUDA; the SDPA paths
write SDPA's math out with the cap.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexpack import _attention_flex, _attention_sdpa, _attention_tree
from flexpack import masks as _masks
from flexpack._attention_flex import RecompileLimitError
from flexpack._tensor_cache import PerTensor, all_match, make_room, on_clear, stamps
from flexpack.layout import _check_runs

__all__ = ["RecompileLimitError", "attention"]

Backend = Literal["auto", "flex", "varlen", "sdpa"]
_BACKENDS = ("auto", "flex", "varlen", "sdpa")
_DOCUMENT_KINDS = ("document", "document_causal")
# Largest head dim "auto" sends to flex on CUDA (inductor's flex kernels; larger head dims and
# float64 go to SDPA, which runs them).
_FLEX_CUDA_MAX_HEAD_DIM = 256
# Masks that let no padding token (id -1) attend or be attended: padded ids mask the tail.
_PADDING_EXCLUDED = ("document", "document_causal", "padding", "prefix_lm", "tree")
# Smallest bucket length of the flex path (see flex_row_length).
_FLEX_MIN_BUCKET = 128


@dataclass(frozen=True)
class _MaskSpec:
    """What the dispatcher knows about a mask argument."""

    kind: str | None  # flexpack Mask kind; None for a foreign BlockMask
    doc_ids: Tensor | None  # (Bm, S) int, Bm in {1, B}; None when the mask has none
    mask: Any  # the flexpack Mask, or None
    block_mask: BlockMask | None  # given by the caller, or None (built on demand)


def _is_flexpack_mask(obj: object) -> bool:
    # Duck-typed (as flexpack.testing does) so that any object honouring the Mask contract works.
    return hasattr(obj, "mask_mod") and hasattr(obj, "kind") and not isinstance(obj, BlockMask)


def _layout_hint(q: Tensor, mask_len: int) -> str:
    """A sentence for a shape mismatch that is really q in (B, S, H, D), the transformers layout."""
    if q.shape[1] == mask_len and q.shape[2] != mask_len:
        return (
            f". q has shape {tuple(q.shape)}: that looks like (B, S, H, D), but flexpack.attention "
            f"takes q, k, v as (B, H, S, D); pass q.transpose(1, 2), k.transpose(1, 2), "
            f"v.transpose(1, 2) and transpose the output back (the mask is right as it is)"
        )
    return ""


def _mask_spec(mask: object, q: Tensor) -> _MaskSpec:
    B, _, S, _ = q.shape
    block_mask = None
    if isinstance(mask, BlockMask):
        block_mask = mask
        recovered = _masks.mask_of(mask)  # the flexpack Mask behind it, None if foreign
        if block_mask.seq_lengths != (S, S):
            raise ValueError(
                f"the BlockMask is for (Q_LEN, KV_LEN)={tuple(block_mask.seq_lengths)} but q, k, v "
                f"have sequence length {S}; build the mask from doc_ids of shape (B, {S})"
                + _layout_hint(q, block_mask.seq_lengths[0])
            )
        Bm = int(block_mask.kv_num_blocks.shape[0])
        if Bm not in (1, B):
            raise ValueError(
                f"the BlockMask has batch size {Bm} but q has batch size {B}; expected 1 or {B}"
            )
        if block_mask.kv_num_blocks.device != q.device:
            how = (
                f"flexpack.masks.mask_of(block_mask).to({str(q.device)!r}).block_mask()"
                if recovered is not None
                else f"create_block_mask(..., device={str(q.device)!r}) with a mask_mod that "
                "reads tensors on that device"
            )
            raise ValueError(
                f"the BlockMask is on {block_mask.kv_num_blocks.device} but q is on {q.device}. "
                "BlockMask.to(device) moves the block tables but not the tensors its mask_mod "
                f"reads, so rebuild it on q's device: {how}"
            )
        if recovered is None:
            return _MaskSpec(kind=None, doc_ids=None, mask=None, block_mask=block_mask)
        mask = recovered
        if any(t.device != q.device for t in _mask_tensors(mask)):
            # A flexpack BlockMask moved with BlockMask.to(): its tables moved, the tensors its
            # mask_mod reads did not. Read them from a copy of the mask on q's device.
            mask = mask.to(q.device)
            block_mask = _with_mask_mod(block_mask, mask.mask_mod)
    elif not _is_flexpack_mask(mask):
        raise TypeError(
            f"mask must be a flexpack Mask (flexpack.masks.document(doc_ids) & "
            f"flexpack.masks.causal(), ...) or a BlockMask (flexpack.document_causal_mask(...)), "
            f"got {type(mask).__name__}"
        )
    doc_ids = getattr(mask, "doc_ids", None)
    if doc_ids is not None:
        if doc_ids.dim() == 1:
            doc_ids = doc_ids.unsqueeze(0)
        if doc_ids.dim() != 2 or doc_ids.shape[1] != S or doc_ids.shape[0] not in (1, B):
            raise ValueError(
                f"the mask was built from doc_ids of shape {tuple(mask.doc_ids.shape)} but q has "
                f"batch size {B} and sequence length {S}; expected doc_ids of shape ({B}, {S}), "
                f"(1, {S}) or ({S},)" + _layout_hint(q, doc_ids.shape[1])
            )
        if doc_ids.device != q.device:
            raise ValueError(
                f"the mask's doc_ids are on {doc_ids.device} but q is on {q.device}; "
                "move the mask with mask.to(q.device) (it moves every tensor the mask reads), "
                "or build it from doc_ids on q's device"
            )
    return _MaskSpec(kind=mask.kind, doc_ids=doc_ids, mask=mask, block_mask=block_mask)


def _mask_tensors(mask: object) -> list[Tensor]:
    tensors = getattr(mask, "_tensors", None)
    if tensors is not None:
        return tensors()
    doc_ids = getattr(mask, "doc_ids", None)
    return [] if doc_ids is None else [doc_ids]


def _with_mask_mod(block_mask: BlockMask, mask_mod: Any) -> BlockMask:
    """The same block tables with another mask_mod (no copy)."""
    return BlockMask(
        seq_lengths=block_mask.seq_lengths,
        kv_num_blocks=block_mask.kv_num_blocks,
        kv_indices=block_mask.kv_indices,
        full_kv_num_blocks=block_mask.full_kv_num_blocks,
        full_kv_indices=block_mask.full_kv_indices,
        q_num_blocks=block_mask.q_num_blocks,
        q_indices=block_mask.q_indices,
        full_q_num_blocks=block_mask.full_q_num_blocks,
        full_q_indices=block_mask.full_q_indices,
        BLOCK_SIZE=block_mask.BLOCK_SIZE,
        mask_mod=mask_mod,
    )


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype of the enclosing ``torch.autocast`` region for ``device_type``; None outside."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except RuntimeError:  # a device type autocast does not know (meta, ...)
        pass
    return None


def _autocast(x: Any, dtype: torch.dtype | None) -> Any:
    # What autocast does to an SDPA input: float32 and half tensors are cast, float64 is not.
    if dtype is None or not isinstance(x, Tensor) or not x.is_floating_point():
        return x
    return x if x.dtype in (dtype, torch.float64) else x.to(dtype)


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (B, H, S, D), got shape {tuple(x.shape)}; "
                "for (B, S, H, D) activations pass x.transpose(1, 2)"
            )
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}. In a "
            "mixed-precision model, run it under torch.autocast(device_type, "
            "dtype=torch.bfloat16): flexpack.attention then casts q, k, v to that dtype, as "
            "SDPA does. Otherwise cast them yourself with .to(dtype)."
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, Hq, S, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2] != S or k.shape[3] != D:
        raise ValueError(
            f"expected k and v of shape ({B}, Hkv, {S}, {D}) to match q {tuple(q.shape)}, got "
            f"k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    Hkv = k.shape[1]
    if Hkv != Hq and not enable_gqa:
        raise ValueError(
            f"q has {Hq} heads but k and v have {Hkv}; pass enable_gqa=True for grouped-query "
            "attention (or repeat k and v to the query heads)"
        )
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(
            f"grouped-query attention needs the query heads ({Hq}) to be a multiple of the "
            f"key/value heads ({Hkv})"
        )


def _needs_grad(q: Tensor, k: Tensor, v: Tensor) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _varlen_head_dim(D: int) -> bool:
    """FlashAttention 2's head dims (torch's varlen kernel): multiples of 8, at most 256."""
    return D % 8 == 0 and D <= _attention_flex.VARLEN_MAX_HEAD_DIM


def _choose_path(
    q: Tensor, k: Tensor, v: Tensor, spec: _MaskSpec, backend: str, softcap: float | None = None
) -> str:
    """The path for these inputs: "flex", "varlen", "sdpa_document", "sdpa_document_window",
    "sdpa_causal", "sdpa_tree", "sdpa_document_masked", "sdpa_dense".

    Raises ValueError when ``backend`` cannot run this mask on this device.
    """
    on_cuda = q.device.type == "cuda"
    grad = _needs_grad(q, k, v)
    per_document = spec.kind in _DOCUMENT_KINDS and spec.doc_ids is not None
    windowed = _document_window(spec) is not None
    within_documents = _documents_of(spec) is not None

    def sdpa_path() -> str:
        if per_document:
            return "sdpa_document"
        if windowed:
            return "sdpa_document_window"  # each document's own band, one SDPA call per doc
        if spec.kind == "causal":
            return "sdpa_causal"
        if spec.kind == "tree" and spec.mask is not None:
            return "sdpa_tree"  # one SDPA call per segment (flexpack._attention_tree)
        if within_documents:
            return "sdpa_document_masked"  # the mask on each document's own L x L block
        return "sdpa_dense"

    if backend == "sdpa":
        return sdpa_path()
    if backend == "flex":
        if grad and q.device.type == "cpu":
            raise ValueError(
                f"backend='flex' cannot train on CPU: torch {torch.__version__}'s flex_attention "
                "has no CPU backward. Use backend='auto' or 'sdpa' (same result, with a "
                "backward), or run under torch.no_grad()"
            )
        if on_cuda and (q.dtype == torch.float64 or q.shape[-1] > _FLEX_CUDA_MAX_HEAD_DIM):
            raise ValueError(
                f"backend='flex' cannot run q of {q.dtype} with head dim {q.shape[-1]} on CUDA: "
                "inductor's flex kernels take float16, bfloat16 and float32 with head dims up to "
                f"{_FLEX_CUDA_MAX_HEAD_DIM}. Use backend='auto' or 'sdpa' (SDPA runs it, with a "
                "dense mask or per document), or cast q, k, v with .float()"
            )
        if q.dtype == torch.float64 and q.device.type == "cpu":
            raise ValueError(
                f"backend='flex' cannot run float64 on CPU: torch {torch.__version__}'s CPU "
                "flex_attention takes float32, float16 and bfloat16 only. Use backend='auto' or "
                "'sdpa' (float64 runs there), or cast q, k, v with .float()"
            )
        return "flex"
    if backend == "varlen":
        problems = []
        if not on_cuda:
            problems.append(f"it runs on CUDA only (q is on {q.device})")
        if q.dtype not in _attention_flex.VARLEN_DTYPES:
            problems.append(f"it needs float16 or bfloat16 (q is {q.dtype})")
        if not (per_document or windowed):
            what = "a foreign BlockMask" if spec.kind is None else f"a {spec.kind!r} mask"
            problems.append(
                "it supports document and document_causal masks, and document_causal & "
                f"sliding_window, only (got {what})"
            )
        if softcap is not None:
            problems.append("it has no attention-logit soft-capping (softcap)")
        if not _varlen_head_dim(q.shape[-1]):
            problems.append(
                f"FlashAttention takes head dims that are multiples of 8 up to "
                f"{_attention_flex.VARLEN_MAX_HEAD_DIM} (q has {q.shape[-1]})"
            )
        if on_cuda and not _attention_flex.varlen_available(q.device):
            problems.append(
                f"it needs torch >= 2.10 (have {torch.__version__}) and a GPU of compute "
                "capability >= 8.0"
            )
        if problems:
            raise ValueError(
                "backend='varlen' cannot run here: "
                + "; ".join(problems)
                + ". Use backend='auto' to pick a path that can."
            )
        return "varlen_window" if windowed else "varlen"
    # backend == "auto"
    if on_cuda:
        if (
            (per_document or windowed)
            and softcap is None
            and _varlen_head_dim(q.shape[-1])
            and q.dtype in _attention_flex.VARLEN_DTYPES
            and _attention_flex.varlen_available(q.device)
        ):
            # A window: FlashAttention's window_size=(W, 0) (every document is one run).
            return "varlen_window" if windowed else "varlen"
        if spec.kind == "causal" and softcap is None:
            return "sdpa_causal"
        if q.dtype == torch.float64 or q.shape[-1] > _FLEX_CUDA_MAX_HEAD_DIM:
            return sdpa_path()  # beyond inductor's flex kernels: SDPA runs anything
        return "flex"
    if per_document or spec.kind == "causal" or windowed:
        # On CPU, SDPA per document beats compiled flex even without grad (bench/attention.py).
        return sdpa_path()
    if spec.kind == "tree" and spec.mask is not None:
        # Per-segment SDPA compiles nothing: new row or segment counts cost nothing, where
        # compiled flex took seconds per new layout on CPU (the reference pass of an RL step).
        return sdpa_path()
    if within_documents:
        # Any mask inside the documents (prefix-LM, Gemma 3's image spans, windows over split
        # documents): SDPA on each document's block compiles nothing and beats flex on CPU.
        return sdpa_path()
    if q.device.type == "cpu" and not grad and q.dtype != torch.float64:
        return "flex"  # (flex on CPU has no float64 kernel: float64 stays on SDPA)
    return sdpa_path()


def _documents_of(spec: _MaskSpec) -> Tensor | None:
    """The doc ids (B or 1, S) of a mask that allows no pair across their documents, else None.

    A prefix_lm mask, or an AND with a document / document_causal / prefix_lm factor: every
    allowed pair lies in one document of that factor, so the mask can be evaluated and applied
    block by block (``per_document_sdpa(mask_mod=...)``)."""
    mask = spec.mask
    if mask is None:
        return None
    within = ("prefix_lm", *_DOCUMENT_KINDS)
    factors = mask.children if mask.kind == "and" else (mask,)
    for factor in factors:
        if factor.kind in within and factor.doc_ids is not None:
            return factor.doc_ids
    return None


def _document_window(spec: _MaskSpec) -> int | None:
    """The window of a ``document_causal & sliding_window(w)`` mask (either order), else None."""
    mask = spec.mask
    if spec.kind != "and" or spec.doc_ids is None or len(mask.children) != 2:
        return None
    kinds = sorted(c.kind for c in mask.children)
    if kinds != ["document_causal", "sliding_window"]:
        return None
    return next(c.window for c in mask.children if c.kind == "sliding_window")


def _check_split_runs(spec: _MaskSpec, path: str, B: int) -> None:
    """Refuse a mask whose documents name an id for two runs of a row (flexpack.layout's one
    rule and ValueError), without a host sync of its own where the path syncs anyway.

    The factories check on the host; on an accelerator the check waits for the call: the
    varlen and per-document plans count runs and documents in their one sync (one run each
    iff the counts agree), and the flex path's block mask checks with its own
    (``Mask.block_mask``). Other paths (a dense mask, documents of a second factor) check once
    per tensor.
    """
    if spec.mask is None or path == "flex" or torch.compiler.is_compiling():
        return
    planned = _documents_of(spec)  # the ids the per-document SDPA paths plan by
    for d in _masks._documents_of(spec.mask):
        if path in ("varlen", "varlen_window"):
            one_run_each = _attention_flex.varlen_windows_exactly(d, B)  # the plan's flag
        elif path.startswith("sdpa_document") and d is planned:
            one_run_each = _attention_sdpa.contiguous_documents(d, B)  # the plan's flag
        else:
            one_run_each = False  # not planned: check
        if not one_run_each:
            _check_runs(d)  # raises with the id and its positions


def _kv_for_causal_sdpa(
    q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool
) -> tuple[Tensor, Tensor, bool]:
    """k, v (and enable_gqa) for SDPA ``is_causal`` without its O(S^2) math fallback.

    On CUDA, SDPA's GQA runs in the flash kernel only, which takes fp16/bf16: fp32 with
    ``enable_gqa`` falls back to the math kernel (the (B, H, S, S) score matrix). Repeating k
    and v to the query heads (O(S) memory) keeps the memory-efficient kernel.
    """
    Hq, Hkv = q.shape[1], k.shape[1]
    if q.device.type == "cuda" and enable_gqa and Hkv != Hq and q.dtype == torch.float32:
        rep = Hq // Hkv
        return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), False
    return k, v, enable_gqa


# BlockMasks built for flexpack Masks on the flex path, reused by every layer of a forward:
# (id of the mask_mod, B, S, block size, device) -> (mask_mod, tensor stamps, BlockMask). The
# BlockMask holds its mask_mod, so an id is never reused while its entry lives.
_BLOCK_MASKS: dict[tuple, tuple[Any, tuple, BlockMask]] = {}
_MAX_BLOCK_MASKS = 8
on_clear(_BLOCK_MASKS.clear)


def _cached_block_mask(mask: Any, B: int, S: int, block_size: int, device: torch.device):
    """``mask.block_mask(...)``, built once while the mask and its tensors are unchanged."""
    tensors = _mask_tensors(mask)
    key = (id(mask.mask_mod), B, S, block_size, str(device))
    hit = _BLOCK_MASKS.get(key)
    if hit is not None and hit[0] is mask.mask_mod and all_match(hit[1], tensors):
        return hit[2]
    # Masks with doc ids build on their device (that of q, checked by _mask_spec).
    where = None if getattr(mask, "doc_ids", None) is not None else device
    built = mask.block_mask(B=B, Q_LEN=S, KV_LEN=S, device=where, block_size=block_size)
    make_room(_BLOCK_MASKS, _MAX_BLOCK_MASKS)
    _BLOCK_MASKS[key] = (mask.mask_mod, stamps(tensors), built)
    return built


def _bucketed_flex(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spec: _MaskSpec,
    *,
    scale: float | None,
    enable_gqa: bool,
    softcap: float | None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Compiled flex on ``spec``: a flexpack Mask's call padded to its (B, S) bucket."""
    B, S = q.shape[0], q.shape[2]
    if not torch.is_grad_enabled():
        # flex_attention rejects CPU inputs that require grad even under no_grad, where no
        # graph is recorded anyway.
        q, k, v = q.detach(), k.detach(), v.detach()
    B_flex, S_flex, bucket = B, S, None
    if spec.block_mask is None and isinstance(spec.mask, _masks.Mask):
        # Rows padded to the bucket length (the tail masked as padding) and the batch to a
        # bucket row count (padding rows attend nothing): one compiled graph per (B, S)
        # bucket instead of one per shape. Masks that need a padding factor for the tail
        # get it at every S, so that a row of exactly a bucket length runs the same graph.
        B_flex, S_flex = _attention_flex.flex_batch_rows(B), flex_row_length(S)
        bucket = (B_flex, S_flex)
        if (B_flex, S_flex) != (B, S) or not _excludes_padding(spec.mask):
            spec = _padded_spec(spec.mask, B, S, B_flex, S_flex, q.device)
        if (B_flex, S_flex) != (B, S):
            pad = (0, 0, 0, S_flex - S, 0, 0, 0, B_flex - B)
            q, k, v = (F.pad(x, pad) for x in (q, k, v))
    block_mask = _flex_block_mask(spec, S_flex, q.device)
    out = _attention_flex.flex(
        q, k, v, block_mask, scale=scale, enable_gqa=enable_gqa, softcap=softcap,
        bucket=bucket, return_lse=return_lse,
    )  # fmt: skip
    if (B_flex, S_flex) == (B, S):
        return out
    if return_lse:
        return out[0][:B, :, :S], out[1][:B, :, :S]
    return out[:B, :, :S]


def flex_with_lse(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Any,
    *,
    scale: float | None,
    enable_gqa: bool,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Compiled flex on a flexpack Mask (or a BlockMask built from one) with its LSE, bucketed as
    :func:`attention`'s flex path is: ``(out (B, Hq, S, D), lse (B, Hq, S) float32)``. For
    CUDA (CPU inductor's flex returns no LSE); attention sinks use it."""
    spec = _mask_spec(mask, q)
    return _bucketed_flex(
        q, k, v, spec, scale=scale, enable_gqa=enable_gqa, softcap=softcap, return_lse=True
    )


def _flex_block_mask(spec: _MaskSpec, S: int, device: torch.device) -> BlockMask:
    """The BlockMask flex runs with: the caller's, or one built (once) from the flexpack mask.

    On CUDA, inductor's flex configs use blocks of up to 128 (sm90 bf16: BLOCK_M=128) and fail
    on a BlockMask whose block size they do not divide; the backward has no config at all for
    64-token blocks there. A flexpack BlockMask of another block size is rebuilt at 128; a
    foreign one raises with the fix.
    """
    block_mask = spec.block_mask
    multiple = _attention_flex.CUDA_BLOCK_MULTIPLE
    if block_mask is not None:
        sizes = tuple(block_mask.BLOCK_SIZE)
        if device.type != "cuda" or all(b % multiple == 0 for b in sizes):
            return block_mask
        if spec.mask is None:
            raise ValueError(
                f"the BlockMask has BLOCK_SIZE={sizes}, but flex_attention on CUDA needs "
                f"multiples of {multiple}: torch {torch.__version__}'s kernels use blocks of up "
                f"to {multiple} (BLOCK_M=128 for bf16 on sm90) and fail to compile otherwise. "
                f"Build it with create_block_mask(..., BLOCK_SIZE={multiple})."
            )
        block_size = multiple * -(-max(sizes) // multiple)
    else:
        block_size = multiple  # flexpack's default block size, right for CUDA and CPU alike
    Bm = spec.doc_ids.shape[0] if spec.doc_ids is not None else 1
    return _cached_block_mask(spec.mask, Bm, S, block_size, device)


def flex_row_length(S: int) -> int:
    """The row length the flex path compiles for rows of S tokens: the bucket S is padded to.

    Buckets are 128 * 2**k (128, 256, 512, ...): ``flexpack.attention`` given a flexpack Mask
    (not a BlockMask) on the flex path pads q, k, v and the mask's tensors to the bucket, masks
    the tail as padding (no query attends to it; its own outputs are dropped) and compiles one
    graph per bucket, so rows of varying length (``DataCollatorWithFlattening``, a last short
    batch) compile at most log2(S_max / 64) graphs instead of one per length. Padded blocks are
    empty, so flex skips them; the cost is the copy of q, k, v into the padded length. The
    row count is bucketed the same way (:func:`flexpack._attention_flex.flex_batch_rows`), and
    each (rows, length) bucket gets a compiled wrapper of its own, so batches of any shape
    compile one graph per bucket and never reach dynamo's recompile limit. A BlockMask you pass
    runs at its own shape.

    Example:
        >>> [flex_row_length(S) for S in (1, 128, 129, 1000, 4096)]
        [128, 128, 256, 1024, 4096]
    """
    bucket = _FLEX_MIN_BUCKET
    while bucket < S:
        bucket *= 2
    return bucket


# Padded copies of flexpack Masks for the flex path's bucket lengths, as _BLOCK_MASKS:
# (id of the mask_mod, B, B_flex, S_flex) -> (mask_mod, tensor stamps, padded Mask).
_PADDED: dict[tuple, tuple[Any, tuple, Any]] = {}
on_clear(_PADDED.clear)


def _excludes_padding(mask: Any) -> bool:
    """Whether no token of id -1 attends or is attended under ``mask`` (so padded ids alone
    mask a padded tail)."""
    if mask.kind in _PADDING_EXCLUDED:
        return True
    return mask.kind == "and" and any(_excludes_padding(c) for c in mask.children)


# Padded copies of a mask's tensors, per tensor and width. Two masks over one row's ids (a model's
# sliding and full layers) then share one padded tensor, and with it the block-mask code's
# per-tensor facts (one host sync per forward, not one per mask).
_PADDED_TENSORS: PerTensor[Tensor] = PerTensor(16)


def _padded_tensor(t: Tensor, n: int, B: int, B_flex: int) -> Tensor:
    """``t`` with n more columns and, when ``B_flex > B``, its rows first expanded to B (a
    one-row mask serves every row) and then ``B_flex - B`` more: -1 for ids and tree ends,
    False for prefix flags (padding rows attend nothing, so flex skips their blocks)."""
    # (B, S) doc / segment ids and prefix flags; (B, S + 1) tree ends: -1 / False
    value = False if t.dtype == torch.bool else -1

    def build() -> Tensor:
        if B_flex == B:
            return F.pad(t, (0, n), value=value)
        rows = t.expand(B, t.shape[1]) if t.shape[0] == 1 else t
        return F.pad(rows, (0, n, 0, B_flex - B), value=value)

    return _PADDED_TENSORS.get(t, build, (n, B, B_flex))


def _padded_spec(
    mask: _masks.Mask, B: int, S: int, B_flex: int, S_flex: int, device: torch.device
) -> _MaskSpec:
    """The spec of ``mask`` padded from (B, S) to (B_flex, S_flex): same pairs on the first S
    tokens of the first B rows, and nothing attends to the tail or the padding rows or from them
    (built once per mask and bucket)."""
    tensors = _mask_tensors(mask)
    key = (id(mask.mask_mod), B, B_flex, S_flex)
    hit = _PADDED.get(key)
    if hit is not None and hit[0] is mask.mask_mod and all_match(hit[1], tensors):
        padded = hit[2]
    else:
        n = S_flex - S

        def pad(t: Tensor | None) -> Tensor | None:
            if t is None or t.dim() == 0 or (n == 0 and B_flex == B):
                return t  # a window limit
            return _padded_tensor(t, n, B, B_flex)

        doc_ids = mask.doc_ids
        rows = B_flex  # every table is padded to B_flex rows, unless no row is added:
        if B_flex == B:
            rows = 1 if doc_ids is None else doc_ids.shape[0]
        tail = torch.zeros(rows, S_flex, dtype=torch.int32, device=device)
        tail[:, S:] = -1  # a fill on the device: no host-to-device copy
        tail[B:] = -1  # padding rows (B_flex > B)
        padded = mask._rebuilt(pad)
        if not _excludes_padding(padded):
            padded = padded & _masks.padding(tail)
        make_room(_PADDED, _MAX_BLOCK_MASKS)
        _PADDED[key] = (mask.mask_mod, stamps(tensors), padded)
    return _MaskSpec(kind=padded.kind, doc_ids=padded.doc_ids, mask=padded, block_mask=None)


def _dense_mask(spec: _MaskSpec, B: int, Hq: int, S: int, device: torch.device) -> Tensor:
    if spec.mask is None:  # a foreign BlockMask: reproduce exactly what flex computes with it
        return _attention_sdpa.dense_mask_from_block_mask(spec.block_mask, B, device)
    Bm = spec.doc_ids.shape[0] if spec.doc_ids is not None else 1
    return _attention_sdpa.dense_mask_from_mod(spec.mask.mask_mod, Bm, 1, S, device)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Any,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
    backend: Backend = "auto",
    softcap: float | None = None,
) -> Tensor:
    """Masked scaled-dot-product attention for packed rows, with a backward on every device.

    Shape legend: B batch (rows), Hq query heads, Hkv key/value heads, S tokens per row, D head
    dimension.

    Args:
        q: (B, Hq, S, D) float16, bfloat16, float32 (or float64 on the SDPA paths).
        k, v: (B, Hkv, S, D), same dtype and device as q (inside ``torch.autocast`` all three
            are cast to the autocast dtype first, as SDPA does). Hkv < Hq needs
            ``enable_gqa=True`` and Hq % Hkv == 0.
        mask: a flexpack mask (``flexpack.masks.document(doc_ids) & flexpack.masks.causal()``,
            ...) or a BlockMask (``flexpack.document_causal_mask(doc_ids)``, or one of your own
            from ``create_block_mask``), for (S, S) and batch size 1 or B, on q's device. A
            mask of batch size 1 is broadcast: every one of the B rows gets that row's layout
            (as a (1, S) ``position_ids`` serves a whole batch in transformers). For rows that
            each hold their own documents, build the mask from their (B, S) doc_ids.
            flexpack masks let the call pick per-document kernels; a foreign BlockMask runs on
            the "flex" backend, or on "sdpa" through its dense twin. On the flex path a Mask is
            turned into a BlockMask on every call: in a model, build ``mask.block_mask()`` (or
            ``flexpack.document_causal_mask``) once per batch and pass it to every layer.
        scale: softmax scale; default ``1 / sqrt(D)``.
        enable_gqa: allow Hkv < Hq (grouped-query attention).
        backend: "auto" (default) picks the fastest path that supports the mask, device and
            whether a backward is needed (see the module docstring; on CPU without grad, masks
            other than document / causal compile flex_attention once per shape: seconds).
            "flex": compiled flex_attention, compiled once per (device, dtype) and shape, never
            recompiled for a new document layout. "varlen": torch's FlashAttention varlen kernel
            (``torch.nn.attention.varlen.varlen_attn``; CUDA, fp16/bf16, document and
            document_causal masks, and document_causal & sliding_window). "sdpa":
            ``scaled_dot_product_attention`` per document for document masks and any mask
            inside documents (the mask evaluated on each document's own block), with a dense
            (B, 1, S, S) mask otherwise; any device, with backward.
        softcap: attention-logit soft-capping as in Gemma 2: scores become
            ``softcap * tanh(scores / softcap)`` after ``scale``, before masking. None (default)
            for none. Runs on every backend but "varlen"; on CUDA "auto" uses flex for it.

    Returns:
        (B, Hq, S, D) tensor, q's dtype and device (the autocast dtype inside
        ``torch.autocast``). Queries with no allowed key (padding) are 0.

    Raises:
        TypeError: q, k, v are not floating tensors of one dtype (outside autocast); ``mask`` is
            neither a flexpack mask nor a BlockMask; ``scale`` or ``softcap`` is not a number.
        ValueError: shapes disagree (q vs k/v, mask vs S or B), devices disagree, Hkv != Hq
            without ``enable_gqa``, an unknown backend, or a backend that cannot run this mask
            here ("flex" with grad or float64 on CPU, "varlen" off CUDA / in fp32 / on a
            non-document mask / with softcap), a softcap that is not positive and finite; the
            mask's doc ids name an id for two separate runs of a row (checked here, with the
            plan's host sync, when the mask was built on an accelerator).
        RecompileLimitError: compiled flex_attention hit dynamo's recompile limit (too many
            distinct shapes); raised instead of silently running eagerly, many times slower.

    Example:
        >>> import torch, flexpack
        >>> doc_ids = torch.tensor([[0, 0, 0, 1, 1, -1]])  # (B, S); -1 is padding
        >>> mask = flexpack.masks.document(doc_ids) & flexpack.masks.causal()
        >>> q = torch.randn(1, 2, 6, 8, requires_grad=True)  # (B, Hq, S, D)
        >>> k = v = torch.randn(1, 1, 6, 8)  # (B, Hkv, S, D)
        >>> out = flexpack.attention(q, k, v, mask, enable_gqa=True)
        >>> out.shape, bool(out[0, :, -1].eq(0).all())  # padding gives 0
        (torch.Size([1, 2, 6, 8]), True)
        >>> out.sum().backward()  # on CPU too: the per-document SDPA path
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if isinstance(q, Tensor):
        autocast_dtype = _autocast_dtype(q.device.type)
        q, k, v = (_autocast(x, autocast_dtype) for x in (q, k, v))
        if autocast_dtype is not None:
            # Inputs are in the autocast dtype now; the paths below must not recast their
            # internals (mask arithmetic, the softcap math in float32).
            with torch.autocast(q.device.type, enabled=False):
                return attention(
                    q, k, v, mask, scale=scale, enable_gqa=enable_gqa, backend=backend,
                    softcap=softcap,
                )  # fmt: skip
    _check_inputs(q, k, v, enable_gqa)
    for name, value in (("scale", scale), ("softcap", softcap)):
        # numbers.Real takes numpy and Python scalars alike (np.float32(0.5) from a config)
        if value is not None and (
            isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real)
        ):
            raise TypeError(
                f"{name} must be a float or None, got {value!r} of type {type(value).__name__}; "
                f"pass a Python number, e.g. {name}=float(x) for a 0-d tensor."
            )
    if softcap is not None and not (0 < softcap < float("inf")):
        raise ValueError(
            f"softcap must be a positive finite number (Gemma 2 uses 50.0), got {softcap}; "
            "pass None for no soft-capping"
        )
    softcap = None if softcap is None else float(softcap)
    scale = None if scale is None else float(scale)
    spec = _mask_spec(mask, q)
    path = _choose_path(q, k, v, spec, backend, softcap)
    B, Hq, S, _ = q.shape
    if B == 0:  # an empty batch (a last, empty shard): an empty result, still in the graph
        return q * 0.0
    _check_split_runs(spec, path, B)

    if path == "varlen_window":
        # every document one run (checked above): the window in the row is the document's
        return _attention_flex.varlen(
            q, k, v, spec.mask.doc_ids, causal=True, scale=scale, enable_gqa=enable_gqa,
            window=_document_window(spec),
        )  # fmt: skip
    if path == "flex":
        return _bucketed_flex(q, k, v, spec, scale=scale, enable_gqa=enable_gqa, softcap=softcap)
    causal = spec.kind == "document_causal"
    if path == "varlen":
        # The mask's own doc_ids tensor (not a view): its grouping is cached across layers.
        return _attention_flex.varlen(
            q, k, v, spec.mask.doc_ids, causal=causal, scale=scale, enable_gqa=enable_gqa
        )
    if path == "sdpa_document":
        return _attention_sdpa.per_document_sdpa(
            q, k, v, spec.mask.doc_ids, causal=causal, scale=scale, enable_gqa=enable_gqa,
            softcap=softcap,
        )  # fmt: skip
    if path == "sdpa_document_window":
        return _attention_sdpa.per_document_sdpa(
            q, k, v, spec.mask.doc_ids, causal=True, scale=scale, enable_gqa=enable_gqa,
            softcap=softcap, window=_document_window(spec),
        )  # fmt: skip
    if path == "sdpa_document_masked":
        return _attention_sdpa.per_document_sdpa(
            q, k, v, _documents_of(spec), causal=False, scale=scale, enable_gqa=enable_gqa,
            softcap=softcap, mask_mod=spec.mask.mask_mod,
        )  # fmt: skip
    if path == "sdpa_causal":
        k, v, enable_gqa = _kv_for_causal_sdpa(q, k, v, enable_gqa)
        return _attention_sdpa.sdpa(
            q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa, softcap=softcap
        )
    if path == "sdpa_tree":
        spans = _attention_tree.spans_of(spec.mask)
        return _attention_tree.per_tree_sdpa(
            q, k, v, spans, scale=scale, enable_gqa=enable_gqa, softcap=softcap
        )
    dense = _dense_mask(spec, B, Hq, S, q.device)
    return _attention_sdpa.dense_sdpa(
        q, k, v, dense, scale=scale, enable_gqa=enable_gqa, softcap=softcap
    )
