"""docs/masks.md stays true: its python blocks run, its printed output and pictures exist."""

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGE = (DOCS / "masks.md").read_text()


def fenced_blocks(text, lang):
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_python_blocks_run_in_order(capsys):
    pytest.importorskip("matplotlib")
    namespace = {"__name__": "docs_masks"}
    blocks = fenced_blocks(PAGE, "python")
    assert len(blocks) >= 8
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"docs/masks.md python block {i}", "exec"), namespace)
        except Exception as err:  # pragma: no cover - the message is the point
            raise AssertionError(f"python block {i} of docs/masks.md failed:\n{block}") from err
    printed = capsys.readouterr().out
    # The abridged output shown after "prints (abridged)" is what the example prints.
    shown = PAGE.split("prints (abridged)", 1)[1]
    for line in fenced_blocks(shown, "")[0].splitlines():
        if line.strip() != "...":
            assert line in printed, line


def test_pictures_exist():
    names = re.findall(r"\]\((img/[^)]+\.png)\)", PAGE)
    assert len(names) >= 8
    for name in names:
        assert (DOCS / name).read_bytes()[:4] == b"\x89PNG", name
