"""Exceptions of the RMA windows (besides the communicator's ``PeerFailure`` / ``CommTimeout``)."""

from __future__ import annotations

from torchnext.comms.errors import CommError

__all__ = ["WindowBoundsError", "WindowClosed", "WindowDtypeError", "WindowInvalidated"]


class WindowBoundsError(IndexError):
    """An access outside the target's registered tensor (or a row index outside its rows). Nothing was moved."""


class WindowDtypeError(TypeError):
    """A tensor's dtype differs from the target's registered dtype (no implicit casts). Nothing was moved."""


class WindowClosed(CommError):
    """The window was closed (by ``close()`` on this rank, or the target's service is gone after its close)."""


class WindowInvalidated(CommError):
    """The window was invalidated (``Window.invalidate``, e.g. by a reconfiguration of the communicator)."""
