"""The Mamba (1) mixer in one pass over packed rows (flexpack.mixers.ssm.mamba_one_pass): Mamba,
Jamba (dt, B, C norms with weights), Falcon-Mamba (weightless norms).

References: each document run alone through the plain module. In float64 its scan is replaced by
the recurrence it defines, token by token (:func:`_recurrent_scan_forward`): the module's own
``mamba_scan_forward`` rounds A, B and x of float64 rows to float32, so only that twin can hold
the one pass to 1e-10 (and the recurrence is held to the module's own scan in float32). In
float32 the plain module itself, to 1e-5; gradients included; and the one pass must be what ran
through the adapted module (not the per-group calls). Rows of 24 tokens: the scan's chunks are
5 tokens, so documents cross them and start inside them.
"""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from _onepass import close, count, each_alone, inputs  # noqa: E402
from _rows import layout_ids  # noqa: E402

import flexpack.mixers as fm  # noqa: E402
from flexpack.integrations._tiny import tiny_config  # noqa: E402
from flexpack.mixers import ssm  # noqa: E402
from flexpack.mixers._plan import DocumentPlan  # noqa: E402

# model type -> (config class, fields set on its tiny config): every Mamba (1) family of
# transformers 5.25 that mamba_one_pass takes (Zamba's multi-head mixer: test_mixers_onepass_zamba)
KINDS = {
    "mamba": ("MambaConfig", {}),
    "jamba": ("JambaConfig", {"mamba_dt_rank": 8}),
    "falcon_mamba": ("FalconMambaConfig", {}),
}

# documents longer than a chunk, starting mid-chunk, on a chunk's edge, of one token; padding
LAYOUTS = {
    "mixed": [[1, 6, 2, 9, 1], [4, 4, 8, 3], [], [1, 1, 1, 1, 1, 14]],
    "one per row": [[13], [24]],
}
S = 24


@functools.cache
def _config(kind: str):
    name, fields = KINDS[kind]
    config = tiny_config(getattr(transformers, name)())
    for key, value in fields.items():
        setattr(config, key, value)
    return config


def _model(kind: str, dtype=torch.float64):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_config(kind), dtype=dtype)
    return model.eval()


def _mixer(model) -> torch.nn.Module:
    found = [m for m in model.modules() if type(m).__name__.endswith("Mixer")]
    mixer = found[0]
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # parameters away from their initial values (D = 1, norms' 1...)
        for p in mixer.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return mixer


def _recurrent_scan_forward(module, hidden_states, time_step, B, C, gate, cache, **kwargs):
    """``mamba_scan_forward`` without a cache, as its definition: h_t = exp(A dt_t) h_{t-1} +
    dt_t B_t u_t, y_t = (C_t . h_t + D u_t) silu(gate_t), token by token in the inputs' dtype
    (float64 here). u, time step, gate: (batch, I, L); B, C: (batch, L, n)."""
    assert cache is None
    u = hidden_states
    batch, inner, length = u.shape
    dt = time_step + module.dt_proj.bias.to(u.dtype)[:, None]
    dt = torch.nn.functional.softplus(dt)
    A = -torch.exp(module.A_log.to(u.dtype))  # (I, n)
    state = u.new_zeros(batch, inner, A.shape[-1])
    ys = []
    for t in range(length):
        step = dt[:, :, t, None]  # (batch, I, 1)
        state = torch.exp(A * step) * state + step * B[:, t, None, :] * u[:, :, t, None]
        ys.append((state * C[:, t, None, :]).sum(-1) + module.D * u[:, :, t])
    return torch.stack(ys, -1) * torch.nn.functional.silu(gate)


# the plain module with its scan the float64 recurrence (what each_alone swaps in)
REFERENCE = dict(seam="mamba_scan_forward", scan=_recurrent_scan_forward)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_recurrence_is_the_modules_own_scan_float32(kind):
    """The float64 reference's scan is what the module computes: within 1e-5 in float32."""
    model = _model(kind, torch.float32)
    mixer = _mixer(model)
    x = torch.randn(2, 11, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = mixer(x)
        got = each_alone(mixer, x, torch.zeros(2, 11, dtype=torch.int64), **REFERENCE)
    for (b, _, _), out in got.items():
        close(out[0], want[b], 1e-5)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_one_pass_is_each_document_alone_float64(kind, layout):
    """Outputs to 1e-10; gradients of a random projection, w.r.t. the rows and every parameter,
    to 1e-8; padding gives zeros."""
    model = _model(kind)
    mixer = _mixer(model)
    doc_ids = layout_ids(LAYOUTS[layout], S)
    plan = DocumentPlan.from_doc_ids(doc_ids)
    x, weights = inputs(model, doc_ids, torch.float64)
    params = [p for p in mixer.parameters() if p.requires_grad]

    packed = x.clone().requires_grad_()
    out = ssm.mamba_one_pass(mixer, packed, plan)
    got = torch.autograd.grad((out * weights).sum(), [packed, *params], allow_unused=True)

    rows = x.clone().requires_grad_()
    alone = each_alone(mixer, rows, doc_ids, **REFERENCE)
    loss = sum((o[0] * weights[b, a:e]).sum() for (b, a, e), o in alone.items())
    want = torch.autograd.grad(loss, [rows, *params], allow_unused=True)

    for (b, a, e), o in alone.items():
        torch.testing.assert_close(out[b, a:e], o[0], rtol=0, atol=1e-10)
    assert not out[doc_ids < 0].any()
    for name, g, w in zip(["x"] + [n for n, p in mixer.named_parameters()], got, want, strict=True):
        if w is None:
            assert g is None or not g.any(), name
            continue
        torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-8, msg=lambda m, n=name: f"{n}: {m}")


def mixer_name(model, mixer) -> str:
    return next(name for name, m in model.named_modules() if m is mixer)


def _through_adapt(kind, rows, monkeypatch):
    """The float32 mixer adapted, on ``rows``' layout: (calls, out, got grads, alone, want)."""
    model = _model(kind, torch.float32)
    mixer = _mixer(model)
    doc_ids = layout_ids(rows, S)
    x, weights = inputs(model, doc_ids, torch.float32)
    params = [p for p in mixer.parameters() if p.requires_grad]
    ref = x.clone().requires_grad_()
    alone = each_alone(mixer, ref, doc_ids)
    loss = sum((o[0] * weights[b, a:e]).sum() for (b, a, e), o in alone.items())
    want = torch.autograd.grad(loss, [ref, *params])

    fm.adapt(model)
    try:
        assert dict(fm.mixers_of(model))[mixer_name(model, mixer)] == "mamba"
        with torch.no_grad():
            mixer(x, doc_ids=doc_ids, attention_mask=None)  # the class's self-check runs once
        assert ssm.MAMBA.one_pass.verified[type(mixer)]
        calls = count(monkeypatch, ssm.MAMBA)
        packed = x.clone().requires_grad_()
        out = mixer(packed, doc_ids=doc_ids, attention_mask=None)
        got = torch.autograd.grad((out * weights).sum(), [packed, *params])
    finally:
        fm.restore(model)
    for (b, a, e), o in alone.items():
        close(out[b, a:e], o[0], 1e-5)
    assert not out[doc_ids < 0].any()
    for g, w in zip(got, want, strict=True):
        close(g, w, 1e-5)
    return calls


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_adapted_mixer_runs_the_one_pass_float32(kind, monkeypatch):
    """Through flexpack.mixers.adapt: the one pass ran (and no per-group call), each document
    within 1e-5 of the plain module alone, gradients too."""
    calls = _through_adapt(kind, LAYOUTS["mixed"], monkeypatch)
    assert calls == {"one_pass": 1, "split": 0}


def test_padding_only_row_and_one_token_documents(monkeypatch):
    """A row of padding beside rows of 1-token documents (each its own state, every tap but
    its own masked): the one pass, exact, zeros on the padding."""
    calls = _through_adapt("mamba", [[1, 1, 1], [], [1, 5, 1]], monkeypatch)
    assert calls == {"one_pass": 1, "split": 0}


def test_float64_rows_and_a_padding_mask_keep_the_per_group_calls(monkeypatch):
    """float64 rows (the module's scan rounds them to float32: the per-group calls give its exact
    numbers) and a padding mask leave the one pass out."""
    model = _model("jamba", torch.float64)
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


def test_a_mixer_built_otherwise_fails_closed():
    """A class whose forward is not the one pass's (here: the output doubled) fails its
    self-check and keeps the per-group calls; Zamba's multi-head mixer is not Mamba's structure
    but its own (zamba_mamba_one_pass takes it)."""
    model = _model("mamba", torch.float32)
    mixer = _mixer(model)
    plain = type(mixer)

    class Doubled(plain):
        def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
            return 2 * plain.forward(self, hidden_states, cache, attention_mask, **kwargs)

    mixer.__class__ = Doubled
    doc_ids = layout_ids(LAYOUTS["mixed"], S)
    x, _ = inputs(model, doc_ids, torch.float32)
    plan = DocumentPlan.from_doc_ids(doc_ids)
    own = Doubled.forward.__get__(mixer)
    assert ssm.MAMBA.one_pass(mixer, own, x, plan, {}) is None
    assert ssm.MAMBA.one_pass.verified[Doubled] is False

    zamba = transformers.models.zamba.modeling_zamba.ZambaMambaMixer(
        tiny_config(transformers.ZambaConfig()), 0
    )
    assert not ssm._mamba_parts(zamba) and ssm._zamba_parts(zamba)


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
    model = _model("jamba")
    return model, _mixer(model)


@settings(max_examples=12, deadline=None)
@given(case=_layouts())
def test_property_random_layouts_float64(case):
    doc_ids, chunk = case
    model, mixer = _property_mixer()
    x, _ = inputs(model, doc_ids, torch.float64)
    with torch.no_grad():
        out = ssm.mamba_one_pass(mixer, x, DocumentPlan.from_doc_ids(doc_ids), chunk=chunk)
        alone = each_alone(mixer, x, doc_ids, **REFERENCE)
    for (b, a, e), o in alone.items():
        torch.testing.assert_close(out[b, a:e], o[0], rtol=0, atol=1e-10)
    assert not out[doc_ids < 0].any()
    assert math.isfinite(out.abs().sum().item())
