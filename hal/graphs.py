"""Graph capture as a HAL op: CAPTURE_GRAPH(step, pool) -> a graph whose replay() re-runs `step`.

`step` is a closure over static buffers (inputs the runner refills in place, an output it reads back). The native
implementation records nothing and replays by calling `step` again, so the capture/replay path (buckets, padding,
static buffers) runs and is tested on the cpu; GPU backends register a provider that records a CUDA/HIP graph.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

from resin.hal.registry import Op


class StepGraph(Protocol):
    def replay(self) -> None: ...

    def pool(self) -> Any:
        """A memory-pool handle later captures may share (None when there is none)."""


class EagerGraph:
    def __init__(self, step: Callable[[], None]):
        self.step = step

    def replay(self) -> None:
        self.step()

    def pool(self) -> Any:
        return None


def _capture_eager(step: Callable[[], None], pool: Any = None) -> StepGraph:
    """Run `step` once (as a capture would) and return a graph that replays by running it again."""
    step()
    return EagerGraph(step)


CAPTURE_GRAPH = Op("capture_graph", _capture_eager, self_checked=False)
