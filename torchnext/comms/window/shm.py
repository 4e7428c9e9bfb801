"""Same-host channel: the target's segment is mapped into this process; every op is one memory copy.

Peer liveness: a ``pidfd`` of the target process (Linux >= 5.3) becomes readable when it exits. Each op checks it
before and after the copy, so an op on a dead target raises ``PeerFailure`` instead of silently succeeding
against memory nobody will read. Without pidfd support (other OSes) liveness is not checked on this transport.
"""

from __future__ import annotations

import contextlib
import os
import select
from typing import Any

import torch

from torchnext.comms.errors import PeerFailure
from torchnext.comms.reduce_op import ReduceOp
from torchnext.comms.window.segment import ACCUMULATE, Segment

__all__ = ["ShmChannel"]


class ShmChannel:
    """Origin-side channel to ``target`` through its mapped :class:`Segment` (``segment`` may be this rank's own)."""

    def __init__(self, target: int, origin: int, segment: Segment, pid: int, err_ctx: dict[str, Any]) -> None:
        self.target = target
        self.origin = origin
        self.segment = segment
        self._ctx = err_ctx
        self._poll: select.poll | None = None
        self._pidfd = -1
        if pid != os.getpid() and hasattr(os, "pidfd_open"):
            with contextlib.suppress(OSError):
                self._pidfd = os.pidfd_open(pid)
                self._poll = select.poll()
                self._poll.register(self._pidfd, select.POLLIN)

    def alive(self) -> bool:
        return self._poll is None or not self._poll.poll(0)

    def _check(self, op: str) -> None:
        if self._poll is not None and self._poll.poll(0):
            raise PeerFailure("its process exited (shared-memory window)", peer=self.target, op=op, **self._ctx)

    def put(self, offset: int, src: torch.Tensor) -> None:
        self._check("window.put")
        self.segment.data[offset : offset + src.numel()].copy_(src)
        self._check("window.put")

    def get(self, offset: int, out: torch.Tensor) -> None:
        self._check("window.get")
        out.view(-1).copy_(self.segment.data[offset : offset + out.numel()])
        self._check("window.get")

    def get_rows(self, indices: torch.Tensor, out: torch.Tensor) -> None:
        self._check("window.get_rows")
        cols = out.shape[1]
        table = self.segment.data.view(-1, cols) if cols else self.segment.data.view(0, 0)
        torch.index_select(table, 0, indices, out=out)
        self._check("window.get_rows")

    def accumulate(self, offset: int, src: torch.Tensor, op: ReduceOp) -> None:
        self._check("window.accumulate")
        fn = ACCUMULATE[op]
        with self.segment.lock():
            fn(self.segment.data[offset : offset + src.numel()], src)
        self._check("window.accumulate")

    def signal(self, value: int) -> None:
        self._check("window.signal")
        self.segment.add_signal(self.origin, value)

    def flush(self) -> None:
        self._check("window.flush")  # copies are complete when the op returns

    def close(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
            self._poll = None
        if not self.segment.owner:
            self.segment.close()
