"""A tree ``flexpack_mask`` reaches a model only where flexpack's code reads it.

``model(**packed_forward_kwargs(tree_batch, model=model))`` is the documented call for prefix
trees (docs/trees.md). Handed the model, it makes the tree read or refuses the call:

- models without attention (RWKV, Mamba, Mamba2, Falcon-Mamba, xLSTM) get their mixers adapted,
  so each rollout's log-probs equal the rollout run alone through the plain model (before, the
  raw call ``model(..., flexpack_mask=mask)`` let the model's ``**kwargs`` swallow the mask:
  log-probs off by 0.4 to 1.2);
- models with attention that is not flexpack's (Llama on sdpa, Qwen3.5, LFM2) raise a
  ValueError that names ``register()``, and are left as they were;
- a model loaded with ``attn_implementation=register()`` (Llama, and LFM2's convs beside its
  attention) gives each rollout its own log-probs.

References: each rollout (its prompt and completion) alone through the plain model, eager.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flexpack  # noqa: E402
import flexpack.mixers as fm  # noqa: E402
from flexpack.integrations._tiny import tiny_config  # noqa: E402
from flexpack.integrations.transformers import packed_forward_kwargs, register  # noqa: E402

ATTENTION_FREE = {"rwkv": "RwkvConfig", "mamba": "MambaConfig", "mamba2": "Mamba2Config",
                  "falcon_mamba": "FalconMambaConfig", "xlstm": "xLSTMConfig"}  # fmt: skip
# plain attention, and hybrids whose attention sits beside gated delta / conv mixers
WITH_ATTENTION = {"llama": "LlamaConfig", "qwen3_5": "Qwen3_5TextConfig", "lfm2": "Lfm2Config"}


def tiny(config_name: str, attn_implementation: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_config(getattr(transformers, config_name)(), attn_implementation)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def rollouts() -> list[tuple[list[int], list[list[int]]]]:
    """Two groups: a prompt and its completions (3 and 2 of them, 1 to 7 tokens)."""
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(3, 100, (n,), generator=g).tolist()

    return [(ids(9), [ids(5), ids(1), ids(7)]), (ids(13), [ids(4), ids(6)])]


def alone_logps(model: torch.nn.Module) -> list[torch.Tensor]:
    """log p(completion token | prompt, earlier completion tokens) of each rollout run alone,
    in ``pack_trees``' rollout order (groups in order, completions in order)."""
    out = []
    with torch.no_grad():
        for prompt, completions in rollouts():
            for completion in completions:
                ids = torch.tensor([prompt + completion])
                logits = model(input_ids=ids, use_cache=False).logits[0].double()
                predicting = logits[len(prompt) - 1 : -1].log_softmax(-1)  # (len(completion), V)
                out.append(predicting.gather(-1, torch.tensor(completion)[:, None])[:, 0])
    return out


def assert_each_rollout_alone(model: torch.nn.Module, want: list[torch.Tensor]) -> None:
    batch = flexpack.pack_trees(rollouts(), max_len=64)
    with torch.no_grad():
        logits = model(**packed_forward_kwargs(batch, model=model)).logits
    logps, valid = batch.gather_logps(logits.double())
    assert len(want) == logps.shape[0]
    for n, w in enumerate(want):
        assert int(valid[n].sum()) == len(w)
        torch.testing.assert_close(logps[n, : len(w)], w, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", sorted(ATTENTION_FREE))
def test_attention_free_model_reads_the_tree_through_packed_forward_kwargs(kind):
    """A model without attention, never adapted by hand: the kwargs call adapts its mixers, and
    each rollout's log-probs equal it alone."""
    model = tiny(ATTENTION_FREE[kind], "eager")
    want = alone_logps(model)
    assert not any(fm.is_adapted(model.get_submodule(p)) for p, _ in fm.mixers_of(model))
    assert_each_rollout_alone(model, want)
    assert all(fm.is_adapted(model.get_submodule(p)) for p, _ in fm.mixers_of(model))


@pytest.mark.parametrize("kind", sorted(WITH_ATTENTION))
def test_a_model_whose_attention_ignores_the_tree_is_refused_naming_register(kind):
    """sdpa takes flexpack_mask into its **kwargs and attends across the row: refused before
    the call, naming the fix, the model left unadapted."""
    model = tiny(WITH_ATTENTION[kind], "sdpa")
    batch = flexpack.pack_trees(rollouts(), max_len=64)
    with pytest.raises(ValueError, match=r"attn_implementation='sdpa'.*ignores flexpack_mask"):
        packed_forward_kwargs(batch, model=model)
    with pytest.raises(ValueError, match=r"set_attn_implementation\(register\(\)\)"):
        packed_forward_kwargs(batch, model=model)
    assert not any(fm.is_adapted(model.get_submodule(p)) for p, _ in fm.mixers_of(model))


@pytest.mark.parametrize("kind", ["llama", "lfm2"])
def test_a_model_on_flexpack_attention_gives_each_rollout_its_own_logps(kind):
    """The fix the refusal names: the same model switched to register()'s attention (LFM2's
    convs adapted beside it) gives each rollout the log-probs it has alone."""
    model = tiny(WITH_ATTENTION[kind], "eager")
    want = alone_logps(model)
    model.set_attn_implementation(register())
    assert_each_rollout_alone(model, want)


def test_a_tree_batch_with_labels_is_a_type_error_naming_gather_logps():
    batch = flexpack.pack_trees(rollouts(), max_len=64)
    with pytest.raises(TypeError, match="gather_logps"):
        packed_forward_kwargs(batch, labels=True)


def test_a_tree_batch_gives_its_mask_and_no_doc_ids():
    batch = flexpack.pack_trees(rollouts(), max_len=64)
    kwargs = packed_forward_kwargs(batch)
    assert sorted(kwargs) == ["flexpack_mask", "input_ids", "position_ids", "use_cache"]
    assert kwargs["flexpack_mask"].kind == "tree" and kwargs["use_cache"] is False
    assert torch.equal(kwargs["position_ids"], batch.position_ids)
