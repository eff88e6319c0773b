"""POST /v1/chat/completions."""
from __future__ import annotations

from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from resin.core.outputs import RequestOutput
from resin.server.errors import APIError
from resin.server.formatting import chat_logprobs
from resin.server.protocol import ChatCompletionRequest
from resin.server.serving_common import (RequestTimer, ServerState, admit, check_common, collect, make_params,
                                         merged_outputs, new_id, sse, usage)


def _prompt(state: ServerState, req: ChatCompletionRequest) -> tuple[str, list[int]]:
    tok = state.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise APIError(400, "this model has no chat template: use /v1/completions", "messages")
    if not req.messages:
        raise APIError(400, "messages is empty", "messages")
    try:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=req.add_generation_prompt)
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None
    except Exception as e:  # noqa: BLE001 - a template that rejects this conversation (e.g. role order)
        raise APIError(400, f"the chat template rejected these messages: {e}", "messages") from None
    return prompt, tok(prompt, add_special_tokens=False)["input_ids"]


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request):
    check_common(state, req)
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", "top_logprobs")
    prompt, ids = _prompt(state, req)
    name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = make_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
    admit(state, ids, params, max_tokens, name)
    rid, timer = new_id("chatcmpl"), RequestTimer(state.metrics)
    outputs = merged_outputs(state, rid, [(prompt, ids)], params)
    if req.stream:
        head = {"id": rid, "object": "chat.completion.chunk", "created": state.created, "model": state.model_name}
        return StreamingResponse(_stream(req, len(ids), outputs, head, timer), media_type="text/event-stream")
    results = await collect(raw, outputs, 1, timer)
    top = req.top_logprobs or 0
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c.token_ids, c.logprobs, top) if req.logprobs else None,
                "finish_reason": c.finish_reason} for c in results[0].outputs]
    return JSONResponse({"id": rid, "object": "chat.completion", "created": state.created,
                         "model": state.model_name, "choices": choices, "usage": usage([len(ids)], results)})


async def _stream(req: ChatCompletionRequest, prompt_len: int, outputs: AsyncIterator, head: dict,
                  timer: RequestTimer) -> AsyncIterator[str]:
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    done: set[int] = set()  # choices whose final chunk went out
    last: RequestOutput | None = None
    top = req.top_logprobs or 0
    try:
        for i in range(req.n):
            yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
        async for _, out in outputs:
            last = out
            timer.observe([out])
            for c in out.outputs:
                if c.index in done:
                    continue
                start_tok, start_txt = sent_tokens.get(c.index, 0), sent_text.get(c.index, 0)
                delta = c.text[start_txt:]
                if not delta and len(c.token_ids) == start_tok and c.finish_reason is None:
                    continue
                lp = None
                if req.logprobs:
                    lp = chat_logprobs(c.token_ids[start_tok:], (c.logprobs or [])[start_tok:len(c.token_ids)], top)
                sent_text[c.index], sent_tokens[c.index] = len(c.text), len(c.token_ids)
                if c.finish_reason is not None:
                    done.add(c.index)
                yield sse({**head, "choices": [{"index": c.index, "delta": {"content": delta} if delta else {},
                                                "logprobs": lp, "finish_reason": c.finish_reason}]})
        if last is not None:
            timer.finish([last])
        if req.stream_options and req.stream_options.include_usage and last is not None:
            yield sse({**head, "choices": [], "usage": usage([prompt_len], [last])})
    except APIError as e:
        yield sse({"error": {"message": e.message, "type": "invalid_request_error", "param": e.param,
                             "code": e.status}})
    yield sse("[DONE]")
