"""What low-precision code asks when ``torch.compile`` or ``torch.export`` may be tracing it.

Two helpers, both free of a ``torch._dynamo`` import (2 s that every ``import torchnext.lowp`` would pay)::

    compiling()                 # torch.compiler.is_compiling(): True inside a dynamo trace or an export
    @trace_time_constant        # torch.compiler.assume_constant_result(fn): under dynamo the call runs at trace
    def f(*constants): ...      # time in plain Python (a lock, a file, a compiler are fine) and its result is a
                                # constant of the graph; its arguments must be Python constants

Eager calls of a ``trace_time_constant`` function are ordinary calls. ``tests/lowp/test_compile_export.py`` checks
that the marker set here is still the one torch reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["compiling", "trace_time_constant"]

F = TypeVar("F", bound=Callable[..., Any])


def compiling() -> bool:
    """Whether dynamo (``torch.compile``, strict export) or a non-strict export is tracing the caller."""
    is_compiling = getattr(torch.compiler, "is_compiling", None)
    return bool(is_compiling and is_compiling())


def trace_time_constant(fn: F) -> F:
    """Mark ``fn`` as ``torch.compiler.assume_constant_result`` does, by the attribute dynamo reads."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn
