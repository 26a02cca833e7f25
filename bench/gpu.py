"""GPU attention benchmark: correctness first, then bf16 TFLOP/s of flexpack vs torch's kernels.

Made to survive a first contact with a GPU: every check and every timing row runs in its own
``try`` (a failure marks its line or row, and the run goes on, to the timing too); the report is
rewritten after every row (``--out``, default ``bench/results/gpu-quick.md`` with ``--quick``,
``bench/results/gpu.md`` otherwise), so a crash or a time-out keeps what finished; the budget
(``--quick``: 225 s, under 4 minutes; full run: 570 s) is printed with the plan and an estimate of
the flex compiles at the start, checked before every step, and enforced by an alarm inside one:
what does not fit is skipped and listed in the report. Runs from a plain checkout with torch,
numpy and nothing else: ``PYTHONPATH=. python3 bench/gpu.py --quick``.

1. Correctness (S=1000, a lognormal layout with padding and a row of arbitrary repeated ids, GQA):
   ``flexpack.attention`` with backend "varlen", "auto", "sdpa", "flex" in bf16, then "flex",
   "auto", "sdpa" in fp32, against a float64 per-document reference, outputs and q/k/v gradients
   (relative error: bf16 < 1e-2, fp32 < 1e-5), padding rows exactly 0. The reference takes the
   inputs rounded to the kernel's dtype (a perfect bf16 kernel scores ~4.5e-3 against the
   unrounded fp32 inputs). Then every other CUDA path once: head dim 8 (flex pads it to 16), a
   sliding window (flex), a BlockMask of 64-token blocks (rebuilt at 128 on CUDA), fp32 GQA causal
   SDPA (k/v repeated so it stays off the math kernel; the SDPA backend that ran is logged); and 0
   recompiles of flex for a new layout or a new window at the same shape.
2. Speed: B=1, H=16, D=128, S in {8K, 32K, 128K} (``--quick``: 8K, 32K), lognormal documents
   (median 1024 tokens, sigma 1), document-causal, bf16. Forward and forward+backward of
   flexpack (backend "flex" and "auto") against ``varlen_attn`` on pre-unpadded tokens, SDPA
   with a dense (S, S) mask (up to 32K only: at 128K the mask is ~48 GiB, the efficient kernel
   is wrong past row 2^32 / S and its backward crashes above ~46-65K tokens in torch 2.13) and
   SDPA causal without a document mask (not the same mask: a speed anchor only). Each SDPA row
   notes the backend that ran (cuDNN may come first on sm90). At least 5 timed repetitions (more
   while under ~2 s per phase). TFLOP/s count only unmasked work, the same numerator for every
   method: forward 4 * H * D * sum_i L_i (L_i + 1) / 2, backward 2.5x that.
3. Targets, printed as PASS/FAIL: flex >= 90% of varlen_attn forward, >= 85% backward (time of
   fwd+bwd minus fwd); auto >= 98% of the best exact method, forward and forward+backward.

Exit status: 0 when every check that ran passed, 1 when one failed (after timing), 2 without
CUDA. ``--dry-run`` runs the same code on CPU at tiny sizes (no varlen, no flex backward:
neither exists on CPU), so this script cannot rot on machines without a GPU; the CPU suite
also runs the correctness section on a faked CUDA device (tests/test_fake_cuda_paths.py).

Usage: python bench/gpu.py [--quick] [--sizes 8192 32768 131072] [--out FILE] [--budget S]
       python bench/gpu.py --dry-run
"""

from __future__ import annotations

import argparse
import datetime
import math
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

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


class Budget:
    """The wall-clock budget of a run: steps that would not fit are skipped, and named.

    ``left()`` is what remains; ``fits(estimate)`` whether a step of ``estimate`` seconds fits.
    With a budget, a SIGALRM at the deadline interrupts a step that overruns its estimate
    (a compile slower than expected): it fails with :class:`OutOfTime` and the run reports.
    """

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.t0 = time.perf_counter()
        self.skipped: list[str] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return math.inf if self.seconds is None else self.seconds - self.elapsed()

    def fits(self, estimate: float) -> bool:
        return estimate <= self.left()

    def skip(self, what: str, estimate: float) -> str:
        note = f"skipped: budget ({estimate:.0f} s needed, {max(self.left(), 0):.0f} s left)"
        self.skipped.append(what)
        return note

    def __enter__(self) -> Budget:
        if self.seconds is not None and hasattr(signal, "setitimer"):
            self._old = signal.signal(signal.SIGALRM, _out_of_time)
            signal.setitimer(signal.ITIMER_REAL, max(self.left(), 0.001))
        return self

    def __exit__(self, *exc) -> None:
        if self.seconds is not None and hasattr(signal, "setitimer"):
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._old)


class OutOfTime(Exception):
    """The run's budget ran out inside a step."""


def _out_of_time(signum, frame):
    raise OutOfTime("the run's time budget ran out during this step")


# Rough costs on an H100/H200 with torch 2.11-2.13, for the budget and the compile estimate:
# a new compiled flex graph (forward + backward) and a correctness check once compiled.
COMPILE_S = 25.0
_TRACEBACKS = False  # print the traceback of a failed check (tests, debugging)
CHECK_S = 2.0


@dataclass
class Check:
    """One correctness check: ``run()`` adds its line to the Checks; ``compiles`` new flex
    graphs it is expected to compile (for the estimate and the budget)."""

    name: str
    run: Callable[[], None]
    compiles: int = 0

    @property
    def estimate(self) -> float:
        return CHECK_S + COMPILE_S * self.compiles


def correctness_plan(device: torch.device, *, S: int, dry_run: bool, checks: Checks) -> list[Check]:
    """The correctness checks, in the order they run (the most telling first); each check
    builds its own inputs inside its ``try``, so that nothing outside one can stop the run."""
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, D = 2, 4, 2, 64
    bf16, fp32 = torch.bfloat16, torch.float32
    cpu_ids: dict[str, torch.Tensor] = {}

    def doc_ids_cpu() -> torch.Tensor:
        if "ids" not in cpu_ids:
            row0 = lognormal_doc_ids(S, median=S / 6, seed=1)
            row0[-(S // 10) :] = -1  # padding at the end, as the packer emits
            row1 = torch.randint(0, 3, (S,), generator=g, dtype=torch.int32)  # repeated ids
            row1[S // 3 : S // 3 + 5] = -1
            cpu_ids["ids"] = torch.stack([row0, row1])
        return cpu_ids["ids"]

    def doc_ids() -> torch.Tensor:
        return doc_ids_cpu().to(device)

    def mask():
        return masks.document(doc_ids()) & masks.causal()

    def inputs(Dh: int = D):
        return [torch.randn(B, h, S, Dh, generator=g) for h in (Hq, Hkv, Hkv)]

    def per_doc(q, k, v):
        return per_document_reference(q, k, v, doc_ids_cpu())

    def check(name, base, run, want_fn, dtype, grad, pad=None):
        """One path: run(q, k, v) against want_fn(q, k, v) in float64 on the rounded inputs."""
        try:
            base = base() if callable(base) else base
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
        except OutOfTime:
            raise
        except Exception as err:  # report every path, then go on
            if _TRACEBACKS:
                import traceback

                traceback.print_exc()
            checks.add(name, False, f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
        finally:
            _empty_cache(device)

    plan: list[Check] = []

    def backend_check(backend: str, dtype: torch.dtype) -> Check:
        name = f"{backend:<6} {str(dtype).removeprefix('torch.'):<8}"
        grad = not (dry_run and backend == "flex")  # flex has no CPU backward

        def run():
            block_mask = flexpack.document_causal_mask(doc_ids())
            check(
                name,
                inputs,
                lambda q, k, v: flexpack.attention(
                    q, k, v, block_mask, enable_gqa=True, backend=backend
                ),
                per_doc,
                dtype,
                grad,
                (doc_ids_cpu() < 0),
            )

        return Check(name, run, compiles=int(backend == "flex"))

    # bf16 first: what a training run uses. varlen is CUDA only.
    for backend in ["varlen", "auto", "sdpa", "flex"]:
        if backend == "varlen" and dry_run:
            continue
        plan.append(backend_check(backend, bf16))
    for backend in ["flex", "auto", "sdpa"]:  # fp32 (auto: flex on CUDA)
        plan.append(backend_check(backend, fp32))
    plan[-3].compiles = 1  # fp32 flex: a configuration of its own (auto fp32 then reuses it)

    grad = not dry_run

    def head_dim_8():
        block_mask = flexpack.document_causal_mask(doc_ids())
        check(
            "flex   head dim 8 (padded to 16 on CUDA)",
            lambda: inputs(8),
            lambda q, k, v: flexpack.attention(
                q, k, v, block_mask, enable_gqa=True, backend="flex"
            ),
            per_doc,
            bf16,
            grad,
        )

    def window():
        windowed = mask() & masks.sliding_window(S // 7)
        check(
            "flex   sliding window",
            inputs,
            lambda q, k, v: flexpack.attention(q, k, v, windowed, enable_gqa=True, backend="flex"),
            lambda q, k, v: _reference(q, k, v, windowed),
            bf16,
            grad,
        )

    def blocks64():
        bm = mask().block_mask(block_size=64)
        check(
            "flex   BlockMask of 64-token blocks",
            inputs,
            lambda q, k, v: flexpack.attention(q, k, v, bm, enable_gqa=True, backend="flex"),
            per_doc,
            bf16,
            grad,
        )

    def causal_fp32():
        causal = masks.causal()
        seen: list[str] = []

        def run(q, k, v):
            seen.append(sdpa_backend(lambda: flexpack.attention(q, k, v, causal, enable_gqa=True)))
            return flexpack.attention(q, k, v, causal, enable_gqa=True)

        check("sdpa   causal fp32 GQA", inputs, run, _reference_causal, fp32, True)
        if seen:
            ok = dry_run or seen[0] != "math"
            checks.add("sdpa   causal fp32 GQA backend", ok, f"{seen[0]} (not the O(S^2) math)")

    def recompiles():
        from torch._dynamo.utils import counters

        try:
            q, k, v = (
                torch.randn(B, h, S, D, generator=g)
                .to(device, torch.bfloat16)
                .requires_grad_(not dry_run)
                for h in (Hq, Hkv, Hkv)
            )
            before = counters["stats"]["unique_graphs"]
            for seed in (5, 6):
                other = torch.stack([lognormal_doc_ids(S, median=S / 8, seed=seed)] * B)
                out = flexpack.attention(
                    q, k, v, flexpack.document_causal_mask(other.to(device)), enable_gqa=True,
                    backend="flex",
                )  # fmt: skip
                if not dry_run:
                    out.sum().backward()
            new = counters["stats"]["unique_graphs"] - before
            checks.add("flex recompiles for 2 new layouts", new == 0, f"{new} new graphs")
            new = 0
            for window in (S // 5, S // 3, S // 2):  # the first may compile (a new mask_mod)
                before = counters["stats"]["unique_graphs"]
                out = flexpack.attention(
                    q, k, v, mask() & masks.sliding_window(window), enable_gqa=True,
                    backend="flex",
                )  # fmt: skip
                if not dry_run:
                    out.sum().backward()
                new += (counters["stats"]["unique_graphs"] - before) * (window != S // 5)
            checks.add("flex recompiles for 2 new windows", new == 0, f"{new} new graphs")
        except OutOfTime:
            raise
        except Exception as err:
            checks.add("flex recompiles", False, f"{type(err).__name__}: {str(err)[:200]}")
        finally:
            _empty_cache(device)

    plan += [
        Check("flex   head dim 8 (padded to 16 on CUDA)", head_dim_8, compiles=1),
        Check("flex   sliding window", window, compiles=1),
        Check("flex   BlockMask of 64-token blocks", blocks64, compiles=0),
        Check("sdpa   causal fp32 GQA", causal_fp32, compiles=0),
        Check("flex recompiles (new layouts, new windows)", recompiles, compiles=1),
    ]
    return plan


def run_checks(steps: list[Check], checks: Checks, budget: Budget) -> None:
    """Run the steps that fit the budget; a failure marks its line and the next step runs."""
    for step in steps:
        if not budget.fits(step.estimate):
            checks.lines.append(f"  skip {step.name}: {budget.skip(step.name, step.estimate)}")
            print(checks.lines[-1], flush=True)
            continue
        try:
            step.run()
        except OutOfTime:  # cut at the deadline: not a failure of the check
            checks.lines.append(f"  skip {step.name}: stopped, the time budget ran out")
            print(checks.lines[-1], flush=True)
            budget.skipped.append(step.name)
        except Exception as err:  # a check's own bookkeeping failed: still only its line
            checks.add(step.name, False, f"{type(err).__name__}: {str(err)[:200]}")


def correctness(
    device: torch.device, *, S: int, dry_run: bool, budget: Budget | None = None
) -> Checks:
    """Every check of :func:`correctness_plan` that fits the budget, in order."""
    checks = Checks()
    plan = correctness_plan(device, S=S, dry_run=dry_run, checks=checks)
    run_checks(plan, checks, budget or Budget(None))
    return checks


def _empty_cache(device: torch.device) -> None:
    """Give the allocator's cached blocks back between steps (inside the guarded region: a
    failure here is reported like any other)."""
    if device.type == "cuda":
        try:
            torch.cuda.empty_cache()
        except Exception as err:  # a broken context: the next step will say so
            print(f"  (empty_cache failed: {type(err).__name__}: {err})", flush=True)


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
    if isinstance(err, OutOfTime):
        return "stopped: the time budget ran out"
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
    budget: Budget | None = None,
):
    """Time every method at one S; each row goes to ``on_result`` as soon as it is measured.

    Every row runs in its own ``try``; a row that would not fit ``budget`` is skipped (and
    named). Returns (results, forward FLOPs); ``flops[S]`` is set before the first row."""
    budget = budget or Budget(None)
    dtype = torch.float32 if dry_run else torch.bfloat16
    results: list[Result] = []
    doc_ids_cpu = lognormal_doc_ids(S, median=median)[None]  # (1, S)
    seqlens = seqlens_of(doc_ids_cpu)
    flops_fwd = 4 * H * D * sum(n * (n + 1) / 2 for n in seqlens)
    if flops is not None:
        flops[S] = flops_fwd
    print(
        f"\nS={S}: {len(seqlens)} documents, max {max(seqlens)}, H={H}, D={D}, {dtype}", flush=True
    )
    g = torch.Generator().manual_seed(0)  # on the host: a CUDA generator is not needed
    try:
        doc_ids = doc_ids_cpu.to(device)
        # Model layout: projections give (B, S, H, D), attention sees the (B, H, S, D) view.
        leaves = [
            torch.randn(1, S, H, D, generator=g, dtype=dtype).to(device).requires_grad_()
            for _ in range(3)
        ]
        q, k, v = (x.transpose(1, 2) for x in leaves)  # (1, H, S, D) views
        dout_base = torch.randn(1, S, H, D, generator=g, dtype=dtype).to(device)
        dout = dout_base.transpose(1, 2)
        block_mask = flexpack.document_causal_mask(doc_ids)
    except OutOfTime:
        raise
    except Exception as err:  # no inputs at this S: every row says why
        for method in METHODS:
            r = Result(S, method, note=f"setup {_failure(err)}")
            results.append(r)
            on_result(r)
        _empty_cache(device)
        return results, flops_fwd
    timer = make_timer(device, min_reps=2 if dry_run else 5, budget_s=0.05 if dry_run else 2.0)

    def run(method: str, fwd: Callable[[], torch.Tensor], grad_out, note="", sdpa=False):
        estimate = ROW_S + (COMPILE_S if method == "flexpack flex" else 0.0)
        if not budget.fits(estimate):
            return skip(method, budget.skip(f"S={S} {method}", estimate))
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
        except Exception as err:  # one method failing must not lose the others (OutOfTime too)
            notes.append(_failure(err))
        finally:
            _empty_cache(device)
        r.note = "; ".join(notes)
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
        try:
            from torch.nn.attention.varlen import varlen_attn

            qt, kt, vt = (x[0] for x in leaves)  # (S, H, D): already unpadded, no copy
            cu = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
            cu[1:] = torch.cumsum(torch.tensor(seqlens), 0)
            cu, mx = cu.to(device), max(seqlens)
            run(
                "varlen_attn",
                lambda: varlen_attn(qt, kt, vt, cu, cu, mx, mx, window_size=(-1, 0)),
                dout_base[0],
            )
        except Exception as err:
            skip("varlen_attn", _failure(err))
    else:
        skip("varlen_attn", "CUDA only")

    dense_bytes = S * S * 3  # bool mask + its additive bf16 copy inside SDPA
    try:
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 8 * 2**30
    except Exception:
        free = 0
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
        _empty_cache(device)
    run(
        "SDPA causal (no doc mask)",
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        dout,
        note="not a document mask",
        sdpa=True,
    )
    return results, flops_fwd


# The rows of speed(), in order, and the seconds a row takes once compiled (2 warm-up calls
# and ~2 s of repetitions per phase).
METHODS = (
    "flexpack flex",
    "flexpack auto",
    "varlen_attn",
    "SDPA + dense mask",
    "SDPA causal (no doc mask)",
)
ROW_S = 10.0


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


def markdown(
    results, flops, checks: Checks, device_name: str, argv: list[str], budget: Budget | None = None
) -> str:
    lines = [
        "| S | method | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | note |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]

    def cells(t: float, flop: float) -> str:
        return "— | —" if math.isnan(t) else f"{t * 1e3:.2f} | {flop / t / 1e12:.3g}"

    for r in results:
        f = flops.get(r.S, math.nan)
        fwd, fwd_bwd = cells(r.fwd, f), cells(r.fwd_bwd, 3.5 * f)
        note = "; ".join(([f"{r.reps} reps"] if r.reps else []) + ([r.note] if r.note else []))
        lines.append(f"| {r.S} | {r.method} | {fwd} | {fwd_bwd} | {note} |")
    lines += ["", "| S | target | measured | needed | |", "|---:|---|---:|---:|---|"]
    for S, name, value, target, ok in targets(results):
        lines.append(f"| {S} | {name} | {value:.1%} | {target:.0%} | {'PASS' if ok else 'FAIL'} |")
    ran = sum(line.startswith(("  ok", "  FAIL")) for line in checks.lines)
    passed = sum(line.startswith("  ok") for line in checks.lines)
    head = (
        f"# Attention on GPU: flexpack vs varlen_attn and SDPA (document-causal, bf16)\n\n"
        f"- Date: {datetime.date.today()}; device: {device_name}; torch {torch.__version__}\n"
        f"- Command: `python bench/gpu.py {' '.join(argv)}`\n"
        f"- Correctness: {passed}/{ran} checks passed\n"
        f"- Skipped (budget): {', '.join(budget.skipped) if budget and budget.skipped else 'none'}"
        "\n\n"
    )
    return head + "\n".join(["```", *checks.lines, "```", "", *lines]) + "\n"


QUICK_BUDGET_S = 225.0  # --quick stops cleanly before 4 minutes
FULL_BUDGET_S = 570.0  # the full run stops before 10 minutes


def plan_summary(sizes: list[int], checks: list[Check]) -> tuple[str, int, float]:
    """(the plan in run order, estimated new flex graphs, estimated seconds) of a run."""
    compiles = sum(c.compiles for c in checks) + len(sizes)  # + the flex row of every S
    seconds = sum(c.estimate for c in checks) + len(sizes) * (len(METHODS) * ROW_S + COMPILE_S)
    core = [c for c in checks if c.name.endswith("bfloat16")]
    rest = [c for c in checks if c not in core]
    row = f"(~{len(METHODS) * ROW_S + COMPILE_S:.0f} s)"
    lines = [f"  check {c.name} (~{c.estimate:.0f} s)" for c in core]
    lines += [f"  time  S={S}: {', '.join(METHODS)} {row}" for S in sizes[:1]]
    lines += [f"  check {c.name} (~{c.estimate:.0f} s)" for c in rest]
    lines += [f"  time  S={S}: {', '.join(METHODS)} {row}" for S in sizes[1:]]
    return "\n".join(lines), compiles, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=None)
    parser.add_argument("--quick", action="store_true", help="S in {8K, 32K}: under 4 minutes")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU")
    parser.add_argument(
        "--out",
        default=None,
        help="the markdown report, rewritten after every row (default: "
        "bench/results/gpu-quick.md with --quick, bench/results/gpu.md otherwise; "
        "bench/results/gpu-dry-run.md with --dry-run)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"seconds (default {QUICK_BUDGET_S:.0f} with --quick, {FULL_BUDGET_S:.0f} "
        "otherwise, none with --dry-run): steps that would not fit are skipped and named",
    )
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    suffix = "-dry-run" if args.dry_run else "-quick" if args.quick else ""
    out = args.out or str(Path(__file__).resolve().parent / "results" / f"gpu{suffix}.md")
    seconds = args.budget
    if seconds is None and not args.dry_run:
        seconds = QUICK_BUDGET_S if args.quick else FULL_BUDGET_S
    budget = Budget(seconds)

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
    try:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)"
    except Exception as err:
        name = f"CUDA ({type(err).__name__} naming it)"
    print(f"device: {name}; torch {torch.__version__}", flush=True)
    # (environment: library versions and active feature fallbacks are printed here)
    torch.set_float32_matmul_precision("highest")  # fp32 checks mean IEEE fp32, not TF32
    results: list[Result] = []
    flops: dict[int, float] = {}
    checks = Checks()

    def write() -> None:  # after every row: a crash or a time-out keeps what finished
        try:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(markdown(results, flops, checks, name, argv, budget))
        except OSError as err:
            print(f"  (could not write {out}: {err})", flush=True)

    text, compiles, estimate = plan_summary(
        sizes, correctness_plan(device, S=S_check, dry_run=args.dry_run, checks=Checks())
    )
    limit = "none" if seconds is None else f"{seconds:.0f} s"
    print(
        f"budget: {limit}; plan (estimated ~{estimate:.0f} s, ~{compiles} flex compiles of "
        f"~{COMPILE_S:.0f} s each; what does not fit is skipped and listed):\n{text}\n"
        f"report: {out} (rewritten after every row)",
        flush=True,
    )
    try:
        with budget:
            # Order: the bf16 checks a training run relies on, the timing of the first size,
            # the other checks, then the other sizes; so a short budget still times something.
            plan = correctness_plan(device, S=S_check, dry_run=args.dry_run, checks=checks)
            core = [c for c in plan if c.name.endswith("bfloat16")]
            rest = [c for c in plan if c not in core]

            def on_result(r: Result) -> None:
                results.append(r)
                write()

            def time_at(S: int) -> None:
                try:
                    speed(
                        device, S, H=H, D=D, median=median, dry_run=args.dry_run, flops=flops,
                        on_result=on_result, budget=budget,
                    )  # fmt: skip
                except OutOfTime:
                    budget.skipped.append(f"S={S} (the rest)")
                except Exception as err:
                    print(f"S={S} failed: {_failure(err)}", flush=True)

            print(f"\ncorrectness on {name} (S={S_check}), bf16:", flush=True)
            run_checks(core, checks, budget)
            write()
            time_at(sizes[0])
            print(f"\ncorrectness on {name} (S={S_check}), the other paths:", flush=True)
            run_checks(rest, checks, budget)
            write()
            if checks.failed:
                print(f"{checks.failed} correctness checks FAILED (marked)", flush=True)
            for S in sizes[1:]:
                time_at(S)
    except OutOfTime:
        budget.skipped.append("the rest (the time budget ran out)")
    report = markdown(results, flops, checks, name, argv, budget)
    print("\n" + report)
    print(f"total {budget.elapsed():.0f} s; skipped: {', '.join(budget.skipped) or 'nothing'}")
    write()
    return 1 if checks.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
