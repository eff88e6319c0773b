"""The built-in model: fetched once into the cache, converted, and a real check of quality."""
from __future__ import annotations

import time

import pytest

from resin import LLM, SamplingParams
from resin.builtin import BUILTIN_NAME, MARKER, ensure_builtin_model
from resin.parity import run_parity

pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def builtin():
    return ensure_builtin_model(progress=False)


def test_capital_of_france(builtin):
    llm = LLM(kv_cache_memory="256MiB")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


def test_parity_with_transformers_on_dequantised_weights(builtin):
    prompts = ["The capital of France is", "def add(a, b):", "Photosynthesis is the process by which"]
    card = run_parity(str(builtin.path), prompts=prompts, decode_steps=32)
    print(card.format())
    assert card.prefill_max_diff <= 1e-3
    assert card.greedy_matches == len(prompts), card.format()
    assert card.passed


def test_cache_second_load_does_not_download_and_partial_is_redone(tmp_path, monkeypatch):
    monkeypatch.setenv("RESIN_CACHE", str(tmp_path))
    first = ensure_builtin_model(progress=False)
    assert first.downloaded and first.converted and (first.path / MARKER).exists()
    start = time.monotonic()
    second = ensure_builtin_model(progress=False)
    assert not second.downloaded and not second.converted and second.path == first.path
    assert time.monotonic() - start < 1.0

    # an interrupted conversion: the weights file is cut short -> reconverted from the kept GGUF, not downloaded
    weights = first.path / "model.safetensors"
    full_size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(full_size // 2)
    third = ensure_builtin_model(progress=False)
    assert third.converted and not third.downloaded
    assert (third.path / "model.safetensors").stat().st_size == full_size
    assert LLM(str(third.path), kv_cache_memory="64MiB").generate(
        "Hello", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids

    # an interrupted download: a truncated GGUF without its marker -> fetched again
    (first.gguf.parent / MARKER).unlink()
    with open(first.gguf, "r+b") as f:
        f.truncate(1000)
    (first.path / MARKER).unlink()
    fourth = ensure_builtin_model(progress=False)
    assert fourth.downloaded and fourth.converted and fourth.path.name == BUILTIN_NAME
    assert first.gguf.stat().st_size > 1000
