"""Timing helpers for the bench scripts: Stopwatch wraps functions so that their wall time adds up to one total
(how the profiling scripts time the parts of an engine step without touching the engine); median_seconds times a
call on the host."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    """Median wall time of fn over reps calls, after one warm-up call (host-synchronous work only)."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Stopwatch:
    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed
