"""One attempt at a training step of a :class:`~torchnext.ft.FaultTolerant` member (``with ft.step() as step``).

How the attempt ends, by the :class:`~torchnext.ft.FailureKind` of what ended it (:mod:`torchnext.ft.errors`)::

    no exception, committed:        done (ft.step_count moved on; the failed-attempt count starts over)
    no exception, not committed:    a failed attempt; reconfigure; the loop retries the step
    TRANSIENT (PeerFailure, ...):   a failed attempt; report the generation broken, reconfigure, swallow
    DETERMINISTIC (CollectiveMismatch, a user exception, ... -- raised in the block or recorded by
        ft.process_group):          raise it (with a note); no report, no new generation; unless every member
                                    raises it by itself, end the job: the others raise StepFailed
    FATAL, LEAVE:                   raise as is
    a failed attempt beyond FaultTolerantConfig.max_retries in a row at one step:
                                    end the job; raise RetriesExhausted (the others raise it too)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING

from torchnext.ft.errors import FailureKind, RetriesExhausted, classify_failure, raised_on_every_member

if TYPE_CHECKING:
    from torchnext.ft.fault_tolerant import FaultTolerant

__all__ = ["Step"]


class Step:
    """One attempt at a training step (``with ft.step() as step``; see the module docstring). ``committed``:
    whether it was committed; ``error``: the transient error that failed it (swallowed by the context), else None."""

    def __init__(self, ft: FaultTolerant) -> None:
        self._ft = ft
        self.committed = False
        self.decided = False
        self.error: BaseException | None = None

    def commit(self) -> bool:
        """Two-phase commit: True iff every member completed this step (see :meth:`FaultTolerant.should_commit`);
        with ``FaultTolerantConfig(defer_commit=True)`` True is provisional: the step is revoked (the state reverted)
        if the decision, awaited at the next commit, refuses it (:mod:`torchnext.ft.provisional`). Raises the
        deterministic error ``ft.process_group`` recorded in this attempt, if any."""
        if not self.decided:
            self.committed = self._ft.should_commit()
            self.decided = True
        return self.committed

    def __enter__(self) -> Step:
        ft = self._ft
        ft._check_not_finished()
        ft._begin_attempt()  # the ranks of a replica group begin the attempt in the same generation
        if ft.config.defer_commit:
            ft._begin_snapshot()  # the state this attempt's update would be revoked to, copied while it runs
        with ft._lock:
            ft._in_step = True
            ft._step_error = None
            ft._early_voted = False
            ft._early_vote = None
        ft._check_not_finished()  # a notice that arrived meanwhile
        return self

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        ft = self._ft
        with ft._lock:
            ft._in_step = False
            recorded, ft._step_error = ft._step_error, None
        if recorded is not None and recorded is not exc and (
                exc is None or classify_failure(exc) is FailureKind.TRANSIENT):
            # ft.process_group recorded a deterministic error (it never raises out of torch's machinery): it, not
            # the failure it caused later (an aborted op, a refused commit), ends the step
            _deterministic(self, recorded)
            raise recorded
        if (exc is not None and ft._early_vote is not None and not self.decided
                and classify_failure(exc) is FailureKind.TRANSIENT and _voted_then_raised(self, exc)):
            return False
        if (exc is not None and self.committed and ft._provisional is not None
                and classify_failure(exc) is FailureKind.TRANSIENT and _applied_then_raised(self, exc)):
            return False
        if exc is None:
            if not self.decided:
                self.commit()
            if self.committed:
                if ft._provisional is None:  # a provisional step resets the count once it is confirmed
                    ft._failed_attempts.reset()
                ft._after_commit()
            else:
                self._failed_attempt(f"commit refused: {ft._refusal}", None)
                ft._settle(need_new=True)
            return False
        return _ON_KIND[classify_failure(exc)](self, exc)

    def _failed_attempt(self, reason: str, cause: BaseException | None) -> None:
        """Count a failed attempt at the current step; beyond ``max_retries`` in a row, end the job and raise."""
        ft = self._ft
        cap = ft.config.max_retries
        attempts = ft._failed_attempts.add(ft.step_count, ft.generation, reason)
        if attempts <= cap:
            return
        last = [f"generation {g}: {r}" for g, r in ft._failed_attempts.last]
        msg = (f"member {ft.member_id}: step {ft.step_count} failed {attempts} attempts in a row (max_retries={cap}); "
               f"the last {len(last)}: " + " | ".join(last))
        ft._end_job("retries_exhausted", msg)
        raise RetriesExhausted(msg, step=ft.step_count, attempts=attempts, failures=last) from cause


def _voted_then_raised(step: Step, exc: BaseException) -> bool:
    """The block raised a transient error after this member's early vote (``DistributedDataParallel(
    vote_early=True)``; a deterministic one ends the job as always): the others
    may commit the step it voted for. Await the decision; if they did, this member holds no committed state (its
    optimizer step was not applied): it leaves the group -- a restarted process rejoins and heals -- and ``exc``
    propagates. True when it left; False (the decision was a refusal) handles ``exc`` as usual."""
    ft = step._ft
    step.committed = ft.should_commit()
    step.decided = True
    if not step.committed:
        return False
    ft.close()
    exc.add_note(f"torchnext.ft: member {ft.member_id} raised after its early vote for step {ft.step_count - 1}, "
                 "which the group committed: it left the group (restart it to rejoin and heal)")
    return True


def _applied_then_raised(step: Step, exc: BaseException) -> bool:
    """The block raised a transient error after ``step.commit()`` returned True provisionally (``defer_commit``):
    the optimizer update may be half-applied. Await the decision; if the step was committed, this member cannot
    rebuild that state: it leaves the group -- a restarted process rejoins and heals -- and ``exc`` propagates (True).
    If it was refused, the state was reverted: ``exc`` is handled as usual (False)."""
    ft = step._ft
    if not ft.confirm():
        step.committed = False
        return False
    ft.close()
    exc.add_note(f"torchnext.ft: member {ft.member_id} raised after step.commit() of step {ft.step_count - 1}, "
                 "which the group committed (defer_commit): its update may be incomplete, so it left the group "
                 "(restart it to rejoin and heal)")
    return True


def _transient(step: Step, exc: BaseException) -> bool:
    """Report the generation broken, reconfigure, swallow: the caller retries the step."""
    ft = step._ft
    ft._raise_fatal(exc)  # membership ended meanwhile (the abort that failed the op came with it): that is the error
    ft._check_not_finished(exc)
    step.error = exc
    reason = f"{type(exc).__name__}: {exc}"
    step._failed_attempt(reason, exc)
    ft._report(reason)
    ft._settle(need_new=True)
    return True


def _deterministic(step: Step, exc: BaseException) -> bool:
    """Raise on this member without reporting; make sure every other member stops too (see the module docstring)."""
    ft = step._ft
    where = f"step {ft.step_count} (generation {ft.generation}, member {ft.member_id})"
    if raised_on_every_member(exc):
        tail = "every member raises it"
    elif ft._end_job("step_failed", f"{where} raised {type(exc).__name__}: {exc}"):
        tail = "the job was ended: every other member raises StepFailed"
    else:
        tail = "membership had already ended"
    exc.add_note(f"torchnext.ft: {where} failed with a deterministic error: not retried, no new generation; {tail}")
    return False


def _propagate(step: Step, exc: BaseException) -> bool:
    return False


_ON_KIND: dict[FailureKind, Callable[[Step, BaseException], bool]] = {
    FailureKind.TRANSIENT: _transient,
    FailureKind.DETERMINISTIC: _deterministic,
    FailureKind.FATAL: _propagate,
    FailureKind.LEAVE: _propagate,
}
"""What ``Step.__exit__`` does with an exception of each kind: True swallows it (the loop retries the step)."""


class _FailedAttempts:
    """Consecutive failed attempts at one committed-step count (``ft._failed_attempts``): ``count``, and the last
    ``keep`` ``(generation, reason)`` pairs in ``last``. An attempt at another count starts over; so does
    :meth:`reset` (a commit)."""

    def __init__(self, keep: int = 3) -> None:
        self.step: int | None = None
        self.count = 0
        self.last: deque[tuple[int, str]] = deque(maxlen=keep)

    def add(self, step: int, generation: int, reason: str) -> int:
        """Count a failed attempt at ``step``; return the failed attempts in a row at it."""
        if step != self.step:
            self.reset()
            self.step = step
        self.count += 1
        self.last.append((generation, reason[:300]))
        return self.count

    def reset(self) -> None:
        self.step = None
        self.count = 0
        self.last.clear()
