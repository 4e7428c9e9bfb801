"""Helpers shared by the backends: turning operands into dense fp32 matrices."""

from __future__ import annotations

import torch

from torchnext.lowp.mm.decode import dequantize_operand
from torchnext.lowp.tensor import BlockScaledTensor
from torchnext.lowp.workspace import cast

__all__ = ["dense_operand"]


def dense_operand(
    x: torch.Tensor | BlockScaledTensor, dtype: torch.dtype = torch.float32, *, scratch_tag: str | None = None
) -> torch.Tensor:
    """``x`` as a dense ``dtype`` matrix (block-scaled operands via the eager LUT dequantizer; with ``scratch_tag``
    decoded or cast into reusable scratch memory, valid until the next use of the tag: see
    :mod:`torchnext.lowp.workspace`)."""
    if isinstance(x, torch.Tensor):
        return cast(x, dtype, scratch_tag)
    return dequantize_operand(x, dtype, scratch_tag=scratch_tag)
