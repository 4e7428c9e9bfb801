"""Shared helpers for the scaled_mm tests."""

from __future__ import annotations

import math

import torch

FORMATS = ("nvfp4", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4")

SQNR_BACKEND_DB = 90.0
"""A backend vs the fp64 reference on the same quantized operands: only fp32 accumulation noise remains."""

SQNR_VS_DENSE_DB = {"nvfp4": 14.0, "mxfp4": 12.0, "mxfp8_e4m3": 27.0, "mxfp8_e5m2": 21.0}
"""reference(quantized w) vs the unquantized fp32 matmul on Gaussian data (weight-only): the format's own error."""


def sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    ref64 = ref.double()
    noise = float(((x.double() - ref64) ** 2).sum())
    signal = float((ref64**2).sum())
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)
