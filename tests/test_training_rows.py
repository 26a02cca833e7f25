"""The rows a training loop hands a hybrid or MoE model, beyond a packed batch with doc ids.

Rows described by ``position_ids`` alone on models whose layers do not hand them to attention
(Llama 4, ZAYA), 3-D (mRoPE) positions into a text model, a cache (``use_cache`` left at its
default) beside a padding-only row, a data-parallel rank's all-padding filler batch, gradient
checkpointing across two forwards before one backward, the router's load-balancing loss of
packed SFT, and a property over every mixer room on random layouts. Each test failed on the code
before its fix. Results are pinned against each document run alone; errors against the message a
user needs.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flexpack
import flexpack.integrations.transformers  # registers the rooms' exact kinds
import flexpack.mixers as fm

transformers = pytest.importorskip("transformers")
import _zoo  # noqa: E402
from _rows import random_rows as _rows_of  # noqa: E402
from test_mixers import FAMILIES, ONE_PASS_FLOAT64, _first, _model, positions  # noqa: E402

# ----------------------------------------------------------------------------- position_ids


@pytest.mark.parametrize("model_type", ["llama4_text", "zaya", "kimi_linear", "bailing_hybrid"])
def test_position_ids_only_rows_are_exact_where_layers_drop_them(model_type):
    """A default DataCollatorWithFlattening batch: position_ids restart per document, no doc_ids.
    Llama 4's decoder layer and ZAYA's model never hand position_ids to attention (leaked
    0.2-3.8 before): the attention falls back to the model call's sources."""
    model, reference = _zoo.build(model_type)
    vocab = model.config.get_text_config().vocab_size
    batch = flexpack.pack_sequences(_zoo.samples(vocab), _zoo.MAX_LEN)
    spans = _zoo._spans(batch.doc_ids[0])
    alone = _zoo._alone(reference, batch, spans)
    with torch.no_grad():
        out = model(
            input_ids=batch.input_ids, position_ids=batch.position_ids.long(), use_cache=False
        ).logits
    for (a, b), want in zip(spans, alone, strict=True):
        torch.testing.assert_close(out[0, a:b], want, rtol=0, atol=1e-4)


def test_mrope_position_ids_without_doc_ids_into_a_text_model():
    """3-D (mRoPE) position_ids (3, B, S) without doc_ids: a raw `expand` RuntimeError before;
    the first (temporal) row of positions starts the documents."""
    from flexpack.integrations.transformers import register

    model = _model("gated_delta_rule", register())
    reference = _model("gated_delta_rule")
    ids, _, docs, spans = _rows_of([[7, 11]], S=18)
    pos = torch.cat([torch.arange(7), torch.arange(11)])[None]  # (1, S)
    with torch.no_grad():
        out = model.model(input_ids=ids, position_ids=pos.expand(3, 1, -1), use_cache=False)
        for (b, a, e), doc in zip(spans, docs, strict=True):
            want = reference.model(input_ids=doc[None], use_cache=False).last_hidden_state[0]
            torch.testing.assert_close(out.last_hidden_state[b, a:e], want, rtol=0, atol=1e-4)


# ----------------------------------------------------------------------------- padding


@pytest.mark.parametrize("kind", ["gated_delta_rule", "mamba", "short_conv"])
def test_a_cache_beside_a_padding_only_row_keeps_documents_apart(kind):
    """transformers makes a cache whenever use_cache is left at its default; two documents in
    one row beside an all-padding row are not prompts (leaked 8e-5..1.9e-2 in float64)."""
    from flexpack.integrations.transformers import register

    model = fm.adapt(_model(kind, register(), torch.float64))
    reference = _model(kind, dtype=torch.float64)
    ids, doc_ids, docs, spans = _rows_of([[7, 11], []], S=20)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "generation cannot continue from these rows"
        out = model(input_ids=ids, doc_ids=doc_ids).logits
        for (b, a, e), doc in zip(spans, docs, strict=True):
            want = reference(input_ids=doc[None], use_cache=False).logits[0]
            torch.testing.assert_close(out[b, a:e], want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_an_all_padding_batch_runs_and_gives_zeros_in_the_mixers(kind):
    """A data-parallel rank's filler batch (doc_ids all -1) raised IndexError in the plan; it
    runs, the mixers give zeros, and backward reaches the mixer's parameters (DDP needs it)."""
    from flexpack.integrations.transformers import register

    model = fm.adapt(_model(kind, register()))
    mixer = model.get_submodule(f"model.layers.0.{FAMILIES[kind][2]}")
    seen = []
    hook = mixer.register_forward_hook(lambda m, a, out: seen.append(out))
    ids = torch.randint(3, 64, (2, 12))
    doc_ids = torch.full((2, 12), -1, dtype=torch.int32)
    try:
        out = model(input_ids=ids, doc_ids=doc_ids, use_cache=False).logits
    finally:
        hook.remove()
    assert torch.isfinite(out).all()
    first = seen[0] if isinstance(seen[0], torch.Tensor) else seen[0][0]
    assert first.shape[:2] == (2, 12) and not first.any()
    out.sum().backward()
    assert any(p.grad is not None for p in mixer.parameters())


# ----------------------------------------------------------------------------- checkpointing


def _two_forwards_grads(model, calls) -> dict[str, torch.Tensor]:
    model.zero_grad()
    total = sum(model(**kw).logits.sum() for kw in calls)
    total.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("other", [(11, 7), (5, 4, 9)], ids=["same lengths", "other lengths"])
def test_checkpointed_recompute_uses_its_own_forwards_documents(other, reentrant):
    """Two forwards then one backward under gradient checkpointing: the recompute planned its
    documents from the latest call (Jamba's conv bias grad 17% off; other lengths: a raw
    CheckpointError). Gradients equal the same forwards without checkpointing."""
    from flexpack.integrations.transformers import register

    model = fm.adapt(_model("mamba", register()))
    model.train()
    calls = []
    for seed, layout in ((0, [[7, 11]]), (1, [list(other)])):
        ids, doc_ids, _, _ = _rows_of(layout, S=20, seed=seed)
        calls.append(dict(input_ids=ids, doc_ids=doc_ids, use_cache=False))
    want = _two_forwards_grads(model, calls)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' deprecation of the old name
        model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    got = _two_forwards_grads(model, calls)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


# ----------------------------------------------------------------------------- router aux loss


def test_router_aux_loss_over_packed_rows_leaves_padding_out():
    """gpt-oss with output_router_logits=True (TRL's SFT defaults it on for MoE models): the
    load-balancing loss pooled the packed rows' padding (training differed with no word).
    packed_forward_kwargs(model=...) marks the padding: the loss equals the unpacked batch's;
    rows that do not mark it get a warning, once."""
    from flexpack.integrations.transformers import packed_forward_kwargs

    model, reference = _zoo.build("gpt_oss")
    model.train(), reference.train()  # gpt-oss has no dropout: train mode is deterministic
    for m in (model, reference):
        m.config.output_router_logits = True
    docs = _zoo.samples(model.config.vocab_size)
    batch = flexpack.pack_sequences(docs, _zoo.MAX_LEN)
    assert (batch.doc_ids < 0).any()  # the row has padding
    kwargs = packed_forward_kwargs(batch, labels=True, model=model)
    torch.testing.assert_close(kwargs["attention_mask"], (batch.doc_ids >= 0).long())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # padding marked: nothing to say
        packed = model(**kwargs).aux_loss
    # unpacked: each sample its own right-padded row, transformers' own attention
    longest = max(len(d) for d in docs)
    ids = torch.stack([torch.nn.functional.pad(d, (0, longest - len(d))) for d in docs])
    mask = torch.stack([torch.arange(longest) < len(d) for d in docs]).long()
    unpacked = reference(input_ids=ids, attention_mask=mask, use_cache=False).aux_loss
    torch.testing.assert_close(packed, unpacked, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # the padding did count before: without the mask the loss differs
        pooled = model(**{k: v for k, v in kwargs.items() if k != "attention_mask"}).aux_loss
    assert (pooled - unpacked).abs() > 1e-4

    fresh = _zoo.build("gpt_oss")[0].train()
    fresh.config.output_router_logits = True
    flat = dict(input_ids=batch.input_ids, position_ids=batch.position_ids.long(),
                labels=batch.labels.long(), use_cache=False)  # fmt: skip
    with pytest.warns(UserWarning, match=r"GptOssForCausalLM returns an MoE auxiliary loss") as w:
        assert torch.isfinite(fresh(**flat).loss)
    assert any("attention_mask=(doc_ids >= 0).long()" in str(x.message) for x in w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per model
        fresh(**flat)
    other = _zoo.build("gpt_oss")[0].train()  # no aux loss: nothing to say, no mask added
    assert "attention_mask" not in packed_forward_kwargs(batch, model=other)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        other(**packed_forward_kwargs(batch, labels=True, model=other))


# ----------------------------------------------------------------------------- property


S_PROP = 12  # fixed tiny shapes: two rows of 12 tokens
_MIXERS: dict[str, tuple] = {}


def _mixer_of(kind: str):
    """(float64 model, its mixer, extra kwargs, positional args, float32 model) of a kind's tiny
    models, adapted (MoE experts refuse float64 matmuls: the whole model runs in float32)."""
    if kind not in _MIXERS:
        model = fm.adapt(_model(kind, dtype=torch.float64))
        mixer = model.get_submodule(f"model.layers.0.{FAMILIES[kind][2]}")
        args, extra = (), {"attention_mask": None}
        if kind == "lightning_attention":
            extra["position_embeddings"] = None
        if kind == "cca_projection":
            extra, args = {}, (None,)
        _MIXERS[kind] = (model, mixer, extra, args, fm.adapt(_model(kind)))
    return _MIXERS[kind]


@st.composite
def layouts(draw):
    """Per row: document lengths filling at most S_PROP tokens (an empty row is padding); maybe
    one id reused for two runs of a row."""
    rows = []
    for _ in range(2):
        lengths, left = [], S_PROP
        while left and draw(st.booleans()):
            n = draw(st.integers(1, left))
            lengths.append(n)
            left -= n
        rows.append(lengths)
    return rows, draw(st.booleans())


@pytest.mark.parametrize("kind", sorted(FAMILIES))
@settings(max_examples=6, deadline=None)
@given(layout=layouts())
def test_every_room_on_random_layouts_equals_each_document_alone(kind, layout):
    """Random rows (padding rows, all padding, documents split into runs of one id): each
    document's outputs equal the document alone (float64), padding gives zeros, an id naming
    two runs is refused; the whole model gives the same logits with a cache as without, and
    the same gradients under checkpointing with two forwards before one backward."""
    rows, split = layout
    model, mixer, extra, args, whole = _mixer_of(kind)
    ids, doc_ids, _, spans = _rows_of(rows, S=S_PROP)
    g = torch.Generator().manual_seed(len(spans))
    x = torch.randn(2, S_PROP, model.config.hidden_size, generator=g, dtype=torch.float64)
    row = next((b for b in range(2) if sum(s[0] == b for s in spans) >= 3), None)
    if split and row is not None:  # the row's last document takes its first one's id
        last = max((s for s in spans if s[0] == row), key=lambda s: s[1])
        doc_ids[row, last[1] : last[2]] = 0
        with pytest.raises(ValueError, match=f"two separate runs of row {row}"):
            mixer(x, *args, doc_ids=doc_ids, **extra, **positions(kind, x))
        return
    with torch.no_grad():
        out = mixer(x, *args, doc_ids=doc_ids, **extra, **positions(kind, x))
        out = out if kind == "cca_projection" else (_first(out),)
        for b, a, e in spans:
            one = x[b : b + 1, a:e]
            alone = type(mixer).forward(mixer, one, *args, **extra, **positions(kind, one))
            alone = alone if kind == "cca_projection" else (_first(alone),)
            for got, want in zip(out, alone, strict=True):  # the rule's own is fp32 inside
                atol = 1e-6 if kind in ONE_PASS_FLOAT64 else 1e-10
                torch.testing.assert_close(got[b, a:e], want[0], rtol=0, atol=atol)
        assert not any(o[doc_ids < 0].any() for o in out)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # packed rows with a cache: "cannot continue"
            cached = whole(input_ids=ids, doc_ids=doc_ids, use_cache=True).logits
        plain = whole(input_ids=ids, doc_ids=doc_ids, use_cache=False).logits
    real = doc_ids >= 0
    torch.testing.assert_close(cached[real], plain[real], rtol=0, atol=1e-6)
    # gradient checkpointing, two forwards (this layout, then its rows swapped), one backward:
    # each replay plans its own forward's documents, the gradients are the plain ones
    calls = [dict(input_ids=i, doc_ids=d, use_cache=False)
             for i, d in ((ids, doc_ids), (ids.flip(0), doc_ids.flip(0)))]  # fmt: skip
    whole.train()
    try:
        want = _two_forwards_grads(whole, calls)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers' deprecation of the old name
            whole.gradient_checkpointing_enable()
        got = _two_forwards_grads(whole, calls)
    finally:
        whole.gradient_checkpointing_disable()
        whole.eval()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
