"""HTTP fuzz with schemathesis against the OpenAPI schema the server publishes: whatever the body, no 5xx, every
error in OpenAI's shape, and the server healthy and idle afterwards.

The server runs with a short context and small n, so that every body the fuzzer makes valid is cheap to serve.
RESIN_FUZZ_EXAMPLES sets the examples per operation (CI: the default below; the closing note's run: thousands).
"""
from __future__ import annotations

import os
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from server_utils import ServerProcess

pytestmark = pytest.mark.e2e

EXAMPLES = int(os.environ.get("RESIN_FUZZ_EXAMPLES", "60"))
FUZZED = r"^/v1/(completions|chat/completions|models)$"


@pytest.fixture(scope="module")
def fuzz_server(text_model):
    srv = ServerProcess(str(text_model[0]), "--served-model-name", "tiny", "--kv-cache-memory", "16MiB",
                        "--dtype", "float32", "--max-model-len", "64", "--max-n", "2", "--max-waiting", "64",
                        "--max-request-bytes", "200000").wait_ready()
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json").include(path_regex=FUZZED)


def _check(case, counts: dict[str, int]) -> None:
    response = case.call(timeout=60)
    counts[str(response.status_code)] = counts.get(str(response.status_code), 0) + 1
    assert response.status_code < 500, (case.as_curl_command(), response.status_code, response.text[:1000])
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"}, body
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["code"] == response.status_code and body["error"]["message"]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_server_errors_and_openai_shaped_errors(api_schema, mode):
    # schemathesis' operations and strategies driven by hypothesis directly (its pytest plugin does not run on
    # pytest 9): valid bodies (POSITIVE) and bodies that break the schema on purpose (NEGATIVE)
    counts: dict[str, int] = {}
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) == 3
    if mode is GenerationMode.NEGATIVE:  # GET /v1/models takes nothing that could be made invalid
        operations = [op for op in operations if op.method.upper() == "POST"]
    for operation in operations:
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=operation.as_strategy(generation_mode=mode))
        def fuzz(case):
            _check(case, counts)
        fuzz()
    print(f"{mode.value}: responses by status {counts}")
    assert sum(counts.values()) >= len(operations)


def test_the_schema_describes_the_real_bodies(api_schema):
    """The fuzzer explores what the schema says: it must list the fields a request really takes."""
    raw = api_schema.raw_schema
    operations = {(p, m) for p, methods in raw["paths"].items() for m in methods}
    assert {("/v1/completions", "post"), ("/v1/chat/completions", "post"), ("/v1/models", "get")} <= operations
    components = raw["components"]["schemas"]
    for name, fields in (("CompletionRequest", {"prompt", "n", "max_tokens", "temperature", "stream", "logprobs"}),
                         ("ChatCompletionRequest", {"messages", "n", "max_completion_tokens", "top_logprobs"})):
        assert fields <= set(components[name]["properties"]), name
        assert components[name].get("additionalProperties") is False, name


def test_the_server_is_healthy_and_idle_after_the_fuzz(fuzz_server):
    deadline = time.monotonic() + 30
    while True:
        m = fuzz_server.metrics()
        if m["resin:num_requests_running"] == 0 and m["resin:kv_cache_usage_perc"] == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
    assert httpx.get(fuzz_server.url + "/health").status_code == 200
    assert m.get("resin:request_failed_total", 0) == 0
    # ignore_eos: the random tiny model samples its eos now and then, which would end the answer early
    r = fuzz_server.client().completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=3,
                                                extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
