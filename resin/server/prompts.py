"""Turning request prompts into token ids: cheap bounds first, then tokenising and templating off the event loop.

A request is checked against what costs nothing (characters, list lengths, id ranges) before anything that
costs time, so an oversized prompt is refused in microseconds instead of after seconds of tokenising; the work
that remains runs in a worker thread (the tokenizer releases the GIL), so other streams and /health never wait.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from resin.server.errors import APIError

# Normalisation (NFKC and the like) can fold a few characters into one before tokenising; a character bound this
# many times looser than the tokenizer's longest token still refuses huge prompts at once and never a valid one.
_NORMALISATION_SLACK = 2


def longest_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters one token decodes to: the longest vocabulary entry as stored (byte-level
    entries spell one byte per character, so they are never shorter than the text they decode to)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


@dataclass
class PromptChecker:
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    max_sequences: int  # the most sequences the server queues (--max-waiting)
    max_chars: int  # longer text cannot fit max_model_len tokens

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, max_model_len: int, vocab_size: int,
                      max_sequences: int) -> "PromptChecker":
        per_token = longest_token_chars(tokenizer) if tokenizer is not None else 1
        return cls(tokenizer, max_model_len, vocab_size, max_sequences,
                   max_model_len * per_token * _NORMALISATION_SLACK)

    def check_sequences(self, prompts: int, n: int) -> None:
        if prompts * n > self.max_sequences:
            raise APIError(400, f"{prompts} prompt(s) x n={n} is more sequences than this server queues "
                                f"({self.max_sequences}); send fewer at a time", "n")

    def check_text(self, text: str, param: str) -> None:
        if len(text) > self.max_chars:
            raise APIError(400, f"{param} is {len(text)} characters: more than this model's maximum context of "
                                f"{self.max_model_len} tokens can hold. Shorten it.", param)

    def check_ids(self, ids: list[int], param: str = "prompt") -> None:
        if not ids:
            raise APIError(400, f"{param} is empty: give at least one token", param)
        if len(ids) >= self.max_model_len:
            raise APIError(400, f"{param} has {len(ids)} tokens but this model's maximum context length is "
                                f"{self.max_model_len} tokens. Shorten it.", param)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"{param} token id(s) {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
                           param)

    def _tokenizer(self, param: str) -> Any:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param)
        return self.tokenizer

    async def completion_prompts(self, prompt: str | list, echo: bool, n: int) -> list[tuple[str | None, list[int]]]:
        """(text, ids) per prompt of a /v1/completions request. Token-id prompts are decoded only for echo."""
        prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
        if not prompts:
            raise APIError(400, "prompt is empty", "prompt")
        self.check_sequences(len(prompts), n)
        for p in prompts:
            if isinstance(p, str):
                self.check_text(p, "prompt")
                self._tokenizer("prompt")
            else:
                self.check_ids(p)
        return await asyncio.to_thread(self._encode_all, prompts, echo)

    def _encode_all(self, prompts: list, echo: bool) -> list[tuple[str | None, list[int]]]:
        out = []
        for p in prompts:
            if isinstance(p, str):
                ids = self.tokenizer(p)["input_ids"]
                self.check_ids(ids)
                out.append((p, ids))
            else:
                text = self.tokenizer.decode(p) if echo and self.tokenizer is not None else None
                out.append((text, list(p)))
        return out

    async def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                          tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
        tok = self._tokenizer("messages")
        if not getattr(tok, "chat_template", None):
            raise APIError(400, "this model has no chat template: use /v1/completions", "messages")
        if not messages:
            raise APIError(400, "messages is empty", "messages")
        if len(messages) >= self.max_model_len:  # a template spends at least a token on each message
            raise APIError(400, f"{len(messages)} messages cannot fit this model's maximum context length of "
                                f"{self.max_model_len} tokens", "messages")
        text = [m["content"] for m in messages] + [str(c["function"]) for m in messages for c in m.get("tool_calls", ())]
        self.check_text("".join(text) + (json.dumps(tools) if tools else ""), "messages")
        return await asyncio.to_thread(self._render, messages, add_generation_prompt, tools)

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None) -> tuple[str, list[int]]:
        try:
            prompt = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                        add_generation_prompt=add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - a template that rejects this conversation (e.g. role order)
            raise APIError(400, f"the chat template rejected these messages: {e}", "messages") from None
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        self.check_ids(ids, "messages")
        return prompt, ids
