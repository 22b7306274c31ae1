"""Wall-clock timing for the performance benchmarks (`benchmarks.roofline`, `benchmarks.retrieval`)."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_seconds(fn: Callable[[], object], repeats: int, *, warmup: bool = False) -> float:
    """The fastest of `repeats` timed calls of `fn` (after one untimed call when `warmup`)."""
    if warmup:
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
