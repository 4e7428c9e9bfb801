"""Fault injectors for multi-rank tests: freeze, resume, kill, crash; scripted faults for fault-tolerant jobs."""

from __future__ import annotations

import enum
import os
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Fault", "FaultInjector", "FaultKind", "FaultPoint", "crash_now", "drop_coordinator", "freeze_self", "kill",
    "refuse_next_op", "resume",
]


def freeze_self() -> None:
    """SIGSTOP this process (it stops at once; another process must ``resume`` or ``kill`` it)."""
    os.kill(os.getpid(), signal.SIGSTOP)


def resume(pid: int) -> None:
    """SIGCONT a frozen process."""
    os.kill(pid, signal.SIGCONT)


def kill(pid: int) -> None:
    """SIGKILL a process (works on a frozen one too)."""
    os.kill(pid, signal.SIGKILL)


def crash_now(code: int = 3) -> None:
    """End this process immediately without cleanup (``os._exit``), like a crash: sockets close, nothing flushes."""
    os._exit(code)


# ------------------------------------------------------------------------------------- scripted faults for FT jobs
class FaultKind(enum.Enum):
    """What a scripted :class:`Fault` does to the member it targets."""

    KILL = "kill"
    """SIGKILL itself (a crash: every socket closes at once)."""
    STOP = "stop"
    """SIGSTOP itself for ``seconds`` (a hang: sockets stay open, heartbeats stop); a helper process sends SIGCONT."""
    RAISE = "raise"
    """Raise ``PeerFailure`` from the collective (as if a connection broke), on this member only."""
    RAISE_IN_OP = "raise_in_op"
    """The member's next collective raises ``PeerFailure`` from inside the op call, on this member only: a one-shot
    check hook of its Communicator refuses the op (:func:`refuse_next_op`), so the error takes the Communicator's
    own path (the op is not issued here, the Communicator is errored; the fault-tolerant group records the op as
    failed and the step cannot commit) -- unlike RAISE, it also works where the collective is issued by a library
    (DDP's comm hook, FSDP2's reductions) that must not see a Python exception mid-backward."""
    KILL_PID = "kill_pid"
    """SIGKILL another process, ``Fault.pid`` (say the coordinator in office), at this member's fault point; the
    member goes on. Places a coordinator kill exactly: inside a step, during a reconfiguration, during healing."""


class FaultPoint(enum.Enum):
    """Where in a fault-tolerant training loop the fault fires."""

    IDLE = "idle"
    """Between steps (before the step's collectives)."""
    COLLECTIVE = "collective"
    """Inside the step's all_reduce: the op is issued, then the fault fires while peers are blocked in it."""
    RECONFIGURE = "reconfigure"
    """While entering a new generation, before its Communicator is built (peers are connecting)."""
    HEALING = "healing"
    """On the donor, while a joiner is being healed (before the state is streamed)."""


@dataclass(frozen=True, kw_only=True)
class Fault:
    """``Fault(kind=KILL, member=2, step=5, where=COLLECTIVE)``: member 2 dies inside step 5's all_reduce.

    ``step``: the fault fires at the first opportunity (its ``where``) once the committed step count is ``>= step``
    (a replacement that joins later fires it right after joining). Each fault fires once.
    """

    kind: FaultKind
    member: int
    step: int
    where: FaultPoint = FaultPoint.IDLE
    seconds: float = 0.0
    """STOP only: how long the process stays stopped."""
    pid: int = 0
    """KILL_PID only: the process to kill."""

    def __post_init__(self) -> None:
        if self.kind is FaultKind.STOP and self.seconds <= 0:
            raise ValueError("a STOP fault needs seconds > 0")
        if self.kind is FaultKind.KILL_PID and (not isinstance(self.pid, int) or self.pid <= 1):
            raise ValueError(f"a KILL_PID fault needs the pid of another process, got pid={self.pid!r}")
        if self.step < 0:
            raise ValueError(f"Fault.step must be >= 0, got {self.step}")


class FaultInjector:
    """Fires this member's :class:`Fault` s when the training loop calls ``at(point, step)``.

    ``at`` returns normally when nothing fires; KILL never returns; STOP returns after the process was resumed;
    RAISE raises ``PeerFailure``; KILL_PID returns once the other process was sent SIGKILL (one already gone is
    ignored). Helper processes (the SIGCONT sender) are reaped by ``close()``.
    """

    def __init__(self, faults: Sequence[Fault], member: int) -> None:
        self._faults = [f for f in faults if f.member == member]
        self._fired: set[int] = set()
        self._helpers: list[subprocess.Popen[bytes]] = []

    def due(self, point: FaultPoint, step: int) -> Fault | None:
        for i, f in enumerate(self._faults):
            if i not in self._fired and f.where is point and step >= f.step:
                self._fired.add(i)
                return f
        return None

    def at(self, point: FaultPoint, step: int) -> None:
        f = self.due(point, step)
        if f is not None:
            self.fire(f)

    def fire(self, f: Fault, comm: Any = None) -> None:
        """Fire ``f`` now (RAISE_IN_OP needs the member's current Communicator, ``comm``)."""
        if f.kind is FaultKind.KILL:
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.kind is FaultKind.STOP:
            self._helpers.append(subprocess.Popen(
                ["/bin/sh", "-c", f"sleep {f.seconds}; kill -CONT {os.getpid()}"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))
            os.kill(os.getpid(), signal.SIGSTOP)
        elif f.kind is FaultKind.RAISE:
            from torchnext.comms.errors import PeerFailure

            raise PeerFailure(f"injected fault at step {f.step} ({f.where.value})", op="all_reduce")
        elif f.kind is FaultKind.RAISE_IN_OP:
            if comm is None:
                raise ValueError("a RAISE_IN_OP fault needs the member's Communicator: fire(fault, comm=...)")
            refuse_next_op(comm, f"injected fault at step {f.step} ({f.where.value})")
        elif f.kind is FaultKind.KILL_PID:
            try:
                os.kill(f.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        for p in self._helpers:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._helpers.clear()


def refuse_next_op(comm: Any, reason: str) -> None:
    """Make the next op issued on Communicator ``comm`` raise ``PeerFailure(reason)`` from inside the op call (a
    one-shot check hook: the op is refused on this rank only, the Communicator is errored)."""
    from torchnext.comms.errors import PeerFailure

    fired = [False]

    def hook(info: Any) -> None:
        if not fired[0]:
            fired[0] = True
            raise PeerFailure(f"{reason}: {info.op} refused by an injected fault", op=info.op)

    comm.register_check_hook(hook)


def drop_coordinator(target: Any) -> None:
    """Kill the coordinator: a ``subprocess.Popen`` / pid of ``torchnext coordinator`` or a
    :class:`~torchnext.testing.coordinators.CoordinatorProcess` gets SIGKILL (and is reaped); an in-process
    :class:`~torchnext.ft.Coordinator` is stopped (its connections and store close at once)."""
    if isinstance(target, int):
        os.kill(target, signal.SIGKILL)
    elif isinstance(target, subprocess.Popen):
        target.kill()
        target.wait(timeout=30)
    elif hasattr(target, "kill") and hasattr(target, "pid"):  # a testing.coordinators.CoordinatorProcess
        target.kill()
    elif hasattr(target, "stop"):
        target.stop()
    else:
        raise TypeError(f"drop_coordinator: expected a pid, Popen or Coordinator, got {type(target).__name__}")
