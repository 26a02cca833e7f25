"""pack_dataset vs TRL's pack_dataset: pack a disk-backed HF dataset and save_to_disk.

Side by side in one run, each packer in its own process (its peak RSS is its own, the imports
included), alternating and repeated (the minimum time is kept):

- TRL: ``trl.pack_dataset(ds, 4096, strategy="bfd")`` (its documented API at its defaults),
  then ``save_to_disk``;
- flexpack: ``flexpack.integrations.datasets.pack_dataset(ds, 4096)`` (defaults: unpadded rows,
  labels kept when the source has a labels column), then ``save_to_disk``.

Each run starts from its own fresh copy of the source (``load_from_disk``, memory-mapped), so
no run reuses another's map cache. Bytes on disk are ``du`` of the saved folder.

    python bench/pack_dataset.py                    # 100k samples, with and without labels
    python bench/pack_dataset.py --samples 1000000 --repeats 1 --no-labels-variant

Lengths lognormal (median 300, sigma 1.0, clipped to [1, 4096]); token ids uniform in
[0, 32000) stored as int64 (what ``Dataset.from_dict`` infers from tokenizer output); the
labels variant adds a ``labels`` column with the first ~30% of every sample (the prompt) -100.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
from _machine import describe  # bench/ is on sys.path when run as a script

MAX_LEN = 4096


def make_source(n: int, folder: str, labels: bool, seed: int = 0) -> dict:
    """Write the source dataset chunk by chunk (bounded memory), then save_to_disk it."""
    import datasets
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(300), 1.0, size=n), 1, MAX_LEN).astype(np.int64)
    arrow = os.path.join(folder, "raw.arrow")
    fields = [("input_ids", pa.list_(pa.int64()))]
    if labels:
        fields.append(("labels", pa.list_(pa.int64())))
    schema = pa.schema(fields)
    with pa.OSFile(arrow, "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for lo in range(0, n, 50_000):
            part = lengths[lo : lo + 50_000]
            offsets = np.zeros(len(part) + 1, dtype=np.int64)
            np.cumsum(part, out=offsets[1:])
            ids = rng.integers(0, 32000, size=int(offsets[-1]), dtype=np.int64)
            offs = pa.array(offsets.astype(np.int32))
            cols = [pa.ListArray.from_arrays(offs, pa.array(ids))]
            if labels:
                lab = ids.copy()
                prompt = (part * 0.3).astype(np.int64)
                mask = np.arange(int(offsets[-1])) - np.repeat(offsets[:-1], part)
                lab[mask < np.repeat(prompt, part)] = -100
                cols.append(pa.ListArray.from_arrays(offs, pa.array(lab)))
            writer.write_table(pa.Table.from_arrays(cols, schema=schema))
    ds = datasets.Dataset.from_file(arrow)
    ds.save_to_disk(os.path.join(folder, "source"))
    del ds
    os.remove(arrow)
    return {"samples": n, "tokens": int(lengths.sum())}


def proc_status_mb(key: str) -> float:
    """VmRSS / VmHWM of this process image (VmHWM resets at exec, unlike ru_maxrss)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    return float("nan")


class AnonPeak:
    """Samples RssAnon every 20 ms in a thread: the peak of the process's own memory, without
    the pages of memory-mapped files (reclaimable page cache that VmHWM counts too)."""

    def __init__(self) -> None:
        import threading

        self.peak = proc_status_mb("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, proc_status_mb("RssAnon"))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak, proc_status_mb("RssAnon"))


def du(path: str) -> int:
    return int(subprocess.check_output(["du", "-sb", path]).split()[0])


def run_one(packer: str, source: str, out: str) -> dict:
    """In a child process: load, pack, save; print a JSON line."""
    import datasets

    datasets.disable_progress_bars()
    if packer == "trl":
        from trl import pack_dataset as trl_pack

        def do(ds):
            return trl_pack(ds, MAX_LEN, strategy="bfd")
    else:
        from flexpack.integrations.datasets import pack_dataset

        def do(ds):
            return pack_dataset(ds, MAX_LEN)

    ds = datasets.load_from_disk(source)
    rss_before = proc_status_mb("VmRSS")
    anon_before = proc_status_mb("RssAnon")
    anon = AnonPeak()
    t = time.perf_counter()
    packed = do(ds)
    t_pack = time.perf_counter() - t
    packed.save_to_disk(out)
    total = time.perf_counter() - t
    anon_peak = anon.stop()
    kept = "labels" in packed.column_names and "labels" in ds.column_names
    return {
        "packer": packer,
        "rows": len(packed),
        "s": total,
        "pack_s": t_pack,
        "bytes": du(out),
        "columns": packed.column_names,
        "labels_kept": kept,
        "rss_after_import_mb": rss_before,
        "peak_rss_mb": proc_status_mb("VmHWM"),
        "anon_before_mb": anon_before,
        "anon_peak_mb": anon_peak,
    }


def spawn(packer: str, source_dir: str) -> dict:
    work = tempfile.mkdtemp(dir=os.path.dirname(source_dir), prefix=f"run-{packer}-")
    try:
        src = os.path.join(work, "source")
        shutil.copytree(source_dir, src)  # a fresh copy: no map cache from an earlier run
        out = os.path.join(work, "out")
        args = [sys.executable, __file__, "--child", packer, src, out]
        proc = subprocess.run(args, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{packer} failed: {(proc.stdout + proc.stderr)[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(work, ignore_errors=True)


def compare(n: int, labels: bool, repeats: int, root: str) -> dict:
    folder = tempfile.mkdtemp(dir=root, prefix=f"src-{n}-")
    try:
        args = [sys.executable, __file__, "--make-source", str(n), folder, str(int(labels))]
        info = json.loads(subprocess.check_output(args, text=True).strip().splitlines()[-1])
        source = os.path.join(folder, "source")
        info["source_bytes"] = du(source)
        runs: dict[str, list[dict]] = {"trl": [], "flexpack": []}
        for _ in range(repeats):
            for packer in ("trl", "flexpack"):
                runs[packer].append(spawn(packer, source))
                print(json.dumps(runs[packer][-1]), file=sys.stderr)
        best = {k: min(v, key=lambda r: r["s"]) for k, v in runs.items()}
        for k, v in runs.items():
            best[k]["all_s"] = [r["s"] for r in v]
            best[k]["peak_rss_mb"] = max(r["peak_rss_mb"] for r in v)
            best[k]["anon_peak_mb"] = max(r["anon_peak_mb"] for r in v)
        return {**info, "labels": labels, **best}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def table(res: dict) -> list[str]:
    t, f = res["trl"], res["flexpack"]
    mib = 2**20
    what = "input_ids + labels (prompt -100)" if res["labels"] else "input_ids only"
    lines = [
        f"### {res['samples']:,} samples, {res['tokens']:,} tokens, {what} "
        f"(source {res['source_bytes'] / mib:,.0f} MiB on disk)",
        "",
        '| | TRL `pack_dataset(ds, 4096, strategy="bfd")` | flexpack `pack_dataset(ds, 4096)` '
        "| flexpack / TRL |",
        "|---|---|---|---|",
        f"| time to pack + save_to_disk (min of {len(t['all_s'])}) | {t['s']:.2f} s | "
        f"{f['s']:.2f} s | {f['s'] / t['s']:.2f}x |",
        f"| median of {len(t['all_s'])} | {np.median(t['all_s']):.2f} s | "
        f"{np.median(f['all_s']):.2f} s | "
        f"{np.median(f['all_s']) / np.median(t['all_s']):.2f}x |",
        f"| of which pack | {t['pack_s']:.2f} s | {f['pack_s']:.2f} s | "
        f"{f['pack_s'] / t['pack_s']:.2f}x |",
        f"| bytes on disk (du of the saved folder) | {t['bytes'] / mib:,.0f} MiB | "
        f"{f['bytes'] / mib:,.0f} MiB | {f['bytes'] / t['bytes']:.2f}x |",
        f"| rows | {t['rows']:,} | {f['rows']:,} | {f['rows'] / t['rows']:.4f}x |",
        f"| peak anonymous RSS (RssAnon, sampled every 20 ms) | {t['anon_peak_mb']:,.0f} MB | "
        f"{f['anon_peak_mb']:,.0f} MB | {f['anon_peak_mb'] / t['anon_peak_mb']:.2f}x |",
        f"| anonymous RSS after imports | {t['anon_before_mb']:,.0f} MB | "
        f"{f['anon_before_mb']:,.0f} MB | |",
        f"| peak RSS incl. mapped files (VmHWM) | {t['peak_rss_mb']:,.0f} MB | "
        f"{f['peak_rss_mb']:,.0f} MB | {f['peak_rss_mb'] / t['peak_rss_mb']:.2f}x |",
        f"| columns written | {', '.join(t['columns'])} | {', '.join(f['columns'])} | |",
        f"| labels kept | {t['labels_kept']} | {f['labels_kept']} | |",
        "",
        "All times: "
        + "; ".join(
            f"{k} " + ", ".join(f"{s:.2f}" for s in res[k]["all_s"]) + " s"
            for k in ("trl", "flexpack")
        )
        + ".",
        "",
    ]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, nargs="+", default=[100_000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-labels-variant", action="store_true")
    ap.add_argument("--root", default=None, help="folder for the temporary datasets")
    ap.add_argument("--out", default=None, help="write the markdown table here")
    ap.add_argument("--child", nargs=3, metavar=("PACKER", "SOURCE", "OUT"))
    ap.add_argument("--make-source", nargs=3, metavar=("N", "FOLDER", "LABELS"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_one(*args.child)))
        return
    if args.make_source:
        import datasets

        datasets.disable_progress_bars()
        n, folder, labels = args.make_source
        print(json.dumps(make_source(int(n), folder, bool(int(labels)))))
        return
    from importlib.metadata import version

    machine = describe()
    root = args.root or tempfile.gettempdir()
    lines = [
        f"## pack_dataset vs TRL ({datetime.date.today().isoformat()}, {machine}, "
        f"TRL {version('trl')}, datasets {version('datasets')}, pyarrow {version('pyarrow')})",
        "",
        "Command: `python " + " ".join(sys.argv) + "`. Lognormal lengths (median 300, sigma 1, "
        "clipped to [1, 4096]), max_len 4096, int64 token ids; both packers write next to the "
        "memory-mapped source, then `save_to_disk`.",
        "",
    ]
    for n in args.samples:
        variants = [False] if args.no_labels_variant else [False, True]
        for labels in variants:
            res = compare(n, labels, args.repeats, root)
            lines += table(res)
            print("\n".join(table(res)))
    text = "\n".join(lines)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
