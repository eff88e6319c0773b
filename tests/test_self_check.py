"""The startup self-check: every chosen provider against native on the loaded model's shapes. The cpu's own
providers pass; a provider wrong in one corner is dropped with a line naming it and the run then equals native;
strict refuses to start with the same message; off skips."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import save_tiny
from resin import LLM, SamplingParams, hal
from resin.core.self_check import SelfCheckError

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]

WRONG_PROVIDERS = '''
import torch
from resin import hal


class WrongGroupAttention(hal.NativeAttention):
    """Right everywhere but the last GQA group, which gets the first group's output: a corner a batch can miss."""

    def forward(self, layer_idx, q, k, v, kv_cache, sinks=None):
        out = super().forward(layer_idx, q, k, v, kv_cache, sinks)
        layer = self.layers[layer_idx]
        group = layer.num_heads // layer.num_kv_heads * layer.head_size
        out = out.clone()
        out[:, -group:] = out[:, :group]
        return out


def wrong_tail_rms_norm(x, weight, eps):
    """Forgets the last element of each row (a tail left out of a vectorised loop)."""
    out = hal.RMS_NORM.native(x, weight, eps).clone()
    out[..., -1] = x[..., -1]
    return out


hal.ATTENTION.register("wrong_gqa")(WrongGroupAttention)
hal.RMS_NORM.register("wrong_tail")(wrong_tail_rms_norm)
'''
WRONG = "attention=wrong_gqa,rms_norm=wrong_tail"


@pytest.fixture(scope="module")
def wrong_providers():
    namespace: dict = {}
    exec(compile(WRONG_PROVIDERS, "wrong_providers", "exec"), namespace)
    yield
    hal.ATTENTION.providers.pop("wrong_gqa")
    hal.RMS_NORM.providers.pop("wrong_tail")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("self-check")
    save_tiny(folder, "LlamaForCausalLM", seed=11, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
              hidden_size=48)
    return folder


PROMPTS = [[5, 9, 2, 7, 1, 3, 8, 4, 6, 2, 9, 1, 5, 3, 7, 2, 8, 6, 1, 4], [3, 1, 4]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _logits_of(llm_kwargs: dict) -> tuple[list[list[int]], list[torch.Tensor], LLM]:
    rows: list[torch.Tensor] = []
    llm = LLM(kv_cache_memory="8MiB", logits_observer=lambda reqs, logits: rows.extend(logits.float().clone()),
              **llm_kwargs)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], rows, llm


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("attention", ["cpp", "cpu"])
def test_the_cpu_providers_pass(model_dir, dtype, attention):
    from resin.backends.cpu import kernels

    if attention == "cpp" and not kernels.supported(hal.select_backend("cpu", install=False).platform)[0]:
        pytest.skip("requires a C++ toolchain for the cpp providers (this machine has none)")
    llm = LLM(str(model_dir), dtype=dtype, kv_cache_memory="8MiB", ops=f"attention={attention}")
    report = llm.self_check
    assert report is not None and not report.failed, report.summary()
    checked = {(c.op, c.provider) for c in report.checks}
    assert ("attention", attention) in checked
    assert {op for op, _ in checked} >= {"attention", "rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary"}


def test_a_wrong_provider_is_dropped_and_the_run_equals_native(model_dir, wrong_providers, caplog):
    with caplog.at_level("WARNING", logger="resin.self_check"):
        tokens, logits, llm = _logits_of(dict(model=str(model_dir), dtype="float32", ops=WRONG))
    dropped = {(c.op, c.provider) for c in llm.self_check.failed}
    assert dropped == {("attention", "wrong_gqa"), ("rms_norm", "wrong_tail")}
    assert "DROPPED attention: provider wrong_gqa" in caplog.text and "max |diff|" in caplog.text
    assert "DROPPED rms_norm: provider wrong_tail" in caplog.text
    table = llm.selection.format_table()  # what `resin backends --model` prints
    assert "wrong_gqa: failed the self-check" in table and "wrong_tail: failed the self-check" in table
    assert llm.selection.table["attention"].chosen != "wrong_gqa"

    native_tokens, native_logits, _ = _logits_of(dict(model=str(model_dir), dtype="float32",
                                                      ops="attention=native,rms_norm=native", self_check="off"))
    assert tokens == native_tokens
    assert max(float((a - b).abs().max()) for a, b in zip(logits, native_logits)) <= 1e-4


def test_strict_refuses_to_start(model_dir, wrong_providers):
    with pytest.raises(SelfCheckError, match="DROPPED attention: provider wrong_gqa.*max \\|diff\\|"):
        LLM(str(model_dir), dtype="float32", kv_cache_memory="8MiB", ops=WRONG, self_check="strict")


def test_strict_exits_non_zero_from_the_command_line(model_dir, tmp_path):
    script = tmp_path / "launch.py"
    script.write_text(WRONG_PROVIDERS + textwrap.dedent(f"""
        import sys
        from resin.cli import main
        sys.exit(main(["generate", "--model", {str(model_dir)!r}, "--dtype", "float32", "--ops", {WRONG!r},
                       "--kv-cache-memory", "8MiB", "--self-check", "strict", "--max-tokens", "2", "1 2 3"]))
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0
    assert "DROPPED attention: provider wrong_gqa" in proc.stderr and "--self-check strict" in proc.stderr


def test_off_skips_it(model_dir, wrong_providers):
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="8MiB", ops=WRONG, self_check="off")
    assert llm.self_check is None and llm.selection.table["attention"].chosen == "wrong_gqa"
    with pytest.raises(ValueError, match="self_check='maybe'"):
        LLM(str(model_dir), dtype="float32", kv_cache_memory="8MiB", self_check="maybe")


def test_small_blocks_and_non_finite_values(model_dir):
    """Block size 4 (a prefill of block_size + 5 spans three blocks), and outputs equal to native's infinities and
    NaNs count as agreeing: a provider is judged on what native computes."""
    from resin.core.provider_check import compare

    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="8MiB", block_size=4)
    assert llm.self_check is not None and not llm.self_check.failed
    x = torch.tensor([float("inf"), float("nan"), 1.0, -float("inf")])
    tolerance = hal.RMS_NORM.tolerance
    assert compare(x, x.clone(), tolerance)[1] is None
    assert compare(x, torch.tensor([float("inf"), 0.0, 1.0, -float("inf")]), tolerance)[1] is not None


def test_backends_command_runs_the_check_on_a_model(model_dir, capsys):
    from resin.cli import main

    assert main(["backends", "--model", str(model_dir), "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "self-check:" in out and "provider checks passed" in out and "inputs seeded" in out
    assert "attention: provider" in out and ": ok, max |diff|" in out
    assert main(["backends"]) == 0 and "--model builtin" in capsys.readouterr().out
