"""Scratch memory reused across calls, for the decoded operands of the eager CPU paths.

Why: on CPU, torch allocates every tensor from the C allocator, and a buffer of tens of MiB is a fresh ``mmap`` each
time: the first write to each 4 KiB page faults. Measured on the 2-core CI machine (docs/benchmarks.md), decoding an
(8, 2048, 1024) NVFP4 stack to fp32 took 43 ms into fresh memory and 6 ms into reused memory; the table lookup
alone 28.6 ms vs 3.0 ms. The decoded operand of a matmul is consumed inside the call, so its memory can be reused.

Meaning::

    buf = scratch("w", numel, dtype, device)   # 1-D, contents undefined, numel elements
    # valid until the next scratch("w", ...) with the same dtype and device on this thread

Fresh outputs (:func:`fresh`): an output must be new memory, so its page faults cannot be avoided by reuse, but
they can be made 512 times fewer: on Linux, :func:`fresh` asks for transparent huge pages
(``madvise(MADV_HUGEPAGE)`` on the 2 MiB-aligned interior of a new tensor of at least :data:`HUGE_MIN_BYTES`, before
its first write) — what PyTorch itself does for every allocation when started with ``THP_MEM_ALLOC_ENABLE=1``.
Measured here: widening a (4096, 2048) bf16 tensor into a fresh fp32 one 10.2 ms → 2.3 ms. ``TORCHNEXT_HUGE_PAGES=0``
turns it off; where the kernel refuses (THP ``never``) or on other systems it is plain ``torch.empty``.

Rules that keep scratch safe:

* Only internal callers take scratch, only for tensors that do not escape the call (never an output, never a tensor
  autograd would save: see :func:`reusable`).
* Per thread (``threading.local``): two threads never share a buffer.
* CPU only, and not while ``torch.compile`` traces (fake tensors): elsewhere :func:`scratch` is ``torch.empty``.
* Requests under :data:`MIN_BYTES` use plain allocation (the C allocator reuses small blocks already); a pool slot
  grows to the largest request seen and :func:`release_workspace` frees this thread's slots.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any

import torch

from torchnext._config import env_config
from torchnext.lowp.tracing import compiling

__all__ = ["HUGE_MIN_BYTES", "MIN_BYTES", "advise_huge_pages", "cast", "fresh", "release_workspace", "reusable", "scratch", "workspace_bytes"]

MIN_BYTES = 1 << 20
"""Requests smaller than this (1 MiB) are plain ``torch.empty``."""

HUGE_MIN_BYTES = 4 << 20
""":func:`fresh` advises huge pages from this size (4 MiB: at least one whole aligned 2 MiB page inside)."""

_HUGE = 1 << 21
_MADV_HUGEPAGE = 14  # linux/mman.h

_TLS = threading.local()
_madvise: Any = None  # libc.madvise once resolved; False where unavailable


def _pool() -> dict[tuple[str, torch.dtype, torch.device], torch.Tensor]:
    pool = getattr(_TLS, "pool", None)
    if pool is None:
        pool = {}
        _TLS.pool = pool
    return pool


def scratch(tag: str, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A 1-D ``dtype`` tensor of ``numel`` elements whose memory is reused by the next request with the same
    ``tag``/dtype/device on this thread (see the module docstring). Contents are undefined."""
    device = torch.device(device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or numel * itemsize < MIN_BYTES or compiling():
        return torch.empty(numel, dtype=dtype, device=device)
    pool = _pool()
    key = (tag, dtype, device)
    buf = pool.get(key)
    if buf is None or buf.numel() < numel:
        pool.pop(key, None)  # free the old slot before allocating the larger one
        buf = torch.empty(numel, dtype=dtype, device=device)
        pool[key] = buf
    return buf[:numel]


def cast(x: torch.Tensor, dtype: torch.dtype, tag: str | None = None) -> torch.Tensor:
    """``x.to(dtype)``; with ``tag``, into :func:`scratch` memory under that tag (valid until its next use)."""
    if x.dtype == dtype:
        return x
    if tag is None:
        return x.to(dtype)
    return scratch(tag, x.numel(), dtype, x.device).view(x.shape).copy_(x)


def reusable(*inputs: object) -> bool:
    """Whether an operand decoded from ``inputs`` may live in scratch memory: not while autograd could save it
    (grad mode on and some input tensor requires grad) and not while ``torch.compile`` traces."""
    if compiling():
        return False
    if not torch.is_grad_enabled():
        return True
    return not any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs)


def workspace_bytes() -> int:
    """Bytes held by this thread's scratch slots."""
    return sum(b.numel() * b.element_size() for b in _pool().values())


def release_workspace() -> None:
    """Free this thread's scratch slots (the next large request allocates again)."""
    _pool().clear()


def _libc_madvise() -> Any:
    global _madvise
    if _madvise is None:
        _madvise = False
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None, use_errno=True).madvise
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                fn.restype = ctypes.c_int
                _madvise = fn
            except (OSError, AttributeError):
                pass
    return _madvise


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask the kernel to back the whole 2 MiB pages inside ``t``'s (not yet written) memory with huge pages.
    Returns whether the advice was given and accepted. Never changes ``t``'s values or layout."""
    fn = _libc_madvise()
    if not fn or t.device.type != "cpu":
        return False
    start = t.data_ptr()
    end = start + t.untyped_storage().nbytes()
    lo = (start + _HUGE - 1) & ~(_HUGE - 1)
    hi = end & ~(_HUGE - 1)
    if hi <= lo:
        return False
    return int(fn(lo, hi - lo, _MADV_HUGEPAGE)) == 0


def fresh(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)`` — new memory, safe to return — with huge pages advised on
    Linux CPU for tensors of at least :data:`HUGE_MIN_BYTES` (module docstring) unless ``TORCHNEXT_HUGE_PAGES=0``."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.device.type == "cpu" and t.numel() * t.element_size() >= HUGE_MIN_BYTES and not compiling():
        if env_config().huge_pages:
            advise_huge_pages(t)
    return t
