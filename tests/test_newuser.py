"""What a new user looks for first: a license, type hints that ship, a version, a clean dir()."""

from __future__ import annotations

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
