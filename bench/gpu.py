"""GPU attention benchmark: correctness first, then bf16 TFLOP/s of flexpack vs torch's kernels.

Made for a short GPU loan (15 minutes of device time, machine start included; only files under
``$OUT`` come back): one command, ``PYTHONUNBUFFERED=1 PYTHONPATH=. python3 bench/gpu.py``, runs
everything in order of value inside a 390 s budget and writes ``$OUT/gpu.md`` (rewritten after
every row, so a crash or a time-out keeps what finished) with the log ``$OUT/gpu.log`` beside
it; without $OUT, ``bench/results/gpu.md`` (``gpu-quick.md`` with ``--quick``). Every check and
every timing row runs in its own ``try`` (a failure marks its line or row, and the run goes on).
The budget (``--quick``: 225 s; full run: 390 s; ``--budget``) is printed with the plan and an
estimate per step at the start, checked before every step, and enforced by an alarm inside one:
what does not fit is skipped and listed in the report. The budget's stop is a stop, never a
failure: once it is spent, any exception (dynamo wraps the alarm's in InternalTorchDynamoError,
TorchRuntimeError, BackendCompilerFailed) ends the run cleanly. The flex compile estimate (25 s)
is replaced by the first compile measured. Runs from a plain checkout with torch, numpy and
nothing else.

Plan (:func:`run_plan`), in order:

1. Correctness, bf16 (S=1000, a lognormal layout with padding and a row of arbitrary repeated
   ids, GQA): ``flexpack.attention`` with backend "varlen", "auto", "sdpa", "flex", outputs and
   q/k/v gradients against a float64 per-document reference (bf16 < 1e-2), padding rows exactly
   0; a sliding window on flex and on auto (varlen's ``window_size=(W, 0)``), fp32 GQA causal
   SDPA (not the math kernel), and 0 recompiles of flex for a new layout or a new window. The
   reference takes the inputs rounded to the kernel's dtype.
2. Speed, document-causal, B=1, H=16, lognormal documents (median 1024, sigma 1), bf16, at
   S=8K and 32K and D=128 then 64: flexpack flex against ``varlen_attn`` on pre-unpadded tokens
   (at D=128 also flexpack auto, SDPA with a dense (S, S) mask and SDPA causal without a
   document mask, a speed anchor only). Each SDPA row notes the backend that ran.
3. Tree masks (GRPO-like trees: a prompt and 8 completions, repeated) and window masks
   (document_causal & sliding_window(1024), documents of median 4096) at 32K: flex against the
   per-segment SDPA path, and against varlen with the window.
4. S=128K (no dense mask: ~48 GiB; torch 2.13's efficient kernel is wrong past row 2^32 / S).
5. The other checks: fp32 flex / auto / sdpa (< 1e-5), head dim 8 (flex pads it to 16), a
   BlockMask of 64-token blocks (rebuilt at 128).

At least 5 timed repetitions (more while under ~1 s per phase). TFLOP/s count only unmasked
work, the same numerator for every method of a row group: 4 * H * D * (allowed pairs) forward,
2.5x that backward. Targets, printed as PASS/FAIL: flex >= 90% of varlen_attn forward, >= 85%
backward (time of fwd+bwd minus fwd); auto >= 98% of the best exact method.

Exit status: 0 when every check that ran passed, 1 when one failed (after timing), 2 without
CUDA. ``--dry-run`` runs the same code on CPU at tiny sizes (no varlen, no flex backward:
neither exists on CPU), exits 1 on a failed check, does not judge CPU timings against the
targets, and writes under a fresh temp dir unless ``--out`` is given; the CPU suite also runs
``main`` on a faked CUDA device (tests/test_fake_cuda_paths.py).

Usage: python bench/gpu.py [--quick] [--skip-checks] [--sizes 8192 32768 131072]
                           [--dims 128 64] [--out FILE] [--budget S]
       python bench/gpu.py --dry-run
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import signal
import sys
import tempfile
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


# The clock budgets read (tests swap in a fake one, which also turns the alarm off).
_CLOCK: Callable[[], float] = time.perf_counter


class Budget:
    """The wall-clock budget of a run: steps that would not fit are skipped, and named.

    ``left()`` is what remains; ``fits(estimate)`` whether a step of ``estimate`` seconds fits.
    With a budget, a SIGALRM at the deadline interrupts a step that overruns its estimate
    (a compile slower than expected): it fails with :class:`OutOfTime` and the run reports.
    ``compile_s`` is the estimate of one flex compile: :data:`COMPILE_S` until the first compile
    is measured, that measurement after.
    """

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.clock = _CLOCK
        self.t0 = self.clock()
        self.skipped: list[str] = []
        self.fired = False  # the alarm went off: every later exception is the budget's stop
        self.compile_s = COMPILE_S
        self.compile_measured = False

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def left(self) -> float:
        return math.inf if self.seconds is None else self.seconds - self.elapsed()

    def spent(self) -> bool:
        """Whether the budget is used up (the alarm fired, or no time is left)."""
        return self.fired or self.left() <= 0

    def fits(self, estimate: float) -> bool:
        return estimate <= self.left()

    def skip(self, what: str, estimate: float) -> str:
        note = f"skipped: budget ({estimate:.0f} s needed, {max(self.left(), 0):.0f} s left)"
        self.skipped.append(what)
        return note

    def measured_compile(self, seconds: float, compiles: int) -> None:
        """Take the first measured compile as the estimate of every later one."""
        if self.compile_measured or compiles <= 0:
            return
        self.compile_measured = True
        was, self.compile_s = self.compile_s, max(1.0, seconds / compiles)
        print(
            f"  (first flex compile measured: ~{self.compile_s:.0f} s, the plan assumed "
            f"{was:.0f} s; later estimates use the measurement)",
            flush=True,
        )

    def _alarm(self) -> bool:
        return (
            self.seconds is not None
            and hasattr(signal, "setitimer")
            and (self.clock is time.perf_counter)
        )

    def __enter__(self) -> Budget:
        global _ACTIVE
        _ACTIVE = self
        if self._alarm():
            self._old = signal.signal(signal.SIGALRM, _out_of_time)
            signal.setitimer(signal.ITIMER_REAL, max(self.left(), 0.001))
        return self

    def __exit__(self, *exc) -> None:
        global _ACTIVE
        _ACTIVE = None
        if self._alarm():
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._old)


_ACTIVE: Budget | None = None  # the budget of the run in progress


class OutOfTime(Exception):
    """The run's budget ran out inside a step."""


def _out_of_time(signum, frame):
    if _ACTIVE is not None:
        _ACTIVE.fired = True
    raise OutOfTime("the run's time budget ran out during this step")


def budget_stop(err: BaseException) -> bool:
    """Whether ``err`` is the budget's stop rather than a failure of the step.

    The alarm raises :class:`OutOfTime` wherever the step is; inside ``torch.compile`` dynamo
    wraps it (``InternalTorchDynamoError``, ``TorchRuntimeError``, ``BackendCompilerFailed``),
    sometimes keeping it only as a cause, sometimes only in its message. So an OutOfTime anywhere
    in the chain, and any exception at all once the budget is spent, is a stop.
    """
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        if isinstance(e, OutOfTime) or "time budget ran out" in str(e):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return _ACTIVE is not None and _ACTIVE.spent()


def _stop_if_budget(err: BaseException) -> None:
    """Re-raise ``err`` as :class:`OutOfTime` when it is the budget's stop (see budget_stop)."""
    if budget_stop(err):
        if isinstance(err, OutOfTime):
            raise err
        raise OutOfTime(f"the run's time budget ran out ({type(err).__name__})") from err


# Rough costs on an H100/H200 with torch 2.11-2.13, for the budget and the compile estimate:
# a new compiled flex graph (forward + backward) and a correctness check once compiled. The
# first compile measured replaces COMPILE_S (Budget.measured_compile).
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
    late: bool = False  # run after the 8K-32K timings (fp32, head dim 8): less telling

    def estimate(self, compile_s: float = COMPILE_S) -> float:
        return CHECK_S + compile_s * self.compiles


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
        except Exception as err:  # report every path, then go on
            _stop_if_budget(err)
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
        plan[-1].late = True
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

    def window(backend: str):
        def run():
            ids = doc_ids()
            if backend == "auto":  # contiguous documents (the packer's): varlen can window them
                ids = ids[:1].repeat(B, 1)
            windowed = masks.document(ids) & masks.causal() & masks.sliding_window(S // 7)
            check(
                f"{backend:<6} sliding window",
                inputs,
                lambda q, k, v: flexpack.attention(
                    q, k, v, windowed, enable_gqa=True, backend=backend
                ),
                lambda q, k, v: _reference(q, k, v, windowed),
                bf16,
                grad,
            )

        return run

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

    def sinks():
        # gpt-oss's sinks: compiled flex with its LSE (bucketed), o * sigmoid(lse - sink)
        from flexpack._attention_sinks import dense_sink_attention, sink_attention
        from flexpack.testing import references

        logits = torch.randn(Hq, generator=g)
        cpu_mask = masks.document(doc_ids_cpu()) & masks.causal()

        def want(q, k, v):
            allowed = references.dense_mask(cpu_mask, device="cpu")
            return dense_sink_attention(q, k, v, allowed, logits.double(), scale=None)

        check(
            "flex   attention sinks (LSE)",
            inputs,
            lambda q, k, v: sink_attention(
                q, k, v, mask(), logits.to(device), scale=None, enable_gqa=True, backend="flex"
            ),
            want,
            bf16,
            grad,
        )

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
        except Exception as err:
            _stop_if_budget(err)
            checks.add("flex recompiles", False, f"{type(err).__name__}: {str(err)[:200]}")
        finally:
            _empty_cache(device)

    plan += [
        Check("flex   head dim 8 (padded to 16 on CUDA)", head_dim_8, compiles=1, late=True),
        Check("flex   sliding window", window("flex"), compiles=1),
        # auto: varlen with window_size=(W, 0) on CUDA (the row's documents are contiguous)
        Check("auto   sliding window", window("auto"), compiles=0),
        # A BlockMask runs at its own shape (S=1000, not a bucket): a graph of its own.
        Check("flex   BlockMask of 64-token blocks", blocks64, compiles=1, late=True),
        Check("sdpa   causal fp32 GQA", causal_fp32, compiles=0),
        Check("flex   attention sinks (LSE)", sinks, compiles=1),
        # New layouts and windows at the shapes of the checks above: no new graph.
        Check("flex recompiles (new layouts, new windows)", recompiles, compiles=0),
    ]
    return plan


def run_checks(steps: list[Check], checks: Checks, budget: Budget) -> None:
    """Run the steps that fit the budget; a failure marks its line and the next step runs."""
    for step in steps:
        estimate = step.estimate(budget.compile_s)
        if not budget.fits(estimate):
            checks.lines.append(f"  skip {step.name}: {budget.skip(step.name, estimate)}")
            print(checks.lines[-1], flush=True)
            continue
        t0, failed = budget.elapsed(), checks.failed
        try:
            step.run()
        except Exception as err:  # a check's own bookkeeping failed: still only its line
            if budget_stop(err):  # cut at the deadline: not a failure of the check
                checks.lines.append(f"  skip {step.name}: stopped, the time budget ran out")
                print(checks.lines[-1], flush=True)
                budget.skipped.append(step.name)
                continue
            checks.add(step.name, False, f"{type(err).__name__}: {str(err)[:200]}")
        if checks.failed == failed:  # a failed compile measures nothing
            budget.measured_compile(budget.elapsed() - t0 - CHECK_S, step.compiles)


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
    def timer(fn: Callable[[], object]) -> tuple[float, int, float]:
        """(mean seconds per call, repetitions, seconds of the first call): 2 warm-up calls
        (the first compiles: its time is the compile's measurement), then at least
        ``min_reps`` timed calls, more while they fit in ``budget_s``."""
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
        t0 = time.perf_counter()
        fn()
        sync(device)
        first = time.perf_counter() - t0
        fn()
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
            return start.elapsed_time(end) / 1e3 / reps, reps, first
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps, reps, first

    return timer


@dataclass
class Result:
    S: int
    method: str
    fwd: float = math.nan  # seconds
    fwd_bwd: float = math.nan
    note: str = ""
    reps: int = 0
    D: int = 128
    mask: str = "document_causal"

    @property
    def key(self) -> tuple[int, int, str]:
        """(S, D, mask): the rows that time the same work."""
        return (self.S, self.D, self.mask)


def _failure(err: BaseException) -> str:
    if budget_stop(err):
        return "stopped: the time budget ran out"
    if isinstance(err, torch.OutOfMemoryError):
        return "out of memory"
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"failed: {type(err).__name__}: {first[:160]}"


# The rows of speed() per mask, in order, and the methods that compile a flex graph.
METHODS = (
    "flexpack flex",
    "flexpack auto",
    "varlen_attn",
    "SDPA + dense mask",
    "SDPA causal (no doc mask)",
)
MASK_METHODS = {
    "document_causal": METHODS,
    # GRPO-like prefix trees: flex against flexpack's per-segment SDPA path.
    "tree": ("flexpack flex", "flexpack sdpa (per segment)"),
    # document_causal & sliding_window(W): flex, auto (varlen with window_size on CUDA), and
    # the peer's call (varlen_attn with window_size=(W, 0) on pre-unpadded tokens).
    "window": ("flexpack flex", "flexpack auto", "varlen_attn"),
}
COMPILING = ("flexpack flex",)
# Seconds a row takes once compiled (3 warm-up calls and ~1 s of repetitions per phase).
ROW_S = 5.0
WINDOW = 1024  # the sliding window of the "window" rows (Mistral's 4096 at a quarter)


def tree_layout(S: int, *, prompt: int, completions: int, completion: int, seed: int = 0):
    """(1, S) segment ids and (1, n) parents of GRPO-like trees filling a row: a prompt of
    ~``prompt`` tokens, then ``completions`` completions of lognormal lengths (median
    ``completion``) as its children; repeated while they fit, the rest padding (-1)."""
    g = torch.Generator().manual_seed(seed)
    seg, parents, pos = torch.full((S,), -1, dtype=torch.int32), [], 0

    def length(median: float) -> int:
        return max(8, int(math.exp(math.log(median) + 0.5 * float(torch.randn(1, generator=g)))))

    while True:
        sizes = [length(prompt)] + [length(completion) for _ in range(completions)]
        if pos + sum(sizes) > S:
            break
        root = len(parents)
        for j, n in enumerate(sizes):
            seg[pos : pos + n] = len(parents)
            parents.append(-1 if j == 0 else root)
            pos += n
    return seg[None], torch.tensor([parents], dtype=torch.int64)


def tree_flops(seg: torch.Tensor, parents: torch.Tensor, H: int, D: int) -> float:
    """Forward FLOPs of tree attention: each segment's queries against its ancestors' keys and
    itself causally (4 * H * D per (query, key) pair)."""
    lengths = torch.bincount(seg[seg >= 0].long()).tolist()
    pairs = 0.0
    for s, n in enumerate(lengths):
        ancestors, p = 0, int(parents[0, s])
        while p >= 0:
            ancestors += lengths[p]
            p = int(parents[0, p])
        pairs += n * ancestors + n * (n + 1) / 2
    return 4 * H * D * pairs


def window_flops(seqlens: list[int], window: int, H: int, D: int) -> float:
    """Forward FLOPs of document_causal & sliding_window(window): query i of a document sees
    min(i + 1, window + 1) keys."""
    W = window + 1
    pairs = sum(W * (W + 1) / 2 + (n - W) * W if n > W else n * (n + 1) / 2 for n in seqlens)
    return 4 * H * D * pairs


def speed(
    device: torch.device,
    S: int,
    *,
    H: int,
    D: int,
    median: float,
    dry_run: bool,
    flops: dict | None = None,
    on_result: Callable[[Result], None] = lambda r: None,
    budget: Budget | None = None,
    mask: str = "document_causal",
    methods: tuple[str, ...] | None = None,
    window: int = WINDOW,
):
    """Time ``methods`` (default: every row of ``mask``) at one (S, D, mask); each row goes to
    ``on_result`` as soon as it is measured.

    Every row runs in its own ``try``; a row that would not fit ``budget`` is skipped (and
    named); the budget's stop ends the call (:class:`OutOfTime`). Returns (results, forward
    FLOPs); ``flops[(S, D, mask)]`` is set before the first row."""
    budget = budget or Budget(None)
    methods = methods or MASK_METHODS[mask]
    dtype = torch.float32 if dry_run else torch.bfloat16
    results: list[Result] = []
    if mask == "tree":
        prompt = min(median, S / 32)  # a few trees in any row
        seg_cpu, parents = tree_layout(S, prompt=prompt, completions=8, completion=prompt / 2)
        doc_ids_cpu, seqlens = seg_cpu, [int((seg_cpu >= 0).sum())]
        flops_fwd = tree_flops(seg_cpu, parents, H, D)
        what = f"{int(parents.shape[1])} segments in trees of 1 prompt + 8 completions"
    else:
        # Windows: documents of median 4 windows, so that the window cuts most of them.
        doc_median = max(median, 4 * window) if mask == "window" else median
        doc_ids_cpu = lognormal_doc_ids(S, median=doc_median)[None]  # (1, S)
        seqlens = seqlens_of(doc_ids_cpu)
        if mask == "window":
            flops_fwd = window_flops(seqlens, window, H, D)
            what = f"{len(seqlens)} documents, max {max(seqlens)}, window {window}"
        else:
            flops_fwd = 4 * H * D * sum(n * (n + 1) / 2 for n in seqlens)
            what = f"{len(seqlens)} documents, max {max(seqlens)}"
    key = (S, D, mask)
    if flops is not None:
        flops[key] = flops_fwd
    print(f"\nS={S} {mask}: {what}, H={H}, D={D}, {dtype}", flush=True)
    g = torch.Generator().manual_seed(0)  # on the host: a CUDA generator is not needed

    def row(method: str, note: str = "") -> Result:
        return Result(S, method, note=note, D=D, mask=mask)

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
        if mask == "tree":
            the_mask = masks.tree(doc_ids, parents.to(device))
        elif mask == "window":
            the_mask = masks.document(doc_ids) & masks.causal() & masks.sliding_window(window)
        else:
            the_mask = flexpack.document_causal_mask(doc_ids)
    except Exception as err:  # no inputs at this S: every row says why
        _stop_if_budget(err)
        for method in methods:
            r = row(method, note=f"setup {_failure(err)}")
            results.append(r)
            on_result(r)
        _empty_cache(device)
        return results, flops_fwd
    timer = make_timer(device, min_reps=2 if dry_run else 5, budget_s=0.05 if dry_run else 1.0)

    def run(method: str, fwd: Callable[[], torch.Tensor], grad_out, note="", sdpa=False):
        compiles = method in COMPILING
        estimate = ROW_S + (budget.compile_s if compiles else 0.0)
        if not budget.fits(estimate):
            return skip(method, budget.skip(f"S={S} D={D} {mask} {method}", estimate))
        r = row(method, note=note)
        notes = [note] if note else []
        stop = None
        try:
            if sdpa:  # which SDPA kernel ran (cuDNN, flash, efficient, math)
                notes.append(f"SDPA backend: {sdpa_backend(fwd)}")
            r.fwd, r.reps, first = timer(fwd)
            if not (dry_run and method == "flexpack flex"):  # no flex backward on CPU
                r.fwd_bwd, _, first_bwd = timer(lambda: fwd().backward(grad_out))
                first += first_bwd
            else:
                notes.append("no CPU backward")
            if compiles:
                budget.measured_compile(first, 1)
        except Exception as err:  # one method failing must not lose the others
            notes.append(_failure(err))
            if budget_stop(err):
                stop = err
        finally:
            _empty_cache(device)
        r.note = "; ".join(notes)
        results.append(r)
        on_result(r)
        tf = lambda t: flops_fwd / t / 1e12
        print(
            f"  {method:<28} fwd {r.fwd * 1e3:9.2f} ms {tf(r.fwd):7.3g} TFLOP/s   fwd+bwd "
            f"{r.fwd_bwd * 1e3:9.2f} ms {3.5 * tf(r.fwd_bwd):7.3g} TFLOP/s  x{r.reps}  {r.note}",
            flush=True,
        )
        if stop is not None:  # the budget is spent: the rest of the run is skipped
            _stop_if_budget(stop)

    def skip(method: str, note: str):
        r = row(method, note=note)
        results.append(r)
        on_result(r)
        print(f"  {method}: {note}", flush=True)

    def flex_fwd():
        if dry_run:  # no flex backward on CPU: time the forward without grad
            return flexpack.attention(q.detach(), k.detach(), v.detach(), the_mask, backend="flex")
        return flexpack.attention(q, k, v, the_mask, backend="flex")

    def varlen_row(window_size: tuple[int, int]) -> None:
        if device.type != "cuda":
            return skip("varlen_attn", "CUDA only")
        try:
            from torch.nn.attention.varlen import varlen_attn

            qt, kt, vt = (x[0] for x in leaves)  # (S, H, D): already unpadded, no copy
            cu = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
            cu[1:] = torch.cumsum(torch.tensor(seqlens), 0)
            cu, mx = cu.to(device), max(seqlens)
        except Exception as err:
            _stop_if_budget(err)
            return skip("varlen_attn", _failure(err))
        note = "" if window_size == (-1, 0) else f"window_size={window_size}"
        run(
            "varlen_attn",
            lambda: varlen_attn(qt, kt, vt, cu, cu, mx, mx, window_size=window_size),
            dout_base[0],
            note=note,
        )

    for method in methods:
        if method == "flexpack flex":
            run(method, flex_fwd, dout)
        elif method == "flexpack auto":
            run(method, lambda: flexpack.attention(q, k, v, the_mask), dout)
        elif method == "flexpack sdpa (per segment)":
            run(method, lambda: flexpack.attention(q, k, v, the_mask, backend="sdpa"), dout)
        elif method == "varlen_attn":
            varlen_row((window, 0) if mask == "window" else (-1, 0))
        elif method == "SDPA + dense mask":
            dense_row(S, doc_ids, q, k, v, dout, run, skip, device)
        elif method == "SDPA causal (no doc mask)":
            run(
                method,
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                dout,
                note="not a document mask",
                sdpa=True,
            )
    return results, flops_fwd


def dense_row(S, doc_ids, q, k, v, dout, run, skip, device) -> None:
    """The "SDPA + dense mask" row: a (1, 1, S, S) bool mask, where it fits."""
    dense_bytes = S * S * 3  # bool mask + its additive bf16 copy inside SDPA
    try:
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 8 * 2**30
    except Exception as err:
        _stop_if_budget(err)
        free = 0
    if S > DENSE_MAX_S:
        return skip(
            "SDPA + dense mask",
            f"skipped: S > {DENSE_MAX_S // 1024}K (mask ~{dense_bytes / 2**30:.0f} GiB; torch "
            "2.13's efficient kernel is wrong past row 2^32/S, its backward crashes past ~46K)",
        )
    if dense_bytes > 0.5 * free:
        return skip("SDPA + dense mask", f"skipped: mask needs ~{dense_bytes / 2**30:.0f} GiB")
    try:
        dense = (doc_ids[:, :, None] == doc_ids[:, None, :]).tril_()[:, None]  # (1, 1, S, S)
    except Exception as err:
        _stop_if_budget(err)
        return skip("SDPA + dense mask", f"building the mask: {_failure(err)}")
    run(
        "SDPA + dense mask",
        lambda: F.scaled_dot_product_attention(q, k, v, dense),
        dout,
        sdpa=True,
    )
    _empty_cache(device)  # (the mask is freed when this returns)


# --------------------------------------------------------------------------- report


def targets(results: list[Result]) -> list[tuple[int, str, float, float, bool]]:
    """(S, check, value, target, pass) for each target that could be measured: per (S, D,
    mask), flex against varlen_attn (documents and windows), auto against the best exact row."""
    out = []
    by = {(r.key, r.method): r for r in results}
    for key in sorted({r.key for r in results}, key=lambda k: (k[2] != "document_causal", k)):
        S, D, mask = key
        label = "" if (D, mask) == (128, "document_causal") else f" (D={D}, {mask})"
        # Rows arrive one at a time (the report is rewritten after each): use what exists.
        flex, auto, varlen = (
            by.get((key, "flexpack flex")),
            by.get((key, "flexpack auto")),
            by.get((key, "varlen_attn")),
        )
        if flex is not None and varlen is not None and not math.isnan(varlen.fwd):
            ratio = varlen.fwd / flex.fwd
            out.append((S, f"flex fwd / varlen fwd{label}", ratio, 0.90, ratio >= 0.90))
            vb, fb = varlen.fwd_bwd - varlen.fwd, flex.fwd_bwd - flex.fwd
            if not math.isnan(vb / fb):
                out.append((S, f"flex bwd / varlen bwd{label}", vb / fb, 0.85, vb / fb >= 0.85))
        exact = [by.get((key, m)) for m in ("flexpack flex", "varlen_attn", "SDPA + dense mask")]
        for phase in ("fwd", "fwd_bwd"):
            times = [
                getattr(r, phase)
                for r in exact
                if r is not None and not math.isnan(getattr(r, phase))
            ]
            if times and auto is not None and not math.isnan(getattr(auto, phase)):
                ratio = min(times) / getattr(auto, phase)
                name = f"auto {phase.replace('_', '+')} / best exact{label}"
                out.append((S, name, ratio, 0.98, ratio >= 0.98))
    return out


def markdown(
    results,
    flops,
    checks: Checks,
    device_name: str,
    argv: list[str],
    budget: Budget | None = None,
    judged: bool = True,
) -> str:
    """The report. ``judged=False`` (a dry run: CPU timings) prints targets without PASS/FAIL."""
    lines = [
        "| S | D | mask | method | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | note |",
        "|---:|---:|---|---|---:|---:|---:|---:|---|",
    ]

    def cells(t: float, flop: float) -> str:
        return "— | —" if math.isnan(t) else f"{t * 1e3:.2f} | {flop / t / 1e12:.3g}"

    for r in results:
        f = flops.get(r.key, math.nan)
        fwd, fwd_bwd = cells(r.fwd, f), cells(r.fwd_bwd, 3.5 * f)
        note = "; ".join(([f"{r.reps} reps"] if r.reps else []) + ([r.note] if r.note else []))
        lines.append(f"| {r.S} | {r.D} | {r.mask} | {r.method} | {fwd} | {fwd_bwd} | {note} |")
    lines += ["", "| S | target | measured | needed | |", "|---:|---|---:|---:|---|"]
    for S, name, value, target, ok in targets(results):
        verdict = ("PASS" if ok else "FAIL") if judged else "not judged (dry run)"
        lines.append(f"| {S} | {name} | {value:.1%} | {target:.0%} | {verdict} |")
    ran = sum(line.startswith(("  ok", "  FAIL")) for line in checks.lines)
    passed = sum(line.startswith("  ok") for line in checks.lines)
    head = (
        f"# Attention on GPU: flexpack vs varlen_attn and SDPA (bf16)\n\n"
        f"- Date: {datetime.date.today()}; device: {device_name}; torch {torch.__version__}\n"
        f"- Command: `python bench/gpu.py {' '.join(argv)}`\n"
        f"- Correctness: {passed}/{ran} checks passed\n"
        f"- Skipped (budget): {', '.join(budget.skipped) if budget and budget.skipped else 'none'}"
        "\n\n"
    )
    return head + "\n".join(["```", *checks.lines, "```", "", *lines]) + "\n"


QUICK_BUDGET_S = 225.0  # --quick stops cleanly before 4 minutes
# The full run stops at 6.5 minutes: with Python's start and CUDA's initialisation it ends before
# 8, inside one device command's 10 and the loan's 15 (machine start included).
FULL_BUDGET_S = 390.0


@dataclass
class Stage:
    """One step of the plan: correctness checks, or the timing rows of one (S, D, mask)."""

    name: str
    checks: list[Check] = field(default_factory=list)
    S: int = 0
    D: int = 0
    H: int = 0
    mask: str = "document_causal"
    methods: tuple[str, ...] = ()

    def compiles(self) -> int:
        if self.checks:
            return sum(c.compiles for c in self.checks)
        return sum(m in COMPILING for m in self.methods)

    def estimate(self, compile_s: float = COMPILE_S) -> float:
        if self.checks:
            return sum(c.estimate(compile_s) for c in self.checks)
        return len(self.methods) * ROW_S + self.compiles() * compile_s


def run_plan(
    *,
    sizes: list[int],
    dims: list[int],
    checks: list[Check],
    H: int,
    dry_run: bool,
    trees_and_windows: bool = True,
) -> list[Stage]:
    """The run in order of value: the bf16 correctness checks (what training runs); flex
    against varlen at every size up to 32K (every head dim of ``dims``, all rows at the first);
    tree and window masks; the sizes above 32K; then the other checks (fp32, head dim 8, a
    64-token BlockMask: paths fewer users take, 3 more compiles)."""
    core = [c for c in checks if not c.late]
    late = [c for c in checks if c.late]
    short = [S for S in sizes if S <= DENSE_MAX_S] or sizes[:1]
    long = [S for S in sizes if S not in short]
    stages = [Stage("checks", checks=core)] if core else []
    for S in short:
        for i, D in enumerate(dims):
            methods = METHODS if i == 0 else ("flexpack flex", "varlen_attn")
            stages.append(Stage(f"time S={S} D={D}", S=S, D=D, H=H, methods=methods))
    if trees_and_windows:
        S, D = short[-1], dims[0]
        for mask in ("tree", "window"):
            stages.append(
                Stage(f"time S={S} D={D} {mask}", S=S, D=D, H=H, mask=mask,
                      methods=MASK_METHODS[mask])
            )  # fmt: skip
    for S in long:
        methods = tuple(m for m in METHODS if m != "SDPA + dense mask")
        stages.append(Stage(f"time S={S} D={dims[0]}", S=S, D=dims[0], H=H, methods=methods))
    if late:
        stages.append(Stage("checks (fp32, head dim 8, 64-token blocks)", checks=late))
    return stages


def plan_summary(stages: list[Stage]) -> tuple[str, int, float]:
    """(the plan in run order, estimated new flex graphs, estimated seconds) of a run."""
    lines, elapsed = [], 0.0
    for st in stages:
        elapsed += st.estimate()
        what = ", ".join(c.name.strip() for c in st.checks) if st.checks else ", ".join(st.methods)
        lines.append(f"  ~{elapsed:4.0f} s  {st.name}: {what} (~{st.estimate():.0f} s)")
    compiles = sum(st.compiles() for st in stages)
    return "\n".join(lines), compiles, elapsed


class _Tee:
    """stdout that is also written to a log file (the report's twin under $OUT)."""

    def __init__(self, stream, path: Path) -> None:
        self.stream, self.file = stream, open(path, "w")

    def write(self, text: str) -> int:
        self.file.write(text)
        self.file.flush()
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()
        self.file.flush()

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def default_out(dry_run: bool, quick: bool) -> Path:
    """Where the report goes without ``--out``: ``$OUT/gpu.md`` when $OUT is set (the device
    machine sends back only what is under it), a fresh temp dir for a dry run (never the tracked
    results), else bench/results/gpu[-quick].md."""
    if dry_run:
        return Path(tempfile.mkdtemp(prefix="flexpack-gpu-dry-run-")) / "gpu-dry-run.md"
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu.md"
    return Path(__file__).resolve().parent / "results" / f"gpu{'-quick' if quick else ''}.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=None)
    parser.add_argument(
        "--dims", type=int, nargs="+", default=None, help="head dims (default 128 64)"
    )
    parser.add_argument("--quick", action="store_true", help="S in {8K, 32K}, D 128")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU")
    parser.add_argument("--skip-checks", action="store_true", help="time only (a rerun)")
    parser.add_argument(
        "--check-size", type=int, default=None, help="S of the correctness checks (default 1000)"
    )
    parser.add_argument(
        "--out",
        default=None,
        help="the markdown report, rewritten after every row, with its log beside it (.log; "
        "default: $OUT/gpu.md when $OUT is set, a temp dir with --dry-run, else "
        "bench/results/gpu.md or gpu-quick.md)",
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
    out = Path(args.out) if args.out else default_out(args.dry_run, args.quick)
    seconds = args.budget
    if seconds is None and not args.dry_run:
        seconds = QUICK_BUDGET_S if args.quick else FULL_BUDGET_S
    budget = Budget(seconds)
    stdout = sys.stdout
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        sys.stdout = _Tee(stdout, out.with_suffix(".log"))
    except OSError as err:
        print(f"  (no log beside {out}: {err})", flush=True)
    try:
        return _main(args, argv, out, seconds, budget)
    finally:
        if isinstance(sys.stdout, _Tee):
            sys.stdout.file.close()
        sys.stdout = stdout


def _main(args, argv: list[str], out: Path, seconds: float | None, budget: Budget) -> int:
    from flexpack import _compat

    print("\n".join(_compat.describe()), flush=True)  # torch, triton, fallbacks in use
    if args.dry_run:
        device = torch.device("cpu")
        sizes, dims, H, median, S_check = args.sizes or [256], args.dims or [16], 2, 32, 150
        window = 32
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run on a GPU machine, or pass --dry-run", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        default = [8192, 32768] if args.quick else [8192, 32768, 131072]
        sizes, H, median, S_check = args.sizes or default, 16, 1024, 1000
        dims = args.dims or ([128] if args.quick else [128, 64])
        window = WINDOW
    S_check = args.check_size or S_check
    try:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)"
    except Exception as err:
        name = f"CUDA ({type(err).__name__} naming it)"
    print(f"device: {name}; torch {torch.__version__}; load {os.getloadavg()}", flush=True)
    torch.set_float32_matmul_precision("highest")  # fp32 checks mean IEEE fp32, not TF32
    results: list[Result] = []
    flops: dict = {}
    checks = Checks()
    judged = not args.dry_run

    def write() -> None:  # after every row: a crash or a time-out keeps what finished
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(markdown(results, flops, checks, name, argv, budget, judged))
        except OSError as err:
            print(f"  (could not write {out}: {err})", flush=True)

    def plan_of(check_list: list[Check]) -> list[Stage]:
        return run_plan(
            sizes=sizes, dims=dims, checks=[] if args.skip_checks else check_list, H=H,
            dry_run=args.dry_run,
        )  # fmt: skip

    text, compiles, estimate = plan_summary(
        plan_of(correctness_plan(device, S=S_check, dry_run=args.dry_run, checks=Checks()))
    )
    limit = "none" if seconds is None else f"{seconds:.0f} s"
    print(
        f"budget: {limit}; plan (estimated ~{estimate:.0f} s, ~{compiles} flex compiles of "
        f"~{COMPILE_S:.0f} s each until the first is measured; what does not fit is skipped "
        f"and listed):\n{text}\nreport: {out} (rewritten after every row; log: "
        f"{out.with_suffix('.log')})",
        flush=True,
    )

    def on_result(r: Result) -> None:
        results.append(r)
        write()

    try:
        with budget:
            plan = correctness_plan(device, S=S_check, dry_run=args.dry_run, checks=checks)
            stages = plan_of(plan)
            for st in stages:
                if st.checks:
                    print(f"\ncorrectness on {name} (S={S_check}): {st.name}", flush=True)
                    run_checks(st.checks, checks, budget)
                    write()
                    continue
                try:
                    speed(
                        device, st.S, H=st.H, D=st.D, median=median, dry_run=args.dry_run,
                        flops=flops, on_result=on_result, budget=budget, mask=st.mask,
                        methods=st.methods, window=window,
                    )  # fmt: skip
                except Exception as err:
                    if budget_stop(err):
                        budget.skipped.append(f"{st.name} (the rest)")
                        raise OutOfTime("stopped") from err
                    print(f"{st.name} failed: {_failure(err)}", flush=True)
    except OutOfTime:
        budget.skipped.append("the rest (the time budget ran out)")
    if checks.failed:
        print(f"{checks.failed} correctness checks FAILED (marked)", flush=True)
    report = markdown(results, flops, checks, name, argv, budget, judged)
    print("\n" + report)
    print(f"total {budget.elapsed():.0f} s; skipped: {', '.join(budget.skipped) or 'nothing'}")
    print(f"report: {out}; log: {out.with_suffix('.log')}")
    write()
    return 1 if checks.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
