"""torchnext's compiled CPU kernels: C++ (AVX-512 / AVX2 / portable) built on first use, cached, optional.

What they are: the weight-only block-scaled GEMV of the ``cpu`` scaled_mm backend
(:mod:`torchnext.lowp.mm.backends.cpu`) and the quantize casts of the ``cpu`` quantizer
(:mod:`torchnext.lowp.quantizers.cpu`), registered as ``torch.ops.torchnext_cpu.*``.

Meaning of :func:`status` (memoized per process; the first call on a machine compiles for about a minute on 2
cores, saying so on stderr)::

    if TORCHNEXT_CPU_KERNELS == 0:            unavailable "disabled by TORCHNEXT_CPU_KERNELS=0"
    elif no C++ compiler:                     unavailable "no C++ compiler ..."
    elif the cached library exists:           load it
    else:                                     compile csrc/*.cpp (see _build.py), cache it, load it
    a failing build or load is reported as   unavailable "<why>"  — never raised
    a build past TORCHNEXT_BUILD_TIMEOUT      unavailable "build failed: ... TORCHNEXT_BUILD_TIMEOUT ..." (warned)

Everything that uses the kernels asks :func:`status` first and falls back to the pure-torch paths (the ``eager`` /
``inductor`` backends, the ``eager`` quantizer) when they are unavailable; ``torchnext doctor`` shows the answer
(``lowp/cpu-kernels``).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchnext._config import env_config
from torchnext.lowp.tracing import trace_time_constant

__all__ = ["ISAS", "KernelStatus", "KernelsUnavailable", "describe", "isa_index", "ops", "simd", "status",
           "unavailable"]

log = logging.getLogger("torchnext.lowp.cpu")

ABI_VERSION = 3
"""Must equal ``kAbiVersion`` in csrc/register.cpp (the loader refuses another library)."""

ISAS = ("avx512", "avx2", "portable")
"""Instruction-set variants a build may hold, in the kernels' index order (``isa=`` argument of the ops)."""


class KernelsUnavailable(RuntimeError):
    """The compiled CPU kernels cannot be used here (the message says why)."""


@dataclass(frozen=True, kw_only=True)
class KernelStatus:
    """Whether the compiled CPU kernels run in this process, and why (not)."""

    available: bool
    reason: str
    compiler: str | None = None
    """The compiler's version line."""
    library: str | None = None
    """Path of the loaded shared library."""
    isas: tuple[str, ...] = field(default_factory=tuple)
    """Instruction-set variants compiled in, best first (e.g. ``("avx512", "avx2", "portable")``)."""
    build_seconds: float | None = None
    """Compile time if this process built the library, None if it was loaded from the cache."""


_STATUS: KernelStatus | None = None
_LOCK = threading.Lock()


def _load() -> KernelStatus:
    cfg = env_config()
    if not cfg.cpu_kernels:
        return KernelStatus(available=False, reason="disabled by TORCHNEXT_CPU_KERNELS=0")
    from torchnext.lowp.cpu import _build

    cxx = _build.compiler_command(cfg.cxx)
    if cxx is None:
        wanted = cfg.cxx or "$CXX or c++"
        return KernelStatus(available=False, reason=f"no C++ compiler ({wanted} not found on PATH)")
    try:
        res = _build.build(Path(cfg.kernel_cache), cxx, timeout_s=float(cfg.build_timeout),
                           keep_days=cfg.kernel_cache_keep_days)
    except Exception as exc:  # any build problem means "use the fallback", with the reason kept
        log.warning("torchnext CPU kernels: build failed, using the pure-torch paths: %s", exc)
        return KernelStatus(available=False, reason=f"build failed: {exc}")
    try:
        torch.ops.load_library(str(res.library))
        version = int(torch.ops.torchnext_cpu.abi_version())
        if version != ABI_VERSION:
            raise RuntimeError(f"library ABI {version} != expected {ABI_VERSION}")
        isas = tuple(str(torch.ops.torchnext_cpu.isas()).split(","))
        from torchnext.lowp.cpu import _fakes

        _fakes.register()  # torch.compile / torch.export trace the ops through these
    except Exception as exc:
        log.warning("torchnext CPU kernels: cannot load %s: %s", res.library, exc)
        return KernelStatus(available=False, reason=f"load failed ({res.library}): {exc}", compiler=res.compiler)
    how = f"built in {res.seconds:.1f} s" if res.built else "from the cache"
    if res.built:
        log.info("torchnext CPU kernels built in %.1f s with %s: %s", res.seconds, res.compiler, res.library)
    return KernelStatus(
        available=True,
        reason=f"built with {res.compiler} ({'/'.join(isas)}; {how}), cached at {res.library.parent}",
        compiler=res.compiler,
        library=str(res.library),
        isas=isas,
        build_seconds=res.seconds if res.built else None,
    )


def status() -> KernelStatus:
    """The kernels' state in this process (builds or loads them on the first call; see the module docstring)."""
    global _STATUS
    st = _STATUS
    if st is not None:
        return st
    with _LOCK:
        if _STATUS is None:
            _STATUS = _load()
        return _STATUS


@trace_time_constant
def unavailable() -> str:
    """Why the kernels cannot be used here (``""``: they can). What code that ``torch.compile`` may trace asks
    instead of :func:`status`: it runs at trace time, not traced (the first call builds or loads the library --
    a lock, a compiler and a library load are not graph material), and its answer is a constant of the graph."""
    st = status()
    return "" if st.available else st.reason


@trace_time_constant
def describe() -> str:
    """:attr:`KernelStatus.reason` (available or not), as :func:`unavailable` asks it: a constant under compile."""
    return status().reason


@trace_time_constant
def simd() -> bool:
    """Whether a SIMD variant (AVX-512 or AVX2) is compiled in: only then do the ``auto`` choices assume the
    compiled kernels beat the pure-torch paths (the portable variant is correct everywhere, but its speed depends on
    what the compiler makes of plain loops)."""
    st = status()
    return st.available and st.isas[:1] != ("portable",)


def ops() -> Any:
    """``torch.ops.torchnext_cpu`` (building or loading the library first).

    Raises:
        KernelsUnavailable: the kernels cannot be used here (reason in the message).
    """
    st = status()
    if not st.available:
        raise KernelsUnavailable(f"torchnext CPU kernels unavailable: {st.reason}")
    return torch.ops.torchnext_cpu


def isa_index(name: str | None) -> int:
    """The ``isa=`` argument of the ops for a variant name (``None``: -1, the best compiled one).

    Raises:
        KernelsUnavailable: ``name`` is not compiled into this build.
    """
    if name is None:
        return -1
    st = status()
    if name not in st.isas:
        raise KernelsUnavailable(f"instruction set {name!r} is not in this build (has {list(st.isas)})")
    return ISAS.index(name)
