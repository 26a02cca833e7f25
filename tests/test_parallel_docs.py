"""docs/context_parallel.md stays true: its python blocks run in order in one process, and its
torchrun script trains two steps on 2 CPU processes (gloo) at a small MAX_LEN, checking on the
way that the ranks' summed loss is the one-process loss of the whole row."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "context_parallel.md").read_text()


def _blocks(info: str) -> list[str]:
    return re.findall(rf"^```{info}\n(.*?)^```", PAGE, flags=re.S | re.M)


def test_python_blocks_run_in_order() -> None:
    namespace = {"__name__": "docs_context_parallel"}
    blocks = _blocks("python")
    assert len(blocks) >= 4
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"docs/context_parallel.md python block {i}", "exec"), namespace)
        except Exception as err:  # pragma: no cover - the message is the point
            raise AssertionError(f"python block {i} of docs/context_parallel.md failed") from err


def test_torchrun_script_trains_on_two_gloo_ranks(tmp_path) -> None:
    (script,) = _blocks("python torchrun")
    path = tmp_path / "train_cp.py"
    path.write_text(script)
    env = dict(os.environ, MAX_LEN="1024", CP="2", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(path)]  # fmt: skip
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "step 1: loss" in run.stdout
