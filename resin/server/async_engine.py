"""AsyncEngine: the LLMEngine steps in a worker thread; asyncio handlers submit requests and await outputs.

The event loop never runs a model forward. Requests and aborts reach the engine thread through a command queue;
each step's outputs go back to the waiting handlers with `call_soon_threadsafe`, so SSE framing and client I/O
happen on the event loop while the next step already runs. New requests join the running batch at the next step.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from resin.core.engine import LLMEngine
from resin.core.outputs import RequestOutput
from resin.core.sampling_params import SamplingParams

log = logging.getLogger("resin")


class QueueFull(RuntimeError):
    pass


class EngineDead(RuntimeError):
    pass


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int = 1024,
                 on_step: Callable[[LLMEngine], None] | None = None,
                 on_change: Callable[[LLMEngine], None] | None = None):
        self.engine = engine
        self.max_waiting = max_waiting
        self.on_step = on_step  # after every step (metrics)
        self.on_change = on_change  # after aborts outside a step (gauges)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._pending = 0  # submitted, not yet taken by the engine thread (changed from both threads)
        self._pending_lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="resin-engine", daemon=True)
        self.error: BaseException | None = None

    # ---- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def abort_all(self) -> None:
        """Abort every request now (shutdown past its grace period): each stream ends with finish_reason abort."""
        self._post(("abort_all",))

    # ---- requests ---------------------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting + self._pending

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       prompt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they are produced; leaving early (client gone) aborts it and frees its KV."""
        if not self.alive:
            raise EngineDead("the engine is not running")
        if self.num_waiting >= self.max_waiting:
            raise QueueFull(f"the waiting queue is full ({self.max_waiting} requests); retry later")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        if self.error is not None:  # died between the check above and the registration
            self._streams.pop(request_id, None)
            raise EngineDead("the engine is not running")
        with self._pending_lock:
            self._pending += 1
        self._post(("add", request_id, prompt_ids, params, prompt))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._post(("abort", request_id))

    def _post(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    # ---- the engine thread ------------------------------------------------------------------------------------
    def _drain(self) -> None:
        aborted = False
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                if aborted and self.on_change is not None:
                    self.on_change(self.engine)
                return
            if cmd[0] == "add":
                _, rid, ids, params, prompt = cmd
                with self._pending_lock:
                    self._pending -= 1
                if rid not in self._streams:
                    continue  # the client left before the engine saw the request
                try:
                    self.engine.add_request(rid, ids, params, prompt)
                except ValueError as e:
                    self._deliver(rid, e)
            elif cmd[0] == "abort":
                aborted = True
                out = self.engine.abort_request(cmd[1])
                if out is not None:
                    self._deliver(cmd[1], out)
            elif cmd[0] == "abort_all":
                aborted = True
                for out in self.engine.abort_all():
                    self._deliver(out.request_id, out)

    def _run(self) -> None:
        try:
            while not self._stop:
                self._drain()
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    if self.on_step is not None:
                        self.on_step(self.engine)
                    for out in outputs:
                        self._deliver(out.request_id, out)
                else:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - a crashed engine must fail every waiting request, not hang it
            log.exception("engine thread crashed")
            self.error = e
            for rid in list(self._streams):
                self._deliver(rid, EngineDead(f"the engine failed: {e!r}"))
