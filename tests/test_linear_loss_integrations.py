"""Where users compute the loss: flexpack's GPT, transformers models and TRL's SFTTrainer, each
with the chunked loss (no (B, S, V) logits) equal to packed_cross_entropy of the model's logits."""

from __future__ import annotations

import pytest
import torch

import flexpack
from flexpack.models import GPT, GPTConfig

FP32 = {"rtol": 1e-5, "atol": 1e-6}


def sft_batch(vocab: int, *, seed: int, max_len: int = 48):
    """Packed rows of prompt-masked samples, with padding and a row of one document."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for n in (20, 7, 30, 11, 48, 5):
        ids = torch.randint(0, vocab, (n,), generator=g)
        labels = ids.clone()
        labels[: n // 3] = -100
        samples.append({"input_ids": ids, "labels": labels})
    return flexpack.pack_sequences(samples, max_len=max_len)


def grads(loss, params):
    return torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)


def assert_grads_close(a, b, **tol):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, **tol)


@pytest.mark.parametrize("reduction", ["token", "document"])
@pytest.mark.parametrize("tied", [True, False])
def test_gpt_loss_equals_the_logits_path(reduction, tied):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=32, tie_embeddings=tied))
    batch = sft_batch(256, seed=1)
    params = list(model.parameters())
    got = model.loss(batch.input_ids, batch.labels, doc_ids=batch.doc_ids, reduction=reduction)
    logits = model(batch.input_ids, doc_ids=batch.doc_ids)
    want = flexpack.packed_cross_entropy(logits, batch.labels, batch.doc_ids, reduction=reduction)
    torch.testing.assert_close(got, want, **FP32)
    assert_grads_close(grads(got, params), grads(want, params), **FP32)
    # the packer's host-side layout, and a plain row without doc_ids (one document per row)
    by_layout = model.loss(batch.input_ids, batch.labels, layout=batch.layout, reduction=reduction)
    torch.testing.assert_close(by_layout, want, **FP32)
    plain = model.loss(batch.input_ids, batch.labels, reduction=reduction)
    one_doc = torch.zeros_like(batch.doc_ids)
    want_plain = flexpack.packed_cross_entropy(
        model(batch.input_ids), batch.labels, one_doc, reduction=reduction
    )
    torch.testing.assert_close(plain, want_plain, **FP32)


transformers = pytest.importorskip("transformers")


def tiny(cls_name: str, **extra):
    from flexpack.integrations.transformers import register

    config_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    config = config_cls(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation=register(), **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    return getattr(transformers, cls_name)(config)


@pytest.mark.parametrize("reduction", ["token", "document"])
def test_transformers_loss_equals_the_model_own_and_the_logits_path(reduction):
    from flexpack.integrations.transformers import packed_causal_lm_loss, packed_forward_kwargs

    model = tiny("LlamaForCausalLM")
    batch = sft_batch(96, seed=2)
    params = list(model.parameters())
    got = packed_causal_lm_loss(model, batch, reduction=reduction)
    out = model(**packed_forward_kwargs(batch, labels=True))
    want = flexpack.packed_cross_entropy(
        out.logits, batch.labels, batch.doc_ids, reduction=reduction
    )
    torch.testing.assert_close(got, want, **FP32)
    assert_grads_close(grads(got, params), grads(want, params), **FP32)
    if reduction == "token":  # transformers' own loss on flexpack rows
        torch.testing.assert_close(got, out.loss, **FP32)
    # the keyword arguments of a model call (a Trainer batch) give the same
    again = packed_causal_lm_loss(
        model, packed_forward_kwargs(batch, labels=True), reduction=reduction
    )
    torch.testing.assert_close(again, got)


def test_transformers_loss_applies_gemma2_final_softcapping():
    from flexpack.integrations.transformers import packed_causal_lm_loss, packed_forward_kwargs

    model = tiny("Gemma2ForCausalLM", head_dim=8, sliding_window=8, final_logit_softcapping=2.0,
                 initializer_range=0.5)  # fmt: skip
    batch = sft_batch(96, seed=3)
    params = list(model.parameters())
    got = packed_causal_lm_loss(model, batch, reduction="document")
    logits = model(**packed_forward_kwargs(batch)).logits  # soft-capped by the model
    assert logits.abs().max() <= 2.0
    want = flexpack.packed_cross_entropy(logits, batch.labels, batch.doc_ids, reduction="document")
    torch.testing.assert_close(got, want, **FP32)
    assert_grads_close(grads(got, params), grads(want, params), **FP32)


def test_transformers_loss_reads_documents_from_position_ids_and_padding():
    # A DataCollatorWithFlattening-style row (positions restart per sample) and a 2-D padding
    # attention_mask: the documents the attention sees are the loss's documents.
    from flexpack.integrations.transformers import packed_causal_lm_loss

    model = tiny("LlamaForCausalLM")
    batch = sft_batch(96, seed=4)
    kwargs = {
        "input_ids": batch.input_ids,
        "position_ids": batch.position_ids,
        "attention_mask": (batch.doc_ids >= 0).long(),
        "labels": batch.labels,
    }
    got = packed_causal_lm_loss(model, kwargs, reduction="document")
    logits = model(**kwargs, use_cache=False).logits
    want = flexpack.packed_cross_entropy(logits, batch.labels, batch.doc_ids, reduction="document")
    torch.testing.assert_close(got, want, **FP32)


def test_transformers_loss_refuses_what_it_cannot_do():
    from flexpack.integrations.transformers import packed_causal_lm_loss, packed_forward_kwargs

    model = tiny("LlamaForCausalLM")
    batch = sft_batch(96, seed=5)
    with pytest.raises(TypeError, match="needs labels"):
        packed_causal_lm_loss(model, packed_forward_kwargs(batch))
    model.config.logit_scale = 0.25  # Cohere-style scaled logits
    with pytest.raises(ValueError, match=r"scales its logits \(logit_scale=0.25\)"):
        packed_causal_lm_loss(model, batch)
    del model.config.logit_scale

    class DistributedDataParallel(torch.nn.Module):  # what torch's wrapper is called
        def __init__(self, module):
            super().__init__()
            self.module = module

    with pytest.raises(ValueError, match=r"DistributedDataParallel.*model\.module"):
        packed_causal_lm_loss(DistributedDataParallel(model), batch)
    with pytest.raises(TypeError, match="backbone"):
        packed_causal_lm_loss(torch.nn.Linear(2, 2), batch)


def test_trl_sft_trainer_subclass_trains_on_the_chunked_loss(tmp_path):
    # TRL's seam: a subclass overriding compute_loss (compute_loss_func gets the full logits).
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from flexpack.data import collate
    from flexpack.integrations.datasets import pack_dataset
    from flexpack.integrations.transformers import packed_causal_lm_loss, packed_forward_kwargs

    class PackedSFTTrainer(trl.SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return packed_causal_lm_loss(model, inputs, reduction="document")

    g = torch.Generator().manual_seed(6)
    rows = []
    for k in torch.randint(4, 40, (24,), generator=g).tolist():
        ids = torch.randint(0, 96, (k,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * (k // 3) + ids[k // 3 :]})
    packed = pack_dataset(datasets.Dataset.from_list(rows), 64)
    seen = []

    def collate_rows(batch_rows):
        kwargs = packed_forward_kwargs(collate(batch_rows, max_len=64), labels=True)
        seen.append(kwargs)
        return kwargs

    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(96)}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab | {"<unk>": 95}, unk_token="<unk>")),
        pad_token="t0", eos_token="t1", unk_token="<unk>",
    )  # fmt: skip
    model = tiny("LlamaForCausalLM")
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    args = trl.SFTConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, learning_rate=0.0,
        report_to=[], save_strategy="no", use_cpu=True, bf16=False, logging_steps=1,
        remove_unused_columns=False, dataset_kwargs={"skip_prepare_dataset": True},
    )  # fmt: skip
    trainer = PackedSFTTrainer(
        model=model, args=args, train_dataset=packed, data_collator=collate_rows,
        processing_class=tokenizer,
    )  # fmt: skip
    trainer.train()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2
    reference = copy_of(tiny("LlamaForCausalLM"), start)
    first = seen[0]
    logits = reference(**{k: v for k, v in first.items() if k != "labels"}).logits
    want = flexpack.packed_cross_entropy(logits, first["labels"], first["doc_ids"],
                                         reduction="document")  # fmt: skip
    assert logged[0] == pytest.approx(want.item(), rel=1e-4)


def copy_of(model, state):
    with torch.no_grad():
        for k, v in model.named_parameters():
            v.copy_(state[k])
    return model
