"""Triton quantizer (GPU): one fused kernel per call, same bytes as :mod:`torchnext.lowp.quantizers.reference`.

Imported only when ``backend="triton"`` is requested (``import torchnext.lowp`` never imports triton). Each program
handles ``ROWS`` blocks: it loads them once, computes the block amax as an integer max of the sign-cleared bits,
the scale with the recipe's formula (exact divisions via ``div_rn``), rounds the elements and stores the codes and
scale bytes. The element rounding avoids fp32 subnormals (GPU flush-to-zero would break the eager bit trick): the
minifloat code is ``(bits(r) >> (23 - mbits)) - ((127 - bias) << mbits)`` for normal ``r`` and ``r / quantum`` below
``min_normal``.

Status: checked bit-exact against the reference under ``TRITON_INTERPRET=1`` on CPU (tests/lowp/test_triton.py);
on a CUDA device the same test runs for real (skipped without one). Dequantize uses the eager path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchnext.lowp.elements import stochastic_round
from torchnext.lowp.errors import FormatError
from torchnext.lowp.formats import FormatSpec
from torchnext.lowp.options import ResolvedOptions, block_outputs
from torchnext.lowp.quantizers.eager import dequantize_blocks
from torchnext.lowp.rng import CounterNoise, noise_rows
from torchnext.lowp.scales import SCALE_RECIPES, ScaleInputs

__all__ = ["dequantize_blocks", "quantize_blocks"]

_RECIPE_IDS = {"torchao": 0, "te": 1, "floor": 2, "rceil": 3}
_FLT_MAX = 3.4028234663852886e38


@triton.jit
def _e4m3_rne(v):  # type: ignore[no-untyped-def]
    """fp32 v in [0, 448] or NaN → (E4M3 byte, its fp32 value), RNE by the magic-number trick; NaN → 0x7F, NaN."""
    magic = tl.maximum((v.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True), 0.015625)
    magic = magic * (1.5 * 1048576.0)
    r = (v + magic) - magic
    normal = (r.to(tl.int32, bitcast=True) >> 20) - (120 << 3)
    sub = (r * 512.0).to(tl.int32)
    code = tl.where(r < 0.015625, sub, normal)
    code = tl.where(v != v, 0x7F, code)
    return code.to(tl.uint8), r


@triton.jit
def _quantize_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    codes_ptr,
    scales_ptr,
    glob_ptr,
    rounded_ptr,
    n_blocks,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    RECIPE: tl.constexpr,
    HAS_GLOBAL: tl.constexpr,
    BITS: tl.constexpr,
    IS_BF16: tl.constexpr,
    EMAX: tl.constexpr,
    MAXV: tl.constexpr,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    rmask = rows < n_blocks
    offs = rows[:, None] * BLOCK + cols[None, :]
    if IS_BF16:  # raw bf16 bits → fp32 by a shift (exact, subnormals included, on every device)
        raw = tl.load(x_ptr + offs, mask=rmask[:, None], other=0).to(tl.int32) & 0xFFFF
        x = (raw << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(x_ptr + offs, mask=rmask[:, None], other=0.0)
    amax = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1).to(tl.float32, bitcast=True)

    if RECIPE == 0:  # NVFP4 torchao
        block = tl.math.div_rn(amax, 6.0)
        if HAS_GLOBAL:
            g = tl.load(glob_ptr)
            block = tl.math.div_rn(block, g)
        c = tl.where(block != block, block, tl.minimum(tl.maximum(block, 0.015625), 448.0))
        sbyte, sf = _e4m3_rne(c)
        if HAS_GLOBAL:
            mult = tl.math.div_rn(tl.math.div_rn(1.0, g), sf)
        else:
            mult = tl.math.div_rn(1.0, sf)
    elif RECIPE == 1:  # NVFP4 te: glob_ptr holds the encode scale S
        enc = tl.load(glob_ptr)
        sixth: tl.constexpr = 1.0 / 6.0
        s = amax * (enc * sixth)
        c = tl.where(s != s, s, tl.minimum(s, 448.0))
        sbyte, sf = _e4m3_rne(c)
        dec = tl.math.div_rn(1.0, enc)
        m = tl.math.div_rn(1.0, sf * dec)
        mult = tl.where(m != m, _FLT_MAX, tl.minimum(m, _FLT_MAX))
    elif RECIPE == 2:  # MX floor
        field = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
        byte = tl.minimum(tl.maximum(field - EMAX, 0), 255)
        byte = tl.where(amax != amax, 255, byte)
        scale = tl.maximum((byte << 23).to(tl.float32, bitcast=True), 1.1754943508222875e-38)
        mult = tl.math.div_rn(1.0, scale)
        sbyte = byte.to(tl.uint8)
    else:  # MX rceil
        descale = tl.math.div_rn(amax, MAXV)
        bits = descale.to(tl.int32, bitcast=True)
        field = (bits >> 23) & 0xFF
        mant = bits & 0x7FFFFF
        byte = tl.where(field == 0, (mant > 0x400000).to(tl.int32), field + (mant != 0).to(tl.int32))
        byte = tl.minimum(byte, 254)
        byte = tl.where(descale != descale, 255, byte)
        mult = ((255 - byte) << 23).to(tl.float32, bitcast=True) * 0.5
        mult = tl.where(byte == 0, 1.0, mult)
        mult = tl.where(byte == 255, descale, mult)
        sbyte = byte.to(tl.uint8)
    tl.store(scales_ptr + rows, sbyte, mask=rmask)

    y = x * mult[:, None]
    if STOCHASTIC:
        y = tl.load(rounded_ptr + offs, mask=rmask[:, None], other=0.0)  # rounded on the host (see below)
    y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -MAXV), MAXV))
    # generic minifloat RNE (E2M1, E4M3, E5M2 alike; no dependence on the device's fp8 conversion)
    sign = (y.to(tl.int32, bitcast=True) >> (31 - (BITS - 1))) & (1 << (BITS - 1))
    a = tl.abs(y)
    magic = tl.maximum((a.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True), MIN_NORMAL)
    magic = magic * (1.5 * (2.0 ** (23 - MBITS)))
    r = (a + magic) - magic
    normal = (r.to(tl.int32, bitcast=True) >> (23 - MBITS)) - ((127 - BIAS) << MBITS)
    sub = (r * (2.0 ** (MBITS + BIAS - 1))).to(tl.int32)
    code = tl.where(r < MIN_NORMAL, sub, normal)
    magnitude_mask: tl.constexpr = (1 << (BITS - 1)) - 1
    # NaN → all magnitude bits: the FP8 NaN byte (0x7F | sign), FP4 ±6 (FP4 has no NaN; the block scale is NaN)
    code = tl.where(a != a, magnitude_mask, code)
    code = (code & magnitude_mask) | sign
    if BITS == 4:
        pairs = tl.reshape(code, (ROWS, BLOCK // 2, 2))
        lo, hi = tl.split(pairs)
        packed = (lo | (hi << 4)).to(tl.uint8)
        pcols = tl.arange(0, BLOCK // 2)
        tl.store(codes_ptr + rows[:, None] * (BLOCK // 2) + pcols[None, :], packed, mask=rmask[:, None])
    else:
        tl.store(codes_ptr + offs, code.to(tl.uint8), mask=rmask[:, None])


def quantize_blocks(
    x2: torch.Tensor,
    spec: FormatSpec,
    opts: ResolvedOptions,
    inp: ScaleInputs,
    noise: torch.Tensor | CounterNoise | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`torchnext.lowp.quantizers.reference.quantize_blocks`."""
    el = spec.element
    n, block = x2.shape
    codes, scale_bytes = block_outputs(x2, spec)
    if n == 0 or block == 0:
        return codes, scale_bytes.view(spec.scale_dtype)
    rid = _RECIPE_IDS[opts.scale_recipe]
    glob = inp.global_encode if rid == 1 else inp.global_decode
    has_global = glob is not None
    glob_t = (glob if glob is not None else torch.ones((), device=x2.device)).float().reshape(1).to(x2.device)
    rounded = None
    if noise is not None:
        # stochastic rounding: round on the host with the shared definition (the scale multiplier is recomputed
        # there), then the kernel encodes the exactly representable rounded values
        amax = x2.float().abs().amax(dim=1)
        _, mult = SCALE_RECIPES[(opts.scale_recipe, True)](amax, inp)
        u = noise_rows(noise, 0, n, block, device=x2.device)
        rounded = stochastic_round(x2.float() * mult[:, None], el, u).contiguous()
    if el.bits not in (4, 8):
        raise FormatError(f"the triton backend handles 4- and 8-bit elements, not {el.bits}-bit {el.name}")
    is_bf16 = x2.dtype == torch.bfloat16
    xin = x2.contiguous().view(torch.int16) if is_bf16 else x2.float().contiguous()
    rows = max(1, 2048 // block)
    grid = (triton.cdiv(n, rows),)
    _quantize_kernel[grid](
        xin,
        codes.view(torch.uint8),
        scale_bytes,
        glob_t,
        rounded if rounded is not None else xin,
        n,
        BLOCK=block,
        ROWS=rows,
        RECIPE=rid,
        HAS_GLOBAL=has_global,
        BITS=el.bits,
        IS_BF16=is_bf16,
        EMAX=el.emax,
        MAXV=el.max_value,
        MBITS=el.mbits,
        BIAS=el.bias,
        MIN_NORMAL=el.min_normal,
        STOCHASTIC=rounded is not None,
    )
    return codes, scale_bytes.view(spec.scale_dtype)
