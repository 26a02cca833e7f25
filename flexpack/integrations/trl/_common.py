"""What every TRL trainer here shares: trl's import (the release whose seams it adapts), the model
inside the containers TRL and accelerate wrap it in, and the switch of a model's attention to
flexpack's for a block.

Nothing here knows trees or packing: ``sft`` imports it, and so does the tree forward
(``_forward``) that GRPO, RLOO and DPO run.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

from flexpack.integrations._mixers_check import has_attention

# The trainers' __module__: users import them from the package, and reprs and pickle name it.
PUBLIC_MODULE = __name__.rpartition(".")[0]  # "flexpack.integrations.trl"


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
