"""Pytest plugin: test-group and hardware markers, the `gpu_device` fixture, and the rule that a GPU test must
say which GPU it needs (a test using `gpu_device` without a requires_* marker fails collection)."""
from __future__ import annotations

import pytest

GROUP_MARKERS = {
    "unit": "fast tests of one module",
    "parity": "model logits/tokens against Hugging Face transformers",
    "kernels": "kernel providers against the native op",
    "compiled": "every Triton kernel compiled ahead of time for the GPU targets (no GPU needed)",
    "e2e": "whole processes: the server, the command line",
    "distributed": "several ranks over torch.distributed: tensor and expert parallelism",
}
HARDWARE_MARKERS = {
    "requires_cuda": "needs an NVIDIA GPU (skipped elsewhere, with the reason printed)",
    "requires_rocm": "needs an AMD GPU (skipped elsewhere, with the reason printed)",
    "requires_gpu": "needs any GPU, NVIDIA or AMD (skipped elsewhere, with the reason printed)",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, text in {**GROUP_MARKERS, **HARDWARE_MARKERS}.items():
        config.addinivalue_line("markers", f"{name}: {text}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [item.nodeid for item in items if "gpu_device" in getattr(item, "fixturenames", ())
                and not any(item.get_closest_marker(m) for m in HARDWARE_MARKERS)]
    if unmarked:
        raise pytest.UsageError(f"GPU test(s) without requires_cuda / requires_rocm / requires_gpu: {unmarked}")


@pytest.fixture
def gpu_device(request: pytest.FixtureRequest):
    """The GPU a marked test runs on; skipped, with the reason, where that GPU is absent."""
    import torch

    from resin.hal import detect_kind

    kind = detect_kind()
    for marker, wanted in (("requires_cuda", ("cuda",)), ("requires_rocm", ("rocm",)),
                           ("requires_gpu", ("cuda", "rocm"))):
        if request.node.get_closest_marker(marker) and kind not in wanted:
            pytest.skip(f"requires {'/'.join(wanted)} GPU (this machine: {kind})")
    return torch.device("cuda")
