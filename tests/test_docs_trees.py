"""docs/trees.md stays true: its python blocks run in order, print what the page shows, and its
pictures exist."""

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGE = (DOCS / "trees.md").read_text()


def fenced_blocks(text, lang):
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def test_python_blocks_run_in_order(capsys):
    pytest.importorskip("transformers")
    namespace = {"__name__": "docs_trees"}
    blocks = fenced_blocks(PAGE, "python")
    assert len(blocks) >= 4
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"docs/trees.md python block {i}", "exec"), namespace)
        except Exception as err:  # pragma: no cover - the message is the point
            raise AssertionError(f"python block {i} of docs/trees.md failed:\n{block}") from err
    printed = capsys.readouterr().out.splitlines()
    shown = [
        line
        for part in PAGE.split("\nprints\n")[1:]
        for line in fenced_blocks(part, "")[0].splitlines()
    ]
    assert len(shown) >= 5
    assert shown == printed


def test_pictures_exist():
    names = re.findall(r"\]\((img/[^)]+\.png)\)", PAGE)
    assert len(names) >= 2
    for name in names:
        assert (DOCS / name).read_bytes()[:4] == b"\x89PNG", name
