"""flexpack.integrations.litgpt against LitGPT's own forward, data modules and checkpoints.

The reference for every packed result is LitGPT itself: each document run alone through
``model(ids)``, the unpacked token-mean loss, LitGPT's ``SFTDataset`` labels, LitGPT's checkpoint
loader. Runs in the litgpt virtual environment only (``.ci/run``'s second venv); skipped elsewhere.
"""

from __future__ import annotations

import csv
import json
import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

litgpt = pytest.importorskip("litgpt")

from litgpt import GPT, Config  # noqa: E402
from litgpt.data import DataModule  # noqa: E402
from litgpt.model import Block, CausalSelfAttention  # noqa: E402

import flexpack  # noqa: E402
from flexpack.integrations.litgpt import (  # noqa: E402
    PackedDataModule,
    PackedGPT,
    PackedGPTLoss,
    lr_schedule,
    main,
    packed_forward,
    packed_loss,
)
from flexpack.testing.litgpt import BYTE_VOCAB_SIZE, tiny_checkpoint  # noqa: E402

EOS = 2
_COMMON = dict(block_size=64, vocab_size=BYTE_VOCAB_SIZE, padding_multiple=64, n_embd=64)
CONFIGS = {
    # Llama: GQA, RMSNorm, SwiGLU, full rotary, sequential residual.
    "llama": dict(
        name="tiny-llama", n_layer=2, n_head=4, n_query_groups=2, rotary_percentage=1.0,
        parallel_residual=False, bias=False, norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP", intermediate_size=128,
    ),
    # Pythia: parallel residual, rotary on a quarter of the head, LayerNorm, biases.
    "pythia": dict(
        name="tiny-pythia", n_layer=2, n_head=4, rotary_percentage=0.25,
        parallel_residual=True, bias=True, norm_class_name="LayerNorm",
        mlp_class_name="GptNeoxMLP",
    ),
    # Mistral: sliding window on every layer, multi-query attention.
    "mistral": dict(
        name="tiny-mistral", n_layer=2, n_head=4, n_query_groups=1, rotary_percentage=1.0,
        parallel_residual=False, bias=False, norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP", intermediate_size=128, sliding_window_size=5,
    ),
    # Gemma 2: alternating sliding window, attention and final softcapping (small, so that tanh
    # bends), post norms, scaled embeddings, attention_scores_scalar != head_size, GQA.
    "gemma2": dict(
        name="Gemma-2-tiny", n_layer=2, n_head=4, n_query_groups=2, rotary_percentage=1.0,
        parallel_residual=False, bias=False, norm_class_name="RMSNorm",
        mlp_class_name="GemmaMLP", gelu_approximate="tanh", intermediate_size=128,
        post_attention_norm=True, post_mlp_norm=True, scale_embeddings=True,
        attention_scores_scalar=24, sliding_window_size=5, sliding_window_indices=[1, 0],
        attention_logit_softcapping=2.0, final_logit_softcapping=5.0,
    ),
    # Gemma 3: local RoPE base on the sliding layers (rope_indices), q/k norms.
    "gemma3": dict(
        name="Gemma-3-tiny", n_layer=2, n_head=4, n_query_groups=1, rotary_percentage=1.0,
        parallel_residual=False, bias=False, norm_class_name="RMSNorm",
        mlp_class_name="GemmaMLP", gelu_approximate="tanh", intermediate_size=128,
        post_attention_norm=True, post_mlp_norm=True, scale_embeddings=True, norm_qk=True,
        sliding_window_size=5, sliding_window_indices=[1, 0], rope_base=10000,
        rope_local_base_freq=100, rope_indices=[1, 0],
    ),
}  # fmt: skip


def make_model(kind: str, *, seed: int = 0) -> GPT:
    """A LitGPT GPT of the named shape with random weights large enough to make leaks visible."""
    config = Config(**_COMMON, **CONFIGS[kind])
    model = GPT(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(
                    (0.1 if name.endswith(".bias") else 1.0)
                    + 0.1 * torch.randn(p.shape, generator=g)
                )
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model


def documents(batch) -> list[tuple[int, torch.Tensor]]:
    """(row, token positions) of every document of a packed batch."""
    out = []
    for r in range(batch.input_ids.shape[0]):
        d = batch.doc_ids[r]
        for i in torch.unique(d[d >= 0]).tolist():
            out.append((r, torch.nonzero(d == i).reshape(-1)))
    return out


def packed_docs(lengths, max_len, *, seed=0):
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(3, BYTE_VOCAB_SIZE, (n,), generator=g) for n in lengths]
    return flexpack.pack_sequences(docs, max_len=max_len, strategy="greedy")


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_packed_logits_equal_each_document_alone(kind):
    model = make_model(kind)
    batch = packed_docs([7, 13, 4, 9, 11, 3], max_len=24)
    logits = packed_forward(model, batch.input_ids, batch.doc_ids)
    assert logits.shape == (*batch.input_ids.shape, model.config.padded_vocab_size)
    leak = 0.0
    unpacked_rows = model(batch.input_ids)  # LitGPT's own forward: one causal row, leaks
    for r, pos in documents(batch):
        alone = model(batch.input_ids[r, pos][None])[0]
        torch.testing.assert_close(logits[r, pos], alone, rtol=0, atol=1e-4)
        leak = max(leak, (unpacked_rows[r, pos] - alone).abs().max().item())
    assert leak > 0.5  # the test can see a leak


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_packed_token_loss_grads_equal_unpacked(kind):
    model = make_model(kind, seed=1)
    batch = packed_docs([9, 5, 12, 6, 8], max_len=20, seed=1)
    loss = flexpack.packed_cross_entropy(
        packed_forward(model, batch.input_ids, batch.doc_ids),
        batch.labels,
        batch.doc_ids,
        reduction="token",
    )
    loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    total, count = 0.0, 0
    for r, pos in documents(batch):
        ids = batch.input_ids[r, pos]
        logits = model(ids[None])[0]
        total = total + F.cross_entropy(logits[:-1], ids[1:], reduction="sum")
        count += len(ids) - 1
    ref = total / count
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-5)
    for n, p in model.named_parameters():
        # fp32 summation order: Gemma's scaled, tied embedding grads (max ~1.5) differ by ~4e-6
        torch.testing.assert_close(packed_grads[n], p.grad, rtol=1e-4, atol=1e-5, msg=n)


@settings(max_examples=8)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=5),
    slack=st.integers(0, 5),
    kind=st.sampled_from(["llama", "mistral"]),
)
def test_property_any_layout_matches_documents_alone(lengths, slack, kind):
    model = _MODELS.setdefault(kind, make_model(kind))
    max_len = max(lengths) + slack
    batch = packed_docs(lengths, max_len=max_len)
    with torch.no_grad():
        logits = packed_forward(model, batch.input_ids, batch.doc_ids, backend="sdpa")
        for r, pos in documents(batch):
            alone = model(batch.input_ids[r, pos][None])[0]
            torch.testing.assert_close(logits[r, pos], alone, rtol=0, atol=1e-4)


_MODELS: dict[str, GPT] = {}


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_bf16_autocast_is_within_bf16_noise(kind):
    # Fabric's "bf16-mixed" runs the forward under autocast. The packed result's error against
    # fp32 stays within twice LitGPT's own bf16 error on each document alone.
    model = make_model(kind)
    batch = packed_docs([7, 13, 4, 9, 11, 3], max_len=24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = packed_forward(model, batch.input_ids, batch.doc_ids)
    assert logits.dtype == torch.bfloat16
    for r, pos in documents(batch):
        ids = batch.input_ids[r, pos][None]
        exact = model(ids)[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lit_bf16 = model(ids)[0].float()
        own_noise = (lit_bf16 - exact).abs().max().item()
        assert (logits[r, pos].float() - exact).abs().max().item() <= 2 * own_noise + 0.05


def test_model_is_left_exactly_as_it_was():
    model = make_model("gemma2")
    methods = {cls: cls.forward for cls in (GPT, Block, CausalSelfAttention)}
    attrs = {name: set(m.__dict__) for name, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(3, BYTE_VOCAB_SIZE, (1, 10))
    before = model(ids)
    batch = packed_docs([5, 6], max_len=12)
    packed_forward(model, batch.input_ids, batch.doc_ids).sum().backward()
    assert {cls: cls.forward for cls in methods} == methods
    assert {name: set(m.__dict__) for name, m in model.named_modules()} == attrs
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    torch.testing.assert_close(model(ids), before, rtol=0, atol=0)


def test_explicit_position_ids_and_padding_rows():
    model = make_model("llama")
    batch = packed_docs([6, 4], max_len=16)  # one row with 6 padding tokens
    default = packed_forward(model, batch.input_ids, batch.doc_ids)
    given_pos = packed_forward(
        model, batch.input_ids, batch.doc_ids, position_ids=batch.position_ids
    )
    torch.testing.assert_close(default, given_pos, rtol=0, atol=0)
    assert torch.isfinite(default).all()


def test_pretraining_rows_with_from_eos():
    # LitGPT's pretraining streams: documents joined by EOS, cut into rows; no padding.
    model = make_model("mistral")
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(3, BYTE_VOCAB_SIZE, (n,), generator=g) for n in (6, 9, 5)]
    stream = torch.cat([torch.cat([d, torch.tensor([EOS])]) for d in docs])
    rows = stream[:18].reshape(1, 18)  # the last document is cut by the row end
    layout = flexpack.PackedLayout.from_eos(rows, EOS)
    logits = packed_forward(model, rows, layout.doc_ids)
    start = 0
    for n in (7, 10, 1):  # two whole documents with their EOS, then the head of the third
        piece = rows[:, start : start + n]
        torch.testing.assert_close(logits[:, start : start + n], model(piece), rtol=0, atol=1e-4)
        start += n


def test_packed_gpt_module_wraps_without_copying():
    model = make_model("pythia")
    wrapper = PackedGPT(model)
    assert wrapper.model is model
    assert [p for p in wrapper.parameters()] == [p for p in model.parameters()]
    batch = packed_docs([3, 4], max_len=8)
    torch.testing.assert_close(
        wrapper(batch.input_ids, batch.doc_ids),
        packed_forward(model, batch.input_ids, batch.doc_ids),
        rtol=0,
        atol=0,
    )


def test_bad_inputs_say_what_to_do():
    model = make_model("llama")
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(TypeError, match=r"litgpt\.GPT"):
        packed_forward(torch.nn.Linear(2, 2), ids, ids)
    with pytest.raises(ValueError, match=r"\(B, S\)"):
        packed_forward(model, ids, torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="integer"):
        packed_forward(model, ids, torch.zeros(1, 4))
    model.max_seq_length = 8
    long_doc = torch.zeros(1, 12, dtype=torch.long)
    with pytest.raises(ValueError, match="RoPE cache"):
        packed_forward(model, long_doc, torch.zeros(1, 12, dtype=torch.long))
    # the same row as two documents fits
    packed_forward(model, long_doc, torch.tensor([[0] * 6 + [1] * 6]))
    short = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="RoPE cache"):  # explicit positions are checked too
        packed_forward(model, short, short, position_ids=torch.tensor([[0, 1, 2, 8]]))


# ------------------------------------------------------------------------------------ data


WORDS = "the cat sat on a mat and dog ran far away from home while birds sang".split()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A tiny LitGPT checkpoint (byte tokenizer) and an instruction JSON file, all offline."""
    root = tmp_path_factory.mktemp("litgpt")
    rng = random.Random(0)
    samples = [
        {
            "instruction": " ".join(rng.choices(WORDS, k=rng.randint(1, 6))),
            "input": "",
            "output": " ".join(rng.choices(WORDS, k=rng.randint(1, 25))),
        }
        for _ in range(80)
    ]
    (root / "data.json").write_text(json.dumps(samples))
    config = Config(**{**_COMMON, **CONFIGS["llama"], "block_size": 512})
    tiny_checkpoint(root / "ckpt", config, seed=0)
    return root


def json_data(workdir):
    from litgpt.data import JSON

    return JSON(workdir / "data.json", val_split_fraction=0.1, mask_prompt=True, num_workers=0)


def test_packed_data_module_keeps_prompt_masks_and_every_sample(workdir):
    from litgpt import Tokenizer

    tokenizer = Tokenizer(workdir / "ckpt")
    inner = json_data(workdir)
    inner.connect(tokenizer, max_seq_length=512)
    inner.setup()
    expected = {}
    for i in range(len(inner.train_dataset)):
        item = inner.train_dataset[i]
        labels = item["labels"].clone()
        labels[0] = -100  # packing also masks each document's first token
        expected.setdefault(tuple(item["input_ids"].tolist()), []).append(labels.tolist())

    rows = {}
    for rank in (0, 1):
        data = PackedDataModule(json_data(workdir), 512, seed=3, world_size=2, rank=rank)
        data.connect(tokenizer, batch_size=2, max_seq_length=512)
        data.setup()
        batches = list(data.train_dataloader())
        rows[rank] = sum(b["input_ids"].shape[0] for b in batches)
        for b in batches:
            assert sorted(b) == ["doc_ids", "input_ids", "labels", "position_ids"]
            assert b["input_ids"].shape[1] == 512 and b["doc_ids"].dtype == torch.int32
            for r in range(b["input_ids"].shape[0]):
                d = b["doc_ids"][r]
                for i in torch.unique(d[d >= 0]).tolist():
                    pos = torch.nonzero(d == i).reshape(-1)
                    key = tuple(b["input_ids"][r, pos].tolist())
                    assert b["labels"][r, pos].tolist() in expected[key]
                    assert b["position_ids"][r, pos].tolist() == list(range(len(pos)))
                    assert (b["labels"][r, pos] == -100).sum() > 1  # the prompt stays masked
    assert rows[0] == rows[1]  # equal rows per rank
    plan = data.train_plan
    assert plan.stats.samples == len(inner.train_dataset)
    assert plan.stats.placed == plan.stats.tokens  # nothing truncated or dropped
    assert rows[0] + rows[1] >= plan.num_rows  # every row served (a few twice)


class ListData(DataModule):
    """The smallest LitGPT DataModule: in-memory SFT samples, no tokenizer."""

    def __init__(self, train, val):
        super().__init__()
        self.train, self.val = train, val

    def connect(self, tokenizer=None, batch_size=1, max_seq_length=None):
        self.max_seq_length = max_seq_length

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.train)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.val)


@settings(max_examples=15)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=30),
    world_size=st.integers(1, 4),
    batch_size=st.integers(1, 3),
    epoch=st.integers(0, 2),
)
def test_property_equal_rows_per_rank_and_every_sample_each_epoch(
    lengths, world_size, batch_size, epoch
):
    samples = [
        {"input_ids": torch.full((n,), 3 + i), "labels": torch.full((n,), -100 if i % 2 else 3 + i)}
        for i, n in enumerate(lengths)
    ]
    seen, rows = set(), []
    for rank in range(world_size):
        data = PackedDataModule(
            ListData(samples, samples[:1]), 48, world_size=world_size, rank=rank
        )
        data.connect(batch_size=batch_size)
        data.setup()
        data.set_epoch(epoch)
        batches = list(data.train_dataloader())
        rows.append([b["input_ids"].shape[0] for b in batches])
        for b in batches:
            d = b["doc_ids"]
            for r in range(d.shape[0]):
                for i in torch.unique(d[r][d[r] >= 0]).tolist():
                    pos = torch.nonzero(d[r] == i).reshape(-1)
                    sample = int(b["input_ids"][r, pos[0]]) - 3
                    assert len(pos) == lengths[sample]
                    want = samples[sample]["labels"].clone()
                    want[0] = -100
                    assert b["labels"][r, pos].tolist() == want.tolist()
                    seen.add(sample)
    assert all(r == rows[0] for r in rows)  # same batches, same sizes, on every rank
    assert seen == set(range(len(lengths)))  # every sample this epoch


@settings(max_examples=20)
@given(warmup=st.integers(0, 10), extra=st.integers(1, 30))
def test_property_lr_schedule_warms_up_then_decays(warmup, extra):
    max_steps = warmup + extra
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = lr_schedule(opt, warmup, max_steps)
    rates = []
    for _ in range(max_steps):
        rates.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert all(0 < r <= 1 for r in rates)  # the first step trains (LitGPT's starts at 0)
    assert rates[:warmup] == sorted(rates[:warmup])
    assert rates[warmup:] == sorted(rates[warmup:], reverse=True)
    assert rates[min(warmup, max_steps - 1)] == pytest.approx(1.0)


def test_packed_data_module_rejects_non_datamodules():
    with pytest.raises(TypeError, match="DataModule"):
        PackedDataModule([[1, 2, 3]], 8)
    from litgpt.data import Alpaca

    with pytest.raises(ValueError, match="max_len"):
        PackedDataModule(Alpaca(), 0)


# ------------------------------------------------------------------------------- fine-tuning


def test_finetune_20_steps_equals_unpacked_training_and_saves_a_litgpt_checkpoint(
    workdir, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # LLM.load must find the local checkpoint
    from litgpt import Tokenizer
    from litgpt.utils import check_valid_checkpoint_dir

    out = workdir / "out"
    lr, wd, warmup, steps, seed = 3e-3, 0.02, 3, 20, 5
    # fmt: off
    assert main([
        "finetune", str(workdir / "ckpt"), "--data", "JSON",
        "--data.json_path", str(workdir / "data.json"), "--data.val_split_fraction", "0.1",
        "--data.mask_prompt", "true", "--max-len", "256", "--out_dir", str(out),
        "--precision", "32-true", "--seed", str(seed), "--train.micro_batch_size", "1",
        "--train.epochs", "3", "--train.max_steps", str(steps),
        "--train.lr_warmup_steps", str(warmup), "--optimizer.lr", str(lr),
        "--optimizer.weight_decay", str(wd), "--progress", "false",
    ]) == 0
    # fmt: on
    with open(out / "logs" / "version_0" / "metrics.csv") as f:
        logged = [float(r["loss"]) for r in csv.DictReader(f) if r["loss"]]
    assert len(logged) == steps

    # The same steps on the unpacked samples: every document alone through LitGPT's forward.
    config = Config.from_file(workdir / "ckpt" / "model_config.yaml")
    model = GPT(config)
    model.load_state_dict(torch.load(workdir / "ckpt" / "lit_model.pth"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    scheduler = lr_schedule(optimizer, warmup, steps)
    data = PackedDataModule(json_data(workdir), 256, seed=seed)
    data.connect(Tokenizer(workdir / "ckpt"), batch_size=1, max_seq_length=256)
    data.setup()
    reference = []
    epoch = 0
    while len(reference) < steps:
        data.set_epoch(epoch)
        for b in data.train_dataloader():
            if len(reference) == steps:
                break
            total, count = 0.0, 0
            for r in range(b["input_ids"].shape[0]):
                d = b["doc_ids"][r]
                for i in torch.unique(d[d >= 0]).tolist():
                    pos = torch.nonzero(d == i).reshape(-1)
                    logits = model(b["input_ids"][r, pos][None])[0]
                    target = b["labels"][r, pos][1:]
                    total = total + F.cross_entropy(logits[:-1], target, reduction="sum")
                    count += int((target != -100).sum())
            loss = total / count
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            reference.append(loss.item())
        epoch += 1
    assert max(abs(a - b) for a, b in zip(logged, reference, strict=True)) < 1e-4
    assert reference[-1] < reference[0]  # it learned

    # The output is a LitGPT checkpoint directory that LitGPT's own loader reads.
    final = out / "final"
    check_valid_checkpoint_dir(final)
    loaded = GPT(Config.from_file(final / "model_config.yaml"))
    from lightning import Fabric
    from litgpt.utils import load_checkpoint

    load_checkpoint(Fabric(accelerator="cpu", devices=1), loaded, final / "lit_model.pth")
    for (name, p), q in zip(model.named_parameters(), loaded.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-3, atol=1e-5, msg=name)
    assert (final / "prompt_style.yaml").is_file() and (final / "tokenizer.json").is_file()

    # ... and LitGPT's high-level API loads it and generates from it.
    from litgpt import LLM

    llm = LLM.load(str(final), distribute=None)
    llm.distribute(accelerator="cpu", precision="32-true")
    assert isinstance(llm.generate("the cat", max_new_tokens=4, top_k=1), str)


def test_docstring_example_pythia_14m():
    # packed_forward's docstring example (its doctest is skipped where litgpt is absent).
    torch.manual_seed(0)
    model = GPT(Config.from_name("pythia-14m"))
    batch = flexpack.pack_sequences([[1, 2, 3], [4, 5]], max_len=8)
    logits = packed_forward(model, batch.input_ids, batch.doc_ids)
    alone = model(batch.input_ids[:, 3:5])
    assert torch.allclose(logits[0, 3:5], alone[0], atol=1e-5)


def test_docs_litgpt_blocks_run(tmp_path, monkeypatch):
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "litgpt.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", page, flags=re.S | re.M)
    assert len(blocks) == 2
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "docs_litgpt"}
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"docs/litgpt.md python block {i}", "exec"), namespace)
        except Exception as err:  # pragma: no cover - the message is the point
            raise AssertionError(f"python block {i} of docs/litgpt.md failed:\n{block}") from err
    stats = namespace["data"].train_plan.stats
    assert stats.rows < stats.samples  # rows hold several samples

    # The pretraining block's loss is the mean over every document run alone, targets inside it.
    model, train_data, doc_ids = (namespace[k] for k in ("model", "train_data", "doc_ids"))
    S = train_data.shape[1] - 1
    total, count = 0.0, 0
    for r in range(train_data.shape[0]):
        for i in torch.unique(doc_ids[r]).tolist():
            pos = torch.nonzero(doc_ids[r] == i).reshape(-1)
            inputs = pos[pos < S]
            with_target = inputs[doc_ids[r, inputs + 1] == i]
            if len(with_target) == 0:
                continue
            logits = model(train_data[r, inputs][None])[0][: len(with_target)]
            total = total + F.cross_entropy(logits, train_data[r, with_target + 1], reduction="sum")
            count += len(with_target)
    torch.testing.assert_close(namespace["loss"], total / count, rtol=0, atol=1e-5)


def test_finetune_ddp_two_processes_equals_averaged_unpacked_gradients(workdir):
    # Fabric DDP on CPU (gloo), launched as a user would: two processes, equal rows per rank
    # (else a collective would hang), gradients averaged over the ranks.
    import subprocess
    import sys

    from litgpt import Tokenizer

    out = workdir / "ddp"
    lr, steps, seed = 3e-3, 4, 11
    # fmt: off
    cmd = [
        sys.executable, "-m", "flexpack.integrations.litgpt", "finetune", str(workdir / "ckpt"),
        "--data", "JSON", "--data.json_path", str(workdir / "data.json"),
        "--data.val_split_fraction", "0.1", "--data.mask_prompt", "true", "--max-len", "256",
        "--out_dir", str(out), "--precision", "32-true", "--seed", str(seed), "--devices", "2",
        "--train.max_steps", str(steps), "--train.lr_warmup_steps", "0",
        "--optimizer.lr", str(lr), "--optimizer.weight_decay", "0", "--progress", "false",
        "--eval.final_validation", "false",
    ]
    # fmt: on
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    config = Config.from_file(workdir / "ckpt" / "model_config.yaml")
    model = GPT(config)
    model.load_state_dict(torch.load(workdir / "ckpt" / "lit_model.pth"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    scheduler = lr_schedule(optimizer, 0, steps)
    loaders = []
    for rank in (0, 1):
        data = PackedDataModule(json_data(workdir), 256, seed=seed, world_size=2, rank=rank)
        data.connect(Tokenizer(workdir / "ckpt"), batch_size=1, max_seq_length=256)
        data.setup()
        loaders.append(data.train_dataloader())
    assert len(loaders[0]) == len(loaders[1])
    real = 0  # real tokens of both ranks: "real tokens" was rank 0's count times world size
    for _, batches in zip(range(steps), zip(*loaders, strict=True), strict=False):
        for b in batches:  # each rank's token mean, then the mean over ranks (DDP)
            real += int((b["doc_ids"] >= 0).sum())
            total, count = 0.0, 0
            d = b["doc_ids"][0]
            for i in torch.unique(d[d >= 0]).tolist():
                pos = torch.nonzero(d == i).reshape(-1)
                logits = model(b["input_ids"][0, pos][None])[0]
                target = b["labels"][0, pos][1:]
                total = total + F.cross_entropy(logits[:-1], target, reduction="sum")
                count += int((target != -100).sum())
            (total / count / len(batches)).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    saved = torch.load(out / "final" / "lit_model.pth")["model"]
    for name, p in model.named_parameters():
        torch.testing.assert_close(saved[name], p.detach(), rtol=1e-3, atol=1e-5, msg=name)
    assert f"Trained {steps} steps on {real:,} real tokens" in done.stdout, done.stdout[-2000:]
    with open(out / "logs" / "version_0" / "metrics.csv") as f:
        assert int(float(list(csv.DictReader(f))[-1]["tokens"])) == real


@settings(max_examples=20)
@given(text=st.text(max_size=40))
def test_property_byte_tokenizer_is_one_token_per_byte(text, tmp_path_factory):
    from litgpt import Tokenizer

    from flexpack.testing.litgpt import write_byte_tokenizer

    directory = _TOKENIZER_DIRS.setdefault(
        "dir", write_byte_tokenizer(tmp_path_factory.mktemp("tok"))
    )
    tok = Tokenizer(directory)
    ids = tok.encode(text, eos=True).tolist()
    assert ids == [1, *(3 + b for b in text.encode()), 2]
    assert tok.decode(torch.tensor(ids)) == text


_TOKENIZER_DIRS: dict[str, object] = {}


def test_packed_data_module_points_pretraining_streams_to_from_eos():
    stream = [torch.arange(10), torch.arange(10)]  # what a pretraining dataset yields
    data = PackedDataModule(ListData(stream, stream), 16)
    data.connect()
    with pytest.raises(TypeError, match="from_eos"):
        data.setup()


# ----------------------------------------------------------------------------- on CUDA (faked)


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_packed_forward_on_cuda_syncs_at_most_once(fake_cuda, kind):
    # The faked CUDA device of tests/fake_cuda.py, kernels recorded (tests/test_fake_cuda_paths):
    # Llama in bf16 reaches varlen, Gemma 2 (softcap) flex.
    import torch.nn.attention.varlen as varlen_module
    from test_fake_cuda_paths import Recorder

    from flexpack import _attention_flex

    model = make_model(kind).to(torch.bfloat16)
    batch = packed_docs([7, 13, 4, 9, 11, 3], max_len=24)
    with torch.no_grad():
        want = packed_forward(model, batch.input_ids, batch.doc_ids, backend="sdpa")
    rec = Recorder(fake_cuda)
    _attention_flex.compiled_flex_attention.cache_clear()
    real_flex, real_varlen = _attention_flex.compiled_flex_attention, varlen_module.varlen_attn
    _attention_flex.compiled_flex_attention, varlen_module.varlen_attn = rec.flex, rec.varlen_attn
    try:
        model.to("cuda")
        ids, doc_ids = fake_cuda.to(batch.input_ids), fake_cuda.to(batch.doc_ids)
        with torch.no_grad(), fake_cuda.count() as syncs:
            got = packed_forward(model, ids, doc_ids)
    finally:
        _attention_flex.compiled_flex_attention, varlen_module.varlen_attn = real_flex, real_varlen
    # One per forward: Llama's document-causal plan; Gemma 2's sliding and full layers'
    # BlockMasks, built from one shared snapshot of the ids.
    assert len(syncs) <= 1, syncs
    assert {c.kernel for c in rec.calls} == ({"varlen"} if kind == "llama" else {"flex"})
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.float().cpu(), want.float(), atol=0.1, rtol=0.05)


# ----------------------------------------------------------------------------- issue 20


def _finetune_argv(workdir, *extra):
    return [
        "finetune", str(workdir / "ckpt"), "--out_dir", str(workdir / "out-args"),
        "--precision", "32-true", "--progress", "false", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize("value", ["0", "-3", "x"])
def test_finetune_max_len_must_be_positive(workdir, capsys, value):
    # --max-len 0 trained at block size (0 or block_size); -3 was a traceback.
    with pytest.raises(SystemExit) as exit_:
        main(_finetune_argv(workdir, "--max-len", value))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--max-len" in err and "positive integer" in err


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--data", "JSON"], "--data JSON needs --data.json_path PATH"),
        (["--data", "JSON", "--data.json_path", "missing.json"], "missing.json: no such file"),
    ],
)
def test_finetune_json_path_missing_is_a_usage_error(workdir, capsys, extra, words):
    # A missing --data.json_path was a traceback, after the Fabric launch.
    with pytest.raises(SystemExit) as exit_:
        main(_finetune_argv(workdir, *extra))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and words in err and "Traceback" not in err


def test_finetune_default_alpaca_offline_says_what_to_do(workdir, capsys, monkeypatch, tmp_path):
    # The default --data Alpaca downloads its data: offline that was a requests traceback.
    import litgpt.data.alpaca as alpaca

    def offline(path, url, *args, **kwargs):
        raise ConnectionError(
            f"Failed to resolve host of {url}"
        )  # what requests raises, an OSError

    monkeypatch.setattr(alpaca, "download_if_missing", offline)
    monkeypatch.chdir(tmp_path)  # Alpaca's download_dir is relative: ./data/alpaca
    assert main(_finetune_argv(workdir)) == 2
    err = capsys.readouterr().err
    assert "--data Alpaca downloads its data on first use from https://" in err
    assert "--data JSON --data.json_path FILE.json" in err and "ConnectionError" in err


def test_finetune_max_len_above_block_size_says_it_is_fine_and_is(tmp_path, capsys, workdir):
    # Rows longer than the model's block came with no word; they are fine: each sample is
    # truncated to block_size and attends only within itself. The first step's loss equals the
    # unpacked loss of the same samples, truncated to block_size, each alone through model(ids).
    from litgpt import Tokenizer
    from litgpt.data import JSON

    block = 32
    config = Config(**{**_COMMON, **CONFIGS["llama"], "block_size": block})
    tiny_checkpoint(tmp_path / "ckpt", config, seed=0)
    out = tmp_path / "out"
    argv = [
        "finetune", str(tmp_path / "ckpt"), "--data", "JSON",
        "--data.json_path", str(workdir / "data.json"), "--data.val_split_fraction", "0.1",
        "--data.mask_prompt", "false", "--max-len", "128", "--out_dir", str(out),
        "--precision", "32-true", "--train.max_steps", "1", "--progress", "false",
        "--eval.final_validation", "false", "--seed", "3",
    ]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert f"Rows of 128 tokens exceed the model's block_size ({block}): fine" in text
    with open(out / "logs" / "version_0" / "metrics.csv") as f:
        logged = float(next(r for r in csv.DictReader(f) if r["loss"])["loss"])

    model = GPT(Config.from_file(tmp_path / "ckpt" / "model_config.yaml"))
    model.load_state_dict(torch.load(tmp_path / "ckpt" / "lit_model.pth"))
    inner = JSON(workdir / "data.json", val_split_fraction=0.1, mask_prompt=False, num_workers=0)
    data = PackedDataModule(inner, 128, seed=3)
    data.connect(Tokenizer(tmp_path / "ckpt"), batch_size=1, max_seq_length=block)
    data.setup()
    data.set_epoch(0)
    b = next(iter(data.train_dataloader()))
    total, count, longest = 0.0, 0, 0
    d = b["doc_ids"][0]
    for i in torch.unique(d[d >= 0]).tolist():
        pos = torch.nonzero(d == i).reshape(-1)
        longest = max(longest, len(pos))
        with torch.no_grad():
            logits = model(b["input_ids"][0, pos][None])[0]
        target = b["labels"][0, pos][1:]
        total = total + F.cross_entropy(logits[:-1], target, reduction="sum")
        count += int((target != -100).sum())
    assert longest == block and int((d >= 0).sum()) > block  # truncated docs, a row past block
    assert count > 0 and abs(logged - float(total / count)) < 1e-4


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("reduction", ["token", "document"])
def test_packed_loss_equals_the_logits_path(kind, reduction):
    # The chunked head (final softcapping on Gemma 2, bias where the config has one): the loss
    # and every parameter's gradient of packed_cross_entropy(packed_forward(...)).
    model = make_model(kind, seed=2)
    batch = packed_docs([9, 5, 12, 6, 8], max_len=20, seed=2)
    labels = batch.labels.clone()
    labels[:, :3] = -100  # a prompt
    params = [p for p in model.parameters() if p.requires_grad]
    got = packed_loss(model, batch.input_ids, labels, batch.doc_ids, reduction=reduction)
    want = flexpack.packed_cross_entropy(
        packed_forward(model, batch.input_ids, batch.doc_ids), labels, batch.doc_ids,
        reduction=reduction,
    )  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(torch.autograd.grad(got, params, allow_unused=True, materialize_grads=True),
                    torch.autograd.grad(want, params, allow_unused=True, materialize_grads=True),
                    strict=True):  # fmt: skip
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    module = PackedGPTLoss(model, reduction=reduction)
    again = module(batch.input_ids, batch.doc_ids, None, labels)
    torch.testing.assert_close(again, got)
