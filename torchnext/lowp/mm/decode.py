"""Operand decoding for the matmul backends: eager LUT dequantization, traceable decoders for Inductor, and the
cached "prepared" (transposed) weight layout of the decode GEMV.

* :func:`dequantize_operand` — eager, fast: FP4 bytes go through a 256-entry table whose entries are the *pair* of
  fp32 values of a byte (low nibble first) stored as one int64, so one ``index_select`` decodes two elements; FP8
  codes are cast; then one in-place multiply by the block scales (times the global scale). Same values as
  :func:`torchnext.lowp.dequantize` (tests compare). With ``dtype=torch.bfloat16`` a 65536-entry table maps two
  bytes to their four bf16 values (one int64) and the multiply runs in bf16: half the bytes written, and bitwise the same as decoding to
  fp32 and casting (each product is rounded once). Without a global scale those bf16 values are *exact*: an E2M1
  element (1 mantissa bit) or an E4M3/E5M2 element (3/2 bits) times an E4M3 scale (3 bits) or an E8M0 power of
  two has at most 5 significant bits and lies in bf16's exponent range (which is fp32's), except products below
  2^-133 (e.g. E5M2 subnormals times E8M0 scales under 2^-117) that underflow. ``with_global_scale=False`` leaves
  the NVFP4 global scale out (the caller multiplies it in later, e.g. on the matmul output).
* :func:`fp4_times2` — traceable: ``2 * e2m1(code)`` from a 4-bit code with integer bit arithmetic and one
  bitcast (≈ 9 vector instructions per 16 codes), which Inductor's C++ backend vectorizes (a table lookup would
  become a scalar gather).
* :func:`prepared_gemv_weight` — ``(codes_b (N / 16, K / 8, 16), scales_b (N / 16, K / block, 16) fp32)``: the
  weight in tiles of 16 output columns, each tile contiguous along K (FP4: int32 words holding 8 consecutive codes
  along K, code ``j`` in bits ``4j..4j+3``; FP8: one code per row), so a GEMV vectorizes along N, streams memory
  and reads each code byte once; the fp32 scales fold in the global scale (and the ½ of :func:`fp4_times2`).
  Built once per weight and cached (weakly keyed by its ``qdata``; rebuilt if the tensor is modified in place).
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from torchnext.lowp.formats import ElementKind, FormatSpec
from torchnext.lowp.tensor import BlockScaledTensor
from torchnext.lowp.workspace import cast, scratch

__all__ = ["GEMV_LANES", "dequantize_operand", "fp4_times2", "is_fp4", "prepared_gemv_weight", "scale_factors"]

_PAIR_LUT: torch.Tensor | None = None
_QUAD_LUT_BF16: torch.Tensor | None = None


def is_fp4(spec: FormatSpec) -> bool:
    return spec.element.kind is ElementKind.MINIFLOAT and spec.element.bits == 4


def _pair_lut() -> torch.Tensor:
    """(256,) int64: byte → (e2m1(low nibble), e2m1(high nibble)) as two fp32 bit patterns (little endian)."""
    global _PAIR_LUT
    if _PAIR_LUT is None:
        mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
        vals = torch.cat([mags, -mags])
        b = torch.arange(256)
        pairs = torch.stack([vals[b & 15], vals[b >> 4]], dim=1).contiguous()
        if not _little_endian():
            pairs = pairs.flip(1).contiguous()
        _PAIR_LUT = pairs.view(torch.int64).reshape(256)
    return _PAIR_LUT


def _quad_lut_bf16() -> torch.Tensor:
    """(65536,) int64: two bytes (4 FP4 codes, in memory order) → their 4 bf16 values' bit patterns."""
    global _QUAD_LUT_BF16
    if _QUAD_LUT_BF16 is None:
        mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
        vals = torch.cat([mags, -mags]).to(torch.bfloat16)  # exact: ≤ 2 significant bits
        # index = the two bytes read as one little-endian uint16: byte 0 = bits 0..7 (codes 0, 1), byte 1 = codes 2, 3
        i = torch.arange(65536)
        quad = torch.stack([vals[(i >> (4 * j)) & 15] for j in range(4)], dim=1).contiguous()
        _QUAD_LUT_BF16 = quad.view(torch.int64).reshape(65536)
    return _QUAD_LUT_BF16


def _little_endian() -> bool:
    import sys

    return sys.byteorder == "little"


def scale_factors(q: BlockScaledTensor, *, with_global_scale: bool = True) -> torch.Tensor:
    """fp32 block factors ``float(scale) * global_scale``, shape ``(*storage_shape[:-1], n_blocks)``."""
    f = q.unswizzled_scales().to(torch.float32)
    if q.global_scale is not None and with_global_scale:
        f = f * q.global_scale.to(torch.float32)
    return f


def dequantize_operand(
    q: BlockScaledTensor,
    dtype: torch.dtype = torch.float32,
    *,
    with_global_scale: bool = True,
    scratch_tag: str | None = None,
) -> torch.Tensor:
    """Dense values of ``q`` (blocks along its last dim), logical shape, as ``dtype`` — the eager fast path.

    ``dtype=torch.bfloat16`` decodes in bf16 directly (see the module docstring: exact without a global scale);
    ``with_global_scale=False`` omits the NVFP4 global scale. ``scratch_tag`` (internal callers only): decode into
    the reusable memory of :func:`torchnext.lowp.workspace.scratch` under that tag — the result is then valid only
    until the next decode with the same tag on this thread, so it must not escape the caller (FP4 and FP8 elements;
    other formats ignore it)."""
    if q.block_dim != len(q.shape) - 1:
        raise ValueError(f"dequantize_operand expects blocks along the last dim, got block_dim={q.block_dim}")
    spec = q.spec
    rest = q.storage_shape[:-1]
    kp = q.k_padded
    nb = kp // spec.block_size
    factors = scale_factors(q, with_global_scale=with_global_scale).reshape(*rest, nb, 1)
    fp4 = is_fp4(spec)
    if not fp4 and spec.element.kind is not ElementKind.TORCH_FLOAT8:
        # generic minifloat (e.g. a registered FP6): the formats' own decoder
        if not with_global_scale and q.global_scale is not None:
            raise ValueError("dequantize_operand: with_global_scale=False needs FP4 or FP8 elements")
        return q.dequantize(dtype)
    if dtype == torch.bfloat16:
        return _dequantize_bf16(q, factors, bf16_factors=q.global_scale is None or not with_global_scale, tag=scratch_tag)
    if fp4:
        pairs = _lookup(_pair_lut().to(q.device), q.qdata.reshape(-1), scratch_tag)
        vals = pairs.view(torch.float32).reshape(*rest, nb, spec.block_size)
    else:
        vals = cast(q.qdata, torch.float32, scratch_tag).reshape(*rest, nb, spec.block_size)  # FP8 → fp32: exact
    vals.mul_(factors)
    out = vals.reshape(*rest, kp)
    if kp != q.k:
        out = out[..., : q.k]
    return out.to(dtype) if dtype != torch.float32 else out


def _lookup(table: torch.Tensor, codes: torch.Tensor, tag: str | None, mask: int | None = None) -> torch.Tensor:
    """``table[codes]`` for 1-D integer codes (made int32 first, optionally ``& mask``), into scratch if tagged."""
    if tag is None:
        idx = codes.to(torch.int32)
        if mask is not None:
            idx = idx & mask
        return torch.index_select(table, 0, idx)
    idx = scratch(f"{tag}.idx", codes.numel(), torch.int32, codes.device)
    idx.copy_(codes)
    if mask is not None:
        idx.bitwise_and_(mask)
    out = scratch(tag, codes.numel(), table.dtype, codes.device)
    return torch.index_select(table, 0, idx, out=out)


def _dequantize_bf16(
    q: BlockScaledTensor, factors: torch.Tensor, *, bf16_factors: bool, tag: str | None = None
) -> torch.Tensor:
    """bf16 decode (FP4 via the bf16 pair table, FP8 by a cast); ``factors`` (..., nb, 1) fp32, exactly
    representable in bf16 when ``bf16_factors`` (no global scale folded in)."""
    spec = q.spec
    rest = q.storage_shape[:-1]
    kp = q.k_padded
    nb = kp // spec.block_size
    if is_fp4(spec) and _little_endian():
        # 4 codes per lookup: half the index conversions and lookups of a per-byte table (512 KiB table, L2-sized)
        quads = _lookup(_quad_lut_bf16().to(q.device), q.qdata.reshape(-1).view(torch.int16), tag, mask=0xFFFF)
        vals = quads.view(torch.bfloat16)
    elif is_fp4(spec):  # big endian: the fp32 pair table (exact values), then a cast
        idx = q.qdata.reshape(-1).to(torch.int32)
        vals = torch.index_select(_pair_lut().to(q.device), 0, idx).view(torch.float32).to(torch.bfloat16)
    else:
        vals = cast(q.qdata, torch.bfloat16, tag)  # E4M3 / E5M2 → bf16 is exact
    vals = vals.reshape(*rest, nb, spec.block_size)
    if bf16_factors:  # E4M3 / E8M0 scales are exact in bf16
        # bf16 * bf16 is computed in fp32 and rounded once: the same bits as the fp32 product cast to bf16.
        # The factors are materialized at full size first: torch's bf16 multiply with a broadcast operand runs a
        # slow path (11 ms for 16M elements here) while a broadcast copy + a same-shape multiply take 1.3 + 1.1 ms.
        full = scratch(f"{tag}.f", vals.numel(), torch.bfloat16, vals.device) if tag else torch.empty_like(vals)
        full = full.view(vals.shape).copy_(factors.to(torch.bfloat16).expand(vals.shape))
        vals.mul_(full)
    else:
        vals = (vals.to(torch.float32) * factors).to(torch.bfloat16)
    out = vals.reshape(*rest, kp)
    return out[..., : q.k] if kp != q.k else out


def fp4_times2(c: torch.Tensor) -> torch.Tensor:
    """``2 * e2m1(c)`` in fp32 for 4-bit codes ``c`` (0..15): exact small integers (0, ±1, ..., ±12).

    Bit arithmetic, no table and no subnormals (so it is also right under flush-to-zero): the magnitude code
    ``e1 e0 m`` shifted into an fp32's low exponent / top mantissa bits plus the bits of 1.0 is ``2^e * (1 + m/2)``,
    which is ``2 * e2m1`` for ``e >= 1``; for ``e == 0`` it is ``1 + m/2`` and ``2 * (f - 1) = m`` is the subnormal
    value; the sign bit (bit 3) is OR'ed into bit 31::

        f = bitcast_f32(((c & 7) << 22) + bits(1.0));  f = 2 * f - 2 if (c & 7) < 2 else f;  sign from c & 8
    """
    c = c if c.dtype == torch.int32 else c.to(torch.int32)
    mag = c & 7
    f = ((mag << 22) + _ONE_BITS).view(torch.float32)
    f = torch.where(mag < 2, f * 2.0 - 2.0, f)
    return (f.view(torch.int32) | ((c & 8) << 28)).view(torch.float32)


_ONE_BITS = 0x3F800000
"""The bits of fp32 1.0."""

GEMV_LANES = 16
"""Width of the N tiles of the prepared GEMV weight (one AVX-512 vector of fp32)."""


class _Prepared:
    __slots__ = ("codes_t", "n", "scales_t", "version")

    def __init__(self, codes_t: torch.Tensor, scales_t: torch.Tensor, version: tuple[int, ...], n: int) -> None:
        self.codes_t = codes_t
        self.scales_t = scales_t
        self.version = version
        self.n = n


_PREPARED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def prepared_gemv_weight(w: BlockScaledTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes_b, scales_b)`` for an (N, K) weight blocked along K (see the module docstring); cached.

    Tiled by :data:`GEMV_LANES` columns: ``codes_b[c, i, l]`` is word ``i`` along K (FP4: an int32 of 8 codes; FP8:
    one code) of output column ``n = c * GEMV_LANES + l``; ``scales_b[c, b, l]`` the fp32 factor of block ``b``.
    Each tile is contiguous, so the GEMV streams it (a (K, N) layout strides N * 4 bytes per step: one page, and
    one TLB entry, per row). N is zero-padded to a multiple of the tile width.
    """
    version = (w.qdata._version, w.scales._version, -1 if w.global_scale is None else w.global_scale._version)
    hit = _PREPARED.get(w.qdata)
    n = w.shape[0]
    if hit is not None and hit.version == version and hit.n == n:
        return hit.codes_t, hit.scales_t
    lanes = GEMV_LANES
    if is_fp4(w.spec):
        # 4 bytes (8 consecutive FP4 codes along K) per int32 word: full-width integer SIMD in the kernel
        codes = w.qdata.reshape(n, -1).view(torch.int32)
    else:
        codes = w.qdata.reshape(n, -1)
    f = scale_factors(w)
    if is_fp4(w.spec):
        f = f * 0.5
    npad = -n % lanes
    if npad:
        codes = torch.nn.functional.pad(codes, (0, 0, 0, npad))
        f = torch.nn.functional.pad(f, (0, 0, 0, npad))
    codes_b = codes.reshape(-1, lanes, codes.shape[1]).transpose(1, 2).contiguous()
    scales_b = f.reshape(-1, lanes, f.shape[1]).transpose(1, 2).contiguous()
    _PREPARED[w.qdata] = _Prepared(codes_b, scales_b, version, n)
    return codes_b, scales_b
