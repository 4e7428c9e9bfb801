"""The Work of an async window op: the communicator's :class:`~torchnext.comms.Work`, finished the window's way."""

from __future__ import annotations

import time

from torchnext.comms.hooks import PostHookArgs
from torchnext.comms.work import Work, WorkStatus

__all__ = ["WindowWork"]

_TERMINAL = frozenset({WorkStatus.COMPLETED, WorkStatus.ERROR, WorkStatus.TIMED_OUT, WorkStatus.ABORTED})


class WindowWork(Work):
    """The :class:`~torchnext.comms.Work` of an async window op (same API: ``wait``, ``is_completed``, ``status``,
    ``exception``, ``result``). ``op`` is ``"window.<name>"``; ``op_id`` counts this window's ops (its own
    sequence, not the communicator's). A failed window op does not make the communicator errored."""

    __slots__ = ()

    def _finish(self, status: WorkStatus, exc: BaseException | None, *, breaks_comm: bool = True) -> bool:
        comm = self._comm
        with self._table.lock:
            if self.status in _TERMINAL:
                return False
            self.status = status
            self._exc = exc
            self._t_end = time.perf_counter()
        info = self.info
        if info is not None:
            self._hook_error = comm.run_post_hooks(PostHookArgs(info, self, status, self._t_end - self._t0, exc))
        if self._done is not None:
            self._done.release()
        return True
