"""Every docs page stays true: each ```python block of README.md and docs/*.md runs as written.

Pages are found by glob, so a new page is tested the day it lands. The blocks of a page run in
order in one namespace, in a fresh working directory: a block of ``>>>`` lines runs as a doctest
(its printed output must match), any other block is executed. A page's printed output must also
contain what the page shows after a ``prints`` line, and the pictures it links must exist and be
drawn by one of the scripts docs/make_*.py (so that every picture can be redrawn from the code).

Markers (HTML comments, invisible on the rendered page):

- ``<!-- docs-test: requires MOD[, MOD ...] -->`` anywhere in a page: the importable modules its
  code needs (the page also names the extra that installs them); without them the page skips,
  saying which is missing.
- ``<!-- docs-test: skip REASON -->`` on the line right before a fence: that block does not run
  here, and REASON says why and what runs it instead (a GPU, several processes, a download,
  another virtual environment). Keep these rare.
"""

from __future__ import annotations

import doctest
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(
    r"^(?:<!-- docs-test: skip (?P<skip>.+?) -->\n)?```python\n(?P<code>.*?)^```", re.S | re.M
)
REQUIRES = re.compile(r"<!-- docs-test: requires (.+?) -->")
# Pictures a page links: img/... from docs/*.md, docs/img/... from README.md.
PICTURE = re.compile(r"\]\(((?:docs/)?img/[^)]+\.png)\)")
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def blocks(text: str) -> list[tuple[str, str | None]]:
    """(code, skip reason or None) of every ```python block, in page order."""
    return [(m["code"], m["skip"]) for m in FENCE.finditer(text)]


def shown_output(text: str) -> list[str]:
    """The lines of the plain ``` blocks that follow a line reading ``prints`` (or ``prints
    (abridged)``), "..." lines left out."""
    lines = []
    for part in re.split(r"^prints(?: \(abridged\))?\n", text, flags=re.M)[1:]:
        block = re.match(r"\s*```\n(.*?)^```", part, flags=re.S | re.M)
        if block:
            lines += [line for line in block[1].splitlines() if line.strip() != "..."]
    return lines


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_page_blocks_run(page, tmp_path, monkeypatch, capsys):
    text = page.read_text()
    for spec in REQUIRES.findall(text):
        for module in (m.strip() for m in spec.split(",")):
            pytest.importorskip(module, reason=f"{page_id(page)} needs {module}")
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": f"docs_{page.stem}"}
    parser, runner = doctest.DocTestParser(), doctest.DocTestRunner(optionflags=FLAGS)
    ran = 0
    for i, (code, skip) in enumerate(blocks(text)):
        if skip is not None:
            continue
        where = f"{page_id(page)} python block {i}"
        if code.lstrip().startswith(">>>"):
            test = parser.get_doctest(code, namespace, where, str(page), 0)
            report: list[str] = []
            result = runner.run(test, out=report.append, clear_globs=False)
            namespace.update(test.globs)  # DocTest runs on a copy of the namespace
            assert result.failed == 0, f"{where} failed:\n{''.join(report)}"
        else:
            try:
                exec(compile(code, where, "exec"), namespace)
            except Exception as err:  # pragma: no cover - the message is the point
                raise AssertionError(f"{where} failed:\n{code}") from err
        ran += 1
    printed = capsys.readouterr().out
    for line in shown_output(text):
        assert line in printed, f"{page_id(page)} shows {line!r}, which its code did not print"
    if not ran:
        assert not blocks(text) or all(skip for _, skip in blocks(text))


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_page_names_its_extras_and_pictures(page):
    text = page.read_text()
    for spec in REQUIRES.findall(text):
        # A page that needs more than the core names the install line of its extras.
        assert re.search(r"pip install -e '\.\[[a-z0-9,]+\]'", text), (
            f"{page_id(page)} needs {spec} but names no pip install -e '.[extra]' line"
        )
        for module in (m.strip() for m in spec.split(",")):
            assert re.fullmatch(r"[A-Za-z_][\w.]*", module), module
    for _, skip in blocks(text):
        assert skip is None or len(skip) > 10, f"{page_id(page)}: say why a block is skipped"
    for name in re.findall(PICTURE, text):
        assert (page.parent / name).read_bytes()[:4] == b"\x89PNG", name


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_every_picture_a_page_shows_is_drawn_by_a_generator(tmp_path):
    """docs/make_*.py redraw every picture of docs/img/ that a page links, from flexpack's own
    output: a picture no script draws would go stale the first time the code changes."""
    pytest.importorskip("matplotlib")
    drawn: set[str] = set()
    for script in sorted((ROOT / "docs").glob("make_*.py")):
        spec = importlib.util.spec_from_file_location(f"docs_{script.stem}", script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        out = tmp_path / script.stem
        module.main(out)
        made = {p.name for p in out.glob("*.png")}
        assert made, f"{script.name} drew nothing into {out}"
        drawn |= made
    linked = {Path(name).name for page in PAGES for name in re.findall(PICTURE, page.read_text())}
    assert linked, "no page links a picture"
    assert linked <= drawn, f"no docs/make_*.py draws {sorted(linked - drawn)}"


def test_every_page_is_found():
    names = {page_id(p) for p in PAGES}
    assert {"README.md", "docs/masks.md", "docs/trees.md", "docs/streaming.md"} <= names
    assert importlib.util.find_spec("flexpack") is not None


def test_docs_say_trls_packing_default_as_trl_has_it(tmp_path):
    # docs/integrations.md said TRL's default is packing=True; TRL 1.16's is False.
    from pathlib import Path

    trl = pytest.importorskip("trl")
    page = (Path(__file__).resolve().parents[1] / "docs" / "integrations.md").read_text()
    default = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True).packing
    assert f"`packing={default}` is TRL's default" in page
    assert "TRL's defaults: `packing=True`" not in page
