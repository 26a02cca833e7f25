"""``flexpack demo`` at small settings: it packs, proves packed == per-document, times, draws."""

from __future__ import annotations

import re
import sys

import pytest
import torch

import flexpack.demo as demo

SMALL = dict(max_len=256, num_docs=30, n_layer=1, n_embd=32, batch_rows=4)


def test_demo_runs_and_reports(tmp_path, capsys):
    assert demo.main(out=str(tmp_path), **SMALL) == 0
    text = capsys.readouterr().out
    assert "30 documents of real prose" in text
    assert f"pictures go to {tmp_path.resolve()} (flexpack demo --out DIR" in text
    # 30 documents are far under the 4,096 pieces where the compiled packer pays off; numpy
    # packs them unless an earlier test of this process loaded the compiled kernels already.
    assert re.search(r"materialized in \d+ ms \((numpy, no compile|\+\d+ ms to load the co)", text)
    packed = re.search(r"flexpack\.pack \(bfd\), rows of 256\s+(\d+)\s+[\d,]+\s+([\d.]+)%", text)
    padded = re.search(r"one document per row, padded to 256\s+(\d+)\s+[\d,]+\s+([\d.]+)%", text)
    assert packed and padded, text
    assert int(packed[1]) < int(padded[1]) and float(packed[2]) > float(padded[2])
    diff = re.search(r"largest \|logit difference\| (\S+) \(tolerance 1e-04\) -> OK", text)
    assert diff and float(diff[1]) <= 1e-4, text
    assert re.search(r"packed \(flexpack\.attention\)\s+[\d.]+ s\s+[\d,]+ tokens/s", text)
    assert re.search(r"-> packed is [\d.]+x (faster|slower) than padding", text)
    assert "median of 3 interleaved repeats" in text
    for name in ("mask.png", "block_mask.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"wrote {(tmp_path / name).resolve()}" in text  # says where


def test_demo_fails_when_documents_leak(tmp_path, capsys, monkeypatch):
    """A model whose mask lets documents see each other must make the demo exit non-zero."""
    import flexpack.models.gpt as gpt

    build = gpt.document
    # One document per row: plain causal attention over the packed row.
    monkeypatch.setattr(gpt, "document", lambda d: build(torch.zeros_like(d)))
    assert demo.main(out=str(tmp_path), **SMALL) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_demo_without_matplotlib_skips_the_png(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert demo.main(out=str(tmp_path), **SMALL) == 0
    assert "skipped the mask PNGs: matplotlib is not installed" in capsys.readouterr().out
    assert not (tmp_path / "mask.png").exists()


@pytest.mark.parametrize("text", ["", "héllo, wörld", "The Zen of Python"])
def test_byte_tokenizer_round_trips(text):
    assert bytes(demo.tokenize_bytes(text).tolist()).decode("utf-8") == text


@pytest.mark.parametrize(
    "bad", [dict(num_docs=0), dict(batch_rows=0), dict(max_len=0), dict(max_len=True)]
)
def test_demo_rejects_bad_settings(bad, tmp_path):
    with pytest.raises(ValueError):
        demo.main(out=str(tmp_path), **{**SMALL, **bad})


def test_demo_refuses_settings_that_run_for_minutes(tmp_path, capsys):
    """Issue 11: `flexpack demo --max-len 3` ran over 300 s (82,407 pieces, each run alone)."""
    with pytest.raises(ValueError, match=r"82,407 pieces.*max_len >= 128, or fewer"):
        demo.main(out=str(tmp_path), max_len=3)
    assert capsys.readouterr().out == ""  # refused before any work


def test_demo_explains_pieces_and_says_slower_when_slower(tmp_path, capsys, monkeypatch):
    """Issue 11: 601 documents vs 659 pieces went unexplained, and a 0.73x gain was printed as
    "packed gains 0.73x"."""
    monkeypatch.setattr(
        demo,
        "_time_forwards",
        lambda model, layouts, **kw: demo._Speed(dict.fromkeys(layouts, 1.0), 0.5),
    )
    assert demo.main(out=str(tmp_path), **{**SMALL, "max_len": 100, "num_docs": 5}) == 0
    text = capsys.readouterr().out
    assert re.search(r"\d+ documents are longer than 100 tokens: each is split", text)
    assert "5 documents become" in text and "pieces below" in text
    assert "-> packed is 2.00x slower than padding each batch to its longest" in text


def test_gain_is_the_median_of_interleaved_repeats(monkeypatch):
    """One disturbed repeat does not move the reported gain."""
    clock = iter(
        # repeat 0 (order a, b): a 2 s, b 1 s; repeat 1 (b, a): b 1 s, a 2 s;
        # repeat 2 (a, b): a 20 s (a load spike), b 1 s. One chunk each.
        [0, 2, 2, 3, 3, 4, 4, 6, 6, 26, 26, 27]
    )
    monkeypatch.setattr(demo.time, "perf_counter", lambda: next(clock))
    model = lambda **kw: None
    layouts = {"a": [dict(x=1)], "b": [dict(x=2)]}
    speed = demo._time_forwards(model, layouts, repeats=3, chunks=1)
    assert speed.gain == 2.0 and speed.seconds == {"a": 2, "b": 1}
