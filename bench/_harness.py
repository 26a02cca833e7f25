"""The harness bench/gpu.py runs on: its checks, timer, device helpers and log plumbing.

Generic and stateless (the budget, the clock the tests replace, the preflight and the open log
stay in bench/gpu.py): :class:`Checks` (the ok/FAIL lines of a report), :func:`rel_err`,
:func:`empty_cache` and :func:`sdpa_backend` (which SDPA kernel ran, from the profiler),
:func:`make_timer` (interleaved timing with CUDA events; :class:`Timing`), and for failures
:func:`summary` / :func:`exception_chain` (the whole chain, dynamo's ``inner_exception`` too)
with :class:`Log`, :class:`Tee` and :class:`Fd2Tee`, which copy stdout and file descriptor 2
into the log beside the report. Imports torch and the standard library only: it runs from a
plain checkout (``bench/`` is put on ``sys.path`` by bench/gpu.py).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

# --------------------------------------------------------------------------- checks and errors


@dataclass
class Checks:
    lines: list[str] = field(default_factory=list)
    failed: int = 0

    def add(self, name: str, ok: bool, detail: str) -> None:
        self.failed += not ok
        line = f"  {'ok  ' if ok else 'FAIL'} {name}: {detail}"
        self.lines.append(line)
        print(line, flush=True)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (floored at 0.1; inputs are O(1))."""
    got = got.detach().double()
    return float((got - want.detach()).abs().max() / want.detach().abs().max().clamp(min=0.1))


# --------------------------------------------------------------------------- device helpers


def empty_cache(device: torch.device) -> None:
    """Give the allocator's cached blocks back between steps (inside the guarded region: a
    failure here is reported like any other)."""
    if device.type == "cuda":
        try:
            torch.cuda.empty_cache()
        except Exception as err:  # a broken context: the next step will say so
            print(f"  (empty_cache failed: {type(err).__name__}: {err})", flush=True)


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


# --------------------------------------------------------------------------- timing


@dataclass
class Timing:
    """What the timer measured of one function: mean seconds per call over ``reps`` timed calls,
    and the seconds of its first call (a compile's measurement, where it compiles)."""

    mean: float
    reps: int
    first: float


def make_timer(
    device: torch.device,
    *,
    min_reps: int,
    budget_s: float,
    stop: Callable[[BaseException], None] = lambda err: None,
):
    """A timer of ``fns`` on ``device`` (see ``timer``); ``stop(err)`` is called with a
    warm-up's exception before it is kept: it re-raises what must end the run (a budget's
    stop)."""

    def timer(*fns: Callable[[], object]) -> list[Timing | Exception]:
        """Time ``fns`` interleaved: call 1 of each, then call 2 of each, ..., so that what
        drifts during a phase (clocks, temperature, a neighbour) weighs on each alike. Each gets
        2 warm-up calls (the first compiles: its time is the compile's measurement), then at
        least ``min_reps`` timed calls, more while they fit in ``budget_s`` per function. One
        that fails in its warm-up gets its exception in its place and is left out of the loop
        (the budget's stop propagates)."""
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
        firsts: list[float | Exception] = []
        for fn in fns:
            try:
                t0 = time.perf_counter()
                fn()
                sync(device)
                firsts.append(time.perf_counter() - t0)
            except Exception as err:
                stop(err)
                firsts.append(err)
        live = [i for i, f in enumerate(firsts) if not isinstance(f, Exception)]
        one = 0.0
        for i in live:
            fns[i]()
            sync(device)
            t0 = time.perf_counter()
            fns[i]()
            sync(device)
            one += time.perf_counter() - t0
        reps = max(min_reps, min(100, int(budget_s * max(len(live), 1) / max(one, 1e-6))))
        total = dict.fromkeys(live, 0.0)
        if device.type == "cuda" and live:
            events = {
                i: [
                    (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                    for _ in range(reps)
                ]
                for i in live
            }
            for r in range(reps):
                for i in live:
                    start, end = events[i][r]
                    start.record()
                    fns[i]()
                    end.record()
            torch.cuda.synchronize(device)
            for i in live:
                total[i] = sum(start.elapsed_time(end) for start, end in events[i]) / 1e3
        else:
            for _ in range(reps):
                for i in live:
                    t0 = time.perf_counter()
                    fns[i]()
                    total[i] += time.perf_counter() - t0
        return [
            f if isinstance(f, Exception) else Timing(total[i] / reps, reps, f)
            for i, f in enumerate(firsts)
        ]

    return timer


# --------------------------------------------------------------------------- failures and the log


def linked_exceptions(err: BaseException) -> list[BaseException]:
    """``err`` and every exception linked to it: ``__cause__``, ``__context__`` (suppressed or
    not) and dynamo's ``inner_exception`` (``BackendCompilerFailed`` raises ``from None``, so the
    compiler's own exception is reachable only there), each once, depth first."""
    out: list[BaseException] = []
    todo: list[BaseException] = [err]
    while todo:
        e = todo.pop()
        if any(e is seen for seen in out):
            continue
        out.append(e)
        for nxt in (getattr(e, "inner_exception", None), e.__context__, e.__cause__):
            if isinstance(nxt, BaseException):
                todo.append(nxt)
    return out


def exception_chain(err: BaseException) -> str:
    """The whole chain of ``err`` as Python prints it (``traceback.format_exception``: causes
    and contexts), then that of each ``inner_exception`` it did not print."""
    parts: list[str] = []
    printed: list[BaseException] = []

    def shown(e: BaseException) -> list[BaseException]:  # what format_exception prints of e
        out = []
        while e is not None and not any(e is x for x in out):
            out.append(e)
            e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
        return out

    for e in linked_exceptions(err):
        if any(e is x for x in printed):
            continue
        if parts:
            parts.append(
                "\n(linked but not printed above, e.g. dynamo's inner_exception, raised `from "
                "None`:)\n"
            )
        parts.append("".join(traceback.format_exception(e)))
        printed += shown(e)
    return "".join(parts)


def summary(err: BaseException) -> str:
    """``Type: first line`` of ``err``, with the next line when the first only introduces it
    (``BackendCompilerFailed: backend='inductor' raised:`` names the real error on line 2)."""
    lines = [x.strip() for x in str(err).strip().splitlines() if x.strip()]
    text = lines[0] if lines else ""
    if text.endswith(":") and len(lines) > 1:
        text += " " + lines[1]
    return f"{type(err).__name__}: {text}"


class Log:
    """The log file beside the report: stdout and file descriptor 2 go to it (their writers
    share the lock), and every failure's exception chain (:func:`log_failure`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = open(path, "w", encoding="utf-8", errors="replace")
        self.lock = threading.Lock()

    def write(self, text: str) -> None:
        with self.lock:
            if not self.file.closed:
                self.file.write(text)
                self.file.flush()

    def close(self) -> None:
        """Flush, fsync and close: what the machine sends back is what reached the disk."""
        with self.lock:
            if self.file.closed:
                return
            self.file.flush()
            with contextlib.suppress(OSError):
                os.fsync(self.file.fileno())
            self.file.close()


class Tee:
    """stdout that is also written to the log."""

    def __init__(self, stream, log: Log) -> None:
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.log.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


class Fd2Tee:
    """File descriptor 2 copied into the log as well as to where it went: a pipe in its place and
    a thread that forwards. What writes there without Python's sys.stderr (gcc called by triton,
    torch's logging handlers made at import, ptxas) reaches the log this way only.

    ``close()`` puts fd 2 back and waits a moment for the thread; a process that inherited the
    pipe (an inductor compile worker) may keep it open, so the thread is a daemon that keeps
    forwarding to the original fd 2 after the log is closed."""

    def __init__(self, log: Log) -> None:
        self.log = log
        sys.stderr.flush()
        self.saved = os.dup(2)
        self.read_fd, write_fd = os.pipe()
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self.thread = threading.Thread(target=self._forward, name="gpu.py fd 2 tee", daemon=True)
        self.thread.start()

    def _forward(self) -> None:
        while True:
            try:
                data = os.read(self.read_fd, 65536)
            except OSError:
                return
            if not data:
                return
            with contextlib.suppress(OSError):
                os.write(self.saved, data)
            self.log.write(data.decode("utf-8", errors="replace"))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(self.saved, 2)  # our end of the pipe closes here: the thread reads to its end
        self.thread.join(timeout=2.0)
        if not self.thread.is_alive():
            os.close(self.read_fd)
            os.close(self.saved)
