"""``eager``: the decomposed path in eager torch ops, on any device. Fast LUT dequantize of each block-scaled
operand to fp32 (:func:`torchnext.lowp.mm.decode.dequantize_operand`, into reused scratch memory: see
:mod:`torchnext.lowp.workspace`), ``F.linear`` in fp32, then the epilogue as separate eager ops on the accumulator,
in place. It needs no compiler, so it is the fallback when ``inductor`` cannot compile."""

from __future__ import annotations

import torch

from torchnext.lowp.formats import FORMATS
from torchnext.lowp.mm.backends import EPILOGUE_FEATURES, Capability, KernelBackend, Problem, check_capability
from torchnext.lowp.mm.backends._common import dense_operand
from torchnext.lowp.mm.epilogue import EpilogueOutput, apply_epilogue
from torchnext.lowp.workspace import fresh, reusable

__all__ = ["BACKEND", "EagerBackend"]


class EagerBackend:
    name = KernelBackend.EAGER.value
    autotune_candidate = True

    def capability(self) -> Capability:
        return Capability(
            devices=frozenset({"cpu", "cuda", "xpu", "mps"}),
            formats=frozenset({"dense", *(f.value for f in FORMATS)}),
            epilogue=EPILOGUE_FEATURES,
        )

    def available(self) -> tuple[bool, str]:
        return True, "always available (eager torch ops)"

    def supports(self, problem: Problem) -> str | None:
        return check_capability(self.capability(), problem)

    def run(self, problem: Problem) -> EpilogueOutput:
        # decoded operands live in scratch memory unless autograd could save them (they never leave this call)
        reuse = reusable(problem.a, problem.w)
        a = dense_operand(problem.a, scratch_tag="eager.a" if reuse else None)
        w = dense_operand(problem.w, scratch_tag="eager.w" if reuse else None)
        if reuse and a.dim() == 2 and a.dtype == w.dtype:
            # the same BLAS call as F.linear, into a fresh accumulator with huge pages advised (workspace.fresh)
            acc = torch.mm(a, w.t(), out=fresh((a.shape[0], w.shape[0]), a.dtype, a.device))
        else:
            acc = torch.nn.functional.linear(a, w)
        return apply_epilogue(acc, problem.epilogue, problem.out_dtype, inplace=True)


BACKEND = EagerBackend()
