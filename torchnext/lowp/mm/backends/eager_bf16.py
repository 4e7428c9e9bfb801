"""``eager_bf16``: both block-scaled operands decoded *exactly* to bf16, one bf16 GEMM, the epilogue in fp32.

Meaning::

    a16 = decode(a) without its global scale      # exact: an FP4/FP8 element times an E4M3/E8M0 scale has <= 5
    w16 = decode(w) without its global scale      # significant bits and lies in bf16's (= fp32's) exponent range
    acc = fp32(bf16_gemm(a16, w16.T))             # oneDNN / cuBLAS: fp32 accumulation, the sum rounded to bf16
    acc *= global_a * global_w                    # NVFP4 global scales, in fp32
    return epilogue(acc)                          # as every backend (fp32)

So it multiplies the same numbers as ``eager`` but rounds each output element once to bf16 (relative error
<= 2**-9) before the epilogue — the output precision of the hardware low-precision GEMMs with a bf16 output. The
bf16 GEMM runs at ~4-5x the fp32 one on this CPU (AVX512-BF16). Only exact for products of at least 2**-133 (E5M2
subnormals times E8M0 scales below 2**-117 flush; see :mod:`torchnext.lowp.mm.decode`). Dense operands are
declined (their bf16 cast would not be exact). Opt-in (``backend="eager_bf16"``): the autotuner never picks it,
since it rounds outputs that ``"auto"`` promises at the other backends' (fp32) accuracy.
"""

from __future__ import annotations

import torch

from torchnext.lowp.formats import FORMATS
from torchnext.lowp.mm.backends import EPILOGUE_FEATURES, Capability, KernelBackend, Problem, check_capability
from torchnext.lowp.mm.decode import dequantize_operand
from torchnext.lowp.mm.epilogue import EpilogueOutput, apply_epilogue
from torchnext.lowp.tensor import BlockScaledTensor
from torchnext.lowp.workspace import fresh, reusable

__all__ = ["BACKEND", "EagerBF16Backend"]

_EXACT = frozenset({"nvfp4", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4"})


class EagerBF16Backend:
    name = KernelBackend.EAGER_BF16.value
    autotune_candidate = False  # opt-in: it changes results (bf16 outputs), so "auto" never picks it

    def capability(self) -> Capability:
        return Capability(
            devices=frozenset({"cpu", "cuda", "xpu"}),
            formats=frozenset(f.value for f in FORMATS if f.value in _EXACT),
            epilogue=EPILOGUE_FEATURES,
            notes="block-scaled operands only (decoded exactly to bf16); the GEMM output is rounded to bf16",
        )

    def available(self) -> tuple[bool, str]:
        return True, "always available (eager torch ops, bf16 GEMM)"

    def supports(self, problem: Problem) -> str | None:
        return check_capability(self.capability(), problem)

    def run(self, problem: Problem) -> EpilogueOutput:
        a, w = problem.a, problem.w
        assert isinstance(a, BlockScaledTensor) and isinstance(w, BlockScaledTensor)
        reuse = reusable(a, w)
        a16 = dequantize_operand(a, torch.bfloat16, with_global_scale=False,
                                 scratch_tag="eager_bf16.a" if reuse else None)
        w16 = dequantize_operand(w, torch.bfloat16, with_global_scale=False,
                                 scratch_tag="eager_bf16.w" if reuse else None)
        out16 = torch.mm(a16, w16.t())
        acc = fresh(out16.shape, torch.float32, out16.device).copy_(out16) if reuse else out16.to(torch.float32)
        for q in (a, w):
            if q.global_scale is not None:
                acc.mul_(q.global_scale.to(torch.float32))
        return apply_epilogue(acc, problem.epilogue, problem.out_dtype, inplace=True)


BACKEND = EagerBF16Backend()
