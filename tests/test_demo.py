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
    packed = re.search(r"flexpack\.pack \(bfd\), rows of 256\s+(\d+)\s+[\d,]+\s+([\d.]+)%", text)
    padded = re.search(r"one document per row, padded to 256\s+(\d+)\s+[\d,]+\s+([\d.]+)%", text)
    assert packed and padded, text
    assert int(packed[1]) < int(padded[1]) and float(packed[2]) > float(padded[2])
    diff = re.search(r"largest \|logit difference\| (\S+) \(tolerance 1e-04\) -> OK", text)
    assert diff and float(diff[1]) <= 1e-4, text
    assert re.search(r"packed \(flexpack\.attention\)\s+[\d.]+ s\s+[\d,]+ tokens/s", text)
    assert "packed gains" in text
    for name in ("mask.png", "block_mask.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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


@pytest.mark.parametrize("bad", [dict(num_docs=0), dict(batch_rows=0), dict(max_len=0)])
def test_demo_rejects_bad_settings(bad, tmp_path):
    with pytest.raises(ValueError):
        demo.main(out=str(tmp_path), **{**SMALL, **bad})
