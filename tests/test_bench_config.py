"""How the benchmarks configure their peers: vLLM-CPU bound to every core, as its docs advise."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from engines import vllm_cpu_env  # noqa: E402

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("cpus, bind", [(1, "0-0"), (2, "0-1"), (64, "0-63")])
def test_vllm_threads_are_bound_to_every_core(cpus, bind):
    env = vllm_cpu_env(cpus)
    assert env == {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": "1"}
