// Block-scaled quantize casts: fp32 / bf16 / fp16 -> NVFP4, MXFP8 (E4M3, E5M2), MXFP4, bit-identical to
// torchnext.lowp.quantizers.reference (the tests compare bytes on random and edge-case inputs).
//
// Input x is viewed as (outer, k, inner), contiguous, blocks along k: output row r = o * inner + i holds
// x[o, :, i] zero-padded to kp (a multiple of the block). inner == 1 is the row path (blocks are contiguous: one
// vector per 16 elements, a horizontal max per block); inner > 1 the column path (lanes are 16 neighbouring rows:
// vertical maxes, and the codes are transposed through a small tile buffer). Both read x once, write codes and
// scales once (scales straight into the SWIZZLE_32_4_4 layout when asked) and draw stochastic-rounding noise either
// from a given tensor or from the counter-based generator of torchnext/lowp/rng.py (counter = offset + r * kp + kk,
// kk the padded position along k: padding consumes counters).
//
// The arithmetic mirrors the reference's torch ops one by one in fp32 (IEEE division where torch divides; no
// contraction: the build uses -ffp-contract=off), so the bytes agree; see torchnext/lowp/scales.py and elements.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cstring>

#include "simd.h"

namespace tnx {

enum Elem : int { kE2m1 = 0, kE4m3 = 1, kE5m2 = 2 };
enum Recipe : int { kTorchao = 0, kTe = 1, kFloor = 2, kRceil = 3 };

struct ElemGeom {
  int mbits, bias, emax;
  float max_value, min_normal;
};
inline ElemGeom elem_geom(int e) {
  switch (e) {
    case kE2m1: return {1, 1, 2, 6.0f, 1.0f};
    case kE4m3: return {3, 7, 8, 448.0f, 0.015625f};
    case kE5m2: return {2, 15, 15, 57344.0f, 6.103515625e-05f};
    default: TORCH_CHECK(false, "torchnext_cpu.quantize: unknown element code ", e);
  }
  return {0, 0, 0, 0.f, 0.f};
}

// --------------------------------------------------------------------------------------- counter-based RNG
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}
inline uint32_t rng_key(uint64_t seed) {
  return mix32(static_cast<uint32_t>(seed)) ^ mix32(static_cast<uint32_t>(seed >> 32) ^ 0x9E3779B9u);
}

template <class S>
TNX_INLINE typename S::I mix32v(typename S::I x) {
  x = S::ixor(x, S::template srl<16>(x));
  x = S::imul(x, S::iset(static_cast<int32_t>(0x7FEB352Du)));
  x = S::ixor(x, S::template srl<15>(x));
  x = S::imul(x, S::iset(static_cast<int32_t>(0x846CA68Bu)));
  return S::ixor(x, S::template srl<16>(x));
}

// uniform(seed, c) for the 16 counters lo[l] (+ hi[l] << 32): (bits >> 8) * 2^-24
template <class S>
TNX_INLINE typename S::F uniform16(uint32_t key, typename S::I lo, typename S::I hi) {
  typename S::I h = mix32v<S>(S::ixor(lo, S::iset(static_cast<int32_t>(key))));
  h = S::ixor(h, S::ixor(hi, S::iset(static_cast<int32_t>(0x85EBCA6Bu))));
  h = mix32v<S>(h);
  return S::mul(S::cvt_f(S::template srl<8>(h)), S::fset(5.9604644775390625e-08f));
}

// counters c0 + l * stride for the 16 lanes, split into low and high words
template <class S>
__attribute__((noinline)) void counters16_slow(uint64_t c0, uint64_t stride, typename S::I& lo, typename S::I& hi) {
  alignas(64) int32_t l32[16], h32[16];
  for (int l = 0; l < 16; ++l) {
    const uint64_t c = c0 + static_cast<uint64_t>(l) * stride;
    l32[l] = static_cast<int32_t>(static_cast<uint32_t>(c));
    h32[l] = static_cast<int32_t>(static_cast<uint32_t>(c >> 32));
  }
  lo = S::iload(l32);
  hi = S::iload(h32);
}

template <class S>
TNX_INLINE void counters16(uint64_t c0, uint64_t stride, typename S::I& lo, typename S::I& hi) {
  const uint64_t lo0 = c0 & 0xFFFFFFFFu;
  if (stride < (1u << 27) && lo0 + 15 * stride <= 0xFFFFFFFFu) {  // no carry into the high word: one vector op
    lo = S::iadd(S::iset(static_cast<int32_t>(static_cast<uint32_t>(lo0))), S::imul(S::iota(), S::iset(static_cast<int32_t>(stride))));
    hi = S::iset(static_cast<int32_t>(static_cast<uint32_t>(c0 >> 32)));
    return;
  }
  counters16_slow<S>(c0, stride, lo, hi);
}

// ------------------------------------------------------------------------------------------- scale recipes
struct RecipeArgs {
  int recipe;
  ElemGeom el;
  float g_dec;  // torchao: the global decode scale; te: unused (dec is recomputed from enc, as the reference does)
  float g_enc;  // te: the global encode scale
  bool has_g;
};

// RNE of a non-negative (or NaN) fp32 onto E4M3, saturation not needed (callers clamp to <= 448). Returns the
// E4M3 byte; `val` gets the exact E4M3 value (NaN for NaN).
template <class S>
TNX_INLINE typename S::I e4m3_pos(typename S::F a, typename S::F& val) {
  using F = typename S::F;
  const typename S::M nan = S::fnan(a);
  const F a0 = S::fsel(nan, S::fzero(), a);
  F magic = S::from_bits(S::iand(S::bits(a0), S::iset(0x7F800000)));
  magic = S::mul(S::max(magic, S::fset(0.015625f)), S::fset(1.5f * 1048576.0f));  // 1.5 * 2^(23 - 3)
  const F r = S::sub(S::add(a0, magic), magic);
  const typename S::I normal = S::isub(S::template srl<20>(S::bits(r)), S::iset(120 << 3));
  const typename S::I sub = S::cvt_i(S::mul(r, S::fset(512.0f)));  // r / 2^-9
  const typename S::I code = S::isel(S::flt(r, S::fset(0.015625f)), sub, normal);
  val = S::fsel(nan, a, r);
  return S::isel(nan, S::iset(0x7F), code);
}

// (scale byte, element multiplier) per lane from the block amax, as torchnext/lowp/scales.py computes them.
template <class S>
inline void recipe16(const RecipeArgs& ra, typename S::F amax, typename S::I& sbyte, typename S::F& mult) {
  using F = typename S::F;
  using I = typename S::I;
  switch (ra.recipe) {
    case kTorchao: {
      F c = S::div(amax, S::fset(6.0f));
      if (ra.has_g) c = S::div(c, S::fset(ra.g_dec));
      // torch.clamp(c, 2^-6, 448): NaN stays NaN
      const F cl = S::fsel(S::fnan(c), c, S::min(S::max(c, S::fset(0.015625f)), S::fset(448.0f)));
      F sval;
      sbyte = e4m3_pos<S>(cl, sval);
      if (ra.has_g) mult = S::div(S::fset(1.0f / ra.g_dec), sval);
      else mult = S::div(S::fset(1.0f), sval);
      return;
    }
    case kTe: {
      const float t = ra.g_enc * (1.0f / 6.0f);
      const F c = S::mul(amax, S::fset(t));
      const F cl = S::fsel(S::fnan(c), c, S::min(c, S::fset(448.0f)));
      F sval;
      sbyte = e4m3_pos<S>(cl, sval);
      const float dec = 1.0f / ra.g_enc;
      mult = S::min(S::div(S::fset(1.0f), S::mul(sval, S::fset(dec))), S::fset(FLT_MAX));  // fmin: NaN -> FLT_MAX
      return;
    }
    case kFloor: {
      const I field = S::iand(S::template srl<23>(S::bits(amax)), S::iset(0xFF));
      I b = S::imin(S::imax(S::isub(field, S::iset(ra.el.emax)), S::iset(0)), S::iset(255));
      b = S::isel(S::fnan(amax), S::iset(255), b);
      const F scale = S::max(S::from_bits(S::template sll<23>(b)), S::fset(1.1754943508222875e-38f));
      sbyte = b;
      mult = S::div(S::fset(1.0f), scale);
      return;
    }
    case kRceil: {
      const F descale = S::div(amax, S::fset(ra.el.max_value));
      const I bits = S::bits(descale);
      const I field = S::iand(S::template srl<23>(bits), S::iset(0xFF));
      const I mant = S::iand(bits, S::iset(0x7FFFFF));
      const I one = S::iset(1), zero = S::iset(0);
      const I sub = S::isel(S::igt(mant, S::iset(0x400000)), one, zero);
      const I nrm = S::iadd(field, S::isel(S::ieq(mant, zero), zero, one));
      I b = S::isel(S::ieq(field, zero), sub, nrm);
      b = S::imin(b, S::iset(254));
      const typename S::M nan = S::fnan(descale);
      b = S::isel(nan, S::iset(255), b);
      F m = S::mul(S::from_bits(S::template sll<23>(S::isub(S::iset(255), b))), S::fset(0.5f));
      m = S::fsel(S::ieq(b, zero), S::fset(1.0f), m);
      m = S::fsel(nan, descale, m);
      sbyte = b;
      mult = m;
      return;
    }
    default: TORCH_CHECK(false, "torchnext_cpu.quantize: unknown recipe ", ra.recipe);
  }
}

// ------------------------------------------------------------------------------------------ element codes
// RNE of y onto the element grid, saturating: codes (magnitude | sign) per lane.
//   minifloat: a = min(|y|, max) (NaN -> max); r = (a + M) - M with M = max(2^floor(log2 a), min_normal) * 1.5 *
//   2^(23 - mbits) (fp32's own RNE onto the grid); code = (bits(r) >> (23 - mbits)) - ((127 - bias) << mbits) for
//   r >= min_normal, r / (min_normal * 2^-mbits) below (the value bits(r * 2^(bias - 127)) >> (23 - mbits) would
//   give, without making a subnormal fp32).
//   float8: the same on min(|y|, max); a NaN y gives 0x7F | sign (torch's cast).
template <class S, int E>
TNX_INLINE typename S::I encode16(typename S::F y) {
  using F = typename S::F;
  using I = typename S::I;
  constexpr int MB = E == kE2m1 ? 1 : E == kE4m3 ? 3 : 2;
  constexpr float MAXV = E == kE2m1 ? 6.0f : E == kE4m3 ? 448.0f : 57344.0f;
  constexpr float MINN = E == kE2m1 ? 1.0f : E == kE4m3 ? 0.015625f : 6.103515625e-05f;
  constexpr int SIGN_SHIFT = E == kE2m1 ? 28 : 24;
  const I yb = S::bits(y);
  const I sign = S::template srl<SIGN_SHIFT>(S::iand(yb, S::iset(static_cast<int32_t>(0x80000000u))));
  const F a = S::min(S::from_bits(S::iand(yb, S::iset(0x7FFFFFFF))), S::fset(MAXV));  // NaN -> MAXV
  F magic = S::from_bits(S::iand(S::bits(a), S::iset(0x7F800000)));
  magic = S::mul(S::max(magic, S::fset(MINN)), S::fset(1.5f * static_cast<float>(1u << (23 - MB))));
  const F r = S::sub(S::add(a, magic), magic);
  // r is a grid value: normal range -> (its fp32 exponent/mantissa bits) - the exponent bias difference; subnormal
  // range -> r / quantum, an exact small integer. (No subnormal fp32 is produced: denormal results are slow.)
  constexpr int BIAS = E == kE2m1 ? 1 : E == kE4m3 ? 7 : 15;
  constexpr float INV_SUB_QUANTUM = static_cast<float>(1u << (MB + BIAS - 1));
  const I normal = S::isub(S::template srl<23 - MB>(S::bits(r)), S::iset((127 - BIAS) << MB));
  const I sub = S::cvt_i(S::mul(r, S::fset(INV_SUB_QUANTUM)));
  I code = S::isel(S::flt(r, S::fset(MINN)), sub, normal);
  if constexpr (E != kE2m1) code = S::isel(S::fnan(y), S::iset(0x7F), code);
  return S::ior(code, sign);
}

// Stochastic rounding (torchnext.lowp.elements.stochastic_round) then the exact encode of the grid value.
template <class S, int E>
inline typename S::I encode16_sr(typename S::F y, typename S::F u) {
  using F = typename S::F;
  constexpr int MB = E == kE2m1 ? 1 : E == kE4m3 ? 3 : 2;
  constexpr float MAXV = E == kE2m1 ? 6.0f : E == kE4m3 ? 448.0f : 57344.0f;
  constexpr float MINN = E == kE2m1 ? 1.0f : E == kE4m3 ? 0.015625f : 6.103515625e-05f;
  const F a = S::from_bits(S::iand(S::bits(y), S::iset(0x7FFFFFFF)));
  const typename S::M nan = S::fnan(y);
  const F ac = S::min(a, S::fset(MAXV));
  F q = S::from_bits(S::iand(S::bits(ac), S::iset(0x7F800000)));  // 2^floor(log2 a) (0 for subnormals)
  q = S::mul(S::max(q, S::fset(MINN)), S::fset(1.0f / static_cast<float>(1u << MB)));
  // a / q with q a normal power of two is exactly a * (1 / q), and 1 / q's bits are (254 << 23) - bits(q)
  const F inv_q = S::from_bits(S::isub(S::iset(254 << 23), S::bits(q)));
  F r = S::mul(S::floor(S::add(S::mul(a, inv_q), u)), q);
  r = S::min(r, S::fset(MAXV));  // a = Inf: Inf / q + u = Inf -> min -> MAXV
  const F signed_r = S::from_bits(S::ior(S::bits(r), S::iand(S::bits(y), S::iset(static_cast<int32_t>(0x80000000u)))));
  return encode16<S, E>(S::fsel(nan, y, signed_r));
}

// --------------------------------------------------------------------------------------------- arguments
struct QArgs {
  const void* x;
  int dtype;  // 0 fp32, 1 bf16, 2 fp16
  int64_t outer, k, inner, kp, nb;
  int block;
  int elem;
  RecipeArgs ra;
  uint8_t* codes;   // (rows, kp / per_byte)
  uint8_t* scales;  // rows * nb, or the swizzled buffer
  bool swizzle;
  int64_t swz_cb;  // swizzled: ceil(nb / 4)
  const float* noise;  // (rows, kp) or null
  bool seeded;
  uint32_t key;
  uint64_t offset;
};

inline int64_t scale_pos(const QArgs& q, int64_t r, int64_t b) {
  if (!q.swizzle) return r * q.nb + b;
  return ((r >> 7) * q.swz_cb + (b >> 2)) * 512 + (r & 31) * 16 + ((r >> 5) & 3) * 4 + (b & 3);
}

// 16 input elements starting at p (n of them valid, the rest read as 0), widened to fp32
template <class S>
TNX_INLINE typename S::F load_x(const void* x, int dtype, int64_t idx, int n) {
  if (dtype == 0) {
    const float* p = static_cast<const float*>(x) + idx;
    return n == 16 ? S::load(p) : S::load_n(p, n);
  }
  const uint16_t* p = static_cast<const uint16_t*>(x) + idx;
  const typename S::I h = n == 16 ? S::load_u16(p) : S::load_u16_n(p, n);
  if (dtype == 1) return S::from_bits(S::template sll<16>(h));
  return S::half_to_f(h);
}

// strided gather of 16 elements x[idx + l * stride] (column path, lanes = rows), n valid
template <class S>
inline typename S::F gather_x(const QArgs& q, int64_t idx, int64_t stride, int n) {
  alignas(64) float t[16];
  for (int l = 0; l < 16; ++l) {
    if (l >= n) {
      t[l] = 0.f;
    } else if (q.dtype == 0) {
      t[l] = static_cast<const float*>(q.x)[idx + l * stride];
    } else {
      const uint32_t h = static_cast<const uint16_t*>(q.x)[idx + l * stride];
      t[l] = q.dtype == 1 ? bits_to_f(h << 16) : half_bits_to_float(h);
    }
  }
  return S::load(t);
}

template <class S>
TNX_INLINE typename S::F noise16(const QArgs& q, int64_t pos, int64_t stride) {
  if (q.noise) {
    if (stride == 1) return S::load(q.noise + pos);
    alignas(64) float t[16];
    for (int l = 0; l < 16; ++l) t[l] = q.noise[pos + l * stride];
    return S::load(t);
  }
  typename S::I lo, hi;
  counters16<S>(q.offset + static_cast<uint64_t>(pos), static_cast<uint64_t>(stride), lo, hi);
  return uniform16<S>(q.key, lo, hi);
}

template <class S>
TNX_INLINE typename S::I amax_bits(typename S::F v) {
  return S::iand(S::bits(v), S::iset(0x7FFFFFFF));
}

// ------------------------------------------------------------------------------------------------ row path
template <class S, int E, int B, bool SR>
void rows_kernel(const QArgs& q, int64_t r0, int64_t r1) {
  using F = typename S::F;
  using I = typename S::I;
  constexpr int V = B / 16;  // vectors per block
  constexpr int PB = E == kE2m1 ? 2 : 1;
  alignas(64) float amax_v[16];
  alignas(64) float mult_v[16];
  alignas(64) int32_t sbyte_v[16];
  const int64_t row_bytes = q.kp / PB;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t xrow = r * q.k;
    for (int64_t b0 = 0; b0 < q.nb; b0 += 16) {
      const int nblk = static_cast<int>(std::min<int64_t>(16, q.nb - b0));
      // block amaxes (integer max of the sign-cleared bits: NaN sorts above Inf)
      for (int j = 0; j < 16; ++j) {
        if (j >= nblk) {
          amax_v[j] = 0.f;
          continue;
        }
        I m = S::iset(0);
        for (int v = 0; v < V; ++v) {
          const int64_t kk = (b0 + j) * B + v * 16;
          const int n = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(16, q.k - kk)));
          if (n > 0) m = S::imax(m, amax_bits<S>(load_x<S>(q.x, q.dtype, xrow + kk, n)));
        }
        amax_v[j] = bits_to_f(static_cast<uint32_t>(S::ihmax(m)));
      }
      I sb;
      F mu;
      recipe16<S>(q.ra, S::load(amax_v), sb, mu);
      S::store(mult_v, mu);
      S::istore(sbyte_v, sb);
      for (int j = 0; j < nblk; ++j) q.scales[scale_pos(q, r, b0 + j)] = static_cast<uint8_t>(sbyte_v[j]);
      for (int j = 0; j < nblk; ++j) {
        const F mj = S::fset(mult_v[j]);
        for (int v = 0; v < V; ++v) {
          const int64_t kk = (b0 + j) * B + v * 16;
          const int n = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(16, q.k - kk)));
          const F xv = n > 0 ? load_x<S>(q.x, q.dtype, xrow + kk, n) : S::fzero();
          const F y = S::mul(xv, mj);
          I c;
          if constexpr (SR) c = encode16_sr<S, E>(y, noise16<S>(q, r * q.kp + kk, 1));
          else c = encode16<S, E>(y);
          uint8_t* dst = q.codes + r * row_bytes + kk / PB;
          if constexpr (PB == 2) S::store_nibbles(dst, c);
          else S::store_u8(dst, c);
        }
      }
    }
  }
}

// --------------------------------------------------------------------------------------------- column path
// lanes = 16 neighbouring i of one o; for each block: vertical amax over its B steps, then encode and transpose.
constexpr int kStage = 4;
template <class S, int E, int B, bool SR>
void cols_kernel(const QArgs& q, int64_t task0, int64_t task1) {
  using F = typename S::F;
  using I = typename S::I;
  constexpr int PB = E == kE2m1 ? 2 : 1;
  const int64_t itiles = (q.inner + 15) / 16;
  const int64_t row_bytes = q.kp / PB;
  alignas(64) int32_t sbyte_v[16];
  // a task is a group of G blocks of one o, each swept over all i-tiles: every input row is streamed end to end (the
  // hardware prefetchers follow it), and G = 64 bytes / the bytes a block adds to an output row, so every output
  // line (64 bytes of one row's codes) is complete when the task ends
  constexpr int64_t G = 64 / (B / PB) < 1 ? 1 : 64 / (B / PB);
  const int64_t bgroups = (q.nb + G - 1) / G;
  for (int64_t task = task0; task < task1; ++task) {
    const int64_t o = task / bgroups;
    const int64_t bg = task % bgroups;
    for (int64_t b = bg * G; b < std::min<int64_t>(q.nb, (bg + 1) * G); ++b)
    for (int64_t it0 = 0; it0 < itiles; it0 += kStage) {
    // stage kStage i-tiles of the block's B rows: each row is visited for kStage * 64 bytes at a time (one DRAM page
    // burst instead of a line), with a software prefetch two stages ahead
    F stage[B][kStage];
    const int nst = static_cast<int>(std::min<int64_t>(kStage, itiles - it0));
    for (int j = 0; j < B; ++j) {
      const int64_t kk = b * B + j;
      const int64_t base = (o * q.k + kk) * q.inner + it0 * 16;
      if (kk < q.k)
        for (int64_t off = 0; off < 16 * kStage; off += (q.dtype == 0 ? 16 : 32))
          __builtin_prefetch(static_cast<const char*>(q.x) + (base + 2 * 16 * kStage + off) * (q.dtype == 0 ? 4 : 2), 0, 3);
      for (int u = 0; u < nst; ++u) {
        const int nu = static_cast<int>(std::min<int64_t>(16, q.inner - (it0 + u) * 16));
        stage[j][u] = kk < q.k ? load_x<S>(q.x, q.dtype, base + 16 * u, nu) : S::fzero();
      }
    }
    for (int u = 0; u < nst; ++u) {
    const int64_t i0 = (it0 + u) * 16;
    const int n = static_cast<int>(std::min<int64_t>(16, q.inner - i0));
    const int64_t r0 = o * q.inner + i0;  // output row of lane 0
      I m = S::iset(0);
      F xs[B];
      for (int j = 0; j < B; ++j) {
        xs[j] = stage[j][u];
        m = S::imax(m, amax_bits<S>(xs[j]));
      }
      I sb;
      F mu;
      recipe16<S>(q.ra, S::from_bits(m), sb, mu);
      S::istore(sbyte_v, sb);
      for (int l = 0; l < n; ++l) q.scales[scale_pos(q, r0 + l, b)] = static_cast<uint8_t>(sbyte_v[l]);
      for (int h = 0; h < B; h += 16) {
        I c[16];
        for (int j = 0; j < 16; ++j) {
          const F y = S::mul(xs[h + j], mu);
          if constexpr (SR) c[j] = encode16_sr<S, E>(y, noise16<S>(q, r0 * q.kp + b * B + h + j, q.kp));
          else c[j] = encode16<S, E>(y);
        }
        S::transpose16(c);  // c[l] = the 16 codes of output row r0 + l
        for (int l = 0; l < n; ++l) {
          uint8_t* dst = q.codes + (r0 + l) * row_bytes + (b * B + h) / PB;
          if constexpr (PB == 2) S::store_nibbles(dst, c[l]);
          else S::store_u8(dst, c[l]);
        }
      }
    }
    }
  }
}

template <class S, int E, int B, bool SR>
void run_q(const QArgs& q) {
  const int64_t rows = q.outer * q.inner;
  if (q.inner == 1) {
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, q.kp));
    at::parallel_for(0, rows, grain, [&](int64_t a, int64_t b) { rows_kernel<S, E, B, SR>(q, a, b); });
  } else {
    constexpr int PB = E == kE2m1 ? 2 : 1;
    constexpr int64_t G = 64 / (B / PB) < 1 ? 1 : 64 / (B / PB);
    const int64_t tasks = q.outer * ((q.nb + G - 1) / G);
    at::parallel_for(0, tasks, 1, [&](int64_t a, int64_t b) { cols_kernel<S, E, B, SR>(q, a, b); });
  }
}

template <class S>
void dispatch_q(const QArgs& q, bool sr) {
  const int key = q.elem * 4 + (q.block == 16 ? 0 : 2) + (sr ? 1 : 0);
  switch (key) {
    case kE2m1 * 4 + 0: run_q<S, kE2m1, 16, false>(q); break;
    case kE2m1 * 4 + 1: run_q<S, kE2m1, 16, true>(q); break;
    case kE2m1 * 4 + 2: run_q<S, kE2m1, 32, false>(q); break;
    case kE2m1 * 4 + 3: run_q<S, kE2m1, 32, true>(q); break;
    case kE4m3 * 4 + 2: run_q<S, kE4m3, 32, false>(q); break;
    case kE4m3 * 4 + 3: run_q<S, kE4m3, 32, true>(q); break;
    case kE5m2 * 4 + 2: run_q<S, kE5m2, 32, false>(q); break;
    case kE5m2 * 4 + 3: run_q<S, kE5m2, 32, true>(q); break;
    default: TORCH_CHECK(false, "torchnext_cpu.quantize: unsupported element/block combination ", q.elem, "/", q.block);
  }
}

int best_isa();

// NVFP4's two-level scale, passed as 0-d tensors (a graph traced by torch.compile holds tensors, not values read
// from them): the values Python's float() would give, rounded to fp32 as before; the encode scale defaults to
// 1 / decode computed in double.
struct Global {
  float dec = 1.0f;
  float enc = 1.0f;
  bool has = false;
};

// One value of a 0-d tensor: read in place when it is a CPU fp32 scalar (no dispatch), else through item().
double scalar_of(const at::Tensor& t) {
  if (t.scalar_type() == at::kFloat && t.device().is_cpu()) return static_cast<double>(*t.data_ptr<float>());
  return t.item<double>();
}

Global global_of(const c10::optional<at::Tensor>& dec, const c10::optional<at::Tensor>& enc, const char* op) {
  Global g;
  if (!dec.has_value()) return g;
  TORCH_CHECK(dec->numel() == 1, op, ": the global decode scale must hold one value");
  TORCH_CHECK(!enc.has_value() || enc->numel() == 1, op, ": the global encode scale must hold one value");
  const double d = scalar_of(*dec);
  g.dec = static_cast<float>(d);
  g.enc = static_cast<float>(enc.has_value() ? scalar_of(*enc) : 1.0 / d);
  g.has = true;
  return g;
}

void quantize(const at::Tensor& x, int64_t outer, int64_t k, int64_t inner, const at::Tensor& codes,
              const at::Tensor& scales, int64_t elem, int64_t block, int64_t recipe,
              const c10::optional<at::Tensor>& g_dec, const c10::optional<at::Tensor>& g_enc, bool swizzle, int64_t swz_cols, const c10::optional<at::Tensor>& noise, bool sr_seeded,
              int64_t seed, int64_t offset, int64_t isa) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu(), "torchnext_cpu.quantize: x must be a contiguous CPU tensor");
  TORCH_CHECK(x.numel() == outer * k * inner, "torchnext_cpu.quantize: x has ", x.numel(), " elements, not ", outer, "*", k, "*", inner);
  TORCH_CHECK(block == 16 || block == 32, "torchnext_cpu.quantize: block must be 16 or 32");
  QArgs q;
  q.x = x.data_ptr();
  switch (x.scalar_type()) {
    case at::kFloat: q.dtype = 0; break;
    case at::kBFloat16: q.dtype = 1; break;
    case at::kHalf: q.dtype = 2; break;
    default: TORCH_CHECK(false, "torchnext_cpu.quantize: x must be float32, bfloat16 or float16");
  }
  q.outer = outer;
  q.k = k;
  q.inner = inner;
  q.block = static_cast<int>(block);
  q.kp = (k + block - 1) / block * block;
  q.nb = q.kp / block;
  q.elem = static_cast<int>(elem);
  const Global g = global_of(g_dec, g_enc, "torchnext_cpu.quantize");
  q.ra = {static_cast<int>(recipe), elem_geom(q.elem), g.dec, g.enc, g.has};
  const int pb = elem == kE2m1 ? 2 : 1;
  const int64_t rows = outer * inner;
  TORCH_CHECK(codes.is_contiguous() && codes.element_size() == 1 && codes.numel() == rows * q.kp / pb,
              "torchnext_cpu.quantize: codes buffer has the wrong size");
  q.codes = static_cast<uint8_t*>(codes.data_ptr());
  q.swizzle = swizzle;
  q.swz_cb = (swz_cols + 3) / 4;
  if (swizzle) {
    TORCH_CHECK(swz_cols == q.nb, "torchnext_cpu.quantize: swizzled scales have ", swz_cols, " columns, not ", q.nb);
    TORCH_CHECK(scales.numel() == (rows + 127) / 128 * 128 * q.swz_cb * 4, "torchnext_cpu.quantize: swizzled scale buffer has the wrong size");
  } else {
    TORCH_CHECK(scales.numel() == rows * q.nb, "torchnext_cpu.quantize: scale buffer has the wrong size");
  }
  TORCH_CHECK(scales.is_contiguous() && scales.element_size() == 1, "torchnext_cpu.quantize: scales must be a contiguous byte buffer");
  q.scales = static_cast<uint8_t*>(scales.data_ptr());
  at::Tensor nz;
  q.noise = nullptr;
  if (noise.has_value()) {
    nz = noise->contiguous();
    TORCH_CHECK(nz.scalar_type() == at::kFloat && nz.numel() == rows * q.kp, "torchnext_cpu.quantize: noise must be fp32 with rows*kp elements");
    q.noise = nz.data_ptr<float>();
  }
  q.seeded = sr_seeded;
  q.key = rng_key(static_cast<uint64_t>(seed));
  q.offset = static_cast<uint64_t>(offset);
  const bool sr = q.noise != nullptr || sr_seeded;
  if (rows == 0 || q.kp == 0) return;
  const int use = isa < 0 ? best_isa() : static_cast<int>(isa);
  switch (static_cast<Isa>(use)) {
#ifdef TNX_HAVE_AVX512
    case Isa::kAvx512: dispatch_q<Avx512>(q, sr); break;
#endif
#ifdef TNX_HAVE_AVX2
    case Isa::kAvx2: dispatch_q<Avx2>(q, sr); break;
#endif
    case Isa::kPortable: dispatch_q<Portable>(q, sr); break;
    default: TORCH_CHECK(false, "torchnext_cpu.quantize: instruction set ", use, " is not compiled into this build");
  }
}

// ------------------------------------------------------------------------------------- the two training copies
// quantize_pair_blocks (torchnext/lowp/pair.py documents the contract): from one read of each B x B tile of the
// (M, K) input, the rowwise copy (blocks along K, from x) and the columnwise copy (blocks along M, from x or from
// rht(x, signs, dim=0): the 16-point butterfly of torchnext/lowp/hadamard.py, same fp32 operations in the same
// order). Row copy: rows m < M, Kp = K padded to B; column copy: rows k < K, Mp = M' padded to B (M' = M, or M
// padded to 16 under the RHT); zero padding everywhere. SR counters: row (m, kk) -> offset_r + m * Kp + kk,
// column (k, mm) -> offset_c + k * Mp + mm (each copy's padded block matrix).
struct CopyArgs {
  RecipeArgs ra;
  bool sr;
  uint32_t key;
  uint64_t offset;
  uint8_t* codes;
  uint8_t* scales;
};

struct PairArgs {
  const void* x;
  int dtype;
  int64_t m, k, kp, mp, mprime;
  int block;
  CopyArgs row, col;
  bool rht;
  float signs[16];
};

template <class S>
TNX_INLINE typename S::F counter_noise(const CopyArgs& c, uint64_t pos, uint64_t stride) {
  typename S::I lo, hi;
  counters16<S>(c.offset + pos, stride, lo, hi);
  return uniform16<S>(c.key, lo, hi);
}

template <class S, int E, int B, bool RHT>
void pair_tiles(const PairArgs& p, int64_t t0, int64_t t1) {
  using F = typename S::F;
  using I = typename S::I;
  constexpr int V = B / 16;
  constexpr int PB = E == kE2m1 ? 2 : 1;
  const int64_t tcols = p.kp / B;
  const int64_t nb_r = p.kp / B, nb_c = p.mp / B;
  alignas(64) float amax_v[B];
  alignas(64) float mult_v[B];
  alignas(64) int32_t sb_v[B];
  F v[B][V];
  F stage[B][kStage * V];
  // a task is a strip of ST tile-rows swept over all tile-columns: the input rows of a tile-row are streamed end
  // to end, and ST = 64 bytes / the bytes a tile adds to a code row, so the column copy's code lines are complete
  // when the strip ends
  constexpr int64_t ST = 64 / (B / PB) < 1 ? 1 : 64 / (B / PB);
  const int64_t trows = p.mp / B;
  for (int64_t task = t0; task < t1; ++task)
  for (int64_t ti = task * ST; ti < std::min<int64_t>(trows, (task + 1) * ST); ++ti)
  for (int64_t tj = 0; tj < tcols; ++tj) {
    const int64_t m0 = ti * B, k0 = tj * B;
    if (tj % kStage == 0) {
      // stage the next kStage tiles of the B rows (zeros outside the M x K input): each row is visited for
      // kStage * B elements at a time (a DRAM page burst), with a software prefetch two stages ahead
      for (int r = 0; r < B; ++r) {
        const int64_t m = m0 + r;
        if (m < p.m)
          for (int64_t off = 0; off < kStage * B; off += (p.dtype == 0 ? 16 : 32))
            __builtin_prefetch(static_cast<const char*>(p.x) + (m * p.k + k0 + 2 * kStage * B + off) * (p.dtype == 0 ? 4 : 2), 0, 3);
        for (int j = 0; j < kStage * V; ++j) {
          const int64_t k = k0 + 16 * j;
          const int n = m < p.m ? static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(16, p.k - k))) : 0;
          stage[r][j] = n == 0 ? S::fzero() : load_x<S>(p.x, p.dtype, m * p.k + k, n);
        }
      }
    }
    for (int r = 0; r < B; ++r)
      for (int j = 0; j < V; ++j) v[r][j] = stage[r][(tj % kStage) * V + j];
    // rowwise copy: one block per row (V vectors)
    const int rows = static_cast<int>(std::min<int64_t>(B, p.m - m0));
    if (rows > 0) {
      for (int r = 0; r < B; ++r) {
        I mx = S::iset(0);
        for (int j = 0; j < V; ++j) mx = S::imax(mx, amax_bits<S>(v[r][j]));
        amax_v[r] = bits_to_f(static_cast<uint32_t>(S::ihmax(mx)));
      }
      for (int h = 0; h < B; h += 16) {
        I sb;
        F mu;
        recipe16<S>(p.row.ra, S::load(amax_v + h), sb, mu);
        S::store(mult_v + h, mu);
        S::istore(sb_v + h, sb);
      }
      for (int r = 0; r < rows; ++r) {
        const int64_t m = m0 + r;
        p.row.scales[m * nb_r + tj] = static_cast<uint8_t>(sb_v[r]);
        const F mr = S::fset(mult_v[r]);
        uint8_t* dst = p.row.codes + m * (p.kp / PB) + k0 / PB;
        for (int j = 0; j < V; ++j) {
          const F y = S::mul(v[r][j], mr);
          I c;
          if (p.row.sr) c = encode16_sr<S, E>(y, counter_noise<S>(p.row, static_cast<uint64_t>(m * p.kp + k0 + 16 * j), 1));
          else c = encode16<S, E>(y);
          if constexpr (PB == 2) S::store_nibbles(dst + 8 * j, c);
          else S::store_u8(dst + 16 * j, c);
        }
      }
    }
    // columnwise copy: one block per column (lanes), optionally from the RHT of each group of 16 rows
    if constexpr (RHT) {
      for (int g0 = 0; g0 < B; g0 += 16) {
        if (m0 + g0 >= p.mprime) break;  // rows past M' are the block padding: +0, never transformed
        for (int j = 0; j < V; ++j) {
          F u[16];
          for (int i = 0; i < 16; ++i) u[i] = S::mul(v[g0 + i][j], S::fset(p.signs[i]));
          for (int h = 1; h < 16; h <<= 1) {
            for (int i = 0; i < 16; ++i) {
              if (i & h) continue;
              const F a = u[i], b = u[i + h];
              u[i] = S::add(a, b);
              u[i + h] = S::sub(a, b);
            }
          }
          for (int i = 0; i < 16; ++i) v[g0 + i][j] = S::mul(u[i], S::fset(0.25f));
        }
      }
    }
    for (int j = 0; j < V; ++j) {
      const int64_t kc = k0 + 16 * j;
      const int ncol = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(16, p.k - kc)));
      if (ncol == 0) continue;
      I mx = S::iset(0);
      for (int r = 0; r < B; ++r) mx = S::imax(mx, amax_bits<S>(v[r][j]));
      I sb;
      F mu;
      recipe16<S>(p.col.ra, S::from_bits(mx), sb, mu);
      S::istore(sb_v, sb);
      for (int l = 0; l < ncol; ++l) p.col.scales[(kc + l) * nb_c + ti] = static_cast<uint8_t>(sb_v[l]);
      for (int h = 0; h < B; h += 16) {
        I c[16];
        for (int r = 0; r < 16; ++r) {
          const F y = S::mul(v[h + r][j], mu);
          if (p.col.sr) c[r] = encode16_sr<S, E>(y, counter_noise<S>(p.col, static_cast<uint64_t>(kc * p.mp + m0 + h + r), static_cast<uint64_t>(p.mp)));
          else c[r] = encode16<S, E>(y);
        }
        S::transpose16(c);  // c[l] = codes of column kc + l, rows m0 + h ..
        for (int l = 0; l < ncol; ++l) {
          uint8_t* dst = p.col.codes + (kc + l) * (p.mp / PB) + (m0 + h) / PB;
          if constexpr (PB == 2) S::store_nibbles(dst, c[l]);
          else S::store_u8(dst, c[l]);
        }
      }
    }
  }
}

template <class S, int E, int B>
void run_pair(const PairArgs& p) {
  constexpr int PB = E == kE2m1 ? 2 : 1;
  constexpr int64_t ST = 64 / (B / PB) < 1 ? 1 : 64 / (B / PB);
  const int64_t tasks = (p.mp / B + ST - 1) / ST;
  auto body = [&](int64_t a, int64_t b) {
    if (p.rht) pair_tiles<S, E, B, true>(p, a, b);
    else pair_tiles<S, E, B, false>(p, a, b);
  };
  at::parallel_for(0, tasks, 1, body);
}

template <class S>
void dispatch_pair(const PairArgs& p, int elem) {
  const int key = elem * 2 + (p.block == 16 ? 0 : 1);
  switch (key) {
    case kE2m1 * 2 + 0: run_pair<S, kE2m1, 16>(p); break;
    case kE2m1 * 2 + 1: run_pair<S, kE2m1, 32>(p); break;
    case kE4m3 * 2 + 1: run_pair<S, kE4m3, 32>(p); break;
    case kE5m2 * 2 + 1: run_pair<S, kE5m2, 32>(p); break;
    default: TORCH_CHECK(false, "torchnext_cpu.quantize_pair: unsupported element/block combination ", elem, "/", p.block);
  }
}

void quantize_pair(const at::Tensor& x, const at::Tensor& row_codes, const at::Tensor& row_scales,
                   const at::Tensor& col_codes, const at::Tensor& col_scales, int64_t elem, int64_t block,
                   int64_t recipe_r, const c10::optional<at::Tensor>& gdec_r,
                   const c10::optional<at::Tensor>& genc_r, bool sr_r, int64_t seed_r, int64_t off_r,
                   int64_t recipe_c, const c10::optional<at::Tensor>& gdec_c, const c10::optional<at::Tensor>& genc_c,
                   bool sr_c, int64_t seed_c, int64_t off_c, const c10::optional<at::Tensor>& signs, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "torchnext_cpu.quantize_pair: x must be a contiguous 2-D CPU tensor");
  TORCH_CHECK(block == 16 || block == 32, "torchnext_cpu.quantize_pair: block must be 16 or 32");
  PairArgs p;
  p.x = x.data_ptr();
  switch (x.scalar_type()) {
    case at::kFloat: p.dtype = 0; break;
    case at::kBFloat16: p.dtype = 1; break;
    case at::kHalf: p.dtype = 2; break;
    default: TORCH_CHECK(false, "torchnext_cpu.quantize_pair: x must be float32, bfloat16 or float16");
  }
  p.m = x.size(0);
  p.k = x.size(1);
  p.block = static_cast<int>(block);
  p.kp = (p.k + block - 1) / block * block;
  p.rht = signs.has_value();
  p.mprime = p.rht ? (p.m + 15) / 16 * 16 : p.m;
  p.mp = (p.mprime + block - 1) / block * block;
  const int pb = elem == kE2m1 ? 2 : 1;
  TORCH_CHECK(row_codes.is_contiguous() && row_codes.numel() * row_codes.element_size() == p.m * p.kp / pb, "torchnext_cpu.quantize_pair: row codes size");
  TORCH_CHECK(col_codes.is_contiguous() && col_codes.numel() * col_codes.element_size() == p.k * p.mp / pb, "torchnext_cpu.quantize_pair: column codes size");
  TORCH_CHECK(row_scales.is_contiguous() && row_scales.numel() == p.m * p.kp / block, "torchnext_cpu.quantize_pair: row scales size");
  TORCH_CHECK(col_scales.is_contiguous() && col_scales.numel() == p.k * p.mp / block, "torchnext_cpu.quantize_pair: column scales size");
  const ElemGeom eg = elem_geom(static_cast<int>(elem));
  const Global gr = global_of(gdec_r, genc_r, "torchnext_cpu.quantize_pair");
  const Global gc = global_of(gdec_c, genc_c, "torchnext_cpu.quantize_pair");
  p.row = {{static_cast<int>(recipe_r), eg, gr.dec, gr.enc, gr.has}, sr_r,
           rng_key(static_cast<uint64_t>(seed_r)), static_cast<uint64_t>(off_r), static_cast<uint8_t*>(row_codes.data_ptr()),
           static_cast<uint8_t*>(row_scales.data_ptr())};
  p.col = {{static_cast<int>(recipe_c), eg, gc.dec, gc.enc, gc.has}, sr_c,
           rng_key(static_cast<uint64_t>(seed_c)), static_cast<uint64_t>(off_c), static_cast<uint8_t*>(col_codes.data_ptr()),
           static_cast<uint8_t*>(col_scales.data_ptr())};
  if (p.rht) {
    const at::Tensor sg = signs->to(at::kFloat).contiguous();
    TORCH_CHECK(sg.numel() == 16, "torchnext_cpu.quantize_pair: 16 RHT signs expected");
    std::memcpy(p.signs, sg.data_ptr<float>(), sizeof(p.signs));
  }
  if (p.m == 0 || p.k == 0) return;
  const int use = isa < 0 ? best_isa() : static_cast<int>(isa);
  switch (static_cast<Isa>(use)) {
#ifdef TNX_HAVE_AVX512
    case Isa::kAvx512: dispatch_pair<Avx512>(p, static_cast<int>(elem)); break;
#endif
#ifdef TNX_HAVE_AVX2
    case Isa::kAvx2: dispatch_pair<Avx2>(p, static_cast<int>(elem)); break;
#endif
    case Isa::kPortable: dispatch_pair<Portable>(p, static_cast<int>(elem)); break;
    default: TORCH_CHECK(false, "torchnext_cpu.quantize_pair: instruction set ", use, " is not compiled into this build");
  }
}

// max |x| over the whole tensor as fp32 (NaN if any element is NaN), one parallel pass
at::Tensor absmax(const at::Tensor& x, int64_t isa) {
  const at::Tensor xc = x.contiguous();
  TORCH_CHECK(xc.scalar_type() == at::kFloat || xc.scalar_type() == at::kBFloat16 || xc.scalar_type() == at::kHalf,
              "torchnext_cpu.absmax: float32/bfloat16/float16 expected");
  const int64_t n = xc.numel();
  std::atomic<int32_t> best{0};
  // bit patterns of |x| compare like the values (NaN above Inf) for fp32, bf16 and fp16 alike
  at::parallel_for(0, n, 1 << 16, [&](int64_t a, int64_t b) {
    int32_t local = 0;
    if (xc.scalar_type() == at::kFloat) {
      const uint32_t* p = reinterpret_cast<const uint32_t*>(xc.data_ptr<float>());
      uint32_t m = 0;
      for (int64_t i = a; i < b; ++i) m = std::max(m, p[i] & 0x7FFFFFFFu);
      local = static_cast<int32_t>(m);
    } else {
      const uint16_t* p = static_cast<const uint16_t*>(xc.data_ptr());
      uint16_t m = 0;
      for (int64_t i = a; i < b; ++i) m = std::max<uint16_t>(m, p[i] & 0x7FFFu);
      const float f = xc.scalar_type() == at::kBFloat16 ? bits_to_f(static_cast<uint32_t>(m) << 16) : half_bits_to_float(m);
      local = static_cast<int32_t>(f_to_bits(f));
    }
    int32_t cur = best.load(std::memory_order_relaxed);
    while (local > cur && !best.compare_exchange_weak(cur, local, std::memory_order_relaxed)) {
    }
  });
  (void)isa;
  at::Tensor out = at::empty({}, xc.options().dtype(at::kFloat));
  out.data_ptr<float>()[0] = bits_to_f(static_cast<uint32_t>(best.load()));
  return out;
}

// max |rht(x, signs, dim=0)| of a 2-D (M, K) tensor without writing the transform: each group of 16 rows (M padded
// with zeros to 16) goes through the butterfly of torchnext/lowp/hadamard.py in registers (same fp32 operations).
template <class S>
void rht_absmax_impl(const void* x, int dtype, int64_t m, int64_t k, const float* signs, std::atomic<int32_t>& best) {
  using F = typename S::F;
  using I = typename S::I;
  const int64_t groups = (m + 15) / 16, ctiles = (k + 15) / 16;
  at::parallel_for(0, groups * ctiles, 16, [&](int64_t a, int64_t b) {
    I mx = S::iset(0);
    for (int64_t t = a; t < b; ++t) {
      const int64_t g = t / ctiles, c0 = (t % ctiles) * 16;
      const int n = static_cast<int>(std::min<int64_t>(16, k - c0));
      F u[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t row = g * 16 + i;
        u[i] = row < m ? S::mul(load_x<S>(x, dtype, row * k + c0, n), S::fset(signs[i])) : S::mul(S::fzero(), S::fset(signs[i]));
      }
      for (int h = 1; h < 16; h <<= 1) {
        for (int i = 0; i < 16; ++i) {
          if (i & h) continue;
          const F p = u[i], q = u[i + h];
          u[i] = S::add(p, q);
          u[i + h] = S::sub(p, q);
        }
      }
      for (int i = 0; i < 16; ++i) mx = S::imax(mx, amax_bits<S>(S::mul(u[i], S::fset(0.25f))));
    }
    const int32_t local = S::ihmax(mx);
    int32_t cur = best.load(std::memory_order_relaxed);
    while (local > cur && !best.compare_exchange_weak(cur, local, std::memory_order_relaxed)) {
    }
  });
}

at::Tensor rht_absmax(const at::Tensor& x, const at::Tensor& signs, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "torchnext_cpu.rht_absmax: contiguous 2-D CPU tensor expected");
  const at::Tensor sg = signs.to(at::kFloat).contiguous();
  TORCH_CHECK(sg.numel() == 16, "torchnext_cpu.rht_absmax: 16 signs expected");
  int dtype = 0;
  switch (x.scalar_type()) {
    case at::kFloat: dtype = 0; break;
    case at::kBFloat16: dtype = 1; break;
    case at::kHalf: dtype = 2; break;
    default: TORCH_CHECK(false, "torchnext_cpu.rht_absmax: float32/bfloat16/float16 expected");
  }
  std::atomic<int32_t> best{0};
  const int use = isa < 0 ? best_isa() : static_cast<int>(isa);
  switch (static_cast<Isa>(use)) {
#ifdef TNX_HAVE_AVX512
    case Isa::kAvx512: rht_absmax_impl<Avx512>(x.data_ptr(), dtype, x.size(0), x.size(1), sg.data_ptr<float>(), best); break;
#endif
#ifdef TNX_HAVE_AVX2
    case Isa::kAvx2: rht_absmax_impl<Avx2>(x.data_ptr(), dtype, x.size(0), x.size(1), sg.data_ptr<float>(), best); break;
#endif
    case Isa::kPortable: rht_absmax_impl<Portable>(x.data_ptr(), dtype, x.size(0), x.size(1), sg.data_ptr<float>(), best); break;
    default: TORCH_CHECK(false, "torchnext_cpu.rht_absmax: instruction set ", use, " is not compiled into this build");
  }
  at::Tensor out = at::empty({}, x.options().dtype(at::kFloat));
  out.data_ptr<float>()[0] = bits_to_f(static_cast<uint32_t>(best.load()));
  return out;
}

// The generator's draws uniform(seed, offset + i), i < numel (tests compare them with torchnext.lowp.rng).
at::Tensor rng_uniform(int64_t seed, int64_t offset, int64_t numel) {
  at::Tensor out = at::empty({numel}, at::TensorOptions().dtype(at::kFloat));
  float* p = out.data_ptr<float>();
  const uint32_t key = rng_key(static_cast<uint64_t>(seed));
  for (int64_t i = 0; i < numel; ++i) {
    const uint64_t c = static_cast<uint64_t>(offset) + static_cast<uint64_t>(i);
    const uint32_t h = mix32(mix32(static_cast<uint32_t>(c) ^ key) ^ static_cast<uint32_t>(c >> 32) ^ 0x85EBCA6Bu);
    p[i] = static_cast<float>(h >> 8) * 5.9604644775390625e-08f;
  }
  return out;
}

}  // namespace tnx
