"""Red-team regressions (issue 20, first half): each test failed on the code before its fix.

Silent wrong results are pinned against a reference (dense masks, float64 attention, the input
itself); unclear errors against the message a user needs (what was received, what was expected,
how to fix it).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flexpack
from flexpack import masks as fm
from flexpack.testing.references import dense_mask, reference_attention


def _qkv(B: int, S: int, H: int = 2, D: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, S, D, dtype=torch.float64, generator=g) for _ in range(3))


# ----------------------------------------------------------------------------- silent results


@pytest.mark.parametrize("big", [2**31, 2**32])
def test_transformers_forward_keeps_int64_doc_ids(big):
    # _doc_ids cast to int32: 2**32 merged with document 0, 2**31 wrapped negative (padding).
    from flexpack.integrations.transformers import flexpack_attention_forward

    d = torch.tensor([[0, 0, big, big, big, 1]])  # (an id in two runs is refused: 1, not 0)
    q, k, v = _qkv(1, 6)
    out, _ = flexpack_attention_forward(torch.nn.Module(), q, k, v, None, doc_ids=d)
    ref = reference_attention(q, k, v, fm.document(d) & fm.causal())
    torch.testing.assert_close(out.transpose(1, 2), ref)


def test_mask_factories_refuse_uint64_doc_ids_past_int64():
    # uint64 ids >= 2**63 wrapped to negative int64, i.e. padding; PackedLayout refuses them.
    d = torch.tensor([0, 2**63, 2**63], dtype=torch.uint64)
    for make in (fm.document, fm.padding, lambda x: fm.tree(x, torch.tensor([-1]))):
        with pytest.raises(ValueError, match=r"2\*\*63"):
            make(d)
    ok = fm.document(torch.tensor([0, 5, 5], dtype=torch.uint64))
    assert ok.doc_ids.dtype == torch.int64 and ok.doc_ids.tolist() == [[0, 5, 5]]


@pytest.mark.parametrize("kind", ["document_causal", "tree"])
def test_mask_doc_ids_edited_in_place_is_refused_on_every_path(kind):
    # mask.doc_ids was public and writable: SDPA and the BlockMask tables read the edit while
    # mask_mod read a snapshot (max diff 2.1). Now an edit is refused wherever the ids are read.
    d = torch.tensor([[0, 0, 0, 1, 1, 1]])
    if kind == "tree":
        m = fm.tree(d, torch.tensor([[-1, 0]]))
    else:
        m = fm.document(d) & fm.causal()
    q, k, v = _qkv(1, 6)
    before = flexpack.attention(q, k, v, m)
    torch.testing.assert_close(before, reference_attention(q, k, v, m))
    m.doc_ids[0, 2] = 1
    for use in (
        lambda: flexpack.attention(q, k, v, m),
        lambda: m.block_mask(block_size=2),
        lambda: dense_mask(m),
        lambda: m.doc_ids,
    ):
        with pytest.raises(ValueError, match="in place"):
            use()
    with pytest.raises(AttributeError):
        m.doc_ids = d


@pytest.mark.parametrize("token", [-1, 16])
def test_gather_logps_names_a_token_outside_the_vocabulary(token):
    # A negative token silently read vocabulary entry V - 1; a token >= V was a raw IndexError.
    # pack_trees refuses a negative one already; gather_logps still checks the range.
    if token < 0:
        with pytest.raises(ValueError, match="token id -1; token ids are vocabulary indices"):
            flexpack.pack_trees([([5, 6, 7], [[8, token], [4]])], max_len=8)
        return
    b = flexpack.pack_trees([([5, 6, 7], [[8, token], [4]])], max_len=8)
    with pytest.raises(ValueError, match=rf"token {token} .*\[0, 16\)"):
        b.gather_logps(torch.zeros(1, 8, 16))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint32, torch.uint64])
def test_packed_cross_entropy_takes_unsigned_doc_ids(dtype):
    # uint32/uint64 doc ids were a NotImplementedError ("ge_cpu") from inside torch.
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 6, 5, generator=g)
    labels = torch.tensor([[-100, 1, 2, -100, 3, 4]])
    d = torch.tensor([[0, 0, 0, 7, 7, 7]])
    for reduction in ("token", "document"):
        want = flexpack.packed_cross_entropy(logits, labels, d, reduction=reduction)
        got = flexpack.packed_cross_entropy(logits, labels, d.to(dtype), reduction=reduction)
        torch.testing.assert_close(got, want)
    if dtype == torch.uint64:
        with pytest.raises(ValueError, match=r"2\*\*63"):
            flexpack.packed_cross_entropy(logits, labels, torch.full((1, 6), 2**63, dtype=dtype))


def test_attention_with_q_in_bshd_says_to_transpose():
    # q in (B, S, H, D): the message said to rebuild the mask; the mask was right, q was not.
    d = torch.tensor([[0, 0, 0, 1, 1, 1]])
    m = fm.document(d) & fm.causal()
    q, k, v = (x.transpose(1, 2) for x in _qkv(1, 6, H=2))  # (B, S, H, D)
    for mask in (m, m.block_mask(block_size=2)):
        with pytest.raises(ValueError, match=r"\(B, H, S, D\).*transpose\(1, 2\)"):
            flexpack.attention(q, k, v, mask)


@pytest.mark.parametrize(
    ("dtype", "eos_id"),
    [(torch.int32, 2**32 + 2), (torch.uint8, 258), (torch.uint8, -1), (torch.int64, 2**64 + 2)],
)
def test_from_eos_refuses_an_eos_id_the_dtype_cannot_hold(dtype, eos_id):
    # The comparison wrapped: int32 ids and 2**32 + 2 split at token 2 (uint8 and 258, -1 and
    # 255 likewise); 2**64 + 2 was a bare OverflowError.
    x = torch.tensor([[5, 2, 7, 255, 8]]).to(dtype)
    with pytest.raises(ValueError, match=rf"eos_id={eos_id} cannot occur in input_ids of dtype"):
        flexpack.PackedLayout.from_eos(x, eos_id)
    ref = flexpack.PackedLayout.from_eos(x.long(), 2).doc_ids
    assert torch.equal(flexpack.PackedLayout.from_eos(x, 2).doc_ids, ref)


# uint64 token ids >= 2**63: every reader refuses them with the one shared check, as
# pack_sequences does (they wrapped to negative ids: PackedDataset, PackedIterableDataset,
# pack_trees; the CLI's Parquet reader is tested in test_cli.py).
_BIG = np.array([3, 2**63 + 5, 4], dtype=np.uint64)


@pytest.mark.parametrize(
    "read",
    [
        lambda s: flexpack.data.PackedDataset(s, max_len=4)[0],
        lambda s: list(flexpack.data.PackedIterableDataset(s, max_len=4, buffer_size=2)),
        lambda s: flexpack.pack_trees([(s[0], [s[0]])], max_len=8),
        lambda s: flexpack.pack_sequences(s, max_len=4),
    ],
    ids=["PackedDataset", "PackedIterableDataset", "pack_trees", "pack_sequences"],
)
@pytest.mark.parametrize("as_tensor", [False, True])
def test_uint64_token_ids_past_int64_are_refused(read, as_tensor):
    big = torch.from_numpy(_BIG) if as_tensor else _BIG
    with pytest.raises(ValueError, match=rf"element 1 is {2**63 + 5}, which does not fit int64"):
        read([big])
    fits = np.array([3, 2**63 - 1, 4], dtype=np.uint64)
    row = flexpack.data.PackedDataset([fits], max_len=4)[0]
    assert row.input_ids.tolist() == [[3, 2**63 - 1, 4, 0]]


@pytest.mark.parametrize("pad_id", [1.7, True, "0"])
def test_datasets_refuse_a_pad_id_that_is_not_an_int(pad_id):
    # pad_id=1.7 was truncated to 1 by int(); pack_sequences refuses it.
    with pytest.raises(TypeError, match="pad_id must be an int token id"):
        flexpack.data.PackedDataset([[1, 2]], max_len=4, pad_id=pad_id)
    with pytest.raises(TypeError, match="pad_id must be an int token id"):
        flexpack.data.PackedIterableDataset([[1, 2]], max_len=4, pad_id=pad_id)
    ds = flexpack.data.PackedDataset([[1, 2]], max_len=4, pad_id=np.int64(7))
    assert ds[0].input_ids.tolist() == [[1, 2, 7, 7]]


def test_getitems_of_no_indices_is_no_rows():
    # __getitems__([]) returned one empty batch: one result for zero indices.
    ds = flexpack.data.PackedDataset([[1, 2], [3]], max_len=4)
    assert ds.__getitems__([]) == []
    assert len(ds.__getitems__([0, 0])) == 2


@pytest.mark.parametrize("name", ["world_size", "num_replicas"])
def test_world_size_zero_says_ranks_not_4096(name):
    # world_size=0 suggested "world_size=4096", a row length.
    ds = flexpack.data.PackedDataset([[1, 2], [3]], max_len=4)
    if name == "world_size":
        call = lambda: ds.shard(0, 0)
    else:
        call = lambda: flexpack.data.DistributedPackedSampler(ds, num_replicas=0, rank=0)
    with pytest.raises(ValueError, match=r"number of ranks.*get_world_size\(\)") as e:
        call()
    assert "4096" not in str(e.value)


def test_tree_parent_of_segment_zero_names_no_empty_range():
    # "an earlier segment 0..-1" for segment 0.
    with pytest.raises(ValueError, match=r"parent of segment 0 must be -1: it is a root") as e:
        fm.tree(torch.tensor([0, 0, 1]), torch.tensor([0, 0]))
    assert "0..-1" not in str(e.value)
    with pytest.raises(ValueError, match=r"an earlier segment 0\.\.0"):
        fm.tree(torch.tensor([0, 0, 1]), torch.tensor([-1, 1]))


# Null labels rows: one rule on every path, "a sample whose labels row is null is labelled by its
# tokens" (as a dict sample without the labels key). PackedDataset and pack_dataset refused
# them while streaming labelled them; an all-null column failed only with sync_ranks=True.
def _null_label_paths():
    from flexpack.data import PackedDataset, PackedIterableDataset, collate
    from flexpack.integrations.datasets import pack_dataset

    def rows(batches):
        return [b.labels[0].tolist() for b in batches]

    return {
        "PackedDataset": lambda ds: rows(PackedDataset(ds, 8)[i] for i in range(len(ds) and 1)),
        "PackedDataset(table)": lambda ds: rows([PackedDataset(ds.data.table, 8)[0]]),
        "stream": lambda ds: rows(PackedIterableDataset(ds, 8, buffer_size=8)),
        "stream sync": lambda ds: rows(
            PackedIterableDataset(ds, 8, buffer_size=8, sync_ranks=True, world_size=1, rank=0)
        ),
        "pack_dataset": lambda ds: collate(list(pack_dataset(ds, 8)), max_len=8).labels.tolist(),
        "pack_dataset shuffled": lambda ds: collate(
            list(pack_dataset(ds.select([1, 0, 2]).select([1, 0, 2]), 8)), max_len=8
        ).labels.tolist(),
        "pack_dataset padded": lambda ds: [r["labels"] for r in pack_dataset(ds, 8, padded=True)],
    }


@pytest.mark.parametrize("path", list(_null_label_paths()))
@pytest.mark.parametrize("nulls", [(1,), (2,), (0, 1, 2)], ids=["middle", "last", "all"])
def test_a_null_labels_row_is_labelled_by_its_tokens_on_every_path(path, nulls):
    datasets = pytest.importorskip("datasets")
    ids = [[1, 2, 3], [4, 5], [6, 7, 8]]
    labels = [[-100, 2, 3], [-100, 5], [-100, -100, 8]]
    given = [None if i in nulls else lab for i, lab in enumerate(labels)]
    explicit = [ids[i] if i in nulls else lab for i, lab in enumerate(labels)]  # the reference
    run = _null_label_paths()[path]
    if path == "PackedDataset(table)" and len(nulls) == 3:
        pytest.skip("an all-null column of a Table built from a Dataset is the same Table")
    got = run(datasets.Dataset.from_dict({"input_ids": ids, "labels": given}))
    want = run(datasets.Dataset.from_dict({"input_ids": ids, "labels": explicit}))
    assert got == want


def test_a_null_label_inside_a_labels_list_is_still_refused():
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3, 4]], "labels": [None, [1, None]]})
    with pytest.raises(ValueError, match="row 1 holds a null"):
        flexpack.data.PackedDataset(ds, 8)


def test_docs_say_trls_packing_default_as_trl_has_it(tmp_path):
    # docs/integrations.md said TRL's default is packing=True; TRL 1.16's is False.
    from pathlib import Path

    trl = pytest.importorskip("trl")
    page = (Path(__file__).resolve().parents[1] / "docs" / "integrations.md").read_text()
    default = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True).packing
    assert f"`packing={default}` is TRL's default" in page
    assert "TRL's defaults: `packing=True`" not in page


_INT_DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]


@given(data=st.data())
def test_property_from_eos_matches_a_python_reference_or_refuses(data):
    # The reference counts, in Python ints (no wrapping), the EOS tokens strictly before each
    # token; an eos_id the dtype cannot hold is refused instead of compared with wrapping.
    dtype = data.draw(st.sampled_from(_INT_DTYPES))
    info = torch.iinfo(dtype)
    row = data.draw(st.lists(st.integers(info.min, info.max), min_size=1, max_size=12))
    eos = data.draw(
        st.one_of(st.sampled_from(row), st.integers(-(2**65), 2**65), st.integers(-3, 300))
    )
    x = torch.tensor([row], dtype=torch.int64).to(dtype)
    if not info.min <= eos <= info.max:
        with pytest.raises(ValueError, match="cannot occur in input_ids"):
            flexpack.PackedLayout.from_eos(x, eos)
        return
    want, seen = [], 0
    for t in row:
        want.append(seen)
        seen += t == eos
    assert flexpack.PackedLayout.from_eos(x, eos).doc_ids.tolist() == [want]
