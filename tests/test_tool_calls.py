"""The tool-call parser: whatever the chunking of a stream, its deltas reassemble to the whole-text parse."""
from __future__ import annotations

import json
import random

import pytest

from resin.server.tool_calls import FORMATS, ToolCallParser, assemble, detect_format, parse_all, tool_call_format

pytestmark = pytest.mark.unit

CASES = [
    ("hermes", 'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "days": [1, '
               '{"x": 2}]}}\n</tool_call>\n<tool_call>{"name": "b", "arguments": "{\\"q\\": 1}"}</tool_call> Done.',
     "Let me look. Done.", [("get_weather", {"city": 'Pa"ris}', "days": [1, {"x": 2}]}), ("b", {"q": 1})]),
    ("hermes", "No tools here, only < and <tool and text.", "No tools here, only < and <tool and text.", []),
    ("hermes", 'a <tool_call>{"nam": 1}</tool_call> b', 'a {"nam": 1} b', []),  # not a call: content
    ("hermes", '<tool_call>{"arguments": {"k": "v"}, "name": "late"}</tool_call>', "", [("late", {"k": "v"})]),
    ("mistral", 'Sure [TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]',
     "Sure ", [("f", {"a": 1}), ("g", {})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": [1, 2]}}; {"name": "g", "parameters": {}}', "",
     [("f", {"a": [1, 2]}), ("g", {})]),
    ("llama3_json", '[{"name": "f", "parameters": {"a": "]}"}}]', "", [("f", {"a": "]}"})]),
    ("llama3_json", 'Hello {"name": "f"}', 'Hello {"name": "f"}', []),
    # answers that only look like calls stay content, whole
    ("llama3_json", '[1, 2, 3]', '[1, 2, 3]', []),
    ("llama3_json", '[{"a": 1}, {"b": 2}]', '[{"a": 1}, {"b": 2}]', []),
    ("llama3_json", '[] and [1] Smith', '[] and [1] Smith', []),
    ("llama3_json", '{"name": "Ann", "age": 3}', '{"name": "Ann", "age": 3}', []),
    # a call the model left unclosed ends at the block's end marker; what follows is still parsed
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>\nSure, done. <tool_call>{"name": "g", '
               '"arguments": {}}</tool_call>', "Sure, done. ", [("f", {"x": 1}), ("g", {})]),
    # names and arguments that are not valid or not encodable never break the response
    ("hermes", '<tool_call>{"name": "a\\qb", "arguments": {}}</tool_call>', '{"name": "a\\qb", "arguments": {}}', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": "\\ud83d"}</tool_call>', "", [("f", None)]),
]


def calls_of(result) -> list[tuple[str, object]]:
    """(name, arguments) per call; arguments None where they are not JSON (a model's broken call)."""
    out = []
    for c in result.calls:
        c["function"]["arguments"].encode("utf-8")  # every part of a response must encode
        try:
            args = json.loads(c["function"]["arguments"])
        except ValueError:
            args = None
        out.append((c["function"]["name"], args))
    return out


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_whole_text_parse(fmt, text, content, calls):
    result = parse_all(FORMATS[fmt], text)
    assert result.content == content
    assert calls_of(result) == calls
    assert all(c["type"] == "function" and (c["id"].startswith("call_") or fmt == "mistral") for c in result.calls)


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_any_chunking_reassembles_to_the_whole_text_parse(fmt, text, content, calls):
    rng = random.Random(fmt + text)
    whole = parse_all(FORMATS[fmt], text)
    cuts = [[i] for i in range(1, len(text))] + [sorted(rng.sample(range(1, len(text)), 5)) for _ in range(30)]
    for cut in cuts:
        parser = ToolCallParser(FORMATS[fmt])
        bounds = [0, *cut, len(text)]
        parts = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [parser.finish()]
        got = assemble(parts)
        assert got.content == whole.content, cut
        assert [c["function"] for c in got.calls] == [c["function"] for c in whole.calls], cut
        # the name goes out once, on the call's first delta, before any of its arguments
        firsts = [d for p in parts for d in p.calls if d.id is not None]
        assert [d.name for d in firsts] == [c["function"]["name"] for c in whole.calls]


def test_arguments_stream_as_they_are_written():
    parser = ToolCallParser(FORMATS["hermes"])
    assert parser.feed('<tool_call>{"name": "f", ').calls == []  # the name goes out with its arguments key
    first = parser.feed('"arguments": {"city": "Par').calls[0]
    assert first.name == "f" and first.arguments == '{"city": "Par'
    assert parser.feed('is"}}</tool_call>').calls[0].arguments == 'is"}'
    assert parser.made_calls


def test_parallel_false_keeps_the_first_call():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert [c["function"]["name"] for c in parse_all(FORMATS["hermes"], text, parallel=False).calls] == ["a"]


def test_an_unfinished_call_keeps_what_was_streamed():
    result = parse_all(FORMATS["hermes"], 'x <tool_call>{"name": "f", "arguments": {"q": "unterminated')
    assert result.content == "x " and result.calls[0]["function"]["arguments"] == '{"q": "unterminated'


def test_format_detection_and_choice():
    assert detect_format("...<tool_call>...") == "hermes"
    assert detect_format("[TOOL_CALLS]") == "mistral"
    assert detect_format("{{ '<|python_tag|>' }}") == "llama3_json"
    assert detect_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert tool_call_format(None, "hermes") == "hermes" and tool_call_format(None, "none") is None
    with pytest.raises(ValueError, match="unknown"):
        tool_call_format(None, "bogus")


@pytest.mark.timeout(20)
def test_long_and_deep_outputs_stay_linear_and_never_raise():
    """A long name-first answer fed a few characters at a time is never rescanned whole on each delta (40 KB took
    12 s that way), and arguments nested past Python's recursion limit still give a call."""
    long_name = '{"name": "' + "x" * 40_000 + '", "parameters": {}}'
    parser = ToolCallParser(FORMATS["llama3_json"])
    parts = [parser.feed(long_name[i:i + 4]) for i in range(0, len(long_name), 4)] + [parser.finish()]
    assert assemble(parts).calls[0]["function"]["name"] == "x" * 40_000
    deep = '<tool_call>{"name": "f", "arguments": ' + "[" * 5000 + "]" * 5000 + "}</tool_call>"
    assert parse_all(FORMATS["hermes"], deep).calls[0]["function"]["arguments"] == "[" * 5000 + "]" * 5000
    deep_late = '<tool_call>{"arguments": ' + "[" * 5000 + "]" * 5000 + ', "name": "f"}</tool_call>'
    assert parse_all(FORMATS["hermes"], deep_late).content == deep_late[len("<tool_call>"):-len("</tool_call>")]


def test_mistral_call_ids_are_what_its_templates_accept():
    result = parse_all(FORMATS["mistral"], '[TOOL_CALLS][{"name": "f", "arguments": {}}]')
    assert len(result.calls[0]["id"]) == 9 and result.calls[0]["id"].isalnum()
