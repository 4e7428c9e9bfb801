"""Block-scaled formats: one :class:`FormatSpec` per :class:`Format`, kept in the :data:`FORMATS` registry.

A block-scaled format stores a tensor as small *elements* (FP4 / FP8 codes) plus one *scale* per block of
``block_size`` consecutive elements along one dimension::

    value[i] = decode(element[i]) * decode(scale[i // block_size]) * global_scale   # global_scale: NVFP4 only

Adding a format (e.g. MXFP6 E2M3) is one :class:`FormatSpec` entry: an :class:`ElementSpec` (the minifloat
codec is generic in ``ebits``/``mbits``), a block size and a :class:`ScaleKind`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from torchnext.lowp.errors import FormatError

__all__ = ["ElementKind", "ElementSpec", "FORMATS", "Format", "FormatSpec", "ScaleKind", "format_spec"]


class ElementKind(str, enum.Enum):
    """How element codes are produced and stored."""

    TORCH_FLOAT8 = "torch_float8"
    """A torch float8 dtype: torch's saturating RNE cast; one code per byte, stored with that dtype."""
    MINIFLOAT = "minifloat"
    """A sub-byte float without Inf/NaN (E2M1, E2M3, E3M2): our codec; codes stored in ``uint8``, packed two per
    byte when ``bits == 4`` (element ``2i`` in the low nibble, ``2i + 1`` in the high nibble)."""


class ScaleKind(str, enum.Enum):
    """The scale's number format."""

    E4M3 = "e4m3"
    """FP8 E4M3 (NVFP4): positive values up to 448, with 3 mantissa bits; stored as ``torch.float8_e4m3fn``."""
    E8M0 = "e8m0"
    """Power of two 2**(byte - 127), byte 255 = NaN (OCP MX); stored as ``torch.float8_e8m0fnu``."""


@dataclass(frozen=True, kw_only=True)
class ElementSpec:
    """One element number format."""

    name: str
    """Short name: ``"e2m1"``, ``"e4m3"``, ``"e5m2"``."""
    kind: ElementKind
    """Codec family."""
    bits: int
    """Bits per element code."""
    ebits: int
    """Exponent bits."""
    mbits: int
    """Mantissa bits."""
    max_value: float
    """Largest finite magnitude; larger magnitudes saturate to it."""
    min_normal: float
    """Smallest normal magnitude (the subnormal quantum is ``min_normal * 2**-mbits``)."""
    emax: int
    """``floor(log2(max_value))``: the OCP MX FLOOR scale subtracts it from the block amax exponent."""
    torch_dtype: torch.dtype | None = None
    """Storage dtype for :attr:`ElementKind.TORCH_FLOAT8` elements (None for minifloats)."""

    @property
    def bias(self) -> int:
        """Exponent bias, ``2**(ebits - 1) - 1``."""
        return (1 << (self.ebits - 1)) - 1

    @property
    def per_byte(self) -> int:
        """Element codes per stored byte (2 for FP4, else 1)."""
        return 2 if self.bits == 4 else 1


E2M1 = ElementSpec(name="e2m1", kind=ElementKind.MINIFLOAT, bits=4, ebits=2, mbits=1, max_value=6.0, min_normal=1.0, emax=2)
E4M3 = ElementSpec(
    name="e4m3",
    kind=ElementKind.TORCH_FLOAT8,
    bits=8,
    ebits=4,
    mbits=3,
    max_value=448.0,
    min_normal=2.0**-6,
    emax=8,
    torch_dtype=torch.float8_e4m3fn,
)
E5M2 = ElementSpec(
    name="e5m2",
    kind=ElementKind.TORCH_FLOAT8,
    bits=8,
    ebits=5,
    mbits=2,
    max_value=57344.0,
    min_normal=2.0**-14,
    emax=15,
    torch_dtype=torch.float8_e5m2,
)


class Format(str, enum.Enum):
    """The block-scaled formats torchnext implements (values are the accepted string spellings)."""

    NVFP4 = "nvfp4"
    MXFP8_E4M3 = "mxfp8_e4m3"
    MXFP8_E5M2 = "mxfp8_e5m2"
    MXFP4 = "mxfp4"


@dataclass(frozen=True, kw_only=True)
class FormatSpec:
    """Everything that defines a block-scaled format."""

    name: str
    """The format's name (a :class:`Format` value for the built-in formats)."""
    element: ElementSpec
    """Element number format."""
    block_size: int
    """Consecutive elements sharing one scale."""
    scale: ScaleKind
    """Scale number format."""
    two_level: bool
    """Whether a per-tensor (global) fp32 scale may sit above the block scales (NVFP4)."""

    @property
    def scale_dtype(self) -> torch.dtype:
        """The torch dtype scales are stored with."""
        return torch.float8_e4m3fn if self.scale is ScaleKind.E4M3 else torch.float8_e8m0fnu

    @property
    def bits_per_element(self) -> float:
        """Average storage bits per element, scale included (global scale excluded)."""
        return self.element.bits + 8 / self.block_size


FORMATS: dict[Format, FormatSpec] = {
    Format.NVFP4: FormatSpec(name="nvfp4", element=E2M1, block_size=16, scale=ScaleKind.E4M3, two_level=True),
    Format.MXFP8_E4M3: FormatSpec(name="mxfp8_e4m3", element=E4M3, block_size=32, scale=ScaleKind.E8M0, two_level=False),
    Format.MXFP8_E5M2: FormatSpec(name="mxfp8_e5m2", element=E5M2, block_size=32, scale=ScaleKind.E8M0, two_level=False),
    Format.MXFP4: FormatSpec(name="mxfp4", element=E2M1, block_size=32, scale=ScaleKind.E8M0, two_level=False),
}
"""The registry: one entry per format."""


def format_spec(fmt: Format | str | FormatSpec) -> FormatSpec:
    """Resolve ``fmt`` (a :class:`Format`, its string value such as ``"nvfp4"``, or a spec) to its spec.

    Raises:
        FormatError: unknown format name.
    """
    if isinstance(fmt, FormatSpec):
        return fmt
    if isinstance(fmt, Format):
        return FORMATS[fmt]
    if isinstance(fmt, str):
        try:
            return FORMATS[Format(fmt.lower())]
        except ValueError:
            known = ", ".join(repr(f.value) for f in Format)
            raise FormatError(f"unknown block-scaled format {fmt!r}; known formats: {known}") from None
    raise FormatError(f"format must be a torchnext.lowp.Format or its name, got {type(fmt).__name__}")
