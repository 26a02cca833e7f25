"""The training recipes of docs/integrations.md, run as written, then checked against references.

References: each sample run alone through the same weights under transformers' own ``sdpa``
(per-document losses), and the same optimizer steps on the unpacked samples in the same order
(loss curve and final weights). A negative control shows the tolerance would catch a leak.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _rows import documents

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

PAGE = Path(__file__).parents[1] / "docs" / "integrations.md"
FP32 = 1e-5
BF16 = 2e-2  # bf16 noise on a loss of ~5.5; a leak moves per-document losses by far more


def recipe_blocks() -> list[str]:
    page = PAGE.read_text().split("## Training recipes")[1]
    return re.findall(r"```python\n(.*?)```", page, flags=re.S)


def run_block(marker: str, namespace: dict) -> dict:
    """Run the one recipe block that contains ``marker``, in ``namespace``."""
    (code,) = [block for block in recipe_blocks() if marker in block]
    exec(compile(code, f"docs/integrations.md recipe with {marker!r}", "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    here = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("recipes"))  # the recipes write to out/
    yield
    os.chdir(here)


@pytest.fixture(scope="module")
def common(workdir) -> dict:
    return run_block("def tiny_llama", {})


def spans(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """(start, stop) of each sample of a flattened (1, T) row: a sample starts at position 0."""
    starts = [*torch.nonzero(position_ids[0] == 0).squeeze(1).tolist(), position_ids.shape[1]]
    return list(itertools.pairwise(starts))


def row_spans(batch: dict) -> list[tuple[int, int, int]]:
    """(row, start, stop) of every sample of a (B, S) batch, read independently of flexpack:
    from the runs of ``doc_ids`` (-1 = padding) when the batch has them, else from
    ``position_ids`` (a sample starts at position 0)."""
    if "doc_ids" in batch:
        return documents(batch["doc_ids"])
    out = []
    for r in range(batch["position_ids"].shape[0]):
        out += [(r, a, b) for a, b in spans(batch["position_ids"][r : r + 1])]
    return out


def doc_losses(logits: torch.Tensor, labels: torch.Tensor, cuts) -> list[float]:
    """Mean next-token loss of each sample; logits (B, S, V), labels (B, S) unshifted, HF style;
    ``cuts`` from :func:`row_spans`. Samples without a supervised target are skipped."""
    out = []
    for r, a, b in cuts:
        target = labels[r, a + 1 : b]
        if (target != -100).any():
            out.append(
                F.cross_entropy(logits[r, a : b - 1].float(), target, ignore_index=-100).item()
            )
    return out


def alone_logits(reference, input_ids: torch.Tensor, cuts) -> torch.Tensor:
    """Each sample run alone, written back at its tokens: (B, S, V), 0 elsewhere."""
    out = None
    for r, a, b in cuts:
        logits = reference(input_ids=input_ids[r : r + 1, a:b], use_cache=False).logits[0]
        if out is None:
            out = logits.new_zeros(*input_ids.shape, logits.shape[-1])
        out[r, a:b] = logits
    return out


def unpacked_loss(model, batch: dict, num_items: int | torch.Tensor | None = None):
    """Sum of every sample's next-token losses, each sample run alone, over the supervised count."""
    ids, labels = batch["input_ids"], batch["labels"]
    total = torch.zeros((), dtype=torch.float32)
    count = 0
    for r, a, b in row_spans(batch):
        logits = model(input_ids=ids[r : r + 1, a:b], use_cache=False).logits[0]
        target = labels[r, a + 1 : b]
        total = total + F.cross_entropy(
            logits[:-1].float(), target, ignore_index=-100, reduction="sum"
        )
        count += int((target != -100).sum())
    return total / (count if num_items is None else num_items)


def max_param_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return max((p - q).abs().max().item() for p, q in pairs)


# ----------------------------------------------------------------------------- autocast Llama


def test_packed_llama_under_bf16_autocast_equals_each_document_alone(common):
    g = torch.Generator().manual_seed(3)
    samples = [torch.randint(0, 256, (n,), generator=g) for n in (30, 9, 50, 20)]
    ids = torch.cat(samples)[None]
    positions = torch.cat([torch.arange(len(s)) for s in samples])[None]
    cuts = row_spans({"position_ids": positions})
    model = common["tiny_llama"]()
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        alone = alone_logits(reference, ids, cuts)
        # Negative control: the same row with a 2-D attention_mask makes transformers' sdpa
        # drop its packed-sequence detection, and documents attend to each other.
        leaky = reference(
            input_ids=ids, position_ids=positions, attention_mask=torch.ones_like(ids)
        ).logits
    assert packed.dtype == torch.bfloat16
    assert (packed.float() - alone.float()).abs().max().item() < 0.05
    assert (leaky.float() - alone.float()).abs().max().item() > 0.3
    with torch.no_grad():  # fp32 stays exact
        packed32 = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        alone32 = alone_logits(reference, ids, cuts)
    assert (packed32 - alone32).abs().max().item() < FP32


# ----------------------------------------------------------------------------- 1. HF Trainer


class UnpackedTrainer(transformers.Trainer):
    """The reference: the same Trainer, but every sample of a packed batch runs alone."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return unpacked_loss(model, inputs, num_items_in_batch)


def curve(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.fixture(scope="module")
def hf_trainer(common) -> dict:
    ns = run_block("data_collator=collate_rows", dict(common))
    return run_block("padded_trainer = ", ns)


def test_trainer_recipe_losses_per_document_equal_each_sample_alone(hf_trainer):
    batch = next(iter(hf_trainer["trainer"].get_train_dataloader()))
    assert batch["input_ids"].shape == (2, 128) and "doc_ids" in batch
    assert (batch["labels"] == -100).float().mean() > 0.3  # prompts (and padding) masked
    model, reference = hf_trainer["tiny_llama"](), hf_trainer["tiny_llama"]("sdpa")
    cuts = row_spans(batch)
    with torch.no_grad():
        packed = model(**batch).logits
        alone = alone_logits(reference, batch["input_ids"], cuts)
    got, want = (doc_losses(x, batch["labels"], cuts) for x in (packed, alone))
    assert len(got) >= 4
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < FP32


def test_trainer_recipe_loss_curve_equals_unpacked_training(hf_trainer):
    args = dataclasses.replace(hf_trainer["trainer_args"], output_dir="out/unpacked")
    reference = UnpackedTrainer(
        model=hf_trainer["tiny_llama"]("sdpa"),
        args=args,
        train_dataset=hf_trainer["packed"],
        data_collator=hf_trainer["collate_rows"],
    )
    reference.train()
    got, want = curve(hf_trainer["trainer"]), curve(reference)
    assert len(got) == 20
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < FP32
    assert max_param_diff(hf_trainer["trainer"].model, reference.model) < FP32


def test_padded_rows_with_trainer_defaults_train_exactly_as_the_collated_rows(hf_trainer):
    """remove_unused_columns drops doc_ids; position_ids find the documents, padding is -100."""
    batch = next(iter(hf_trainer["padded_trainer"].get_train_dataloader()))
    assert "doc_ids" not in batch and "position_ids" in batch
    got, want = curve(hf_trainer["padded_trainer"]), curve(hf_trainer["trainer"])
    assert len(got) == 20
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < FP32
    assert max_param_diff(hf_trainer["padded_trainer"].model, hf_trainer["trainer"].model) < FP32


# ----------------------------------------------------------------------------- 2. TRL SFTTrainer


class UnpackedSFTTrainer(trl.SFTTrainer):
    """The reference: the same trainer (optimizer, schedule, data order, autocast), but every
    sample of a packed batch runs alone through the model."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return unpacked_loss(model, inputs, num_items_in_batch)


@pytest.fixture(scope="module")
def sft(common) -> dict:
    return run_block("trl.SFTTrainer(", dict(common))


def test_sft_recipe_uses_trl_defaults_and_keeps_prompts_masked(sft):
    args = sft["sft"].args
    assert args.bf16 and args.packing and args.completion_only_loss in (None, True)
    batch = next(iter(sft["sft"].get_train_dataloader()))
    # The prompt of every sample carries no loss: its first supervised label is past the start.
    for start, _ in spans(batch["position_ids"]):
        assert (batch["labels"][0, start] == -100).item()
    assert (batch["labels"] == -100).float().mean() > 0.3
    losses = [h["loss"] for h in sft["sft"].state.log_history if "loss" in h]
    assert len(losses) == 20 and all(torch.isfinite(torch.tensor(losses)))


def test_sft_recipe_bf16_losses_per_document_equal_each_sample_alone(sft):
    trainer = sft["sft"]
    batch = next(iter(trainer.get_train_dataloader()))
    model = trainer.model.eval()
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    cuts = row_spans(batch)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        packed = model(**batch, use_cache=False).logits
        alone = alone_logits(reference, batch["input_ids"], cuts)
    got, want = (doc_losses(x, batch["labels"], cuts) for x in (packed, alone))
    assert len(got) >= 3
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < BF16


def test_sft_recipe_fp32_loss_curve_equals_unpacked_training(sft):
    # 8 of the recipe's 20 steps: fp32 agreement to 1e-5 after 8 optimizer steps already rules
    # out a leak (the recipe block itself, bf16, trains all 20); each step is ~1 s per trainer here
    args = dataclasses.replace(sft["sft_args"], bf16=False, output_dir="out/sft32", max_steps=8)
    runs = {}
    for name, cls, attn in (
        ("packed", trl.SFTTrainer, sft["register"]()),
        ("unpacked", UnpackedSFTTrainer, "sdpa"),
    ):
        trainer = cls(
            model=sft["tiny_llama"](attn),
            args=args,
            train_dataset=sft["sft_data"],
            processing_class=sft["tokenizer"],
        )
        trainer.train()
        runs[name] = trainer
    curves = [
        [h["loss"] for h in t.state.log_history if "loss" in h] for t in runs.values()
    ]  # fmt: skip
    assert len(curves[0]) == 8
    assert max(abs(a - b) for a, b in zip(*curves, strict=True)) < FP32
    assert max_param_diff(runs["packed"].model, runs["unpacked"].model) < FP32


# ----------------------------------------------------------------------------- 3. flattening


@pytest.fixture(scope="module")
def flat(common) -> dict:
    return run_block("DataCollatorWithFlattening(", dict(common))


def test_flattening_recipe_losses_per_document_equal_each_sample_alone(flat):
    batch = next(iter(flat["flat"]))
    reference = flat["tiny_llama"]("sdpa")
    model = flat["tiny_llama"]()
    cuts = row_spans(batch)
    with torch.no_grad():
        packed = model(**batch, use_cache=False).logits
        alone = alone_logits(reference, batch["input_ids"], cuts)
    got, want = (doc_losses(x, batch["labels"], cuts) for x in (packed, alone))
    assert len(got) == 4
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < FP32


def test_flattening_recipe_loss_curve_equals_unpacked_training(flat):
    reference = flat["tiny_llama"]("sdpa")
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    want = []
    for _, batch in zip(range(20), flat["flat"], strict=False):
        loss = unpacked_loss(reference, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        want.append(loss.item())
    got = flat["flat_losses"]
    assert len(got) == 20
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < FP32
    assert max_param_diff(flat["model"], reference) < FP32
