"""GPU attention benchmark: correctness first, then bf16 TFLOP/s of flexpack vs torch's kernels.

Made for a short GPU loan (15 minutes of device time, machine start included; only files under
``$OUT`` come back): one command, ``PYTHONUNBUFFERED=1 PYTHONPATH=. python3 bench/gpu.py``, runs
everything in order of value inside a 390 s budget and writes ``$OUT/gpu.md`` (rewritten after
every row, so a crash or a time-out keeps what finished) with the log ``$OUT/gpu.log`` beside
it; without $OUT, ``bench/results/gpu.md`` (``gpu-quick.md`` with ``--quick``). The log holds
stdout and file descriptor 2 (Python's stderr, torch's logging, and the C compiler that triton
calls, whose errors reach nothing else), and the whole exception chain of every FAIL
(``traceback.format_exception`` with its causes, and the ``inner_exception`` that dynamo's
``BackendCompilerFailed`` keeps after raising ``from None``). Every check and every timing row
runs in its own ``try`` (a failure marks its line or row, and the run goes on). The budget
(``--quick``: 225 s; full run: 390 s; ``--budget``) is printed with the plan and an estimate per
step at the start, checked before every step, and enforced by an alarm inside one: what does not
fit is skipped and listed in the report. The budget's stop is a stop, never a failure: once it is
spent, any exception (dynamo wraps the alarm's in InternalTorchDynamoError, TorchRuntimeError,
BackendCompilerFailed) ends the run cleanly. The flex compile estimate (25 s) is replaced by the
second compile measured (the first includes inductor's one-time warm-up). After the last write
(report and log flushed and fsynced) the command ends with ``os._exit``, so that a compile cut by
the budget (inductor's worker processes, threads) cannot hold the process. Runs from a plain
checkout with torch, numpy and nothing else.

Preflight (:func:`preflight`, ~5 s, its result the first lines of the report): the C compiler
triton calls (``$CC``, else gcc, else clang), ``Python.h`` in sysconfig's include dir, libcuda
(``ctypes.util.find_library`` or ``torch.cuda.is_available()``), and one trivial triton kernel
compiled and run (skipped where triton is not installed). When it fails, no flex compile is
attempted: the flex checks and rows are skipped and named, and the budget goes to the varlen and
SDPA rows.

Plan (:func:`run_plan`), in order of value:

1. Correctness, bf16 (S=1000, a lognormal layout with padding and a row of arbitrary repeated
   ids, GQA): ``flexpack.attention`` with backend "varlen", "auto", "sdpa", "flex", outputs and
   q/k/v gradients against a float64 per-document reference (bf16 < 1e-2), padding rows exactly
   0; a sliding window on flex and on auto (varlen's ``window_size=(W, 0)``), fp32 GQA causal
   SDPA (not the math kernel). The reference takes the inputs rounded to the kernel's dtype.
2. Speed, document-causal, B=1, H=16, lognormal documents (median 1024, sigma 1), bf16, at
   S=8K and 32K, D=128: flexpack flex, flexpack auto and ``varlen_attn`` on pre-unpadded tokens
   (auto and varlen timed interleaved, call for call, so that drift does not decide the 98%
   target), SDPA with a dense (S, S) mask and SDPA causal without a document mask (a speed anchor
   only). Each SDPA row notes the backend that ran.
3. Tree masks (GRPO-like trees: a prompt and 8 completions, repeated) and window masks
   (document_causal & sliding_window(1024), documents of median 4096) at 32K: flex against the
   per-segment SDPA path, and against varlen with the window.
4. Attention sinks (flex with its LSE; tolerance from a bf16 error model, :func:`sink_tolerances`)
   and 0 recompiles of flex for a new layout or a new window.
   Then the hybrid models' token mixers at the first size (:func:`hybrid_rows`, no flex
   compile; fp32 weights in bf16 autocast, hidden 1024): LFM2's short conv, Qwen3.5's gated
   delta rule and Bamba's Mamba2, each as flexpack's one pass over the packed row, the
   module's own forward per group of right-padded documents (flexpack's path before the one
   pass), the module's own forward over the whole row (a speed anchor only: its state leaks)
   and the one pass over GRPO-like prefix trees (the state forked at each branch).
5. D=64 at 8K and 32K: flex against varlen.
6. S=128K (no dense mask: ~48 GiB; torch 2.13's efficient kernel is wrong past row 2^32 / S).
7. The other checks: fp32 flex / auto / sdpa (< 1e-5), head dim 8 (flex pads it to 16), a
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
                           [--dims 128 64] [--out FILE] [--budget S] [--skip-preflight]
       python bench/gpu.py --dry-run
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import math
import os
import shutil
import signal
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

import flexpack
from flexpack import masks

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the harness beside this file
try:
    import _harness
    from _harness import (
        Checks,
        Fd2Tee,
        Log,
        Tee,
        empty_cache,
        exception_chain,
        linked_exceptions,
        rel_err,
        sdpa_backend,
        summary,
    )
finally:  # bench/ holds litgpt.py, trees.py, ...: never left to shadow a package
    del sys.path[0]

# --------------------------------------------------------------------------- layouts


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


BF16_U = 2.0**-8  # bf16's unit roundoff: 8 significant bits, rounding to nearest


def sink_tolerances(q, k, v, allowed, sinks, cot, *, u: float = BF16_U) -> dict[str, float]:
    """Tolerances of the bf16 sinks check for "out" and "dv", in :func:`rel_err`'s units, from
    an error model of what the GPU computes (not a margin picked from one run).

    Args:
        q: (B, Hq, S, D) float64; k, v: (B, Hkv, S, D) float64 (the bf16-rounded inputs).
        allowed: (B or 1, 1, S, S) bool, the mask's dense twin.
        sinks: (Hq,) float64 sink logits.
        cot: (B, Hq, S, D) float64, the cotangent of the output.

    The model, first order in u = 2**-8 (bf16's unit roundoff; fp32 accumulation and exp,
    ~2**-24 per operation, are left out). With o = P V the flex output over the real keys,
    w = sigmoid(lse - sink) and P' = w P the probabilities with the sink column (whose value is
    0: it adds no |p v| term, only roundings), out = w o = P' V, and each rounding to bf16 costs
    at most u times its value:

    - out: flex rounds P before P @ V and rounds o, each u |P'| |V| once scaled by w; then the
      sink term: w rounded to bf16 and the product o * w rounded, u |out| each. So
      |d out| <= u (2 |P'| |V| + 2 |out|), element by element.
    - dv = P'^T dout (GQA: summed over the group): dout, dout * w, P and dv rounded, so
      |d dv| <= 4 u |P'|^T |dout|.

    A bound that holds element by element bounds the max: the tolerance is the max of the bound
    over :func:`rel_err`'s denominator (max |want|, floored at 0.1). dq and dk keep the plain
    bf16 tolerance: their worst case, 5 u scale (P' * (|dout| |V|^T + |rowsum(dout * out)|)) |K|,
    adds magnitudes that cancel in dq and comes to 0.1-0.3 of max |dq| here, too loose to check
    anything.
    """
    rep = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # (B, Hq, S, D)
    s = (q @ kr.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~allowed, -math.inf)
    sink = sinks.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]  # (B, Hq, S, S) P': sink left out
    out = p @ vr

    def grouped(x: torch.Tensor) -> torch.Tensor:  # (B, Hq, S, D) -> (B, Hkv, S, D)
        return x.unflatten(1, (-1, rep)).sum(2)

    want = {"out": out, "dv": grouped(p.transpose(-1, -2) @ cot)}
    bound = {
        "out": u * (2 * (p @ vr.abs()) + 2 * out.abs()),
        "dv": 4 * u * grouped(p.transpose(-1, -2) @ cot.abs()),
    }
    return {n: float(bound[n].max() / want[n].abs().max().clamp(min=0.1)) for n in want}


# --------------------------------------------------------------------------- preflight


PREFLIGHT_S = 5.0  # the preflight's limit; the triton kernel gets what the probes before it left
tl = None  # triton.language, once probe_triton has imported it (triton is optional here)


@dataclass
class Probe:
    """One preflight probe: ``status`` "ok", "FAIL" or "skip" (could not be tried: not a
    failure), and what it found or what to do."""

    name: str
    status: str
    detail: str

    @property
    def line(self) -> str:
        return f"  {self.status:<4} {self.name}: {self.detail}"


@dataclass
class Preflight:
    """The preflight's probes; ``ok`` when none failed (flex compiles go ahead)."""

    probes: list[Probe] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(p.status != "FAIL" for p in self.probes)

    def lines(self) -> list[str]:
        verdict = (
            "ok: flex compiles go ahead"
            if self.ok
            else "FAILED: no flex compile is attempted; the budget goes to the varlen and SDPA "
            "rows (flex checks and rows are skipped and named)"
        )
        return [f"Preflight ({self.seconds:.1f} s): {verdict}", *(p.line for p in self.probes)]


def probe_compiler() -> Probe:
    """The C compiler triton builds its launchers with: ``$CC``, else gcc, else clang (triton's
    own order; a bare ``cc`` is not looked for)."""
    name = "C compiler (triton: $CC, else gcc, else clang)"
    cc = os.environ.get("CC")
    if cc:
        found = shutil.which(cc.split()[0])
        if found is None:
            return Probe(name, "FAIL", f"CC={cc!r} is not on PATH: set CC to a C compiler")
        return Probe(name, "ok", f"CC={cc} ({found})")
    for candidate in ("gcc", "clang"):
        found = shutil.which(candidate)
        if found:
            return Probe(name, "ok", found)
    cc = shutil.which("cc")
    if cc:
        return Probe(name, "FAIL", f"only {cc}, which triton does not look for: set CC={cc}")
    return Probe(name, "FAIL", "none found (no CC, gcc, clang or cc): install gcc or set CC")


def probe_python_h() -> Probe:
    """``Python.h`` in the include dir triton passes to the compiler (sysconfig's, with triton's
    posix_local -> posix_prefix substitution)."""
    scheme = sysconfig.get_default_scheme()
    scheme = "posix_prefix" if scheme == "posix_local" else scheme
    include = sysconfig.get_paths(scheme=scheme)["include"]
    header = Path(include) / "Python.h"
    if header.is_file():
        return Probe("Python.h", "ok", str(header))
    return Probe(
        "Python.h",
        "FAIL",
        f"not in {include}: install this Python's headers (python3-dev) or point CC at an "
        "include dir",
    )


def probe_libcuda() -> Probe:
    """libcuda, the driver triton loads: ``ctypes.util.find_library("cuda")``, or CUDA already
    initialised by torch (which loaded it)."""
    import ctypes.util

    found = ctypes.util.find_library("cuda")
    if found:
        return Probe("libcuda", "ok", found)
    try:
        available = torch.cuda.is_available()
    except Exception as err:
        return Probe("libcuda", "FAIL", f"not found, and torch.cuda says {summary(err)}")
    if available:
        return Probe("libcuda", "ok", "torch.cuda is available (ldconfig does not list it)")
    return Probe("libcuda", "FAIL", "ctypes.util.find_library('cuda') and torch.cuda: none")


def probe_triton(device: torch.device, seconds: float) -> Probe:
    """One trivial triton kernel compiled and run on ``device`` within ``seconds`` (what every
    flex compile needs: the compiler, Python.h, ptxas, libcuda, a launch). Triton missing: a
    skip, not a failure. Its time is not lost: the driver and launcher builds are cached for
    the flex compiles after it."""
    global tl
    name = "triton kernel"
    try:
        import triton

        tl = importlib.import_module("triton.language")  # a global: every triton reads those
    except ImportError as err:
        return Probe(name, "skip", f"triton not importable ({summary(err)})")

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

    t0 = time.perf_counter()
    try:
        with _alarm_after(seconds):
            x = torch.zeros(100, device=device)
            add_one[(1,)](x, 100, BLOCK=128)
            got = float(x.sum())
    except Exception as err:
        log_failure("preflight: triton kernel", err)
        return Probe(name, "FAIL", f"triton {triton.__version__}: {summary(err)[:240]}")
    if got != 100.0:
        return Probe(name, "FAIL", f"triton {triton.__version__}: ran, summed {got}, not 100")
    return Probe(
        name, "ok", f"triton {triton.__version__}: compiled and ran in "
        f"{time.perf_counter() - t0:.1f} s",
    )  # fmt: skip


class PreflightTimeout(Exception):
    """The preflight ran past its limit."""


@contextlib.contextmanager
def _alarm_after(seconds: float):
    """Raise :class:`PreflightTimeout` in the block after ``seconds`` (real clock only: with a
    test's clock, or without setitimer, no alarm)."""
    if not (hasattr(signal, "setitimer") and _CLOCK is time.perf_counter):
        yield
        return
    if seconds <= 0:
        raise PreflightTimeout("no time left of the preflight's limit")

    def fire(signum, frame):
        raise PreflightTimeout(f"did not finish inside the preflight's {PREFLIGHT_S:g} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def preflight(device: torch.device, *, seconds: float = PREFLIGHT_S) -> Preflight:
    """What a flex compile needs, probed in a few seconds before the budget goes to it (see
    the module docstring). On CPU (a dry run) libcuda and the triton kernel are skipped."""
    t0 = time.perf_counter()
    result = Preflight()
    for probe in (probe_compiler, probe_python_h):
        result.probes.append(probe())
    if device.type == "cuda":
        result.probes.append(probe_libcuda())
        result.probes.append(probe_triton(device, seconds - (time.perf_counter() - t0)))
    else:
        result.probes.append(Probe("libcuda, triton kernel", "skip", "not on CUDA (dry run)"))
    result.seconds = time.perf_counter() - t0
    for line in result.lines():
        print(line, flush=True)
    return result


# --------------------------------------------------------------------------- correctness


def _reference_causal(q, k, v) -> torch.Tensor:
    """float64 causal attention (no documents), GQA by repetition."""
    from flexpack.testing import references

    S = q.shape[2]
    causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    return references.reference_attention(q, k, v, causal, enable_gqa=True)


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
    ``compile_s`` is the estimate of one flex compile: :data:`COMPILE_S` until the second compile
    is measured, that measurement after (the first pays inductor's one-time warm-up: imports,
    triton's driver build, the autotuning cache, so it overstates every later compile).
    """

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.clock = _CLOCK
        self.t0 = self.clock()
        self.skipped: list[str] = []
        self.fired = False  # the alarm went off: every later exception is the budget's stop
        self.compile_s = COMPILE_S
        self.compiles_measured: list[float] = []  # seconds per compile, in the order measured

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
        """Take the second measured compile as the estimate of every later one (the first
        includes inductor's warm-up)."""
        if compiles <= 0 or len(self.compiles_measured) >= 2:
            return
        self.compiles_measured.append(max(1.0, seconds / compiles))
        if len(self.compiles_measured) == 1:
            print(
                f"  (first flex compile measured: ~{self.compiles_measured[0]:.0f} s with "
                f"inductor's warm-up; estimates keep {self.compile_s:.0f} s until the second)",
                flush=True,
            )
            return
        was, self.compile_s = self.compile_s, self.compiles_measured[1]
        print(
            f"  (second flex compile measured: ~{self.compile_s:.0f} s, the plan assumed "
            f"{was:.0f} s; later estimates use it)",
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
    for e in linked_exceptions(err):
        if isinstance(e, OutOfTime) or "time budget ran out" in str(e):
            return True
    return _ACTIVE is not None and _ACTIVE.spent()


def _stop_if_budget(err: BaseException) -> None:
    """Re-raise ``err`` as :class:`OutOfTime` when it is the budget's stop (see budget_stop)."""
    if budget_stop(err):
        if isinstance(err, OutOfTime):
            raise err
        raise OutOfTime(f"the run's time budget ran out ({type(err).__name__})") from err


# --------------------------------------------------------------------------- failures, the log


_LOG: Log | None = None  # the log of the run in progress (main)


def log_failure(what: str, err: BaseException) -> None:
    """Write the whole exception chain of a FAIL into the log (the console gets one line; the
    report gets :func:`summary`). Without a log, the chain goes to stdout."""
    text = (
        f"\n----- FAIL {what.strip()}: the exception chain\n{exception_chain(err)}"
        f"----- end of {what.strip()}\n"
    )
    if _LOG is None:
        print(text, flush=True)
        return
    _LOG.write(text)
    print(f"  (the exception chain of {what.strip()!r} is in {_LOG.path.name})", flush=True)


# Rough costs on an H100/H200 with torch 2.11-2.13, for the budget and the compile estimate:
# a new compiled flex graph (forward + backward) and a correctness check once compiled. The
# second compile measured replaces COMPILE_S (Budget.measured_compile).
COMPILE_S = 25.0
CHECK_S = 2.0


@dataclass
class Check:
    """One correctness check: ``run()`` adds its line to the Checks; ``compiles`` new flex
    graphs it is expected to compile (for the estimate and the budget); ``flex``: it runs
    compiled flex on CUDA (skipped when the preflight failed); ``group``: where
    :func:`run_plan` puts it ("first": the bf16 paths; "sinks": sinks and recompiles, after
    the tree and window rows; "other": fp32, head dim 8, 64-token blocks, last)."""

    name: str
    run: Callable[[], None]
    compiles: int = 0
    flex: bool = False
    group: str = "first"

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
            row1 = torch.randint(0, 3, (S,), generator=g, dtype=torch.int32)
            row1[S // 3 : S // 3 + 5] = -1
            # many short documents with unsorted ids, one run each (an id in two runs of a row
            # is refused everywhere: tests/test_split_runs.py)
            starts = torch.ones(S, dtype=torch.bool)
            starts[1:] = row1[1:] != row1[:-1]
            runs = starts.cumsum(0) - 1
            ids = torch.randperm(int(runs[-1]) + 1, generator=g).to(torch.int32)[runs]
            row1 = torch.where(row1 >= 0, ids, -1)
            cpu_ids["ids"] = torch.stack([row0, row1])
        return cpu_ids["ids"]

    def doc_ids() -> torch.Tensor:
        return doc_ids_cpu().to(device)

    def mask():
        return masks.document(doc_ids()) & masks.causal()

    def inputs(Dh: int = D):
        return [torch.randn(B, h, S, Dh, generator=g) for h in (Hq, Hkv, Hkv)]

    def per_doc(q, k, v):  # each document alone, causal
        return _reference(q, k, v, masks.document(doc_ids_cpu()) & masks.causal())

    def check(name, base, run, want_fn, dtype, grad, pad=None, tol_fn=None):
        """One path: run(q, k, v) against want_fn(q, k, v) in float64 on the rounded inputs.
        ``tol_fn(q, k, v, cot)`` (float64 leaves, the output's cotangent) gives tolerances
        by name ("out", "dq", "dk", "dv"); the others, 1e-2 in bf16, 1e-5 else."""
        try:
            base = base() if callable(base) else base
            # The reference sees what the kernel sees: the inputs rounded to its dtype.
            leaves = [x.to(dtype).double().requires_grad_() for x in base]
            want = want_fn(*leaves)
            cot = torch.randn(want.shape, generator=g, dtype=torch.float64)
            tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
            tols = tol_fn(*(x.detach() for x in leaves), cot) if tol_fn is not None else {}
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
            if tols:
                tols = {n: tols.get(n, tol) for n in errs}
                ok = all(e < tols[n] for n, e in errs.items())
                detail = " ".join(f"{n} {e:.1e} (< {tols[n]:.1e})" for n, e in errs.items())
            else:
                ok = max(errs.values()) < tol
                detail = " ".join(f"{n} {e:.1e}" for n, e in errs.items()) + f" (< {tol:g})"
            if pad is not None:
                pad_zero = bool((out.detach().cpu().transpose(1, 2)[pad] == 0).all())
                ok &= pad_zero
                detail += f", pad 0: {pad_zero}"
            checks.add(name, ok, detail)
        except Exception as err:  # report every path, then go on
            _stop_if_budget(err)
            log_failure(name, err)
            checks.add(name, False, summary(err)[:240])
        finally:
            empty_cache(device)

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

        # auto runs flex on CUDA in fp32 (varlen takes half precision only)
        flex = backend == "flex" or (backend == "auto" and dtype == fp32)
        return Check(name, run, compiles=int(backend == "flex"), flex=flex)

    # bf16 first: what a training run uses. varlen is CUDA only.
    for backend in ["varlen", "auto", "sdpa", "flex"]:
        if backend == "varlen" and dry_run:
            continue
        plan.append(backend_check(backend, bf16))
    fp32_checks = [backend_check(backend, fp32) for backend in ["flex", "auto", "sdpa"]]
    for c in fp32_checks:  # fp32 flex: a configuration of its own (auto fp32 then reuses it)
        c.group = "other"

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

        def tolerances(q, k, v, cot):
            allowed = references.dense_mask(cpu_mask, device="cpu")
            return sink_tolerances(q, k, v, allowed, logits.double(), cot)

        check(
            "flex   attention sinks (LSE)",
            inputs,
            lambda q, k, v: sink_attention(
                q, k, v, mask(), logits.to(device), scale=None, enable_gqa=True, backend="flex"
            ),
            want,
            bf16,
            grad,
            tol_fn=tolerances,
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
            log_failure("flex recompiles", err)
            checks.add("flex recompiles", False, summary(err)[:240])
        finally:
            empty_cache(device)

    plan += [
        Check("flex   sliding window", window("flex"), compiles=1, flex=True),
        # auto: varlen with window_size=(W, 0) on CUDA (the row's documents are contiguous)
        Check("auto   sliding window", window("auto"), compiles=0),
        Check("sdpa   causal fp32 GQA", causal_fp32, compiles=0),
        Check("flex   attention sinks (LSE)", sinks, compiles=1, flex=True, group="sinks"),
        # New layouts and windows at the shapes of the checks above: no new graph.
        Check(
            "flex recompiles (new layouts, new windows)",
            recompiles,
            compiles=0,
            flex=True,
            group="sinks",
        ),
        *fp32_checks,
        Check(
            "flex   head dim 8 (padded to 16 on CUDA)",
            head_dim_8,
            compiles=1,
            flex=True,
            group="other",
        ),
        # A BlockMask runs at its own shape (S=1000, not a bucket): a graph of its own.
        Check(
            "flex   BlockMask of 64-token blocks", blocks64, compiles=1, flex=True, group="other"
        ),
    ]
    return plan


NO_FLEX = "skipped: the preflight failed, no flex compile attempted"


def run_checks(steps: list[Check], checks: Checks, budget: Budget, *, flex: bool = True) -> None:
    """Run the steps that fit the budget; a failure marks its line and the next step runs.
    ``flex=False`` (a failed preflight) skips the steps that compile flex, naming them."""
    for step in steps:
        if step.flex and not flex:
            checks.lines.append(f"  skip {step.name}: {NO_FLEX}")
            print(checks.lines[-1], flush=True)
            continue
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
            log_failure(step.name, err)
            checks.add(step.name, False, summary(err)[:240])
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


# --------------------------------------------------------------------------- speed


DENSE_MAX_S = 32768  # SDPA with a dense mask above this: see the module docstring


def make_timer(device: torch.device, *, min_reps: int, budget_s: float):
    """The harness's interleaved timer (:func:`_harness.make_timer`); the budget's stop in a
    warm-up call ends the run, any other failure is kept in its function's place."""
    return _harness.make_timer(device, min_reps=min_reps, budget_s=budget_s, stop=_stop_if_budget)


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
    return f"failed: {summary(err)[:200]}"


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
# Hybrid models' token mixers (flexpack.mixers), one stage per run at the first size: per kind,
# the one pass over the packed row, the module's own forward once per group of right-padded
# documents (what flexpack ran before the one pass), the module's own forward over the whole
# row (a speed anchor only: its state leaks across documents), and the one pass over GRPO-like
# prefix trees of the same length (the state forked at each branch).
HYBRID_KINDS = ("short_conv", "gated_delta_rule", "mamba2")
HYBRID_METHODS = ("one pass", "per group", "own forward (leaks)", "tree (forked)")
MASK_METHODS["hybrid"] = tuple(f"{k}: {m}" for k in HYBRID_KINDS for m in HYBRID_METHODS)
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
    flex: bool = True,
):
    """Time ``methods`` (default: every row of ``mask``) at one (S, D, mask); each row goes to
    ``on_result`` as soon as it is measured.

    Every row runs in its own ``try``; a row that would not fit ``budget`` is skipped (and
    named), and so is flex with ``flex=False`` (a failed preflight); flexpack auto and
    varlen_attn are timed together, interleaved (:func:`make_timer`); the budget's stop ends
    the call (:class:`OutOfTime`). Returns (results, forward FLOPs); ``flops[(S, D, mask)]``
    is set before the first row."""
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
        log_failure(f"S={S} D={D} {mask} (setup)", err)
        for method in methods:
            r = row(method, note=f"setup {_failure(err)}")
            results.append(r)
            on_result(r)
        empty_cache(device)
        return results, flops_fwd
    timer = make_timer(device, min_reps=2 if dry_run else 5, budget_s=0.05 if dry_run else 1.0)

    def run(*calls: TimedCall) -> None:
        """Time ``calls`` together (interleaved), each its own row, reported in order."""
        todo, spent = [], 0.0
        rows = {c.method: row(c.method, note=c.skip) for c in calls}
        for c in calls:
            estimate = ROW_S + (budget.compile_s if c.method in COMPILING else 0.0)
            if c.skip:
                continue
            if c.method in COMPILING and not flex:
                rows[c.method].note = NO_FLEX
            elif not budget.fits(spent + estimate):
                rows[c.method].note = budget.skip(f"S={S} D={D} {mask} {c.method}", estimate)
            else:
                spent += estimate
                todo.append(c)
        notes = {c.method: [c.note] if c.note else [] for c in todo}
        failed: dict[str, Exception] = {}
        firsts = dict.fromkeys(rows, 0.0)
        live = list(todo)
        try:
            for c in todo:
                if c.sdpa:  # which SDPA kernel ran (cuDNN, flash, efficient, math)
                    notes[c.method].append(f"SDPA backend: {sdpa_backend(c.fwd)}")
            for phase in ("fwd", "fwd_bwd"):
                timed = []
                for c in live:
                    if phase == "fwd_bwd" and dry_run and c.method == "flexpack flex":
                        notes[c.method].append("no CPU backward")  # no flex backward on CPU
                    else:
                        timed.append(c)
                fns = [
                    c.fwd if phase == "fwd" else (lambda c=c: c.fwd().backward(c.grad_out))
                    for c in timed
                ]
                for c, t in zip(timed, timer(*fns) if fns else [], strict=True):
                    if isinstance(t, Exception):
                        failed[c.method] = t
                        live.remove(c)
                        continue
                    setattr(rows[c.method], phase, t.mean)
                    rows[c.method].reps = rows[c.method].reps or t.reps
                    firsts[c.method] += t.first
        except Exception as err:  # one group failing must not lose the other rows
            for c in live:
                failed.setdefault(c.method, err)
        finally:
            empty_cache(device)
        stop = None
        for c in calls:
            r = rows[c.method]
            err = failed.get(c.method)
            if c in todo:
                if err is None and c.method in COMPILING:
                    budget.measured_compile(firsts[c.method], 1)
                if err is not None:
                    notes[c.method].append(_failure(err))
                    if budget_stop(err):
                        stop = err
                    else:
                        log_failure(f"S={S} D={D} {mask} {c.method}", err)
                r.note = "; ".join(notes[c.method])
            results.append(r)
            on_result(r)
            if c not in todo:
                print(f"  {c.method}: {r.note}", flush=True)
                continue
            tf = lambda t: flops_fwd / t / 1e12
            print(
                f"  {c.method:<28} fwd {r.fwd * 1e3:9.2f} ms {tf(r.fwd):7.3g} TFLOP/s   fwd+bwd "
                f"{r.fwd_bwd * 1e3:9.2f} ms {3.5 * tf(r.fwd_bwd):7.3g} TFLOP/s  x{r.reps}  "
                f"{r.note}",
                flush=True,
            )
        if stop is not None:  # the budget is spent: the rest of the run is skipped
            _stop_if_budget(stop)

    def flex_fwd():
        if dry_run:  # no flex backward on CPU: time the forward without grad
            return flexpack.attention(q.detach(), k.detach(), v.detach(), the_mask, backend="flex")
        return flexpack.attention(q, k, v, the_mask, backend="flex")

    def varlen_call() -> TimedCall:
        method = "varlen_attn"
        if device.type != "cuda":
            return TimedCall(method, skip="CUDA only")
        window_size = (window, 0) if mask == "window" else (-1, 0)
        try:
            from torch.nn.attention.varlen import varlen_attn

            qt, kt, vt = (x[0] for x in leaves)  # (S, H, D): already unpadded, no copy
            cu = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
            cu[1:] = torch.cumsum(torch.tensor(seqlens), 0)
            cu, mx = cu.to(device), max(seqlens)
        except Exception as err:
            _stop_if_budget(err)
            log_failure(f"S={S} D={D} {mask} {method} (setup)", err)
            return TimedCall(method, skip=_failure(err))
        note = "" if window_size == (-1, 0) else f"window_size={window_size}"
        return TimedCall(
            method,
            lambda: varlen_attn(qt, kt, vt, cu, cu, mx, mx, window_size=window_size),
            dout_base[0],
            note=note,
        )

    calls: dict[str, Callable[[], TimedCall]] = {
        "flexpack flex": lambda: TimedCall("flexpack flex", flex_fwd, dout),
        "flexpack auto": lambda: TimedCall(
            "flexpack auto", lambda: flexpack.attention(q, k, v, the_mask), dout
        ),
        "flexpack sdpa (per segment)": lambda: TimedCall(
            "flexpack sdpa (per segment)",
            lambda: flexpack.attention(q, k, v, the_mask, backend="sdpa"),
            dout,
        ),
        "varlen_attn": varlen_call,
        "SDPA + dense mask": lambda: dense_call(S, doc_ids, q, k, v, dout, device),
        "SDPA causal (no doc mask)": lambda: TimedCall(
            "SDPA causal (no doc mask)",
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            dout,
            note="not a document mask",
            sdpa=True,
        ),
    }
    # auto against varlen is a 98% target: time them call for call, so drift cannot decide it
    together = {"flexpack auto": "varlen_attn"}
    done: set[str] = set()
    for method in methods:
        if method in done:
            continue
        group = [method] + [m for m in (together.get(method),) if m in methods]
        done.update(group)
        run(*(calls[m]() for m in group))
        empty_cache(device)  # (a dense mask is freed here)
    return results, flops_fwd


def hybrid_mixer(kind: str, *, dry_run: bool) -> torch.nn.Module:
    """One mixer layer of a hybrid family at a training size (hidden 1024; the dry run's tiny),
    fp32 weights (bf16 autocast runs it, as TRL trains): LFM2's short conv, Qwen3.5's gated
    delta rule, Bamba's Mamba2."""
    import transformers

    from flexpack import mixers

    H = 32 if dry_run else 1024
    common = dict(vocab_size=128, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=1,
                  num_attention_heads=4 if dry_run else 16, num_key_value_heads=2)  # fmt: skip
    if kind == "short_conv":
        config = transformers.Lfm2Config(**common, layer_types=["conv"], full_attn_idxs=[])
    elif kind == "gated_delta_rule":
        heads, dim = (2, 8) if dry_run else (8, 128)
        config = transformers.Qwen3_5TextConfig(
            **common, layer_types=["linear_attention"], linear_num_key_heads=heads,
            linear_num_value_heads=2 * heads, linear_key_head_dim=dim, linear_value_head_dim=dim,
        )  # fmt: skip
    else:
        heads, dim, state, chunk = (4, 16, 8, 16) if dry_run else (32, 64, 128, 256)
        config = transformers.BambaConfig(
            **common, attn_layer_indices=[], mamba_n_heads=heads, mamba_d_head=dim,
            mamba_d_state=state, mamba_chunk_size=chunk, mamba_expand=2,
        )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config)
    (path, _), *_ = [(p, k) for p, k in mixers.mixers_of(model) if k == kind]
    return model.get_submodule(path)


def hybrid_rows(
    device: torch.device, S: int, *, dry_run: bool, on_result: Callable[[Result], None],
    budget: Budget | None = None, median: float = 1024,
) -> None:  # fmt: skip
    """Time each hybrid kind's mixer (:data:`HYBRID_METHODS`) on one packed row of lognormal
    documents (and one of prefix trees), fwd and fwd+bwd in bf16 autocast; a method that fails
    or declines (the one pass's self-check) gets a row that says so."""
    from flexpack.mixers._plan import DocumentPlan
    from flexpack.mixers._tree import TreePlan

    timer = make_timer(device, min_reps=2 if dry_run else 5, budget_s=0.05 if dry_run else 1.0)
    median = min(median, S / 8)  # several documents in the row, several trees
    docs = DocumentPlan.from_doc_ids(lognormal_doc_ids(S, median=median)[None].to(device))
    seg, parents = tree_layout(S, prompt=median / 2, completions=8, completion=median / 4)
    tree = TreePlan.from_parents(seg.to(device), parents.to(device))
    tiny = dry_run or S < 2048  # a rehearsal (the dry run, the faked device): tiny widths
    for kind in HYBRID_KINDS:
        estimate = len(HYBRID_METHODS) * (1.0 if dry_run else ROW_S)
        if budget is not None and not budget.fits(estimate):
            budget.skip(f"hybrid {kind}", estimate)
            continue
        for r in _hybrid_kind(kind, device, S, docs, tree, timer, dry_run=tiny):
            on_result(r)
        empty_cache(device)


def _hybrid_kind(kind, device, S, docs, tree, timer, *, dry_run: bool) -> list[Result]:
    """:func:`hybrid_rows`' rows of one kind."""
    from flexpack.mixers import _one_pass
    from flexpack.mixers import _room_of as room_of

    mixer = hybrid_mixer(kind, dry_run=dry_run).to(device)
    own = type(mixer).forward.__get__(mixer)
    hook = room_of(mixer).one_pass
    x = torch.randn(1, S, _width(mixer), device=device, requires_grad=True)

    def one_pass(plan):
        out = hook(mixer, own, x, plan, {})
        if out is None:
            raise RuntimeError("the one pass declined (its self-check or structure)")
        return out

    def own_row():
        out = own(x)
        return out[0] if isinstance(out, tuple) else out

    calls = {
        "one pass": lambda: one_pass(docs),
        "per group": lambda: _one_pass.per_group(own, x, docs),
        "own forward (leaks)": own_row,
        "tree (forked)": lambda: one_pass(tree),
    }

    def forward(call):
        def run():
            with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
                return call()

        return run

    def backward(call):
        def run():
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = call()
            out.float().sum().backward()
            x.grad = None
            mixer.zero_grad(set_to_none=True)

        return run

    fwd = timer(*(forward(calls[m]) for m in HYBRID_METHODS))
    both = timer(*(backward(calls[m]) for m in HYBRID_METHODS))
    rows = []
    for method, f, b in zip(HYBRID_METHODS, fwd, both, strict=True):
        failed = next((t for t in (f, b) if isinstance(t, Exception)), None)
        rows.append(
            Result(
                S, f"{kind}: {method}", D=_width(mixer), mask="hybrid",
                fwd=math.nan if isinstance(f, Exception) else f.mean,
                fwd_bwd=math.nan if isinstance(b, Exception) else b.mean,
                reps=0 if failed else f.reps,
                note=_failure(failed) if failed else "",
            )
        )  # fmt: skip
    return rows


def _width(mixer: torch.nn.Module) -> int:
    """The hidden size a mixer takes."""
    return int(mixer.hidden_size if isinstance(getattr(mixer, "hidden_size", None), int)
               else mixer.out_proj.out_features)  # fmt: skip


@dataclass(eq=False)
class TimedCall:
    """One timed method of :func:`speed`: ``fwd()`` runs the forward, ``fwd().backward(
    grad_out)`` the training step; ``skip`` (a reason) makes it a row that is not timed."""

    method: str
    fwd: Callable[[], torch.Tensor] | None = None
    grad_out: torch.Tensor | None = None
    note: str = ""
    sdpa: bool = False  # note which SDPA kernel ran
    skip: str = ""


def dense_call(S, doc_ids, q, k, v, dout, device) -> TimedCall:
    """The "SDPA + dense mask" row: a (1, 1, S, S) bool mask, where it fits."""
    method = "SDPA + dense mask"
    dense_bytes = S * S * 3  # bool mask + its additive bf16 copy inside SDPA
    try:
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 8 * 2**30
    except Exception as err:
        _stop_if_budget(err)
        free = 0
    if S > DENSE_MAX_S:
        return TimedCall(
            method,
            skip=f"skipped: S > {DENSE_MAX_S // 1024}K (mask ~{dense_bytes / 2**30:.0f} GiB; torch "
            "2.13's efficient kernel is wrong past row 2^32/S, its backward crashes past ~46K)",
        )
    if dense_bytes > 0.5 * free:
        return TimedCall(method, skip=f"skipped: mask needs ~{dense_bytes / 2**30:.0f} GiB")
    try:
        dense = (doc_ids[:, :, None] == doc_ids[:, None, :]).tril_()[:, None]  # (1, 1, S, S)
    except Exception as err:
        _stop_if_budget(err)
        log_failure(f"S={S} {method} (building the mask)", err)
        return TimedCall(method, skip=f"building the mask: {_failure(err)}")
    return TimedCall(
        method, lambda: F.scaled_dot_product_attention(q, k, v, dense), dout, sdpa=True
    )


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
        measured = [r is not None and not math.isnan(r.fwd) for r in (flex, varlen)]
        if all(measured):  # (a failed or skipped row has no time: no ratio)
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
    preflight: Preflight | None = None,
) -> str:
    """The report: the preflight's result first (its first lines), then the title, the checks,
    the rows and the targets. ``judged=False`` (a dry run: CPU timings) prints targets without
    PASS/FAIL."""
    lines = [
        "| S | D | mask | method | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | note |",
        "|---:|---:|---|---|---:|---:|---:|---:|---|",
    ]

    def cells(t: float, flop: float) -> str:
        if math.isnan(t):
            return "— | —"
        return f"{t * 1e3:.2f} | " + ("—" if math.isnan(flop) else f"{flop / t / 1e12:.3g}")

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
    first = ["```", *preflight.lines(), "```", ""] if preflight is not None else []
    skipped = ", ".join(budget.skipped) if budget and budget.skipped else "none"
    head = [
        *first,
        "# Attention on GPU: flexpack vs varlen_attn and SDPA (bf16)",
        "",
        f"- Date: {datetime.date.today()}; device: {device_name}; torch {torch.__version__}",
        f"- Command: `python bench/gpu.py {' '.join(argv)}`",
        f"- Correctness: {passed}/{ran} checks passed",
        f"- Skipped (budget): {skipped}",
        "",
    ]
    return "\n".join([*head, "```", *checks.lines, "```", "", *lines]) + "\n"


QUICK_BUDGET_S = 225.0  # --quick stops cleanly before 4 minutes
# The full run stops at 6.5 minutes: with Python's start and CUDA's initialisation it ends before
# 8, inside one device command's 10 and the loan's 15 (machine start included).
FULL_BUDGET_S = 390.0


@dataclass
class Stage:
    """One step of the plan: correctness checks, or the timing rows of one (S, D, mask).
    ``flex=False`` (a failed preflight): its flex checks and rows are skipped, not estimated."""

    name: str
    checks: list[Check] = field(default_factory=list)
    S: int = 0
    D: int = 0
    H: int = 0
    mask: str = "document_causal"
    methods: tuple[str, ...] = ()
    flex: bool = True

    def compiles(self) -> int:
        if self.checks:
            return sum(c.compiles for c in self.checks if self.flex or not c.flex)
        return sum(m in COMPILING for m in self.methods) if self.flex else 0

    def estimate(self, compile_s: float = COMPILE_S) -> float:
        if self.checks:
            return sum(c.estimate(compile_s) for c in self.checks if self.flex or not c.flex)
        timed = [m for m in self.methods if self.flex or m not in COMPILING]
        return len(timed) * ROW_S + self.compiles() * compile_s


def run_plan(
    *,
    sizes: list[int],
    dims: list[int],
    checks: list[Check],
    H: int,
    dry_run: bool,
    trees_and_windows: bool = True,
    flex: bool = True,
    hybrids: bool = True,
) -> list[Stage]:
    """The run in order of value (at ~40 s a compile, what comes last is what the budget cuts):

    1. the bf16 correctness checks (what training runs);
    2. every size up to 32K at the first head dim (``dims[0]``), all five rows;
    3. tree and window masks at the largest of those sizes;
    4. the sinks and recompile checks, then the hybrid models' mixers at the first size
       (``hybrids``; no flex compile);
    5. the other head dims (flex and varlen) at those sizes;
    6. the sizes above 32K, at the first head dim;
    7. the other checks (fp32, head dim 8, a 64-token BlockMask: paths fewer users take).

    ``flex=False`` (the preflight failed): the same steps, their flex checks and rows skipped.
    """
    group = {name: [c for c in checks if c.group == name] for name in ("first", "sinks", "other")}
    short = [S for S in sizes if S <= DENSE_MAX_S] or sizes[:1]
    long = [S for S in sizes if S not in short]
    stages = [Stage("checks", checks=group["first"])] if group["first"] else []
    stages += [
        Stage(f"time S={S} D={dims[0]}", S=S, D=dims[0], H=H, methods=METHODS) for S in short
    ]
    if trees_and_windows:
        S, D = short[-1], dims[0]
        for mask in ("tree", "window"):
            stages.append(
                Stage(f"time S={S} D={D} {mask}", S=S, D=D, H=H, mask=mask,
                      methods=MASK_METHODS[mask])
            )  # fmt: skip
    if group["sinks"]:
        stages.append(Stage("checks (sinks, recompiles)", checks=group["sinks"]))
    if hybrids:
        S = short[0]
        stages.append(Stage(f"time S={S} hybrid mixers", S=S, D=0, H=H, mask="hybrid",
                            methods=MASK_METHODS["hybrid"]))  # fmt: skip
    for D in dims[1:]:
        for S in short:
            stages.append(
                Stage(f"time S={S} D={D}", S=S, D=D, H=H, methods=("flexpack flex", "varlen_attn"))
            )
    for S in long:
        methods = tuple(m for m in METHODS if m != "SDPA + dense mask")
        stages.append(Stage(f"time S={S} D={dims[0]}", S=S, D=dims[0], H=H, methods=methods))
    if group["other"]:
        stages.append(Stage("checks (fp32, head dim 8, 64-token blocks)", checks=group["other"]))
    for st in stages:
        st.flex = flex
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


def default_out(dry_run: bool, quick: bool) -> Path:
    """Where the report goes without ``--out``: ``$OUT/gpu.md`` when $OUT is set (the device
    machine sends back only what is under it), a fresh temp dir for a dry run (never the tracked
    results), else bench/results/gpu[-quick].md."""
    if dry_run:
        return Path(tempfile.mkdtemp(prefix="flexpack-gpu-dry-run-")) / "gpu-dry-run.md"
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu.md"
    return Path(__file__).resolve().parent / "results" / f"gpu{'-quick' if quick else ''}.md"


def main(argv: list[str] | None = None, *, hard_exit: bool = False) -> int:
    """Run the benchmark (``argv``: the command line's arguments); returns the exit status.

    ``hard_exit`` (the command line): end the process with ``os._exit`` after the last write,
    the report and the log flushed and fsynced, so that nothing a compile cut by the budget left
    behind (inductor's worker processes and threads, which Python's normal exit joins) can hold
    it past the loan; a crash of the script itself is logged and exits 1 the same way."""
    global _LOG
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=None)
    parser.add_argument(
        "--dims", type=int, nargs="+", default=None, help="head dims (default 128 64)"
    )
    parser.add_argument("--quick", action="store_true", help="S in {8K, 32K}, D 128")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU")
    parser.add_argument("--skip-checks", action="store_true", help="time only (a rerun)")
    parser.add_argument(
        "--skip-preflight",
        action="store_true",
        help="attempt flex compiles without the preflight (a rerun after a preflight that "
        "failed for a reason that does not hold)",
    )
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
    stdout, fd2 = sys.stdout, None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _LOG = Log(out.with_suffix(".log"))
        sys.stdout = Tee(stdout, _LOG)
        fd2 = Fd2Tee(_LOG)
    except OSError as err:
        print(f"  (no log beside {out}, or not all of it: {err})", flush=True)
    status = 1
    try:
        status = _main(args, argv, out, seconds, budget)
    except BaseException as err:
        if not hard_exit:
            raise
        log_failure("bench/gpu.py itself", err)
    finally:
        sys.stdout.flush()
        sys.stdout = stdout
        if fd2 is not None:
            fd2.close()
        if _LOG is not None:
            _LOG.close()
            _LOG = None
    if hard_exit:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


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
    if args.skip_preflight:
        pre = Preflight([Probe("preflight", "skip", "--skip-preflight: flex compiles go ahead")])
        print("\n".join(pre.lines()), flush=True)
    else:
        pre = preflight(device)
    flex = pre.ok

    def write() -> None:  # after every row: a crash or a time-out keeps what finished
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            text = markdown(results, flops, checks, name, argv, budget, judged, pre)
            with open(out, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())  # what the machine sends back is what reached the disk
        except OSError as err:
            print(f"  (could not write {out}: {err})", flush=True)

    def plan_of(check_list: list[Check]) -> list[Stage]:
        return run_plan(
            sizes=sizes, dims=dims, checks=[] if args.skip_checks else check_list, H=H,
            dry_run=args.dry_run, flex=flex,
        )  # fmt: skip

    text, compiles, estimate = plan_summary(
        plan_of(correctness_plan(device, S=S_check, dry_run=args.dry_run, checks=Checks()))
    )
    limit = "none" if seconds is None else f"{seconds:.0f} s"
    print(
        f"budget: {limit}; plan (estimated ~{estimate:.0f} s, ~{compiles} flex compiles of "
        f"~{COMPILE_S:.0f} s each until the second is measured; what does not fit is skipped "
        f"and listed):\n{text}\nreport: {out} (rewritten after every row; log: "
        f"{out.with_suffix('.log')})",
        flush=True,
    )
    write()  # the preflight's result, before anything can hang

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
                    run_checks(st.checks, checks, budget, flex=flex)
                    write()
                    continue
                try:
                    if st.mask == "hybrid":
                        hybrid_rows(
                            device, st.S, dry_run=args.dry_run, on_result=on_result,
                            budget=budget, median=median,
                        )  # fmt: skip
                        continue
                    speed(
                        device, st.S, H=st.H, D=st.D, median=median, dry_run=args.dry_run,
                        flops=flops, on_result=on_result, budget=budget, mask=st.mask,
                        methods=st.methods, window=window, flex=flex,
                    )  # fmt: skip
                except Exception as err:
                    if budget_stop(err):
                        budget.skipped.append(f"{st.name} (the rest)")
                        raise OutOfTime("stopped") from err
                    log_failure(st.name, err)
                    print(f"{st.name} failed: {_failure(err)}", flush=True)
    except OutOfTime:
        budget.skipped.append("the rest (the time budget ran out)")
    if checks.failed:
        print(f"{checks.failed} correctness checks FAILED (marked)", flush=True)
    report = markdown(results, flops, checks, name, argv, budget, judged, pre)
    print("\n" + report)
    print(f"total {budget.elapsed():.0f} s; skipped: {', '.join(budget.skipped) or 'nothing'}")
    print(f"report: {out}; log: {out.with_suffix('.log')}")
    write()  # the last write: main then closes the log, and the command ends with os._exit
    return 1 if checks.failed else 0


if __name__ == "__main__":
    main(hard_exit=True)
