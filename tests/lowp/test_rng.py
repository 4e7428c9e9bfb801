"""The counter-based generator: the documented scalar formula, counter arithmetic, statistics, stream seeds."""

from __future__ import annotations

import math

import pytest
import torch

from torchnext.lowp.rng import MASK32, bits, mix32, stream_seed, uniform


def _scalar_bits(seed: int, c: int) -> int:
    """The module docstring's reference, written again here."""
    key = mix32(seed & MASK32) ^ mix32(((seed >> 32) & MASK32) ^ 0x9E3779B9)
    return mix32(mix32((c & MASK32) ^ key) ^ ((c >> 32) & MASK32) ^ 0x85EBCA6B)


def test_mix32_is_injective_on_a_sample_and_avalanches() -> None:
    assert mix32(0) == 0  # the hash is xor/multiply only: zero is its fixed point (the key salts avoid it)
    sample = [mix32(i) for i in range(1 << 16)]
    assert len(set(sample)) == 1 << 16
    flips = [bin(mix32(x) ^ mix32(x ^ (1 << b))).count("1") for x in range(0, 1 << 20, 4099) for b in range(32)]
    assert 15.5 < sum(flips) / len(flips) < 16.5  # one flipped input bit flips half the output bits


@pytest.mark.parametrize("seed", [0, 1, 0xDEADBEEF, (1 << 63) + 12345, (1 << 64) - 1])
@pytest.mark.parametrize("offset", [0, 7, (1 << 32) - 3, (1 << 40) + 5])
def test_tensor_bits_equal_the_scalar_reference(seed: int, offset: int) -> None:
    got = bits(seed, offset, 9).tolist()
    assert got == [_scalar_bits(seed, offset + i) for i in range(9)]
    assert all(0 <= b <= MASK32 for b in got)


def test_offsets_compose_and_seeds_differ() -> None:
    whole = bits(42, 100, 1000)
    assert torch.equal(whole[500:], bits(42, 600, 500))
    assert not torch.equal(bits(42, 0, 64), bits(43, 0, 64))


def test_uniform_is_uniform_and_exact_in_fp32() -> None:
    u = uniform(stream_seed(1, 2, 3), 0, (256, 256))
    assert u.dtype == torch.float32 and u.shape == (256, 256)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert torch.equal(u * 2**24, torch.floor(u * 2**24))
    n = u.numel()
    assert abs(float(u.mean()) - 0.5) < 4 * math.sqrt(1 / 12 / n)
    hist = torch.histc(u, bins=16, min=0.0, max=1.0)
    expected = n / 16
    chi2 = float(((hist - expected) ** 2 / expected).sum())
    assert chi2 < 60  # 15 degrees of freedom: p < 1e-6 above ~ 52
    # neighbouring counters are not correlated
    flat = u.reshape(-1)
    corr = torch.corrcoef(torch.stack([flat[:-1], flat[1:]]))[0, 1]
    assert abs(float(corr)) < 0.01


def test_stream_seed_is_order_sensitive_and_checked() -> None:
    assert stream_seed(1, 2) != stream_seed(2, 1)
    assert stream_seed(1, 2, 3) == stream_seed(1, 2, 3)
    assert stream_seed() != stream_seed(0)
    assert 0 <= stream_seed(7, 1 << 63) < 1 << 64
    with pytest.raises(ValueError, match="part 1"):
        stream_seed(1, -2)
    with pytest.raises(TypeError, match="int"):
        stream_seed(1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="overflow"):
        bits(0, (1 << 64) - 2, 5)


@pytest.mark.parametrize(("seed", "offset", "numel"), [
    (0, 0, 5000), (0xDEADBEEF, (1 << 32) - 300, 1000),  # the low word wraps inside the call: carry
    ((1 << 64) - 1, (1 << 40) + 5, 777), (3, (1 << 64) - 1000, 1000), (11, (1 << 33) - 1, 2),
])
def test_int32_fast_path_equals_the_int64_reference(seed: int, offset: int, numel: int) -> None:
    from torchnext.lowp.rng import bits_reference

    assert torch.equal(bits(seed, offset, numel), bits_reference(seed, offset, numel))
    want = (bits_reference(seed, offset, numel) >> 8).to(torch.float32) * 2.0**-24
    assert torch.equal(uniform(seed, offset, (numel,)), want)
