"""docs/context_parallel.md's torchrun scripts, launched as users launch them (torchrun, gloo on
CPU) at small sizes: the tiny model's two steps on 2 ranks, checking on the way that the ranks'
summed loss is the one-process loss of the whole row; and the long-context recipe, a tiny Llama
(transformers) trained over 4 CP ranks with the chunked loss, equal to one process in every
step's loss and the final weights. (The page's python blocks run in tests/test_docs.py, as every
page's.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "context_parallel.md").read_text()


def _script(name: str) -> str:
    """The ```python torchrun block whose first line names the script."""
    (script,) = [b for b in re.findall(r"^```python torchrun\n(.*?)^```", PAGE, flags=re.S | re.M)
                 if b.startswith(f"# {name}")]  # fmt: skip
    return script


def _torchrun(tmp_path: Path, name: str, nproc: int, **env: str) -> str:
    path = tmp_path / name
    path.write_text(_script(name))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="",
               **env)  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), str(path)]  # fmt: skip
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if run.returncode != 0 and _TEARDOWN_ABORT in run.stderr:
        # gloo's threads can abort a rank as its process group is torn down, after the script
        # has done its work (seen once, in a clean-clone CI run on a loaded machine): run it again
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


_TEARDOWN_ABORT = "terminate called without an active exception"


def test_torchrun_script_trains_on_two_gloo_ranks(tmp_path) -> None:
    out = _torchrun(tmp_path, "train_cp.py", 2, MAX_LEN="1024", CP="2")
    assert "step 1: loss" in out


def test_llama_recipe_over_four_cp_ranks_equals_one_process(tmp_path) -> None:
    pytest.importorskip("transformers")
    out = _torchrun(tmp_path, "train_llama_cp.py", 4, MAX_LEN="2048", STEPS="4", SCHEDULE="ring")
    assert "equal to one process: 4 losses and the final weights" in out
    assert "peak resident memory per rank" in out
