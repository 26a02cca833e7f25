"""What the benchmarks share: one line describing the machine (for the tables in
docs/benchmarks.md), and the peak of live tensor bytes during a call."""

import os
import platform


def describe() -> str:
    """e.g. '2-core x86_64 CPU, load average 0.3 at start'.

    The load average says whether other jobs shared the cores: above ~0.5 per core, absolute
    times are noisy and only the ratios measured within the run count.
    """
    load = os.getloadavg()[0]
    return f"{os.cpu_count()}-core {platform.machine()} CPU, load average {load:.1f} at start"


def tensor_peak(fn) -> int:
    """Peak of live tensor bytes during fn(), from the CPU profiler's allocation events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak
