"""xLSTM's mLSTM layer (``xLSTMForCausalLM``): a matrix memory that restarts per document.

transformers' ``xLSTMLayer`` projects q, k, v, an output gate and per-head input / forget gate
pre-activations (soft-capped), and its ``mlstm_backend`` runs the mLSTM cell along the whole row
(chunkwise, then token by token for the rest): a matrix memory C, a normaliser n and a
stabiliser m carried from one document into the next. No kernel mapping, no conv. flexpack runs
the layer once over the whole packed rows (:func:`mlstm_one_pass`): the cell's chunked form
(:func:`segment_mlstm`) with the forget gate cut at every document start, where a document's
state restarts as it does alone (C = 0, n = 0 and m = 0: the stabiliser still counts that
starting 0, decayed by the document's forget gates); on prefix trees (:func:`tree_mlstm`) each
branch's chunk enters with its parent's end state (C, n, m). A class whose structure or
behaviour differs runs once per group of right-padded documents. The layer is recognised by its
``mlstm_backend`` submodule, not by its class name.

The layer's cache is its ``state`` argument (the model hands it ``cache.rnn_state[layer]`` under
``use_cache``): a call with one runs the layer's own forward (prompts, decoding), so
``generate()`` is the model's own. Packed rows with a cache (``use_cache`` left at its default)
are exact too, with flexpack.mixers' warning: the model copies the state each layer returns into
its cache, so the one pass returns an empty state (zeros, the cache's shapes), where a packed row
has no one state to hand on.

One mLSTM step per head (i, f: pre-activations, d: the q/k head width, eps the config's)::

    m_t = max(logsigmoid(f_t) + m_{t-1}, i_t)
    C_t = exp(logsigmoid(f_t) + m_{t-1} - m_t) C_{t-1} + exp(i_t - m_t) k_t v_t^T
    n_t = exp(logsigmoid(f_t) + m_{t-1} - m_t) n_{t-1} + exp(i_t - m_t) k_t
    h_t = (q_t C_t / sqrt(d)) / (max(|q_t . n_t / sqrt(d)|, exp(-m_t)) + eps)

Shapes: B rows of S tokens, H heads, q/k heads of Dk channels, v heads of Dv; chunks of C
tokens (N of them per row, the row padded to a multiple of C).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from flexpack.mixers import _one_pass
from flexpack.mixers._plan import DocumentPlan
from flexpack.mixers._room import Room
from flexpack.mixers._tree import ChunkLayout, TreePlan, fork

__all__ = ["empty_state", "mlstm_one_pass", "segment_mlstm", "tree_mlstm"]

CHUNK = 64  # transformers' xLSTMConfig.chunk_size default
# document ids of the self-check's rows: documents crossing a chunk cut (64), one starting
# mid-chunk, one of one token, padding and a padding-only row
PROBE = [
    [0] * 3 + [1] * 70 + [2] + [-1] * 6,
    [0] * 64 + [1] * 10 + [-1] * 6,
    [-1] * 80,
]


def segment_mlstm(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    igate: Tensor,
    fgate: Tensor,
    segments: Tensor,
    *,
    chunk_size: int = CHUNK,
    eps: float = 1e-6,
) -> Tensor:
    """The mLSTM cell over rows of several documents, each from a zero state.

    The chunkwise form of transformers' ``mlstm_chunkwise_native_autograd`` (the same stabilised
    sums, in float32, or float64 for float64 inputs, autocast off), with the documents kept
    apart: inside a chunk a token reads only its own segment's earlier tokens, the cumulative
    log forget gates are summed per segment, and the state carried into a chunk reaches only
    the segment it continues; every other segment starts from C = 0, n = 0, m = 0, so its
    stabiliser is the one it has alone.

    Args:
        query, key: (B, S, H, Dk).
        value: (B, S, H, Dv).
        igate, fgate: (B, S, H) input and forget gate pre-activations (after the soft cap).
        segments: (B, S) integer segment of each token (a new value wherever a document, or a
            run of padding, starts; equal values only within one run).
        chunk_size: tokens per chunk.
        eps: added to the denominator, as the module's ``config.eps``.

    Returns:
        (B, S, H, Dv) in ``query``'s dtype.

    Example:
        >>> import torch
        >>> from flexpack.mixers.xlstm import segment_mlstm
        >>> q, k, v = (torch.randn(1, 6, 2, 4, dtype=torch.float64) for _ in range(3))
        >>> i, f = (torch.randn(1, 6, 2, dtype=torch.float64) for _ in range(2))
        >>> seg = torch.tensor([[0, 0, 0, 1, 1, 1]])
        >>> out = segment_mlstm(q, k, v, i, f, seg, chunk_size=4)
        >>> alone = segment_mlstm(q[:, 3:], k[:, 3:], v[:, 3:], i[:, 3:], f[:, 3:], seg[:, 3:])
        >>> torch.allclose(out[:, 3:], alone, rtol=0, atol=1e-12)
        True
    """
    with torch.autocast(query.device.type, enabled=False):
        out = _mlstm_chunks(query, key, value, igate, fgate, segments, None, chunk_size, eps)
    return out.to(query.dtype)


def tree_mlstm(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    igate: Tensor,
    fgate: Tensor,
    plan: TreePlan,
    *,
    chunk_size: int = CHUNK,
    eps: float = 1e-6,
) -> Tensor:
    """The mLSTM cell over prefix-tree rows: each branch starts from its parent segment's end
    state (C, n and m, forked, not recomputed), gradients flowing back through it.

    The rows are laid out so that every segment starts a chunk (:meth:`TreePlan.chunk_layout`;
    a segment's last chunk filled with tokens that neither decay nor add to the state), and
    each chunk enters with the end state of its source chunk (:func:`fork`). Arguments as
    :func:`segment_mlstm`'s, ``plan`` the rows' trees. Returns (B, S, H, Dv) in ``query``'s
    dtype, zeros on padding.
    """

    def cell(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, layout: ChunkLayout) -> Tensor:
        live = layout.index < plan.S  # not the filling
        with torch.autocast(q.device.type, enabled=False):
            out = _mlstm_chunks(q, k, v, i, f, layout.segment, live, chunk_size, eps, layout)
        return out.to(q.dtype)

    return plan.chunked(cell, chunk_size, query, key, value, igate, fgate)


segment_mlstm.tree = tree_mlstm  # type: ignore[attr-defined]


def _mlstm_chunks(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    igate: Tensor,
    fgate: Tensor,
    segments: Tensor,
    live: Tensor | None,
    chunk_size: int,
    eps: float,
    layout: ChunkLayout | None = None,
) -> Tensor:
    """:func:`segment_mlstm`'s computation, in the working dtype; ``live`` (B, S) bool marks
    the tokens that count (None: all), the others neither decay nor add to the state; with a
    tree ``layout``, each chunk holds one segment and enters with the state its sources name
    (:func:`tree_mlstm`)."""
    work = torch.promote_types(query.dtype, torch.float32)
    B, S, H, Dk = key.shape
    q, k, v = (t.transpose(1, 2).to(work) for t in (query, key, value))  # (B, H, S, D)
    i, f = (t.transpose(1, 2).to(work) for t in (igate, fgate))  # (B, H, S)
    if live is None:
        live = torch.ones(B, S, dtype=torch.bool, device=q.device)
    C = chunk_size
    pad = (-S) % C
    if pad:  # padded tokens: a segment of their own, not live
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        i, f = (F.pad(t, (0, pad)) for t in (i, f))
        segments = torch.cat([segments, (segments[:, -1:] + 1).expand(B, pad)], dim=1)
        live = F.pad(live, (0, pad), value=False)
    N = (S + pad) // C
    live = live[:, None]  # (B, 1, S + pad)
    log_f = torch.where(live, F.logsigmoid(f), 0.0).view(B, H, N, C)  # log forget gates
    i = torch.where(live, i, -torch.inf).view(B, H, N, C)
    q, k, v = (t.reshape(B, H, N, C, -1) for t in (q, k, v))
    seg = segments.reshape(B, 1, N, C)
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    same = (seg[..., :, None] == seg[..., None, :]) & lower  # (B, 1, N, t, s): s <= t, one doc
    # log forget from the chunk's start (or the segment's) through each token, per segment
    cum = (log_f[..., None, :] * same).sum(-1)  # (B, H, N, C)
    # token s's input as token t reads it: decayed by the forget gates after s
    log_d = (cum[..., :, None] - cum[..., None, :] + i[..., None, :]).masked_fill(
        ~same, -torch.inf
    )  # (B, H, N, t, s)
    if layout is None:  # tokens of the segment that continues the previous chunk's last one
        before = torch.cat([seg.new_full((B, 1, 1, 1), -1), seg[..., :-1, -1:]], dim=2)
        open_ = seg == before  # (B, 1, N, C)
    else:  # one segment per chunk: it enters with a state where it has a source
        open_ = layout.entered[:, None, :, None].expand(B, 1, N, C)

    # what each chunk adds to the state its last token's segment hands on, stabilised by its
    # own largest weight (-inf where it adds nothing: a chunk of filling)
    tail = seg == seg[..., -1:]
    w = (cum[..., -1:] - cum + i).masked_fill(~tail, -torch.inf)  # (B, H, N, C)
    top = w.max(-1).values  # (B, H, N)
    safe = torch.where(top > -torch.inf, top, 0.0)
    k_added = k * (w - safe[..., None]).exp()[..., None]
    added_C = k_added.transpose(-1, -2) @ v  # (B, H, N, Dk, Dv)
    added_n = k_added.sum(-2)  # (B, H, N, Dk)
    through = open_[..., -1]  # (B, 1, N): the last segment continues the entering state
    entering = _scan_chunks(cum[..., -1], top, added_C, added_n, through, layout)
    C_in, n_in, m_in = (torch.stack(t, dim=2) for t in entering)  # (B, H, N, ...)

    # each token: the state entering its chunk (its segment's, else zeros and m = 0) and the
    # inputs of its segment inside the chunk, under the stabiliser it has alone
    base = cum + torch.where(open_, m_in[..., None], 0.0)  # (B, H, N, C)
    m = torch.maximum(base, log_d.max(-1).values)
    inter = (base - m).exp() * open_
    scale = Dk**-0.5
    scores = (q @ k.transpose(-1, -2)) * scale * (log_d - m[..., None]).exp()  # (B, H, N, t, s)
    q_in = q * (scale * inter)[..., None]
    num = q_in @ C_in + scores @ v  # (B, H, N, C, Dv)
    den = q_in @ n_in[..., None] + scores.sum(-1, keepdim=True)  # (B, H, N, C, 1)
    h = num / (torch.maximum(den.abs(), (-m).exp()[..., None]) + eps)
    return h.reshape(B, H, N * C, -1)[:, :, :S].transpose(1, 2)


def _scan_chunks(
    total: Tensor,
    top: Tensor,
    added_C: Tensor,
    added_n: Tensor,
    through: Tensor,
    layout: ChunkLayout | None,
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """The (C, n, m) state entering each chunk: a chunk's end state is its entering state
    decayed through it (``total`` (B, H, N), its last segment's log forget; only where
    ``through`` (B, 1, N): that segment continues the entering state, else a zero state with
    m = 0) plus what it adds (``added_C`` (B, H, N, Dk, Dv), ``added_n`` (B, H, N, Dk), scaled
    by exp(``top`` (B, H, N))), under the larger of the two stabilisers. A tree ``layout``:
    each chunk enters with the end state its sources name (:func:`fork`)."""
    B, H, _, Dk, Dv = added_C.shape
    zero = (added_C.new_zeros(B, H, Dk, Dv), added_n.new_zeros(B, H, Dk), top.new_zeros(B, H))
    state = zero
    entering: tuple[list[Tensor], list[Tensor], list[Tensor]] = ([], [], [])
    ends: tuple[list[Tensor], list[Tensor], list[Tensor]] = ([], [], [])
    # the chunks taken apart once (indexing one in the loop would build a zero gradient of the
    # whole tensor per chunk)
    for n, (g, a, c, v, keep) in enumerate(zip(
        total.unbind(2), top.unbind(2), added_C.unbind(2), added_n.unbind(2), through.unbind(2),
        strict=True,
    )):  # fmt: skip
        forked = None if layout is None else fork(ends[0], layout.sources, n, zero[0])
        if forked is not None:  # a tree's chunk: the end states its sources name
            state = (forked, fork(ends[1], layout.sources, n, zero[1]),
                     fork(ends[2], layout.sources, n, zero[2]))  # fmt: skip
        C_in, n_in, m_in = state
        for held, t in zip(entering, state, strict=True):
            held.append(t)
        m_in = torch.where(keep, m_in, 0.0)
        m_end = torch.maximum(g + m_in, a)
        kept = (g + m_in - m_end).exp() * keep  # (B, H)
        new = (a - m_end).exp()
        state = (
            kept[..., None, None] * C_in + new[..., None, None] * c,
            kept[..., None] * n_in + new[..., None] * v,
            m_end,
        )
        for held, t in zip(ends, state, strict=True):
            held.append(t)
    return entering


def _soft_cap(values: Tensor, cap: float | None) -> Tensor:
    return values if cap is None else cap * torch.tanh(values / cap)  # as transformers'


def _mlstm_layer(module: torch.nn.Module) -> bool:
    return isinstance(getattr(module, "mlstm_backend", None), torch.nn.Module)


_PROJECTIONS = {
    "single": ("q", "k", "v", "ogate_preact", "igate_preact", "fgate_preact"),
    "fused": ("qkv_opreact", "ifgate_preact"),
}


def _fits(module: torch.nn.Module, x: Tensor) -> bool:
    """transformers' ``xLSTMLayer`` structure: q, k, v, output and input / forget gate
    projections (``single``) or two fused ones (``fused``), ``num_heads`` heads, a
    ``multihead_norm``, an ``ogate_act_fn`` and ``out_proj``, on floating rows of its width."""
    config = getattr(module, "config", None)
    mode = getattr(config, "weight_mode", None)
    heads = getattr(config, "num_heads", None)
    if not (_mlstm_layer(module) and mode in _PROJECTIONS and isinstance(heads, int) and heads > 0):
        return False
    projections = [getattr(module, n, None) for n in _PROJECTIONS[mode]]
    qk, v = getattr(module, "qk_dim", None), getattr(module, "v_dim", None)
    return (
        x.is_floating_point()
        and all(isinstance(p, torch.nn.Linear) for p in projections)
        and projections[0].in_features == x.shape[-1]
        and isinstance(qk, int)
        and isinstance(v, int)
        and qk % heads == 0
        and v % heads == 0
        and isinstance(getattr(config, "eps", None), float)
        and all(isinstance(getattr(module, n, None), torch.nn.Module)
                for n in ("multihead_norm", "out_proj", "ogate_act_fn"))
    )  # fmt: skip


def mlstm_one_pass(module: torch.nn.Module, x: Tensor, plan: DocumentPlan | TreePlan) -> Tensor:
    """An mLSTM layer's forward over packed rows, documents kept apart, in one pass.

    As transformers 5.25's ``xLSTMLayer.forward`` without a state: the q, k, v and output gate
    projections, the input and forget gate pre-activations soft-capped at
    ``config.gate_soft_cap`` -> the mLSTM cell per head by :func:`segment_mlstm` (each document
    from a zero state; on prefix trees :func:`tree_mlstm`, each branch from its parent's end
    state) -> ``multihead_norm`` -> ``ogate_act_fn(o) * h`` -> ``out_proj``; padding tokens give
    zeros.

    Args:
        module: an mLSTM layer (:func:`_fits` accepts its structure).
        x: (B, S, H) hidden states of packed rows.
        plan: the rows' documents (or trees).

    Returns:
        (B, S, H) in the dtype ``module``'s own forward returns (autocast included).
    """
    config = module.config
    B, S, _ = x.shape
    heads, cap = config.num_heads, config.gate_soft_cap
    if config.weight_mode == "single":
        q, k, v = module.q(x), module.k(x), module.v(x)
        o = module.ogate_preact(x)
        i = _soft_cap(module.igate_preact(x), cap)
        f = _soft_cap(module.fgate_preact(x), cap)
    else:
        qk = module.qk_dim
        q, k, v, o = torch.tensor_split(
            module.qkv_opreact(x), (qk, 2 * qk, 2 * qk + module.v_dim), dim=-1
        )
        i, f = torch.tensor_split(_soft_cap(module.ifgate_preact(x), cap), (heads,), dim=-1)
    q, k, v = (t.reshape(B, S, heads, -1) for t in (q, k, v))
    h = plan.scan(segment_mlstm, q, k, v, i, f, eps=config.eps)  # (B, S, heads, Dv)
    h = module.multihead_norm(h).reshape(B, S, -1)
    out = module.out_proj(module.ogate_act_fn(o) * h)
    return out * plan.real[..., None].to(out.dtype)


def empty_state(module: torch.nn.Module, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The state an mLSTM layer returns for packed rows: zeros of the shapes of transformers'
    ``xLSTMCache`` entries, C (B, heads, Dk, Dv), n (B, heads, Dk), m (B, heads, 1), in ``x``'s
    dtype and device. A packed row holds several documents, so no one end state continues it;
    the model copies what the layer returns into its cache when it made one (``use_cache`` left
    at its default), and a None there is transformers' ``TypeError``."""
    config = module.config
    heads, B = config.num_heads, x.shape[0]
    # the cache's widths, from the config (rounded up to 64 there, where the layer's are not)
    dk = getattr(config, "qk_head_dim", module.qk_dim // heads)
    dv = getattr(config, "v_head_dim", module.v_dim // heads)
    return (
        x.new_zeros(B, heads, dk, dv),
        x.new_zeros(B, heads, dk),
        x.new_zeros(B, heads, 1),
    )


class _WithEmptyState:
    """The room's one pass: :func:`_one_pass.hook`'s (whose ``verified`` and ``fn`` it shows,
    for the tests that count or stop it), its output paired with :func:`empty_state`. On
    document rows of a class the one pass does not take, the layer's own forward per group of
    documents, paired the same way (flexpack.mixers' own per-group calls return None for the
    state); on tree rows None (the layer cannot branch: flexpack.mixers refuses)."""

    def __init__(self, hooked: Callable[..., Tensor | None]) -> None:
        self.hooked = hooked

    @property
    def verified(self) -> dict[type, bool]:
        return self.hooked.verified  # type: ignore[attr-defined]

    @property
    def fn(self) -> Callable[..., Tensor]:
        return self.hooked.fn  # type: ignore[attr-defined]

    @fn.setter
    def fn(self, fn: Callable[..., Tensor]) -> None:
        self.hooked.fn = fn  # type: ignore[attr-defined]

    def __call__(self, module, own, x: Tensor, plan, kwargs: dict[str, Any]):
        out = self.hooked(module, own, x, plan, kwargs)
        if out is None:
            if not isinstance(plan, DocumentPlan) or not _mlstm_layer(module) or x.dim() != 3:
                return None
            if any(kwargs.get(k) is not None for k in kwargs if k != "state"):
                return None  # a keyword the per-group calls below would not pass on
            out = _one_pass.per_group(own, x, plan)
        return out, empty_state(module, x)


MLSTM = Room(
    "mlstm",
    matches=_mlstm_layer,
    recognised_by="its `mlstm_backend` (the mLSTM cell of transformers' xLSTM layer)",
    how="the matrix memory, normaliser and stabiliser restart per document: one pass over the "
    "rows (torch, transformers' xLSTM structure), else documents run apart (no kernel mapping)",
    # its cache is the `state` argument: a call with one runs the layer's own forward; packed
    # rows (the state dropped) return an empty state, which the model copies into its cache
    one_pass=_WithEmptyState(
        _one_pass.hook(
            mlstm_one_pass,
            _fits,
            probe=lambda _: PROBE,
            changes=(*_one_pass.CHANGES_THE_PASS, "state"),
        )
    ),
)

ROOMS = (MLSTM,)
