"""torchnext: fault tolerance and low precision as default infrastructure for PyTorch.

Subpackages:

* :mod:`torchnext.comms`   -- a Communicator over any torch.distributed backend (Gloo, NCCL, custom), its Flight
  Recorder and RMA windows.
* :mod:`torchnext.ft`      -- fault tolerance: coordinator, membership, reconfiguration, healing.
* :mod:`torchnext.lowp`    -- block-scaled formats (NVFP4, MXFP8, MXFP4) and scaled matmuls.
* :mod:`torchnext.control` -- compiler control flow (switch, while_loop, dynamic_spec, complex -> real).

``import torchnext`` is lean: it imports torch, but it does not initialise CUDA, compile anything or open sockets.
Subpackages are imported on first attribute access. It registers the ``"torchnext"`` backend with torch.distributed
(the name only: ``dist.init_process_group(backend="torchnext")`` then imports :mod:`torchnext.comms`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from torchnext._version import __version__

_SUBMODULES = ("comms", "ft", "lowp", "control", "testing")

# Curated top-level re-exports: public name -> (module, attribute). Filled in as the areas land.
_REEXPORTS: dict[str, tuple[str, str]] = {
    # torchnext.control
    **{
        name: ("torchnext.control", name)
        for name in (
            "switch",
            "while_loop",
            "fori_loop",
            "dynamic_spec",
            "compile",
            "export",
            "make_fx",
            "ShapeSpecError",
            "ShapeVar",
            "IntVar",
            "TensorSpec",
            "STATIC",
            "ParamsSpec",
            "ShapesSpec",
        )
    },
}

__all__ = ["__version__", *_SUBMODULES]

if TYPE_CHECKING:  # pragma: no cover
    from torchnext import comms as comms
    from torchnext import control as control
    from torchnext import ft as ft
    from torchnext import lowp as lowp
    from torchnext import testing as testing


def _create_process_group(common: Any, backend_options: Any = None) -> Any:
    """torch's creator for ``backend="torchnext"`` (imports the process-group package on first use)."""
    from torchnext.comms.process_group import create

    return create(common, backend_options)


def _register_backend() -> None:
    import torch.distributed as dist

    if not dist.is_available() or "torchnext" in dist.Backend.backend_list:
        return
    dist.Backend.register_backend("torchnext", _create_process_group, extended_api=True, devices=["cpu", "cuda"])


_register_backend()


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"torchnext.{name}")
    if name in _REEXPORTS:
        module, attr = _REEXPORTS[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'torchnext' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_REEXPORTS))
