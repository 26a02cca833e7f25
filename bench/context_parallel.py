"""Context parallelism for packed rows: how evenly each balancer spreads the attention work, what
a CP step costs on CPU, and data-parallel balance by compute instead of tokens.

    python bench/context_parallel.py --write bench/results/context_parallel.md
    python bench/context_parallel.py --quick          # smaller, for a smoke run
    python bench/context_parallel.py --memory-only    # 4: ring vs all-gather (W = 4 and 8)
    python bench/context_parallel.py --balance-only   # 5: short rows, plan time

1. Imbalance. Rows of S = 32K and 128K tokens; lognormal documents (sigma 1.0) of median 300,
   1000, 3000 and 8000 tokens, each row with one long document of 30-60% of S; 4 rows per
   setting. Per rank, work = (query, key) pairs the document-causal mask allows for its queries,
   counted exactly; the table gives max / mean over the ranks (1.00 is perfect; the slowest rank
   sets the step time), averaged over the rows. Columns:

   - contiguous: rank r holds tokens r * S/W .. (r + 1) * S/W - 1 (no balancing).
   - torch head-tail: ``_HeadTailLoadBalancer`` (torch's default for causal CP; ignores documents).
   - torch PTRR: ``_PTRRLoadBalancer`` (flex only) on the document-causal BlockMask of 128-token
     blocks, as a torch user would build it.
   - flexpack: ``shard_context(balance="work")``.
   - torch per-doc head-tail: ``_PerDocumentHeadTailLoadBalancer``, which asserts that every
     document length is a multiple of 2W. It runs on a variant of each row whose lengths are
     rounded to multiples of 2W (the last document absorbs the rest); flexpack on the same
     variant rows sits beside it. Two columns: the split ``_context_parallel_shard`` makes of
     its indices (rank r takes the r-th contiguous S/W; torch 2.13 lists the indices document
     by document, so rank 0 gets the first documents whole), and the rank-major regrouping its
     docstring draws (each rank a head and a tail chunk of every document).

2. Wall time of one CP forward + backward of attention (float32, B=1, H=4, D=64, S=4096) on CPU,
   gloo, world 2 and 4 (one process per rank on this machine's cores), vs one process running
   flexpack.attention on the whole row; median of interleaved repeats, as ratios. On a 2-core
   machine shared with other jobs, 4 processes contend for 2 cores: the ratios say what the
   all-gather and the split cost here, not what 4 GPUs gain.

4. Ring vs all-gather (``--memory-only``): per-rank memory kept from forward to backward, peak
   memory and bytes sent (``shard.stats``) of one attention forward + backward under each
   schedule, S = 16K-128K, W = 4 and 8 (gloo, one process per rank), tiny heads (2 x 16) so
   the CPU time stays in minutes; and what ``schedule="auto"`` picks.

5. Short rows (``--balance-only``; also in the full run): the worst row's max / mean at 4K and
   8K on the bundled corpus and lognormal rows, W = 2, 4, 8; plan time at 128K (CPU and wall,
   a new layout and a cached one).

3. Data-parallel balance. Rows packed with ``flexpack.pack`` (bfd) are dealt to W = 4 ranks,
   one row per rank per step, by ``shard_rows(shuffle=True)`` with cost = tokens (today's
   default), verl's ``24576 * s + s^2`` per document, or ``flops_weights`` of the model. Each
   row's true cost is the model's ``a * tokens + b * sum(len^2)``; per step, max / mean over the
   ranks; "lost" = sum over steps of (max - mean) / sum of max, the share of the ranks' time
   spent waiting for the slowest. Data: the bundled corpus (601 texts, UTF-8 bytes as tokens,
   rows of 4096) and a long-tailed lognormal (median 600, sigma 1.6, clipped to 32K, rows of
   32K). Model: Llama-3-8B-like dims (params 7e9, 32 layers, hidden 4096).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _machine import describe  # bench/ is on sys.path when run as a script

import flexpack
from flexpack.data import flops_weights, shard_rows
from flexpack.parallel import _token_work, shard_context

CORPUS = Path(flexpack.__file__).parent / "assets" / "corpus.jsonl"


# ------------------------------------------------------------------------------- imbalance


def lognormal_row(S: int, median: int, rng: np.random.Generator, multiple: int = 1) -> np.ndarray:
    """(S,) doc ids: one long document of 30-60% of S among lognormal ones; lengths rounded
    to ``multiple`` (the last document takes the rest, a multiple too when S is)."""
    lengths = [int(S * rng.uniform(0.3, 0.6))]
    while sum(lengths) < S:
        lengths.append(max(1, int(rng.lognormal(np.log(median), 1.0))))
    rng.shuffle(lengths)
    if multiple > 1:
        lengths = [max(multiple, round(n / multiple) * multiple) for n in lengths]
        out, total = [], 0
        for n in lengths:
            if total + n >= S:
                break
            out.append(n)
            total += n
        lengths = [*out, S - total]
    ids = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)])[:S]
    return ids


def imbalance_of(ids: np.ndarray, order: np.ndarray, world: int) -> float:
    """max / mean work over ranks when rank r holds ``order[r * S/W : (r + 1) * S/W]``."""
    work, _ = _token_work(ids)
    per = work[order].reshape(world, -1).sum(1)
    return float(per.max() / per.mean())


def torch_orders(ids: np.ndarray, world: int) -> dict[str, np.ndarray | None]:
    from torch.distributed.tensor.experimental._context_parallel import (
        _HeadTailLoadBalancer,
        _PerDocumentHeadTailLoadBalancer,
        _PTRRLoadBalancer,
    )

    S = ids.shape[0]
    out: dict[str, np.ndarray | None] = {}
    out["torch head-tail"] = _HeadTailLoadBalancer(S, world, "cpu")._generate_indices()[0].numpy()
    d = torch.from_numpy(ids)[None]
    block_mask = flexpack.document_causal_mask(d, block_size=128)
    ptrr = _PTRRLoadBalancer(block_mask, world)._generate_indices()[0].numpy()
    out["torch PTRR"] = ptrr
    _, counts = np.unique(ids, return_counts=True)
    lengths = counts[np.argsort(np.unique(ids, return_index=True)[1])].tolist()
    try:
        per_doc = _PerDocumentHeadTailLoadBalancer([lengths], world, "cpu")._generate_indices()
        per_doc = per_doc[0].numpy()
    except AssertionError:  # a length that is not a multiple of 2W
        out["torch per-doc head-tail"] = out["torch per-doc, as documented"] = None
        return out
    # What _context_parallel_shard does with it: rank r takes the r-th contiguous S/W of the
    # order, which torch 2.13 lists document by document ([doc 0: rank 0's head and tail,
    # rank 1's, ...], then doc 1), so rank 0 gets the first documents whole.
    out["torch per-doc head-tail"] = per_doc
    # Its docstring's intent: every rank takes its head and tail chunk of every document.
    pieces, start = [[] for _ in range(world)], 0
    for n in lengths:
        chunk = n // (2 * world)
        for r in range(world):
            pieces[r].append(per_doc[start + 2 * r * chunk : start + 2 * (r + 1) * chunk])
        start += n
    out["torch per-doc, as documented"] = np.concatenate([np.concatenate(p) for p in pieces])
    return out


def flexpack_order(ids: np.ndarray, world: int, balance: str = "work") -> np.ndarray:
    s = shard_context(torch.from_numpy(ids)[None], world, 0, balance=balance)
    return s.gathered_index[0].numpy()


def imbalance_table(sizes, medians, worlds, rows: int) -> list[str]:
    lines = [
        "| S | median | W | contiguous | torch head-tail | torch PTRR | flexpack | "
        "torch per-doc head-tail (lengths % 2W == 0), as torch shards it | the same, rank-major "
        "as its docstring shows | flexpack (same rows) | flexpack plan time |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for S in sizes:
        for median in medians:
            for world in worlds:
                rng = np.random.default_rng([S, median, world])
                cols: dict[str, list[float]] = {}
                plan_time = []
                for _ in range(rows):
                    ids = lognormal_row(S, median, rng)
                    even = lognormal_row(S, median, rng, multiple=2 * world)
                    t = time.perf_counter()
                    fp = flexpack_order(ids, world)
                    plan_time.append(time.perf_counter() - t)
                    orders = {"contiguous": np.arange(S), **torch_orders(ids, world)}
                    orders["flexpack"] = fp
                    for name, order in orders.items():
                        if not name.startswith("torch per-doc"):
                            cols.setdefault(name, []).append(imbalance_of(ids, order, world))
                    even_orders = torch_orders(even, world)
                    for name, key in (("per-doc", "torch per-doc head-tail"),
                                      ("per-doc-doc", "torch per-doc, as documented")):  # fmt: skip
                        order = even_orders[key]
                        cols.setdefault(name, []).append(imbalance_of(even, order, world))
                    cols.setdefault("fp-even", []).append(
                        imbalance_of(even, flexpack_order(even, world), world)
                    )
                m = {k: statistics.mean(v) for k, v in cols.items()}
                lines.append(
                    f"| {S // 1024}K | {median} | {world} | {m['contiguous']:.3f} | "
                    f"{m['torch head-tail']:.3f} | {m['torch PTRR']:.3f} | "
                    f"**{m['flexpack']:.3f}** | {m['per-doc']:.3f} | {m['per-doc-doc']:.3f} | "
                    f"{m['fp-even']:.3f} | "
                    f"{statistics.median(plan_time) * 1e3:.0f} ms |"
                )
                print(lines[-1], flush=True)
    return lines


def corpus_rows(S: int) -> list[np.ndarray]:
    """The bundled corpus (UTF-8 bytes as tokens) packed into rows of S tokens, as doc ids."""
    seg = flexpack.pack(corpus_lengths(), S, overflow="split").segments
    rows = []
    for r in np.unique(seg[:, 0]):
        n = seg[seg[:, 0] == r][:, 3] - seg[seg[:, 0] == r][:, 2]
        ids = np.full(S, -1)
        ids[: n.sum()] = np.repeat(np.arange(n.size), n)
        rows.append(ids)
    return rows


def short_rows_table() -> list[str]:
    """Worst row's max / mean at 4K and 8K (every corpus row, 12 lognormal rows), and the plan
    time at 128K: cold (a new layout) and cached (the layout again), one thread."""
    from flexpack import parallel

    lines = [
        "| S | rows | W | worst row: contiguous | head-tail (torch's) | flexpack |",
        "|---|---|---|---|---|---|",
    ]
    for S in (4096, 8192):
        rng = np.random.default_rng(S)
        rows = corpus_rows(S) + [lognormal_row(S, m, rng) for m in (300, 1000, 3000, 8000)
                                 for _ in range(3)]  # fmt: skip
        for world in (2, 4, 8):
            worst = {}
            for ids in rows:
                d = torch.from_numpy(ids)[None]
                for name, balance in (("contiguous", "contiguous"), ("head-tail", "head_tail"),
                                      ("flexpack", "work")):  # fmt: skip
                    imb = shard_context(d, world, 0, balance=balance).imbalance
                    worst[name] = max(worst.get(name, 1.0), imb)
            lines.append(
                f"| {S // 1024}K | {len(rows)} | {world} | {worst['contiguous']:.3f} | "
                f"{worst['head-tail']:.3f} | **{worst['flexpack']:.3f}** |"
            )
            print(lines[-1], flush=True)
    torch.set_num_threads(1)
    rng = np.random.default_rng(128)
    lines += [
        "",
        "Plan time at 128K (median of 6 rows): CPU time of the process (what the planning costs"
        " one core, whatever else runs) and wall time.",
        "",
        "| S | W | new layout: CPU | wall | cached layout: CPU | wall |",
        "|---|---|---|---|---|---|",
    ]
    for world in (2, 4, 8):
        times: dict[str, list[float]] = {}
        for median in (300, 1000, 3000, 8000, 300, 3000):
            d = torch.from_numpy(lognormal_row(131072, median, rng))[None]
            parallel._PLANS.clear()
            for name, rank in (("cold", 0), ("cached", 1)):
                t, c = time.perf_counter(), time.process_time()
                shard_context(d, world, rank)
                times.setdefault(name + " cpu", []).append(time.process_time() - c)
                times.setdefault(name + " wall", []).append(time.perf_counter() - t)
        m = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        lines.append(f"| 128K | {world} | {m['cold cpu']:.0f} ms | {m['cold wall']:.0f} ms | "
                     f"{m['cached cpu']:.1f} ms | {m['cached wall']:.1f} ms |")  # fmt: skip
        print(lines[-1], flush=True)
    return lines


# ------------------------------------------------------------------------------- wall time

WALL_S, WALL_H, WALL_D, REPEATS = 4096, 4, 64, 5


def _wall_ids() -> torch.Tensor:
    return torch.from_numpy(lognormal_row(WALL_S, 300, np.random.default_rng(7)))[None]


def _qkv(S: int):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, WALL_H, S, WALL_D, generator=g) for _ in range(3)]


def _single_process() -> list[float]:
    d = _wall_ids()
    mask = flexpack.masks.document(d) & flexpack.masks.causal()
    q, k, v = (x.requires_grad_() for x in _qkv(WALL_S))
    times = []
    for _ in range(REPEATS + 1):
        t = time.perf_counter()
        flexpack.attention(q, k, v, mask).sum().backward()
        times.append(time.perf_counter() - t)
    return times[1:]


def _cp_worker(rank: int, world: int, init: str, out: str, balance: str) -> None:
    import torch.distributed as dist

    from flexpack.parallel import context_parallel_attention

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    d = _wall_ids()
    shard = shard_context(d, world, rank, balance=balance)
    q, k, v = (shard.take(x, dim=2).requires_grad_() for x in _qkv(WALL_S))
    times = []
    for _ in range(REPEATS + 1):
        dist.barrier()
        t = time.perf_counter()
        context_parallel_attention(q, k, v, shard).sum().backward()
        dist.barrier()  # the step ends when the slowest rank does
        times.append(time.perf_counter() - t)
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times[1:], "imbalance": shard.imbalance}))


def _cp_times(world: int, balance: str) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_cp_worker, args=(world, os.path.join(tmp, "init"), out, balance), nprocs=world)
        return json.loads(Path(out).read_text())


def _slowest_local(world: int, balance: str) -> float:
    """Largest per-rank time of the local attention alone (k, v given whole: no collective),
    forward + backward, over the one-process time; the ranks run one after the other in this
    process, interleaved with the one-process call, medians of the repeats."""
    from flexpack.parallel import _local_attention

    d = _wall_ids()
    mask = flexpack.masks.document(d) & flexpack.masks.causal()
    q, k, v = (x.requires_grad_() for x in _qkv(WALL_S))
    shards = [shard_context(d, world, r, balance=balance) for r in range(world)]
    local_q = [s.take(q.detach(), dim=2).requires_grad_() for s in shards]
    calls = [lambda: flexpack.attention(q, k, v, mask)] + [
        (lambda s=s, ql=ql: _local_attention(ql, k, v, s, mask="document_causal", scale=None,
                                             enable_gqa=False, softcap=None))
        for s, ql in zip(shards, local_q, strict=True)
    ]  # fmt: skip
    times: list[list[float]] = [[] for _ in calls]
    for repeat in range(REPEATS + 1):
        for i, call in enumerate(calls):
            t = time.perf_counter()
            call().sum().backward()
            if repeat:
                times[i].append(time.perf_counter() - t)
    one, *ranks = (statistics.median(t) for t in times)
    return max(ranks) / one


def wall_table() -> list[str]:
    torch.set_num_threads(1)  # one core per process everywhere, the ranks' too
    one = statistics.median(_single_process())
    lines = [
        f"One process, flexpack.attention on the whole row (1 thread): {one * 1e3:.0f} ms per "
        "forward + backward.",
        "",
        "| world | balance | work max / mean | CP step (gloo, W processes) / one process | "
        "slowest rank's local attention (no collective) / one process |",
        "|---|---|---|---|---|",
    ]
    for world in (2, 4):
        for balance in ("contiguous", "work"):
            res = _cp_times(world, balance)
            ratio = statistics.median(res["times"]) / one
            local = _slowest_local(world, balance)
            lines.append(
                f"| {world} | {balance} | {res['imbalance']:.2f} | {ratio:.2f} | {local:.2f} |"
            )
            print(lines[-1], flush=True)
    return lines


# ------------------------------------------------------------------------------- ring vs all-gather

MEM_H, MEM_D, MEM_MEDIAN = 2, 16, 300


def _live_and_peak(fn):
    """(result, peak live tensor bytes during fn, bytes still live when it returns) from the
    CPU profiler's allocation events (tensors allocated before fn do not count)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return out, peak, live


def _mem_row(S: int) -> np.ndarray:
    """(S,) doc ids: lognormal documents of median MEM_MEDIAN (no long one: the memory and the
    bytes do not depend on it, the CPU time does), the last 1/64 padding."""
    rng = np.random.default_rng(S)
    lengths = np.maximum(1, rng.lognormal(np.log(MEM_MEDIAN), 1.0, S // 10).astype(np.int64))
    lengths = lengths[np.cumsum(lengths) <= S - S // 64]
    ids = np.full(S, -1)
    ids[: lengths.sum()] = np.repeat(np.arange(lengths.size), lengths)
    return ids


def _mem_step(shard, full: list[torch.Tensor], schedule: str) -> dict:
    """One attention forward + backward of this rank under ``schedule``: memory and bytes."""
    import torch.distributed as dist

    from flexpack.parallel import context_parallel_attention

    q, k, v = (shard.take(x, dim=2).requires_grad_() for x in full)
    dist.barrier()
    t = time.perf_counter()
    o, fwd_peak, kept = _live_and_peak(
        lambda: context_parallel_attention(q, k, v, shard, schedule=schedule)
    )
    _, bwd_peak, _ = _live_and_peak(lambda: o.sum().backward())
    dist.barrier()
    wall = time.perf_counter() - t
    return dict(S=shard.shape[1], schedule=schedule, kept=kept, peak=max(fwd_peak, kept + bwd_peak),
                sent=shard.stats.bytes_sent, wall=wall)  # fmt: skip


def _mem_worker(rank: int, world: int, init: str, out: str, sizes: list[int]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    rows = []
    for S in sizes:
        d = torch.from_numpy(_mem_row(S))[None]
        g = torch.Generator().manual_seed(0)
        full = [torch.randn(1, MEM_H, S, MEM_D, generator=g) for _ in range(3)]
        for schedule in ("all_gather", "ring"):
            rows.append(_mem_step(shard_context(d, world, rank), full, schedule))
    every = [None] * world
    dist.all_gather_object(every, rows)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(every))


def memory_table(sizes: list[int], worlds: list[int]) -> list[str]:
    import torch.multiprocessing as mp

    from flexpack.parallel import _auto_schedule

    kv_row = lambda S: 2 * S * MEM_H * MEM_D * 4  # k and v of the whole row, fp32
    lines = [
        f"One row of S tokens (lognormal documents, median {MEM_MEDIAN}, 1/64 padding), B=1, "
        f"H={MEM_H}, D={MEM_D}, float32, one attention forward + backward per rank (gloo, one "
        f"process per rank, 1 thread each). Per rank, the largest over the ranks: kept = "
        f"tensor bytes the layer holds from its forward to its backward (what every layer of a"
        f" model keeps without checkpointing), peak = peak live tensor bytes during forward + "
        f"backward, sent = bytes of K, V and their gradients sent (stats.bytes_sent). K+V of "
        f"the whole row is 2 * S * H * D * 4 bytes.",
        "",
        "| S | W | K+V of the row | schedule | kept | peak | sent | wall (s) | auto picks |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    mib = lambda b: f"{b / 2**20:.1f} MiB"
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "out.json")
            mp.spawn(_mem_worker, args=(world, os.path.join(tmp, "init"), out, sizes),
                     nprocs=world)  # fmt: skip
            every = json.loads(Path(out).read_text())
        for i, row in enumerate(every[0]):
            per_rank = [ranks[i] for ranks in every]
            S = row["S"]
            dummy = torch.empty(1, MEM_H, S // world, MEM_D)
            shard = shard_context(torch.zeros(1, S, dtype=torch.long), world, 0)
            auto = _auto_schedule(dummy, dummy, shard)
            lines.append(
                f"| {S // 1024}K | {world} | {mib(kv_row(S))} | {row['schedule']} | "
                f"{mib(max(r['kept'] for r in per_rank))} | "
                f"{mib(max(r['peak'] for r in per_rank))} | "
                f"{mib(max(r['sent'] for r in per_rank))} | "
                f"{max(r['wall'] for r in per_rank):.2f} | {auto} |"
            )
            print(lines[-1], flush=True)
    return lines


# ------------------------------------------------------------------------------- DP balance


def corpus_lengths() -> np.ndarray:
    with open(CORPUS, encoding="utf-8") as f:
        return np.array([len(json.loads(line)["text"].encode()) for line in f], dtype=np.int64)


def long_tail_lengths(n: int, cap: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.clip(np.round(rng.lognormal(np.log(600), 1.6, n)), 1, cap).astype(np.int64)


def dp_rows(lengths: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    plan = flexpack.pack(lengths, max_len, overflow="split")
    seg = plan.segments
    n = (seg[:, 3] - seg[:, 2]).astype(np.float64)
    tokens = np.bincount(seg[:, 0], weights=n, minlength=plan.num_rows)
    sq = np.bincount(seg[:, 0], weights=n**2, minlength=plan.num_rows)
    return tokens, sq


def dp_table(world: int, epochs: int) -> list[str]:
    a, b = flops_weights(params=7e9, layers=32, hidden=4096)
    data = {
        "bundled corpus (rows of 4096)": dp_rows(corpus_lengths(), 4096),
        "long-tailed lognormal (rows of 32K)": dp_rows(long_tail_lengths(20000, 32768), 32768),
    }
    costs = {
        "tokens": dict(cost="tokens"),
        "verl 24576*s + s^2": dict(cost="flops", flops=(24576.0, 1.0)),
        "flops_weights(7e9, 32, 4096)": dict(cost="flops", flops=(a, b)),
    }
    lines = [
        f"W = {world} ranks, one row per rank per step, {epochs} shuffled epochs; true cost "
        f"a * tokens + b * sum(len^2) with (a, b) = flops_weights(params=7e9, layers=32, "
        "hidden=4096).",
        "",
        "| data | rows | cost dealt by | per-step max / mean (mean) | worst step | lost |",
        "|---|---|---|---|---|---|",
    ]
    for name, (tokens, sq) in data.items():
        true = a * tokens + b * sq
        for label, kw in costs.items():
            ratios, maxes, means = [], [], []
            for epoch in range(epochs):
                shards = shard_rows(tokens, world, shuffle=True, epoch=epoch, sum_sq=sq, **kw)
                per = true[shards]  # (W, steps)
                ratios.extend((per.max(0) / per.mean(0)).tolist())
                maxes.append(per.max(0).sum())
                means.append(per.mean(0).sum())
            lost = 1 - sum(means) / sum(maxes)
            lines.append(
                f"| {name} | {len(tokens)} | {label} | {statistics.mean(ratios):.3f} | "
                f"{max(ratios):.3f} | {lost:.1%} |"
            )
            print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", type=Path, help="write the report (markdown) here")
    parser.add_argument("--quick", action="store_true", help="fewer rows, 32K only, no wall time")
    parser.add_argument("--wall-only", action="store_true", help="only the CPU wall times")
    parser.add_argument("--no-wall", action="store_true", help="skip the CPU wall times")
    parser.add_argument("--balance-only", action="store_true", help="only short rows, plan time")
    parser.add_argument(
        "--memory-only", action="store_true", help="only ring vs all-gather: memory, bytes moved"
    )
    args = parser.parse_args()
    if args.wall_only:
        print("\n".join(wall_table()))
        return
    if args.balance_only:
        print("\n".join(short_rows_table()))
        return
    if args.memory_only:
        sizes = [16384, 32768] if args.quick else [16384, 32768, 65536, 131072]
        print("\n".join(memory_table(sizes, [2, 4] if args.quick else [4, 8])))
        return
    head = [
        f"`python bench/context_parallel.py{' --quick' if args.quick else ''}`, "
        f"{datetime.date.today()}, {describe()}, torch {torch.__version__}.",
        "",
    ]
    sizes = (32768,) if args.quick else (32768, 131072)
    lines = [*head, "### Work imbalance (max / mean over ranks; 1.00 is even)", ""]
    lines += imbalance_table(sizes, (300, 1000, 3000, 8000), (2, 4, 8), 1 if args.quick else 4)
    if not args.quick:
        lines += ["", "### Short rows (worst row) and plan time", ""]
        lines += short_rows_table()
    lines += ["", "### Data-parallel balance by compute", ""]
    lines += dp_table(4, 2 if args.quick else 8)
    if not (args.quick or args.no_wall):
        lines += ["", "### CP forward + backward on CPU (gloo), relative to one process", ""]
        lines += wall_table()
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
