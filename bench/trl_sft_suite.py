"""TRL's own SFT tests, run against trl.SFTTrainer and against flexpack's drop-in.

Copies TRL's ``tests/test_sft_trainer.py`` (with its ``testing_utils.py``, ``testing_constants.py``,
``conftest.py`` and ``data/``) from a TRL git repository at ``--rev`` into a temporary directory
and runs it with pytest twice: as it is, then with ``trl.SFTTrainer`` and
``trl.trainer.sft_trainer.SFTTrainer`` replaced by ``flexpack.integrations.trl.SFTTrainer`` (a
``conftest.py`` in the temporary directory sets both before the test module imports them; nothing
outside that run is touched). Prints passed / failed / skipped for both runs, the tests that fail
only with flexpack and those that fail only with TRL.

Offline, the Hub repositories the tests load get local stand-ins (``bench/_trl_hub.py``): TRL's
own dataset generator scripts at the same commit write ``trl-internal-testing/zen`` and its
siblings as parquet, and each ``trl-internal-testing/tiny-<Class>`` model becomes a random tiny
model of that class with a byte-level tokenizer and the family's chat template, written into a
Hub cache the run reads with ``HF_HUB_OFFLINE=1``. Families without a stand-in (the
vision-language models) fail on both sides ("no stand-in").

TRL's files are read from TRL's repository, never copied into flexpack. Names the file imports
from ``trl.trainer.sft_trainer`` that the installed TRL no longer has (the file is from another
release) become stubs that raise: the tests that use them fail on both sides ("API drift").

    python bench/trl_sft_suite.py --trl-git /path/to/trl/.git --rev f2cd57710ae3 [-k EXPR]

Speed is not measured here; the run takes about 10 minutes on 2 cores (two pytest sessions of
~260 tests, about 90 of them training a tiny model on the CPU).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import _trl_hub  # bench/ is on sys.path when run as a script

FILES = ("__init__.py", "conftest.py", "testing_utils.py", "testing_constants.py")
TEST = "test_sft_trainer.py"

# Names TRL's test files import from trl that the installed TRL lacks (another release): stubs.
SHIM = """\
import importlib
import re
from pathlib import Path

_IMPORT = re.compile(r"^from (trl[\\w.]*) import (\\([^)]*\\)|[^\\n]+)", re.M)
for _file in (Path(__file__).parent / "tests").glob("*.py"):
    for _module, _names in _IMPORT.findall(_file.read_text()):
        _mod = importlib.import_module(_module)
        for _part in re.sub(r"#[^\\n]*|[()]", "", _names).split(","):
            _name = _part.split()[0] if _part.split() else ""
            if not _name:
                continue
            if hasattr(_mod, _name):
                continue
            if _name.startswith("is_") and _name.endswith("_available"):
                setattr(_mod, _name, lambda: False)
                continue

            def _stub(*args, _name=f"{_module}.{_name}", **kwargs):
                raise NotImplementedError(f"API drift: {_name} is not in this TRL")

            setattr(_mod, _name, _stub)
"""

# pytest-datadir's fixture, which the one test that reads tests/data asks for.
DATADIR = """
import pathlib as _pathlib

import pytest as _pytest


@_pytest.fixture
def lazy_shared_datadir():
    return _pathlib.Path(__file__).parent / "tests" / "data"
"""

# The flexpack run: TRL's names point at the drop-in before the test module imports them.
SWAP = """
import trl
import trl.trainer.sft_trainer
from flexpack.integrations.trl import SFTTrainer as _Flexpack

trl.SFTTrainer = _Flexpack
trl.trainer.sft_trainer.SFTTrainer = _Flexpack
"""

NETWORK = re.compile(
    r"OfflineModeIsEnabled|LocalEntryNotFoundError|offline mode|HF_HUB_OFFLINE|"
    r"couldn't connect|Couldn't reach|ConnectionError|Max retries exceeded|"
    r"is not a local folder and is not a valid model identifier|"
    r"We couldn't connect to|Cannot find the requested files in the local cache|"
    r"FileNotFoundError: .*trl-internal-testing|DatasetNotFoundError",
    re.IGNORECASE,
)


def copy_tests(git_dir: str, rev: str, into: Path) -> str:
    """Write TRL's test files at ``rev`` under ``into / "tests"``; return the commit."""
    tests = into / "tests"
    tests.mkdir(parents=True)
    commit = subprocess.run(
        ["git", "--git-dir", git_dir, "rev-parse", f"{rev}^{{commit}}"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    data = subprocess.run(
        ["git", "--git-dir", git_dir, "ls-tree", "-r", "--name-only", commit, "tests/data/"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    for name in (*FILES, TEST, *(d.removeprefix("tests/") for d in data)):
        text = subprocess.run(
            ["git", "--git-dir", git_dir, "show", f"{commit}:tests/{name}"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        (tests / name).parent.mkdir(parents=True, exist_ok=True)
        (tests / name).write_text(text)
    return commit


def run(root: Path, flexpack: bool, extra: list[str]) -> dict[str, tuple[str, str]]:
    """Run the copied file under pytest; test id -> (outcome, message)."""
    standins = _trl_hub.LOAD_DATASET.format(root=str(root))
    (root / "conftest.py").write_text(SHIM + DATADIR + standins + (SWAP if flexpack else ""))
    report = root / ("flexpack.xml" if flexpack else "trl.xml")
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_CACHE=str(root / "hub"),
        HF_DATASETS_CACHE=str(root / "datasets_cache"),
        HF_MODULES_CACHE=str(root / "modules"),  # tiny-RemoteForCausalLM's code
    )
    cmd = [
        sys.executable, "-m", "pytest", "tests/" + TEST, "-q", "-p", "no:xdist",
        "-p", "no:cacheprovider", "-p", "no:randomly", f"--junitxml={report}",
        "--rootdir", str(root), "-o", "addopts=", *extra,
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    if not report.exists():
        sys.exit(f"pytest wrote no report ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr}")
    out = {}
    for case in ET.parse(report).iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                message = f"{child.get('message', '')}\n{child.text or ''}"
                break
            if child.tag == "skipped":
                outcome, message = "skipped", child.get("message", "")
        out[name] = (outcome, message)
    return out


MISSING: dict[str, str] = {}  # repo id -> why it has no stand-in (filled by main)


def kind(message: str) -> str:
    if any(repo_id in message for repo_id in MISSING):
        return "no stand-in"
    if "API drift" in message:
        return "API drift"
    if re.search(r"fixture '\w+' not found", message):
        return "missing pytest plugin"
    return "no network" if NETWORK.search(message) else "other"


def first_line(message: str) -> str:
    for line in message.splitlines():
        if line.strip():
            return line.strip()[:160]
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trl-git", required=True, help="a TRL git directory (bare or .git)")
    parser.add_argument("--rev", default="HEAD", help="tag or commit of TRL's tests")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args, extra = parser.parse_known_args()
    import torch
    import transformers
    import trl

    import flexpack

    root = Path(tempfile.mkdtemp(prefix="trl_sft_suite_"))
    commit = copy_tests(args.trl_git, args.rev, root)
    source = (root / "tests" / TEST).read_text()
    MISSING.update(_trl_hub.build(args.trl_git, commit, source, root))
    print(
        f"TRL tests at {args.rev} ({commit[:12]}); installed trl {trl.__version__}, "
        f"transformers {transformers.__version__}, torch {torch.__version__}, "
        f"flexpack {getattr(flexpack, '__version__', '?')}; in {root}"
    )
    for repo_id, why in sorted(MISSING.items()):
        print(f"no stand-in: {repo_id}: {why}")
    ours, theirs = run(root, True, extra), run(root, False, extra)
    for label, res in (("trl.SFTTrainer", theirs), ("flexpack SFTTrainer", ours)):
        c = collections.Counter(o for o, _ in res.values())
        why = collections.Counter(kind(m) for o, m in res.values() if o == "failed")
        print(
            f"{label:20s} {c['passed']:4d} passed {c['failed']:4d} failed {c['skipped']:4d} "
            f"skipped   (failed: {dict(why)})"
        )
    both = collections.Counter(
        kind(theirs[t][1] + ours[t][1])
        for t in ours
        if ours[t][0] == "failed" and theirs.get(t, ("",))[0] == "failed"
    )
    print(f"fail on both: {dict(both)}")
    only = sorted(t for t in ours if ours[t][0] == "failed" and theirs.get(t, ("",))[0] != "failed")
    print(f"failing only with flexpack: {len(only)}")
    for t in only:
        print(f"  {t}: {first_line(ours[t][1])}")
    trl_only = sorted(
        t for t in theirs if theirs[t][0] == "failed" and ours.get(t, ("",))[0] != "failed"
    )
    print(f"failing only with trl: {len(trl_only)}")
    for t in trl_only:
        print(f"  {t}: {first_line(theirs[t][1])}")
    if not args.keep:
        import shutil

        shutil.rmtree(root)


if __name__ == "__main__":
    main()
