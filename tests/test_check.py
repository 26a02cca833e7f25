"""flexpack.check: a packed row against each document alone, on a probe of the user's model.

Differential, as the model zoo: the verdicts are what the models do (a tiny Llama and a tiny
Mamba are exact, GPT-1 is refused by name, a token mixer flexpack has never seen is named by its
module path), and the verified table round-trips through its writer and reader.
"""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flexpack  # noqa: E402
from flexpack.check import verified, write_verified  # noqa: E402

transformers.logging.set_verbosity_error()

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


@pytest.fixture(autouse=True)
def _fresh_verdicts():
    flexpack.clear_caches()  # verdicts are kept per process: each test starts without them
    yield
    flexpack.clear_caches()


def tiny_llama(**overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, **overrides}))


class RunningSum(torch.nn.Module):
    """A token mixer flexpack has never seen: a running sum over the sequence, (B, S, H)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.cumsum(dim=1)


class CausalConv(torch.nn.Module):
    """A depthwise causal conv of width 3 (B, S, H) -> (B, S, H): its window crosses documents."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width, 1, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.conv1d(
            x.transpose(1, 2), self.weight, padding=2, groups=x.shape[-1]
        )
        return y[..., : x.shape[1]].transpose(1, 2)


class ShiftThenProject(torch.nn.Module):
    """Mixes tokens in its own code (no module of its own does), then runs a Linear: the Linear
    is the first module whose output differs, and the error blames the code before it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shifted = torch.cat([x[:, :1], x[:, :-1]], dim=1)  # each token gets its predecessor's
        return self.proj(shifted)


def test_tiny_llama_is_exact():
    model = tiny_llama()
    report = flexpack.check(model, force=True)  # force: run the probe, not the verified table
    assert report.model == "LlamaForCausalLM"
    assert report.transformers == transformers.__version__
    assert report.flexpack == flexpack.__version__
    assert (report.probe, report.documents, report.tokens, report.cached) == ("copy", 3, 34, False)
    assert report.max_abs_diff < 1e-5 and report.seconds > 0
    assert str(report).startswith("LlamaForCausalLM: exact on packed rows (3 documents, 34 tokens")
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.cached = True


def test_second_call_is_cached():
    model = tiny_llama()
    first = flexpack.check(model, force=True)
    second = flexpack.check(model)
    assert second.cached and not first.cached
    assert second.max_abs_diff == first.max_abs_diff and second.probe == "copy"
    assert second.seconds < first.seconds
    assert "cached" in str(second)
    # another configuration of the same class is checked again, not answered from the cache
    assert not flexpack.check(tiny_llama(hidden_size=48), force=True).cached


def test_the_users_model_is_left_as_it_was():
    model = tiny_llama(attn_implementation="sdpa")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flexpack.check(model, force=True)
    assert model.config._attn_implementation == "sdpa"
    assert model.training and next(model.parameters()).dtype == torch.float32
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize(
    ("mixer", "named"),
    [
        (lambda: RunningSum(), r"`model\.layers\.1\.mlp` \(RunningSum\)"),
        (lambda: CausalConv(32), r"`model\.layers\.1\.mlp` \(CausalConv\)"),
    ],
    ids=["running_sum", "causal_conv"],
)
def test_an_unknown_token_mixer_is_named_by_its_path(mixer, named):
    model = tiny_llama()
    model.model.layers[1].mlp = mixer()
    # not force: LlamaForCausalLM is in the verified table, but this one has a module of its own
    with pytest.raises(ValueError, match=named) as error:
        flexpack.check(model)
    assert "Its input matches: this module mixes tokens across documents" in str(error.value)
    with pytest.raises(ValueError, match=named):  # the verdict is kept: raised again
        flexpack.check(model)


def test_tokens_mixed_in_a_modules_own_code_are_blamed_on_that_code():
    model = tiny_llama()
    model.model.layers[0].mlp = ShiftThenProject(32)
    with pytest.raises(ValueError, match=r"`model\.layers\.0\.mlp\.proj` \(Linear\)") as error:
        flexpack.check(model)
    assert "code of `model.layers.0.mlp` (ShiftThenProject) that runs before it" in str(error.value)


def test_a_refused_model_raises_the_refusal():
    """GPT-1 writes its attention out: flexpack refuses it by name, and check() says so."""
    config = transformers.OpenAIGPTConfig(vocab_size=128, n_positions=64, n_embd=32, n_layer=2,
                                          n_head=4)  # fmt: skip
    model = transformers.OpenAIGPTLMHeadModel(config)
    with pytest.raises(ValueError, match=r"own_attention \(OpenAIGPTLMHeadModel"):
        flexpack.check(model)
    with pytest.raises(ValueError, match="own_attention"):
        flexpack.check(model)


def test_a_pure_ssm_is_adapted_and_exact():
    """Mamba never calls an attention function: check() adapts its mixers on the probe (as
    packed_forward_kwargs(model=...) does), never on the user's model."""
    from flexpack import mixers

    config = transformers.MambaConfig(vocab_size=128, hidden_size=32, state_size=8,
                                      num_hidden_layers=2, conv_kernel=4, expand=2)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MambaForCausalLM(config)
    report = flexpack.check(model, force=True)
    assert (report.model, report.documents) == ("MambaForCausalLM", 3)
    assert report.max_abs_diff < 1e-5
    assert not any(mixers.is_adapted(m) for m in model.modules())


def test_a_hybrid_model_is_adapted_and_exact():
    """Qwen3.5: gated delta rule layers beside attention layers, one of each."""
    from flexpack.integrations._tiny import tiny_config

    config = tiny_config(transformers.Qwen3_5TextConfig())
    assert sorted(set(config.layer_types)) == ["full_attention", "linear_attention"]
    torch.manual_seed(0)
    report = flexpack.check(transformers.Qwen3_5ForCausalLM(config), force=True)
    assert (report.model, report.probe, report.documents) == ("Qwen3_5ForCausalLM", "copy", 3)
    assert report.max_abs_diff < 1e-5


def test_a_large_model_is_probed_on_a_tiny_twin():
    """A model too large to copy (here: on the meta device, 0.4 B parameters) is probed on a
    model of its class built from a shrunk copy of its config."""
    config = transformers.LlamaConfig(hidden_size=2048, intermediate_size=5504,
                                      num_hidden_layers=6, num_attention_heads=16)  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    report = flexpack.check(model, force=True)
    assert report.probe == "tiny" and report.documents == 3
    assert "a tiny float64 twin" in str(report)


def test_the_tiny_twin_warns_about_modules_it_does_not_have():
    model = tiny_llama()
    model.model.layers[1].mlp = RunningSum()
    with pytest.warns(UserWarning, match=r"\['RunningSum'\].*probe='copy'"):
        flexpack.check(model, probe="tiny")


def test_the_verified_table_round_trips(tmp_path):
    path = tmp_path / "verified.json"
    write_verified(path, {"LlamaForCausalLM": {"5.25.0": "exact"}})
    write_verified(path, {"OpenAIGPTLMHeadModel": {"5.25.0": "refused"},
                          "LlamaForCausalLM": {"5.24.0": "exact"}})  # fmt: skip
    assert verified("LlamaForCausalLM", "5.25.0", path=path) == "exact"  # merged, kept
    assert verified("LlamaForCausalLM", "5.24.0", path=path) == "exact"
    assert verified("OpenAIGPTLMHeadModel", "5.25.0", path=path) == "refused"
    assert verified("LlamaForCausalLM", "4.0.0", path=path) is None
    assert verified("NoSuchModel", "5.25.0", path=path) is None
    table = json.loads(path.read_text())
    assert table["flexpack"] == flexpack.__version__
    write_verified(path, {"Qwen3ForCausalLM": {"5.25.0": "exact"}}, merge=False)
    assert verified("LlamaForCausalLM", "5.25.0", path=path) is None
    # a table written by another flexpack version says nothing
    path.write_text(json.dumps({**table, "flexpack": "0.0.0-other"}))
    write_verified(tmp_path / "other.json", {})  # (any write forgets the tables read so far)
    assert verified("LlamaForCausalLM", "5.25.0", path=path) is None
    with pytest.raises(ValueError, match="'exact', 'refused'"):
        write_verified(path, {"LlamaForCausalLM": {"5.25.0": "leaks"}})


def test_a_verified_class_skips_the_probe(tmp_path, monkeypatch):
    """A transformers class the table lists as exact on the installed release: nothing runs,
    unless force=True; a model with a module of its own is probed whatever the table says."""
    import sys

    table = tmp_path / "verified.json"
    write_verified(table, {"LlamaForCausalLM": {transformers.__version__: "exact"}})
    monkeypatch.setattr(sys.modules["flexpack.check"], "_TABLE", table)
    report = flexpack.check(tiny_llama())
    assert (report.probe, report.max_abs_diff, report.documents) == ("table", None, 0)
    assert "verified table" in str(report) and "force=True" in str(report)
    assert flexpack.check(tiny_llama(), force=True).probe == "copy"


def test_the_shipped_table_is_well_formed():
    from importlib.resources import files

    table = json.loads((files("flexpack") / "assets" / "verified_models.json").read_text())
    assert set(table) == {"flexpack", "models"} and table["models"]
    for name, by_version in table["models"].items():
        assert name.isidentifier(), name  # a class name: type(model).__name__
        assert set(by_version.values()) <= {"exact", "refused"}, name


def test_bad_input_says_what_was_expected():
    with pytest.raises(TypeError, match=r"a torch\.nn\.Module with a config.*got str"):
        flexpack.check("meta-llama/Llama-3.2-1B")
    with pytest.raises(TypeError, match="got a Linear without a transformers config"):
        flexpack.check(torch.nn.Linear(2, 2))
    model = tiny_llama()
    for bad, match in (
        (dict(atol=-1.0), "atol must be a number >= 0"),
        (dict(rtol=float("nan")), "rtol must be a number >= 0"),
        (dict(probe="deep"), "probe must be 'auto', 'copy' or 'tiny'"),
        (dict(lengths=(5,)), "at least 2 document lengths"),
    ):
        with pytest.raises(ValueError, match=match):
            flexpack.check(model, **bad)


def test_warnings_of_the_probe_stay_inside():
    """The probe's own warnings (its attention is set on a copy) do not reach the caller."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flexpack.check(tiny_llama(), force=True)


def test_first_forward_outside_the_verified_range_runs_the_check(monkeypatch):
    """On a transformers release flexpack was not verified on, the first forward of a model
    under flexpack's attention runs flexpack.check: a token mixer flexpack does not know is
    refused with the module named, a plain model runs (its verdict cached once)."""
    from flexpack.integrations import _mixers_check
    from flexpack.integrations.transformers import packed_forward_kwargs, register

    monkeypatch.setattr(_mixers_check, "VERIFIED_TRANSFORMERS", ("5.0.0", "5.1.0"))
    assert _mixers_check.outside_verified()
    assert not _mixers_check.outside_verified("5.0.3")
    batch = flexpack.pack_sequences([torch.arange(3, 14), torch.arange(3, 12)], 24)

    plain = tiny_llama(attn_implementation=register())
    with torch.no_grad():
        plain(**packed_forward_kwargs(batch))  # checked (or listed in the table): runs

    leaky = tiny_llama(attn_implementation=register())
    leaky.model.layers[1].mlp = RunningSum()
    with pytest.raises(ValueError, match=r"outside the verified range.*model\.layers\.1\.mlp"):
        with torch.no_grad():
            leaky(**packed_forward_kwargs(batch))
    monkeypatch.undo()
    _mixers_check._checked.clear()
