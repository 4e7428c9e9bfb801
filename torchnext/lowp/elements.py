"""Element codecs: fp32 values → element codes and back, for every :class:`~torchnext.lowp.formats.ElementSpec`.

Two implementations of each step, compared in the tests:

* ``*_reference``: the definition, written plainly (``torch.round`` of ``|y| / quantum``, a search in the value
  grid, ``torch.signbit``).
* ``*_fast``: a few elementwise passes of integer/float bit manipulation, used by the eager kernels on
  cache-sized chunks.

Semantics (both): the input ``y`` is already divided by its block scale. Magnitudes above ``max_value`` (and ±Inf)
saturate to ±max; rounding is round-to-nearest-even; a code keeps the input's sign (``-0.1`` → ``-0``, code
``0b1000`` for FP4); a NaN element becomes ±max for minifloats (which have no NaN; the block scale carries the NaN)
and NaN for float8.
"""

from __future__ import annotations

import torch

from torchnext.lowp.formats import ElementKind, ElementSpec

__all__ = [
    "decode_reference",
    "encode_fast",
    "encode_reference",
    "minifloat_grid",
    "pack_nibbles",
    "stochastic_round",
    "stochastic_round_fast",
    "unpack_nibbles",
]


def minifloat_grid(spec: ElementSpec) -> torch.Tensor:
    """The non-negative values of a minifloat, indexed by magnitude code (E2M1: 0, .5, 1, 1.5, 2, 3, 4, 6)."""
    values = []
    for code in range(1 << (spec.bits - 1)):
        e, m = code >> spec.mbits, code & ((1 << spec.mbits) - 1)
        if e == 0:
            values.append(m * 2.0 ** (1 - spec.bias - spec.mbits))
        else:
            values.append((1 + m / (1 << spec.mbits)) * 2.0 ** (e - spec.bias))
    return torch.tensor(values, dtype=torch.float32)


def _quantum(a: torch.Tensor, spec: ElementSpec) -> torch.Tensor:
    """Grid spacing of ``spec`` around magnitude ``a``: ``max(2**floor(log2 a), min_normal) * 2**-mbits``."""
    _, exp = torch.frexp(a)
    pow2 = torch.ldexp(torch.ones_like(a), exp - 1)
    return torch.clamp(pow2, min=spec.min_normal) * 2.0**-spec.mbits


# ----------------------------------------------------------------------------------------------------- reference


def encode_reference(y: torch.Tensor, spec: ElementSpec) -> torch.Tensor:
    """Round fp32 ``y`` to ``spec`` (RNE, saturating). Returns codes: uint8 (one per element) for minifloats, the
    float8 dtype for float8 elements. The tiny Python meaning, per element::

        a = min(abs(y), max_value); r = round_half_even(a / quantum(a)) * quantum(a); code = sign | index(r)
    """
    y = y.float()
    if spec.kind is ElementKind.TORCH_FLOAT8:
        assert spec.torch_dtype is not None
        return torch.clamp(y, -spec.max_value, spec.max_value).to(spec.torch_dtype)
    a = torch.clamp(torch.abs(y).nan_to_num(nan=spec.max_value), max=spec.max_value)
    r = torch.clamp(torch.round(a / _quantum(a, spec)) * _quantum(a, spec), max=spec.max_value)
    idx = torch.searchsorted(minifloat_grid(spec).to(y.device), r)
    return (idx + torch.signbit(y).to(torch.int64) * (1 << (spec.bits - 1))).to(torch.uint8)


def decode_reference(codes: torch.Tensor, spec: ElementSpec) -> torch.Tensor:
    """Element codes (as produced by :func:`encode_reference`) → fp32 values."""
    if spec.kind is ElementKind.TORCH_FLOAT8:
        return codes.float()
    grid = minifloat_grid(spec).to(codes.device)
    half = 1 << (spec.bits - 1)
    c = codes.to(torch.int64)
    mag = grid[c % half]
    return torch.where(c >= half, -mag, mag)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes (uint8, last dim even) two per byte: element ``2i`` low nibble, ``2i + 1`` high nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: (..., n) uint8 → (..., 2n) uint8 codes."""
    out = torch.empty((*packed.shape[:-1], packed.shape[-1], 2), dtype=torch.uint8, device=packed.device)
    torch.bitwise_and(packed, 15, out=out[..., 0])
    torch.bitwise_right_shift(packed, 4, out=out[..., 1])
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def stochastic_round(y: torch.Tensor, spec: ElementSpec, noise: torch.Tensor) -> torch.Tensor:
    """Stochastically round ``y`` onto the grid of ``spec`` (saturating at ±max): ``|y|`` goes to the neighbour
    above with probability ``(|y| - lo) / (hi - lo)``, so ``E[result] = y`` below saturation. ``noise`` holds
    uniform [0, 1) draws shaped like ``y``. Returns fp32 grid values (exactly representable in ``spec``)."""
    a = torch.abs(y)
    q = _quantum(torch.clamp(a, max=spec.max_value), spec)
    r = torch.clamp(torch.floor(a / q + noise) * q, max=spec.max_value)
    return torch.where(torch.isnan(y), y, torch.copysign(r, y))


# ---------------------------------------------------------------------------------------------------------- fast


def stochastic_round_fast(y: torch.Tensor, spec: ElementSpec, noise: torch.Tensor) -> torch.Tensor:
    """:func:`stochastic_round` with the grid spacing from the exponent bits (``q = 2**(E(clamp(|y|, min_normal,
    max)) - mbits)``, and ``|y| / q`` as an exact multiplication by the power of two ``1 / q``): the same values,
    fewer passes. ``y`` (a contiguous fp32 chunk) is clobbered; ``noise`` is not."""
    a = y.abs()
    c = torch.clamp(a, min=spec.min_normal, max=spec.max_value)
    exp_bits = c.view(torch.int32).bitwise_and_(_EXP_MASK)
    inv_q = torch.sub(0x7F000000 + (spec.mbits << 23), exp_bits).view(torch.float32)  # 2**(mbits - E), exact
    q = exp_bits.sub_(spec.mbits << 23).view(torch.float32)  # 2**(E - mbits)
    r = a.mul_(inv_q).add_(noise).floor_().mul_(q).clamp_(max=spec.max_value)
    r = torch.where(torch.isnan(y), y, r.copysign_(y))
    return r


_EXP_MASK = 0x7F800000


def encode_fast(y: torch.Tensor, spec: ElementSpec, out: torch.Tensor) -> None:
    """Bit-trick version of :func:`encode_reference` for a contiguous fp32 chunk ``y`` of shape (rows, B) already
    clamped to ±max (NaN allowed); ``y`` is clobbered. Writes ``out``: (rows, B) float8 codes, or (rows, B / per_byte)
    uint8 (packed for FP4).

    Minifloat steps: ``q = max(2**floor(log2 |y|), min_normal) * 2**-mbits``; ``r = (|y| + 1.5 * 2**23 * q) -
    1.5 * 2**23 * q`` is fp32's own RNE onto the grid; ``bits(r * 2**(bias - 127)) >> (23 - mbits)`` is the
    magnitude code (fp32's subnormals line up with the minifloat's); the sign bit comes from ``y``'s bits.
    """
    if spec.kind is ElementKind.TORCH_FLOAT8:
        out.copy_(y)
        return
    sign = torch.bitwise_right_shift(y.view(torch.int32), 31 - (spec.bits - 1))
    sign.bitwise_and_(1 << (spec.bits - 1))
    a = y.abs_()
    magic = torch.bitwise_and(a.view(torch.int32), _EXP_MASK).view(torch.float32)
    magic.clamp_(min=spec.min_normal).mul_(1.5 * 2.0 ** (23 - spec.mbits))
    a.add_(magic).sub_(magic).mul_(2.0 ** (spec.bias - 127))
    code = a.view(torch.int32).bitwise_right_shift_(23 - spec.mbits)
    code.bitwise_and_((1 << (spec.bits - 1)) - 1).bitwise_or_(sign)
    if spec.per_byte == 2:
        high = code[:, 1::2].bitwise_left_shift(4)
        out.copy_(high.bitwise_or_(code[:, 0::2]))
    else:
        out.copy_(code)
