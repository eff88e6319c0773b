"""Mixture-of-experts families against transformers: logits at every step (fp32, 1e-3) and greedy tokens, in
mixed chunked batches, and the checkpoint's per-expert tensors landing in the stacked expert weights."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import save_tiny
from parity import LogitsRecorder, hf_greedy, run_and_compare
from resin import LLM
from resin.models.moe import SparseMoe
from resin.models.loader import load_model

pytestmark = pytest.mark.parity

MOE_ARCHS = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_model_matches_hf(arch, tmp_path):
    hf = save_tiny(tmp_path, arch, seed=random.randrange(1000))
    rec = LogitsRecorder()
    llm = LLM(str(tmp_path), dtype="float32", logits_observer=rec, kv_cache_memory="8MiB", max_num_batched_tokens=24)
    rng = random.Random()
    prompts = [[rng.randrange(211) for _ in range(n)] for n in (1, 5, 17, 33, 60)]
    outs = run_and_compare(llm, rec, hf, prompts, max_tokens=6)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 6)


def test_expert_weights_are_stacked_from_the_checkpoint(tmp_path):
    hf = save_tiny(tmp_path, "Qwen3MoeForCausalLM", seed=2)
    model = load_model(tmp_path, torch.float32, torch.device("cpu")).model
    moe = model.model.layers[0].mlp
    assert isinstance(moe, SparseMoe) and not isinstance(model.model.layers[1].mlp, SparseMoe)  # mlp_only_layers
    state = hf.state_dict()
    experts = [k for k in state if "layers.0.mlp.experts" in k]
    if any(".gate_up_proj" in k for k in experts):  # transformers keeps them stacked already
        ref13, ref2 = state["model.layers.0.mlp.experts.gate_up_proj"], state["model.layers.0.mlp.experts.down_proj"]
    else:
        e = moe.w13.shape[0]
        ref13 = torch.stack([torch.cat((state[f"model.layers.0.mlp.experts.{i}.gate_proj.weight"],
                                        state[f"model.layers.0.mlp.experts.{i}.up_proj.weight"])) for i in range(e)])
        ref2 = torch.stack([state[f"model.layers.0.mlp.experts.{i}.down_proj.weight"] for i in range(e)])
    assert torch.equal(moe.w13, ref13) and torch.equal(moe.w2, ref2)
