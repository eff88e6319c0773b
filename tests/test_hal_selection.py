"""Backend selection: the table and its reasons, per-call fallthrough, overrides, and clear errors."""
from __future__ import annotations

import pytest
import torch

from resin import hal
from resin.hal.platform import cpu_platform, fp8_dtype_for_arch, hypothetical_platform
from resin.hal.registry import SelectionError, activate, deactivate, resolve

pytestmark = pytest.mark.unit


@pytest.fixture
def fake_providers():
    calls = []

    def fast_norm(x, w, eps):
        calls.append("fast")
        return hal.RMS_NORM.native(x, w, eps) + 0  # same numbers, but we can see it ran

    hal.RMS_NORM.register("fast", supports_args=lambda x, w, eps: None if x.shape[-1] % 8 == 0
                          else f"hidden size {x.shape[-1]} not a multiple of 8")(fast_norm)
    hal.RMS_NORM.register("vendorlib", supported=lambda p: (False, "vendorlib not importable"))(fast_norm)
    yield calls
    for name in ("fast", "vendorlib"):
        hal.RMS_NORM.providers.pop(name)
    deactivate()


def test_cpu_selection_table():
    sel = hal.select_backend("auto", install=False)
    assert sel.platform.kind == "cpu" and sel.backend.name == "cpu"
    assert set(sel.table) == set(hal.all_ops())
    assert [p.name for p in sel.table["attention"].chain] == ["cpu", "native"]
    linear_chain = [p.name for p in sel.table["linear"].chain]
    if sel.platform.has_native_bf16_matmul():
        assert linear_chain == ["onednn", "native"]
    else:
        assert linear_chain == ["native"] and sel.table["linear"].skipped[0][0] == "onednn"
    assert all(c.chosen == "native" for name, c in sel.table.items() if name not in ("attention", "linear"))
    text = sel.format_table()
    assert "rms_norm" in text and "only provider on this backend" in text and "first in priority order" in text


def test_attention_falls_back_to_native_for_soft_cap():
    sel = hal.select_backend("cpu")
    plain = [hal.AttentionLayer(4, 2, 16, 0.25)]
    capped = [hal.AttentionLayer(4, 2, 16, 0.25, logits_soft_cap=30.0)]
    assert type(hal.ATTENTION(plain, 16, torch.float32, torch.device("cpu"))).__name__ == "CpuAttention"
    assert isinstance(hal.ATTENTION(capped, 16, torch.float32, torch.device("cpu")), hal.NativeAttention)
    assert sel.table["attention"].chosen == "cpu"
    deactivate()


def test_unsupported_provider_is_skipped_with_its_reason(fake_providers):
    table = resolve({"rms_norm": ["vendorlib", "fast"]}, cpu_platform())
    choice = table["rms_norm"]
    assert [p.name for p in choice.chain] == ["fast", "native"]
    assert choice.skipped == [("vendorlib", "vendorlib not importable")]
    table = resolve({"rms_norm": ["missing"]}, cpu_platform())
    assert table["rms_norm"].skipped[0][0] == "missing" and "not registered" in table["rms_norm"].skipped[0][1]


def test_per_call_supports_args_falls_through_to_native(fake_providers):
    activate(resolve({"rms_norm": ["fast"]}, cpu_platform()))
    w = torch.ones(16)
    hal.RMS_NORM(torch.randn(2, 16), w, 1e-6)
    assert fake_providers == ["fast"]
    hal.RMS_NORM(torch.randn(2, 15), torch.ones(15), 1e-6)  # rejected by supports_args -> native
    assert fake_providers == ["fast"]


def test_override_reorders_and_rejects_bad_names(fake_providers, monkeypatch):
    sel = hal.select_backend("cpu", ops="rms_norm=fast", install=False)
    assert sel.table["rms_norm"].chosen == "fast" and sel.table["rms_norm"].overridden
    monkeypatch.setenv("RESIN_OPS", "rms_norm=fast")
    assert hal.select_backend("cpu", install=False).table["rms_norm"].chosen == "fast"
    monkeypatch.delenv("RESIN_OPS")
    with pytest.raises(SelectionError, match="vendorlib not importable"):
        hal.select_backend("cpu", ops="rms_norm=vendorlib", install=False)
    with pytest.raises(SelectionError, match="no provider 'nope'.*registered"):
        hal.select_backend("cpu", ops="rms_norm=nope", install=False)
    with pytest.raises(SelectionError, match="unknown op"):
        hal.select_backend("cpu", ops="rmsnorm=native", install=False)
    with pytest.raises(SelectionError, match="OP=PROVIDER"):
        hal.select_backend("cpu", ops="rms_norm", install=False)


@pytest.mark.parametrize("backend", ["rocm", "cuda"])
def test_absent_gpu_backend_is_a_clear_error(backend):
    if hal.detect_kind() == backend:
        pytest.skip(f"a {backend} device is present")
    with pytest.raises(SelectionError) as err:
        hal.select_backend(backend, install=False)
    msg = str(err.value)
    assert f"--backend {backend}" in msg and "torch.version.hip" in msg and torch.__version__ in msg
    assert "install" in msg.lower() and "--backend cpu" in msg


def test_unknown_backend_name():
    with pytest.raises(SelectionError, match="unknown backend 'tpu'"):
        hal.select_backend("tpu", install=False)


@pytest.mark.parametrize("backend,arch", [("rocm", "gfx942"), ("rocm", "gfx950"), ("cuda", "sm_90")])
def test_describe_backend_for_absent_hardware(backend, arch):
    sel = hal.describe_backend(backend, arch=arch)
    assert sel.platform.hypothetical and sel.platform.arch == arch and sel.backend.name == backend
    assert all(c.chosen == "native" for c in sel.table.values())  # no GPU kernels registered yet
    assert "no GPU kernels registered yet" in sel.backend.note


def test_fp8_flavour_per_arch():
    assert fp8_dtype_for_arch("gfx942") == torch.float8_e4m3fnuz
    assert fp8_dtype_for_arch("gfx950") == torch.float8_e4m3fn
    assert fp8_dtype_for_arch("sm_90") == torch.float8_e4m3fn
    assert fp8_dtype_for_arch("sm_80") is None
    assert hypothetical_platform("rocm").fp8_dtype == torch.float8_e4m3fnuz


def test_attention_op_constructs_the_first_backend_that_accepts_the_layers():
    layers = [hal.AttentionLayer(4, 2, 16, 0.25)]
    backend = hal.ATTENTION(layers, 16, torch.float32, torch.device("cpu"))
    assert isinstance(backend, hal.NativeAttention)
