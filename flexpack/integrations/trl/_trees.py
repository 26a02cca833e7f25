"""What GRPO, RLOO and DPO share beside the tree forward: TRL's padded rows as prefix trees
(:func:`_pack_rows`: multi-level where distinct prompts begin alike), and the trainers' mixin
(the construction checks, the attention switch around ``train``, the fallback warning, the
token counts of :class:`TreeStats`).

Shape legend: B rows of TRL's batch, P prompt tokens, C completion tokens, L targets of a
rollout.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flexpack.integrations.trl._common import (
    _attn_implementation,
    _check_switchable,
    _inner,
    _unwrapped,
)
from flexpack.integrations.trl._forward import _install_tree_forward
from flexpack.trees import PaddedTrees, pack_padded

# ----------------------------------------------------------------------------- shared prefixes


@dataclass(frozen=True, eq=False)
class _PrefixTrees(PaddedTrees):
    """:class:`PaddedTrees` whose trees share prompt prefixes at several levels: a rollout's
    targets are its prompt tokens after its tree's root, then its completion, so the
    completion of row b starts at target ``row_offset[b]``."""

    row_offset: Tensor | None = None  # (B,) int64

    def scatter(self, values: Tensor) -> Tensor:
        B, C = self.completion_mask.shape
        out = values.new_zeros((B, C, *values.shape[2:]))
        has = self.row_rollout >= 0
        rows = values[self.row_rollout.clamp(min=0)]  # (B, L)
        L = rows.shape[1]
        mask = self.completion_mask
        j = torch.cumsum(mask, dim=1) - 1 + self.row_offset.to(mask.device)[:, None]
        take = mask & has[:, None] & (j < L)
        src = rows.gather(1, j.clamp(0, max(L - 1, 0)).to(torch.int64))
        return torch.where(take.reshape(B, C, *[1] * (values.dim() - 2)), src, out)


def _pack_rows(
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    min_shared: int,
) -> PaddedTrees:
    """:func:`flexpack.trees.pack_padded`, and where distinct prompts share a beginning of at
    least ``min_shared`` tokens (a system prompt, earlier turns of one conversation), one
    multi-level tree for them: the shared beginning once, then each prompt's rest, then its
    completions (a prompt that is a prefix of another is a node with both below it)."""
    import numpy as np

    from flexpack.trees import pack_trees

    flat = pack_padded(prompt_ids, prompt_mask, completion_ids, completion_mask)  # validates
    if min_shared < 1:
        return flat
    B, P = prompt_ids.shape
    plen = prompt_mask.bool().sum(1).tolist()
    clen = completion_mask.bool().sum(1).tolist()
    pids = prompt_ids.detach().cpu().numpy()
    cids = completion_ids.detach().cpu().numpy()
    rows_of: dict[bytes, list[int]] = {}
    prompt_of: dict[bytes, np.ndarray] = {}
    for b in range(B):
        if clen[b]:
            p = pids[b, P - plen[b] :].astype(np.int64)
            rows_of.setdefault(p.tobytes(), []).append(b)
            prompt_of[p.tobytes()] = p
    heads: dict[bytes, list[bytes]] = {}  # prompts by their first min_shared tokens
    for key, p in prompt_of.items():
        head = p[:min_shared].tobytes() if len(p) >= min_shared else b"whole:" + key
        heads.setdefault(head, []).append(key)
    if all(len(keys) == 1 for keys in heads.values()):
        return flat  # nothing shared beyond whole prompts

    def build(keys: list[bytes], depth: int) -> tuple[Any, list[int]]:
        """The node of prompts ``keys`` (equal on [:depth]) and its rows, leaves in order."""
        ps = [prompt_of[k] for k in keys]
        end = min(len(p) for p in ps)
        lcp = depth
        while lcp < end and all(p[lcp] == ps[0][lcp] for p in ps):
            lcp += 1
        children, rows = [], []
        for k, p in zip(keys, ps, strict=True):
            if len(p) == lcp:  # this prompt ends here: its completions hang below
                for b in rows_of[k]:
                    children.append(cids[b, : clen[b]].astype(np.int64))
                    rows.append(b)
        below: dict[int, list[bytes]] = {}
        for k, p in zip(keys, ps, strict=True):
            if len(p) > lcp:
                below.setdefault(int(p[lcp]), []).append(k)
        for sub in below.values():
            node, sub_rows = build(sub, lcp)
            children.append(node)
            rows.extend(sub_rows)
        return (ps[0][depth:lcp], children), rows

    trees, order, offset = [], [], torch.zeros(B, dtype=torch.int64)
    for keys in heads.values():
        tree, rows = build(keys, 0)
        trees.append(tree)
        order.extend(rows)
        root = len(tree[0])
        for b in rows:
            offset[b] = plen[b] - root

    def size(node: Any) -> int:
        return len(node) if not isinstance(node, tuple) else len(node[0]) + sum(map(size, node[1]))

    batch = pack_trees(trees, max(map(size, trees)), seed=None)  # one tree fits each row
    row_rollout = torch.full((B,), -1, dtype=torch.int64)
    for n, b in enumerate(order):
        row_rollout[b] = n
    device = completion_ids.device
    return _PrefixTrees(
        batch=batch.to(device) if device.type != "cpu" else batch,
        row_rollout=row_rollout.to(device),
        completion_mask=completion_mask.bool(),
        row_offset=offset.to(device),
    )


_EMPTY_ROWS_AUX = (
    "a row without completion tokens joins TRL's MoE auxiliary loss with its prompt, which no "
    "tree holds"
)


def _every_row_a_rollout(trees: PaddedTrees) -> bool:
    """Whether every padded row is a rollout of the trees (so the trees hold every real token
    of the rows: what a statistic over the rows, such as the router's loss, needs)."""
    return bool((trees.row_rollout >= 0).all())


# ----------------------------------------------------------------------------- the trainers' mixin


@dataclass
class TreeStats:
    """Tokens the trainer's log-prob forwards ran, as trees and as TRL's padded rows would.

    Attributes:
        calls: tree forwards run. fallbacks: calls that took TRL's own path.
        tree_tokens: real tokens forwarded (each shared prompt once), padded rows included as
            the packed rows' size (``R * S``).
        padded_tokens: what TRL's own forwards would have run (``B * S`` of its batches).
    """

    calls: int = 0
    fallbacks: int = 0
    tree_tokens: int = 0
    padded_tokens: int = 0


def _refuse_sharding(trainer: Any) -> None:
    """Refuse, by name and at construction, the sharding wrappers the tree forward cannot run in."""
    accelerator = trainer.accelerator
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if getattr(trainer, "is_deepspeed_enabled", False) and plugin is not None:
        if plugin.zero_stage == 3:
            raise ValueError(
                "flexpack's TRL trainers do not run under DeepSpeed ZeRO-3: it partitions every "
                "parameter outside its own module's forward, and the tree forward's chunked LM "
                "head reads lm_head.weight directly and again in backward. Use ZeRO-1/2, FSDP2 "
                "(fsdp_version: 2 in the accelerate config), or trl's own trainer."
            )


class _TreeMixin:
    """What the three trainers share: the construction check, the fallback warning, the stats."""

    #: ``flexpack.attention`` backend of the tree forwards (see :func:`tree_logps`).
    flexpack_backend: str = "auto"
    #: Distinct prompts that begin with this many equal tokens or more (a system prompt, the
    #: earlier turns of one conversation) share them in one multi-level tree; 0: only rows
    #: with equal whole prompts share.
    flexpack_shared_prefix: int = 16

    def _flexpack_start(self) -> None:
        """Before TRL's constructor, which may already forward (DPO's precomputed reference)."""
        self.flexpack_stats = TreeStats()
        self._flexpack_warned: set[str] = set()

    def _flexpack_init(self) -> None:
        """After TRL's constructor: refuse what cannot run trees, install the tree forwards."""
        _refuse_sharding(self)
        _check_switchable(self.model, "the model")
        ref = getattr(self, "ref_model", None)
        if ref is not None:
            _check_switchable(_unwrapped(ref), "the reference model")
        for model in (self.model, ref):
            if model is not None:
                _install_tree_forward(_inner(_unwrapped(model)))
        if getattr(self.args, "torch_compile", False):
            warnings.warn(
                "flexpack: args.torch_compile=True compiles TRL's other forwards (generation, "
                "anything outside the log-probs); the tree log-prob forwards run eagerly, around "
                "the compiled wrapper (on CUDA their attention is compiled flex_attention "
                "either way).",
                stacklevel=3,
            )

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's ``train``, with the policy's attention on flexpack's for its duration.

        Gradient checkpointing (TRL's default) recomputes each layer in backward with the
        attention implementation current then, so the switch spans the whole of training, not
        one forward; it is undone when ``train`` returns. Generation in between runs through
        flexpack's KV-cache path, which gives ``sdpa``'s tokens (``tests/test_hf_generate.py``).
        """
        from flexpack.integrations.transformers import register

        ref = getattr(self, "ref_model", None)
        with contextlib.ExitStack() as stack:
            # the reference model too: where a batch takes TRL's own path, policy and reference
            # then run the same code, and TRL's step-0 rewards tie at exactly 0 as in TRL's own
            # trainer (rounding between two attention paths flipped rewards/accuracies)
            for model in (self.model, ref):
                if model is not None:
                    stack.enter_context(_attn_implementation(_inner(_unwrapped(model)), register()))
            return super().train(*args, **kwargs)

    def _flexpack_fallback(self, why: str) -> None:
        self.flexpack_stats.fallbacks += 1
        if why not in self._flexpack_warned:
            self._flexpack_warned.add(why)
            warnings.warn(
                f"flexpack: {why}; these log-probs run through TRL's own padded forward "
                "(exact, without prompt sharing).",
                stacklevel=3,
            )

    def _flexpack_count(self, trees: PaddedTrees, padded: tuple[int, int]) -> None:
        R, S = trees.batch.shape
        self.flexpack_stats.calls += 1
        self.flexpack_stats.tree_tokens += R * S
        self.flexpack_stats.padded_tokens += padded[0] * padded[1]
