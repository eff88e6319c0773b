"""The offline API end to end on a tiny model with a real tokenizer: text, stop strings, n, seeds, logprobs,
chat templates, abort."""
from __future__ import annotations

import pytest

from resin import LLM, SamplingParams

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def llm(text_model):
    folder, _ = text_model
    return LLM(str(folder), dtype="float32", kv_cache_memory="8MiB")


def test_text_matches_tokens(llm):
    out = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.prompt == "Hello world" and out.prompt_token_ids == llm.tokenizer("Hello world")["input_ids"]
    comp = out.outputs[0]
    assert comp.text == llm.tokenizer.decode(comp.token_ids, skip_special_tokens=True)
    assert comp.finish_reason == "length" and len(comp.token_ids) == 12


def test_stop_string_cuts_text(llm):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    free = llm.generate("The quick", params, use_tqdm=False)[0].outputs[0]
    text = free.text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert len(stop) == 3
    cut = llm.generate("The quick", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[:text.index(stop)]


def test_stop_strings_wait_for_min_tokens(llm):
    free = llm.generate("The quick", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = free.text[2:4]
    early = llm.generate("The quick", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
                         use_tqdm=False)[0].outputs[0]
    late = llm.generate("The quick", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                    min_tokens=20), use_tqdm=False)[0].outputs[0]
    assert len(early.token_ids) < 20 <= len(late.token_ids)


def test_stop_token_ids_and_eos(llm):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    free = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    target = free.token_ids[3]
    first = free.token_ids.index(target)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[target]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == target and out.token_ids == free.token_ids[:first + 1]


def test_n_and_seed(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=42, ignore_eos=True)
    a = llm.generate("Grüße", params, use_tqdm=False)[0]
    b = llm.generate(["Hello", "Grüße"], params, use_tqdm=False)[1]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1


def test_logprobs_structure(llm):
    out = llm.generate("Hello", SamplingParams(temperature=0.7, seed=1, max_tokens=6, logprobs=2, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, pos in zip(out.token_ids, out.logprobs):
        assert tok in pos and len(pos) in (2, 3)
        assert sorted(lp.rank for t, lp in pos.items() if t != tok or lp.rank <= 2)[:2] == [1, 2]
        assert pos[tok].decoded_token == llm.tokenizer.decode([tok])


def test_chat_applies_template(llm):
    out = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(temperature=0, max_tokens=4),
                   use_tqdm=False)[0]
    assert out.prompt == "<|user|>Hello<|end|><|assistant|>"
    assert out.prompt_token_ids == llm.tokenizer(out.prompt, add_special_tokens=False)["input_ids"]


def test_abort_frees_blocks(llm):
    engine = llm.engine
    free_before = engine.kv.pool.num_free
    engine.add_request("to-abort", [1] * 40, SamplingParams(max_tokens=50))
    engine.step()
    assert engine.kv.pool.num_free < free_before
    out = engine.abort_request("to-abort")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.kv.pool.num_free == free_before and not engine.has_unfinished_requests()
