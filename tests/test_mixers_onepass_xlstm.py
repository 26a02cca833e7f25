"""xLSTM's mLSTM layer in one pass over packed rows (flexpack.mixers.xlstm).

References: the mLSTM cell token by token (its definition, float64) per document and per
root-to-leaf path of a prefix tree, to 1e-10, outputs and gradients; the layer's own forward per
document (float32, 1e-5); a whole tiny xLSTMForCausalLM packed against each document alone, and
its generate() after packed rows against a fresh model's.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import flexpack  # noqa: E402
import flexpack.mixers as fm  # noqa: E402
from flexpack import masks  # noqa: E402
from flexpack.integrations._tiny import tiny_config  # noqa: E402
from flexpack.mixers import xlstm  # noqa: E402
from flexpack.mixers._plan import DocumentPlan  # noqa: E402
from flexpack.mixers._tree import TreePlan  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rows import documents, layout_ids  # noqa: E402

# documents longer than a chunk (64), starting mid-chunk, of one token; a padding-only row
LAYOUTS = {
    "mixed": [[70, 1, 40, 17], [3, 100, 2], []],
    "one per row": [[130], [64]],
    "one-token documents": [[1, 1, 1, 1, 1], [1]],
}
S = 140


def _config(weight_mode="single", attn_implementation="eager"):
    """flexpack's tiny xLSTM config, q/k as wide as v (transformers' cache rounds the q/k width
    up to a multiple of 64 and the layer does not: at 32 of 64, generate() cannot run)."""
    xlstm_config = transformers.xLSTMConfig(qk_dim_factor=1.0, weight_mode=weight_mode)
    return tiny_config(xlstm_config, attn_implementation)


def _random_gates(model: torch.nn.Module) -> torch.nn.Module:
    """Input and forget gates that vary from token to token (the model's init gives them zero
    weights: constant gates), the same for every model built."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, m in model.named_modules():
            if name.endswith("gate_preact") and name.split(".")[-1] != "ogate_preact":
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.3)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 2)
    return model


def _model(dtype=torch.float32, attn_implementation="eager"):
    """A tiny xLSTMForCausalLM with varying gates, in eval mode."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.xLSTMForCausalLM(_config(attn_implementation=attn_implementation))
    return _random_gates(model).to(dtype).eval()


def _layer(dtype=torch.float32, weight_mode="single"):
    """One mLSTM layer with varying gates (built alone: transformers' init of a fused model
    fails on its gate biases)."""
    from transformers.models.xlstm.modeling_xlstm import xLSTMLayer

    torch.manual_seed(0)
    return _random_gates(xLSTMLayer(_config(weight_mode))).to(dtype)


def _cell(q, k, v, i, f, eps=1e-6):
    """The mLSTM cell token by token from C = 0, n = 0, m = 0 (transformers'
    ``mlstm_recurrent_step_native`` without its float32 state): one document, (L, H, ...)."""
    L, H, Dk = k.shape
    C = q.new_zeros(H, Dk, v.shape[-1])
    n, m = q.new_zeros(H, Dk), q.new_zeros(H)
    out = []
    for t in range(L):
        log_f = F.logsigmoid(f[t])
        m_new = torch.maximum(log_f + m, i[t])
        kept, new = (log_f + m - m_new).exp(), (i[t] - m_new).exp()
        C = kept[:, None, None] * C + new[:, None, None] * k[t][:, :, None] * v[t][:, None, :]
        n = kept[:, None] * n + new[:, None] * k[t]
        qs = q[t] * Dk**-0.5
        num = (qs[:, :, None] * C).sum(1)
        den = (qs * n).sum(-1)
        out.append(num / (torch.maximum(den.abs(), (-m_new).exp()) + eps)[:, None])
        m = m_new
    return torch.stack(out)


def _layer_alone(layer, x):
    """The mLSTM layer on one document (L, H) with the cell token by token: the layer's own
    projections, norm and output gate (per token), the recurrence written out."""
    config = layer.config
    cap, heads = config.gate_soft_cap, config.num_heads
    q, k, v = (p(x).view(x.shape[0], heads, -1) for p in (layer.q, layer.k, layer.v))
    i = cap * torch.tanh(layer.igate_preact(x) / cap)
    f = cap * torch.tanh(layer.fgate_preact(x) / cap)
    h = _cell(q, k, v, i, f, config.eps)
    h = layer.multihead_norm(h[None]).reshape(1, x.shape[0], -1)
    return layer.out_proj(layer.ogate_act_fn(layer.ogate_preact(x)) * h)[0]


def _grads(out, probe, tensors):
    return torch.autograd.grad((out * probe).sum(), tensors)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, name: str = "") -> None:
    """Within ``tol`` of the largest value (at least 1): the cell's gradients reach 1e4 where a
    denominator |q . n| is small, and carry that many more roundings."""
    scale = max(want.abs().max().item(), 1.0)
    error = (got - want).abs().max().item()
    assert error <= tol * scale, f"{name}: {error:.3g} > {tol:g} * {scale:.3g}"


@pytest.mark.parametrize("chunk", [64, 8])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_cell_on_packed_rows_equals_the_recurrence_per_document(layout, chunk):
    """float64, 1e-10: each document's outputs and gradients (q, k, v and both gates) are its own
    recurrence's, with strong and weak forget gates (a stabiliser far from 0) and padding."""
    doc_ids = layout_ids(LAYOUTS[layout], S)
    plan = DocumentPlan.from_doc_ids(doc_ids)
    g = torch.Generator().manual_seed(0)
    B = doc_ids.shape[0]
    f64 = dict(generator=g, dtype=torch.float64)
    q, k, v = (torch.randn(B, S, 2, 8, **f64).requires_grad_(True) for _ in range(3))
    i, f = (torch.randn(B, S, 2, **f64).mul(4).requires_grad_(True) for _ in range(2))
    inputs = [q, k, v, i, f]
    probe = torch.randn(B, S, 2, 8, **f64)
    out = xlstm.segment_mlstm(q, k, v, i, f, plan.seq_idx.view(B, S), chunk_size=chunk)
    got = _grads(out[doc_ids >= 0], probe[doc_ids >= 0], inputs)
    want = [torch.zeros_like(t) for t in inputs]
    for b, a, e in documents(doc_ids):
        pieces = [t.detach()[b, a:e].requires_grad_(True) for t in inputs]
        alone = _cell(*pieces)
        _close(out[b, a:e], alone, 1e-10, "output")
        for w, gr in zip(want, _grads(alone, probe[b, a:e], pieces), strict=True):
            w[b, a:e] = gr
    for name, a, b in zip("q k v i f".split(), got, want, strict=True):
        _close(a, b, 1e-10, name)


def test_the_layer_in_float64_equals_the_recurrence_per_document_with_gradients():
    """The whole layer in one pass (float64): outputs, input and parameter gradients equal each
    document through the token-by-token layer (1e-10); padding gives zeros."""
    layer = _layer(torch.float64)
    doc_ids = layout_ids(LAYOUTS["mixed"], S)
    plan = DocumentPlan.from_doc_ids(doc_ids)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*doc_ids.shape, 64, generator=g, dtype=torch.float64).requires_grad_(True)
    probe = torch.randn(*doc_ids.shape, 64, generator=g, dtype=torch.float64)
    out = xlstm.mlstm_one_pass(layer, x, plan)
    assert not out[doc_ids < 0].any()
    params = list(layer.parameters())
    got = _grads(out, probe, [x, *params])
    want_x, want_p = torch.zeros_like(x), [torch.zeros_like(p) for p in params]
    for b, a, e in documents(doc_ids):
        piece = x.detach()[b, a:e].requires_grad_(True)
        alone = _layer_alone(layer, piece)
        _close(out[b, a:e], alone, 1e-10, "output")
        grads = _grads(alone, probe[b, a:e], [piece, *params])
        want_x[b, a:e] = grads[0]
        want_p = [w + gp for w, gp in zip(want_p, grads[1:], strict=True)]
    _close(got[0], want_x, 1e-10, "x")
    names = [n for n, _ in layer.named_parameters()]
    for name, a, b in zip(names, got[1:], want_p, strict=True):
        _close(a, b, 1e-10, name)


@pytest.mark.parametrize("weight_mode", ["single", "fused"])
def test_the_layer_in_one_pass_equals_its_own_forward_per_document(weight_mode):
    """float32: outputs (1e-5), input and parameter gradients equal each document run alone
    through the layer's own forward (transformers' chunkwise and step kernels)."""
    layer = _layer(weight_mode=weight_mode)
    doc_ids = layout_ids(LAYOUTS["mixed"], S)
    plan = DocumentPlan.from_doc_ids(doc_ids)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*doc_ids.shape, 64, generator=g).requires_grad_(True)
    probe = torch.randn(*doc_ids.shape, 64, generator=g)
    out = xlstm.mlstm_one_pass(layer, x, plan)
    assert out.dtype == torch.float32 and not out[doc_ids < 0].any()
    params = list(layer.parameters())
    got = _grads(out, probe, [x, *params])
    want_x, want_p = torch.zeros_like(x), [torch.zeros_like(p) for p in params]
    for b, a, e in documents(doc_ids):
        piece = x.detach()[b : b + 1, a:e].requires_grad_(True)
        alone = layer(piece)[0]
        torch.testing.assert_close(out[b, a:e], alone[0], rtol=0, atol=1e-5)
        grads = _grads(alone, probe[b : b + 1, a:e], [piece, *params])
        want_x[b, a:e] = grads[0][0]
        want_p = [w + gp for w, gp in zip(want_p, grads[1:], strict=True)]
    # gradients to 5e-5 of their largest value: each float32 path is about 1e-5 of it off the
    # float64 truth where a denominator |q . n| is small (the layer's own as much as the pass)
    _close(got[0], want_x, 5e-5, "x")
    names = [n for n, _ in layer.named_parameters()]
    for name, a, b in zip(names, got[1:], want_p, strict=True):
        _close(a, b, 5e-5, name)


def test_under_bf16_autocast_the_one_pass_keeps_the_plain_layers_dtype():
    """bf16 autocast over fp32 weights: the adapted layer returns the plain layer's dtype, and
    each document's values are no farther from the float32 ones than the plain layer's own
    bf16 forward is (both round the projections to bf16; the cell runs in float32 here)."""
    model = _model()
    layer = model.backbone.blocks[0].mlstm_layer
    doc_ids = layout_ids([[40, 1, 23]], 64)
    x = torch.randn(1, 64, 64, generator=torch.Generator().manual_seed(0))
    own = type(layer).forward.__get__(layer)
    fm.adapt(model)
    fm.set_sources(model, doc_ids=doc_ids)
    try:
        with torch.no_grad():
            exact, _ = layer(x)  # float32
            with torch.autocast("cpu", dtype=torch.bfloat16):
                got, state = layer(x)
                wants = [(a, e, own(x[:, a:e])[0][0]) for _, a, e in documents(doc_ids)]
    finally:
        fm.restore(model)
    assert xlstm.MLSTM.one_pass.verified[type(layer)] is True
    # packed rows hand on no state: an empty one, which a model's cache can take
    assert all(not t.any() for t in state) and state[0].shape[:2] == (1, layer.config.num_heads)
    for a, e, want in wants:
        assert got.dtype == want.dtype == torch.bfloat16
        ours = (got[0, a:e].float() - exact[0, a:e]).abs().max().item()
        theirs = (want.float() - exact[0, a:e]).abs().max().item()
        assert ours <= theirs + 1e-2 * exact[0, a:e].abs().max().item(), (ours, theirs)


def test_padding_rows_give_zeros_and_backward_reaches_the_parameters():
    """A batch of padding only (a data-parallel rank's filler) gives zeros, and gradients (zero)
    for every parameter; a padding-only row beside documents gives zeros."""
    model = fm.adapt(_model())
    layer = model.backbone.blocks[0].mlstm_layer
    x = torch.randn(2, 16, 64)
    try:
        fm.set_sources(model, doc_ids=torch.full((2, 16), -1))
        out, _ = layer(x)
        out.sum().backward()
        assert not out.any()
        assert all(p.grad is not None for p in layer.parameters())
        fm.set_sources(model, doc_ids=layout_ids([[5, 1, 7], []], 16))
        out, _ = layer(x)
        assert not out[1].any() and not out[0, 13:].any()
    finally:
        fm.restore(model)


# per row: (segment lengths, parents); rows padded to TREE_S
FORESTS = {
    "prompt and 3 branches": [([9, 5, 1, 12], [-1, 0, 0, 0]), ([2, 7, 7], [-1, 0, 0])],
    "two levels": [([6, 4, 3, 5, 2, 8, 1], [-1, 0, 1, 1, 0, 4, -1])],
    "long prompt": [([66, 3, 2], [-1, 0, 0])],  # a prompt over a chunk, branches mid-chunk
    "documents and padding": [([40, 30], [-1, -1]), ([], [])],
}
TREE_S = 72


def _forest(forest) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """(B, S) segment ids, (B, M) parents and the flat token positions of every path."""
    B, M = len(forest), max(1, max(len(lengths) for lengths, _ in forest))
    seg = torch.full((B, TREE_S), -1, dtype=torch.int64)
    parents = torch.full((B, M), -1, dtype=torch.int64)
    paths = []
    for b, (lengths, par) in enumerate(forest):
        spans, at = [], 0
        for j, n in enumerate(lengths):
            seg[b, at : at + n] = j
            spans.append(range(b * TREE_S + at, b * TREE_S + at + n))
            at += n
        parents[b, : len(par)] = torch.tensor(par, dtype=torch.int64)
        for leaf in set(range(len(lengths))) - set(par):
            chain = [leaf]
            while par[chain[-1]] >= 0:
                chain.append(par[chain[-1]])
            paths.append([t for j in reversed(chain) for t in spans[j]])
    return seg, parents, paths


@pytest.mark.parametrize("forest", sorted(FORESTS))
def test_tree_rows_equal_each_path_alone_float64(forest):
    """The adapted layer over prefix-tree rows (the tree mask in the call's sources, float64):
    every token's output is its root-to-leaf path's through the token-by-token layer, and the
    input and parameter gradients (shared segments from every branch) too, to 1e-10; the cell
    forks its state (its tree form runs, not the paths')."""
    model = _model(torch.float64)
    layer = model.backbone.blocks[0].mlstm_layer
    seg, parents, paths = _forest(FORESTS[forest])
    B = seg.shape[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, TREE_S, 64, generator=g, dtype=torch.float64)
    w = torch.randn(B, TREE_S, 64, generator=g, dtype=torch.float64)
    calls = []
    tree = xlstm.segment_mlstm.tree
    fm.adapt(model)
    fm.set_sources(model, flexpack_mask=masks.tree(seg, parents))
    xt = x.clone().requires_grad_()
    try:
        xlstm.segment_mlstm.tree = lambda *a, **k: calls.append(1) or tree(*a, **k)
        got, _ = layer(xt)
    finally:
        xlstm.segment_mlstm.tree = tree
        fm.restore(model)
    assert calls
    params = list(layer.parameters())
    mine = _grads(got, w, [xt, *params])

    xr = x.clone().requires_grad_()
    flat = xr.reshape(B * TREE_S, -1)
    want = torch.zeros(B * TREE_S, 64, dtype=torch.float64)
    taken = torch.zeros(B * TREE_S, dtype=torch.bool)
    for path in paths:
        out = _layer_alone(layer, flat[path])
        new = ~taken[path]
        index = torch.tensor(path)[new]
        want = want.index_copy(0, index, out[new])
        taken[index] = True
    want = want.view(B, TREE_S, 64)
    ref = _grads(want, w, [xr, *params])
    real = seg >= 0
    _close(got[real], want[real], 1e-10, "output")
    assert not got[~real].any()
    for name, a, b in zip(["x", *(n for n, _ in layer.named_parameters())], mine, ref,
                          strict=True):  # fmt: skip
        _close(a, b, 1e-10, name)


def test_tree_cell_equals_the_paths_fallback():
    """The forked cell (:func:`tree_mlstm`) against TreePlan.scan's per-path fallback (the same
    cell without its tree form, each path a row of its own), float64, chunks of 8: segments
    cross chunk cuts."""
    seg, parents, _ = _forest(FORESTS["two levels"])
    plan = TreePlan.from_parents(seg, parents)
    g = torch.Generator().manual_seed(1)
    f64 = dict(generator=g, dtype=torch.float64)
    tensors = [torch.randn(1, TREE_S, 2, 4, **f64) for _ in range(3)]
    tensors += [torch.randn(1, TREE_S, 2, **f64).mul(4) for _ in range(2)]

    def cell(q, k, v, i, f, segments):
        return xlstm.segment_mlstm(q, k, v, i, f, segments, chunk_size=8)

    paths = plan.scan(cell, *tensors)
    cell.tree = lambda q, k, v, i, f, tree: xlstm.tree_mlstm(q, k, v, i, f, tree, chunk_size=8)
    forked = plan.scan(cell, *tensors)
    _close(forked, paths, 1e-10)


def _docs():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 100, (n,), generator=g) for n in (70, 1, 9, 33, 20, 5)]


@pytest.mark.parametrize("one_pass", [True, False], ids=["one pass", "per group"])
def test_a_packed_model_equals_each_document_alone_then_generates_as_a_fresh_one(
    one_pass, monkeypatch
):
    """A whole tiny xLSTMForCausalLM through ``packed_forward_kwargs(batch, model=model)``:
    logits equal each document alone (1e-5 of the largest), by the one pass (the per-group
    split never runs) or by the per-group calls (a class that failed its self-check); then
    ``generate()`` on the same model (its cache: the layers' own forward) gives a fresh model's
    tokens and logits."""
    from flexpack.integrations.transformers import packed_forward_kwargs, register

    model, fresh = _model(attn_implementation=register()), _model()
    batch = flexpack.pack_sequences(_docs(), 80)
    layer_type = type(model.backbone.blocks[0].mlstm_layer)
    if one_pass:
        with torch.no_grad():  # the class's self-check (it runs the per-group calls)
            model(**packed_forward_kwargs(batch, model=model))
        monkeypatch.setattr(DocumentPlan, "split", _no_split)
    else:
        monkeypatch.setitem(xlstm.MLSTM.one_pass.verified, layer_type, False)
        monkeypatch.setattr(xlstm.MLSTM.one_pass, "fn", _no_one_pass)
    with torch.no_grad():
        packed = model(**packed_forward_kwargs(batch, model=model)).logits
    assert fm.mixers_of(model) == [(f"backbone.blocks.{n}.mlstm_layer", "mlstm") for n in (0, 1)]
    if one_pass:
        assert xlstm.MLSTM.one_pass.verified[layer_type] is True
    with torch.no_grad():
        for b, a, e in documents(batch.doc_ids):
            alone = fresh(input_ids=batch.input_ids[b : b + 1, a:e], use_cache=False).logits
            _close(packed[b, a:e], alone[0], 1e-5, f"document at {b}:{a}")
    monkeypatch.undo()

    prompt = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=6, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "packed rows with a cache" warning
        got = model.generate(prompt, **kwargs)
    want = fresh.generate(prompt, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_training_with_checkpointing_gives_each_documents_gradients():
    """Training (float64, gradient checkpointing: each block's forward replayed in backward):
    the packed loss and every weight's gradient equal the documents' own (1e-5 of the largest
    gradient: the model casts its logits to float32, and the layer's own forward keeps its
    state in float32 past its last full chunk)."""
    from flexpack.integrations.transformers import packed_forward_kwargs, register

    model = _model(torch.float64, attn_implementation=register()).train()
    reference = _model(torch.float64).train()
    # transformers 5.25's name, its older one before
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    assert model.backbone.blocks[0].gradient_checkpointing
    batch = flexpack.pack_sequences(_docs(), 80)
    loss = model(**packed_forward_kwargs(batch, model=model, labels=True)).loss
    loss.backward()
    total, count = 0.0, 0
    for b, a, e in documents(batch.doc_ids):
        if e - a > 1:  # a 1-token document supervises nothing
            ids = batch.input_ids[b : b + 1, a:e]
            alone = reference(input_ids=ids, labels=ids, use_cache=False).loss
            total, count = total + alone * (e - a - 1), count + e - a - 1
    (total / count).backward()
    _close(loss.detach(), (total / count).detach(), 1e-6, "loss")  # the model's logits: fp32
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        _close(p.grad, q.grad, 1e-5, name)


def _no_split(*_args, **_kwargs):
    raise AssertionError("the per-group path ran")


def _no_one_pass(*_args, **_kwargs):
    raise AssertionError("the one pass ran")
