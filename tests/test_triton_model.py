"""The GPU backends' code path end to end, on the cpu: a tiny model whose ops run the shared Triton kernels in
Triton's interpreter, with decode steps captured per batch bucket and replayed (the native capture_graph replays
eagerly, so bucketing, padding with the scratch block, static buffers and plan_for_replay are what is tested).
Logits must match transformers' (fp32, the parity gate's 1e-3) and greedy tokens its generate."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import KERNEL_DEVICE, save_tiny
from parity import LogitsRecorder, hf_greedy, hf_logits
from resin import SamplingParams, hal
from resin.backends.triton import providers  # noqa: F401  (registers the "triton" providers)
from resin.core.config import EngineConfig
from resin.core.engine import LLMEngine
from resin.core.self_check import run_self_check
from resin.hal.registry import activate_chains, all_ops, deactivate
from resin.models.loader import load_model

pytestmark = pytest.mark.kernels


@pytest.fixture
def triton_ops():
    """Every op with a triton provider runs it (native only behind it), as `--backend cuda` would."""
    activate_chains({name: tuple(op.providers[p] for p in ("triton", "native") if p in op.providers)
                     for name, op in all_ops().items()})
    yield
    deactivate()


EXTRA = {"Qwen3NextForCausalLM": dict(layer_types=["linear_attention", "full_attention"])}


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM",
                                  "Qwen3NextForCausalLM", "GptOssForCausalLM"])
def test_tiny_model_on_triton_kernels_with_decode_graphs(tmp_path, triton_ops, arch):
    hf = save_tiny(tmp_path, arch, seed=3, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                   head_dim=16, hidden_size=48, **EXTRA.get(arch, {}))
    loaded = load_model(tmp_path, torch.float32, KERNEL_DEVICE)
    rec = LogitsRecorder()
    config = EngineConfig(max_model_len=128, max_num_seqs=6, max_num_batched_tokens=40, graphs=True,
                          max_graph_batch=4)
    engine = LLMEngine(loaded.model, config, loaded.model.config.vocab_size, torch.float32, KERNEL_DEVICE,
                       num_blocks=24, logits_observer=rec)
    graphs = engine.runner.graphs
    assert type(engine.runner.attn).__name__ == "TritonAttention" and graphs is not None
    if arch == "Gemma2ForCausalLM":  # a sliding-window group and a full one, each with its own tables in graphs
        assert len(engine.runner.attns) == 2 and engine.runner.attns[0].layers[0].sliding_window == 12
    if arch in ("Qwen3MoeForCausalLM", "GptOssForCausalLM"):  # routing and experts run the triton MoE kernels too
        # (GPT-OSS: expert biases and the clamped SwiGLU; its attention has sinks)
        assert hal.MOE_ROUTE.providers["triton"] in hal.registry._ACTIVE["moe_route"]
    if arch == "Qwen3NextForCausalLM":  # the Gated DeltaNet layer's conv and delta rule run their triton kernels,
        # captured decode steps carry each row's state slot
        for op in (hal.CAUSAL_CONV1D, hal.CAUSAL_CONV1D_UPDATE, hal.GATED_DELTA_RULE):
            assert hal.registry._ACTIVE[op.name][0] is op.providers["triton"]
        assert len(engine.runner.states) == 1
    assert graphs.buckets == [1, 2, 4]
    assert engine.runner.graphs_match_eager() is None  # the start-up check of capture itself

    rng = random.Random()
    prompts = [[rng.randrange(211) for _ in range(n)] for n in (3, 17, 9, 30, 1)]
    max_tokens = 6
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
    assert graphs.replays > 0  # decode batches of <= 4 replayed; the 5-wide ones ran eagerly

    # then a one-token prompt alone: every step of it is a decode-only batch, replayed from a graph from its first
    # token on (a recurrent model's reused state slot must start from zeros there too)
    prompts.append([42])
    replays = graphs.replays
    engine.add_request(str(len(prompts) - 1), prompts[-1], params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
    assert graphs.replays == replays + max_tokens

    for i, prompt in enumerate(prompts):
        got = tokens[str(i)]
        ref = hf_logits(hf, prompt + got)[len(prompt) - 1:len(prompt) - 1 + max_tokens]
        diff = (rec.of(str(i)).cpu() - ref).abs().max().item()
        assert diff <= 1e-3, f"prompt {i}: max |logit diff| {diff:.2e}"
        assert got == hf_greedy(hf, prompt, max_tokens)


def test_graphs_stay_off_when_a_chosen_provider_cannot_be_captured(tmp_path, triton_ops, caplog):
    """The native fused_moe loops over the experts present (a host sync), so with it first in the chain the
    runner must not capture, and must say why."""
    save_tiny(tmp_path, "Qwen3MoeForCausalLM", seed=4, num_hidden_layers=1, mlp_only_layers=[])
    loaded = load_model(tmp_path, torch.float32, KERNEL_DEVICE)
    chains = dict(hal.registry._ACTIVE)
    chains["fused_moe"] = (hal.FUSED_MOE.providers["native"],)
    activate_chains(chains)
    config = EngineConfig(max_model_len=64, max_num_seqs=2, graphs=True, max_graph_batch=2)
    with caplog.at_level("WARNING", logger="resin.runner"):
        engine = LLMEngine(loaded.model, config, loaded.model.config.vocab_size, torch.float32, KERNEL_DEVICE,
                           num_blocks=8)
    assert engine.runner.graphs is None
    assert "op fused_moe: no graph-safe provider takes this call" in caplog.text


class EagerOnlyAttention(hal.NativeAttention):
    """Stands in for aiter's unified attention (not graph-safe) on a faked gfx942: correct, and counted."""
    forwards = 0

    def forward(self, *args, **kwargs):
        EagerOnlyAttention.forwards += 1
        return super().forward(*args, **kwargs)


def test_decode_graphs_stay_on_with_aiter_first_on_a_faked_gfx942(tmp_path, caplog):
    """The rocm table with aiter importable puts aiter's attention (not graph-safe) first. Eager steps must use it,
    captured decode steps the Triton kernel behind it, and the tokens must still be transformers'."""
    from resin.hal.registry import Provider

    sel = hal.describe_backend("rocm", arch="gfx942", libraries=frozenset({"aiter", "triton"}))
    fakes = {"attention": EagerOnlyAttention}  # every other aiter provider: its op's native math, graph-safe
    chains = {name: tuple(Provider("aiter", fakes.get(name, all_ops()[name].native), graph_safe=p.graph_safe)
                          if p.name == "aiter" else p for p in choice.chain)
              for name, choice in sel.table.items()}
    chains["capture_graph"] = (all_ops()["capture_graph"].providers["native"],)  # no GPU: "graphs" replay eagerly
    assert not chains["attention"][0].graph_safe and chains["attention"][1].name == "triton"
    activate_chains(chains)
    try:
        hf = save_tiny(tmp_path, "Qwen3ForCausalLM", seed=5, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, hidden_size=32)
        loaded = load_model(tmp_path, torch.float32, KERNEL_DEVICE)
        config = EngineConfig(max_model_len=64, max_num_seqs=4, graphs=True, max_graph_batch=4)
        with caplog.at_level("INFO", logger="resin.runner"):
            engine = LLMEngine(loaded.model, config, loaded.model.config.vocab_size, torch.float32, KERNEL_DEVICE,
                               num_blocks=16)
        runner = engine.runner
        assert isinstance(runner.attn, EagerOnlyAttention) and runner.graphs is not None
        # the self-check covers both: aiter's attention for eager steps, the Triton kernel for captured ones
        report = run_self_check(loaded.model, torch.float32, KERNEL_DEVICE, 16, "strict")
        assert {("attention", "aiter"), ("attention", "triton")} <= {(c.op, c.provider) for c in report.checks}
        assert type(runner.graphs.attns[0]).__name__ == "TritonAttention"
        assert "attention: EagerOnlyAttention eagerly, TritonAttention in graphs" in caplog.text
        EagerOnlyAttention.forwards = 0
        prompts = [[7, 3, 9, 1], [4, 4, 8, 2, 6, 1, 3]]
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] = out.outputs[0].token_ids
        assert runner.graphs.replays > 0 and EagerOnlyAttention.forwards > 0  # both paths served steps
        for i, prompt in enumerate(prompts):
            assert tokens[str(i)] == hf_greedy(hf, prompt, 5)
    finally:
        deactivate()


def test_triton_providers_pass_the_startup_self_check(tmp_path, triton_ops):
    save_tiny(tmp_path, "Qwen3MoeForCausalLM", seed=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              hidden_size=32)
    loaded = load_model(tmp_path, torch.float32, KERNEL_DEVICE)
    report = run_self_check(loaded.model, torch.float32, KERNEL_DEVICE, 16, "strict")
    assert not report.failed
    assert {c.op for c in report.checks if c.provider == "triton"} == {
        "attention", "rms_norm", "fused_add_rms_norm", "rotary", "silu_and_mul", "moe_route", "fused_moe"}


def test_a_replay_that_differs_from_eager_is_caught(tmp_path, triton_ops, monkeypatch):
    save_tiny(tmp_path, "Qwen3ForCausalLM", seed=7, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              hidden_size=32)
    loaded = load_model(tmp_path, torch.float32, KERNEL_DEVICE)
    config = EngineConfig(max_model_len=64, max_num_seqs=4, graphs=True, max_graph_batch=4)
    engine = LLMEngine(loaded.model, config, loaded.model.config.vocab_size, torch.float32, KERNEL_DEVICE,
                       num_blocks=8)
    graphs = engine.runner.graphs
    replay = type(graphs).run
    monkeypatch.setattr(type(graphs), "run", lambda self, *a, **k: replay(self, *a, **k).roll(1, 0))  # rows swapped
    assert "differs from the same step run eagerly" in engine.runner.graphs_match_eager()
