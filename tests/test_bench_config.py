"""How the benchmarks configure their peers: vLLM-CPU bound to every core, as its docs advise."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from engines import vllm_cpu_env  # noqa: E402

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("cpus, bind", [(1, "0-0"), (2, "0-1"), (64, "0-63")])
def test_vllm_threads_are_bound_to_every_core(cpus, bind):
    env = vllm_cpu_env(cpus)
    assert env == {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": "1"}


def test_structured_mask_bench_times_the_mask_at_a_steady_batch(text_model):
    """The bench's measurement is real: the mask and matcher time of constrained steps is seen (and none without a
    grammar to advance), at a full batch, and the wrapped functions are restored."""
    import resin.core.sampler as sampler_module
    from resin import LLM
    from resin.core.structured_output import Grammar, GrammarMask
    from structured_mask import run

    before = (sampler_module.grammar_mask, GrammarMask.apply, Grammar.accept)
    llm = LLM(str(text_model[0]), dtype="float32", kv_cache_memory="8MiB", max_num_seqs=4)
    with_grammar, without = run(llm, 4, 3, True), run(llm, 4, 3, False)
    assert with_grammar["steps_at_full_batch"] == 3 and with_grammar["mask_ms"] > 0
    assert with_grammar["advance_ms"] > 0 and 0 < with_grammar["mask_fraction"] < 1
    assert without["advance_ms"] == 0  # no matcher without a grammar
    assert (sampler_module.grammar_mask, GrammarMask.apply, Grammar.accept) == before
    assert not llm.engine.has_unfinished_requests()


def test_single_mode_measures_prefill_and_decode(text_model, tmp_path):
    """longctx.py's measurement: engines.py in single mode, with the options longctx.py passes (a longer
    max_model_len), reports the prefill and decode rates of the prompt it was given; its prompts are seeded and
    in range."""
    import json

    from compare import run_engine
    from longctx import random_prompt

    prompt = random_prompt(300, 500, seed=1)
    assert prompt == random_prompt(300, 500, seed=1) and all(100 <= t < 500 for t in prompt)
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([prompt]))
    r = run_engine(sys.executable, "resin", "float32", "single", 1, str(prompts), str(text_model[0]), "", 8,
                   extra=["--max-model-len", "400"])
    assert r["prompt_len"] == 300 and r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0


def test_serve_sweep_measures_each_point_on_its_own_prompts(tmp_path):
    """serve_sweep.py end to end without a vLLM venv (bench/serve.py's client against a real `resin run` of the
    built-in model): a median row per concurrency, every request answered in full, and the seed of each point
    differs, so no point finds the prompts of another in the prefix cache."""
    import json
    import subprocess

    out = tmp_path / "sweep.json"
    bench = Path(__file__).resolve().parent.parent / "bench"
    done = subprocess.run([sys.executable, str(bench / "serve_sweep.py"), "--concurrency", "1,2", "--rounds", "2",
                           "--waves", "1", "--min-prompts", "2", "--input-len", "8", "--output-len", "3",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [(m["server"], m["concurrency"], m["rounds"]) for m in result["medians"]] == [("resin", 1, 2),
                                                                                       ("resin", 2, 2)]
    assert all(r["output_throughput"] > 0 and r["median_ttft_ms"] > 0 for r in result["rows"])
    assert len(result["rows"]) == 4 and len({r["seed"] for r in result["rows"]}) == 4


def test_a_peer_that_crashes_is_reported_not_fatal(tmp_path):
    """A peer run that dies (llama.cpp's batched path took SIGILL on an AMX VM) raises EngineFailed naming the
    signal, and the medians skip failed runs (compare.py records the failure and goes on)."""
    import signal

    from compare import EngineFailed, median_of, ratio, run_engine

    crasher = tmp_path / "python"
    crasher.write_text("#!/bin/sh\nkill -ILL $$\n")
    crasher.chmod(0o755)
    with pytest.raises(EngineFailed, match=f"killed by signal {int(signal.SIGILL)}"):
        run_engine(str(crasher), "llamacpp", "q4_1", "batch", 4, "p.json", "m", "g.gguf", 8)
    runs = [{"decode_tok_s": 10.0}, {"failed": "x"}, {"decode_tok_s": 30.0}]
    assert median_of(runs, "decode_tok_s") == 20.0 and median_of([{"failed": "x"}], "decode_tok_s") is None
    assert ratio(3.0, 2.0) == "1.50x" and ratio(None, 2.0) == "n/a"


def test_step_profile_splits_decode_and_prefill_by_op(text_model):
    """step_profile's measurements are real and leave the engine as it was: decode steps and a prefill, each with
    every op's time; the provider chains and the attention backend's methods are restored afterwards."""
    from step_profile import profile, profile_prefill

    from resin import LLM
    from resin.hal import registry

    llm = LLM(str(text_model[0]), dtype="float32", kv_cache_memory="8MiB")
    chains, attn = registry.active_chains(), llm.engine.runner.attn
    row = profile(llm, 2, 3, per_op=True, prompt_len=12)
    assert row["step_ms"] > 0 and "attention (per layer)" in row["ops"] and "linear" in row["ops"]
    pre = profile_prefill(llm, 3, 20, reps=1)
    assert pre["prefill_tok_s"] > 0 and pre["ops"]["attention (per layer)"]["calls_per_step"] > 0
    assert registry.active_chains() == chains and "forward" not in vars(attn) and "plan" not in vars(attn)
    assert not llm.engine.has_unfinished_requests()


def test_compare_rejects_an_unknown_engine_key():
    """A mistyped --engines key stops the run with the choices named, instead of silently measuring fewer engines."""
    from compare import asked_engines

    configured = [("resin", "float32", "py"), ("llamacpp", "q4_1", "peer-py")]
    assert asked_engines("resin-gguf/float32,llamacpp/q4_1", configured, "py") == [
        ("resin-gguf", "float32", "py"), ("llamacpp", "q4_1", "peer-py")]
    with pytest.raises(SystemExit, match="not an engine/dtype key"):
        asked_engines("resin-gguf/fp16", configured, "py")
    with pytest.raises(SystemExit, match="needs --vllm-python"):
        asked_engines("vllm/float32", configured, "py")
