"""flexpack.integrations.trl.SFTTrainer on streaming datasets (``datasets.IterableDataset``).

The stream is prepared by TRL (tokens, labels) and packed on the fly by flexpack's streaming
packer. The references: TRL's own unpacked trainer fed the same samples step by step (losses and
weights to float32 round-off, as tests/test_trl_sft.py), and TRL's own unpacked preparation of
the same data (every sample's tokens in exactly one row; what truncation cut is counted).
"""

from __future__ import annotations

import collections
import copy
import warnings

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from test_trl_sft import (  # noqa: E402
    FP32,
    STEPS,
    Recorder,
    documents,
    losses,
    max_param_diff,
    prompt_completion,
    reference_run,
    sft_args,
    tiny,
    word_tokenizer,
)

from flexpack.integrations.trl import SFTTrainer  # noqa: E402
from flexpack.integrations.trl.sft import _StreamedRows  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer()


def build(tmp_path, tokenizer, train, name="flexpack", model=None, **overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SFTTrainer(
            model=model if model is not None else tiny("llama"), processing_class=tokenizer,
            args=sft_args(tmp_path, name, **overrides), train_dataset=train, buffer_size=16,
        )  # fmt: skip


def trl_samples(tmp_path, tokenizer, data, **overrides) -> list[dict]:
    """TRL's own unpacked preparation of ``data``: the samples its trainer would train on."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.SFTTrainer(
            model=tiny("llama"), processing_class=tokenizer, train_dataset=data,
            args=sft_args(tmp_path, "trl-prep", packing=False, padding_free=False, **overrides),
        )  # fmt: skip
    return [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in trainer.train_dataset]


def key(sample: dict) -> tuple:
    # A packed document's first label is -100 (nothing predicts it across a boundary); TRL's
    # shifted loss never reads a sample's first label either.
    return tuple(sample["input_ids"]), tuple(sample["labels"][1:])


def streamed(rows) -> list[dict]:
    return documents(list(rows))


def test_streaming_training_equals_unpacked_trl(tmp_path, tokenizer):
    """A stream packed on the fly trains as TRL's unpacked trainer on the same samples."""
    model = tiny("llama")
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    stream = prompt_completion().to_iterable_dataset(num_shards=4)
    trainer = build(tmp_path, tokenizer, stream, model=model)
    assert isinstance(trainer.train_dataset, _StreamedRows)
    recorder = Recorder(trainer.data_collator)
    trainer.data_collator = recorder
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
        ref = reference_run(
            reference, tokenizer, recorder.steps[:STEPS],
            sft_args(tmp_path, "trl", packing=False, padding_free=False,
                     remove_unused_columns=False,
                     dataset_kwargs={"skip_prepare_dataset": True}),
        )  # fmt: skip
    assert max(len(r["seq_lengths"]) for r in recorder.steps[0]) > 1  # rows really packed
    ours, theirs = losses(trainer), losses(ref)
    assert len(ours) == len(theirs) == STEPS
    assert (ours - theirs).abs().max().item() < FP32
    # Adam's normalised step can turn an fp32 rounding of a near-zero gradient into a move of
    # up to the learning rate: 4.4e-5 on one q_proj weight, every other weight within 1e-6.
    assert max_param_diff(model, reference) < 10 * FP32
    assert max_param_diff(model, tiny("llama")) > 100 * FP32
    stats = trainer.flexpack_stats
    assert stats.steps == STEPS and stats.truncated == 0 and stats.documents > stats.rows
    assert all("flexpack/truncated" in h for h in trainer.state.log_history if "loss" in h)


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
def test_every_streamed_sample_once(tmp_path, tokenizer, strategy):
    """Every sample of TRL's preparation lands in exactly one row (bfd: cut as TRL cuts it,
    or dropped when the cut leaves no supervised token, the lost tokens counted)."""
    data = prompt_completion(40, seed=3)  # up to 29 + 19 tokens: many over max_length=24
    m = 24
    trainer = build(
        tmp_path, tokenizer, data.to_iterable_dataset(num_shards=3), max_length=m,
        packing_strategy=strategy,
    )  # fmt: skip
    rows = list(trainer.train_dataset)
    assert all(
        len(r["input_ids"]) <= m and sum(r["seq_lengths"]) == len(r["input_ids"]) for r in rows
    )
    docs = streamed(rows)
    whole = trl_samples(tmp_path, tokenizer, data, max_length=None)
    total = sum(len(s["input_ids"]) for s in whole)
    truncated = sum(r["truncated"] for r in rows)
    if strategy == "bfd":  # TRL's unpacked preparation at max_length: the same samples
        expected = trl_samples(tmp_path, tokenizer, data, max_length=m)
        assert len(expected) < len(whole)  # some samples were dropped: the test has teeth
        assert collections.Counter(map(key, docs)) == collections.Counter(map(key, expected))
        assert truncated > 0
    elif strategy == "bfd_split":  # pieces of max_length, in order
        pieces = [s for s in whole for s in _pieces(s, m)]
        assert collections.Counter(map(key, docs)) == collections.Counter(map(key, pieces))
        assert truncated == 0
    else:  # wrapped: every row full but the last; the stream's tokens in order
        assert all(len(r["input_ids"]) == m for r in rows[:-1])
        assert [t for r in rows for t in r["input_ids"]] == [
            t for s in whole for t in s["input_ids"]
        ]
        assert truncated == 0
    assert sum(len(d["input_ids"]) for d in docs) + truncated == total


def _pieces(sample: dict, m: int) -> list[dict]:
    n = len(sample["input_ids"])
    return [{k: v[s : s + m] for k, v in sample.items()} for s in range(0, n, m)]


def test_ranks_and_workers_share_the_stream_once(tmp_path, tokenizer):
    """Two ranks (and DataLoader workers) each read the whole stream and take their rows: the
    same number of rows on every rank, every sample once over all of them, each cut counted
    once. accelerate does not shard the rows again."""
    data = prompt_completion(40, seed=3)
    trainer = build(tmp_path, tokenizer, data.to_iterable_dataset(num_shards=2), max_length=24)
    one = trainer.train_dataset
    single = streamed(one)
    lost = sum(r["truncated"] for r in one)
    assert lost > 0

    def rank(r, world):
        return _StreamedRows(
            one.samples, 24, strategy="bfd", overflow="truncate", truncation_mode="keep_start",
            buffer_size=16, pad_id=0, rank=r, world_size=world,
        )  # fmt: skip

    ranks = [list(rank(r, 2)) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1])
    got = [d for rows in ranks for d in streamed(rows)]
    assert collections.Counter(map(key, got)) == collections.Counter(map(key, single))
    assert sum(r["truncated"] for rows in ranks for r in rows) == lost
    # DataLoader workers read the whole stream too (HF's per-worker shard split is bypassed).
    loader = torch.utils.data.DataLoader(rank(1, 2), batch_size=None, num_workers=2)
    in_workers = list(loader)
    assert collections.Counter(map(key, streamed(in_workers))) == collections.Counter(
        map(key, streamed(ranks[1]))
    )
    loader = torch.utils.data.DataLoader(rank(0, 1), batch_size=None, num_workers=2)
    in_workers = list(loader)
    assert collections.Counter(map(key, streamed(in_workers))) == collections.Counter(
        map(key, single)
    )
    assert sum(r["truncated"] for r in in_workers) == lost
    # The trainer's loader is over the rows themselves (no IterableDatasetShard on top).
    assert trainer.get_train_dataloader().dataset is one


def test_only_the_eval_set_streams(tmp_path, tokenizer):
    """A streamed eval set beside a map-style train set: packed on the fly, every sample once;
    with eval_packing=False each sample its own row, as the same set not streamed."""
    train, held_out = prompt_completion(16), prompt_completion(12, seed=5)
    losses_by_kind = {}
    for eval_packing in (True, False):
        for stream in (True, False):
            eval_set = held_out.to_iterable_dataset(num_shards=2) if stream else held_out
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer = SFTTrainer(
                    model=tiny("llama"), processing_class=tokenizer, train_dataset=train,
                    eval_dataset=eval_set, buffer_size=16,
                    args=sft_args(tmp_path, "eval", eval_packing=eval_packing),
                )  # fmt: skip
            assert isinstance(trainer.eval_dataset, _StreamedRows) == (stream and eval_packing)
            recorder = Recorder(trainer.data_collator)
            trainer.data_collator = recorder
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = trainer.evaluate()
            losses_by_kind[eval_packing, stream] = out["eval_loss"]
            rows = [r for step in recorder.steps for r in step]
            if eval_packing:
                docs = streamed(rows)
            else:
                docs = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows]
            expected = trl_samples(tmp_path, tokenizer, held_out, max_length=64)
            got = collections.Counter(map(key, docs))
            assert got == collections.Counter(map(key, expected)), (eval_packing, stream)
    # unpacked: the same rows in the same order, streamed or not
    assert losses_by_kind[False, True] == pytest.approx(losses_by_kind[False, False], abs=1e-6)


WORLD = 2


def _ddp_worker(rank: int, port: int, out_dir: str, max_steps: int) -> None:
    """One rank of a 2-process CPU (gloo) run of the trainer on a stream, as torchrun starts
    it: accelerate reads the environment, Trainer wraps the model in DDP."""
    import os
    import pickle
    from pathlib import Path

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    tokenizer = word_tokenizer()
    stream = prompt_completion(40, seed=3).to_iterable_dataset(num_shards=2)
    trainer = build(
        Path(out_dir), tokenizer, stream, name="ddp", max_length=24, max_steps=max_steps
    )
    assert trainer.args.world_size == WORLD
    recorder = Recorder(trainer.data_collator)
    trainer.data_collator = recorder
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump((recorder.steps, trainer.flexpack_stats), f)


def test_two_processes_train_every_streamed_sample_once(tmp_path, tokenizer):
    """Two real processes (gloo, DDP): the same number of steps on each rank, the epoch's
    samples split between them with none twice or missing (accelerate does not shard the rows
    again), the truncation counted once over the ranks."""
    import pickle
    import socket

    import torch.multiprocessing as mp

    data = prompt_completion(40, seed=3)
    one = build(tmp_path, tokenizer, data.to_iterable_dataset(num_shards=2), max_length=24)
    single = streamed(one.train_dataset)
    lost = sum(r["truncated"] for r in one.train_dataset)
    rows = len(list(one.train_dataset))
    per_rank = -(-rows // WORLD)
    steps = -(-per_rank // 2)  # per_device_train_batch_size=2: one epoch, then stop
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(
        _ddp_worker, args=(port, str(tmp_path), steps), nprocs=WORLD, join=True,
        start_method="spawn",
    )  # fmt: skip
    results = []
    for r in range(WORLD):
        with open(tmp_path / f"rank{r}.pkl", "rb") as f:
            results.append(pickle.load(f))
    assert [len(rec) for rec, _ in results] == [steps] * WORLD
    got = [d for rec, _ in results for step in rec for d in streamed(step)]
    assert collections.Counter(map(key, got)) == collections.Counter(map(key, single))
    # PackStats' counts are gathered over the ranks (steps are each rank's own)
    assert all(stats.truncated == lost and stats.steps == steps for _, stats in results)


@pytest.mark.parametrize("kind", ["dataset", "iterable", "dict", "iterable_dict"])
def test_evaluate_given_any_dataset_kind_packs_it_once(tmp_path, tokenizer, kind):
    """evaluate(eval_dataset=...) with a raw set, a stream, or dicts of them (as TRL's own
    test_evaluate_with_eval_dataset): the same eval_loss for each. TRL prepares what evaluate
    is handed and Trainer evaluates a dict by calling evaluate on each prepared set; packing
    those rows again made each row one sample (its documents attending to each other)."""
    held_out = prompt_completion(12, seed=5)
    split = held_out.to_iterable_dataset(num_shards=2) if "iterable" in kind else held_out
    given = {"a": split, "b": split} if "dict" in kind else split
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = build(tmp_path, tokenizer, prompt_completion(16))
        want = trainer.evaluate(eval_dataset=held_out)["eval_loss"]
        out = trainer.evaluate(eval_dataset=given)
    got = [out["eval_a_loss"], out["eval_b_loss"]] if "dict" in kind else [out["eval_loss"]]
    assert got == pytest.approx([want] * len(got), abs=1e-6)
