"""Bad input gets a clear error naming the problem and the fix, and never disturbs other requests."""
from __future__ import annotations

import json

import pytest

from resin import LLM, SamplingParams
from resin.models import MODEL_REGISTRY

pytestmark = pytest.mark.unit


def test_unknown_architecture_lists_supported(tiny_models, tmp_path):
    folder, _ = tiny_models["LlamaForCausalLM"]
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as err:
        LLM(str(tmp_path), kv_cache_memory="4MiB")
    assert "FooForCausalLM" in str(err.value)
    for name in MODEL_REGISTRY:
        assert name in str(err.value)


def test_missing_path():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM("/nonexistent/model/folder")


def test_pickle_checkpoint_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match="pickle checkpoints are never loaded"):
        LLM(str(tmp_path))


def test_too_long_prompt_fails_alone(tiny_models):
    folder, _ = tiny_models["Qwen2ForCausalLM"]
    llm = LLM(str(folder), kv_cache_memory="4MiB", max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=4)
    outs = llm.generate([[1] * 100, [5, 6, 7], [], [3, 999]], params, use_tqdm=False)
    assert outs[0].error and "100 tokens" in outs[0].error and "max_model_len is 64" in outs[0].error
    assert outs[0].outputs[0].finish_reason == "abort"
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 4
    assert outs[2].error and "empty" in outs[2].error
    assert outs[3].error and "outside the vocabulary" in outs[3].error


def test_max_tokens_clipped_to_context(tiny_models):
    folder, _ = tiny_models["Qwen2ForCausalLM"]
    llm = LLM(str(folder), kv_cache_memory="4MiB", max_model_len=20)
    out = llm.generate([[1] * 15], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("max_tokens", 0), ("min_tokens", -1), ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -3), ("min_p", 2.0), ("repetition_penalty", 0.0), ("presence_penalty", 3.0),
    ("frequency_penalty", -2.5), ("logprobs", -1), ("prompt_logprobs", -2), ("stop", [""]),
    ("stop_token_ids", [-1]), ("seed", "abc"),
])
def test_invalid_sampling_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**{field: value})


def test_text_prompt_without_tokenizer(tiny_models):
    folder, _ = tiny_models["Qwen3ForCausalLM"]
    llm = LLM(str(folder), kv_cache_memory="4MiB")
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello")


def test_bad_engine_arguments(tiny_models):
    folder, _ = tiny_models["Qwen3ForCausalLM"]
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(str(folder), kv_cache_memory="lots")
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(folder), dtype="int3")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(str(folder), max_model_len=10 ** 6)
