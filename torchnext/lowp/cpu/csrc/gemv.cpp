// Weight-only block-scaled GEMV / small-M matmul: y = epilogue(x @ dequantize(w).T) for M <= 16 rows.
//
// Packed weight layout (built once by gemv_pack, cached by the Python side):
//   tiles of 16 output columns; tile t is contiguous: for each block b of the K dimension,
//     16 scale bytes (one per column), then the block's codes as steps of 16 bytes (one byte per column):
//     FP4: B/2 steps, step j holds elements 2j (low nibble) and 2j+1 (high nibble) of the block;
//     FP8: B steps, step j holds element j.
//   So the kernel streams one array, decodes 16 columns per vector (FP4: one byte load, one shift and two
//   16-entry table permutes give 32 weights) and broadcasts activations: no horizontal reduction anywhere.
//   Columns past N are zero (zero codes and scales). NaN scales / E4M3 NaN codes are replaced by zeros and their
//   column is flagged: its output is NaN whatever x is (NaN * anything is NaN), which the epilogue writes.
//
// Exactness: every decoded weight is exactly the fp32 value dequantize() gives (E2M1 x E4M3 products are exact,
// E8M0 scales are powers of two; NVFP4's global scale multiplies the accumulator). Accumulation is fp32 FMA in
// K order per 16-element step (the reference is fp64: the tests hold every backend to the same tolerance).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <tuple>
#include <vector>

#include "epilogue.h"
#include "simd.h"

namespace tnx {

enum GemvFormat : int { kNvfp4 = 0, kMxfp4 = 1, kMxfp8E4m3 = 2, kMxfp8E5m2 = 3 };

struct FormatGeom {
  int block;     // elements per block
  int steps;     // 16-byte code steps per block
  bool fp4;
};

inline FormatGeom geom(int fmt) {
  switch (fmt) {
    case kNvfp4: return {16, 8, true};
    case kMxfp4: return {32, 16, true};
    case kMxfp8E4m3:
    case kMxfp8E5m2: return {32, 32, false};
    default: TORCH_CHECK(false, "torchnext_cpu: unknown GEMV format code ", fmt);
  }
  return {0, 0, false};
}

inline int64_t block_bytes(int fmt) { return 16 + 16 * static_cast<int64_t>(geom(fmt).steps); }

// ------------------------------------------------------------------------------------------------ packing
// qdata: (N, row_bytes) uint8; scales: (N, nb) uint8. Returns (packed, nan_cols, flags) where flags[0] = 1 when an
// MX scale is so large that max|code| * scale overflows fp32 (blocks that held an Inf): the kernel then runs its
// "safe" variant, which forms every weight as code * scale in fp32 (overflowing exactly as dequantize() does)
// instead of folding the scale into per-block partial sums or into a x 256 factor.
std::tuple<at::Tensor, at::Tensor, at::Tensor> gemv_pack(const at::Tensor& qdata, const at::Tensor& scales, int64_t fmt) {
  TORCH_CHECK(qdata.dim() == 2 && scales.dim() == 2, "gemv_pack: qdata and scales must be 2-D");
  TORCH_CHECK(qdata.scalar_type() == at::kByte && scales.scalar_type() == at::kByte, "gemv_pack: uint8 views expected");
  const FormatGeom g = geom(static_cast<int>(fmt));
  const int64_t n = qdata.size(0);
  const int64_t nb = scales.size(1);
  const int64_t row_bytes = qdata.size(1);
  TORCH_CHECK(scales.size(0) == n, "gemv_pack: ", n, " weight rows but ", scales.size(0), " scale rows");
  TORCH_CHECK(row_bytes == nb * g.steps, "gemv_pack: ", row_bytes, " code bytes per row do not match ", nb, " blocks");
  const at::Tensor q = qdata.contiguous();
  const at::Tensor s = scales.contiguous();
  const int64_t tiles = (n + 15) / 16;
  const int64_t bb = block_bytes(static_cast<int>(fmt));
  at::Tensor packed = at::empty({tiles * nb * bb}, q.options());
  at::Tensor nan_cols = at::zeros({tiles * 16}, q.options());
  at::Tensor flags = at::zeros({1}, q.options());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const uint8_t* sp = s.data_ptr<uint8_t>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  uint8_t* nanp = nan_cols.data_ptr<uint8_t>();
  std::atomic<int> big_scale{0};
  const bool e4m3_scale = fmt == kNvfp4;
  // smallest E8M0 byte at which max|code| * scale overflows fp32 (6 * 2^126, 448 * 2^120, 57344 * 2^113)
  const int big_threshold = fmt == kMxfp4 ? 253 : fmt == kMxfp8E4m3 ? 247 : fmt == kMxfp8E5m2 ? 240 : 256;
  at::parallel_for(0, tiles, 1, [&](int64_t t_begin, int64_t t_end) {
    for (int64_t t = t_begin; t < t_end; ++t) {
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* dst = out + (t * nb + b) * bb;
        for (int l = 0; l < 16; ++l) {
          const int64_t col = t * 16 + l;
          uint8_t sc = 0;
          if (col < n) {
            sc = sp[col * nb + b];
            const bool nan = e4m3_scale ? (sc & 0x7F) == 0x7F : sc == 0xFF;
            if (nan) {
              nanp[col] = 1;
              sc = 0;
            }
            if (sc >= big_threshold) big_scale.store(1, std::memory_order_relaxed);
          }
          dst[l] = sc;
        }
        for (int j = 0; j < g.steps; ++j) {
          uint8_t* step = dst + 16 + 16 * j;
          for (int l = 0; l < 16; ++l) {
            const int64_t col = t * 16 + l;
            uint8_t c = 0;
            if (col < n) {
              c = qp[col * row_bytes + b * g.steps + j];
              if (fmt == kMxfp8E4m3 && (c & 0x7F) == 0x7F) {  // E4M3 NaN code
                nanp[col] = 1;
                c = 0;
              }
            }
            step[l] = c;
          }
        }
      }
    }
  });
  flags.data_ptr<uint8_t>()[0] = static_cast<uint8_t>(big_scale.load());
  return {packed, nan_cols, flags};
}

// ------------------------------------------------------------------------------------------------- kernel
struct GemvArgs {
  const uint8_t* packed;
  int64_t nb;         // blocks along K
  int64_t tiles;      // 16-column tiles
  const float* xt;    // (Kp, MR) fp32: x transposed, zero-padded rows and K
  const uint8_t* nan_cols;
  float gscale;       // NVFP4 global decode scale (1 when absent)
  bool has_g;
  EpilogueArgs ep;
};

// Decode one block's 16 column scales (the bytes at p) into fp32 factors.
//   NVFP4: e4m3 / 256 (the FP4 table holds 256 * e2m1, so the product is the exact e2m1 * e4m3);
//   MXFP4 / E5M2: 2^(b - 127) (b = 0 is 2^-127, a subnormal);  MXFP8 E4M3: 2^(b - 119) = 256 * 2^(b - 127)
//   (the FP8 decode yields e4m3 / 256), or 2^(b - 127) with a separate x 256 when `safe` (b >= 247 present).
template <class S, int FMT, bool SAFE>
TNX_INLINE typename S::F scales16(const uint8_t* p) {
  if constexpr (FMT == kNvfp4) {
    return Fp8Decode<S>::e4m3_div256(p);
  } else {
    const typename S::I b = S::load_u8(p);
    if constexpr (FMT == kMxfp8E4m3 && !SAFE) {
      return S::from_bits(S::template sll<23>(S::iadd(b, S::iset(8))));
    } else {
      const typename S::I e = S::template sll<23>(b);
      return S::from_bits(S::isel(S::ieq(b, S::iset(0)), S::iset(0x00400000), e));
    }
  }
}

template <class S, int FMT, bool SAFE>
TNX_INLINE typename S::F fp8_codes16(const uint8_t* p) {
  if constexpr (FMT == kMxfp8E5m2) {
    return Fp8Decode<S>::e5m2(p);
  } else if constexpr (SAFE) {
    return S::mul(Fp8Decode<S>::e4m3_div256(p), S::fset(256.0f));
  } else {
    return Fp8Decode<S>::e4m3_div256(p);
  }
}

#ifndef TNX_PREFETCH
#define TNX_PREFETCH 2048
#endif
constexpr int64_t kPrefetchBytes = TNX_PREFETCH;

// MR rows x NT tiles starting at tile t0: accumulate over all K, then the epilogue.
// FOLD: 0 = scale every decoded weight vector (for large MR); 1 = per-block partial sums of the raw products, scaled
// once per block (fewer multiplies); 2 = the same with separate partials for even and odd steps (more independent
// FMA chains when MR * NT is small).
template <class S, int FMT, int MR, int NT, int FOLD, bool SAFE>
void tile_kernel(const GemvArgs& a, int64_t t0, typename S::I& amax_bits) {
  using F = typename S::F;
  constexpr int B = FMT == kNvfp4 ? 16 : 32;
  constexpr bool FP4 = FMT == kNvfp4 || FMT == kMxfp4;
  constexpr int STEPS = FP4 ? B / 2 : B;
  constexpr int64_t BB = 16 + 16 * STEPS;
  const float tab_scale = FMT == kNvfp4 ? 256.0f : 1.0f;
  alignas(64) float tab_v[16];
  {
    const float mags[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
    for (int i = 0; i < 8; ++i) {
      tab_v[i] = mags[i] * tab_scale;
      tab_v[i + 8] = -mags[i] * tab_scale;
    }
  }
  const F tab = S::load(tab_v);
  const uint8_t* base[NT];
  for (int t = 0; t < NT; ++t) base[t] = a.packed + (t0 + t) * a.nb * BB;
  F acc[NT][MR];
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MR; ++m) acc[t][m] = S::fzero();

  for (int64_t b = 0; b < a.nb; ++b) {
    // software prefetch PF_BYTES ahead in every tile stream (hardware prefetchers stop at 4 KiB pages)
    for (int t = 0; t < NT; ++t)
      for (int64_t off = 0; off < BB; off += 64) __builtin_prefetch(base[t] + b * BB + kPrefetchBytes + off, 0, 3);
    F s[NT];
    for (int t = 0; t < NT; ++t) s[t] = scales16<S, FMT, SAFE>(base[t] + b * BB);
    const float* xb = a.xt + b * B * MR;
    if constexpr (FOLD > 0) {
      constexpr int P = FOLD == 2 ? 2 : 1;  // partial accumulators per (tile, row)
      F pe[NT][MR], po[NT][MR];
      for (int t = 0; t < NT; ++t)
        for (int m = 0; m < MR; ++m) pe[t][m] = po[t][m] = S::fzero();
      for (int j = 0; j < STEPS; ++j) {
        for (int t = 0; t < NT; ++t) {
          const uint8_t* p = base[t] + b * BB + 16 + 16 * j;
          if constexpr (FP4) {
            const typename S::I v = S::load_u8(p);
            const F we = S::permute16(tab, v);
            const F wo = S::permute16(tab, S::template srl<4>(v));
            for (int m = 0; m < MR; ++m) {
              pe[t][m] = S::fma(we, S::fset(xb[(2 * j) * MR + m]), pe[t][m]);
              if constexpr (P == 2) po[t][m] = S::fma(wo, S::fset(xb[(2 * j + 1) * MR + m]), po[t][m]);
              else pe[t][m] = S::fma(wo, S::fset(xb[(2 * j + 1) * MR + m]), pe[t][m]);
            }
          } else {
            const F w = fp8_codes16<S, FMT, SAFE>(p);
            for (int m = 0; m < MR; ++m) {
              if (P == 2 && (j & 1)) po[t][m] = S::fma(w, S::fset(xb[j * MR + m]), po[t][m]);
              else pe[t][m] = S::fma(w, S::fset(xb[j * MR + m]), pe[t][m]);
            }
          }
        }
      }
      for (int t = 0; t < NT; ++t)
        for (int m = 0; m < MR; ++m) acc[t][m] = S::fma(P == 2 ? S::add(pe[t][m], po[t][m]) : pe[t][m], s[t], acc[t][m]);
    } else {
      for (int j = 0; j < STEPS; ++j) {
        for (int t = 0; t < NT; ++t) {
          const uint8_t* p = base[t] + b * BB + 16 + 16 * j;
          if constexpr (FP4) {
            const typename S::I v = S::load_u8(p);
            const F we = S::mul(S::permute16(tab, v), s[t]);
            const F wo = S::mul(S::permute16(tab, S::template srl<4>(v)), s[t]);
            for (int m = 0; m < MR; ++m) {
              acc[t][m] = S::fma(we, S::fset(xb[(2 * j) * MR + m]), acc[t][m]);
              acc[t][m] = S::fma(wo, S::fset(xb[(2 * j + 1) * MR + m]), acc[t][m]);
            }
          } else {
            const F w = S::mul(fp8_codes16<S, FMT, SAFE>(p), s[t]);
            for (int m = 0; m < MR; ++m) acc[t][m] = S::fma(w, S::fset(xb[j * MR + m]), acc[t][m]);
          }
        }
      }
    }
  }

  // epilogue: global scale, NaN columns, then the shared epilogue
  const F nanv = S::fset(__builtin_nanf(""));
  for (int t = 0; t < NT; ++t) {
    const int64_t tile = t0 + t;
    const int64_t n0 = tile * 16;
    const int nc = static_cast<int>(std::min<int64_t>(16, a.ep.n - n0));
    const typename S::M nan_mask = S::ieq(S::load_u8(a.nan_cols + n0), S::iset(1));
    for (int m = 0; m < MR && m < a.ep.m; ++m) {
      F y = acc[t][m];
      if (a.has_g) y = S::mul(y, S::fset(a.gscale));
      y = S::fsel(nan_mask, nanv, y);
      epilogue16<S>(a.ep, m, n0, nc, y, amax_bits);
    }
  }
}

template <class S, int FMT, int MR, int NT, int FOLD, bool SAFE>
void run_tiles(const GemvArgs& a, std::atomic<int32_t>& amax) {
  const int64_t groups = (a.tiles + NT - 1) / NT;
  at::parallel_for(0, groups, 1, [&](int64_t g_begin, int64_t g_end) {
    typename S::I amax_bits = S::iset(0);
    for (int64_t g = g_begin; g < g_end; ++g) {
      const int64_t t0 = g * NT;
      if (t0 + NT <= a.tiles) {
        tile_kernel<S, FMT, MR, NT, FOLD, SAFE>(a, t0, amax_bits);
      } else {
        for (int64_t t = t0; t < a.tiles; ++t) tile_kernel<S, FMT, MR, 1, FOLD, SAFE>(a, t, amax_bits);
      }
    }
    if (a.ep.want_amax) {
      const int32_t local = S::ihmax(amax_bits);
      int32_t cur = amax.load(std::memory_order_relaxed);
      while (local > cur && !amax.compare_exchange_weak(cur, local, std::memory_order_relaxed)) {
      }
    }
  });
}

// Rows padded to MR in {1, 2, 4, 8, 16}; the tile count per group (NT) keeps the accumulators in registers.
template <class S, int FMT, bool SAFE>
void dispatch_rows(const GemvArgs& a, int mr, std::atomic<int32_t>& amax) {
  constexpr bool wide = S::kRegs >= 32;
  constexpr int F2 = SAFE ? 0 : 2, F1 = SAFE || !wide ? 0 : 1;  // no scale folding in the safe variant
  switch (mr) {
    case 1: run_tiles<S, FMT, 1, 4, F2, SAFE>(a, amax); break;
    case 2: run_tiles<S, FMT, 2, (wide ? 2 : 1), F2, SAFE>(a, amax); break;
    case 4: run_tiles<S, FMT, 4, (wide ? 2 : 1), F1, SAFE>(a, amax); break;
    case 8: run_tiles<S, FMT, 8, (wide ? 2 : 1), 0, SAFE>(a, amax); break;
    case 16: run_tiles<S, FMT, 16, 1, 0, SAFE>(a, amax); break;
    default: TORCH_CHECK(false, "torchnext_cpu.gemv: unsupported row block ", mr);
  }
}

template <class S>
void dispatch_format(const GemvArgs& a, int fmt, bool safe, int mr, std::atomic<int32_t>& amax) {
  switch (fmt) {
    case kNvfp4: dispatch_rows<S, kNvfp4, false>(a, mr, amax); break;
    case kMxfp4:
      if (safe) dispatch_rows<S, kMxfp4, true>(a, mr, amax);
      else dispatch_rows<S, kMxfp4, false>(a, mr, amax);
      break;
    case kMxfp8E4m3:
      if (safe) dispatch_rows<S, kMxfp8E4m3, true>(a, mr, amax);
      else dispatch_rows<S, kMxfp8E4m3, false>(a, mr, amax);
      break;
    case kMxfp8E5m2:
      if (safe) dispatch_rows<S, kMxfp8E5m2, true>(a, mr, amax);
      else dispatch_rows<S, kMxfp8E5m2, false>(a, mr, amax);
      break;
    default: TORCH_CHECK(false, "torchnext_cpu.gemv: unknown format ", fmt);
  }
}

int best_isa();                        // register.cpp
double scalar_of(const at::Tensor& t);  // quantize.cpp

// x: (M, K) fp32 or bf16, M <= 16. Returns (y (M, N) fp32 or bf16, amax 0-d fp32 (0 unless want_amax)).
std::tuple<at::Tensor, at::Tensor> gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& nan_cols,
                                        const at::Tensor& flags, int64_t fmt, int64_t n, int64_t kp,
                                        const c10::optional<at::Tensor>& gscale,
                                        const c10::optional<at::Tensor>& scale, int64_t scale_kind,
                                        const c10::optional<at::Tensor>& bias, int64_t act,
                                        const c10::optional<at::Tensor>& residual, bool want_amax, bool bf16_out,
                                        int64_t isa) {
  TORCH_CHECK(x.dim() == 2, "torchnext_cpu.gemv: x must be 2-D");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "torchnext_cpu.gemv: x must be fp32 or bf16");
  const int64_t m = x.size(0);
  const int64_t k = x.size(1);
  TORCH_CHECK(m >= 1 && m <= 16, "torchnext_cpu.gemv: M must be in [1, 16], got ", m);
  const FormatGeom g = geom(static_cast<int>(fmt));
  TORCH_CHECK(kp % g.block == 0 && k <= kp && kp - k < g.block, "torchnext_cpu.gemv: K=", k, " does not match the weight's ", kp);
  const int64_t nb = kp / g.block;
  const int64_t tiles = (n + 15) / 16;
  TORCH_CHECK(packed.numel() == tiles * nb * block_bytes(static_cast<int>(fmt)), "torchnext_cpu.gemv: packed weight size mismatch");
  TORCH_CHECK(nan_cols.numel() == tiles * 16, "torchnext_cpu.gemv: nan_cols size mismatch");
  const int mr = m == 1 ? 1 : m == 2 ? 2 : m <= 4 ? 4 : m <= 8 ? 8 : 16;

  // x transposed to (Kp, MR) fp32, zero padded (rows past M, K past k)
  at::Tensor xt_t;
  const float* xt = nullptr;
  const at::Tensor xc = x.contiguous();
  if (mr == 1 && k == kp && xc.scalar_type() == at::kFloat) {
    xt = xc.data_ptr<float>();
  } else {
    xt_t = at::zeros({kp * mr}, x.options().dtype(at::kFloat));
    float* dst = xt_t.data_ptr<float>();
    if (xc.scalar_type() == at::kFloat) {
      const float* src = xc.data_ptr<float>();
      for (int64_t r = 0; r < m; ++r)
        for (int64_t i = 0; i < k; ++i) dst[i * mr + r] = src[r * k + i];
    } else {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
      for (int64_t r = 0; r < m; ++r)
        for (int64_t i = 0; i < k; ++i) dst[i * mr + r] = bits_to_f(static_cast<uint32_t>(src[r * k + i]) << 16);
    }
    xt = dst;
  }

  GemvArgs a;
  a.packed = packed.data_ptr<uint8_t>();
  a.nb = nb;
  a.tiles = tiles;
  a.xt = xt;
  a.nan_cols = nan_cols.data_ptr<uint8_t>();
  // the NVFP4 global decode scale as a 0-d tensor (a traced graph holds tensors, not values read from them)
  TORCH_CHECK(!gscale.has_value() || gscale->numel() == 1, "torchnext_cpu.gemv: the global scale must hold one value");
  a.has_g = gscale.has_value();
  a.gscale = a.has_g ? static_cast<float>(scalar_of(*gscale)) : 1.0f;
  a.ep.m = m;
  a.ep.n = n;
  a.ep.scale_kind = static_cast<int>(scale_kind);
  at::Tensor sc, bi, re;
  if (scale_kind != kScaleNone) {
    TORCH_CHECK(scale.has_value(), "torchnext_cpu.gemv: scale_kind set without a scale");
    sc = scale->contiguous();
    TORCH_CHECK(sc.scalar_type() == at::kFloat, "torchnext_cpu.gemv: scale must be fp32");
    const int64_t want = scale_kind == kScaleScalar ? 1 : scale_kind == kScaleRow ? m : n;
    TORCH_CHECK(sc.numel() == want, "torchnext_cpu.gemv: scale has ", sc.numel(), " elements, expected ", want);
    a.ep.scale = sc.data_ptr<float>();
  }
  if (bias.has_value()) {
    bi = bias->contiguous();
    TORCH_CHECK(bi.scalar_type() == at::kFloat && bi.numel() == n, "torchnext_cpu.gemv: bias must be fp32 (N,)");
    a.ep.bias = bi.data_ptr<float>();
  }
  a.ep.act = static_cast<int>(act);
  if (residual.has_value()) {
    re = residual->contiguous();
    TORCH_CHECK(re.scalar_type() == at::kFloat && re.numel() == m * n, "torchnext_cpu.gemv: residual must be fp32 (M, N)");
    a.ep.residual = re.data_ptr<float>();
  }
  a.ep.want_amax = want_amax;
  at::Tensor y = at::empty({m, n}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  if (bf16_out) a.ep.out16 = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  else a.ep.out32 = y.data_ptr<float>();

  const bool safe = flags.data_ptr<uint8_t>()[0] != 0;
  std::atomic<int32_t> amax{0};
  const int use = isa < 0 ? best_isa() : static_cast<int>(isa);
  switch (static_cast<Isa>(use)) {
#ifdef TNX_HAVE_AVX512
    case Isa::kAvx512: dispatch_format<Avx512>(a, static_cast<int>(fmt), safe, mr, amax); break;
#endif
#ifdef TNX_HAVE_AVX2
    case Isa::kAvx2: dispatch_format<Avx2>(a, static_cast<int>(fmt), safe, mr, amax); break;
#endif
    case Isa::kPortable: dispatch_format<Portable>(a, static_cast<int>(fmt), safe, mr, amax); break;
    default: TORCH_CHECK(false, "torchnext_cpu.gemv: instruction set ", use, " is not compiled into this build");
  }
  at::Tensor amax_t = at::empty({}, x.options().dtype(at::kFloat));
  amax_t.data_ptr<float>()[0] = bits_to_f(static_cast<uint32_t>(amax.load()));
  return {y, amax_t};
}

}  // namespace tnx
