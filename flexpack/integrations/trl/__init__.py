"""TRL: GRPO, RLOO and DPO trainers that forward each shared prompt once, as a prefix tree;
an SFT trainer on rows packed over the whole dataset.

``SFTTrainer`` here is TRL's ``SFTTrainer`` (a subclass: the same constructor and config)
whose dataset, once TRL has tokenized it and built its labels, is packed by one best-fit-
decreasing plan into rows of ``max_length`` (:func:`flexpack.integrations.datasets.
pack_dataset`), trained on flexpack attention with TRL's own chunked loss, and counted in
``trainer.flexpack_stats`` and the logs (see :class:`PackStats`).

``GRPOTrainer``, ``RLOOTrainer`` and ``DPOTrainer`` here are TRL's own trainers (subclasses: the
same constructor, config and behaviour) with one change: where TRL computes per-token log-probs
of completions (for the policy, the reference model and the old policy), the rows that share a
prompt are packed as one tree (:func:`flexpack.trees.pack_padded`: the prompt once, then every
completion), the model runs once over the trees through flexpack attention, and the log-probs
come from the hidden states in bounded chunks (:func:`flexpack.trees.rollout_logps`). TRL gets
back its own tensors, in its own order: GRPO's ``(B, logits_to_keep)`` log-probs and entropies,
DPO's per-token log-probs behind its chosen / rejected sums.

    >>> from flexpack.integrations.trl import GRPOTrainer  # was: from trl import GRPOTrainer

The tree forward runs inside the model's own ``forward`` (given to the policy and the reference
model per instance, as TRL's ``add_fused_lm_head`` gives its fused head: called with
``flexpack_trees=``, it runs the trees; otherwise it is the forward the model had), through the
model as TRL holds it, so a ``DistributedDataParallel``, FSDP2 or FSDP1 wrapper runs its own
forward around it (gradient reduction, unsharding). DeepSpeed ZeRO-3 is refused at construction.

The model may come with any ``attn_implementation``: each tree forward switches it to flexpack's
on that model instance and back (``model.set_attn_implementation``), so generation and the
rest of training keep the user's (a model without attention, RWKV, Mamba or xLSTM, keeps its
own: it has nothing to switch). An MoE model's router load-balancing loss is computed over
the trees' tokens, each weighed by the rollouts that share it, which is the loss over TRL's
padded rows. Rows TRL pads some other way (multimodal inputs, completion masks with holes,
DPO's WPO weighting, rows without completion tokens when the router loss is on) take TRL's own
path, with a warning once. trl and transformers are imported lazily (extra ``trl``).

Shape legend: B rows of TRL's batch, P prompt tokens, C completion tokens (``logits_to_keep``),
S = P + C.

The package, one file per trainer as TRL has: ``grpo`` (:class:`GRPOTrainer`,
:class:`RLOOTrainer`), ``dpo`` (:class:`DPOTrainer`), ``sft`` (:class:`SFTTrainer`,
:class:`PackStats`); what they share in ``_common`` (trl's import, the attention switch),
``_forward`` (the tree forward, :func:`tree_logps`) and ``_trees`` (TRL's rows as prefix trees,
the trainers' mixin, :class:`TreeStats`). A trainer file imports the shared ones, never another
trainer's.
"""

from __future__ import annotations

from flexpack.integrations.trl import dpo, grpo, sft
from flexpack.integrations.trl._forward import tree_logps
from flexpack.integrations.trl._trees import TreeStats
from flexpack.integrations.trl.sft import PackStats

# The trainers subclass trl's, so they are made when first looked up (module __getattr__).
__all__ = [
    "DPOTrainer",
    "GRPOTrainer",
    "PackStats",
    "RLOOTrainer",
    "SFTTrainer",
    "TreeStats",
    "tree_logps",
]

_TRAINERS = {"GRPOTrainer": grpo, "RLOOTrainer": grpo, "DPOTrainer": dpo, "SFTTrainer": sft}


def __getattr__(name: str) -> type:
    # The trainer classes subclass trl's, so they exist once trl is imported: on first access.
    if name in _TRAINERS:
        return getattr(_TRAINERS[name], name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
