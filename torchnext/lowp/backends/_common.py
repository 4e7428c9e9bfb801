"""Helpers shared by the backends: turning operands into dense fp32 matrices."""

from __future__ import annotations

import torch

from torchnext.lowp.decode import dequantize_operand
from torchnext.lowp.tensor import BlockScaledTensor

__all__ = ["dense_operand"]


def dense_operand(x: torch.Tensor | BlockScaledTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x`` as a dense ``dtype`` matrix (block-scaled operands via the eager LUT dequantizer)."""
    if isinstance(x, torch.Tensor):
        return x if x.dtype == dtype else x.to(dtype)
    return dequantize_operand(x, dtype)
