"""Operand decoding: exact bf16 decode, the GEMV decode pieces (fp4_times2, tiled prepared weight), and the bf16
grouped_scaled_mm (vs the fp32 per-expert loop, with an explicit SQNR bound)."""

from __future__ import annotations

import pytest
import torch
from mm_helpers import FORMATS, SQNR_BACKEND_DB, sqnr_db

from torchnext.lowp import Epilogue, grouped_scaled_mm, quantize
from torchnext.lowp.mm.decode import dequantize_operand
from torchnext.lowp.mm.grouped import grouped_reference

SQNR_BF16_DB = 40.0
"""bf16 activations and bf16 GEMM output vs the fp32 semantics (≈ 50 dB measured on Gaussian data)."""


def _wide(fmt: str, k: int = 72, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # rows spanning 2^-40 .. 2^40: scales from the bottom to the top of the E4M3 / E8M0 ranges (E4M3 scales
    # saturate/underflow at the extremes, including subnormal E4M3 scales)
    rows = torch.logspace(-40, 40, 96, base=2.0).unsqueeze(1)
    return torch.randn(96, k, generator=g) * rows


@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_decode_is_exact_without_global_scale(fmt: str) -> None:
    q = quantize(_wide(fmt), fmt)
    assert q.global_scale is None
    d32 = q.dequantize(torch.float32)  # the formats' own decoder (oracle)
    d16 = dequantize_operand(q, torch.bfloat16)
    assert d16.dtype == torch.bfloat16 and d16.shape == d32.shape
    assert torch.equal(d16.to(torch.float32), d32)  # no rounding at all
    # also for stacked (E, N, K) weights
    q3 = quantize(_wide(fmt).reshape(4, 24, 72), fmt)
    assert torch.equal(dequantize_operand(q3, torch.bfloat16).to(torch.float32), q3.dequantize(torch.float32))


def test_bf16_decode_with_global_scale() -> None:
    q = quantize(_wide("nvfp4"), "nvfp4", global_scale=True)
    assert q.global_scale is not None
    d32 = q.dequantize(torch.float32)
    # with the global scale folded in: one rounding of the fp32 value (bitwise the fp32 decode cast to bf16)
    assert torch.equal(dequantize_operand(q, torch.bfloat16), d32.to(torch.bfloat16))
    # without it: exact, and times the global scale gives the fp32 values back up to fp32 rounding
    d16 = dequantize_operand(q, torch.bfloat16, with_global_scale=False)
    torch.testing.assert_close(d16.to(torch.float32) * q.global_scale, d32, rtol=2**-23, atol=0)


SIZES = [0, 13, 1, 40, 0, 7, 33]


@pytest.mark.parametrize("fmt,global_scale", [("nvfp4", False), ("nvfp4", True), ("mxfp8_e4m3", False), ("mxfp4", False)])
@pytest.mark.parametrize("fallback", [False, True])
def test_grouped_bf16_vs_fp32_loop(fmt: str, global_scale: bool, fallback: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if fallback:
        monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    g = torch.Generator().manual_seed(0)
    t, e, n, k = sum(SIZES), len(SIZES), 48, 72
    a = torch.randn(t, k, generator=g)
    w = quantize(torch.randn(e, n, k, generator=g), fmt, global_scale=global_scale) if global_scale else quantize(
        torch.randn(e, n, k, generator=g), fmt
    )
    ep = Epilogue(bias=torch.randn(e, n, generator=g), activation="silu", output_amax=True)
    offs = torch.tensor(SIZES).cumsum(0)
    r = grouped_scaled_mm(a, w, offs, epilogue=ep, compute_dtype=torch.bfloat16)
    ref = grouped_reference(a, w, offs, epilogue=Epilogue(bias=ep.bias, activation="silu"))
    y = r.output  # type: ignore[union-attr]
    assert y.dtype == torch.float32 and y.shape == (t, n)
    assert sqnr_db(y, ref) >= SQNR_BF16_DB
    assert float(r.amax) == float(y.abs().max())  # type: ignore[union-attr]
    # and it is really the bf16 path: not bitwise the fp32 result
    y32 = grouped_scaled_mm(a, w, offs, epilogue=Epilogue(bias=ep.bias, activation="silu"))
    assert not torch.equal(y, y32)


def test_grouped_bf16_equals_bf16_oracle() -> None:
    """Oracle built from plain torch ops: exact bf16 weights (fp32 decode cast), bf16 activations, bf16 matmul."""
    g = torch.Generator().manual_seed(5)
    a = torch.randn(20, 64, generator=g)
    w = quantize(torch.randn(2, 16, 64, generator=g), "nvfp4")
    offs = torch.tensor([8, 20])
    y = grouped_scaled_mm(a, w, offs, compute_dtype=torch.bfloat16)
    wb = w.dequantize(torch.float32).to(torch.bfloat16)
    ab = a.to(torch.bfloat16)
    expect = torch.cat([ab[:8] @ wb[0].T, ab[8:] @ wb[1].T]).to(torch.float32)
    # equal up to the bf16 rounding of the output (the GEMM's fp32 summation order may differ by kernel)
    torch.testing.assert_close(y, expect, rtol=2**-7, atol=1e-5)


def test_grouped_compute_dtype_error() -> None:
    w = torch.randn(2, 8, 16)
    with pytest.raises(ValueError, match="compute_dtype"):
        grouped_scaled_mm(torch.randn(4, 16), w, torch.tensor([2, 4]), compute_dtype=torch.float16)


# ------------------------------------------------------------------------------------- GEMV decode pieces
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32])
def test_fp4_times2_all_codes_vs_ml_dtypes(dtype: torch.dtype) -> None:
    import ml_dtypes
    import numpy as np

    from torchnext.lowp.mm.decode import fp4_times2

    codes = np.arange(16, dtype=np.uint8)
    # ml_dtypes' float4_e2m1fn stores one code per byte in the low nibble
    expect = torch.from_numpy((codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32) * 2).copy())
    got = fp4_times2(torch.arange(16, dtype=dtype))
    assert torch.equal(got, expect)
    assert torch.equal(torch.signbit(got), torch.arange(16) >= 8)  # -0.0 for code 8, like the format


def test_fp4_times2_is_right_under_flush_to_zero() -> None:
    from torchnext.lowp.mm.decode import fp4_times2

    ref = fp4_times2(torch.arange(16, dtype=torch.int32))
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        assert torch.equal(fp4_times2(torch.arange(16, dtype=torch.int32)), ref)
    finally:
        torch.set_flush_denormal(False)


def test_prepared_gemv_weight_tiles_and_pads() -> None:
    from torchnext.lowp.mm.decode import GEMV_LANES, prepared_gemv_weight

    w = quantize(torch.randn(40, 64), "nvfp4")
    codes_b, scales_b = prepared_gemv_weight(w)
    assert codes_b.shape == (3, 64 // 8, GEMV_LANES) and scales_b.shape == (3, 64 // 16, GEMV_LANES)
    words = w.qdata.reshape(40, -1).view(torch.int32)
    assert torch.equal(codes_b[1, :, 5], words[GEMV_LANES + 5])
    assert torch.equal(codes_b[2, :, 8:], torch.zeros(8, 8, dtype=torch.int32))  # padding columns
    assert prepared_gemv_weight(w)[0] is codes_b  # cached


def test_inductor_gemv_with_padded_tile_vs_reference() -> None:
    """N = 40 is not a multiple of the 16-column tile; M = 3 is padded to 4 rows."""
    from torchnext.lowp import scaled_mm

    g = torch.Generator().manual_seed(7)
    a, w = torch.randn(3, 96, generator=g), torch.randn(40, 96, generator=g)
    wq = quantize(w, "nvfp4")
    ep = Epilogue(bias=torch.randn(40, generator=g), activation="gelu", output_amax=True)
    res = scaled_mm(a, wq, epilogue=ep, backend="inductor")
    ref = scaled_mm(a, wq, epilogue=ep, backend="reference")
    assert res.output.shape == (3, 40)  # type: ignore[union-attr]
    assert sqnr_db(res.output, ref.output) >= SQNR_BACKEND_DB  # type: ignore[union-attr]
    assert float(res.amax) == float(res.output.abs().max())  # type: ignore[union-attr]
