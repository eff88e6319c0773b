"""Logprobs in the two OpenAI shapes: the legacy completions one and the chat one."""
from __future__ import annotations

import math
from typing import Any

from resin.core.outputs import PositionLogprobs


def _finite(logprob: float) -> float:
    """JSON has no -inf or NaN (Starlette refuses to encode them): an impossible token reports -9999.0, as vLLM's
    server does."""
    return logprob if math.isfinite(logprob) else -9999.0


def _top(pos: PositionLogprobs, n: int) -> list[tuple[int, Any]]:
    return sorted(pos.items(), key=lambda kv: kv[1].rank)[:n]


def completion_logprobs(token_ids: list[int], positions: list[PositionLogprobs | None], top_n: int,
                        text_offset: int) -> dict[str, Any]:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"} for the given tokens (a None position, as the
    first prompt token has, gives a None logprob)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset
    for tok, pos in zip(token_ids, positions):
        if pos is None:
            text, lp, top = "", None, None
        else:
            entry = pos[tok]
            text, lp = entry.decoded_token or "", _finite(entry.logprob)
            top = {(e.decoded_token or ""): _finite(e.logprob) for _, e in _top(pos, top_n)}
        tokens.append(text)
        token_lps.append(lp)
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], top_n: int) -> dict[str, Any]:
    content = []
    for tok, pos in zip(token_ids, positions):
        entry = pos[tok]
        text = entry.decoded_token or ""
        content.append({
            "token": text, "logprob": _finite(entry.logprob), "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": e.decoded_token or "", "logprob": _finite(e.logprob),
                              "bytes": list((e.decoded_token or "").encode("utf-8"))} for _, e in _top(pos, top_n)],
        })
    return {"content": content}
