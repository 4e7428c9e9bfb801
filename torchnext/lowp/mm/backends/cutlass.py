"""``cutlass``: NVIDIA CUTLASS's Python ``cutlass.operators`` package, when installed.

Reported unavailable (with the reason) unless ``cutlass.operators`` imports and a CUDA device is present. Even
then no problem is claimed: ``cutlass.operators`` rejects every epilogue on block-scaled operators, and its
epilogue-free block-scaled GEMM entry point could not be verified in this environment (no GPU, package absent), so
the binding is left out rather than guessed — ``supports`` says so.
"""

from __future__ import annotations

import importlib

import torch

from torchnext.lowp.mm.backends import Capability, KernelBackend, Problem
from torchnext.lowp.mm.epilogue import EpilogueOutput

__all__ = ["BACKEND", "CutlassBackend"]


class CutlassBackend:
    name = KernelBackend.CUTLASS.value
    autotune_candidate = True
    traceable = False
    """Not chosen inside torch.compile/export: it calls cutlass.operators."""

    def capability(self) -> Capability:
        return Capability(devices=frozenset({"cuda"}), formats=frozenset(), epilogue=frozenset(), notes="not bound")

    def available(self) -> tuple[bool, str]:
        try:
            importlib.import_module("cutlass.operators")
        except Exception as exc:  # ImportError, or a broken install
            return False, f"cutlass.operators is not importable ({type(exc).__name__}: {exc})"
        if not torch.cuda.is_available():
            return False, "cutlass.operators is installed but no CUDA device is available"
        return True, "cutlass.operators importable"

    def supports(self, problem: Problem) -> str | None:
        ok, why = self.available()
        if not ok:
            return why
        return (
            "no torchnext binding: cutlass.operators rejects epilogues on block-scaled operators and its epilogue-free "
            "block-scaled GEMM API is not bound here"
        )

    def run(self, problem: Problem) -> EpilogueOutput:
        from torchnext.lowp.mm.backends import BackendUnavailable

        raise BackendUnavailable(self.supports(problem) or "cutlass backend cannot run this problem")


BACKEND = CutlassBackend()
