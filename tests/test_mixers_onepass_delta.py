"""The gated delta rule in one pass over packed rows (flexpack.mixers.delta).

References: each document run alone through the plain module (float64 to 1e-10, float32 to
1e-5), gradients included; transformers' own ``torch_chunk_gated_delta_rule`` for the chunked
rule on one document per row; and the one pass must be what ran (not the per-group calls).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flexpack.mixers as fm  # noqa: E402
from flexpack.mixers import delta  # noqa: E402
from flexpack.mixers._plan import DocumentPlan  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _onepass import close  # noqa: E402
from _rows import documents, layout_ids  # noqa: E402
from test_mixers import _model  # noqa: E402

# documents longer than a chunk (64), starting mid-chunk, of one token; a padding-only row
LAYOUTS = {
    "mixed": [[70, 1, 40, 17], [3, 100, 2], []],
    "one per row": [[130], [64]],
}


def _mixer(dtype):
    model = _model("gated_delta_rule", dtype=dtype)
    return model.model.layers[0].linear_attn


def _recurrence(q, k, v, g, beta):
    """The gated delta rule token by token (its definition, float64): one document."""
    Hk, Hv = k.shape[-2], v.shape[-2]
    q, k = (t.repeat_interleave(Hv // Hk, dim=-2) for t in (q, k))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    state = q.new_zeros(Hv, k.shape[-1], v.shape[-1])
    out = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        delta_ = (v[t] - (state * k[t][..., None]).sum(-2)) * beta[t][:, None]
        state = state + k[t][..., None] * delta_[:, None, :]
        out.append((state * q[t][..., None]).sum(-2))
    return torch.stack(out)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_rule_on_packed_rows_equals_the_recurrence_per_document(layout):
    """float64, 1e-10: each document's outputs and gradients are its own recurrence's."""
    doc_ids = layout_ids(LAYOUTS[layout], 140)
    plan = DocumentPlan.from_doc_ids(doc_ids)
    g = torch.Generator().manual_seed(0)
    B, S = doc_ids.shape
    f64 = dict(generator=g, dtype=torch.float64)
    q, k = (torch.randn(B, S, 2, 8, **f64).requires_grad_(True) for _ in range(2))
    v = torch.randn(B, S, 4, 8, **f64).requires_grad_(True)
    decay = (-torch.rand(B, S, 4, **f64) * 2).requires_grad_(True)
    beta = torch.rand(B, S, 4, **f64).requires_grad_(True)
    inputs = [q, k, v, decay, beta]
    probe = torch.randn(B, S, 4, 8, **f64)
    out = delta.segment_chunk_gated_delta_rule(q, k, v, decay, beta, plan.seq_idx.view(B, S))
    got = torch.autograd.grad((out * probe)[doc_ids >= 0].sum(), inputs)
    want = [torch.zeros_like(t) for t in inputs]
    for b, a, e in documents(doc_ids):
        pieces = [t.detach()[b, a:e].requires_grad_(True) for t in inputs]
        alone = _recurrence(*pieces)
        torch.testing.assert_close(out[b, a:e], alone, rtol=0, atol=1e-10)
        grads = torch.autograd.grad((alone * probe[b, a:e]).sum(), pieces)
        for w, gr in zip(want, grads, strict=True):
            w[b, a:e] = gr
    for name, a, b in zip("q k v g beta".split(), got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=name)


def _other_mixer(family: str) -> torch.nn.Module:
    """Layer 0's GatedDeltaNet of a tiny Qwen3-Next (fused qkvz / ba projections) or OLMo
    hybrid (separate q, k, v, a, b, g projections; beta doubled: allow_neg_eigval)."""
    from flexpack.integrations._tiny import tiny_config

    name, fields = {
        "qwen3_next": ("Qwen3NextConfig", {}),
        "olmo_hybrid": ("OlmoHybridConfig", {"linear_allow_neg_eigval": True}),
    }[family]
    config = tiny_config(getattr(transformers, name)())
    for key, value in fields.items():
        setattr(config, key, value)
    config.layer_types = ["linear_attention", *config.layer_types[1:]]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    (path, _), *_ = [(p, k) for p, k in fm.mixers_of(model) if k == "gated_delta_rule"]
    return model.get_submodule(path)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "olmo_hybrid"])
def test_the_mixer_in_one_pass_equals_each_document_alone_with_gradients(family):
    """The whole GatedDeltaNet (fp32) of each structure: outputs, input and parameter
    gradients equal each document run alone through the module's own forward (1e-5)."""
    if family == "qwen3_5":
        mixer = _model("gated_delta_rule").model.layers[0].linear_attn
    else:
        mixer = _other_mixer(family)
    assert delta._fits(mixer, torch.zeros(1, 1, mixer.hidden_size))
    doc_ids = layout_ids(LAYOUTS["mixed"], 140)
    plan = DocumentPlan.from_doc_ids(doc_ids)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*doc_ids.shape, mixer.hidden_size, generator=g).requires_grad_(True)
    probe = torch.randn(*doc_ids.shape, mixer.hidden_size, generator=g)
    out = delta.gated_delta_one_pass(mixer, x, plan)
    assert not out[doc_ids < 0].any()
    params = list(mixer.parameters())
    got = torch.autograd.grad((out * probe).sum(), [x, *params])
    want_x, want_p = torch.zeros_like(x), [torch.zeros_like(p) for p in params]
    for b, a, e in documents(doc_ids):
        piece = x.detach()[b : b + 1, a:e].requires_grad_(True)
        alone = mixer(piece)
        torch.testing.assert_close(out[b, a:e], alone[0], rtol=0, atol=1e-5)
        grads = torch.autograd.grad((alone * probe[b : b + 1, a:e]).sum(), [piece, *params])
        want_x[b, a:e] = grads[0][0]
        want_p = [w + gp for w, gp in zip(want_p, grads[1:], strict=True)]
    torch.testing.assert_close(got[0], want_x, rtol=0, atol=1e-5)
    # parameter gradients sum over every token (A_log, dt_bias: over 340 of them, in fp32 on
    # both sides, through differently chunked rules): to 1e-3 of their largest element
    for a, b in zip(got[1:], want_p, strict=True):
        close(a, b, 1e-3)


def test_one_document_per_row_equals_transformers_chunked_rule():
    """No boundary inside a row: the segment-aware rule is transformers' own (fp32)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    g = torch.Generator().manual_seed(1)
    B, S, Hk, Hv, D = 2, 150, 2, 4, 8
    q, k = (torch.randn(B, S, Hk, D, generator=g) for _ in range(2))
    v = torch.randn(B, S, Hv, D, generator=g)
    decay = -torch.rand(B, S, Hv, generator=g) * 3
    beta = torch.rand(B, S, Hv, generator=g)
    segments = torch.arange(B)[:, None].expand(B, S)
    ours = delta.segment_chunk_gated_delta_rule(q, k, v, decay, beta, segments)
    # transformers 5.17's rule takes q and k with the value heads already (the module repeats
    # them first); 5.25's repeats them itself
    q, k = (t.repeat_interleave(Hv // Hk, dim=2) for t in (q, k))
    theirs, _ = torch_chunk_gated_delta_rule(q, k, v, g=decay, beta=beta,
                                             use_qk_l2norm_in_kernel=True)  # fmt: skip
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_float32_model_takes_the_one_pass_and_equals_documents_alone(monkeypatch):
    """Through the adapted model (flexpack attention, doc_ids): the class passes the
    self-check, the per-group split never runs, and logits equal each document alone (1e-5)."""
    from flexpack.integrations.transformers import register

    model = fm.adapt(_model("gated_delta_rule", register()))
    reference = _model("gated_delta_rule")
    doc_ids = layout_ids([[70, 1, 40, 17], [3, 100, 2]], 140)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, doc_ids.shape, generator=g)
    with torch.no_grad():
        model(input_ids=ids[:, :20], doc_ids=doc_ids[:, :20], use_cache=False)  # self-check
        mixer = model.model.layers[0].linear_attn
        assert delta.GATED_DELTA_RULE.one_pass.verified[type(mixer)] is True
        monkeypatch.setattr(DocumentPlan, "split", _no_split)
        out = model(input_ids=ids, doc_ids=doc_ids, use_cache=False).logits
        for b, a, e in documents(doc_ids):
            want = reference(input_ids=ids[b : b + 1, a:e], use_cache=False).logits[0]
            torch.testing.assert_close(out[b, a:e], want, rtol=0, atol=1e-5)


def _no_split(*_args, **_kwargs):
    raise AssertionError("the per-group path ran")
