"""Helpers for the tensor-parallel tests: the prompts, and TP=2 against TP=1 on one folder."""
from __future__ import annotations

from pathlib import Path

from parity import LogitsRecorder
from resin import LLM, SamplingParams

PROMPTS = [[1, 5, 9, 13, 2, 7], list(range(3, 40)), [7, 7, 8, 9, 10] * 6, list(range(3, 40))]  # last: prefix hit


def run_tp(folder: Path, tp: int, ep: bool = False):
    rec = LogitsRecorder()
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", tensor_parallel_size=tp,
              enable_expert_parallel=ep, max_num_batched_tokens=24, logits_observer=rec)  # chunked prefills
    try:
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=2)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return outs, rec, llm.rank_weight_bytes
    finally:
        llm.shutdown()


def greedy_tp2_equals_tp1(folder: Path, **engine) -> dict[int, list[int]]:
    """Asserts TP=2's greedy tokens and logits (1e-4) equal TP=1's; returns each run's per-rank weight bytes."""
    outs, weight_bytes = {}, {}
    for tp in (1, 2):
        rec = LogitsRecorder()
        llm = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", tensor_parallel_size=tp,
                  logits_observer=rec, **engine)
        outs[tp] = (llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                 use_tqdm=False), rec)
        weight_bytes[tp] = list(llm.rank_weight_bytes)
        llm.shutdown()
    for a, b in zip(outs[1][0], outs[2][0]):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert (outs[2][1].of(b.request_id) - outs[1][1].of(a.request_id)).abs().max().item() <= 1e-4
    return weight_bytes
