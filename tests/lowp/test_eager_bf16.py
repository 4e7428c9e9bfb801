"""The eager_bf16 scaled_mm backend: exact bf16 operands, one bf16 GEMM, so each output is the fp32-accumulated
product rounded once to bf16 (then the fp32 epilogue); dense operands declined."""

from __future__ import annotations

import pytest
import torch

from torchnext.lowp import BackendUnavailable, Epilogue, quantize, scaled_mm
from torchnext.lowp.mm.decode import dequantize_operand


@pytest.mark.parametrize(("fmt", "opts"), [("nvfp4", {"recipe": "te"}), ("nvfp4", {}), ("mxfp8_e4m3", {}),
                                           ("mxfp8_e5m2", {}), ("mxfp4", {})])
def test_bf16_gemm_rounds_the_exact_product_once(fmt: str, opts: dict[str, object]) -> None:
    g = torch.Generator().manual_seed(0)
    a = quantize(torch.randn(70, 96, generator=g) * 4, fmt, **opts)  # K = 96: MX operands padded
    w = quantize(torch.randn(50, 96, generator=g), fmt, **opts)
    # the operands really are exact in bf16
    for q in (a, w):
        assert torch.equal(dequantize_operand(q, torch.bfloat16, with_global_scale=False).float(),
                           dequantize_operand(q, torch.float32, with_global_scale=False))
    ref = scaled_mm(a, w, backend="reference").double()
    got = scaled_mm(a, w, backend="eager_bf16").double()
    scale = a.dequantize(torch.float64).abs() @ w.dequantize(torch.float64).abs().T  # accumulation-order bound
    assert ((got - ref).abs() <= ref.abs() * 2.0**-8 + scale * 1e-6).all()
    # the epilogue runs in fp32 after the rounding, like every backend's
    ep = Epilogue(bias=torch.randn(50, generator=g), activation="gelu", output_amax=True)
    res = scaled_mm(a, w, epilogue=ep, backend="eager_bf16")
    assert float(res.amax) == float(res.output.abs().max())  # type: ignore[union-attr]


def test_declines_dense_operands() -> None:
    w = quantize(torch.randn(16, 32), "mxfp8_e4m3")
    with pytest.raises(BackendUnavailable, match="dense"):
        scaled_mm(torch.randn(4, 32), w, backend="eager_bf16")
