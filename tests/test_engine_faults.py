"""A failure inside a step ends only the requests it touched; everything else continues exactly as in a clean run.
Also: requests that would have failed a step are refused up front, n > 1 computes its prompt once, prompt
logprobs are computed in bounded chunks, and DELTA outputs keep the output path O(length)."""
from __future__ import annotations

import pytest
import torch

from resin import LLM, SamplingParams
from resin.core import engine as engine_module
from resin.core.sampling_params import OutputKind

pytestmark = pytest.mark.unit

PROMPTS = [[5, 17, 33, 2, 9, 100, 41], [7, 7, 8, 250, 3], [300, 12, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53]]


@pytest.fixture(scope="module")
def llm(text_model):
    return LLM(str(text_model[0]), dtype="float32", kv_cache_memory="16MiB", max_num_seqs=8)


def _params() -> list[SamplingParams]:
    # seeded sampling, greedy (the victim), greedy with logprobs: the ways a row can be sampled
    return [SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)]


def _run(engine, inject=None) -> dict[str, object]:
    """Add PROMPTS as requests a, b, c (the victim "b" joins a running batch), step until done, return the final
    outputs by id. `inject(engine)` breaks something once b is in, and returns how to undo it."""
    outs = {}
    engine.add_request("a", PROMPTS[0], _params()[0])
    engine.add_request("c", PROMPTS[2], _params()[2])
    engine.step()
    engine.add_request("b", PROMPTS[1], _params()[1])
    undo = inject(engine) if inject else None
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out
    finally:
        if undo:
            undo()
    return outs


def _swap(name, make):
    def inject(engine):
        original = getattr(engine, name)
        setattr(engine, name, make(original))
        return lambda: setattr(engine, name, original)
    return inject


def _victim_in(reqs) -> bool:
    return any(r.parent_id == "b" and r.num_output_tokens >= 3 for r in reqs)


class _FailingRunner:
    def __init__(self, runner):
        self.runner = runner

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, batch):
        if _victim_in(batch.requests):
            raise RuntimeError("injected runner fault")
        return self.runner.execute(batch)


class _FailingSampler:
    def __init__(self, sampler):
        self.sampler = sampler
        self.generator = sampler.generator

    def __call__(self, logits, reqs):
        if _victim_in(reqs):
            # consume the shared generators first, as a fault halfway through sampling would
            self.sampler(logits, reqs)
            raise RuntimeError("injected sampler fault")
        return self.sampler(logits, reqs)


def _break_detokenizer(engine):
    detok = engine.groups["b"].detoks[0]
    add = detok.add
    calls = {"n": 0}

    def failing_add(token, check_stop=True):
        calls["n"] += 1
        if calls["n"] == 4:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokeniser fault")
        return add(token, check_stop)

    detok.add = failing_add


@pytest.mark.parametrize("stage", ["runner", "sampler", "detokenizer"])
def test_a_failure_in_any_stage_ends_only_its_request(llm, stage):
    engine = llm.engine
    clean = _run(engine)
    assert all(o.error is None for o in clean.values())
    inject = {"runner": _swap("runner", _FailingRunner), "sampler": _swap("sampler", _FailingSampler),
              "detokenizer": _break_detokenizer}[stage]
    faulty = _run(engine, inject)

    b = faulty["b"]
    assert b.finished and b.error and "injected" in b.error
    assert all(c.finish_reason == "abort" for c in b.outputs)
    for rid in ("a", "c"):
        assert faulty[rid].error is None
        assert faulty[rid].outputs[0].token_ids == clean[rid].outputs[0].token_ids, rid
        assert faulty[rid].outputs[0].text == clean[rid].outputs[0].text, rid
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks  # the failed request's blocks came back
    after = _run(engine)  # and the engine is as good as new
    for rid in "abc":
        assert after[rid].outputs[0].token_ids == clean[rid].outputs[0].token_ids


def test_logprobs_beyond_the_vocabulary_are_refused_and_the_engine_goes_on(llm):
    vocab = llm.engine.vocab_size
    ok = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    for field in ("logprobs", "prompt_logprobs"):
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, **{field: vocab + 5}), use_tqdm=False)[0]
        assert out.error and f"{field}={vocab + 5}" in out.error and "at most 20" in out.error
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, **{field: 21}), use_tqdm=False)[0]
        assert out.error and "max_logprobs=20" in out.error
    again = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert again.error is None and again.outputs[0].token_ids == ok.outputs[0].token_ids


def test_n_siblings_compute_the_prompt_once(llm):
    engine = llm.engine
    engine.kv.pool.reset_prefix_cache()
    prompt = [(i * 37) % 390 + 5 for i in range(109)]  # 6 full blocks of 16 and 13 tokens more
    computed = []
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True)
    engine.add_request("fork", prompt, params)
    outs = None
    peak_used = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs = out
        computed.append(engine.last_step.num_tokens)
        peak_used = max(peak_used, engine.kv.pool.num_blocks - engine.kv.pool.num_free)
    # Sequence 0 computes the prompt and 4 decodes; each sibling draws its first token from sequence 0's logits,
    # then computes the prompt's last partial block (13 tokens) with that token, then 3 decodes.
    assert sum(computed) == (109 + 4) + 3 * (13 + 1 + 3), computed
    assert peak_used <= 8 + 3 * 2, peak_used  # the 6 full prompt blocks are shared, not held 4 times
    assert len(outs.outputs) == 4 and all(len(c.token_ids) == 5 for c in outs.outputs)
    # seeded siblings draw from their own generators: the same request again gives the same four choices
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in outs.outputs]
    assert len({tuple(c.token_ids) for c in outs.outputs}) > 1


def test_prompt_logprobs_are_computed_in_bounded_chunks(llm, monkeypatch):
    monkeypatch.setattr(engine_module, "_PROMPT_LOGITS_ROWS", 8)
    runner = llm.engine.runner
    rows = []
    original = runner.model.compute_logits

    def recording(hidden):
        rows.append(hidden.shape[0])
        return original(hidden)

    monkeypatch.setattr(runner.model, "compute_logits", recording)
    prompt = [(i * 11) % 390 + 5 for i in range(100)]
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2, temperature=0), use_tqdm=False)[0]
    assert max(rows) <= 8 and sum(rows) >= 99
    monkeypatch.undo()
    whole = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2, temperature=0),
                         use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == 100 and out.prompt_logprobs[0] is None
    for a, b in zip(out.prompt_logprobs[1:], whole.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        for tok in a:
            assert a[tok].rank == b[tok].rank
            torch.testing.assert_close(a[tok].logprob, b[tok].logprob, rtol=0, atol=1e-5)


def test_delta_outputs_add_up_to_the_final_text_and_stay_linear(llm):
    engine = llm.engine
    base = dict(temperature=0, max_tokens=300, ignore_eos=True, stop=["zz-never"], logprobs=1)
    engine.add_request("cum", [1, 2, 3], SamplingParams(**base))
    engine.add_request("delta", [1, 2, 3], SamplingParams(**base, output_kind=OutputKind.DELTA))
    cumulative, deltas = None, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "cum":
                cumulative = out
            else:
                deltas.append(out)
    text = "".join(c.text for o in deltas for c in o.outputs)
    tokens = [t for o in deltas for c in o.outputs for t in c.token_ids]
    logprobs = [p for o in deltas for c in o.outputs for p in c.logprobs]
    final = cumulative.outputs[0]
    assert text == final.text and tokens == final.token_ids and len(logprobs) == len(final.logprobs)
    for a, b in zip(logprobs, final.logprobs):  # two rows of one batch: equal up to fp32 reassociation
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)
    # what the deltas carried in total is the length of the output, not the sum of every prefix of it
    assert sum(len(c.token_ids) for o in deltas for c in o.outputs) == 300
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "length"


def test_a_broken_device_is_not_contained(llm, monkeypatch):
    """A fault that leaves the device unusable would fail every later step: the step raises (the engine thread
    dies and the server exits for a restart) instead of failing request after request forever."""
    from resin.core import contained

    engine = llm.engine
    engine.add_request("x", PROMPTS[0], _params()[1])
    engine.add_request("y", PROMPTS[1], _params()[1])
    monkeypatch.setattr(engine, "runner", _FailingRunnerAlways(engine.runner))
    monkeypatch.setattr(contained, "device_healthy", lambda device: False)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    monkeypatch.undo()
    engine.abort_all()
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


class _FailingRunnerAlways(_FailingRunner):
    def execute(self, batch):
        raise RuntimeError("device lost")


def test_final_only_outputs_are_built_once(llm, monkeypatch):
    """Whole responses (the server's non-streamed ones, LLM.generate) build their text once, at the end, not
    every step: O(length) per request, not O(length^2)."""
    from resin.core.detokenizer import IncrementalDetokenizer

    calls = {"n": 0}
    original = IncrementalDetokenizer.stable_text

    def counting(self, finished):
        calls["n"] += 1
        return original(self, finished)

    monkeypatch.setattr(IncrementalDetokenizer, "stable_text", counting)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 50 and calls["n"] == 1


def test_stream_with_n_follows_the_first_sequence(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=20, ignore_eos=True)
    streamed = "".join(llm.stream([4, 5, 6], params))
    whole = llm.generate([[4, 5, 6]], params, use_tqdm=False)[0]
    assert streamed == whole.outputs[0].text
