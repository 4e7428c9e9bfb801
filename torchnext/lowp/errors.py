"""Exceptions raised by :mod:`torchnext.lowp`.

Callers that must tell a bad request apart from other failures catch :class:`FormatError` (a ``ValueError``);
:class:`FormatDTypeError` is also a ``TypeError`` (wrong input dtype), :class:`DeterminismError` is raised when a
request cannot be honoured deterministically.
"""

from __future__ import annotations

__all__ = ["DeterminismError", "FormatDTypeError", "FormatError"]


class FormatError(ValueError):
    """An invalid quantization request: unknown format, option that does not apply, bad shape or layout."""


class FormatDTypeError(FormatError, TypeError):
    """The input tensor's dtype cannot be quantized (integer, bool, complex, float8, ...)."""


class DeterminismError(FormatError):
    """``rounding="stochastic"`` without a ``seed`` while determinism is requested."""
