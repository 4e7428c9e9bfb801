"""Stochastic rounding: unbiased in expectation, reproducible from a seed (the counter-based generator, with the
documented counter convention), refused without one when determinism is requested."""

from __future__ import annotations

import pytest
import torch

from torchnext.lowp import DeterminismError, FormatError, QuantOptions, quantize
from torchnext.lowp.elements import stochastic_round
from torchnext.lowp.rng import uniform


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8_e4m3", "mxfp8_e5m2"])
def test_unbiased(fmt: str) -> None:
    g = torch.Generator().manual_seed(1234)
    n_blocks = 4096
    base = torch.rand(1, 32, generator=g) * 5 + 0.05  # fixed values between grid points
    base[0, 0] = 6.0  # pins the block scale (amax) so every row quantizes the same values
    x = base.repeat(n_blocks, 1)
    q = quantize(x, fmt, rounding="stochastic", seed=7)
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


def test_reproducible_from_a_seed() -> None:
    x = torch.randn(64, 64)
    a = quantize(x, "nvfp4", rounding="stochastic", seed=3)
    b = quantize(x, "nvfp4", rounding="stochastic", seed=3)
    c = quantize(x, "nvfp4", rounding="stochastic", seed=4)
    d = quantize(x, "nvfp4", rounding="stochastic", seed=3, offset=1)
    assert torch.equal(a.qdata, b.qdata)
    assert not torch.equal(a.qdata, c.qdata)
    assert not torch.equal(a.qdata, d.qdata)
    assert torch.equal(a.scale_bytes, quantize(x, "nvfp4").scale_bytes)  # scales stay RNE
    for backend in ("reference", "eager"):
        e = quantize(x, "nvfp4", rounding="stochastic", seed=3, backend=backend)
        assert torch.equal(a.qdata, e.qdata)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8_e4m3"])
@pytest.mark.parametrize("dim", [-1, 0])
def test_counter_convention(fmt: str, dim: int) -> None:
    """The noise of element i of the padded block matrix x2 is uniform(seed, offset + i): written out here."""
    x = torch.randn(37, 45) * 3  # both dims off the block size: padding consumes counters
    seed, offset = 0xC0FFEE, 1000
    q = quantize(x, fmt, dim=dim, rounding="stochastic", seed=seed, offset=offset, backend="eager")
    # the same rounding done by hand: x2, the RNE block multipliers, the documented draws
    rne = quantize(x, fmt, dim=dim)
    block = q.block_size
    xm = x.movedim(dim, -1)
    xm = torch.nn.functional.pad(xm, (0, q.k_padded - xm.shape[-1]))
    x2 = xm.reshape(-1, block)
    scale = rne.scales.float().reshape(-1, 1) * (rne.global_scale if rne.global_scale is not None else 1.0)
    noise = uniform(seed, offset, x2.shape)
    want = stochastic_round(x2 / scale, q.spec.element, noise) * scale
    got = q.dequantize(torch.float32).movedim(dim, -1)
    got = torch.nn.functional.pad(got, (0, q.k_padded - got.shape[-1])).reshape(-1, block)
    assert torch.equal(got, want)


def test_offsets_split_one_stream() -> None:
    """Two halves quantized with disjoint counter ranges give the bytes of the whole (blocks along dim -1)."""
    x = torch.randn(64, 48)
    whole = quantize(x, "nvfp4", rounding="stochastic", seed=9, global_scale=0.01)
    top = quantize(x[:40], "nvfp4", rounding="stochastic", seed=9, global_scale=0.01)
    bottom = quantize(x[40:], "nvfp4", rounding="stochastic", seed=9, offset=40 * 48, global_scale=0.01)
    assert torch.equal(whole.qdata, torch.cat([top.qdata, bottom.qdata]))


def test_requires_a_seed_when_deterministic() -> None:
    x = torch.randn(8, 32)
    with pytest.raises(DeterminismError, match="seed"):
        quantize(x, "mxfp4", rounding="stochastic", deterministic=True)
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(DeterminismError):
            quantize(x, "mxfp4", rounding="stochastic")
        quantize(x, "mxfp4", rounding="stochastic", seed=0)
    finally:
        torch.use_deterministic_algorithms(prev)
    # not deterministic: the seed is drawn from the global RNG
    torch.manual_seed(5)
    a = quantize(x, "mxfp4", options=QuantOptions(rounding="stochastic"))
    torch.manual_seed(5)
    b = quantize(x, "mxfp4", rounding="stochastic")
    assert torch.equal(a.qdata, b.qdata)


def test_bad_seed_options() -> None:
    x = torch.randn(8, 32)
    with pytest.raises(FormatError, match="only used with rounding='stochastic'"):
        quantize(x, "mxfp4", seed=1)
    with pytest.raises(FormatError, match=r"seed must be an int in \[0, 2\*\*64\)"):
        quantize(x, "mxfp4", rounding="stochastic", seed=-1)
    with pytest.raises(FormatError, match="offset"):
        quantize(x, "mxfp4", rounding="stochastic", seed=1, offset=2**64)
    with pytest.raises(FormatError, match="seed=/offset="):  # the old option names the new ones
        quantize(x, "mxfp4", rounding="stochastic", generator=torch.Generator())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8_e4m3", "mxfp8_e5m2"])
def test_fast_stochastic_round_equals_the_reference(fmt: str) -> None:
    """The eager quantizer's bit-trick rounding gives the reference's values on wide data, saturation, zeros,
    subnormal-range values and NaN."""
    from torchnext.lowp.elements import stochastic_round_fast
    from torchnext.lowp.formats import format_spec

    el = format_spec(fmt).element
    g = torch.Generator().manual_seed(0)
    y = torch.randn(2048, 64, generator=g) * torch.exp2(torch.randint(-14, 8, (2048, 64), generator=g).float())
    y = y.clamp(-el.max_value * 1.02, el.max_value * 1.02)
    y[0, :5] = torch.tensor([float("nan"), -0.0, 0.0, el.max_value, -el.min_normal * 2.0**-el.mbits * 0.5])
    u = uniform(1, 0, y.shape)
    want = stochastic_round(y, el, u)
    got = stochastic_round_fast(y.clone(), el, u)
    assert torch.equal(want.view(torch.int32), got.view(torch.int32))
