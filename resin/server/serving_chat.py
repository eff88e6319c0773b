"""POST /v1/chat/completions."""
from __future__ import annotations

import dataclasses
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from resin.core.outputs import RequestOutput
from resin.server.async_engine import RequestStream
from resin.server.chat_tools import ToolPlan, delta_of, finish_reason
from resin.server.errors import APIError
from resin.server.formatting import chat_logprobs
from resin.server.protocol import ChatCompletionRequest
from resin.server.serving_common import (RequestTimer, ServerState, check_common, collect, constrained, make_params,
                                         new_id, outcome_of, raise_for_error, sse, sse_response, submit, usage)
from resin.server.structured import requested_constraint
from resin.server.tool_calls import assemble


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request):
    check_common(state, req)
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", "top_logprobs")
    name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = make_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None, req.stream)
    tools = ToolPlan.of(req, state.tool_parser)
    asked = requested_constraint(req)
    if tools.constraint is not None and asked is not None:
        raise APIError(400, f"tool_choice {tools.choice!r} already constrains the output to a tool call: drop "
                            f"{asked[1]}, or use tool_choice 'auto'", asked[1])
    try:
        messages = [m.for_template() for m in req.messages]
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None
    prompt, ids = await state.prompts.chat_prompt(messages, req.add_generation_prompt, tools.template_tools)
    if tools.constraint is not None:
        asked = (tools.constraint, "tool_choice")
    params = await constrained(state, params, asked)
    if tools.fmt is not None and tools.fmt.name == "mistral":  # its [TOOL_CALLS] marker is a special token
        params = dataclasses.replace(params, skip_special_tokens=False)
    rid, timer = new_id("chatcmpl"), RequestTimer(state.metrics)
    stream = submit(state, rid, [(prompt, ids)], params, max_tokens, name)
    if req.stream:
        head = {"id": rid, "object": "chat.completion.chunk", "created": state.created, "model": state.model_name}
        return StreamingResponse(sse_response(_chunks(req, tools, len(ids), stream, head, timer), stream, timer),
                                 media_type="text/event-stream")
    results = await collect(raw, stream, 1, timer)
    top = req.top_logprobs or 0
    choices = []
    for c in results[0].outputs:
        message = {"role": "assistant", "content": c.text}
        parser = tools.parser()
        if parser is not None:
            calls = assemble([parser.feed(c.text), parser.finish()])
            message["content"] = calls.content or (None if calls.calls else "")
            if calls.calls:
                message["tool_calls"] = calls.calls
        choices.append({"index": c.index, "message": message,
                        "logprobs": chat_logprobs(c.token_ids, c.logprobs, top) if req.logprobs else None,
                        "finish_reason": finish_reason(parser, c.finish_reason)})
    completion = sum(len(c.token_ids) for c in results[0].outputs)
    return JSONResponse({"id": rid, "object": "chat.completion", "created": state.created,
                         "model": state.model_name, "choices": choices, "usage": usage([len(ids)], completion)})


async def _chunks(req: ChatCompletionRequest, tools: ToolPlan, prompt_len: int, stream: RequestStream, head: dict,
                  timer: RequestTimer) -> AsyncIterator[str]:
    top = req.top_logprobs or 0
    final: RequestOutput | None = None
    completion = 0
    parsers = [tools.parser() for _ in range(req.n)]
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
            parser = parsers[c.index]
            if parser is None:
                deltas = [{"content": c.text}] if c.text else []
            else:
                deltas = delta_of(parser.feed(c.text))
                if c.finish_reason is not None:
                    deltas += delta_of(parser.finish())
            deltas = deltas or [{}]
            reason = finish_reason(parser, c.finish_reason)
            for k, delta in enumerate(deltas):  # logprobs ride on the first, the finish reason on the last
                last = k == len(deltas) - 1
                yield sse({**head, "choices": [{"index": c.index, "delta": delta, "logprobs": lp if k == 0 else None,
                                                "finish_reason": reason if last else None}]})
    timer.finish(outcome_of([final] if final else []))
    if req.stream_options and req.stream_options.include_usage:
        yield sse({**head, "choices": [], "usage": usage([prompt_len], completion)})
