"""The design's correctness gate: Resin's logits equal transformers' (fp32, max |diff| <= 1e-3) at prefill and
every decode step, through the paged cache, batched with requests of other lengths; greedy tokens equal
transformers' generate; prefix-cache hits and preemption change nothing."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import ARCHS, MLA_ARCHS, RECURRENT_ARCHS, save_tiny
from parity import LogitsRecorder, hf_greedy, hf_logits, run_and_compare
from resin import LLM, SamplingParams

pytestmark = pytest.mark.parity

TOL = 1e-3


def prompts_of(lengths, vocab, seed):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def make_llm(folder, rec, **kw):
    kw.setdefault("kv_cache_memory", "8MiB")
    return LLM(str(folder), dtype="float32", logits_observer=rec, **kw)


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_chunked_prefill_matches_hf(arch, tiny_models):
    folder, hf = tiny_models[arch]
    rec = LogitsRecorder()
    # a small token budget forces chunked prefill; lengths differ so decodes and prefill chunks share steps
    llm = make_llm(folder, rec, max_num_batched_tokens=24)
    prompts = prompts_of([1, 5, 17, 33, 70], 211, seed=random.randrange(1 << 30))
    outs = run_and_compare(llm, rec, hf, prompts, max_tokens=6, tol=TOL)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 6)


CONFIGS = [
    dict(num_attention_heads=6, num_key_value_heads=1, head_dim=20, hidden_size=48),  # MQA, odd head size
    dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16, tie_word_embeddings=True, vocab_size=173),
    dict(num_attention_heads=8, num_key_value_heads=2, head_dim=12, num_hidden_layers=3,
         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 32}, rope_theta=500000.0),
]


@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in RECURRENT_ARCHS + MLA_ARCHS])  # theirs: own files
@pytest.mark.parametrize("cfg_idx", range(len(CONFIGS)))
def test_config_shapes_match_hf(arch, cfg_idx, tmp_path):
    overrides = dict(CONFIGS[cfg_idx])
    if arch != "LlamaForCausalLM" and "rope_scaling" in overrides:
        overrides.pop("rope_scaling")  # llama3 scaling is a Llama feature; keep the other shape changes
    hf = save_tiny(tmp_path, arch, seed=cfg_idx + 1, **overrides)
    rec = LogitsRecorder()
    llm = make_llm(tmp_path, rec, max_num_batched_tokens=32)
    vocab = overrides.get("vocab_size", 211)
    run_and_compare(llm, rec, hf, prompts_of([3, 40, 9], vocab, seed=cfg_idx), max_tokens=5, tol=TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_hit_gives_cold_logits(arch, tiny_models):
    folder, hf = tiny_models[arch]
    rec = LogitsRecorder()
    llm = make_llm(folder, rec)
    shared = prompts_of([48], 211, seed=7)[0]
    first = llm.generate([shared + [1, 2, 3]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    stats = llm.engine.prefix_cache_stats
    hits_before = stats.hit_blocks
    second_prompt = shared + [9, 8, 7, 6]
    outs = run_and_compare(llm, rec, hf, [second_prompt], max_tokens=4, tol=TOL)
    cached = 0 if arch in RECURRENT_ARCHS else 48  # recurrent state is not in cached blocks: caching is off
    assert stats.hit_blocks - hits_before == cached // 16  # 48 shared tokens = 3 full blocks of 16
    assert outs[0].metrics["num_cached_tokens"] == cached
    assert first.finished


@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_then_resume_gives_same_tokens(arch, tiny_models):
    folder, hf = tiny_models[arch]
    prompts = prompts_of([30, 25, 20, 35], 211, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy_llm = LLM(str(folder), dtype="float32", kv_cache_memory="8MiB")
    roomy = roomy_llm.generate(prompts, params, use_tqdm=False)
    page = roomy_llm.engine.layout.page_bytes  # one block of every layer of a cache group
    states = sum(layer.bytes_per_sequence(torch.float32) for layer in getattr(roomy_llm.engine.runner.model,
                                                                               "recurrent_layers", []))
    rec = LogitsRecorder()
    # 12 pages and the null page: not all four at once (and recurrent state slots for 4 sequences and a scratch)
    tight = make_llm(folder, rec, kv_cache_memory=page * 13 + states * 5, max_num_seqs=4)
    outs = run_and_compare(tight, rec, hf, prompts, max_tokens=24, tol=TOL)
    assert tight.engine.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logprobs_equal_hf_log_softmax(arch, tiny_models):
    folder, hf = tiny_models[arch]
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=16)  # chunked prompt
    prompt = prompts_of([37], 211, seed=11)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    ref = torch.log_softmax(hf_logits(hf, prompt), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        tok = prompt[pos]
        assert abs(entry[tok].logprob - ref[pos - 1, tok].item()) <= TOL
        assert entry[tok].rank == int((ref[pos - 1] > ref[pos - 1, tok]).sum()) + 1
        top = torch.topk(ref[pos - 1], 3)
        for val, tid in zip(top.values.tolist(), top.indices.tolist()):
            assert abs(entry[tid].logprob - val) <= TOL


def test_batch_invariance_of_greedy_output(tiny_models):
    folder, _ = tiny_models["Qwen3ForCausalLM"]
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=40)
    target = prompts_of([21], 211, seed=5)[0]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
    crowd = prompts_of([3, 50, 8, 33, 12], 211, seed=6)
    together = llm.generate(crowd[:2] + [target] + crowd[2:], params, use_tqdm=False)[2].outputs[0].token_ids
    assert alone == together


def test_sharded_checkpoint_loads(tmp_path):
    hf = save_tiny(tmp_path / "src", "LlamaForCausalLM", seed=9)
    hf.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    rec = LogitsRecorder()
    llm = make_llm(tmp_path / "sharded", rec)
    run_and_compare(llm, rec, hf, prompts_of([12, 4], 211, seed=1), max_tokens=3, tol=TOL)


def test_prompt_logprobs_survive_preemption(tiny_models):
    folder, hf = tiny_models["LlamaForCausalLM"]
    c = hf.config
    per_block = c.num_hidden_layers * 2 * 16 * c.num_key_value_heads * c.head_dim * 4
    llm = LLM(str(folder), dtype="float32", kv_cache_memory=per_block * 12)
    prompts = prompts_of([30, 25, 20, 35], 211, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=0 if i == 3 else None)
              for i in range(4)]
    out = llm.generate(prompts, params, use_tqdm=False)[3]
    assert llm.engine.num_preemptions > 0
    assert len(out.prompt_logprobs) == len(prompts[3])
    ref = torch.log_softmax(hf_logits(hf, prompts[3]), dim=-1)
    for pos in range(1, len(prompts[3])):
        tok = prompts[3][pos]
        assert abs(out.prompt_logprobs[pos][tok].logprob - ref[pos - 1, tok].item()) <= TOL
