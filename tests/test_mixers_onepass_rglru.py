"""RecurrentGemma's recurrent block in one pass over packed rows (flexpack.mixers.rglru).

References: each document run alone through the plain block, from position 0. In float64 its
RG-LRU scan is replaced by the recurrence it defines, token by token, in float64
(:func:`_float64_rnn_scan`): the block's own ``_rnn_scan`` accumulates in float32 whatever its
inputs, so only that twin can hold the one pass to 1e-10 (and the twin is held to the block's
own scan in float32). In float32 the plain block itself, to 1e-5; gradients included; the one
pass must be what ran through the adapted block. Rows of 24 tokens: the scan's chunks are 5
tokens, so documents cross them and start inside them. The broader battery (random layouts,
checkpointing, caches, all-padding batches, trees, generate()) runs it as ``rg_lru`` in
tests/test_mixers.py's FAMILIES.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _onepass import close, count, inputs  # noqa: E402
from _rows import documents, layout_ids  # noqa: E402
from test_mixers import FAMILIES, _config  # noqa: E402

import flexpack  # noqa: E402
import flexpack.mixers as fm  # noqa: E402
from flexpack.mixers import rglru  # noqa: E402
from flexpack.mixers._plan import DocumentPlan  # noqa: E402

LAYOUTS = {
    "mixed": [[1, 6, 2, 9, 1], [4, 4, 8, 3], [], [1, 1, 1, 1, 1, 14]],
    "one per row": [[13], [24]],
}
S = 24


def _model(dtype=torch.float64):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_config("rg_lru"), dtype=dtype)
    return model.eval()


def _block(model) -> torch.nn.Module:
    block = model.get_submodule(f"model.layers.0.{FAMILIES['rg_lru'][2]}")
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # parameters away from their initial values
        for p in block.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return block


def _float64_rnn_scan(self, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype=None):
    """``RecurrentGemmaRglru._rnn_scan`` without a cache, as its definition: h_t = a_t h_{t-1} +
    x_t with a_t = 0 where ``reset``, token by token in the inputs' dtype (float64 here)."""
    assert recurrent_states is None
    a = recurrent_gate * ~reset
    state = torch.zeros_like(hidden_states[:, 0])
    out = []
    for t in range(hidden_states.shape[1]):
        state = a[:, t] * state + hidden_states[:, t]
        out.append(state)
    return torch.stack(out, 1), state


def _alone(block, x, doc_ids, *, float64_scan: bool) -> dict:
    """Each document through the plain block, from position 0: {(row, start, end): (1, n, H)}."""
    with pytest.MonkeyPatch.context() as patch:
        if float64_scan:
            patch.setattr(type(block.rg_lru), "_rnn_scan", _float64_rnn_scan)
        return {
            (b, a, e): block(x[b : b + 1, a:e], position_ids=torch.arange(e - a)[None],
                             attention_mask=None, use_cache=False)[0]
            for b, a, e in documents(doc_ids)
        }  # fmt: skip


def test_float64_twin_is_the_blocks_own_scan_float32():
    """The float64 reference's scan is what the block computes: within 1e-5 in float32."""
    model = _model(torch.float32)
    block = _block(model)
    x = torch.randn(2, 11, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    ids = torch.zeros(2, 11, dtype=torch.int64)
    with torch.no_grad():
        want = _alone(block, x, ids, float64_scan=False)
        got = _alone(block, x, ids, float64_scan=True)
    for key, out in got.items():
        close(out, want[key], 1e-5)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_one_pass_is_each_document_alone_float64(layout):
    """Outputs to 1e-10; gradients of a random projection, w.r.t. the rows and every parameter,
    to 1e-8; padding gives zeros."""
    model = _model()
    block = _block(model)
    doc_ids = layout_ids(LAYOUTS[layout], S)
    plan = DocumentPlan.from_doc_ids(doc_ids)
    x, weights = inputs(model, doc_ids, torch.float64)
    params = list(block.parameters())

    packed = x.clone().requires_grad_()
    out = rglru.rglru_one_pass(block, packed, plan, chunk=5)
    got = torch.autograd.grad((out * weights).sum(), [packed, *params], allow_unused=True)

    rows = x.clone().requires_grad_()
    alone = _alone(block, rows, doc_ids, float64_scan=True)
    loss = sum((o[0] * weights[b, a:e]).sum() for (b, a, e), o in alone.items())
    want = torch.autograd.grad(loss, [rows, *params], allow_unused=True)

    for (b, a, e), o in alone.items():
        torch.testing.assert_close(out[b, a:e], o[0], rtol=0, atol=1e-10)
    assert not out[doc_ids < 0].any()
    for name, g, w in zip(["x"] + [n for n, _ in block.named_parameters()], got, want, strict=True):
        if w is None:
            assert g is None or not g.any(), name
            continue
        torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-8, msg=lambda m, n=name: f"{n}: {m}")


def test_adapted_block_runs_the_one_pass_float32(monkeypatch):
    """Through flexpack.mixers.adapt: the one pass ran (no per-group call), each document within
    1e-5 of the plain block alone, gradients too."""
    model = _model(torch.float32)
    block = _block(model)
    doc_ids = layout_ids(LAYOUTS["mixed"], S)
    x, weights = inputs(model, doc_ids, torch.float32)
    params = list(block.parameters())
    ref = x.clone().requires_grad_()
    alone = _alone(block, ref, doc_ids, float64_scan=False)
    loss = sum((o[0] * weights[b, a:e]).sum() for (b, a, e), o in alone.items())
    want = torch.autograd.grad(loss, [ref, *params])

    positions = torch.arange(S).expand(len(doc_ids), -1)
    fm.adapt(model)
    try:
        assert dict(fm.mixers_of(model))["model.layers.0.temporal_block"] == "rg_lru"
        with torch.no_grad():  # the class's self-check runs once
            block(x, position_ids=positions, attention_mask=None, use_cache=False, doc_ids=doc_ids)
        assert rglru.RG_LRU.one_pass.verified[type(block)]
        calls = count(monkeypatch, rglru.RG_LRU)
        packed = x.clone().requires_grad_()
        out, _ = block(packed, position_ids=positions, attention_mask=None, use_cache=False,
                       doc_ids=doc_ids)  # fmt: skip
        got = torch.autograd.grad((out * weights).sum(), [packed, *params])
    finally:
        fm.restore(model)
    assert calls == {"one_pass": 1, "split": 0}
    for (b, a, e), o in alone.items():
        close(out[b, a:e], o[0], 1e-5)
    assert not out[doc_ids < 0].any()
    for g, w in zip(got, want, strict=True):
        close(g, w, 1e-5)


def test_a_block_built_otherwise_fails_closed():
    """A class whose forward is not the one pass's (here: the output doubled) fails its
    self-check and keeps the per-group calls."""
    model = _model(torch.float32)
    block = _block(model)
    plain = type(block)

    class Doubled(plain):
        def forward(self, *args, **kwargs):
            out, state = plain.forward(self, *args, **kwargs)
            return 2 * out, state

    block.__class__ = Doubled
    doc_ids = layout_ids(LAYOUTS["mixed"], S)
    x, _ = inputs(model, doc_ids, torch.float32)
    own = Doubled.forward.__get__(block)
    assert rglru.RG_LRU.one_pass(block, own, x, DocumentPlan.from_doc_ids(doc_ids), {}) is None
    assert rglru.RG_LRU.one_pass.verified[Doubled] is False


@functools.cache
def _docs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 64, (n,), generator=g) for n in (7, 11, 5, 9)]


def test_use_cache_is_the_blocks_cache_prompts_keep_it_packed_rows_warn():
    """RecurrentGemma keeps its cache in the block's attributes when ``use_cache`` is true (its
    default): packed rows with it warn and stay exact (the block runs without it); after them,
    ``generate()`` on the same model object gives a fresh model's tokens."""
    from flexpack.integrations.transformers import register

    model = _model(torch.float32)
    model.config._attn_implementation = register()
    reference = _model(torch.float32)
    batch = flexpack.pack_sequences(_docs(), max_len=20)
    with torch.no_grad():
        with pytest.warns(UserWarning, match="together with a cache"):
            out = model(input_ids=batch.input_ids, doc_ids=batch.doc_ids,
                        position_ids=batch.position_ids.long(), use_cache=True).logits  # fmt: skip
        for b, a, e in documents(batch.doc_ids):
            want = reference(input_ids=batch.input_ids[b : b + 1, a:e], use_cache=False).logits[0]
            torch.testing.assert_close(out[b, a:e], want, rtol=0, atol=1e-4)
    prompt = torch.stack([_docs()[0], _docs()[0].flip(0)])
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(model.generate(input_ids=prompt, **kw),
                           reference.generate(input_ids=prompt, **kw))  # fmt: skip
