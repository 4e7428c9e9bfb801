// Operator registration: the torch.ops.torchnext_cpu namespace (no Python headers: loaded by torch.ops.load_library).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <string>

#include "simd.h"

namespace tnx {

// Bumped whenever an op's schema or meaning changes: the Python loader refuses a library with another version.
constexpr int64_t kAbiVersion = 3;

int best_isa() {
#if defined(TNX_HAVE_AVX512)
  return static_cast<int>(Isa::kAvx512);
#elif defined(TNX_HAVE_AVX2)
  return static_cast<int>(Isa::kAvx2);
#else
  return static_cast<int>(Isa::kPortable);
#endif
}

// Instruction sets compiled into this build, best first, e.g. "avx512,avx2,portable".
std::string isas() {
  std::string s;
#if defined(TNX_HAVE_AVX512)
  s += "avx512,";
#endif
#if defined(TNX_HAVE_AVX2)
  s += "avx2,";
#endif
  s += "portable";
  return s;
}

int64_t abi_version() { return kAbiVersion; }

std::tuple<at::Tensor, at::Tensor, at::Tensor> gemv_pack(const at::Tensor& qdata, const at::Tensor& scales, int64_t fmt);
std::tuple<at::Tensor, at::Tensor> gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& nan_cols,
                                        const at::Tensor& flags, int64_t fmt, int64_t n, int64_t kp,
                                        const c10::optional<at::Tensor>& gscale,
                                        const c10::optional<at::Tensor>& scale, int64_t scale_kind,
                                        const c10::optional<at::Tensor>& bias, int64_t act,
                                        const c10::optional<at::Tensor>& residual, bool want_amax, bool bf16_out,
                                        int64_t isa);
void quantize(const at::Tensor& x, int64_t outer, int64_t k, int64_t inner, const at::Tensor& codes,
              const at::Tensor& scales, int64_t elem, int64_t block, int64_t recipe,
              const c10::optional<at::Tensor>& g_dec, const c10::optional<at::Tensor>& g_enc, bool swizzle, int64_t swz_cols, const c10::optional<at::Tensor>& noise, bool sr_seeded,
              int64_t seed, int64_t offset, int64_t isa);
void quantize_pair(const at::Tensor& x, const at::Tensor& row_codes, const at::Tensor& row_scales,
                   const at::Tensor& col_codes, const at::Tensor& col_scales, int64_t elem, int64_t block,
                   int64_t recipe_r, const c10::optional<at::Tensor>& gdec_r,
                   const c10::optional<at::Tensor>& genc_r, bool sr_r, int64_t seed_r, int64_t off_r,
                   int64_t recipe_c, const c10::optional<at::Tensor>& gdec_c, const c10::optional<at::Tensor>& genc_c,
                   bool sr_c, int64_t seed_c, int64_t off_c, const c10::optional<at::Tensor>& signs, int64_t isa);
at::Tensor absmax(const at::Tensor& x, int64_t isa);
at::Tensor rht_absmax(const at::Tensor& x, const at::Tensor& signs, int64_t isa);
at::Tensor rng_uniform(int64_t seed, int64_t offset, int64_t numel);

}  // namespace tnx

// Schemas here, kernels per dispatch key below: the tensor ops have CPU kernels only, so FakeTensor tracing
// (torch.compile, torch.export) reaches the fake (meta) implementations registered in Python
// (torchnext/lowp/cpu/_fakes.py) instead of running a kernel on data that is not allocated. The two scalar
// queries keep catch-all kernels (no tensor to dispatch on); rng_uniform has no tensor argument either, so its
// kernel is CompositeExplicitAutograd (any key) and its fake comes from Python as the others'.
TORCH_LIBRARY(torchnext_cpu, m) {
  m.def("abi_version() -> int", &tnx::abi_version);
  m.def("isas() -> str", &tnx::isas);
  m.def("gemv_pack(Tensor qdata, Tensor scales, int fmt) -> (Tensor, Tensor, Tensor)");
  m.def(
      "gemv(Tensor x, Tensor packed, Tensor nan_cols, Tensor flags, int fmt, int n, int kp, Tensor? gscale, "
      "Tensor? scale, int scale_kind, Tensor? bias, int act, Tensor? residual, bool want_amax, bool bf16_out, "
      "int isa) -> (Tensor, Tensor)");
  m.def(
      "quantize(Tensor x, int outer, int k, int inner, Tensor(a!) codes, Tensor(b!) scales, int elem, int block, "
      "int recipe, Tensor? g_dec, Tensor? g_enc, bool swizzle, int swz_cols, Tensor? noise, bool sr_seeded, "
      "int seed, int offset, int isa) -> ()");
  m.def(
      "quantize_pair(Tensor x, Tensor(a!) row_codes, Tensor(b!) row_scales, Tensor(c!) col_codes, "
      "Tensor(d!) col_scales, int elem, int block, int recipe_r, Tensor? gdec_r, Tensor? genc_r, bool sr_r, "
      "int seed_r, int off_r, int recipe_c, Tensor? gdec_c, Tensor? genc_c, bool sr_c, int seed_c, "
      "int off_c, Tensor? signs, int isa) -> ()");
  m.def("absmax(Tensor x, int isa) -> Tensor");
  m.def("rht_absmax(Tensor x, Tensor signs, int isa) -> Tensor");
  m.def("rng_uniform(int seed, int offset, int numel) -> Tensor");
}

TORCH_LIBRARY_IMPL(torchnext_cpu, CPU, m) {
  m.impl("gemv_pack", &tnx::gemv_pack);
  m.impl("gemv", &tnx::gemv);
  m.impl("quantize", &tnx::quantize);
  m.impl("quantize_pair", &tnx::quantize_pair);
  m.impl("absmax", &tnx::absmax);
  m.impl("rht_absmax", &tnx::rht_absmax);
}

TORCH_LIBRARY_IMPL(torchnext_cpu, CompositeExplicitAutograd, m) {
  m.impl("rng_uniform", &tnx::rng_uniform);
}
