"""OpenAI request bodies (pydantic) and their mapping onto SamplingParams.

Unknown fields are rejected (extra="forbid"), and fields OpenAI defines but Resin does not implement are
rejected by name, so no parameter is ever silently ignored.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from resin.core.sampling_params import SamplingParams

# OpenAI parameters Resin does not implement: a request that sets them gets a 400 naming them.
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "response_format",
               "logit_bias", "suffix", "audio", "modalities", "prediction", "web_search_options",
               "reasoning_effort", "service_tier", "store", "metadata")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    # allow_inf_nan=False: JSON Infinity / NaN in a float field is a 400, not a value for the sampler (subclasses
    # inherit the config)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    user: str | None = None
    # extensions vLLM users know
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    # accepted only to be refused by name (see UNSUPPORTED)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None
    logit_bias: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    service_tier: Any = None
    store: Any = None
    metadata: Any = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        """JSON may spell a lone surrogate ("\\ud800"); Python keeps it, but no tokenizer or UTF-8 encoder takes it.
        Refused here, for every string in the body, with the place it was found. The C encoder checks the whole
        body at once (a million-id prompt in ~0.1 s); only a body that fails is walked to name the place."""
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
            return data
        except (UnicodeEncodeError, TypeError, ValueError):
            pass
        stack = [("body", data)]
        while stack:
            where, value = stack.pop()
            if isinstance(value, str):
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    raise ValueError(f"{where} contains a lone UTF-16 surrogate, which is not valid Unicode: "
                                     f"send UTF-8 text") from None
            elif isinstance(value, dict):
                for k, v in value.items():
                    k = str(k).encode("utf-8", "backslashreplace").decode()  # a bad key must not break the error
                    stack.append((f"{where}.{k}" if where != "body" else k, v))
            elif isinstance(value, list):
                stack.extend((f"{where}[{i}]", v) for i, v in enumerate(value))
        return data

    def unsupported_fields(self) -> list[str]:
        return [name for name in UNSUPPORTED if getattr(self, name, None) is not None
                and not (name == "tool_choice" and self.tool_choice == "none")]

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, repetition_penalty=self.repetition_penalty or 1.0,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, seed=self.seed,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens)


class CompletionRequest(_Common):
    prompt: list[int] | str | list[str] | list[list[int]]  # ids first: a long id list validates 10x faster
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: Any = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # OpenAI content parts: only text parts are supported
            parts = []
            for part in self.content:
                if part.get("type") != "text":
                    raise ValueError(f"message content part of type {part.get('type')!r} is not supported; "
                                     f"only text")
                if not isinstance(part.get("text"), str):
                    raise ValueError("a text content part needs a string 'text'")
                parts.append(part["text"])
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
