"""The tree forward: a transformers causal LM run once over packed prefix trees, inside its own
``forward``, with per-rollout log-probs from the hidden states in bounded chunks
(:func:`tree_logps`).

The forward is installed on the model instance (as TRL's ``add_fused_lm_head`` installs its
fused head) and called through the model as TRL holds it, so a DDP, FSDP2 or FSDP1 wrapper runs
its own forward around it. GRPO, RLOO and DPO read their log-probs from it.

Shape legend: R packed rows of S tokens, H hidden size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flexpack import mixers
from flexpack.integrations._mixers_check import has_attention
from flexpack.integrations.trl._common import _attn_implementation, _inner, _unwrapped
from flexpack.mixers import TreeRefused
from flexpack.trees import PaddedTrees, RolloutLogps, rollout_logps


def _logit_transform(model: Any) -> tuple[float, float | None]:
    """(logit_scale, final_logit_softcapping) as TRL's fused LM head reads them from the config."""
    config = model.config.get_text_config()
    softcap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None)
    if scale is None:
        scale = getattr(config, "output_multiplier", None)
    if scale is None:
        scale = getattr(config, "lm_head_multiplier", None)
    if scale is None and getattr(config, "logits_scaling", None) is not None:
        s = config.logits_scaling
        scale = s if config.model_type == "hyperclovax" else 1 / s
    return (1.0 if scale is None else float(scale)), softcap


@dataclass(frozen=True, eq=False)
class _TreeRequest:
    """What a tree forward computes; passed as the ``flexpack_trees`` forward kwarg."""

    trees: PaddedTrees
    temperature: float = 1.0
    entropy: bool = False
    mean_logits: bool = False
    is_top1: bool = False
    cast_lm_head_to_fp32: bool = False
    chunk_size: int = 1024
    backend: str = "auto"
    router_aux_loss: bool = False


def _router_aux_loss(model: Any, router_logits: Any, counts: Tensor) -> Tensor:
    """The load-balancing loss TRL's fused head adds for MoE models (Mixtral's, which every MoE
    family of transformers shares), over tree tokens weighed by ``counts`` (R, S): the times
    each appears in the padded rows the trees replace. transformers' function weighs tokens
    by its mask's values, so the counts go in as the mask: equal to the loss over those rows."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    return load_balancing_loss_func(
        router_logits, experts, text.num_experts_per_tok, counts.to(torch.float32)
    )


def _run_trees(model: Any, request: _TreeRequest) -> dict[str, Tensor | None]:
    """The tree forward of a transformers causal LM, run inside its ``forward``: the backbone
    over the packed trees through flexpack attention, then the LM head in chunks."""
    from flexpack.integrations.transformers import register

    batch = request.trees.batch
    head = model.get_output_embeddings()
    weight, bias = head.weight, head.bias
    # FSDP2: parameters of a module whose own forward has not run (an lm_head sharded by
    # itself) are DTensor shards; gather them as TRL's fused head does (the gradient is
    # reduce-scattered back by the gather's backward). Parameters of the root's group are
    # unsharded for the whole forward (this one) and its backward.
    if type(weight).__name__ == "DTensor":
        weight = weight.full_tensor()
        bias = None if bias is None else bias.full_tensor()
    device = weight.device
    if batch.input_ids.device != device:
        batch = batch.to(device)
    # A Mask, not a BlockMask: flexpack.attention builds its BlockMask once per forward on the
    # flex path, padded to a bucket length, so batches of new lengths do not recompile.
    mask = batch.mask()
    # Recurrent / conv mixers read the tree from the call's sources (their layers are not
    # handed flexpack_mask): the model's own call carried flexpack_trees only.
    try:
        mixers.adapt(model)
    except ValueError as e:  # a mixer flexpack refuses: TRL's padded path runs it as it is
        raise TreeRefused(str(e)) from e
    mixers.set_sources(model, flexpack_mask=mask, position_ids=batch.position_ids)
    extra = {"output_router_logits": True} if request.router_aux_loss else {}
    with _attn_implementation(model, register()):
        out = model.base_model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            flexpack_mask=mask,
            flexpack_backend=request.backend,
            use_cache=False,
            **extra,
        )
    aux = None
    if request.router_aux_loss:
        aux = _router_aux_loss(model, out.router_logits, batch.token_counts())
    hidden = out.last_hidden_state  # (R, S, H)
    logit_scale, softcap = _logit_transform(model)
    ctx: Any = contextlib.nullcontext()
    if request.cast_lm_head_to_fp32:
        hidden = hidden.float()
        ctx = torch.autocast(device.type, enabled=False)
    with ctx:
        r = rollout_logps(
            batch, hidden, weight, bias, temperature=request.temperature,
            logit_scale=logit_scale, softcap=softcap, entropy=request.entropy,
            mean_logits=request.mean_logits, is_top1=request.is_top1,
            chunk_size=request.chunk_size,
        )  # fmt: skip
    # A dict of tensors: DDP (find_unused_parameters) and FSDP2 find the outputs in it.
    return {f.name: getattr(r, f.name) for f in dataclasses.fields(r)} | {"aux_loss": aux}


def _install_tree_forward(model: Any) -> bool:
    """Give ``model`` (a transformers causal LM) a forward that runs the trees when called with
    ``flexpack_trees=`` and is the forward it had otherwise (TRL's fused head, accelerate's
    autocast, generation: unchanged). Per instance, as TRL's ``add_fused_lm_head``; idempotent.
    Returns whether it installed (False: already there)."""
    if getattr(model.forward, "_flexpack_previous", None) is not None:
        return False
    previous = model.forward
    own = model.__dict__.get("forward")  # an instance forward (TRL's, accelerate's) or None

    # Keep the signature: generate() validates its model kwargs against it.
    @functools.wraps(type(model).forward)
    def forward(self: Any, *args: Any, flexpack_trees: _TreeRequest | None = None, **kwargs: Any):
        if flexpack_trees is None:
            return previous(*args, **kwargs)
        # A PEFT model passes its own arguments on as None (input_ids=None, labels=None, ...).
        given = [k for k, v in kwargs.items() if v is not None and k != "use_cache"]
        if args or given:
            raise TypeError(
                f"a flexpack tree forward takes flexpack_trees only, got also "
                f"{len(args)} positional and {given}."
            )
        return _run_trees(self, flexpack_trees)

    forward._flexpack_previous = (own,)  # type: ignore[attr-defined]
    model.forward = types.MethodType(forward, model)
    return True


def _remove_tree_forward(model: Any) -> None:
    """Undo :func:`_install_tree_forward` (the instance forward it replaced comes back)."""
    (own,) = model.forward._flexpack_previous
    if own is None:
        del model.forward
    else:
        model.forward = own


def tree_logps(
    model: Any,
    trees: PaddedTrees,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    mean_logits: bool = False,
    is_top1: bool = False,
    cast_lm_head_to_fp32: bool = False,
    chunk_size: int = 1024,
    backend: str = "auto",
    router_aux_loss: bool = False,
) -> RolloutLogps:
    """One forward of a transformers causal LM over packed trees; per-rollout log-probs.

    The model's backbone (``model.base_model``) runs on ``trees.batch`` with its tree mask
    through flexpack attention (switched on this instance for the call, whatever the model's
    ``attn_implementation``), then :func:`flexpack.trees.rollout_logps` applies the LM head in
    chunks, with the logit transform of TRL's fused LM head (config ``logit_scale`` /
    ``final_logit_softcapping``, then ``temperature``).

    Args:
        model: a transformers ``*ForCausalLM``, as it is called in training: bare, a PEFT
            model (its adapters stay active), sharded by FSDP2's ``fully_shard``, or inside
            ``DistributedDataParallel`` / ``torch.compile``. The forward runs through
            ``model(...)``, so a wrapper's forward runs too (DDP reduces the gradients as
            after any forward of its own); the tree forward is the model's ``forward`` for
            that call (installed on the instance, then removed, unless the trainers installed
            it for good).
        trees: from :func:`flexpack.trees.pack_padded`, on the model's device.
        temperature, entropy, mean_logits, is_top1, chunk_size: as in ``rollout_logps``.
        cast_lm_head_to_fp32: run the LM head in float32 outside autocast (TRL's option).
        backend: the ``flexpack.attention`` backend of the tree forward ("auto": compiled flex
            on CUDA, one SDPA call per segment elsewhere; "sdpa": per segment everywhere).
        router_aux_loss: also the MoE router's load-balancing loss (``aux_loss``), each tree
            token weighed by the rollouts that hold it: the loss TRL's padded forward of the
            same rows computes.

    Returns:
        :class:`flexpack.trees.RolloutLogps`; ``trees.scatter`` puts its fields in (B, C).

    Example:
        >>> import torch, transformers
        >>> from flexpack.trees import pack_padded
        >>> model = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=32,
        ...     hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
        >>> prompts, completions = torch.tensor([[0, 5, 6]] * 2), torch.tensor([[7, 8], [9, 0]])
        >>> trees = pack_padded(prompts, prompts != 0, completions, completions != 0)
        >>> trees.scatter(tree_logps(model, trees).logps).shape  # (B, C), TRL's layout
        torch.Size([2, 2])
    """
    from flexpack.integrations.transformers import register

    name = register()
    inner = _inner(_unwrapped(model))
    checkpointing = (
        "is_activation_checkpointing"  # transformers >= 5.x; the older name warns there
        if hasattr(type(inner), "is_activation_checkpointing")
        else "is_gradient_checkpointing"
    )
    if (
        inner.config._attn_implementation != name
        and has_attention(inner)
        and torch.is_grad_enabled()
        and getattr(inner, checkpointing, False)
    ):
        raise ValueError(
            "tree_logps with grad on a gradient-checkpointed model whose attn_implementation is "
            f"{inner.config._attn_implementation!r}: backward recomputes the layers with the "
            "implementation current then. Switch it for the whole step "
            "(model.set_attn_implementation(flexpack.integrations.transformers.register())), "
            "as the trainers' train() does."
        )
    while type(model).__name__ == "OptimizedModule":
        # torch.compile'd (accelerate compiles the prepared model when args.torch_compile): the
        # tree forward runs eagerly inside it; its host-side layout (segments, paths) and the
        # per-instance attention switch would break the graph at every layer.
        model = model._orig_mod
    request = _TreeRequest(
        trees, temperature=temperature, entropy=entropy, mean_logits=mean_logits,
        is_top1=is_top1, cast_lm_head_to_fp32=cast_lm_head_to_fp32, chunk_size=chunk_size,
        backend=backend, router_aux_loss=router_aux_loss,
    )  # fmt: skip
    # Through the model's own __call__ (and its wrapper's: DDP's forward prepares the gradient
    # reduction, FSDP2's hooks unshard and reshard), with the tree forward inside it.
    installed = _install_tree_forward(inner)
    try:
        out = model(flexpack_trees=request)
    finally:
        if installed:
            _remove_tree_forward(inner)
    return RolloutLogps(**out)
