"""Block-scaled matmuls: ``scaled_mm`` with fused epilogues, its kernel backends and autotuner, grouped GEMM.

``scaled_mm(a, w, epilogue=...)`` validates its operands into a ``Problem`` and runs it on a backend from the
registry in :mod:`torchnext.lowp.mm.backends` (``backend="auto"`` asks :mod:`torchnext.lowp.mm.autotune`);
:mod:`~torchnext.lowp.mm.epilogue` defines the epilogue every backend reproduces; :mod:`~torchnext.lowp.mm.decode`
the operand decoders they share; :mod:`~torchnext.lowp.mm.grouped` the MoE form. See docs/lowp_mm.md.
"""

from torchnext.lowp.mm.backends import BackendUnavailable as BackendUnavailable
from torchnext.lowp.mm.backends import KernelBackend as KernelBackend
from torchnext.lowp.mm.backends import available_backends as available_backends
from torchnext.lowp.mm.backends import register_backend as register_backend
from torchnext.lowp.mm.epilogue import ACTIVATIONS as ACTIVATIONS
from torchnext.lowp.mm.epilogue import Epilogue as Epilogue
from torchnext.lowp.mm.epilogue import EpilogueError as EpilogueError
from torchnext.lowp.mm.epilogue import register_activation as register_activation
from torchnext.lowp.mm.grouped import grouped_scaled_mm as grouped_scaled_mm
from torchnext.lowp.mm.scaled_mm import ScaledMMResult as ScaledMMResult
from torchnext.lowp.mm.scaled_mm import scaled_mm as scaled_mm

__all__ = [
    "ACTIVATIONS",
    "BackendUnavailable",
    "Epilogue",
    "EpilogueError",
    "KernelBackend",
    "ScaledMMResult",
    "available_backends",
    "grouped_scaled_mm",
    "register_activation",
    "register_backend",
    "scaled_mm",
]
