"""Outer-gradient compression: the wire formats of :class:`~torchnext.ft.StreamingDiLoCo`'s pseudo-gradients.

A pseudo-gradient (one flat fp32 vector per fragment and dtype) goes on the wire in one of the
:class:`OuterDType` formats and is reduced **in fp32**. Meaning, on every rank of the live groups::

    fp32:       out = all_reduce(x, SUM)                                # gloo's result is broadcast: one value
    otherwise:  payloads = all_gather(encode(x))                        # each rank's codes + scales, as bytes
                out = decode(payloads[0]); for r in 1..M-1: out += decode(payloads[r])   # fp32, in rank order

Every rank decodes the same bytes and adds them in the same order with the same kernels, so the result is bitwise
the same everywhere (a rank's own contribution is taken from its payload, quantization error included, never from
its fp32 original). Why an all-gather and not a reduce-scatter of dequantized values: the reduce-scatter sends fp32
(4 bytes per element), the all-gather sends the codes -- ``(M - 1) * bits / 8`` bytes per element received against
a ring all-reduce's ``2 (M - 1) / M * 4``: 0.13x fp32 for MXFP4 and 0.14x for NVFP4 at M = 2, 0.27x / 0.28x at
M = 4 (docs/benchmarks.md has the measurement). A re-quantizing reduce-scatter would stay at ~0.14x for any M but
rounds twice.

The formats (``encode`` / ``decode`` through :mod:`torchnext.lowp`, blocks along the flat vector)::

    bf16:   x.to(bfloat16), decoded exactly to fp32                    2 bytes / element
    mxfp8:  lowp "mxfp8_e4m3", E8M0 scale per 32                       1.03 bytes / element
    mxfp4:  lowp "mxfp4", E2M1 codes, E8M0 scale per 32                0.53 bytes / element
    nvfp4:  lowp "nvfp4", recipe "te": E2M1 codes, E4M3 scale per 16,
            one fp32 global scale (2688 / amax) per vector             0.56 bytes / element + 4

NVFP4 uses the two-level ("te") recipe: torchao's single-level recipe clamps block scales to >= 2**-6, which
rounds every pseudo-gradient element below ~2**-7 to zero. Rounding is round-to-nearest-even (deterministic).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

import torch

from torchnext.lowp import BlockScaledTensor, QuantOptions, quantize

__all__ = ["OuterCodec", "OuterDType", "outer_codec"]


class OuterDType(str, enum.Enum):
    """How pseudo-gradients travel between replica groups (values are the accepted spellings)."""

    FP32 = "fp32"
    """All-reduce (SUM) of the fp32 values: the same as :class:`~torchnext.ft.DiLoCo`."""
    BF16 = "bf16"
    """All-gather of bfloat16 values, fp32 sum."""
    MXFP8 = "mxfp8"
    """All-gather of MXFP8 (E4M3) codes and E8M0 scales, fp32 sum."""
    MXFP4 = "mxfp4"
    """All-gather of MXFP4 (E2M1) codes and E8M0 scales, fp32 sum."""
    NVFP4 = "nvfp4"
    """All-gather of NVFP4 codes, E4M3 scales and a global scale, fp32 sum."""


class OuterCodec:
    """A wire format: ``encode(fp32 vector) -> uint8 payload`` of :meth:`wire_bytes` bytes, ``decode`` back to
    fp32. ``gathered``: reduced by all-gather + local fp32 sum (False: by an fp32 all-reduce, no payload)."""

    dtype: OuterDType
    gathered: bool = True

    def wire_bytes(self, numel: int) -> int:
        """Payload bytes for a vector of ``numel`` elements."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: 1-D fp32. Returns a 1-D uint8 tensor of ``wire_bytes(x.numel())`` bytes."""
        raise NotImplementedError

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """The fp32 vector of ``numel`` elements a payload encodes."""
        raise NotImplementedError


@dataclass(eq=False)
class _Fp32(OuterCodec):
    dtype: OuterDType = OuterDType.FP32
    gathered: bool = False

    def wire_bytes(self, numel: int) -> int:
        return 4 * numel

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous().view(torch.uint8)

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        return payload.view(torch.float32)[:numel]


@dataclass(eq=False)
class _Bf16(OuterCodec):
    dtype: OuterDType = OuterDType.BF16

    def wire_bytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16).view(torch.uint8)

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        return payload.view(torch.bfloat16).to(torch.float32)


@dataclass(eq=False)
class _BlockScaled(OuterCodec):
    """A :mod:`torchnext.lowp` block-scaled format: payload = codes bytes | scale bytes | [fp32 global scale]."""

    dtype: OuterDType
    fmt: str
    options: QuantOptions
    _templates: dict[int, BlockScaledTensor] = field(default_factory=dict)

    def _template(self, numel: int) -> BlockScaledTensor:
        """The layout (metadata, byte counts) of a quantized vector of ``numel`` elements."""
        t = self._templates.get(numel)
        if t is None:
            t = quantize(torch.zeros(numel), self.fmt, options=self.options)
            self._templates[numel] = t
        return t

    def _split(self, numel: int) -> tuple[int, int, bool]:
        t = self._template(numel)
        return t.qdata.numel() * t.qdata.element_size(), t.scales.numel(), t.global_scale is not None

    def wire_bytes(self, numel: int) -> int:
        codes, scales, two_level = self._split(numel)
        return codes + scales + (4 if two_level else 0)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        q = quantize(x, self.fmt, options=self.options)
        parts = [q.qdata.reshape(-1).view(torch.uint8), q.scales.reshape(-1).view(torch.uint8)]
        if q.global_scale is not None:
            parts.append(q.global_scale.reshape(1).to(torch.float32).view(torch.uint8))
        return torch.cat(parts)

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        t = self._template(numel)
        codes, scales, two_level = self._split(numel)
        qdata = payload[:codes].view(t.qdata.dtype).view(t.qdata.shape)
        sc = payload[codes:codes + scales].view(t.scales.dtype).view(t.scales.shape)
        gs = payload[codes + scales:codes + scales + 4].clone().view(torch.float32).reshape(()) if two_level else None
        return replace(t, qdata=qdata, scales=sc, global_scale=gs).dequantize(torch.float32)


_CODECS: dict[OuterDType, OuterCodec] = {
    OuterDType.FP32: _Fp32(),
    OuterDType.BF16: _Bf16(),
    OuterDType.MXFP8: _BlockScaled(OuterDType.MXFP8, "mxfp8_e4m3", QuantOptions()),
    OuterDType.MXFP4: _BlockScaled(OuterDType.MXFP4, "mxfp4", QuantOptions()),
    OuterDType.NVFP4: _BlockScaled(OuterDType.NVFP4, "nvfp4", QuantOptions(recipe="te")),
}
"""The registry: one codec per :class:`OuterDType`."""


def outer_codec(dtype: OuterDType | str) -> OuterCodec:
    """The codec of ``dtype`` (an :class:`OuterDType` or its value, e.g. ``"nvfp4"``).

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    try:
        return _CODECS[OuterDType(dtype)]
    except ValueError:
        raise ValueError(f"unknown outer_dtype {dtype!r}; one of {[d.value for d in OuterDType]}") from None


def bits_per_element(dtype: OuterDType | str, numel: int = 1 << 20) -> float:
    """Wire bits per element of a vector of ``numel`` elements (scales included)."""
    return 8 * outer_codec(dtype).wire_bytes(numel) / numel if numel else math.nan
