"""Wall-clock limits for subprocesses that follow how loaded the machine is, measured when they start.

A limit is a guard against a hang, not a benchmark: a run that needs 40 s of CPU takes 40 s on a quiet
machine and 200 s where eight jobs share two cores. A fixed limit either fails the second (the suite at load
8 gave 16 timeouts) or is too loose to catch a hang on the first. `scaled_timeout(seconds)` is `seconds` on
an idle machine times how much slower this process gets CPU right now: the wall time of a short CPU-bound
loop over its CPU time, and the 1-minute load average per core, whichever is larger (capped).
"""

from __future__ import annotations

import os
import time

MAX_SLOWDOWN = 10.0


def slowdown(sample_s: float = 0.05) -> float:
    """How many wall seconds a CPU second takes here now (1.0 on an idle machine)."""
    wall, cpu = time.perf_counter(), time.process_time()
    x = 0
    while time.process_time() - cpu < sample_s:
        x += 1
    measured = (time.perf_counter() - wall) / max(time.process_time() - cpu, 1e-9)
    try:
        per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:  # no load average on this platform
        per_core = 1.0
    return min(MAX_SLOWDOWN, max(1.0, measured, per_core))


def scaled_timeout(seconds: float) -> float:
    """`seconds` (what the work takes on an idle machine, with margin) scaled by the current slowdown."""
    return seconds * slowdown()
