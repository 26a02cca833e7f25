"""flexpack.integrations.trl: TRL's GRPO / RLOO / DPO trainers with log-probs on prefix trees.

References are TRL's own code on the same model: its ``_get_per_token_logps_and_entropies``
(its fused LM head over padded rows) for the per-token tensors, and ``trl.GRPOTrainer`` /
``trl.DPOTrainer`` themselves for whole ``train()`` runs (losses and weights). Tiny random models
saved to a temporary directory and a word-level tokenizer: no downloads.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from flexpack.integrations import trl as ftrl  # noqa: E402
from flexpack.integrations.trl import dpo as fdpo  # noqa: E402
from flexpack.integrations.trl._trees import _pack_rows, _refuse_sharding  # noqa: E402
from flexpack.trees import pack_padded  # noqa: E402

V = 64
PAD, EOS = V, V + 1


@pytest.fixture(scope="module")
def tokenizer():
    vocab = {f"t{i}": i for i in range(V)} | {"<pad>": PAD, "</s>": EOS, "<unk>": V + 2}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


def tiny(kind: str = "llama", seed: int = 0):
    common = dict(
        vocab_size=V + 3, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=PAD, eos_token_id=EOS,
        initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(seed)
    if kind == "mistral":  # a window shorter than prompt + completion
        return transformers.MistralForCausalLM(
            transformers.MistralConfig(**common, sliding_window=3)
        )
    if kind == "gpt_oss":  # attention sinks, sliding and full layers, experts
        return transformers.GptOssForCausalLM(
            transformers.GptOssConfig(
                **common, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                sliding_window=3, layer_types=["sliding_attention", "full_attention"],
            )
        )  # fmt: skip
    if kind in HYBRIDS or kind in MOE:  # recurrent / conv mixers beside attention; experts
        from flexpack.integrations._tiny import tiny_config

        config = tiny_config(getattr(transformers, {**HYBRIDS, **MOE}[kind])())
        config.vocab_size, config.pad_token_id, config.eos_token_id = V + 3, PAD, EOS
        return transformers.AutoModelForCausalLM.from_config(config)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))


# short convs (LFM2), gated delta rule + conv (Qwen3.5), Mamba2 + conv (Bamba; Nemotron-H,
# Falcon-H1 and Granite 4 share the room)
HYBRIDS = {"lfm2": "Lfm2Config", "qwen3_5": "Qwen3_5TextConfig", "bamba": "BambaConfig",
           "falcon_h1": "FalconH1Config"}  # fmt: skip
MOE = {"qwen3_moe": "Qwen3MoeConfig", "mixtral": "MixtralConfig"}  # beside gpt-oss


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    for kind in ("llama", "mistral", "gpt_oss", *HYBRIDS, *MOE):
        tiny(kind).save_pretrained(path / kind)
    return path


def words(g, n):
    return " ".join(f"t{i}" for i in torch.randint(0, V, (n,), generator=g).tolist())


def reward(completions, **_):
    return [float(len(c) % 5) for c in completions]


def grpo_args(tmp_path, **overrides):
    kw = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=6, use_cpu=True, bf16=False, report_to=[], beta=0.1,
        num_iterations=2, gradient_accumulation_steps=2, max_steps=2, seed=0, logging_steps=1,
        save_strategy="no", learning_rate=1e-2, model_init_kwargs={"dtype": torch.float32},
    )  # fmt: skip
    kw.update(overrides)
    return trl.GRPOConfig(**kw)


def grpo(cls, model_dir, tokenizer, tmp_path, kind="llama", **overrides):
    g = torch.Generator().manual_seed(0)
    data = datasets.Dataset.from_dict({"prompt": [words(g, n) for n in (5, 9, 3, 7)]})
    return cls(
        model=str(model_dir / kind), reward_funcs=reward, train_dataset=data,
        args=grpo_args(tmp_path, **overrides), processing_class=tokenizer,
    )  # fmt: skip


def rl_batch(seed=0):
    """(B, P + C) ids and mask: left-padded prompts, right-padded completions of other lengths,
    rows sharing a prompt not contiguous and groups of 3, 2 and 1, one empty completion."""
    g = torch.Generator().manual_seed(seed)
    B, P, C = 7, 6, 5
    ids = torch.randint(0, V, (B, P + C), generator=g)
    mask = torch.ones(B, P + C, dtype=torch.long)
    ids[[0, 2, 5], :P] = ids[0, :P]
    ids[[1, 4], :P] = ids[1, :P]
    mask[[1, 4], :2] = 0
    mask[3, :4] = 0
    mask[6, :1] = 0
    for b, n in enumerate([5, 2, 4, 1, 5, 3, 0]):  # completion lengths
        mask[b, P + n :] = 0
    ids[mask == 0] = PAD
    return ids, mask, C


def seam_pair(trainer, model, ids, mask, C):
    ours = trainer._get_per_token_logps_and_entropies(model, ids, mask, C, compute_entropy=True)
    theirs = (
        type(trainer)
        .__mro__[2]
        ._get_per_token_logps_and_entropies(trainer, model, ids, mask, C, compute_entropy=True)
    )
    return ours, theirs


@pytest.mark.parametrize("kind", ["llama", "mistral", "gpt_oss"])
def test_grpo_per_token_logps_and_entropies_equal_trls(model_dir, tokenizer, tmp_path, kind):
    trainer = grpo(ftrl.GRPOTrainer, model_dir, tokenizer, tmp_path, kind=kind)
    own = "eager" if kind == "gpt_oss" else "sdpa"  # the user's (gpt-oss has no sdpa path)
    assert trainer.model.config._attn_implementation == own
    ids, mask, C = rl_batch()
    model = trainer.model
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            (lp, ent, _), (want_lp, want_ent, _) = seam_pair(trainer, model, ids, mask, C)
        assert lp.shape == want_lp.shape == (7, C) and lp.dtype == want_lp.dtype
        torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=0)
    # Gradients of a loss over log-probs and entropies, through the tree forward and TRL's.
    model.gradient_checkpointing_disable()
    w = torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))
    grads = []
    theirs = trl.GRPOTrainer._get_per_token_logps_and_entropies.__get__(trainer)
    for fn in (trainer._get_per_token_logps_and_entropies, theirs):
        model.zero_grad()
        lp, ent, _ = fn(model, ids, mask, C, compute_entropy=True)
        ((lp * w).sum() + 0.1 * ent.sum()).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    # The prompts ran once: 3 groups + a lone row + the empty one's prompt is not forwarded.
    assert trainer.flexpack_stats.tree_tokens < trainer.flexpack_stats.padded_tokens
    assert trainer.model.config._attn_implementation == own  # left as it was


@pytest.mark.parametrize("kind", ["gpt_oss", *MOE])
def test_grpo_router_aux_loss_on_trees_equals_trls(model_dir, tokenizer, tmp_path, kind):
    """gpt-oss, Qwen3-MoE and Mixtral with their router's load-balancing loss (TRL turns it on):
    every log-prob call fell back to TRL's padded path. The trees weigh each token by the rows
    that share it: the aux loss, its gradients and the log-probs equal TRL's padded forward; a
    row without completion tokens (its prompt is in no tree) falls back."""
    trainer = grpo(ftrl.GRPOTrainer, model_dir, tokenizer, tmp_path, kind=kind)
    assert trainer.aux_loss_enabled
    ids, mask, C = rl_batch()
    mask[6, -C : -C + 2] = 1  # the empty completion gets two tokens: every row is a rollout
    model = trainer.model
    model.gradient_checkpointing_disable()
    theirs = trl.GRPOTrainer._get_per_token_logps_and_entropies.__get__(trainer)
    w = torch.randn(7, C, generator=torch.Generator().manual_seed(1))
    results = []
    for fn in (trainer._get_per_token_logps_and_entropies, theirs):
        model.zero_grad()
        lp, _, aux = fn(model, ids, mask, C, batch_size=4, compute_aux_loss=True)
        ((lp * w).sum() + aux).backward()
        results.append((lp.detach(), aux.detach(), [p.grad.clone() for p in model.parameters()]))
    (lp, aux, grads), (want_lp, want_aux, want_grads) = results
    assert trainer.flexpack_stats.fallbacks == 0 and trainer.flexpack_stats.calls == 2
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(aux, want_aux, atol=1e-6, rtol=1e-6)
    for a, b in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    ids, mask, C = rl_batch()  # row 6 has no completion token
    with pytest.warns(UserWarning, match="no tree holds"):
        trainer._get_per_token_logps_and_entropies(model, ids, mask, C, compute_aux_loss=True)
    assert trainer.flexpack_stats.fallbacks == 1


def test_tree_token_counts_are_the_rows_holding_each_token():
    """TreeBatch.token_counts against the tree mask itself: a token's count is the number of
    rollouts whose last token attends to it; summed, the padded rows' real tokens."""
    for seed in range(4):
        ids, mask, C = rl_batch(seed)
        mask[6, -C : -C + 2] = 1
        ids[mask == 0] = PAD
        trees = pack_padded(ids[:, :-C], mask[:, :-C], ids[:, -C:], mask[:, -C:])
        batch = trees.batch
        counts = batch.token_counts()
        R, S = batch.shape
        mod = batch.mask().mask_mod
        keys = torch.arange(S)
        last = (batch.rollout_lengths - 1)[:, None]
        leaves = batch._targets[batch._rollout_targets.gather(1, last)[:, 0]]
        want = torch.zeros(R, S, dtype=torch.int64)
        for leaf in leaves.tolist():
            r, t = divmod(leaf, S)
            want[r] += mod(torch.tensor(r), torch.tensor(0), torch.tensor(t), keys).long()
        torch.testing.assert_close(counts, want)
        assert int(counts.sum()) == int(mask.sum())  # every real token of the rows, once each


def test_grpo_batch_size_chunks_as_trls(model_dir, tokenizer, tmp_path):
    """TRL's batch_size (its chunking of the no-grad passes, to bound their peak): the rows are
    packed and forwarded batch_size at a time, the same values as one call."""
    trainer = grpo(ftrl.GRPOTrainer, model_dir, tokenizer, tmp_path)
    ids, mask, C = rl_batch()
    with torch.no_grad():
        whole, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
        lp, ent, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, C, batch_size=3, compute_entropy=True
        )
        want, want_ent, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, ids, mask, C, batch_size=3, compute_entropy=True
        )
    torch.testing.assert_close(lp, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(lp, whole, atol=1e-5, rtol=0)
    assert trainer.flexpack_stats.calls == 1 + 3  # 7 rows: chunks of 3, 3, 1


def test_grpo_bf16_autocast_within_bf16_noise(model_dir, tokenizer, tmp_path):
    trainer = grpo(ftrl.GRPOTrainer, model_dir, tokenizer, tmp_path, bf16=True)
    ids, mask, C = rl_batch(1)
    with torch.no_grad():
        (lp, ent, _), (want_lp, want_ent, _) = seam_pair(trainer, trainer.model, ids, mask, C)
        with trainer.accelerator.autocast():
            assert torch.is_autocast_enabled("cpu")
    torch.testing.assert_close(lp, want_lp, atol=0.1, rtol=0)
    torch.testing.assert_close(ent, want_ent, atol=0.1, rtol=0)
    assert (lp - want_lp).abs().max() > 0  # really ran in bf16


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def grpo_as_trl(model_dir, tokenizer, tmp_path, **overrides):
    """TRL's GRPOTrainer and flexpack's trained alike for 2 steps: the losses and weights
    equal (1e-4). Returns (TRL's weights, flexpack's trainer)."""
    runs = {}
    for name, cls in (("trl", trl.GRPOTrainer), ("flexpack", ftrl.GRPOTrainer)):
        trainer = grpo(cls, model_dir, tokenizer, tmp_path / name, **overrides)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
        runs[name] = (losses(trainer), weights(trainer.model), trainer)
    (want, want_w, _), (got, got_w, ours) = runs["trl"], runs["flexpack"]
    assert len(got) == len(want) == 2
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)
    for k in want_w:
        torch.testing.assert_close(got_w[k], want_w[k], atol=1e-4, rtol=0, msg=k)
    return want_w, ours


@pytest.mark.parametrize(
    "over",
    # SGD for the second: Adam turns float noise on a ~0 gradient into a step of ~lr.
    [
        {},
        dict(
            num_iterations=1,
            gradient_accumulation_steps=1,
            steps_per_generation=2,
            optim="sgd",
            learning_rate=0.1,
        ),
    ],
    ids=["iterations", "steps_per_generation"],
)
def test_grpo_train_equals_trls_trainer(model_dir, tokenizer, tmp_path, over):
    """2 steps, beta > 0 (a reference model), num_iterations = 2, gradient accumulation 2; or
    one generation for 2 steps (steps_per_generation = 2: the old policy's log-probs are
    computed, in TRL's per-device batch_size chunks)."""
    want_w, ours = grpo_as_trl(model_dir, tokenizer, tmp_path, **over)
    moved = max((want_w[k] - weights(tiny())[k]).abs().max().item() for k in want_w)
    assert moved > 1e-3  # training changed the weights
    # policy (2 iterations), old policy and reference: all through trees, none fell back
    assert ours.flexpack_stats.calls >= 6 and ours.flexpack_stats.fallbacks == 0
    if over:  # 8 rows of one generation: old and reference log-probs in 2 chunks each
        assert ours.flexpack_stats.calls == 2 + 2 + 2
    assert ours.model.config._attn_implementation == "sdpa"  # restored after train()


@pytest.mark.parametrize("kind", sorted(HYBRIDS))
def test_grpo_on_hybrids_trains_on_trees_as_trl(model_dir, tokenizer, tmp_path, kind):
    """Recurrent and conv mixers on prefix trees: each completion's state starts from the end
    of its shared prompt's (the state forked, the conv window along the path). 2 steps
    (a reference model, 2 iterations, accumulation 2): losses and weights equal TRL's own
    trainer, every log-prob forward a tree (no fallback)."""
    _, ours = grpo_as_trl(model_dir, tokenizer, tmp_path, kind=kind)
    assert ours.flexpack_stats.calls >= 6 and ours.flexpack_stats.fallbacks == 0
    assert ours.flexpack_stats.tree_tokens < ours.flexpack_stats.padded_tokens


# every mixer kind with a tree form, beside the trained ones above
SEAM_HYBRIDS = {**HYBRIDS, "nemotron_h": "NemotronHConfig",
                "kimi_linear": "KimiLinearConfig", "jamba": "JambaConfig",
                "minimax": "MiniMaxConfig", "zaya": "ZayaConfig",
                "recurrent_gemma": "RecurrentGemmaConfig", "qwen3_next": "Qwen3NextConfig",
                "olmo_hybrid": "OlmoHybridConfig", "xlstm": "xLSTMConfig",
                # no attention at all: nothing to switch, the mixers read the trees
                "rwkv": "RwkvConfig", "mamba": "MambaConfig", "mamba2": "Mamba2Config",
                "falcon_mamba": "FalconMambaConfig"}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(SEAM_HYBRIDS))
def test_hybrid_per_token_logps_equal_trls_on_trees(tokenizer, tmp_path, kind):
    """Every mixer kind with a tree form (short conv, gated delta rule, KDA, Mamba2, Mamba,
    lightning, CCA, RG-LRU, mLSTM, WKV; Qwen3-Next's and OLMo hybrid's delta nets; the
    attention-free RWKV, Mamba, Mamba2, Falcon-Mamba and xLSTM as they are), groups of 3, 2
    and 1 rows sharing a prompt, an empty completion: TRL's padded log-probs and entropies from
    one tree forward, no fallback. (TRL's path runs second, on the model the tree forward
    adapted: RWKV's and xLSTM's own forwards ignore attention_mask, so left padding would
    enter their state.)"""
    from flexpack.integrations._tiny import tiny_config

    config = tiny_config(getattr(transformers, SEAM_HYBRIDS[kind])())
    config.vocab_size, config.pad_token_id, config.eos_token_id = V + 3, PAD, EOS
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / kind)
    trainer = grpo(ftrl.GRPOTrainer, tmp_path, tokenizer, tmp_path / "out", kind=kind)
    ids, mask, C = rl_batch()
    with torch.no_grad():
        (lp, ent, _), (want_lp, want_ent, _) = seam_pair(trainer, trainer.model, ids, mask, C)
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=0)
    assert trainer.flexpack_stats.calls == 1 and trainer.flexpack_stats.fallbacks == 0


def test_grpo_on_rwkv_without_attention_trains_on_trees_as_trl(tokenizer, tmp_path):
    """RWKV has no attention: construction and train() leave it eager (nothing to switch; it
    was refused as unswitchable) and its WKV and token shifts fork on the trees. 2 steps, 2
    iterations, accumulation 2, SGD: losses and weights equal TRL's own trainer (1e-5), every
    log-prob forward a tree. TRL's model is adapted by flexpack.mixers too: RWKV's own forward
    ignores attention_mask, so left-padded prompts would carry their padding in its state."""
    from flexpack import mixers
    from flexpack.integrations._tiny import tiny_config

    config = tiny_config(transformers.RwkvConfig())
    config.vocab_size, config.pad_token_id, config.eos_token_id = V + 3, PAD, EOS
    g = torch.Generator().manual_seed(0)
    data = datasets.Dataset.from_dict({"prompt": [words(g, n) for n in (5, 9, 3, 7)]})
    runs = {}
    for name, cls in (("trl", trl.GRPOTrainer), ("flexpack", ftrl.GRPOTrainer)):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config))
        if name == "trl":
            mixers.adapt(model)
        args = grpo_args(tmp_path / name, beta=0.0, optim="sgd", learning_rate=0.1,
                         model_init_kwargs=None)  # fmt: skip
        trainer = cls(model=model, reward_funcs=reward, train_dataset=data, args=args,
                      processing_class=tokenizer)  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
        runs[name] = (losses(trainer), weights(trainer.model), trainer)
    (want, want_w, _), (got, got_w, ours) = runs["trl"], runs["flexpack"]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)
    for k in want_w:
        torch.testing.assert_close(got_w[k], want_w[k], atol=1e-5, rtol=0, msg=k)
    assert ours.flexpack_stats.calls >= 6 and ours.flexpack_stats.fallbacks == 0
    assert ours.model.config._attn_implementation == "eager"


@pytest.mark.parametrize("kind", ["bamba", "qwen3_5"])
def test_hybrid_tree_logps_equal_generates(model_dir, kind):
    """The log-probs generate() scored its sampled completions with (the model's own cached
    decoding, step by step) equal the tree forward's over prompt + completions."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir / kind).eval()
    prompt = torch.tensor([[5, 17, 3, 40, 22, 9, 31]])
    torch.manual_seed(1)
    out = model.generate(
        prompt, do_sample=True, max_new_tokens=6, num_return_sequences=3, output_logits=True,
        return_dict_in_generate=True, pad_token_id=PAD, eos_token_id=None,
    )  # fmt: skip
    completions = out.sequences[:, prompt.shape[1] :]
    scores = torch.stack(out.logits, 1).float().log_softmax(-1)  # (3, 6, V)
    want = scores.gather(-1, completions[..., None])[..., 0]
    prompts = prompt.expand(3, -1)
    trees = pack_padded(
        prompts, torch.ones_like(prompts), completions, torch.ones_like(completions)
    )
    with torch.no_grad():
        got = trees.scatter(ftrl.tree_logps(model, trees).logps)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_a_mixer_without_a_tree_form_falls_back_to_trl(model_dir, tokenizer, tmp_path, monkeypatch):
    """A mixer whose one pass declines (here: its class's self-check verdict forced to False,
    for this test only) refuses the tree by name; the trainer takes TRL's padded path for that
    call, with a warning, and returns TRL's numbers."""
    from flexpack.mixers import conv

    trainer = grpo(ftrl.GRPOTrainer, model_dir, tokenizer, tmp_path, kind="lfm2")
    short_conv = trainer.model.get_submodule("model.layers.0.conv")
    monkeypatch.setitem(conv.SHORT_CONV.one_pass.verified, type(short_conv), False)
    ids, mask, C = rl_batch()
    with pytest.warns(UserWarning, match="Lfm2ShortConv"), torch.no_grad():
        (lp, _, _), (want, _, _) = seam_pair(trainer, trainer.model, ids, mask, C)
    assert torch.equal(lp, want) and trainer.flexpack_stats.fallbacks == 1


def test_moe_with_router_aux_loss_trains_on_trees_as_trl(model_dir, tokenizer, tmp_path):
    """gpt-oss, TRL's defaults (router load-balancing loss on): GRPO (2 steps, a reference
    model, 2 iterations, accumulation 2) and DPO (2 steps) run every log-prob forward as trees
    (no fallback) and equal TRL's own trainers in losses, aux losses and weights (SGD: Adam
    turns float noise on an expert's ~0 gradient into a step of ~lr)."""
    runs = {}
    for name, cls in (("trl", trl.GRPOTrainer), ("flexpack", ftrl.GRPOTrainer)):
        trainer = grpo(cls, model_dir, tokenizer, tmp_path / name, kind="gpt_oss",
                       max_completion_length=4, optim="sgd")  # fmt: skip
        assert trainer.aux_loss_enabled
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
        runs[name] = trainer
    for name, cls in (("trl-dpo", trl.DPOTrainer), ("flexpack-dpo", ftrl.DPOTrainer)):
        args = trl.DPOConfig(
            output_dir=str(tmp_path / name), per_device_train_batch_size=3, max_steps=2,
            use_cpu=True, bf16=False, report_to=[], seed=0, logging_steps=1,
            save_strategy="no", learning_rate=1e-2, beta=0.1, optim="sgd",
        )  # fmt: skip
        trainer = cls(model=tiny("gpt_oss"), ref_model=tiny("gpt_oss"), args=args,
                      train_dataset=dpo_data(), processing_class=tokenizer)  # fmt: skip
        assert trainer.aux_loss_enabled
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
        runs[name] = trainer
    for ours, theirs in (("flexpack", "trl"), ("flexpack-dpo", "trl-dpo")):
        got, want = runs[ours], runs[theirs]
        assert got.flexpack_stats.fallbacks == 0 and got.flexpack_stats.calls > 0, ours
        logged = [h for h in got.state.log_history if "loss" in h]
        expected = [h for h in want.state.log_history if "loss" in h]
        assert len(logged) == len(expected) == 2
        for a, b in zip(logged, expected, strict=True):
            for k in ("loss", "aux_loss"):
                assert a[k] == pytest.approx(b[k], abs=1e-4), (ours, k)
        got_w, want_w = weights(got.model), weights(want.model)
        for k in want_w:
            torch.testing.assert_close(got_w[k], want_w[k], atol=1e-5, rtol=0, msg=k)


def test_rloo_on_a_hybrid_trains_on_trees_as_trl(model_dir, tokenizer, tmp_path):
    """RLOO on Qwen3.5 (gated delta rule + attention), 2 steps with a reference model, 2
    iterations and accumulation 2: losses and weights equal TRL's own RLOOTrainer (1e-4; SGD:
    Adam turns float noise on a ~0 gradient into a step of ~lr), every log-prob forward a tree
    (no fallback)."""
    g = torch.Generator().manual_seed(0)
    data = datasets.Dataset.from_dict({"prompt": [words(g, n) for n in (5, 9, 3, 7)]})
    runs = {}
    for name, cls in (("trl", trl.RLOOTrainer), ("flexpack", ftrl.RLOOTrainer)):
        args = trl.RLOOConfig(
            output_dir=str(tmp_path / name), per_device_train_batch_size=4, num_generations=4,
            max_completion_length=6, use_cpu=True, bf16=False, report_to=[], beta=0.1,
            num_iterations=2, gradient_accumulation_steps=2, max_steps=2, seed=0,
            logging_steps=1, save_strategy="no", optim="sgd", learning_rate=0.1,
            model_init_kwargs={"dtype": torch.float32},
        )  # fmt: skip
        trainer = cls(
            model=str(model_dir / "qwen3_5"), reward_funcs=reward, train_dataset=data,
            args=args, processing_class=tokenizer,
        )  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
        runs[name] = (losses(trainer), weights(trainer.model), trainer)
    (want, want_w, _), (got, got_w, ours) = runs["trl"], runs["flexpack"]
    assert len(got) == len(want) == 2
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)
    for k in want_w:
        torch.testing.assert_close(got_w[k], want_w[k], atol=1e-4, rtol=0, msg=k)
    assert ours.flexpack_stats.calls >= 6 and ours.flexpack_stats.fallbacks == 0


def test_rloo_shares_the_seam(model_dir, tokenizer, tmp_path):
    g = torch.Generator().manual_seed(0)
    data = datasets.Dataset.from_dict({"prompt": [words(g, n) for n in (5, 9, 3, 7)]})
    args = trl.RLOOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=6, use_cpu=True, bf16=False, report_to=[], beta=0.1,
        model_init_kwargs={"dtype": torch.float32},
    )  # fmt: skip
    trainer = ftrl.RLOOTrainer(
        model=str(model_dir / "llama"), reward_funcs=reward, train_dataset=data, args=args,
        processing_class=tokenizer,
    )  # fmt: skip
    ids, mask, C = rl_batch(2)
    with torch.no_grad():
        got = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
        want = trl.RLOOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, ids, mask, C
        )
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=0)
    assert trainer.flexpack_stats.calls == 1


def test_unpackable_batch_falls_back_to_trl_with_a_warning(model_dir, tokenizer, tmp_path):
    trainer = grpo(ftrl.GRPOTrainer, model_dir, tokenizer, tmp_path)
    ids, mask, C = rl_batch()
    mask[0, -C + 1] = 0  # a hole inside a completion
    with pytest.warns(UserWarning, match="cannot be packed"), torch.no_grad():
        (lp, _, _), (want, _, _) = seam_pair(trainer, trainer.model, ids, mask, C)
    assert torch.equal(lp, want) and trainer.flexpack_stats.fallbacks == 1


@pytest.mark.parametrize("kind", ["GRPOTrainer", "RLOOTrainer"])
@pytest.mark.parametrize("which", ["one_truncated", "all_truncated"])
def test_mask_truncated_completions_trains_as_trl(model_dir, tokenizer, tmp_path, kind, which):
    """mask_truncated_completions=True, TRL's own test layout (generation mocked): of three
    completions of 8 tokens one ends without EOS, one has EOS then padding, one has EOS as its
    last token. The truncated completion leaves the loss; flexpack's trainer (the truncated
    row holds no completion token, so no tree holds it) and TRL's train alike, losses and
    weights, and the weights move. With every completion truncated, neither moves a weight."""
    from unittest.mock import patch

    truncated = [1, 2, 3, 4, 5, 6, 7, 8]
    rows = {
        "one_truncated": [truncated, [9, 10, 11, EOS, PAD, PAD, PAD, PAD], [*range(12, 19), EOS]],
        "all_truncated": [truncated, [*range(9, 17)], [*range(12, 20)]],
    }[which]

    def fake_generate(input_ids, **_):
        completions = torch.tensor(rows).repeat(input_ids.shape[0] // 3, 1)
        return torch.cat([input_ids, completions.to(input_ids.device)], dim=1)

    config = {"GRPOTrainer": trl.GRPOConfig, "RLOOTrainer": trl.RLOOConfig}[kind]
    g = torch.Generator().manual_seed(0)
    data = datasets.Dataset.from_dict({"prompt": [words(g, n) for n in (5, 9, 3, 7, 4, 6)]})
    runs = {}
    for name, cls in (("trl", getattr(trl, kind)), ("flexpack", getattr(ftrl, kind))):
        args = config(
            output_dir=str(tmp_path / name), per_device_train_batch_size=3, num_generations=3,
            max_completion_length=8, mask_truncated_completions=True, use_cpu=True, bf16=False,
            report_to=[], max_steps=2, seed=0, logging_steps=1, save_strategy="no",
            optim="sgd", learning_rate=0.1, model_init_kwargs={"dtype": torch.float32},
        )  # fmt: skip
        trainer = cls(
            model=str(model_dir / "llama"), reward_funcs=reward, train_dataset=data, args=args,
            processing_class=tokenizer,
        )  # fmt: skip
        before = weights(trainer.model)
        with (
            warnings.catch_warnings(),
            patch(
                "transformers.generation.utils.GenerationMixin.generate", side_effect=fake_generate
            ),
        ):
            warnings.simplefilter("ignore")
            trainer.train()
        after = weights(trainer.model)
        moved = max((after[k] - before[k]).abs().max().item() for k in before)
        runs[name] = (losses(trainer), after, moved, trainer)
    (want, want_w, want_moved, _), (got, got_w, got_moved, ours) = runs["trl"], runs["flexpack"]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)
    for k in want_w:
        torch.testing.assert_close(got_w[k], want_w[k], atol=1e-4, rtol=0, msg=k)
    if which == "one_truncated":
        assert want_moved > 1e-3 and got_moved > 1e-3
    else:
        assert want_moved == got_moved == 0
    assert ours.flexpack_stats.calls >= 2 and ours.flexpack_stats.fallbacks == 0


def test_dpo_fallback_warning_names_what_the_call_carried():
    """The reason DPO's call takes TRL's path names the call's arguments (it once read
    "DPO passed inputs flexpack does not pack ([])")."""
    why = fdpo._dpo_call_unpacked((), {"input_ids": 1, "attention_mask": 1}, [])
    assert "no fused_lm_head=True" in why and "compute_metrics" in why
    why = fdpo._dpo_call_unpacked((1,), {"fused_lm_head": True}, ["pixel_values"])
    assert "1 positional argument" in why and "pixel_values" in why
    assert "fused_lm_head" not in why.replace("pixel_values", "")


def dpo_data(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for i in range(n):
        rows["prompt"].append(words(g, 3 + 2 * i))
        rows["chosen"].append(" " + words(g, 1 + i % 4))
        rows["rejected"].append(" " + words(g, 2 + (i * 3) % 5))
    return datasets.Dataset.from_dict(rows)


@pytest.mark.parametrize("precompute", [False, True])
def test_dpo_train_equals_trls_trainer(tokenizer, tmp_path, precompute):
    """With ``precompute_ref_log_probs`` the reference log-probs are computed at construction
    (through the trees too), cached in the dataset, and read back by the loss."""
    runs = {}
    for name, cls in (("trl", trl.DPOTrainer), ("flexpack", ftrl.DPOTrainer)):
        args = trl.DPOConfig(
            output_dir=str(tmp_path / name), per_device_train_batch_size=3, max_steps=2,
            gradient_accumulation_steps=2, use_cpu=True, bf16=False, report_to=[], seed=0,
            logging_steps=1, save_strategy="no", learning_rate=1e-2, beta=0.1,
            precompute_ref_log_probs=precompute, precompute_ref_batch_size=4,
        )  # fmt: skip
        trainer = cls(
            model=tiny(), ref_model=tiny(), args=args, train_dataset=dpo_data(),
            processing_class=tokenizer,
        )  # fmt: skip
        if precompute:
            data = trainer.train_dataset
            ref = list(data["ref_chosen_logps"]) + list(data["ref_rejected_logps"])
            runs[name + "-ref"] = torch.tensor(ref)
            if name == "flexpack":  # 6 pairs in batches of 4: two tree forwards
                assert trainer.flexpack_stats.calls == 2
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
        runs[name] = (trainer.state.log_history, weights(trainer.model), trainer)
    (want, want_w, _), (got, got_w, ours) = runs["trl"], runs["flexpack"]
    keys = ["loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "entropy",
            "logits/chosen", "mean_token_accuracy"]  # fmt: skip
    for a, b in zip(got, want, strict=True):
        for k in keys:
            if k in b:
                assert a[k] == pytest.approx(b[k], abs=1e-4), k
    for k in want_w:
        torch.testing.assert_close(got_w[k], want_w[k], atol=1e-4, rtol=0)
    assert ours.flexpack_stats.calls >= 4 and ours.flexpack_stats.fallbacks == 0
    assert ours.flexpack_stats.tree_tokens < ours.flexpack_stats.padded_tokens
    if precompute:
        torch.testing.assert_close(runs["flexpack-ref"], runs["trl-ref"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", sorted(HYBRIDS))
def test_dpo_on_a_hybrid_logs_trls_metrics(tokenizer, tmp_path, kind):
    """LFM2 (short convs), Qwen3.5 (gated delta rule), Bamba and Falcon-H1 (Mamba2) on trees:
    each answer's state and conv window start from its prompt's end. The policy and the
    reference both run flexpack's attention (once the reference ran its own: at step 0 the two
    differed by rounding, so LFM2's rewards/accuracies logged 0.33 where TRL logs 0.0, its
    rewards tying at exactly 0): 2 steps, every logged metric and every weight equal TRL's
    (1e-4; SGD: Adam turns float noise on a ~0 gradient into a step of ~lr), no fallback."""
    from flexpack.integrations._tiny import tiny_config

    def hybrid():
        torch.manual_seed(0)
        config = tiny_config(getattr(transformers, HYBRIDS[kind])())
        config.vocab_size = 128
        return transformers.AutoModelForCausalLM.from_config(config)

    logs, trained = {}, {}
    for name, cls in (("trl", trl.DPOTrainer), ("flexpack", ftrl.DPOTrainer)):
        args = trl.DPOConfig(
            output_dir=str(tmp_path / name), per_device_train_batch_size=3, max_steps=2,
            use_cpu=True, bf16=False, report_to=[], seed=0, logging_steps=1,
            save_strategy="no", optim="sgd", learning_rate=0.1, beta=0.1,
        )  # fmt: skip
        trainer = cls(model=hybrid(), ref_model=hybrid(), args=args, train_dataset=dpo_data(),
                      processing_class=tokenizer)  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
        logs[name] = [h for h in trainer.state.log_history if "loss" in h]
        trained[name] = weights(trainer.model)
    assert trainer.flexpack_stats.fallbacks == 0 and trainer.flexpack_stats.calls > 0
    if kind == "lfm2":
        assert logs["trl"][0]["rewards/accuracies"] == 0.0  # rewards tie at 0 at step 0
    assert len(logs["flexpack"]) == len(logs["trl"]) == 2
    for a, b in zip(logs["flexpack"], logs["trl"], strict=True):
        assert a["rewards/accuracies"] == b["rewards/accuracies"]
        for k in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert a[k] == pytest.approx(b[k], abs=1e-4), k
    for k, want in trained["trl"].items():
        torch.testing.assert_close(trained["flexpack"][k], want, atol=1e-4, rtol=0, msg=k)


def test_dpo_pairs_sharing_earlier_turns_pack_as_multi_level_trees(
    tokenizer, tmp_path, monkeypatch
):
    """Multi-turn preference pairs: prompts that begin with the same turns (20 tokens, over
    flexpack_shared_prefix's 16) share them one level above each pair's prompt; the training
    run equals TRL's own DPOTrainer and forwards fewer tokens than one tree per prompt."""
    g = torch.Generator().manual_seed(5)
    turns = words(g, 20)
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for i in range(6):
        rows["prompt"].append(turns + " " + words(g, 1 + i % 3) if i % 3 else words(g, 4))
        rows["chosen"].append(" " + words(g, 1 + i % 4))
        rows["rejected"].append(" " + words(g, 2 + (i * 3) % 5))
    data = datasets.Dataset.from_dict(rows)
    calls, dpo_trees = {"rows": []}, fdpo._dpo_trees

    def record(ids, mask, labels, k=0):
        calls["rows"].append((ids, mask, labels, k))
        return dpo_trees(ids, mask, labels, k)

    runs = {}
    for name, cls in (("trl", trl.DPOTrainer), ("flexpack", ftrl.DPOTrainer)):
        args = trl.DPOConfig(
            output_dir=str(tmp_path / name), per_device_train_batch_size=6, max_steps=2,
            use_cpu=True, bf16=False, report_to=[], seed=0, logging_steps=1,
            save_strategy="no", learning_rate=1e-2, beta=0.1,
        )  # fmt: skip
        trainer = cls(
            model=tiny(), ref_model=tiny(), args=args, train_dataset=data,
            processing_class=tokenizer,
        )  # fmt: skip
        with warnings.catch_warnings(), monkeypatch.context() as patch:
            warnings.simplefilter("ignore")
            patch.setattr(fdpo, "_dpo_trees", record)
            trainer.train()
        runs[name] = trainer
    want, got = runs["trl"], runs["flexpack"]
    for a, b in zip(got.state.log_history, want.state.log_history, strict=True):
        for k in ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen"):
            if k in b:
                assert a[k] == pytest.approx(b[k], abs=1e-4), k
    want_w = weights(want.model)
    for k, v in weights(got.model).items():
        torch.testing.assert_close(v, want_w[k], atol=1e-4, rtol=0)
    assert got.flexpack_stats.fallbacks == 0
    seen = calls["rows"]
    assert seen and all(k == 16 for *_, k in seen)
    alone, shared = (
        sum(fdpo._dpo_trees(i, m, y, k)[0].batch.num_tokens for i, m, y, _ in seen) for k in (0, 16)
    )
    assert shared < alone  # the 20 shared tokens once per batch, not once per prompt


def test_tree_path_never_holds_whole_batch_logits():
    """The LM head runs in chunks: no tensor with the vocabulary as last dim exceeds a chunk."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else (out,):
                if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[-1] != V + 3:
                    continue
                if t.untyped_storage().data_ptr() not in weights:  # views of W.T are no logits
                    Largest.most = max(Largest.most, t.numel() // (V + 3))
            return out

    model = tiny()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ids, mask, C = rl_batch()
    trees = pack_padded(ids[:, :-C], mask[:, :-C], ids[:, -C:], mask[:, -C:])
    with Largest():
        r = ftrl.tree_logps(model, trees, entropy=True, chunk_size=4)
        (r.logps.sum() + r.entropies.sum()).backward()
    T = int(trees.batch.rollout_lengths.sum())
    assert T > 12 and Largest.most == 4  # chunks of 4 rows of logits, never (T, V) or more


def test_construction_refuses_a_model_that_cannot_switch(tokenizer, tmp_path):
    class Fixed(transformers.LlamaForCausalLM):
        def set_attn_implementation(self, *_a, **_k):  # a model that keeps its attention
            pass

    model = Fixed(copy.deepcopy(tiny().config))
    data = datasets.Dataset.from_dict({"prompt": ["t1 t2"] * 4})
    with pytest.raises(ValueError, match="cannot switch its attention"):
        ftrl.GRPOTrainer(
            model=model, reward_funcs=reward, train_dataset=data,
            args=grpo_args(tmp_path, beta=0.0), processing_class=tokenizer,
        )  # fmt: skip


def test_grpo_seam_on_the_fake_cuda_device(model_dir, tokenizer, tmp_path, fake_cuda):
    """The tree forward of the trainer seam on cuda:0 (tests/fake_cuda.py): no mixed-device
    kernel anywhere, TRL's tensors on the device, the CPU values. (Compiled flex is no part of
    the fake, so the tree forward runs its per-segment SDPA path: backend "sdpa".)"""
    from fake_cuda import to_cpu, to_fake_cuda

    with fake_cuda.paused():
        trainer = grpo(ftrl.GRPOTrainer, model_dir, tokenizer, tmp_path)
        ids, mask, C = rl_batch()
        with torch.no_grad():
            want = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, mask, C, compute_entropy=True
            )
    trainer.flexpack_backend = "sdpa"
    model = to_fake_cuda(trainer.model)
    with torch.no_grad(), fake_cuda.count() as syncs:
        lp, ent, _ = trainer._get_per_token_logps_and_entropies(
            model, ids.cuda(), mask.cuda(), C, compute_entropy=True
        )
    assert lp.device.type == "cuda" and ent.device.type == "cuda"
    torch.testing.assert_close(to_cpu(lp), want[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(to_cpu(ent), want[1], atol=1e-5, rtol=0)
    # Grouping prompts by their tokens reads them on the host (a few copies per batch), and the
    # tree layout is read once per forward, not once per layer.
    assert len(syncs) < 40, syncs


def test_ddp_wrapped_model_runs_trees_through_ddps_forward(model_dir, tokenizer, tmp_path):
    """A DDP-wrapped model runs the tree forward inside DDP's own forward (its reducer is
    prepared, as after any forward of its own); values and gradients as TRL's. Two ranks:
    tests/test_trl_distributed.py."""
    import datetime
    import socket

    import torch.distributed as dist

    trainer = grpo(ftrl.GRPOTrainer, model_dir, tokenizer, tmp_path)
    trainer.model.gradient_checkpointing_disable()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(  # a stuck rendezvous fails the test, not the whole run
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(trainer.model)
        calls = []
        ddp.register_forward_pre_hook(lambda *_: calls.append(1))
        ids, mask, C = rl_batch()
        grads = []
        theirs = trl.GRPOTrainer._get_per_token_logps_and_entropies.__get__(trainer)
        for fn in (trainer._get_per_token_logps_and_entropies, theirs):
            ddp.zero_grad()
            lp, _, _ = fn(ddp, ids, mask, C)
            lp.sum().backward()
            grads.append((lp.detach(), [p.grad.clone() for p in ddp.parameters()]))
        (lp, got), (want_lp, want) = grads
        torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        assert len(calls) == 2  # DDP's forward ran for both
        assert trainer.flexpack_stats.calls == 1 and trainer.flexpack_stats.fallbacks == 0
    finally:
        dist.destroy_process_group()


def test_grpo_torch_compile_trains_as_trl_with_eager_tree_forwards(model_dir, tokenizer, tmp_path):
    """args.torch_compile=True: accelerate compiles the prepared model (the "eager" dynamo
    backend here, to keep the test fast); the tree forwards run eagerly around the compiled
    wrapper, as the construction warning says, and training equals TRL's compiled run."""
    runs = {}
    over = dict(torch_compile=True, torch_compile_backend="eager", max_steps=1)
    for name, cls in (("trl", trl.GRPOTrainer), ("flexpack", ftrl.GRPOTrainer)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = grpo(cls, model_dir, tokenizer, tmp_path / name, **over)
            trainer.train()
        runs[name] = (losses(trainer), weights(trainer.model), trainer, caught)
    (want, want_w, _, _), (got, got_w, ours, caught) = runs["trl"], runs["flexpack"]
    assert type(ours.model_wrapped).__name__ == "OptimizedModule"
    assert any("run eagerly" in str(w.message) for w in caught)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)
    for k in want_w:
        torch.testing.assert_close(got_w[k], want_w[k], atol=1e-4, rtol=0)
    assert ours.flexpack_stats.calls >= 3 and ours.flexpack_stats.fallbacks == 0


def test_deepspeed_zero3_is_refused_by_name():
    """ZeRO-3 partitions lm_head.weight outside the head's own forward, which the chunked head
    reads directly (and again in backward): refused at construction, naming what to use.
    (deepspeed is not installed here: the check reads what HF Trainer sets up, stood in.)"""
    from types import SimpleNamespace

    plugin = SimpleNamespace(zero_stage=3)
    trainer = SimpleNamespace(
        is_deepspeed_enabled=True,
        accelerator=SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin)),
    )
    with pytest.raises(ValueError, match=r"DeepSpeed ZeRO-3.*ZeRO-1/2, FSDP2"):
        _refuse_sharding(trainer)
    plugin.zero_stage = 2  # ZeRO-1/2 keep whole parameters: the engine's forward runs the trees
    _refuse_sharding(trainer)


def test_gpt2_positions_count_from_the_first_real_token_as_generate_does(tokenizer, tmp_path):
    """Absolute positions (GPT-2): a tree counts a rollout's positions from its first real
    token, as generate() does with a left-padded prompt (positions from the attention mask),
    so the log-probs are those of the policy that sampled. TRL's padded forward passes no
    position_ids, so its positions count the left padding: it agrees on unpadded rows only."""
    config = transformers.GPT2Config(
        vocab_size=V + 3, n_embd=32, n_layer=2, n_head=4, n_positions=64, pad_token_id=PAD,
        eos_token_id=EOS, bos_token_id=EOS,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    data = datasets.Dataset.from_dict({"prompt": ["t1 t2"] * 4})
    trainer = ftrl.GRPOTrainer(
        model=model, reward_funcs=reward, train_dataset=data,
        args=grpo_args(tmp_path, beta=0.0), processing_class=tokenizer,
    )  # fmt: skip
    ids, mask, C = rl_batch()
    prompts, pmask = ids[:, :-C], mask[:, :-C]
    model.eval()
    with torch.no_grad():
        out = model.generate(
            prompts, attention_mask=pmask, max_new_tokens=C, min_new_tokens=C, do_sample=False,
            output_logits=True, return_dict_in_generate=True, pad_token_id=PAD,
        )  # fmt: skip
        completion = out.sequences[:, -C:]
        sampled = torch.stack(out.logits, 1).log_softmax(-1)  # (B, C, V), before processors
        sampled = sampled.gather(-1, completion[..., None])[..., 0]
        ids = torch.cat([prompts, completion], 1)
        mask = torch.cat([pmask, torch.ones_like(completion)], 1)
        ours, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, C)
        theirs, _, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, model, ids, mask, C
        )
    torch.testing.assert_close(ours, sampled, atol=1e-5, rtol=0)
    padded = (pmask == 0).any(1)
    assert padded.any() and (~padded).any()
    torch.testing.assert_close(theirs[~padded], sampled[~padded], atol=1e-5, rtol=0)
    assert (theirs[padded] - sampled[padded]).abs().max() > 1e-2  # shifted by the padding


def test_grpo_prompts_sharing_a_beginning_pack_as_multi_level_trees(model_dir, tokenizer, tmp_path):
    """Prompts that begin alike (a system prompt, earlier turns of one conversation) share
    that beginning in one multi-level tree: S once, then each prompt's rest (one prompt is S
    itself, one is a prefix of another), then the completions; TRL's tensors and gradients."""
    trainer = grpo(ftrl.GRPOTrainer, model_dir, tokenizer, tmp_path)
    model = trainer.model
    model.gradient_checkpointing_disable()
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, V, (5,), generator=g).tolist()
    rest = [[], [7, 8], [7, 8, 9], [11]]  # S, S+[7,8], S+[7,8,9], S+[11]
    prompts = [shared + r for r in rest] + [[1, 2, 3]]  # and one unrelated prompt
    P, C = 9, 4
    rows, masks = [], []
    for i, p in enumerate(prompts):
        for j in range(2):  # 2 completions each, of lengths 1-4
            c = torch.randint(0, V, (1 + (i + j) % 4,), generator=g).tolist()
            rows.append([PAD] * (P - len(p)) + p + c + [PAD] * (C - len(c)))
            masks.append([0] * (P - len(p)) + [1] * (len(p) + len(c)) + [0] * (C - len(c)))
    ids, mask = torch.tensor(rows), torch.tensor(masks)
    results = {}
    for share in (0, 3):
        trainer.flexpack_shared_prefix = share
        before = trainer.flexpack_stats.tree_tokens
        model.zero_grad()
        lp, ent, _ = trainer._get_per_token_logps_and_entropies(
            model, ids, mask, C, compute_entropy=True
        )
        (lp.sum() + 0.1 * ent.sum()).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        results[share] = (lp, ent, grads, trainer.flexpack_stats.tree_tokens - before)
    model.zero_grad()
    want, want_ent, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(
        trainer, model, ids, mask, C, compute_entropy=True
    )
    (want.sum() + 0.1 * want_ent.sum()).backward()
    for lp, ent, grads, _ in results.values():
        torch.testing.assert_close(lp, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=0)
        for a, b in zip(grads, [p.grad for p in model.parameters()], strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert results[3][3] < results[0][3]  # packed rows' tokens (R * S)
    # S (5 tokens) once instead of 4 times and [7, 8] once instead of twice: 17 fewer
    real = [
        _pack_rows(ids[:, :-C], mask[:, :-C], ids[:, -C:], mask[:, -C:], share).batch.num_tokens
        for share in (0, 3)
    ]
    assert real[1] == real[0] - 17
    assert trainer.flexpack_stats.fallbacks == 0
