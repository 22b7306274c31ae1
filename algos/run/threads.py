"""CPU threads for torch at the start of a run: the requested count, or the cores other processes leave idle.

A run decides again between steps from longer windows (`algos.run.control.TorchThreads`); these helpers give the
count at start and measure what other processes keep busy now.
"""

from __future__ import annotations

import os
import time

from algos.run import control as run_control

__all__ = ["busy_cores", "cpu_threads"]


def cpu_threads(requested: int | None) -> int:
    """CPU threads for torch at start: `requested`, or every core that other processes leave idle now (at least one).

    What other processes use is measured over half a second (`busy_cores`); the load average, minutes behind, stands
    in where that cannot be read. A run decides again between steps from longer windows (`run_control.TorchThreads`,
    whose rule is `run_control.choose_threads`), so a spike at start does not fix the count for the whole run.
    """
    if requested:
        return requested
    busy = busy_cores()
    if busy is None:
        try:
            busy = os.getloadavg()[0]
        except OSError:
            busy = 0.0
    return run_control.choose_threads(os.cpu_count() or 1, busy)


def busy_cores(window: float = 0.5, stat: str = "/proc/stat") -> float | None:
    """Cores other processes keep busy over the next `window` seconds, from the kernel's CPU time counters (Linux);
    None where they cannot be read."""
    start = run_control.read_cpu(stat)
    time.sleep(window)
    end = run_control.read_cpu(stat)
    if start is None or end is None:
        return None
    return run_control.others_busy(start, end, os.cpu_count() or 1)
