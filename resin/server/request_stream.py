"""RequestStream: the outputs of one user request, handed from the engine thread to one consumer on the event loop.

Deltas that arrive while the consumer is busy (writing to a slow client) wait as a list and are merged once, when
it reads: what waits is O(the request's length). If output has waited unread for longer than the engine's stall
timeout (the client stopped reading, so the response's writes block), the request is aborted and its KV freed.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from resin.core.outputs import CompletionOutput, RequestOutput

if TYPE_CHECKING:
    from resin.server.async_engine import AsyncEngine

log = logging.getLogger("resin")


def merge_deltas(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive DELTA outputs of one request as one: texts, tokens and logprobs joined per sequence, in one
    pass (merging pairwise as they arrive would copy a stalled stream's text once per step)."""
    if len(outputs) == 1:
        return outputs[0]
    texts: dict[int, list[str]] = {}
    tokens: dict[int, list[int]] = {}
    logprobs: dict[int, list | None] = {}
    last: dict[int, CompletionOutput] = {}
    for out in outputs:
        for c in out.outputs:
            texts.setdefault(c.index, []).append(c.text)
            tokens.setdefault(c.index, []).extend(c.token_ids)
            lp = logprobs.setdefault(c.index, None if c.logprobs is None else [])
            if lp is not None:
                lp.extend(c.logprobs or [])
            last[c.index] = c
    merged = [CompletionOutput(i, "".join(texts[i]), tokens[i], last[i].finish_reason, last[i].stop_reason,
                               logprobs[i]) for i in sorted(last)]
    b = outputs[-1]
    return RequestOutput(b.request_id, b.prompt, b.prompt_token_ids, merged,
                         prompt_logprobs=next((o.prompt_logprobs for o in outputs if o.prompt_logprobs), None),
                         finished=b.finished, error=next((o.error for o in outputs if o.error), None),
                         metrics=b.metrics)


class RequestStream:
    """The outputs of one user request (one engine request per prompt), for one consumer on the event loop.

    Iterating yields (prompt index, output) with everything that arrived since the last read merged; it ends
    when every engine request finished. `close()` (always call it) aborts whatever is still running."""

    def __init__(self, engine: "AsyncEngine", request_ids: list[str]):
        self._engine = engine
        self.request_ids = request_ids
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self._open = set(request_ids)
        self._pending: dict[int, list[RequestOutput]] = {}  # per prompt, deltas not read yet
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        # Since when outputs have been waiting unread (None: nothing waits). A consumer parked on _ready while the
        # request queues or prefills is not stalled, however long that takes; only unread output counts.
        self._waiting_since: float | None = None
        self.stalled = False

    # event-loop side, called by the AsyncEngine
    def _put(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = now
        elif now - self._waiting_since > self._engine.stall_timeout and not self.stalled:
            log.warning("request %s: client has not read for %.0fs; aborting it", out.request_id,
                        self._engine.stall_timeout)
            self.stalled = True
            self._abort_open()
        self._pending.setdefault(self._index[out.request_id], []).append(out)
        if out.finished:
            self._open.discard(out.request_id)
        self._ready.set()

    @property
    def done(self) -> bool:
        """Every engine request has delivered its final output (or the stream failed or was closed)."""
        return not self._open

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._abort_open()  # the stream's other prompts must not run on for nobody
        self._open.clear()
        self._ready.set()

    def _abort_open(self) -> None:
        for rid in self._open:
            self._engine._post(("abort", rid))

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        while not self._pending:
            if self._error is not None:
                raise self._error
            if not self._open:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        i = next(iter(self._pending))
        out = merge_deltas(self._pending.pop(i))
        self._waiting_since = time.monotonic() if self._pending else None  # reading: the clock restarts
        return i, out

    def close(self) -> None:
        self._abort_open()
        self._open.clear()
        self._engine._streams_close(self)
