"""The VLM recipes of docs/vlm.md, run as written, then checked against unpacked training.

Reference: the same trainer (optimizer, schedule, data order), but every sample of a packed batch
runs alone through the model under transformers' ``sdpa``, as its processor output; the loss is
the sum of their next-token losses over the batch's supervised tokens. 10 steps, fp32.
"""

from __future__ import annotations

import dataclasses
import functools
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

from flexpack.integrations.transformers import collate_multimodal  # noqa: E402

PAGE = Path(__file__).parents[1] / "docs" / "vlm.md"
FP32 = 1e-5


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> dict:
    """Every python block of the page, in order, in one namespace (they write to out/)."""
    here = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("vlm"))
    namespace: dict = {}
    try:
        for k, code in enumerate(re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)):
            exec(compile(code, f"docs/vlm.md block {k}", "exec"), namespace)
        yield namespace
    finally:
        os.chdir(here)


def unpacked_loss(model, inputs: dict, samples: list[dict], num_items=None) -> torch.Tensor:
    """Each sample of the batch alone (found by its sample_ids), summed, over the supervised."""
    total, count = torch.zeros(()), 0
    for r, a, b in documents(inputs["doc_ids"]):
        sample = samples[int(inputs["sample_ids"][r, a])]
        logits = model(**{k: v for k, v in sample.items() if k != "labels"}).logits[0]
        target = inputs["labels"][r, a + 1 : b]
        total = total + F.cross_entropy(logits[:-1], target, ignore_index=-100, reduction="sum")
        count += int((target != -100).sum())
    return total / (count if num_items is None else num_items)


def alone_mixin(base):
    class Unpacked(base):
        def __init__(self, *args, samples, **kwargs):
            super().__init__(*args, **kwargs)
            self.samples = samples

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return unpacked_loss(model, inputs, self.samples, num_items_in_batch)

    return Unpacked


def curve(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def max_param_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """Over every weight but SigLIP's key biases: softmax is invariant to them, their gradient is
    0 in exact arithmetic, and Adam scales the fp32 rounding left in it up to lr-sized steps
    (measured: 4.6e-5 on a bias of 4.1e-5; every other weight within 2e-7)."""
    pairs = zip(a.named_parameters(), b.named_parameters(), strict=True)
    return max((p - q).abs().max().item() for (n, p), (_, q) in pairs if "k_proj.bias" not in n)


def test_trainer_recipe_trains_exactly_as_each_sample_alone(page):
    trainer = page["trainer"]
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["position_ids"].shape == (3, 2, 64) and "pixel_values" in batch
    assert "sample_ids" not in batch
    reference = alone_mixin(transformers.Trainer)(
        model=page["tiny_qwen2_vl"]("sdpa"),
        args=dataclasses.replace(page["trainer_args"], output_dir="out/vlm-unpacked"),
        train_dataset=list(page["train_rows"]),
        data_collator=functools.partial(collate_multimodal, sample_ids=True),
        samples=page["train_samples"],
    )
    reference.train()
    got, want = curve(trainer), curve(reference)
    assert len(got) == 10
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < FP32
    assert max_param_diff(trainer.model, reference.model) < FP32


def test_sft_recipe_trains_exactly_as_each_sample_alone(page):
    sft = page["sft"]
    batch = next(iter(sft.get_train_dataloader()))
    assert batch["image_span_ids"].shape == (2, 48)
    reference = alone_mixin(trl.SFTTrainer)(
        model=page["tiny_gemma3"]("sdpa"),
        args=dataclasses.replace(page["sft_args"], output_dir="out/vlm-sft-unpacked"),
        train_dataset=datasets.Dataset.from_list(list(page["sft_rows"])),
        data_collator=functools.partial(collate_multimodal, sample_ids=True),
        processing_class=page["tokenizer"],
        samples=page["sft_samples"],
    )
    reference.train()
    got, want = curve(sft), curve(reference)
    assert len(got) == 10
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < FP32
    assert max_param_diff(sft.model, reference.model) < FP32
