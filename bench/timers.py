"""Stopwatch: wraps functions so that their wall time adds up to one total (how the profiling scripts time the
parts of an engine step without touching the engine)."""
from __future__ import annotations

import time
from typing import Callable


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
