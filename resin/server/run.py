"""`resin run`: build the engine, start the engine thread, serve HTTP with uvicorn, shut down gracefully.

On SIGINT/SIGTERM uvicorn stops accepting connections and waits for in-flight requests; if they are still
running when the grace period ends, they are aborted, so every stream ends with a final chunk (finish_reason
"abort") and [DONE] rather than a cut connection, and the process exits 0.
"""
from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass

import uvicorn

from resin.engine_builder import EngineArgs, build_engine
from resin.server.app import create_app
from resin.server.async_engine import AsyncEngine
from resin.server.metrics import ServerMetrics
from resin.server.serving_common import ServerState

log = logging.getLogger("resin")


@dataclass
class ServeArgs:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_waiting: int = 1024
    shutdown_timeout: float = 10.0


def serve(engine_args: EngineArgs, args: ServeArgs) -> int:
    built = build_engine(engine_args)
    name = args.served_model_name or (str(engine_args.model) if engine_args.model else "SmolLM2-135M-Instruct")
    metrics = ServerMetrics(name)
    engine = AsyncEngine(built.engine, max_waiting=args.max_waiting, on_step=metrics.on_step,
                         on_change=metrics.on_change)
    state = ServerState(engine, built.tokenizer, name, built.engine.config.max_model_len, metrics)
    app = create_app(state, api_key=args.api_key)
    log.info("op table (%s backend):\n%s", built.selection.backend.name, built.selection.format_table())
    log.info("KV cache capacity: %d tokens", built.engine.capacity_tokens)
    log.info("serving %s at http://%s:%d/v1%s", name, args.host, args.port,
             " (API key required)" if args.api_key else "")

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=int(args.shutdown_timeout) + 5)
    server = _GracefulServer(config, state, args.shutdown_timeout)
    server.run()
    return 0


class _GracefulServer(uvicorn.Server):
    """uvicorn.Server whose exit signal also starts the grace-period clock for in-flight requests."""

    def __init__(self, config: uvicorn.Config, state: ServerState, grace: float):
        super().__init__(config)
        self.state, self.grace = state, grace

    def handle_exit(self, sig, frame) -> None:
        # Not super(): uvicorn would re-raise the signal after shutting down, and the process would die of it
        # instead of exiting 0.
        if not self.state.shutting_down:
            self.state.shutting_down = True
            log.info("shutting down: finishing in-flight requests (up to %.0fs)", self.grace)
            timer = threading.Timer(self.grace, self.state.engine.abort_all)
            timer.daemon = True
            timer.start()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C stops waiting
        self.should_exit = True
