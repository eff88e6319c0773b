"""quant_linear: the native dequantisers against the gguf package's, and the cpu provider against native, on fresh
random blocks of every packed type each run (odd row counts, batches on both sides of the GEMM switch, biases).

Every path is covered: few rows (exact products; fused for Q4_0/Q4_1/Q8_0/Q4_K: vdpbf16ps in bf16 on AVX512-BF16,
fma in fp32, and in bf16 without AVX512-BF16), bf16 batches (weights unpacked to bf16 rows), large batches
(tiles unpacked into torch's GEMM). Bounds. fp32: the provider sums in another order than native, so it may differ by fp32 reassociation over K
terms: K * eps32 * sum_k |x_k w_k| (a wrong nibble or a misread scale moves an output by a whole block's share of
that sum, ~32/K of it, far above). bf16: native rounds its fp32 sum once to bf16 and the provider rounds its own
once (the GEMM path also rounds each weight to bf16 first: 2^-8 sum_k |x_k w_k|). Two fp32 sums that differ by
reassociation and straddle a rounding midpoint round to neighbouring bf16 values, a whole step apart: 2^-7 |ref|
(seen: exact 1.19921869, native's fp32 sum 1.19921887, the midpoint 1.19921875 between them; native gave 1.203125,
the kernel the correctly rounded 1.1953125).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from resin import hal
from resin.backends.cpu import kernels, quant
from resin.hal.quant import FORMATS, INT8, QTYPES, dequantize
from resin.tiny import random_packed

from conftest import require_cpu_kernels

pytestmark = pytest.mark.kernels

require_cpu_kernels()


def _seeded() -> torch.Generator:
    seed = int(torch.randint(0, 2**31, (1,)).item())
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("qtype", list(FORMATS))
def test_native_dequantisers_equal_the_gguf_package(qtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    w = random_packed(qtype, 7, 512, _seeded())
    ref = gguf_dequantize(w.numpy(), getattr(GGMLQuantizationType, qtype.upper())).reshape(7, 512)
    assert np.array_equal(dequantize(w, qtype).numpy(), ref)


def _bound(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor, exact_products: bool) -> torch.Tensor:
    """exact_products: the path multiplies x by the exact weights (fp32, or bf16 through a fused kernel), so it may
    differ from native by fp32 reassociation, plus one bf16 step of the output where x is bf16; otherwise it
    rounded the weights to bf16 first."""
    magnitude = x.double().abs() @ w.double().abs().T
    reassociation = x.shape[-1] * torch.finfo(torch.float32).eps * magnitude + 1e-30
    if x.dtype == torch.float32:
        return reassociation
    output_rounding = 2.0 ** -7 * ref.double().abs()  # both round to bf16: one step apart at most (docstring)
    if exact_products:
        return output_rounding + reassociation
    return output_rounding + 2.0 ** -8 * magnitude


def _check(x, qweight, qtype, scales=None, bias=None, path=quant.quant_linear, exact_products=None):
    """exact_products: whether `path` multiplies by unrounded weights (None: as quant_linear routes these rows)."""
    ref = hal.QUANT_LINEAR.native(x, qweight, qtype, scales, bias)
    got = path(x, qweight, qtype, scales, bias)
    assert got.dtype == x.dtype and got.shape == ref.shape
    w = dequantize(qweight, qtype, scales)
    err = (got.double() - ref.double()).abs()
    rows = x.reshape(-1, x.shape[-1]).shape[0]
    fused = x.dtype == torch.bfloat16 and qtype in quant.FUSED_BF16 and rows < (
        quant.FUSED_MAX_ROWS if kernels.native_bf16() else quant.GEMM_MIN_ROWS)  # AVX2: the fma row kernel
    if exact_products is not None:
        fused = exact_products
    bound = _bound(x, w, ref, fused) + (0 if bias is None else 2.0 ** -8 * bias.double().abs())
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"{qtype} {tuple(x.shape)} {x.dtype}: error {worst:.2f}x the bound"


@pytest.mark.parametrize("qtype", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, quant.FUSED_MAX_ROWS - 1, quant.FUSED_MAX_ROWS, 41, quant.GEMM_MIN_ROWS - 1,
                                  quant.GEMM_MIN_ROWS])
def test_packed_provider_matches_native(qtype, dtype, rows):
    g = _seeded()
    block = FORMATS[qtype].block
    for in_features in sorted({block * 3, 512, block * 18}):  # 18 blocks: the kernels take scales 16 at a time
        qweight = random_packed(qtype, 37, in_features, g)
        x = torch.randn(rows, in_features, generator=g).to(dtype)
        _check(x, qweight, qtype)
    bias = torch.randn(37, generator=g)
    _check(torch.randn(2, rows, 512, generator=g).to(dtype), random_packed(qtype, 37, 512, g), qtype, bias=bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 40, 64])
def test_int8_provider_matches_native(dtype, rows):
    g = _seeded()
    for in_features in (100, 576):  # 100: not a whole number of 32-weight chunks
        qweight = torch.randint(-127, 128, (37, in_features), dtype=torch.int8, generator=g)
        scales = torch.rand(37, generator=g) * 0.01
        x = torch.randn(rows, in_features, generator=g).to(dtype)
        _check(x, qweight, INT8, scales, torch.randn(37, generator=g))


@pytest.mark.parametrize("qtype", list(FORMATS))
def test_native_decoders_follow_the_weight_device(qtype):
    """The native op serves backends without a kernel: nothing in a decoder may be made on the CPU regardless."""
    w = random_packed(qtype, 3, 512).to("meta")
    assert dequantize(w, qtype).device.type == "meta"


def test_cpu_backend_chooses_the_packed_kernels():
    sel = hal.select_backend("cpu", install=False)
    assert sel.table["quant_linear"].chosen == "cpp", sel.format_table()
    assert sel.table["quant_embedding"].chosen == "cpp", sel.format_table()


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_provider_matches_native(qtype, dtype):
    """Rows picked by id (repeats, a 2-D batch of ids) unpacked by the kernel: native's values exactly (the kernel
    forms each weight as native does, and a block scale times a small integer quant is exact in fp32)."""
    g = _seeded()
    if qtype == INT8:
        qweight, scales = torch.randint(-127, 128, (50, 512), dtype=torch.int8, generator=g), torch.rand(50) * 0.01
    else:
        qweight, scales = random_packed(qtype, 50, 512, g), None
    ids = torch.randint(0, 50, (3, 7), generator=g)
    ids[0, 0] = ids[2, 6] = 49
    ref = hal.QUANT_EMBEDDING.native(ids, qweight, qtype, scales, dtype)
    got = quant.quant_embedding(ids, qweight, qtype, scales, dtype)
    assert got.dtype == dtype and got.shape == ref.shape == (3, 7, 512)
    assert torch.equal(got, ref)
    assert quant.embedding_args(ids, qweight, qtype, scales, torch.float16) is not None


def test_unsupported_calls_are_declined_with_a_reason():
    w = random_packed("q4_1", 4, 64)
    assert "float32 or bfloat16" in quant.supports_args(torch.randn(1, 64).half(), w, "q4_1")
    assert "contiguous 2-D" in quant.supports_args(torch.randn(1, 64), w[:, ::2], "q4_1")
    assert quant.supports_args(torch.randn(1, 64), w, "q4_1") is None


def test_in_features_must_fill_whole_blocks():
    with pytest.raises(ValueError, match="blocks of 256"):
        FORMATS["q4_k"].row_bytes(300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_path_in_tiles(monkeypatch, dtype):
    """Large weights are unpacked a tile of rows at a time: uneven tiles, biases and int8 scales stay aligned. (In
    bf16 this is the path of CPUs without AVX512-BF16, so it is called directly.)"""
    g = _seeded()
    monkeypatch.setattr(quant, "TILE_BYTES", 8 * 512 * 4)  # 8 rows of fp32 (16 of bf16) per tile, 37 rows
    x = torch.randn(67, 512, generator=g).to(dtype)
    _check(x, random_packed("q4_k", 37, 512, g), "q4_k", bias=torch.randn(37, generator=g), path=quant._tiled_gemm)
    qweight = torch.randint(-127, 128, (37, 512), dtype=torch.int8, generator=g)
    _check(x, qweight, INT8, torch.rand(37, generator=g) * 0.01, torch.randn(37, generator=g), path=quant._tiled_gemm)


@pytest.mark.parametrize("amx", [False, True], ids=["panel-gemm", "amx"])
@pytest.mark.parametrize("rows", [40, 300])
@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q6_k", INT8])
def test_bf16_gemm_paths_at_batch_and_prefill_sizes(monkeypatch, qtype, rows, amx):
    """bf16 batches on every path, whatever this CPU has: the panel GEMM (CPUs with AVX512-BF16 but no AMX: many
    12-row passes, a partial last panel, 70 = 2 x 32 + 6 rows; tiles where the CPU lacks AVX512-BF16 too) and, as
    on a CPU with AMX, the panels on brgemm for a decode batch (40 rows; tiles where cpublas cannot pack bf16) and
    tiles unpacked into torch's GEMM for a prefill (300)."""
    monkeypatch.setattr(kernels, "amx_gemm", lambda: amx)
    g = _seeded()
    x = torch.randn(rows, 768, generator=g).to(torch.bfloat16)
    if qtype == INT8:
        qweight = torch.randint(-127, 128, (70, 768), dtype=torch.int8, generator=g)
        _check(x, qweight, INT8, torch.rand(70, generator=g) * 0.01, torch.randn(70, generator=g))
    else:
        _check(x, random_packed(qtype, 70, 768, g), qtype, bias=torch.randn(70, generator=g))


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q8_0", "q4_k", "q6_k", INT8])
@pytest.mark.parametrize("rows", [1, 13, 128, 300])
def test_amx_panels_match_native(qtype, rows):
    """The quantised panels multiplied on AMX tiles through torch's brgemm (as quant_linear runs 8-128 rows on an
    AMX CPU), called directly: weights rounded to bf16 once, fp32 sums, one rounding with the bias; 70 weight rows
    (a partial last panel) and 300 activation rows (two brgemm calls of 256 + 44)."""
    if not kernels.brgemm_bf16():
        pytest.skip("requires a CPU where torch's brgemm ukernels pack bf16 (AMX tiles)")
    g = _seeded()
    x = torch.randn(rows, 768, generator=g).to(torch.bfloat16)
    if qtype == INT8:
        qweight, scales = torch.randint(-127, 128, (70, 768), dtype=torch.int8, generator=g), torch.rand(70) * 0.01
    else:
        qweight, scales = random_packed(qtype, 70, 768, g), None
    bias = torch.randn(70, generator=g)
    amx = lambda *a: kernels.extension().quant_matmul_bf16(*a, amx=True)  # noqa: E731
    _check(x, qweight, qtype, scales, bias, path=amx, exact_products=False)


@pytest.fixture(scope="module")
def portable_kernels(tmp_path_factory):
    """The same sources built for a CPU without AVX2 or AVX-512 (x86-64-v2): the portable loops, which this
    machine's -march=native build never runs."""
    import platform

    from torch.utils import cpp_extension

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"requires an x86-64 CPU to build for x86-64-v2 (this is {platform.machine()})")
    flags = [f for f in kernels._FLAGS if f != "-march=native"] + ["-march=x86-64-v2"]
    return cpp_extension.load(name="resin_cpu_kernels_portable", sources=[str(s) for s in kernels.SOURCES],
                              build_directory=str(tmp_path_factory.mktemp("portable")), extra_cflags=flags,
                              extra_ldflags=["-fopenmp"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_portable_build_matches_native(portable_kernels, monkeypatch, dtype):
    """Every packed type and int8 through the portable build: few rows, the bf16 batch path (which declines there,
    so tiles serve), the GEMM switch; and its embedding rows and argmax."""
    monkeypatch.setattr(kernels, "extension", lambda: portable_kernels)
    g = _seeded()
    rows_bf16 = torch.zeros(2, 64, dtype=torch.bfloat16)
    assert portable_kernels.quant_matmul_bf16(rows_bf16, random_packed("q4_1", 4, 64, g), "q4_1", None,
                                              None) is None  # no AVX512-BF16: the caller's GEMM path serves
    for qtype in QTYPES:
        for rows in (1, quant.FUSED_MAX_ROWS - 1, quant.GEMM_MIN_ROWS + 1):
            x = torch.randn(rows, 512, generator=g).to(dtype)
            if qtype == INT8:
                qweight = torch.randint(-127, 128, (37, 512), dtype=torch.int8, generator=g)
                _check(x, qweight, INT8, torch.rand(37, generator=g) * 0.01, torch.randn(37, generator=g))
                ids = torch.randint(0, 37, (5,), generator=g)
                assert torch.equal(quant.quant_embedding(ids, qweight, INT8, torch.ones(37), dtype),
                                   hal.QUANT_EMBEDDING.native(ids, qweight, INT8, torch.ones(37), dtype))
            else:
                qweight = random_packed(qtype, 37, 512, g)
                _check_unfused(x, qweight, qtype)
                ids = torch.randint(0, 37, (5,), generator=g)
                assert torch.equal(quant.quant_embedding(ids, qweight, qtype, None, dtype),
                                   hal.QUANT_EMBEDDING.native(ids, qweight, qtype, None, dtype))
    scores = torch.randn(3, 1000, generator=g)
    scores[1, 7] = scores[1, 9] = scores[1].max() + 1
    assert torch.equal(portable_kernels.argmax_rows(scores), scores.argmax(-1))


def _check_unfused(x, qweight, qtype):
    """_check with the bound of a path that may round weights to bf16 (the portable build has no fused kernel)."""
    ref = hal.QUANT_LINEAR.native(x, qweight, qtype)
    got = quant.quant_linear(x, qweight, qtype)
    w = dequantize(qweight, qtype)
    err = (got.double() - ref.double()).abs()
    worst = (err / _bound(x, w, ref, exact_products=False)).max().item()
    assert worst <= 1.0, f"{qtype} {tuple(x.shape)} {x.dtype}: error {worst:.2f}x the bound"
