"""``Epilogue``: what happens to the fp32 accumulator of a scaled matmul before it is written out.

Order of operations (the reference, :func:`apply_epilogue`; every backend computes exactly this)::

    y = acc                                   # fp32 (M, N) accumulator of a @ w.T on dequantized operands
    if ep.scale is not None:    y = y * ep.scale        # python scalar, 0-d, per-row (M, 1) or per-column (N,)
    if ep.bias is not None:     y = y + ep.bias         # (N,)
    if ep.activation:           y = ACTIVATIONS[ep.activation](y)
    if ep.residual is not None: y = y + ep.residual     # (M, N), added last
    amax = y.abs().max()  if ep.output_amax  else None  # fp32 0-d, of the fp32 y (before any cast); NaN if y has one
    y_q  = quantize(y, ep.out_format, dim=-1) if ep.out_format else None   # blocks along N, from the fp32 y
    out  = y.to(ep.out_dtype or <a's dtype>)

Tensors given to the epilogue are read as fp32. Activations live in the :data:`ACTIVATIONS` registry
(:func:`register_activation` adds one); the built-ins are ``relu``, ``gelu`` (erf), ``gelu_tanh`` and ``silu``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from torchnext.lowp.errors import FormatError
from torchnext.lowp.formats import Format, FormatSpec, format_spec

if TYPE_CHECKING:
    from torchnext.lowp.tensor import BlockScaledTensor

__all__ = [
    "ACTIVATIONS",
    "Epilogue",
    "EpilogueError",
    "EpilogueOutput",
    "INPLACE_ACTIVATIONS",
    "apply_epilogue",
    "register_activation",
]


class EpilogueError(FormatError):
    """An epilogue that does not fit the matmul: wrong shape or dtype of scale/bias/residual, unknown activation."""


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu,
    "gelu": lambda y: torch.nn.functional.gelu(y),
    "gelu_tanh": lambda y: torch.nn.functional.gelu(y, approximate="tanh"),
    "silu": torch.nn.functional.silu,
}
"""Activation registry: name → elementwise fp32 function (must also trace under ``torch.compile``)."""

INPLACE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu_,
    "gelu": lambda y: torch.ops.aten.gelu_(y),
    "gelu_tanh": lambda y: torch.ops.aten.gelu_(y, approximate="tanh"),
    "silu": lambda y: torch.nn.functional.silu(y, inplace=True),
}
"""In-place twins of :data:`ACTIVATIONS` (same kernels, same bits), used by the eager paths on an accumulator they
own; an activation without one runs out of place."""


def register_activation(
    name: str,
    fn: Callable[[torch.Tensor], torch.Tensor],
    *,
    inplace: Callable[[torch.Tensor], torch.Tensor] | None = None,
    overwrite: bool = False,
) -> None:
    """Add an elementwise activation usable as ``Epilogue(activation=name)`` by every backend.

    ``inplace`` (optional) computes the same values into its argument and returns it; the eager paths use it on
    accumulators they own (saves one (M, N) allocation per call).

    Raises:
        EpilogueError: ``name`` is taken and ``overwrite`` is False.
    """
    if name in ACTIVATIONS and not overwrite:
        raise EpilogueError(f"activation {name!r} is already registered (pass overwrite=True to replace it)")
    ACTIVATIONS[name] = fn
    INPLACE_ACTIVATIONS.pop(name, None)
    if inplace is not None:
        INPLACE_ACTIVATIONS[name] = inplace


@dataclass(frozen=True, kw_only=True, eq=False)
class Epilogue:
    """The fused epilogue of :func:`~torchnext.lowp.mm.scaled_mm` (see the module docstring for the exact order)."""

    scale: float | torch.Tensor | None = None
    """Multiplier of the accumulator: python scalar, 0-d tensor, per-row ``(M, 1)`` or per-column ``(N,)``."""
    bias: torch.Tensor | None = None
    """``(N,)`` added after the scale."""
    activation: str | None = None
    """Name in :data:`ACTIVATIONS` (``"relu"``, ``"gelu"``, ``"gelu_tanh"``, ``"silu"``), or None."""
    residual: torch.Tensor | None = None
    """``(M, N)`` added last (after the activation)."""
    output_amax: bool = False
    """Also return ``max |y|`` (fp32, before the output cast)."""
    out_format: Format | str | FormatSpec | None = None
    """Also return the output quantized to this block-scaled format (blocks along N), e.g. for the next layer."""
    out_dtype: torch.dtype | None = None
    """dtype of the dense output (default: the dtype of ``a``; fp32 for a block-scaled ``a`` quantized from fp32)."""

    def __post_init__(self) -> None:
        if self.activation is not None and self.activation not in ACTIVATIONS:
            known = ", ".join(sorted(ACTIVATIONS))
            raise EpilogueError(f"unknown activation {self.activation!r}; registered: {known}")
        if self.out_format is not None:
            format_spec(self.out_format)  # raises FormatError for unknown names
        if self.out_dtype is not None and (not isinstance(self.out_dtype, torch.dtype) or not self.out_dtype.is_floating_point):
            raise EpilogueError(f"out_dtype must be a floating torch.dtype, got {self.out_dtype!r}")
        if self.scale is not None and not isinstance(self.scale, (int, float, torch.Tensor)):
            raise EpilogueError(f"scale must be a number or a tensor, got {type(self.scale).__name__}")

    # ----------------------------------------------------------------------------------------------- queries
    @property
    def scale_kind(self) -> str | None:
        """``None``, ``"scalar"``, ``"row"`` (M, 1) or ``"col"`` (N,)."""
        s = self.scale
        if s is None:
            return None
        if not isinstance(s, torch.Tensor) or s.dim() == 0 or (s.numel() == 1 and s.dim() != 1):
            return "scalar"
        return "row" if s.dim() == 2 else "col"

    @property
    def out_spec(self) -> FormatSpec | None:
        return None if self.out_format is None else format_spec(self.out_format)

    @property
    def features(self) -> frozenset[str]:
        """The features a backend must support: ``scale``, ``bias``, ``activation``, ``residual``, ``amax``,
        ``out_format``."""
        f = set()
        if self.scale is not None:
            f.add("scale")
        if self.bias is not None:
            f.add("bias")
        if self.activation is not None:
            f.add("activation")
        if self.residual is not None:
            f.add("residual")
        if self.output_amax:
            f.add("amax")
        if self.out_format is not None:
            f.add("out_format")
        return frozenset(f)

    def signature(self) -> str:
        """A short string naming everything that changes the generated code (the autotuner's key part)."""
        parts = []
        if self.scale is not None:
            parts.append(f"scale:{self.scale_kind}")
        if self.bias is not None:
            parts.append("bias")
        if self.activation is not None:
            parts.append(f"act:{self.activation}")
        if self.residual is not None:
            parts.append("res")
        if self.output_amax:
            parts.append("amax")
        if self.out_spec is not None:
            parts.append(f"q:{self.out_spec.name}")
        if self.out_dtype is not None:
            parts.append(f"dt:{str(self.out_dtype).removeprefix('torch.')}")
        return ",".join(parts) or "none"

    def check(self, m: int, n: int) -> None:
        """Raise :class:`EpilogueError` if the tensors do not fit an (m, n) output."""
        s = self.scale
        if isinstance(s, torch.Tensor):
            kind = self.scale_kind
            if kind == "row" and tuple(s.shape) != (m, 1):
                raise EpilogueError(f"per-row scale must have shape ({m}, 1), got {tuple(s.shape)}")
            if kind == "col" and tuple(s.shape) != (n,):
                raise EpilogueError(f"per-column scale must have shape ({n},), got {tuple(s.shape)}")
            if not s.is_floating_point():
                raise EpilogueError(f"scale must be a floating tensor, got {s.dtype}")
        elif isinstance(s, (int, float)) and not math.isfinite(float(s)):
            raise EpilogueError(f"scale must be finite, got {s}")
        if self.bias is not None:
            if not isinstance(self.bias, torch.Tensor) or tuple(self.bias.shape) != (n,):
                got = tuple(self.bias.shape) if isinstance(self.bias, torch.Tensor) else type(self.bias).__name__
                raise EpilogueError(f"bias must be a ({n},) tensor, got {got}")
            if not self.bias.is_floating_point():
                raise EpilogueError(f"bias must be a floating tensor, got {self.bias.dtype}")
        if self.residual is not None:
            if not isinstance(self.residual, torch.Tensor) or tuple(self.residual.shape) != (m, n):
                got = tuple(self.residual.shape) if isinstance(self.residual, torch.Tensor) else type(self.residual).__name__
                raise EpilogueError(f"residual must be an ({m}, {n}) tensor, got {got}")
            if not self.residual.is_floating_point():
                raise EpilogueError(f"residual must be a floating tensor, got {self.residual.dtype}")

    def scale_tensor(self, device: torch.device) -> torch.Tensor | None:
        """The scale as an fp32 tensor broadcastable against (M, N) (0-d, (M, 1) or (N,))."""
        s = self.scale
        if s is None:
            return None
        if isinstance(s, torch.Tensor):
            t = s.to(device=device, dtype=torch.float32)
            return t.reshape(()) if self.scale_kind == "scalar" else t
        return torch.tensor(float(s), dtype=torch.float32, device=device)


@dataclass(kw_only=True, eq=False)
class EpilogueOutput:
    """What an epilogue produced: the dense output, the optional amax and the optional quantized output."""

    output: torch.Tensor
    amax: torch.Tensor | None = None
    quantized: BlockScaledTensor | None = None


def epilogue_pointwise(acc: torch.Tensor, ep: Epilogue, tensors: dict[str, torch.Tensor | None]) -> torch.Tensor:
    """The pointwise part (scale, bias, activation, residual) on an fp32 accumulator; ``tensors`` holds the fp32
    ``scale``/``bias``/``residual`` (as from :func:`epilogue_tensors`). Traceable by ``torch.compile``."""
    y = acc
    s = tensors.get("scale")
    if s is not None:
        y = y * s
    b = tensors.get("bias")
    if b is not None:
        y = y + b
    if ep.activation is not None:
        y = ACTIVATIONS[ep.activation](y)
    r = tensors.get("residual")
    if r is not None:
        y = y + r
    return y


def _epilogue_pointwise_(acc: torch.Tensor, ep: Epilogue, tensors: dict[str, torch.Tensor | None]) -> torch.Tensor:
    """:func:`epilogue_pointwise` computed into ``acc`` (fp32, owned by the caller): the same ops, the same bits."""
    s = tensors.get("scale")
    if s is not None:
        acc.mul_(s)
    b = tensors.get("bias")
    if b is not None:
        acc.add_(b)
    if ep.activation is not None:
        act = INPLACE_ACTIVATIONS.get(ep.activation)
        if act is not None:
            act(acc)
        else:
            acc.copy_(ACTIVATIONS[ep.activation](acc))
    r = tensors.get("residual")
    if r is not None:
        acc.add_(r)
    return acc


def epilogue_tensors(ep: Epilogue, device: torch.device, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor | None]:
    """The epilogue's tensors converted to ``dtype`` on ``device`` (None where absent)."""
    s = ep.scale_tensor(device)
    return {
        "scale": None if s is None else s.to(dtype),
        "bias": None if ep.bias is None else ep.bias.to(device=device, dtype=dtype),
        "residual": None if ep.residual is None else ep.residual.to(device=device, dtype=dtype),
    }


def finish_epilogue(y: torch.Tensor, ep: Epilogue, out_dtype: torch.dtype, amax: torch.Tensor | None = None) -> EpilogueOutput:
    """amax (unless already computed by a fused kernel), output quantization and the cast (see module docstring)."""
    if ep.output_amax and amax is None:
        amax = _amax(y)
    q = None
    if ep.out_format is not None:
        from torchnext.lowp.quantize import quantize

        q = quantize(y, ep.out_format, dim=-1)
    return EpilogueOutput(output=y.to(out_dtype), amax=amax, quantized=q)


def _amax(y: torch.Tensor) -> torch.Tensor:
    if y.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=y.device)
    return y.abs().amax().to(torch.float32)


def apply_epilogue(
    acc: torch.Tensor, ep: Epilogue | None, out_dtype: torch.dtype, *, compute_dtype: Any = None, inplace: bool = False
) -> EpilogueOutput:
    """The reference epilogue (module docstring) applied to an (M, N) accumulator.

    ``compute_dtype`` (default fp32) is the dtype the pointwise part runs in (the reference backend uses fp64 and
    rounds to fp32 before amax / quantization, so every backend is compared on the same fp32 ``y``).
    ``inplace=True``: ``acc`` is an fp32 accumulator the caller owns and no longer needs; the pointwise part then
    overwrites it (same values, no (M, N) temporaries) — unless autograd tracks ``acc``, where it runs out of place.
    """
    ep = ep or Epilogue()
    ep.check(acc.shape[0], acc.shape[1])
    cdt = compute_dtype or torch.float32
    tensors = epilogue_tensors(ep, acc.device, cdt)
    if inplace and cdt == torch.float32 and acc.dtype == torch.float32 and not (torch.is_grad_enabled() and acc.requires_grad):
        y = _epilogue_pointwise_(acc, ep, tensors)
    else:
        y = epilogue_pointwise(acc.to(cdt), ep, tensors).to(torch.float32)
    return finish_epilogue(y, ep, out_dtype)
