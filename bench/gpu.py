"""GPU attention benchmark: correctness first, then bf16 TFLOP/s of flexpack vs torch's kernels.

One call, under 10 minutes on one CUDA GPU (``--quick``: under 4 minutes):

1. Correctness (small S, lognormal layout with padding, a row of arbitrary repeated ids, GQA):
   ``flexpack.attention`` with backend "flex", "auto", "varlen" and "sdpa" against a float64
   per-document reference, outputs and q/k/v gradients (relative error: bf16 < 1e-2,
   fp32 < 1e-5), padding rows exactly 0. The reference takes the inputs rounded to the kernel's
   dtype (a perfect bf16 kernel scores ~4.5e-3 against the unrounded fp32 inputs). Then every
   other CUDA path once: head dim 8 (flex pads it to 16), a sliding window (flex), a BlockMask of
   64-token blocks (rebuilt at 128 on CUDA), fp32 GQA causal SDPA (k/v repeated so it stays off
   the math kernel; the SDPA backend that ran is logged); and 0 recompiles of flex for a new
   layout or a new window at the same shape. Any failure exits with status 1 before timing.
2. Speed: B=1, H=16, D=128, S in {8K, 32K, 128K} (``--quick``: 8K, 32K), lognormal documents
   (median 1024 tokens, sigma 1), document-causal, bf16. Forward and forward+backward of
   flexpack (backend "flex" and "auto") against ``varlen_attn`` on pre-unpadded tokens, SDPA
   with a dense (S, S) mask (up to 32K only: at 128K the mask is ~48 GiB, the efficient kernel
   is wrong past row 2^32 / S and its backward crashes above ~46-65K tokens in torch 2.13) and
   SDPA causal without a document mask (not the same mask: a speed anchor only). Each SDPA row
   notes the backend that ran (cuDNN may come first on sm90). Every method runs in its own
   try/except, at least 5 timed repetitions (more while under ~2 s per phase), and the report
   is rewritten after every row, so a crash keeps the finished rows. TFLOP/s count only
   unmasked work, the same numerator for every method: forward 4 * H * D * sum_i L_i (L_i + 1)
   / 2, backward 2.5x that.
3. Targets, printed as PASS/FAIL: flex >= 90% of varlen_attn forward, >= 85% backward (time of
   fwd+bwd minus fwd); auto >= 98% of the best exact method, forward and forward+backward.

``--dry-run`` runs the same code on CPU at tiny sizes (no varlen, no flex backward: neither
exists on CPU), so this script cannot rot on machines without a GPU.

Usage: python bench/gpu.py [--quick] [--sizes 8192 32768 131072] [--out bench/results/gpu.md]
       python bench/gpu.py --dry-run
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import flexpack
from flexpack import masks

# --------------------------------------------------------------------------- layouts, reference


def lognormal_doc_ids(S: int, *, median: float, sigma: float = 1.0, seed: int = 0) -> torch.Tensor:
    """(S,) int32 doc ids 0..n-1 filling the row with lognormal document lengths (>= 16 but the
    last)."""
    g = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < S:
        n = int(math.exp(math.log(median) + sigma * float(torch.randn(1, generator=g))))
        n = min(max(16, n), S - total)
        lengths.append(n)
        total += n
    return torch.repeat_interleave(
        torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths)
    )


def seqlens_of(doc_ids: torch.Tensor) -> list[int]:
    """Lengths of every (row, id) document of a (B, S) doc_ids (ids may repeat, -1 padding)."""
    out = []
    for row in doc_ids:
        _, counts = torch.unique(row[row >= 0], return_counts=True)
        out += counts.tolist()
    return out


def per_document_reference(q, k, v, doc_ids, *, causal=True):
    """Each document alone in float64. q (B, Hq, S, D); k, v (B, Hkv, S, D); doc_ids (B, S)."""
    B, Hq, _, D = q.shape
    rep = Hq // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    rows = []
    for b in range(B):
        row = q[b].double() * 0
        for d in doc_ids[b].unique().tolist():
            if d < 0:
                continue
            idx = torch.nonzero(doc_ids[b] == d).squeeze(1)
            qd, kd, vd = (x[b][:, idx].double() for x in (q, k, v))
            s = qd @ kd.transpose(-1, -2) / math.sqrt(D)
            if causal:
                n = idx.numel()
                tri = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
                s = s.masked_fill(tri, -math.inf)
            row = row.index_copy(1, idx, s.softmax(-1) @ vd)
        rows.append(row)
    return torch.stack(rows)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (floored at 0.1; inputs are O(1))."""
    got = got.detach().double()
    return float((got - want.detach()).abs().max() / want.detach().abs().max().clamp(min=0.1))


# --------------------------------------------------------------------------- correctness


@dataclass
class Checks:
    lines: list[str] = field(default_factory=list)
    failed: int = 0

    def add(self, name: str, ok: bool, detail: str) -> None:
        self.failed += not ok
        line = f"  {'ok  ' if ok else 'FAIL'} {name}: {detail}"
        self.lines.append(line)
        print(line, flush=True)


SDPA_OPS = (  # aten op -> SDPA backend, as the profiler records them
    ("aten::_scaled_dot_product_cudnn_attention", "cuDNN"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "flash (CPU)"),
    ("aten::_scaled_dot_product_flash_attention", "flash"),
    ("aten::_scaled_dot_product_efficient_attention", "efficient"),
    ("aten::_scaled_dot_product_attention_math", "math"),
)


def sdpa_backend(fn: Callable[[], object]) -> str:
    """Which SDPA kernel ``fn`` runs, from the aten ops the profiler records (one call)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = {e.name for e in prof.events()}
    found = [label for op, label in SDPA_OPS if op in names]
    return "+".join(found) if found else "none seen"


def _reference(q, k, v, mask) -> torch.Tensor:
    """float64 masked attention of a flexpack mask (dense; small S only), GQA by repetition."""
    from flexpack.testing import references

    return references.reference_attention(
        q, k, v, references.dense_mask(mask, device="cpu"), enable_gqa=True
    )


def correctness(device: torch.device, *, S: int, dry_run: bool) -> Checks:
    checks = Checks()
    g = torch.Generator().manual_seed(0)
    row0 = lognormal_doc_ids(S, median=S / 6, seed=1)
    row0[-(S // 10) :] = -1  # padding at the end, as the packer emits
    row1 = torch.randint(0, 3, (S,), generator=g, dtype=torch.int32)  # arbitrary repeated ids
    row1[S // 3 : S // 3 + 5] = -1
    doc_ids = torch.stack([row0, row1]).to(device)
    pad = (doc_ids < 0).cpu()
    B, Hq, Hkv, D = 2, 4, 2, 64
    mask = masks.document(doc_ids) & masks.causal()
    block_mask = flexpack.document_causal_mask(doc_ids)
    backends = ["flex", "auto", "sdpa"] + ([] if dry_run else ["varlen"])
    dtypes = [torch.bfloat16, torch.float32]

    def check(name, base, run, want_fn, dtype, grad, pad=None):
        """One path: run(q, k, v) against want_fn(q, k, v) in float64 on the rounded inputs."""
        try:
            # The reference sees what the kernel sees: the inputs rounded to its dtype.
            leaves = [x.to(dtype).double().requires_grad_() for x in base]
            want = want_fn(*leaves)
            cot = torch.randn(want.shape, generator=g, dtype=torch.float64)
            tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
            q, k, v = (x.to(device, dtype).requires_grad_(grad) for x in base)
            out = run(q, k, v)
            errs = {"out": rel_err(out.cpu(), want)}
            if grad:
                grads_want = torch.autograd.grad((want * cot).sum(), leaves)
                grads = torch.autograd.grad((out.double() * cot.to(device)).sum(), (q, k, v))
                for n, gr, gw in zip("qkv", grads, grads_want, strict=True):
                    errs[f"d{n}"] = rel_err(gr.cpu(), gw)
                    if not torch.isfinite(gr).all():
                        errs[f"d{n}"] = math.inf
            worst = max(errs.values())
            detail = " ".join(f"{n} {e:.1e}" for n, e in errs.items())
            ok = worst < tol
            if pad is not None:
                pad_zero = bool((out.detach().cpu().transpose(1, 2)[pad] == 0).all())
                ok &= pad_zero
                detail += f" (< {tol:g}), pad 0: {pad_zero}"
            else:
                detail += f" (< {tol:g})"
            checks.add(name, ok, detail)
        except Exception as err:  # report every path, then fail
            checks.add(name, False, f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")

    def per_doc(q, k, v):
        return per_document_reference(q, k, v, doc_ids.cpu())

    for dtype in dtypes:
        base = [torch.randn(B, h, S, D, generator=g) for h in (Hq, Hkv, Hkv)]
        for backend in backends:
            if backend == "varlen" and dtype == torch.float32:
                continue  # FlashAttention kernels are fp16/bf16 only
            name = f"{backend:<6} {str(dtype).removeprefix('torch.'):<8}"
            # flex has no CPU backward: check its forward there, without grad.
            grad = not (dry_run and backend == "flex")
            run = lambda q, k, v, backend=backend: flexpack.attention(
                q, k, v, block_mask, enable_gqa=True, backend=backend
            )
            check(name, base, run, per_doc, dtype, grad, pad)

    # Every other CUDA path once (bf16 unless the path is about fp32).
    bf16 = torch.bfloat16
    grad = not dry_run  # flex has no CPU backward
    small = [torch.randn(B, h, S, 8, generator=g) for h in (Hq, Hkv, Hkv)]
    check(
        "flex   head dim 8 (padded to 16 on CUDA)",
        small,
        lambda q, k, v: flexpack.attention(q, k, v, block_mask, enable_gqa=True, backend="flex"),
        per_doc,
        bf16,
        grad,
    )
    base = [torch.randn(B, h, S, D, generator=g) for h in (Hq, Hkv, Hkv)]
    windowed = mask & masks.sliding_window(S // 7)
    check(
        "flex   sliding window",
        base,
        lambda q, k, v: flexpack.attention(q, k, v, windowed, enable_gqa=True, backend="flex"),
        lambda q, k, v: _reference(q, k, v, windowed),
        bf16,
        grad,
    )
    blocks64 = mask.block_mask(block_size=64)
    check(
        "flex   BlockMask of 64-token blocks",
        base,
        lambda q, k, v: flexpack.attention(q, k, v, blocks64, enable_gqa=True, backend="flex"),
        per_doc,
        bf16,
        grad,
    )
    causal = masks.causal()
    seen: list[str] = []

    def causal_fp32(q, k, v):
        seen.append(sdpa_backend(lambda: flexpack.attention(q, k, v, causal, enable_gqa=True)))
        return flexpack.attention(q, k, v, causal, enable_gqa=True)

    check(
        "sdpa   causal fp32 GQA",
        base,
        causal_fp32,
        lambda q, k, v: _reference_causal(q, k, v),
        torch.float32,
        True,
    )
    if seen:
        backend = seen[0]
        ok = dry_run or backend != "math"
        checks.add("sdpa   causal fp32 GQA backend", ok, f"{backend} (not the O(S^2) math kernel)")

    # No recompile for a new layout or a new window at the same shape (flex, bf16).
    from torch._dynamo.utils import counters

    q, k, v = (
        torch.randn(B, h, S, D, device=device, dtype=torch.bfloat16, requires_grad=not dry_run)
        for h in (Hq, Hkv, Hkv)
    )
    before = counters["stats"]["unique_graphs"]
    for seed in (5, 6):
        other = torch.stack([lognormal_doc_ids(S, median=S / 8, seed=seed)] * B).to(device)
        out = flexpack.attention(
            q, k, v, flexpack.document_causal_mask(other), enable_gqa=True, backend="flex"
        )
        if not dry_run:
            out.sum().backward()
    new = counters["stats"]["unique_graphs"] - before
    checks.add("flex recompiles for 2 new layouts", new == 0, f"{new} new graphs")
    new = 0
    for window in (S // 5, S // 3, S // 2):  # the first one may compile (a new mask_mod)
        before = counters["stats"]["unique_graphs"]
        out = flexpack.attention(
            q, k, v, mask & masks.sliding_window(window), enable_gqa=True, backend="flex"
        )
        if not dry_run:
            out.sum().backward()
        new += (counters["stats"]["unique_graphs"] - before) * (window != S // 5)
    checks.add("flex recompiles for 2 new windows", new == 0, f"{new} new graphs")
    return checks


def _reference_causal(q, k, v):
    """float64 causal attention, GQA by repetition."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


# --------------------------------------------------------------------------- speed


DENSE_MAX_S = 32768  # SDPA with a dense mask above this: see the module docstring


def make_timer(device: torch.device, *, min_reps: int, budget_s: float):
    def timer(fn: Callable[[], object]) -> tuple[float, int]:
        """(mean seconds per call, repetitions): 2 warm-up calls (the first compiles), then at
        least ``min_reps`` timed calls, more while they fit in ``budget_s``."""
        for _ in range(2):
            fn()
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        one = time.perf_counter() - t0
        reps = max(min_reps, min(100, int(budget_s / max(one, 1e-6))))
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            torch.cuda.synchronize(device)
            return start.elapsed_time(end) / 1e3 / reps, reps
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps, reps

    return timer


@dataclass
class Result:
    S: int
    method: str
    fwd: float = math.nan  # seconds
    fwd_bwd: float = math.nan
    note: str = ""
    reps: int = 0


def _failure(err: BaseException) -> str:
    if isinstance(err, torch.OutOfMemoryError):
        return "out of memory"
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"failed: {type(err).__name__}: {first[:160]}"


def speed(
    device: torch.device,
    S: int,
    *,
    H: int,
    D: int,
    median: float,
    dry_run: bool,
    flops: dict[int, float] | None = None,
    on_result: Callable[[Result], None] = lambda r: None,
):
    """Time every method at one S; each row goes to ``on_result`` as soon as it is measured.

    Returns (results, forward FLOPs); ``flops[S]`` is set before the first row."""
    dtype = torch.float32 if dry_run else torch.bfloat16
    doc_ids = lognormal_doc_ids(S, median=median).to(device)[None]  # (1, S)
    seqlens = seqlens_of(doc_ids.cpu())
    flops_fwd = 4 * H * D * sum(n * (n + 1) / 2 for n in seqlens)
    if flops is not None:
        flops[S] = flops_fwd
    print(
        f"\nS={S}: {len(seqlens)} documents, max {max(seqlens)}, H={H}, D={D}, {dtype}", flush=True
    )
    g = torch.Generator(device=device).manual_seed(0)
    # Model layout: projections give (B, S, H, D), attention sees the (B, H, S, D) transpose.
    leaves = [
        torch.randn(1, S, H, D, device=device, dtype=dtype, generator=g).requires_grad_()
        for _ in range(3)
    ]
    q, k, v = (x.transpose(1, 2) for x in leaves)  # (1, H, S, D) views
    dout_base = torch.randn(1, S, H, D, device=device, dtype=dtype, generator=g)
    dout = dout_base.transpose(1, 2)
    block_mask = flexpack.document_causal_mask(doc_ids)
    timer = make_timer(device, min_reps=2 if dry_run else 5, budget_s=0.05 if dry_run else 2.0)
    results: list[Result] = []

    def run(method: str, fwd: Callable[[], torch.Tensor], grad_out, note="", sdpa=False):
        r = Result(S, method, note=note)
        notes = [note] if note else []
        try:
            if sdpa:  # which SDPA kernel ran (cuDNN, flash, efficient, math)
                notes.append(f"SDPA backend: {sdpa_backend(fwd)}")
            r.fwd, r.reps = timer(fwd)
            if not (dry_run and method == "flexpack flex"):  # no flex backward on CPU
                r.fwd_bwd, _ = timer(lambda: fwd().backward(grad_out))
            else:
                notes.append("no CPU backward")
        except Exception as err:  # one method failing must not lose the others
            notes.append(_failure(err))
        r.note = "; ".join(notes)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        results.append(r)
        on_result(r)
        tf = lambda t: flops_fwd / t / 1e12
        print(
            f"  {method:<26} fwd {r.fwd * 1e3:9.2f} ms {tf(r.fwd):7.3g} TFLOP/s   fwd+bwd "
            f"{r.fwd_bwd * 1e3:9.2f} ms {3.5 * tf(r.fwd_bwd):7.3g} TFLOP/s  x{r.reps}  {r.note}",
            flush=True,
        )

    def skip(method: str, note: str):
        r = Result(S, method, note=note)
        results.append(r)
        on_result(r)
        print(f"  {method}: {note}", flush=True)

    def flex_fwd():
        if dry_run:  # no flex backward on CPU: time the forward without grad
            return flexpack.attention(
                q.detach(), k.detach(), v.detach(), block_mask, backend="flex"
            )
        return flexpack.attention(q, k, v, block_mask, backend="flex")

    run("flexpack flex", flex_fwd, dout)
    run("flexpack auto", lambda: flexpack.attention(q, k, v, block_mask), dout)

    if device.type == "cuda":
        from torch.nn.attention.varlen import varlen_attn

        qt, kt, vt = (x[0] for x in leaves)  # (S, H, D): already unpadded, no copy
        cu = torch.zeros(len(seqlens) + 1, dtype=torch.int32, device=device)
        cu[1:] = torch.cumsum(torch.tensor(seqlens, device=device), 0)
        mx = max(seqlens)
        run(
            "varlen_attn",
            lambda: varlen_attn(qt, kt, vt, cu, cu, mx, mx, window_size=(-1, 0)),
            dout_base[0],
        )
    else:
        skip("varlen_attn", "CUDA only")

    dense_bytes = S * S * 3  # bool mask + its additive bf16 copy inside SDPA
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 8 * 2**30
    if S > DENSE_MAX_S:
        skip(
            "SDPA + dense mask",
            f"skipped: S > {DENSE_MAX_S // 1024}K (mask ~{dense_bytes / 2**30:.0f} GiB; torch "
            "2.13's efficient kernel is wrong past row 2^32/S, its backward crashes past ~46K)",
        )
    elif dense_bytes > 0.5 * free:
        skip("SDPA + dense mask", f"skipped: mask needs ~{dense_bytes / 2**30:.0f} GiB")
    else:
        try:
            dense = (doc_ids[:, :, None] == doc_ids[:, None, :]).tril_()[:, None]  # (1, 1, S, S)
            run(
                "SDPA + dense mask",
                lambda: F.scaled_dot_product_attention(q, k, v, dense),
                dout,
                sdpa=True,
            )
            del dense
        except Exception as err:
            skip("SDPA + dense mask", f"building the mask: {_failure(err)}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    run(
        "SDPA causal (no doc mask)",
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        dout,
        note="not a document mask",
        sdpa=True,
    )
    return results, flops_fwd


# --------------------------------------------------------------------------- report


def targets(results: list[Result]) -> list[tuple[int, str, float, float, bool]]:
    """(S, check, value, target, pass) for each target that could be measured."""
    out = []
    by = {(r.S, r.method): r for r in results}
    for S in sorted({r.S for r in results}):
        # Rows arrive one at a time (the report is rewritten after each): use what exists.
        flex, auto, varlen = (
            by.get((S, "flexpack flex")),
            by.get((S, "flexpack auto")),
            by.get((S, "varlen_attn")),
        )
        if flex is not None and varlen is not None and not math.isnan(varlen.fwd):
            out.append(
                (
                    S,
                    "flex fwd / varlen fwd",
                    varlen.fwd / flex.fwd,
                    0.90,
                    varlen.fwd / flex.fwd >= 0.90,
                )
            )
            vb, fb = varlen.fwd_bwd - varlen.fwd, flex.fwd_bwd - flex.fwd
            if not math.isnan(vb / fb):
                out.append((S, "flex bwd / varlen bwd", vb / fb, 0.85, vb / fb >= 0.85))
        exact = [by.get((S, m)) for m in ("flexpack flex", "varlen_attn", "SDPA + dense mask")]
        for phase in ("fwd", "fwd_bwd"):
            times = [
                getattr(r, phase)
                for r in exact
                if r is not None and not math.isnan(getattr(r, phase))
            ]
            if times and auto is not None and not math.isnan(getattr(auto, phase)):
                ratio = min(times) / getattr(auto, phase)
                out.append(
                    (S, f"auto {phase.replace('_', '+')} / best exact", ratio, 0.98, ratio >= 0.98)
                )
    return out


def markdown(results, flops, checks: Checks, device_name: str, argv: list[str]) -> str:
    lines = [
        "| S | method | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | note |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]

    def cells(t: float, flop: float) -> str:
        return "— | —" if math.isnan(t) else f"{t * 1e3:.2f} | {flop / t / 1e12:.3g}"

    for r in results:
        f = flops[r.S]
        fwd, fwd_bwd = cells(r.fwd, f), cells(r.fwd_bwd, 3.5 * f)
        note = "; ".join(([f"{r.reps} reps"] if r.reps else []) + ([r.note] if r.note else []))
        lines.append(f"| {r.S} | {r.method} | {fwd} | {fwd_bwd} | {note} |")
    lines += ["", "| S | target | measured | needed | |", "|---:|---|---:|---:|---|"]
    for S, name, value, target, ok in targets(results):
        lines.append(f"| {S} | {name} | {value:.1%} | {target:.0%} | {'PASS' if ok else 'FAIL'} |")
    head = (
        f"# Attention on GPU: flexpack vs varlen_attn and SDPA (document-causal, bf16)\n\n"
        f"- Date: {datetime.date.today()}; device: {device_name}; torch {torch.__version__}\n"
        f"- Command: `python bench/gpu.py {' '.join(argv)}`\n"
        f"- Correctness: {len(checks.lines) - checks.failed}/{len(checks.lines)} checks passed\n\n"
    )
    return head + "\n".join(["```", *checks.lines, "```", "", *lines]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=None)
    parser.add_argument("--quick", action="store_true", help="S in {8K, 32K}: under 4 minutes")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU")
    parser.add_argument("--out", default=None, help="write the markdown report here (as it goes)")
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    from flexpack import _compat

    print("\n".join(_compat.describe()), flush=True)  # torch, triton, fallbacks in use
    if args.dry_run:
        device = torch.device("cpu")
        sizes, H, D, median, S_check = args.sizes or [256], 2, 16, 32, 150
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run on a GPU machine, or pass --dry-run", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        default = [8192, 32768] if args.quick else [8192, 32768, 131072]
        sizes, H, D, median, S_check = args.sizes or default, 16, 128, 1024, 1000
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)"
    torch.set_float32_matmul_precision("highest")  # fp32 checks mean IEEE fp32, not TF32
    t0 = time.perf_counter()
    results: list[Result] = []
    flops: dict[int, float] = {}

    def write(checks: Checks) -> None:  # after every row: a crash keeps what finished
        if args.out:
            with open(args.out, "w") as f:
                f.write(markdown(results, flops, checks, name, argv))

    print(f"correctness on {name} (S={S_check}):", flush=True)
    checks = correctness(device, S=S_check, dry_run=args.dry_run)
    write(checks)
    if checks.failed:
        print(f"{checks.failed} correctness checks FAILED: not timing", file=sys.stderr)
        return 1
    for S in sizes:
        speed(
            device,
            S,
            H=H,
            D=D,
            median=median,
            dry_run=args.dry_run,
            flops=flops,
            on_result=lambda r: (results.append(r), write(checks)),
        )
    report = markdown(results, flops, checks, name, argv)
    print("\n" + report)
    print(f"total {time.perf_counter() - t0:.0f} s")
    write(checks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
