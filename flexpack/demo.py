"""``flexpack demo``: pack a bundled corpus, prove packed == per-document, show the gain.

1. Reads the bundled corpus (``flexpack/assets/corpus.jsonl``: the Zen of Python and 600 docstrings
   of the Python standard library, real prose of very uneven length) and tokenizes it as UTF-8
   bytes, so nothing is downloaded.
2. Packs it into rows of ``max_len`` with ``flexpack.pack`` and prints the rows, efficiency and
   padding against padding every document to ``max_len`` and against padding each batch to its
   longest document. Documents longer than ``max_len`` are split into ``max_len`` pieces, each its
   own document (the demo says how many).
3. Runs the reference GPT (``flexpack.models.GPT``, random weights, fp32, CPU) on the packed rows
   with the document-causal mask, and on every document alone; prints the largest absolute logit
   difference (the exit code is 1 if it exceeds ``tolerance``), then the tokens/s of packed rows
   against padded rows over the same real tokens: interleaved chunks, the gain is the median of
   the per-chunk ratios, so a change in the machine's load does not swing it.
4. Writes a PNG of the mask of one packed row (matplotlib, optional extra ``viz``) into ``out``
   (``flexpack demo --out DIR``; by default ``flexpack-demo/`` in the current folder, which it
   says first) and prints where.

Slow steps print what they do first and show a progress bar when tqdm is installed and stderr
is a terminal. Settings that would run for many minutes (``max_len`` so small that the documents
fall into thousands of pieces, each checked alone) are refused up front.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from flexpack.layout import PackedLayout

CORPUS = Path(__file__).with_name("assets") / "corpus.jsonl"
# Each piece also runs alone through the model (the proof): past this many the demo takes minutes.
MAX_PIECES = 2500
_TIMED_ROWS = 64  # packed rows whose documents are timed, both ways

__all__ = ["load_corpus", "main", "tokenize_bytes"]


def load_corpus(path: str | Path = CORPUS) -> list[str]:
    """The texts of the bundled corpus (or of any JSONL file with a ``"text"`` field per line).

    Example:
        >>> texts = load_corpus()
        >>> len(texts), texts[0].splitlines()[0]
        (601, 'The Zen of Python, by Tim Peters')
    """
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def tokenize_bytes(text: str) -> Tensor:
    """A byte-level tokenizer: the UTF-8 bytes of ``text`` as a (L,) int64 tensor (vocab 256).

    Example:
        >>> tokenize_bytes("héllo")
        tensor([104, 195, 169, 108, 108, 111])
    """
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def _padded_rows(docs: list[Tensor], max_len: int) -> Tensor:
    """(N, max_len) int64: every document in its own row, right-padded with 0."""
    rows = torch.zeros(len(docs), max_len, dtype=torch.long)
    for i, d in enumerate(docs):
        rows[i, : len(d)] = d
    return rows


def _progress(iterable, total: int, desc: str, every: float = 2.0):
    """``iterable`` with a tqdm bar on a terminal when tqdm is installed; otherwise (no tqdm, or
    output to a file or pipe) a plain ``desc: i/total (s)`` line at most every ``every`` seconds,
    so no wait passes in silence."""
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm
        except ImportError:
            pass
        else:
            return tqdm(iterable, total=total, desc=desc, leave=False, file=sys.stderr)
    return _plain_progress(iterable, total, desc, every)


def _plain_progress(iterable, total: int, desc: str, every: float):
    start = last = time.monotonic()  # not perf_counter, which times the work itself
    for i, item in enumerate(iterable):
        now = time.monotonic()
        if now - last >= every:
            print(f"  {desc}: {i}/{total} ({now - start:.0f} s)", flush=True)
            last = now
        yield item


@dataclass(frozen=True)
class _Speed:
    seconds: dict[str, float]  # median over repeats of each layout's time over all its batches
    gain: float  # median over repeats of (first layout's time) / (last layout's time)


def _time_forwards(
    model, layouts: dict[str, list[dict]], *, repeats: int, chunks: int = 8
) -> _Speed:
    """Time the model over every batch of each layout, robustly against the machine's load.

    Each repeat times every layout in interleaved chunks (a slice of each in turn, the order
    alternating), so that a change in load hits them all alike; the result is the median over
    the repeats, of the times and of the ratio, so one disturbed repeat does not move it. One
    warm-up batch each first (it compiles flex_attention once on CPU).
    """
    names = list(layouts)
    totals: dict[str, list[float]] = {name: [] for name in names}
    with torch.no_grad():
        for batches in layouts.values():
            model(**batches[0])
        steps = [(r, c) for r in range(repeats) for c in range(chunks)]
        spent = dict.fromkeys(names, 0.0)
        for r, c in _progress(steps, len(steps), "timing (repeat x chunk)"):
            for name in names if (r + c) % 2 == 0 else names[::-1]:
                batches = layouts[name]
                part = batches[c * len(batches) // chunks : (c + 1) * len(batches) // chunks]
                start = time.perf_counter()
                for kwargs in part:
                    model(**kwargs)
                spent[name] += time.perf_counter() - start
            if c == chunks - 1:  # a repeat is complete
                for name in names:
                    totals[name].append(spent[name])
                spent = dict.fromkeys(names, 0.0)
    ratios = [a / b for a, b in zip(totals[names[0]], totals[names[-1]], strict=True)]
    return _Speed({k: statistics.median(v) for k, v in totals.items()}, statistics.median(ratios))


def _row_batches(n_rows: int, batch_rows: int) -> list[slice]:
    return [slice(i, min(i + batch_rows, n_rows)) for i in range(0, n_rows, batch_rows)]


def _pad_rows_to(x: Tensor, n: int, value: int) -> Tensor:
    """Append rows of ``value`` so that x has n rows (fixed shapes: one compile, no recompiles)."""
    if x.shape[0] == n:
        return x
    return torch.cat([x, x.new_full((n - x.shape[0], *x.shape[1:]), value)])


def _write_mask_pngs(doc_ids: Tensor, out: Path) -> list[str]:
    """Draw the mask of one packed row with ``flexpack.viz``; returns what was written or why not.

    doc_ids: (S,) int32, the row's document ids (-1 = padding).
    """
    import flexpack
    from flexpack import viz

    try:
        import matplotlib  # noqa: F401  (the viz extra)
    except ImportError:
        return ["skipped the mask PNGs: matplotlib is not installed (pip install matplotlib)"]
    block_mask = flexpack.document_causal_mask(doc_ids[None])  # (1, 1, S, S)
    n_docs = int((doc_ids >= 0).sum() and doc_ids.max() + 1)
    S = doc_ids.shape[0]
    element = viz.plot_mask(
        block_mask,
        out / "mask.png",
        doc_ids=doc_ids,
        title=f"document-causal mask of one packed row\n{n_docs} documents, S={S}",
    )
    blocks = viz.plot_block_mask(block_mask, out / "block_mask.png")
    return [
        f"wrote {Path(element).resolve()} (element mask of a row with {n_docs} documents)",
        f"wrote {Path(blocks).resolve()} (its {block_mask.BLOCK_SIZE[0]}-token blocks: skipped, "
        "partial, full)",
    ]


def main(
    *,
    out: str = "flexpack-demo",
    max_len: int = 1024,
    num_docs: int | None = None,
    n_layer: int = 2,
    n_embd: int = 64,
    batch_rows: int = 8,
    repeats: int = 3,
    tolerance: float = 1e-4,
    seed: int = 0,
) -> int:
    """Run the demo; return the exit code (0 ok, 1 if packed and per-document logits disagree).

    Args:
        out: folder for the mask PNGs, created if missing (relative: in the current folder).
        max_len: tokens per packed row; longer documents are split into pieces of ``max_len``.
        num_docs: use only the first ``num_docs`` documents of the corpus (default all 601).
        n_layer: layers of the reference GPT.
        n_embd: its width (4 query heads, 2 key/value heads).
        batch_rows: rows per forward call when timing.
        repeats: timing repeats (the median is reported).
        tolerance: largest allowed absolute logit difference, packed vs alone.
        seed: seeds the packing order and the model weights.

    Raises:
        ValueError: ``num_docs``, ``batch_rows``, ``repeats`` or ``max_len`` is not a positive
            int, or ``max_len`` cuts the documents into more than ``MAX_PIECES`` (2,500) pieces.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     main(out=d, max_len=128, num_docs=8, n_layer=1, n_embd=32, batch_rows=2)
        flexpack demo: 8 documents ... -> OK
        ...
        0
    """
    import flexpack
    from flexpack import _kernels
    from flexpack.models import GPT, GPTConfig

    settings = (("batch_rows", batch_rows), ("repeats", repeats), ("num_docs", num_docs))
    for name, value in (*settings, ("max_len", max_len)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
    started = time.perf_counter()
    torch.manual_seed(seed)
    texts = load_corpus()[:num_docs]
    samples = [tokenize_bytes(t) for t in texts]
    lengths = [len(s) for s in samples]
    n_pieces = sum(-(-n // max_len) for n in lengths)
    if n_pieces > MAX_PIECES:
        enough = next(
            m
            for m in (2**k for k in range(4, 16))
            if sum(-(-n // m) for n in lengths) <= MAX_PIECES
        )
        raise ValueError(
            f"max_len={max_len} cuts the {len(texts)} documents into {n_pieces:,} pieces, and "
            f"each piece is also run alone to check the packed rows: more than the demo's "
            f"{MAX_PIECES:,} (it would run for many minutes). Use max_len >= {enough}, or "
            "fewer documents (num_docs)."
        )
    n_bytes = sum(lengths)
    print(
        f"flexpack demo: {len(texts)} documents of real prose (CPython docstrings, PSF license), "
        f"{n_bytes:,} byte tokens, lengths {min(lengths)}..{max(lengths)}, rows of {max_len}"
    )
    print(f"pictures go to {Path(out).resolve()} (flexpack demo --out DIR puts them elsewhere)")
    n_long = sum(n > max_len for n in lengths)
    if n_long:
        print(
            f"{n_long} documents are longer than {max_len} tokens: each is split into pieces of "
            f"at most {max_len} (overflow='split'), every piece its own document, so "
            f"{len(texts)} documents become {n_pieces} pieces below"
        )

    # -- packing -------------------------------------------------------------------------------
    compiled = _kernels.compiled_for("best_fit_decreasing", n_pieces)
    if compiled:
        print(
            "loading the compiled packer (the first run after an install compiles it) ...",
            flush=True,
        )
    else:
        print(
            f"packing {n_pieces:,} pieces with numpy: under {_kernels.SMALL:,} pieces that beats "
            "loading the compiled packer ...",
            flush=True,
        )
    t0 = time.perf_counter()
    if compiled:  # loads (on a fresh install: compiles, then caches) the packer
        with _kernels.forced("numba"):
            flexpack.pack([1], max_len).layout()
    t1 = time.perf_counter()
    plan = flexpack.pack(lengths, max_len, overflow="split", seed=seed)
    batch = plan.materialize(samples)
    pack_ms, load_ms = (time.perf_counter() - t1) * 1e3, (t1 - t0) * 1e3
    load = f"+{load_ms:.0f} ms to load the compiled packer" if compiled else "numpy, no compile"
    layout = batch.layout
    spans = _doc_spans(layout)
    docs = [batch.input_ids[r, a:b] for r, a, b in spans]  # long samples: max_len pieces
    n = len(docs)
    padded_slots = n * max_len
    dyn_slots = sum(
        max(len(d) for d in docs[s]) * len(docs[s]) for s in _row_batches(n, batch_rows)
    )
    packed_slots = plan.num_rows * max_len
    print()
    print(f"{'layout':<36}{'rows':>7}{'token slots':>13}{'efficiency':>12}{'padding':>10}")
    for name, rows, slots in (
        (f"one document per row, padded to {max_len}", n, padded_slots),
        (f"padded to the longest of {batch_rows}", n, dyn_slots),
        (f"flexpack.pack (bfd), rows of {max_len}", plan.num_rows, packed_slots),
    ):
        print(f"{name:<36}{rows:>7,}{slots:>13,}{n_bytes / slots:>12.1%}{slots - n_bytes:>10,}")
    print(
        f"-> {n / plan.num_rows:.2f}x fewer rows than one per row, "
        f"{padded_slots - packed_slots:,} padding tokens saved; lower bound "
        f"{plan.stats.lower_bound_rows} rows; packed and materialized in {pack_ms:.0f} ms "
        f"({load})"
    )

    # -- the proof -------------------------------------------------------------------------------
    config = GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=4, n_kv_head=2)
    model = GPT(config).eval()
    n_params = sum(p.numel() for p in model.parameters())
    print()
    print(
        f"model: flexpack.models.GPT (n_layer={n_layer}, n_embd={n_embd}, 4 query / 2 key-value "
        f"heads, {n_params / 1e6:.2f}M parameters, random weights), fp32, "
        f"torch threads={torch.get_num_threads()}"
    )
    print(f"checking the packed rows against each of the {n} pieces run alone ...", flush=True)
    worst = 0.0
    row_batches = _row_batches(plan.num_rows, batch_rows)
    with torch.no_grad():
        for sl in _progress(row_batches, len(row_batches), "checking"):
            logits = model(
                batch.input_ids[sl], position_ids=layout.position_ids[sl], doc_ids=batch.doc_ids[sl]
            )
            for r, a, b in spans:
                if sl.start <= r < sl.stop:
                    alone = model(batch.input_ids[r, a:b][None])[0]  # one document, no padding
                    worst = max(worst, (logits[r - sl.start, a:b] - alone).abs().max().item())
    ok = worst <= tolerance
    print(
        f"packed rows vs each of the {n} pieces run alone: largest |logit difference| "
        f"{worst:.2e} (tolerance {tolerance:.0e}) -> {'OK' if ok else 'MISMATCH'}"
    )

    # -- speed -----------------------------------------------------------------------------------
    # Timed on the documents of the first rows only (the same documents both ways), so that the
    # repeats that make the gain robust fit in the time of one pass over everything.
    timed_rows = min(plan.num_rows, _TIMED_ROWS)
    timed_docs = [d for d, (r, _, _) in zip(docs, spans, strict=True) if r < timed_rows]
    timed_tokens = sum(len(d) for d in timed_docs)
    packed_batches = []
    for sl in _row_batches(timed_rows, batch_rows):
        ids, pos, doc = batch.input_ids[sl], layout.position_ids[sl], batch.doc_ids[sl]
        packed_batches.append(
            dict(
                input_ids=_pad_rows_to(ids, batch_rows, 0),
                position_ids=_pad_rows_to(pos, batch_rows, 0),
                doc_ids=_pad_rows_to(doc, batch_rows, -1),
            )
        )
    # The padded baseline is the cheaper one: each batch padded to its longest document (causal
    # attention, so trailing padding never reaches a real token). Padding every row to max_len
    # would cost the slots of the first table line and only make packing look better.
    padded = _padded_rows(timed_docs, max_len)
    dyn_batches = [
        dict(input_ids=padded[sl, : max(len(d) for d in timed_docs[sl])])
        for sl in _row_batches(len(timed_docs), batch_rows)
    ]
    padded_name = f"padded to longest of {batch_rows} (SDPA causal)"
    packed_name = "packed (flexpack.attention)"
    print()
    what = "all" if timed_rows == plan.num_rows else f"the {len(timed_docs)} pieces of the first"
    print(
        f"timing forwards over {what} {timed_rows} packed rows ({timed_tokens:,} real tokens) "
        f"both ways, {batch_rows} rows per call, no grad; median of {repeats} interleaved "
        "repeats ...",
        flush=True,
    )
    speed = _time_forwards(
        model, {padded_name: dyn_batches, packed_name: packed_batches}, repeats=repeats
    )
    for name, seconds in speed.seconds.items():
        print(f"  {name:<40}{seconds:>8.2f} s{timed_tokens / seconds:>12,.0f} tokens/s")
    if speed.gain >= 1:
        print(f"-> packed is {speed.gain:.2f}x faster than padding each batch to its longest")
    else:
        print(f"-> packed is {1 / speed.gain:.2f}x slower than padding each batch to its longest")

    # -- picture ---------------------------------------------------------------------------------
    busiest = int(torch.as_tensor(layout.num_docs).argmax())
    print()
    print(f"drawing the mask of row {busiest} into {Path(out).resolve()} ...", flush=True)
    for line in _write_mask_pngs(batch.doc_ids[busiest], Path(out)):
        print("mask: " + line)
    print(f"done in {time.perf_counter() - started:.1f} s")
    return 0 if ok else 1


def _doc_spans(layout: PackedLayout) -> list[tuple[int, int, int]]:
    """(row, start, stop) of every document of a packer layout, row-major."""
    spans = []
    for row, lengths in enumerate(layout.row_seqlens):
        start = 0
        for n in lengths:
            spans.append((row, start, start + n))
            start += n
    return spans
