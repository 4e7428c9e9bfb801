"""torchnext's native process-group data path: a C++ ``c10d::Backend`` built on first use, cached per torch version.

What it is (``csrc/native.cpp``): a backend that wraps the group's inner c10d backend (Gloo today) through the
virtual ``c10d::Backend`` interface only, and per op forwards the op, returns a Work whose status is one atomic
state machine (``IN_PROGRESS -> COMPLETED | FAILED | ABORTED``, exactly one) with a condition variable and the op's
deadline, and records a Flight Recorder entry in a C++ ring. :mod:`torchnext.comms.process_group` decides when a
group runs on it (``TORCHNEXT_NATIVE_PG=1``, the default, and nothing asks for Python per op).

Meaning of :func:`status` (memoized per process; the first call in a fresh cache compiles for about a minute)::

    if the cached extension exists:       import it straight from its folder (milliseconds: no ninja, no lock)
    elif no C++ compiler (or no ninja):   unavailable "no C++ compiler ..." (one warning; the Python path runs)
    else:                                 build it under a file lock (one rank builds, the others wait), load it
    a failing build or load is reported as  unavailable "<why>" -- never raised

Cache: ``<TORCHNEXT_KERNEL_CACHE>/torchnext_native-<key>/`` where ``key`` hashes the sources and torch's version.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from torchnext.comms.native import _build

__all__ = ["ABI_VERSION", "NativeStatus", "NativeUnavailable", "module", "status"]

log = logging.getLogger("torchnext.comms.native")

ABI_VERSION = 4
"""Must equal ``kAbiVersion`` in csrc/native.cpp (the loader refuses another extension)."""


class NativeUnavailable(RuntimeError):
    """The native data path cannot be used in this process (the message says why)."""


@dataclass(frozen=True, kw_only=True)
class NativeStatus:
    """Whether the native extension loads in this process, and why (not)."""

    available: bool
    reason: str
    path: str | None = None
    """Folder of the built extension."""
    build_seconds: float | None = None
    """Compile time if this process built it, None if it came from the cache (or is unavailable)."""


_STATUS: list[NativeStatus] = []
_MODULE: list[Any] = []
_LOCK = threading.Lock()


def _load() -> NativeStatus:
    try:
        cached = _build.load_cached()  # the common case: built before, imported in milliseconds
    except Exception as exc:  # a damaged cache entry: build it again below
        log.warning("torchnext native process-group path: cached build unusable (%s); rebuilding", exc)
        cached = None
    if cached is not None:
        return _accept(cached)
    missing = _build.missing_tools()
    if missing is not None:
        log.warning("torchnext native process-group path unavailable (%s); process groups use the Python path",
                    missing)
        return NativeStatus(available=False, reason=missing)
    try:
        res = _build.build()
    except Exception as exc:  # any build problem means "use the Python path", with the reason kept
        log.warning("torchnext native process-group path: build failed, using the Python path: %s", exc)
        return NativeStatus(available=False, reason=f"build failed: {exc}")
    return _accept(res)


def _accept(res: _build.BuildResult) -> NativeStatus:
    version = int(res.module.abi_version())
    if version != ABI_VERSION:
        return NativeStatus(available=False, reason=f"extension ABI {version} != expected {ABI_VERSION}")
    _MODULE.append(res.module)
    how = f"built in {res.seconds:.1f} s" if res.built else "from the cache"
    return NativeStatus(available=True, reason=f"{how} at {res.folder}", path=str(res.folder),
                        build_seconds=res.seconds if res.built else None)


def status() -> NativeStatus:
    """The extension's state in this process (builds or loads it on the first call; see the module docstring)."""
    if _STATUS:
        return _STATUS[0]
    with _LOCK:
        if not _STATUS:
            _STATUS.append(_load())
        return _STATUS[0]


def module() -> Any:
    """The loaded extension module (building or loading it first).

    Raises:
        NativeUnavailable: the extension cannot be used here (reason in the message).
    """
    st = status()
    if not st.available:
        raise NativeUnavailable(f"torchnext native process-group path unavailable: {st.reason}")
    return _MODULE[0]
