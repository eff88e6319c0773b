"""POST /v1/completions."""
from __future__ import annotations

from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from resin.core.outputs import CompletionOutput, RequestOutput
from resin.server.async_engine import RequestStream
from resin.server.errors import APIError
from resin.server.formatting import completion_logprobs
from resin.server.protocol import CompletionRequest
from resin.server.serving_common import (RequestTimer, ServerState, check_common, collect, constrained, make_params,
                                         new_id, outcome_of, raise_for_error, sse, sse_response, submit, usage)
from resin.server.structured import requested_constraint


def _choice_logprobs(req: CompletionRequest, out: RequestOutput, c: CompletionOutput, first: bool, offset: int):
    """Logprobs of c's tokens (a delta when streaming); the first chunk of an echoed prompt leads with the prompt's."""
    if req.logprobs is None:
        return None
    ids, positions = c.token_ids, c.logprobs or []
    if req.echo and first and out.prompt_logprobs is not None:
        ids, positions = out.prompt_token_ids + ids, list(out.prompt_logprobs) + positions
    return completion_logprobs(ids, positions, req.logprobs, offset)


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request):
    check_common(state, req)
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of different from n is not supported", "best_of")
    echo_lp = req.logprobs if req.echo and req.logprobs is not None else None
    params = make_params(req, req.max_tokens, req.logprobs, req.stream, prompt_logprobs=echo_lp)
    asked = requested_constraint(req)
    prompts = await state.prompts.completion_prompts(req.prompt, req.echo, req.n)
    params = await constrained(state, params, asked)
    rid, timer = new_id("cmpl"), RequestTimer(state.metrics)
    stream = submit(state, rid, prompts, params, req.max_tokens, "max_tokens")
    head = {"id": rid, "object": "text_completion", "created": state.created, "model": state.model_name}
    if req.stream:
        return StreamingResponse(sse_response(_chunks(req, prompts, stream, head, timer), stream, timer),
                                 media_type="text/event-stream")
    results = await collect(raw, stream, len(prompts), timer)
    choices = []
    for i, out in enumerate(results):
        prefix = (prompts[i][0] or "") if req.echo else ""
        for c in out.outputs:
            choices.append({"index": i * req.n + c.index, "text": prefix + c.text, "finish_reason": c.finish_reason,
                            "logprobs": _choice_logprobs(req, out, c, True, 0)})
    completion = sum(len(c.token_ids) for o in results for c in o.outputs)
    return JSONResponse({**head, "choices": choices, "usage": usage([len(p[1]) for p in prompts], completion)})


async def _chunks(req: CompletionRequest, prompts, stream: RequestStream, head: dict,
                  timer: RequestTimer) -> AsyncIterator[str]:
    offsets: dict[int, int] = {}  # text_offset of the next logprob token, per choice
    started: set[int] = set()
    finals: list[RequestOutput] = []
    completion = 0
    async for i, out in stream:
        raise_for_error(out)
        if out.finished:
            finals.append(out)
        for c in out.outputs:
            idx = i * req.n + c.index
            first = idx not in started
            started.add(idx)
            text = (prompts[i][0] or "") + c.text if first and req.echo else c.text
            lp = _choice_logprobs(req, out, c, first, offsets.get(idx, 0))
            if lp and lp["tokens"]:
                offsets[idx] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            completion += len(c.token_ids)
            timer.observe(len(c.token_ids))
            yield sse({**head, "choices": [{"index": idx, "text": text, "logprobs": lp,
                                            "finish_reason": c.finish_reason}]})
    timer.finish(outcome_of(finals))
    if req.stream_options and req.stream_options.include_usage:
        yield sse({**head, "choices": [], "usage": usage([len(p[1]) for p in prompts], completion)})
