"""What both OpenAI endpoints share: request checks, prompt admission, output streams, SSE, timing metrics."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import Request

from resin.core.outputs import RequestOutput
from resin.core.sampling_params import SamplingParams
from resin.server.async_engine import AsyncEngine, EngineDead, QueueFull
from resin.server.errors import APIError, param_of_sampling_error
from resin.server.metrics import ServerMetrics
from resin.server.protocol import _Common


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Any
    model_name: str
    max_model_len: int
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    shutting_down: bool = False


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_common(state: ServerState, req: _Common) -> None:
    if state.shutting_down:
        raise APIError(503, "the server is shutting down")
    if req.model is not None and req.model != state.model_name:
        raise APIError(404, f"The model `{req.model}` does not exist; this server serves `{state.model_name}`.",
                       "model")
    bad = req.unsupported_fields()
    if bad:
        raise APIError(400, f"parameter(s) {', '.join(bad)} not supported by this server", bad[0])


def make_params(req: _Common, max_tokens: int | None, logprobs: int | None,
                prompt_logprobs: int | None = None) -> SamplingParams:
    try:
        return req.sampling_params(max_tokens, logprobs, prompt_logprobs)
    except ValueError as e:
        raise APIError(400, str(e), param_of_sampling_error(str(e))) from None


def admit(state: ServerState, prompt_ids: list[int], params: SamplingParams, max_tokens: int | None,
          max_tokens_name: str) -> None:
    """Reject what cannot run before any response starts: a full queue, context overflow (naming both numbers),
    bad token ids."""
    if state.engine.num_waiting >= state.engine.max_waiting:
        raise APIError(429, f"the waiting queue is full ({state.engine.max_waiting} requests); retry later")
    n = len(prompt_ids)
    if max_tokens is not None and n + max_tokens > state.max_model_len:
        raise APIError(400, f"This model's maximum context length is {state.max_model_len} tokens. However, you "
                            f"requested {n + max_tokens} tokens ({n} in the prompt, {max_tokens} in "
                            f"{max_tokens_name}). Reduce the prompt or {max_tokens_name}.", max_tokens_name)
    try:
        state.engine.engine.check_request(prompt_ids, params)
    except ValueError as e:
        raise APIError(400, str(e), "prompt") from None


class RequestTimer:
    """TTFT, inter-token latency and end-to-end latency of one user request, into the histograms."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.start = self.last = time.monotonic()
        self.tokens = 0

    def observe(self, outputs: list[RequestOutput]) -> None:
        total = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        new = total - self.tokens
        if new <= 0:
            return
        now = time.monotonic()
        if self.tokens == 0:
            self.metrics.ttft.observe(now - self.start)
        else:
            for _ in range(new):
                self.metrics.itl.observe((now - self.last) / new)
        self.tokens, self.last = total, now

    def finish(self, outputs: list[RequestOutput]) -> None:
        """Aborts are counted by the engine (every path: disconnect, shutdown); this counts the rest."""
        self.metrics.e2e.observe(time.monotonic() - self.start)
        if not any(c.finish_reason == "abort" for o in outputs for c in o.outputs):
            self.metrics.finished.inc()


async def merged_outputs(state: ServerState, base_id: str, prompts: list[tuple[str | None, list[int]]],
                         params: SamplingParams) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Run every prompt as its own engine request and yield (prompt index, output) as they arrive. Leaving
    early (client disconnect) cancels the producers, which aborts their requests and frees their blocks."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def produce(i: int, text: str | None, ids: list[int]) -> None:
        try:
            async for out in state.engine.generate(f"{base_id}-{i}", ids, params, text):
                await queue.put((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which decides
            await queue.put(e)
        finally:
            await queue.put(done)

    for text, ids in prompts:
        state.metrics.prompt_tokens.inc(len(ids))
    tasks = [asyncio.create_task(produce(i, t, ids)) for i, (t, ids) in enumerate(prompts)]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, QueueFull):
                raise APIError(429, str(item))
            elif isinstance(item, EngineDead):
                raise APIError(503, str(item))
            elif isinstance(item, ValueError):
                raise APIError(400, str(item))
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(raw: Request, outputs: AsyncIterator[tuple[int, RequestOutput]], count: int,
                  timer: RequestTimer) -> list[RequestOutput]:
    """Final outputs for a non-streaming request, watching for the client leaving meanwhile."""
    final: list[RequestOutput | None] = [None] * count

    async def consume() -> None:
        async for i, out in outputs:
            final[i] = out
            timer.observe([o for o in final if o is not None])

    task = asyncio.create_task(consume())
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if not done and await raw.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise APIError(499, "client disconnected")
    task.result()
    results = [o for o in final if o is not None]
    timer.finish(results)
    return results


def sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(prompt_lens: list[int], outputs: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(prompt_lens)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
