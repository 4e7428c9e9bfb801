"""Quantizer kernels: the code that turns blocks of floats into element codes and block scales, and back.

Every kernel module offers the same two functions (see :mod:`torchnext.lowp.quantizers.reference` for their exact
semantics)::

    quantize_blocks(x2 (n, B) float, spec, opts, scale_inputs, noise) -> (codes (n, B / per_byte), scales (n,))
    dequantize_blocks(codes, scales (n,), spec, global_decode, dtype) -> (n, B) values

``noise`` is None (RNE), an ``(n, B)`` fp32 tensor of uniform draws, or a :class:`~torchnext.lowp.rng.CounterNoise`
``(seed, offset)``: the draw of ``x2[r, j]`` is ``rng.uniform(seed, offset + r * B + j)``, which a kernel may
compute in-kernel. A module may also offer ``quantize_pair_blocks`` (both training copies of a 2-D tensor from one
read); :func:`torchnext.lowp.quantize_pair` documents that contract and uses it when present.

Built in: ``reference`` (the definitions written plainly: the oracle), ``eager`` (vectorized torch ops on cache-sized
chunks; what ``"auto"`` picks) and ``triton`` (one fused GPU kernel; imported only when asked for). The public
entry points that choose a kernel are :func:`torchnext.lowp.quantize` / :func:`torchnext.lowp.dequantize`
(``backend=...``). These are not the matmul backends of :mod:`torchnext.lowp.mm.backends`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from torchnext.lowp.errors import FormatError

__all__ = ["QUANTIZERS", "get_quantizer", "register_quantizer"]

QUANTIZERS: dict[str, str] = {
    "reference": "torchnext.lowp.quantizers.reference",
    "eager": "torchnext.lowp.quantizers.eager",
    "triton": "torchnext.lowp.quantizers.triton",
}
"""Kernel name -> module path (imported on first use). ``"auto"`` means ``"eager"``."""

_ALIASES = {"auto": "eager"}


def register_quantizer(name: str, module: str, *, replace: bool = False) -> None:
    """Make ``quantize(..., backend=name)`` use the kernel module ``module`` (a dotted path)."""
    if not isinstance(name, str) or not name or name in _ALIASES:
        raise ValueError(f"quantizer name must be a non-empty string other than 'auto', got {name!r}")
    if name in QUANTIZERS and not replace:
        raise ValueError(f"quantizer {name!r} is already registered (pass replace=True to override)")
    QUANTIZERS[name] = module


def get_quantizer(name: str) -> ModuleType:
    """The kernel module registered as ``name`` (``"auto"``: ``"eager"``).

    Raises:
        FormatError: unknown name, or the kernel's dependencies (e.g. the triton package) are missing.
    """
    key = _ALIASES.get(name, name)
    path = QUANTIZERS.get(key) if isinstance(key, str) else None
    if path is None:
        raise FormatError(f"unknown backend {name!r}; quantizers: {['auto', *sorted(QUANTIZERS)]}")
    try:
        return importlib.import_module(path)
    except ImportError as exc:
        raise FormatError(f"backend={name!r} needs a package that is missing here: {exc}") from None
