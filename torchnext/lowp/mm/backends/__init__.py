"""Kernel backends of :func:`~torchnext.lowp.mm.scaled_mm`: a ``str`` enum, a registry and capability declarations.

Each backend is an object with ``name``, ``capability()``, ``available() -> (bool, reason)``,
``supports(problem) -> None | reason`` and ``run(problem) -> EpilogueOutput``; optionally
``supersedes(problem) -> frozenset of names``: backends the autotuner need not time where this one is eligible, and
``traceable = False``: never chosen by ``backend="auto"`` inside ``torch.compile``/``torch.export``. The built-in ones are registered
lazily (first registry query), so ``import torchnext.lowp`` imports no compiler:

==============  ===========================================================================================
``reference``   dequantize → fp64 matmul → fp64 epilogue (rounded to fp32): the oracle, never auto-selected
``eager``       fast eager dequantize (byte LUT) → ``F.linear`` (fp32) → eager epilogue; everywhere
``eager_bf16``  block-scaled operands decoded exactly to bf16 → one bf16 GEMM (output rounded to bf16) → fp32
                epilogue; everywhere
``aten``        ``torch._scaled_mm`` with block scales (CUDA sm_100+), ``F.linear`` for dense operands
``cpu``         torchnext's compiled C++ small-M kernel (M <= 16, block-scaled weight, dense activations): decode
                in SIMD registers + fused epilogue; CPU, when a C++ compiler is present (built on first use)
``inductor``    ``torch.compile``-generated kernels: decode + reduction + epilogue fused (GEMV for tiny M),
                fused dequantize → mm → fused epilogue + amax otherwise; CPU and GPU
``triton``      a Triton kernel (block-scaled operands decoded in-kernel, epilogue in-kernel); CUDA only
``cutlass``     ``cutlass.operators`` when importable and supporting the request
==============  ===========================================================================================
"""

from __future__ import annotations

import enum
import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from torchnext.lowp.errors import FormatError

if TYPE_CHECKING:
    from torchnext.lowp.mm.epilogue import Epilogue, EpilogueOutput
    from torchnext.lowp.tensor import BlockScaledTensor

__all__ = [
    "BACKENDS",
    "Backend",
    "BackendUnavailable",
    "Capability",
    "KernelBackend",
    "Problem",
    "available_backends",
    "get_backend",
    "register_backend",
]

EPILOGUE_FEATURES = frozenset({"scale", "bias", "activation", "residual", "amax", "out_format"})
DENSE = "dense"
"""Format name used for a plain floating tensor operand."""


class KernelBackend(str, enum.Enum):
    """Backends of :func:`~torchnext.lowp.mm.scaled_mm` (``backend="auto"`` lets the autotuner choose)."""

    REFERENCE = "reference"
    EAGER = "eager"
    EAGER_BF16 = "eager_bf16"
    ATEN = "aten"
    CPU = "cpu"
    INDUCTOR = "inductor"
    TRITON = "triton"
    CUTLASS = "cutlass"


class BackendUnavailable(FormatError, RuntimeError):
    """The requested backend cannot run this problem (not installed, wrong device, unsupported format/epilogue)."""


@dataclass(frozen=True, kw_only=True)
class Capability:
    """What a backend declares it supports."""

    devices: frozenset[str]
    """Device types (``"cpu"``, ``"cuda"``)."""
    formats: frozenset[str]
    """Operand formats: format names (``"nvfp4"``, ...) and ``"dense"`` for a plain float tensor."""
    epilogue: frozenset[str] = EPILOGUE_FEATURES
    """Epilogue features (see :attr:`Epilogue.features`)."""
    notes: str = ""
    """Conditions not captured above (compute capability, ...)."""


@dataclass(kw_only=True, eq=False)
class Problem:
    """One scaled matmul as backends see it: ``epilogue(a @ w.T)``, ``a`` (M, K), ``w`` (N, K)."""

    a: torch.Tensor | BlockScaledTensor
    w: torch.Tensor | BlockScaledTensor
    epilogue: Epilogue
    out_dtype: torch.dtype
    m: int
    n: int
    k: int
    device: torch.device
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def a_format(self) -> str:
        return operand_format(self.a)

    @property
    def w_format(self) -> str:
        return operand_format(self.w)

    @property
    def formats(self) -> tuple[str, str]:
        return self.a_format, self.w_format


def operand_format(x: object) -> str:
    """``"dense"`` for a tensor, the format name for a BlockScaledTensor."""
    return DENSE if isinstance(x, torch.Tensor) else x.spec.name  # type: ignore[attr-defined]


@runtime_checkable
class Backend(Protocol):
    """The contract every backend implements."""

    name: str

    def capability(self) -> Capability: ...

    def available(self) -> tuple[bool, str]: ...

    def supports(self, problem: Problem) -> str | None: ...

    def run(self, problem: Problem) -> EpilogueOutput: ...


def check_capability(cap: Capability, problem: Problem) -> str | None:
    """The first reason ``problem`` is outside ``cap`` (None if inside)."""
    if problem.device.type not in cap.devices:
        return f"device {problem.device.type!r} not in {sorted(cap.devices)}"
    for side, fmt in zip(("a", "w"), problem.formats, strict=True):
        if fmt not in cap.formats:
            return f"operand {side} format {fmt!r} not in {sorted(cap.formats)}"
    missing = problem.epilogue.features - cap.epilogue
    if missing:
        return f"epilogue features {sorted(missing)} not supported"
    return None


BACKENDS: dict[str, Backend] = {}
"""The registry: name → backend object."""

_BUILTIN_MODULES = {
    KernelBackend.REFERENCE: "torchnext.lowp.mm.backends.reference",
    KernelBackend.EAGER: "torchnext.lowp.mm.backends.eager",
    KernelBackend.EAGER_BF16: "torchnext.lowp.mm.backends.eager_bf16",
    KernelBackend.ATEN: "torchnext.lowp.mm.backends.aten",
    KernelBackend.CPU: "torchnext.lowp.mm.backends.cpu",
    KernelBackend.INDUCTOR: "torchnext.lowp.mm.backends.inductor",
    KernelBackend.TRITON: "torchnext.lowp.mm.backends.triton",
    KernelBackend.CUTLASS: "torchnext.lowp.mm.backends.cutlass",
}
_loaded = False


def _load_builtins() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for kb, mod in _BUILTIN_MODULES.items():
        if kb.value not in BACKENDS:
            BACKENDS[kb.value] = importlib.import_module(mod).BACKEND


def register_backend(backend: Backend, *, overwrite: bool = False) -> None:
    """Add ``backend`` to the registry under ``backend.name``.

    Raises:
        FormatError: the object does not implement :class:`Backend`, or the name is taken and not ``overwrite``.
    """
    _load_builtins()
    if not isinstance(backend, Backend):
        raise FormatError(f"{backend!r} does not implement the Backend protocol (name, capability, available, supports, run)")
    if backend.name in BACKENDS and not overwrite:
        raise FormatError(f"backend {backend.name!r} is already registered (pass overwrite=True to replace it)")
    BACKENDS[backend.name] = backend


def get_backend(name: str | KernelBackend) -> Backend:
    """The backend registered under ``name``.

    Raises:
        FormatError: unknown name.
    """
    _load_builtins()
    key = name.value if isinstance(name, KernelBackend) else str(name)
    try:
        return BACKENDS[key]
    except KeyError:
        raise FormatError(f"unknown scaled_mm backend {key!r}; registered: {sorted(BACKENDS)}") from None


def available_backends() -> dict[str, tuple[bool, str]]:
    """name → (available, reason) for every registered backend (cheap: no kernels run)."""
    _load_builtins()
    return {name: b.available() for name, b in BACKENDS.items()}
