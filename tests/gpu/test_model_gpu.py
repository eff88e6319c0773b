"""A tiny model end to end on the GPU backend (fp32 and bf16, graphs on and off) against the cpu backend in fp32.

The checkpoint's weights are rounded to bf16 values first, so a bf16 run differs from fp32 in its activations
only. Bounds: fp32 on the GPU is the parity gate's (max |logit diff| <= 1e-3, tokens equal). bf16 activations
move the dense models' logits by well under 0.1 (their spread is ~1), but MoE routing and recurrent state amplify
bf16 rounding: transformers' own bf16 run of the same weights moves GPT-OSS and Qwen3-Next logits by up to
~0.35 and ~1 (measured on the cpu). So the bf16 bound is the larger of 0.1 and 1.5x the deviation of
transformers' bf16 run on the same GPU and sequences, checked through the first step where the greedy tokens differ (bf16 may flip a near-tie,
after which the prefixes differ). Graph replay gives the eager path's logits within bf16 rounding of their size
(the padded bucket may pick another split-K count)."""
from __future__ import annotations

import copy
import random

import pytest
import torch

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


def _hf_bf16_deviation(hf, prompts, tokens, cpu_logits, device) -> float:
    """How far transformers' bf16 run of the model on this GPU (its GEMMs, their reduced-precision reductions)
    moves the fp32 logits on these sequences, at most."""
    hb = copy.deepcopy(hf).to(device=device, dtype=torch.bfloat16)
    worst = 0.0
    with torch.no_grad():
        for p, t, c in zip(prompts, tokens, cpu_logits):
            logits = hb(torch.tensor([p + t], device=device)).logits[0, len(p) - 1:len(p) - 1 + len(t)]
            worst = max(worst, (logits.float().cpu() - c).abs().max().item())
    return worst


# per family: what makes its layers differ (windows + soft-cap, sinks + biased experts, recurrent state)
SHAPES = {"Gemma2ForCausalLM": dict(sliding_window=16), "GptOssForCausalLM": dict(sliding_window=16),
          "Qwen3NextForCausalLM": dict(layer_types=["linear_attention", "linear_attention", "full_attention"])}


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM", "GptOssForCausalLM",
                                  "Qwen3NextForCausalLM"])
def test_gpu_matches_cpu_fp32_and_graphs_match_eager(gpu_device, tmp_path, arch):
    hf = save_tiny(tmp_path, arch, seed=11, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                   head_dim=32, hidden_size=128, **SHAPES.get(arch, {}))
    with torch.no_grad():  # bf16-representable weights
        for p in hf.parameters():
            p.copy_(p.bfloat16().float())
    hf.save_pretrained(tmp_path, safe_serialization=True)
    rng = random.Random()
    prompts = [[rng.randrange(211) for _ in range(n)] for n in (5, 33, 1, 70, 12)]
    _, cpu_tokens, cpu_logits = _run(tmp_path, prompts, "cpu", "float32")
    llm, fp32_tokens, fp32_logits = _run(tmp_path, prompts, "auto", "float32", ops="attention=triton")
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.replays > 0
    assert fp32_tokens == cpu_tokens
    for c_log, g_log in zip(cpu_logits, fp32_logits):
        assert (g_log.float().cpu() - c_log).abs().max().item() <= 1e-3
    # the graph-safe attention provider, so decode graphs are captured whatever else is installed (aiter's
    # attention runs eagerly)
    llm, gpu_tokens, gpu_logits = _run(tmp_path, prompts, "auto", "bfloat16", ops="attention=triton")
    assert llm.selection.platform.kind in ("cuda", "rocm")
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.replays > 0
    bound = max(0.1, 1.5 * _hf_bf16_deviation(hf, prompts, cpu_tokens, cpu_logits, gpu_device))
    for c_tok, g_tok, c_log, g_log in zip(cpu_tokens, gpu_tokens, cpu_logits, gpu_logits):
        steps = min(len(c_tok), len(g_tok))
        # Both runs see the same prefix up to and including the first step where their tokens differ, so the
        # logits are compared through that step: a flip is allowed only where the bound makes it a near-tie.
        same = next((i for i in range(steps) if c_tok[i] != g_tok[i]), steps - 1)
        diff = (g_log[:same + 1].float().cpu() - c_log[:same + 1]).abs().max().item()
        assert diff <= bound, f"max |logit diff| {diff:.3f} over the first {same + 1} steps (bound {bound:.3f})"

    _, eager_tokens, eager_logits = _run(tmp_path, prompts, "auto", "bfloat16", graphs=False, ops="attention=triton")
    for g_log, e_log in zip(gpu_logits, eager_logits):
        e_log = e_log.float()
        assert ((g_log.float() - e_log).abs() <= 2e-2 + 2 ** -7 * e_log.abs()).all()
    assert eager_tokens == gpu_tokens
