"""The torch.distributed Work of a torchnext process group: one torchnext :class:`~torchnext.comms.Work` seen
through torch's ``dist.Work`` interface (``wait``, ``is_completed``, ``get_future``, ``exception``, ...).

The rule for failures (docs/process_group.md): ``wait()`` raises the op's error (``CommTimeout``, ``PeerFailure``,
``CommAborted``, ``CommError``) -- that is how ``dist.all_reduce(..., group=pg)`` reports it. The **future never
completes with an exception**: torch's DDP reducer crashes the process (segfault, torch 2.13) on such a future. A
failed op completes its future with its outputs *marked invalid* (:func:`mark_invalid`: floating-point outputs
NaN, integer outputs the dtype's extreme value), and the failure raises at the next call into the group (the
communicator is errored). Semantics::

    work.wait()               # True; or raises the op's exception
    work.get_future().wait()  # == outputs (torch's layout for the op); marked invalid if the op failed
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from torchnext.comms.work import Work, WorkStatus

if TYPE_CHECKING:
    from torchnext.comms.process_group.group import TorchnextProcessGroup

__all__ = ["GroupWork", "invalid_value", "mark_invalid"]

_COMPLETED = WorkStatus.COMPLETED


def invalid_value(dtype: torch.dtype) -> float | int | None:
    """The value that marks an output of ``dtype`` invalid::

        NaN                      # floating point and complex (float8 included)
        torch.iinfo(dtype).min   # signed integers (int8 ... int64)
        torch.iinfo(dtype).max   # unsigned integers (uint8 ... uint64)
        None                     # bool: no value marks it; the output is left as the failed op left it
    """
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return None
    info = torch.iinfo(dtype)
    return info.min if info.min < 0 else info.max


def mark_invalid(tensors: Sequence[Any]) -> None:
    """Fill the tensors of ``tensors`` (nested lists allowed) with :func:`invalid_value` of their dtype: the mark
    of an op that failed while its caller could not be told (a future that must not raise). The native path
    (``comms/native/csrc/native.cpp``) marks the same values."""
    for t in tensors:
        if isinstance(t, (list, tuple)):
            mark_invalid(t)
        elif isinstance(t, torch.Tensor):
            v = invalid_value(t.dtype)
            if v is not None:
                with torch.no_grad():
                    t.fill_(v)


class GroupWork(dist._Work):
    """One or more torchnext :class:`~torchnext.comms.Work` (a coalesced op issues several) as one
    ``torch.distributed.Work``: complete when all of them are.

    ``result``: what the op's future holds and ``result()`` returns, in torch's layout for the op (the in-place
    tensor list for ``all_reduce``; the list of output lists for ``all_gather``; ...). ``invalid``: the tensors to
    mark invalid when the op fails under a future (default: ``result``).
    """

    __slots__ = ("_future", "_group", "_invalid", "_left", "_result", "_works")

    def __init__(self, group: TorchnextProcessGroup, works: Work | Sequence[Work], result: list[Any],
                 invalid: Sequence[Any] | None = None) -> None:
        super().__init__()
        self._group = group
        self._works: tuple[Work, ...] = (works,) if isinstance(works, Work) else tuple(works)
        self._result = result
        self._invalid = result if invalid is None else invalid
        self._future: torch.futures.Future[Any] | None = None
        self._left = len(self._works)

    def __repr__(self) -> str:
        return f"GroupWork({', '.join(map(repr, self._works))})"

    @property
    def works(self) -> tuple[Work, ...]:
        """The torchnext Works behind this one (their status, duration, op ids)."""
        return self._works

    # -------------------------------------------------------------------------------------------- torch's API
    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Block until the op finished; raise its exception if it failed. ``timeout`` (0: none, as in torch)
        bounds only this wait: when it elapses first, ``RuntimeError`` is raised and the op keeps running."""
        limit = timeout or None  # timedelta(0) is false
        for work in self._works:
            if not work.wait(limit):
                raise RuntimeError(f"{work.op}: wait() timed out after {timeout} (the op is still in flight; "
                                   "wait again, or abort the group)")
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return all(w.status is _COMPLETED for w in self._works)

    def exception(self) -> BaseException | None:
        return next((e for e in (w.exception() for w in self._works) if e is not None), None)

    def source_rank(self) -> int:
        rank = self._works[-1].source_rank() if self._works else None
        if rank is None:
            raise RuntimeError("no source rank: not a completed recv")
        return rank

    _source_rank = source_rank

    def result(self) -> list[Any]:
        self.wait()
        return self._result

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future[Any]:
        """A future completed with the op's result once the op is terminal -- never with an exception (see the
        module docstring)."""
        if self._future is None:
            self._future = torch.futures.Future()
            if not self._works:  # nothing was issued (an op refused inside a fault-tolerant step)
                self._future.set_result(self._result)
            for work in self._works:
                work.add_done_callback(self._part_done)
        return self._future

    def _terminal(self, failed: bool) -> None:
        """Called once every part is terminal, before the future completes (a subclass's last word on the
        outputs: :class:`torchnext.ft.FaultTolerantProcessGroup` copies its staging buffers back here)."""

    def _part_done(self, work: Work) -> None:
        with self._group._lock:
            self._left -= 1
            last = self._left == 0
        if not last:
            return
        assert self._future is not None
        failed = [w for w in self._works if w.status is not _COMPLETED]
        self._terminal(bool(failed))
        if failed:
            mark_invalid(self._invalid)
            self._group._note_swallowed(failed[0])
        self._future.set_result(self._result)
