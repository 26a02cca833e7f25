"""Log-probs and losses of prefix-tree batches: per-rollout log-probs from a model's last hidden
states through a chunked LM head (:func:`rollout_logps`, :class:`RolloutLogps`), and the losses
on them (:func:`sequence_logps`, :func:`grpo_loss`).

The public names are those of :mod:`flexpack.trees`. This module imports the building side
(``flexpack/trees/_build.py``), never the reverse.

Shape legend:
    R: packed rows; S = max_len tokens per row; H hidden size; V vocabulary.
    N: rollouts (root-to-leaf paths); L: most targets of a rollout; T: all targets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from flexpack.trees._build import TreeBatch

# ----------------------------------------------------------------------------- losses


def sequence_logps(logps: Tensor, valid: Tensor, *, reduction: str = "sum") -> Tensor:
    """Per-rollout log-prob of its tokens: the DPO / reward-model input, from ``gather_logps``.

    Unpacked equivalent, for rollout n with completion tokens ``y`` after prompt ``x``:
    ``sum_t log p(y_t | x, y_<t)`` ("sum") or that divided by ``len(y)`` ("mean").

    Args:
        logps: (N, L) float, from :meth:`TreeBatch.gather_logps`.
        valid: (N, L) bool, from the same call.
        reduction: "sum" or "mean" (0 for a rollout without targets).

    Returns:
        (N,) tensor in logps' dtype.

    Example:
        >>> sequence_logps(torch.tensor([[-1.0, -2.0], [-3.0, 0.0]]),
        ...                torch.tensor([[True, True], [True, False]]), reduction="mean")
        tensor([-1.5000, -3.0000])
    """
    _check_pair(logps, valid)
    total = torch.where(valid, logps, 0.0).sum(-1)
    if reduction == "sum":
        return total
    if reduction == "mean":
        return total / valid.sum(-1).clamp(min=1)
    raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}.")


def grpo_loss(
    logps: Tensor,
    valid: Tensor,
    advantages: Tensor,
    *,
    old_logps: Tensor | None = None,
    epsilon: float = 0.2,
    reduction: str = "token_mean",
) -> Tensor:
    """The clipped GRPO / PPO policy loss over rollouts, from ``gather_logps``.

    Per token: ``ratio = exp(logp - old_logp)`` and
    ``loss_t = -min(ratio * A_n, clip(ratio, 1 - epsilon, 1 + epsilon) * A_n)``, where ``A_n``
    is the advantage of the token's rollout. ``old_logps=None`` is the on-policy step
    (``old_logp = logp.detach()``: ratio 1, gradient ``-A_n * grad logp``).

    Unpacked equivalent, rollouts run one per sequence with the same per-token terms:
    "token_mean" is ``sum_n sum_t loss_{n,t} / sum_n len_n`` (every token weighs the same, as
    DAPO and TRL's default); "sequence_mean" is ``mean_n (sum_t loss_{n,t} / len_n)``, the
    original GRPO normalization. Rollouts without targets count for nothing.

    Args:
        logps: (N, L) float, from :meth:`TreeBatch.gather_logps`.
        valid: (N, L) bool, from the same call.
        advantages: (N,) float, one per rollout (e.g. rewards normalized within each group of
            ``batch.rollout_groups``).
        old_logps: (N, L) log-probs of the sampling policy, or None.
        epsilon: clipping range.
        reduction: "token_mean" or "sequence_mean".

    Returns:
        A scalar tensor.

    Example:
        >>> logps = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
        >>> valid = torch.tensor([[True, True], [True, False]])
        >>> loss = grpo_loss(logps, valid, torch.tensor([1.0, -1.0]))
        >>> loss.backward(); logps.grad  # -A_n / (3 tokens) on every valid token
        tensor([[-0.3333, -0.3333],
                [ 0.3333,  0.0000]])
    """
    _check_pair(logps, valid)
    if not isinstance(advantages, Tensor) or tuple(advantages.shape) != (logps.shape[0],):
        got = tuple(advantages.shape) if isinstance(advantages, Tensor) else type(advantages)
        raise ValueError(
            f"advantages must be a ({logps.shape[0]},) tensor, one per rollout, got {got}."
        )
    old = logps.detach() if old_logps is None else old_logps
    if tuple(old.shape) != tuple(logps.shape):
        raise ValueError(
            f"old_logps must have the shape of logps {tuple(logps.shape)}, got {tuple(old.shape)}."
        )
    ratio = torch.exp(torch.where(valid, logps - old, 0.0))
    adv = advantages.to(logps.dtype)[:, None]
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - epsilon, 1 + epsilon) * adv)
    per_token = torch.where(valid, per_token, 0.0)
    if reduction == "token_mean":
        return per_token.sum() / valid.sum().clamp(min=1)
    if reduction == "sequence_mean":
        n = valid.sum(-1)
        has = n > 0
        per_rollout = per_token.sum(-1) / n.clamp(min=1)
        return per_rollout[has].sum() / has.sum().clamp(min=1)
    raise ValueError(f"reduction must be 'token_mean' or 'sequence_mean', got {reduction!r}.")


def _check_pair(logps: Tensor, valid: Tensor) -> None:
    if not isinstance(logps, Tensor) or not isinstance(valid, Tensor):
        raise TypeError("logps and valid must be the tensors TreeBatch.gather_logps returns.")
    if logps.shape != valid.shape or valid.dtype != torch.bool:
        raise ValueError(
            f"logps and valid must have one shape (N, L) and valid be bool, got "
            f"{tuple(logps.shape)} and {tuple(valid.shape)} {valid.dtype}; pass both results of "
            f"TreeBatch.gather_logps."
        )


# ----------------------------------------------------------------------------- rollout log-probs


@dataclass(frozen=True, eq=False)
class RolloutLogps:
    """Per-rollout results of :func:`rollout_logps`, each (N, L) float32, 0 past a rollout's end.

    Attributes:
        logps: log p(target) of every rollout token.
        valid: (N, L) bool, True on the ``rollout_lengths[n]`` first entries of row n.
        entropies: entropy of the predicting distribution, or None when not asked.
        mean_logits: mean (transformed) logit over the vocabulary, or None when not asked.
        is_top1: (N, L) bool, the target is the argmax (the first maximum), or None.
        aux_loss: () the MoE router's load-balancing loss over the trees' tokens, each weighed
            by the rollouts that hold it (``TreeBatch.token_counts``), as over the padded rows;
            None when not asked (``flexpack.integrations.trl.tree_logps(router_aux_loss=True)``).
    """

    logps: Tensor
    valid: Tensor
    entropies: Tensor | None = None
    mean_logits: Tensor | None = None
    is_top1: Tensor | None = None
    aux_loss: Tensor | None = None


def _logits(h: Tensor, weight: Tensor, bias: Tensor | None, tf: tuple) -> tuple[Tensor, Tensor]:
    """(z, dz/dy) of one chunk: y = h @ W.T + b in the compute dtype, z its float32 transform."""
    logit_scale, softcap, inv_t, compute_dtype = tf
    with torch.autocast(h.device.type, enabled=False):
        b = None if bias is None else bias.to(compute_dtype)
        y = torch.nn.functional.linear(h.to(compute_dtype), weight.to(compute_dtype), b)
    u = y.to(torch.promote_types(y.dtype, torch.float32)) * logit_scale  # (n, V) per chunk
    if softcap is None:
        return u * inv_t, None
    t = torch.tanh(u / softcap)
    return softcap * t * inv_t, (1 - t * t) * (logit_scale * inv_t)


class _ChunkedHead(torch.autograd.Function):
    """log p(target) and entropy of ``transform(h @ W.T + b)`` per row, ``chunk`` rows at a
    time; backward recomputes each chunk's logits, so only (chunk, V) tensors ever exist."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, tf, chunk, extra):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        T = hidden.shape[0]
        acc = torch.promote_types(tf[3], torch.float32)  # float32 (float64 for float64)
        lp = hidden.new_zeros(T, dtype=acc)
        ent, mean, top1 = torch.zeros_like(lp), torch.zeros_like(lp), torch.zeros_like(lp)
        for a in range(0, T, chunk):
            z, _ = _logits(hidden[a : a + chunk], weight, bias, tf)
            tok = tokens[a : a + chunk]
            log_z = torch.logsumexp(z, dim=-1)
            target = z.gather(-1, tok[:, None])[:, 0]
            lp[a : a + chunk] = target - log_z
            want_entropy, want_mean, want_top1 = extra  # (zeros where not asked for)
            if want_entropy:
                ent[a : a + chunk] = log_z - (torch.softmax(z, dim=-1) * z).sum(-1)
            if want_mean:
                mean[a : a + chunk] = z.mean(-1)
            if want_top1:
                top1[a : a + chunk] = (z.argmax(-1) == tok).to(acc)
        ctx.save_for_backward(hidden, weight, bias, tokens)
        ctx.tf, ctx.chunk = tf, chunk
        ctx.mark_non_differentiable(mean, top1)
        return lp, ent, mean, top1

    @staticmethod
    def backward(ctx, g_lp, g_ent, _g_mean, _g_top1):  # type: ignore[override]
        hidden, weight, bias, tokens = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc = torch.promote_types(ctx.tf[3], torch.float32)  # gradients accumulate in float32
        gh = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
        gw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        gb = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        T, chunk = hidden.shape[0], ctx.chunk
        for a in range(0, T, chunk):
            h = hidden[a : a + chunk]
            z, dz = _logits(h, weight, bias, ctx.tf)
            p = torch.softmax(z, dim=-1)
            g = torch.zeros_like(z)
            if g_lp is not None:  # d log p_t / dz = onehot(t) - p
                gl = g_lp[a : a + chunk, None].to(acc)
                g = g - gl * p
                g.scatter_add_(-1, tokens[a : a + chunk, None], gl)
            if g_ent is not None:  # dH / dz = -p * (z - E_p[z])
                ez = (p * z).sum(-1, keepdim=True)
                g = g - g_ent[a : a + chunk, None].to(acc) * p * (z - ez)
            if dz is not None:
                g = g * dz
            else:
                g = g * (ctx.tf[0] * ctx.tf[2])
            if gh is not None:
                gh[a : a + chunk] = g @ weight.to(acc)
            if gw is not None:
                gw += g.t() @ h.to(acc)
            if gb is not None:
                gb += g.sum(0)
        return (
            None if gh is None else gh.to(hidden.dtype),
            None if gw is None else gw.to(weight.dtype),
            None if gb is None else gb.to(bias.dtype),
            None,
            None,
            None,
            None,
        )


def rollout_logps(
    batch: TreeBatch,
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    entropy: bool = False,
    mean_logits: bool = False,
    is_top1: bool = False,
    chunk_size: int = 1024,
) -> RolloutLogps:
    """Per-rollout log-probs (and entropies) from a model's last hidden states, in chunks.

    The LM head runs on the hidden states of the predicting positions only (one per target, the
    last prompt token once per completion), ``chunk_size`` of them at a time, and backward
    recomputes each chunk: no (R, S, V) nor (T, V) logits tensor exists, only (chunk_size, V)
    ones (the gradient reaches ``hidden``, ``weight`` and ``bias``). Logits are transformed as
    TRL's fused LM head does, ``z = softcap * tanh(logit_scale * (h @ W.T + b) / softcap) /
    temperature``, in float32 after a projection in the autocast dtype (or the hidden states'
    dtype; float64 stays float64).

    Args:
        batch: the :class:`TreeBatch` the model ran on.
        hidden: (R, S, H) float last hidden states of the model on ``batch.input_ids``.
        weight: (V, H) the LM head's weight; bias: (V,) or None.
        temperature, logit_scale, softcap: the logit transform (TRL's ``temperature``).
        entropy, mean_logits, is_top1: also return these per token.
        chunk_size: predicting positions per LM-head call.

    Returns:
        :class:`RolloutLogps`.

    Raises:
        ValueError: hidden not (R, S, H) for this batch, or a weight of another width.

    Example:
        >>> from flexpack.trees import pack_trees
        >>> b = pack_trees([([5, 6, 7], [[8, 9], [4]])], max_len=8)
        >>> r = rollout_logps(b, torch.zeros(1, 8, 4), torch.zeros(16, 4), entropy=True)
        >>> r.logps[0], r.entropies[1]  # uniform over 16 tokens
        (tensor([-2.7726, -2.7726]), tensor([2.7726, 0.0000]))
    """
    R, S = batch.shape
    if not isinstance(hidden, Tensor) or hidden.dim() != 3 or tuple(hidden.shape[:2]) != (R, S):
        got = tuple(hidden.shape) if isinstance(hidden, Tensor) else type(hidden).__name__
        raise ValueError(
            f"rollout_logps needs hidden states of shape (R, S, H) = ({R}, {S}, H), got {got}; "
            "pass the model's last_hidden_state on batch.input_ids."
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[2]:
        raise ValueError(
            f"weight must be (V, H) with H = {hidden.shape[2]}, got {tuple(weight.shape)}."
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}.")
    device = hidden.device
    sources = batch._sources.to(device)
    tokens = batch.input_ids.to(device).reshape(-1)[batch._targets.to(device)]  # (T,)
    flat = hidden.reshape(R * S, -1)
    compute_dtype = (
        torch.get_autocast_dtype(device.type)
        if torch.is_autocast_enabled(device.type)
        else hidden.dtype
    )
    tf = (float(logit_scale), softcap, 1.0 / temperature, compute_dtype)
    extra = (bool(entropy), bool(mean_logits), bool(is_top1))
    cols = _ChunkedHead.apply(flat[sources], weight, bias, tokens, tf, chunk_size, extra)
    index = batch._rollout_targets.to(device)
    valid = batch._rollout_valid.to(device)

    def per_rollout(col: Tensor) -> Tensor:
        return torch.nn.functional.pad(col, (0, 1))[index]  # past the end: the spare 0

    lp, ent, mean, top1 = cols
    logps = per_rollout(lp)
    ent = per_rollout(ent) if entropy else None
    mean = per_rollout(mean) if mean_logits else None
    top1 = per_rollout(top1).bool() & valid if is_top1 else None
    return RolloutLogps(logps=logps, valid=valid, entropies=ent, mean_logits=mean, is_top1=top1)
