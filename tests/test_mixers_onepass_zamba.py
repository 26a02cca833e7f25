"""Zamba's multi-head Mamba (1) mixer in one pass over packed rows and prefix trees
(flexpack.mixers.ssm.zamba_mamba_one_pass).

References: each document (each root-to-leaf path of a tree) run alone through the plain
module. In float64 its scan is replaced by the recurrence it defines, token by token
(:func:`_recurrence`): the module hands its scan A, D and the dt bias already rounded to
float32, and the scan rounds B and x to float32, so only that twin can hold the one pass to
1e-10 (and the twin is held to the module's own scan in float32). In float32 the plain module
itself, to 1e-5; gradients of the rows and every parameter included; the one pass must be what
ran through the adapted module (not the per-group calls), and on trees its forked form (not
each path). A whole tiny ZambaForCausalLM packed through ``packed_forward_kwargs(batch,
model=model)`` against each document alone, then ``generate()`` on it against a fresh model's.
Rows of 24 tokens: the scan's chunks are 5 tokens, so documents cross them and start inside
them.
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from _onepass import close, count, each_alone, inputs  # noqa: E402
from _rows import documents, layout_ids  # noqa: E402

import flexpack  # noqa: E402
import flexpack.mixers as fm  # noqa: E402
from flexpack import masks  # noqa: E402
from flexpack.integrations._tiny import tiny_config  # noqa: E402
from flexpack.integrations.transformers import packed_forward_kwargs, register  # noqa: E402
from flexpack.mixers import ssm  # noqa: E402
from flexpack.mixers._plan import DocumentPlan  # noqa: E402
from flexpack.mixers._tree import TreePlan  # noqa: E402

S = 24
# documents longer than a chunk, starting mid-chunk, on a chunk's edge, of one token; padding
LAYOUTS = {
    "mixed": [[1, 6, 2, 9, 1], [4, 4, 8, 3], [], [1, 1, 1, 1, 1, 14]],
    "one per row": [[13], [24]],
}
# per row: (segment lengths, parents), padded to S: a prompt and its completions (one of a
# single token); several levels; a 1-token parent (a branch's conv window reaches its
# grandparent); documents beside a padding-only row
FORESTS = {
    "grpo": [([7, 5, 1, 6], [-1, 0, 0, 0]), ([3, 9, 2], [-1, 0, 0])],
    "multi-level": [([6, 4, 3, 5, 2, 1], [-1, 0, 1, 1, 0, -1])],
    "short parents": [([3, 1, 2, 2, 1, 4], [-1, 0, 1, 1, 0, 4])],
    "documents and padding": [([11, 13], [-1, -1]), ([], [])],
}


def _model(dtype=torch.float64, attn_implementation: str = "eager"):
    """A tiny ZambaForCausalLM: four layers (two Mamba, two hybrid: the shared attention block
    then Mamba), 2 Mamba heads of 64 channels, an 8-wide state."""
    config = tiny_config(transformers.ZambaConfig(), attn_implementation)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _mixer(model) -> torch.nn.Module:
    """The first layer's mixer, its parameters moved away from their initial values (every
    head's A the same, D = 1, x_proj zero)."""
    mixer = model.model.layers[0].mamba
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return mixer


def _recurrence(mixer) -> Callable:
    """``mamba_selective_scan`` as Zamba's mixer calls it (once per head, in order, without a
    cache), as its definition: h_t = exp(A dt_t) h_{t-1} + dt_t B_t u_t, y_t = (C_t . h_t +
    D u_t) silu(z_t), token by token in the inputs' dtype (float64 here), with the head's A_log,
    D and dt bias read from ``mixer`` (the module hands them over rounded to float32). u, dt, z:
    (batch, p, L); B, C: (batch, n, L)."""
    calls = itertools.count()

    def scan(u, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
             return_last_state=False, **kwargs):  # fmt: skip
        assert delta_softplus and not return_last_state
        head = next(calls) % mixer.n_mamba_heads
        A_log = mixer.A_log[head]  # (p, n)
        torch.testing.assert_close(A, -torch.exp(A_log.float()))  # the head the module runs
        dt = F.softplus(dt + mixer.dt_proj_bias[head].to(u.dtype)[:, None])
        A = -torch.exp(A_log.to(u.dtype))
        state = u.new_zeros(*u.shape[:2], A.shape[-1])
        ys = []
        for t in range(u.shape[-1]):
            step = dt[:, :, t, None]  # (batch, p, 1)
            state = torch.exp(A * step) * state + step * B[:, None, :, t] * u[:, :, t, None]
            ys.append((state * C[:, None, :, t]).sum(-1) + mixer.D[head] * u[:, :, t])
        return torch.stack(ys, -1) * F.silu(z)

    return scan


def _reference(mixer) -> dict:
    """each_alone's keywords: the plain module with its scan the float64 recurrence."""
    return dict(seam="mamba_selective_scan", scan=_recurrence(mixer))


def test_recurrence_is_the_modules_own_scan_float32():
    """The float64 reference's scan is what the module computes: within 1e-5 in float32."""
    model = _model(torch.float32)
    mixer = _mixer(model)
    x = torch.randn(2, 11, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = mixer(x)
        got = each_alone(mixer, x, torch.zeros(2, 11, dtype=torch.int64), **_reference(mixer))
    for (b, _, _), out in got.items():
        close(out[0], want[b], 1e-5)


def _grads_match(mixer, got, want, tol: float) -> None:
    """Gradients of the rows then of each parameter: ``rtol`` = ``atol`` = ``tol``; a float32
    parameter of a float64 model (Zamba builds ``A_log`` in float32 whatever the model's
    dtype: its gradient is rounded to float32, the reference's once per document) within 1e-6
    of its largest."""
    names = ["x"] + [n for n, _ in mixer.named_parameters()]
    for name, g, w in zip(names, got, want, strict=True):
        if w.dtype == torch.float32:
            close(g, w, 1e-6)
            continue
        torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_one_pass_is_each_document_alone_float64(layout):
    """Outputs to 1e-10; gradients of a random projection, w.r.t. the rows and every parameter,
    to 1e-8; padding gives zeros."""
    model = _model()
    mixer = _mixer(model)
    doc_ids = layout_ids(LAYOUTS[layout], S)
    plan = DocumentPlan.from_doc_ids(doc_ids)
    x, weights = inputs(model, doc_ids, torch.float64)
    params = list(mixer.parameters())

    packed = x.clone().requires_grad_()
    out = ssm.zamba_mamba_one_pass(mixer, packed, plan)
    got = torch.autograd.grad((out * weights).sum(), [packed, *params])

    rows = x.clone().requires_grad_()
    alone = each_alone(mixer, rows, doc_ids, **_reference(mixer))
    loss = sum((o[0] * weights[b, a:e]).sum() for (b, a, e), o in alone.items())
    want = torch.autograd.grad(loss, [rows, *params])

    assert out.dtype == torch.float64
    for (b, a, e), o in alone.items():
        torch.testing.assert_close(out[b, a:e], o[0], rtol=0, atol=1e-10)
    assert not out[doc_ids < 0].any()
    _grads_match(mixer, got, want, 1e-8)


def _through_adapt(rows, monkeypatch, dtype=torch.float32, autocast: bool = False):
    """The mixer adapted, on ``rows``' layout: (calls, out, alone); float32 rows also check the
    gradients, to 1e-5 of the largest."""
    model = _model(dtype)
    mixer = _mixer(model)
    doc_ids = layout_ids(rows, S)
    x, weights = inputs(model, doc_ids, dtype)
    params = list(mixer.parameters())
    ctx = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16, enabled=autocast)
    ref = x.clone().requires_grad_()
    with ctx():
        alone = each_alone(mixer, ref, doc_ids)
    loss = sum((o[0].float() * weights[b, a:e]).sum() for (b, a, e), o in alone.items())
    want = torch.autograd.grad(loss, [ref, *params])

    fm.adapt(model)
    try:
        assert dict(fm.mixers_of(model))["model.layers.0.mamba"] == "mamba"
        with torch.no_grad():
            mixer(x, doc_ids=doc_ids, attention_mask=None)  # the class's self-check runs once
        assert ssm.MAMBA.one_pass.verified[type(mixer)]
        calls = count(monkeypatch, ssm.MAMBA)
        packed = x.clone().requires_grad_()
        with ctx():
            out = mixer(packed, doc_ids=doc_ids, attention_mask=None)
        got = torch.autograd.grad((out.float() * weights).sum(), [packed, *params])
    finally:
        fm.restore(model)
    assert not out[doc_ids < 0].any()
    if dtype == torch.float32 and not autocast:
        for (b, a, e), o in alone.items():
            close(out[b, a:e], o[0], 1e-5)
        for g, w in zip(got, want, strict=True):
            close(g, w, 1e-5)
    return calls, out, alone


def test_adapted_mixer_runs_the_one_pass_float32(monkeypatch):
    """Through flexpack.mixers.adapt: the one pass ran (and no per-group call), each document
    within 1e-5 of the plain module alone, gradients too."""
    calls, _, _ = _through_adapt(LAYOUTS["mixed"], monkeypatch)
    assert calls == {"one_pass": 1, "split": 0}


def test_padding_only_row_and_one_token_documents(monkeypatch):
    """A row of padding beside rows of 1-token documents (each its own state, every tap but
    its own masked): the one pass, exact, zeros on the padding."""
    calls, _, _ = _through_adapt([[1, 1, 1], [], [1, 5, 1]], monkeypatch)
    assert calls == {"one_pass": 1, "split": 0}


@pytest.mark.parametrize("case", ["bf16 autocast", "bf16 weights"])
def test_bf16_keeps_the_plain_modules_dtype(case, monkeypatch):
    """bf16 autocast over float32 weights (how trainers run) and a bf16 module: the one pass
    runs, returns the plain module's dtype and each document's values to bf16's rounding
    (3e-2 of the largest: under autocast the module runs its conv in bf16 and rounds its
    scan's state to bf16 before C, the one pass rounds the conv's and the scan's outputs;
    each is about 1e-2 from the float32 module)."""
    autocast = case == "bf16 autocast"
    dtype = torch.float32 if autocast else torch.bfloat16
    calls, out, alone = _through_adapt(LAYOUTS["mixed"], monkeypatch, dtype, autocast)
    assert calls == {"one_pass": 1, "split": 0}
    for (b, a, e), o in alone.items():
        assert out.dtype == o.dtype == torch.bfloat16
        close(out[b, a:e].float(), o[0].float(), 3e-2)


def test_float64_rows_and_a_padding_mask_keep_the_per_group_calls(monkeypatch):
    """float64 rows (the module's scan rounds them to float32: the per-group calls give its exact
    numbers) and a padding mask leave the one pass out."""
    model = _model()
    mixer = _mixer(model)
    doc_ids = layout_ids(LAYOUTS["mixed"], S)
    x, _ = inputs(model, doc_ids, torch.float64)
    plan = DocumentPlan.from_doc_ids(doc_ids)
    assert ssm.MAMBA.one_pass(mixer, None, x, plan, {}) is None
    assert (
        ssm.MAMBA.one_pass(mixer, None, x.float(), plan, {"attention_mask": doc_ids >= 0}) is None
    )
    fm.adapt(model)
    try:
        calls = count(monkeypatch, ssm.MAMBA)
        with torch.no_grad():
            out = mixer(x, doc_ids=doc_ids, attention_mask=None)
    finally:
        fm.restore(model)
    assert calls["one_pass"] == 0 and calls["split"] > 0
    with torch.no_grad():
        for (b, a, e), o in each_alone(mixer, x, doc_ids).items():
            torch.testing.assert_close(out[b, a:e], o[0], rtol=0, atol=1e-10)


def test_structures_and_a_mixer_built_otherwise_fails_closed():
    """Zamba's structure is its own (``_zamba_parts``), not Mamba's, and Mamba's is not
    Zamba's; a subclass whose forward is not the one pass's (here: the output doubled) fails
    its self-check and keeps the per-group calls."""
    model = _model(torch.float32)
    mixer = _mixer(model)
    assert ssm._zamba_parts(mixer) and not ssm._mamba_parts(mixer)
    mamba = transformers.MambaForCausalLM(tiny_config(transformers.MambaConfig()))
    assert not ssm._zamba_parts(mamba.backbone.layers[0].mixer)
    plain = type(mixer)

    class Doubled(plain):
        def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
            return 2 * plain.forward(self, hidden_states, cache, attention_mask, **kwargs)

    mixer.__class__ = Doubled
    doc_ids = layout_ids(LAYOUTS["mixed"], S)
    x, _ = inputs(model, doc_ids, torch.float32)
    own = Doubled.forward.__get__(mixer)
    assert ssm.MAMBA.one_pass(mixer, own, x, DocumentPlan.from_doc_ids(doc_ids), {}) is None
    assert ssm.MAMBA.one_pass.verified[Doubled] is False


@st.composite
def _layouts(draw):
    """(doc_ids (B, S), chunk): rows of random documents (1 to S tokens) and right padding."""
    length = draw(st.integers(1, 14))
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        lengths, room = [], draw(st.integers(0, length))
        while room:
            n = draw(st.integers(1, room))
            lengths.append(n)
            room -= n
        rows.append(lengths)
    return layout_ids(rows, length), draw(st.integers(1, 6))


@functools.cache
def _property_mixer():
    model = _model()
    return model, _mixer(model)


@settings(max_examples=12, deadline=None)
@given(case=_layouts())
def test_property_random_layouts_float64(case):
    doc_ids, chunk = case
    model, mixer = _property_mixer()
    x, _ = inputs(model, doc_ids, torch.float64)
    with torch.no_grad():
        plan = DocumentPlan.from_doc_ids(doc_ids)
        out = ssm.zamba_mamba_one_pass(mixer, x, plan, chunk=chunk)
        alone = each_alone(mixer, x, doc_ids, **_reference(mixer))
    for (b, a, e), o in alone.items():
        torch.testing.assert_close(out[b, a:e], o[0], rtol=0, atol=1e-10)
    assert not out[doc_ids < 0].any()
    assert math.isfinite(out.abs().sum().item())


# ----------------------------------------------------------------------------- prefix trees


def _forest(forest) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """(B, S) segment ids, (B, M) parents and the flat token positions of every path."""
    B, M = len(forest), max(1, max(len(lengths) for lengths, _ in forest))
    seg = torch.full((B, S), -1, dtype=torch.int64)
    parents = torch.full((B, M), -1, dtype=torch.int64)
    paths = []
    for b, (lengths, par) in enumerate(forest):
        spans, at = [], 0
        for j, n in enumerate(lengths):
            seg[b, at : at + n] = j
            spans.append(range(b * S + at, b * S + at + n))
            at += n
        parents[b, : len(par)] = torch.tensor(par, dtype=torch.int64)
        for leaf in set(range(len(lengths))) - set(par):
            chain = [leaf]
            while par[chain[-1]] >= 0:
                chain.append(par[chain[-1]])
            paths.append([t for j in reversed(chain) for t in spans[j]])
    return seg, parents, paths


def _each_path(run, x: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
    """(B, S, H): every token's output from the first path that holds it, each path through
    ``run`` ((1, L, H) -> (1, L, H)) alone; zeros on padding."""
    B, _, H = x.shape
    flat = x.reshape(B * S, H)
    want = torch.zeros(B * S, H, dtype=x.dtype)
    taken = torch.zeros(B * S, dtype=torch.bool)
    for path in paths:
        out = run(flat[path][None])[0]
        new = ~taken[path]
        index = torch.tensor(path)[new]
        want = want.index_copy(0, index, out[new])
        taken[index] = True
    return want.view(B, S, H)


@pytest.mark.parametrize("forest", sorted(FORESTS))
def test_tree_rows_equal_each_path_alone_float64(forest, monkeypatch):
    """float64, 1e-10: the one pass over tree rows gives each token what its root-to-leaf path
    alone gives (the plain module, its scan the float64 recurrence), outputs and gradients of
    the rows and every parameter (1e-8); its forked form ran, never each path."""
    model = _model()
    mixer = _mixer(model)
    seg, parents, paths = _forest(FORESTS[forest])
    plan = TreePlan.from_parents(seg, parents)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*seg.shape, model.config.hidden_size, generator=g, dtype=torch.float64)
    w = torch.randn(x.shape, generator=g, dtype=torch.float64)
    params = list(mixer.parameters())
    monkeypatch.setattr(TreePlan, "expand", lambda *a, **k: pytest.fail("ran each path"))

    xt = x.clone().requires_grad_()
    got = ssm.zamba_mamba_one_pass(mixer, xt, plan)
    mine = torch.autograd.grad((got * w).sum(), [xt, *params])

    reference = _reference(mixer)
    xr = x.clone().requires_grad_()
    modeling = sys.modules[type(mixer).__module__]
    monkeypatch.setattr(modeling, reference["seam"], reference["scan"])
    want = _each_path(mixer, xr, paths)
    theirs = torch.autograd.grad((want * w).sum(), [xr, *params])

    real = seg >= 0
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-10)
    assert not got[~real].any()
    _grads_match(mixer, mine, theirs, 1e-8)


@pytest.mark.parametrize("forest", sorted(FORESTS))
def test_tree_rows_through_adapt_equal_each_path_alone_float32(forest):
    """The adapted mixer on tree rows (the tree mask in the call's sources), float32: outputs
    within 1e-5 of the largest of each root-to-leaf path through the plain module, gradients
    of the rows and every parameter within 1e-4 (sums of more roundings); padding gives zeros."""
    model = _model(torch.float32)
    mixer = _mixer(model)
    own = type(mixer).forward.__get__(mixer)
    seg, parents, paths = _forest(FORESTS[forest])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*seg.shape, model.config.hidden_size, generator=g)
    w = torch.randn(x.shape, generator=g)
    params = list(mixer.parameters())

    fm.adapt(model)
    try:
        fm.set_sources(model, flexpack_mask=masks.tree(seg, parents))
        xt = x.clone().requires_grad_()
        got = mixer(xt)
    finally:
        fm.restore(model)
    mine = torch.autograd.grad((got * w).sum(), [xt, *params])
    xr = x.clone().requires_grad_()
    want = _each_path(own, xr, paths)
    theirs = torch.autograd.grad((want * w).sum(), [xr, *params])

    real = seg >= 0
    close(got[real], want[real], 1e-5)
    assert not got[~real].any()
    for a, b in zip(mine, theirs, strict=True):
        close(a, b, 1e-4)


# ----------------------------------------------------------------------------- a whole model


def _no_split(*_args, **_kwargs):
    raise AssertionError("the per-group path ran")


def test_a_packed_model_equals_each_document_alone_then_generates_as_a_fresh_one(monkeypatch):
    """A whole tiny ZambaForCausalLM (flexpack's attention) through ``packed_forward_kwargs(
    batch, model=model)``: its four Mamba mixers in one pass (the per-group split never runs),
    logits within 1e-5 of the largest of each document alone through a fresh model (the same
    weights, eager attention, never adapted), gradients of every weight within 1e-4; then
    ``generate()`` on the same model (a cache: the mixers' own forward), left-padded prompts
    included, gives the fresh model's tokens and logits."""
    model = _model(torch.float32, register())
    fresh = _model(torch.float32)
    fresh.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 128, (n,), generator=g) for n in (11, 1, 14, 9, 5, 7)]
    batch = flexpack.pack_sequences(docs, S)
    kwargs = packed_forward_kwargs(batch, model=model)
    with torch.no_grad():
        model(**kwargs)  # adapted, and the mixer class's self-check runs once
    mixers = [p for p, room in fm.mixers_of(model) if room == "mamba"]
    assert len(mixers) == 4 and all(fm.is_adapted(model.get_submodule(p)) for p in mixers)
    assert ssm.MAMBA.one_pass.verified[type(model.model.layers[0].mamba)] is True
    calls = count(monkeypatch, ssm.MAMBA)
    monkeypatch.setattr(DocumentPlan, "split", _no_split)
    logits = model(**kwargs).logits  # (R, S, V)
    assert calls["one_pass"] == 4
    monkeypatch.undo()

    w = torch.randn(logits.shape, generator=g) * (batch.doc_ids >= 0)[..., None]  # no padding
    loss, want = (logits * w).sum(), 0.0
    for b, a, e in documents(batch.doc_ids):
        alone = fresh(input_ids=batch.input_ids[b : b + 1, a:e], use_cache=False).logits[0]
        close(logits[b, a:e], alone, 1e-5)
        want = want + (alone * w[b, a:e]).sum()
    loss.backward()
    want.backward()
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        if p.grad is None and q.grad is None:
            continue
        assert p.grad is not None and q.grad is not None, name
        close(p.grad, q.grad, 1e-4)

    prompts = torch.randint(3, 128, (2, 6), generator=g)
    mask = torch.ones_like(prompts)
    prompts[1, :2], mask[1, :2] = 0, 0  # left padding
    settings = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                    return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            got = model.generate(prompts, **settings)
            want = fresh.generate(prompts, **settings)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
