"""The cross-compile gate: every Triton kernel the engine launches compiles for gfx942, gfx950, sm_90 and sm_100 on
this GPU-less machine, without spills and within each arch's shared memory; and the gate fails when a tuning breaks
that. It runs in a subprocess: conftest turns on Triton's interpreter in this one, and the gate compiles for real."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from resin.ci.kernel_gate import run_gate

pytestmark = pytest.mark.compiled
ROOT = Path(__file__).resolve().parents[1]
KERNELS = {"_paged_attention_kernel", "_merge_splits_kernel", "_write_kv_kernel", "_rms_norm_kernel",
           "_rotary_kernel", "_act_and_mul_kernel", "_route_kernel", "_grouped_gemm_kernel",
           "_quant_per_token_kernel", "_scaled_mm_kernel", "_conv1d_kernel", "_gdn_kernel", "_paged_mla_kernel",
           "_write_rows_kernel", "_quant_groups_kernel"}
LIMITS = {"gfx942": 64 << 10, "gfx950": 160 << 10, "sm_90": 227 << 10, "sm_100": 227 << 10}


def _compiled_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


@pytest.mark.timeout(1500)  # ~5 min on 2 idle cores: it compiles ~800 specialisations afresh
def test_every_kernel_compiles_for_every_target(tmp_path):
    out = tmp_path / "kernels.json"
    proc = subprocess.run([sys.executable, "-m", "resin.ci", "kernels", "--json", str(out)], capture_output=True,
                          text=True, cwd=ROOT, env=_compiled_env(), timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "0 problem(s)" in proc.stdout
    report = json.loads(out.read_text())
    assert set(report["results"]) == set(LIMITS)
    for target, results in report["results"].items():
        assert {r["kernel"] for r in results} == KERNELS, target
        for r in results:
            assert r["error"] is None and r["spills"] == 0 and r["shared"] <= LIMITS[target]
            assert r["registers"] > 0 and r["occupancy"] >= 1
        fp8 = {r["spec"].split()[0] for r in results if r["kernel"] == "_scaled_mm_kernel"}
        flavour = "fp8e4b8" if target == "gfx942" else "fp8e4nv"  # each arch's own fp8 (e4m3fnuz on gfx942)
        assert fp8 and all(flavour in dtypes for dtypes in fp8), (target, fp8)
    for vendor in ("cuda", "rocm"):
        counts = {c["shape"]: c for c in report["decode_launches"][vendor]}
        builtin = counts["SmolLM2-135M (built-in)"]
        assert builtin["layers"] == 30 and builtin["triton_per_layer"] > 0 and builtin["triton_outside"] > 0
        moe = counts["Qwen3-30B-A3B"]  # routing + two grouped GEMMs + activation on top of the dense layer's
        assert moe["triton_per_layer"] > builtin["triton_per_layer"]
    assert "Kernel launches per decode step" in proc.stdout


def test_the_gate_fails_a_tuning_that_spills_or_overflows_lds():
    """A prefill tile of 256 rows at head size 256 cannot fit gfx942: the gate must say so, naming the kernel."""
    script = textwrap.dedent("""
        import dataclasses, sys
        import resin.backends.rocm.tuning as rocm
        rocm.TUNING = dataclasses.replace(rocm.TUNING, attention_block_m=256)
        from resin.ci.kernel_gate import run_gate
        report = run_gate(["gfx942"], shapes=["gemma2"])
        print("\\n".join(report.problems()))
        sys.exit(1 if report.problems() else 0)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                          env=_compiled_env(), timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "_paged_attention_kernel" in proc.stdout and "BLOCK_Q=128" in proc.stdout
    assert "shared memory 131072 B > 65536 B" in proc.stdout and "spills" in proc.stdout


def test_the_gate_refuses_the_interpreter_and_unknown_targets(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="unset TRITON_INTERPRET"):
        run_gate(["gfx942"])
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="unknown target.*gfx1100.*known: gfx942"):
        run_gate(["gfx1100"])
