"""One-sided RMA windows: put / get / get_rows / accumulate / signal on memory every rank of a communicator registered.

``win = comm.new_window(tensor)`` (collective) is served by :func:`new_window`; :mod:`~torchnext.comms.window.window`
states the memory model, :mod:`~torchnext.comms.window._connect` the registration handshake, and the transports
live beside them (:mod:`~torchnext.comms.window.segment` the shared segment every rank owns,
:mod:`~torchnext.comms.window.shm` same-host channels, :mod:`~torchnext.comms.window.tcp` the TCP service and
channel). See docs/comms_windows.md.

Importing this package registers ``Communicator.new_window``; windows follow their communicator through its abort
hook (an abort invalidates them).
"""

from torchnext.comms.extension import register_factory
from torchnext.comms.window.channel import WindowTransport as WindowTransport
from torchnext.comms.window.errors import WindowBoundsError as WindowBoundsError
from torchnext.comms.window.errors import WindowClosed as WindowClosed
from torchnext.comms.window.errors import WindowDtypeError as WindowDtypeError
from torchnext.comms.window.errors import WindowInvalidated as WindowInvalidated
from torchnext.comms.window.window import Window as Window
from torchnext.comms.window.window import new_window as new_window
from torchnext.comms.window.work import WindowWork as WindowWork

__all__ = [
    "Window",
    "WindowBoundsError",
    "WindowClosed",
    "WindowDtypeError",
    "WindowInvalidated",
    "WindowTransport",
    "WindowWork",
    "new_window",
]

register_factory("new_window", new_window)
