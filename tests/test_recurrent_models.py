"""Families with a recurrent state per sequence (Qwen3-Next's Gated DeltaNet layers): parity across shapes, state
slots given and taken back, n > 1 siblings, the startup report, and a budget too small for the slots."""
from __future__ import annotations

import logging
import random

import pytest

from conftest import save_tiny
from parity import LogitsRecorder, hf_greedy, run_and_compare
from resin import LLM, SamplingParams

pytestmark = pytest.mark.parity

ARCH = "Qwen3NextForCausalLM"

SHAPES = [
    # one value head per key head, conv width 2, half the head rotated, MQA, tied embeddings, dense MLPs only
    dict(linear_num_key_heads=2, linear_num_value_heads=2, linear_conv_kernel_dim=2, head_dim=32,
         num_attention_heads=2, num_key_value_heads=1, partial_rotary_factor=0.5, tie_word_embeddings=True,
         num_experts=0, num_hidden_layers=3, layer_types=["full_attention", "linear_attention", "linear_attention"]),
    # three value heads per key head, wider key heads, full attention in the middle, MoE on every layer
    dict(linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=16, linear_value_head_dim=8,
         num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
         mlp_only_layers=[]),
]


def prompts_of(lengths, seed):
    rng = random.Random(seed)
    return [[rng.randrange(211) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_shapes_match_hf_through_chunks_and_mixed_batches(shape, tmp_path):
    hf = save_tiny(tmp_path, ARCH, seed=shape + 5, **SHAPES[shape])
    rec = LogitsRecorder()
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=16,
              logits_observer=rec)
    outs = run_and_compare(llm, rec, hf, prompts_of([2, 37, 11, 20], seed=shape), max_tokens=5)
    assert len(llm.engine.kv.free_state_slots) == llm.engine.config.max_num_seqs  # every slot came back
    assert all(o.outputs[0].token_ids == hf_greedy(hf, p, 5) for p, o in zip(prompts_of([2, 37, 11, 20], shape),
                                                                             outs))


def computed_tokens(llm) -> list[int]:
    """Counts the tokens each step computes (the runner's batches)."""
    counts, execute = [], llm.engine.runner.execute
    llm.engine.runner.execute = lambda batch: counts.append(batch.total_tokens) or execute(batch)
    return counts


def test_siblings_fork_their_parents_state(tmp_path, caplog):
    """n = 3 sequences of one prompt: prefix caching is off, so the siblings fork from sequence 0 once it has
    computed the prompt (blocks shared, partial block and state copied): the prompt is computed once. Greedy
    siblings agree with transformers; sampled ones differ from each other and replay by seed."""
    hf = save_tiny(tmp_path, ARCH, seed=2)
    with caplog.at_level(logging.INFO):
        llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory="8MiB", max_num_seqs=8)
    assert "prefix caching off: 3 of the model's layers keep a recurrent state" in caplog.text
    assert "recurrent state: 3 layers, 7488 bytes per sequence, 9 slots" in caplog.text
    counts = computed_tokens(llm)
    prompt = prompts_of([29], seed=4)[0]  # one full block of 16 shared, the partial one copied
    greedy = llm.generate([prompt], SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)[0]
    want = hf_greedy(hf, prompt, 6)
    assert [c.token_ids for c in greedy.outputs] == [want] * 3
    assert sum(counts) == 29 + 3 * 5  # the prompt once, then each sibling's 5 decode steps
    sampled = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    first = [c.token_ids for c in llm.generate([prompt], sampled, use_tqdm=False)[0].outputs]
    again = [c.token_ids for c in llm.generate([prompt], sampled, use_tqdm=False)[0].outputs]
    assert first == again and len({tuple(t) for t in first}) > 1
    assert len(llm.engine.kv.free_state_slots) == 8 and llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks


def test_a_sibling_without_a_free_slot_recomputes_the_prompt(tmp_path):
    """max_num_seqs=2: the parent and one forked sibling hold both state slots, so the third sibling waits for
    one and computes the prompt itself; every sibling still matches transformers."""
    hf = save_tiny(tmp_path, ARCH, seed=3)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory="8MiB", max_num_seqs=2)
    counts = computed_tokens(llm)
    prompt = prompts_of([21], seed=6)[0]
    out = llm.generate([prompt], SamplingParams(n=3, temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [hf_greedy(hf, prompt, 4)] * 3
    assert sum(counts) == 2 * 21 + 3 * 3
    assert len(llm.engine.kv.free_state_slots) == 2


def test_a_budget_below_the_state_slots_is_a_clear_error(tmp_path):
    save_tiny(tmp_path, ARCH, seed=1)
    with pytest.raises(ValueError, match="recurrent state of max_num_seqs=256 sequences .* lower max_num_seqs"):
        LLM(str(tmp_path), dtype="float32", kv_cache_memory="1MiB")


def test_a_fresh_sequence_never_sees_a_reused_slots_state(tmp_path):
    """Slots are reused: a sequence that starts in one (here a one-token prompt, which runs as a decode-only
    batch through the single-token update ops) must start from zeros, not from the last owner's state."""
    hf = save_tiny(tmp_path, ARCH, seed=2)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory="8MiB", max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for prompt in (prompts_of([12], seed=7)[0], [42], [7], prompts_of([5], seed=9)[0]):
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 4)


def test_a_failed_step_recomputes_the_sequences_that_continued_a_state(tmp_path):
    """A batch fails after every Gated DeltaNet layer has updated its states: retrying a decoding sequence alone
    would apply its token twice, so it computes again from the start instead (as after preemption); the fresh
    one is retried alone. Both still equal transformers and neither reports an error."""
    hf = save_tiny(tmp_path, ARCH, seed=5)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory="8MiB")
    engine = llm.engine
    norm = engine.runner.model.model.norm  # the last module of the forward
    forward, armed = norm.forward, {"on": False}

    def failing(x, residual=None):
        if armed["on"] and x.shape[0] > 1:
            armed["on"] = False
            raise RuntimeError("injected fault after the recurrent layers")
        return forward(x, residual)
    norm.forward = failing
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a, b = prompts_of([9, 14], seed=8)
    engine.add_request("a", a, params)
    engine.step()
    engine.step()  # a now continues its state one token a step
    engine.add_request("b", b, params)
    armed["on"] = True
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert not armed["on"]  # the fault fired, in a batch of a's decode and b's prompt
    assert outs["a"].error is None and outs["b"].error is None
    assert outs["a"].outputs[0].token_ids == hf_greedy(hf, a, 6)
    assert outs["b"].outputs[0].token_ids == hf_greedy(hf, b, 6)


def test_waiting_forks_give_way_when_nothing_else_can_free_blocks():
    """A request at the head of the queue needs blocks that forked siblings waiting behind it hold, and nothing
    is running: the scheduler frees the forks (they will recompute) instead of stalling for ever."""
    from resin.core.kv_cache_manager import KVCacheManager
    from resin.core.request import Request
    from resin.core.scheduler import Scheduler

    kv = KVCacheManager(10, 16, enable_prefix_caching=False, num_state_slots=2)
    scheduler = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=2048)
    params = SamplingParams(n=2, max_tokens=20, ignore_eos=True)
    prompt = list(range(100))
    parent, sibling, big = (Request(f"{rid}#{i}", list(p), params, 20, frozenset(), None, parent_id=rid, index=i)
                            for rid, i, p in (("r", 0, prompt), ("r", 1, prompt), ("x", 0, list(range(150)))))
    scheduler.add(parent)
    batch = scheduler.schedule()
    parent.num_computed_tokens += batch.num_new_tokens[0]
    for r in (parent, sibling):
        r.token_ids.append(1)
    assert kv.fork(parent, sibling) is not None  # 6 shared blocks + a copied partial one, a slot
    scheduler.finish(parent)
    scheduler.add_front(sibling)
    scheduler.add_front(big)  # say, preempted earlier: 10 blocks, but the fork pins 7
    batch = scheduler.schedule()
    assert batch.requests == [big] and not sibling.block_ids and sibling.num_computed_tokens == 0
