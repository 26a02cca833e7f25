"""Kernel paths of ``flexpack.attention``: compiled flex_attention, torch's FlashAttention varlen.

Compilation is lazy and cached (nothing compiles at import). Shapes are fixed
(``dynamic=False``): a new (B, H, S, D) compiles once more, a new document layout, window or
softcap at the same shape does not (they are tensors the mask reads). ``flexpack.attention``
pads B and S of a flexpack Mask's call to bucket sizes (:func:`flex_batch_rows`,
``flexpack.attention.flex_row_length``), so any batch shape compiles one graph per bucket, each
in a wrapper of its own. Every configuration
(device, dtype, grad or not, scale, GQA, softcap, block size) gets its own compiled wrapper with
its own dynamo cache (``_compat.compile_isolated``: ``isolate_recompiles`` where torch has it, a
fresh code object on torch 2.11 and 2.12), so ``torch._dynamo.config.recompile_limit`` counts
the shapes of one configuration, not everything flex_attention ever ran on. Past that limit dynamo
would silently run flex_attention eagerly, which materializes the whole score matrix (one peer's
users lost 5x that way); here that case raises instead, naming the guard that failed.

CUDA facts this module works around (torch 2.13's inductor flex templates):

- head dims below 16 are rejected ("NYI: embedding dimension ... at least 16"): q, k and v are
  zero-padded to 16 channels (exact: zero channels add nothing to the scores, and the padded
  output channels are dropped), with the scale of the true head dim;
- the forward and backward configs use blocks of up to 128 (sm90 bf16: BLOCK_M=128), and a
  BlockMask whose block size they do not divide fails to compile; ``flexpack.attention`` keeps
  flex BlockMasks at multiples of 128 on CUDA (:data:`CUDA_BLOCK_MULTIPLE`);
- FlashAttention's varlen kernel takes head dims that are multiples of 8, up to 256.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from flexpack import _compat
from flexpack._attention_sdpa import _tokens, _untokens, cached_plan, document_groups
from flexpack._tensor_cache import make_room


class RecompileLimitError(RuntimeError):
    """Compiled flex_attention hit dynamo's recompile limit and would run eagerly (slowly)."""


# The dynamo backend of the compiled wrappers; the tests swap in dynamo's CompileCounter.
_BACKEND: object = "inductor"

# Smallest head dim inductor's CUDA flex kernels take (tl.dot needs 16).
MIN_CUDA_FLEX_HEAD_DIM = 16
# Block sizes of a BlockMask flex runs with on CUDA: the largest BLOCK_M / BLOCK_N of torch
# 2.13's default forward and backward configs (sm80/sm90/sm100) is 128, and every smaller one
# divides it.
CUDA_BLOCK_MULTIPLE = 128
# FlashAttention's varlen kernel: head dim a multiple of 8, at most 256.
VARLEN_MAX_HEAD_DIM = 256
# Backward blocks for head dims above 128 (Gemma 2's 256) on CUDA. Torch 2.11-2.13's default
# there (sm90: BLOCK_M1/N1/M2/N2 = 64, 2 stages, 4 warps) keeps the dK and dV accumulators of
# 64 x 256 fp32 in 128 threads, 256 registers a thread before anything else: the kernel spills
# ~3.9 KB a thread. Blocks of 32 rows over 8 warps hold them in 64 registers (and the k, v tiles
# in 32 more); one stage, since a second would double the tiles in shared memory. Every block
# still divides the 128-token BlockMask blocks (CUDA_BLOCK_MULTIPLE), and BLOCK_N1 % BLOCK_M1
# and BLOCK_M2 % BLOCK_N2 are 0, as the template asserts.
WIDE_HEAD_DIM = 128
WIDE_HEAD_BWD_OPTIONS = {
    "bwd_BLOCK_M1": 32,
    "bwd_BLOCK_N1": 32,
    "bwd_BLOCK_M2": 32,
    "bwd_BLOCK_N2": 32,
    "bwd_num_warps": 8,
    "bwd_num_stages": 1,
}


def flex_kernel_options(device: torch.device, head_dim: int, dtype: torch.dtype, grad: bool):
    """``kernel_options`` for compiled flex_attention where inductor's defaults spill, else None.

    CUDA, a backward, a half-precision head dim above :data:`WIDE_HEAD_DIM`:
    :data:`WIDE_HEAD_BWD_OPTIONS` (``bwd_`` options reach the backward kernel only; the forward
    keeps its defaults). float32 already runs 16-row backward blocks.

    Example:
        >>> flex_kernel_options(torch.device("cuda"), 256, torch.bfloat16, True)["bwd_BLOCK_N1"]
        32
        >>> flex_kernel_options(torch.device("cuda"), 128, torch.bfloat16, True) is None
        True
    """
    if device.type != "cuda" or not grad or head_dim <= WIDE_HEAD_DIM or dtype == torch.float32:
        return None
    return dict(WIDE_HEAD_BWD_OPTIONS)


def flex_batch_rows(B: int) -> int:
    """The row count the flex path compiles for a batch of B rows: the next power of two.

    ``flexpack.attention`` given a flexpack Mask pads the batch with rows of padding (q, k, v
    zero; the mask's ids -1, so every block of those rows is empty and flex skips it) and drops
    their outputs: a training loop whose row count varies (GRPO trees packed by
    ``flexpack.trees.pack_padded``, dynamic batching, a last short batch) compiles one graph per
    bucket, at most ``log2(B_max) + 1``. Shapes stay static (``dynamic=False``): no symbolic
    shapes reach inductor's flex templates.

    Example:
        >>> [flex_batch_rows(B) for B in (1, 2, 3, 5, 8, 9)]
        [1, 2, 4, 8, 8, 16]
    """
    bucket = 1
    while bucket < B:
        bucket *= 2
    return bucket


@functools.cache
def compiled_flex_attention(config: tuple, dynamic: bool = False):
    """``torch.compile(flex_attention)`` for one configuration, built once, with its own cache.

    ``config`` only keys the cache (device type, dtype, grad, scale, ...).
    :func:`flexpack._compat.compile_isolated` gives each wrapper its own dynamo cache entries and
    recompile count; the limit is ``torch._dynamo.config.recompile_limit`` at call time.
    """
    del config
    return _compat.compile_isolated(
        flex_attention, backend=_BACKEND, dynamic=dynamic, fullgraph=True
    )


def _recompile_limit() -> int:
    cfg = torch._dynamo.config
    return int(getattr(cfg, "recompile_limit", getattr(cfg, "cache_size_limit", 8)))


class _RecompileReason(logging.Handler):
    """Keeps the guard dynamo names when it hits the recompile limit ("last reason: ...").

    Dynamo logs that warning (``torch._dynamo.convert_frame``) right before it raises; the
    exception itself does not carry the reason.
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.local = threading.local()

    def emit(self, record: logging.LogRecord) -> None:
        if "hit config." in str(record.msg) and isinstance(record.args, tuple):
            if len(record.args) >= 4:
                self.local.reason = str(record.args[3])

    def take(self) -> str | None:
        reason = getattr(self.local, "reason", None)
        self.local.reason = None
        return reason


@functools.cache
def _reason_handler() -> _RecompileReason:
    handler = _RecompileReason()
    logging.getLogger("torch._dynamo.convert_frame").addHandler(handler)
    return handler


_QKV = ("query", "key", "value")
_DIMS = {
    "0": (
        "The number of rows B changed",
        "pass flexpack.attention a flexpack Mask (it pads B and S to bucket sizes), keep "
        "the rows per batch fixed (pad the batch with all-padding rows, doc ids -1), or group "
        "batches by row count",
    ),
    "1": ("The number of heads changed", "keep the head count fixed"),
    "2": (
        "The row length S changed",
        "pass flexpack.attention a flexpack Mask (it pads S to a bucket length, see "
        "flexpack.attention), or feed rows of a fixed length (pack to max_len and keep the "
        "padding)",
    ),
    "3": ("The head dim changed", "keep the head dim fixed"),
}


def _fix_for(reason: str | None) -> str:
    """What the failed guard means, and the fix that applies to it."""
    text = reason or ""
    for name in _QKV:
        if f"'{name}' size mismatch at index " in text:
            index = text.split(f"'{name}' size mismatch at index ", 1)[1][:1]
            what, fix = _DIMS.get(index, ("A size of q, k or v changed", "keep shapes fixed"))
            return f"{what} ({name} dim {index}). Fix: {fix}"
    if "size mismatch" in text or "stride mismatch" in text:
        return (
            "A tensor the mask or score_mod reads changed shape. Fix: give those tensors "
            "shapes that depend on (B, S) only (flexpack's masks do), not on the layout"
        )
    return (
        "Fix: feed rows of a fixed length (pack to max_len and keep the padding; a few "
        "bucket lengths at most) and keep mask parameters in tensors"
    )


def recompile_limit_message(reason: str | None, q: Tensor, k: Tensor, block_mask: BlockMask) -> str:
    """The RecompileLimitError text: the failed guard, this call's inputs, and the fix for it."""
    what = (
        f"the guard that failed: {reason.strip()}"
        if reason
        else "dynamo did not report which guard failed (TORCH_LOGS=recompiles shows it)"
    )
    return (
        f"compiled flex_attention hit torch._dynamo.config.recompile_limit="
        f"{_recompile_limit()} for one configuration (device, dtype, grad, scale, GQA, softcap "
        f"and block size each get their own compiled function); {what}. This call: q "
        f"{tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, block size {block_mask.BLOCK_SIZE}. "
        "Dynamo would now run flex_attention eagerly, which materializes the full score matrix "
        f"and is many times slower. {_fix_for(reason)}; or raise "
        "torch._dynamo.config.recompile_limit if you really need more variants."
    )


def flex_head_dim(device: torch.device, head_dim: int) -> int:
    """The head dim flex runs with: zero-padded to 16 on CUDA below 16, else unchanged."""
    if device.type == "cuda" and head_dim < MIN_CUDA_FLEX_HEAD_DIM:
        return MIN_CUDA_FLEX_HEAD_DIM
    return head_dim


def softcap_score_mod(softcap: float, device: torch.device):
    """The flex ``score_mod`` of attention-logit soft-capping: ``cap * tanh(score / cap)``.

    The cap is a 0-d tensor the closure reads, not a Python number baked into the graph, so a new
    value reuses the compiled kernel instead of recompiling. One closure per (cap, device), made
    once: every later layer and step reuses it, so no call copies a Python float to the device
    (on CUDA, a pageable host-to-device copy is a stream sync). The tensor is filled on the
    device (``torch.full``), not copied from the host, even the first time.
    """
    key = (float(softcap), str(torch.device(device)))
    mod = _SOFTCAP_MODS.get(key)
    if mod is None:
        cap = torch.full((), float(softcap), device=device)

        def softcap_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor):
            return cap * torch.tanh(score / cap)

        make_room(_SOFTCAP_MODS, 16)
        mod = _SOFTCAP_MODS[key] = softcap_mod
    return mod


# (cap, device) -> the softcap score_mod closure of :func:`softcap_score_mod`.
_SOFTCAP_MODS: dict[tuple[float, str], object] = {}


def flex(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    block_mask: BlockMask,
    *,
    scale: float | None,
    enable_gqa: bool,
    softcap: float | None = None,
    bucket: tuple[int, int] | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Compiled flex_attention; raises :class:`RecompileLimitError` instead of an eager fallback.

    ``return_lse=True`` returns ``(out, lse)``, lse (B, Hq, S) float32 (attention sinks read it);
    a graph of its own per bucket.

    Head dims below 16 on CUDA run zero-padded to 16 (see the module docstring). ``bucket``
    (rows, length) is the bucket shape of a call padded by ``flexpack.attention``: each bucket
    gets a compiled wrapper (and recompile count) of its own. None for shapes the caller chose
    (a BlockMask it passed): those count against the limit of one wrapper, so a loop that feeds
    a new shape every step is told to bucket instead of compiling without end.
    """
    D = q.shape[-1]
    padded = flex_head_dim(q.device, D)
    if padded != D:
        scale = D**-0.5 if scale is None else scale
        q, k, v = (F.pad(x, (0, padded - D)) for x in (q, k, v))
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    config = (
        q.device.type,
        q.dtype,
        grad,
        scale,
        enable_gqa,
        softcap is not None,
        tuple(block_mask.BLOCK_SIZE),
        return_lse,
        bucket,
    )
    fn = compiled_flex_attention(config)
    score_mod = None if softcap is None else softcap_score_mod(softcap, q.device)
    options = flex_kernel_options(q.device, q.shape[-1], q.dtype, grad)
    extra = {} if options is None else {"kernel_options": options}
    if return_lse:
        from torch.nn.attention.flex_attention import AuxRequest

        extra["return_aux"] = AuxRequest(lse=True)
    handler = _reason_handler()
    handler.take()
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            out = fn(
                q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                enable_gqa=enable_gqa, **extra,
            )  # fmt: skip
    except torch._dynamo.exc.FailOnRecompileLimitHit as err:
        raise RecompileLimitError(
            recompile_limit_message(handler.take(), q, k, block_mask)
        ) from err
    if return_lse:
        out, aux = out
        return (out[..., :D] if padded != D else out), aux.lse
    return out[..., :D] if padded != D else out


@functools.cache
def varlen_available(device: torch.device) -> bool:
    """Whether ``varlen_attn`` runs on ``device``: torch >= 2.10 ships it, and its FlashAttention
    kernels need a CUDA GPU of compute capability 8.0 (Ampere) or newer. Probed on first use."""
    if _compat.varlen_attn_function() is None:
        return False
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


VARLEN_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class _VarlenPlan:
    """Unpadding for varlen: order (T,), cu_seqlens (N + 1,) int32, max_seqlen, and whether the
    order is the identity (no padding, documents in order: no gather or scatter needed)."""

    order: Tensor
    cu_seqlens: Tensor
    max_seqlen: int
    identity: bool
    contiguous: bool = True  # every document one run of tokens: a window is its own band


def _varlen_plan(doc_ids: Tensor) -> _VarlenPlan:
    """The plan of (B, S) doc ids: ``document_groups`` (one host sync)."""
    groups = document_groups(doc_ids)
    return _VarlenPlan(
        groups.order, groups.cu_seqlens, groups.max_seqlen, groups.in_order, groups.contiguous
    )


def varlen_windows_exactly(doc_ids: Tensor, B: int) -> bool:
    """Whether varlen's ``window_size=(W, 0)`` is the mask ``document_causal & sliding_window(W)``
    over ``doc_ids`` (B or 1, S): every document one run of consecutive tokens, so positions in
    the document and in the row differ by a constant. Reads the cached varlen plan (its one
    host sync, shared with the call that follows)."""
    return cached_plan("varlen", doc_ids, B, _varlen_plan).contiguous


def layout_varlen_plan(layout, B: int | None = None) -> _VarlenPlan | None:
    """The varlen plan of a ``PackedLayout`` from its cached views: no host sync.

    The packer computes ``indices``, ``cu_seqlens`` and ``max_seqlen`` on the host; a layout
    moved with ``.to(device)`` carries them along. Returns None when a view has not been
    computed yet (computing it here would cost the syncs this avoids), or when ``B`` rows are
    asked of a layout with another number of rows.
    """
    cache = getattr(layout, "__dict__", {})
    if not all(name in cache for name in ("indices", "cu_seqlens", "max_seqlen")):
        return None
    rows, S = layout.shape
    if B is not None and B != rows:
        return None
    order = cache["indices"]  # ascending: documents are contiguous runs, in position order
    identity = order.numel() == rows * S  # no padding: every token, in order
    return _VarlenPlan(order, cache["cu_seqlens"], int(cache["max_seqlen"]), identity)


def use_layout(layout, doc_ids: Tensor | None = None) -> bool:
    """Let the varlen path take ``layout``'s host-computed plan for ``doc_ids``.

    Seeds the per-doc_ids plan cache for ``doc_ids`` (a mask's own copy of ``layout.doc_ids``;
    default ``layout.doc_ids``), so a mask over those ids runs varlen with no host sync at all.
    Returns whether the layout had its views cached.
    """
    plan = layout_varlen_plan(layout)
    if plan is None:
        return False
    rows = layout.shape[0]
    ids = layout.doc_ids if doc_ids is None else doc_ids
    cached_plan("varlen", ids, rows, lambda _: plan)
    return True


def varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    doc_ids: Tensor,
    *,
    causal: bool,
    scale: float | None,
    enable_gqa: bool,
    window: int | None = None,
) -> Tensor:
    """torch's FlashAttention varlen kernel over the documents of ``doc_ids`` (B or 1, S).

    ``window`` (with ``causal``): each query sees itself and the ``window`` keys before it in its
    document, FlashAttention's ``window_size=(window, 0)`` (torch 2.11 and 2.13 both take it);
    exact for ``document_causal & sliding_window(window)`` when every document is one run
    (:func:`varlen_windows_exactly`).

    Tokens are unpadded flash-attn style (``indices`` / ``cu_seqlens``), attended per document
    and scattered back; padding gets 0. The plan (one host sync, none when seeded from a
    ``PackedLayout`` by :func:`use_layout`) is computed once per doc_ids tensor and reused
    across layers. Rows without padding whose documents are in
    order skip the gather and scatter; with q, k, v laid out (B, S, H, D) underneath, as models
    produce them before ``transpose(1, 2)``, no copy is made at all.
    """
    varlen_attn = _compat.varlen_attn_function()
    B, Hq, S, D = q.shape
    plan = cached_plan("varlen", doc_ids, B, _varlen_plan)
    if plan.identity:
        qs, ks, vs = (_tokens(x) for x in (q, k, v))  # (B * S, H, D)
    else:
        qs, ks, vs = (_tokens(x).index_select(0, plan.order) for x in (q, k, v))  # (T, H, D)
    window_size = (-1, 0) if causal else (-1, -1)
    if causal and window is not None and window < plan.max_seqlen - 1:
        window_size = (window, 0)  # (a window as long as every document is plain causal)
    if plan.max_seqlen == 0:  # all padding: zeros, still connected to the graph
        return _untokens(q.new_zeros(B * S, Hq, D) + 0.0 * (qs.sum() + ks.sum() + vs.sum()), B, S)
    o = varlen_attn(
        qs,
        ks,
        vs,
        plan.cu_seqlens,
        plan.cu_seqlens,
        plan.max_seqlen,
        plan.max_seqlen,
        scale=scale,
        window_size=window_size,
        # torch 2.11's varlen_attn has no enable_gqa: its FlashAttention kernel groups the fewer
        # k/v heads by itself (flexpack.attention checked that Hkv divides Hq).
        **({"enable_gqa": enable_gqa} if _compat.varlen_takes_enable_gqa(varlen_attn) else {}),
    )
    if plan.identity:
        return _untokens(o, B, S)
    return _untokens(q.new_zeros(B * S, Hq, D).index_copy(0, plan.order, o), B, S)
