"""A counter-based random generator: the same bits for the same (seed, offset) on every backend.

Stochastic rounding needs noise that every implementation (the reference and eager quantizers, Triton, compiled CPU
kernels) reproduces bit for bit, and that data-parallel replicas draw identically from a shared seed. A stateful
``torch.Generator`` gives neither (Triton's and torch's RNGs differ). Here each draw is a pure function of a 64-bit
*seed* and the element's 64-bit *counter* (``offset + flat index``), built from one 32-bit integer hash that any
language writes in five lines (C: ``uint32_t``; Triton: ``tl.uint32``; torch: int64 with a 32-bit mask)::

    M = 0xFFFFFFFF
    def mix32(x):                         # Wellons' "lowbias32": a bijection of uint32 with strong avalanche
        x ^= x >> 16; x = (x * 0x7FEB352D) & M
        x ^= x >> 15; x = (x * 0x846CA68B) & M
        return x ^ (x >> 16)

    def key(seed):                        # per stream
        return mix32(seed & M) ^ mix32(((seed >> 32) & M) ^ 0x9E3779B9)

    def bits(seed, c):                    # c = offset + i, the element's counter (0 <= c < 2**64)
        return mix32(mix32((c & M) ^ key(seed)) ^ ((c >> 32) & M) ^ 0x85EBCA6B)

    def uniform(seed, c):                 # in [0, 1), a multiple of 2**-24: exact in fp32
        return (bits(seed, c) >> 8) * 2**-24

Streams: :func:`stream_seed` folds any tuple of ints (say model seed, layer, step, operand) into one 64-bit seed, so
each (layer, step, operand) draws independent noise and replicas that share the model seed draw the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MASK32", "CounterNoise", "bits", "bits32", "bits_reference", "mix32", "noise_rows", "stream_seed", "uniform", "uniform_like"]

MASK32 = 0xFFFFFFFF
_M1, _M2 = 0x7FEB352D, 0x846CA68B
_SEED_HI_SALT, _COUNTER_HI_SALT = 0x9E3779B9, 0x85EBCA6B
_U64 = (1 << 64) - 1


def mix32(x: int) -> int:
    """The 32-bit hash on a Python int (the scalar reference of :func:`_mix32_t`)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * _M1) & MASK32
    x ^= x >> 15
    x = (x * _M2) & MASK32
    return x ^ (x >> 16)


def _mix32_t(x: torch.Tensor) -> torch.Tensor:
    """:func:`mix32` on an int64 tensor of values in [0, 2**32) (products wrap in int64; the low 32 bits are
    exact), in place where it can."""
    x = x ^ (x >> 16)
    x = (x * _M1) & MASK32
    x ^= x >> 15
    x = (x * _M2) & MASK32
    x ^= x >> 16
    return x


def _check_seed(seed: object, what: str = "seed") -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{what} must be an int, got {type(seed).__name__}")
    if not 0 <= seed <= _U64:
        raise ValueError(f"{what} must be in [0, 2**64), got {seed}")
    return seed


def _key(seed: int) -> int:
    return mix32(seed & MASK32) ^ mix32(((seed >> 32) & MASK32) ^ _SEED_HI_SALT)


def stream_seed(*parts: int) -> int:
    """One 64-bit seed from any number of ints (e.g. ``stream_seed(model_seed, layer, step, operand)``); order
    matters, and equal tuples give equal seeds on every process. Each part must be in [0, 2**64)."""
    h_lo, h_hi = 0x243F6A88, 0x85A308D3  # digits of pi: the empty tuple's seed
    for i, p in enumerate(parts):
        p = _check_seed(p, f"stream_seed part {i}")
        h_lo = mix32(h_lo ^ mix32((p & MASK32) ^ (i * 0x27D4EB2F & MASK32)))
        h_hi = mix32(h_hi ^ mix32(((p >> 32) & MASK32) ^ h_lo))
    return (h_hi << 32) | h_lo


def _i32(v: int) -> int:
    """A uint32 bit pattern as the int32 value with the same bits."""
    return v - (1 << 32) if v >= 1 << 31 else v


_M1_I32, _M2_I32 = _i32(_M1), _i32(_M2)


def _mix32_i32_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """:func:`mix32` in place on an int32 tensor of uint32 bit patterns: products wrap modulo 2**32 (the low 32
    bits, as uint32 arithmetic), right shifts are made logical by masking. ``tmp`` is scratch of x's shape."""
    for shift, mult in ((16, _M1_I32), (15, _M2_I32), (16, None)):
        torch.bitwise_right_shift(x, shift, out=tmp)
        tmp.bitwise_and_((1 << (32 - shift)) - 1)
        x.bitwise_xor_(tmp)
        if mult is not None:
            x.mul_(mult)
    return x


def _check_counters(seed: int, offset: int, numel: int) -> tuple[int, int]:
    seed = _check_seed(seed)
    offset = _check_seed(offset, "offset")
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")
    if offset + numel > _U64 + 1:
        raise ValueError(f"counters offset + numel = {offset + numel} overflow 64 bits")
    return seed, offset


def bits32(seed: int, offset: int, numel: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """The 32-bit draws of counters ``offset .. offset + numel - 1`` as int32 bit patterns (the fast path: int32
    tensors, in-place ops, half the memory traffic of :func:`bits_reference`; the same bits)."""
    seed, offset = _check_counters(seed, offset, numel)
    key = _key(seed)
    lo0, hi0 = offset & MASK32, offset >> 32
    if numel >= 1 << 31:
        raise ValueError(f"bits32 draws at most 2**31 - 1 counters per call, got {numel}")
    h = torch.arange(numel, dtype=torch.int32, device=device)
    h.add_(_i32(lo0))  # wraps: the low word of offset + i
    tmp = torch.empty_like(h)
    h.bitwise_xor_(_i32(key))
    _mix32_i32_(h, tmp)
    wrap_at = (1 << 32) - lo0  # counters from index wrap_at on carry into the high word
    h.bitwise_xor_(_i32((hi0 ^ _COUNTER_HI_SALT) & MASK32))
    if wrap_at < numel:
        h[wrap_at:].bitwise_xor_(_i32(((hi0 ^ _COUNTER_HI_SALT) ^ (((hi0 + 1) & MASK32) ^ _COUNTER_HI_SALT)) & MASK32))
    return _mix32_i32_(h, tmp)


def bits(seed: int, offset: int, numel: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """The 32-bit draws of counters ``offset .. offset + numel - 1`` as an int64 tensor of values in [0, 2**32)."""
    if numel >= 1 << 31:
        return bits_reference(seed, offset, numel, device=device)
    return bits32(seed, offset, numel, device=device).to(torch.int64).bitwise_and_(MASK32)


def bits_reference(seed: int, offset: int, numel: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """:func:`bits` written plainly on int64 tensors (the reference of the int32 fast path)."""
    seed, offset = _check_counters(seed, offset, numel)
    key = _key(seed)
    lo0, hi0 = offset & MASK32, offset >> 32
    idx = torch.arange(numel, dtype=torch.int64, device=device)
    c_lo = idx + lo0  # < 2**33: the carry goes to the high word
    carry = c_lo >> 32
    c_lo &= MASK32
    c_hi = (carry + hi0) & MASK32 if hi0 or numel + lo0 > MASK32 else None
    h = _mix32_t(c_lo ^ key)
    h ^= (c_hi if c_hi is not None else hi0) ^ _COUNTER_HI_SALT
    return _mix32_t(h)


def uniform(seed: int, offset: int, shape: tuple[int, ...] | torch.Size, *,
            device: torch.device | str | None = None) -> torch.Tensor:
    """fp32 draws in [0, 1) (multiples of 2**-24), shaped ``shape`` in row-major counter order: element ``i`` of
    the flattened tensor uses counter ``offset + i``."""
    n = 1
    for s in shape:
        n *= int(s)
    if n >= 1 << 31:
        return ((bits_reference(seed, offset, n, device=device) >> 8).to(torch.float32) * 2.0**-24).reshape(tuple(shape))
    h = bits32(seed, offset, n, device=device)
    h.bitwise_right_shift_(8).bitwise_and_(0xFFFFFF)  # the top 24 bits, as a non-negative int
    return h.to(torch.float32).mul_(2.0**-24).reshape(tuple(shape))


def uniform_like(t: torch.Tensor, seed: int, offset: int = 0) -> torch.Tensor:
    """:func:`uniform` with ``t``'s shape and device."""
    return uniform(seed, offset, t.shape, device=t.device)


@dataclass(frozen=True, kw_only=True)
class CounterNoise:
    """The stochastic-rounding noise of one quantization, as (seed, offset) instead of a materialized tensor.

    Meaning: the noise of element ``j`` of row ``r`` of the padded block matrix ``x2`` (shape ``(n_blocks, B)``,
    row-major, padding elements included) is ``uniform(seed, offset + r * B + j)``. A quantizer kernel either
    computes that in-kernel or asks :meth:`rows` for a chunk of it.
    """

    seed: int
    """64-bit stream seed (e.g. :func:`stream_seed` of (model seed, layer, step, operand))."""
    offset: int = 0
    """Counter of element 0 of ``x2``."""

    def __post_init__(self) -> None:
        _check_seed(self.seed)
        _check_seed(self.offset, "offset")

    def rows(self, start: int, stop: int, block: int, *, device: torch.device | str | None = None) -> torch.Tensor:
        """fp32 noise of rows ``start .. stop - 1`` of a block matrix with rows of ``block`` elements:
        ``uniform(seed, offset + start * block, (stop - start, block))``."""
        return uniform(self.seed, self.offset + start * block, (stop - start, block), device=device)


def noise_rows(
    noise: torch.Tensor | CounterNoise, start: int, stop: int, block: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """Rows ``start .. stop - 1`` of a kernel's noise argument: a slice of a materialized ``(n_blocks, block)``
    fp32 tensor, or computed from a :class:`CounterNoise`."""
    if isinstance(noise, CounterNoise):
        return noise.rows(start, stop, block, device=device)
    return noise[start:stop]
