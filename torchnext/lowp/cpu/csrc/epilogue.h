// The scaled_mm epilogue on 16 output columns at a time, and the activations it needs, for any ISA struct S.
//
// Order (torchnext/lowp/mm/epilogue.py, which every backend reproduces):
//   y = acc; y *= scale (scalar | per row | per column); y += bias; y = act(y); y += residual; amax = max |y|
// Activations are computed in fp32 from exp (range reduction + degree-7 polynomial, < 2 ulp) and erfc
// (Abramowitz-Stegun 7.1.26, |error| < 1.5e-7): within ~1e-7 relative of torch's kernels, far inside the
// tolerance every backend is held to (the reference is fp64). NaN in -> NaN out for every activation, and +-Inf
// give what torch's kernels give (silu(-Inf) and gelu(-Inf) are NaN: -Inf * 0).
#pragma once

#include "simd.h"

namespace tnx {

enum Act : int { kActNone = 0, kActRelu = 1, kActGelu = 2, kActGeluTanh = 3, kActSilu = 4 };
enum ScaleKind : int { kScaleNone = 0, kScaleScalar = 1, kScaleRow = 2, kScaleCol = 3 };

template <class S>
struct Math {
  using F = typename S::F;
  using I = typename S::I;

  // e^x: +Inf above ln(FLT_MAX) (so y / (1 + e^-y) is NaN at y = -Inf, as torch's silu is), e^-87.3 (a normal
  // fp32) below -87.3; NaN handled by the callers
  static F exp(F x_in) {
    const F x = S::min(S::max(x_in, S::fset(-87.33654f)), S::fset(88.0f));
    const F n = S::floor(S::fma(x, S::fset(1.44269504088896341f), S::fset(0.5f)));
    F r = S::fma(n, S::fset(-0.693145751953125f), x);  // ln2 split: hi has 12 significant bits, n*hi is exact
    r = S::fma(n, S::fset(-1.428606765330187045e-06f), r);
    F p = S::fset(1.0f / 5040.0f);
    p = S::fma(p, r, S::fset(1.0f / 720.0f));
    p = S::fma(p, r, S::fset(1.0f / 120.0f));
    p = S::fma(p, r, S::fset(1.0f / 24.0f));
    p = S::fma(p, r, S::fset(1.0f / 6.0f));
    p = S::fma(p, r, S::fset(0.5f));
    p = S::fma(p, r, S::fset(1.0f));
    p = S::fma(p, r, S::fset(1.0f));
    const I e = S::template sll<23>(S::iadd(S::cvt_i(n), S::iset(127)));
    return S::fsel(S::flt(S::fset(88.72283935546875f), x_in), S::fset(__builtin_inff()), S::mul(p, S::from_bits(e)));
  }

  // erfc(z) for z >= 0
  static F erfc_pos(F z) {
    const F t = S::div(S::fset(1.0f), S::fma(z, S::fset(0.3275911f), S::fset(1.0f)));
    F p = S::fset(1.061405429f);
    p = S::fma(p, t, S::fset(-1.453152027f));
    p = S::fma(p, t, S::fset(1.421413741f));
    p = S::fma(p, t, S::fset(-0.284496736f));
    p = S::fma(p, t, S::fset(0.254829592f));
    p = S::mul(p, t);
    return S::mul(p, exp(S::mul(S::sub(S::fzero(), z), z)));
  }

  // y / (1 + e^-u), i.e. y * sigmoid(u)
  static F times_sigmoid(F y, F u) {
    return S::div(y, S::add(S::fset(1.0f), exp(S::sub(S::fzero(), u))));
  }

  static F act(F y, int kind) {
    switch (kind) {
      case kActRelu:
        return S::max(S::fzero(), y);  // max(0, NaN) = NaN (the second operand)
      case kActSilu:
        return S::fsel(S::fnan(y), y, times_sigmoid(y, y));
      case kActGeluTanh: {
        // 0.5 y (1 + tanh(u)) = y * sigmoid(2u), u = sqrt(2/pi) (y + 0.044715 y^3): no cancellation
        const F y3 = S::mul(S::mul(y, y), y);
        const F u2 = S::mul(S::fma(y3, S::fset(0.044715f), y), S::fset(2.0f * 0.7978845608028654f));
        return S::fsel(S::fnan(y), y, times_sigmoid(y, u2));
      }
      case kActGelu: {
        // 0.5 y (1 + erf(y / sqrt 2)) = 0.5 y erfc(-y / sqrt 2): y >= 0 -> 0.5 y (2 - erfc(z)), y < 0 -> 0.5 y erfc(z)
        const F z = S::mul(S::from_bits(S::iand(S::bits(y), S::iset(0x7FFFFFFF))), S::fset(0.70710678118654752f));
        const F e = erfc_pos(z);
        const F half_y = S::mul(y, S::fset(0.5f));
        const F pos = S::mul(half_y, S::sub(S::fset(2.0f), e));
        const F neg = S::mul(half_y, e);
        return S::fsel(S::flt(y, S::fzero()), neg, S::fsel(S::fnan(y), y, pos));
      }
      default:
        return y;
    }
  }
};

// Everything the epilogue reads (fp32, contiguous; null where absent).
struct EpilogueArgs {
  int64_t m = 0;  // valid rows
  int64_t n = 0;  // columns
  int scale_kind = kScaleNone;
  const float* scale = nullptr;  // scalar: [0]; row: [m]; col: [n]
  const float* bias = nullptr;    // [n]
  int act = kActNone;
  const float* residual = nullptr;  // [m, n] row-major
  float* out32 = nullptr;           // [m, n] fp32 output, or
  uint16_t* out16 = nullptr;        // [m, n] bf16 output bits
  bool want_amax = false;
};

// Apply the epilogue to y = acc (16 columns starting at n0, `nc` of them valid) of row `row`, store it and fold
// |y| of the valid lanes into `amax_bits` (max of the sign-cleared bit patterns: NaN sorts above Inf).
template <class S>
inline void epilogue16(const EpilogueArgs& e, int64_t row, int64_t n0, int nc, typename S::F y, typename S::I& amax_bits) {
  using F = typename S::F;
  const bool full = nc == 16;
  auto ld = [&](const float* p) -> F { return full ? S::load(p) : S::load_n(p, nc); };
  if (e.scale_kind == kScaleScalar) y = S::mul(y, S::fset(e.scale[0]));
  else if (e.scale_kind == kScaleRow) y = S::mul(y, S::fset(e.scale[row]));
  else if (e.scale_kind == kScaleCol) y = S::mul(y, ld(e.scale + n0));
  if (e.bias) y = S::add(y, ld(e.bias + n0));
  if (e.act != kActNone) y = Math<S>::act(y, e.act);
  if (e.residual) y = S::add(y, ld(e.residual + row * e.n + n0));
  if (e.want_amax) {
    typename S::I a = S::iand(S::bits(y), S::iset(0x7FFFFFFF));
    if (!full) {
      alignas(64) int32_t lane[16];
      for (int l = 0; l < 16; ++l) lane[l] = l;
      a = S::isel(S::igt(S::iset(nc), S::iload(lane)), a, S::iset(0));
    }
    amax_bits = S::imax(amax_bits, a);
  }
  if (e.out32) {
    float* p = e.out32 + row * e.n + n0;
    if (full) S::store(p, y);
    else S::store_n(p, y, nc);
  } else {
    // fp32 -> bf16, round to nearest even, NaN -> 0x7FC0 (c10::BFloat16's rule)
    const typename S::I b = S::bits(y);
    const typename S::I rounded = S::template srl<16>(S::iadd(b, S::iadd(S::iset(0x7FFF), S::iand(S::template srl<16>(b), S::iset(1)))));
    const typename S::I h = S::isel(S::fnan(y), S::iset(0x7FC0), rounded);
    uint16_t* p = e.out16 + row * e.n + n0;
    if (full) S::store_u16(p, h);
    else S::store_u16_n(p, h, nc);
  }
}

}  // namespace tnx
