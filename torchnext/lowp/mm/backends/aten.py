"""``aten``: PyTorch's own GEMM kernels.

* Block-scaled operands: ``torch._scaled_mm`` with both operands in the same format (NVFP4, MXFP8 E4M3, MXFP4) and
  scales in the swizzled 32_4_4 layout — CUDA with compute capability ≥ 10.0 only (on CPU, torch 2.13/2.14 reject
  block scales: "CPU does not support swizzle"; CPU ``_scaled_mm`` takes tensorwise/rowwise scales only, which cannot
  express a scale per block along K). NVFP4 global scales are applied to the output.
* Dense operands (any device): ``F.linear``.

The epilogue runs as eager ops after the GEMM (nothing is fused here).
"""

from __future__ import annotations

import torch

from torchnext.lowp.mm.backends import EPILOGUE_FEATURES, Capability, KernelBackend, Problem, check_capability
from torchnext.lowp.mm.epilogue import EpilogueOutput, apply_epilogue
from torchnext.lowp.tensor import BlockScaledTensor

__all__ = ["BACKEND", "AtenBackend"]

_GPU_FORMATS = frozenset({"nvfp4", "mxfp8_e4m3", "mxfp4"})


def _cuda_sm100(device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 10


class AtenBackend:
    name = KernelBackend.ATEN.value
    autotune_candidate = True

    def capability(self) -> Capability:
        return Capability(
            devices=frozenset({"cpu", "cuda"}),
            formats=frozenset({"dense"} | _GPU_FORMATS),
            epilogue=EPILOGUE_FEATURES,
            notes="block-scaled: CUDA sm_100+, both operands in the same format; dense: any device (F.linear)",
        )

    def available(self) -> tuple[bool, str]:
        return True, "F.linear everywhere; block-scaled torch._scaled_mm on CUDA sm_100+"

    def supports(self, problem: Problem) -> str | None:
        why = check_capability(self.capability(), problem)
        if why is not None:
            return why
        fa, fw = problem.formats
        if fa == "dense" and fw == "dense":
            return None
        if fa != fw:
            return f"torch._scaled_mm needs both operands in one block-scaled format, got {fa} x {fw}"
        if not _cuda_sm100(problem.device):
            return "block-scaled torch._scaled_mm needs CUDA compute capability >= 10.0 (CPU: 'does not support swizzle')"
        if fa == "nvfp4" and not hasattr(torch, "float4_e2m1fn_x2"):
            return "this torch has no float4_e2m1fn_x2 dtype"
        if problem.k % 32 or problem.n % 16:
            return f"torch._scaled_mm block-scaled needs K % 32 == 0 and N % 16 == 0, got K={problem.k}, N={problem.n}"
        return None

    def run(self, problem: Problem) -> EpilogueOutput:
        a, w = problem.a, problem.w
        if isinstance(a, torch.Tensor) and isinstance(w, torch.Tensor):
            acc = torch.nn.functional.linear(a.float(), w.float())
            return apply_epilogue(acc, problem.epilogue, problem.out_dtype)
        assert isinstance(a, BlockScaledTensor) and isinstance(w, BlockScaledTensor)
        acc = _scaled_mm_block(a, w)
        return apply_epilogue(acc, problem.epilogue, problem.out_dtype)


def _codes(q: BlockScaledTensor) -> torch.Tensor:
    if q.spec.element.bits == 4:
        return q.qdata.view(torch.float4_e2m1fn_x2)
    return q.qdata


def _scaled_mm_block(a: BlockScaledTensor, w: BlockScaledTensor) -> torch.Tensor:
    """fp32 ``a @ w.T`` through cuBLAS block-scaled GEMM (global scales applied after)."""
    sa = a.with_layout(swizzle=True).scales
    sw = w.with_layout(swizzle=True).scales
    acc = torch._scaled_mm(_codes(a), _codes(w).t(), scale_a=sa, scale_b=sw, out_dtype=torch.float32)
    acc = acc[: a.shape[0], : w.shape[0]]
    for q in (a, w):
        if q.global_scale is not None:
            acc = acc * q.global_scale.float()
    return acc


BACKEND = AtenBackend()
