"""AsyncEngine: the LLMEngine steps in a thread of its own; asyncio handlers submit requests and read their outputs.

The event loop never runs a model forward. `resin run` steps the engine in the process's main thread, the one that
loaded the model, and serves HTTP from another (`run_in_this_thread`): on a CPU every intra-op parallel region
then runs on the one OpenMP team the main thread already has. A second thread that runs parallel regions gets a
team of its own, and once libgomp manages more threads than there are cores its workers stop spinning between
regions and sleep on a futex, ~70 us per region on a 2-core machine: a batch-1 decode step took 37 ms instead
of 26. `start()` (a background engine thread) is for embedding and tests.

Requests and aborts reach the step loop through a command queue; each step's outputs go back to the event loop in
one `call_soon_threadsafe`, so SSE framing and client I/O happen there while the next step already runs. New
requests join the running batch at the next step.

What a request may cost is bounded here: admission counts sequences (n x prompts) against `max_waiting`, so the
queue between the threads holds at most that many; outputs arrive as deltas and a consumer that falls behind
finds them merged, so what waits for it is O(its length); a consumer that has not read for `stall_timeout`
seconds while outputs wait (a client that stopped reading) has its requests aborted and their KV freed.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Callable

from resin.core.engine import LLMEngine
from resin.core.outputs import RequestOutput
from resin.core.sampling_params import SamplingParams
from resin.server.request_stream import RequestStream

log = logging.getLogger("resin")


class StreamError(RuntimeError):
    """Ends a request's stream; `status` is the HTTP status it maps to."""
    status = 500


class QueueFull(StreamError):
    status = 429


class EngineDead(StreamError):
    status = 503


class RequestRejected(StreamError):
    """The engine refused the request when it took it. The server runs the same checks before submitting, so
    this means a check exists only in add_request: a bug to fix there, reported as a 400 meanwhile."""
    status = 400


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int = 1024, stall_timeout: float = 30.0,
                 on_step: Callable[[LLMEngine], None] | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None):
        self.engine = engine
        self.max_waiting = max_waiting
        self.stall_timeout = stall_timeout
        self.on_step = on_step  # after every step (metrics)
        self.on_fatal = on_fatal  # the engine thread died: the server should end in-flight requests and exit
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}  # engine request id -> stream; touched on the loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._submitted = 0  # sequences submitted, not yet taken by the engine thread (changed from both threads)
        self._submitted_lock = threading.Lock()
        self._stop = False
        self._started = False  # start() or run_in_this_thread() was called: never a second stepping thread
        self._done = threading.Event()  # the step loop returned
        self._stepper: threading.Thread | None = None  # the thread that steps (or is about to)
        self.error: BaseException | None = None

    # ---- lifecycle --------------------------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self._started

    def _claim(self, thread: threading.Thread) -> None:
        if self._started:
            raise RuntimeError("this AsyncEngine already has a thread stepping it")
        self._started = True
        self._stepper = thread

    def start(self) -> None:
        """Step the engine in a background thread (embedding, tests)."""
        self._claim(threading.Thread(target=self._run, name="resin-engine", daemon=True))
        self._stepper.start()

    def run_in_this_thread(self, then_start: Callable[[], None] = lambda: None) -> None:
        """Step the engine in the calling thread until stop() or a fatal error (resin run: the main thread).
        `then_start` runs once the engine counts as alive, before the first step: it starts the HTTP thread, whose
        requests wait in the command queue until the loop drains it."""
        self._claim(threading.current_thread())
        try:
            then_start()
        except BaseException:
            self._done.set()
            raise
        self._run()

    def stop(self) -> None:
        """End the step loop; from another thread, wait (up to 30 s) until it has returned, so that no step's
        outputs are handed to an event loop that is closing. A failed engine may be stuck in a collective with a
        rank that is gone: then wait 1 s only."""
        self._stop = True
        self._wake.set()
        if self._stepper is not None and self._stepper is not threading.current_thread():
            self._done.wait(timeout=30 if self.error is None else 1)

    def wait_stopped(self, timeout: float) -> bool:
        """Whether the step loop has returned within `timeout` seconds."""
        return self._done.wait(timeout)

    def fail(self, error: BaseException) -> None:
        """The engine ended outside its thread (a tensor-parallel rank exited): fail every waiting request and
        tell the server, as if the thread had crashed."""
        log.error("engine failed: %s", error)
        if self.error is None:
            self.error = error
        self._stop = True
        self._wake.set()
        self._to_loop(self._dispatch_error, None, EngineDead(f"the engine failed: {error!r}"))
        if self.on_fatal is not None:
            self.on_fatal(error)

    @property
    def alive(self) -> bool:
        return self._started and not self._done.is_set() and self.error is None  # the step loop runs or is about to

    def abort_all(self) -> None:
        """Abort every request now (shutdown past its grace period): each stream ends with finish_reason abort."""
        self._post(("abort_all",))

    # ---- requests (event loop) --------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Sequences waiting: in the engine's queue, or submitted and not yet taken by the engine thread."""
        return self.engine.num_waiting + self._submitted

    def submit(self, base_id: str, prompts: list[tuple[str | None, list[int]]],
               params: SamplingParams) -> RequestStream:
        """Queue one engine request per prompt, all or none. Raises EngineDead or QueueFull before anything is
        queued, so the caller can still answer with a real status."""
        if not self.alive:
            raise EngineDead("the engine is not running")
        seqs = len(prompts) * params.n
        if self.num_waiting + seqs > self.max_waiting:
            raise QueueFull(f"the waiting queue is full ({self.max_waiting} sequences); retry later")
        self._loop = asyncio.get_running_loop()
        stream = RequestStream(self, [f"{base_id}-{i}" for i in range(len(prompts))])
        for rid in stream.request_ids:
            self._streams[rid] = stream
        with self._submitted_lock:
            self._submitted += seqs
        for rid, (text, ids) in zip(stream.request_ids, prompts):
            self._post(("add", rid, ids, params, text))
        return stream

    def _streams_close(self, stream: RequestStream) -> None:
        for rid in stream.request_ids:
            if self._streams.get(rid) is stream:
                del self._streams[rid]

    def _post(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream._put(out)

    def _dispatch_error(self, rid: str | None, error: BaseException) -> None:
        streams = {id(s): s for s in self._streams.values()} if rid is None else \
            ({0: self._streams[rid]} if rid in self._streams else {})
        for stream in streams.values():
            stream._fail(error)

    def _to_loop(self, fn: Callable, *args) -> None:
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop closed since the check (the server is gone): nobody is left to tell
                pass

    # ---- the engine thread ------------------------------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, ids, params, prompt = cmd
                try:
                    self.engine.add_request(rid, ids, params, prompt)
                except ValueError as e:
                    self._to_loop(self._dispatch_error, rid, RequestRejected(str(e)))
                finally:  # only now: until the engine queues them, its num_waiting does not count them
                    with self._submitted_lock:
                        self._submitted -= params.n
            elif cmd[0] == "abort":
                out = self.engine.abort_request(cmd[1])
                if out is not None:
                    self._to_loop(self._dispatch, [out])
            elif cmd[0] == "abort_all":
                self._to_loop(self._dispatch, self.engine.abort_all())

    def _run(self) -> None:
        try:
            while not self._stop:
                self._drain()
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    if self.on_step is not None:
                        self.on_step(self.engine)
                    if outputs:
                        self._to_loop(self._dispatch, outputs)
                else:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - a crashed engine must fail every waiting request, not hang it
            self._stop = True
            interrupted = isinstance(e, (KeyboardInterrupt, SystemExit))
            if not interrupted:
                log.exception("engine step loop crashed")
            self.error = e
            self._to_loop(self._dispatch_error, None, EngineDead(f"the engine failed: {e!r}"))
            if self.on_fatal is not None:
                self.on_fatal(e)
            if interrupted:  # Ctrl-C in a caller's own thread (run_in_this_thread without handlers) still ends it
                raise
        finally:
            self._done.set()
