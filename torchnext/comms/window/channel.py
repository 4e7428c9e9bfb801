"""Transports behind :class:`torchnext.comms.window.Window`: one file per transport.

* :mod:`.segment` -- a rank's registered memory: a file in ``/dev/shm`` mapped ``MAP_SHARED``, laid out as
  ``[signal counters | data]``, with the per-target accumulate lock (a thread lock + an ``fcntl`` byte-range lock,
  so it excludes threads of this process and other processes alike). Every window owns one per rank, whatever the
  transport, so a TCP service and same-host peers update the same memory under the same lock.
* :mod:`.shm` -- same-host channel: maps the peer's segment read/write; put/get are one ``copy_`` each.
* :mod:`.tcp` -- cross-host channel: a small request/response service per rank (length-prefixed binary header, no
  pickle, a per-window token checked at connection time).

A *channel* is what an origin holds per target rank; both transports implement :class:`Channel`.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from torchnext.comms.reduce_op import ReduceOp

__all__ = ["Channel", "WindowTransport"]


class WindowTransport(str, enum.Enum):
    """How an origin reaches a target's registered memory (``Window.transport(rank)``)."""

    SHM = "shm"
    """Same host: the target's segment is mapped into this process; ops are memory copies."""
    TCP = "tcp"
    """Any host: requests to the target's window service over TCP."""


class Channel(Protocol):
    """Origin-side access to one target's registered memory. Arguments are already bounds/dtype-checked by the
    window; a channel re-checks nothing but the transport itself (the TCP service re-checks on the target)."""

    target: int

    def put(self, offset: int, src: torch.Tensor) -> None: ...

    def get(self, offset: int, out: torch.Tensor) -> None: ...

    def get_rows(self, indices: torch.Tensor, out: torch.Tensor) -> None: ...

    def accumulate(self, offset: int, src: torch.Tensor, op: ReduceOp) -> None: ...

    def signal(self, value: int) -> None: ...

    def flush(self) -> None: ...

    def alive(self) -> bool: ...

    def close(self) -> None: ...
