"""Mamba and Mamba2 scans (Nemotron-H, Bamba, Falcon-H1, Zamba2, Granite 4 hybrids, Mamba2;
Jamba, Zamba, Falcon-Mamba, Mamba): per-document state and causal conv.

Without mamba_ssm, transformers' torch scans (``mamba2_chunk_scan``'s segment sums,
``mamba_selective_scan``) and ``causal_conv1d_fn`` run over the whole row. On that path flexpack
runs a mixer once over the whole packed rows, from the module's own submodules, with the conv
window and the SSM state restarting at every document start: a Mamba2 mixer through
:func:`mamba2_one_pass` (the chunked SSD scan with its decays masked to same-document pairs), a
Mamba (1) mixer through :func:`mamba_one_pass` (the selective scan with its decay zeroed at
document starts, chunked so that its Python loops run about 2 sqrt(S) steps, not S), Zamba's
multi-head Mamba (1) mixer through :func:`zamba_mamba_one_pass` (that scan, each head a row of
its own); a class whose structure or behaviour differs runs once per group of right-padded
documents instead, so each starts from a zero state. With mamba_ssm and
causal-conv1d (on CUDA), Mamba2 mixers forward ``seq_idx`` to
``mamba_split_conv1d_scan_combined`` / ``mamba_chunk_scan_combined`` and ``causal_conv1d_fn``:
the rows are flattened and handed the segment index. Mamba (1) scans have no varlen argument in
mamba_ssm: on the kernel path their documents run apart.

Shapes: B rows of S tokens, h heads of p channels, g groups of an n-wide state, chunks of q
tokens (c of them per row, the row padded to a multiple of q); a Mamba (1) mixer's I inner
channels, each with its own n-wide state, and its dt rank r.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor

from flexpack.mixers import _one_pass
from flexpack.mixers._conv_ops import _depthwise, _masked_conv
from flexpack.mixers._plan import DocumentPlan
from flexpack.mixers._room import Room, _closure, hub_functions
from flexpack.mixers._tree import ChunkLayout, TreePlan, fork

__all__ = ["mamba2_one_pass", "mamba_one_pass", "zamba_mamba_one_pass"]

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
    sizes = [getattr(module, name, None) for name in _SIZES]
    if not all(isinstance(v, int) and v > 0 for v in sizes):
        return False
    heads, _, groups, state, inner, conv_dim, _ = sizes
    in_proj = getattr(module, "in_proj", None)
    # the short conv's check of a causal depthwise conv between two projections, on conv1d
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


def _tree_ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, plan: TreePlan,
                   chunk: int) -> Tensor:  # fmt: skip
    """:func:`_ssd_scan` over prefix-tree rows, each branch's state forked from the end of its
    parent segment: the rows laid out with every segment starting a chunk
    (:meth:`TreePlan.chunk_layout`; the filling has no time step, so no decay and no input), a
    chunk's entering state the end state of the chunk its sources name. Returns (B, S, h, p),
    zeros on padding."""

    def scan(x: Tensor, dt: Tensor, B: Tensor, C: Tensor, layout: ChunkLayout) -> Tensor:
        return _ssd_scan(x, dt, A, B, C, layout.segment, chunk, layout=layout)

    return plan.chunked(scan, chunk, x, dt, B, C)


def _ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, segment: Tensor,
              chunk: int, layout: ChunkLayout | None = None) -> Tensor:  # fmt: skip
    """The chunked SSD scan of ``mamba2_chunk_scan`` (without D), the state zeroed wherever
    ``segment`` changes: h_t = exp(A dt_t) h_{t-1} [same segment] + dt_t B_t x_t, y_t = C_t h_t.

    Args:
        x: (B, S, h, p), dt: (B, S, h) after softplus and clamp, A: (h,) negative,
        B, C: (B, S, h, n) (groups repeated per head), all in the working dtype.
        segment: (B, S) int, a different value on each side of every document start.
        chunk: tokens per chunk, q.
        layout: tree rows, each chunk one segment entering with the end state of the chunk
            its sources name (:func:`_tree_ssd_scan`).

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
    if layout is None:
        crossing = in_doc[..., -1].masked_fill(start.any(-1)[:, None], -torch.inf)  # (B, h, c)
        every = torch.ones(c + 1, c + 1, dtype=torch.bool, device=x.device).tril()
        across = torch.exp(_segment_sum(F.pad(crossing, (1, 0)), every)).transpose(1, 3)
        states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)  # (B, c + 1, ...)
        states = torch.einsum("bzch,bzhpn->bchpn", across, states)[:, :-1]  # at chunk starts
        open_ = same[..., 0] & ~start[..., :1]  # (B, c, t)
    else:  # trees: each chunk one segment, entering with the end state of its source chunk
        states = _forked_states(states, in_doc[..., -1], layout.sources)
        open_ = layout.entered[..., None].expand(batch, c, q)

    # 4. the state at a chunk's start reaches the tokens of the document open there
    from_start = torch.exp(in_doc).masked_fill(~open_[:, None], 0)  # (B, h, c, t)
    carried = torch.einsum("bclhn,bchpn->bclhp", C, states)  # (B, c, q, h, p)
    y = y + carried * from_start.permute(0, 2, 3, 1)[..., None]
    return y.reshape(batch, c * q, heads, p)[:, :S]


def _forked_states(local: Tensor, total: Tensor, sources: list[list[int]]) -> Tensor:
    """The state entering each chunk, (B, c, h, p, n): a chunk's end state is its entering
    state decayed through it (``total`` (B, h, c), its log decay) plus its own (``local``
    (B, c, h, p, n)); a chunk enters with the end state of the chunk ``sources`` names
    (:func:`flexpack.mixers._tree.fork`)."""
    zero = torch.zeros_like(local[:, 0])
    decay = total.exp().permute(0, 2, 1)[..., None, None]  # (B, c, h, 1, 1)
    entering, ends = [], []
    for k in range(local.shape[1]):
        state = fork(ends, sources, k, zero)
        entering.append(ends[k - 1] if state is None else state)
        ends.append(entering[-1] * decay[:, k] + local[:, k])
    return torch.stack(entering, 1)


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
    xBC = _masked_conv(conv, xBC.transpose(1, 2), plan)  # (B, D, S)
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
    chunk = module.chunk_size

    def scan(h: Tensor, dt: Tensor, B: Tensor, C: Tensor, segment: Tensor) -> Tensor:
        return _ssd_scan(h, dt, A, B, C, segment, chunk)

    scan.tree = lambda h, dt, B, C, tree: _tree_ssd_scan(h, dt, A, B, C, tree, chunk)
    y = plan.scan(scan, h, dt, B, C)
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

# what mamba_one_pass reads of a Mamba (1) mixer besides its submodules and parameters
# (transformers 5.25's MambaMixer, JambaMambaMixer, FalconMambaMixer); Jamba and Falcon-Mamba
# normalise dt, B and C (Jamba with weights, Falcon-Mamba without) before dt_proj
_MAMBA_SIZES = ("intermediate_size", "ssm_state_size", "time_step_rank")
_MAMBA_NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")


def _mamba_parts(module: torch.nn.Module) -> bool:
    """Is ``module`` built as transformers' Mamba (1) mixers are: ``in_proj`` -> (x, gate), a
    causal depthwise ``conv1d`` over x, ``x_proj`` -> dt, B, C (optionally normalised by
    ``dt_layernorm``, ``b_layernorm``, ``c_layernorm``), ``dt_proj``, the selective scan from
    ``A_log`` (I, n) and ``D`` (I,), ``out_proj``? Zamba's mixer (per-head ``x_proj_weight``
    parameters: :func:`_zamba_parts`) and a quantised config (its ``dt_proj`` detour) are not."""
    sizes = [getattr(module, name, None) for name in _MAMBA_SIZES]
    if not all(isinstance(v, int) and v > 0 for v in sizes):
        return False
    inner, state, rank = sizes
    in_proj, x_proj, dt_proj = (getattr(module, n, None) for n in ("in_proj", "x_proj", "dt_proj"))
    # the short conv's check of a causal depthwise conv between two projections, on conv1d
    conv = _depthwise(SimpleNamespace(conv=getattr(module, "conv1d", None), in_proj=in_proj,
                                      out_proj=getattr(module, "out_proj", None)))  # fmt: skip
    weights = [getattr(m, "weight", None) for m in (in_proj, x_proj, dt_proj)]
    norms = [getattr(module, name, None) for name in _MAMBA_NORMS]
    A_log, D = getattr(module, "A_log", None), getattr(module, "D", None)
    return (
        conv is not None
        and conv.in_channels == inner
        and all(isinstance(w, Tensor) and w.dim() == 2 for w in weights)
        and isinstance(x_proj, torch.nn.Module)
        and weights[0].shape[0] == 2 * inner
        and weights[1].shape == (rank + 2 * state, inner)
        and weights[2].shape == (inner, rank)
        and isinstance(A_log, Tensor)
        and A_log.shape == (inner, state)
        and isinstance(D, Tensor)
        and D.shape == (inner,)
        and callable(getattr(module, "act", None))
        and (all(m is None for m in norms) or all(isinstance(m, torch.nn.Module) for m in norms))
        and not hasattr(getattr(module, "config", None), "_is_quantized")
    )


def _selective_chunk(S: int) -> int:
    """Tokens per chunk of :func:`_selective_scan` for rows of S tokens: ceil(sqrt(S)), which
    makes its two Python loops (q steps inside the chunks, c across them) about as short as
    they get together."""
    return max(1, math.isqrt(max(S - 1, 0)) + 1)


def _tree_selective_scan(u: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                         plan: TreePlan, chunk: int) -> Tensor:  # fmt: skip
    """:func:`_selective_scan` over prefix-tree rows, each branch's state forked from the end of
    its parent segment (laid out as :func:`_tree_ssd_scan`; no decay is zeroed: a root's first
    chunk enters with a zero state). Returns (B, S, I), zeros on padding."""

    def scan(u: Tensor, dt: Tensor, B: Tensor, C: Tensor, layout: ChunkLayout) -> Tensor:
        start = torch.zeros(u.shape[:2], dtype=torch.bool, device=u.device)
        return _selective_scan(u, dt, A, B, C, start, chunk, layout=layout)

    return plan.chunked(scan, chunk, u, dt, B, C)


def _selective_scan(u: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, start: Tensor,
                    chunk: int, layout: ChunkLayout | None = None) -> Tensor:  # fmt: skip
    """``mamba_selective_scan``'s recurrence (without D and the gate), the state restarting
    wherever ``start``: h_t = exp(A dt_t) h_{t-1} + dt_t B_t u_t, y_t = C_t . h_t
    (:func:`diagonal_scan`).

    Args:
        u, dt: (B, S, I) inputs and time steps (after softplus), in the working dtype.
        A: (I, n) negative. B, C: (B, S, n) in the working dtype.
        start: (B, S) bool, True where a document (or a padding run) starts.
        chunk: tokens per chunk, q.
        layout: tree rows (:func:`_tree_selective_scan`).

    Returns:
        (B, S, I) in the working dtype.
    """
    inputs = (dt * u)[..., None] * B[:, :, None]  # (B, S, I, n)
    return diagonal_scan(A * dt[..., None], inputs, C, start, chunk, layout)


def segment_starts(segment: Tensor) -> Tensor:
    """(B, S) segment ids -> (B, S) bool, True where a segment (a document or a padding run)
    starts: a row's first token, and wherever the id changes."""
    start = torch.ones_like(segment, dtype=torch.bool)
    start[:, 1:] = segment[:, 1:] != segment[:, :-1]
    return start


def diagonal_scan(log_decay: Tensor, inputs: Tensor, C: Tensor, start: Tensor, chunk: int,
                  layout: ChunkLayout | None = None) -> Tensor:  # fmt: skip
    """A diagonal linear recurrence over packed rows, the state restarting wherever ``start``:
    h_t = exp(log_decay_t) h_{t-1} + inputs_t, with the decay 0 at a document's first token
    (what a fresh document computes), y_t = C_t . h_t (Mamba's selective scan, RecurrentGemma's
    RG-LRU with n = 1).

    Chunked, and exact, rather than token by token: every chunk is scanned from a zero state at
    once (q steps over (B, c, I, n) slices), the state entering each chunk is carried across
    the chunks (c steps over (B, I, n)) and added to each token's state through the running
    product of the chunk's decays (a zeroed decay stops it at a document start).

    Args:
        log_decay, inputs: (B, S, I, n) in the working dtype; a log-decay of 0 (a zero token
            of a tree layout's filling) carries the state through unchanged.
        C: (B, S, n) in the working dtype.
        start: (B, S) bool, True where a document (or a padding run) starts.
        chunk: tokens per chunk, q.
        layout: tree rows, each chunk entering with the end state of the chunk its sources
            name (``TreePlan.chunked``; ``start`` is then all False).

    Returns:
        (B, S, I) in the working dtype.
    """
    batch, S, inner, n = inputs.shape
    decay = torch.exp(log_decay).masked_fill(start[..., None, None], 0)  # (B, S, I, n)
    pad = (-S) % chunk
    if pad:  # tokens past the row's end: no decay, no input, no output
        decay, inputs = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (decay, inputs))
        C = F.pad(C, (0, 0, 0, pad))
    c, q = (S + pad) // chunk, chunk
    decay, inputs = (t.reshape(batch, c, q, inner, n) for t in (decay, inputs))

    # 1. each chunk from a zero state, all chunks at once, and the running product of its
    # decays (unbound, not indexed: a slice's backward would zero a whole (B, c, q, I, n) per step)
    decays, inputs = decay.unbind(2), inputs.unbind(2)  # q of (B, c, I, n)
    local, through = [inputs[0]], [decays[0]]
    for j in range(1, q):
        local.append(decays[j] * local[-1] + inputs[j])
        through.append(decays[j] * through[-1])

    # 2. the state entering each chunk, carried chunk to chunk through each chunk's decays
    ends, products = local[-1].unbind(1), through[-1].unbind(1)  # c of (B, I, n)
    zero = torch.zeros_like(ends[0])
    entering, finals = [zero], []
    for k in range(1, c):
        finals.append(products[k - 1] * entering[-1] + ends[k - 1])
        forked = None if layout is None else fork(finals, layout.sources, k, zero)
        entering.append(finals[-1] if forked is None else forked)

    # 3. each token's state: its chunk's own part plus what entered the chunk, decayed to it
    states = torch.stack(local, 2) + torch.stack(through, 2) * torch.stack(entering, 1)[:, :, None]
    y = states @ C.reshape(batch, c, q, n, 1)  # (B, c, q, I, 1)
    return y.reshape(batch, c * q, inner)[:, :S]


def mamba_one_pass(
    module: torch.nn.Module, x: Tensor, plan: DocumentPlan, *, chunk: int | None = None
) -> Tensor:
    """A Mamba (1) mixer's forward over packed rows, documents kept apart, in one pass.

    ``in_proj`` -> x, gate -> causal depthwise ``conv1d`` + activation of x -> ``x_proj`` ->
    dt, B, C (normalised where the module has ``dt_layernorm``, ``b_layernorm`` and
    ``c_layernorm``: Jamba, Falcon-Mamba) -> softplus(``dt_proj``(dt)) -> the selective scan
    (A = -exp(``A_log``), ``D`` skip) gated by silu(gate) -> ``out_proj``, as transformers
    5.25's Mamba, Jamba and Falcon-Mamba mixers on the torch path without a cache, where a conv
    tap reaches token t - j only inside t's document and the scan's decay is zero at every
    document start (its state restarts from zero there); padding tokens give zeros.

    The scan runs in float32 for float32 and narrower rows (as the module's own does) and in
    float64 for float64 rows (the module's own rounds A, B and x to float32; Jamba's and
    Falcon-Mamba's norms still compute in float32, as theirs do).

    Args:
        module: a Mamba (1) mixer (:func:`_mamba_parts` accepts its structure).
        x: (B, S, H) hidden states of packed rows.
        plan: the rows' documents.
        chunk: tokens per chunk of the scan (default: ceil(sqrt(S))); any gives the same
            numbers up to rounding.

    Returns:
        (B, S, H) in the dtype ``module``'s own forward returns.

    Example:
        >>> import torch, transformers
        >>> _ = torch.manual_seed(0)
        >>> from flexpack.mixers._plan import DocumentPlan
        >>> from flexpack.mixers.ssm import mamba_one_pass
        >>> config = transformers.MambaConfig(hidden_size=16, state_size=4, intermediate_size=32,
        ...     time_step_rank=4, num_hidden_layers=1)
        >>> mixer = transformers.models.mamba.modeling_mamba.MambaMixer(config, 0)
        >>> plan = DocumentPlan.from_doc_ids(torch.tensor([[0, 0, 0, 1, 1, -1]]))
        >>> x = torch.randn(1, 6, 16)
        >>> out = mamba_one_pass(mixer, x, plan)
        >>> torch.allclose(out[:, 3:5], mixer(x[:, 3:5]), atol=1e-5), out[0, 5].abs().max().item()
        (True, 0.0)
    """
    dtype = x.dtype
    n, rank = module.ssm_state_size, module.time_step_rank
    h, gate = module.in_proj(x).chunk(2, dim=-1)  # (B, S, I) each
    conv = module.conv1d
    h = _masked_conv(conv, h.transpose(1, 2), plan)  # (B, I, S)
    h = module.act(h).transpose(1, 2)  # (B, S, I)
    dt, B, C = module.x_proj(h).split([rank, n, n], dim=-1)  # (B, S, r), (B, S, n) twice
    if getattr(module, "dt_layernorm", None) is not None:  # Jamba, Falcon-Mamba
        dt, B, C = module.dt_layernorm(dt), module.b_layernorm(B), module.c_layernorm(C)
    dt = F.linear(dt, module.dt_proj.weight)  # (B, S, I); the bias joins as the scan's
    if module.dt_proj.bias is not None:
        dt = dt + module.dt_proj.bias.to(dt.dtype)

    work = torch.promote_types(dtype, torch.float32)
    dt = F.softplus(dt).to(work)
    A = -torch.exp(module.A_log.to(work))  # (I, n)

    def scan(h: Tensor, dt: Tensor, B: Tensor, C: Tensor, segment: Tensor) -> Tensor:
        q = chunk or _selective_chunk(h.shape[1])
        return _selective_scan(h, dt, A, B, C, segment_starts(segment), q)

    scan.tree = lambda h, dt, B, C, tree: _tree_selective_scan(
        h, dt, A, B, C, tree, chunk or _selective_chunk(h.shape[1])
    )

    y = plan.scan(scan, h.to(work), dt, B.to(work), C.to(work))
    # the module's scan output is in the rows' dtype (bf16 rows: rounded), its D skip and gate
    # promote it back to float32
    y = (y.to(dtype) + h * module.D.to(work)) * F.silu(gate)
    out = module.out_proj(y.to(dtype))  # (B, S, H)
    return out * plan.real[..., None].to(out.dtype)


# what zamba_mamba_one_pass reads of Zamba's multi-head Mamba (1) mixer besides its submodules
# and parameters (transformers 5.25's ZambaMambaMixer): heads of p channels, each with its own
# x_proj, dt_proj, A_log and D
_ZAMBA_SIZES = ("intermediate_size", "ssm_state_size", "time_step_rank", "n_mamba_heads",
                "mamba_head_dim")  # fmt: skip


def _zamba_parts(module: torch.nn.Module) -> bool:
    """Is ``module`` built as Zamba's multi-head Mamba (1) mixer: ``in_proj`` -> (x, gate)
    interleaved channel by channel, a causal depthwise ``conv1d`` over x, per head h of p
    channels ``x_proj_weight`` (h, r + 2n, p) -> dt, B, C, ``dt_proj_weight`` (h, p, r) and
    ``dt_proj_bias`` (h, p), the selective scan from ``A_log`` (h, p, n) and ``D`` (h, p),
    ``out_proj``?"""
    sizes = [getattr(module, name, None) for name in _ZAMBA_SIZES]
    if not all(isinstance(v, int) and v > 0 for v in sizes):
        return False
    inner, state, rank, heads, p = sizes
    in_proj = getattr(module, "in_proj", None)
    # the short conv's check of a causal depthwise conv between two projections, on conv1d
    conv = _depthwise(SimpleNamespace(conv=getattr(module, "conv1d", None), in_proj=in_proj,
                                      out_proj=getattr(module, "out_proj", None)))  # fmt: skip
    weight = getattr(in_proj, "weight", None)
    shapes = {
        "x_proj_weight": (heads, rank + 2 * state, p),
        "dt_proj_weight": (heads, p, rank),
        "A_log": (heads, p, state),
        "D": (heads, p),
    }
    bias = getattr(module, "dt_proj_bias", None)
    return (
        conv is not None
        and heads * p == inner == conv.in_channels
        and isinstance(weight, Tensor)
        and weight.dim() == 2
        and weight.shape[0] == 2 * inner
        and all(
            isinstance(t := getattr(module, name, None), Tensor) and t.shape == shape
            for name, shape in shapes.items()
        )
        and (bias is None or (isinstance(bias, Tensor) and bias.shape == (heads, p)))
        and callable(getattr(module, "act", None))
    )


def _heads_selective_scan(u: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, start: Tensor,
                          chunk: int, layout: ChunkLayout | None = None) -> Tensor:  # fmt: skip
    """:func:`_selective_scan` with heads, each with its own A, B and C (Zamba): h_t = exp(A dt_t)
    h_{t-1} + dt_t B_t u_t, y_t = C_t . h_t per head, the state restarting wherever ``start``.
    The heads run as rows of their own through :func:`diagonal_scan` (a tree layout's sources
    repeated for each head's row).

    Args:
        u, dt: (B, S, h, p) inputs and time steps (after softplus), in the working dtype.
        A: (h, p, n) negative. B, C: (B, S, h, n) in the working dtype.
        start: (B, S) bool, True where a document (or a padding run) starts.
        chunk: tokens per chunk, q.
        layout: tree rows (``TreePlan.chunked``; ``start`` is then all False).

    Returns:
        (B, S, h, p) in the working dtype.
    """
    batch, S, heads, p = u.shape
    n = A.shape[-1]
    u, dt, B, C = (t.transpose(1, 2).reshape(batch * heads, S, -1) for t in (u, dt, B, C))
    log_decay = (dt.view(batch, heads, S, p, 1) * A[:, None]).view(batch * heads, S, p, n)
    inputs = (dt * u)[..., None] * B[:, :, None]  # (B h, S, p, n)
    if layout is not None:  # row b's chunk sources, for each of its heads' rows
        layout = layout._replace(sources=[row for row in layout.sources for _ in range(heads)])
    y = diagonal_scan(log_decay, inputs, C, start.repeat_interleave(heads, 0), chunk, layout)
    return y.view(batch, heads, S, p).transpose(1, 2)


def zamba_mamba_one_pass(
    module: torch.nn.Module, x: Tensor, plan: DocumentPlan, *, chunk: int | None = None
) -> Tensor:
    """Zamba's multi-head Mamba (1) mixer's forward over packed rows, documents kept apart, in
    one pass.

    ``in_proj`` -> x, gate (interleaved channel by channel) -> causal depthwise ``conv1d`` +
    activation of x -> per head: ``x_proj_weight`` -> dt, B, C -> softplus(``dt_proj_weight``
    dt + ``dt_proj_bias``) -> the selective scan (A = -exp(``A_log``), ``D`` skip) gated by
    silu(gate) -> the heads side by side -> ``out_proj``, as transformers 5.25's
    ``ZambaMambaMixer`` on the torch path without a cache, where a conv tap reaches token t - j
    only inside t's document and every head's decay is zero at every document start (its state
    restarts from zero there); padding tokens give zeros. On prefix trees each head's state
    forks at the end of a shared segment (:meth:`TreePlan.chunked`).

    The scan runs in float32 for float32 and narrower rows (as the module's own does) and in
    float64 for float64 rows (the module's own rounds A, B, x, D and the dt bias to float32).

    Args:
        module: Zamba's mixer (:func:`_zamba_parts` accepts its structure).
        x: (B, S, H) hidden states of packed rows.
        plan: the rows' documents (or trees).
        chunk: tokens per chunk of the scan (default: ceil(sqrt(S))); any gives the same
            numbers up to rounding.

    Returns:
        (B, S, H) in the dtype ``module``'s own forward returns.

    Example:
        >>> import torch, transformers
        >>> _ = torch.manual_seed(0)
        >>> from flexpack.mixers._plan import DocumentPlan
        >>> from flexpack.mixers.ssm import zamba_mamba_one_pass
        >>> config = transformers.ZambaConfig(hidden_size=16, mamba_d_state=4, mamba_expand=2,
        ...     mamba_dt_rank=4, n_mamba_heads=2, num_hidden_layers=1,
        ...     layers_block_type=["linear_attention"])
        >>> mixer = transformers.models.zamba.modeling_zamba.ZambaMambaMixer(config, 0)
        >>> plan = DocumentPlan.from_doc_ids(torch.tensor([[0, 0, 0, 1, 1, -1]]))
        >>> x = torch.randn(1, 6, 16)
        >>> out = zamba_mamba_one_pass(mixer, x, plan)
        >>> torch.allclose(out[:, 3:5], mixer(x[:, 3:5]), atol=1e-5), out[0, 5].abs().max().item()
        (True, 0.0)
    """
    dtype, (batch, S, _) = x.dtype, x.shape
    heads, p = module.n_mamba_heads, module.mamba_head_dim
    n, rank = module.ssm_state_size, module.time_step_rank
    h, gate = module.in_proj(x).view(batch, S, heads * p, 2).unbind(-1)  # (B, S, I) each
    h = _masked_conv(module.conv1d, h.transpose(1, 2), plan)  # (B, I, S)
    h = module.act(h)
    # each head's projections as the module computes them: (h, 1, ., p) @ (h, B, p, S)
    u = h.view(batch, heads, p, S).transpose(0, 1)  # (h, B, p, S)
    dt, B, C = (module.x_proj_weight[:, None] @ u).split([rank, n, n], dim=2)
    dt = module.dt_proj_weight[:, None] @ dt  # (h, B, p, S)
    if module.dt_proj_bias is not None:
        dt = dt + module.dt_proj_bias.to(dt.dtype)[:, None, :, None]

    work = torch.promote_types(dtype, torch.float32)
    dt = F.softplus(dt).permute(1, 3, 0, 2).to(work)  # (B, S, h, p)
    B, C = (t.permute(1, 3, 0, 2).to(work) for t in (B, C))  # (B, S, h, n)
    u = u.permute(1, 3, 0, 2)  # (B, S, h, p)
    A = -torch.exp(module.A_log.to(work))  # (h, p, n)

    def scan(u: Tensor, dt: Tensor, B: Tensor, C: Tensor, segment: Tensor) -> Tensor:
        q = chunk or _selective_chunk(S)
        return _heads_selective_scan(u, dt, A, B, C, segment_starts(segment), q)

    def tree(u: Tensor, dt: Tensor, B: Tensor, C: Tensor, plan: TreePlan) -> Tensor:
        def forked(u: Tensor, dt: Tensor, B: Tensor, C: Tensor, layout: ChunkLayout) -> Tensor:
            start = torch.zeros(u.shape[:2], dtype=torch.bool, device=u.device)
            return _heads_selective_scan(u, dt, A, B, C, start, q, layout=layout)

        q = chunk or _selective_chunk(S)
        return plan.chunked(forked, q, u, dt, B, C)

    scan.tree = tree
    y = plan.scan(scan, u.to(work), dt, B, C)  # (B, S, h, p)
    # the module's scan output is in the conv's dtype (bf16 rows or autocast: rounded), its D
    # skip (D in float32) and gate promote it back to float32
    y = (y.to(u.dtype) + u * module.D.to(work)) * F.silu(gate.view(batch, S, heads, p))
    out = module.out_proj(y.reshape(batch, S, heads * p).to(dtype))  # (B, S, H)
    return out * plan.real[..., None].to(out.dtype)


def _mamba1_one_pass(module: torch.nn.Module, x: Tensor, plan: DocumentPlan) -> Tensor:
    """The Mamba (1) room's one pass: :func:`zamba_mamba_one_pass` for Zamba's multi-head
    structure (:func:`_zamba_parts`), else :func:`mamba_one_pass`."""
    fn = zamba_mamba_one_pass if _zamba_parts(module) else mamba_one_pass
    return fn(module, x, plan)


def _mamba_fits(module: torch.nn.Module, x: Tensor, parts=_mamba_parts) -> bool:
    """A Mamba (1) mixer (``parts``: :func:`_mamba_parts`, or :func:`_zamba_parts` for Zamba's)
    on the torch path (no function of its class runs mamba_ssm's or causal-conv1d's kernel:
    those keep the per-group calls) on rows of its width, at most float32 wide: the module's own
    scan rounds float64 to float32, and only the per-group calls reproduce its numbers to
    float64's precision."""
    if not x.is_floating_point() or torch.finfo(x.dtype).bits > 32:
        return False
    if not parts(module) or x.shape[-1] != module.in_proj.weight.shape[1]:
        return False
    return not any(_closure(f)["is_new_implementation"] for f in hub_functions(module).values())


def _mamba1_fits(module: torch.nn.Module, x: Tensor) -> bool:
    """:func:`_mamba_fits` for either structure: Mamba's, Jamba's, Falcon-Mamba's or Zamba's."""
    return _mamba_fits(module, x) or _mamba_fits(module, x, _zamba_parts)


MAMBA = Room(
    "mamba",
    functions=frozenset({"mamba_selective_scan", "selective_scan_fn", "mamba_inner_fn"}),
    excludes=frozenset(MAMBA2.functions),
    how="scan and conv restart per document: one pass over the rows with the decays at "
    "document starts zeroed and taps across them masked (torch), else documents run apart; "
    "documents run apart (kernels: mamba_ssm has no varlen argument)",
    one_pass=_one_pass.hook(_mamba1_one_pass, _mamba1_fits, changes=_CHANGES_THE_SCAN),
)

ROOMS = (MAMBA2, MAMBA)
