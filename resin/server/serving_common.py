"""What both OpenAI endpoints share: request checks, admission, collecting outputs, SSE, timing and outcomes."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import Request

from resin.core.outputs import RequestOutput
from resin.core.sampling_params import OutputKind, SamplingParams
from resin.core.structured_output import StructuredOutputsParams
from resin.server.async_engine import AsyncEngine, EngineDead, QueueFull, RequestStream, StreamError
from resin.server.errors import APIError, error_body, param_of_sampling_error
from resin.server.metrics import RequestTimer, ServerMetrics, outcome_of
from resin.server.prompts import PromptChecker
from resin.server.protocol import _Common
from resin.server.structured import GrammarCompiles

log = logging.getLogger("resin")


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Any
    model_name: str
    max_model_len: int
    metrics: ServerMetrics
    prompts: PromptChecker
    max_n: int = 128
    grammars: GrammarCompiles | None = None
    tool_parser: str | None = None  # the tool-call format for tool_choice 'auto' (tool_calls.FORMATS)
    created: int = field(default_factory=lambda: int(time.time()))
    shutting_down: bool = False


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_common(state: ServerState, req: _Common) -> None:
    """What needs no work at all: state, model name, unsupported fields, n."""
    if state.shutting_down:
        raise APIError(503, "the server is shutting down")
    if not state.engine.alive:
        raise APIError(503, "the engine is not running")
    if req.model is not None and req.model != state.model_name:
        raise APIError(404, f"The model `{req.model}` does not exist; this server serves `{state.model_name}`.",
                       "model")
    bad = req.unsupported_fields()
    if bad:
        raise APIError(400, f"parameter(s) {', '.join(bad)} not supported by this server", bad[0])
    if not 1 <= req.n <= state.max_n:
        raise APIError(400, f"n={req.n} is invalid: this server allows 1 to {state.max_n} choices per request "
                            f"(--max-n)", "n")


def make_params(req: _Common, max_tokens: int | None, logprobs: int | None, stream: bool,
                prompt_logprobs: int | None = None) -> SamplingParams:
    try:
        params = req.sampling_params(max_tokens, logprobs, prompt_logprobs)
    except ValueError as e:
        raise APIError(400, str(e), param_of_sampling_error(str(e))) from None
    # Streams take deltas; a whole response is built once, from the final output.
    return dataclasses.replace(params, output_kind=OutputKind.DELTA if stream else OutputKind.FINAL_ONLY)


async def constrained(state: ServerState, params: SamplingParams,
                      asked: tuple[StructuredOutputsParams, str] | None) -> SamplingParams:
    """params with the request's grammar, compiled first (a grammar that cannot compile is a 400 naming it)."""
    if asked is None:
        return params
    spec, param = asked
    if state.grammars is None:
        raise APIError(400, "this server does not take structured outputs", param)
    await state.grammars.compile(spec, param)
    return dataclasses.replace(params, structured_outputs=spec)


def submit(state: ServerState, base_id: str, prompts: list[tuple[str | None, list[int]]], params: SamplingParams,
           max_tokens: int | None, max_tokens_name: str) -> RequestStream:
    """Everything that can refuse a request, before any response starts (so each refusal has its real status):
    context overflow (naming both numbers), the engine's own checks, the engine's state, a full queue."""
    state.prompts.check_sequences(len(prompts), params.n)
    for _, ids in prompts:
        n = len(ids)
        if max_tokens is not None and n + max_tokens > state.max_model_len:
            raise APIError(400, f"This model's maximum context length is {state.max_model_len} tokens. However, "
                                f"you requested {n + max_tokens} tokens ({n} in the prompt, {max_tokens} in "
                                f"{max_tokens_name}). Reduce the prompt or {max_tokens_name}.", max_tokens_name)
        try:
            state.engine.engine.check_request(ids, params)
        except ValueError as e:
            message = str(e)
            raise APIError(400, message, param_of_sampling_error(message) or "prompt") from None
    try:
        stream = state.engine.submit(base_id, prompts, params)
    except QueueFull as e:
        raise APIError(429, str(e)) from None
    except EngineDead as e:
        raise APIError(503, str(e)) from None
    for _, ids in prompts:
        state.metrics.prompt_tokens.inc(len(ids))
    return stream


def raise_for_error(out: RequestOutput) -> None:
    if out.error is not None:
        raise APIError(500, f"the request failed inside the engine ({out.error}); other requests are unaffected")


async def collect(raw: Request, stream: RequestStream, count: int, timer: RequestTimer) -> list[RequestOutput]:
    """Final outputs for a non-streaming request, watching for the client leaving meanwhile."""
    final: list[RequestOutput | None] = [None] * count

    async def consume() -> None:
        try:
            async for i, out in stream:
                final[i] = out
                raise_for_error(out)
        except StreamError as e:
            raise APIError(e.status, str(e)) from None

    task = asyncio.create_task(consume())
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if not done and await raw.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                timer.finish("aborted")
                error = APIError(499, "client disconnected")
                error.counted = True
                raise error
        try:
            task.result()
        except APIError as e:
            timer.finish("failed")
            e.counted = True
            raise
    finally:
        stream.close()
    results = [o for o in final if o is not None]
    timer.observe_final(results)
    timer.finish(outcome_of(results))
    return results


async def sse_response(chunks: AsyncIterator[str], stream: RequestStream, timer: RequestTimer) -> AsyncIterator[str]:
    """The frame around an endpoint's chunks: [DONE] at the end, an engine error or refusal as an error event
    (the 200 went out long ago), and the request's engine work aborted if the client leaves mid-stream."""
    try:
        async for chunk in chunks:
            yield chunk
    except (APIError, StreamError) as e:
        timer.finish("failed")
        yield error_event(e)
    except Exception as e:  # noqa: BLE001 - a bug in shaping this stream's output: end it with an error, not a cut
        log.exception("stream %s failed", stream)
        timer.finish("failed")
        yield sse(error_body(500, f"the server failed while streaming this response ({type(e).__name__}); other "
                                  f"requests are unaffected"))
    finally:
        stream.close()
        timer.finish("aborted")  # no-op unless the client left mid-stream
    yield sse("[DONE]")


def error_event(e: APIError | StreamError) -> str:
    """A mid-stream error (the 200 and its headers went out long ago): typed by the status it would have had."""
    if isinstance(e, StreamError):
        return sse(error_body(e.status, str(e)))
    return sse(error_body(e.status, e.message, e.param))


# Characters str.splitlines() breaks lines at that JSON leaves unescaped: a client that splits an SSE stream into
# lines that way (httpx's aiter_lines does) would cut an event in two. Inside JSON they can only be in strings.
_LINE_BREAKS = {ord("\u2028"): "\\u2028", ord("\u2029"): "\\u2029", ord("\x85"): "\\u0085"}


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKS)
    return f"data: {data}\n\n"


def usage(prompt_lens: list[int], completion_tokens: int) -> dict[str, int]:
    prompt = sum(prompt_lens)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}
