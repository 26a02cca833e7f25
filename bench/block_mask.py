"""BlockMask construction: flexpack (from doc ids) vs torch's create_block_mask, eager and compiled.

Usage:
    python bench/block_mask.py                 # the full table (about 5-6 minutes on 2 cores)
    python bench/block_mask.py --quick         # 4K and 16K only
    python bench/block_mask.py --out bench/results/block_mask.md

Two baselines, each labelled in the table:

- headline: what a user of torch writes, at torch's defaults: the document-causal mask_mod of
  attention-gym and torchtune (``doc[b, q] == doc[b, kv]`` & ``doc[b, q] >= 0`` & ``q >= kv``) in
  ``torch.compile(create_block_mask)``, at the default intra-op thread count; flexpack at the
  same thread count.
- second column: ``create_block_mask`` compiled on flexpack's own mask_mod (a clamped flat
  lookup), both at one thread: the comparison of earlier reports.

Every (S, B, method) runs in a fresh subprocess so peak memory is not polluted by the previous
config (compiled code, allocator caches). Per config it reports:
- time: median of the timed calls after one warm-up call (the compile for torch.compile).
- peak: the high-water mark of live torch tensor bytes during one call, from the profiler's
  allocation/free events (exact for tensors, blind to Python objects; works at every size,
  where RSS cannot resolve kilobytes).
- rss: ru_maxrss growth over the baseline taken after imports and input creation (includes the
  compile for the compiled method, and a few MB of one-time lazy initialization for every
  method); coarse (glibc at its defaults keeps freed blocks in its heap), but catches
  allocations the profiler cannot see.
- size: the BlockMask's own tensors (sum of nbytes), the denominator of "peak / size".

Document lengths: lognormal, median 300, sigma 1.0, clipped to [1, S], concatenated per row and
cut at S (what a packer emits, minus its end padding). Mask: document-causal.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import time

from _machine import describe, tensor_peak  # bench/ is on sys.path when run as a script

CONFIGS = [(4096, 1), (4096, 8), (16384, 1), (16384, 8), (65536, 1), (65536, 8)]
# (method, threads): None is torch's default intra-op thread count.
METHODS = (
    ("flexpack", None),
    ("user_compiled", None),
    ("user_eager", None),
    ("flexpack", 1),
    ("compiled", 1),
)
EAGER_BYTES_PER_PAIR = 10  # measured: +2.6 GB at S=16K, B=1 (bool mask, padded copy, sums)
COMPILED_PAIRS_PER_S = 3.0e8  # measured: about 0.9 s for 16K^2 pairs, one thread


def _doc_ids(S: int, B: int, seed: int = 0):
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(B):
        lengths = []
        while sum(lengths) < S:
            lengths.append(int(np.clip(rng.lognormal(np.log(300), 1.0), 1, S)))
        row = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)[:S]
        rows.append(torch.from_numpy(row))
    return torch.stack(rows)


def user_document_causal(doc):
    """The mask_mod a torch user writes (attention-gym, torchtune): (B, S) doc ids, -1 padding."""

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (doc[b, q_idx] >= 0) & (q_idx >= kv_idx)

    return document_causal


def _worker(S: int, B: int, method: str, reps: int, threads: int | None) -> dict:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    from flexpack import masks

    if threads is not None:
        torch.set_num_threads(threads)
    d = _doc_ids(S, B)
    mask = masks.document(d) & masks.causal()
    if method == "flexpack":
        fn = lambda: mask.block_mask(block_size=128)
    elif method == "user_compiled":  # the user's code, torch's defaults
        compiled = torch.compile(create_block_mask)
        mod = user_document_causal(d)
        fn = lambda: compiled(mod, B, None, S, S, device="cpu")
    elif method == "user_eager":
        mod = user_document_causal(d)
        fn = lambda: create_block_mask(mod, B, None, S, S, device="cpu")
    else:  # "compiled": flexpack's own mask_mod
        compiled = torch.compile(create_block_mask)
        fn = lambda: compiled(mask.mask_mod, B, 1, S, S, device="cpu")
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    bm = fn()  # warm-up (compiles for "compiled")
    first = time.perf_counter() - t0
    ours = lambda: mask.block_mask(block_size=128)
    if method != "flexpack":
        ours()  # warm-up
    times, paired = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        bm = fn()
        times.append(time.perf_counter() - t0)
        if method != "flexpack":
            # flexpack right after each baseline call, in the same process and moment: the
            # ratio then survives the load of the shared machine drifting between processes.
            for _ in range(5):
                t0 = time.perf_counter()
                ours()
                paired.append(time.perf_counter() - t0)
    rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024
    is_compiled = method in ("compiled", "user_compiled")
    peak = tensor_peak(fn) if not is_compiled or S <= 16384 else None
    size = sum(t.nbytes for t in bm.as_tuple() if isinstance(t, torch.Tensor))
    times.sort()
    paired.sort()
    return {
        "flexpack_paired": paired[len(paired) // 2] if paired else None,
        "S": S,
        "B": B,
        "method": method,
        "threads": torch.get_num_threads(),
        "seconds": times[len(times) // 2],
        "first": first,
        "peak": peak,
        "rss": rss,
        "size": size,
        "kv_num_blocks_sum": int(bm.kv_num_blocks.sum()),
        "full_kv_num_blocks_sum": int(bm.full_kv_num_blocks.sum()),
    }


def _skip_reason(S: int, B: int, method: str, eager_gb: float, compiled_s: float) -> str | None:
    pairs = B * S * S
    if method == "user_eager" and pairs * EAGER_BYTES_PER_PAIR > eager_gb * 2**30:
        return f"needs ~{pairs * EAGER_BYTES_PER_PAIR / 2**30:.0f} GB (O(B*S^2)), cap {eager_gb} GB"
    if method in ("compiled", "user_compiled") and pairs / COMPILED_PAIRS_PER_S > compiled_s:
        return f"~{pairs / COMPILED_PAIRS_PER_S:.0f} s per call (O(B*S^2)), cap {compiled_s} s"
    return None


def _reps(S: int, B: int, method: str) -> int:
    if method == "flexpack":
        return 21
    return 3 if B * S * S <= 4096 * 4096 * 8 else 1


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="S in {4K, 16K} only")
    parser.add_argument("--eager-gb", type=float, default=4.0, help="skip eager above this")
    parser.add_argument("--compiled-s", type=float, default=20.0, help="skip compiled above")
    parser.add_argument("--out", help="also write the markdown table here")
    parser.add_argument(
        "--worker", nargs=4, metavar=("S", "B", "METHOD", "THREADS"), help=argparse.SUPPRESS
    )
    parser.add_argument("--reps", type=int, default=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        S, B, method = int(args.worker[0]), int(args.worker[1]), args.worker[2]
        threads = None if args.worker[3] == "default" else int(args.worker[3])
        print(json.dumps(_worker(S, B, method, args.reps, threads)))
        return 0

    configs = [c for c in CONFIGS if not args.quick or c[0] <= 16384]
    rows: list[tuple[int, int, dict[str, dict | str]]] = []
    start = time.perf_counter()
    for S, B in configs:
        results: dict[str, dict | str] = {}
        for method, threads in METHODS:
            key = _key(method, threads)
            reason = _skip_reason(S, B, method, args.eager_gb, args.compiled_s)
            if reason:
                results[key] = f"skipped: {reason}"
                print(f"S={S} B={B} {key}: skipped ({reason})", flush=True)
                continue
            cmd = [sys.executable, __file__, "--worker", str(S), str(B), method]
            cmd += [str(threads or "default"), "--reps", str(_reps(S, B, method))]
            # The allocator at its defaults, as users run: a fixed mmap threshold (which makes
            # ru_maxrss track live memory) turns every block over 64 KB into an mmap and a page
            # fault per page, which doubled flexpack's time at S = 16K.
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                results[key] = f"failed: {proc.stderr.strip().splitlines()[-1][:120]}"
                print(f"S={S} B={B} {key}: {results[key]}", flush=True)
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            results[key] = r
            print(
                f"S={S} B={B} {key} ({r['threads']} threads): {_fmt_s(r['seconds'])} "
                f"(first {_fmt_s(r['first'])}), peak {_fmt_bytes(r['peak'])}, "
                f"rss +{_fmt_bytes(r['rss'])}",
                flush=True,
            )
        rows.append((S, B, results))
    elapsed = time.perf_counter() - start

    import torch

    table = _table(rows)
    load = os.getloadavg()[0]
    header = (
        f"# BlockMask construction: flexpack vs create_block_mask\n\n"
        f"- date: {datetime.date.today().isoformat()}\n"
        f"- machine: {describe()}, torch {torch.__version__}; default intra-op threads: "
        f"{torch.get_num_threads()}; load average {load:.1f} at the end\n"
        f"- command: `python bench/block_mask.py{' --quick' if args.quick else ''}` "
        f"({elapsed:.0f} s)\n"
        f"- mask: document-causal, block_size 128; doc lengths lognormal (median 300, sigma 1)\n"
        f"- time: median after a warm-up call (the compile, for compiled); ratios are "
        f"create_block_mask time / flexpack time at the same thread count, in the same run "
        f"(each in its own process; the JSON of a baseline worker also carries flexpack timed "
        f"right after each baseline call, `flexpack_paired`)\n"
        f"- **headline**: `torch.compile(create_block_mask)` on the mask_mod a user writes "
        f"(`doc[b, q] == doc[b, kv]` & `doc[b, q] >= 0` & `q >= kv`, as attention-gym and "
        f"torchtune), default threads, vs flexpack at default threads\n"
        f"- second baseline: compiled `create_block_mask` on flexpack's own mask_mod, both at "
        f"one thread (the comparison of earlier reports)\n"
        f"- peak: high-water mark of live tensor bytes during one call (profiler allocation "
        f"events); rss: ru_maxrss growth in a fresh subprocess (includes compiling)\n"
        f"- size: the BlockMask's own tensors; `peak/size` is flexpack's peak over it\n"
    )
    text = header + "\n" + table
    print()
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


def _key(method: str, threads: int | None) -> str:
    return method if threads is None else f"{method}_{threads}t"


def _cell_time(r) -> str:
    return _fmt_s(r["seconds"]) if isinstance(r, dict) else "-"


def _cell_ratio(r, fp) -> str:
    if isinstance(r, dict) and isinstance(fp, dict):
        return f"{r['seconds'] / fp['seconds']:.0f}x"
    return "-"


def _cell_mem(r) -> str:
    return f"{_fmt_bytes(r['peak'])} ({_fmt_bytes(r['rss'])})" if isinstance(r, dict) else "-"


def _table(rows) -> str:
    lines = [
        "| S | B | flexpack | compiled, user mask_mod | **headline ratio** | eager, user mask_mod "
        "| eager ratio | flexpack, 1 thread | compiled, flexpack mask_mod, 1 thread "
        "| 1-thread ratio | BlockMask size | flexpack peak (rss) | peak / size "
        "| compiled (user) peak (rss) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for S, B, res in rows:
        fp, user, eager = res.get("flexpack"), res.get("user_compiled"), res.get("user_eager")
        fp1, comp1 = res.get("flexpack_1t"), res.get("compiled_1t")
        for key, r in res.items():
            if isinstance(r, str):
                notes.append(f"- {S // 1024}K, B={B}, {key}: {r}")
        ok = isinstance(fp, dict)
        size = _fmt_bytes(fp["size"]) if ok else "-"
        per = f"{fp['peak'] / fp['size']:.2f}" if ok and fp["peak"] is not None else "-"
        cells = [f"{S // 1024}K", str(B), _cell_time(fp), _cell_time(user)]
        cells += [f"**{_cell_ratio(user, fp)}**", _cell_time(eager), _cell_ratio(eager, fp)]
        cells += [_cell_time(fp1), _cell_time(comp1), _cell_ratio(comp1, fp1)]
        cells += [size, _cell_mem(fp), per, _cell_mem(user)]
        lines.append("| " + " | ".join(cells) + " |")
    if notes:
        lines += ["", "Skipped or failed:", *notes]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
