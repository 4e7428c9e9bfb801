"""An independent numpy + ml_dtypes implementation of the NVFP4 training recipe's casts (test oracle).

Written from the published math (NVIDIA, arXiv 2509.25149; TransformerEngine's NVFP4 formulas), not from
torchnext code:

* per-tensor encode scale ``S = 448 * 6 / amax`` (fp32; 1 when amax is 0 or S is 0), decode scale ``1 / S``;
* block scale ``s = e4m3(min(block_amax * (S * fp32(1/6)), 448))`` (RNE); element multiplier
  ``fmin(1 / (s * (1 / S)), FLT_MAX)``; elements RNE to E2M1 (ml_dtypes), saturating at 6;
* 1 x 16 blocks along a dim (zero padding), or 16 x 16 tiles (one scale per tile, both orientations);
* random Hadamard transform along M: per group of 16, ``0.25 * butterfly(signs * v)`` in fp32 (the documented
  butterfly order), amax taken after it;
* stochastic rounding: ``floor(|y| / q + u) * q`` with ``q`` the E2M1 spacing at ``|y|`` (0.5 below 2, 1 below 4,
  2 above), saturating at 6; ``u`` from the counter-based generator's documented formula (mix32, reimplemented
  here on numpy uint32) at counter ``offset + i`` for the element's flat index in the padded block matrix.

Outputs: packed codes (element 2i in the low nibble), scale bytes, and the decode scale.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
M32 = np.uint64(0xFFFFFFFF)


# ------------------------------------------------------------------------------------------ counter-based noise
def _mix32(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64) & M32
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & M32
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & M32
    return x ^ (x >> np.uint64(16))


def uniform(seed: int, offset: int, n: int) -> np.ndarray:
    """fp32 draws of counters offset .. offset + n - 1 (the rng module docstring's formula)."""
    key = int(_mix32(np.array([seed & 0xFFFFFFFF]))[0]) ^ int(_mix32(np.array([((seed >> 32) & 0xFFFFFFFF) ^ 0x9E3779B9]))[0])
    c = np.arange(offset, offset + n, dtype=np.uint64)
    h = _mix32((c & M32) ^ np.uint64(key))
    h = _mix32(h ^ (c >> np.uint64(32)) ^ np.uint64(0x85EBCA6B))
    return ((h >> np.uint64(8)).astype(np.float64) * 2.0**-24).astype(np.float32)


# --------------------------------------------------------------------------------------------------- the math
def encode_scale(x: np.ndarray) -> np.float32:
    amax = F32(np.max(np.abs(x))) if x.size else F32(0)
    with np.errstate(divide="ignore", over="ignore"):
        s = F32(min(F32(2688.0) / amax if amax != 0 else F32(np.inf), FLT_MAX))
    return F32(1.0) if amax == 0 or s == 0 else s


def _round_e2m1_stochastic(y: np.ndarray, u: np.ndarray) -> np.ndarray:
    a = np.abs(y).astype(np.float32)
    q = np.where(a < 2, F32(0.5), np.where(a < 4, F32(1.0), F32(2.0))).astype(np.float32)
    r = (np.floor((a / q).astype(np.float32) + u).astype(np.float32) * q).astype(np.float32)
    return np.copysign(np.minimum(r, F32(6.0)), y).astype(np.float32)


def quantize_rows(x2: np.ndarray, s_enc: np.float32, noise: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Blocks = rows of x2 (n, B): (codes (n, B) uint8 E2M1 codes, scale bytes (n,))."""
    sixth = F32(1.0) / F32(6.0)
    s_dec = F32(F32(1.0) / s_enc)
    amax = np.max(np.abs(x2), axis=1).astype(np.float32)
    s = np.minimum((amax * F32(s_enc * sixth)).astype(np.float32), F32(448.0))
    s8 = s.astype(ml_dtypes.float8_e4m3fn)
    sf = s8.astype(np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        mult = np.minimum((F32(1.0) / (sf * s_dec).astype(np.float32)).astype(np.float32), FLT_MAX)
        y = (x2 * mult[:, None]).astype(np.float32)
    if noise is not None:
        y = _round_e2m1_stochastic(y, noise.reshape(y.shape))
    y = np.clip(y, -6.0, 6.0).astype(np.float32)
    return y.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & np.uint8(15), s8.view(np.uint8)


def pack(codes: np.ndarray) -> np.ndarray:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def blocks_1x16(x: np.ndarray, seed: int | None = None, offset: int = 0) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """x (R, C) blocked along C: packed codes (R, Cp / 2), scales (R, Cp / 16), decode scale."""
    x = x.astype(np.float32)
    r, c = x.shape
    cp = -(-c // 16) * 16
    xp = np.zeros((r, cp), np.float32)
    xp[:, :c] = x
    s_enc = encode_scale(x)
    noise = uniform(seed, offset, xp.size) if seed is not None else None
    codes, scales = quantize_rows(xp.reshape(-1, 16), s_enc, noise)
    return pack(codes.reshape(r, cp)), scales.reshape(r, cp // 16), F32(F32(1.0) / s_enc)


def tiles_16x16(w: np.ndarray) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray], np.float32]:
    """W (N, K) in 16 x 16 tiles: (rowwise codes (N, Kp/2), scales (N, Kp/16)), (colwise codes (K, Np/2), scales
    (K, Np/16)), decode scale."""
    w = w.astype(np.float32)
    n, k = w.shape
    np_, kp = -(-n // 16) * 16, -(-k // 16) * 16
    wp = np.zeros((np_, kp), np.float32)
    wp[:n, :k] = w
    s_enc = encode_scale(w)
    codes = np.zeros((np_, kp), np.uint8)
    tile_scale = np.zeros((np_ // 16, kp // 16), np.uint8)
    for i in range(np_ // 16):  # one tile at a time, plainly
        for j in range(kp // 16):
            t = wp[i * 16 : (i + 1) * 16, j * 16 : (j + 1) * 16]
            c, s = quantize_rows(t.reshape(1, 256), s_enc)
            codes[i * 16 : (i + 1) * 16, j * 16 : (j + 1) * 16] = c.reshape(16, 16)
            tile_scale[i, j] = s[0]
    row = (pack(codes[:n]), np.repeat(tile_scale, 16, axis=0)[:n])
    col = (pack(codes.T[:k]), np.repeat(tile_scale.T, 16, axis=0)[:k])
    return row, col, F32(F32(1.0) / s_enc)


def rht_rows(x: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """x (M, C) transformed along M (padded to 16) by 0.25 * butterfly(signs * v), fp32."""
    m, c = x.shape
    mp = -(-m // 16) * 16
    out = np.zeros((mp, c), np.float32)
    out[:m] = x
    for g in range(0, mp, 16):
        u = out[g : g + 16] * signs[:, None].astype(np.float32)
        for h in (1, 2, 4, 8):
            nxt = u.copy()
            for i in range(16):
                if i & h == 0:
                    nxt[i], nxt[i + h] = u[i] + u[i + h], u[i] - u[i + h]
            u = nxt.astype(np.float32)
        out[g : g + 16] = u * F32(0.25)
    return out
