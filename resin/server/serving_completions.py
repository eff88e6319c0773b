"""POST /v1/completions."""
from __future__ import annotations

from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from resin.core.outputs import RequestOutput
from resin.server.errors import APIError
from resin.server.formatting import completion_logprobs
from resin.server.protocol import CompletionRequest
from resin.server.serving_common import (RequestTimer, ServerState, admit, check_common, collect, make_params,
                                         merged_outputs, new_id, sse, usage)


def _prompts(state: ServerState, prompt) -> list[tuple[str | None, list[int]]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty", "prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    out = []
    for p in prompt:
        if isinstance(p, str):
            if state.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send the prompt as token ids", "prompt")
            out.append((p, state.tokenizer(p)["input_ids"]))
        else:
            text = state.tokenizer.decode(p) if state.tokenizer is not None else None
            out.append((text, list(p)))
    return out


def _choice_logprobs(req: CompletionRequest, out: RequestOutput, c, start: int, end: int, offset: int):
    if req.logprobs is None:
        return None
    ids, positions = c.token_ids[start:end], (c.logprobs or [])[start:end]
    if req.echo and start == 0 and out.prompt_logprobs is not None:
        ids, positions = out.prompt_token_ids + ids, list(out.prompt_logprobs) + positions
    return completion_logprobs(ids, positions, req.logprobs, offset)


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request):
    check_common(state, req)
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of different from n is not supported", "best_of")
    prompts = _prompts(state, req.prompt)
    echo_lp = req.logprobs if req.echo and req.logprobs is not None else None
    params = make_params(req, req.max_tokens, req.logprobs, prompt_logprobs=echo_lp)
    for _, ids in prompts:
        admit(state, ids, params, req.max_tokens, "max_tokens")
    rid, timer = new_id("cmpl"), RequestTimer(state.metrics)
    outputs = merged_outputs(state, rid, prompts, params)
    head = {"id": rid, "object": "text_completion", "created": state.created, "model": state.model_name}
    if req.stream:
        return StreamingResponse(_stream(state, req, prompts, outputs, head, timer), media_type="text/event-stream")
    results = await collect(raw, outputs, len(prompts), timer)
    choices = []
    for i, out in enumerate(results):
        prefix = (prompts[i][0] or "") if req.echo else ""
        for c in out.outputs:
            choices.append({"index": i * req.n + c.index, "text": prefix + c.text, "finish_reason": c.finish_reason,
                            "logprobs": _choice_logprobs(req, out, c, 0, len(c.token_ids), 0)})
    return JSONResponse({**head, "choices": choices, "usage": usage([len(p[1]) for p in prompts], results)})


async def _stream(state: ServerState, req: CompletionRequest, prompts, outputs: AsyncIterator, head: dict,
                  timer: RequestTimer) -> AsyncIterator[str]:
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    offsets: dict[int, int] = {}  # text_offset of the next logprob token, per choice
    done: set[int] = set()  # choices whose final chunk went out
    latest: dict[int, RequestOutput] = {}
    try:
        async for i, out in outputs:
            latest[i] = out
            timer.observe(list(latest.values()))
            for c in out.outputs:
                idx = i * req.n + c.index
                if idx in done:
                    continue
                first = idx not in sent_text
                start_tok, start_txt = sent_tokens.get(idx, 0), sent_text.get(idx, 0)
                delta = c.text[start_txt:]
                if first and req.echo:
                    delta = (prompts[i][0] or "") + delta
                if not delta and len(c.token_ids) == start_tok and c.finish_reason is None and not first:
                    continue
                lp = _choice_logprobs(req, out, c, start_tok, len(c.token_ids), offsets.get(idx, 0))
                if lp and lp["tokens"]:
                    offsets[idx] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                sent_text[idx], sent_tokens[idx] = len(c.text), len(c.token_ids)
                if c.finish_reason is not None:
                    done.add(idx)
                yield sse({**head, "choices": [{"index": idx, "text": delta, "logprobs": lp,
                                                "finish_reason": c.finish_reason}]})
        timer.finish(list(latest.values()))
        if req.stream_options and req.stream_options.include_usage:
            yield sse({**head, "choices": [], "usage": usage([len(p[1]) for p in prompts], list(latest.values()))})
    except APIError as e:
        yield sse({"error": {"message": e.message, "type": "invalid_request_error", "param": e.param,
                             "code": e.status}})
    yield sse("[DONE]")
