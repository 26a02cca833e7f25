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
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flexpack import mixers
from flexpack.integrations._mixers_check import has_attention
from flexpack.mixers import TreeRefused
from flexpack.trees import PaddedTrees, RolloutLogps, pack_padded, rollout_logps

# The trainers subclass trl's, so they are made when first looked up (module __getattr__).
__all__ = [  # noqa: F822
    "DPOTrainer",
    "GRPOTrainer",
    "PackStats",
    "RLOOTrainer",
    "SFTTrainer",
    "TreeStats",
    "tree_logps",
]


def _import_trl():
    try:
        import trl
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "flexpack.integrations.trl needs trl; install it with `pip install trl` (or "
            "`pip install -e '.[trl]'` in a flexpack checkout)."
        ) from e
    import trl.trainer.utils as utils

    if not hasattr(utils, "add_fused_lm_head"):
        raise ImportError(
            f"flexpack.integrations.trl adapts the log-prob seams of TRL >= 1.16 (its fused LM "
            f"head), got trl {trl.__version__}; upgrade with `pip install -U trl`."
        )
    return trl


# ----------------------------------------------------------------------------- the tree forward


@contextlib.contextmanager
def _attn_implementation(model: Any, name: str) -> Iterator[None]:
    """``model`` runs attention through ``name`` inside the block, and as before after it. A model
    without attention (RWKV, Mamba, xLSTM) has nothing to switch: it runs as it is."""
    before = model.config._attn_implementation
    if before == name or not has_attention(model):
        yield
        return
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def _check_switchable(model: Any, what: str) -> None:
    """Refuse, at construction, a model whose attention cannot be switched to flexpack's."""
    from flexpack.integrations.transformers import register

    name = register()
    if not hasattr(model, "set_attn_implementation") or not hasattr(model, "base_model"):
        raise TypeError(
            f"flexpack's TRL trainers need a transformers PreTrainedModel as {what}, got "
            f"{type(model).__name__}; use trl's own trainer for other models."
        )
    target = _inner(model)
    if not has_attention(target):
        return  # nothing to switch: its mixers read the trees from the call's sources
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with _attn_implementation(target, name):
            switched = target.config._attn_implementation == name
    if not switched:
        raise ValueError(
            f"{what} ({type(target).__name__}) cannot switch its attention implementation to "
            f"flexpack's at run time (transformers' set_attn_implementation refused); build it "
            f"with attn_implementation=flexpack.integrations.transformers.register(), or use "
            f"trl's own trainer."
        )


def _inner(model: Any) -> Any:
    """The transformers model inside a PEFT model (its adapters stay active), or the model."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


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


_WRAPPERS = {  # containers whose forward calls the model inside: the attribute that holds it
    "DistributedDataParallel": "module",
    "DataParallel": "module",
    "DeepSpeedEngine": "module",
    "OptimizedModule": "_orig_mod",  # torch.compile
    "FullyShardedDataParallel": "_fsdp_wrapped_module",  # FSDP1
}


def _unwrapped(model: Any) -> Any:
    """The model inside DDP / DeepSpeed / torch.compile containers (FSDP2 shards in place)."""
    while type(model).__name__ in _WRAPPERS:
        model = getattr(model, _WRAPPERS[type(model).__name__])
    return model


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


# ----------------------------------------------------------------------------- GRPO and RLOO

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


_EMPTY_ROWS_AUX = (
    "a row without completion tokens joins TRL's MoE auxiliary loss with its prompt, which no "
    "tree holds"
)


def _every_row_a_rollout(trees: PaddedTrees) -> bool:
    """Whether every padded row is a rollout of the trees (so the trees hold every real token
    of the rows: what a statistic over the rows, such as the router's loss, needs)."""
    return bool((trees.row_rollout >= 0).all())


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
            "__module__": __name__,
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


# ----------------------------------------------------------------------------- DPO


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

    DPOTrainer.__module__ = __name__
    return DPOTrainer


# ----------------------------------------------------------------------------- SFT


@dataclass
class PackStats:
    """What :class:`SFTTrainer`'s training steps forwarded, summed over steps (and ranks).

    Attributes:
        steps: micro-batches forwarded (``compute_loss`` calls in training).
        rows: packed rows forwarded, R per micro-batch.
        documents: samples in those rows (a sample split by ``packing_strategy="bfd_split"``
            counts once per piece).
        tokens: their real tokens.
        row_tokens: the slots of the rows, ``R * max_length`` per micro-batch.
        padded_tokens: what the same samples take unpacked, each its own row padded to the
            longest of its micro-batch (TRL's ``packing=False`` collator).
        truncated: tokens of a streaming train set that no row holds (``IterableDataset``,
            ``packing_strategy="bfd"``): cut by truncation to ``max_length`` (as TRL's
            ``truncation_mode`` cuts), or of a sample left with no supervised token (TRL drops
            those). The rows' ``tokens`` plus ``truncated`` are the stream's tokens.

    ``padding_removed`` is ``padded_tokens - row_tokens`` when that is positive, else 0: the
    slots TRL's default padded batches would have forwarded beyond flexpack's rows. It cannot
    go negative: where flexpack's rows took as many slots or more (a last, half-empty row of
    long samples), it is 0 and ``fill`` says how full the rows were.
    """

    steps: int = 0
    rows: int = 0
    documents: int = 0
    tokens: int = 0
    row_tokens: int = 0
    padded_tokens: int = 0
    truncated: int = 0

    @property
    def fill(self) -> float:
        """Real tokens per row slot, in [0, 1]."""
        return self.tokens / max(self.row_tokens, 1)

    @property
    def padding_removed(self) -> int:
        """Slots the unpacked micro-batches would have forwarded beyond these rows; >= 0."""
        return max(self.padded_tokens - self.row_tokens, 0)


@dataclass(frozen=True)
class _PackedCollator:
    """Rows of the packed dataset (``input_ids`` (T_r,), ``labels`` (T_r,), ``seq_lengths``
    (k_r,), TRL's name; flexpack's ``seqlens`` is read too) -> the model call's keywords, each
    (R, max_len): ``input_ids``, ``labels`` (-100 on padding and on each document's first
    token), ``position_ids`` (restarting per document), ``doc_ids`` (-1 on padding). A row
    without either (an unpacked eval set, a dataset passed with ``skip_prepare_dataset``) is
    one document."""

    max_len: int
    pad_id: int
    padding_mask: bool = False  # also an attention_mask (1 = real token): see SFTTrainer

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        from flexpack.data import collate
        from flexpack.integrations.transformers import packed_forward_kwargs

        rows = [
            {
                "input_ids": r["input_ids"],
                **({"labels": r["labels"]} if "labels" in r else {}),
                "seqlens": _row_seqlens(r),
            }
            for r in rows
        ]
        batch = collate(rows, max_len=self.max_len, pad_id=self.pad_id)
        kwargs = packed_forward_kwargs(batch, labels=True)
        del kwargs["use_cache"]  # TRL's compute_loss sets it
        if self.padding_mask:
            kwargs["attention_mask"] = (batch.doc_ids >= 0).long()
        return kwargs


def _row_seqlens(row: dict[str, Any]) -> Any:
    """A packed row's document lengths: TRL's ``seq_lengths``, flexpack's ``seqlens``, or the
    whole row as one document."""
    for key in ("seq_lengths", "seqlens"):
        if key in row:
            return row[key]
    return [len(row["input_ids"])]


def _document_weights(labels: Tensor, doc_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Per-document loss weights for the shifted targets of packed rows, without a host sync.

    labels, doc_ids: (R, S), HF-style unshifted labels (-100 = not supervised). Returns the
    (R, S - 1) weight of each target ``labels[:, 1:]`` (1 / the supervised targets of its
    document, 0 where not supervised) and the number of documents with a supervised target.
    A document is a (row, id) pair; ids are below S.
    """
    supervised = labels[:, 1:] != -100
    doc = doc_ids[:, 1:].long().clamp(min=0)
    counts = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
    counts.scatter_add_(1, doc, supervised.float())  # (R, S): supervised targets per id
    weight = torch.where(supervised, 1.0 / counts.gather(1, doc).clamp(min=1), 0.0)
    return weight, (counts > 0).sum()


class _DocumentWeighted:
    """The model as TRL's ``compute_loss`` calls it, with the fused head's per-token log-probs
    weighted per document: TRL's ``sum(-log_probs) / num_items_in_batch`` with the number of
    documents as ``num_items_in_batch`` is then the mean over documents of each one's mean."""

    def __init__(self, model: Any, weight: Tensor) -> None:
        self.model, self.weight = model, weight

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.model(*args, **kwargs)
        if kwargs.get("fused_lm_head"):
            out.log_probs = out.log_probs * self.weight.to(out.log_probs)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


class _Truncated:
    """The samples of TRL's prepared stream as TRL's unpacked path cuts them: to ``max_len``
    tokens by ``mode`` (``"keep_start"`` / ``"keep_end"``; None: uncut), samples left without a
    supervised token dropped. Re-iterable; reads the whole stream in every DataLoader worker.

    ``lost`` counts the tokens no row will hold, of the samples this reader owns (stream index
    ``i % n == g``, ``owner = (g, n)``): every reader reads every sample, so each loss is
    counted by exactly one reader."""

    def __init__(self, samples: Any, max_len: int, mode: str | None) -> None:
        self.samples, self.max_len, self.mode = samples, max_len, mode
        self.owner, self.lost = (0, 1), 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from flexpack.data.streaming import _whole_stream

        g, n, m = *self.owner, self.max_len
        for i, sample in enumerate(_whole_stream(self.samples)):
            ids = list(sample["input_ids"])
            labels = list(sample["labels"]) if sample.get("labels") is not None else ids
            lost = 0
            if self.mode is not None:
                if len(ids) > m:
                    cut = slice(None, m) if self.mode == "keep_start" else slice(-m, None)
                    lost, ids, labels = len(ids) - m, ids[cut], labels[cut]
                if all(label == -100 for label in labels):  # TRL drops it: no loss
                    lost, ids = lost + len(ids), []
            if lost and i % n == g:
                self.lost += lost
            if ids:
                yield {"input_ids": ids, "labels": labels}


class _StreamedRows(torch.utils.data.IterableDataset):
    """TRL's prepared stream (a ``datasets.IterableDataset`` of ``input_ids`` and ``labels``)
    packed on the fly by :class:`flexpack.data.PackedIterableDataset` into rows as TRL's packed
    datasets hold them: dicts of ``input_ids`` (T_r,) and ``labels`` (T_r,) lists, the row's
    ``seq_lengths`` (k_r,), and ``truncated``, the tokens lost (see :class:`_Truncated`) that
    this row reports (counted once over rows, workers and ranks; the last row of each reader
    carries what is left).

    Memory: at most ``buffer_size`` samples wait, plus one row. Ranks: this object deals the rows
    itself (``sync_ranks=True``: every rank the same number of rows, every sample once; a short
    rank's last row is empty), so its DataLoader must not be sharded again (see
    ``SFTTrainer._flexpack_stream_loader``)."""

    def __init__(
        self, samples: Any, max_len: int, *, strategy: str, overflow: str, truncation_mode: str,
        buffer_size: int, pad_id: int, rank: int, world_size: int,
    ) -> None:  # fmt: skip
        from flexpack.data import PackedIterableDataset

        self.samples = samples
        self.truncated = _Truncated(
            samples, max_len, truncation_mode if overflow == "truncate" else None
        )
        self.rank, self.world_size = rank, world_size
        self.packer = PackedIterableDataset(
            self.truncated, max_len, buffer_size=buffer_size, strategy=strategy,
            overflow="error" if overflow == "truncate" else overflow, labels_column="labels",
            pad_id=pad_id, rank=rank, world_size=world_size, sync_ranks=world_size > 1,
        )  # fmt: skip

    def set_epoch(self, epoch: int) -> None:  # Trainer calls it: a shuffled stream reshuffles
        if hasattr(self.samples, "set_epoch"):
            self.samples.set_epoch(epoch)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        self.truncated.owner = (self.rank * workers + worker, self.world_size * workers)
        self.truncated.lost = reported = 0
        held = None
        for row in self.packer:  # one row late: the last one reports what is left
            if held is not None:
                yield _stream_row(held, self.truncated.lost - reported)
                reported = self.truncated.lost
            held = row
        if held is not None:
            yield _stream_row(held, self.truncated.lost - reported)


def _stream_row(row: Any, truncated: int) -> dict[str, Any]:
    """A one-row ``PackedBatch`` as a row of TRL's packed datasets (plus ``truncated``)."""
    doc_ids = row.doc_ids[0]
    real = doc_ids >= 0
    seq_lengths = torch.bincount(doc_ids[real].long()).tolist() if bool(real.any()) else []
    return {
        "input_ids": row.input_ids[0][real].tolist(),
        "labels": row.labels[0][real].tolist(),
        "seq_lengths": seq_lengths,
        "truncated": truncated,
    }


class _StreamCollator:
    """The trainer's collator over streamed rows; their ``truncated`` counts travel beside the
    batch as ``flexpack_truncated`` (read off by ``compute_loss``)."""

    def __init__(self, collator: Any) -> None:
        self.collator = collator

    def __call__(self, rows: list[dict[str, Any]]) -> Any:
        truncated = sum(r.get("truncated", 0) for r in rows)
        batch = self.collator([{k: v for k, v in r.items() if k != "truncated"} for r in rows])
        if isinstance(batch, dict):
            batch["flexpack_truncated"] = torch.tensor(truncated)
        return batch


# TRL's packing_strategy -> flexpack's (strategy, overflow) of pack_dataset
_SFT_STRATEGIES = {
    "bfd": ("bfd", "truncate"),
    "bfd_split": ("bfd", "split"),
    "wrapped": ("wrap", "error"),  # samples cut at row ends; each piece its own document
}


def _peft_configs(model: Any, peft_config: Any) -> list[Any]:
    """The PEFT configs a trainer would train: TRL's ``peft_config`` argument and those of a
    model that already carries adapters (PEFT's ``peft_config`` dict, ``active_peft_config``)."""
    found = [] if peft_config is None else [peft_config]
    if isinstance(model, str):
        return found
    held = getattr(model, "peft_config", None)
    if isinstance(held, dict):
        found.extend(held.values())
    elif held is not None:
        found.append(held)
    try:
        active = getattr(model, "active_peft_config", None)
    except Exception:  # PEFT raises when no adapter is active
        active = None
    if active is not None:
        found.append(active)
    return found


def _refuse_prompt_learning(model: Any, peft_config: Any) -> None:
    """Refuse, at construction, PEFT methods that add virtual tokens to the model's input."""
    for config in _peft_configs(model, peft_config):
        if not getattr(config, "is_prompt_learning", False):
            continue
        method = getattr(getattr(config, "peft_type", None), "value", None) or type(config).__name__
        raise ValueError(
            f"flexpack's SFTTrainer does not train PEFT prompt-learning methods; got {method} "
            f"({type(config).__name__}, {getattr(config, 'num_virtual_tokens', '?')} virtual "
            "tokens). PEFT adds its virtual tokens once per row, not per sample: prefix tuning "
            "gives its key/values to the first sample of a packed row only (the others train "
            "without them, silently), and prompt tuning / P-tuning prepend embeddings that the "
            "rows' doc_ids do not cover. Use trl.SFTTrainer for prompt-learning methods, or a "
            "weight adapter (LoRA, DoRA, IA3, ...) with flexpack's."
        )


def _sft_class() -> type:
    trl = _import_trl()
    base = trl.SFTTrainer
    signature = inspect.signature(base.__init__)

    class SFTTrainer(base):
        """TRL's ``SFTTrainer`` on rows packed by flexpack over the whole dataset.

        Same constructor and ``SFTConfig`` as ``trl.SFTTrainer``; one import changes. TRL
        tokenizes the dataset and builds its labels as it does without packing (the prompt
        masked when the data is prompt-completion: ``completion_only_loss``, TRL's default;
        ``assistant_only_loss``; truncation to ``max_length``), then ``flexpack.integrations.
        datasets.pack_dataset`` packs all of it with one best-fit-decreasing plan into rows of
        ``args.max_length`` (``packing`` is implied; ``packing_strategy="bfd_split"`` splits
        over-long samples instead of truncating them). The packed rows carry TRL's
        ``seq_lengths`` column: row i of ``trainer.train_dataset`` holds several samples, not
        sample i. Each micro-batch is
        ``per_device_train_batch_size`` rows of (R, max_length), with ``doc_ids`` and
        ``position_ids`` that restart per sample. The model runs on flexpack attention (switched
        on this instance for ``train`` / ``evaluate``, restored after) and its recurrent / conv
        mixers are adapted, so no sample sees another; the loss is TRL's own (its fused LM head:
        per-token log-probs from the hidden states in chunks, never the (R, S, V) logits; the
        first token of every sample has label -100, so no prediction crosses a boundary).

        TRL's options, as flexpack reads them:

        - ``completion_only_loss``, ``assistant_only_loss``, ``dataset_text_field``,
          ``formatting_func``, ``truncation_mode``: TRL's own preparation builds the samples and
          their labels, so each packed sample is the one TRL's unpacked trainer trains on.
        - ``packing_strategy``: ``"bfd"`` (truncate over-long samples), ``"bfd_split"`` (split
          them) or ``"wrapped"`` (concatenate in order, cut every ``max_length`` tokens: rows
          full but the last; each piece is its own document, where TRL's wrapped rows let the
          samples of a row attend to each other).
        - ``eval_packing=False``: each eval sample in its own row (truncated to ``max_length``),
          as TRL evaluates it; otherwise the eval set is packed as the train set.
        - ``packing`` and ``padding_free``: flexpack's rows are packed and carry no attention
          across samples either way, so both only change what TRL checks at construction
          (``padding_free=True`` with ``packing=False`` and a ``max_length`` is TRL's error).
        - PEFT weight adapters (LoRA, DoRA, IA3, ...) train as in TRL; prompt-learning methods
          (prefix tuning, prompt tuning, P-tuning: virtual tokens once per row) are refused at
          construction. Datasets with images are refused at construction too.

        Streaming (a ``datasets.IterableDataset`` as train or eval set, ``max_steps`` set as TRL
        asks): TRL prepares the stream lazily as above, and :class:`flexpack.data.
        PackedIterableDataset` packs it on the fly (best fit inside a buffer of ``buffer_size``
        samples, a keyword of flexpack's, default 1024; ``"bfd_split"`` / ``"wrapped"`` as
        above). With ``"bfd"`` a sample over ``max_length`` is cut as TRL's
        ``truncation_mode`` cuts it, and one left without a supervised token is dropped, as TRL
        drops it; their lost tokens are counted (``flexpack/truncated``,
        ``PackStats.truncated``). Every rank reads the whole stream and takes its own rows, the
        same number on every rank (a short rank's last row is empty), every sample once; the
        DataLoader is not sharded again by accelerate (whose split repeats rows from the first
        batch to fill the last).

        ``reduction`` (keyword, flexpack's): ``"token"`` (TRL's: the mean over every supervised
        token of the step) or ``"document"`` (the mean over the step's samples of each sample's
        mean token loss, so a long answer weighs as much as a short one; across gradient
        accumulation and ranks, as ``num_items_in_batch`` counts tokens for TRL).

        An MoE model's router load-balancing loss (on when TRL turns it on) is taken over the
        rows' real tokens (the rows carry an ``attention_mask`` marking padding), as TRL's
        unpacked trainer takes it over the same samples' tokens.

        ``trainer.flexpack_stats`` (:class:`PackStats`) counts what training forwarded, and the
        logs carry ``flexpack/rows``, ``flexpack/fill``, ``flexpack/tokens`` and
        ``flexpack/padding_removed`` (>= 0, see :class:`PackStats`) and, for a streaming set,
        ``flexpack/truncated`` beside TRL's metrics (per
        micro-batch, averaged over the logging interval as TRL averages its own).
        """

        def __init__(
            self, *args: Any, reduction: str = "token", buffer_size: int = 1024, **kwargs: Any
        ) -> None:
            if reduction not in ("token", "document"):
                raise ValueError(
                    f"flexpack's SFTTrainer takes reduction='token' (TRL's mean over supervised "
                    f"tokens) or 'document' (the mean of each sample's mean), got {reduction!r}."
                )
            bound = signature.bind(self, *args, **kwargs).arguments
            _refuse_prompt_learning(bound.get("model"), bound.get("peft_config"))
            self.flexpack_stats = PackStats()
            self.flexpack_reduction = reduction
            if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
                raise ValueError(
                    f"flexpack's SFTTrainer takes buffer_size, the samples of a streaming dataset "
                    f"held for best fit, as an int >= 1 (1024 or more keeps rows full); got "
                    f"{buffer_size!r}."
                )
            self.flexpack_buffer_size = buffer_size
            self._flexpack_prepared_train = False  # TRL prepares the train set first
            base.__init__(self, *args, **kwargs)
            _refuse_prompt_learning(self.model, None)
            if reduction == "document" and (
                self.compute_loss_func is not None or self.label_smoother is not None
            ):
                raise ValueError(
                    "flexpack's SFTTrainer(reduction='document') weighs TRL's own token loss; "
                    "it cannot with a compute_loss_func or label_smoothing_factor > 0. Drop "
                    "those, or use reduction='token'."
                )
            from flexpack.integrations.transformers import _prepare

            if self._is_vision_dataset:
                raise ValueError(
                    "flexpack's SFTTrainer packs text datasets; this one has images. Use "
                    "trl.SFTTrainer, or flexpack.integrations.transformers.pack_multimodal."
                )
            _check_switchable(self.model, "the model")
            _prepare(self.model)  # adapt recurrent / conv mixers, refuse what cannot be exact
            trl_collator = trl.trainer.sft_trainer.DataCollatorForLanguageModeling
            if isinstance(self.data_collator, trl_collator):  # TRL's own: replaced by flexpack's
                self.data_collator = _PackedCollator(
                    max_len=self._flexpack_max_len(self.args),
                    pad_id=self._tokenizer.pad_token_id,
                    padding_mask=self.aux_loss_enabled,  # the router's loss leaves padding out
                )

        @staticmethod
        def _flexpack_max_len(args: Any) -> int:
            if args.max_length is None:
                raise ValueError(
                    "flexpack's SFTTrainer packs rows of args.max_length tokens; got "
                    "max_length=None. Set SFTConfig(max_length=...) (TRL's default is 1024)."
                )
            return int(args.max_length)

        def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, name):
            from flexpack.integrations.datasets import pack_dataset

            max_len = self._flexpack_max_len(args)
            if isinstance(dataset, _StreamedRows) or {"seq_lengths", "seqlens"} & set(
                _datasets_columns(dataset)
            ):
                # Packed already: TRL's evaluate prepares a dataset it is handed, and Trainer's
                # evaluate of a dict calls evaluate again on each prepared one. Packing rows
                # again would make each row one sample, its documents attending to each other.
                return dataset
            is_train = not self._flexpack_prepared_train  # TRL's __init__ prepares it first
            self._flexpack_prepared_train = True
            if not is_train and args.eval_packing is False:
                # TRL's unpacked preparation (truncated to max_length): each sample its own row
                dataset = base._prepare_dataset(
                    self, dataset, processing_class, args, False, formatting_func, name
                )
                keep = [c for c in ("input_ids", "labels") if c in _datasets_columns(dataset)]
                return dataset.select_columns(keep) if keep else dataset
            strategy = args.packing_strategy
            if strategy not in _SFT_STRATEGIES:
                raise ValueError(
                    f"flexpack's SFTTrainer packs with packing_strategy 'bfd', 'bfd_split' or "
                    f"'wrapped' (TRL's), got {strategy!r}."
                )
            strategy, overflow = _SFT_STRATEGIES[strategy]
            streaming = isinstance(dataset, _datasets().IterableDataset)
            if overflow != "truncate" or streaming:
                # TRL's unpacked path truncates to max_length: not here. A stream is cut while
                # it is packed, where the tokens cut off are counted (_StreamedRows).
                args = copy.copy(args)
                args.max_length = None
            # TRL's own preparation as for unpadded training: tokenize, labels, truncation.
            dataset = base._prepare_dataset(
                self, dataset, processing_class, args, False, formatting_func, name
            )
            if streaming:
                # Every rank reads the whole stream; the rows are dealt to the ranks here (and
                # only here: _flexpack_stream_loader keeps accelerate from sharding them again).
                return _StreamedRows(
                    dataset, max_len, strategy=strategy, overflow=overflow,
                    truncation_mode=args.truncation_mode, buffer_size=self.flexpack_buffer_size,
                    pad_id=self._tokenizer.pad_token_id or 0,
                    rank=args.process_index, world_size=args.world_size,
                )  # fmt: skip
            if not isinstance(dataset, _datasets().Dataset):
                raise TypeError(
                    f"flexpack's SFTTrainer packs a datasets.Dataset or datasets.IterableDataset; "
                    f"the {name} dataset is a {type(dataset).__name__}."
                )
            packed = pack_dataset(
                dataset, max_len, labels_column="labels", strategy=strategy, overflow=overflow,
                seed=args.seed, num_proc=args.dataset_num_proc,
            )  # fmt: skip
            return packed.rename_column("seqlens", "seq_lengths")  # TRL's name for the column

        def _set_signature_columns_if_needed(self) -> None:
            base._set_signature_columns_if_needed(self)
            if "seqlens" not in self._signature_columns:  # the packed rows' document lengths
                self._signature_columns = [*self._signature_columns, "seqlens"]

        def get_train_dataloader(self) -> Any:
            if isinstance(self.train_dataset, _StreamedRows):
                return self._flexpack_stream_loader(self.train_dataset, self._train_batch_size)
            return base.get_train_dataloader(self)

        def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
            dataset = eval_dataset
            if isinstance(dataset, str):
                dataset = self.eval_dataset[dataset]
            elif dataset is None:
                dataset = self.eval_dataset
            if isinstance(dataset, _StreamedRows):
                return self._flexpack_stream_loader(dataset, self.args.eval_batch_size)
            return base.get_eval_dataloader(self, eval_dataset)

        def _flexpack_stream_loader(self, rows: _StreamedRows, batch_size: int) -> Any:
            """A DataLoader over streamed rows, prepared by accelerate as for one process.

            accelerate shards an IterableDataset across processes itself (IterableDatasetShard,
            which completes the last batch with rows from the first: samples twice); the rows
            are already this rank's (``_StreamedRows`` deals them), so it must not: the loader
            gets accelerate's device placement and end-of-data signal, not its split."""
            from accelerate.data_loader import prepare_data_loader

            args, acc = self.args, self.accelerator
            extra = {}
            if args.dataloader_num_workers > 0:
                extra["persistent_workers"] = args.dataloader_persistent_workers
                if args.dataloader_prefetch_factor is not None:
                    extra["prefetch_factor"] = args.dataloader_prefetch_factor
            loader = torch.utils.data.DataLoader(
                rows, batch_size=batch_size, collate_fn=_StreamCollator(self.data_collator),
                num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory,
                **extra,
            )  # fmt: skip
            return prepare_data_loader(
                loader, acc.device, num_processes=1, process_index=0,
                put_on_device=acc.device_placement, rng_types=None, dispatch_batches=False,
                non_blocking=acc.non_blocking, use_stateful_dataloader=acc.use_stateful_dataloader,
            )  # fmt: skip

        def train(self, *args: Any, **kwargs: Any) -> Any:
            """TRL's ``train`` with the model on flexpack attention, restored when it returns
            (gradient checkpointing recomputes layers with the implementation current then)."""
            from flexpack.integrations.transformers import register

            with _attn_implementation(_inner(self.model), register()):
                return base.train(self, *args, **kwargs)

        def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
            """TRL's ``evaluate`` on packed rows, with the model on flexpack attention."""
            from flexpack.integrations.transformers import register

            with _attn_implementation(_inner(self.model), register()):
                return base.evaluate(self, *args, **kwargs)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            """TRL's ``compute_loss`` (its fused LM head over the packed rows), plus flexpack's
            counts; TRL's ``num_tokens`` counts the rows' real tokens, not their padding."""
            mode = "train" if self.model.training else "eval"
            truncated = inputs.pop("flexpack_truncated", None)  # a streamed set's lost tokens
            counted = self._flexpack_count(inputs, mode, truncated)
            before = self._total_train_tokens
            if self.flexpack_reduction == "document" and "doc_ids" in inputs:
                weight, documents = _document_weights(inputs["labels"], inputs["doc_ids"])
                model = _DocumentWeighted(model, weight)
                if num_items_in_batch is None:  # evaluation: this micro-batch's documents
                    num_items_in_batch = documents
            out = base.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
            if counted is not None and mode == "train":
                self._total_train_tokens = before + counted // self._tp_size
                self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
            return out

        def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> Any:
            """TRL's count of supervised tokens over the accumulated micro-batches (and ranks),
            or of documents with ``reduction="document"``."""
            if self.flexpack_reduction != "document" or not all(
                "doc_ids" in b and "labels" in b for b in batch_samples
            ):
                return base._get_num_items_in_batch(self, batch_samples, device)
            total = sum(_document_weights(b["labels"], b["doc_ids"])[1] for b in batch_samples)
            total = torch.as_tensor(total, device=device)
            if self.args.average_tokens_across_devices and self.args.world_size > 1:
                total = self.accelerator.gather(total).sum()
            return total

        def _flexpack_count(
            self, inputs: dict[str, Any], mode: str, truncated: Tensor | None = None
        ) -> int | None:
            """Count the micro-batch into the stats and TRL's metrics; its real tokens."""
            doc_ids, pos = inputs.get("doc_ids"), inputs.get("position_ids")
            if not isinstance(doc_ids, Tensor) or not isinstance(pos, Tensor):
                return None  # a collator of the user's own
            R, S = doc_ids.shape
            real = doc_ids >= 0
            docs = (doc_ids.amax(1) + 1).clamp(min=0).sum()
            longest = torch.where(real, pos, 0).amax() + 1
            lost = docs.new_tensor(0) if truncated is None else truncated.to(docs)
            local = torch.stack(
                [docs.new_tensor(R), docs.new_tensor(R * S), docs, real.sum(), docs * longest, lost]
            )
            rows, slots, docs, tokens, padded, lost = (
                self.accelerator.gather_for_metrics(local[None]).sum(0).tolist()
            )  # one host sync, as TRL's own metrics
            if mode == "train":
                s = self.flexpack_stats
                s.steps += 1
                s.rows, s.documents, s.tokens = s.rows + rows, s.documents + docs, s.tokens + tokens
                s.row_tokens, s.padded_tokens = s.row_tokens + slots, s.padded_tokens + padded
                s.truncated += lost
            metrics = self._metrics[mode]
            metrics["flexpack/rows"].append(float(rows))
            metrics["flexpack/fill"].append(tokens / max(slots, 1))
            metrics["flexpack/tokens"].append(float(tokens))
            metrics["flexpack/padding_removed"].append(float(max(padded - slots, 0)))
            if truncated is not None:
                metrics["flexpack/truncated"].append(float(lost))
            return int(tokens)

    SFTTrainer.__module__ = __name__
    SFTTrainer.__qualname__ = "SFTTrainer"
    return SFTTrainer


def _datasets():
    import datasets

    return datasets


def _datasets_columns(dataset: Any) -> list[str]:
    """Column names of a ``datasets.Dataset`` or ``IterableDataset`` (None when unknown: [])."""
    return list(getattr(dataset, "column_names", None) or [])


@functools.cache
def _classes() -> dict[str, type]:
    trl = _import_trl()
    return {
        "GRPOTrainer": _grpo_like(
            trl.GRPOTrainer, "GRPOTrainer", _GRPO_DOC.format(base="GRPOTrainer")
        ),
        "RLOOTrainer": _grpo_like(
            trl.RLOOTrainer, "RLOOTrainer", _GRPO_DOC.format(base="RLOOTrainer")
        ),
        "DPOTrainer": _dpo_class(),
        "SFTTrainer": _sft_class(),
    }


def __getattr__(name: str) -> type:
    # The trainer classes subclass trl's, so they exist once trl is imported: on first access.
    if name in ("GRPOTrainer", "RLOOTrainer", "DPOTrainer", "SFTTrainer"):
        return _classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
