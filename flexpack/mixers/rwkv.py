"""RWKV (transformers' RWKV-4, ``rwkv``): a token shift and the WKV recurrence that restart per
document.

RWKV has no attention. Each block's time mix (``RwkvSelfAttention``) mixes every token with the
previous one (the token shift), projects key, value and receptance from the mix and runs the WKV
recurrence over the row; its channel mix (``RwkvFeedForward``) shifts tokens the same way before
its squared-ReLU MLP. Per channel, with w = -exp(``time_decay``) and u = ``time_first``:

    wkv_t = (sum over s < t of e^{(t - 1 - s) w + k_s} v_s + e^{u + k_t} v_t)
            / (sum over s < t of e^{(t - 1 - s) w + k_s}     + e^{u + k_t})

carried token by token as (num, den, max), the sums scaled by e^{-max} so nothing overflows.
Over a packed row both run across documents: the shift hands a document's first token the last
token of the one before, and the sums reach back into it. flexpack runs each module once over
the whole packed rows, from its own submodules and parameters: the shift reads the previous
token only inside a document (zeros at its start, as the document alone gets), and the WKV
state restarts empty at each document start (:func:`wkv_scan`: chunked, about 2 sqrt(S) Python
steps instead of S, exact up to rounding, gradients included). On prefix-tree rows the shift of
a branch's first token reads its parent's last token and each branch starts from the WKV state
at the end of its parent segment. A class whose structure or behaviour differs runs once per
group of right-padded documents. The kinds are recognised by their parameters (``time_decay``,
``time_first``, ``time_mix_*``), not by their class names.

Shapes: B rows of S tokens, H hidden features, A attention channels (``attention_hidden_size``),
chunks of q tokens (c of them per row, the row padded to a multiple of q).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flexpack.mixers import _one_pass
from flexpack.mixers._plan import DocumentPlan
from flexpack.mixers._room import Room
from flexpack.mixers._tree import ChunkLayout, TreePlan, fork
from flexpack.mixers.ssm import _selective_chunk, segment_starts

__all__ = ["channel_mix_one_pass", "time_mix_one_pass", "wkv_scan"]

# keywords of the modules' forwards that would change what a one pass computes: a cache (RWKV's
# is `state`, the per-layer shift, num, den and max), besides the other rooms' names for one
_CHANGES = (*_one_pass.CHANGES_THE_PASS, "state")
# the empty WKV state's max (the module's own: finite, so that empty - empty is never nan)
_EMPTY_MAX = -1e38

State = tuple[Tensor, Tensor, Tensor]  # num, den, max: the sums are num e^max and den e^max


def _linear(module: torch.nn.Module, name: str, into: int | None = None) -> torch.nn.Linear | None:
    layer = getattr(module, name, None)
    if not isinstance(layer, torch.nn.Linear) or (into is not None and layer.in_features != into):
        return None
    return layer


def _mix_weights(module: torch.nn.Module, *names: str) -> int | None:
    """The hidden width H when ``module`` has every ``time_mix_<name>`` parameter, (1, 1, H)."""
    found = [module._parameters.get(f"time_mix_{n}") for n in names]
    if not all(isinstance(p, torch.nn.Parameter) and p.dim() == 3 for p in found):
        return None
    widths = {p.shape[-1] for p in found}
    return widths.pop() if len(widths) == 1 and found[0].shape[:2] == (1, 1) else None


def _time_mix(module: torch.nn.Module) -> bool:
    """A WKV time mix: per-channel ``time_decay`` and ``time_first`` beside token-shift mixes."""
    return (
        all(isinstance(module._parameters.get(n), torch.nn.Parameter)
            for n in ("time_decay", "time_first"))
        and _mix_weights(module, "key", "value", "receptance") is not None
    )  # fmt: skip


def _channel_mix(module: torch.nn.Module) -> bool:
    """An RWKV channel mix: token-shift mixes of key and receptance, no recurrence."""
    return (
        "time_decay" not in module._parameters
        and "time_mix_value" not in module._parameters
        and _mix_weights(module, "key", "receptance") is not None
    )


def _time_mix_fits(module: torch.nn.Module, x: Tensor) -> bool:
    """transformers 5.25's ``RwkvSelfAttention`` structure: ``key``, ``value``,
    ``receptance`` (H -> A, no bias) and ``output`` (A -> H), ``time_decay`` and
    ``time_first`` of A channels, on floating rows of width H."""
    hidden = _mix_weights(module, "key", "value", "receptance")
    if hidden is None or not x.is_floating_point() or x.shape[-1] != hidden:
        return False
    parts = [_linear(module, n, hidden) for n in ("key", "value", "receptance")]
    out = _linear(module, "output")
    if out is None or any(p is None for p in parts):
        return False
    channels = parts[0].out_features
    return (
        all(p.out_features == channels for p in parts)
        and out.in_features == channels
        and out.out_features == hidden
        and module.time_decay.shape == (channels,)
        and module.time_first.shape == (channels,)
    )


def _channel_mix_fits(module: torch.nn.Module, x: Tensor) -> bool:
    """transformers' ``RwkvFeedForward`` structure: ``key`` (H -> I), ``value`` (I -> H),
    ``receptance`` (H -> H), on floating rows of width H."""
    hidden = _mix_weights(module, "key", "receptance")
    if hidden is None or not x.is_floating_point() or x.shape[-1] != hidden:
        return False
    key, receptance = _linear(module, "key", hidden), _linear(module, "receptance", hidden)
    value = _linear(module, "value", None if key is None else key.out_features)
    return (
        key is not None
        and receptance is not None
        and value is not None
        and receptance.out_features == hidden
        and value.out_features == hidden
    )


def _previous(x: Tensor, plan: DocumentPlan | TreePlan) -> Tensor:
    """(B, S, H) -> (B, S, H): each token's predecessor in its document (on tree rows: on its
    root-to-leaf path), zeros at a document's first token and on padding (the module's
    ``time_shift`` pads a row with zeros on the left)."""
    back = plan.shift(x.transpose(1, 2), 1) * plan.taps(2)[1, :, None].to(x.dtype)  # (B, H, S)
    return back.transpose(1, 2)


def _merge(a: State, b: State) -> State:
    """The state holding both states' sums. Its max is a constant (detached): the sums are
    what carries the values and their gradients, the max only keeps e^(...) finite."""
    top = torch.maximum(a[2], b[2]).detach()
    ea, eb = torch.exp(a[2] - top), torch.exp(b[2] - top)
    return a[0] * ea + b[0] * eb, a[1] * ea + b[1] * eb, top


def _where(keep: Tensor, a: State, b: State) -> State:
    return tuple(torch.where(keep, p, q) for p, q in zip(a, b, strict=True))  # type: ignore[return-value]


def wkv_scan(k: Tensor, v: Tensor, w: Tensor, u: Tensor, start: Tensor, chunk: int,
             layout: ChunkLayout | None = None, live: Tensor | None = None) -> Tensor:  # fmt: skip
    """The WKV recurrence of ``rwkv_linear_attention_cpu`` over packed rows, the state
    restarting empty wherever ``start``.

    Chunked, and exact, rather than token by token: every chunk is scanned from an empty state
    at once (q steps over (B, c, A) slices), the state entering each chunk is carried across the
    chunks (c steps over (B, A)) and merged into each token's state, decayed to it, where no
    document started in the chunk before the token.

    Args:
        k, v: (B, S, A) keys and values in the working dtype.
        w: (A,) log decays (-exp(time_decay)), u: (A,) the current token's bonus (time_first).
        start: (B, S) bool, True where a document (or a padding run) starts.
        chunk: tokens per chunk, q.
        layout: tree rows (``TreePlan.chunked``): each chunk enters with the end state of the
            chunk its sources name (``start`` is then all False).
        live: (B, S) bool, False on a tree layout's filling (tokens that neither decay the
            state nor add to it); None: every token.

    Returns:
        (B, S, A) in the working dtype.
    """
    batch, S, A = k.shape
    live = torch.ones_like(start) if live is None else live
    pad = (-S) % chunk
    if pad:  # tokens past the row's end: a run of their own
        k, v = (F.pad(t, (0, 0, 0, pad)) for t in (k, v))
        start = F.pad(start, (0, pad), value=True)
        live = F.pad(live, (0, pad), value=True)
    c, q = (S + pad) // chunk, chunk
    k, v = (t.reshape(batch, c, q, A) for t in (k, v))
    start, live = (t.reshape(batch, c, q, 1) for t in (start, live))
    empty_at = torch.zeros_like(k[:, :, 0])  # (B, c, A)
    empty: State = (empty_at, empty_at, empty_at + _EMPTY_MAX)

    # 1. each chunk from an empty state, all chunks at once: the state before each token (its
    # document's earlier tokens in the chunk) and after the chunk's last one
    keys, values, starts, lives = k.unbind(2), v.unbind(2), start.unbind(2), live.unbind(2)
    state, before = empty, []
    for j in range(q):
        state = _where(starts[j], empty, state)
        before.append(state)
        moved = _merge((state[0], state[1], state[2] + w), (values[j], torch.ones_like(values[j]),
                                                            keys[j]))  # fmt: skip
        state = _where(lives[j], moved, state)
    opened = ~start.cumsum(2).bool()  # (B, c, q, 1): no start in the chunk up to the token
    steps = live.cumsum(2) - live.to(torch.int64)  # live tokens before each token in its chunk

    # 2. the state entering each chunk, carried chunk to chunk (forked on trees), (B, 3, A)
    ends = torch.stack(state, 2).unbind(1)  # each chunk's own sums, c of (B, 3, A)
    total = steps[:, :, -1] + live[:, :, -1]  # (B, c, 1): live tokens per chunk
    zero = torch.stack(empty, 1)[:, :, 0]  # (B, 3, A)
    entering, finals = [zero], []
    for n in range(1, c):
        num, den, top = entering[-1].unbind(1)
        carried = _where(opened[:, n - 1, -1], (num, den, top + total[:, n - 1] * w),
                         zero.unbind(1))  # fmt: skip
        finals.append(torch.stack(_merge(carried, ends[n - 1].unbind(1)), 1))
        forked = None if layout is None else fork(finals, layout.sources, n, zero)
        entering.append(finals[-1] if forked is None else forked)

    # 3. each token: the state entering its chunk decayed to it, its chunk's own sums before
    # it, and its own key with the bonus u
    num, den, top = torch.stack(entering, 1)[:, :, None].unbind(3)  # (B, c, 1, A) each
    into = _where(opened, (num, den, top + steps * w), (empty_at[:, :, None],) * 2
                  + (torch.full_like(num, _EMPTY_MAX),))  # fmt: skip
    own = tuple(torch.stack(t, 2) for t in zip(*before, strict=True))  # (B, c, q, A) each
    num, den, _ = _merge(_merge(into, own), (v, torch.ones_like(v), k + u))
    return (num / den).reshape(batch, c * q, A)[:, :S]


def time_mix_one_pass(
    module: torch.nn.Module, x: Tensor, plan: DocumentPlan | TreePlan, *, chunk: int | None = None
) -> Tensor:
    """An RWKV time mix's forward over packed rows, documents kept apart, in one pass.

    As transformers 5.25's ``RwkvSelfAttention.forward`` without a state: the token
    shift (the previous token inside the document, zeros at its start) mixed with each token
    by ``time_mix_key`` / ``_value`` / ``_receptance`` -> ``key``, ``value``,
    sigmoid(``receptance``) -> the WKV recurrence (:func:`wkv_scan`, its state empty at each
    document start) -> ``output`` of receptance * wkv; padding gives zeros.

    The recurrence runs in float32 for float32 and narrower rows, as the module's own does, and
    in float64 for float64 rows (the module's own rounds the keys of those to float32); its
    output is in the keys' dtype, as the module's.

    Args:
        module: a time mix (:func:`_time_mix_fits` accepts its structure).
        x: (B, S, H) hidden states of packed rows.
        plan: the rows' documents (or trees).
        chunk: tokens per chunk of the recurrence (default: ceil(sqrt(S))); any gives the same
            numbers up to rounding.

    Returns:
        (B, S, H) in the dtype ``module``'s own forward returns.

    Example:
        >>> import torch, transformers
        >>> _ = torch.manual_seed(0)
        >>> from flexpack.mixers._plan import DocumentPlan
        >>> from flexpack.mixers.rwkv import time_mix_one_pass
        >>> config = transformers.RwkvConfig(hidden_size=16, attention_hidden_size=16,
        ...     intermediate_size=32, num_hidden_layers=2)
        >>> mix = transformers.RwkvForCausalLM(config).rwkv.blocks[0].attention
        >>> plan = DocumentPlan.from_doc_ids(torch.tensor([[0, 0, 0, 1, 1, -1]]))
        >>> x = torch.randn(1, 6, 16)
        >>> out = time_mix_one_pass(mix, x, plan)
        >>> alone = mix(x[:, 3:5])[0]
        >>> torch.allclose(out[:, 3:5], alone, atol=1e-5), out[0, 5].abs().max().item()
        (True, 0.0)
    """
    shifted = _previous(x, plan)
    key = x * module.time_mix_key + shifted * (1 - module.time_mix_key)
    value = x * module.time_mix_value + shifted * (1 - module.time_mix_value)
    receptance = x * module.time_mix_receptance + shifted * (1 - module.time_mix_receptance)
    k, v = module.key(key), module.value(value)  # (B, S, A)
    r = torch.sigmoid(module.receptance(receptance))

    work = torch.promote_types(k.dtype, torch.float32)
    w = -torch.exp(module.time_decay).to(work)  # (A,), in the parameter's dtype as the module's
    u = module.time_first.to(work)
    q = chunk or _selective_chunk(x.shape[1])

    def scan(k: Tensor, v: Tensor, segment: Tensor) -> Tensor:
        return wkv_scan(k, v, w, u, segment_starts(segment), q)

    def tree(k: Tensor, v: Tensor, plan: TreePlan) -> Tensor:
        def forked(k: Tensor, v: Tensor, live: Tensor, layout: ChunkLayout) -> Tensor:
            return wkv_scan(k, v, w, u, torch.zeros_like(live), q, layout, live)

        live = torch.ones(k.shape[:2], dtype=torch.bool, device=k.device)
        return plan.chunked(forked, q, k, v, live)

    scan.tree = tree  # type: ignore[attr-defined]
    wkv = plan.scan(scan, k.to(work), v.to(work)).to(k.dtype)
    out = module.output(r * wkv)  # (B, S, H)
    return out * plan.real[..., None].to(out.dtype)


def channel_mix_one_pass(
    module: torch.nn.Module, x: Tensor, plan: DocumentPlan | TreePlan
) -> Tensor:
    """An RWKV channel mix's forward over packed rows, documents kept apart, in one pass.

    As transformers' ``RwkvFeedForward.forward`` without a state: the token shift (the previous
    token inside the document, zeros at its start) mixed with each token by ``time_mix_key`` /
    ``_receptance`` -> relu(``key``)^2 -> ``value``, gated by sigmoid(``receptance``); padding
    gives zeros.

    Args:
        module: a channel mix (:func:`_channel_mix_fits` accepts its structure).
        x: (B, S, H) hidden states of packed rows.
        plan: the rows' documents (or trees).

    Returns:
        (B, S, H) in the dtype ``module``'s own forward returns.
    """
    shifted = _previous(x, plan)
    key = x * module.time_mix_key + shifted * (1 - module.time_mix_key)
    receptance = x * module.time_mix_receptance + shifted * (1 - module.time_mix_receptance)
    value = module.value(torch.square(torch.relu(module.key(key))))
    out = torch.sigmoid(module.receptance(receptance)) * value  # (B, S, H)
    return out * plan.real[..., None].to(out.dtype)


WKV = Room(
    "wkv",
    matches=_time_mix,
    recognised_by="its per-channel `time_decay` and `time_first` beside token-shift mixes",
    how="the token shift and the WKV state restart per document: one pass over the rows "
    "(torch), else documents run apart",
    one_pass=_one_pass.hook(time_mix_one_pass, _time_mix_fits, changes=_CHANGES, outputs=2),
)

TOKEN_SHIFT = Room(
    "token_shift",
    matches=_channel_mix,
    recognised_by="its token-shift mixes (`time_mix_key`, `time_mix_receptance`) without a "
    "recurrence",
    how="the previous token is read only inside a document: one pass over the rows (torch), "
    "else documents run apart",
    one_pass=_one_pass.hook(channel_mix_one_pass, _channel_mix_fits, changes=_CHANGES, outputs=2),
)

ROOMS = (WKV, TOKEN_SHIFT)
