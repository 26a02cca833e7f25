"""PackedBatch / materialize / pack_sequences against a per-token Python reference."""

import numpy as np
import pytest
import torch

import flexpack
from flexpack import PackedBatch, PackedLayout, pack, pack_sequences


def reference_rows(plan, sequences, pad_id=0):
    """The slow, obvious materialize: walk every segment token by token."""
    ids = [[pad_id] * plan.max_len for _ in range(plan.num_rows)]
    labels = [[-100] * plan.max_len for _ in range(plan.num_rows)]
    docs = [[-1] * plan.max_len for _ in range(plan.num_rows)]
    pos = [[0] * plan.max_len for _ in range(plan.num_rows)]
    fill = [0] * plan.num_rows
    ndoc = [0] * plan.num_rows
    for row, sample, start, stop in plan.segments.tolist():
        item = sequences[sample]
        tok = list(item["input_ids"]) if isinstance(item, dict) else list(item)
        lab = list(item.get("labels", tok)) if isinstance(item, dict) else tok
        for k, t in enumerate(range(start, stop)):
            c = fill[row] + k
            ids[row][c] = int(tok[t])
            labels[row][c] = -100 if k == 0 else int(lab[t])
            docs[row][c] = ndoc[row]
            pos[row][c] = k
        fill[row] += stop - start
        ndoc[row] += 1
    return ids, labels, docs, pos


def _random_sequences(rng, n, max_tokens):
    return [rng.integers(1, 1000, rng.integers(0, max_tokens)).tolist() for _ in range(n)]


@pytest.mark.parametrize("strategy", ["bfd", "ffd", "greedy", "wrap"])
def test_materialize_matches_reference(strategy):
    rng = np.random.default_rng(0)
    seqs = _random_sequences(rng, 60, 40)
    plan = pack([len(s) for s in seqs], 32, strategy=strategy, overflow="split")
    batch = plan.materialize(seqs, pad_id=7)
    ids, labels, docs, pos = reference_rows(plan, seqs, pad_id=7)
    assert batch.input_ids.tolist() == ids
    assert batch.labels.tolist() == labels
    assert batch.doc_ids.tolist() == docs
    assert batch.position_ids.tolist() == pos
    assert batch.input_ids.dtype == batch.labels.dtype == torch.int64
    assert batch.doc_ids.dtype == torch.int32
    assert (
        batch.cu_seqlens.tolist()
        == np.concatenate([[0], np.cumsum(plan.segments[:, 3] - plan.segments[:, 2])]).tolist()
    )
    assert batch.layout == plan.layout()


def test_sequence_types_and_labels():
    seqs = [
        {"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]},
        np.array([5, 6, 7], dtype=np.int32),
        torch.tensor([8, 9]),
        [10],
        {"input_ids": torch.tensor([11, 12])},
    ]
    batch = pack_sequences(seqs, max_len=6, strategy="greedy")
    ids, labels, _, _ = reference_rows(
        pack([4, 3, 2, 1, 2], 6, strategy="greedy"),
        [
            {"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]},
            [5, 6, 7],
            [8, 9],
            [10],
            [11, 12],
        ],
    )
    assert batch.input_ids.tolist() == ids
    assert batch.labels.tolist() == labels
    assert batch.labels.tolist()[0] == [-100, -100, 3, 4, -100, -100]


def test_rows_subset_and_order():
    rng = np.random.default_rng(1)
    seqs = _random_sequences(rng, 40, 20)
    plan = pack([len(s) for s in seqs], 24)
    full = plan.materialize(seqs)
    part = plan.materialize(seqs, rows=[3, 1])
    assert torch.equal(part.input_ids, full.input_ids[[3, 1]])
    assert torch.equal(part.labels, full.labels[[3, 1]])
    assert torch.equal(part.doc_ids, full.doc_ids[[3, 1]])
    assert part.layout == plan.layout([3, 1])


def test_split_pieces_are_own_documents():
    batch = pack_sequences([list(range(1, 11))], max_len=4, overflow="split", strategy="greedy")
    assert batch.input_ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 0, 0]]
    assert batch.labels.tolist() == [[-100, 2, 3, 4], [-100, 6, 7, 8], [-100, 10, -100, -100]]


def test_to_and_properties():
    batch = pack_sequences([[1, 2, 3], [4, 5]], max_len=8)
    moved = batch.to("cpu")
    assert isinstance(moved, PackedBatch)
    assert torch.equal(moved.input_ids, batch.input_ids)
    assert moved.max_seqlen == 3 and moved.seqlens.tolist() == [3, 2]
    assert len(batch) == 1 and batch.shape == (1, 8)
    assert "PackedBatch(shape=(1, 8)" in repr(batch)


def test_empty():
    batch = pack_sequences([], max_len=8)
    assert batch.input_ids.shape == (0, 8)
    assert batch.cu_seqlens.tolist() == [0]
    assert pack_sequences([[]], max_len=8).input_ids.shape == (0, 8)


def test_bad_sequences():
    plan = pack([3, 2], 8)
    with pytest.raises(ValueError, match="sequence 1 has 3 tokens but the plan was made for 2"):
        plan.materialize([[1, 2, 3], [1, 2, 3]])
    with pytest.raises(ValueError, match="made for 2 samples but 1"):
        plan.materialize([[1, 2, 3]])
    with pytest.raises(ValueError, match="'input_ids' key"):
        pack_sequences([{"tokens": [1]}], 8)
    with pytest.raises(ValueError, match="3 input_ids but 2 labels"):
        pack_sequences([{"input_ids": [1, 2, 3], "labels": [1, 2]}], 8)
    with pytest.raises(TypeError, match="integer token ids"):
        pack_sequences([[1.5, 2.5]], 8)
    # A float after an int first element must not be truncated silently (2.5 -> 2).
    with pytest.raises(TypeError, match=r"sequence 0 .*integer token ids"):
        pack_sequences([[1, 2.5, 3], [4, 5]], 8)
    with pytest.raises(TypeError, match="1-D token ids"):
        pack_sequences([torch.zeros(2, 2, dtype=torch.long)], 8)
    with pytest.raises(TypeError, match="sized"):
        pack_sequences(iter([[1]]), 8)
    with pytest.raises(ValueError, match="layout's shape"):
        PackedBatch(torch.zeros(1, 3), torch.zeros(1, 4), PackedLayout.from_seqlens([[2]], 4))


@pytest.mark.parametrize(
    ("seqs", "words"),
    [
        ([[3, 4], [1, "a"]], "sequence 1 .*element 1 is 'a'.*does not tokenize"),
        ([[1, None]], "sequence 0 .*element 1 is None"),
        ([[1, [2]]], "sequence 0 .*element 1 is \\[2\\]"),
        ([[1, 2**64]], "element 1 is 18446744073709551616, which does not fit int64"),
        ([[1, 2**63]], "element 1 is 9223372036854775808, which does not fit int64"),
        ([np.array([1, 2**63], dtype=np.uint64)], "element 1 is 9223372036854775808"),
    ],
)
def test_bad_tokens_name_the_sample_and_element(seqs, words):
    """Issue 11: raw TypeErrors without a sample index, and "Python int too large"."""
    with pytest.raises((TypeError, ValueError), match=words):
        pack_sequences(seqs, 4)


def test_a_text_column_says_flexpack_does_not_tokenize():
    with pytest.raises(ValueError, match=r"does not tokenize.*tokenizer"):
        pack_sequences([{"text": "hello"}], 4)


def test_pack_sequences_refuses_text_before_reporting_lengths():
    with pytest.raises(TypeError, match="does not tokenize"):
        flexpack.pack_sequences(["hello world"], max_len=8)


@pytest.mark.parametrize(
    ("pad_id", "exc"),
    [("x", TypeError), (None, TypeError), (0.5, TypeError), (True, TypeError), (2**64, ValueError)],
)
def test_bad_pad_id_is_refused_clearly(pad_id, exc):
    """Issue 11: "x"/None gave a numba TypingError wall and 0.5 was silently 0."""
    with pytest.raises(exc, match="pad_id"):
        pack_sequences([[1, 2]], 4, pad_id=pad_id)
    with pytest.raises(exc, match="pad_id"):
        pack([2], 4).materialize([[1, 2]], pad_id=pad_id)
    assert pack_sequences([[1, 2]], 4, pad_id=np.int64(7)).input_ids.tolist() == [[1, 2, 7, 7]]


def test_python_api_refuses_negative_token_and_pad_ids_as_the_cli_does():
    with pytest.raises(ValueError, match="token id -2"):
        flexpack.pack_sequences([[1, -2, 3]], max_len=8)
    with pytest.raises(ValueError, match="token id -2"):
        flexpack.pack_sequences([np.array([1, -2, 3])], max_len=8)
    with pytest.raises(ValueError, match=r"pad_id must be a token id in 0\.\.2\*\*63 - 1"):
        flexpack.pack_sequences([[1, 2]], max_len=8, pad_id=-1)
    labels = flexpack.pack_sequences([{"input_ids": [1, 2], "labels": [-100, 2]}], 4).labels
    assert labels.tolist() == [[-100, 2, -100, -100]]
