"""How ``ft.step()`` treats the exception that ended a step attempt, and the errors that end a job from a step.

Every exception that leaves a ``with ft.step()`` block (or that ``ft.process_group`` recorded inside it) has a
:class:`FailureKind`, looked up by class in a registry -- the most specific registered class of its MRO wins::

    kind = next(KINDS[c] for c in type(exc).__mro__ if c in KINDS)
    TRANSIENT:      report the generation broken, reconfigure, swallow (the loop retries the step), at most
                    max_retries failed attempts in a row per step, then RetriesExhausted on every member
    DETERMINISTIC:  raise on this member, no report, no new generation; unless every member raises it by itself
                    (raised_on_every_member), end the job so that every other member raises StepFailed
    FATAL:          membership ended (a MembershipError): raise as is
    LEAVE:          not an Exception (KeyboardInterrupt, SystemExit): raise as is; the process is leaving, which
                    the others see as a departure

Registered kinds (:func:`register_failure_kind` adds one)::

    PeerFailure, CommTimeout, CommAborted, CommError         TRANSIENT       a peer or the generation failed
    torch.distributed.DistError                              TRANSIENT       torch's own groups (a shard group)
    CollectiveMismatch                                       DETERMINISTIC   the members disagree on an op
    TypeError, ValueError                                    DETERMINISTIC   argument validation
    HookError, any other Exception (user code)               DETERMINISTIC
    MembershipError (RemovedFromGroup, QuorumLost, ...)      FATAL
    BaseException                                            LEAVE
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

import torch.distributed as dist

from torchnext.comms.communicator import Communicator
from torchnext.comms.errors import CollectiveMismatch, CommAborted, CommError, CommTimeout, HookError, PeerFailure
from torchnext.comms.process_group import TorchnextProcessGroup
from torchnext.ft.membership import MembershipError

__all__ = [
    "FailureKind",
    "RetriesExhausted",
    "StepFailed",
    "classify_failure",
    "raised_on_every_member",
    "register_failure_kind",
]


class FailureKind(str, Enum):
    """What ``ft.step()`` does with an exception that ended an attempt (see the module docstring)."""

    TRANSIENT = "transient"
    """A peer, a connection or the generation failed: report, reconfigure, retry the step."""
    DETERMINISTIC = "deterministic"
    """Retrying would fail again (a programming or data error): raise on every member, no new generation."""
    FATAL = "fatal"
    """This member's membership ended: raise as is."""
    LEAVE = "leave"
    """Not an ``Exception``: the process is leaving; raise as is."""


class StepFailed(MembershipError):
    """The job ended because a step failed in a way that retrying cannot fix: a deterministic error on some member
    (an exception from user code, invalid arguments, a collective that not every member issued). The member that
    hit the error raises the error itself; every other member raises this, naming that member and the error."""


class RetriesExhausted(StepFailed):
    """A step failed more than ``FaultTolerantConfig.max_retries`` attempts in a row (transient failures each time).

    ``step``: the committed-step count the attempts were at; ``attempts``: failed attempts in a row;
    ``failures``: the last few failure messages, oldest first. Raised by the member that counted past the cap
    (with all three set) and, through the coordinator, by every other member (message only)."""

    def __init__(self, message: str, *, step: int | None = None, attempts: int | None = None,
                 failures: Sequence[str] = ()) -> None:
        self.step = step
        self.attempts = attempts
        self.failures = tuple(failures)
        super().__init__(message)


_KINDS: dict[type[BaseException], FailureKind] = {
    BaseException: FailureKind.LEAVE,
    Exception: FailureKind.DETERMINISTIC,
    TypeError: FailureKind.DETERMINISTIC,
    ValueError: FailureKind.DETERMINISTIC,
    HookError: FailureKind.DETERMINISTIC,
    dist.DistError: FailureKind.TRANSIENT,
    CommError: FailureKind.TRANSIENT,
    PeerFailure: FailureKind.TRANSIENT,
    CommTimeout: FailureKind.TRANSIENT,
    CommAborted: FailureKind.TRANSIENT,
    CollectiveMismatch: FailureKind.DETERMINISTIC,
    MembershipError: FailureKind.FATAL,
}

_EVERY_MEMBER: dict[type[BaseException], Callable[[BaseException], bool]] = {
    # refused on every member before any data moved; an "arrival" mismatch is not: the culprits never issued it
    CollectiveMismatch: lambda exc: not getattr(exc, "breaks_communicator", True),
}


def classify_failure(exc: BaseException) -> FailureKind:
    """The :class:`FailureKind` of ``exc``: the kind of the most specific registered class in its MRO."""
    for cls in type(exc).__mro__:
        kind = _KINDS.get(cls)
        if kind is not None:
            return kind
    return FailureKind.LEAVE  # unreachable: BaseException is registered


def raised_on_every_member(exc: BaseException) -> bool:
    """True when every member of the generation raises ``exc`` by itself (a symmetric deterministic error: a
    ``CollectiveMismatch`` that refused the op everywhere), so no member needs to be told."""
    for cls in type(exc).__mro__:
        test = _EVERY_MEMBER.get(cls)
        if test is not None:
            return test(exc)
    return False


def register_failure_kind(cls: type[BaseException], kind: FailureKind) -> None:
    """Classify ``cls`` (and its subclasses without a registration of their own) as ``kind`` inside ``ft.step()``,
    e.g. a data loader's retryable error as ``TRANSIENT``.

    Raises:
        TypeError: ``cls`` is not an exception class or ``kind`` not a :class:`FailureKind`.
    """
    if not (isinstance(cls, type) and issubclass(cls, BaseException)):
        raise TypeError(f"register_failure_kind: expected an exception class, got {cls!r}")
    if not isinstance(kind, FailureKind):
        raise TypeError(f"register_failure_kind: expected a FailureKind, got {kind!r}")
    _KINDS[cls] = kind


def quiet_abort(comm: Any, reason: str, cause: BaseException | None = None) -> None:
    """Abort ``comm`` (a Communicator, a torchnext process group, or any torch process group: its ``abort()`` takes
    no reason) on a failure path, where a raising abort hook must not stop the reconfiguration or turn a recorded
    failure into a crash. ``cause``: the ``__cause__`` of the ``CommAborted`` its ops raise (torchnext ones only)."""
    try:
        if isinstance(comm, Communicator | TorchnextProcessGroup):
            comm.abort(reason, cause=cause)
        else:
            comm.abort()
    except Exception:
        pass
