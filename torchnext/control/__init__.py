"""torchnext.control: compiler control flow that works eagerly, under torch.compile, torch.export and make_fx.

* :func:`switch` -- multi-way branching on a data-dependent index (mixture-of-experts routing).
* :func:`while_loop`, :func:`fori_loop` -- loops with data-dependent trip counts.
* :func:`dynamic_spec` -- one shape declaration for compile, export and make_fx, checked at every call.
* :func:`compile` / :func:`export` / :func:`make_fx` -- the entry points that honour a spec; ``compile`` can also
  decompose complex programs into real ones (``decompose_complex=True``).

Importing this package is lean: nothing is compiled and Inductor is not imported until an API needs it.
"""

from __future__ import annotations

from torchnext.control._tracing import CompileUnsupportedError
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
    "CompileUnsupportedError",
]
