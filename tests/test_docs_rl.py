"""docs/rl.md stays true: its python blocks run in order and print what the page shows."""

import re
from pathlib import Path

import pytest

PAGE = (Path(__file__).resolve().parents[1] / "docs" / "rl.md").read_text()


def fenced_blocks(text, lang):
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def test_python_blocks_run_in_order(capsys, tmp_path, monkeypatch):
    pytest.importorskip("trl")
    monkeypatch.chdir(tmp_path)  # the recipes' output_dir
    namespace = {"__name__": "docs_rl"}
    blocks = fenced_blocks(PAGE, "python")
    assert len(blocks) == 4
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"docs/rl.md python block {i}", "exec"), namespace)
        except Exception as err:  # pragma: no cover - the message is the point
            raise AssertionError(f"python block {i} of docs/rl.md failed:\n{block}") from err
    printed = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("{")]
    shown = fenced_blocks(PAGE.split("\nprints\n")[1], "")[0].splitlines()
    assert shown == printed[-len(shown) :]
