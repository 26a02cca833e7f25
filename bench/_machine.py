"""One line describing the machine a benchmark ran on, for the tables in docs/benchmarks.md."""

import os
import platform


def describe() -> str:
    """e.g. '2-core x86_64 CPU, load average 0.3 at start'.

    The load average says whether other jobs shared the cores: above ~0.5 per core, absolute
    times are noisy and only the ratios measured within the run count.
    """
    load = os.getloadavg()[0]
    return f"{os.cpu_count()}-core {platform.machine()} CPU, load average {load:.1f} at start"
