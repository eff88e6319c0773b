"""The OpenAI-compatible server, as a real process on 127.0.0.1, driven by the official `openai` client."""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import openai
import pytest

from resin import LLM, SamplingParams
from server_utils import ServerProcess

pytestmark = pytest.mark.e2e

NAME = "tiny"


@pytest.fixture(scope="module")
def server(text_model):
    folder, _ = text_model
    srv = ServerProcess(str(folder), "--served-model-name", NAME, "--kv-cache-memory", "64MiB",
                        "--dtype", "float32").wait_ready()
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def offline(text_model):
    return LLM(str(text_model[0]), dtype="float32", kv_cache_memory="64MiB")


def test_completion_and_stream(server, offline):
    client = server.client()
    resp = client.completions.create(model=NAME, prompt="Hello world", max_tokens=8, temperature=0)
    want = offline.generate("Hello world", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    choice = resp.choices[0]
    assert choice.text == want.outputs[0].text and choice.finish_reason == want.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids)
    assert resp.usage.completion_tokens == len(want.outputs[0].token_ids)
    chunks = list(client.completions.create(model=NAME, prompt="Hello world", max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens


def test_chat_and_stream(server, offline):
    client = server.client()
    messages = [{"role": "user", "content": "Grüße aus München"}]
    resp = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
    assert resp.choices[0].message.role == "assistant" and resp.choices[0].message.content == want.text
    stream = client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=10,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


def test_sampling_options_logprobs_n_echo(server):
    client = server.client()
    options = dict(model=NAME, prompt="The quick", max_tokens=5, temperature=0.8, seed=7, n=2, top_p=0.9,
                   stop=["zzz"], presence_penalty=0.5, frequency_penalty=0.2, user="tester",
                   extra_body={"top_k": 20, "min_p": 0.01})
    resp = client.completions.create(logprobs=2, echo=True, **options)
    assert sorted(c.index for c in resp.choices) == [0, 1]
    for c in resp.choices:
        assert c.text.startswith("The quick")
        lp = c.logprobs
        assert lp.token_logprobs[0] is None  # the first prompt token has no logprob
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    again = client.completions.create(**options)  # same seed, no echo/logprobs: the same samples
    assert [c.text for c in again.choices] == [c.text[len("The quick"):] for c in resp.choices]
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in content)


def test_stream_n2_finishes_each_choice_once_and_offsets_add_up(server):
    client = server.client()
    opts = dict(model=NAME, prompt="The quick", max_tokens=30, temperature=1.0, seed=11, n=2,
                extra_body={"ignore_eos": True})
    texts = [c.text for c in sorted(client.completions.create(**opts).choices, key=lambda c: c.index)]
    stop = next(texts[0][i:i + 2] for i in range(1, len(texts[0]) - 2) if texts[0][i:i + 2] not in texts[1])
    finals = {0: 0, 1: 0}
    tokens = {0: [], 1: []}
    offsets = {0: [], 1: []}
    for chunk in client.completions.create(stream=True, stop=[stop], logprobs=1, **opts):
        for c in chunk.choices:
            finals[c.index] += c.finish_reason is not None
            if c.logprobs:
                tokens[c.index] += c.logprobs.tokens
                offsets[c.index] += c.logprobs.text_offset
    assert finals == {0: 1, 1: 1}
    for i in (0, 1):
        want = [sum(len(t) for t in tokens[i][:k]) for k in range(len(tokens[i]))]
        assert offsets[i] == want
    assert len(tokens[0]) < len(tokens[1]) == 30


def test_64_concurrent_streams_batched_and_equal_to_offline(server, offline):
    rng = random.Random(0)
    words = "the quick brown fox jumps over lazy dog Paris capital France hello world".split()
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 30))) for _ in range(64)]
    lengths = [rng.randint(4, 40) for _ in range(64)]
    before = server.metrics()

    async def one(client, prompt, n):
        stream = await client.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0,
                                                 stream=True)
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def main():
        async with server.async_client(timeout=120) as client:
            return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))

    results = asyncio.run(main())
    want = offline.generate(prompts, [SamplingParams(temperature=0, max_tokens=n) for n in lengths],
                            use_tqdm=False)
    assert [r[0] for r in results] == [w.outputs[0].text for w in want]
    assert all(r[1] in ("stop", "length") for r in results)
    after = server.metrics()
    steps = after["resin:step_batch_size_count"] - before.get("resin:step_batch_size_count", 0)
    single = after["resin:step_batch_size_bucket{le=1.0}"] - before.get("resin:step_batch_size_bucket{le=1.0}", 0)
    assert steps > 0 and single < steps  # most steps ran several sequences together
    assert after["resin:step_batch_size_sum"] - before["resin:step_batch_size_sum"] >= 2 * steps


def post(server, path, body, **kw):
    return httpx.post(server.url + path, content=body if isinstance(body, str) else json.dumps(body),
                      headers={"content-type": "application/json"}, timeout=30, **kw)


def test_errors_have_openai_shape_and_status(server):
    cases = [
        ("/v1/completions", '{"prompt": "hi", "max_tokens": ', 400, None),
        ("/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "hi", "top_p": 3}, 400, "top_p"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"1": 2}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
         400, "tools"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
         400, "max_tokens"),
    ]
    for path, body, status, param in cases:
        r = post(server, path, body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"] and err["code"] == status
        if param:
            assert err["param"] == param, (body, err)
    r = post(server, "/v1/completions", {"prompt": "hi " * 300, "max_tokens": 1900})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "2048 tokens" in msg and "1900 in max_tokens" in msg
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    # the server is unharmed
    assert server.client().completions.create(model=NAME, prompt="ok", max_tokens=2).choices[0].finish_reason


def test_models_health_version(server):
    assert [m.id for m in server.client().models.list().data] == [NAME]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_metrics_parse_and_move(server):
    before = server.metrics()
    server.client().completions.create(model=NAME, prompt="Hello there", max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    after = server.metrics()
    for name in ("resin:time_to_first_token_seconds_count", "resin:inter_token_latency_seconds_count",
                 "resin:e2e_request_latency_seconds_count", "resin:request_success_total"):
        assert after[name] > before.get(name, 0), name
    assert after["resin:generation_tokens_total"] - before["resin:generation_tokens_total"] == 6
    assert after["resin:prompt_tokens_total"] > before["resin:prompt_tokens_total"]
    for gauge in ("resin:num_requests_running", "resin:num_requests_waiting", "resin:kv_cache_usage_perc",
                  "resin:prefix_cache_hit_rate", "resin:num_preemptions_total", "resin:request_aborted_total"):
        assert gauge in after


def wait_idle(server, timeout: float = 10) -> dict[str, float]:
    """Metrics once nothing runs and no KV block is held (or after the timeout, for the caller to assert on)."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = m["resin:num_requests_running"] == 0 and m["resin:kv_cache_usage_perc"] == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_disconnect_aborts_and_frees_blocks(server):
    before = server.metrics()
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                      json={"prompt": "Hello", "max_tokens": 2000, "stream": True, "ignore_eos": True}) as r:
        lines = 0
        for line in r.iter_lines():
            lines += bool(line)
            if lines == 3:
                mid = server.metrics()  # still streaming: the request holds blocks
                break  # leaving the loop closes the response: the client is gone
    assert mid["resin:kv_cache_usage_perc"] > 0 and mid["resin:num_requests_running"] == 1
    m = wait_idle(server)
    assert m["resin:kv_cache_usage_perc"] == 0 and m["resin:num_requests_running"] == 0
    assert m["resin:request_aborted_total"] == before["resin:request_aborted_total"] + 1
    assert m["resin:generation_tokens_total"] - before["resin:generation_tokens_total"] < 2000


def test_non_streaming_client_gone_aborts(server):
    before = server.metrics()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=1.0,
                   json={"prompt": "Hello", "max_tokens": 2000, "ignore_eos": True})
    m = wait_idle(server)
    assert m["resin:num_requests_running"] == 0 and m["resin:kv_cache_usage_perc"] == 0
    assert m["resin:request_aborted_total"] == before["resin:request_aborted_total"] + 1
    assert m["resin:generation_tokens_total"] - before["resin:generation_tokens_total"] < 2000
