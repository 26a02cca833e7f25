"""Gated delta rule (Qwen3.5, Qwen3-Next, OLMo hybrid: GatedDeltaNet) and Kimi delta attention
(Kimi Linear, Bailing hybrid: KDA): per-document recurrent state and causal conv.

Without fla, transformers runs ``torch_chunk_gated_delta_rule`` / ``chunk_kimi_delta_attention``
and ``causal_conv1d_fn`` over the whole row: state and conv window cross documents. On that torch
path flexpack runs a GatedDeltaNet (Qwen3.5's, Qwen3-Next's or OLMo hybrid's projections)
once over the whole packed rows
(:func:`gated_delta_one_pass`: the conv's taps masked at document boundaries, and
:func:`segment_chunk_gated_delta_rule`, transformers' chunked algorithm with the decay between
two tokens of different documents set to zero and the state carried across a chunk cut where a
document starts), and a Kimi Linear or Bailing hybrid KDA mixer likewise (:func:`kda_one_pass`,
:func:`segment_chunk_kda`: the same, with a decay per key channel), each self-checked per class;
other classes run once per group of right-padded documents (:mod:`flexpack.mixers._plan`), so
each starts from a zero state. With fla and causal-conv1d installed (on CUDA), the rows are
flattened to one and the boundaries go to the kernels' varlen arguments: GatedDeltaNet forwards
``cu_seq_lens_q`` to the rule's ``cu_seqlens``, KDA forwards its keywords as they are
(``cu_seqlens``), and both forward ``seq_idx`` to ``causal_conv1d_fn``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flexpack.mixers import _one_pass
from flexpack.mixers._conv_ops import _masked_conv
from flexpack.mixers._plan import DocumentPlan
from flexpack.mixers._room import Room
from flexpack.mixers._tree import ChunkLayout, TreePlan, fork

CHUNK = 64  # transformers' torch_chunk_gated_delta_rule's default


def _l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)  # as transformers / fla


def segment_chunk_gated_delta_rule(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    segments: Tensor,
    *,
    chunk_size: int = CHUNK,
    use_qk_l2norm: bool = True,
) -> Tensor:
    """The gated delta rule over rows of several documents, each from a zero state.

    transformers' ``torch_chunk_gated_delta_rule`` (the same chunked UT transform, in fp32, or
    float64 for float64 inputs), with
    the documents kept apart: inside a chunk the decay between two tokens of different
    segments is zero (so the triangular system decouples per document), the cumulative decays
    are summed per segment (never a difference of row-wide sums, which would cancel an earlier
    document's large decays), and the state carried into a chunk reaches only the segment it
    continues; the state carried out of it only the segment that reaches its end.

    Args:
        query, key: (B, S, Hk, Dk).
        value: (B, S, Hv, Dv); Hv a multiple of Hk.
        g: (B, S, Hv) log decays (<= 0).
        beta: (B, S, Hv).
        segments: (B, S) integer segment of each token (a new value wherever a document, or a
            run of padding, starts; equal values only within one run).
        chunk_size: tokens per chunk.
        use_qk_l2norm: normalise q and k as the kernel does.

    Returns:
        (B, S, Hv, Dv) in ``query``'s dtype.
    """
    return _gated_delta_chunks(query, key, value, g, beta, segments, chunk_size, use_qk_l2norm)


def tree_chunk_gated_delta_rule(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    plan: TreePlan,
    *,
    chunk_size: int = CHUNK,
    use_qk_l2norm: bool = True,
) -> Tensor:
    """The gated delta rule over prefix-tree rows: each branch's state starts from its parent
    segment's end state (forked, not recomputed), gradients flowing back through it.

    The rows are laid out so that every segment starts a chunk (:meth:`TreePlan.chunk_layout`;
    a segment's last chunk filled with zero keys, values, betas and log decays, which leave the
    state as it is), and the scan hands each chunk the end state of its source chunk: the
    previous chunk of its segment, its parent's last chunk at a branch's start.

    Args:
        query, key, value, g, beta: as :func:`segment_chunk_gated_delta_rule`, (B, S, ...).
        plan: the rows' trees.
        chunk_size, use_qk_l2norm: as :func:`segment_chunk_gated_delta_rule`.

    Returns:
        (B, S, Hv, Dv) in ``query``'s dtype, zeros on padding.
    """

    def rule(q, k, v, g, beta, layout: ChunkLayout) -> Tensor:
        return _gated_delta_chunks(
            q, k, v, g, beta, layout.segment, chunk_size, use_qk_l2norm, layout=layout
        )

    return plan.chunked(rule, chunk_size, query, key, value, g, beta)


segment_chunk_gated_delta_rule.tree = tree_chunk_gated_delta_rule  # type: ignore[attr-defined]


def _gated_delta_chunks(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    segments: Tensor,
    chunk_size: int,
    use_qk_l2norm: bool,
    layout: ChunkLayout | None = None,
) -> Tensor:
    """:func:`segment_chunk_gated_delta_rule`'s computation; with a tree ``layout``, each chunk
    holds one segment and reads the state of the chunk its sources name
    (:func:`tree_chunk_gated_delta_rule`)."""
    dtype = query.dtype
    compute = torch.promote_types(dtype, torch.float32)  # fp32 as transformers; float64 kept
    B, S, Hk, Dk = key.shape
    Hv = value.shape[-2]
    if Hk != Hv:
        query = query.repeat_interleave(Hv // Hk, dim=2)
        key = key.repeat_interleave(Hv // Hk, dim=2)
    query, key, value, beta, g = (
        t.transpose(1, 2).to(compute, memory_format=torch.contiguous_format)
        for t in (query, key, value, beta, g)
    )  # (B, H, S, ...)
    if use_qk_l2norm:
        query, key = _l2norm(query), _l2norm(key)
    query = query * Dk**-0.5
    C = chunk_size
    pad = (C - S % C) % C
    query, key, value = (F.pad(t, (0, 0, 0, pad)) for t in (query, key, value))
    beta, g = (F.pad(t, (0, pad)) for t in (beta, g))
    last = segments[:, -1:]
    seg = torch.cat([segments, (last + 1).expand(B, pad)], dim=1) if pad else segments
    N = (S + pad) // C
    v_beta = value * beta[..., None]
    k_beta = key * beta[..., None]
    query, key, k_beta, v_beta = (t.reshape(B, Hv, N, C, -1) for t in (query, key, k_beta, v_beta))
    g = g.reshape(B, Hv, N, C)
    seg = seg.reshape(B, 1, N, C)
    lower = torch.ones(C, C, dtype=torch.bool, device=g.device).tril()
    same = (seg[..., :, None] == seg[..., None, :]) & lower  # (B, 1, N, C, C): j <= i, one doc
    # cumulative decay from the chunk's start (or the segment's) to each token, per segment
    cum = (g[..., None, :] * same).sum(-1)  # (B, H, N, C)
    pairwise = (cum[..., :, None] - cum[..., None, :]).masked_fill(~same, float("-inf")).exp()
    # the segment that continues the previous chunk (none in the first chunk)
    before = torch.cat([seg[..., :1, :1].new_full((B, 1, 1, 1), -1), seg[..., :-1, -1:]], dim=2)
    carry = seg == before  # (B, 1, N, C)
    if layout is not None:  # one segment per chunk: it reads a state where it has a source
        carry = layout.entered[:, None, :, None].expand(B, 1, N, C)
    into = cum.exp() * carry  # decay of the carried state at each token; 0 past a new start
    ut = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra = (query @ key.transpose(-1, -2)) * pairwise
    new_values, k_cumdecay = _solve_unit_lower(ut, v_beta, k_beta * into[..., None])
    query = query * into[..., None]
    # what reaches the chunk's end: tokens of its last segment, decayed to the end
    tail = seg == seg[..., -1:]
    key = key * ((cum[..., -1:] - cum).masked_fill(~tail, float("-inf")).exp())[..., None]
    chunk_decay = into[..., -1, None, None]  # (B, H, N, 1, 1)
    out = _scan_chunks(query, key, intra, new_values, k_cumdecay, chunk_decay, layout)[:, :, :S]
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)


def _unit_lower_inverse(t: Tensor) -> Tensor:
    """(..., C, C) -> the inverse of the unit lower triangular matrix with ``t``'s strictly
    lower part (its diagonal and upper part are not read); C a power of two.

    Diagonal blocks doubled log2(C) times, each step ``[[A, 0], [L, D]]^-1 = [[A^-1, 0],
    [-D^-1 L A^-1, D^-1]]`` in batched matmuls: forward substitution by blocks, as stable. Not
    ``torch.linalg.solve_triangular``, which on CPU solves the batch one small matrix at a time
    (one LAPACK call each, per chunk and head): slower alone, and seconds where other work
    contends for the cores.
    """
    C = t.shape[-1]
    lead = t.shape[:-2]
    blocks = t.new_ones(*lead, C, 1, 1)  # (..., C // s, s, s): the inverted diagonal blocks
    s = 1
    while s < C:
        n = C // (2 * s)
        pairs = torch.diagonal(t.reshape(*lead, n, 2 * s, n, 2 * s), dim1=-4, dim2=-2)
        low = pairs.movedim(-1, -3)[..., s:, :s]  # (..., n, s, s): the blocks below the diagonal
        a, d = blocks.reshape(*lead, n, 2, s, s).unbind(-3)
        blocks = torch.cat(
            [torch.cat([a, torch.zeros_like(a)], -1), torch.cat([-(d @ low @ a), d], -1)], -2
        )  # (..., n, 2s, 2s)
        s *= 2
    return blocks.reshape(*lead, C, C)


def _solve_unit_lower(ut: Tensor, *rhs: Tensor) -> tuple[Tensor, ...]:
    """(I + strictly lower part of ``ut``)^-1 @ each of ``rhs`` (..., C, D_i), in one matmul."""
    C = ut.shape[-1]
    if C & (C - 1):  # not a power of two: the LAPACK solve
        solved = torch.linalg.solve_triangular(
            ut, torch.cat(rhs, dim=-1), upper=False, unitriangular=True
        )
    else:
        solved = _unit_lower_inverse(ut) @ torch.cat(rhs, dim=-1)
    return solved.split([r.shape[-1] for r in rhs], dim=-1)


def _scan_chunks(
    query: Tensor,
    key: Tensor,
    intra: Tensor,
    new_values: Tensor,
    k_cumdecay: Tensor,
    chunk_decay: Tensor,
    layout: ChunkLayout | None = None,
) -> Tensor:
    """The delta rules' scan over chunks (B, H, N, C, ...) -> outputs (B, H, N * C, Dv): the
    state carried from chunk to chunk, then each chunk's read of it and its own attention.

    The loop carries only the state; the outputs come after it in batched matmuls (writing
    each chunk's slice of one output tensor would copy all of its gradient once per chunk in
    backward), and the chunks are taken apart once (indexing chunk i in the loop would build a
    zero gradient of the whole tensor per chunk). ``key`` is decayed to its chunk's end,
    ``chunk_decay`` (B, H, N, 1 or Dk, 1) the carried state's decay across each chunk.
    A tree ``layout``: each chunk enters with the end state its sources name (:func:`fork`).
    """
    B, H, N, C, Dk = key.shape
    zero = query.new_zeros(B, H, Dk, new_values.shape[-1])
    state = zero
    states, v_news, ends = [], [], []
    for n, (values, k_decay, decay, k) in enumerate(zip(
        new_values.unbind(2), k_cumdecay.unbind(2), chunk_decay.unbind(2),
        key.transpose(-1, -2).unbind(2), strict=True,
    )):  # fmt: skip
        forked = None if layout is None else fork(ends, layout.sources, n, zero)
        if forked is not None:
            state = forked
        v_new = values - k_decay @ state
        states.append(state)
        v_news.append(v_new)
        state = state * decay + k @ v_new
        ends.append(state)
    out = query @ torch.stack(states, dim=2) + intra @ torch.stack(v_news, dim=2)
    return out.reshape(B, H, N * C, -1)


# the projections: Qwen3.5's separate q/k/v, z, b, a; Qwen3-Next's fused qkvz and ba (interleaved
# per key head, taken apart by the module's own fix_query_key_value_ordering); OLMo hybrid's
# q, k, v, a, b and its gate g (and o_norm / o_proj for norm / out_proj)
_SEPARATE = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "norm", "out_proj")
_FUSED = ("in_proj_qkvz", "in_proj_ba", "norm", "out_proj")
_OLMO = ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_norm", "o_proj")


def _has(module: torch.nn.Module, names: tuple[str, ...]) -> bool:
    return all(isinstance(getattr(module, n, None), torch.nn.Module) for n in names)


def _fits(module: torch.nn.Module, x: Tensor) -> bool:
    """A GatedDeltaNet's structure: separate q/k/v, z, b, a projections (Qwen3.5), fused qkvz
    and ba ones with ``fix_query_key_value_ordering`` (Qwen3-Next) or separate q, k, v, a, b,
    g ones (OLMo hybrid, with ``allow_neg_eigval``), a causal depthwise conv1d, A_log and
    dt_bias, a gated norm and the output projection."""
    fused = _has(module, _FUSED) and callable(getattr(module, "fix_query_key_value_ordering", None))
    olmo = _has(module, _OLMO) and isinstance(getattr(module, "allow_neg_eigval", None), bool)
    if not (isinstance(getattr(module, "conv1d", None), torch.nn.Module) and (
        _has(module, _SEPARATE) or fused or olmo
    )):  # fmt: skip
        return False
    if x.shape[-1] != getattr(module, "hidden_size", None):
        return False
    if not all(isinstance(getattr(module, n, None), Tensor) for n in ("A_log", "dt_bias")):
        return False
    conv = module.conv1d
    return (
        isinstance(conv, torch.nn.Conv1d)
        and conv.groups == conv.in_channels == conv.out_channels
        and conv.padding == (conv.kernel_size[0] - 1,)
        and conv.stride == (1,)
        and conv.dilation == (1,)
        and getattr(conv, "_hf_hook", None) is None  # accelerate moves its weights
        and all(isinstance(getattr(module, n, None), int) for n in
                ("head_k_dim", "head_v_dim", "key_dim", "value_dim"))
        and isinstance(getattr(module, "activation", None), str)
    )  # fmt: skip


def _projections(module: torch.nn.Module, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q/k/v before the conv (B, S, 2 key_dim + value_dim), the norm's gate z (B, S, Hv, Dv),
    beta, a (B, S, Hv)) of a GatedDeltaNet, from whichever projections it has."""
    B, S, _ = x.shape
    if _has(module, _SEPARATE):
        z = module.in_proj_z(x).reshape(B, S, -1, module.head_v_dim)
        return module.in_proj_qkv(x), z, module.in_proj_b(x).sigmoid(), module.in_proj_a(x)
    if _has(module, _OLMO):
        qkv = torch.cat([module.q_proj(x), module.k_proj(x), module.v_proj(x)], dim=-1)
        beta = module.b_proj(x).sigmoid()
        beta = beta * 2.0 if module.allow_neg_eigval else beta  # eigenvalues in [-1, 1]
        return qkv, module.g_proj(x).reshape(B, S, -1, module.head_v_dim), beta, module.a_proj(x)
    q, k, v, z, b, a = module.fix_query_key_value_ordering(
        module.in_proj_qkvz(x), module.in_proj_ba(x)
    )
    return torch.cat([t.reshape(B, S, -1) for t in (q, k, v)], dim=-1), z, b.sigmoid(), a


def gated_delta_one_pass(module: torch.nn.Module, x: Tensor, plan: DocumentPlan) -> Tensor:
    """A GatedDeltaNet's forward over packed rows, documents kept apart, in one pass.

    As Qwen3.5's, Qwen3-Next's and OLMo hybrid's ``forward`` without a cache (transformers
    5.17 to 5.25):
    projections, the causal conv with its taps masked at document boundaries, the gated delta
    rule by :func:`segment_chunk_gated_delta_rule`, the gated norm and the output projection;
    padding tokens give zeros.

    Args:
        module: a GatedDeltaNet whose structure :func:`_fits` accepts.
        x: (B, S, H) hidden states of packed rows.
        plan: the rows' documents.

    Returns:
        (B, S, H), in the dtype ``module``'s own forward returns (autocast included).
    """
    from transformers.activations import ACT2FN

    B, S, _ = x.shape
    qkv, z, beta, a = _projections(module, x)
    mixed = _masked_conv(module.conv1d, qkv.transpose(1, 2), plan)
    mixed = ACT2FN[module.activation](mixed).transpose(1, 2)  # (B, S, conv channels)
    q, k, v = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    q = q.reshape(B, S, -1, module.head_k_dim)
    k = k.reshape(B, S, -1, module.head_k_dim)
    v = v.reshape(B, S, -1, module.head_v_dim)
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    core = plan.scan(segment_chunk_gated_delta_rule, q, k, v, g, beta)
    norm, out_proj = (module.o_norm, module.o_proj) if _has(module, _OLMO) else (
        module.norm, module.out_proj
    )  # fmt: skip
    core = norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    out = out_proj(core.reshape(B, S, -1))
    return out * plan.real[..., None].to(out.dtype)


GATED_DELTA_RULE = Room(
    "gated_delta_rule",
    functions=frozenset({"torch_chunk_gated_delta_rule", "chunk_gated_delta_rule"}),
    varlen={"cu_seq_lens_q": "cu_seqlens", "seq_idx": "seq_idx"},
    how="state and conv restart per document: one pass over the rows (torch: Qwen3.5's, "
    "Qwen3-Next's and OLMo hybrid's structures), else documents run apart; fla's cu_seqlens "
    "and causal-conv1d's seq_idx (kernels)",
    one_pass=_one_pass.hook(gated_delta_one_pass, _fits),
)

KDA_CHUNK = 64  # transformers' chunk_kimi_delta_attention's default
KDA_SUB = 8  # sub-chunk whose pairs build their per-channel decays (:func:`_kda_pairs`)
# document ids of KDA's self-check: its chunks are 64 tokens, so documents that cross a chunk
# cut, one that starts mid-chunk, one of one token, padding and a padding-only row
KDA_PROBE = [
    [0] * 3 + [1] * 70 + [2] + [-1] * 6,
    [0] * 64 + [1] * 10 + [-1] * 6,
    [-1] * 80,
]


def _kda_l2norm(x: Tensor) -> Tensor:
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)  # as transformers' KDA


def segment_chunk_kda(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    segments: Tensor,
    *,
    chunk_size: int = KDA_CHUNK,
    use_qk_l2norm: bool = True,
) -> Tensor:
    """Kimi delta attention over rows of several documents, each from a zero state.

    transformers' ``chunk_kimi_delta_attention`` (the gated delta rule with a decay per key
    channel: the chunked UT transform with per-channel pairwise decays, in fp32, or float64 for
    float64 inputs), with the documents kept apart as in :func:`segment_chunk_gated_delta_rule`:
    inside a chunk the decay between two tokens of different segments is zero, the cumulative
    decays are summed per segment, and the state carried into a chunk reaches only the segment
    it continues; the state carried out of it only the segment that reaches its end.

    Args:
        query, key: (B, S, H, Dk).
        value: (B, S, H, Dv).
        g: (B, S, H, Dk) log decays per key channel (<= 0).
        beta: (B, S, H).
        segments: (B, S) integer segment of each token (a new value wherever a document, or a
            run of padding, starts; equal values only within one run).
        chunk_size: tokens per chunk.
        use_qk_l2norm: normalise q and k as the kernel does.

    Returns:
        (B, S, H, Dv) in ``query``'s dtype.
    """
    # fp32 as transformers (float64 kept), autocast off: its matmuls would round the UT system
    # to bf16, which the triangular solve does not take
    with torch.autocast(query.device.type, enabled=False):
        out = _chunk_kda(query, key, value, g, beta, segments, chunk_size, use_qk_l2norm)
    return out.to(query.dtype)


def tree_chunk_kda(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    plan: TreePlan,
    *,
    chunk_size: int = KDA_CHUNK,
    use_qk_l2norm: bool = True,
) -> Tensor:
    """Kimi delta attention over prefix-tree rows, each branch's state forked from its parent
    segment's end state, as :func:`tree_chunk_gated_delta_rule` (arguments as
    :func:`segment_chunk_kda`'s, ``plan`` the rows' trees). Returns (B, S, H, Dv), zeros on
    padding."""

    def rule(q, k, v, g, beta, layout: ChunkLayout) -> Tensor:
        with torch.autocast(q.device.type, enabled=False):
            out = _chunk_kda(q, k, v, g, beta, layout.segment, chunk_size, use_qk_l2norm, layout)
        return out.to(q.dtype)

    return plan.chunked(rule, chunk_size, query, key, value, g, beta)


segment_chunk_kda.tree = tree_chunk_kda  # type: ignore[attr-defined]


def _chunk_kda(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    segments: Tensor,
    chunk_size: int,
    use_qk_l2norm: bool,
    layout: ChunkLayout | None = None,
) -> Tensor:
    compute = torch.promote_types(query.dtype, torch.float32)
    B, S, H, Dk = key.shape
    query, key, value, beta, g = (
        t.transpose(1, 2).to(compute, memory_format=torch.contiguous_format)
        for t in (query, key, value, beta, g)
    )  # (B, H, S, ...)
    if use_qk_l2norm:
        query, key = _kda_l2norm(query), _kda_l2norm(key)
    query = query * Dk**-0.5
    C = chunk_size
    pad = (C - S % C) % C
    query, key, value, g = (F.pad(t, (0, 0, 0, pad)) for t in (query, key, value, g))
    beta = F.pad(beta, (0, pad))
    last = segments[:, -1:]
    seg = torch.cat([segments, (last + 1).expand(B, pad)], dim=1) if pad else segments
    N = (S + pad) // C
    v_beta = value * beta[..., None]
    k_beta = key * beta[..., None]
    query, key, g, k_beta, v_beta = (
        t.reshape(B, H, N, C, -1) for t in (query, key, g, k_beta, v_beta)
    )  # (B, H, N, C, D)
    seg = seg.reshape(B, 1, N, C)
    lower = torch.ones(C, C, dtype=torch.bool, device=g.device).tril()
    same = (seg[..., :, None] == seg[..., None, :]) & lower  # (B, 1, N, C, C): j <= i, one doc
    # cumulative decay per channel from the chunk's start (or the segment's) to each token
    cum = same.to(compute) @ g  # (B, H, N, C, Dk)
    # row i of the UT system (k_beta) and of the intra-chunk attention (query) against every
    # key j, decayed from j to i per channel; zero across documents and above the diagonal
    pairs = _kda_pairs(torch.stack([k_beta, query], dim=-3), key, cum)  # (B, H, N, 2, C, C)
    ut, intra = (pairs * same[:, :, :, None]).unbind(3)
    # the segment that continues the previous chunk (none in the first chunk)
    before = torch.cat([seg[..., :1, :1].new_full((B, 1, 1, 1), -1), seg[..., :-1, -1:]], dim=2)
    carry = (seg == before)[..., None]  # (B, 1, N, C, 1)
    if layout is not None:  # one segment per chunk: it reads a state where it has a source
        carry = layout.entered[:, None, :, None, None].expand(B, 1, N, C, 1)
    into = cum.exp() * carry  # decay of the carried state at each token; 0 past a new start
    new_values, k_cumdecay = _solve_unit_lower(ut, v_beta, k_beta * into)
    query = query * into
    # what reaches the chunk's end: tokens of its last segment, decayed to the end per channel
    tail = (seg == seg[..., -1:])[..., None]
    key = key * (cum[..., -1:, :] - cum).masked_fill(~tail, float("-inf")).exp()
    chunk_decay = into[..., -1, :, None]  # (B, H, N, Dk, 1)
    out = _scan_chunks(query, key, intra, new_values, k_cumdecay, chunk_decay, layout)[:, :, :S]
    return out.transpose(1, 2).contiguous()


def _kda_pairs(rows: Tensor, key: Tensor, cum: Tensor) -> Tensor:
    """sum over channels d of rows[i, d] * key[j, d] * exp(cum[i, d] - cum[j, d]) for every
    pair of a chunk: (B, H, N, R, C, Dk) rows, (B, H, N, C, Dk) keys and cumulative log decays
    -> (B, H, N, R, C, C), meaningful where j <= i in one segment (the caller masks the rest).

    Not one (C, C, Dk) tensor of pairwise decays per chunk (memory-bound: half a GiB per
    tensor, several kept for backward, at 4 rows of 2048 tokens and 4 heads of 64 channels).
    Pairs in different sub-chunks of KDA_SUB tokens take the decay split at the later
    sub-chunk's start r, exp(cum_i - r) * exp(r - cum_j): two factors at most 1 for a pair of
    one segment (log decays <= 0), clamped at 1 for the others, which the mask drops, so that
    nothing overflows; one matmul. Only pairs inside one sub-chunk build their (c, c, Dk)
    decays (fla's sub-chunked KDA does the same).
    """
    B, H, N, C, Dk = key.shape
    R = rows.shape[3]
    c = KDA_SUB if C % KDA_SUB == 0 else C
    M = C // c
    # the cumulative decay just before each sub-chunk: (B, H, N, M, 1, Dk)
    ref = torch.cat([torch.zeros_like(cum[..., :1, :]), cum[..., c - 1 : C - 1 : c, :]], dim=-2)
    ref = ref.reshape(B, H, N, M, 1, Dk)
    cum_sub = cum.reshape(B, H, N, M, c, Dk)
    left = rows.reshape(B, H, N, R, M, c, Dk) * (cum_sub - ref).clamp(max=0).exp()[:, :, :, None]
    right = key[..., None, :, :] * (ref - cum[..., None, :, :]).clamp(max=0).exp()  # (B,H,N,M,C,Dk)
    out = left @ right[:, :, :, None].transpose(-1, -2)  # (B, H, N, R, M, c, C)
    # pairs inside one sub-chunk: their decays exactly (a pair across the sub-chunk's
    # segments, or above the diagonal, is masked by the caller: clamp what would overflow)
    inside = (cum_sub[..., :, None, :] - cum_sub[..., None, :, :]).clamp(max=0).exp()
    k_sub = key.reshape(B, H, N, M, 1, c, Dk) * inside  # (B, H, N, M, c, c, Dk)
    diag = (rows.reshape(B, H, N, R, M, c, 1, Dk) * k_sub[:, :, :, None]).sum(-1)
    out = out.reshape(B, H, N, R, M, c, M, c)
    eye = torch.eye(M, dtype=torch.bool, device=key.device)[:, None, :, None]  # (M, 1, M, 1)
    out = torch.where(eye, diag[..., None, :].expand_as(out), out)
    return out.reshape(B, H, N, R, C, C)


_KDA_PARTS = ("q_proj", "k_proj", "v_proj", "conv1d", "forget_gate", "b_proj", "o_norm", "o_proj")


def _kda_gate(module: torch.nn.Module, x: Tensor) -> Tensor:
    """The output gate's projection: Kimi Linear's low-rank ``g_b_proj(g_a_proj(x))``, Bailing
    hybrid's ``g_proj(x)``."""
    if isinstance(getattr(module, "g_proj", None), torch.nn.Module):
        return module.g_proj(x)
    return module.g_b_proj(module.g_a_proj(x))


def _kda_fits(module: torch.nn.Module, x: Tensor) -> bool:
    """Kimi Linear's / Bailing hybrid's KDA structure: q, k, v projections, one causal
    depthwise conv1d over the three, a forget gate module (per-channel log decays), a beta
    projection, an output gate projection, a gated norm and the output projection."""
    if not all(isinstance(getattr(module, n, None), torch.nn.Module) for n in _KDA_PARTS):
        return False
    if x.shape[-1] != getattr(module, "hidden_size", None):
        return False
    low_rank = all(isinstance(getattr(module, n, None), torch.nn.Module)
                   for n in ("g_a_proj", "g_b_proj"))  # fmt: skip
    if not (low_rank or isinstance(getattr(module, "g_proj", None), torch.nn.Module)):
        return False
    head_dim, qkv_dim = getattr(module, "head_dim", None), getattr(module, "qkv_dim", None)
    if not (isinstance(head_dim, int) and isinstance(qkv_dim, int) and head_dim > 0):
        return False
    conv = module.conv1d
    return (
        isinstance(conv, torch.nn.Conv1d)
        and conv.groups == conv.in_channels == conv.out_channels == 3 * qkv_dim
        and conv.padding == (conv.kernel_size[0] - 1,)
        and conv.padding_mode == "zeros"
        and conv.stride == (1,)
        and conv.dilation == (1,)
        and getattr(conv, "_hf_hook", None) is None  # accelerate moves its weights
        and qkv_dim % head_dim == 0
        and isinstance(getattr(module, "activation", None), str)
    )


def kda_one_pass(module: torch.nn.Module, x: Tensor, plan: DocumentPlan) -> Tensor:
    """A KDA mixer's forward over packed rows, documents kept apart, in one pass.

    As Kimi Linear's ``KimiLinearDeltaAttention.forward`` and Bailing hybrid's
    ``BailingHybridDeltaAttention.forward`` without a cache (transformers 5.25): q, k, v
    projections, the causal conv with its taps masked at document boundaries, the forget gate
    and beta, the rule by :func:`segment_chunk_kda`, the gated norm and the output
    projection; padding tokens give zeros.

    Args:
        module: a KDA mixer whose structure :func:`_kda_fits` accepts.
        x: (B, S, H) hidden states of packed rows.
        plan: the rows' documents.

    Returns:
        (B, S, H), in the dtype ``module``'s own forward returns (autocast included).
    """
    from transformers.activations import ACT2FN

    B, S, _ = x.shape
    heads = (B, S, -1, module.head_dim)
    conv = module.conv1d
    mixed = torch.cat([module.q_proj(x), module.k_proj(x), module.v_proj(x)], dim=-1)
    mixed = _masked_conv(conv, mixed.transpose(1, 2), plan)
    mixed = ACT2FN[module.activation](mixed).transpose(1, 2)  # (B, S, 3 * qkv_dim)
    q, k, v = (t.reshape(heads) for t in torch.split(mixed, [module.qkv_dim] * 3, dim=-1))
    g = module.forget_gate(x)  # (B, S, heads, head_dim) per-channel log decays
    beta = module.b_proj(x).sigmoid()
    core = plan.scan(segment_chunk_kda, q, k, v, g, beta)
    core = module.o_norm(core, _kda_gate(module, x).view(heads)).reshape(B, S, -1)
    out = module.o_proj(core)
    return out * plan.real[..., None].to(out.dtype)


KDA = Room(
    "kda",
    functions=frozenset({"chunk_kimi_delta_attention", "chunk_kda"}),
    varlen={"cu_seqlens": "cu_seqlens", "seq_idx": "seq_idx"},
    how="state and conv restart per document: one pass over the rows (torch, Kimi Linear's and "
    "Bailing hybrid's structure), else documents run apart; fla's cu_seqlens and "
    "causal-conv1d's seq_idx (kernels)",
    # the torch KDA's work grows with the padded tokens more than with its calls: 0.735 s vs
    # 0.982 s a step at 2.0 (bench/mixers.py's Kimi Linear, docs/benchmarks.md)
    pad_factor=1.25,
    one_pass=_one_pass.hook(kda_one_pass, _kda_fits, probe=lambda _: KDA_PROBE),
)

ROOMS = (GATED_DELTA_RULE, KDA)
