"""OpenAI request bodies (pydantic) and their mapping onto SamplingParams.

Unknown fields are rejected (extra="forbid"), and fields OpenAI defines but Resin does not implement are
rejected by name, so no parameter is ever silently ignored.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from resin.core.sampling_params import SamplingParams

# OpenAI parameters Resin does not implement: a request that sets them gets a 400 naming them. (The legacy
# `functions` / `function_call` are superseded by `tools` / `tool_choice`.)
UNSUPPORTED = ("functions", "function_call", "logit_bias", "suffix", "audio", "modalities", "prediction",
               "web_search_options", "reasoning_effort", "service_tier", "store", "metadata")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Strict):
    """vLLM's `structured_outputs` field: exactly one constraint."""
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None  # accepted for vLLM clients; compact JSON is Resin's default


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
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # accepted only to be refused by name (see UNSUPPORTED)
    functions: Any = None
    function_call: Any = None
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
        return [name for name in UNSUPPORTED if getattr(self, name, None) is not None]

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """Everything but the grammar, which the server compiles off the event loop first (see structured.py)."""
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


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: FunctionName


class FunctionCall(BaseModel):
    name: str
    arguments: str


class MessageToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message answers this call

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it. A call's arguments go in as an object when they are JSON:
        templates write them with `tojson`, which would quote a string a second time."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                                 for c in self.tool_calls]
        return out

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


def _json_or_text(text: str) -> Any:
    """JSON arguments as an object; anything else (not JSON, too deep, spelling lone surrogates) as written."""
    try:
        value = json.loads(text)
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        return value
    except (ValueError, RecursionError, UnicodeEncodeError):
        return text


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
