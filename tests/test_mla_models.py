"""DeepSeek-V2/V3 against transformers: multi-head latent attention over a latent cache (the cpu provider: decodes
absorbed, fresh prompts expanded, chunks after context as expanded_prefill_pays says), in config variants (with and
without the query bottleneck, rotary in halves or interleaved, with and without YaRN, q/k/v bias, greedy or grouped
routing) through the paged cache, in mixed chunked batches, past the original context; the cache's size per token
and the capacity the startup log reports; the MTP layers left out, said so."""
from __future__ import annotations

import json
import logging
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import save_tiny
from parity import LogitsRecorder, hf_greedy, run_and_compare
from resin import LLM, SamplingParams
from resin.core.cache_layout import plan_cache_layout
from resin.hal import mla_layer
from resin.models.loader import load_model

pytestmark = pytest.mark.parity

VARIANTS = {
    "v3-rotary-in-halves": ("DeepseekV3ForCausalLM", dict(rope_interleave=False)),
    "v3-no-query-bottleneck-with-bias": ("DeepseekV3ForCausalLM", dict(q_lora_rank=None, attention_bias=True)),
    "v3-no-yarn-one-group": ("DeepseekV3ForCausalLM", dict(rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 10000.0},
                                                           n_group=1, topk_group=1, norm_topk_prob=False)),
    "v2-greedy-bottleneck": ("DeepseekV2ForCausalLM", dict(topk_method="greedy", q_lora_rank=16)),
    "v2-yarn-without-mscale": ("DeepseekV2ForCausalLM", dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 48})),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_matches_hf_past_the_original_context(variant, tmp_path):
    arch, overrides = VARIANTS[variant]
    hf = save_tiny(tmp_path, arch, seed=random.randrange(1000), **overrides)
    rec = LogitsRecorder()
    # chunked prefills beside decodes; strict: the startup self-check may not drop the provider under test
    llm = LLM(str(tmp_path), dtype="float32", logits_observer=rec, kv_cache_memory="8MiB",
              max_num_batched_tokens=40, self_check="strict")
    rng = random.Random()
    # the tiny configs' YaRN extends 64 (or 48) original positions; 150 + 6 runs well past them
    prompts = [[rng.randrange(211) for _ in range(n)] for n in (2, 19, 70, 150)]
    outs = run_and_compare(llm, rec, hf, prompts, max_tokens=6)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 6)


def test_latent_cache_holds_one_row_per_token_and_layer(tmp_path, caplog):
    save_tiny(tmp_path, "DeepseekV3ForCausalLM", seed=1)  # 3 layers, kv_lora_rank 24 + 8 rotary dims
    with caplog.at_level(logging.INFO, logger="resin"):
        llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory="8MiB")
    layout = llm.engine.layout
    assert layout.page_bytes == 3 * 16 * (24 + 8) * 4  # layers x block x (L + R) x fp32: no per-head K or V
    cache = llm.engine.runner.kv_caches[0]
    assert cache.shape[1:] == (16, 1, 32)
    # expanded, each token would take 4 heads x (16 + 8 + 12) x 4 bytes per layer: 4.5x the latent row
    assert "latent attention (MLA): 3 layers, 384 bytes/token, 4.5x the tokens K and V expanded to every head " \
           "would hold (1728 bytes/token)" in caplog.text
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_capacity_of_a_deepseek_v3_shaped_cache():
    """DeepSeek-V3: 128 heads of (128 + 64) query/key and 128 value dims, a 512 latent + 64 rotary dims cached,
    61 layers in bf16: 70,272 bytes a token against ~5.0 MB expanded, 71.1x the tokens in the same memory."""
    layers = [mla_layer(128, 512, 64, 128, 128, 192 ** -0.5) for _ in range(61)]
    layout = plan_cache_layout(layers, 64, torch.bfloat16)
    assert layout.page_bytes == 61 * 64 * 576 * 2
    (line,) = layout.describe(layers, torch.bfloat16)
    assert line == ("latent attention (MLA): 61 layers, 70272 bytes/token, 71.1x the tokens K and V expanded to "
                    "every head would hold (4997120 bytes/token)")


def test_mtp_layers_are_read_over_and_named(tmp_path, caplog):
    """V3 checkpoints carry their multi-token-prediction layer as model.layers.<num_hidden_layers>: loaded over,
    ignored, and the log says so; any other unknown tensor is still an error."""
    save_tiny(tmp_path, "DeepseekV3ForCausalLM", seed=2)
    weights = load_file(tmp_path / "model.safetensors")
    extra = {k.replace("model.layers.2.", "model.layers.3."): v.clone()
             for k, v in weights.items() if ".layers.2." in k}
    extra["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file({**weights, **extra}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="resin.loader"):
        loaded = load_model(tmp_path, torch.float32, torch.device("cpu"))
    assert len(loaded.model.model.layers) == 3
    assert f"{len(extra)} checkpoint tensor(s) not loaded: multi-token-prediction layers (model.layers.3 and on)" \
        in caplog.text
    save_file({**weights, "model.layers.1.self_attn.stray.weight": torch.zeros(2)}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="stray.weight"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "longrope"}])
def test_unsupported_rope_scaling_names_the_supported_ones(rope, tmp_path):
    save_tiny(tmp_path, "LlamaForCausalLM", seed=3)
    config = tmp_path / "config.json"
    c = json.loads(config.read_text())
    c["rope_parameters"] = {**rope, "rope_theta": 10000.0}
    config.write_text(json.dumps(c))
    with pytest.raises(ValueError, match=rf"'{rope['rope_type']}' is not supported.*default.*linear.*llama3.*yarn"):
        LLM(str(tmp_path), dtype="float32", kv_cache_memory="8MiB")
