"""A tiny model end to end on the GPU backend (bf16, graphs on and off) against the cpu backend in fp32.

Bounds: bf16 weights and activations move logits of these random tiny models by well under 0.1 (their spread is
~1); greedy top-1 must agree on >= 90% of steps (bf16 may flip near-ties); graph replay must give the eager
path's logits within bf16 rounding (the padded bucket may pick another split-K count)."""
from __future__ import annotations

import random

import pytest

from conftest import save_tiny
from parity import LogitsRecorder
from resin import LLM, SamplingParams

pytestmark = [pytest.mark.parity, pytest.mark.requires_gpu]


def _run(folder, prompts, backend, dtype, graphs=True, ops=None):
    rec = LogitsRecorder()
    llm = LLM(str(folder), backend=backend, dtype=dtype, kv_cache_memory="64MiB", logits_observer=rec,
              max_num_seqs=8, enable_graphs=graphs, ops=ops)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs], [rec.of(o.request_id) for o in outs]


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"])
def test_gpu_bf16_matches_cpu_fp32_and_graphs_match_eager(gpu_device, tmp_path, arch):
    save_tiny(tmp_path, arch, seed=11, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
              head_dim=32, hidden_size=128)
    rng = random.Random()
    prompts = [[rng.randrange(211) for _ in range(n)] for n in (5, 33, 1, 70, 12)]
    _, cpu_tokens, cpu_logits = _run(tmp_path, prompts, "cpu", "float32")
    # the graph-safe attention provider, so decode graphs are captured whatever else is installed (aiter's
    # attention runs eagerly)
    llm, gpu_tokens, gpu_logits = _run(tmp_path, prompts, "auto", "bfloat16", ops="attention=triton")
    assert llm.selection.platform.kind in ("cuda", "rocm")
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.replays > 0
    agree = total = 0
    for c_tok, g_tok, c_log, g_log in zip(cpu_tokens, gpu_tokens, cpu_logits, gpu_logits):
        steps = min(len(c_tok), len(g_tok))
        # teacher forcing differs once tokens diverge; compare logits up to the first divergence
        same = next((i for i in range(steps) if c_tok[i] != g_tok[i]), steps)
        n = max(1, same)
        assert (g_log[:n].float().cpu() - c_log[:n]).abs().max().item() <= 0.1
        agree += sum(a == b for a, b in zip(c_tok, g_tok))
        total += steps
    assert agree / total >= 0.9

    _, eager_tokens, eager_logits = _run(tmp_path, prompts, "auto", "bfloat16", graphs=False, ops="attention=triton")
    for g_log, e_log in zip(gpu_logits, eager_logits):
        assert (g_log.float() - e_log.float()).abs().max().item() <= 2e-2
    assert eager_tokens == gpu_tokens
