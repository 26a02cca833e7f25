"""DPO: TRL's ``DPOTrainer`` with each prompt's chosen and rejected answers forwarded as one tree
(the prompt once), for the policy and the reference model alike; see the package docstring.
The class subclasses trl's, so it is made on first access (``__getattr__``).

TRL's DPO calls the model on right-padded rows (prompt, then answer) with ``fused_lm_head=True``
and reads per-token log-probs where column t - 1 scores token t; :class:`_TreeCaller` answers
that call from one tree forward, in that layout.

Shape legend: B rows of DPO's batch (chosen and rejected answers), S tokens, C answer tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flexpack.integrations.trl._common import PUBLIC_MODULE, _import_trl
from flexpack.integrations.trl._forward import tree_logps
from flexpack.integrations.trl._trees import (
    _EMPTY_ROWS_AUX,
    _every_row_a_rollout,
    _pack_rows,
    _TreeMixin,
)
from flexpack.mixers import TreeRefused

__all__ = ["DPOTrainer"]  # noqa: F822 (made on first access: __getattr__)


@dataclass
class _FusedOutput:
    """The fields of TRL's ``FusedCausalLMOutput`` that DPO reads, in its (2B, S - 1) layout."""

    log_probs: Tensor
    entropy: Tensor | None = None
    mean_logits: Tensor | None = None
    is_top1: Tensor | None = None
    log_sum_sq_probs: Tensor | None = None
    aux_loss: Tensor | None = None
    loss: Tensor | None = None


class _TreeCaller:
    """Stands for the model in DPO's forward: ``model(input_ids=..., labels=..., fused_lm_head=
    True)`` answered from one tree forward, in TRL's layout (position t - 1 scores token t)."""

    def __init__(self, trainer: Any, model: Any, *, extras: bool) -> None:
        self.trainer, self.model, self.extras = trainer, model, extras

    def __getattr__(self, name: str) -> Any:  # anything else (training, config, ...) as is
        return getattr(self.model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        known = {"input_ids", "attention_mask", "labels", "fused_lm_head", "use_cache",
                 "output_router_logits"}  # fmt: skip
        others = sorted(k for k, v in kwargs.items() if k not in known and v is not None)
        if args or not kwargs.get("fused_lm_head") or others:
            self.trainer._flexpack_fallback(_dpo_call_unpacked(args, kwargs, others))
            return self.model(*args, **kwargs)
        input_ids, attention_mask, labels = (
            kwargs[k] for k in ("input_ids", "attention_mask", "labels")
        )
        try:
            trees, starts = _dpo_trees(
                input_ids, attention_mask, labels, self.trainer.flexpack_shared_prefix
            )
        except ValueError as e:
            self.trainer._flexpack_fallback(f"this batch cannot be packed as trees ({e})")
            return self.model(*args, **kwargs)
        aux = bool(kwargs.get("output_router_logits"))
        if aux and not _every_row_a_rollout(trees):
            self.trainer._flexpack_fallback(_EMPTY_ROWS_AUX)
            return self.model(*args, **kwargs)
        try:
            r = tree_logps(
                self.model, trees, entropy=self.extras, mean_logits=self.extras,
                is_top1=self.extras, backend=self.trainer.flexpack_backend, router_aux_loss=aux,
            )  # fmt: skip
        except TreeRefused as e:  # a mixer whose state cannot branch here
            self.trainer._flexpack_fallback(str(e))
            return self.model(*args, **kwargs)
        self.trainer._flexpack_count(trees, tuple(input_ids.shape))
        B, S = input_ids.shape
        C = trees.completion_mask.shape[1]
        # Completion token j of row b sits at column starts[b] + j; TRL scores it at column - 1.
        cols = (starts[:, None] + torch.arange(C, device=starts.device) - 1).clamp(0, S - 2)

        def place(values: Tensor | None) -> Tensor | None:
            if values is None:
                return None
            v = trees.scatter(values)  # (B, C), 0 on padding
            out = v.new_zeros(B, S - 1)
            return out.scatter_add(1, cols.to(v.device), v)

        top1 = place(r.is_top1.float()) if r.is_top1 is not None else None
        return _FusedOutput(
            log_probs=place(r.logps),
            entropy=place(r.entropies),
            mean_logits=place(r.mean_logits),
            is_top1=None if top1 is None else top1.bool(),
            aux_loss=r.aux_loss,
        )


def _dpo_call_unpacked(args: tuple, kwargs: dict[str, Any], others: list[str]) -> str:
    """Why a model call of DPO's is not one flexpack packs, naming what the call carried."""
    why = []
    if args:
        why.append(f"{len(args)} positional argument{'s' * (len(args) != 1)}")
    if not kwargs.get("fused_lm_head"):
        why.append(
            "no fused_lm_head=True (a call for the full logits: TRL's extra forward for "
            "compute_metrics, return_outputs=True)"
        )
    if others:
        why.append(f"inputs flexpack does not pack: {', '.join(others)}")
    return f"DPO called the model with {'; '.join(why)}"


def _dpo_trees(input_ids: Tensor, attention_mask: Tensor, labels: Tensor, min_shared: int = 0):
    """DPO's right-padded rows (prompt + answer) as (prompt, answer) trees; prompts that share
    a beginning of ``min_shared`` tokens or more (multi-turn pairs: earlier turns, a system
    prompt) as multi-level trees (:func:`_pack_rows`).

    Returns ``(trees, starts)``: ``starts`` (B,) the column of each row's first answer token.
    """
    B, S = input_ids.shape
    real = attention_mask.bool()
    target = (labels != -100) & real
    n_real = real.sum(1)
    has = target.any(1)
    first = torch.where(has, target.float().argmax(1), n_real)  # first answer token
    cols = torch.arange(S, device=input_ids.device)
    want_real = cols[None, :] < n_real[:, None]
    want_target = (cols[None, :] >= first[:, None]) & want_real
    if not bool((real == want_real).all()) or not bool((target == want_target).all()):
        raise ValueError("rows must be right-padded prompt + answer with the answer at the end")
    plen, clen = first, n_real - first
    P, C = int(plen.max()), max(int(clen.max()), 1)
    prompt_ids = input_ids.new_zeros(B, P)
    prompt_mask = torch.zeros(B, P, dtype=torch.bool, device=input_ids.device)
    completion_ids = input_ids.new_zeros(B, C)
    completion_mask = torch.zeros(B, C, dtype=torch.bool, device=input_ids.device)
    for b, (p, c) in enumerate(zip(plen.tolist(), clen.tolist(), strict=True)):
        prompt_ids[b, P - p :] = input_ids[b, :p]
        prompt_mask[b, P - p :] = True
        completion_ids[b, :c] = input_ids[b, p : p + c]
        completion_mask[b, :c] = True
    trees = _pack_rows(prompt_ids, prompt_mask, completion_ids, completion_mask, min_shared)
    return trees, first


@functools.cache
def _dpo_class() -> type:
    base = _import_trl().DPOTrainer

    class DPOTrainer(_TreeMixin, base):
        """TRL's ``DPOTrainer`` with chosen and rejected answers forwarded as one tree per prompt.

        Same constructor and ``DPOConfig`` as ``trl.DPOTrainer``; the policy's and the
        reference model's forwards run the prompt once for both answers and give TRL the same
        per-token log-probs (so the same chosen / rejected sums, losses and metrics).
        ``trainer.flexpack_stats`` counts the tokens forwarded.
        """

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._flexpack_start()
            base.__init__(self, *args, **kwargs)
            self._flexpack_init()

        def _trees_apply(self, model: Any) -> bool:
            if self.use_weighting:
                self._flexpack_fallback("WPO weighting (use_weighting) needs log_sum_sq_probs")
                return False
            return True

        def _compute_loss(self, model, inputs, return_outputs):
            if not self._trees_apply(model):
                return base._compute_loss(self, model, inputs, return_outputs)
            ref = self.ref_model
            self.ref_model = None if ref is None else _TreeCaller(self, ref, extras=False)
            try:
                caller = _TreeCaller(self, model, extras=True)
                return base._compute_loss(self, caller, inputs, return_outputs)
            finally:
                self.ref_model = ref

        def compute_ref_log_probs(self, model, inputs):
            if not self._trees_apply(model):
                return base.compute_ref_log_probs(self, model, inputs)
            return base.compute_ref_log_probs(self, _TreeCaller(self, model, extras=False), inputs)

    DPOTrainer.__module__ = PUBLIC_MODULE
    return DPOTrainer


def __getattr__(name: str) -> type:
    # The trainer subclasses trl's, so it exists once trl is imported: on first access.
    if name == "DPOTrainer":
        return _dpo_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
