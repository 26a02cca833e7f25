"""flexpack.integrations.trl.SFTTrainer: TRL's SFTTrainer on rows flexpack packs.

The reference is TRL's own ``SFTTrainer`` (``packing=False, padding_free=False``: each sample
its own right-padded row, transformers' ``sdpa`` / ``eager`` attention) fed, step by step, the
samples that flexpack's trainer packed into that step's rows. Both normalise TRL's way: the sum
of per-token losses over the step's supervised tokens (``num_items_in_batch``), and both run
Trainer's own AdamW, schedule and gradient clipping, so the 10 losses and the final weights
agree to float32 round-off. Tiny random models and a word-level tokenizer: no downloads.
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

from flexpack.integrations._tiny import tiny_config  # noqa: E402
from flexpack.integrations.trl import PackStats, SFTTrainer  # noqa: E402

V = 125  # words t0..t124, then <pad> 125, </s> 126, <unk> 127: a vocabulary of 128
PAD, EOS = V, V + 1
STEPS = 10
FP32 = 1e-5


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer()


def word_tokenizer():
    """t0..t124 one token each, whitespace-split; <pad>, </s>, <unk>."""
    vocab = {f"t{i}": i for i in range(V)} | {"<pad>": PAD, "</s>": EOS, "<unk>": V + 2}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


def words(g: torch.Generator, n: int) -> str:
    return " ".join(f"t{i}" for i in torch.randint(0, V, (n,), generator=g).tolist())


def prompt_completion(n: int = 48, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return datasets.Dataset.from_dict(
        {
            "prompt": [words(g, int(k)) for k in torch.randint(2, 30, (n,), generator=g)],
            "completion": [" " + words(g, int(k)) for k in torch.randint(1, 20, (n,), generator=g)],
        }
    )


def tiny(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)
    if kind == "qwen3":
        config = transformers.Qwen3Config(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.2,
        )  # fmt: skip
        return transformers.Qwen3ForCausalLM(config)
    if kind == "qwen3_5":  # hybrid: a gated-delta-rule layer and a full attention layer
        return transformers.Qwen3_5ForCausalLM(tiny_config(transformers.Qwen3_5TextConfig()))
    if kind == "gpt_oss":  # attention sinks, a sliding and a full layer, experts
        return transformers.GptOssForCausalLM(tiny_config(transformers.GptOssConfig()))
    raise ValueError(kind)


def sft_args(tmp_path, name: str, **overrides):
    kw = dict(
        output_dir=str(tmp_path / name), max_length=64, per_device_train_batch_size=2,
        max_steps=STEPS, logging_steps=1, learning_rate=1e-3, use_cpu=True, bf16=False,
        report_to=[], save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    return trl.SFTConfig(**(kw | overrides))


class Recorder:
    """The flexpack trainer's collator, keeping each step's rows."""

    def __init__(self, collator) -> None:
        self.collator, self.steps = collator, []

    def __call__(self, rows):
        self.steps.append([dict(r) for r in rows])
        return self.collator(rows)


def documents(rows) -> list[dict]:
    """The samples of packed rows, each with its own input_ids and labels (in row order)."""
    out = []
    for row in rows:
        start = 0
        for n in row["seq_lengths"]:
            ids = list(row["input_ids"][start : start + n])
            out.append({"input_ids": ids, "labels": list(row["labels"][start : start + n])})
            start += n
    return out


def reference_run(model, tokenizer, steps, args, **kwargs):
    """TRL's own SFTTrainer, unpacked and padded, over the same samples, step by step."""
    pad = trl.trainer.sft_trainer.DataCollatorForLanguageModeling(pad_token_id=PAD)
    batches = iter([documents(rows) for rows in steps])

    def collate(_items):  # Trainer asks for one item per step: that step's samples, padded
        return pad(next(batches))

    trainer = trl.SFTTrainer(
        model=model, args=args, processing_class=tokenizer, data_collator=collate,
        train_dataset=datasets.Dataset.from_dict({"step": list(range(len(steps)))}), **kwargs,
    )  # fmt: skip
    trainer.train()
    return trainer


def losses(trainer) -> torch.Tensor:
    return torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h])


def max_param_diff(a, b) -> float:
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return max((p - q).abs().max().item() for p, q in pairs)


@pytest.mark.parametrize(
    ("kind", "reference_attention"),
    [("llama", "sdpa"), ("qwen3", "sdpa"), ("qwen3_5", "sdpa"), ("gpt_oss", "eager")],
)
def test_training_equals_unpacked_trl(tmp_path, tokenizer, kind, reference_attention):
    model = tiny(kind)
    attention = model.config._attn_implementation
    reference = copy.deepcopy(model)
    reference.set_attn_implementation(reference_attention)
    # gpt-oss: TRL turns its router's load-balancing loss on (router_aux_loss_coef 0.9): over
    # the packed rows' real tokens it equals the loss over the same samples unpacked.
    extra = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = SFTTrainer(
            model=model, args=sft_args(tmp_path, "flexpack", **extra),
            train_dataset=prompt_completion(), processing_class=tokenizer,
        )  # fmt: skip
        recorder = Recorder(trainer.data_collator)
        trainer.data_collator = recorder
        trainer.train()
        assert model.config._attn_implementation == attention  # restored after train()
        ref = reference_run(
            reference, tokenizer, recorder.steps[:STEPS],
            sft_args(tmp_path, "trl", packing=False, padding_free=False,
                     remove_unused_columns=False,
                     dataset_kwargs={"skip_prepare_dataset": True}, **extra),
        )  # fmt: skip
    # Packing really happened: rows of several samples, the prompts out of the loss.
    first = recorder.steps[0]
    assert max(len(r["seq_lengths"]) for r in first) > 1
    assert sum(label == -100 for r in first for label in r["labels"]) > len(first[0]["seq_lengths"])
    ours, theirs = losses(trainer), losses(ref)
    assert len(ours) == len(theirs) == STEPS
    loss_diff = (ours - theirs).abs().max().item()
    weight_diff = max_param_diff(model, reference)
    print(f"{kind}: max loss diff {loss_diff:.2e}, max weight diff {weight_diff:.2e}")
    assert loss_diff < FP32
    assert weight_diff < FP32
    # Training moved the weights far more than the tolerance: the comparison has teeth.
    assert max_param_diff(model, tiny(kind)) > 100 * FP32


def per_sample_mean_loss(steps_docs: list[int]):
    """The reference's per-document loss: for each micro-batch of right-padded samples, the sum
    of each sample's mean token loss over the step's number of samples (TRL's compute_loss_func
    hook, on the full logits)."""
    counts = iter(steps_docs)

    def loss(outputs, labels, num_items_in_batch=None):
        logits = outputs.logits[:, :-1].float()
        target = labels[:, 1:]
        nll = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), target, ignore_index=-100, reduction="none"
        )  # (B, S - 1)
        supervised = target != -100
        per_sample = nll.sum(1) / supervised.sum(1).clamp(min=1)
        return per_sample[supervised.any(1)].sum() / next(counts)

    return loss


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_per_document_loss_equals_unpacked_mean_of_sample_means(tmp_path, tokenizer, kind):
    """reduction="document": each step's loss is the mean over its samples of each one's mean
    token loss, over two accumulated micro-batches; equal, over the steps and in the weights, to
    TRL's unpacked trainer computing exactly that from the full logits."""
    model = tiny(kind)
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    steps, accumulate = 4, 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = SFTTrainer(
            model=model, processing_class=tokenizer, train_dataset=prompt_completion(),
            args=sft_args(tmp_path, "flexpack", max_steps=steps,
                          gradient_accumulation_steps=accumulate),
            reduction="document",
        )  # fmt: skip
        recorder = Recorder(trainer.data_collator)
        trainer.data_collator = recorder
        trainer.train()
        micro = recorder.steps[: steps * accumulate]
        per_step = [
            sum(len(r["seq_lengths"]) for rows in micro[i : i + accumulate] for r in rows)
            for i in range(0, len(micro), accumulate)
        ]
        # each micro-batch's compute_loss call divides by its step's samples
        divisors = [n for n in per_step for _ in range(accumulate)]
        ref = reference_run(
            reference, tokenizer, micro,
            sft_args(tmp_path, "trl", packing=False, padding_free=False, max_steps=steps,
                     gradient_accumulation_steps=accumulate, remove_unused_columns=False,
                     dataset_kwargs={"skip_prepare_dataset": True}),
            compute_loss_func=per_sample_mean_loss(divisors),
        )  # fmt: skip
    ours, theirs = losses(trainer), losses(ref)
    assert len(ours) == len(theirs) == steps
    assert (ours - theirs).abs().max().item() < FP32
    # Adam's normalised step can turn an fp32 rounding of a near-zero gradient into a move of
    # up to the learning rate (Qwen3.5's one-pass rule and TRL's per-document one chunk
    # differently): 2e-5 on one weight after 4 steps
    assert max_param_diff(model, reference) < 10 * FP32
    assert max_param_diff(model, tiny(kind)) > 100 * FP32


def test_per_document_weights_count_documents_not_tokens():
    from flexpack.integrations.trl.sft import _document_weights

    labels = torch.tensor([[-100, 5, 6, -100, 7, -100], [-100, -100, 8, 9, 9, -100]])
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, -1], [0, 0, 0, 1, 1, 1]])
    weight, documents = _document_weights(labels, doc_ids)
    # row 0: document 0 has targets 5, 6 (1/2 each), document 1 has 7 (1); row 1: 8 in doc 0,
    # 9 9 in doc 1 (the prompt-masked first token of doc 1 is a -100 target)
    want = torch.tensor([[0.5, 0.5, 0, 1, 0], [0, 1, 0.5, 0.5, 0]])
    torch.testing.assert_close(weight, want)
    assert int(documents) == 4


def test_flexpack_stats_in_logs(tmp_path, tokenizer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = SFTTrainer(
            model=tiny("llama"), args=sft_args(tmp_path, "stats", max_steps=3),
            train_dataset=prompt_completion(), processing_class=tokenizer,
        )  # fmt: skip
        trainer.train()
    stats = trainer.flexpack_stats
    assert isinstance(stats, PackStats)
    assert stats.steps == 3 and stats.rows == 6 and stats.row_tokens == 6 * 64
    assert stats.documents > stats.rows  # several samples per row
    assert 0.5 < stats.fill <= 1 and stats.padding_removed > 0
    logged = [h for h in trainer.state.log_history if "loss" in h]
    for key in ("flexpack/rows", "flexpack/fill", "flexpack/tokens", "flexpack/padding_removed"):
        assert all(key in h for h in logged), key
    assert sum(h["flexpack/tokens"] for h in logged) == stats.tokens
    # TRL's num_tokens counts the rows' real tokens, not their padding
    assert logged[-1]["num_tokens"] == stats.tokens


def test_dataset_is_packed_whole_with_prompt_masked(tmp_path, tokenizer):
    data = prompt_completion(n=60)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = SFTTrainer(
            model=tiny("llama"), args=sft_args(tmp_path, "packed"), train_dataset=data,
            processing_class=tokenizer,
        )  # fmt: skip
    packed = trainer.train_dataset
    assert sum(len(s) for s in packed["seq_lengths"]) == len(data)  # every sample, once
    assert all(n <= 64 for n in packed["num_tokens"])
    lengths = sorted(n for s in packed["seq_lengths"] for n in s)
    # one best-fit-decreasing plan over every length: no more rows than tokens need, plus one
    assert len(packed) <= sum(lengths) // 64 + 2
    # completion-only loss (TRL's default on prompt-completion data): each sample's prompt
    # (2 words or more) is -100, its completion and EOS are supervised
    for row in packed.select(range(3)):
        start = 0
        for n in row["seq_lengths"]:
            labels = row["labels"][start : start + n]
            assert labels[:2] == [-100, -100] and labels[-1] == EOS
            start += n


def test_refusals(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="max_length"):
        SFTTrainer(
            model=tiny("llama"), args=sft_args(tmp_path, "n", max_length=None),
            train_dataset=prompt_completion(), processing_class=tokenizer,
        )  # fmt: skip


def test_docs_recipe_runs_as_written(tmp_path, monkeypatch):
    """docs/integrations.md, recipe 2 (the drop-in), after the page's common start."""
    import re
    from pathlib import Path

    page = (Path(__file__).parents[1] / "docs" / "integrations.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page.split("## Training recipes")[1], flags=re.S)
    (common,) = [b for b in blocks if "def tiny_llama" in b]
    (dropin,) = [b for b in blocks if "import SFTTrainer  # was: from trl" in b]
    monkeypatch.chdir(tmp_path)  # the recipe writes to out/
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(common + dropin, "docs/integrations.md recipe 2", "exec"), namespace)
    trainer = namespace["dropin"]
    stats = trainer.flexpack_stats
    assert stats.steps == 8 and stats.rows == 16 and stats.fill > 0.9
    assert trainer.args.bf16 and trainer.completion_only_loss  # TRL's defaults, kept
    assert trainer.model.config._attn_implementation == "sdpa"  # switched back after train()
    assert "flexpack/fill" in trainer.state.log_history[0]
