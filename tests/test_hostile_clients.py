"""A server that hostile or careless clients cannot stall, poison or take down: bounded n and bodies, cheap checks
before expensive work, real statuses before a stream starts, 400 (never 500) for malformed values, and an engine
failure that ends in-flight requests with an error and the process with status 1."""
from __future__ import annotations

import json
import socket
import sys
import threading
import time

import httpx
import pytest

from server_utils import ServerProcess

pytestmark = pytest.mark.e2e

NAME = "tiny"


@pytest.fixture(scope="module")
def server(text_model):
    folder, _ = text_model
    srv = ServerProcess(str(folder), "--served-model-name", NAME, "--kv-cache-memory", "16MiB", "--dtype", "float32",
                        "--max-num-seqs", "2", "--max-waiting", "16", "--max-n", "8",
                        "--max-request-bytes", "1000000").wait_ready()
    yield srv
    assert srv.stop() == 0


def post(srv, body, path="/v1/completions", **kw) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(srv.url + path, content=body, headers={"content-type": "application/json"}, timeout=30,
                          **kw)
    return httpx.post(srv.url + path, json=body, timeout=30, **kw)


def assert_error(r: httpx.Response, status: int, *words: str, param: str | None = None) -> None:
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    for w in words:
        assert w in err["message"], err["message"]
    if param is not None:
        assert err["param"] == param


def test_n_is_bounded(server):
    start = time.monotonic()
    assert_error(post(server, {"prompt": "hi", "n": 10 ** 6}), 400, "--max-n", param="n")
    assert_error(post(server, {"prompt": "hi", "n": 9}), 400, "1 to 8", param="n")
    assert_error(post(server, {"prompt": "hi", "n": 0}), 400, param="n")
    assert_error(post(server, {"prompt": ["a", "b", "c"], "n": 8}), 400, "more sequences", param="n")
    assert time.monotonic() - start < 5
    r = post(server, {"prompt": "hi", "n": 8, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 8


def _open_stream(srv, body):
    """Start a streaming request; return (response, its line iterator) once the status is known."""
    cm = httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=60)
    r = cm.__enter__()
    return cm, r


def test_admission_counts_sequences_and_streams_get_real_statuses(server):
    busy = {"prompt": [1, 2, 3], "max_tokens": 1900, "ignore_eos": True}
    opened, readers = [], []
    try:
        for _ in range(2):  # fill both batch slots
            cm, r = _open_stream(server, busy)
            opened.append(cm)
            assert r.status_code == 200
            readers.append(r.iter_lines())  # kept: a dropped iterator closes the response (a disconnect)
            next(readers[-1])
        for _ in range(2):  # 8 sequences each: 1 waiting + 7 to fork from it; 16 fill the queue
            cm, r = _open_stream(server, {**busy, "n": 8, "max_tokens": 4})
            opened.append(cm)
            assert r.status_code == 200
        # (both batch slots stay busy for seconds, so the two n=8 requests are still queued here)
        assert server.metrics()["resin:num_requests_waiting"] == 16
        # a stream refused for a full queue gets its 429 as the status, not a 200 with an error inside
        cm, r = _open_stream(server, {"prompt": "x", "max_tokens": 2})
        opened.append(cm)
        r.read()
        assert_error(r, 429, "queue is full")
        assert r.headers["content-type"].startswith("application/json")
    finally:
        for cm in opened:
            cm.__exit__(None, None, None)


def test_bodies_are_bounded(server):
    big = json.dumps({"prompt": "a" * 1_100_000})
    assert_error(post(server, big), 413, "--max-request-bytes")

    def chunks():  # no Content-Length: the limit holds while the body streams in
        yield b'{"prompt": "'
        for _ in range(200):
            yield b"b" * 10_000
        yield b'"}'
    r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=30,
                   headers={"content-type": "application/json"})
    assert_error(r, 413)
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_huge_prompt_is_refused_before_tokenising_and_nobody_waits(server):
    health_times = []
    stop = threading.Event()

    def probe():
        while not stop.is_set():
            t = time.monotonic()
            httpx.get(server.url + "/health", timeout=10)
            health_times.append(time.monotonic() - t)

    t = threading.Thread(target=probe)
    t.start()
    try:
        start = time.monotonic()
        for _ in range(3):
            assert_error(post(server, {"prompt": "word " * 190_000}), 400, "characters", param="prompt")
        assert time.monotonic() - start < 3
        # within the character bound but over the context: tokenised off the event loop, then refused
        r = post(server, {"prompt": "word " * 3000})
        assert_error(r, 400, "maximum context length", param="prompt")
    finally:
        stop.set()
        t.join()
    assert max(health_times) < 1.0, max(health_times)


@pytest.mark.parametrize("body, param", [
    ({"prompt": [1, -5, 3]}, "prompt"),
    ({"prompt": [1, 10 ** 30]}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": "x", "logprobs": 5, "echo": True, "max_tokens": 1, "stop_token_ids": [-1]}, "stop_token_ids"),
    ('{"prompt": "a\\ud800b"}', None),
    ('{"prompt": "ok", "model": "\\udfff"}', None),
    ('{"prompt": "ok", "temperature": Infinity}', "temperature"),
    ('{"prompt": "ok", "top_p": NaN}', "top_p"),
    ('{"prompt": "ok", "repetition_penalty": -Infinity}', "repetition_penalty"),
    ({"prompt": "ok", "seed": 2 ** 64}, "seed"),
    ({"prompt": "ok", "stop": ["a"] * 33}, "stop"),
    ({"prompt": "ok", "stop_token_ids": list(range(2000))}, "stop_token_ids"),
])
def test_malformed_values_are_400(server, body, param):
    assert_error(post(server, body), 400, param=param)


def test_malformed_chat_is_400(server):
    body = '{"messages": [{"role": "user", "content": "hi \\ud800"}]}'
    assert_error(post(server, body, "/v1/chat/completions"), 400, "surrogate")
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
    assert_error(post(server, parts, "/v1/chat/completions"), 400, "string", param="messages")
    many = {"messages": [{"role": "user", "content": ""}] * 3000}
    assert_error(post(server, many, "/v1/chat/completions"), 400, "3000 messages", param="messages")


def test_a_tiny_temperature_is_greedy(server):
    base = {"prompt": "Hello", "max_tokens": 8, "ignore_eos": True}
    greedy = post(server, {**base, "temperature": 0}).json()["choices"][0]["text"]
    assert post(server, {**base, "temperature": 1e-40}).json()["choices"][0]["text"] == greedy


def test_echo_with_logprobs_on_a_long_prompt(server):
    prompt = [(i * 7) % 390 + 5 for i in range(1500)]
    r = post(server, {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 1})
    assert r.status_code == 200
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 1501 and lp["token_logprobs"][0] is None


# A server whose engine step raises after a few steps: the real server process, with the fault injected by the
# launching script (the thing a GPU fault or an engine bug would do).
_DYING = """
import sys
from resin.core.engine import LLMEngine
step = LLMEngine.step
count = [0]
def failing_step(self):
    count[0] += 1
    if count[0] == 30:
        raise RuntimeError("injected engine fault")
    return step(self)
LLMEngine.step = failing_step
from resin.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_dead_engine_ends_streams_with_an_error_and_exits_1(text_model, tmp_path):
    script = tmp_path / "dying.py"
    script.write_text(_DYING)
    srv = ServerProcess(str(text_model[0]), "--kv-cache-memory", "16MiB", launcher=[sys.executable, str(script)])
    srv.wait_ready()
    try:
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=30,
                          json={"prompt": "Hi", "max_tokens": 500, "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        died = time.monotonic()
        error = json.loads(events[-2][6:])["error"]
        assert events[-1] == "data: [DONE]"
        assert error["code"] == 503 and error["type"] == "service_unavailable" and "failed" in error["message"]
        assert srv.proc.wait(timeout=15) == 1
        assert time.monotonic() - died < 15
        assert "injected engine fault" in srv.logs()
    finally:
        srv.stop()


def test_a_client_that_stops_reading_is_aborted(text_model):
    """Over real HTTP: a client with a tiny receive window reads the status line and then nothing. The kernel
    buffers a few MB (tcp_wmem), then uvicorn's flow control holds the response, outputs wait, and after
    --stream-stall-timeout the request is aborted and its blocks freed, long before its 4 x 2000 tokens."""
    srv = ServerProcess(str(text_model[0]), "--kv-cache-memory", "16MiB", "--dtype", "float32",
                        "--stream-stall-timeout", "1").wait_ready()
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", srv.port))
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2000, "n": 4, "logprobs": 20, "stream": True,
                           "ignore_eos": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
        deadline = time.monotonic() + 60
        while "has not read for" not in srv.logs():
            assert time.monotonic() < deadline, "the stalled request was never aborted"
            time.sleep(0.25)
        m = srv.metrics()
        assert m["resin:generation_tokens_total"] < 4 * 2000
        while m["resin:num_requests_running"] or m["resin:kv_cache_usage_perc"]:
            assert time.monotonic() < deadline
            m = srv.metrics()
    finally:
        sock.close()
        assert srv.stop() == 0
