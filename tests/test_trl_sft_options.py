"""flexpack's SFTTrainer honours TRL's SFTConfig options (and PEFT methods) or refuses them.

Each option is checked against TRL's own ``SFTTrainer``: the samples TRL prepares unpacked
(``packing=False``) are the samples inside flexpack's packed rows, label for label; an option
that changes training (``packing_strategy="wrapped"``, a LoRA adapter) trains as TRL's unpacked
trainer does over the same samples; ``eval_packing=False`` evaluates each sample in its own row
as TRL does. What flexpack cannot make exact (PEFT prompt learning) is refused by name when the
trainer is built. Tiny random models and the word-level tokenizer of ``test_trl_sft``.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from test_trl_sft import (  # noqa: E402
    EOS,
    FP32,
    Recorder,
    documents,
    losses,
    max_param_diff,
    prompt_completion,
    reference_run,
    sft_args,
    tiny,
    word_tokenizer,
    words,
)

from flexpack.integrations.trl import SFTTrainer  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer()


def build(cls, tmp_path, name, data, tokenizer, model=None, **kwargs):
    """A trainer of ``cls`` (flexpack's or TRL's), warnings silenced."""
    trainer_kwargs = {k: kwargs.pop(k) for k in ("formatting_func", "peft_config") if k in kwargs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(
            model=tiny("llama") if model is None else model,
            args=sft_args(tmp_path, name, **kwargs),
            train_dataset=data,
            processing_class=tokenizer,
            **trainer_kwargs,
        )


def samples(dataset) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(input_ids, supervised labels) of each sample, sorted: the first label is dropped (no
    prediction targets a sample's first token; flexpack's rows write -100 there)."""
    return sorted(
        (tuple(d["input_ids"]), tuple(d["labels"][1:]))
        for d in (documents(dataset) if "seq_lengths" in dataset.column_names else dataset)
    )


# ----------------------------------------------------------------------------- PEFT


def _prompt_learning_configs():
    peft = pytest.importorskip("peft")
    return {
        "PREFIX_TUNING": peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        "PROMPT_TUNING": peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        "P_TUNING": peft.PromptEncoderConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=4, encoder_hidden_size=16
        ),
    }


@pytest.mark.parametrize("method", ["PREFIX_TUNING", "PROMPT_TUNING", "P_TUNING"])
@pytest.mark.parametrize("given", ["peft_config", "peft_model"])
def test_prompt_learning_refused_at_construction(tmp_path, tokenizer, method, given):
    """Prefix tuning would give its virtual key/values to the first sample of each packed row
    only (silently); prompt tuning and P-tuning prepend embeddings the doc ids do not cover.
    Refused when the trainer is built, naming the method, whether TRL would wrap the model
    (``peft_config=``) or it comes wrapped."""
    peft = pytest.importorskip("peft")
    config = _prompt_learning_configs()[method]
    kwargs = {}
    model = tiny("llama")
    if given == "peft_config":
        kwargs["peft_config"] = config
    else:
        model = peft.get_peft_model(model, config)
    with pytest.raises(ValueError, match=f"prompt-learning.*{method}"):
        build(SFTTrainer, tmp_path, "p", prompt_completion(), tokenizer, model=model, **kwargs)


def test_lora_trains_as_trl_unpacked(tmp_path, tokenizer):
    """A weight adapter (LoRA) is not refused and trains as TRL's unpacked trainer with the
    same adapter over the same samples (TRL seeds before wrapping: equal adapter inits)."""
    peft = pytest.importorskip("peft")

    def lora():
        return peft.LoraConfig(
            task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
        )

    model = tiny("llama")
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    steps = 4
    trainer = build(
        SFTTrainer, tmp_path, "lora", prompt_completion(), tokenizer, model=model,
        peft_config=lora(), max_steps=steps,
    )  # fmt: skip
    recorder = Recorder(trainer.data_collator)
    trainer.data_collator = recorder
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
        ref = reference_run(
            reference, tokenizer, recorder.steps[:steps],
            sft_args(tmp_path, "trl", packing=False, padding_free=False, max_steps=steps,
                     remove_unused_columns=False, dataset_kwargs={"skip_prepare_dataset": True}),
            peft_config=lora(),
        )  # fmt: skip
    ours, theirs = losses(trainer), losses(ref)
    assert len(ours) == len(theirs) == steps
    assert (ours - theirs).abs().max().item() < FP32
    assert max_param_diff(trainer.model, ref.model) < FP32
    moved = [p for n, p in trainer.model.named_parameters() if "lora_B" in n]
    assert moved and max(p.abs().max().item() for p in moved) > 100 * FP32


# ----------------------------------------------------------------------------- preparation


def _text(n=24, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [words(g, int(k)) for k in torch.randint(3, 40, (n,), generator=g)]


def _conversations(n=16, seed=4):
    g = torch.Generator().manual_seed(seed)

    def turn(role, low, high):
        return {"role": role, "content": words(g, int(torch.randint(low, high, (1,), generator=g)))}

    chats = [[turn("user", 2, 12), turn("assistant", 1, 9)] for _ in range(n)]
    return datasets.Dataset.from_dict({"messages": chats})


# A word-level template whose assistant turns (and their </s>) are inside generation markers.
_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }} </s>{% endgeneration %}{% else %}{{ m['content'] }} {% endif %}"
    "{% endfor %}"
)


@pytest.mark.parametrize(
    "option",
    ["completion_only_loss=False", "dataset_text_field", "formatting_func",
     "assistant_only_loss", "padding_free"],
)  # fmt: skip
def test_option_prepares_the_samples_trl_prepares(tmp_path, tokenizer, option):
    """The samples inside flexpack's packed rows are, label for label, those TRL's own
    unpacked preparation makes with the same option (which is what a test reading
    ``train_dataset[i]`` as sample i checks, once the rows are taken apart)."""
    data, kwargs = prompt_completion(), {}
    if option == "completion_only_loss=False":
        kwargs["completion_only_loss"] = False
    elif option == "dataset_text_field":
        data = datasets.Dataset.from_dict({"body": _text()})
        kwargs["dataset_text_field"] = "body"
    elif option == "formatting_func":
        data = datasets.Dataset.from_dict({"q": _text(seed=5), "a": _text(seed=6)})
        kwargs["formatting_func"] = lambda ex: ex["q"] + " " + ex["a"]
    elif option == "assistant_only_loss":
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.chat_template = _TEMPLATE
        data = _conversations()
        kwargs["assistant_only_loss"] = True
    else:
        kwargs.update(padding_free=True, packing=True)
    ours = build(SFTTrainer, tmp_path, "ours", data, tokenizer, **kwargs)
    if option == "padding_free":  # TRL's own padding-free run of the same samples is unpacked
        kwargs.update(packing=False, max_length=None)
    theirs = build(trl.SFTTrainer, tmp_path, "trl", data, tokenizer, **kwargs)
    got, want = samples(ours.train_dataset), samples(theirs.train_dataset)
    assert got == want
    supervised = sum(label != -100 for _, labels in got for label in labels)
    everything = sum(len(labels) for _, labels in got)
    if option in ("completion_only_loss=False", "dataset_text_field", "formatting_func"):
        assert supervised == everything  # language modelling: every target supervised
    else:
        assert 0 < supervised < everything  # prompts / user turns out of the loss
    if option == "padding_free":  # and it trains (TRL's collator is replaced by flexpack's)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours.args.max_steps = 2
            ours.train()
        assert ours.flexpack_stats.steps == 2


def test_wrapped_trains_as_trl_unpacked_over_its_pieces(tmp_path, tokenizer):
    """packing_strategy="wrapped": the samples concatenated in order and cut every max_length
    tokens (no padding but the last row, none truncated); each piece is its own document, so
    training equals TRL's unpacked trainer over the pieces. (TRL's own wrapped rows let the
    samples of a row attend to each other; flexpack's keep them apart.)"""
    data = prompt_completion(n=40)
    steps = 4
    # SGD: Adam's normalised step turns the float32 rounding of a near-zero gradient element
    # into a move of up to the learning rate (1e-4 on one lm_head weight here)
    sgd = dict(max_steps=steps, optim="sgd", learning_rate=0.1)
    trainer = build(
        SFTTrainer, tmp_path, "wrap", data, tokenizer, packing_strategy="wrapped", **sgd
    )
    rows = trainer.train_dataset
    lengths = [len(r) for r in rows["input_ids"]]
    assert all(n == 64 for n in lengths[:-1]) and 0 < lengths[-1] <= 64
    unpacked = build(trl.SFTTrainer, tmp_path, "u", data, tokenizer, max_length=None)
    stream = [t for r in unpacked.train_dataset["input_ids"] for t in r]
    assert [t for r in rows["input_ids"] for t in r] == stream  # every token once, in order
    assert any(r[-1] != EOS for r in rows["input_ids"][:-1])  # samples really were cut
    model = trainer.model
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    recorder = Recorder(trainer.data_collator)
    trainer.data_collator = recorder
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
        ref = reference_run(
            reference, tokenizer, recorder.steps[:steps],
            sft_args(tmp_path, "trl", packing=False, padding_free=False, **sgd,
                     remove_unused_columns=False, dataset_kwargs={"skip_prepare_dataset": True}),
        )  # fmt: skip
    ours, theirs = losses(trainer), losses(ref)
    assert len(ours) == len(theirs) == steps
    assert (ours - theirs).abs().max().item() < FP32
    assert max_param_diff(model, reference) < FP32
    assert max_param_diff(model, tiny("llama")) > 100 * FP32


def test_eval_packing_false_evaluates_as_trl_unpacked(tmp_path, tokenizer):
    """eval_packing=False: each eval sample its own row, as TRL's; eval_loss equals TRL's
    unpacked evaluate() on the same model. Left at its default, the eval set is packed."""
    train, held_out = prompt_completion(n=8), prompt_completion(n=10, seed=1)
    model = tiny("llama")
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    common = dict(per_device_eval_batch_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = SFTTrainer(
            model=model, args=sft_args(tmp_path, "ours", eval_packing=False, **common),
            train_dataset=train, eval_dataset=held_out, processing_class=tokenizer,
        )  # fmt: skip
        theirs = trl.SFTTrainer(
            model=reference, args=sft_args(tmp_path, "trl", **common),
            train_dataset=train, eval_dataset=held_out, processing_class=tokenizer,
        )  # fmt: skip
        packed = SFTTrainer(
            model=tiny("llama"), args=sft_args(tmp_path, "packed", **common),
            train_dataset=train, eval_dataset=held_out, processing_class=tokenizer,
        )  # fmt: skip
        got, want = ours.evaluate()["eval_loss"], theirs.evaluate()["eval_loss"]
    assert len(ours.eval_dataset) == len(held_out) and len(packed.eval_dataset) < len(held_out)
    assert "seq_lengths" not in ours.eval_dataset.column_names
    assert abs(got - want) < FP32


def test_padding_removed_is_never_negative(tmp_path, tokenizer):
    """One half-empty row of two short samples: flexpack's row has more slots than the two
    samples padded to the longer; the statistic reads 0, not a negative number."""
    data = prompt_completion(n=2)
    trainer = build(
        SFTTrainer, tmp_path, "half", data, tokenizer, max_steps=1, per_device_train_batch_size=1
    )
    assert len(trainer.train_dataset) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    stats = trainer.flexpack_stats
    assert stats.padded_tokens < stats.row_tokens  # the case that logged -776
    assert stats.padding_removed == 0
    logged = [h for h in trainer.state.log_history if "flexpack/padding_removed" in h]
    assert logged and all(h["flexpack/padding_removed"] == 0 for h in logged)
