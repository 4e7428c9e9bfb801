// 16-lane SIMD vocabulary shared by torchnext's CPU kernels.
//
// Every kernel is written once, as a template over an instruction-set struct S that provides
//   S::F  16 fp32 lanes        S::I  16 int32 lanes        S::M  a 16-bit lane mask
// and static functions on them (below). Three structs implement it:
//   Avx512  one zmm register per vector (AVX-512 F/BW/VL + F16C)
//   Avx2    two ymm registers per vector (AVX2 + FMA + F16C)
//   Portable plain arrays and loops: any C++17 compiler, any CPU (the compiler may still vectorize the loops)
// A struct is compiled only where the compiler targets its instruction set (-march=native picks them for the
// build machine); Portable always is, and the tests run every compiled one against the reference.
//
// Semantics every struct follows exactly (they are what the kernels' bit-exactness relies on):
//   min(a, b) = a < b ? a : b   and   max(a, b) = a > b ? a : b   (b when either is NaN: x86 MINPS/MAXPS)
//   fma(a, b, c) = a * b + c with one rounding; mul/add/sub/div are IEEE fp32 with round-to-nearest-even
//   srl/sll: logical shifts of the 32-bit lanes; cvt_i(F): lanes that hold integer values (every use here) -> int32
//   half_to_f(I): lanes hold IEEE binary16 bit patterns (low 16 bits); exact conversion incl. subnormals/Inf/NaN
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define TNX_HAVE_AVX512 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TNX_HAVE_AVX2 1
#endif

// Hot helpers are force-inlined: a call would pass the 64-byte vectors through memory.
#if defined(__GNUC__) || defined(__clang__)
#define TNX_INLINE inline __attribute__((always_inline))
#else
#define TNX_INLINE inline
#endif

namespace tnx {

inline float bits_to_f(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline uint32_t f_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// IEEE binary16 bits -> fp32, exact (the portable twin of F16C's VCVTPH2PS).
inline float half_bits_to_float(uint32_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (exp == 0x1Fu) return bits_to_f(sign | 0x7F800000u | (man << 13));  // Inf / NaN (payload kept)
  if (exp != 0) return bits_to_f(sign | ((exp + 112u) << 23) | (man << 13));
  // zero or subnormal: man * 2^-24, exact in fp32
  const float v = static_cast<float>(man) * 5.9604644775390625e-08f;
  return sign ? -v : v;
}

// fp32 -> bf16 bits, round to nearest even; NaN -> 0x7FC0 (c10::BFloat16's rule).
inline uint16_t float_to_bf16_bits(float f) {
  const uint32_t b = f_to_bits(f);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// ------------------------------------------------------------------------------------------------- Portable
struct Portable {
  static constexpr const char* kName = "portable";
  static constexpr int kRegs = 16;  // vectors the micro-kernels may keep live (a tiling hint only)
  struct F {
    float v[16];
  };
  struct I {
    int32_t v[16];
  };
  using M = uint32_t;

#define TNX_LANES for (int l = 0; l < 16; ++l)
  static F fzero() { F r; TNX_LANES r.v[l] = 0.f; return r; }
  static F fset(float x) { F r; TNX_LANES r.v[l] = x; return r; }
  static I iset(int32_t x) { I r; TNX_LANES r.v[l] = x; return r; }
  static F load(const float* p) { F r; std::memcpy(r.v, p, 64); return r; }
  static F load_n(const float* p, int n) { F r; TNX_LANES r.v[l] = l < n ? p[l] : 0.f; return r; }
  static void store(float* p, F a) { std::memcpy(p, a.v, 64); }
  static void store_n(float* p, F a, int n) { for (int l = 0; l < n; ++l) p[l] = a.v[l]; }
  static I iload(const int32_t* p) { I r; std::memcpy(r.v, p, 64); return r; }
  static void istore(int32_t* p, I a) { std::memcpy(p, a.v, 64); }
  static F add(F a, F b) { F r; TNX_LANES r.v[l] = a.v[l] + b.v[l]; return r; }
  static F sub(F a, F b) { F r; TNX_LANES r.v[l] = a.v[l] - b.v[l]; return r; }
  static F mul(F a, F b) { F r; TNX_LANES r.v[l] = a.v[l] * b.v[l]; return r; }
  static F div(F a, F b) { F r; TNX_LANES r.v[l] = a.v[l] / b.v[l]; return r; }
  static F fma(F a, F b, F c) { F r; TNX_LANES r.v[l] = std::fma(a.v[l], b.v[l], c.v[l]); return r; }
  static F min(F a, F b) { F r; TNX_LANES r.v[l] = a.v[l] < b.v[l] ? a.v[l] : b.v[l]; return r; }
  static F max(F a, F b) { F r; TNX_LANES r.v[l] = a.v[l] > b.v[l] ? a.v[l] : b.v[l]; return r; }
  static F floor(F a) { F r; TNX_LANES r.v[l] = std::floor(a.v[l]); return r; }
  static I cvt_i(F a) { I r; TNX_LANES r.v[l] = static_cast<int32_t>(a.v[l]); return r; }
  static F cvt_f(I a) { F r; TNX_LANES r.v[l] = static_cast<float>(a.v[l]); return r; }
  static I bits(F a) { I r; std::memcpy(r.v, a.v, 64); return r; }
  static F from_bits(I a) { F r; std::memcpy(r.v, a.v, 64); return r; }
  static I iadd(I a, I b) { I r; TNX_LANES r.v[l] = static_cast<int32_t>(static_cast<uint32_t>(a.v[l]) + static_cast<uint32_t>(b.v[l])); return r; }
  static I isub(I a, I b) { I r; TNX_LANES r.v[l] = static_cast<int32_t>(static_cast<uint32_t>(a.v[l]) - static_cast<uint32_t>(b.v[l])); return r; }
  static I imul(I a, I b) { I r; TNX_LANES r.v[l] = static_cast<int32_t>(static_cast<uint32_t>(a.v[l]) * static_cast<uint32_t>(b.v[l])); return r; }
  static I iand(I a, I b) { I r; TNX_LANES r.v[l] = a.v[l] & b.v[l]; return r; }
  static I ior(I a, I b) { I r; TNX_LANES r.v[l] = a.v[l] | b.v[l]; return r; }
  static I ixor(I a, I b) { I r; TNX_LANES r.v[l] = a.v[l] ^ b.v[l]; return r; }
  static I imax(I a, I b) { I r; TNX_LANES r.v[l] = a.v[l] > b.v[l] ? a.v[l] : b.v[l]; return r; }
  static I imin(I a, I b) { I r; TNX_LANES r.v[l] = a.v[l] < b.v[l] ? a.v[l] : b.v[l]; return r; }
  template <int n> static I srl(I a) { I r; TNX_LANES r.v[l] = static_cast<int32_t>(static_cast<uint32_t>(a.v[l]) >> n); return r; }
  template <int n> static I sll(I a) { I r; TNX_LANES r.v[l] = static_cast<int32_t>(static_cast<uint32_t>(a.v[l]) << n); return r; }
  static M flt(F a, F b) { M m = 0; TNX_LANES m |= (a.v[l] < b.v[l] ? 1u : 0u) << l; return m; }
  static M fle(F a, F b) { M m = 0; TNX_LANES m |= (a.v[l] <= b.v[l] ? 1u : 0u) << l; return m; }
  static M feq(F a, F b) { M m = 0; TNX_LANES m |= (a.v[l] == b.v[l] ? 1u : 0u) << l; return m; }
  static M fnan(F a) { M m = 0; TNX_LANES m |= (a.v[l] != a.v[l] ? 1u : 0u) << l; return m; }
  static M ieq(I a, I b) { M m = 0; TNX_LANES m |= (a.v[l] == b.v[l] ? 1u : 0u) << l; return m; }
  static M igt(I a, I b) { M m = 0; TNX_LANES m |= (a.v[l] > b.v[l] ? 1u : 0u) << l; return m; }
  static F fsel(M m, F a, F b) { F r; TNX_LANES r.v[l] = (m >> l) & 1u ? a.v[l] : b.v[l]; return r; }
  static I isel(M m, I a, I b) { I r; TNX_LANES r.v[l] = (m >> l) & 1u ? a.v[l] : b.v[l]; return r; }
  // 16 bytes -> 16 zero-extended lanes; 16 uint16 -> lanes; lanes -> their low byte / low 16 bits
  static I load_u8(const uint8_t* p) { I r; TNX_LANES r.v[l] = p[l]; return r; }
  static I load_u8_n(const uint8_t* p, int n) { I r; TNX_LANES r.v[l] = l < n ? p[l] : 0; return r; }
  static I load_u16(const uint16_t* p) { I r; TNX_LANES r.v[l] = p[l]; return r; }
  static I load_u16_n(const uint16_t* p, int n) { I r; TNX_LANES r.v[l] = l < n ? p[l] : 0; return r; }
  static void store_u8(uint8_t* p, I a) { TNX_LANES p[l] = static_cast<uint8_t>(a.v[l]); }
  static void store_u8_n(uint8_t* p, I a, int n) { for (int l = 0; l < n; ++l) p[l] = static_cast<uint8_t>(a.v[l]); }
  static void store_u16(uint16_t* p, I a) { TNX_LANES p[l] = static_cast<uint16_t>(a.v[l]); }
  // 16 lanes of 4-bit codes -> 8 bytes, lane 2i in the low nibble of byte i
  static void store_nibbles(uint8_t* p, I a) { for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>((a.v[2 * i] & 15) | ((a.v[2 * i + 1] & 15) << 4)); }
  static I iota() { I r; TNX_LANES r.v[l] = l; return r; }
  // in-place transpose of 16 vectors (row i, lane j) -> (row j, lane i)
  static void transpose16(I (&v)[16]) {
    for (int i = 0; i < 16; ++i)
      for (int j = i + 1; j < 16; ++j) std::swap(v[i].v[j], v[j].v[i]);
  }
  static void store_u16_n(uint16_t* p, I a, int n) { for (int l = 0; l < n; ++l) p[l] = static_cast<uint16_t>(a.v[l]); }
  // table[idx & 15]
  static F permute16(F table, I idx) { F r; TNX_LANES r.v[l] = table.v[idx.v[l] & 15]; return r; }
  static F half_to_f(I h) { F r; TNX_LANES r.v[l] = half_bits_to_float(static_cast<uint32_t>(h.v[l]) & 0xFFFFu); return r; }
  static float hmax(F a) { float m = a.v[0]; for (int l = 1; l < 16; ++l) m = a.v[l] > m ? a.v[l] : m; return m; }
  static int32_t ihmax(I a) { int32_t m = a.v[0]; for (int l = 1; l < 16; ++l) m = a.v[l] > m ? a.v[l] : m; return m; }
  static float hsum(F a) { float s = 0.f; TNX_LANES s += a.v[l]; return s; }
#undef TNX_LANES
};

#ifdef TNX_HAVE_AVX512
// -------------------------------------------------------------------------------------------------- AVX-512
struct Avx512 {
  static constexpr const char* kName = "avx512";
  static constexpr int kRegs = 32;
  struct F {
    __m512 v;
  };
  struct I {
    __m512i v;
  };
  using M = __mmask16;

  static F fzero() { return {_mm512_setzero_ps()}; }
  static F fset(float x) { return {_mm512_set1_ps(x)}; }
  static I iset(int32_t x) { return {_mm512_set1_epi32(x)}; }
  static F load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static F load_n(const float* p, int n) { return {_mm512_maskz_loadu_ps(static_cast<M>((1u << n) - 1u), p)}; }
  static void store(float* p, F a) { _mm512_storeu_ps(p, a.v); }
  static void store_n(float* p, F a, int n) { _mm512_mask_storeu_ps(p, static_cast<M>((1u << n) - 1u), a.v); }
  static I iload(const int32_t* p) { return {_mm512_loadu_si512(p)}; }
  static void istore(int32_t* p, I a) { _mm512_storeu_si512(p, a.v); }
  static F add(F a, F b) { return {_mm512_add_ps(a.v, b.v)}; }
  static F sub(F a, F b) { return {_mm512_sub_ps(a.v, b.v)}; }
  static F mul(F a, F b) { return {_mm512_mul_ps(a.v, b.v)}; }
  static F div(F a, F b) { return {_mm512_div_ps(a.v, b.v)}; }
  static F fma(F a, F b, F c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static F min(F a, F b) { return {_mm512_min_ps(a.v, b.v)}; }
  static F max(F a, F b) { return {_mm512_max_ps(a.v, b.v)}; }
  static F floor(F a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)}; }
  static I cvt_i(F a) { return {_mm512_cvt_roundps_epi32(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
  static F cvt_f(I a) { return {_mm512_cvtepi32_ps(a.v)}; }
  static I bits(F a) { return {_mm512_castps_si512(a.v)}; }
  static F from_bits(I a) { return {_mm512_castsi512_ps(a.v)}; }
  static I iadd(I a, I b) { return {_mm512_add_epi32(a.v, b.v)}; }
  static I isub(I a, I b) { return {_mm512_sub_epi32(a.v, b.v)}; }
  static I imul(I a, I b) { return {_mm512_mullo_epi32(a.v, b.v)}; }
  static I iand(I a, I b) { return {_mm512_and_si512(a.v, b.v)}; }
  static I ior(I a, I b) { return {_mm512_or_si512(a.v, b.v)}; }
  static I ixor(I a, I b) { return {_mm512_xor_si512(a.v, b.v)}; }
  static I imax(I a, I b) { return {_mm512_max_epi32(a.v, b.v)}; }
  static I imin(I a, I b) { return {_mm512_min_epi32(a.v, b.v)}; }
  template <int n> static I srl(I a) { return {_mm512_srli_epi32(a.v, n)}; }
  template <int n> static I sll(I a) { return {_mm512_slli_epi32(a.v, n)}; }
  static M flt(F a, F b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ); }
  static M fle(F a, F b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_LE_OQ); }
  static M feq(F a, F b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_EQ_OQ); }
  static M fnan(F a) { return _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q); }
  static M ieq(I a, I b) { return _mm512_cmpeq_epi32_mask(a.v, b.v); }
  static M igt(I a, I b) { return _mm512_cmpgt_epi32_mask(a.v, b.v); }
  static F fsel(M m, F a, F b) { return {_mm512_mask_blend_ps(m, b.v, a.v)}; }
  static I isel(M m, I a, I b) { return {_mm512_mask_blend_epi32(m, b.v, a.v)}; }
  static I load_u8(const uint8_t* p) { return {_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
  static I load_u8_n(const uint8_t* p, int n) {
    return {_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(static_cast<M>((1u << n) - 1u), p))};
  }
  static I load_u16(const uint16_t* p) { return {_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
  static I load_u16_n(const uint16_t* p, int n) {
    return {_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(static_cast<M>((1u << n) - 1u), p))};
  }
  static void store_u8(uint8_t* p, I a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(a.v)); }
  static void store_u8_n(uint8_t* p, I a, int n) { _mm512_mask_cvtepi32_storeu_epi8(p, static_cast<M>((1u << n) - 1u), a.v); }
  static void store_u16(uint16_t* p, I a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(a.v)); }
  static void store_nibbles(uint8_t* p, I a) {
    // as 8 64-bit lanes: (code 2i) | (code 2i+1) << 32 -> low byte = code 2i | code 2i+1 << 4
    const __m512i v = _mm512_and_si512(a.v, _mm512_set1_epi32(15));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm512_cvtepi64_epi8(_mm512_or_si512(v, _mm512_srli_epi64(v, 28))));
  }
  static I iota() { return {_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)}; }
  static void transpose16(I (&v)[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {  // 32-bit interleave of row pairs
      t[i] = _mm512_unpacklo_epi32(v[i].v, v[i + 1].v);
      t[i + 1] = _mm512_unpackhi_epi32(v[i].v, v[i + 1].v);
    }
    for (int g = 0; g < 16; g += 4) {  // u[g + c], 128-bit lane L: rows g..g+3 of column 4L + c
      u[g + 0] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
      u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
      u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
      u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int c = 0; c < 4; ++c) {
      const __m512i ve = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), vo = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
      const __m512i we = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88), wo = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
      v[c].v = _mm512_shuffle_i32x4(ve, we, 0x88);
      v[8 + c].v = _mm512_shuffle_i32x4(ve, we, 0xDD);
      v[4 + c].v = _mm512_shuffle_i32x4(vo, wo, 0x88);
      v[12 + c].v = _mm512_shuffle_i32x4(vo, wo, 0xDD);
    }
  }
  static void store_u16_n(uint16_t* p, I a, int n) { _mm512_mask_cvtepi32_storeu_epi16(p, static_cast<M>((1u << n) - 1u), a.v); }
  static F permute16(F table, I idx) { return {_mm512_permutexvar_ps(idx.v, table.v)}; }
  static F half_to_f(I h) { return {_mm512_cvtph_ps(_mm512_cvtepi32_epi16(h.v))}; }
  static float hmax(F a) { return _mm512_reduce_max_ps(a.v); }
  static int32_t ihmax(I a) { return _mm512_reduce_max_epi32(a.v); }
  static float hsum(F a) { return _mm512_reduce_add_ps(a.v); }
  // fast paths used by the GEMV (exact, same results as the generic composition)
  static F e5m2x16(const uint8_t* p) {  // 16 E5M2 bytes -> fp32 (E5M2 is the top byte of binary16)
    __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8);
    return {_mm512_cvtph_ps(h)};
  }
  static F e4m3x16_div256(const uint8_t* p) {  // 16 E4M3 bytes (no NaN codes) -> fp32 value / 256
    __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    __m256i mag = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7);
    __m256i sgn = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
    return {_mm512_cvtph_ps(_mm256_or_si256(mag, sgn))};
  }
};
#endif

#ifdef TNX_HAVE_AVX2
// ----------------------------------------------------------------------------------------------------- AVX2
struct Avx2 {
  static constexpr const char* kName = "avx2";
  static constexpr int kRegs = 8;  // 16 ymm = 8 two-register vectors
  struct F {
    __m256 a, b;
  };
  struct I {
    __m256i a, b;
  };
  using M = uint32_t;

  static __m256i mask8(uint32_t m) {  // 8 mask bits -> lane masks
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(m)), bit), bit);
  }
  static F fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static F fset(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static I iset(int32_t x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
  static F load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static F load_n(const float* p, int n) {
    const uint32_t m = (1u << n) - 1u;
    return {_mm256_maskload_ps(p, mask8(m & 0xFF)), _mm256_maskload_ps(p + 8, mask8(m >> 8))};
  }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x.a); _mm256_storeu_ps(p + 8, x.b); }
  static void store_n(float* p, F x, int n) {
    const uint32_t m = (1u << n) - 1u;
    _mm256_maskstore_ps(p, mask8(m & 0xFF), x.a);
    _mm256_maskstore_ps(p + 8, mask8(m >> 8), x.b);
  }
  static I iload(const int32_t* p) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8))};
  }
  static void istore(int32_t* p, I x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x.a);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 8), x.b);
  }
#define TNX_F2(expr_a, expr_b) return {expr_a, expr_b}
  static F add(F x, F y) { TNX_F2(_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)); }
  static F sub(F x, F y) { TNX_F2(_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)); }
  static F mul(F x, F y) { TNX_F2(_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)); }
  static F div(F x, F y) { TNX_F2(_mm256_div_ps(x.a, y.a), _mm256_div_ps(x.b, y.b)); }
  static F fma(F x, F y, F z) { TNX_F2(_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)); }
  static F min(F x, F y) { TNX_F2(_mm256_min_ps(x.a, y.a), _mm256_min_ps(x.b, y.b)); }
  static F max(F x, F y) { TNX_F2(_mm256_max_ps(x.a, y.a), _mm256_max_ps(x.b, y.b)); }
  static F floor(F x) { TNX_F2(_mm256_floor_ps(x.a), _mm256_floor_ps(x.b)); }
  static I cvt_i(F x) { TNX_F2(_mm256_cvtps_epi32(x.a), _mm256_cvtps_epi32(x.b)); }
  static F cvt_f(I x) { TNX_F2(_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)); }
  static I bits(F x) { TNX_F2(_mm256_castps_si256(x.a), _mm256_castps_si256(x.b)); }
  static F from_bits(I x) { TNX_F2(_mm256_castsi256_ps(x.a), _mm256_castsi256_ps(x.b)); }
  static I iadd(I x, I y) { TNX_F2(_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)); }
  static I isub(I x, I y) { TNX_F2(_mm256_sub_epi32(x.a, y.a), _mm256_sub_epi32(x.b, y.b)); }
  static I imul(I x, I y) { TNX_F2(_mm256_mullo_epi32(x.a, y.a), _mm256_mullo_epi32(x.b, y.b)); }
  static I iand(I x, I y) { TNX_F2(_mm256_and_si256(x.a, y.a), _mm256_and_si256(x.b, y.b)); }
  static I ior(I x, I y) { TNX_F2(_mm256_or_si256(x.a, y.a), _mm256_or_si256(x.b, y.b)); }
  static I ixor(I x, I y) { TNX_F2(_mm256_xor_si256(x.a, y.a), _mm256_xor_si256(x.b, y.b)); }
  static I imax(I x, I y) { TNX_F2(_mm256_max_epi32(x.a, y.a), _mm256_max_epi32(x.b, y.b)); }
  static I imin(I x, I y) { TNX_F2(_mm256_min_epi32(x.a, y.a), _mm256_min_epi32(x.b, y.b)); }
  template <int n> static I srl(I x) { TNX_F2(_mm256_srli_epi32(x.a, n), _mm256_srli_epi32(x.b, n)); }
  template <int n> static I sll(I x) { TNX_F2(_mm256_slli_epi32(x.a, n), _mm256_slli_epi32(x.b, n)); }
  static M fmask(__m256 a, __m256 b) {
    return static_cast<M>(_mm256_movemask_ps(a)) | (static_cast<M>(_mm256_movemask_ps(b)) << 8);
  }
  static M flt(F x, F y) { return fmask(_mm256_cmp_ps(x.a, y.a, _CMP_LT_OQ), _mm256_cmp_ps(x.b, y.b, _CMP_LT_OQ)); }
  static M fle(F x, F y) { return fmask(_mm256_cmp_ps(x.a, y.a, _CMP_LE_OQ), _mm256_cmp_ps(x.b, y.b, _CMP_LE_OQ)); }
  static M feq(F x, F y) { return fmask(_mm256_cmp_ps(x.a, y.a, _CMP_EQ_OQ), _mm256_cmp_ps(x.b, y.b, _CMP_EQ_OQ)); }
  static M fnan(F x) { return fmask(_mm256_cmp_ps(x.a, x.a, _CMP_UNORD_Q), _mm256_cmp_ps(x.b, x.b, _CMP_UNORD_Q)); }
  static M ieq(I x, I y) {
    return fmask(_mm256_castsi256_ps(_mm256_cmpeq_epi32(x.a, y.a)), _mm256_castsi256_ps(_mm256_cmpeq_epi32(x.b, y.b)));
  }
  static M igt(I x, I y) {
    return fmask(_mm256_castsi256_ps(_mm256_cmpgt_epi32(x.a, y.a)), _mm256_castsi256_ps(_mm256_cmpgt_epi32(x.b, y.b)));
  }
  static F fsel(M m, F x, F y) {
    TNX_F2(_mm256_blendv_ps(y.a, x.a, _mm256_castsi256_ps(mask8(m & 0xFF))),
           _mm256_blendv_ps(y.b, x.b, _mm256_castsi256_ps(mask8(m >> 8))));
  }
  static I isel(M m, I x, I y) {
    TNX_F2(_mm256_blendv_epi8(y.a, x.a, mask8(m & 0xFF)), _mm256_blendv_epi8(y.b, x.b, mask8(m >> 8)));
  }
  static I load_u8(const uint8_t* p) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    TNX_F2(_mm256_cvtepu8_epi32(v), _mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
  }
  static I load_u8_n(const uint8_t* p, int n) {
    alignas(16) uint8_t buf[16] = {0};
    std::memcpy(buf, p, static_cast<size_t>(n));
    return load_u8(buf);
  }
  static I load_u16(const uint16_t* p) {
    TNX_F2(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
           _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8))));
  }
  static I load_u16_n(const uint16_t* p, int n) {
    alignas(32) uint16_t buf[16] = {0};
    std::memcpy(buf, p, 2 * static_cast<size_t>(n));
    return load_u16(buf);
  }
  static void store_u8(uint8_t* p, I x) {
    // lanes hold 0..255: pack 32 -> 16 -> 8 bits (saturating packs are exact here), undo the in-lane interleave
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(x.a, x.b), 0xD8);
    const __m128i bytes = _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bytes);
  }
  static void store_u8_n(uint8_t* p, I x, int n) {
    alignas(16) uint8_t buf[16];
    store_u8(buf, x);
    std::memcpy(p, buf, static_cast<size_t>(n));
  }
  static void store_u16(uint16_t* p, I x) {
    const __m256i w = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(_mm256_and_si256(x.a, _mm256_set1_epi32(0xFFFF)), _mm256_and_si256(x.b, _mm256_set1_epi32(0xFFFF))), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), w);
  }
  static void store_u16_n(uint16_t* p, I x, int n) {
    alignas(32) uint16_t buf[16];
    store_u16(buf, x);
    std::memcpy(p, buf, 2 * static_cast<size_t>(n));
  }
  static void store_nibbles(uint8_t* p, I x) {
    const __m256i m = _mm256_set1_epi32(15);
    const __m256i a = _mm256_and_si256(x.a, m), b = _mm256_and_si256(x.b, m);
    // per 64-bit lane: low byte = code 2i | code 2i+1 << 4; gather bytes 0, 8, 16, 24 of each half
    const __m256i pa = _mm256_or_si256(a, _mm256_srli_epi64(a, 28));
    const __m256i pb = _mm256_or_si256(b, _mm256_srli_epi64(b, 28));
    const __m256i sel = _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                         0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i ga = _mm256_shuffle_epi8(pa, sel), gb = _mm256_shuffle_epi8(pb, sel);
    const uint32_t lo = static_cast<uint32_t>(_mm256_extract_epi16(ga, 0)) | (static_cast<uint32_t>(_mm256_extract_epi16(ga, 8)) << 16);
    const uint32_t hi = static_cast<uint32_t>(_mm256_extract_epi16(gb, 0)) | (static_cast<uint32_t>(_mm256_extract_epi16(gb, 8)) << 16);
    std::memcpy(p, &lo, 4);
    std::memcpy(p + 4, &hi, 4);
  }
  static I iota() { return {_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)}; }
  static void transpose8(__m256i (&r)[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int g = 0; g < 8; g += 4) {
      u[g + 0] = _mm256_unpacklo_epi64(t[g], t[g + 2]);
      u[g + 1] = _mm256_unpackhi_epi64(t[g], t[g + 2]);
      u[g + 2] = _mm256_unpacklo_epi64(t[g + 1], t[g + 3]);
      u[g + 3] = _mm256_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int c = 0; c < 4; ++c) {
      r[c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x20);
      r[4 + c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x31);
    }
  }
  static void transpose16(I (&v)[16]) {  // four 8x8 blocks: [A B; C D] -> [A' C'; B' D']
    __m256i a[8], b[8], c[8], d[8];
    for (int i = 0; i < 8; ++i) {
      a[i] = v[i].a;
      b[i] = v[i].b;
      c[i] = v[8 + i].a;
      d[i] = v[8 + i].b;
    }
    transpose8(a);
    transpose8(b);
    transpose8(c);
    transpose8(d);
    for (int i = 0; i < 8; ++i) {
      v[i].a = a[i];
      v[i].b = c[i];
      v[8 + i].a = b[i];
      v[8 + i].b = d[i];
    }
  }
  static F permute16(F table, I idx) {
    auto half = [&](__m256i ix) {
      const __m256 lo = _mm256_permutevar8x32_ps(table.a, ix);
      const __m256 hi = _mm256_permutevar8x32_ps(table.b, ix);
      const __m256i use_hi = _mm256_slli_epi32(ix, 28);  // bit 3 of the index -> the sign bit blendv reads
      return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(use_hi));
    };
    TNX_F2(half(idx.a), half(idx.b));
  }
  static F half_to_f(I h) {
    const __m256i m = _mm256_set1_epi32(0xFFFF);
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(_mm256_and_si256(h.a, m), _mm256_and_si256(h.b, m)), 0xD8);
    TNX_F2(_mm256_cvtph_ps(_mm256_castsi256_si128(w)), _mm256_cvtph_ps(_mm256_extracti128_si256(w, 1)));
  }
  static float hmax(F x) {
    alignas(32) float t[16];
    store(t, x);
    float m = t[0];
    for (int l = 1; l < 16; ++l) m = t[l] > m ? t[l] : m;
    return m;
  }
  static int32_t ihmax(I x) {
    const __m256i m8 = _mm256_max_epi32(x.a, x.b);
    __m128i m = _mm_max_epi32(_mm256_castsi256_si128(m8), _mm256_extracti128_si256(m8, 1));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0x4E));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0xB1));
    return _mm_cvtsi128_si32(m);
  }
  static float hsum(F x) {
    alignas(32) float t[16];
    store(t, x);
    float s = 0.f;
    for (int l = 0; l < 16; ++l) s += t[l];
    return s;
  }
  static F e5m2x16(const uint8_t* p) {
    const __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8);
    TNX_F2(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
  }
  static F e4m3x16_div256(const uint8_t* p) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i mag = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7);
    const __m256i sgn = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
    const __m256i h = _mm256_or_si256(mag, sgn);
    TNX_F2(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
  }
#undef TNX_F2
};
#endif

// Generic composed fast paths for structs that do not provide their own (Portable): same values.
template <class S>
inline typename S::F e5m2x16_generic(const uint8_t* p) {
  return S::half_to_f(S::template sll<8>(S::load_u8(p)));
}
template <class S>
inline typename S::F e4m3x16_div256_generic(const uint8_t* p) {
  const typename S::I b = S::load_u8(p);
  const typename S::I h = S::ior(S::template sll<7>(S::iand(b, S::iset(0x7F))), S::template sll<8>(S::iand(b, S::iset(0x80))));
  return S::half_to_f(h);
}

template <class S, class = void>
struct Fp8Decode {
  static typename S::F e5m2(const uint8_t* p) { return e5m2x16_generic<S>(p); }
  static typename S::F e4m3_div256(const uint8_t* p) { return e4m3x16_div256_generic<S>(p); }
};
template <class S>
struct Fp8Decode<S, decltype(&S::e5m2x16, void())> {
  static typename S::F e5m2(const uint8_t* p) { return S::e5m2x16(p); }
  static typename S::F e4m3_div256(const uint8_t* p) { return S::e4m3x16_div256(p); }
};

// Which instruction sets this build holds, best first (the kernels' `isa` argument indexes it: 0 = best).
enum class Isa : int { kAvx512 = 0, kAvx2 = 1, kPortable = 2 };

}  // namespace tnx
