"""Stochastic rounding: unbiased in expectation, reproducible with a generator, refused without one when
determinism is requested."""

from __future__ import annotations

import pytest
import torch

from torchnext.lowp import DeterminismError, QuantOptions, quantize


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8_e4m3", "mxfp8_e5m2"])
def test_unbiased(fmt: str) -> None:
    g = torch.Generator().manual_seed(1234)
    n_blocks = 4096
    base = torch.rand(1, 32, generator=g) * 5 + 0.05  # fixed values between grid points
    base[0, 0] = 6.0  # pins the block scale (amax) so every row quantizes the same values
    x = base.repeat(n_blocks, 1)
    q = quantize(x, fmt, rounding="stochastic", generator=torch.Generator().manual_seed(7))
    xhat = q.dequantize()
    mean = xhat.mean(dim=0)
    rne = quantize(base, fmt).dequantize()[0]
    spread = (xhat - x).std(dim=0) / n_blocks**0.5
    # 5 standard errors, plus slack for values a hair above a grid point (P(up) ~ 1e-6 is invisible in 4096 draws)
    slack = 5 * spread + 1e-4 * base[0].abs()
    scale = q.scales.float()[0].repeat_interleave(q.block_size)
    unsaturated = base[0] < q.spec.element.max_value * scale * (1 - 1e-6)  # saturation clips (documented bias)
    ok = ((mean - base[0]).abs() <= slack) | ~unsaturated
    assert ok.all(), f"biased at {(~ok).nonzero().flatten().tolist()}"
    # and it does round both ways where RNE has an error
    moved = ((rne - base[0]).abs() > 1e-3 * base[0].abs()) & unsaturated
    assert moved.any()
    assert ((xhat - x).std(dim=0)[moved] > 0).all()


def test_reproducible_with_generator() -> None:
    x = torch.randn(64, 64)
    a = quantize(x, "nvfp4", rounding="stochastic", generator=torch.Generator().manual_seed(3))
    b = quantize(x, "nvfp4", rounding="stochastic", generator=torch.Generator().manual_seed(3))
    c = quantize(x, "nvfp4", rounding="stochastic", generator=torch.Generator().manual_seed(4))
    assert torch.equal(a.qdata, b.qdata)
    assert not torch.equal(a.qdata, c.qdata)
    assert torch.equal(a.scale_bytes, quantize(x, "nvfp4").scale_bytes)  # scales stay RNE
    for backend in ("reference", "eager"):
        d = quantize(x, "nvfp4", rounding="stochastic", generator=torch.Generator().manual_seed(3), backend=backend)
        assert torch.equal(a.qdata, d.qdata)


def test_requires_generator_when_deterministic() -> None:
    x = torch.randn(8, 32)
    with pytest.raises(DeterminismError, match="generator"):
        quantize(x, "mxfp4", rounding="stochastic", deterministic=True)
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(DeterminismError):
            quantize(x, "mxfp4", rounding="stochastic")
        quantize(x, "mxfp4", rounding="stochastic", generator=torch.Generator().manual_seed(0))
    finally:
        torch.use_deterministic_algorithms(prev)
    # not deterministic: the global RNG is used
    torch.manual_seed(5)
    a = quantize(x, "mxfp4", options=QuantOptions(rounding="stochastic"))
    torch.manual_seed(5)
    b = quantize(x, "mxfp4", rounding="stochastic")
    assert torch.equal(a.qdata, b.qdata)
