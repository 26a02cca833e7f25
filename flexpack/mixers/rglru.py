"""RecurrentGemma's recurrent block (Griffin / Hawk): a causal conv and the RG-LRU, per document.

``RecurrentGemmaRecurrentBlock`` runs ``linear_x`` through a causal depthwise ``conv_1d`` (its
window crosses document boundaries) and a Real-Gated Linear Recurrent Unit whose state resets
only where ``position_ids`` are 0 (and whose first token skips the input normalisation there).
flexpack runs the block once over the whole packed rows (:func:`rglru_one_pass`): conv taps that
would cross a document start are masked (as a zero-padded document computes them), and the
RG-LRU is a diagonal linear scan (:func:`flexpack.mixers.ssm.diagonal_scan`, a state of one
value per channel) whose decay is cut at every document start, wherever the positions restart
or not; on prefix trees the conv follows each token's root-to-leaf path and the scan forks its
state at each branch. A class whose structure or behaviour differs runs once per group of
right-padded documents, each from position 0.

The block keeps its cache in its own attributes (``conv1d_state``, ``rg_lru.recurrent_states``)
when its call's ``use_cache`` is true (RecurrentGemma's default): prompts, one per row, run the
block's own forward, so ``generate()`` continues from them; packed rows with ``use_cache`` run
with ``use_cache=False`` and a warning (``packed_forward_kwargs`` passes ``use_cache=False``).

Shapes: x (B, S, H) hidden states; the block's width W = ``lru_width`` = heads * block width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flexpack.mixers import _one_pass
from flexpack.mixers._conv_ops import _masked_conv
from flexpack.mixers._plan import DocumentPlan
from flexpack.mixers._room import Room
from flexpack.mixers._tree import ChunkLayout, TreePlan
from flexpack.mixers.ssm import _selective_chunk, diagonal_scan, segment_starts


def _rg_block(module: torch.nn.Module) -> bool:
    lru = getattr(module, "rg_lru", None)
    return (
        isinstance(lru, torch.nn.Module)
        and isinstance(lru._parameters.get("recurrent_param"), torch.nn.Parameter)
        and isinstance(getattr(module, "conv_1d", None), torch.nn.Conv1d)
    )


_LINEARS = ("linear_x", "linear_y", "linear_out")
_GATES = ("input_gate_weight", "input_gate_bias", "recurrent_gate_weight", "recurrent_gate_bias")


def _sqrt_of(module: torch.nn.Module):
    """The RG-LRU's square root with a bounded gradient (``SqrtBoundDerivative`` of its modeling
    file), so that the one pass's gradients are the module's; None where the file has none."""
    fn = getattr(type(module.rg_lru).forward, "__globals__", {}).get("SqrtBoundDerivative")
    return getattr(fn, "apply", None)


def _fits(module: torch.nn.Module, x: Tensor) -> bool:
    """RecurrentGemma's structure: ``linear_x`` / ``linear_y`` / ``linear_out``, an ``act_fn``,
    a causal depthwise ``conv_1d`` (padding kernel - 1) of the LRU width, and an ``rg_lru``
    with per-head block-diagonal gates, on rows of the block's width."""
    if not _rg_block(module) or not all(
        isinstance(getattr(module, n, None), torch.nn.Linear) for n in _LINEARS
    ):
        return False
    lru, conv = module.rg_lru, module.conv_1d
    heads, width = getattr(lru, "num_attention_heads", None), getattr(lru, "block_width", None)
    if not (isinstance(heads, int) and isinstance(width, int) and heads > 0 and width > 0):
        return False
    W, kernel = heads * width, conv.kernel_size[0]
    return (
        module.linear_x.in_features == x.shape[-1]
        and module.linear_x.out_features == W
        and lru.recurrent_param.numel() == W
        and all(isinstance(lru._parameters.get(n), torch.nn.Parameter) for n in _GATES)
        and lru.input_gate_weight.shape == (heads, width, width)
        and conv.in_channels == conv.out_channels == conv.groups == W
        and conv.stride == (1,)
        and conv.dilation == (1,)
        and conv.padding == (kernel - 1,)
        and conv.padding_mode == "zeros"
        and getattr(conv, "_hf_hook", None) is None
        and callable(getattr(module, "act_fn", None))
        and _sqrt_of(module) is not None
    )


def _gate(lru: torch.nn.Module, act: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """sigmoid of the per-head block-diagonal gate: (B, S, W) -> (B, S, W), as the RG-LRU's
    ``baddbmm`` over (heads, B * S, block width)."""
    B, S, W = act.shape
    heads = lru.num_attention_heads
    per_head = act.reshape(B * S, heads, W // heads).permute(1, 0, 2)
    res = torch.baddbmm(bias[:, None, :], per_head, weight)
    return torch.sigmoid(res.transpose(0, 1).reshape(B, S, W))


def _lru_scan(log_a: Tensor, u: Tensor, segment: Tensor, chunk: int) -> Tensor:
    """h_t = exp(log_a_t) h_{t-1} + u_t over rows of documents (``segment`` (B, S): a value per
    document), from zero at each document start. (B, S, W) -> (B, S, W)."""
    ones = u.new_ones(*u.shape[:2], 1)
    return diagonal_scan(log_a[..., None], u[..., None], ones, segment_starts(segment), chunk)


def _tree_lru_scan(log_a: Tensor, u: Tensor, plan: TreePlan, chunk: int) -> Tensor:
    """:func:`_lru_scan` over prefix-tree rows, each branch's state forked from the end of its
    parent segment (a log-decay of 0 on the layout's filling carries it through)."""

    def scan(log_a: Tensor, u: Tensor, layout: ChunkLayout) -> Tensor:
        start = torch.zeros(u.shape[:2], dtype=torch.bool, device=u.device)
        ones = u.new_ones(*u.shape[:2], 1)
        return diagonal_scan(log_a[..., None], u[..., None], ones, start, chunk, layout)

    return plan.chunked(scan, chunk, log_a, u)


def rglru_one_pass(
    module: torch.nn.Module, x: Tensor, plan: DocumentPlan | TreePlan, *, chunk: int | None = None
) -> Tensor:
    """A RecurrentGemma recurrent block's forward over packed rows, documents kept apart, in one
    pass.

    As ``RecurrentGemmaRecurrentBlock.forward`` (transformers 5.17 to 5.25) without a cache, each
    document from position 0: ``act_fn(linear_y(x))`` times the RG-LRU of the causal
    ``conv_1d`` of ``linear_x(x)`` -> ``linear_out``. The conv's taps stay inside each
    document (a tree token's follow its path); the RG-LRU's input and recurrence gates,
    a_t = exp(-8 r_t softplus(param)), and its input normalisation sqrt(1 - a_t^2) (1 at a
    document's first token) are the module's, and its scan restarts at every document start,
    in float32 for float32 and narrower rows (as the module's) and float64 for float64 rows.
    Padding tokens give zeros.

    Args:
        module: a recurrent block (:func:`_fits` accepts its structure).
        x: (B, S, H) hidden states of packed rows.
        plan: the rows' documents (or trees).
        chunk: tokens per chunk of the scan (default: ceil(sqrt(S))); any gives the same
            numbers up to rounding.

    Returns:
        (B, S, H), in the dtype ``module``'s own forward returns (autocast included).

    Example:
        >>> import torch, transformers
        >>> _ = torch.manual_seed(0)
        >>> from flexpack.mixers._plan import DocumentPlan
        >>> from flexpack.mixers.rglru import rglru_one_pass
        >>> config = transformers.RecurrentGemmaConfig(hidden_size=16, lru_width=16,
        ...     num_attention_heads=2, num_hidden_layers=1)
        >>> block = transformers.models.recurrent_gemma.modeling_recurrent_gemma \\
        ...     .RecurrentGemmaRecurrentBlock(config, 0)
        >>> _ = [torch.nn.init.normal_(p, std=0.2) for p in block.parameters()]  # its gates: empty
        >>> plan = DocumentPlan.from_doc_ids(torch.tensor([[0, 0, 0, 1, 1, -1]]))
        >>> x = torch.randn(1, 6, 16)
        >>> out = rglru_one_pass(block, x, plan)
        >>> alone, _ = block(x[:, 3:5], position_ids=torch.arange(2)[None], attention_mask=None,
        ...     use_cache=False)
        >>> torch.allclose(out[:, 3:5], alone, atol=1e-5), out[0, 5].abs().max().item()
        (True, 0.0)
    """
    lru = module.rg_lru
    y_branch = module.act_fn(module.linear_y(x))  # (B, S, W)
    u = module.linear_x(x).transpose(1, 2)  # (B, W, S)
    u = _masked_conv(module.conv_1d, u, plan).transpose(1, 2)  # (B, S, W)

    input_gate = _gate(lru, u, lru.input_gate_weight, lru.input_gate_bias)
    recurrent_gate = _gate(lru, u, lru.recurrent_gate_weight, lru.recurrent_gate_bias)
    log_a = -8.0 * recurrent_gate * F.softplus(lru.recurrent_param)  # (B, S, W)
    multiplier = _sqrt_of(module)(1 - torch.exp(2 * log_a))
    fresh = (plan.real & ~plan.taps(2)[1])[..., None]  # a document's (a tree root's) first token
    multiplier = fresh + ~fresh * multiplier
    normalized = u * input_gate * multiplier.type(u.dtype)

    work = torch.promote_types(normalized.dtype, torch.float32)
    q = chunk or _selective_chunk(x.shape[1])

    def scan(log_a: Tensor, u: Tensor, segment: Tensor) -> Tensor:
        return _lru_scan(log_a, u, segment, q)

    scan.tree = lambda log_a, u, tree: _tree_lru_scan(log_a, u, tree, q)
    h = plan.scan(scan, log_a.to(work), normalized.to(work)).to(normalized.dtype)
    out = module.linear_out(h * y_branch)  # (B, S, H)
    return out * plan.real[..., None].to(out.dtype)


RG_LRU = Room(
    "rg_lru",
    matches=_rg_block,
    recognised_by="its `rg_lru` (a `recurrent_param`) beside a `conv_1d`",
    how="conv taps across a document start masked and the RG-LRU's scan restarted at every "
    "document start: one pass over the rows (torch), else documents run apart from position 0",
    one_pass=_one_pass.hook(rglru_one_pass, _fits, changes=(), outputs=2),
    keeps_cache=True,
)

ROOMS = (RG_LRU,)
