"""Tool calls in model output: one incremental parser per choice, fed text deltas, giving content and call deltas.

Formats (chosen by --tool-call-parser, by default from the chat template):
- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks between content (Hermes, Qwen 2.5/3);
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- llama3_json: the output itself is `{"name": ..., "parameters": {...}}` (several separated by `;`), maybe after
  `<|python_tag|>`; tool_choice "required" uses this format too (a JSON array of calls, forced by a grammar).

A call's name goes out as soon as it is complete, then its arguments as raw fragments of the JSON text as the model
writes them (a string-encoded arguments value is decoded once complete). A whole response is the same parser fed
all of the text at once, so a stream's deltas always reassemble to the non-streamed message. Text that only looks
like the start of a call (an unknown key, invalid JSON, no name) stays content.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

# A call's head: its name, then its arguments key. The call opens (its name goes out) once the head is complete.
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
# Tool names are at most 64 characters: a head not complete within this many is left to the object's end, so a long
# string in a name-first object is never rescanned on every delta.
_HEAD_WINDOW = 256
_ARG_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class ToolFormat:
    name: str
    start: str  # what opens the calls; "" means the output itself begins with the JSON
    end: str = ""  # what closes a block of calls, back to content ("" = none)
    skip_prefix: str = ""  # ignored before the JSON when start is ""


FORMATS = {
    "hermes": ToolFormat("hermes", "<tool_call>", "</tool_call>"),
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]"),
    "llama3_json": ToolFormat("llama3_json", "", skip_prefix="<|python_tag|>"),
}


def detect_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches its model, or None when it shows none Resin knows."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or ('"parameters"' in chat_template and "ipython" in chat_template):
        return "llama3_json"
    return None


def tool_call_format(tokenizer: Any, choice: str) -> str | None:
    """The format for tool_choice 'auto': the one named, or the chat template's ("auto"), or None ("none")."""
    if choice == "none":
        return None
    if choice != "auto":
        if choice not in FORMATS:
            raise ValueError(f"--tool-call-parser {choice!r} is unknown: use one of {', '.join(FORMATS)}, auto or none")
        return choice
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    return detect_format(template if isinstance(template, str) else None)


@dataclass
class CallDelta:
    index: int
    id: str | None = None  # with the name, on a call's first delta
    name: str | None = None
    arguments: str = ""

    def openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index, "function": fn}
        if self.id is not None:
            out.update(id=self.id, type="function")
            fn["name"] = self.name
        return out


@dataclass
class Parsed:
    """What one feed produced: content text and call deltas, in order of appearance."""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


def new_call_id(fmt: ToolFormat | None = None) -> str:
    """OpenAI-style ids; Mistral's templates accept only 9 alphanumeric characters (and refuse the next turn
    otherwise)."""
    if fmt is not None and fmt.name == "mistral":
        return uuid.uuid4().hex[:9]
    return f"call_{uuid.uuid4().hex[:24]}"


def _utf8(text: str) -> str:
    """Decoded model JSON may spell lone surrogates ("\\ud83d"), which no response can encode: kept escaped."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode()


def _may_start_call(text: str) -> bool | None:
    """For formats without a marker: does the output open with a call (`{"name"` or `[{"name"`)? None: not known
    yet."""
    t = text[1:].lstrip() if text.startswith("[") else text
    if not t:
        return None
    if t[0] != "{":
        return False
    rest = t[1:].lstrip()
    if '"name"'.startswith(rest):
        return None
    return rest.startswith('"name"')


@dataclass
class _Scan:
    """Where a JSON object at the start of a growing buffer ends, found incrementally (each character once)."""
    pos: int = 0
    depth: int = 0
    in_str: bool = False
    escaped: bool = False
    args_start: int | None = None  # where a raw (object or array) arguments value begins
    args_end: int | None = None

    def run(self, text: str, end_marker: str = "") -> int | None:
        """The object's end (exclusive) once text holds all of it, else None. An end marker outside a string
        (JSON never has one there) ends an object the model left unclosed."""
        while self.pos < len(text):
            ch = text[self.pos]
            if end_marker and not self.in_str and ch == end_marker[0]:
                rest = text[self.pos:self.pos + len(end_marker)]
                if rest == end_marker:
                    return self.pos
                if end_marker.startswith(rest):
                    return None  # may be the marker: wait for more text
            self.pos += 1
            if self.in_str:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_str = False
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 1 and self.args_start is not None and self.args_end is None \
                        and self.pos > self.args_start:
                    self.args_end = self.pos
                if self.depth == 0:
                    return self.pos
        return None


class ToolCallParser:
    """Incremental: feed(delta) -> Parsed, then finish() -> Parsed for what the end of output settles."""

    def __init__(self, fmt: ToolFormat, parallel: bool = True):
        self.fmt = fmt
        self.parallel = parallel
        self.buf = ""  # text not yet settled
        self.mode = "start" if fmt.start == "" else "content"
        self.index = -1  # of the current call
        self.call_open = False  # the current call's name went out
        self.args_sent = 0  # characters of the current call's raw arguments sent
        self.scan = _Scan()
        self.head_given_up = False  # the current object's head did not complete early: its end decides
        self.strip_next = False  # whitespace right after a block of calls is layout, not content
        self.last_was_call = False

    # ---- driving ------------------------------------------------------------------------------------------
    def feed(self, text: str) -> Parsed:
        self.buf += text
        out = Parsed()
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> Parsed:
        out = Parsed()
        while self._step(out, final=True):
            pass
        if self.mode == "object" and not self.call_open:
            out.content += self.buf  # an unfinished object that never named a call: it was text after all
        elif self.mode != "object":
            out.content += self.buf
        self.buf = ""
        return out

    def _step(self, out: Parsed, final: bool) -> bool:
        """Settle what the buffer allows; True if anything changed (call again)."""
        if self.mode == "content":
            return self._content(out, final)
        if self.mode == "start":
            return self._start(out, final)
        if self.mode == "calls":
            return self._between_calls(out, final)
        return self._object(out, final)

    def _content(self, out: Parsed, final: bool) -> bool:
        if self.strip_next:
            self.buf = self.buf.lstrip()
            if not self.buf and not final:
                return False
            self.strip_next = False
        marker = self.fmt.start
        if not marker:  # formats without a marker find calls only at the start of the output
            out.content += self.buf
            self.buf = ""
            return False
        at = self.buf.find(marker)
        if at >= 0:
            out.content += self.buf[:at]
            self.buf = self.buf[at + len(marker):]
            self.mode = "calls"
            return True
        keep = 0 if final else _partial_suffix(self.buf, marker)  # hold back what may be a marker's start
        out.content += self.buf[:len(self.buf) - keep]
        self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _start(self, out: Parsed, final: bool) -> bool:
        text = self.buf.lstrip()
        if self.fmt.skip_prefix and text.startswith(self.fmt.skip_prefix):
            text = text[len(self.fmt.skip_prefix):].lstrip()
        elif self.fmt.skip_prefix.startswith(text) and text and not final:
            return False
        starts = _may_start_call(text)
        if starts is None and not final:
            return False
        if starts:
            self.buf = text
            self.mode = "calls"
            return True
        return self._to_content()

    def _to_content(self) -> bool:
        self.mode = "content"
        return True

    def _between_calls(self, out: Parsed, final: bool) -> bool:
        text = self.buf.lstrip(" \t\r\n,;[")
        self.buf = text
        if not text:
            return False
        if text[0] == "{":
            self.mode = "object"
            self.scan = _Scan()
            self.head_given_up = False
            return True
        end = self.fmt.end
        if end and text.startswith(end):
            self.buf = text[len(end):]
            self.mode = "content"
            self.strip_next = self.last_was_call
            return True
        if end and end.startswith(text) and not final:
            return False
        if text[0] == "]":
            self.buf = text[1:]
            self.strip_next = self.last_was_call
        self.mode = "content"  # anything else ends the calls (and is content, for formats with a marker)
        return True

    def _object(self, out: Parsed, final: bool) -> bool:
        """A call's JSON object at the start of buf: name first, then raw argument fragments, then its end."""
        scan = self.scan
        if not self.call_open and not self.head_given_up:
            m = _HEAD.match(self.buf)
            if m is None:
                self.head_given_up = len(self.buf) > _HEAD_WINDOW
            elif m.end() < len(self.buf):  # the value's first character is there
                name = _decoded_string(m.group(1))
                if name is None:
                    self.head_given_up = True
                else:
                    self._open(out, name)
                    if self.buf[m.end()] in "{[":
                        scan.args_start = m.end()  # a string value (JSON-encoded arguments) is settled at the end
        end = scan.run(self.buf, self.fmt.end)
        if scan.args_start is not None:
            upto = scan.args_end if scan.args_end is not None else scan.pos
            fragment = self.buf[scan.args_start + self.args_sent:upto]
            if fragment:
                self.args_sent += len(fragment)
                self._arguments(out, fragment)
        if end is None:
            return False
        self._close(out, self.buf[:end])
        self.buf = self.buf[end:]
        self.mode = "calls"
        return True

    def _open(self, out: Parsed, name: str) -> None:
        self.index += 1
        self.call_open = True
        self.args_sent = 0
        if self._emitting:
            out.calls.append(CallDelta(self.index, new_call_id(self.fmt), name))

    @property
    def made_calls(self) -> bool:
        return self.index >= 0

    @property
    def _emitting(self) -> bool:
        return self.parallel or self.index == 0

    def _arguments(self, out: Parsed, fragment: str) -> None:
        if not self._emitting:
            return
        if out.calls and out.calls[-1].index == self.index:
            out.calls[-1].arguments += fragment
        else:
            out.calls.append(CallDelta(self.index, arguments=fragment))

    def _close(self, out: Parsed, obj: str) -> None:
        try:
            call = json.loads(obj)
        except (ValueError, RecursionError):
            call = None
        args_key = next((k for k in _ARG_KEYS if isinstance(call, dict) and k in call), None)
        # Without a marker, only an object with arguments is a call: `{"name": "Ann", "age": 3}` is an answer.
        valid = isinstance(call, dict) and isinstance(call.get("name"), str) and (self.fmt.start or args_key)
        if not self.call_open:
            if not valid:  # never a call: the text goes back out as content
                out.content += obj
                self.last_was_call = False
                return
            self._open(out, _utf8(call["name"]))
        if self.scan.args_start is None and valid:
            value = call.get(args_key, {}) if args_key else {}
            try:
                text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            except RecursionError:
                text = obj  # too deep to re-encode: what the model wrote
            self._arguments(out, _utf8(text))
        self.call_open = False
        self.last_was_call = True


def _decoded_string(body: str) -> str | None:
    """A JSON string literal's content (without its quotes), or None if it is not valid or not encodable."""
    try:
        text = json.loads(f'"{body}"')
        text.encode("utf-8")
        return text
    except (ValueError, UnicodeEncodeError):
        return None


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ToolCallResult:
    """A whole response's content and calls (OpenAI's message shape)."""
    content: str
    calls: list[dict[str, Any]]


def assemble(parts: list[Parsed]) -> ToolCallResult:
    """Join deltas into content and complete calls (what a client does with a stream)."""
    content, calls = "", {}
    for p in parts:
        content += p.content
        for d in p.calls:
            if d.id is not None:
                calls[d.index] = {"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
            calls[d.index]["function"]["arguments"] += d.arguments
    return ToolCallResult(content, [calls[i] for i in sorted(calls)])


def parse_all(fmt: ToolFormat, text: str, parallel: bool = True) -> ToolCallResult:
    parser = ToolCallParser(fmt, parallel)
    return assemble([parser.feed(text), parser.finish()])
