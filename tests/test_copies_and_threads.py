"""What users do to objects flexpack has touched: copy, pickle, save, collect, call from threads.

A model flexpack ran keeps state in its own objects (the hooks and mixer forwards of
``flexpack.mixers.adapt``, tensor stamps in caches, a mask's device copies). Users deep-copy
models all the time (DPO / GRPO reference models, EMA and evaluation copies), pickle and
``torch.save`` them, and evaluate two models in one process or from two threads. Each case
here is compared with a reference: the copy against the original before it was changed, each
document against itself alone through the same model, each thread's forwards against the same
forwards run alone.
"""

from __future__ import annotations

import copy
import gc
import io
import pickle
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from _rows import random_rows as _rows_of

transformers = pytest.importorskip("transformers")

from test_mixers import _model  # noqa: E402

import flexpack  # noqa: E402
import flexpack.mixers  # noqa: E402
from flexpack import masks  # noqa: E402
from flexpack._tensor_cache import PerTensor, Stamp, clear_caches  # noqa: E402
from flexpack.integrations._tiny import tiny_config  # noqa: E402
from flexpack.integrations.transformers import packed_forward_kwargs, register  # noqa: E402

# a conv hybrid, a gated-delta-rule hybrid, a Mamba2 hybrid, plain attention
FAMILIES = ("Lfm2Config", "Qwen3_5TextConfig", "BambaConfig", "LlamaConfig")
DOCS = (17, 25, 9)


def tiny(config_name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = tiny_config(getattr(transformers, config_name)(), register())
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def documents(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 100, (n,), generator=g).tolist() for n in DOCS]


def packed_logits(model: torch.nn.Module, docs: list[list[int]]) -> list[torch.Tensor]:
    """Each document's logits from one packed row (greedy keeps the documents in order)."""
    batch = flexpack.pack_sequences(docs, max_len=64, strategy="greedy")
    logits = model(**packed_forward_kwargs(batch, model=model)).logits[0]
    out, start = [], 0
    for d in docs:
        out.append(logits[start : start + len(d)])
        start += len(d)
    return out


def alone_logits(model: torch.nn.Module, docs: list[list[int]]) -> list[torch.Tensor]:
    return [model(input_ids=torch.tensor([d]), use_cache=False).logits[0] for d in docs]


def mixer_weights(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [
        p
        for path, _ in flexpack.mixers.mixers_of(model)
        for p in model.get_submodule(path).parameters()
    ]


def assert_all_close(got: list[torch.Tensor], want: list[torch.Tensor], atol: float = 2e-5):
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=atol, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_deep_copy_runs_and_trains_its_own_weights(family):
    """A copy of a model flexpack has run: packed exact on its own, its mixers read its own
    weights (changing them changes the copy, never the original) and its backward fills its own
    gradients only."""
    model, docs = tiny(family), documents()
    with torch.no_grad():
        before = packed_logits(model, docs)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        assert_all_close(packed_logits(twin, docs), before, atol=0)
        assert_all_close(packed_logits(twin, docs), alone_logits(twin, docs))
        for p in mixer_weights(twin) or list(twin.parameters())[1:3]:
            p.mul_(1.5)
        changed = packed_logits(twin, docs)
        assert max((c - b).abs().max().item() for c, b in zip(changed, before, strict=True)) > 1e-4
        assert_all_close(changed, alone_logits(twin, docs))  # still exact on its own weights
        assert_all_close(packed_logits(model, docs), before, atol=0)
    sum(t.sum() for t in packed_logits(twin, docs)).backward()
    assert all(p.grad is None for p in model.parameters())
    assert any(p.grad is not None for p in twin.parameters())


@pytest.mark.parametrize("when", ["adapted", "after_forward", "after_clear_caches"])
def test_a_copy_of_an_adapted_model_has_hooks_and_mixers_of_its_own(when):
    """The issue's cases: adapt() alone, a forward, or a forward and clear_caches() before the
    copy. Every installed forward and hook of the copy names the copy's modules."""
    model = tiny("Lfm2Config")
    flexpack.mixers.adapt(model)
    if when != "adapted":
        with torch.no_grad():
            packed_logits(model, documents())
    if when == "after_clear_caches":
        clear_caches()
    twin = copy.deepcopy(model)
    originals = {id(m) for m in model.modules()}
    for path, _ in flexpack.mixers.mixers_of(twin):
        mixer = twin.get_submodule(path)
        assert flexpack.mixers.is_adapted(mixer)
        assert mixer.__dict__["forward"].module is mixer
    for m in twin.modules():
        for hook in (*m._forward_pre_hooks.values(), *m._forward_hooks.values()):
            owner = getattr(hook, "module", None) or getattr(hook, "__self__", None)
            assert id(owner) not in originals
    flexpack.mixers.restore(twin)  # undoes the copy only
    assert not any("forward" in m.__dict__ for m in twin.modules())
    assert all(
        flexpack.mixers.is_adapted(model.get_submodule(p))
        for p, _ in flexpack.mixers.mixers_of(model)
    )


def test_pickle_and_torch_save_round_trip_an_adapted_model():
    model, docs = tiny("Lfm2Config"), documents()
    with torch.no_grad():
        want = packed_logits(model, docs)
        loaded = pickle.loads(pickle.dumps(model))
        assert_all_close(packed_logits(loaded, docs), want, atol=0)
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        saved = torch.load(buf, weights_only=False)
        assert_all_close(packed_logits(saved, docs), want, atol=0)


def test_deep_copy_after_a_packed_forward_does_not_corrupt_the_heap():
    """The issue's ten lines, in a process of their own: a copied storage weak reference was
    freed twice ("corrupted double-linked list" at exit)."""
    code = textwrap.dedent(
        """
        import copy, gc, torch, transformers, flexpack
        from flexpack.integrations.transformers import register, packed_forward_kwargs
        cfg = transformers.AutoConfig.for_model("lfm2", vocab_size=128, hidden_size=64,
            intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=2, layer_types=["conv", "full_attention"], full_attn_idxs=[1],
            conv_L_cache=3, pad_token_id=0)
        m = transformers.AutoModelForCausalLM.from_config(cfg)
        m.set_attn_implementation(register())
        b = flexpack.pack_sequences([list(range(3, 20)), list(range(5, 30))], max_len=48)
        m(**packed_forward_kwargs(b, model=m))
        copies = [copy.deepcopy(m) for _ in range(3)]
        for c in copies:
            c(**packed_forward_kwargs(b, model=c))
        del copies
        for _ in range(5):
            gc.collect()
        print("done")
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "done" in run.stdout, run.stderr[-2000:]


def test_stamps_and_caches_copy_without_sharing_a_weak_reference():
    t = torch.arange(6)
    stamp = Stamp(t)
    assert copy.deepcopy(stamp) is stamp and copy.copy(stamp) is stamp
    revived = pickle.loads(pickle.dumps(stamp))
    assert not revived.matches(t)  # a weak reference does not cross processes
    cache = PerTensor(4)
    cache.get(t, lambda: 1)
    copied = copy.deepcopy(cache)
    assert copied.get(t, lambda: 2) == 2  # a copy starts empty
    assert pickle.loads(pickle.dumps(cache)).get(t, lambda: 3) == 3


def _mask_examples() -> list[masks.Mask]:
    d = torch.tensor([[0, 0, 1, 1, 1, -1, -1, -1]])
    trees = flexpack.pack_trees([([3, 4, 5], [[6, 7], [8]])], max_len=8)
    return [
        masks.document(d) & masks.causal(),
        masks.document(d) & masks.sliding_window(2) | ~masks.padding(d),
        masks.prefix_lm(d, torch.tensor([[1, 2]])),
        masks.causal(),
        trees.mask(),
    ]


@pytest.mark.parametrize("index", range(5))
def test_masks_deep_copy_and_pickle_to_the_same_mask(index):
    """A copied or unpickled mask has the same BlockMask and dense mask, its own ids (readable:
    no 'modified in place'), and moving it to another device first changes nothing."""
    mask = _mask_examples()[index]
    mask.to("meta")  # a device copy in its cache: its stamps must not be shared
    S = 8
    want = mask.block_mask(block_size=2, Q_LEN=S, KV_LEN=S).to_dense()
    for other in (copy.deepcopy(mask), pickle.loads(pickle.dumps(mask))):
        assert other.name == mask.name
        assert torch.equal(other.block_mask(block_size=2, Q_LEN=S, KV_LEN=S).to_dense(), want)
        if mask.doc_ids is not None:
            assert torch.equal(other.doc_ids, mask.doc_ids)
            assert other.doc_ids is not mask.doc_ids


def test_moved_masks_copied_in_a_loop_with_garbage_collection():
    mask = masks.document(torch.tensor([[0, 0, 1, 1]])) & masks.causal()
    for _ in range(60):
        moved = mask.to("meta")
        copies = [copy.deepcopy(mask), copy.deepcopy(moved)]
        del copies
        gc.collect()
    assert torch.equal(copy.deepcopy(mask).doc_ids, mask.doc_ids)


def test_two_models_in_two_threads_each_get_their_own_masks():
    """Two Llama models called from two threads, each with rows of its own: every forward
    equals the same forward run alone (the mask cache was one dict for every thread)."""
    models = [tiny("LlamaConfig", seed) for seed in (0, 1)]
    rows = [
        [
            flexpack.pack_sequences(documents(seed), max_len=64, strategy=s)
            for s in ("greedy", "bfd")
        ]
        for seed in (2, 3)
    ]
    with torch.no_grad():
        want = [
            [m(**packed_forward_kwargs(b, model=m)).logits for b in batches]
            for m, batches in zip(models, rows, strict=True)
        ]
    wrong: list[str] = []
    start = threading.Barrier(2)

    def run(i: int) -> None:
        model, batches = models[i], rows[i]
        start.wait()
        with torch.no_grad():
            for step in range(100):
                j = step % 2
                got = model(**packed_forward_kwargs(batches[j], model=model)).logits
                if not torch.allclose(got, want[i][j], atol=1e-5, rtol=0):
                    wrong.append(f"thread {i} step {step}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: inside a forward, between its layers
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not wrong, wrong[:5]


def test_a_threads_mask_cache_is_its_own():
    """Deterministically: what one thread caches for its ids survives another thread building
    masks for other ids in between (one dict for every thread was cleared and refilled)."""
    from flexpack.integrations.transformers import _mask_for

    def build(ids: torch.Tensor):
        return _mask_for(torch.device("cpu"), 1, ids.shape[1], None, ids, None, None, True, None)

    mine, theirs = torch.tensor([[0, 0, 1, 1, 1, 2]]), torch.tensor([[0, 1, 1, 1, 1, 1]])
    first = build(mine)
    other = threading.Thread(target=build, args=(theirs,))
    other.start()
    other.join()
    assert build(mine) is first  # still this thread's cached mask, built from its own ids
    assert torch.equal(first.doc_ids, mine.int()) or torch.equal(first.doc_ids, mine)


def test_one_models_first_forwards_from_two_threads():
    """Two threads' first forwards of one fresh hybrid model adapt it once (no error from the
    mixer check reading sources), and both are exact."""
    model, docs = tiny("Lfm2Config"), documents()
    with torch.no_grad():
        want = alone_logits(copy.deepcopy(model), docs)
    errors: list[BaseException] = []
    results: list[list[torch.Tensor]] = []
    start = threading.Barrier(2)

    def run() -> None:
        start.wait()
        try:
            with torch.no_grad():
                results.append(packed_logits(model, docs))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for got in results:
        assert_all_close(got, want)


@pytest.mark.parametrize("kind", ["short_conv", "gated_delta_rule"])
def test_swap_tensors_on_doc_ids_after_a_call(kind):
    """torch.utils.swap_tensors refused doc ids flexpack had read ("has weakref associated with
    it": the caches' stamps held weak references to them). The stamps hold the storage's now:
    the swap runs, and the next call sees the swapped-in layout."""
    from flexpack.integrations.transformers import register

    model = _model(kind, register())
    reference = _model(kind)
    ids, doc_ids, _, _ = _rows_of([[7, 11]], S=18)
    with torch.no_grad():
        model(input_ids=ids, doc_ids=doc_ids, use_cache=False)
        _, other, docs, spans = _rows_of([[12, 6]], S=18)
        ids = torch.cat(docs)[None]
        torch.utils.swap_tensors(doc_ids, other)  # no clear_caches() first
        assert torch.equal(doc_ids[0, 11:13], torch.tensor([0, 1], dtype=torch.int32))
        out = model(input_ids=ids, doc_ids=doc_ids, use_cache=False).logits
        for (b, a, e), doc in zip(spans, docs, strict=True):
            want = reference(input_ids=doc[None], use_cache=False).logits[0]
            torch.testing.assert_close(out[b, a:e], want, rtol=0, atol=1e-4)
