"""Structured outputs in the engine (offline API): every sampled output follows its grammar, through n > 1, seeds,
preemption, stop strings, min_tokens and ignore_eos; a grammar that cannot compile fails its own request only."""
from __future__ import annotations

import json
import re
from typing import Literal

import pytest
import torch
from pydantic import BaseModel, Field

from resin import LLM, SamplingParams, StructuredOutputsParams
from resin.core.config import parse_bytes
from resin.core.request import Request
from resin.core.structured_output import MAX_CHOICES, GrammarError

pytestmark = pytest.mark.unit


class Order(BaseModel):
    item: Literal["tea", "coffee", "cake"]
    count: int = Field(ge=1, le=9)
    to_go: bool
    notes: list[Literal["hot", "cold", "sweet"]] = Field(max_length=3)


SCHEMA = Order.model_json_schema()


@pytest.fixture(scope="module")
def llm(text_model):
    return LLM(str(text_model[0]), dtype="float32", kv_cache_memory="8MiB")


def sample(llm, spec: StructuredOutputsParams, n: int = 8, **kw) -> list:
    params = SamplingParams(n=n, temperature=1.0, max_tokens=kw.pop("max_tokens", 60), structured_outputs=spec, **kw)
    out = llm.generate("Hello world", params, use_tqdm=False)[0]
    assert out.error is None, out.error
    return out.outputs


def test_json_schema_outputs_validate_at_temperature_one(llm):
    for seed in range(3):
        for c in sample(llm, StructuredOutputsParams(json=SCHEMA), seed=seed, max_tokens=200):
            assert c.finish_reason == "stop", c.text
            Order.model_validate_json(c.text)
            assert list(json.loads(c.text)) == ["item", "count", "to_go", "notes"]  # the schema's order


def test_regex_choice_grammar_and_json_object(llm):
    for c in sample(llm, StructuredOutputsParams(regex=r"[A-F]\d{2}-(x|yz)")):
        assert re.fullmatch(r"[A-F]\d{2}-(x|yz)", c.text) and c.finish_reason == "stop"
    choices = ["Paris", "Grüße \"aus\" München", "日本語"]
    texts = {c.text for c in sample(llm, StructuredOutputsParams(choice=choices), n=16)}
    assert texts <= set(choices) and len(texts) > 1
    for c in sample(llm, StructuredOutputsParams(grammar='root ::= "id:" [0-9] [0-9]? ("!" | ".")')):
        assert re.fullmatch(r"id:\d\d?[!.]", c.text)
    for c in sample(llm, StructuredOutputsParams(json_object=True), max_tokens=300):
        if c.finish_reason == "stop":  # a free-form object can run past max_tokens on a random model
            assert isinstance(json.loads(c.text), dict)


def test_greedy_is_the_best_allowed_token(llm):
    """Greedy under a grammar picks the model's most likely token among those the grammar allows."""
    seen = []
    llm.engine.logits_observer = lambda rows, logits: seen.append(logits.clone())
    try:
        out = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=5, structured_outputs=(
            StructuredOutputsParams(choice=["ab", "ba", "zz"]))), use_tqdm=False)[0].outputs[0]
    finally:
        llm.engine.logits_observer = None
    tok = llm.get_tokenizer()
    first = [tok.encode(c, add_special_tokens=False)[0] for c in ("ab", "ba", "zz")]
    assert out.token_ids[0] == max(set(first), key=lambda t: seen[0][0, t].item())


def test_preemption_keeps_grammar_state_and_tokens(text_model):
    spec = StructuredOutputsParams(json=SCHEMA)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=100, structured_outputs=spec)
    prompts = ["Hello world", "The quick brown fox", "Grüße aus München", "Numbers 123", "STOP here", "END"]
    roomy = LLM(str(text_model[0]), dtype="float32", kv_cache_memory="8MiB").generate(prompts, params, use_tqdm=False)
    per_block = kv_bytes_per_block(roomy_llm := LLM(str(text_model[0]), dtype="float32", kv_cache_memory="8MiB"))
    del roomy_llm
    tight = LLM(str(text_model[0]), dtype="float32", kv_cache_memory=per_block * 12, max_model_len=160)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.num_preemptions > 0
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in roomy]
    for o in outs:
        for c in o.outputs:
            Order.model_validate_json(c.text)


def kv_bytes_per_block(llm) -> int:
    c = llm.engine.config
    return parse_bytes("8MiB") // (llm.engine.capacity_tokens // c.block_size)


def test_stop_strings_min_tokens_and_ignore_eos(llm):
    cut = sample(llm, StructuredOutputsParams(regex="abc-def-ghi"), stop=["-g"], n=2)
    assert all(c.text == "abc-def" and c.stop_reason == "-g" for c in cut)
    # min_tokens forbids the stop token, but the grammar can only end: the grammar wins, the output stays valid
    ended = sample(llm, StructuredOutputsParams(choice=["yes", "no"]), min_tokens=20, n=4)
    assert all(c.text in ("yes", "no") and c.finish_reason == "stop" for c in ended)
    # ignore_eos: the grammar's end still ends the sequence
    ended = sample(llm, StructuredOutputsParams(choice=["yes", "no"]), ignore_eos=True, n=4)
    assert all(c.text in ("yes", "no") and c.finish_reason == "stop" for c in ended)


def test_a_grammar_that_cannot_compile_fails_its_request_only(llm):
    good = SamplingParams(temperature=0, max_tokens=4)
    outs = llm.generate(["Hello", "world"], [SamplingParams(structured_outputs=StructuredOutputsParams(regex="((")),
                                            good], use_tqdm=False)
    assert outs[0].error.startswith("the regex cannot be compiled: Regex parsing error")
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 4
    with pytest.raises(GrammarError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(GrammarError, match="choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})
    outs = llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(json='{"type": ')),
                        use_tqdm=False)
    assert "not valid JSON" in outs[0].error


def test_sampler_never_leaves_the_grammar_even_on_broken_logits(llm):
    """A row of NaN logits, or one whose every allowed token is -inf, still draws a token the grammar allows."""
    engine = llm.engine
    compiled = engine.grammars.compile(StructuredOutputsParams(choice=["Paris", "world"]))
    tok = llm.get_tokenizer()
    allowed = {t for t in range(engine.vocab_size) if (text := tok.decode([t])) and
               any(w.startswith(text) for w in ("Paris", "world"))}
    params = SamplingParams(temperature=1.0)
    reqs = [Request(f"r{i}", [1, 2], params, 8) for i in range(3)]
    for r in reqs:
        r.grammar = engine.grammars.matcher(compiled)
    logits = torch.randn(3, engine.vocab_size)
    logits[0] = float("nan")
    logits[1, sorted(allowed)] = float("-inf")
    logits[2, sorted(allowed)] = -1e4  # unlikely, but the only choices
    for _ in range(5):
        assert set(engine.sampler(logits, reqs).token_ids) <= allowed


def test_a_slow_compile_is_refused_in_bounded_time(llm):
    """The server compiles on its own pool with a time bound: a grammar that takes longer is a 400, at once."""
    import asyncio
    import time

    from resin.server.errors import APIError
    from resin.server.structured import GrammarCompiles

    import random

    llm.engine.grammars  # noqa: B018 - built first (loading xgrammar is not what is timed)
    compiles = GrammarCompiles(llm.engine, timeout=0.02, workers=1)
    rng = random.Random()  # fresh words each run: never a cache hit
    slow = StructuredOutputsParams(choice=["".join(rng.choice("abcdefghij") for _ in range(12))
                                           for _ in range(MAX_CHOICES)])  # ~0.2 s to compile here

    async def two():
        return await asyncio.gather(compiles.compile(slow, "guided_choice"),
                                    compiles.compile(StructuredOutputsParams(regex="ab"), "guided_regex"),
                                    return_exceptions=True)

    start = time.monotonic()
    slow_error, queued_error = asyncio.run(two())
    assert time.monotonic() - start < 0.15
    assert isinstance(slow_error, APIError) and slow_error.status == 400 and slow_error.param == "guided_choice"
    assert "did not compile within 0.02 s" in slow_error.message
    # the second waited behind it on the one worker: told to retry, and its compile never runs
    assert isinstance(queued_error, APIError) and queued_error.status == 503 and "busy" in queued_error.message
    compiles.close()
    with pytest.raises(GrammarError, match=f"at most {MAX_CHOICES}"):
        StructuredOutputsParams(choice=["a"] * (MAX_CHOICES + 1))
    with pytest.raises(GrammarError, match="characters; at most"):
        StructuredOutputsParams(regex="a" * ((1 << 18) + 1))
