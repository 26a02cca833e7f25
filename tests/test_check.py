"""flexpack.check: a packed row against each document alone, on a probe of the user's model.

Differential, as the model zoo: the verdicts are what the models do (a tiny Llama and a tiny
Mamba are exact, GPT-1 is refused by name, a token mixer flexpack has never seen is named by its
module path, whether it is a module, a forward patched on a class or an instance, a hook or
code that runs only in training), the verdict is kept per object until the object changes, and
the verified table round-trips through its writer and reader (it never replaces a run).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
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


def _leaky_forward(mlp: torch.nn.Module):
    """An instance forward for a LlamaMLP that adds a running sum over the row: a leak."""
    return types.MethodType(lambda self, x: type(self).forward(self, x) + x.cumsum(1), mlp)


class TrainingOnlyMixer(torch.nn.Module):
    """Wraps an MLP; mixes tokens across the row only while training."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.mlp(x)
        return out + 0.3 * x.cumsum(dim=1) if self.training else out


def test_tiny_llama_is_exact():
    model = tiny_llama()
    report = flexpack.check(model)
    assert report.model == "LlamaForCausalLM"
    assert report.transformers == transformers.__version__
    assert report.flexpack == flexpack.__version__
    assert (report.probe, report.documents, report.tokens, report.cached) == (
        "model",
        5,
        100,
        False,
    )
    # the scan chunk (64) crossed after an 11-token document; a 1-token document
    assert report.lengths == (11, 65, 14, 1, 9) and report.not_crossed == ()
    assert report.max_abs_diff < 1e-5 and report.seconds > 0
    assert report.training and report.layers == 2
    assert str(report).startswith("LlamaForCausalLM: exact on packed rows (5 documents, 100 tokens")
    assert "the model itself in float64, training mode" in str(report)
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.cached = True


def test_second_call_is_cached():
    model = tiny_llama()
    first = flexpack.check(model, force=True)
    second = flexpack.check(model)
    assert second.cached and not first.cached
    assert second.max_abs_diff == first.max_abs_diff and second.probe == "model"
    assert second.seconds < first.seconds
    assert "cached" in str(second)
    # another object of the same class and config is run, not answered from the first's verdict
    other = tiny_llama()
    assert not flexpack.check(other).cached
    other.model.layers[0].mlp.forward = _leaky_forward(other.model.layers[0].mlp)
    with pytest.raises(ValueError, match=r"`model\.layers\.0\.mlp` \(LlamaMLP\)"):
        flexpack.check(other)
    assert flexpack.check(model).cached  # the first model's verdict is its own


@pytest.mark.parametrize("training", [True, False], ids=["training", "eval"])
def test_the_users_model_is_left_as_it_was(training):
    from flexpack.check import _State

    model = tiny_llama(attn_implementation="sdpa", attention_dropout=0.25).train(training)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = {n: (p, p.data_ptr()) for n, p in model.named_parameters()}
    attributes = [(m, dict(m.__dict__)) for m in model.modules()]
    state, rng = _State(model), torch.get_rng_state()
    flexpack.check(model)
    assert state.matches(model) and torch.equal(torch.get_rng_state(), rng)
    assert model.config._attn_implementation == "sdpa" and model.config.attention_dropout == 0.25
    assert model.model.layers[0].self_attn.attention_dropout == 0.25
    assert model.training == training and next(model.parameters()).dtype == torch.float32
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all(dict(m.__dict__).keys() == d.keys() for m, d in attributes)
    for n, p in model.named_parameters():
        assert p is params[n][0] and p.data_ptr() == params[n][1], n
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
    report = flexpack.check(model)
    assert (report.model, report.documents) == ("MambaForCausalLM", 5)
    assert report.max_abs_diff < 1e-5
    assert not any(mixers.is_adapted(m) for m in model.modules())


def test_the_flattened_path_is_judged_on_the_model_as_it_is():
    """transformers' own padding-free rows (position_ids only): a Llama on sdpa is exact there
    (transformers finds the documents in the positions), RWKV loaded with register() is not
    (no flexpack code runs in its forward to adapt its recurrence) until it is adapted, and the
    report names the fix; flexpack's own kwargs are exact on all of them."""
    from flexpack import mixers
    from flexpack.integrations._tiny import tiny_config
    from flexpack.integrations.transformers import register

    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    llama.set_attn_implementation("sdpa")
    assert flexpack.check(llama).flattened == "exact"
    rwkv = transformers.AutoModelForCausalLM.from_config(
        tiny_config(transformers.RwkvConfig(), register())
    )
    report = flexpack.check(rwkv)
    assert report.max_abs_diff < 1e-5  # flexpack's kwargs
    assert report.flattened.startswith("not exact") and "flexpack.mixers.adapt" in report.flattened
    assert "rwkv.blocks.0" in report.flattened and "DataCollatorWithFlattening" in str(report)
    assert not any(mixers.is_adapted(m) for m in rwkv.modules())  # left as it was
    mixers.adapt(rwkv)
    assert flexpack.check(rwkv).flattened == "exact"


def test_a_hybrid_model_is_adapted_and_exact():
    """Qwen3.5: gated delta rule layers beside attention layers, one of each."""
    from flexpack.integrations._tiny import tiny_config

    config = tiny_config(transformers.Qwen3_5TextConfig())
    assert sorted(set(config.layer_types)) == ["full_attention", "linear_attention"]
    torch.manual_seed(0)
    report = flexpack.check(transformers.Qwen3_5ForCausalLM(config))
    assert (report.model, report.probe, report.documents) == ("Qwen3_5ForCausalLM", "model", 5)
    assert report.max_abs_diff < 1e-5


def test_a_model_on_the_meta_device_is_probed_on_a_tiny_twin():
    """No weights to run (0.4 B parameters on the meta device): a model of its class built
    from a shrunk copy of its config runs, unless the model carries what that one would not."""
    config = transformers.LlamaConfig(hidden_size=2048, intermediate_size=5504,
                                      num_hidden_layers=6, num_attention_heads=16)  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    report = flexpack.check(model)
    assert report.probe == "tiny" and report.documents == 5
    assert "a tiny model of its class (its weights are on the meta device)" in str(report)
    model.model.layers[3].mlp.forward = _leaky_forward(model.model.layers[3].mlp)
    with pytest.raises(RuntimeError, match=r"code of its own on \['model\.layers\.3\.mlp'\]"):
        flexpack.check(model)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model.model.layers[1].mlp = RunningSum()
    with pytest.raises(RuntimeError, match=r"\['RunningSum'\].*Load its weights"):
        flexpack.check(model)


def test_a_large_model_runs_its_first_layers(monkeypatch):
    """Above FULL_LIMIT parameters the model itself runs its first layers (one of each kind,
    and every layer with code of its own) and the embedding rows the probe's tokens use."""
    monkeypatch.setattr(sys.modules["flexpack.check"], "FULL_LIMIT", 1000)
    model = tiny_llama(num_hidden_layers=4)
    report = flexpack.check(model)
    assert (report.probe, report.layers) == ("layers", 1)
    assert "its first 1 layers" in str(report)
    assert len(model.model.layers) == 4 and model.lm_head.weight.shape == (128, 32)
    model.model.layers[2].mlp.forward = _leaky_forward(model.model.layers[2].mlp)
    with pytest.raises(ValueError, match=r"`model\.layers\.2\.mlp` \(LlamaMLP\)"):
        flexpack.check(model)
    assert len(model.model.layers) == 4


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


def test_the_verified_table_never_replaces_a_run(tmp_path, monkeypatch):
    """A class the table lists as exact on the installed release is still run: the table is
    reported (report.verified), and a model of that class that leaks is found."""
    table = tmp_path / "verified.json"
    write_verified(table, {"LlamaForCausalLM": {transformers.__version__: "exact"}})
    monkeypatch.setattr(sys.modules["flexpack.check"], "_TABLE", table)
    report = flexpack.check(tiny_llama())
    assert (report.probe, report.verified, report.documents) == ("model", "exact", 5)
    model = tiny_llama()
    model.model.layers[1].mlp.forward = _leaky_forward(model.model.layers[1].mlp)
    with pytest.raises(ValueError, match=r"`model\.layers\.1\.mlp` \(LlamaMLP\)"):
        flexpack.check(model)


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
        (dict(probe="copy"), "probe must be one of \\('auto', 'model', 'layers', 'tiny'\\)"),
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


def test_a_forward_patched_on_the_class_is_run():
    model = tiny_llama()
    cls = type(model.model.layers[0].mlp)
    own = cls.forward
    cls.forward = lambda self, x: own(self, x) + x.cumsum(1)
    try:
        with pytest.raises(ValueError, match=r"`model\.layers\.0\.mlp` \(LlamaMLP\)"):
            flexpack.check(model)
    finally:
        cls.forward = own
    assert not flexpack.check(model).cached  # the class changed back: run again, exact


def test_a_forward_hook_is_run():
    model = tiny_llama()
    handle = model.model.layers[1].mlp.register_forward_hook(lambda m, a, out: out + out.cumsum(1))
    with pytest.raises(ValueError, match=r"`model\.layers\.1\.mlp` \(LlamaMLP\)"):
        flexpack.check(model)
    handle.remove()
    assert flexpack.check(model).max_abs_diff < 1e-5


def test_the_probe_runs_in_the_models_mode():
    """A module that mixes tokens only while training is found in training mode (the probe
    never calls .eval()); the same model in eval mode is exact. Dropout stays out of it."""
    model = tiny_llama(attention_dropout=0.5)
    model.model.layers[1].mlp = TrainingOnlyMixer(model.model.layers[1].mlp)
    with pytest.raises(ValueError, match=r"`model\.layers\.1\.mlp` \(TrainingOnlyMixer\)"):
        flexpack.check(model.train())
    report = flexpack.check(model.eval())
    assert not report.training and "eval mode" in str(report)
    assert model.model.layers[1].self_attn.attention_dropout == 0.5
    assert flexpack.check(tiny_llama(attention_dropout=0.5).train()).training  # exact, dropout 0


def _swap_weight(model):
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())


def _write_weight(model):
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(2)


def _swap_data(model):
    model.model.norm.weight.data = model.model.norm.weight.data.clone()


def _hook(model):
    model.model.layers[0].register_forward_pre_hook(lambda m, a: None)


def _forward(model):
    mlp = model.model.layers[1].mlp
    mlp.forward = types.MethodType(type(mlp).forward, mlp)


@pytest.mark.parametrize(
    "change",
    [_swap_weight, _write_weight, _swap_data, _hook, _forward, lambda m: m.eval(),
     lambda m: setattr(m.model.layers[0], "mlp", RunningSum())],
    ids=["parameter_replaced", "parameter_written", "data_swapped", "hook_added",
         "instance_forward", "eval_mode", "module_replaced"],
)  # fmt: skip
def test_a_verdict_is_dropped_when_the_object_changes(change):
    model = tiny_llama()
    flexpack.check(model)
    assert flexpack.check(model).cached
    change(model)
    try:
        assert not flexpack.check(model).cached
    except ValueError:  # RunningSum leaks: run again and found
        assert change.__name__ == "<lambda>"


def test_dynamic_rope_is_refused_by_name():
    """rope_type='dynamic' rescales a whole call by max(position_ids) + 1: a short document
    packed beside a long one differs from itself alone. The packed call refuses it, and check's
    lengths cross max_position_embeddings; a static scaling (linear) is exact."""
    from flexpack.integrations.transformers import packed_forward_kwargs, register

    rope = dict(rope_theta=10000.0, factor=2.0)
    dynamic = tiny_llama(
        max_position_embeddings=16, rope_parameters={"rope_type": "dynamic", **rope}
    )
    refused = r"llama model exact on packed rows: its RoPE is rope_type='dynamic'.*longer than 16"
    with pytest.raises(ValueError, match=refused):
        flexpack.check(dynamic)
    batch = flexpack.pack_sequences([torch.arange(3, 43), torch.arange(3, 9)], 48)
    dynamic.set_attn_implementation(register())
    with pytest.raises(ValueError, match="rope_type='dynamic'"), torch.no_grad():
        dynamic(**packed_forward_kwargs(batch, model=dynamic))
    with torch.no_grad():  # one document, unpacked: nothing to refuse
        dynamic(input_ids=torch.arange(3, 43)[None])
    linear = tiny_llama(
        max_position_embeddings=300, rope_parameters={"rope_type": "linear", **rope}
    )
    report = flexpack.check(linear)
    assert max(report.lengths) == 301 and report.max_abs_diff < 1e-5


def test_the_lengths_cross_the_configs_rules():
    from flexpack.check import _lengths

    assert _lengths(transformers.MistralConfig(sliding_window=100)) == ((11, 101, 14, 1, 9), ())
    lengths, missed = _lengths(transformers.MistralConfig(sliding_window=4096))
    assert lengths == (11, 65, 14, 1, 9) and missed == ("sliding_window=4096",)
    scaled = transformers.LlamaConfig(
        max_position_embeddings=40,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                         "original_max_position_embeddings": 10},
    )  # fmt: skip
    assert _lengths(scaled)[0] == (11, 65, 14, 1, 9)  # past 40 and 10, and the scan chunk
    assert _lengths(transformers.LlamaConfig())[0] == (11, 65, 14, 1, 9)  # no scaling: no limit


def test_check_leaves_flexpacks_own_state_as_it_was():
    """The probe adapts the hybrid model's mixers and marks its config seen; both are undone,
    so the model's own first packed forward (no model=) still adapts it and is exact."""
    from flexpack import mixers
    from flexpack.integrations._tiny import tiny_config
    from flexpack.integrations.transformers import packed_forward_kwargs, register

    config = tiny_config(transformers.Qwen3_5TextConfig(), register())
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config)
    batch = flexpack.pack_sequences([torch.arange(3, 20), torch.arange(5, 30)], 48)
    flexpack.check(model)
    assert not any(mixers.is_adapted(m) for m in model.modules())
    with torch.no_grad():
        row = model(**packed_forward_kwargs(batch)).logits
        model.set_attn_implementation("eager")
        alone = model(input_ids=torch.arange(5, 30)[None]).logits
    torch.testing.assert_close(row[0, 17:42], alone[0], atol=1e-4, rtol=1e-4)
