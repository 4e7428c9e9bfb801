"""Linear layers with block-scaled weights, and :func:`quantize_` to swap them into a model in place.

``NVFP4Linear`` / ``MXFP8Linear`` hold the weight as buffers (``weight_qdata``, ``weight_scales`` and, for a
two-level NVFP4 recipe, ``weight_global_scale``) so ``state_dict`` / ``load_state_dict`` / ``torch.save`` work as for
any module; the bias stays a float parameter. ``forward(x)`` is::

    a = x.reshape(-1, in_features)
    if not weight_only: a = quantize(a, fmt)        # dynamic activation quantization (same format)
    y = scaled_mm(a, W, epilogue=Epilogue(bias=bias, out_dtype=x.dtype), backend=backend)
    return y.reshape(*x.shape[:-1], out_features)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from torchnext.lowp.errors import FormatError
from torchnext.lowp.formats import Format, format_spec
from torchnext.lowp.mm.epilogue import Epilogue
from torchnext.lowp.mm.scaled_mm import scaled_mm
from torchnext.lowp.quantize import quantize
from torchnext.lowp.tensor import BlockScaledTensor

__all__ = ["LINEAR_FOR_FORMAT", "BlockScaledLinear", "MXFP8Linear", "NVFP4Linear", "QuantizeReport", "quantize_"]


class BlockScaledLinear(nn.Module):
    """``nn.Linear`` with a block-scaled weight (see the module docstring). Subclasses fix :attr:`FORMAT`."""

    FORMAT: ClassVar[Format]
    weight_qdata: torch.Tensor
    weight_scales: torch.Tensor
    weight_global_scale: torch.Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        weight_only: bool = True,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        **quant_options: Any,
    ) -> None:
        super().__init__()
        if in_features <= 0 or out_features <= 0:
            raise FormatError(f"{type(self).__name__}: in_features and out_features must be positive, got {in_features}, {out_features}")
        self.in_features = in_features
        self.out_features = out_features
        self.weight_only = weight_only
        self.backend = backend
        self.quant_options = dict(quant_options)
        self.dtype = dtype
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        self._set_weight(quantize(torch.zeros(out_features, in_features, device=device, dtype=dtype), self.FORMAT, **quant_options))

    def _set_weight(self, q: BlockScaledTensor) -> None:
        self._meta = q  # metadata template (spec, shape, recipe...); tensors come from the buffers
        self.register_buffer("weight_qdata", q.qdata)
        self.register_buffer("weight_scales", q.scales)
        self.register_buffer("weight_global_scale", q.global_scale)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, weight_only: bool = True, backend: str = "auto", **quant_options: Any) -> BlockScaledLinear:
        """Quantize ``linear``'s weight (blocks along in_features) into a new module (bias copied)."""
        if not isinstance(linear, nn.Linear):
            raise FormatError(f"from_linear expects an nn.Linear, got {type(linear).__name__}")
        w = linear.weight.detach()
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        mod.in_features, mod.out_features = linear.in_features, linear.out_features
        mod.weight_only, mod.backend, mod.quant_options, mod.dtype = weight_only, backend, dict(quant_options), w.dtype
        mod.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None
        mod._set_weight(quantize(w, cls.FORMAT, **quant_options))
        return mod

    @property
    def weight(self) -> BlockScaledTensor:
        """The weight as a :class:`BlockScaledTensor` over the current buffers."""
        m = self._meta
        return BlockScaledTensor(
            qdata=self.weight_qdata,
            scales=self.weight_scales,
            global_scale=self.weight_global_scale,
            spec=m.spec,
            shape=m.shape,
            block_dim=m.block_dim,
            swizzled=m.swizzled,
            orig_dtype=m.orig_dtype,
            recipe=m.recipe,
            scale_mode=m.scale_mode,
            rounding=m.rounding,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise FormatError(f"{type(self).__name__}: input has {x.shape[-1]} features, expected {self.in_features}")
        lead = x.shape[:-1]
        a2 = x.reshape(-1, self.in_features)
        a: torch.Tensor | BlockScaledTensor = a2 if self.weight_only else quantize(a2, self.FORMAT)
        ep = Epilogue(bias=self.bias, out_dtype=x.dtype)
        y = scaled_mm(a, self.weight, epilogue=ep, backend=self.backend)
        assert isinstance(y, torch.Tensor)
        return y.reshape(*lead, self.out_features)

    @property
    def weight_nbytes(self) -> int:
        """Bytes held by the quantized weight."""
        return self.weight.nbytes

    def extra_repr(self) -> str:
        mode = "weight_only" if self.weight_only else "dynamic_activation"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"format={self.FORMAT.value}, {mode}, backend={self.backend}"
        )


class NVFP4Linear(BlockScaledLinear):
    """Linear layer with an NVFP4 weight (block 16, E4M3 scales; options such as ``recipe="te"`` pass through)."""

    FORMAT = Format.NVFP4


class MXFP8Linear(BlockScaledLinear):
    """Linear layer with an MXFP8 (E4M3 elements, E8M0 scales, block 32) weight."""

    FORMAT = Format.MXFP8_E4M3


LINEAR_FOR_FORMAT: dict[str, type[BlockScaledLinear]] = {"nvfp4": NVFP4Linear, "mxfp8_e4m3": MXFP8Linear, "mxfp8": MXFP8Linear}
"""Format name → module class used by :func:`quantize_`."""


@dataclass(kw_only=True)
class QuantizeReport:
    """What :func:`quantize_` changed."""

    layers: list[str]
    """Qualified names of the swapped layers."""
    dense_bytes: int
    """Bytes of the original weights."""
    quantized_bytes: int
    """Bytes of the quantized weights (codes + scales)."""

    @property
    def saved_bytes(self) -> int:
        return self.dense_bytes - self.quantized_bytes

    def __str__(self) -> str:
        ratio = self.dense_bytes / self.quantized_bytes if self.quantized_bytes else math.nan
        return (
            f"quantized {len(self.layers)} Linear layers: weights {self.dense_bytes / 2**20:.2f} MiB -> "
            f"{self.quantized_bytes / 2**20:.2f} MiB (saved {self.saved_bytes / 2**20:.2f} MiB, {ratio:.2f}x smaller)"
        )


def quantize_(
    model: nn.Module,
    fmt: Format | str,
    *,
    weight_only: bool = True,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    backend: str = "auto",
    **quant_options: Any,
) -> QuantizeReport:
    """Replace every ``nn.Linear`` in ``model`` (for which ``filter_fn(module, qualified_name)`` is true) by the
    block-scaled linear of ``fmt``, in place; return a :class:`QuantizeReport` (memory saved).

    Raises:
        FormatError: ``fmt`` has no Linear module (supported: nvfp4, mxfp8_e4m3), or ``model`` is itself a Linear
            (wrap it in a container: it cannot be replaced in place).
    """
    name = format_spec(fmt).name
    cls = LINEAR_FOR_FORMAT.get(name)
    if cls is None:
        raise FormatError(f"quantize_: no Linear module for format {name!r}; supported: {sorted(set(LINEAR_FOR_FORMAT) - {'mxfp8'})}")
    if type(model) is nn.Linear:
        raise FormatError("quantize_: cannot replace the root module in place; wrap the Linear in a container")
    layers: list[str] = []
    dense = quant = 0
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            fqn = f"{parent_name}.{child_name}" if parent_name else child_name
            if type(child) is not nn.Linear or (filter_fn is not None and not filter_fn(child, fqn)):
                continue
            new = cls.from_linear(child, weight_only=weight_only, backend=backend, **quant_options)
            setattr(parent, child_name, new)
            layers.append(fqn)
            dense += child.weight.numel() * child.weight.element_size()
            quant += new.weight_nbytes
    return QuantizeReport(layers=layers, dense_bytes=dense, quantized_bytes=quant)
