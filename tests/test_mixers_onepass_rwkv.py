"""RWKV's time mix and channel mix in one pass over packed rows (flexpack.mixers.rwkv).

References: in float64 a plain recurrence written from RWKV's definition (:func:`_reference`:
the token shift, then num / den summed token by token without a running max), each document
alone, to 1e-10 (outputs and gradients); in float32 the plain module's own forward on each
document alone, to 1e-5 (keys of hundreds too, where e^k overflows float32 without the
module's running max); tree rows against each root-to-leaf path alone; a whole tiny
RwkvForCausalLM packed through ``packed_forward_kwargs(batch, model=model)`` against each
document alone, and ``generate()`` after a packed forward against a fresh model's. Rows of 24
tokens: the recurrence's chunks are 5 tokens, so documents cross them and start inside them.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from _onepass import close, count  # noqa: E402
from _rows import documents, layout_ids  # noqa: E402

import flexpack  # noqa: E402
import flexpack.mixers as fm  # noqa: E402
from flexpack import masks  # noqa: E402
from flexpack.integrations import _mixers_check  # noqa: E402
from flexpack.integrations._tiny import tiny_config  # noqa: E402
from flexpack.integrations.transformers import packed_forward_kwargs, register  # noqa: E402
from flexpack.mixers import rwkv  # noqa: E402
from flexpack.mixers._plan import DocumentPlan  # noqa: E402
from flexpack.mixers._tree import TreePlan  # noqa: E402

S = 24
# documents longer than a chunk, starting mid-chunk, of one token; a padding-only row
LAYOUTS = {
    "mixed": [[1, 6, 2, 9, 1], [4, 4, 8, 3], [], [1, 1, 1, 1, 1, 14]],
    "one per row": [[13], [24]],
}
# per row: (segment lengths, parents), padded to S: a prompt and three completions (one of a
# single token); two levels (a turn's answers below a first answer); one tree beside padding
FORESTS = {
    "grpo": [([7, 5, 1, 6], [-1, 0, 0, 0]), ([3, 9, 2], [-1, 0, 0])],
    "two levels": [([6, 4, 3, 5, 2, 1], [-1, 0, 1, 1, 0, -1])],
    "one segment": [([11], [-1]), ([], [])],
}
MIXERS = {"wkv": "attention", "token_shift": "feed_forward"}  # room -> the block's attribute


def _model(dtype=torch.float64, attention_hidden_size: int = 48):
    """A tiny RwkvForCausalLM of two blocks (RWKV's init needs two), loaded as users are told
    to (flexpack's attention: RWKV has none, so nothing changes); A = 48 != H = 64 tells the
    recurrence's width from the rows' (its cache, generate(), needs A = H)."""
    config = tiny_config(transformers.RwkvConfig(), register())
    config.attention_hidden_size = attention_hidden_size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = transformers.RwkvForCausalLM(config).to(dtype)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # away from the initial values (time_first all 1, mixes in [0, 1])
        for name, p in model.named_parameters():
            if "time_" in name:
                p.add_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.eval()


def _mixer(model, room: str) -> torch.nn.Module:
    return getattr(model.rwkv.blocks[0], MIXERS[room])


def _reference(mixer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The mixer on one document ``x`` (n, H), from RWKV's definition: the token shift (zeros
    before the first token), then for the time mix num_t = e^w num_{t-1} + e^{k_t} v_t and
    den_t likewise (w = -exp(time_decay)), wkv_t = (num_{t-1} + e^{u + k_t} v_t) /
    (den_{t-1} + e^{u + k_t}), token by token, no running max (float64 does not overflow)."""
    shifted = F.pad(x[:-1], (0, 0, 1, 0))

    def mix(name: str) -> torch.Tensor:
        m = getattr(mixer, f"time_mix_{name}")[0, 0]
        return x * m + shifted * (1 - m)

    if not hasattr(mixer, "time_decay"):  # the channel mix
        value = mixer.value(torch.relu(mixer.key(mix("key"))) ** 2)
        return torch.sigmoid(mixer.receptance(mix("receptance"))) * value
    k, v = mixer.key(mix("key")), mixer.value(mix("value"))
    r = torch.sigmoid(mixer.receptance(mix("receptance")))
    w, u = -torch.exp(mixer.time_decay), mixer.time_first
    num = den = torch.zeros_like(k[0])
    out = []
    for t in range(x.shape[0]):
        bonus = torch.exp(u + k[t])
        out.append((num + bonus * v[t]) / (den + bonus))
        num = torch.exp(w) * num + torch.exp(k[t]) * v[t]
        den = torch.exp(w) * den + torch.exp(k[t])
    return mixer.output(r * torch.stack(out))


def _one_pass(room: str):
    return {"wkv": rwkv.time_mix_one_pass, "token_shift": rwkv.channel_mix_one_pass}[room]


def _grads(out, weights, leaves):
    return torch.autograd.grad((out * weights).sum(), leaves, allow_unused=True)


def _same_grads(got, want, names, tol):
    for name, g, w in zip(names, got, want, strict=True):
        if w is None:
            assert g is None or not g.any(), name
            continue
        close(g, w, tol)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("room", sorted(MIXERS))
def test_one_pass_is_the_plain_recurrence_per_document_float64(room, layout):
    """Outputs to 1e-10 of the recurrence run on each document alone; gradients of a random
    projection, w.r.t. the rows and every parameter, to 1e-10; padding gives zeros."""
    model = _model()
    mixer = _mixer(model, room)
    doc_ids = layout_ids(LAYOUTS[layout], S)
    g = torch.Generator().manual_seed(1)
    x, weights = torch.randn(2, *doc_ids.shape, 64, generator=g, dtype=torch.float64)
    names, params = zip(*mixer.named_parameters(), strict=True)

    packed = x.clone().requires_grad_()
    out = _one_pass(room)(mixer, packed, DocumentPlan.from_doc_ids(doc_ids))
    got = _grads(out, weights, [packed, *params])

    rows = x.clone().requires_grad_()
    want = torch.zeros_like(out)
    for b, a, e in documents(doc_ids):
        want[b, a:e] = _reference(mixer, rows[b, a:e])
    expected = _grads(want, weights, [rows, *params])

    assert out.dtype == torch.float64
    close(out, want, 1e-10)
    assert not out[doc_ids < 0].any()
    _same_grads(got, expected, ["x", *names], 1e-10)


@pytest.mark.parametrize("chunk", [1, 2, 7, 24, 40])
def test_any_chunk_gives_the_same_numbers(chunk):
    """The chunk size only changes how the recurrence is split: every one gives the
    recurrence's numbers (1 token per chunk, chunks over a row)."""
    model = _model()
    mixer = _mixer(model, "wkv")
    doc_ids = layout_ids(LAYOUTS["mixed"], S)
    x = torch.randn(
        *doc_ids.shape, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    with torch.no_grad():
        out = rwkv.time_mix_one_pass(mixer, x, DocumentPlan.from_doc_ids(doc_ids), chunk=chunk)
        for b, a, e in documents(doc_ids):
            close(out[b, a:e], _reference(mixer, x[b, a:e]), 1e-10)


def _through_adapt(room, doc_ids, x, monkeypatch):
    """The float32 mixer adapted, on ``doc_ids``' rows: (calls, packed out, each document
    alone through the plain module {(row, start, end): out}, grads got, grads wanted)."""
    model = _model(torch.float32)
    mixer = _mixer(model, room)
    g = torch.Generator().manual_seed(3)
    weights = torch.randn(x.shape, generator=g)
    params = list(mixer.parameters())
    rows = x.clone().requires_grad_()
    alone = {(b, a, e): mixer(rows[b : b + 1, a:e])[0] for b, a, e in documents(doc_ids)}
    loss = sum((o[0] * weights[b, a:e]).sum() for (b, a, e), o in alone.items())
    want = torch.autograd.grad(loss, [rows, *params])

    fm.adapt(model)
    try:
        assert dict(fm.mixers_of(model))[f"rwkv.blocks.0.{MIXERS[room]}"] == room
        with torch.no_grad():
            mixer(x, doc_ids=doc_ids)  # the class's self-check runs once
        calls = count(monkeypatch, {r.name: r for r in rwkv.ROOMS}[room])
        packed = x.clone().requires_grad_()
        out, state = mixer(packed, doc_ids=doc_ids)
        got = torch.autograd.grad((out * weights).sum(), [packed, *params])
    finally:
        fm.restore(model)
    assert state is None
    return calls, out, alone, got, want


@pytest.mark.parametrize("room", sorted(MIXERS))
def test_adapted_mixer_runs_the_one_pass_float32(room, monkeypatch):
    """Through flexpack.mixers.adapt: the one pass ran (no per-group call), each document
    within 1e-5 of the plain module's own forward alone, gradients too; padding gives zeros."""
    doc_ids = layout_ids(LAYOUTS["mixed"], S)
    x = torch.randn(*doc_ids.shape, 64, generator=torch.Generator().manual_seed(1))
    calls, out, alone, got, want = _through_adapt(room, doc_ids, x, monkeypatch)
    assert calls == {"one_pass": 1, "split": 0}
    for (b, a, e), o in alone.items():
        close(out[b, a:e], o[0], 1e-5)
    assert not out[doc_ids < 0].any()
    for g, w in zip(got, want, strict=True):
        close(g, w, 1e-5)


def test_keys_of_hundreds_stay_finite_float32(monkeypatch):
    """Rows scaled so that keys reach hundreds (e^k overflows float32 past 88): the running
    max keeps the one pass finite and equal to the module's own forward."""
    doc_ids = layout_ids([[3, 12, 9], [1, 1, 22]], S)
    x = 40 * torch.randn(*doc_ids.shape, 64, generator=torch.Generator().manual_seed(4))
    calls, out, alone, got, want = _through_adapt("wkv", doc_ids, x, monkeypatch)
    model = _model(torch.float32)
    k = _mixer(model, "wkv").key(x)
    assert k.abs().max() > 100
    assert calls == {"one_pass": 1, "split": 0}
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in got)
    for (b, a, e), o in alone.items():
        close(out[b, a:e], o[0], 1e-5)
    for g, w in zip(got, want, strict=True):
        close(g, w, 1e-4)


@pytest.mark.parametrize("room", sorted(MIXERS))
def test_bf16_autocast_keeps_the_plain_modules_dtype(room):
    """Under bf16 autocast over float32 weights the adapted mixer returns the plain module's
    dtype, each document's values to bf16's rounding."""
    model = _model(torch.float32)
    mixer = _mixer(model, room)
    doc_ids = layout_ids(LAYOUTS["mixed"], S)
    x = torch.randn(*doc_ids.shape, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        alone = {(b, a, e): mixer(x[b : b + 1, a:e])[0] for b, a, e in documents(doc_ids)}
        fm.adapt(model)
        try:
            out = mixer(x, doc_ids=doc_ids)[0]
        finally:
            fm.restore(model)
    assert out.dtype == next(iter(alone.values())).dtype == torch.bfloat16
    for (b, a, e), o in alone.items():
        close(out[b, a:e].float(), o[0].float(), 3e-2)


@pytest.mark.parametrize("room", sorted(MIXERS))
def test_per_group_fallback_stays_exact(room, monkeypatch):
    """A class whose self-check failed keeps the per-group calls: each document still gets
    what it gets alone."""
    one_pass = {r.name: r for r in rwkv.ROOMS}[room].one_pass
    mixer_type = type(_mixer(_model(torch.float32), room))
    monkeypatch.setitem(one_pass.verified, mixer_type, False)
    doc_ids = layout_ids(LAYOUTS["mixed"], S)
    x = torch.randn(*doc_ids.shape, 64, generator=torch.Generator().manual_seed(1))
    calls, out, alone, got, want = _through_adapt(room, doc_ids, x, monkeypatch)
    assert calls["one_pass"] == 0 and calls["split"] > 0
    for (b, a, e), o in alone.items():
        close(out[b, a:e], o[0], 1e-5)
    for g, w in zip(got, want, strict=True):
        close(g, w, 1e-5)


def _forest(forest):
    """(B, S) segment ids, (B, M) parents and every root-to-leaf path's flat token positions."""
    B, M = len(forest), max(1, max(len(lengths) for lengths, _ in forest))
    seg = torch.full((B, S), -1, dtype=torch.int64)
    parents = torch.full((B, M), -1, dtype=torch.int64)
    paths = []
    for b, (lengths, par) in enumerate(forest):
        spans, at = [], 0
        for j, n in enumerate(lengths):
            seg[b, at : at + n] = j
            spans.append(list(range(b * S + at, b * S + at + n)))
            at += n
        parents[b, : len(par)] = torch.tensor(par, dtype=torch.int64)
        for leaf in (j for j in range(len(lengths)) if j not in par):
            chain = [leaf]
            while par[chain[-1]] >= 0:
                chain.append(par[chain[-1]])
            paths.append([t for j in reversed(chain) for t in spans[j]])
    return seg, parents, paths


@pytest.mark.parametrize("forest", sorted(FORESTS))
@pytest.mark.parametrize("room", sorted(MIXERS))
def test_tree_rows_equal_each_path_alone_float64(room, forest):
    """Through the adapted mixer with a tree flexpack_mask: a branch's first token shifts in
    its parent's last token and starts from the WKV state at the end of its parent segment;
    each token (from the first path that holds it) to 1e-10 of the recurrence on its
    root-to-leaf path alone, gradients too (a shared prompt's from every branch)."""
    model = _model()
    mixer = _mixer(model, room)
    seg, parents, paths = _forest(FORESTS[forest])
    g = torch.Generator().manual_seed(1)
    x, weights = torch.randn(2, *seg.shape, 64, generator=g, dtype=torch.float64)
    names, params = zip(*mixer.named_parameters(), strict=True)

    fm.adapt(model)
    try:
        fm.set_sources(model, flexpack_mask=masks.tree(seg, parents))
        packed = x.clone().requires_grad_()
        out = mixer(packed)[0]
    finally:
        fm.restore(model)
    got = _grads(out, weights, [packed, *params])

    rows = x.clone().requires_grad_()
    flat = rows.reshape(-1, 64)
    want = torch.zeros(seg.numel(), 64, dtype=torch.float64)
    taken = torch.zeros(seg.numel(), dtype=torch.bool)
    for path in paths:
        alone = _reference(mixer, flat[path])
        new = ~taken[path]
        index = torch.tensor(path)[new]
        want = want.index_copy(0, index, alone[new])
        taken[index] = True
    want = want.view(out.shape)
    expected = _grads(want, weights, [rows, *params])

    close(out, want, 1e-10)
    assert not out[seg < 0].any()
    _same_grads(got, expected, ["x", *names], 1e-10)


def test_tree_form_forks_the_state_instead_of_running_each_path(monkeypatch):
    """The time mix on tree rows runs its tree form (one chunked pass, TreePlan.chunked), not
    TreePlan.scan's per-path fallback."""
    model = _model()
    seg, parents, _ = _forest(FORESTS["grpo"])
    plan = TreePlan.from_parents(seg, parents)
    ran = []
    chunked = TreePlan.chunked
    monkeypatch.setattr(TreePlan, "chunked", lambda *a, **k: ran.append(1) or chunked(*a, **k))
    monkeypatch.setattr(TreePlan, "expand", lambda *a, **k: pytest.fail("ran each path"))
    x = torch.randn(*seg.shape, 64, dtype=torch.float64)
    with torch.no_grad():
        rwkv.time_mix_one_pass(_mixer(model, "wkv"), x, plan)
    assert ran == [1]


def test_whole_model_packed_equals_each_document_alone(monkeypatch):
    """A tiny RwkvForCausalLM (two blocks) on packed rows through packed_forward_kwargs(batch,
    model=model): every document's logits within 1e-5 of the document alone (the same weights,
    never adapted), gradients of every weight to 1e-4; the model is no longer refused as
    having its own attention."""
    model = _model(torch.float32)
    reference = copy.deepcopy(model)
    with pytest.raises(ValueError, match="linear_recurrence") as refused:
        _mixers_check.check(model)  # before adapting: its recurrences, not its attention
    assert "own_attention" not in str(refused.value)
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 128, (n,), generator=g) for n in (11, 1, 14, 9, 5)]
    batch = flexpack.pack_sequences(docs, 24)
    kwargs = packed_forward_kwargs(batch, model=model)
    with torch.no_grad():
        model(**kwargs)  # each mixer class's self-check runs once
    calls = [count(monkeypatch, room) for room in rwkv.ROOMS]
    model.train()
    reference.train()
    logits = model(**kwargs).logits  # (R, S, V)
    assert calls == [{"one_pass": 2, "split": 0}] * 2  # each block's mixers, in one pass
    _mixers_check.check(model)  # adapted: exact
    assert sorted({kind for _, kind in fm.mixers_of(model)}) == ["token_shift", "wkv"]
    w = torch.randn(logits.shape, generator=g) * (batch.doc_ids >= 0)[..., None]  # no padding
    loss, want = (logits * w).sum(), 0.0
    for b, a, e in documents(batch.doc_ids):
        alone = reference(input_ids=batch.input_ids[b : b + 1, a:e], use_cache=False).logits[0]
        close(logits[b, a:e], alone, 1e-5)
        want = want + (alone * w[b, a:e]).sum()
    loss.backward()
    want.backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        if p.grad is None and q.grad is None:
            continue
        close(p.grad, q.grad, 1e-4)


def test_generate_after_a_packed_forward_is_a_fresh_models():
    """generate() on the model after a packed forward (its mixers adapted) runs their own
    forward with RWKV's state (a call with a cache: ``state``), left-padded prompts included
    (RWKV reads the padding as tokens): the same tokens and scores as a fresh model's."""
    model = _model(torch.float32, attention_hidden_size=64)
    fresh = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 128, (n,), generator=g) for n in (7, 9, 6)]
    with torch.no_grad():
        model(**packed_forward_kwargs(flexpack.pack_sequences(docs, 24), model=model))
    assert fm.is_adapted(model.rwkv.blocks[0].attention)
    prompts = torch.randint(3, 128, (2, 6), generator=g)
    mask = torch.ones_like(prompts)
    prompts[1, :2], mask[1, :2] = 0, 0  # left padding: not one document per row for the plan
    settings = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, output_scores=True,
                    return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
    with torch.no_grad():
        got = model.generate(prompts, **settings)
        want = fresh.generate(prompts, **settings)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
