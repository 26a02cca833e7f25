"""Mamba and Mamba2 scans (Nemotron-H, Bamba, Falcon-H1, Zamba2, Granite 4 hybrids, Mamba2;
Jamba, Zamba, Falcon-Mamba, Mamba): per-document state and causal conv.

Without mamba_ssm, transformers' torch scans (``mamba2_chunk_scan``'s segment sums,
``mamba_selective_scan``) and ``causal_conv1d_fn`` run over the whole row. On that path flexpack
runs a Mamba2 mixer once over the whole packed rows, from the module's own submodules, with the
conv window and the SSM state restarting at every document start (:func:`mamba2_one_pass`: the
chunked SSD scan with its decays masked to same-document pairs); a class whose structure or
behaviour differs, and Mamba (1) scans, run once per group of right-padded documents instead, so
each starts from a zero state. With mamba_ssm and causal-conv1d (on CUDA), Mamba2 mixers forward
``seq_idx`` to ``mamba_split_conv1d_scan_combined`` / ``mamba_chunk_scan_combined`` and
``causal_conv1d_fn``: the rows are flattened and handed the segment index. Mamba (1) scans have
no varlen argument in mamba_ssm: their documents always run apart.

Shapes: B rows of S tokens, h heads of p channels, g groups of an n-wide state, chunks of q
tokens (c of them per row, the row padded to a multiple of q).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor

from flexpack.mixers import _one_pass
from flexpack.mixers._plan import DocumentPlan
from flexpack.mixers._room import Room

__all__ = ["mamba2_one_pass"]

# keywords of the module's forward that would change what the one pass computes: a cache (its
# names across releases), a padding mask, a scan's initial or returned state, the kernels' own
_CHANGES_THE_SCAN = ("cache", "cache_params", "past_key_values", "layer_past", "attention_mask",
                     "initial_states", "return_final_states", "dt_limit", "activation",
                     "state_idx", "seq_idx", "cu_seqlens")  # fmt: skip
# what mamba2_one_pass reads of a mixer, besides its submodules and parameters (transformers
# 5.25's Mamba2Mixer, BambaMixer, NemotronHMamba2Mixer, FalconH1Mixer, Zamba2MambaMixer,
# GraniteMoeHybridMambaLayer)
_SIZES = ("num_heads", "head_dim", "n_groups", "ssm_state_size", "intermediate_size", "conv_dim",
          "chunk_size")  # fmt: skip


def _mamba2_parts(module: torch.nn.Module) -> bool:
    """Is ``module`` built as transformers' Mamba2 mixers are: ``in_proj`` -> (gate, x B C, dt),
    a causal depthwise ``conv1d`` over x B C, the SSD scan from ``A_log``, ``dt_bias``, ``D``,
    a gated ``norm``, ``out_proj``?"""
    from flexpack.mixers.conv import _depthwise  # conv.py imports this module

    sizes = [getattr(module, name, None) for name in _SIZES]
    if not all(isinstance(v, int) and v > 0 for v in sizes):
        return False
    heads, _, groups, state, inner, conv_dim, _ = sizes
    in_proj = getattr(module, "in_proj", None)
    # conv.py's check of a causal depthwise conv between two projections, on conv1d
    conv = _depthwise(SimpleNamespace(conv=getattr(module, "conv1d", None), in_proj=in_proj,
                                      out_proj=getattr(module, "out_proj", None)))  # fmt: skip
    weight = getattr(in_proj, "weight", None)
    limit = getattr(module, "time_step_limit", None)
    per_head = [getattr(module, name, None) for name in ("A_log", "dt_bias", "D")]
    return (
        conv is not None
        and conv.in_channels == conv_dim == inner + 2 * groups * state
        and isinstance(weight, Tensor)
        and weight.shape[0] == inner + conv_dim + heads
        and heads % groups == 0
        and all(isinstance(t, Tensor) and t.shape == (heads,) for t in per_head)
        and isinstance(getattr(module, "norm", None), torch.nn.Module)
        and callable(getattr(module, "act", None))
        and isinstance(limit, (tuple, list))
        and len(limit) == 2
    )


def _segment_sum(a: Tensor, keep: Tensor) -> Tensor:
    """``[..., t, s]`` = sum of ``a[..., r]`` over s < r <= t where ``keep[..., t, s]``, else
    -inf: the log decay from token s to token t. A masked cumulative sum down each column, as
    transformers' ``segment_sum``: no difference of running sums, so large decays of earlier
    documents never cancel.

    Args:
        a: (..., q) log decays.
        keep: (..., q, q) bool, True only on or below the diagonal.
    """
    q = a.shape[-1]
    below = torch.ones(q, q, dtype=torch.bool, device=a.device).tril(-1)
    sums = a[..., None].expand(*a.shape, q).masked_fill(~below, 0).cumsum(-2)
    return sums.masked_fill(~keep, -torch.inf)


def _ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, segment: Tensor,
              chunk: int) -> Tensor:  # fmt: skip
    """The chunked SSD scan of ``mamba2_chunk_scan`` (without D), the state zeroed wherever
    ``segment`` changes: h_t = exp(A dt_t) h_{t-1} [same segment] + dt_t B_t x_t, y_t = C_t h_t.

    Args:
        x: (B, S, h, p), dt: (B, S, h) after softplus and clamp, A: (h,) negative,
        B, C: (B, S, h, n) (groups repeated per head), all in the working dtype.
        segment: (B, S) int, a different value on each side of every document start.
        chunk: tokens per chunk, q.

    Returns:
        (B, S, h, p) in the working dtype.
    """
    batch, S, heads, p = x.shape
    pad = (-S) % chunk
    if pad:  # padded tokens: a segment of their own, no input
        x, dt, B, C = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
        segment = F.pad(segment, (0, pad), value=-1)
    c, q = (S + pad) // chunk, chunk
    x = (x * dt[..., None]).view(batch, c, q, heads, p)  # (B, c, q, h, p)
    B, C = (t.view(batch, c, q, heads, -1) for t in (B, C))  # (B, c, q, h, n)
    a = (A * dt).view(batch, c, q, heads).permute(0, 3, 1, 2)  # (B, h, c, q) log decays
    seg = segment.view(batch, c, q)
    start = torch.ones_like(seg, dtype=torch.bool).view(batch, c * q)
    start[:, 1:] = segment[:, 1:] != segment[:, :-1]
    start = start.view(batch, c, q)  # a document (or padding run) starts at this token
    causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()
    same = (seg[..., :, None] == seg[..., None, :]) & causal  # (B, c, t, s): s <= t, one document

    # 1. inside each chunk: token s reaches token t of its own document, decayed
    decay = torch.exp(_segment_sum(a, same[:, None]))  # (B, h, c, t, s)
    scores = torch.einsum("bclhn,bcshn->bclsh", C, B) * decay.permute(0, 2, 3, 4, 1)
    y = torch.einsum("bclsh,bcshp->bclhp", scores, x)

    # 2. the state each chunk hands on: its last token's document's tokens, decayed to the end
    to_end = decay[..., -1, :]  # (B, h, c, s)
    states = torch.einsum("bclhn,bclhp->bchpn", B * to_end.permute(0, 2, 3, 1)[..., None], x)

    # 3. chunk to chunk: a state crosses a chunk only if no document starts inside it
    # log decay from the chunk's first token of t's document through t: a per-document sum
    in_doc = torch.einsum("bctr,bhcr->bhct", same.to(a.dtype), a)  # (B, h, c, t)
    crossing = in_doc[..., -1].masked_fill(start.any(-1)[:, None], -torch.inf)  # (B, h, c)
    every = torch.ones(c + 1, c + 1, dtype=torch.bool, device=x.device).tril()
    across = torch.exp(_segment_sum(F.pad(crossing, (1, 0)), every)).transpose(1, 3)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)  # (B, c + 1, h, p, n)
    states = torch.einsum("bzch,bzhpn->bchpn", across, states)[:, :-1]  # at each chunk's start

    # 4. the state at a chunk's start reaches the tokens of the document open there
    open_ = same[..., 0] & ~start[..., :1]  # (B, c, t)
    from_start = torch.exp(in_doc).masked_fill(~open_[:, None], 0)  # (B, h, c, t)
    carried = torch.einsum("bclhn,bchpn->bclhp", C, states)  # (B, c, q, h, p)
    y = y + carried * from_start.permute(0, 2, 3, 1)[..., None]
    return y.reshape(batch, c * q, heads, p)[:, :S]


def mamba2_one_pass(module: torch.nn.Module, x: Tensor, plan: DocumentPlan) -> Tensor:
    """A Mamba2 mixer's forward over packed rows, documents kept apart, in one pass.

    ``in_proj`` -> gate, x B C, dt -> causal depthwise ``conv1d`` + activation of x B C -> the
    chunked SSD scan (softplus(dt + ``dt_bias``) clamped to ``time_step_limit``, A = -exp(
    ``A_log``), ``D`` skip) -> ``norm`` gated by the gate -> ``out_proj``, as transformers 5.25's
    Mamba2 mixers without a cache (Falcon-H1's ``ssm_in_multiplier``, ``mup_vector`` and
    optional norm included), where a conv tap reaches token t - j only inside t's document and
    the scan's state restarts from zero at every document start; padding tokens give zeros.

    The scan runs in float32 for float32 and narrower rows (as the module's own does) and in
    float64 for float64 rows (the module's own rounds those to float32).

    Args:
        module: a Mamba2 mixer (:func:`_mamba2_parts` accepts its structure).
        x: (B, S, H) hidden states of packed rows.
        plan: the rows' documents.

    Returns:
        (B, S, H) in the dtype ``module``'s own forward returns.

    Example:
        >>> import torch, transformers
        >>> _ = torch.manual_seed(0)
        >>> from flexpack.mixers._plan import DocumentPlan
        >>> from flexpack.mixers.ssm import mamba2_one_pass
        >>> config = transformers.Mamba2Config(hidden_size=16, num_heads=4, head_dim=8,
        ...     state_size=4, n_groups=1, chunk_size=4, num_hidden_layers=1)
        >>> mixer = transformers.models.mamba2.modeling_mamba2.Mamba2Mixer(config, 0)
        >>> plan = DocumentPlan.from_doc_ids(torch.tensor([[0, 0, 0, 1, 1, -1]]))
        >>> x = torch.randn(1, 6, 16)
        >>> out = mamba2_one_pass(mixer, x, plan)
        >>> torch.allclose(out[:, 3:5], mixer(x[:, 3:5]), atol=1e-5), out[0, 5].abs().max().item()
        (True, 0.0)
    """
    from flexpack.mixers.conv import _masked_conv  # conv.py imports this module

    dtype, (batch, S, _) = x.dtype, x.shape
    heads, p, groups, n = module.num_heads, module.head_dim, module.n_groups, module.ssm_state_size
    inner = module.intermediate_size
    multiplier = getattr(module, "ssm_in_multiplier", None)  # Falcon-H1's muP
    projected = module.in_proj(x if multiplier is None else x * multiplier)  # (B, S, P)
    mup = getattr(module, "mup_vector", None)
    if mup is not None:
        projected = projected * mup
    gate, xBC, dt = projected.split([inner, module.conv_dim, heads], dim=-1)
    conv = module.conv1d
    xBC = _masked_conv(conv, xBC.transpose(1, 2), plan.taps(conv.kernel_size[0]))  # (B, D, S)
    xBC = module.act(xBC).transpose(1, 2)
    h, B, C = xBC.split([inner, groups * n, groups * n], dim=-1)

    work = torch.promote_types(h.dtype, torch.float32)
    dt = F.softplus(dt + module.dt_bias.to(dt.dtype))
    dt = torch.clamp(dt, min=module.time_step_limit[0], max=module.time_step_limit[1]).to(work)
    h = h.reshape(batch, S, heads, p).to(work)  # (B, S, h, p)
    B, C = (
        t.reshape(batch, S, groups, n).to(work).repeat_interleave(heads // groups, dim=2)
        for t in (B, C)
    )  # (B, S, h, n)
    A = -torch.exp(module.A_log.to(work))
    y = _ssd_scan(h, dt, A, B, C, plan.seq_idx.view(batch, S), module.chunk_size)
    y = (y + module.D[..., None] * h).reshape(batch, S, inner)

    if getattr(module, "mamba_rms_norm", True):  # Falcon-H1 may gate without a norm
        y = module.norm(y, gate)
    else:
        y = y * F.silu(gate)
    out = module.out_proj(y.to(dtype))  # (B, S, H)
    return out * plan.real[..., None].to(out.dtype)


def _probe(module: torch.nn.Module) -> list[list[int]]:
    """Document ids of the self-check's rows, S = 2 * chunk + 3: a 1-token document, documents
    across chunk boundaries and starting inside chunks, one over a chunk then padding, and a
    padding-only row."""
    chunk = module.chunk_size
    lengths = [1, chunk + 1, 2, chunk - 1]
    row = [d for d, k in enumerate(lengths) for _ in range(k)]
    return [row, [0] * (chunk + 3) + [-1] * chunk, [-1] * len(row)]


def _fits(module: torch.nn.Module, x: Tensor) -> bool:
    """A Mamba2 mixer (:func:`_mamba2_parts`) on rows of its width, at most float32 wide: the
    module's own scan rounds float64 to float32, and only the per-group calls reproduce its
    numbers to float64's precision."""
    if not x.is_floating_point() or torch.finfo(x.dtype).bits > 32:
        return False
    return bool(_mamba2_parts(module)) and x.shape[-1] == module.in_proj.weight.shape[1]


MAMBA2 = Room(
    "mamba2",
    functions=frozenset({"mamba2_chunk_scan", "mamba_chunk_scan_combined"}),
    varlen={"seq_idx": "seq_idx"},
    how="scan and conv restart per document: one pass over the rows with cross-document "
    "decays and taps masked (torch), else documents run apart; mamba_ssm's and "
    "causal-conv1d's seq_idx (kernels)",
    one_pass=_one_pass.hook(mamba2_one_pass, _fits, probe=_probe, changes=_CHANGES_THE_SCAN),
)

MAMBA = Room(
    "mamba",
    functions=frozenset({"mamba_selective_scan", "selective_scan_fn", "mamba_inner_fn"}),
    excludes=frozenset(MAMBA2.functions),
    how="scan and conv restart per document: documents run apart (torch and kernels)",
)

ROOMS = (MAMBA2, MAMBA)
