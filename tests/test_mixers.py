"""flexpack.mixers: recurrent and conv token mixers keep each document's state to itself.

Each room's module is compared, in float64, with the same module run on each document alone
(its unpacked twin); one tiny model per kind runs packed vs per document in float32 (logits and
grads); generate() with a cache matches the unadapted model; the kernel hand-off is checked on the
faked CUDA device with recording kernels (see tests/test_mixers_kernels.py).
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import pytest
import torch

import flexpack
import flexpack.mixers as fm
from flexpack.mixers import DocumentPlan

transformers = pytest.importorskip("transformers")

# Tiny configs, one per kind of token mixer: (config class, kwargs, the mixer's path in layer 0).
SMALL = dict(
    vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_size=32,
    intermediate_size=48, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    max_position_embeddings=128,
)  # fmt: skip
FAMILIES = {
    "gated_delta_rule": (
        "Qwen3_5TextConfig",
        dict(
            SMALL,
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
        ),
        "linear_attn",
    ),
    "kda": (
        "KimiLinearConfig",
        dict(
            SMALL,
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            num_experts=2,
            num_experts_per_token=1,
            moe_intermediate_size=16,
            first_k_dense_replace=2,
            linear_conv_kernel_dim=4,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            num_key_value_heads=2,
            linear_head_dim=8,
            linear_num_heads=2,
        ),
        "self_attn",
    ),
    "mamba2": (
        "BambaConfig",
        dict(
            SMALL,
            num_hidden_layers=2,
            attn_layer_indices=[1],
            mamba_chunk_size=4,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=8,
        ),
        "mamba",
    ),
    "mamba": (
        "JambaConfig",
        dict(
            SMALL,
            num_hidden_layers=2,
            attn_layer_period=2,
            attn_layer_offset=1,
            num_experts=1,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_d_state=8,
            mamba_dt_rank=4,
        ),
        "mamba",
    ),
    "lightning_attention": (
        "MiniMaxConfig",
        dict(
            SMALL,
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            block_size=4,
            num_local_experts=2,
            num_experts_per_tok=1,
        ),
        "self_attn",
    ),
    "short_conv": (
        "Lfm2Config",
        dict(
            SMALL,
            num_hidden_layers=2,
            layer_types=["conv", "full_attention"],
            full_attn_idxs=[1],
            conv_L_cache=3,
        ),
        "conv",
    ),
    "cca_projection": (  # ZAYA: q/k causal convs padded by the model, a one-token value delay
        "ZayaConfig",
        dict(
            SMALL,
            num_hidden_layers=2,
            layer_types=["hybrid", "hybrid"],
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=16,
            router_hidden_size=16,
            cca_time0=2,
            cca_time1=3,
        ),
        "self_attn.qkv_proj",
    ),
    "rg_lru": (  # RecurrentGemma: a causal conv and the RG-LRU (it resets where positions are 0)
        "RecurrentGemmaConfig",
        dict(
            SMALL,
            num_hidden_layers=2,
            block_types=["recurrent", "attention"],
            lru_width=32,
            conv1d_width=4,
            attention_window_size=16,
        ),
        "temporal_block",
    ),
}
LENGTHS = (7, 11, 5)  # three documents, longer than the chunks, blocks and conv windows


def _config(kind: str, attn_implementation: str = "eager"):
    name, kwargs, _ = FAMILIES[kind]
    config = getattr(transformers, name)(**kwargs)
    config._attn_implementation = attn_implementation
    return config


def positions(kind: str, x: torch.Tensor) -> dict:
    """What a layer hands its mixer besides the rows ``x`` (B, S, ...) that the test must pass:
    RecurrentGemma's block requires ``position_ids`` (each call's rows from 0; the adapted
    block keeps documents apart by their doc ids) and keeps its cache unless told not to."""
    if kind != "rg_lru":
        return {}
    return {"position_ids": torch.arange(x.shape[1]).expand(x.shape[0], -1), "use_cache": False}


def _model(kind: str, attn_implementation: str = "eager", dtype=torch.float32):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            _config(kind, attn_implementation), dtype=dtype
        )
    return model.eval()


def _rows(vocab: int, lengths=LENGTHS, max_len=32):
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, vocab, (n,), generator=g) for n in lengths]
    return flexpack.pack_sequences(docs, max_len=max_len), docs


def _spans(doc_ids: torch.Tensor) -> list[tuple[int, int, int]]:
    out = []
    for b, row in enumerate(doc_ids.tolist()):
        start = 0
        for i in range(1, len(row) + 1):
            if i == len(row) or row[i] != row[start]:
                if row[start] >= 0:
                    out.append((b, start, i))
                start = i
    return out


# ----------------------------------------------------------------------------- the plan


@pytest.mark.parametrize(
    "ids",
    [
        [[0, 0, 0, 1, 1, -1]],
        [[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, -1, -1]],
        [[3, 3, 3, 3]],
        [[-1, 0, 0, 1]],
    ],
)
def test_plan_split_merge_round_trip(ids):
    doc_ids = torch.tensor(ids)
    plan = DocumentPlan.from_doc_ids(doc_ids)
    x = torch.randn(*doc_ids.shape, 3)
    if plan.single:
        assert len(ids) == 1 and -1 not in ids[0] and len(set(ids[0])) == 1
        return
    pieces = [plan.split(x, g) for g in range(len(plan.groups))]
    back = plan.merge(pieces)
    real = doc_ids >= 0
    assert torch.equal(back[real], x[real]) and not back[~real].any()
    # every group row holds one document from its start, zeros after it
    for (index, valid, _, _), piece in zip(plan.groups, pieces, strict=True):
        flat = doc_ids.reshape(-1)
        for r in range(index.shape[0]):
            n = int(valid[r].sum())
            assert (flat[index[r, :n]] == flat[index[r, 0]]).all() and not piece[r, n:].any()
    assert plan.cu_seqlens[-1] == doc_ids.numel()
    assert plan.seq_idx.shape == (1, doc_ids.numel())


# ----------------------------------------------------------------------------- rooms, float64


def _room_outputs(kind, dtype, outputs, context=contextlib.nullcontext):
    """The room's mixer (first layer) on two packed rows, each document alone and then adapted
    on the rows, under ``context()``: ``(model, mixer, batch, {(row, start, end): outputs
    alone}, outputs on the rows)``; ``outputs(result)`` picks what to compare."""
    model = _model(kind, dtype=dtype)
    mixer = model.get_submodule(f"model.layers.0.{FAMILIES[kind][2]}")
    batch, _ = _rows(64, lengths=(7, 11, 5, 9), max_len=18)  # two rows, padding at the end
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*batch.doc_ids.shape, model.config.hidden_size, generator=g, dtype=dtype)
    args, extra = (), {"attention_mask": None}
    if kind == "lightning_attention":  # its forward takes the rotary tables (and ignores them)
        extra["position_embeddings"] = None
    if kind == "cca_projection":  # (hidden_states, cache, conv_mask) -> (q, k, v), all per token
        extra, args = {}, (None,)  # the cache, positional: `past_key_values` on transformers 5.17
    with torch.no_grad(), context():
        alone = {(b, a, e): outputs(mixer(x[b : b + 1, a:e], *args, **extra,
                                          **positions(kind, x[b : b + 1, a:e])))
                 for b, a, e in _spans(batch.doc_ids)}  # fmt: skip
        fm.adapt(model)
        try:
            out = outputs(mixer(x, *args, doc_ids=batch.doc_ids, **extra, **positions(kind, x)))
        finally:
            fm.restore(model)
    return model, mixer, batch, alone, out


def _first(out):
    return out[0] if isinstance(out, tuple) else out


ONE_PASS_FLOAT64 = {"gated_delta_rule", "kda", "rg_lru"}  # fp32 inside the modules


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_room_module_matches_each_document_alone_float64(kind):
    def outputs(out):  # the per-token outputs the room merges back
        if not isinstance(out, tuple):
            return (out,)
        return out if kind == "cca_projection" else out[:1]

    model, mixer, batch, alone, out = _room_outputs(kind, torch.float64, outputs)
    assert dict(fm.mixers_of(model))[f"model.layers.0.{FAMILIES[kind][2]}"] == kind
    # transformers' torch gated delta rule computes in fp32 whatever its inputs; the one pass
    # keeps float64 (tests/test_mixers_onepass_delta.py pins it to the float64 recurrence)
    atol = 1e-6 if kind in ONE_PASS_FLOAT64 else 1e-10
    for (b, a, e), want in alone.items():
        for got, w in zip(out, want, strict=True):
            torch.testing.assert_close(got[b, a:e], w[0], rtol=0, atol=atol)
    assert not any(o[batch.doc_ids < 0].any() for o in out)  # padding gives zeros
    assert "forward" not in mixer.__dict__  # restored


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_room_keeps_the_mixers_dtype_under_autocast(kind):
    """bf16 autocast over fp32 weights and inputs (how TRL trains): the adapted mixer returns
    the dtype the plain one does (bf16), not its fp32 input's, with each document's values."""
    _, _, _, alone, out = _room_outputs(
        kind, torch.float32, _first, lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    )
    assert out.dtype == next(iter(alone.values())).dtype == torch.bfloat16
    for (b, a, e), want in alone.items():
        torch.testing.assert_close(out[b, a:e], want[0], rtol=2e-2, atol=2e-2)


def _random_layout(g: torch.Generator, B: int = 5, S: int = 24) -> torch.Tensor:
    """(B, S) doc ids: rows of random documents (1 to 8 tokens) with right padding, a full row,
    a row of one document and an all-padding row."""
    ids = torch.full((B, S), -1)
    for b in range(B - 1):
        at, k = 0, 0
        fill = S if b == 1 else int(torch.randint(1, S + 1, (1,), generator=g))
        while at < fill:
            n = min(fill - at, S if b == 2 else int(torch.randint(1, 9, (1,), generator=g)))
            ids[b, at : at + n] = k
            at, k = at + n, k + 1
    return ids[torch.randperm(B, generator=g)]


def test_short_conv_runs_in_one_pass_equal_to_the_per_group_path(monkeypatch):
    """LFM2's short conv on packed rows: no call of the class's forward (one pass over the rows,
    from the module's own in_proj / conv / out_proj), the per-group path's outputs and gradients
    in float64 (1e-12) on random layouts with padding and an all-padding row."""
    from flexpack.mixers import conv

    model = _model("short_conv", dtype=torch.float64)
    mixer = model.get_submodule("model.layers.0.conv")
    cls = type(mixer)
    original = cls.forward
    calls = []

    @functools.wraps(original)
    def counted(self, *args, **kwargs):
        calls.append(args[0].shape if args else kwargs["hidden_states"].shape)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", counted)
    fm.adapt(model)
    g = torch.Generator().manual_seed(3)
    H = model.config.hidden_size
    mixer(torch.randn(2, 8, H, dtype=torch.float64), doc_ids=_random_layout(g, 2, 8))
    verified = conv.SHORT_CONV.one_pass.verified
    assert verified[cls] is True  # the self-check ran (first call of the class)
    params = [p for p in mixer.parameters()]
    for _ in range(4):
        ids = _random_layout(g)
        plan = DocumentPlan.from_doc_ids(ids)
        x = torch.randn(*ids.shape, H, generator=g, dtype=torch.float64, requires_grad=True)
        weights = torch.randn(*ids.shape, H, generator=g, dtype=torch.float64)
        calls.clear()
        got = mixer(x, doc_ids=ids, attention_mask=None)
        assert calls == []  # no per-group call of the module's forward
        got_grads = torch.autograd.grad((got * weights).sum(), [x, *params])
        want = plan.merge([original(mixer, plan.split(x, i)) for i in range(len(plan.groups))])
        want_grads = torch.autograd.grad((want * weights).sum(), [x, *params])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        assert not got[ids < 0].any()  # padding, the all-padding row included, gives zeros
        for a, w in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(a, w, rtol=0, atol=1e-12)
    fm.restore(model)


def test_a_short_conv_that_behaves_otherwise_keeps_the_per_group_path():
    """A class whose forward is not the structure the one pass reproduces (here: its output
    doubled) fails the self-check on the probe and keeps the per-group calls, without error."""
    from flexpack.mixers import conv

    model = _model("short_conv", dtype=torch.float64)
    mixer = model.get_submodule("model.layers.0.conv")

    class Doubled(type(mixer)):
        def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
            return 2 * super().forward(hidden_states, cache, attention_mask, **kwargs)

    mixer.__class__ = Doubled
    batch, _ = _rows(64, lengths=(7, 11, 5, 9), max_len=18)
    x = torch.randn(*batch.doc_ids.shape, model.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        alone = {(b, a, e): mixer(x[b : b + 1, a:e]) for b, a, e in _spans(batch.doc_ids)}
        fm.adapt(model)
        out = mixer(x, doc_ids=batch.doc_ids, attention_mask=None)
    fm.restore(model)
    assert conv.SHORT_CONV.one_pass.verified[Doubled] is False
    for (b, a, e), want in alone.items():
        torch.testing.assert_close(out[b, a:e], want[0], rtol=0, atol=1e-10)


def test_short_conv_yields_to_every_kind_that_also_calls_the_conv():
    """A gated delta net or a Mamba mixer calls causal_conv1d_fn too: the short conv's room
    refuses the scans of those kinds (it names them itself, not importing their rooms), even
    where their room is not asked (tests/test_model_seams.py blinds the Mamba room)."""
    from flexpack.mixers import conv, delta, ssm

    theirs = frozenset().union(*(r.functions for r in (*delta.ROOMS, *ssm.ROOMS)))
    assert conv.SHORT_CONV.excludes == theirs
    assert not conv.SHORT_CONV.functions & theirs


def test_plan_taps_stay_inside_documents():
    ids = torch.tensor([[0, 0, 0, 1, 1, -1], [0, 1, 1, 1, 1, 1]])
    taps = DocumentPlan.from_doc_ids(ids).taps(4)
    for j in range(4):
        for b in range(2):
            for t in range(6):
                want = ids[b, t] >= 0 and t >= j and bool(ids[b, t - j] == ids[b, t])
                assert bool(taps[j, b, t]) == want, (j, b, t)


# ----------------------------------------------------------------------------- whole models


def _loss(logits, labels):
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=-100, reduction="sum"
    )


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_model_packed_equals_documents_alone(kind):
    """fp32 logits within 1e-4 of each document alone; the summed loss's grads too."""
    from flexpack.integrations.transformers import packed_forward_kwargs, register

    model = _model(kind, register())
    reference = _model(kind)  # eager, the same weights, never adapted
    batch, docs = _rows(64)
    kwargs = packed_forward_kwargs(batch)
    out = model(**kwargs).logits  # adapted at this first forward, by flexpack's mask function
    assert fm.mixers_of(model) and all(
        fm.is_adapted(model.get_submodule(p)) for p, _ in fm.mixers_of(model)
    )
    labels = batch.labels.long()
    _loss(out[:, :-1], labels[:, 1:]).backward()
    alone_loss = 0.0
    for (b, a, e), doc in zip(_spans(batch.doc_ids), docs, strict=True):
        logits = reference(input_ids=doc[None], use_cache=False).logits
        torch.testing.assert_close(out[b, a:e], logits[0], rtol=0, atol=1e-4)
        alone_loss = alone_loss + _loss(logits[:, :-1], doc[None, 1:])
    alone_loss.backward()
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is not None or ref[name].grad is not None:
            torch.testing.assert_close(p.grad, ref[name].grad, rtol=1e-3, atol=1e-4)


def test_position_ids_alone_and_restore():
    """DataCollatorWithFlattening rows (restarting position_ids, no doc_ids) on a model whose
    decoder layer forwards nothing to its mixer (Jamba): the pre-hook's sources; restore()."""
    model = fm.adapt(_model("mamba"))
    reference = _model("mamba")
    batch, docs = _rows(64)
    with torch.no_grad():
        out = model(
            input_ids=batch.input_ids, position_ids=batch.position_ids.long(), use_cache=False
        ).logits
        for (b, a, e), doc in zip(_spans(batch.doc_ids), docs, strict=True):
            want = reference(input_ids=doc[None]).logits[0]
            torch.testing.assert_close(out[b, a:e], want, rtol=0, atol=1e-4)
        fm.restore(model)
        assert not any(fm.is_adapted(m) for m in model.modules())
        leaked = model(
            input_ids=batch.input_ids, position_ids=batch.position_ids.long(), use_cache=False
        ).logits
    assert not torch.allclose(leaked, out, atol=1e-5)  # the class forward again: it leaks


def test_plan_sees_writes_the_version_counter_misses_and_inference_tensors():
    """The per-call plan is cached on the call's tensors: a new layout written into the same
    doc_ids / position_ids through numpy must be seen, and inference tensors (no version
    counter) must work."""
    from flexpack.integrations.transformers import register

    model = fm.adapt(_model("short_conv", register()))
    batch, docs = _rows(64)
    doc_ids, position_ids = batch.doc_ids.clone(), batch.position_ids.long().clone()
    with torch.no_grad():
        model(input_ids=batch.input_ids, doc_ids=doc_ids, position_ids=position_ids)
        whole = torch.cat(docs)  # the row's tokens as one document, written through numpy
        doc_ids.numpy()[0, : len(whole)] = 0
        position_ids.numpy()[0, : len(whole)] = range(len(whole))
        got = model(input_ids=batch.input_ids, doc_ids=doc_ids, position_ids=position_ids)
        want = _model("short_conv")(input_ids=whole[None], use_cache=False).logits[0]
    torch.testing.assert_close(got.logits[0, : len(whole)], want, rtol=0, atol=1e-4)
    with torch.inference_mode():
        batch, docs = _rows(64)  # inference tensors
        out = model(input_ids=batch.input_ids, doc_ids=batch.doc_ids, use_cache=False).logits
        reference = _model("short_conv")
        for (b, a, e), doc in zip(_spans(batch.doc_ids), docs, strict=True):
            want = reference(input_ids=doc[None], use_cache=False).logits[0]
            torch.testing.assert_close(out[b, a:e], want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_generate_matches_unadapted(kind):
    """generate() with a cache, left-padded prompts: the same tokens as the plain model."""
    from flexpack.integrations.transformers import register

    model = fm.adapt(_model(kind, register()))
    reference = _model(kind, "sdpa")
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = model.generate(input_ids=ids, attention_mask=mask, **kw)
        want = reference.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(got, want)


def test_packed_rows_with_a_cache_warn_and_stay_exact():
    model = fm.adapt(_model("short_conv"))
    batch, _ = _rows(64)
    with torch.no_grad():
        want = model(input_ids=batch.input_ids, doc_ids=batch.doc_ids, use_cache=False).logits
        with pytest.warns(UserWarning, match="generation cannot continue"):
            got = model(input_ids=batch.input_ids, doc_ids=batch.doc_ids, use_cache=True).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_a_mask_other_than_a_tree_reaching_a_mixer_is_refused_by_name():
    """A recurrent state follows document rows and prefix trees (tests/test_mixers_trees.py);
    any other flexpack_mask (a custom mask) is refused, naming the mixer and the mask."""
    model = _model("short_conv")
    ids = torch.randint(3, 64, (2, 6))
    fm.adapt(model)
    with pytest.raises(fm.TreeRefused, match=r"Lfm2ShortConv .* cannot follow a flexpack_mask"):
        model(input_ids=ids, flexpack_mask=object(), use_cache=False)
