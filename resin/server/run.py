"""`resin run`: build the engine, step it in the main thread, serve HTTP with uvicorn from another, shut down
gracefully.

On SIGINT/SIGTERM uvicorn stops accepting connections and waits for in-flight requests (/health answers 503
meanwhile); if they are still running when the grace period ends, they are aborted, so every stream ends with a
final chunk (finish_reason "abort") and [DONE] rather than a cut connection, and the process exits 0. If the
engine thread dies, every in-flight request ends with an error and the process exits 1 for a supervisor.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

import torch
import uvicorn

from resin.engine_builder import EngineArgs, build_engine, shutdown_engine
from resin.server.app import create_app
from resin.server.async_engine import AsyncEngine
from resin.server.metrics import ServerMetrics
from resin.server.prompts import PromptChecker
from resin.server.serving_common import ServerState
from resin.server.structured import GrammarCompiles
from resin.server.tool_calls import tool_call_format

log = logging.getLogger("resin")


@dataclass
class ServeArgs:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_waiting: int = 1024
    max_n: int = 128
    stall_timeout: float = 30.0
    max_request_bytes: int = 16 << 20
    metrics_need_key: bool = False
    shutdown_timeout: float = 10.0
    tool_call_parser: str = "auto"  # a format in tool_calls.FORMATS, "auto" (from the chat template) or "none"
    grammar_compile_timeout: float = 10.0


def serve(engine_args: EngineArgs, args: ServeArgs) -> int:
    built = build_engine(engine_args)
    name = args.served_model_name or (str(engine_args.model) if engine_args.model else "SmolLM2-135M-Instruct")
    metrics = ServerMetrics(name)
    engine = AsyncEngine(built.engine, max_waiting=args.max_waiting, stall_timeout=args.stall_timeout,
                         on_step=metrics.on_step)
    max_len = built.engine.config.max_model_len
    prompts = PromptChecker.for_tokenizer(built.tokenizer, max_len, built.engine.vocab_size, args.max_waiting)
    tool_parser = tool_call_format(built.tokenizer, args.tool_call_parser)
    state = ServerState(engine, built.tokenizer, name, max_len, metrics, prompts, max_n=args.max_n,
                        grammars=GrammarCompiles(built.engine, args.grammar_compile_timeout), tool_parser=tool_parser)
    app = create_app(state, api_key=args.api_key, max_request_bytes=args.max_request_bytes,
                     metrics_need_key=args.metrics_need_key)
    log.info("op table (%s backend):\n%s", built.selection.backend.name, built.selection.format_table())
    log.info("KV cache capacity: %d tokens", built.engine.capacity_tokens)
    log.info("tool calls (tool_choice 'auto'): %s", f"{tool_parser} format" if tool_parser else
             "off (no known format in the chat template; --tool-call-parser sets one)")
    log.info("serving %s at http://%s:%d/v1%s", name, args.host, args.port,
             " (API key required)" if args.api_key else "")

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=int(args.shutdown_timeout) + 5)
    server = _GracefulServer(config, state, args.shutdown_timeout)
    engine.on_fatal = server.engine_died
    if built.workers is not None:  # a rank that exits fails the engine: unhealthy, then exit 1
        built.workers.on_death = lambda reason: _fail_engine(engine, reason)
    http = threading.Thread(target=_serve_http, args=(server, engine), name="resin-http")
    # Signals reach the main thread, which steps the engine: handled between steps (a CPU step is at most ~2 s).
    previous = {sig: signal.signal(sig, server.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        engine.run_in_this_thread(then_start=http.start)
        http.join()
    finally:
        for sig, handler in previous.items():  # Ctrl-C interrupts the shutdown below again
            signal.signal(sig, handler)
        if engine.error is None:
            shutdown_engine(built)
        elif built.workers is not None:
            built.workers.close(timeout=0)
    if server.exit_code:
        return server.exit_code
    if engine.error is not None:
        log.error("exiting with status 1: the engine failed (%r); a supervisor should restart the server",
                  engine.error)
        return 1
    return 0


def _fail_engine(engine: AsyncEngine, reason: str, grace: float = 10.0) -> None:
    """A tensor-parallel rank died: fail every request now; if the main thread is still stuck in a collective with
    the dead rank after `grace` seconds (a GPU one can wait minutes for its timeout), exit 1 without it."""
    engine.fail(RuntimeError(reason))
    if not engine.wait_stopped(grace):
        log.error("the engine's step did not return %.0fs after a rank died; exiting with status 1", grace)
        os._exit(1)


def _serve_http(server: uvicorn.Server, engine: AsyncEngine) -> None:
    """The HTTP thread: uvicorn's event loop, with one torch thread, so that whatever small tensor work a request
    does here never starts a second OpenMP team beside the engine's (see async_engine's docstring)."""
    torch.set_num_threads(1)
    try:
        server.run()
        if not server.started and not server.should_exit:  # older uvicorns return when the app failed to start
            server.exit_code = 3
    except SystemExit as e:  # uvicorn exits when it cannot listen (the port is taken); in a thread that is silent
        server.exit_code = e.code if isinstance(e.code, int) and e.code else 1
    except BaseException:
        log.exception("the HTTP server failed")
        server.exit_code = 1
    finally:
        engine.stop()  # the server is gone (also if it failed to start): the main thread stops stepping


class _GracefulServer(uvicorn.Server):
    """uvicorn.Server that drains before it stops listening.

    On the first SIGTERM/SIGINT the server keeps accepting connections while in-flight requests finish: /health
    and new requests answer 503, so a load balancer sees the instance leave instead of finding a closed port.
    Once the engine is idle (or the grace period ends and what is left is aborted), uvicorn's own shutdown runs.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState, grace: float):
        super().__init__(config)
        self.state, self.grace = state, grace
        self.exit_code = 0  # non-zero: the server itself failed (e.g. it could not listen)

    def handle_exit(self, sig, frame) -> None:
        # Not super(): uvicorn would re-raise the signal after shutting down, and the process would die of it
        # instead of exiting 0.
        if not self.state.shutting_down:
            self.state.shutting_down = True
            log.info("shutting down: finishing in-flight requests (up to %.0fs)", self.grace)
            threading.Thread(target=self._drain, name="resin-drain", daemon=True).start()
        elif sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C stops waiting
            self.should_exit = True

    def _drain(self) -> None:
        engine = self.state.engine
        deadline = time.monotonic() + self.grace
        while engine.alive and (engine.engine.has_unfinished_requests() or engine.num_waiting) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        if engine.engine.has_unfinished_requests():
            engine.abort_all()  # every stream still open ends with finish_reason "abort" and [DONE]
        self.should_exit = True

    def engine_died(self, error: BaseException) -> None:
        """Called on the engine thread after it failed every in-flight request: stop serving, exit non-zero."""
        self.state.shutting_down = True
        self.should_exit = True
