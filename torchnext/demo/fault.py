"""A demo fault: what ``--fault KIND:RANK@STEP`` / ``coordinator@STEP`` says (shared by the launcher and the chaos
schedule)."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["FAULT_KINDS", "Fault"]

FAULT_KINDS = ("kill", "hang", "partition", "coordinator")
_FAULT_RE = re.compile(r"^\s*([A-Za-z]+)\s*:\s*(-?\d+)\s*@\s*(-?\d+)\s*$")
_COORDINATOR_RE = re.compile(r"^\s*coordinator\s*@\s*(-?\d+)\s*$", re.IGNORECASE)


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One injected failure: ``kind`` (``kill``: SIGKILL; ``hang``: SIGSTOP until the group is removed, then
    SIGCONT -- the rank must learn it was removed) on local rank ``rank`` after the job committed ``step`` steps.
    Written ``kind:RANK@STEP`` (``kill:2@20``). ``partition:RANK@STEP``: every rank runs on its own host (a network
    namespace of a :class:`~torchnext.testing.NetLab`) and the rank's host is cut off the network until its replica
    group has left the generation, then reconnected (the rank must learn it was removed). ``coordinator@STEP``: the coordinator in office is killed (its
    membership service and store stop at once) and the standby the launcher started beside it takes over; ``rank``
    is -1."""

    kind: str
    rank: int
    step: int

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {', '.join(FAULT_KINDS)}, got {self.kind!r}")
        if self.kind == "coordinator":
            if self.rank != -1:
                raise ValueError(f"a coordinator fault names no rank (coordinator@STEP), got rank {self.rank}")
        elif self.rank < 0:
            raise ValueError(f"fault rank must be >= 0, got {self.rank}")
        if self.step < 0:
            raise ValueError(f"fault step must be >= 0, got {self.step}")

    @classmethod
    def parse(cls, text: str) -> Fault:
        """``"kill:2@20"`` -> ``Fault(kind="kill", rank=2, step=20)``.

        Raises:
            ValueError: not ``KIND:RANK@STEP``, an unknown kind, a negative rank or step.
        """
        c = _COORDINATOR_RE.match(text)
        if c is not None:
            step = int(c.group(1))
            if step < 0:
                raise ValueError(f"bad fault {text!r}: step {step} is negative")
            return cls(kind="coordinator", rank=-1, step=step)
        m = _FAULT_RE.match(text)
        if m is None:
            raise ValueError(f"bad fault {text!r}: expected KIND:RANK@STEP with KIND kill, hang or partition "
                             "(e.g. kill:2@20), "
                             "or coordinator@STEP")
        kind = m.group(1).lower()
        if kind == "coordinator":
            raise ValueError(f"bad fault {text!r}: a coordinator fault names no rank: coordinator@STEP")
        if kind not in FAULT_KINDS:
            raise ValueError(f"bad fault {text!r}: unknown kind {m.group(1)!r} (expected one of "
                             f"{', '.join(FAULT_KINDS)})")
        rank, step = int(m.group(2)), int(m.group(3))
        if rank < 0:
            raise ValueError(f"bad fault {text!r}: rank {rank} is negative")
        if step < 0:
            raise ValueError(f"bad fault {text!r}: step {step} is negative")
        return cls(kind=kind, rank=rank, step=step)

    def __str__(self) -> str:
        return f"coordinator@{self.step}" if self.kind == "coordinator" else f"{self.kind}:{self.rank}@{self.step}"
