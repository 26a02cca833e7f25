"""PackedIterableDataset(sync_ranks=True) under a real torch.distributed group (gloo, 4 CPU
processes): every rank steps the same number of times, epoch after epoch, the union of the
tokens is the stream, and a state_dict resume in the middle of an epoch changes none of it."""

from __future__ import annotations

import datetime
import pickle
from collections import Counter

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4
EPOCHS = 2
RESUME_AT = 3  # steps into epoch 0, the run "restarts" from a state_dict


def _samples() -> list[list[int]]:
    """Samples with globally unique token ids, lognormal lengths, a few longer than max_len."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(20), 1.0, size=150).astype(int), 1, 200)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return [list(range(int(s), int(s + k))) for s, k in zip(starts, lengths, strict=True)]


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    from flexpack.data import PackedIterableDataset, collate

    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),  # a rank that stops early fails, not hangs
    )
    samples = _samples()

    def make() -> PackedIterableDataset:  # rank and world size from torch.distributed
        return PackedIterableDataset(samples, 64, buffer_size=16, overflow="split", sync_ranks=True)

    def loader(ds):
        return torch.utils.data.DataLoader(ds, batch_size=2, collate_fn=collate)

    steps, tokens, padding = [], [], 0
    for epoch in range(EPOCHS):
        ds, n, seen = make(), 0, Counter()
        batches = iter(loader(ds))
        while True:
            if epoch == 0 and n == RESUME_AT:  # checkpoint, throw everything away, resume
                state = pickle.loads(pickle.dumps(ds.state_dict()))
                assert all(isinstance(p, list) and len(p) == 3 for p in state["pending"])
                del batches, ds
                ds = make()
                ds.load_state_dict(state)
                batches = iter(loader(ds))
            batch = next(batches, None)
            if batch is None:
                break
            n += 1
            real = batch.doc_ids >= 0
            seen.update(batch.input_ids[real].tolist())
            # the collective every DDP step makes: a rank that runs out first would hang here
            work = torch.tensor([float(real.sum())])
            dist.all_reduce(work)
        steps.append(n)
        tokens.append(seen)
        padding += ds.stats.padding_rows
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, (steps, tokens, padding))
    if rank == 0:
        with open(f"{out_dir}/result.pkl", "wb") as f:
            pickle.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_gloo_four_ranks_equal_steps_every_token_once_with_resume(tmp_path):
    # A fork server that has imported torch and flexpack once forks the 4 ranks: a few seconds
    # instead of 4 fresh interpreters importing torch (and no fork of this threaded process).
    mp.set_forkserver_preload(["torch", "flexpack.data"])
    mp.start_processes(
        _worker,
        args=(str(tmp_path / "init"), str(tmp_path)),
        nprocs=WORLD,
        join=True,
        start_method="forkserver",
    )
    with open(tmp_path / "result.pkl", "rb") as f:
        gathered = pickle.load(f)
    stream = Counter(t for s in _samples() for t in s)
    for epoch in range(EPOCHS):
        steps = [g[0][epoch] for g in gathered]
        assert len(set(steps)) == 1 and steps[0] > RESUME_AT, steps
        union = sum((g[1][epoch] for g in gathered), Counter())
        assert union == stream  # every token once, across the resume too
    assert sum(g[2] for g in gathered) < WORLD  # padding rows only to even out the last step
