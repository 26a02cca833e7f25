"""docs/context_parallel.md's torchrun script trains two steps on 2 CPU processes (gloo) at a small
MAX_LEN, checking on the way that the ranks' summed loss is the one-process loss of the whole row.
(The page's python blocks run in tests/test_docs.py, as every page's.)"""

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
