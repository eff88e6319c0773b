"""Structured outputs and tool calls through the real server and the official openai client.

The built-in model proves the grammar holds at temperature 1.0 (50 sampled requests per constraint, each must
validate); a tiny random model with a Hermes-style chat template proves tool calls: forced ("required", a named
function), parsed ("auto", with a grammar making the random model write calls), streamed and not, and the round
trip through assistant tool_calls and tool messages in the template.
"""
from __future__ import annotations

import asyncio
import copy
import json
import re
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel, Field

from conftest import save_tiny
from server_utils import ServerProcess

pytestmark = pytest.mark.e2e

BUILTIN = "SmolLM2-135M-Instruct"
HERMES_TEMPLATE = (
    "{%- if tools %}<|system|>Call tools as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>. Tools:"
    "{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}<|end|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>{{ m.content or '' }}"
    "{%- for c in m.tool_calls %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{%- endfor %}<|end|>"
    "{%- elif m.role == 'tool' %}<|tool|><tool_response>{{ m.content }}</tool_response><|end|>"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}<|end|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|assistant|>{%- endif %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


class City(BaseModel):
    name: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=100)
    continent: Literal["Europe", "Asia", "Africa", "America", "Oceania"]
    capital: bool


@pytest.fixture(scope="module")
def builtin_server():
    srv = ServerProcess("--kv-cache-memory", "256MiB").wait_ready()
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def hermes_model(tmp_path_factory, bpe_tokenizer):
    tok = copy.deepcopy(bpe_tokenizer)
    tok.chat_template = HERMES_TEMPLATE
    folder = tmp_path_factory.mktemp("hermes-llama")
    save_tiny(folder, "LlamaForCausalLM", tokenizer=tok, vocab_size=len(tok), max_position_embeddings=4096,
              eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    return folder, tok


@pytest.fixture(scope="module")
def tool_server(hermes_model):
    srv = ServerProcess(str(hermes_model[0]), "--served-model-name", "tiny", "--kv-cache-memory", "64MiB",
                        "--dtype", "float32").wait_ready()
    assert "tool calls (tool_choice 'auto'): hermes format" in srv.logs()
    yield srv
    assert srv.stop() == 0


async def _many(make, count: int = 50) -> list:
    return await asyncio.gather(*[make(i) for i in range(count)])


def test_parse_with_a_pydantic_model_validates_every_sample(builtin_server):
    client = builtin_server.async_client()

    async def one(i):
        r = await client.beta.chat.completions.parse(
            model=BUILTIN, messages=[{"role": "user", "content": f"Describe city number {i} as JSON."}],
            response_format=City, temperature=1.0, max_tokens=120)
        return r.choices[0]

    choices = asyncio.run(_many(one))
    assert all(c.finish_reason == "stop" and isinstance(c.message.parsed, City) for c in choices)
    assert len({c.message.content for c in choices}) > 10  # sampled, not one answer repeated


def test_regex_and_choice_hold_for_every_sample(builtin_server):
    client = builtin_server.async_client()
    regex = r"(19|20)\d{2}-(0[1-9]|1[0-2])-[0-3]\d"
    options = ["yes", "no", "it depends"]

    async def dated(i):
        r = await client.chat.completions.create(
            model=BUILTIN, messages=[{"role": "user", "content": "A date, please."}], temperature=1.0,
            max_tokens=30, extra_body={"structured_outputs": {"regex": regex}})
        return r.choices[0].message.content

    async def chosen(i):
        r = await client.completions.create(model=BUILTIN, prompt="Is the sky green? Answer:", temperature=1.0,
                                            max_tokens=10, extra_body={"guided_choice": options})
        return r.choices[0].text

    async def both():
        return await asyncio.gather(_many(dated), _many(chosen))

    dates, picks = asyncio.run(both())
    assert all(re.fullmatch(regex, d) for d in dates), dates
    assert set(picks) <= set(options) and len(set(picks)) > 1


def test_json_object_and_streamed_schema(builtin_server):
    client = builtin_server.client()
    r = client.chat.completions.create(model=BUILTIN, messages=[{"role": "user", "content": "JSON please"}],
                                       response_format={"type": "json_object"}, temperature=0, max_tokens=200)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")
    stream = client.chat.completions.create(
        model=BUILTIN, messages=[{"role": "user", "content": "A city"}], temperature=0, max_tokens=120, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": City.model_json_schema()}})
    City.model_validate_json("".join(c.choices[0].delta.content or "" for c in stream if c.choices))


@pytest.mark.parametrize("body,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     'the JSON schema cannot be compiled: Unsupported type "foo"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs json_schema.schema"),
    ({"guided_regex": "(("}, "the regex cannot be compiled"),
    ({"guided_grammar": "root ::= missing"}, 'Rule "missing" is not defined'),
    ({"guided_json": '{"type": '}, "not valid JSON"),
    ({"guided_choice": []}, "choice must be a non-empty list"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "give only one"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
    ({"tools": [WEATHER]}, "--tool-call-parser"),  # the built-in model's template shows no tool-call format
])
def test_bad_constraints_are_400_naming_the_problem(builtin_server, body, message):
    r = httpx.post(builtin_server.url + "/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    assert httpx.get(builtin_server.url + "/health").status_code == 200


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _streamed(chunks) -> tuple[str, list[tuple[str, dict]], str]:
    content, calls, reason = "", {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        delta = ch.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.id is not None:
                assert d.function.name and d.index not in calls  # id and name come once, first
                calls[d.index] = [d.function.name, ""]
            calls[d.index][1] += d.function.arguments or ""
        reason = ch.choices[0].finish_reason or reason
    return content, [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))], reason


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_are_valid_streamed_and_not(tool_server, choice):
    client = tool_server.client()
    kw = dict(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, temperature=0,
              max_tokens=200, parallel_tool_calls=False)
    r = client.chat.completions.create(**kw)
    calls = _calls(r.choices[0].message)
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    name, args = calls[0]
    if isinstance(choice, dict):
        assert name == "get_time" and args["zone"] in ("UTC", "CET")
    else:
        assert name in ("get_weather", "get_time")
    assert all(c.id.startswith("call_") for c in r.choices[0].message.tool_calls)
    content, streamed, reason = _streamed(client.chat.completions.create(stream=True, **kw))
    assert streamed == calls and reason == "tool_calls" and content == ""
    sampled = client.chat.completions.create(**{**kw, "temperature": 1.0, "n": 8, "parallel_tool_calls": True})
    for c in sampled.choices:  # every sample a valid call, however many
        for name, args in _calls(c.message):
            assert (name, set(args)) in (("get_weather", {"city", "days"}), ("get_time", {"zone"}))


def test_auto_tool_calls_are_parsed_streamed_and_not(tool_server):
    """A grammar makes the random model write Hermes calls (two, with content around them); the auto parser
    finds them in the real token stream."""
    client = tool_server.client()
    written = ('Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}</tool_call>'
               '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')
    kw = dict(model="tiny", messages=ASK, tools=[WEATHER, TIME], temperature=1.0, max_tokens=300,
              extra_body={"structured_outputs": {"regex": re.escape(written)}})
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.content == "Checking. " and r.choices[0].finish_reason == "tool_calls"
    want = [("get_weather", {"city": "Oslo", "days": 3}), ("get_time", {"zone": "UTC"})]
    assert _calls(r.choices[0].message) == want
    assert _streamed(client.chat.completions.create(stream=True, **kw)) == ("Checking. ", want, "tool_calls")
    one = client.chat.completions.create(parallel_tool_calls=False, **kw)
    assert _calls(one.choices[0].message) == want[:1]
    none = client.chat.completions.create(tool_choice="none", **kw)  # no parsing: the text is content
    assert none.choices[0].message.content == written and not none.choices[0].message.tool_calls


@pytest.mark.parametrize("stream", [False, True])
def test_tool_round_trip_renders_calls_and_results(tool_server, hermes_model, stream):
    client = tool_server.client()
    kw = dict(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=200)
    if stream:
        content, calls, _ = _streamed(client.chat.completions.create(stream=True, **kw))
        call_id = "call_streamed1"
        assistant = {"role": "assistant", "content": content, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": calls[0][0], "arguments": json.dumps(calls[0][1])}}]}
    else:
        first = client.chat.completions.create(**kw)
        assistant = first.choices[0].message.model_dump(exclude_none=True)
        call_id = first.choices[0].message.tool_calls[0].id
    call = assistant["tool_calls"][0]
    messages = [*ASK, assistant, {"role": "tool", "tool_call_id": call_id, "content": '{"temp_c": 21}'}]
    answer_kw = dict(model="tiny", messages=messages, tools=[WEATHER], temperature=0, max_tokens=8)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                     **answer_kw))
        text, prompt_tokens = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), \
            chunks[-1].usage.prompt_tokens
    else:
        answer = client.chat.completions.create(**answer_kw)
        assert not answer.choices[0].message.tool_calls
        text, prompt_tokens = answer.choices[0].message.content, answer.usage.prompt_tokens
    assert text
    # the server rendered the call's arguments as an object and the tool result, exactly as the template says
    tok = hermes_model[1]
    rendered = [*ASK, {"role": "assistant", "content": assistant.get("content") or "", "tool_calls": [
        {"id": call_id, "type": "function",
         "function": {"name": call["function"]["name"], "arguments": json.loads(call["function"]["arguments"])}}]},
        {"role": "tool", "tool_call_id": call_id, "content": '{"temp_c": 21}'}]
    text = tok.apply_chat_template(rendered, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert '<tool_response>{"temp_c": 21}</tool_response>' in text and '"arguments": {"city": ' in text
    assert prompt_tokens == len(tok(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("arguments", ["[" * 3000, '{"x": "\\ud800"}', "not json"])
def test_odd_arguments_in_earlier_calls_are_rendered_as_written(tool_server, arguments):
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    r = httpx.post(tool_server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": messages, "tools": [WEATHER], "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body,message", [
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not in tools (get_weather)"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "drop response_format"),
    ({"tools": [WEATHER, WEATHER]}, "distinct function names"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"functions": [{"name": "f"}]}, "not supported"),
    ({"tools": [{"type": "function", "function": {"name": "big", "parameters": {
        "type": "object", "description": "x" * 300_000}}}], "tool_choice": "required"}, "tools: structured outputs"),
    ({"guided_json": "[" * 100_000}, "nested too deeply"),
])
def test_bad_tool_requests_are_400(tool_server, body, message):
    r = httpx.post(tool_server.url + "/v1/chat/completions", timeout=30,
                   json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
