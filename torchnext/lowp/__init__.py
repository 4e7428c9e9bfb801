"""torchnext.lowp: block-scaled low-precision formats (NVFP4, MXFP8 E4M3/E5M2, MXFP4) and the matmuls that use them.

``quantize(x, "nvfp4")`` returns a :class:`BlockScaledTensor` (codes, block scales, optional global scale, layout
metadata); ``dequantize`` reads it back; ``quantization_error`` compares formats on your data. Bytes are identical
to torchao 0.18's reference quantizers (see docs/lowp.md for the exact semantics and the documented differences).

Layout: the format core (``formats``, ``elements``, ``scales``, ``options``, ``tensor``, ``quantize``), the quantizer
kernels (:mod:`torchnext.lowp.quantizers`: reference, eager, triton), the matmuls (:mod:`torchnext.lowp.mm`:
``scaled_mm``, epilogues, kernel backends, autotuner, grouped GEMM), the inference modules on top
(:mod:`torchnext.lowp.nn`) and low-precision training (:mod:`torchnext.lowp.training`: ``Recipe.MXFP8`` /
``Recipe.NVFP4``, ``convert_to_lowp_training``).
"""

from __future__ import annotations

from torchnext.lowp.errors import DeterminismError, FormatDTypeError, FormatError
from torchnext.lowp.formats import FORMATS, ElementKind, ElementSpec, Format, FormatSpec, ScaleKind, format_spec
from torchnext.lowp.hadamard import inverse_rht, rht, rht_signs
from torchnext.lowp.mm import (
                              ACTIVATIONS,
                              BackendUnavailable,
                              Epilogue,
                              EpilogueError,
                              KernelBackend,
                              ScaledMMResult,
                              available_backends,
                              grouped_scaled_mm,
                              register_activation,
                              register_backend,
                              scaled_mm,
)
from torchnext.lowp.nn import MXFP8Linear, NVFP4Linear, QuantizeReport, quantize_
from torchnext.lowp.options import QuantOptions
from torchnext.lowp.pair import quantize_pair
from torchnext.lowp.quantize import dequantize, quantization_error, quantize
from torchnext.lowp.scales import swizzle, unswizzle
from torchnext.lowp.tensor import BlockScaledTensor
from torchnext.lowp.training import (
                                    LowpConversionWarning,
                                    LowpTrainingLinear,
                                    Recipe,
                                    bf16_tail_filter,
                                    convert_to_lowp_training,
                                    lowp_linear,
                                    plan_lowp_training,
                                    set_lowp_step,
)

__all__ = [
    "ACTIVATIONS",
    "BackendUnavailable",
    "Epilogue",
    "EpilogueError",
    "KernelBackend",
    "LowpConversionWarning",
    "LowpTrainingLinear",
    "MXFP8Linear",
    "NVFP4Linear",
    "QuantizeReport",
    "ScaledMMResult",
    "available_backends",
    "bf16_tail_filter",
    "convert_to_lowp_training",
    "grouped_scaled_mm",
    "quantize_",
    "register_activation",
    "register_backend",
    "scaled_mm",
    "plan_lowp_training",
    "set_lowp_step",
    "FORMATS",
    "BlockScaledTensor",
    "DeterminismError",
    "ElementKind",
    "ElementSpec",
    "Format",
    "FormatDTypeError",
    "FormatError",
    "FormatSpec",
    "QuantOptions",
    "Recipe",
    "ScaleKind",
    "dequantize",
    "format_spec",
    "quantization_error",
    "inverse_rht",
    "lowp_linear",
    "quantize",
    "quantize_pair",
    "rht",
    "rht_signs",
    "swizzle",
    "unswizzle",
]

from torchnext.lowp.quantizers import preload_auto as _preload_auto

_preload_auto()  # the kernels "auto" may pick are in the registry before any torch.compile traces a quantize
