"""``BlockScaledTensor``: quantized data, block scales and the metadata needed to read them back.

Storage layout (what a scaled-matmul kernel reads):

* The *logical* tensor has shape :attr:`~BlockScaledTensor.shape`; blocks run along :attr:`block_dim`.
* Physically, the block dimension is moved last and padded with zeros to ``k_padded`` (a multiple of the block
  size): ``storage_shape = (*shape without block_dim, k_padded)``.
* :attr:`qdata` has shape ``(*storage_shape[:-1], k_padded // per_byte)``: FP4 as ``uint8`` with element ``2i`` in
  the low nibble and ``2i + 1`` in the high nibble; FP8 as ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``.
  Always contiguous.
* :attr:`scales`: one per block, ``torch.float8_e4m3fn`` (NVFP4) or ``torch.float8_e8m0fnu`` (MX) (``.view(
  torch.uint8)`` gives the bytes, see :attr:`scale_bytes`). Unswizzled: shape ``(*storage_shape[:-1], k_padded //
  block_size)``, row-major. Swizzled: the (rows = prod(storage_shape[:-1]), cols = k_padded // block_size) matrix in
  the SWIZZLE_32_4_4 layout, shape ``(ceil(rows / 128) * 32, ceil(cols / 4) * 16)``
  (see :mod:`torchnext.lowp.scales`).
* :attr:`global_scale`: NVFP4 two-level only, a 0-d fp32 *decode* scale; else None.

``value = decode(qdata) * float(scales) * global_scale`` (fp32), then the padding is dropped and the block dim moved
back to :attr:`block_dim`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from torchnext.lowp import scales as _scales
from torchnext.lowp.errors import FormatError
from torchnext.lowp.formats import FORMATS, Format, FormatSpec, format_spec
from torchnext.lowp.quantizers import get_quantizer

__all__ = ["BlockScaledTensor"]

_SERIAL_VERSION = 1


@dataclass(kw_only=True, eq=False)
class BlockScaledTensor:
    """A tensor quantized to a block-scaled format (see the module docstring for the exact layout)."""

    qdata: torch.Tensor
    """Element codes, block dim last and padded (FP4: packed uint8; FP8: float8 dtype)."""
    scales: torch.Tensor
    """Block scales (float8_e4m3fn or float8_e8m0fnu), unswizzled or swizzled (:attr:`swizzled`)."""
    global_scale: torch.Tensor | None
    """NVFP4 per-tensor fp32 decode scale (0-d), or None."""
    spec: FormatSpec
    """The format."""
    shape: torch.Size
    """Logical shape."""
    block_dim: int
    """Logical dimension the blocks run along (non-negative)."""
    swizzled: bool = False
    """Whether :attr:`scales` are in the SWIZZLE_32_4_4 layout."""
    orig_dtype: torch.dtype = torch.float32
    """dtype of the tensor that was quantized (the default for :meth:`dequantize`)."""
    recipe: str | None = None
    """NVFP4 recipe (``"torchao"``/``"te"``), else None."""
    scale_mode: str | None = None
    """MX scale mode (``"floor"``/``"rceil"``), else None."""
    rounding: str = "rne"
    """Element rounding used (``"rne"``/``"stochastic"``)."""
    _extra: dict[str, Any] = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------------------------------------ geometry
    @property
    def format(self) -> Format | str:
        """The :class:`Format` (its name for a custom spec)."""
        try:
            return Format(self.spec.name)
        except ValueError:
            return self.spec.name

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def k(self) -> int:
        """Logical length of the block dimension."""
        return self.shape[self.block_dim] if len(self.shape) else 0

    @property
    def k_padded(self) -> int:
        """Block dimension length padded to a multiple of the block size."""
        return -(-self.k // self.block_size) * self.block_size

    @property
    def storage_shape(self) -> tuple[int, ...]:
        """Logical shape with the block dim moved last and padded."""
        rest = [s for i, s in enumerate(self.shape) if i != self.block_dim]
        return (*rest, self.k_padded)

    @property
    def scale_matrix_shape(self) -> tuple[int, int]:
        """(rows, blocks per row) of the unswizzled scale matrix."""
        rows = math.prod(self.storage_shape[:-1])
        return rows, self.k_padded // self.block_size

    @property
    def scale_bytes(self) -> torch.Tensor:
        """The scales as raw uint8 bytes (a view)."""
        return self.scales.view(torch.uint8)

    @property
    def device(self) -> torch.device:
        return self.qdata.device

    # ------------------------------------------------------------------------------------------------- memory
    @property
    def nbytes(self) -> int:
        """Bytes held: qdata + scales (+ 4 for a global scale)."""
        extra = self.global_scale.numel() * 4 if self.global_scale is not None else 0
        return self.qdata.nbytes + self.scales.nbytes + extra

    @property
    def dense_nbytes(self) -> int:
        """Bytes of the logical tensor in :attr:`orig_dtype`."""
        return math.prod(self.shape) * torch.empty((), dtype=self.orig_dtype).element_size()

    # ------------------------------------------------------------------------------------------ conversions
    def unswizzled_scales(self) -> torch.Tensor:
        """Scales in row-major layout, shape ``(*storage_shape[:-1], k_padded // block_size)``."""
        rows, cols = self.scale_matrix_shape
        if not self.swizzled:
            return self.scales
        return _scales.unswizzle(self.scales, rows, cols).reshape(*self.storage_shape[:-1], cols)

    def with_layout(self, *, swizzle: bool) -> BlockScaledTensor:
        """The same values with scales in the requested layout (a copy of the scales, qdata shared)."""
        if swizzle == self.swizzled:
            return self
        rows, cols = self.scale_matrix_shape
        if swizzle:
            scales = _scales.swizzle(self.scales.reshape(rows, cols))
        else:
            scales = self.unswizzled_scales()
        return replace(self, scales=scales, swizzled=swizzle)

    def dequantize(self, dtype: torch.dtype | None = None, *, backend: str = "auto") -> torch.Tensor:
        """Values as a dense tensor of ``dtype`` (default :attr:`orig_dtype`) with the logical shape:
        ``decode(code) * float(scale) * global_scale`` computed in fp32 by the quantizer kernel ``backend``, cast to
        ``dtype``, padding dropped, block dim restored (contiguous).

        Raises:
            FormatError: ``dtype`` is not a floating dtype of at least 16 bits, or ``backend`` is unknown.
        """
        dtype = self.orig_dtype if dtype is None else dtype
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
            raise FormatError(f"dequantize dtype must be float16/bfloat16/float32/float64, got {dtype}")
        with torch.no_grad():
            spec = self.spec
            rows, n_blocks = self.scale_matrix_shape
            block = spec.block_size
            codes = self.qdata.reshape(rows * n_blocks, block // spec.element.per_byte)
            scales = self.unswizzled_scales().reshape(rows * n_blocks)
            vals = get_quantizer(backend, self.qdata.device, spec).dequantize_blocks(codes, scales, spec, self.global_scale, dtype)
            out = vals.reshape(self.storage_shape)[..., : self.k]
            if self.block_dim != len(self.shape) - 1:
                out = out.movedim(-1, self.block_dim)
            return out.contiguous()

    def to(self, device: torch.device | str) -> BlockScaledTensor:
        """A copy on ``device`` (same layout and metadata)."""
        gs = self.global_scale.to(device) if self.global_scale is not None else None
        return replace(self, qdata=self.qdata.to(device), scales=self.scales.to(device), global_scale=gs)

    def t(self) -> BlockScaledTensor:
        """Transpose of a 2-D tensor, metadata only: storage is unchanged, the logical shape is swapped and the
        blocks now run along the other logical dim (an (N, K) weight blocked along K becomes a (K, N) operand
        blocked along K, the layout a scaled matmul wants for its second operand).

        Raises:
            FormatError: not 2-D.
        """
        if len(self.shape) != 2:
            raise FormatError(f"t() expects a 2-D BlockScaledTensor, got shape {tuple(self.shape)}")
        return replace(self, shape=torch.Size((self.shape[1], self.shape[0])), block_dim=1 - self.block_dim)

    # ---------------------------------------------------------------------------------------- serialization
    def to_dict(self) -> dict[str, Any]:
        """Tensors plus plain metadata (str/int/bool/list/None): ``torch.save`` it and load with
        ``torch.load(..., weights_only=True)``; rebuild with :meth:`from_dict`."""
        if self.spec.name not in {f.value for f in FORMATS}:
            raise FormatError(f"to_dict supports the built-in formats only, not {self.spec.name!r}")
        return {
            "version": _SERIAL_VERSION,
            "format": self.spec.name,
            "qdata": self.qdata,
            "scales": self.scales,
            "global_scale": self.global_scale,
            "shape": list(self.shape),
            "block_dim": self.block_dim,
            "swizzled": self.swizzled,
            "orig_dtype": str(self.orig_dtype).removeprefix("torch."),
            "recipe": self.recipe,
            "scale_mode": self.scale_mode,
            "rounding": self.rounding,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BlockScaledTensor:
        """Inverse of :meth:`to_dict` (checks the version, the format and the tensor shapes)."""
        if d.get("version") != _SERIAL_VERSION:
            raise FormatError(f"unsupported BlockScaledTensor serialization version {d.get('version')!r}")
        spec = format_spec(d["format"])
        dtype = getattr(torch, d["orig_dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise FormatError(f"unknown orig_dtype {d['orig_dtype']!r}")
        out = cls(
            qdata=d["qdata"],
            scales=d["scales"],
            global_scale=d["global_scale"],
            spec=spec,
            shape=torch.Size(d["shape"]),
            block_dim=int(d["block_dim"]),
            swizzled=bool(d["swizzled"]),
            orig_dtype=dtype,
            recipe=d["recipe"],
            scale_mode=d["scale_mode"],
            rounding=d["rounding"],
        )
        out.check()
        return out

    def check(self) -> None:
        """Raise FormatError if the tensors do not match the metadata."""
        el = self.spec.element
        want_q = (*self.storage_shape[:-1], self.k_padded // el.per_byte)
        if tuple(self.qdata.shape) != want_q:
            raise FormatError(f"qdata shape {tuple(self.qdata.shape)} != expected {want_q}")
        storage = el.torch_dtype if el.torch_dtype is not None else torch.uint8
        if self.qdata.dtype != storage:
            raise FormatError(f"qdata dtype {self.qdata.dtype} != expected {storage}")
        rows, cols = self.scale_matrix_shape
        want_s = _scales.swizzled_shape(rows, cols) if self.swizzled else (*self.storage_shape[:-1], cols)
        if tuple(self.scales.shape) != tuple(want_s):
            raise FormatError(f"scales shape {tuple(self.scales.shape)} != expected {tuple(want_s)}")
        if self.scales.dtype != self.spec.scale_dtype:
            raise FormatError(f"scales dtype {self.scales.dtype} != expected {self.spec.scale_dtype}")

    def __repr__(self) -> str:
        parts = [f"format={self.spec.name}", f"shape={tuple(self.shape)}", f"block_dim={self.block_dim}"]
        if self.recipe is not None:
            parts.append(f"recipe={self.recipe}")
        if self.scale_mode is not None:
            parts.append(f"scale_mode={self.scale_mode}")
        if self.global_scale is not None:
            parts.append(f"global_scale={float(self.global_scale):.6g}")
        if self.rounding != "rne":
            parts.append(f"rounding={self.rounding}")
        parts.append(f"swizzled={self.swizzled}")
        qd = str(self.qdata.dtype).removeprefix("torch.")
        sd = str(self.scales.dtype).removeprefix("torch.")
        parts.append(f"qdata={qd}{tuple(self.qdata.shape)}")
        parts.append(f"scales={sd}{tuple(self.scales.shape)}")
        dense = self.dense_nbytes
        ratio = f", {dense / self.nbytes:.2f}x smaller than {str(self.orig_dtype).removeprefix('torch.')}" if self.nbytes else ""
        parts.append(f"nbytes={_human(self.nbytes)}{ratio}")
        if self.device.type != "cpu":
            parts.append(f"device={self.device}")
        return "BlockScaledTensor(" + ", ".join(parts) + ")"


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"
