"""Quantizer kernels: the code that turns blocks of floats into element codes and block scales, and back.

Every kernel module offers the same two functions (see :mod:`torchnext.lowp.quantizers.reference` for their exact
semantics)::

    quantize_blocks(x2 (n, B) float, spec, opts, scale_inputs, noise) -> (codes (n, B / per_byte), scales (n,))
    dequantize_blocks(codes, scales (n,), spec, global_decode, dtype) -> (n, B) values

``noise`` is None (RNE), an ``(n, B)`` fp32 tensor of uniform draws, or a :class:`~torchnext.lowp.rng.CounterNoise`
``(seed, offset)``: the draw of ``x2[r, j]`` is ``rng.uniform(seed, offset + r * B + j)``, which a kernel may
compute in-kernel. A module may also offer ``quantize_pair_blocks`` (both training copies of a 2-D tensor from one
read); :func:`torchnext.lowp.quantize_pair` documents that contract and uses it when present. Further optional
entries: ``quantize_tensor(x, dim, spec, opts, scale_inputs, noise) -> (qdata, scales)`` (the final layout, read
from ``x`` in place: :func:`torchnext.lowp.quantize` then skips its transposed/padded copy) and
``unavailable_reason(device, spec) -> str | None`` (None: it can run there; ``"auto"`` skips a kernel that cannot,
and naming it explicitly raises with the reason), and ``auto_reason`` (the same question for ``"auto"`` alone: a
kernel that runs but should not be the default there, e.g. the compiled one without a SIMD variant).

Built in: ``reference`` (the definitions written plainly: the oracle), ``cpu`` (one compiled C++ pass, built on first
use: what ``"auto"`` picks for CPU tensors when a compiler and AVX2/AVX-512 are present), ``eager`` (vectorized torch ops on
cache-sized chunks; ``"auto"`` elsewhere) and ``triton`` (one fused GPU kernel; imported only when asked for). The
public entry points that choose a kernel are :func:`torchnext.lowp.quantize` / :func:`torchnext.lowp.dequantize`
(``backend=...``). These are not the matmul backends of :mod:`torchnext.lowp.mm.backends`.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from torchnext.lowp.errors import FormatError

if TYPE_CHECKING:
    from torchnext.lowp.formats import FormatSpec

__all__ = ["AUTO_ORDER", "QUANTIZERS", "get_quantizer", "register_quantizer"]

QUANTIZERS: dict[str, str] = {
    "reference": "torchnext.lowp.quantizers.reference",
    "eager": "torchnext.lowp.quantizers.eager",
    "cpu": "torchnext.lowp.quantizers.cpu",
    "triton": "torchnext.lowp.quantizers.triton",
}
"""Kernel name -> module path (imported on first use)."""

AUTO_ORDER: tuple[str, ...] = ("cpu", "eager")
"""What ``"auto"`` means: the first of these that can run the request (``auto_reason``, else ``unavailable_reason``,
is None)."""

_ALIASES = {"auto": "eager"}


def register_quantizer(name: str, module: str, *, replace: bool = False) -> None:
    """Make ``quantize(..., backend=name)`` use the kernel module ``module`` (a dotted path)."""
    if not isinstance(name, str) or not name or name in _ALIASES:
        raise ValueError(f"quantizer name must be a non-empty string other than 'auto', got {name!r}")
    if name in QUANTIZERS and not replace:
        raise ValueError(f"quantizer {name!r} is already registered (pass replace=True to override)")
    QUANTIZERS[name] = module
    _LOADED.pop(module, None)


_LOADED: dict[str, ModuleType | str] = {}
"""Module path -> the imported module, or why it cannot be imported: a registry lookup is a dict lookup (what
``torch.compile`` traces through; it cannot trace ``import_module``)."""


def _load(path: str) -> ModuleType | str:
    """Import ``path`` once."""
    got = _LOADED.get(path)
    if got is None:
        try:
            got = importlib.import_module(path)
        except ImportError as exc:
            got = str(exc)
        _LOADED[path] = got
    return got


def preload_auto() -> None:
    """Import what ``"auto"`` may pick (:data:`AUTO_ORDER`) now, so that a ``torch.compile`` tracing the first
    ``quantize`` finds them in the registry (it cannot trace an import). Cheap: no kernel is built."""
    for name in AUTO_ORDER:
        path = QUANTIZERS.get(name)
        if path is not None:
            _load(path)


def _module(name: str) -> ModuleType:
    path = QUANTIZERS.get(name) if isinstance(name, str) else None
    if path is None:
        raise FormatError(f"unknown backend {name!r}; quantizers: {['auto', *sorted(QUANTIZERS)]}")
    got = _load(path)
    if isinstance(got, str):
        raise FormatError(f"backend={name!r} needs a package that is missing here: {got}")
    return got


def _reason(mod: ModuleType, device: torch.device | None, spec: FormatSpec | None, *, auto: bool = False) -> str | None:
    check = getattr(mod, "auto_reason", None) if auto else None
    check = check or getattr(mod, "unavailable_reason", None)
    return None if check is None else check(device, spec)


def get_quantizer(name: str, device: torch.device | None = None, spec: FormatSpec | None = None) -> ModuleType:
    """The kernel module registered as ``name``; ``"auto"``: the first of :data:`AUTO_ORDER` that can quantize a
    ``device`` tensor to ``spec`` (``"eager"`` runs everywhere).

    Raises:
        FormatError: unknown name, the kernel's dependencies (e.g. the triton package) are missing, or the named
            kernel cannot run here (its reason, e.g. no C++ compiler).
    """
    if name == "auto":
        for cand in AUTO_ORDER:
            try:
                mod = _module(cand)
            except FormatError:
                continue
            if _reason(mod, device, spec, auto=True) is None:
                return mod
        return _module(_ALIASES["auto"])
    mod = _module(name)
    why = _reason(mod, device, spec)
    if why is not None:
        raise FormatError(f"backend={name!r} cannot run here: {why}")
    return mod
