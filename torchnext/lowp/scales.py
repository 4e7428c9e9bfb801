"""Block scales: per-block amax → stored scale byte and the fp32 multiplier applied to the block's elements.

Every recipe returns ``(scale, mult)``: ``scale`` is the stored scale (``float8_e4m3fn`` or ``float8_e8m0fnu``, one
per block) and ``mult`` the fp32 factor with which the elements are multiplied before rounding (``y = x * mult``,
then clamped to ±max). The formulas (``amax`` = max |x| over the block, fp32 arithmetic, RNE casts):

* NVFP4 ``torchao``, no global scale: ``s = e4m3(clamp(amax / 6, 2**-6, 448))``, ``mult = 1 / s``.
* NVFP4 ``torchao``, global decode scale ``g``: ``s = e4m3(clamp((amax / 6) / g, 2**-6, 448))``,
  ``mult = (1 / g) / s``. ``g`` must have a finite reciprocal (``g >= 2**-126``; a smaller ``g`` would turn exact
  zeros into NaN via ``0 * inf``, as torchao does), so the computed ``g`` is ``max(amax / 2688, 2**-126)``.
* NVFP4 ``te`` with encode scale ``S = 1 / g``: ``s = e4m3(min(amax * (S * fp32(1/6)), 448))`` (zero allowed),
  ``mult = fmin(1 / (s * (1 / S)), FLT_MAX)``.
* MX ``floor``: ``byte = clamp(exponent(amax) - emax, -127, 128) + 127`` with ``exponent`` the unbiased fp32
  exponent field (Inf → 128, subnormals/0 → -127), NaN → 255; ``mult = 1 / max(2**(byte - 127), 2**-126)``.
* MX ``rceil``: ``byte = clamp(ceil(log2(amax / max)), -127, 127) + 127`` (exact ceil), Inf → 254, NaN → 255;
  ``mult = 2**(127 - byte)``, except byte 0 → 1.
  (torchao's eager fallback computes ``ceil(torch.log2(.))``, which rounds ``log2`` of a descale a few ulps above a
  power of two down to the integer; the exact ceil here is what the hardware ``cvt.rp...ue8m0`` instruction does.)

Each recipe has a plain reference (``frexp``/``ldexp``) and a fast bit-manipulation version; the same NaN/Inf
behaviour is kept in both. The block computations are 1/16 or 1/32 of the element work, so both are cheap.

Swizzle: :func:`swizzle` / :func:`unswizzle` convert a (rows, cols) scale matrix to and from the cuBLAS/CUTLASS
SWIZZLE_32_4_4 layout: padded with zeros to a multiple of 128 rows x 4 columns; within each 128x4 tile the byte
for (r, c) sits at ``(r % 32) * 16 + (r // 32) * 4 + c``; tiles are ordered row-block-major. Stored as a 2-D tensor
of shape (ceil(rows/128) * 32, ceil(cols/4) * 16) (torchao's shape).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchnext.lowp.formats import FormatSpec

__all__ = [
    "SCALE_RECIPES",
    "ScaleInputs",
    "swizzle",
    "swizzle_reference",
    "swizzled_shape",
    "te_encode_scale",
    "torchao_global_scale",
    "unswizzle",
]

FLT_MAX = torch.finfo(torch.float32).max
E4M3_MAX = 448.0
E4M3_TINY = 2.0**-6
FP4_MAX = 6.0
MIN_GLOBAL = 2.0**-126
"""Smallest global decode scale (its reciprocal must be finite)."""


class ScaleInputs:
    """What a scale recipe needs besides the block amax."""

    __slots__ = ("global_decode", "global_encode", "spec")

    def __init__(
        self, spec: FormatSpec, global_decode: torch.Tensor | None, global_encode: torch.Tensor | None = None
    ) -> None:
        self.spec = spec
        self.global_decode = global_decode
        """0-d fp32 decode scale (NVFP4 two-level) or None."""
        self.global_encode = global_encode if global_encode is not None else (
            None if global_decode is None else 1.0 / global_decode
        )
        """0-d fp32 encode scale (the te recipe computes it first, the decode scale is its reciprocal)."""


def _f32(v: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32, device=like.device)


def torchao_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """Per-tensor decode scale of the torchao recipe: ``max(amax / (448 * 6), 2**-126)``; 1 when amax is 0 or not
    finite."""
    g = torch.clamp(amax.float() / (E4M3_MAX * FP4_MAX), min=MIN_GLOBAL)
    ok = torch.isfinite(amax) & (amax > 0)
    return torch.where(ok, g, _f32(1.0, g))


def te_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """TransformerEngine global *encode* scale: ``fmin(2688 / amax, FLT_MAX)``, 1 when amax is 0 or Inf."""
    s = torch.fmin(_f32(E4M3_MAX * FP4_MAX, amax) / amax.float(), _f32(FLT_MAX, amax))
    bad = (amax == 0) | (s == 0)
    return torch.where(bad, _f32(1.0, s), s)


# --------------------------------------------------------------------------------------------------------- NVFP4


def _nvfp4_torchao(amax: torch.Tensor, inp: ScaleInputs) -> tuple[torch.Tensor, torch.Tensor]:
    block = amax / FP4_MAX
    g = inp.global_decode
    if g is None:
        s = torch.clamp(block, E4M3_TINY, E4M3_MAX).to(torch.float8_e4m3fn)
        return s, 1.0 / s.float()
    s = torch.clamp(block / g, E4M3_TINY, E4M3_MAX).to(torch.float8_e4m3fn)
    return s, (1.0 / g) / s.float()


def _nvfp4_te(amax: torch.Tensor, inp: ScaleInputs) -> tuple[torch.Tensor, torch.Tensor]:
    enc = inp.global_encode
    assert enc is not None
    sixth = _f32(1.0 / 6.0, amax)
    s = torch.clamp(amax * (enc * sixth), max=E4M3_MAX).to(torch.float8_e4m3fn)
    dec = 1.0 / enc
    return s, torch.fmin(1.0 / (s.float() * dec), _f32(FLT_MAX, amax))


# ------------------------------------------------------------------------------------------------------ MX (E8M0)


def _e8m0(byte: torch.Tensor) -> torch.Tensor:
    return byte.to(torch.uint8).view(torch.float8_e8m0fnu)


def _mx_floor_reference(amax: torch.Tensor, inp: ScaleInputs) -> tuple[torch.Tensor, torch.Tensor]:
    _, exp = torch.frexp(amax)
    unbiased = (exp - 1).to(torch.int32)  # floor(log2 amax) for finite amax > 0
    unbiased = torch.where(amax == 0, -127, unbiased)
    unbiased = torch.where(torch.isinf(amax), 128, unbiased)
    byte = torch.clamp(unbiased - inp.spec.element.emax, -127, 128) + 127
    byte = torch.where(torch.isnan(amax), 255, byte)
    scale = torch.ldexp(torch.ones_like(amax), byte - 127)  # 255 → inf
    scale = torch.clamp(scale, min=2.0**-126)
    return _e8m0(byte), 1.0 / scale


def _mx_floor_fast(amax: torch.Tensor, inp: ScaleInputs) -> tuple[torch.Tensor, torch.Tensor]:
    field = torch.bitwise_right_shift(amax.view(torch.int32), 23).bitwise_and_(0xFF)
    byte = torch.clamp(field - inp.spec.element.emax, min=0, max=255)  # = clamp(e - 127 - emax, -127, 128) + 127
    byte = torch.where(amax.isnan(), 255, byte)
    scale = torch.bitwise_left_shift(byte, 23).view(torch.float32).clamp_(min=2.0**-126)
    return _e8m0(byte), scale.reciprocal_()


def _mx_rceil_reference(amax: torch.Tensor, inp: ScaleInputs) -> tuple[torch.Tensor, torch.Tensor]:
    descale = amax / inp.spec.element.max_value
    mant, exp = torch.frexp(descale)
    ceil_log2 = torch.where(mant == 0.5, exp - 1, exp).to(torch.int32)  # exact ceil(log2 d) for finite d > 0
    byte = torch.clamp(ceil_log2, -127, 127) + 127
    byte = torch.where(descale == 0, 0, byte)
    byte = torch.where(torch.isinf(descale), 254, byte)
    byte = torch.where(torch.isnan(descale), 255, byte)
    mult = torch.ldexp(torch.ones_like(amax), 127 - byte)
    mult = torch.where(byte == 0, 1.0, mult)
    mult = torch.where(byte == 255, float("nan"), mult)
    return _e8m0(byte), mult


def _mx_rceil_fast(amax: torch.Tensor, inp: ScaleInputs) -> tuple[torch.Tensor, torch.Tensor]:
    descale = amax / inp.spec.element.max_value
    bits = descale.view(torch.int32)
    field = torch.bitwise_right_shift(bits, 23).bitwise_and_(0xFF)
    mant = torch.bitwise_and(bits, 0x7FFFFF)
    byte = torch.where(field == 0, (mant > 0x400000).to(torch.int32), field + (mant != 0).to(torch.int32))
    byte.clamp_(max=254)
    byte = torch.where(descale.isnan(), 255, byte)
    mult = torch.bitwise_left_shift(255 - byte, 23).view(torch.float32).mul_(0.5)  # 2**(127 - byte), exact
    mult = torch.where(byte == 0, 1.0, mult)
    mult = torch.where(byte == 255, descale, mult)  # NaN
    return _e8m0(byte), mult


ScaleFn = Callable[[torch.Tensor, ScaleInputs], tuple[torch.Tensor, torch.Tensor]]

SCALE_RECIPES: dict[tuple[str, bool], ScaleFn] = {
    ("torchao", False): _nvfp4_torchao,
    ("torchao", True): _nvfp4_torchao,
    ("te", False): _nvfp4_te,
    ("te", True): _nvfp4_te,
    ("floor", False): _mx_floor_reference,
    ("floor", True): _mx_floor_fast,
    ("rceil", False): _mx_rceil_reference,
    ("rceil", True): _mx_rceil_fast,
}
"""(recipe or scale mode, fast?) → function(amax fp32 (n,), ScaleInputs) → (scale (n,), mult fp32 (n,))."""


# ------------------------------------------------------------------------------------------------------- swizzle


def swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    """Shape of the swizzled scale matrix for a (rows, cols) one."""
    return -(-rows // 128) * 32, -(-cols // 4) * 16


def swizzle(scales: torch.Tensor) -> torch.Tensor:
    """(rows, cols) scales → SWIZZLE_32_4_4 layout (see module docstring), by reshapes and one permute."""
    rows, cols = scales.shape
    rb, cb = -(-rows // 128), -(-cols // 4)
    u8 = scales.view(torch.uint8)
    if (rows, cols) != (rb * 128, cb * 4):
        padded = torch.zeros(rb * 128, cb * 4, dtype=torch.uint8, device=scales.device)
        padded[:rows, :cols] = u8
        u8 = padded
    # index (rb, r4=r//32 in tile, r32=r%32, cb, c) → (rb, cb, r32, r4, c)
    tiles = u8.view(rb, 4, 32, cb, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(rb * 32, cb * 16).contiguous().view(scales.dtype)


def unswizzle(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle`: back to (rows, cols) row-major (the padding is dropped)."""
    rb, cb = -(-rows // 128), -(-cols // 4)
    if tuple(swizzled.shape) != (rb * 32, cb * 16):
        raise ValueError(f"swizzled scales of shape {tuple(swizzled.shape)} do not match ({rows}, {cols}) scales")
    u8 = swizzled.view(torch.uint8).reshape(rb, cb, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return u8.reshape(rb * 128, cb * 4)[:rows, :cols].contiguous().view(swizzled.dtype)


def swizzle_reference(scales: torch.Tensor) -> torch.Tensor:
    """Swizzle by the published index formula, one scatter: byte (r, c) → tile (r // 128, c // 4), offset
    ``(r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4``."""
    rows, cols = scales.shape
    srows, scols = swizzled_shape(rows, cols)
    cb = scols // 16
    out = torch.zeros(srows * scols, dtype=torch.uint8, device=scales.device)
    r = torch.arange(rows, device=scales.device).view(-1, 1)
    c = torch.arange(cols, device=scales.device).view(1, -1)
    tile = (r // 128) * cb + c // 4
    offset = (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    out[(tile * 512 + offset).reshape(-1)] = scales.view(torch.uint8).reshape(-1)
    return out.view(srows, scols).view(scales.dtype)
