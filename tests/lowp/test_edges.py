"""Edge semantics (docs/lowp.md): NaN, Inf, zeros, subnormals, saturation, empty/1-D/3-D, dim, padding, dtypes,
invalid requests."""

from __future__ import annotations

import math

import pytest
import torch

from torchnext.lowp import (
    DeterminismError,
    Format,
    FormatDTypeError,
    FormatError,
    QuantOptions,
    dequantize,
    quantization_error,
    quantize,
)

ALL = [f.value for f in Format]


@pytest.mark.parametrize("fmt", ALL)
def test_nan_block_scale_and_output(fmt: str) -> None:
    x = torch.randn(4, 64)
    x[1, 3] = float("nan")
    q = quantize(x, fmt)
    bs = q.block_size
    nan_byte = 0x7F if fmt == "nvfp4" else 0xFF
    assert int(q.scale_bytes[1, 0]) & 0x7F == nan_byte & 0x7F
    out = q.dequantize()
    assert torch.isnan(out[1, :bs]).all()
    assert not torch.isnan(out[1, bs:]).any() and not torch.isnan(out[0]).any()


@pytest.mark.parametrize("fmt", ALL)
def test_inf_saturates(fmt: str) -> None:
    x = torch.randn(2, 64)
    x[0, 0] = float("inf")
    x[0, 1] = -float("inf")
    q = quantize(x, fmt)
    out = q.dequantize()
    assert out[0, 0] > 0 and out[0, 1] < 0
    assert out[0, 0] == -out[0, 1]
    if fmt == "nvfp4":  # block scale clamps to 448: Inf saturates to ±6 * 448
        assert float(out[0, 0]) == 6 * 448
        assert torch.isfinite(out).all()
    else:  # E8M0 scale from Inf's exponent field (2**(128 - emax)): max * scale overflows back to ±Inf
        assert torch.isinf(out[0, :2]).all()
        assert (out[0, 2 : q.block_size] == 0).all()  # finite neighbours flush to zero
    torch.testing.assert_close(out[1], quantize(x[1:], fmt).dequantize()[0])


@pytest.mark.parametrize("fmt", ALL)
def test_zero_blocks_and_saturation(fmt: str) -> None:
    x = torch.zeros(3, 64)
    x[2] = torch.linspace(-1e3, 1e3, 64)
    q = quantize(x, fmt)
    out = q.dequantize()
    assert torch.equal(out[:2], torch.zeros(2, 64))
    expect = {"nvfp4": 0x08, "mxfp8_e4m3": 0, "mxfp8_e5m2": 0, "mxfp4": 0}[fmt]
    # all-zero block: E8M0 byte 0; NVFP4 (torchao) byte of 2**-6 (lower clamp)
    assert int(q.scale_bytes[0, 0]) == expect
    el = q.spec.element
    # nothing exceeds max * decode factor
    f = q.scales.float().repeat_interleave(q.block_size, dim=1)
    assert (out.abs() <= el.max_value * f + 0).all()


def test_nvfp4_saturation_at_max() -> None:
    x = torch.full((1, 16), 100.0)
    x[0, 0] = 1e4
    q = quantize(x, "nvfp4")
    assert float(q.dequantize().abs().max()) == 6.0 * float(q.scales.float().max())
    assert float(q.scales.float().max()) == 448.0  # 1e4 / 6 > 448: scale clamps, elements saturate to ±6


@pytest.mark.parametrize("fmt", ALL)
def test_subnormal_inputs(fmt: str) -> None:
    x = torch.randn(2, 64) * 1e-40
    q = quantize(x, fmt)
    out = q.dequantize()
    assert torch.isfinite(out).all()
    assert (out.abs() <= x.abs().max() * 8).all()


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("shape", [(0,), (0, 32), (5, 0), (2, 0, 16), (37,), (3, 5, 40)])
def test_shapes(fmt: str, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape)
    q = quantize(x, fmt)
    assert q.shape == x.shape
    out = q.dequantize()
    assert out.shape == x.shape
    if x.numel():
        assert quantization_error(x, fmt)["sqnr_db"] > 10


@pytest.mark.parametrize("fmt", ALL)
def test_dim_other_than_last(fmt: str) -> None:
    x = torch.randn(48, 6, 5)
    q = quantize(x, fmt, dim=0)
    assert q.block_dim == 0 and q.qdata.shape[:2] == (6, 5)
    ref = quantize(x.movedim(0, -1).contiguous(), fmt)
    assert torch.equal(q.qdata.view(torch.uint8), ref.qdata.view(torch.uint8))
    torch.testing.assert_close(q.dequantize(), ref.dequantize().movedim(-1, 0), rtol=0, atol=0)
    assert torch.equal(quantize(x, fmt, dim=-3).qdata.view(torch.uint8), q.qdata.view(torch.uint8))


@pytest.mark.parametrize("fmt", ALL)
def test_padding_keeps_logical_shape(fmt: str) -> None:
    x = torch.randn(7, 50)
    q = quantize(x, fmt)
    bs = q.block_size
    assert q.k_padded == -(-50 // bs) * bs and q.shape == (7, 50)
    padded = torch.nn.functional.pad(x, (0, q.k_padded - 50))
    qp = quantize(padded, fmt)
    assert torch.equal(q.qdata.view(torch.uint8), qp.qdata.view(torch.uint8))
    torch.testing.assert_close(q.dequantize(), qp.dequantize()[:, :50], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ALL)
def test_input_dtypes(fmt: str, dtype: torch.dtype) -> None:
    x = torch.randn(8, 64).to(dtype)
    q = quantize(x, fmt)
    ref = quantize(x.float(), fmt)
    assert torch.equal(q.qdata.view(torch.uint8), ref.qdata.view(torch.uint8))
    assert q.dequantize().dtype == dtype
    assert q.dequantize(torch.float32).dtype == torch.float32


def test_invalid_requests() -> None:
    x = torch.randn(4, 32)
    with pytest.raises(FormatError, match=r"unknown block-scaled format 'nvfp5'"):
        quantize(x, "nvfp5")
    with pytest.raises(FormatDTypeError, match=r"torch\.int32"):
        quantize(torch.ones(4, 32, dtype=torch.int32), "nvfp4")
    with pytest.raises(TypeError):
        quantize(torch.ones(4, 32, dtype=torch.int64), "mxfp4")
    with pytest.raises(FormatDTypeError):
        quantize([1.0, 2.0], "mxfp4")  # type: ignore[arg-type]
    with pytest.raises(FormatError, match="0-d"):
        quantize(torch.tensor(1.0), "mxfp4")
    with pytest.raises(FormatError, match="dim=2"):
        quantize(x, "mxfp4", dim=2)
    with pytest.raises(FormatError, match="scale_mode"):
        quantize(x, "nvfp4", scale_mode="floor")
    with pytest.raises(FormatError, match="recipe"):
        quantize(x, "mxfp4", recipe="te")
    with pytest.raises(FormatError, match="recipe='tee'"):
        quantize(x, "nvfp4", recipe="tee")
    with pytest.raises(FormatError, match="global_scale"):
        quantize(x, "mxfp8_e4m3", global_scale=True)
    with pytest.raises(FormatError, match="two-level"):
        quantize(x, "nvfp4", recipe="te", global_scale=False)
    with pytest.raises(FormatError, match="reciprocal"):
        quantize(x, "nvfp4", global_scale=0.0)
    with pytest.raises(FormatError, match="rounding"):
        quantize(x, "nvfp4", rounding="up")
    with pytest.raises(FormatError, match="unknown quantization option"):
        quantize(x, "nvfp4", swizle=True)
    with pytest.raises(FormatError, match="backend"):
        quantize(x, "nvfp4", backend="cuda")
    with pytest.raises(DeterminismError):
        quantize(x, "nvfp4", options=QuantOptions(rounding="stochastic", deterministic=True))
    with pytest.raises(FormatError):
        dequantize(x)  # type: ignore[arg-type]
    with pytest.raises(FormatError, match="dtype"):
        quantize(x, "nvfp4").dequantize(torch.int32)
    assert issubclass(FormatError, ValueError)


def test_quantization_error_report() -> None:
    x = torch.randn(64, 128)
    r8 = quantization_error(x, "mxfp8_e4m3")
    r4 = quantization_error(x, "nvfp4")
    assert set(r8) >= {"sqnr_db", "rel_l2", "max_abs_err"}
    assert r8["sqnr_db"] > r4["sqnr_db"] > 15
    assert math.isclose(r4["rel_l2"], 10 ** (-r4["sqnr_db"] / 20), rel_tol=1e-9)
    assert r4["bits_per_element"] == pytest.approx(4.5)
    assert quantization_error(torch.zeros(4, 32), "nvfp4")["sqnr_db"] == math.inf


@pytest.mark.parametrize("fmt", ALL)
def test_requires_grad_and_non_contiguous_inputs(fmt: str) -> None:
    x = torch.randn(64, 40, requires_grad=True)
    q = quantize(x, fmt)
    assert not q.dequantize().requires_grad
    xt = torch.randn(40, 64).t()  # non-contiguous
    assert torch.equal(quantize(xt, fmt).qdata.view(torch.uint8), quantize(xt.contiguous(), fmt).qdata.view(torch.uint8))


def test_flush_denormal_is_refused() -> None:
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        with pytest.raises(FormatError, match="set_flush_denormal"):
            quantize(torch.randn(4, 32), "mxfp4")
    finally:
        torch.set_flush_denormal(False)
    quantize(torch.randn(4, 32), "mxfp4")
