"""The cpu backend's C++ linear (backends/cpu/cpp_linear.py) against native's F.linear, on fresh random inputs.

bf16: both multiply exactly and sum in fp32 in their own order, then round once to bf16, so they may sit one bf16
step apart plus fp32 reassociation. fp32: native's products summed in another order.
"""
from __future__ import annotations

import pytest
import torch

from resin import hal
from resin.backends.cpu import cpp_linear, kernels
from resin.hal.platform import cpu_platform

from conftest import require_cpu_kernels

pytestmark = pytest.mark.kernels

require_cpu_kernels()


def _require(dtype: torch.dtype, needs: str) -> None:
    ok, why = cpp_linear.supported(cpu_platform())
    if not ok or dtype not in cpp_linear._dtypes():
        pytest.skip(f"requires {needs}: {why or 'no C++ linear of this dtype on this CPU'}")


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 17, 33, 300])
@pytest.mark.parametrize("k", [576, 1536, 100])
def test_bf16_panel_linear_matches_native(rows, k):
    """Fresh random bf16 rows and weights, with and without bias. 37 and 100 outputs end in a part-filled panel,
    96 in whole ones (width 48); 3, 9, 17 and 33 rows end in a part-filled register tile (8 rows); 300 rows pass
    over each panel in two blocks (256 + 44); K = 100 is not a multiple of the vector width. Bound: one bf16 step
    plus fp32 reassociation, 2^-7 |ref| + K eps32 sum |x w|."""
    _require(torch.bfloat16, "AVX512-BF16 without AMX")
    for n in (37, 96, 100):
        x, w, b = torch.randn(rows, k).bfloat16(), torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
        for bias in (None, b):
            assert cpp_linear.supports_args(x, w, bias) is None
            ref = hal.LINEAR.native(x, w, bias).double()
            got = cpp_linear.cpp_linear(x, w, bias)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
            sums = x.double().abs() @ w.double().abs().T + (0 if bias is None else b.double().abs())
            bound = 2.0 ** -7 * ref.abs() + k * 2.0 ** -23 * sums + 1e-30
            assert ((got.double() - ref).abs() <= bound).all()


def test_bf16_panels_layout_and_declines():
    """The packed panels hold each weight pair where csrc/bf16_panels.h reads it, rows past N zero; the provider
    declines what the kernel cannot take, and the kernel refuses panels of the wrong shape with a message."""
    _require(torch.bfloat16, "AVX512-BF16 without AMX")
    width = kernels.extension().bf16_panel_width()
    w = torch.randn(width + 5, 6).bfloat16()
    panels = cpp_linear.pack_panels(w)
    assert panels.shape == (2, 3, width) and panels.dtype == torch.int32
    pairs = w.view(torch.int32)
    assert torch.equal(panels[1, 2, 4], pairs[width + 4, 2]) and torch.equal(panels[0, 0, 7], pairs[7, 0])
    assert not panels[1, :, 5:].any()
    x = torch.randn(2, 6).bfloat16()
    assert cpp_linear.supports_args(torch.randn(2, 5).bfloat16(), torch.randn(4, 5).bfloat16()) is not None  # odd K
    assert cpp_linear.supports_args(x, w.float()) is not None  # mixed dtypes
    assert cpp_linear.supports_args(torch.randn(0, 6).bfloat16(), w) is not None  # no rows
    assert cpp_linear.supports_args(x.unsqueeze(0), w) is not None  # 3-D x: the HAL op passes 2-D rows
    assert cpp_linear.supports_args(x, w, torch.randn(width + 5)) is not None  # fp32 bias on bf16
    assert torch.equal(cpp_linear.cpp_linear(x.t().contiguous().t(), w), cpp_linear.cpp_linear(x, w))  # strided x
    with pytest.raises(RuntimeError, match="panels must be"):
        kernels.extension().bf16_panel_linear(x, panels, 3 * width, None)  # N beyond the panels
    with pytest.raises(RuntimeError, match="bias must be contiguous fp32"):  # the provider passes an fp32 copy
        kernels.extension().bf16_panel_linear(x, panels, width + 5, torch.randn(width + 5).bfloat16())
    bias = torch.randn(width + 5).bfloat16()
    cpp_linear.cpp_linear(x, w, bias)
    assert bias._resin_derived["fp32"].dtype == torch.float32  # made once, kept on the bias


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13, 32])
@pytest.mark.parametrize("k", [576, 1536, 100])
def test_fp32_linear_matches_native(rows, k):
    """Fresh random fp32 rows and weights, with and without bias: native's products summed in another order, so
    within fp32 reassociation, K eps32 sum |x w|. 37, 38 and 39 outputs leave 1, 2 or 3 rows after the kernel's
    groups of 3 (or 4, for 1-2 activation rows); K = 100 a scalar tail; 3, 5, 13 rows the 3/2/1-row tiles after
    the 4-row ones. Offered up to FP32_LINEAR_MAX_ROWS; oneDNN's GEMM serves beyond."""
    _require(torch.float32, "AVX2 + FMA")
    for n in (37, 38, 39):
        x, w, b = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
        for bias in (None, b):
            assert cpp_linear.supports_args(x, w, bias) is None
            ref = hal.LINEAR.native(x, w, bias).double()
            got = cpp_linear.cpp_linear(x, w, bias)
            assert got.dtype == torch.float32 and got.shape == (rows, n)
            sums = x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs())
            assert ((got.double() - ref).abs() <= k * 2.0 ** -23 * sums + 1e-30).all()
    assert cpp_linear.supports_args(torch.randn(cpp_linear.FP32_LINEAR_MAX_ROWS + 1, k), w) is not None
