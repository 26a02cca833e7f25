"""flexpack.check's verdict equals the truth, on tiny models patched at random.

The truth is computed apart from check: the packed row through flexpack's path
(``attn_implementation=register()``, ``packed_forward_kwargs(batch, model=model)``) against each
document alone under ``eager``, fp32 logits within 1e-3, and the model's rotary tables for the
packed positions against each document's own (transformers' dynamic and longrope RoPE rescale a
whole call by its longest position). A refusal of the packed call counts as "not exact" only
where the rotary tables do differ: flexpack may refuse only what is not exact.

Patches (each leaky or harmless): a forward patched on the class (undone after the example), a
forward set on an instance, a forward hook, a module that mixes tokens only while training; and
RoPE configs (default, linear, yarn, dynamic, longrope) with small thresholds, in training or
eval mode.
"""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

import flexpack  # noqa: E402
from flexpack.integrations.transformers import packed_forward_kwargs, register  # noqa: E402

transformers.logging.set_verbosity_error()

PATCHES = ("none", "class", "instance", "hook", "training_only")
ROPES = ("default", "linear", "yarn", "dynamic", "longrope")


class TrainingOnly(torch.nn.Module):
    """Wraps an MLP; while training, adds ``mix`` x (a running sum over the row, or the input)."""

    def __init__(self, mlp: torch.nn.Module, leaky: bool) -> None:
        super().__init__()
        self.mlp, self.leaky = mlp, leaky

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.mlp(x)
        if not self.training:
            return out
        return out + 0.3 * (x.cumsum(dim=1) if self.leaky else x)


def _extra(x: torch.Tensor, leaky: bool) -> torch.Tensor:
    return 0.3 * (x.cumsum(dim=1) if leaky else x)  # (B, S, H): across the row, or per token


@st.composite
def scenarios(draw):
    rope = draw(st.sampled_from(ROPES))
    limit = draw(st.integers(8, 40))  # the RoPE's length threshold: crossed by both sides
    return dict(
        patch=draw(st.sampled_from(PATCHES)),
        leaky=draw(st.booleans()),
        layer=draw(st.integers(0, 1)),
        training=draw(st.booleans()),
        rope=rope,
        limit=limit,
        seed=draw(st.integers(0, 2**16)),
    )


def _model(rope: str, limit: int, seed: int) -> torch.nn.Module:
    params: dict = {"rope_type": rope, "rope_theta": 10000.0}
    mpe = 2048
    if rope in ("linear", "dynamic", "yarn"):
        params["factor"] = 2.0
        mpe = limit
    if rope == "yarn":
        params["original_max_position_embeddings"] = limit
        mpe = 2 * limit
    if rope == "longrope":  # head_dim 8: 4 factors each
        params.update(short_factor=[1.0] * 4, long_factor=[1.5, 2.0, 3.0, 4.0],
                      original_max_position_embeddings=limit)  # fmt: skip
        mpe = 4 * limit
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=mpe,
        rope_parameters=params,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def _rotary_exact(model: torch.nn.Module, lengths: list[int]) -> bool:
    rotary = model.model.rotary_emb
    x = torch.zeros(1, 1)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cos, sin = rotary(x, positions)
    start = 0
    for n in lengths:
        cos_alone, sin_alone = rotary(x, torch.arange(n)[None])
        for row, alone in ((cos, cos_alone), (sin, sin_alone)):
            if not torch.allclose(row[:, start : start + n], alone, atol=1e-6):
                return False
        start += n
    return True


def _truth(model: torch.nn.Module, lengths: list[int]) -> bool:
    """Whether each document of a packed row gets, in the model's mode, what it gets alone."""
    g = torch.Generator().manual_seed(1)
    documents = [torch.randint(3, 100, (n,), generator=g) for n in lengths]
    batch = flexpack.pack_sequences(documents, sum(lengths) + 4)
    rotary = _rotary_exact(model, lengths)
    with torch.no_grad():
        model.set_attn_implementation(register())
        try:
            row = model(**packed_forward_kwargs(batch, model=model)).logits
        except ValueError:
            assert not rotary, "flexpack refused a model whose documents get what they get alone"
            return False
        model.set_attn_implementation("eager")
        start = 0
        for doc in documents:
            alone = model(input_ids=doc[None], use_cache=False).logits
            if not torch.allclose(row[:, start : start + len(doc)], alone, atol=1e-3, rtol=1e-3):
                return False
            start += len(doc)
    return rotary


@settings(max_examples=15, deadline=None)
@given(scenarios())
def test_checks_verdict_is_the_truth(case):
    flexpack.clear_caches()
    model = _model(case["rope"], case["limit"], case["seed"]).train(case["training"])
    mlp = model.model.layers[case["layer"]].mlp
    leaky, patch = case["leaky"], case["patch"]
    cls = type(mlp)
    own = cls.forward
    if patch == "class":
        cls.forward = lambda self, x: own(self, x) + _extra(x, leaky)
    elif patch == "instance":
        mlp.forward = types.MethodType(lambda self, x: own(self, x) + _extra(x, leaky), mlp)
    elif patch == "hook":
        mlp.register_forward_hook(lambda module, args, out: out + _extra(args[0], leaky))
    elif patch == "training_only":
        model.model.layers[case["layer"]].mlp = TrainingOnly(mlp, leaky)
    try:
        try:
            flexpack.check(model)
            verdict = True
        except ValueError:
            verdict = False
        # lengths of the truth's own: past the RoPE threshold, beside shorter ones and 1 token
        truth = _truth(model, [11, case["limit"] + 5, 6, 1])
    finally:
        cls.forward = own
    assert verdict == truth, case
