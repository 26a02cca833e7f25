"""Short causal convolutions (LFM2, LFM2.5, LFM2-MoE: ShortConv; ZAYA's q/k projection): a window
that restarts per document.

transformers' ``causal_conv1d_fn`` pads the row on the left only, so a document's first tokens
see the previous document's last ``kernel - 1``. On the torch path flexpack runs a short conv
(LFM2's ``in_proj`` -> B, C, x -> depthwise causal ``conv`` of B * x -> C * conv -> ``out_proj``)
once over the whole packed rows, from the module's own submodules, with every tap that would
cross a document boundary masked out (:func:`short_conv_one_pass`; K taps, K fused multiply-adds,
no padding and no per-group calls); a class whose structure or behaviour differs from that runs
once per group of right-padded documents instead. With causal-conv1d installed (on CUDA) the rows
are flattened and ``seq_idx`` reaches the kernel (the mixer forwards its keywords to
``causal_conv1d_fn``). Mixers whose class also runs a scan or a delta rule belong to those rooms.

ZAYA's attention projects q and k through two causal convolutions it pads itself (``F.pad``,
then ``Conv1d`` with ``padding=0``) and gives each value head half of the previous token's
projection (CCA, Compressed Convolutional Attention): no kernel mapping, so the projection is
recognised by its parts and run once per group of right-padded documents; its q, k and v all
come back merged.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flexpack.mixers import _one_pass
from flexpack.mixers._conv_ops import _depthwise, _masked_conv
from flexpack.mixers._plan import DocumentPlan
from flexpack.mixers._room import Room
from flexpack.mixers._tree import TreePlan


def _cca(module: torch.nn.Module) -> bool:
    conv = getattr(module, "conv_qk_depthwise", None)
    return isinstance(conv, torch.nn.Conv1d) and isinstance(
        getattr(module, "v_proj_delayed", None), torch.nn.Linear
    )


def short_conv_one_pass(module: torch.nn.Module, x: Tensor, plan: DocumentPlan) -> Tensor:
    """A short conv's forward over packed rows, documents kept apart, in one pass.

    ``in_proj`` -> B, C, x -> causal depthwise ``conv`` of B * x -> C * conv -> ``out_proj``, as
    LFM2's ``Lfm2ShortConv.forward`` (transformers 5.17 to 5.25) without a cache, where a tap
    reaches token t - j only inside t's document; padding tokens give zeros.

    Args:
        module: a short conv (:func:`_depthwise` accepts its structure).
        x: (B, S, H) hidden states of packed rows.
        plan: the rows' documents.

    Returns:
        (B, S, H), in the dtype ``module``'s own forward returns (autocast included).
    """
    conv = module.conv
    projected = module.in_proj(x).transpose(-1, -2)  # (B, 3H, S)
    b, c, h = projected.chunk(3, dim=-2)
    y = c * _masked_conv(conv, b * h, plan)  # (B, H, S)
    out = module.out_proj(y.transpose(-1, -2).contiguous())  # (B, S, H)
    return out * plan.real[..., None].to(out.dtype)


def _fits(module: torch.nn.Module, x: Tensor) -> bool:
    conv = _depthwise(module)
    return conv is not None and x.shape[-1] == conv.in_channels


# The kernel-mapped scans of the kinds whose mixers call causal_conv1d_fn too (delta.py's gated
# delta rule and KDA, ssm.py's Mamba2 and Mamba): a module that calls one is theirs, never a short
# conv, whichever rooms are asked. Named here so that no kind imports another; tests/test_mixers.py
# holds them equal to those rooms' functions.
_SCANS_WITH_A_CONV = frozenset({
    "torch_chunk_gated_delta_rule", "chunk_gated_delta_rule",  # delta.GATED_DELTA_RULE
    "chunk_kimi_delta_attention", "chunk_kda",  # delta.KDA
    "mamba2_chunk_scan", "mamba_chunk_scan_combined",  # ssm.MAMBA2
    "mamba_selective_scan", "selective_scan_fn", "mamba_inner_fn",  # ssm.MAMBA
})  # fmt: skip

SHORT_CONV = Room(
    "short_conv",
    functions=frozenset({"causal_conv1d_fn"}),
    varlen={"seq_idx": "seq_idx"},
    excludes=_SCANS_WITH_A_CONV,
    how="the window restarts per document: one pass over the rows with the taps across "
    "document starts masked (torch), else documents run apart; causal-conv1d's seq_idx (kernel)",
    one_pass=_one_pass.hook(short_conv_one_pass, _fits),
)


def _cca_fits(module: torch.nn.Module, x: Tensor) -> bool:
    """ZAYA's CCA structure: q, k and the two half value projections, a depthwise
    ``conv_qk_depthwise`` then a grouped ``conv_qk_grouped`` (no padding of their own, stride
    and dilation 1) over q and k concatenated, heads of ``head_dim``."""
    parts = ("q_proj", "k_proj", "v_proj_current", "v_proj_delayed")
    if not _cca(module) or not all(isinstance(getattr(module, n, None), torch.nn.Linear)
                                   for n in parts):  # fmt: skip
        return False
    dw, gr = module.conv_qk_depthwise, getattr(module, "conv_qk_grouped", None)
    sizes = [
        getattr(module, n, None)
        for n in ("head_dim", "num_key_value_groups", "num_attention_heads", "num_key_value_heads")
    ]
    if not isinstance(gr, torch.nn.Conv1d) or not all(isinstance(v, int) and v > 0 for v in sizes):
        return False
    channels = module.q_proj.out_features + module.k_proj.out_features
    return (
        all(
            conv.in_channels == conv.out_channels == channels
            and conv.padding == (0,)
            and conv.stride == (1,)
            and conv.dilation == (1,)
            and getattr(conv, "_hf_hook", None) is None
            for conv in (dw, gr)
        )
        and dw.groups == channels
        and module.q_proj.in_features == x.shape[-1]
    )


def cca_one_pass(
    module: torch.nn.Module, x: Tensor, plan: DocumentPlan | TreePlan
) -> tuple[Tensor, Tensor, Tensor]:
    """ZAYA's CCA projection over packed rows (or prefix trees), documents kept apart, in one
    pass: as ``ZayaCCAProjection.forward`` without a cache (transformers 5.17 to 5.25).

    Alone, a document's q/k go through the depthwise conv then the grouped conv over its own
    tokens left-padded with zeros: the depthwise output before the document's first token is
    the conv's bias alone. Here the depthwise conv's taps stop at the document start
    (:func:`_masked_conv`), the grouped conv's taps that reach before it read that bias, and
    each value head's delayed half reads the previous token of the document (its path on a
    tree), ``v_proj_delayed`` of zeros at its first token.

    Args:
        module: a CCA projection (:func:`_cca_fits` accepts its structure).
        x: (B, S, H) hidden states of packed rows.
        plan: the rows' documents (or trees).

    Returns:
        (query, key, value), each (B, S, heads, head_dim); padding gives zeros.
    """
    B, S, _ = x.shape
    shape = (B, S, -1, module.head_dim)
    q, k = module.q_proj(x), module.k_proj(x)
    groups = module.num_key_value_groups
    q_res = q.view(shape)
    k_res = k.view(shape).repeat_interleave(groups, dim=2)
    q_res = (q_res + k_res) * 0.5
    k_res = q_res.view(B, S, -1, groups, module.head_dim).mean(dim=-2)

    dw, gr = module.conv_qk_depthwise, module.conv_qk_grouped
    qk = torch.cat([q, k], dim=-1).transpose(1, 2)  # (B, C, S)
    u = _masked_conv(dw, qk, plan)  # (B, C, S), the depthwise bias included
    K = gr.kernel_size[0]
    taps = plan.taps(K)
    before = (dw.bias if dw.bias is not None else u.new_zeros(u.shape[1])).to(u.dtype)
    mixed = None
    for j in range(K):  # tap j of the grouped conv: u at t - j, or the bias before the start
        inside = taps[j][:, None, :].to(u.dtype)
        shifted = plan.shift(u, j) * inside + before[:, None] * (1 - inside)
        term = torch.nn.functional.conv1d(shifted, gr.weight[..., K - 1 - j : K - j],
                                          groups=gr.groups)  # fmt: skip
        mixed = term if mixed is None else mixed + term
    if gr.bias is not None:
        mixed = mixed + gr.bias[:, None].to(mixed.dtype)
    mixed = mixed.transpose(1, 2)  # (B, S, C)
    width = q.shape[-1]
    query = mixed[..., :width].reshape(shape) + q_res
    key = mixed[..., width:].reshape(shape) + k_res

    current = module.v_proj_current(x)
    delayed = module.v_proj_delayed(x)  # (B, S, V/2)
    first = module.v_proj_delayed(x.new_zeros(1, 1, x.shape[-1]))[0, 0]  # a document's start
    prev = plan.taps(2)[1][..., None].to(delayed.dtype)
    shifted = plan.shift(delayed.transpose(1, 2), 1).transpose(1, 2)  # the previous token's
    value = torch.cat([current, shifted * prev + first * (1 - prev)], dim=-1).view(shape)
    real = plan.real[..., None, None]
    return tuple(t * real.to(t.dtype) for t in (query, key, value))  # type: ignore[return-value]


CCA_PROJECTION = Room(
    "cca_projection",
    matches=_cca,
    recognised_by="a `conv_qk_depthwise` Conv1d beside a `v_proj_delayed` Linear (ZAYA)",
    all_outputs=True,
    how="q/k's convolution window and v's one-token delay restart per document: one pass over "
    "the rows with the taps across a document start reading what a fresh document reads "
    "(torch, ZAYA's structure), else documents run apart (no kernel mapping)",
    one_pass=_one_pass.hook(
        cca_one_pass,
        _cca_fits,
        all_outputs=True,
        changes=(*_one_pass.CHANGES_THE_PASS, "conv_mask"),
    ),
)

ROOMS = (SHORT_CONV, CCA_PROJECTION)
