"""The outer-gradient codecs (torchnext.ft.compression): payload sizes, round trips against torchnext.lowp's
quantize/dequantize and torch's bf16 cast, and the NVFP4 recipe choice on pseudo-gradient-sized values."""

from __future__ import annotations

import pytest
import torch

from torchnext.ft import OuterDType
from torchnext.ft.compression import bits_per_element, outer_codec
from torchnext.lowp import quantize

_LOWP = {OuterDType.MXFP8: ("mxfp8_e4m3", {}), OuterDType.MXFP4: ("mxfp4", {}), OuterDType.NVFP4: ("nvfp4", {"recipe": "te"})}


@pytest.mark.parametrize("dtype", list(OuterDType))
@pytest.mark.parametrize("numel", [1, 31, 1000, 4096])
def test_round_trip_is_the_formats_own(dtype: OuterDType, numel: int) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 1e-3
    codec = outer_codec(dtype.value)
    payload = codec.encode(x)
    assert payload.dtype == torch.uint8 and payload.dim() == 1 and payload.numel() == codec.wire_bytes(numel)
    got = codec.decode(payload.clone(), numel)
    if dtype is OuterDType.FP32:
        want = x
    elif dtype is OuterDType.BF16:
        want = x.to(torch.bfloat16).float()
    else:
        fmt, options = _LOWP[dtype]
        want = quantize(x, fmt, **options).dequantize(torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_wire_sizes() -> None:
    n = 1 << 20
    assert bits_per_element("fp32", n) == 32 and bits_per_element("bf16", n) == 16
    assert bits_per_element("mxfp8", n) == 8.25 and bits_per_element("mxfp4", n) == 4.25
    assert bits_per_element("nvfp4", n) == 4.5 + 32 / n  # one fp32 global scale per vector
    assert outer_codec("mxfp4").wire_bytes(33) == 2 * 16 + 2  # padded to two blocks: codes + two E8M0 scales


def test_nvfp4_keeps_small_pseudo_gradients() -> None:
    """Pseudo-gradients are small: the single-level (torchao) recipe clamps block scales at 2**-6 and rounds almost
    all to zero; the two-level recipe the codec uses keeps them (relative error of a 4-bit format)."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 1e-3
    single = quantize(x, "nvfp4").dequantize(torch.float32)
    assert torch.count_nonzero(single) < 0.01 * x.numel()  # all but the outliers beyond 2**-7
    codec = outer_codec("nvfp4")
    got = codec.decode(codec.encode(x), x.numel())
    assert float((got - x).norm() / x.norm()) < 0.15


def test_unknown_name() -> None:
    with pytest.raises(ValueError, match=r"unknown outer_dtype 'fp4'; one of \['fp32', 'bf16', 'mxfp8', 'mxfp4', 'nvfp4'\]"):
        outer_codec("fp4")
