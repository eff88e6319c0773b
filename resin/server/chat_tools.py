"""Tools in a chat request: what the template sees, which grammar forces a call, and how output becomes calls.

- "none": no tools in the prompt, plain content.
- "auto": the tools go to the chat template; the model decides; the output is parsed in the template's format.
- "required": a grammar forces a JSON array of one or more calls, each `{"name": <a tool>, "parameters": <its
  schema>}` (one call when parallel_tool_calls is false), so every call is valid JSON for its tool.
- a named function: a grammar forces that function's arguments; the whole output is the call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from resin.core.structured_output import GrammarError, StructuredOutputsParams
from resin.server.errors import APIError
from resin.server.protocol import ChatCompletionRequest, NamedToolChoice
from resin.server.tool_calls import FORMATS, CallDelta, Parsed, ToolCallParser, ToolFormat, new_call_id

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


class NamedCallParser:
    """The whole output is the arguments of one known function."""

    def __init__(self, name: str):
        self.name = name
        self.made_calls = False

    def feed(self, text: str) -> Parsed:
        if not text:
            return Parsed()
        first = not self.made_calls
        self.made_calls = True
        return Parsed(calls=[CallDelta(0, new_call_id() if first else None, self.name if first else None, text)])

    def finish(self) -> Parsed:
        """An output with no text at all is still the call (with empty arguments), as a named choice promised."""
        if self.made_calls:
            return Parsed()
        self.made_calls = True
        return Parsed(calls=[CallDelta(0, new_call_id(), self.name, "")])


@dataclass
class ToolPlan:
    choice: str  # "none" | "auto" | "required" | "named"
    template_tools: list[dict[str, Any]] | None
    fmt: ToolFormat | None = None
    function: str | None = None
    parallel: bool = True
    constraint: StructuredOutputsParams | None = None

    @classmethod
    def of(cls, req: ChatCompletionRequest, parser_format: str | None) -> "ToolPlan":
        try:
            return cls._of(req, parser_format)
        except GrammarError as e:  # a tool's schema too large or malformed for a grammar
            raise APIError(400, f"tools: {e}", "tools") from None

    @classmethod
    def _of(cls, req: ChatCompletionRequest, parser_format: str | None) -> "ToolPlan":
        tools = req.tools or []
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
        if choice == "none":
            return cls("none", None)
        if not tools:
            raise APIError(400, "tool_choice needs tools: give the functions the model may call", "tool_choice")
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise APIError(400, "tools must have distinct function names", "tools")
        template_tools = [t.model_dump(exclude_none=True, by_alias=True) for t in tools]
        if isinstance(choice, NamedToolChoice):
            tool = next((t for t in tools if t.function.name == choice.function.name), None)
            if tool is None:
                raise APIError(400, f"tool_choice names function {choice.function.name!r}, which is not in tools "
                                    f"({', '.join(names)})", "tool_choice")
            return cls("named", template_tools, function=tool.function.name,
                       constraint=StructuredOutputsParams(json=tool.function.parameters or _ANY_OBJECT))
        if choice == "required":
            calls = {"anyOf": [{"type": "object", "properties": {
                "name": {"const": t.function.name}, "parameters": t.function.parameters or _ANY_OBJECT},
                "required": ["name", "parameters"]} for t in tools]}
            schema = {"type": "array", "items": calls, "minItems": 1}
            if not req.parallel_tool_calls:
                schema["maxItems"] = 1
            return cls("required", template_tools, FORMATS["llama3_json"], parallel=req.parallel_tool_calls,
                       constraint=StructuredOutputsParams(json=schema))
        if parser_format is None:
            raise APIError(400, "tool_choice 'auto' needs to know how this model writes tool calls, and its chat "
                                "template shows no format Resin knows: start the server with --tool-call-parser "
                                f"({', '.join(FORMATS)}), or use tool_choice 'required' or a named function",
                           "tool_choice")
        return cls("auto", template_tools, FORMATS[parser_format], parallel=req.parallel_tool_calls)

    def parser(self) -> ToolCallParser | NamedCallParser | None:
        if self.choice == "none":
            return None
        if self.choice == "named":
            return NamedCallParser(self.function)
        return ToolCallParser(self.fmt, self.parallel)


def finish_reason(parser: ToolCallParser | NamedCallParser | None, reason: str | None) -> str | None:
    """OpenAI's "tool_calls" for an output that ended on its own after calling tools."""
    return "tool_calls" if parser is not None and parser.made_calls and reason == "stop" else reason


def delta_of(parsed: Parsed) -> list[dict[str, Any]]:
    """The chat deltas for what a parser gave: content first, then call fragments."""
    out = []
    if parsed.content:
        out.append({"content": parsed.content})
    if parsed.calls:
        out.append({"tool_calls": [d.openai() for d in parsed.calls]})
    return out
