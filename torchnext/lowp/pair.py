"""The training cast: both copies of a 2-D tensor (rowwise and columnwise) from one call, :func:`quantize_pair`.

Training multiplies X, W and dY along both of their dims (fprop and dgrad reduce over the last dim, wgrad over the
first), so each is quantized twice, each copy from the high-precision tensor (never one copy from the other)::

    rowwise = quantize(x, fmt, dim=1, options=options)                  # blocks along the last dim
    xc      = rht(x, signs, dim=0) if rht is not None else x            # RHT (torchnext.lowp.hadamard) along dim 0
    colwise = quantize(xc, fmt, dim=0, options=col_options)             # blocks along the first dim
    return rowwise, colwise          # colwise.t(): the (K, M') operand blocked along M' that scaled_mm wants

``block_2d=True`` instead quantizes ``B x B`` tiles (``B`` = the block size; NVFP4's 16x16 weight blocks): one
scale per tile from the tile's amax, so both copies carry the same values (``rowwise.dequantize() ==
colwise.dequantize()``), and a weight and its transpose multiply the same numbers in fprop and dgrad.

Kernel contract (``quantize_pair_blocks``). A quantizer module (:mod:`torchnext.lowp.quantizers`) may define::

    quantize_pair_blocks(x, spec, row_opts, col_opts, row_inputs, col_inputs, signs)
        -> (row_codes, row_scales, col_codes, col_scales)  or  None (declined: the torch path runs)

* ``x``: the (M, K) input, contiguous, float32 / bfloat16 / float16, read once.
* ``spec``: the :class:`~torchnext.lowp.formats.FormatSpec` (block ``B``); ``row_opts`` / ``col_opts``: the
  :class:`~torchnext.lowp.options.ResolvedOptions` of each copy (scale recipe, rounding, ``noise``);
  ``row_inputs`` / ``col_inputs``: their :class:`~torchnext.lowp.scales.ScaleInputs` (global scales, already
  computed — the column amax after the transform when ``signs`` is given).
* ``signs``: None, or the 16 fp32 +/-1 signs: the column copy is then quantized from ``rht(x, signs, dim=0)``
  (the butterfly of :mod:`torchnext.lowp.hadamard`, bit for bit), whose M is padded to a multiple of 16.
  A module that also offers ``rht_amax(x, signs) -> 0-d fp32 max |rht(x, signs, dim=0)|`` lets the caller get
  the column copy's global amax without materializing the transform (two-level formats).
* Outputs, with ``Kp`` = K padded to B, ``Mp`` = M' (M, or M padded to 16 with ``signs``) padded to B, zero
  padding: ``row_codes`` (M, Kp / per_byte) and ``row_scales`` (M * Kp / B,) — the row-major blocks of ``x``;
  ``col_codes`` (K, Mp / per_byte) and ``col_scales`` (K * Mp / B,) — the blocks of ``x.T`` (or of the
  transformed ``x.T``). Code dtypes as ``quantize_blocks``; scales uint8 or the scale dtype.
* Noise (stochastic rounding): ``row_opts.noise = CounterNoise(seed_r, offset_r)``: element (m, k) draws
  ``uniform(seed_r, offset_r + m * Kp + k)``; ``col_opts.noise``: element (k, m) of the column copy draws
  ``uniform(seed_c, offset_c + k * Mp + m)`` — the flat index in each copy's padded block matrix, exactly what
  :func:`~torchnext.lowp.quantize` uses for ``dim=1`` and ``dim=0``.
* The bytes must equal the torch path's (the two ``quantize`` calls above). Swizzling is done by the caller.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from torchnext.lowp import scales as _scales
from torchnext.lowp.elements import pack_nibbles, unpack_nibbles
from torchnext.lowp.errors import FormatError
from torchnext.lowp.formats import Format, FormatSpec, format_spec
from torchnext.lowp.hadamard import check_signs, rht
from torchnext.lowp.options import QuantOptions, ResolvedOptions
from torchnext.lowp.quantize import assemble, check_input, flush_denormal_on, global_scales, quantize
from torchnext.lowp.quantizers import get_quantizer
from torchnext.lowp.tensor import BlockScaledTensor

__all__ = ["quantize_pair", "quantize_tiles"]


def _amax(x: torch.Tensor) -> torch.Tensor:
    if not x.numel():
        return torch.zeros((), device=x.device)
    lo, hi = torch.aminmax(x)
    return torch.maximum(hi, -lo).float()


def _inputs(x: torch.Tensor, spec: FormatSpec, ro: ResolvedOptions) -> tuple[torch.Tensor | None, _scales.ScaleInputs]:
    dec, enc = global_scales(x, spec, ro)
    return dec, _scales.ScaleInputs(spec, dec, enc)


@torch.no_grad()
def quantize_pair(
    x: torch.Tensor,
    fmt: Format | str | FormatSpec,
    *,
    options: QuantOptions | None = None,
    col_options: QuantOptions | None = None,
    rht_signs: torch.Tensor | None = None,
    block_2d: bool = False,
) -> tuple[BlockScaledTensor, BlockScaledTensor]:
    """Rowwise and columnwise copies of the 2-D ``x`` (see the module docstring for the exact meaning).

    Args:
        x: (M, K) float32 / bfloat16 / float16 tensor.
        fmt: the block-scaled format of both copies.
        options: :class:`QuantOptions` of the rowwise copy (recipe, scale mode, rounding, seed, backend, ...).
        col_options: those of the columnwise copy (None: ``options``). Give stochastic copies different seeds
            (or disjoint offsets) to keep their noise independent.
        rht_signs: None, or the 16 +/-1 signs (:func:`~torchnext.lowp.hadamard.rht_signs`): the columnwise copy is
            quantized from ``rht(x, signs, dim=0)`` (M padded to a multiple of 16; its global amax is the
            transformed tensor's), for a wgrad GEMM whose other operand gets the same transform.
        block_2d: ``B x B`` tiles shared by both copies (no RHT, one set of options).

    Returns:
        ``(rowwise, colwise)``: ``rowwise`` of shape (M, K) blocked along dim 1; ``colwise`` of shape (M', K)
        blocked along dim 0, with M' = M, or M rounded up to 16 under RHT.

    Raises:
        FormatError: ``x`` not 2-D, bad options, RHT or separate column options with ``block_2d``, bad signs.

    Example::

        >>> row, col = quantize_pair(torch.randn(64, 96), "mxfp8_e4m3", options=QuantOptions(scale_mode="rceil"))
        >>> row.shape, row.block_dim, col.t().shape, col.t().block_dim
        (torch.Size([64, 96]), 1, torch.Size([96, 64]), 1)
    """
    spec = format_spec(fmt)
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise FormatError(f"quantize_pair expects a 2-D tensor, got {getattr(x, 'shape', type(x).__name__)}")
    opts = options if options is not None else QuantOptions()
    copts = col_options if col_options is not None else opts
    if rht_signs is not None:
        try:
            check_signs(rht_signs)
        except ValueError as exc:
            raise FormatError(f"quantize_pair: {exc}") from None
    if block_2d:
        if rht_signs is not None:
            raise FormatError("quantize_pair: block_2d tiles keep both copies equal; an RHT of one copy would break that")
        if col_options is not None and col_options != opts:
            raise FormatError("quantize_pair: block_2d copies share their values, so they take one set of options")
        return quantize_tiles(x, spec, options=opts)
    row_ro, col_ro = opts.resolve(spec), copts.resolve(spec)
    check_input(x, 1)
    if flush_denormal_on(x.device):
        quantize(x, spec, options=opts)  # raises the documented FormatError
    kernel = get_quantizer(row_ro.backend, x.device, spec) if row_ro.backend == col_ro.backend else None
    pair_kernel = getattr(kernel, "quantize_pair_blocks", None)
    # the column copy's global amax is rht(x)'s: a kernel offering rht_amax computes it without the transform
    use_rht_amax = pair_kernel is not None and spec.two_level and col_ro.amax is None
    rht_amax = getattr(kernel, "rht_amax", None) if use_rht_amax else None
    xc = rht(x, rht_signs, dim=0) if rht_signs is not None and rht_amax is None else x
    if pair_kernel is not None and x.numel():
        xin = x.contiguous()
        row_dec, row_inp = _inputs(x, spec, row_ro)
        col_shape = torch.Size((-(-x.shape[0] // 16) * 16, x.shape[1])) if rht_signs is not None else x.shape
        same_scale = (col_ro.recipe, col_ro.global_scale, col_ro.amax) == (row_ro.recipe, row_ro.global_scale, row_ro.amax)
        if rht_signs is not None and rht_amax is not None:
            col_dec, col_enc = global_scales(xin, spec, col_ro, amax=rht_amax(xin, rht_signs))
            col_inp = _scales.ScaleInputs(spec, col_dec, col_enc)
        elif xc is x and same_scale:  # the same tensor under the same global-scale options: one amax pass
            col_dec, col_inp = row_dec, row_inp
        else:
            col_dec, col_inp = _inputs(xc, spec, col_ro)
        out = pair_kernel(xin, spec, row_ro, col_ro, row_inp, col_inp, rht_signs)
        if out is not None:
            rc, rs, cc, cs = out
            row = assemble(rc, rs.view(spec.scale_dtype), row_dec, spec, row_ro, shape=x.shape, dim=1, orig_dtype=x.dtype)
            col = assemble(cc, cs.view(spec.scale_dtype), col_dec, spec, col_ro, shape=col_shape, dim=0, orig_dtype=x.dtype)
            return row, col
    if rht_signs is not None and xc is x:
        xc = rht(x, rht_signs, dim=0)
    row = quantize(x, spec, dim=1, options=opts)
    col = quantize(xc, spec, dim=0, options=copts)
    if rht_signs is not None:
        col.orig_dtype = x.dtype
    return row, col


def _transpose_codes(codes: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """(R, C / per_byte) codes → (C, R / per_byte), elements transposed (FP4 unpacked and repacked)."""
    if spec.element.per_byte == 2:
        return pack_nibbles(unpack_nibbles(codes).t().contiguous())
    return codes.view(torch.uint8).t().contiguous().view(codes.dtype)


@torch.no_grad()
def quantize_tiles(x: torch.Tensor, fmt: Format | str | FormatSpec, *, options: QuantOptions | None = None,
                   **kwargs: Any) -> tuple[BlockScaledTensor, BlockScaledTensor]:
    """``B x B``-tile quantization of the 2-D ``x`` as the two copies of :func:`quantize_pair` (``block_2d=True``).

    Meaning: pad ``x`` with zeros to multiples of ``B`` in both dims; each tile ``t`` (row-major over the tile grid)
    is one block of ``B * B`` elements: ``scale[t], mult = recipe(amax(|tile|))`` (the global scale from ``x``'s
    amax), codes rounded as :func:`~torchnext.lowp.quantize` does. Rowwise copy: each of a tile's ``B`` rows is a
    1 x B block with the tile's scale; columnwise copy: each of its columns, the same. Stochastic rounding draws
    ``uniform(seed, offset + t * B * B + r * B + c)`` for element (r, c) of tile t.
    """
    spec = format_spec(fmt)
    opts = options if options is not None else QuantOptions()
    if kwargs:
        opts = opts.with_(**kwargs)
    ro = opts.resolve(spec)
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise FormatError(f"quantize_tiles expects a 2-D tensor, got {getattr(x, 'shape', type(x).__name__)}")
    check_input(x, 1)
    if flush_denormal_on(x.device):
        quantize(x, spec, options=opts)  # raises the documented FormatError
    b = spec.block_size
    m, k = x.shape
    mt, kt = -(-m // b), -(-k // b)
    xp = torch.nn.functional.pad(x, (0, kt * b - k, 0, mt * b - m)) if (mt * b, kt * b) != (m, k) else x
    tiles = xp.reshape(mt, b, kt, b).permute(0, 2, 1, 3).reshape(mt * kt, b * b).contiguous()
    dec, inp = _inputs(x, spec, ro)
    codes, scales = get_quantizer(ro.backend).quantize_blocks(tiles, spec, ro, inp, ro.noise)
    pb = spec.element.per_byte
    # the tile codes back in place as a (Mp, Kp) matrix; rowwise drops M's padding rows (K's padding columns are
    # storage padding), columnwise is its element transpose (FP4 unpacked and repacked) without K's padding rows
    full = codes.reshape(mt, kt, b, b // pb).permute(0, 2, 1, 3).reshape(mt * b, kt * b // pb)
    grid = scales.view(torch.uint8).reshape(mt, kt)
    plain = replace(ro, swizzle=False)
    row = assemble(full[:m].contiguous(), grid.repeat_interleave(b, dim=0)[:m].reshape(-1).view(spec.scale_dtype),
                   dec, spec, plain, shape=x.shape, dim=1, orig_dtype=x.dtype)
    col = assemble(_transpose_codes(full, spec)[:k].contiguous(),
                   grid.t().repeat_interleave(b, dim=0)[:k].reshape(-1).view(spec.scale_dtype),
                   dec, spec, plain, shape=x.shape, dim=0, orig_dtype=x.dtype)
    if ro.swizzle:
        row, col = row.with_layout(swizzle=True), col.with_layout(swizzle=True)
    return row, col
