"""Prefix trees through the recurrent and convolutional mixers (flexpack.mixers._tree).

A tree row holds a prompt and its branches (GRPO completions, DPO answers, multi-turn rollouts);
a mixer's state at the end of a shared segment must seed every branch below it. Reference: each
root-to-leaf path run alone through the plain module (its class forward, no flexpack), outputs
and gradients (float64 to 1e-10 where the one pass keeps float64, float32 to 1e-5 relative),
every token taken from the first path that holds it; forests with one level (GRPO), several
(multi-turn), a parent shorter than the conv window, single documents and padding rows.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flexpack.mixers as fm  # noqa: E402
from flexpack import masks  # noqa: E402
from flexpack.mixers._tree import TreePlan  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_mixers import FAMILIES, _model, positions  # noqa: E402

KINDS = ("cca_projection", "gated_delta_rule", "kda", "lightning_attention", "mamba", "mamba2",
         "rg_lru", "short_conv")  # fmt: skip
S = 72  # a gated delta / KDA chunk is 64 tokens: a path crosses one

# per row: (segment lengths, parents); rows padded to S
FORESTS = {
    "grpo": [
        ([9, 5, 1, 12, 3], [-1, 0, 0, 0, 0]),
        ([2, 7, 7], [-1, 0, 0]),
    ],
    "multi-level": [
        ([6, 4, 3, 5, 2, 8, 1], [-1, 0, 1, 1, 0, 4, -1]),
    ],
    "short parents": [  # a 1-token parent: a branch's conv window reaches its grandparent
        ([3, 1, 2, 2, 1, 4], [-1, 0, 1, 1, 0, 4]),
    ],
    "documents and padding": [
        ([40, 30], [-1, -1]),
        ([], []),
    ],
    "long prompt": [  # a prompt over a chunk, branches starting mid-chunk
        ([66, 3, 2], [-1, 0, 0]),
    ],
}


def _layout(forest) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
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
        for leaf in range(len(lengths)):
            if leaf in par:
                continue
            chain = [leaf]
            while par[chain[-1]] >= 0:
                chain.append(par[chain[-1]])
            paths.append([t for j in reversed(chain) for t in spans[j]])
    return seg, parents, paths


def _tree_and_alone(kind: str, forest, dtype, autocast: bool = False):
    """The mixer over the tree rows (adapted, the tree mask in the call's sources) and each
    path through the plain module: (outputs (B, S, H), reference (B, S, H), gradient pairs,
    segment ids)."""
    model = _model(kind, dtype=dtype)
    mixer = model.get_submodule(f"model.layers.0.{FAMILIES[kind][2]}")
    own = type(mixer).forward.__get__(mixer)
    seg, parents, paths = _layout(forest)
    B = seg.shape[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, S, model.config.hidden_size, generator=g, dtype=dtype)

    def first(out):  # the per-token output; ZAYA's q, k and v side by side
        if kind == "cca_projection":
            return torch.cat([t.flatten(2) for t in out], dim=-1)
        return out[0] if isinstance(out, tuple) else out

    # lightning attention's forward takes the rotary tables and a mask (and ignores them)
    extra = {"position_embeddings": None, "attention_mask": None}
    extra = extra if kind == "lightning_attention" else {}
    extra = {"attention_mask": None} if kind == "rg_lru" else extra  # required, unused
    args = (None,) if kind == "cca_projection" else ()  # its cache, positional (5.17's name)

    ctx = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if autocast
        else torch.autocast("cpu", enabled=False)
    )
    fm.adapt(model)
    fm.set_sources(model, flexpack_mask=masks.tree(seg, parents))
    xt = x.clone().requires_grad_()
    with ctx:
        got = first(mixer(xt, *args, **extra, **positions(kind, xt)))
    w = torch.randn(got.shape, generator=g, dtype=dtype)  # a random cotangent
    (got.float() * w).sum().backward()
    grads = [xt.grad] + [p.grad.clone() for p in mixer.parameters()]
    mixer.zero_grad()
    fm.restore(model)

    xr = x.clone().requires_grad_()
    flat = xr.reshape(B * S, -1)
    want = torch.zeros(B * S, got.shape[-1], dtype=got.dtype)
    taken = torch.zeros(B * S, dtype=torch.bool)
    for path in paths:
        with ctx:
            one = flat[path][None]
            out = first(own(one, *args, **extra, **positions(kind, one)))[0]
        new = ~taken[path]
        index = torch.tensor(path)[new]
        want = want.index_copy(0, index, out[new])
        taken[index] = True
    want = want.view(B, S, -1)
    (want.float() * w).sum().backward()
    ref = [xr.grad] + [p.grad for p in mixer.parameters()]
    return got, want, list(zip(grads, ref, strict=True)), seg


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    scale = max(want.abs().max().item(), 1e-3)
    error = (got.double() - want.double()).abs().max().item()
    assert error <= tol * scale, f"{error:.3g} > {tol:g} * {scale:.3g}"


@pytest.mark.parametrize("forest", sorted(FORESTS))
@pytest.mark.parametrize("kind", KINDS)
def test_tree_rows_equal_each_path_alone(kind, forest):
    """Outputs and gradients (input and every parameter) of the mixer over tree rows equal each
    root-to-leaf path through the plain module, float32, to 1e-5 of the largest value (1e-4
    for gradients, sums of more roundings)."""
    got, want, grads, seg = _tree_and_alone(kind, FORESTS[forest], torch.float32)
    real = seg >= 0
    _close(got[real], want[real], 1e-5)
    assert not got[~real].any()  # padding gives zeros
    for a, b in grads:
        _close(a, b, 1e-4)


def _scans():
    """Each scan the one passes run, as (name, fn(*tensors, segments), tensor shapes per token)."""
    from flexpack.mixers import delta, rglru, ssm

    H, D = 2, 4
    A = -torch.rand(H, dtype=torch.float64) - 0.5
    A1 = -torch.rand(3, D, dtype=torch.float64) - 0.5

    def gated_delta(q, k, v, g, b, seg):
        return delta.segment_chunk_gated_delta_rule(
            q, k, v, -g.abs(), b.sigmoid(), seg, chunk_size=8
        )

    def forked(q, k, v, g, b, plan):  # its tree form: the state forked, not recomputed
        forked.calls += 1
        return delta.tree_chunk_gated_delta_rule(q, k, v, -g.abs(), b.sigmoid(), plan, chunk_size=8)

    forked.calls = 0
    gated_delta.tree = forked

    def kda(q, k, v, g, b, seg):
        return delta.segment_chunk_kda(q, k, v, -g.abs(), b.sigmoid(), seg, chunk_size=8)

    def kda_forked(q, k, v, g, b, plan):
        kda_forked.calls += 1
        return delta.tree_chunk_kda(q, k, v, -g.abs(), b.sigmoid(), plan, chunk_size=8)

    kda_forked.calls = 0
    kda.tree = kda_forked

    def ssd(x, dt, B, C, seg):
        return ssm._ssd_scan(x, dt.abs(), A, B, C, seg, 8)

    def ssd_forked(x, dt, B, C, plan):
        ssd_forked.calls += 1
        return ssm._tree_ssd_scan(x, dt.abs(), A, B, C, plan, 8)

    ssd_forked.calls = 0
    ssd.tree = ssd_forked

    def selective(u, dt, B, C, seg):
        return ssm._selective_scan(u, dt.abs(), A1, B, C, _starts(seg), 5)

    def selective_forked(u, dt, B, C, plan):
        selective_forked.calls += 1
        return ssm._tree_selective_scan(u, dt.abs(), A1, B, C, plan, 5)

    selective_forked.calls = 0
    selective.tree = selective_forked

    def lru(log_a, u, seg):
        return rglru._lru_scan(-log_a.abs(), u, seg, 5)

    def lru_forked(log_a, u, plan):
        lru_forked.calls += 1
        return rglru._tree_lru_scan(-log_a.abs(), u, plan, 5)

    lru_forked.calls = 0
    lru.tree = lru_forked
    return {
        "gated_delta_rule": (gated_delta, [(H, D), (H, D), (H, D), (H,), (H,)]),
        "kda": (kda, [(H, D), (H, D), (H, D), (H, D), (H,)]),
        "mamba2": (ssd, [(H, D), (H,), (H, D), (H, D)]),
        "mamba": (selective, [(3,), (3,), (D,), (D,)]),
        "rg_lru": (lru, [(3,), (3,)]),
    }


def _starts(seg: torch.Tensor) -> torch.Tensor:
    start = torch.ones_like(seg, dtype=torch.bool)
    start[:, 1:] = seg[:, 1:] != seg[:, :-1]
    return start


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "paths"])
@pytest.mark.parametrize("forest", sorted(FORESTS))
@pytest.mark.parametrize("scan", ["gated_delta_rule", "kda", "mamba", "mamba2", "rg_lru"])
def test_tree_scans_equal_each_path_alone_float64(scan, forest, fork):
    """float64, 1e-10: every scan over tree rows (``TreePlan.scan``) gives each token what its
    root-to-leaf path alone gives, outputs and gradients: each forks the state at the end of
    a shared segment into each branch (chunks of 8 or 5: segments cross chunks); the paths'
    fallback (a scan without a tree form) is checked too."""
    fn, shapes = _scans()[scan]
    if not fork:  # the same scan without its tree form: TreePlan.scan runs each path
        fn = functools.partial(fn)
    seg, parents, paths = _layout(FORESTS[forest])
    B = seg.shape[0]
    plan = TreePlan.from_parents(seg, parents)
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(B, S, *s, generator=g, dtype=torch.float64) for s in shapes]
    leaves = [t.clone().requires_grad_() for t in tensors]
    got = plan.scan(fn, *leaves)
    w = torch.randn(got.shape, generator=g, dtype=torch.float64)
    (got * w).sum().backward()
    mine = [t.grad for t in leaves]

    leaves = [t.clone().requires_grad_() for t in tensors]
    flats = [t.reshape(B * S, *t.shape[2:]) for t in leaves]
    want = torch.zeros(B * S, *got.shape[2:], dtype=torch.float64)
    taken = torch.zeros(B * S, dtype=torch.bool)
    for path in paths:
        one = torch.zeros(1, len(path), dtype=torch.int64)
        out = fn(*(f[path][None] for f in flats), one)[0]
        new = ~taken[path]
        index = torch.tensor(path)[new]
        want = want.index_copy(0, index, out[new])
        taken[index] = True
    want = want.view(got.shape)
    (want * w).sum().backward()
    real = seg >= 0
    _close(got[real], want[real], 1e-10)
    for a, t in zip(mine, leaves, strict=True):
        _close(a, t.grad, 1e-10)
    if fork:
        assert fn.tree.calls == 1  # the forked form ran, not the paths


def test_tree_rows_under_bf16_autocast_keep_the_plain_modules_dtype():
    """bf16 autocast over fp32 weights (how TRL trains): the tree pass returns the plain
    module's dtype, each path's values to bf16's rounding."""
    got, want, _, seg = _tree_and_alone("gated_delta_rule", FORESTS["grpo"], torch.float32, True)
    assert got.dtype == want.dtype == torch.bfloat16
    _close(got[seg >= 0], want[seg >= 0], 3e-2)


def test_tree_plan_tables():
    """The plan's taps follow the path back across segment starts; each token is read back
    from the first path that holds it."""
    seg = torch.tensor([[0, 0, 0, 1, 1, 2, -1]])
    plan = TreePlan.from_parents(seg, torch.tensor([[-1, 0, 0]]))
    assert plan.tap_index(3)[2].tolist() == [[0, 0, 0, 1, 2, 1, 0]]
    assert plan.taps(3)[2].int().tolist() == [[0, 0, 1, 1, 1, 1, 0]]
    x = torch.arange(7.0).view(1, 7, 1)
    assert plan.expand(x)[..., 0].tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 5, 0]]
    assert torch.equal(plan.collapse(plan.expand(x)), x * (seg >= 0)[..., None])
    mask = masks.tree(seg, torch.tensor([-1, 0, 0]))
    same = TreePlan.from_ends(mask.doc_ids, mask._tree_ends)
    assert torch.equal(same.tap_index(3), plan.tap_index(3))


def test_a_mixer_without_a_tree_form_is_refused_by_name():
    """Mamba scans decline float64 (the module's own rounds it to float32): on tree rows that
    is a TreeRefused naming the class, never a pass that lets branches share state."""
    model = _model("mamba2", dtype=torch.float64)
    mixer = model.get_submodule("model.layers.0.mamba")
    seg, parents, _ = _layout(FORESTS["grpo"])
    fm.adapt(model)
    fm.set_sources(model, flexpack_mask=masks.tree(seg, parents))
    try:
        with pytest.raises(fm.TreeRefused, match=type(mixer).__name__):
            mixer(torch.zeros(2, S, model.config.hidden_size, dtype=torch.float64))
        doc_mask = masks.document(seg)
        fm.set_sources(model, flexpack_mask=doc_mask)
        with pytest.raises(fm.TreeRefused, match="kind 'document'"):
            mixer(torch.zeros(2, S, model.config.hidden_size, dtype=torch.float64))
    finally:
        fm.restore(model)
