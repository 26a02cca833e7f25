"""What a release needs to agree on: one version everywhere, metadata, and an sdist that carries
the docs, the changelog and the tests (``.ci/wheel_check`` builds and installs them for real)."""

from __future__ import annotations

import ast
import fnmatch
import importlib.metadata
import re
from pathlib import Path

import pytest

import flexpack

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
VERSION = PROJECT["version"]


def _fallback_version() -> str:
    """The string flexpack/_version.py's _version() returns from a checkout that is not
    installed (read from the source: the import would ask the installed metadata first)."""
    tree = ast.parse((ROOT / "flexpack" / "_version.py").read_text())
    func = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_version")
    values = [
        n.value.value
        for n in ast.walk(func)
        if isinstance(n, ast.Return) and isinstance(n.value, ast.Constant)
    ]
    assert len(values) == 1, values
    return values[0]


def _changelog_sections() -> list[str]:
    return re.findall(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)


def test_one_version_in_pyproject_fallback_and_changelog():
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION), VERSION
    assert _fallback_version() == VERSION
    sections = _changelog_sections()
    assert sections and sections[0] == VERSION, f"CHANGELOG's top section is {sections[:1]}"
    assert len(set(sections)) == len(sections), "a version has two sections"


def test_changelog_top_section_reads_as_release_notes():
    text = (ROOT / "CHANGELOG.md").read_text()
    top = text.split("\n## ")[1]  # the newest section, up to the next version
    assert top.startswith(f"{VERSION} (")
    for part in ("### Highlights", "### Fixes", "### Breaking changes"):
        assert part in top, part


def test_installed_version_is_the_projects():
    installed = importlib.metadata.version("flexpack")
    if installed != VERSION:
        pytest.skip(
            f"the installed metadata says {installed}, pyproject.toml {VERSION}: an install made "
            "before the version changed (pip install -e . refreshes it)"
        )
    assert flexpack.__version__ == VERSION


def test_classifiers_and_keywords():
    classifiers = PROJECT["classifiers"]
    for wanted in (
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Science/Research",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ):
        assert wanted in classifiers, wanted
    # The SPDX expression says the license; setuptools >= 77 refuses a license classifier too.
    assert PROJECT["license"] == "Apache-2.0"
    assert not [c for c in classifiers if c.startswith("License ::")]
    python = re.compile(r"Programming Language :: Python :: 3\.(\d+)")
    pythons = sorted(int(m[1]) for c in classifiers if (m := python.fullmatch(c)))
    assert pythons == list(range(10, 14)), pythons
    assert PROJECT["requires-python"] == f">=3.{pythons[0]}"
    assert len(PROJECT["keywords"]) >= 3


def _manifest() -> list[list[str]]:
    lines = (ROOT / "MANIFEST.in").read_text().splitlines()
    return [line.split() for line in lines if line.strip() and not line.startswith("#")]


def test_sdist_manifest_carries_docs_changelog_and_tests():
    """Without docs/ in the sdist, tests/test_docs.py run from it checked the README alone."""
    rules = _manifest()
    assert ["include", "CHANGELOG.md"] in rules
    assert ["graft", "tests"] in rules
    docs = [rule[2:] for rule in rules if rule[:2] == ["recursive-include", "docs"]]
    assert docs, "no recursive-include docs line"
    patterns = [p for rule in docs for p in rule]
    files = [p for p in (ROOT / "docs").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    missed = [
        str(p.relative_to(ROOT))
        for p in files
        if not any(fnmatch.fnmatch(p.name, pat) for pat in patterns)
    ]
    assert not missed, f"MANIFEST.in leaves these docs files out of the sdist: {missed}"
    assert any(p.suffix == ".png" for p in files) and any(p.suffix == ".py" for p in files)


def test_wheel_check_script_is_there_and_strict():
    script = ROOT / ".ci" / "wheel_check"
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text
    assert "pip_install torch==2.13.0" in text  # pinned first: no multi-GB CUDA build
    assert "tests/test_docs.py" in text and 'flexpack" demo' in text
