"""Backend selection: the table and its reasons, per-call fallthrough, overrides, and clear errors."""
from __future__ import annotations

import platform

import pytest
import torch

from resin import hal
from resin.hal.platform import cpu_platform, fp8_dtype_for_arch, hypothetical_platform
from resin.hal.registry import deactivate
from resin.hal.selection import SelectionError, activate, resolve

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
    from resin.backends.cpu import cpp_linear, kernels, linear

    sel = hal.select_backend("auto", install=False)
    assert sel.platform.kind == "cpu" and sel.backend.name == "cpu"
    assert set(sel.table) == set(hal.all_ops())
    cpp_ok, why = kernels.supported(sel.platform)
    cpp = ["cpp"] if cpp_ok else []  # without a C++ toolchain the plain-torch providers serve, and say why
    if not cpp_ok:
        assert sel.table["rms_norm"].skipped == [("cpp", why)]
    assert [p.name for p in sel.table["attention"].chain] == cpp + ["cpu", "native"]
    linear_chain = [p.name for p in sel.table["linear"].chain]
    cpp_linears = ["cpp"] if cpp_ok and cpp_linear.dtypes(sel.platform.cpu_flags) else []  # bf16 / fp32
    onednn_ok, onednn_why = linear.supported(sel.platform)  # fp32 everywhere, bf16 where native
    assert linear_chain == cpp_linears + (["onednn"] if onednn_ok else []) + ["native"]
    if not onednn_ok:
        assert dict(sel.table["linear"].skipped)["onednn"] == onednn_why
    assert [p.name for p in sel.table["rotary"].chain] == cpp + ["cpu", "native"]
    for name in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "quant_linear", "quant_embedding", "argmax",
                 "random_sample"):
        assert [p.name for p in sel.table[name].chain] == cpp + ["native"]
    assert [p.name for p in sel.table["gated_delta_rule"].chain] == ["chunked", "native"]
    assert [p.name for p in sel.table["mla_attention"].chain] == ["cpu", "native"]
    for name in ("all_reduce", "all_gather"):  # x86-64: shared memory between the ranks of one machine
        shm = ["shm"] if platform.machine() == "x86_64" else []
        assert [p.name for p in sel.table[name].chain] == shm + ["native"]
    assert all(c.chosen == "native" for name, c in sel.table.items()
               if name not in ("attention", "linear", "rotary", "rms_norm", "fused_add_rms_norm", "silu_and_mul",
                               "gated_delta_rule", "quant_linear", "quant_embedding", "argmax", "random_sample",
                               "all_reduce", "all_gather", "mla_attention"))
    text = sel.format_table()
    assert "gelu_and_mul" in text and "only provider on this backend" in text and "first in priority order" in text


def test_attention_falls_back_to_native_for_soft_cap():
    sel = hal.select_backend("cpu", ops="attention=cpu")
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


AITER_OPS = {"attention", "rms_norm", "fused_add_rms_norm", "rotary", "moe_route", "fused_moe", "fp8_linear",
             "gated_delta_rule", "mla_attention", "block_fp8_linear", "all_reduce"}
TRITON_OPS = {"attention", "rms_norm", "fused_add_rms_norm", "rotary", "silu_and_mul", "gelu_and_mul", "moe_route",
              "fused_moe", "causal_conv1d", "causal_conv1d_update", "gated_delta_rule", "mla_attention",
              "block_fp8_linear"}


def _chosen(sel):
    return {name: c.chosen for name, c in sel.table.items()}


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_rocm_table_with_aiter(arch):
    sel = hal.describe_backend("rocm", arch=arch, libraries=frozenset({"aiter", "triton"}))
    chosen = _chosen(sel)
    assert {op for op, p in chosen.items() if p == "aiter"} == AITER_OPS
    assert chosen["silu_and_mul"] == chosen["gelu_and_mul"] == "triton"  # no aiter adapter: triton serves
    assert chosen["capture_graph"] == "torch_graphs" and chosen["linear"] == chosen["embedding"] == "native"
    # every chain still ends in native, and triton backs aiter up where aiter declines a call
    assert [p.name for p in sel.table["attention"].chain] == ["aiter", "triton", "native"]
    assert sel.platform.fp8_dtype == (torch.float8_e4m3fnuz if arch == "gfx942" else torch.float8_e4m3fn)


def test_rocm_table_without_aiter_explains_why():
    sel = hal.describe_backend("rocm", arch="gfx942", libraries=frozenset({"triton"}))
    chosen = _chosen(sel)
    assert {op for op, p in chosen.items() if p == "triton"} == TRITON_OPS
    assert chosen["fp8_linear"] == "scaled_mm"
    reasons = dict(sel.table["attention"].skipped)
    assert "aiter is not importable" in reasons["aiter"] and "amd-aiter" in reasons["aiter"]
    assert "aiter: aiter is not importable" in sel.format_table()


def test_rocm_table_on_an_arch_aiter_does_not_target():
    sel = hal.describe_backend("rocm", arch="gfx90a", libraries=frozenset({"aiter", "triton"}))
    reasons = dict(sel.table["attention"].skipped)
    assert "gfx90a" in reasons["aiter"] and sel.table["attention"].chosen == "triton"
    fp8 = dict(sel.table["fp8_linear"].skipped)
    assert "gfx90a" in fp8["aiter"] and "no fp8" in fp8["scaled_mm"] and "no fp8" in fp8["triton"]
    assert sel.table["fp8_linear"].chosen == "native"


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_cuda_table(arch):
    sel = hal.describe_backend("cuda", arch=arch, libraries=frozenset({"triton"}))
    chosen = _chosen(sel)
    assert {op for op, p in chosen.items() if p == "triton"} == TRITON_OPS
    assert chosen["fp8_linear"] == "scaled_mm" and chosen["capture_graph"] == "torch_graphs"
    assert [p.name for p in sel.table["fp8_linear"].chain] == ["scaled_mm", "triton", "native"]
    assert "aiter" not in sel.format_table()  # not part of this backend


def test_cuda_attention_libraries_follow_triton():
    sel = hal.describe_backend("cuda", arch="sm_90", libraries=frozenset({"triton", "flashinfer", "flash_attn"}))
    assert [p.name for p in sel.table["attention"].chain] == ["triton", "flashinfer", "flash_attn", "native"]
    alone = hal.describe_backend("cuda", arch="sm_90", libraries=frozenset({"flashinfer"}))
    assert alone.table["attention"].chosen == "flashinfer"
    assert not hal.ATTENTION.providers["flashinfer"].graph_safe


def test_flash_attn_and_flashinfer_say_what_they_cannot_serve():
    from resin.backends.cuda.flash_attn_attention import FlashAttnAttention
    from resin.backends.cuda.flashinfer_attention import FlashInferAttention

    layer, cuda = hal.AttentionLayer(32, 8, 128, 128 ** -0.5), torch.device("cpu")
    assert "256" in FlashAttnAttention.unsupported_reason([layer], 16, torch.bfloat16, cuda)
    assert FlashAttnAttention.unsupported_reason([layer], 256, torch.bfloat16, cuda) is None
    sink = hal.AttentionLayer(32, 8, 128, 1.0, has_sinks=True)
    assert "sinks" in FlashAttnAttention.unsupported_reason([sink], 256, torch.bfloat16, cuda)
    assert FlashInferAttention.unsupported_reason([layer], 16, torch.bfloat16, cuda) is None
    assert "fp16/bf16" in FlashInferAttention.unsupported_reason([layer], 16, torch.float32, cuda)
    odd = hal.AttentionLayer(8, 8, 96, 1.0)
    assert "head sizes" in FlashInferAttention.unsupported_reason([odd], 16, torch.bfloat16, cuda)


def test_gpu_all_reduce_providers_and_why_not():
    for arch in ("sm_90", "sm_100"):
        assert hal.describe_backend("cuda", arch=arch, libraries=frozenset()).table["all_reduce"].chosen == "symm_mem"
    ampere = hal.describe_backend("cuda", arch="sm_80", libraries=frozenset()).table["all_reduce"]
    assert ampere.chosen == "native" and "sm_90" in dict(ampere.skipped)["symm_mem"]
    assert hal.describe_backend("rocm", arch="gfx942", libraries=frozenset({"aiter"})).table["all_reduce"].chosen == \
        "aiter"
    bare = hal.describe_backend("rocm", arch="gfx950", libraries=frozenset()).table["all_reduce"]
    assert bare.chosen == "native" and "not importable" in dict(bare.skipped)["aiter"]
    assert all(p.graph_safe for p in hal.ALL_REDUCE.providers.values())  # decode graphs keep them


def test_gpu_all_reduce_providers_decline_what_they_cannot_reduce():
    """Their per-call checks, on what this machine has: one rank, or host tensors, go to native (NCCL/RCCL)."""
    from resin.backends.cuda import symm_mem
    from resin.backends.rocm.aiter import all_reduce as aiter_all_reduce
    from resin.hal.distributed import ParallelGroup, parallel, set_parallel

    x = torch.randn(4, 64).to(torch.bfloat16)
    assert "ranks" in symm_mem.supports_args(x) and "one rank" in aiter_all_reduce.supports_args(x)
    before = parallel()
    set_parallel(ParallelGroup(0, 2))
    try:
        assert "CUDA tensors" in symm_mem.supports_args(x) and "GPU tensors" in aiter_all_reduce.supports_args(x)
        set_parallel(ParallelGroup(0, 3))
        assert "3 ranks" in symm_mem.supports_args(x)
    finally:
        set_parallel(before)


def test_gpu_tables_without_triton_fall_back_to_native():
    for backend, arch in (("cuda", "sm_90"), ("rocm", "gfx942")):
        sel = hal.describe_backend(backend, arch=arch, libraries=frozenset())
        assert "not importable" in dict(sel.table["attention"].skipped)["triton"]
        # symm_mem needs no library: torch's own (on sm_90+)
        assert all(c.chosen in ("native", "torch_graphs", "symm_mem") for c in sel.table.values())
        assert "triton is not importable" in dict(sel.table["rms_norm"].skipped)["triton"]
    old = hal.describe_backend("cuda", arch="sm_75", libraries=frozenset({"triton"}))
    assert "sm_80" in dict(old.table["attention"].skipped)["triton"]


def test_cpu_never_picks_gpu_providers():
    sel = hal.describe_backend("cpu")
    assert "triton" not in _chosen(sel).values() and sel.table["capture_graph"].chosen == "native"


def test_override_to_an_unavailable_provider_names_the_reason():
    with pytest.raises(SelectionError, match="aiter is not importable"):
        hal.describe_backend("rocm", arch="gfx942", libraries=frozenset({"triton"}), ops="attention=aiter")


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


# What each attention provider claims to honour; everything else it must decline, naming the feature. Numerics of
# the claims: native (test_hal_ops), triton (test_triton_kernels), cpu/cpp windows (test_cpu_kernels); flashinfer
# and flash-attn plan windows and soft-cap, aiter passes all three to unified_attention: untested on hardware here.
HONOURS = {"native": {"window", "soft_cap", "sinks"}, "triton": {"window", "soft_cap", "sinks"},
           "aiter": {"window", "soft_cap", "sinks"}, "flashinfer": {"window", "soft_cap"},
           "flash_attn": {"window"},  # soft-cap from flash-attn 2.6 (not installed here): test_gpu_adapters
           "cpu": {"window"}, "cpp": {"window"}}
FEATURES = {"window": dict(sliding_window=128), "soft_cap": dict(logits_soft_cap=30.0),
            "sinks": dict(has_sinks=True)}
NAMED = {"window": "window", "soft_cap": "soft-cap", "sinks": "sinks"}


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("provider", HONOURS)
def test_every_attention_provider_honours_or_declines_window_soft_cap_and_sinks(provider, feature):
    import resin.backends.cpu  # noqa: F401  (registers cpu and cpp)
    import resin.backends.cuda  # noqa: F401  (registers flashinfer and flash_attn)
    import resin.backends.rocm  # noqa: F401  (registers aiter)
    from resin.backends.triton.attention import TritonAttention

    assert set(HONOURS) == set(hal.ATTENTION.providers)  # a new provider must state its claims here
    cls = TritonAttention if provider == "triton" else hal.ATTENTION.providers[provider].fn
    plain = hal.AttentionLayer(8, 2, 128, 128 ** -0.5)
    dev = torch.device("cpu")
    block = next(b for b in (16, 256) if cls.unsupported_reason([plain], b, torch.bfloat16, dev) is None)
    layers = [plain, hal.AttentionLayer(8, 2, 128, 128 ** -0.5, **FEATURES[feature])]
    reason = cls.unsupported_reason(layers, block, torch.bfloat16, dev)
    if feature in HONOURS[provider]:
        assert reason is None
    else:
        assert reason is not None and NAMED[feature] in reason, reason
