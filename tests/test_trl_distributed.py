"""flexpack's TRL trainers on two CPU processes (gloo), launched as users launch them.

Each test starts ``tests/trl_distributed_worker.py`` on 2 ranks, which trains TRL's own trainer
and flexpack's in turn on the same data (HF Trainer wraps both in DistributedDataParallel), and
compares, on every rank: per-step losses (1e-5), final weights (1e-4), weights equal across the
ranks (the ranks see other data, so this holds only if DDP reduced the gradients), and
``flexpack_stats.fallbacks == 0`` (every log-prob forward ran as trees, through DDP's forward).
FSDP2 (``fully_shard`` by hand) compares the trainers' log-prob seams, values and reduced
gradients, on sharded models with a tied, an untied and a separately sharded LM head, and FSDP1
(``FullyShardedDataParallel``, ``use_orig_params=True``) the same once. (accelerate's FSDP
plugin is not used: accelerate drops it on CPU processes, MULTI_CPU.)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "trl_distributed_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    sys.path.insert(0, str(WORKER.parent))
    try:
        from trl_distributed_worker import tiny
    finally:
        sys.path.remove(str(WORKER.parent))
    path = tmp_path_factory.mktemp("tiny") / "llama"
    tiny().save_pretrained(path)
    return path


def launch(launcher: list[str], out: Path, model_dir: Path, *scenario: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               TOKENIZERS_PARALLELISM="false")  # fmt: skip
    cmd = [*launcher, str(WORKER), str(out), str(model_dir), *scenario]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]


def results(out: Path, scenario: str) -> list[dict]:
    return [json.loads((out / f"{scenario}-rank{r}.json").read_text()) for r in (0, 1)]


def check_trained_as_trl(ranks: list[dict], *, find_unused: bool) -> None:
    for r in ranks:
        assert r["world"] == 2 and r["wrapper"] == r["trl_wrapper"] == "DistributedDataParallel"
        assert r["find_unused"] is find_unused and r["checkpointing"]
        assert len(r["losses"]) == len(r["trl_losses"]) == 2
        assert r["losses"] == pytest.approx(r["trl_losses"], abs=1e-5)
        assert r["max_weight_diff"] < 1e-4 and r["moved"] > 1e-3
        assert r["calls"] >= 4 and r["fallbacks"] == 0
        assert r["tree_tokens"] < r["padded_tokens"]
        assert r["attn"] == "sdpa"  # the user's, restored after train()
    # The ranks forwarded other batches, yet hold the same weights: the gradients were reduced.
    assert ranks[0]["tree_tokens"] != ranks[1]["tree_tokens"]
    assert ranks[0]["checksum"] == pytest.approx(ranks[1]["checksum"], abs=1e-6)


def test_grpo_and_dpo_under_torchrun_equal_trls_ddp_run(tmp_path, model_dir):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2"]  # fmt: skip
    launch(torchrun, tmp_path, model_dir, "grpo,dpo")
    check_trained_as_trl(results(tmp_path, "grpo"), find_unused=False)
    check_trained_as_trl(results(tmp_path, "dpo"), find_unused=False)


def test_grpo_under_accelerate_launch_with_find_unused_parameters(tmp_path, model_dir):
    # On one machine accelerate starts CPU processes through mpirun only (MULTI_CPU); its
    # multi-process launcher (torchrun underneath) with use_cpu=True in the training
    # arguments gives the same gloo group of CPU processes.
    config = tmp_path / "accelerate.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_machines: 1\n"
        f"num_processes: 2\nmachine_rank: 0\nmain_process_ip: 127.0.0.1\n"
        f"main_process_port: {free_port()}\nmixed_precision: 'no'\nuse_cpu: false\n"
    )
    exe = Path(sys.executable).with_name("accelerate")  # the console script users run
    accelerate = [str(exe), "launch", "--config_file", str(config)]
    launch(accelerate, tmp_path, model_dir, "grpo", "find_unused")
    check_trained_as_trl(results(tmp_path, "grpo"), find_unused=True)


def test_fsdp2_and_fsdp1_by_hand_seams_equal_trls_on_sharded_heads(tmp_path, model_dir):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2"]  # fmt: skip
    launch(torchrun, tmp_path, model_dir, "fsdp2")
    for rank in results(tmp_path, "fsdp2"):
        for layout in ("untied", "tied", "lm_head_sharded", "fsdp1"):
            r = rank[layout]
            assert max(r["logp_diff"]) < 1e-5, layout
            assert max(r["grad_diff"]) < 1e-4 * r["grad_norm"], layout  # reduced gradients
            assert r["calls"] == (1 if layout == "fsdp1" else 2) and r["fallbacks"] == 0, layout
