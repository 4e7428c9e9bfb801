"""torchnext.control: compiler control flow that works eagerly, under torch.compile, torch.export and make_fx.

* :func:`switch` -- multi-way branching on a data-dependent index (mixture-of-experts routing).
* :func:`while_loop`, :func:`fori_loop` -- loops with data-dependent trip counts.
* :func:`dynamic_spec` -- one shape declaration for compile, export and make_fx, checked at every call; the spec
  vocabulary (``ShapeVar``, ``IntVar``, ``TensorSpec``, ``STATIC``, ``ParamsSpec``, ``ShapesSpec``, ...) is torch's.
* :func:`compile` / :func:`export` / :func:`make_fx` -- the entry points that honour a spec; ``compile`` can also
  decompose complex programs into real ones (``decompose_complex=True``, or :func:`complex_backend`).

Importing this package is lean: nothing is compiled, Inductor is not imported, and torch's spec vocabulary
(sympy) is loaded on first use.
"""

from __future__ import annotations

from typing import Any

from torchnext.control._tracing import CompileUnsupportedError
from torchnext.control.dynamic_spec import VOCABULARY, ShapeSpecError, SpecConflictError, dynamic_spec
from torchnext.control.entry_points import compile, export, make_fx
from torchnext.control.switch import BranchMismatchError, SwitchError, SwitchIndexError, switch
from torchnext.control.while_loop import LoopError, fori_loop, while_loop

__all__ = [
    "switch",
    "SwitchError",
    "SwitchIndexError",
    "BranchMismatchError",
    "while_loop",
    "fori_loop",
    "LoopError",
    "dynamic_spec",
    "ShapeSpecError",
    "SpecConflictError",
    "compile",
    "export",
    "make_fx",
    "complex_backend",
    "ComplexDecompositionError",
    "CompileUnsupportedError",
    *VOCABULARY,
]


def __getattr__(name: str) -> Any:
    if name in VOCABULARY:
        from torch.fx.experimental import dynamic_spec as tds

        return getattr(tds, name)
    if name in ("complex_backend", "ComplexDecompositionError"):
        from torchnext.control import complex as _complex

        return getattr(_complex, name)
    raise AttributeError(f"module 'torchnext.control' has no attribute {name!r}")
