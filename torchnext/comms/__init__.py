"""torchnext.comms: a Communicator with torch.distributed's full collective contract on every backend.

Public names::

    from torchnext.comms import Communicator, Work, WorkStatus, ReduceOp, CommError, CommTimeout, CommAborted, PeerFailure
    from torchnext.comms import CollectiveMismatch      # consistency mode: Communicator(..., check_collectives=True)
    from torchnext.comms import FlightRecorder          # collective trace + hang analysis (docs/flight_recorder.md)
    from torchnext.comms import Window                  # one-sided RMA windows (docs/comms_windows.md)
    from torchnext.comms import TorchnextProcessGroup   # torch.distributed on Communicators (docs/process_group.md)

Layout: the core (``communicator``, ``_ops``, ``work``, ``hooks``, ``errors``, ``reduce_op``, ``backends/``,
``extension``) knows none of its extensions; :mod:`torchnext.comms.flight_recorder`,
:mod:`torchnext.comms.window` and :mod:`torchnext.comms.consistency` build on it, :mod:`torchnext.comms.process_group` on them, and they register themselves with :mod:`torchnext.comms.extension` when they are
imported. Importing this package (or :mod:`torchnext.comms.communicator`) loads the core only: the extension names
above (``FlightRecorder``, ``Window*``, ``TorchnextProcessGroup``, ``Checker``) are imported on first access, and a
Communicator that asks for an extension (``flight_recorder=``, ``check_collectives=``, ``new_window``,
``as_process_group``) imports it then. Fault tolerance is a layer above: :mod:`torchnext.ft`.

See ``docs/comms.md`` for the contract (ops, Work, hooks, abort, split, errors, thread-safety).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from torchnext.comms._ops import P2POp as P2POp
from torchnext.comms.backends import BackendConfig as BackendConfig
from torchnext.comms.backends import BackendHandle as BackendHandle
from torchnext.comms.backends import get_backend as get_backend
from torchnext.comms.backends import register_backend as register_backend
from torchnext.comms.communicator import Communicator as Communicator
from torchnext.comms.errors import CollectiveMismatch as CollectiveMismatch
from torchnext.comms.errors import CommAborted as CommAborted
from torchnext.comms.errors import CommError as CommError
from torchnext.comms.errors import CommTimeout as CommTimeout
from torchnext.comms.errors import HookError as HookError
from torchnext.comms.errors import PeerFailure as PeerFailure
from torchnext.comms.hooks import AbortHookArgs as AbortHookArgs
from torchnext.comms.hooks import OpInfo as OpInfo
from torchnext.comms.hooks import PostHookArgs as PostHookArgs
from torchnext.comms.hooks import RemovableHandle as RemovableHandle
from torchnext.comms.reduce_op import ReduceOp as ReduceOp
from torchnext.comms.work import Work as Work
from torchnext.comms.work import WorkStatus as WorkStatus

if TYPE_CHECKING:  # pragma: no cover -- imported on first access at run time (see _LAZY)
    from torchnext.comms.consistency import Checker as Checker
    from torchnext.comms.flight_recorder import FlightRecorder as FlightRecorder
    from torchnext.comms.process_group import TorchnextProcessGroup as TorchnextProcessGroup
    from torchnext.comms.window import Window as Window
    from torchnext.comms.window import WindowBoundsError as WindowBoundsError
    from torchnext.comms.window import WindowClosed as WindowClosed
    from torchnext.comms.window import WindowDtypeError as WindowDtypeError
    from torchnext.comms.window import WindowInvalidated as WindowInvalidated
    from torchnext.comms.window import WindowTransport as WindowTransport

_LAZY: dict[str, str] = {
    "Checker": "torchnext.comms.consistency",
    "FlightRecorder": "torchnext.comms.flight_recorder",
    "TorchnextProcessGroup": "torchnext.comms.process_group",
    **{name: "torchnext.comms.window" for name in (
        "Window", "WindowBoundsError", "WindowClosed", "WindowDtypeError", "WindowInvalidated", "WindowTransport")},
}
"""Public names of the extensions: name -> the package that defines it, imported on first access."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})

__all__ = [
    "AbortHookArgs",
    "BackendConfig",
    "BackendHandle",
    "Checker",
    "CollectiveMismatch",
    "CommAborted",
    "CommError",
    "CommTimeout",
    "Communicator",
    "FlightRecorder",
    "HookError",
    "OpInfo",
    "P2POp",
    "PeerFailure",
    "PostHookArgs",
    "ReduceOp",
    "RemovableHandle",
    "TorchnextProcessGroup",
    "Window",
    "WindowBoundsError",
    "WindowClosed",
    "WindowDtypeError",
    "WindowInvalidated",
    "WindowTransport",
    "Work",
    "WorkStatus",
    "get_backend",
    "register_backend",
]
