"""Inkling2's dynamic short convolution in one pass over packed rows and prefix trees
(flexpack.mixers.dynamic_conv.dynamic_conv_one_pass).

References: each document (each root-to-leaf path of a tree) run alone through the plain
module, its ``dynamic_input`` cut the same way. The module rounds its input, its taps and its
arithmetic to float32 whatever its dtype, and the one pass repeats those roundings and the
module's order of operations, so in float64 the outputs agree to 1e-10 (in fact bit for bit);
in float32 the projection of the dynamic taps over rows of another shape may round differently
(1e-5). Gradients run through the module's float32 casts and sum the taps in another order:
1e-5 of the largest. A whole tiny Inkling2 (both model types) packed against each document
alone, then ``generate()`` on it against a fresh model's.
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
modeling = pytest.importorskip("transformers.models.inkling2.modeling_inkling2")

from _onepass import close, count  # noqa: E402
from _rows import documents, layout_ids  # noqa: E402

import flexpack  # noqa: E402
import flexpack.mixers as fm  # noqa: E402
from flexpack import masks  # noqa: E402
from flexpack.integrations._tiny import tiny_config  # noqa: E402
from flexpack.integrations.transformers import packed_forward_kwargs, register  # noqa: E402
from flexpack.mixers import dynamic_conv  # noqa: E402
from flexpack.mixers._plan import DocumentPlan  # noqa: E402
from flexpack.mixers._tree import TreePlan  # noqa: E402

ROOM = dynamic_conv.DYNAMIC_SHORT_CONV
S, C, D, HEADS, K = 24, 8, 6, 2, 4
# documents of one token, shorter than the window, longer; a padding-only row
LAYOUTS = {
    "mixed": [[1, 6, 2, 9, 1], [4, 4, 8, 3], [], [1, 1, 1, 1, 1, 14]],
    "one per row": [[13], [24]],
}
# per row: (segment lengths, parents), padded to S (see tests/test_mixers_onepass_zamba.py)
FORESTS = {
    "grpo": [([7, 5, 1, 6], [-1, 0, 0, 0]), ([3, 9, 2], [-1, 0, 0])],
    "multi-level": [([6, 4, 3, 5, 2, 1], [-1, 0, 1, 1, 0, -1])],
    "short parents": [([3, 1, 2, 2, 1, 4], [-1, 0, 1, 1, 0, 4])],
    "documents and padding": [([11, 13], [-1, -1]), ([], [])],
}


def _conv(dtype=torch.float32) -> torch.nn.Module:
    """A plain Inkling2DynamicShortConvolution with random static taps (they start at 0)."""
    torch.manual_seed(0)
    conv = modeling.Inkling2DynamicShortConvolution(C, D, HEADS, K, layer_idx=0, conv_idx=0)
    with torch.no_grad():
        conv.static_weight.normal_()
    return conv.to(dtype)


def _rows(shape, dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, C, generator=g, dtype=dtype)
    d = torch.randn(*shape, D, generator=g, dtype=dtype)
    w = torch.randn(*shape, C, generator=g, dtype=dtype)  # a scalar loss's weights
    return x, d, w


def _alone(conv, x, d, doc_ids, conv_mask=None) -> torch.Tensor:
    """(B, S, C): each document through the plain module; zeros on padding."""
    want = torch.zeros(x.shape, dtype=x.dtype)
    for b, a, e in documents(doc_ids):
        mask = None if conv_mask is None else conv_mask[b : b + 1, a:e]
        want[b, a:e] = conv(x[b : b + 1, a:e], d[b : b + 1, a:e], conv_mask=mask)[0]
    return want


def _grads(out, w, inputs) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad((out * w).sum(), inputs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_one_pass_is_each_document_alone(layout, dtype):
    """The room's one pass on whole rows: each document's output as the plain module gives it
    alone (float64: 1e-10; float32: 1e-5 of the largest), zeros on padding, the class's
    self-check passed; gradients of the rows, the dynamic input and both weights within 1e-5
    of the largest."""
    conv = _conv(dtype)
    own = type(conv).forward.__get__(conv)
    ids = layout_ids(LAYOUTS[layout], S)
    plan = DocumentPlan.from_doc_ids(ids)
    x, d, w = _rows(ids.shape, dtype)
    params = list(conv.parameters())

    xt, dt = x.clone().requires_grad_(), d.clone().requires_grad_()
    got = ROOM.one_pass(conv, own, xt, plan, {"dynamic_input": dt})
    assert got is not None and got.dtype == dtype
    assert ROOM.one_pass.verified[type(conv)] is True
    mine = _grads(got, w, [xt, dt, *params])
    xr, dr = x.clone().requires_grad_(), d.clone().requires_grad_()
    want = _alone(conv, xr, dr, ids)
    theirs = _grads(want, w, [xr, dr, *params])

    real = ids >= 0
    if dtype == torch.float64:
        torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-10)
    else:
        close(got[real], want[real], 1e-5)
    assert not got[~real].any()
    for a, b in zip(mine, theirs, strict=True):
        close(a, b, 1e-5)


def test_adapted_module_runs_the_one_pass_and_a_conv_mask_the_per_group_calls(monkeypatch):
    """The adapted module with the rows' ``doc_ids``: the one pass ran, no per-group split.
    With a ``conv_mask`` the per-group calls run instead, ``dynamic_input`` and the mask cut
    like the rows: still each document alone. With a cache (decoding) its own forward runs."""
    conv = _conv()
    ids = layout_ids(LAYOUTS["mixed"], S)
    x, d, _ = _rows(ids.shape, torch.float32)
    fm.adapt(conv)
    try:
        assert fm.mixers_of(conv) == [("", "dynamic_short_conv")] and fm.is_adapted(conv)
        conv(x, d, doc_ids=ids)  # the class's self-check runs once (its own per-group calls)
        calls = count(monkeypatch, ROOM)
        got = conv(x, d, doc_ids=ids)
        assert calls == {"one_pass": 1, "split": 0}

        conv_mask = torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)) > 0.3
        masked = conv(x, d, conv_mask=conv_mask.long(), doc_ids=ids)
        assert calls["one_pass"] == 1 and calls["split"] > 0
    finally:
        monkeypatch.undo()
        fm.restore(conv)
    real = ids >= 0
    close(got[real], _alone(conv, x, d, ids)[real], 1e-5)
    close(masked[real], _alone(conv, x, d, ids, conv_mask.long())[real], 1e-5)
    assert not got[~real].any() and not masked[~real].any()


def test_a_class_that_computes_otherwise_keeps_the_per_group_calls():
    """A subclass whose forward differs (another output scale) fails the self-check: the hook
    gives None (the per-group calls run, exact through the module's own forward)."""

    class Scaled(modeling.Inkling2DynamicShortConvolution):
        def forward(self, hidden_states, dynamic_input, **kwargs):
            return 2 * super().forward(hidden_states, dynamic_input, **kwargs)

    conv = Scaled(C, D, HEADS, K, layer_idx=0, conv_idx=0)
    own = type(conv).forward.__get__(conv)
    ids = layout_ids(LAYOUTS["mixed"], S)
    x, d, _ = _rows(ids.shape, torch.float32)
    plan = DocumentPlan.from_doc_ids(ids)
    assert ROOM.one_pass(conv, own, x, plan, {"dynamic_input": d}) is None
    assert ROOM.one_pass.verified[Scaled] is False
    fm.adapt(conv)
    try:
        got = conv(x, d, doc_ids=ids)
    finally:
        fm.restore(conv)
    close(got[ids >= 0], _alone(conv, x, d, ids)[ids >= 0], 1e-5)
    # and a module without its dynamic input, or of another width, is not this one pass's
    assert ROOM.one_pass(_conv(), own, x, plan, {}) is None
    assert ROOM.one_pass(_conv(), own, x[..., :4], plan, {"dynamic_input": d}) is None


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


def _each_path(conv, x, d, paths) -> torch.Tensor:
    """(B, S, C): every token's output from the first path that holds it, each path through
    the plain module alone (its dynamic input gathered along the same path); zeros on padding."""
    B = x.shape[0]
    flat, flat_d = x.reshape(B * S, C), d.reshape(B * S, D)
    want = torch.zeros(B * S, C, dtype=x.dtype)
    taken = torch.zeros(B * S, dtype=torch.bool)
    for path in paths:
        out = conv(flat[path][None], flat_d[path][None])[0]
        new = ~taken[path]
        index = torch.tensor(path)[new]
        want = want.index_copy(0, index, out[new])
        taken[index] = True
    return want.view(B, S, C)


@pytest.mark.parametrize("forest", sorted(FORESTS))
def test_tree_rows_equal_each_path_alone_float64(forest):
    """float64, 1e-10: the one pass over tree rows gives each token what its root-to-leaf path
    alone gives; gradients of the rows, the dynamic input and both weights within 1e-5."""
    conv = _conv(torch.float64)
    own = type(conv).forward.__get__(conv)
    seg, parents, paths = _forest(FORESTS[forest])
    plan = TreePlan.from_parents(seg, parents)
    x, d, w = _rows(seg.shape, torch.float64)
    params = list(conv.parameters())

    xt, dt = x.clone().requires_grad_(), d.clone().requires_grad_()
    got = ROOM.one_pass(conv, own, xt, plan, {"dynamic_input": dt})
    mine = _grads(got, w, [xt, dt, *params])
    xr, dr = x.clone().requires_grad_(), d.clone().requires_grad_()
    want = _each_path(conv, xr, dr, paths)
    theirs = _grads(want, w, [xr, dr, *params])

    real = seg >= 0
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-10)
    assert not got[~real].any()
    for a, b in zip(mine, theirs, strict=True):
        close(a, b, 1e-5)


def test_tree_rows_through_adapt_float32():
    """The adapted module on tree rows (the tree mask in its call): each path alone, 1e-5."""
    conv = _conv()
    seg, parents, paths = _forest(FORESTS["short parents"])
    x, d, _ = _rows(seg.shape, torch.float32)
    fm.adapt(conv)
    try:
        got = conv(x, d, flexpack_mask=masks.tree(seg, parents))
    finally:
        fm.restore(conv)
    close(got[seg >= 0], _each_path(conv, x, d, paths)[seg >= 0], 1e-5)


# ----------------------------------------------------------------------------- a whole model


def _model(model_type: str, attn_implementation: str = "eager"):
    config = tiny_config(transformers.AutoConfig.for_model(model_type), attn_implementation)
    # tiny_config leaves the LM head at the checkpoint's 200058 tokens (unpadded_vocab_size),
    # beyond the 128 embeddings: generate() would pick tokens the model cannot embed
    config.unpadded_vocab_size = config.vocab_size
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _document_masks(doc_ids: torch.Tensor) -> dict:
    """Inkling2's mask mapping (its forward takes the dict as is): document-causal additive
    (B, 1, S, S) masks for both attention kinds (documents shorter than the sliding window),
    no conv mask. A padding token sees itself only."""
    _, S_ = doc_ids.shape
    same = (doc_ids[:, :, None] == doc_ids[:, None, :]) & (doc_ids[:, :, None] >= 0)
    allowed = (same & torch.ones(S_, S_, dtype=torch.bool).tril()) | torch.eye(S_, dtype=torch.bool)
    bias = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    bias = bias[:, None]
    return {"full_attention": bias, "sliding_attention": bias, "linear_attention": None}


@pytest.mark.parametrize("model_type", ["inkling2_text", "inkling2_loop_text"])
def test_a_packed_model_equals_each_document_alone_then_generates_as_a_fresh_one(
    model_type, monkeypatch
):
    """A whole tiny Inkling2 on packed rows, its mixers adapted (flexpack.mixers.adapt): the
    dynamic convs in one pass, the static ones per group; attention kept to each document by a
    document-causal mask through the model's own mask-mapping seam (flexpack's attention
    refuses the model's hidden-state-conditioned ``position_bias``: see the last assertion).
    Logits within 1e-5 of the largest of each document alone through a fresh model (the same
    weights, never adapted), gradients of every weight within 5e-4 (inkling2_text: 1.4e-4
    seen, all from the 1-token document, the same with the module's own forward per document
    in place of the one pass; rows without a 1-token document agree within 2e-5), then
    ``generate()`` on the
    same model (a cache: the mixers' own forward), left-padded prompts included, gives the
    fresh model's tokens and logits."""
    model, fresh = _model(model_type), _model(model_type)
    fresh.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 128, (n,), generator=g) for n in (11, 1, 14, 9, 5, 7)]
    batch = flexpack.pack_sequences(docs, S)
    kwargs = dict(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False,
                  attention_mask=_document_masks(batch.doc_ids))  # fmt: skip
    fm.adapt(model)
    dynamic = [p for p, room in fm.mixers_of(model) if room == "dynamic_short_conv"]
    assert dynamic and all(fm.is_adapted(model.get_submodule(p)) for p in dynamic)
    with torch.no_grad():
        model(**kwargs)  # the class's self-check runs once
    assert ROOM.one_pass.verified[type(model.get_submodule(dynamic[0]))] is True
    calls = count(monkeypatch, ROOM)
    logits = model(**kwargs).logits  # (R, S, V)
    assert calls["one_pass"] >= len(dynamic)
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
        close(p.grad, q.grad, 5e-4)

    prompts = torch.randint(3, 128, (2, 6), generator=g)
    mask = torch.ones_like(prompts)
    prompts[1, :2], mask[1, :2] = 0, 0  # left padding
    settings = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                    return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            got = model.generate(prompts, **settings)
            expected = fresh.generate(prompts, **settings)
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)

    # Through packed_forward_kwargs the mixers are no longer what is refused; the attention is
    with_flexpack = _model(model_type, register())
    with pytest.raises(ValueError, match="position_bias") as refused:
        with torch.no_grad():
            with_flexpack(**packed_forward_kwargs(batch, model=with_flexpack))
    assert "short_conv" not in str(refused.value)
