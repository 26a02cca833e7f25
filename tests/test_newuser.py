"""What a new user looks for first: a license, type hints that ship, a version, a clean dir()."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import flexpack

ROOT = Path(__file__).resolve().parents[1]


def test_license_and_py_typed_ship():
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert "Version 2.0" in (ROOT / "LICENSE").read_text()
    assert (ROOT / "flexpack" / "py.typed").exists()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"py.typed"' in pyproject  # package-data, so wheels carry it
    assert 'license = "Apache-2.0"' in pyproject
    assert (ROOT / "CHANGELOG.md").read_text().startswith("# Changelog")


def test_version_flag_and_attribute():
    assert isinstance(flexpack.__version__, str) and flexpack.__version__[0].isdigit()
    out = subprocess.run(
        [sys.executable, "-m", "flexpack", "--version"], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"flexpack {flexpack.__version__}"


def test_dir_lists_the_public_names_not_the_helpers():
    names = dir(flexpack)
    for helper in ("Any", "TYPE_CHECKING", "importlib", "sys", "types", "annotations"):
        assert helper not in names, helper
    for name in flexpack.__all__:
        assert name in names, name
    assert "__version__" in names
    assert not [n for n in names if n.startswith("_") and not n.startswith("__")]


def test_demo_waits_report_progress_without_a_terminal(capsys):
    """Piped to a file (or without tqdm), the demo's long loops still print where they are."""
    import flexpack.demo as demo

    assert list(demo._progress(range(3), 3, "checking", every=0.0)) == [0, 1, 2]
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"  checking: {i}/3 (0 s)" for i in range(3)]


def test_demo_says_what_it_loads(tmp_path, capsys):
    import flexpack.demo as demo

    small = dict(max_len=256, num_docs=10, n_layer=1, n_embd=32, batch_rows=4, repeats=1)
    assert demo.main(out=str(tmp_path), **small) == 0
    out = capsys.readouterr().out
    assert "loading the compiled packer" in out
    assert out.index("loading the compiled packer") < out.index("packed and materialized")


def test_the_hf_extra_installs_what_the_trainer_blocks_need():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    hf = re.search(r"^hf = \[(.*)\]$", (root / "pyproject.toml").read_text(), re.M).group(1)
    assert "Trainer(" in (root / "docs" / "vlm.md").read_text()
    assert "transformers" in hf and "accelerate" in hf  # transformers.Trainer imports accelerate


def test_readme_offers_the_quick_demo_and_says_how_long_things_take():
    from pathlib import Path

    text = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    assert "flexpack demo --docs 64" in text
    assert (
        re.search(r"takes about \d+ minutes idle", text) and "45 minutes on a busy machine" in text
    )
