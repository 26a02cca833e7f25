"""Issue 43, point 4: one definition of split-run ids in every public entry point.

An id that names two separate runs of a row (``[0, 0, 1, 1, 0, 0]``: one document or two?) is
refused with one ValueError, word for word, by the layout, the mask factories, attention, the
losses and context parallelism; ids whose every id is one run are accepted by all of them, and
``PackedLayout.from_runs`` is the fix the message names. On a (fake) GPU the masks leave the check
to the host sync their first use makes, so a call still syncs at most once. A model's forward
(transformers, attention and flexpack.mixers alike) and its loss helper refuse the same ids.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flexpack
import flexpack.mixers as fm
from flexpack import masks
from flexpack.layout import PackedLayout, _check_runs
from flexpack.parallel import ContextShard, context_parallel_attention, shard_context
from flexpack.testing import strategies as fst

try:  # the model forwards at the end need transformers (extra hf)
    import _zoo
except ImportError:
    _zoo = None

SPLIT = torch.tensor([[0, 0, 1, 1, 0, 0]])  # id 0 at positions 0-1 and 4-5


def _entry_points(d: torch.Tensor) -> dict:
    """Every public entry point that reads (B, S) doc ids, called on ``d``."""
    B, S = d.shape
    logits = torch.randn(B, S, 5, dtype=torch.float64)
    labels = torch.randint(0, 5, (B, S))
    hidden, weight = torch.randn(B, S, 4, dtype=torch.float64), torch.randn(5, 4).double()
    q = torch.randn(B, 2, S, 8, dtype=torch.float64)
    lengths = torch.ones(B, S, dtype=torch.int64)  # a one-token prefix for every document
    return {
        "PackedLayout.from_doc_ids": lambda: PackedLayout.from_doc_ids(d),
        "masks.document": lambda: masks.document(d),
        "masks.document & causal": lambda: masks.document(d) & masks.causal(),
        "document_mask": lambda: flexpack.document_mask(d),
        "document_causal_mask": lambda: flexpack.document_causal_mask(d, block_size=2),
        "prefix_lm": lambda: masks.prefix_lm(d, lengths),
        "attention": lambda: flexpack.attention(q, q, q, masks.document(d) & masks.causal()),
        "loss token": lambda: flexpack.packed_cross_entropy(logits, labels, d),
        "loss document": lambda: flexpack.packed_cross_entropy(
            logits, labels, d, reduction="document"
        ),
        "linear loss document": lambda: flexpack.packed_linear_cross_entropy(
            hidden, weight, labels, d, reduction="document"
        ),
        "shard_context": lambda: shard_context(d, 1, 0),
    }


def _refusals(d: torch.Tensor) -> dict[str, str]:
    out = {}
    for name, call in _entry_points(d).items():
        with pytest.raises(ValueError) as info:
            call()
        out[name] = str(info.value)
    return out


def test_every_entry_point_gives_the_same_refusal():
    got = _refusals(SPLIT)
    messages = set(got.values())
    assert len(messages) == 1, got
    (message,) = messages
    # what was received, what is expected, and the fix
    assert message.startswith(
        "doc_ids: doc id 0 names two separate runs of row 0 (at positions 0 and 4"
    )
    assert "one contiguous run of its row" in message
    assert "flexpack.PackedLayout.from_runs(doc_ids).doc_ids" in message


def test_padding_reads_no_documents_and_accepts_any_ids():
    dense = masks.padding(SPLIT).mask_mod(0, 0, torch.arange(6)[:, None], torch.arange(6))
    assert bool(dense.all())


def test_from_runs_is_the_fix_each_run_its_own_document():
    fixed = PackedLayout.from_runs(SPLIT)
    assert fixed.doc_ids.tolist() == [[0, 0, 1, 1, 2, 2]]
    assert fixed.seqlens.tolist() == [2, 2, 2]
    torch.manual_seed(0)
    logits = torch.randn(1, 6, 5, dtype=torch.float64)
    labels = torch.randint(0, 5, (1, 6))
    got = flexpack.packed_cross_entropy(logits, labels, fixed.doc_ids, reduction="document")
    ce = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], reduction="none")
    want = (ce[0] + ce[2] + ce[4]) / 3  # three documents of one supervised pair each
    torch.testing.assert_close(got, want)
    # ids that are one run each: from_runs is from_doc_ids
    d = torch.tensor([[7, 7, 2**40, -1, 3, 3]])
    assert torch.equal(PackedLayout.from_runs(d).doc_ids, PackedLayout.from_doc_ids(d).doc_ids)


def test_the_ring_refuses_a_shard_built_by_hand():
    good = shard_context(torch.tensor([[0, 0, 1, 1, 2, 2]]), 1, 0)
    fields = {f: getattr(good, f) for f in good.__dataclass_fields__}
    fields["row_doc_ids"] = SPLIT.clone()
    shard = ContextShard(**fields)
    q = torch.randn(1, 2, 6, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"shard\.row_doc_ids: doc id 0 names two separate runs"):
        context_parallel_attention(q, q, q, shard, schedule="ring")


def test_the_check_is_skipped_while_torch_compile_traces(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    _check_runs(SPLIT)  # the eager call before the compiled code refuses; a trace does not


def _split(d: torch.Tensor, data: st.DataObject) -> torch.Tensor | None:
    """``d`` with one id written again past a token of another run: a split run, or None."""
    B, S = d.shape
    candidates = []
    for b in range(B):
        row = d[b].tolist()
        for end in range(1, S - 1):  # run ending at end - 1, another token at end
            if row[end - 1] >= 0 and row[end] != row[end - 1]:
                candidates.append((b, end))
    if not candidates:
        return None
    b, end = data.draw(st.sampled_from(candidates))
    p = data.draw(st.integers(end + 1, S - 1))
    out = d.clone()
    out[b, p] = d[b, end - 1]
    return out


@given(d=fst.doc_ids(max_batch_size=2, max_seq_len=24, contiguous=False), data=st.data())
def test_one_run_ids_are_accepted_and_any_split_run_refused_by_all(d, data):
    d = d.long()
    for name, call in _entry_points(d).items():
        if name != "prefix_lm":  # (which takes ids 0..n-1 in order only)
            call()  # accepted
    bad = _split(d, data)
    if bad is None:
        return
    got = _refusals(bad)
    assert len(set(got.values())) == 1, got
    assert re.match(
        r"doc_ids: doc id -?\d+ names two separate runs of row \d", next(iter(got.values()))
    )


# ----------------------------------------------------------------------------- on a (fake) GPU


def test_on_the_gpu_masks_refuse_with_the_sync_of_their_first_use(fake_cuda):
    d = fake_cuda.to(SPLIT)
    with fake_cuda.count() as syncs:
        mask = masks.document(d) & masks.causal()  # built: no sync, no check yet
    assert syncs == []
    q = fake_cuda.to(torch.randn(1, 2, 6, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="doc id 0 names two separate runs of row 0"):
        flexpack.attention(q, q, q, mask, backend="sdpa")  # the per-document plan's flag
    with pytest.raises(ValueError, match="doc id 0 names two separate runs of row 0"):
        mask.block_mask(block_size=2)
    with pytest.raises(ValueError, match="doc id 0 names two separate runs of row 0"):
        flexpack.document_causal_mask(d, block_size=2)


def test_on_the_gpu_accepted_ids_cost_no_extra_sync(fake_cuda):
    good = torch.tensor([[0, 0, 1, 1, 2, -1]])
    d = fake_cuda.to(good)
    mask = masks.document(d) & masks.causal()
    q = fake_cuda.to(torch.randn(1, 2, 6, 8, dtype=torch.float64))
    with fake_cuda.count() as syncs:
        flexpack.attention(q, q, q, mask, backend="sdpa")
    assert syncs and not [s for s in syncs if "_attention_sdpa" not in s.where], syncs
    # the per-document plan's own syncs carry the check: none of its own
    logits = fake_cuda.to(torch.randn(1, 6, 5))
    labels = fake_cuda.to(torch.randint(0, 5, (1, 6)))
    with fake_cuda.count() as syncs:
        flexpack.packed_cross_entropy(logits, labels, d)
    assert len(syncs) <= 1, syncs  # the label check's sync carries it
    with pytest.raises(ValueError, match="doc id 0 names two separate runs"):
        flexpack.packed_cross_entropy(logits, labels, fake_cuda.to(SPLIT))


# ----------------------------------------------------------------------------- model forwards

SPLIT_ROW = [[0, 0, 0, 1, 1, 0, 0, 0]]  # id 0 at positions 0-2 and 5-7
needs_transformers = pytest.mark.skipif(_zoo is None, reason="needs transformers (extra hf)")


def _model(kind: str, attn_implementation: str = "eager"):
    """The tiny model of a mixer kind from tests/test_mixers.py (imported when called: that
    module needs transformers)."""
    import test_mixers

    return test_mixers._model(kind, attn_implementation)


@needs_transformers
@pytest.mark.parametrize("kind", [None, "mamba", "short_conv"])
def test_one_id_in_two_runs_of_a_row_is_refused_everywhere(kind):
    """Attention, loss and the ring joined the runs into one document, the mixers restarted
    their state at the second run (Mamba 5.8e-4 apart): one rule now, PackedLayout's."""
    from flexpack.integrations.transformers import packed_causal_lm_loss, register

    if kind is None:
        model = _zoo.build("llama")[0]
    else:
        model = fm.adapt(_model(kind, register()))
    doc_ids = torch.tensor(SPLIT_ROW)
    ids = torch.randint(3, 64, doc_ids.shape)
    match = r"doc_ids: doc id 0 names two separate runs of row 0 \(at positions 0 and 5"
    with pytest.raises(ValueError, match=match):
        model(input_ids=ids, doc_ids=doc_ids, use_cache=False)
    with pytest.raises(ValueError, match="Give each run its own id"):
        packed_causal_lm_loss(model, {"input_ids": ids, "doc_ids": doc_ids, "labels": ids})
    with pytest.raises(ValueError, match="seq_idx: doc id 0 names two separate runs"):
        model(input_ids=ids, seq_idx=doc_ids, use_cache=False)
    renumbered = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])  # the fix the message names
    assert torch.isfinite(model(input_ids=ids, doc_ids=renumbered, use_cache=False).logits).all()
