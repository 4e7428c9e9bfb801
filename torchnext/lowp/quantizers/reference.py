"""The reference quantizer: the definitions written plainly on the whole tensor (no chunking, no bit tricks).

It is the oracle for the eager and compiled backends (tests compare bytes) and is itself compared with torchao's
reference and ml_dtypes. Interface shared by every backend (see :mod:`torchnext.lowp.quantizers.eager`)::

    quantize_blocks(x2 (n, B) float, spec, opts, scale_inputs, noise) -> (codes (n, B / per_byte), scales (n,))
    # noise: None (RNE), an (n, B) fp32 tensor of uniform draws, or a CounterNoise(seed, offset)
    dequantize_blocks(codes, scales (n,), spec, global_decode, dtype) -> (n, B) values
"""

from __future__ import annotations

import torch

from torchnext.lowp.elements import decode_reference, encode_reference, pack_nibbles, stochastic_round, unpack_nibbles
from torchnext.lowp.formats import FormatSpec
from torchnext.lowp.options import ResolvedOptions
from torchnext.lowp.rng import CounterNoise, noise_rows
from torchnext.lowp.scales import SCALE_RECIPES, ScaleInputs

__all__ = ["dequantize_blocks", "quantize_blocks"]


def quantize_blocks(
    x2: torch.Tensor,
    spec: FormatSpec,
    opts: ResolvedOptions,
    inp: ScaleInputs,
    noise: torch.Tensor | CounterNoise | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the rows of ``x2``: one block per row, one scale per row (the row length ``B`` is the block:
    ``spec.block_size``, or ``spec.block_size ** 2`` for the 2-D tiles of :func:`torchnext.lowp.quantize_pair`).

    ``noise`` (stochastic rounding only, else None): uniform [0, 1) fp32 draws shaped like ``x2``, or a
    :class:`~torchnext.lowp.rng.CounterNoise` meaning the draw of ``x2[r, j]`` is ``uniform(seed, offset + r * B +
    j)`` (see :mod:`torchnext.lowp.quantize`). Returns ``(codes (n, B / per_byte), scales (n,))``."""
    el = spec.element
    xf = x2.float()
    amax = torch.amax(torch.abs(xf), dim=1) if xf.shape[1] else torch.zeros(xf.shape[0], device=xf.device)
    scale, mult = SCALE_RECIPES[(opts.scale_recipe, False)](amax, inp)
    y = xf * mult[:, None]
    if noise is not None:
        y = stochastic_round(y, el, noise_rows(noise, 0, xf.shape[0], xf.shape[1], device=xf.device))
    codes = encode_reference(y, el)
    if el.per_byte == 2:
        codes = pack_nibbles(codes)
    return codes, scale


def dequantize_blocks(
    codes: torch.Tensor, scales: torch.Tensor, spec: FormatSpec, global_decode: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """``decode(code) * (float(scale) * global_decode)`` in fp32, then cast to ``dtype``."""
    el = spec.element
    if el.per_byte == 2:
        codes = unpack_nibbles(codes)
    factor = scales.float()
    if global_decode is not None:
        factor = factor * global_decode
    return (decode_reference(codes, el) * factor[:, None]).to(dtype)
