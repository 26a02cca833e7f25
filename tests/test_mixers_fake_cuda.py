"""Every one-pass mixer on the faked CUDA device (tests/fake_cuda.py): the one pass runs there
(not the per-group split), with the device's rules (one device per op), no host sync once the
call's plan is built, and each document's outputs equal to the document alone through the
plain module on the CPU. The CUDA path of the torch one passes is this path: no kernel package
is involved (tests/test_mixers_kernels.py checks the kernels' hand-off)."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _onepass import close, count  # noqa: E402
from _rows import documents, layout_ids  # noqa: E402
from fake_cuda import to_cpu, to_fake_cuda  # noqa: E402
from test_mixers import FAMILIES, _model, positions  # noqa: E402

import flexpack.mixers as fm  # noqa: E402

# models without an entry in test_mixers.FAMILIES: (config class, its tiny config's fields)
OTHERS = {"rwkv": "RwkvConfig", "xlstm": "xLSTMConfig", "zamba": "ZambaConfig"}
S = 24


def _build(kind: str):
    """(model, its first mixer, positional args and keywords its forward needs besides x)."""
    if kind in FAMILIES:
        model = _model(kind)
        mixer = model.get_submodule(f"model.layers.0.{FAMILIES[kind][2]}")
    else:
        from flexpack.integrations._tiny import tiny_config

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            config = tiny_config(getattr(transformers, OTHERS[kind])())
            model = transformers.AutoModelForCausalLM.from_config(config).eval()
        mixer = model.get_submodule(fm.mixers_of(model)[0][0])
    args, extra = (), {"attention_mask": None}
    if kind == "lightning_attention":  # its forward takes the rotary tables (and ignores them)
        extra["position_embeddings"] = None
    if kind == "cca_projection":  # (hidden_states, cache, conv_mask): its cache, positional
        extra, args = {}, (None,)
    if kind in ("rwkv", "xlstm"):  # (hidden, state): no mask
        extra = {}
    return model, mixer, args, extra


def _first(out):
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("kind", [*sorted(FAMILIES), *sorted(OTHERS)])
def test_one_pass_runs_on_the_fake_cuda_device(kind, fake_cuda, monkeypatch):
    model, mixer, args, extra = _build(kind)
    hidden = model.config.get_text_config().hidden_size
    if kind == "xlstm":
        hidden = model.config.embedding_dim
    doc_ids = layout_ids([[1, 6, 2, 9, 1], [4, 4, 8, 3], [], [24]], S)
    x = torch.randn(len(doc_ids), S, hidden, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        alone = {
            (b, a, e): _first(type(mixer).forward(mixer, x[b : b + 1, a:e], *args, **extra,
                                                  **positions(kind, x[b : b + 1, a:e])))
            for b, a, e in documents(doc_ids)
        }  # fmt: skip
    room = fm._room_of(mixer)
    fm.adapt(model)
    to_fake_cuda(model)
    xs, ids = to_fake_cuda(x), to_fake_cuda(doc_ids)
    where = {k: to_fake_cuda(v) if isinstance(v, torch.Tensor) else v
             for k, v in positions(kind, x).items()}  # fmt: skip
    try:
        with torch.no_grad():
            mixer(xs, *args, doc_ids=ids, **extra, **where)  # the plan, and the class's check
            assert room.one_pass.verified[type(mixer)], kind
            calls = count(monkeypatch, room)
            with fake_cuda.count() as syncs:
                out = _first(mixer(xs, *args, doc_ids=ids, **extra, **where))
    finally:
        fm.restore(model)
    assert calls == {"one_pass": 1, "split": 0}
    assert syncs == [], syncs
    assert out.device.type == "cuda"
    out = to_cpu(out)
    for (b, a, e), want in alone.items():
        close(out[b, a:e], want[0], 1e-5)
    assert not out[doc_ids < 0].any()
