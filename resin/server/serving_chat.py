"""POST /v1/chat/completions."""
from __future__ import annotations

from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from resin.core.outputs import RequestOutput
from resin.server.async_engine import RequestStream
from resin.server.errors import APIError
from resin.server.formatting import chat_logprobs
from resin.server.protocol import ChatCompletionRequest
from resin.server.serving_common import (RequestTimer, ServerState, check_common, collect, make_params, new_id,
                                         outcome_of, raise_for_error, sse, sse_response, submit, usage)


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request):
    check_common(state, req)
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", "top_logprobs")
    name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = make_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None, req.stream)
    try:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None
    prompt, ids = await state.prompts.chat_prompt(messages, req.add_generation_prompt)
    rid, timer = new_id("chatcmpl"), RequestTimer(state.metrics)
    stream = submit(state, rid, [(prompt, ids)], params, max_tokens, name)
    if req.stream:
        head = {"id": rid, "object": "chat.completion.chunk", "created": state.created, "model": state.model_name}
        return StreamingResponse(sse_response(_chunks(req, len(ids), stream, head, timer), stream, timer),
                                 media_type="text/event-stream")
    results = await collect(raw, stream, 1, timer)
    top = req.top_logprobs or 0
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c.token_ids, c.logprobs, top) if req.logprobs else None,
                "finish_reason": c.finish_reason} for c in results[0].outputs]
    completion = sum(len(c.token_ids) for c in results[0].outputs)
    return JSONResponse({"id": rid, "object": "chat.completion", "created": state.created,
                         "model": state.model_name, "choices": choices, "usage": usage([len(ids)], completion)})


async def _chunks(req: ChatCompletionRequest, prompt_len: int, stream: RequestStream, head: dict,
                  timer: RequestTimer) -> AsyncIterator[str]:
    top = req.top_logprobs or 0
    final: RequestOutput | None = None
    completion = 0
    for i in range(req.n):
        yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]})
    async for _, out in stream:
        raise_for_error(out)
        if out.finished:
            final = out
        for c in out.outputs:
            lp = chat_logprobs(c.token_ids, c.logprobs or [], top) if req.logprobs else None
            completion += len(c.token_ids)
            timer.observe(len(c.token_ids))
            yield sse({**head, "choices": [{"index": c.index, "delta": {"content": c.text} if c.text else {},
                                            "logprobs": lp, "finish_reason": c.finish_reason}]})
    timer.finish(outcome_of([final] if final else []))
    if req.stream_options and req.stream_options.include_usage:
        yield sse({**head, "choices": [], "usage": usage([prompt_len], completion)})
