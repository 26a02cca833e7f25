"""GRPO and RLOO: TRL's trainers with the per-token log-probs of completions (policy, reference
model, old policy) computed on prefix trees, each shared prompt forwarded once; see the package
docstring. The classes subclass trl's, so they are made on first access (``__getattr__``).

Shape legend: B rows of TRL's batch, P prompt tokens, C completion tokens (``logits_to_keep``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from flexpack.integrations.trl._common import PUBLIC_MODULE, _import_trl
from flexpack.integrations.trl._forward import tree_logps
from flexpack.integrations.trl._trees import (
    _EMPTY_ROWS_AUX,
    _every_row_a_rollout,
    _pack_rows,
    _TreeMixin,
)
from flexpack.mixers import TreeRefused

__all__ = ["GRPOTrainer", "RLOOTrainer"]  # noqa: F822 (made on first access: __getattr__)

_MULTIMODAL = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def _per_token_logps_and_entropies(
    self,
    model,
    input_ids,
    attention_mask,
    logits_to_keep,
    batch_size=None,
    compute_entropy=False,
    compute_aux_loss=False,
    **multimodal,
):
    """TRL's ``_get_per_token_logps_and_entropies`` on prefix trees: the same (B, C) tensors.

    ``input_ids`` (B, P + C) are TRL's left-padded prompts then right-padded completions,
    ``attention_mask`` (B, P + C) their mask and C = ``logits_to_keep``. Returns (logps (B, C)
    float32, entropies (B, C) or None, None), 0 where the completion is padding, as TRL's.
    """
    fallback = functools.partial(
        self._trl_per_token_logps,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=batch_size,
        compute_entropy=compute_entropy,
        compute_aux_loss=compute_aux_loss,
        **multimodal,
    )
    if any(v is not None for v in multimodal.values()):
        self._flexpack_fallback("multimodal inputs (images) are not packed as trees")
        return fallback()
    C = int(logits_to_keep)
    B = input_ids.shape[0]
    step = batch_size or B  # TRL's chunking of the no-grad passes, to bound their peak
    logps, entropies, aux = [], [], []
    for start in range(0, B, step):
        ids, mask = input_ids[start : start + step], attention_mask[start : start + step]
        try:
            trees = _pack_rows(
                ids[:, :-C], mask[:, :-C], ids[:, -C:], mask[:, -C:], self.flexpack_shared_prefix
            )
        except ValueError as e:
            self._flexpack_fallback(f"this batch cannot be packed as trees ({e})")
            return fallback()
        if compute_aux_loss and not _every_row_a_rollout(trees):
            self._flexpack_fallback(_EMPTY_ROWS_AUX)
            return fallback()
        try:
            with self.accelerator.autocast():
                r = tree_logps(
                    model,
                    trees,
                    temperature=self.temperature,
                    entropy=compute_entropy,
                    cast_lm_head_to_fp32=bool(getattr(self.args, "cast_lm_head_to_fp32", False)),
                    backend=self.flexpack_backend,
                    router_aux_loss=compute_aux_loss,
                )
        except TreeRefused as e:  # a mixer whose state cannot branch here
            self._flexpack_fallback(str(e))
            return fallback()
        self._flexpack_count(trees, tuple(ids.shape))
        logps.append(trees.scatter(r.logps))
        if compute_entropy:
            entropies.append(trees.scatter(r.entropies))
        if compute_aux_loss:
            aux.append(r.aux_loss)
    return (
        torch.cat(logps),
        torch.cat(entropies) if compute_entropy else None,
        torch.stack(aux).mean() if compute_aux_loss else None,  # TRL's: the chunks' mean
    )


def _grpo_like(base: type, name: str, doc: str) -> type:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._flexpack_start()
        base.__init__(self, *args, **kwargs)
        self._flexpack_init()

    def _trl_per_token_logps(self, *args: Any, **kwargs: Any):
        return base._get_per_token_logps_and_entropies(self, *args, **kwargs)

    cls = type(
        name,
        (_TreeMixin, base),
        {
            "__init__": __init__,
            "__doc__": doc,
            "__module__": PUBLIC_MODULE,
            "_trl_per_token_logps": _trl_per_token_logps,
            "_get_per_token_logps_and_entropies": _per_token_logps_and_entropies,
        },
    )
    functools.update_wrapper(__init__, base.__init__, updated=())
    return cls


_GRPO_DOC = """TRL's ``{base}`` with log-probs computed on prefix trees (shared prompts once).

Same constructor and ``{base}Config`` as ``trl.{base}``; see the module docstring. Training is
TRL's own (losses, advantages, generation, logging); only the log-prob forwards differ, and
they return the same tensors. ``trainer.flexpack_stats`` counts the tokens forwarded.
"""


@functools.cache
def _grpo_class(name: str) -> type:
    """``GRPOTrainer`` or ``RLOOTrainer``: trl's trainer of that name, log-probs on trees."""
    return _grpo_like(getattr(_import_trl(), name), name, _GRPO_DOC.format(base=name))


def __getattr__(name: str) -> type:
    # The trainers subclass trl's, so they exist once trl is imported: on first access.
    if name in __all__:
        return _grpo_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
