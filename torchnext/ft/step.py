"""One attempt at a training step of a :class:`~torchnext.ft.FaultTolerant` member (``with ft.step() as step``)."""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING

from torchnext.comms.errors import CommError
from torchnext.ft.membership import MembershipError

if TYPE_CHECKING:
    from torchnext.ft.fault_tolerant import FaultTolerant

__all__ = ["Step"]


class Step:
    """One attempt at a training step (``with ft.step() as step``). ``committed``: whether it was committed;
    ``error``: the communication error that failed it (swallowed by the context), else None."""

    def __init__(self, ft: FaultTolerant) -> None:
        self._ft = ft
        self.committed = False
        self.decided = False
        self.error: BaseException | None = None

    def commit(self) -> bool:
        """Two-phase commit: True iff every member completed this step (see :meth:`FaultTolerant.should_commit`)."""
        if not self.decided:
            self.committed = self._ft.should_commit()
            self.decided = True
        return self.committed

    def __enter__(self) -> Step:
        ft = self._ft
        ft._check_not_finished()
        ft._settle(need_new=False)
        ft._lockstep()  # the ranks of a replica group begin the attempt in the same generation
        with ft._lock:
            ft._in_step = True
        ft._check_not_finished()  # a notice that arrived meanwhile
        return self

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        ft = self._ft
        with ft._lock:
            ft._in_step = False
        if exc is None:
            if not self.decided:
                self.commit()
            ft._settle(need_new=not self.committed)
            return False
        if isinstance(exc, CommError) and not isinstance(exc, MembershipError):
            ft._check_not_finished(exc)
            self.error = exc
            ft._report(f"{type(exc).__name__}: {exc}")
            ft._settle(need_new=True)
            return True  # swallowed: the group reconfigured; the caller retries the step
        return False
