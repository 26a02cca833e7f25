"""flexpack.viz writes real PNGs (decoded back here) and fails clearly without matplotlib."""

import sys

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from flexpack import masks as fm
from flexpack import viz

pytest.importorskip("matplotlib")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def decoded(path):
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 50 and image.shape[1] > 50
    return image


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def test_plot_block_mask_writes_a_png(tmp_path):
    d = torch.tensor([[0] * 40 + [1] * 50 + [-1] * 10, [0] * 100])
    bm = (fm.document(d) & fm.causal()).block_mask(block_size=16)
    out = viz.plot_block_mask(bm, tmp_path / "sub" / "bm.png", batch=1)
    assert out == tmp_path / "sub" / "bm.png"
    image = decoded(out)
    # The three state colours all appear: skipped, partial (diagonal) and full (below it).
    colours = {tuple(round(float(c), 1) for c in px[:3]) for px in image.reshape(-1, 4)}
    assert len(colours) >= 3


def test_plot_mask_writes_a_png_for_every_input_kind(tmp_path):
    d = torch.tensor([0] * 10 + [1] * 15 + [-1] * 5)
    m = fm.prefix_lm(d, torch.tensor([4, 0]))
    bm = create_block_mask(causal, 1, 1, 30, 30, device="cpu", BLOCK_SIZE=8)
    inputs = {
        "mask": (m, {}),
        "mask_mod": (causal, {"Q_LEN": 30, "KV_LEN": 30}),
        "block_mask": (bm, {}),
        "dense": (torch.ones(30, 30, dtype=torch.bool).tril(), {"doc_ids": d}),
    }
    for name, (obj, kw) in inputs.items():
        decoded(viz.plot_mask(obj, tmp_path / f"{name}.png", **kw))


def test_errors(tmp_path):
    bm = create_block_mask(causal, 1, 1, 8, 8, device="cpu", BLOCK_SIZE=4)
    with pytest.raises(ValueError, match=r"\.png"):
        viz.plot_block_mask(bm, tmp_path / "x.jpg")
    with pytest.raises(ValueError, match="batch"):
        viz.plot_block_mask(bm, tmp_path / "x.png", batch=1)
    with pytest.raises(TypeError, match="block_mask"):
        viz.plot_block_mask(fm.causal(), tmp_path / "x.png")
    with pytest.raises(TypeError, match="bool"):
        viz.plot_mask(torch.zeros(4, 4), tmp_path / "x.png")
    with pytest.raises(ValueError, match="doc_ids of length 3"):
        viz.plot_mask(causal, tmp_path / "x.png", Q_LEN=4, KV_LEN=4, doc_ids=torch.zeros(3))


def test_missing_matplotlib_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"\.\[viz\]"):
        viz.plot_mask(causal, tmp_path / "x.png", Q_LEN=4, KV_LEN=4)
