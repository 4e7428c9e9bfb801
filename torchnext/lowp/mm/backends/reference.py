"""``reference``: the oracle. Dequantize both operands with the formats' reference decoder to fp64, multiply in
fp64, apply the epilogue in fp64, round ``y`` to fp32, then amax / output quantization / cast (see
:mod:`torchnext.lowp.mm.epilogue`). Slow; never chosen by ``backend="auto"``."""

from __future__ import annotations

import torch

from torchnext.lowp.formats import FORMATS
from torchnext.lowp.mm.backends import EPILOGUE_FEATURES, Capability, KernelBackend, Problem
from torchnext.lowp.mm.epilogue import EpilogueOutput, apply_epilogue
from torchnext.lowp.tensor import BlockScaledTensor

__all__ = ["BACKEND", "ReferenceBackend", "reference_operand"]


def reference_operand(x: torch.Tensor | BlockScaledTensor) -> torch.Tensor:
    """``x`` as fp64 through the formats' *reference* decoder (independent of :mod:`torchnext.lowp.mm.decode`)."""
    if isinstance(x, torch.Tensor):
        return x.to(torch.float64)
    return x.dequantize(torch.float64, backend="reference")


class ReferenceBackend:
    name = KernelBackend.REFERENCE.value
    autotune_candidate = False

    def capability(self) -> Capability:
        return Capability(
            devices=frozenset({"cpu", "cuda", "xpu", "mps"}),
            formats=frozenset({"dense", *(f.value for f in FORMATS)}),
            epilogue=EPILOGUE_FEATURES,
            notes="fp64 oracle",
        )

    def available(self) -> tuple[bool, str]:
        return True, "always available"

    def supports(self, problem: Problem) -> str | None:
        return None

    def run(self, problem: Problem) -> EpilogueOutput:
        a = reference_operand(problem.a)
        w = reference_operand(problem.w)
        acc = a @ w.T
        return apply_epilogue(acc, problem.epilogue, problem.out_dtype, compute_dtype=torch.float64)


BACKEND = ReferenceBackend()
