"""Server behaviour around the requests: API keys, a full queue, graceful shutdown, the built-in model."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from resin.tiny import save_tiny_model
from server_utils import ServerProcess

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """A tiny model with a long context, so one request can keep the engine busy for seconds."""
    folder = tmp_path_factory.mktemp("long-llama")
    save_tiny_model(folder, "LlamaForCausalLM", max_position_embeddings=4096)
    return folder


def long_stream(srv, max_tokens=4000):
    return httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                        json={"prompt": [1, 2, 3], "max_tokens": max_tokens, "stream": True, "ignore_eos": True})


def test_api_key(long_model):
    srv = ServerProcess(str(long_model), "--served-model-name", "m", "--kv-cache-memory", "32MiB",
                        "--metrics-require-api-key", api_key="s3cret").wait_ready()
    try:
        with pytest.raises(openai.AuthenticationError):
            srv.client(api_key="wrong").models.list()
        r = httpx.get(srv.url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert srv.client().completions.create(model="m", prompt=[1, 2], max_tokens=2).usage.completion_tokens == 2
        assert httpx.get(srv.url + "/health").status_code == 200
        assert httpx.get(srv.url + "/metrics").status_code == 401  # the flag puts /metrics behind the key
        metrics = httpx.get(srv.url + "/metrics", headers={"Authorization": "Bearer s3cret"})
        assert metrics.status_code == 200 and "resin:request_success_total" in metrics.text
    finally:
        assert srv.stop() == 0


def test_an_empty_api_key_is_refused(long_model):
    """RESIN_API_KEY= (set but empty) must not silently serve without authentication."""
    proc = subprocess.run([sys.executable, "-m", "resin.cli", "run", str(long_model)], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, RESIN_API_KEY=""))
    assert proc.returncode != 0 and "API key is empty" in proc.stderr, proc.stderr[-2000:]


def test_full_waiting_queue_gives_429(long_model):
    srv = ServerProcess(str(long_model), "--served-model-name", "m", "--kv-cache-memory", "32MiB",
                        "--max-num-seqs", "1", "--max-waiting", "1").wait_ready()
    try:
        with long_stream(srv) as running:
            lines = running.iter_lines()  # keep the iterator: dropping it closes the response (a disconnect)
            next(lines)
            with long_stream(srv) as waiting:
                deadline = time.monotonic() + 10
                while srv.metrics()["resin:num_requests_waiting"] < 1 and time.monotonic() < deadline:
                    time.sleep(0.05)
                with pytest.raises(openai.RateLimitError) as err:
                    srv.client().completions.create(model="m", prompt=[1], max_tokens=2)
                assert "queue is full" in str(err.value)
                assert waiting.status_code == 200
        # once they are gone, requests are served again
        deadline = time.monotonic() + 10
        while srv.metrics()["resin:num_requests_running"] > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.client().completions.create(model="m", prompt=[1], max_tokens=2).choices
    finally:
        assert srv.stop() == 0


def test_sigterm_ends_in_flight_requests_cleanly_and_exits_0(long_model):
    srv = ServerProcess(str(long_model), "--served-model-name", "m", "--kv-cache-memory", "32MiB",
                        "--shutdown-timeout", "1").wait_ready()
    result: dict = {}
    started = threading.Event()

    def consume():
        try:
            stream = srv.client().completions.create(model="m", prompt=[1, 2, 3], max_tokens=4000, stream=True,
                                                     extra_body={"ignore_eos": True})
            for chunk in stream:
                started.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    result["finish_reason"] = chunk.choices[0].finish_reason
            result["clean"] = True
        except Exception as e:  # noqa: BLE001 - recorded for the assertion
            result["error"] = repr(e)
            started.set()

    t = threading.Thread(target=consume)
    t.start()
    assert started.wait(30)
    start = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    # draining: the stream goes on, but load balancers are told to stop routing here
    deadline = time.monotonic() + 5
    health = None
    while time.monotonic() < deadline and health != 503:
        try:
            health = httpx.get(srv.url + "/health", timeout=1).status_code
        except httpx.HTTPError:
            break  # already closed its listening socket: also "not here"
    assert health == 503 and not result
    assert srv.stop(signal.SIGTERM, timeout=30) == 0
    t.join(30)
    assert time.monotonic() - start < 15
    assert result.get("clean"), result
    assert result["finish_reason"] in ("abort", "length")


@pytest.mark.parametrize("stream", [False, True])
def test_builtin_model_answers_paris(stream, builtin_server):
    client = builtin_server.client()
    kw = dict(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "What is the capital of France? Answer in one word."}],
              temperature=0, max_tokens=32)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw))
    else:
        text = client.chat.completions.create(**kw).choices[0].message.content
    assert "Paris" in text


@pytest.fixture(scope="module")
def builtin_server():
    srv = ServerProcess("--kv-cache-memory", "256MiB").wait_ready()
    yield srv
    assert srv.stop() == 0


def test_a_port_already_taken_exits_non_zero_with_the_reason(long_model):
    """The HTTP server runs beside the engine's main thread: if it cannot listen, the process must still exit
    non-zero (uvicorn's startup-failure status) with uvicorn's reason, not run on without a server or exit 0."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        srv = ServerProcess(str(long_model), "--served-model-name", "m", "--kv-cache-memory", "32MiB",
                            port=taken.getsockname()[1])
        try:
            assert srv.proc.wait(180) != 0
        finally:
            srv.proc.kill()
    assert "address already in use" in srv.logs().lower()


def test_the_server_prefills_a_long_prompt_in_steps_of_at_most_1024_tokens(long_model):
    """resin run's CPU step budget (CPU_SERVING_BATCHED_TOKENS): a 3000-token prompt is prefilled in three steps of
    at most 1024 tokens (offline LLM() keeps 2048); --max-num-batched-tokens overrides it."""
    srv = ServerProcess(str(long_model), "--served-model-name", "m", "--kv-cache-memory", "32MiB").wait_ready()
    try:
        out = srv.client().completions.create(model="m", prompt=[5] * 3000, max_tokens=1)
        assert out.usage.prompt_tokens == 3000
        m = srv.metrics()
        steps = m["resin:step_num_tokens_count"]
        assert m["resin:step_num_tokens_bucket{le=1024.0}"] == steps  # no step over 1024 tokens
        assert m["resin:step_num_tokens_sum"] >= 3000 and steps >= 3
    finally:
        assert srv.stop() == 0
