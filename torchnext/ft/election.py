"""Taking office: how a standby (or restarted) coordinator rebuilds the job's state from its members' reports.

Pure logic, like :mod:`~torchnext.ft.membership`: the service feeds it reports and promises, and asks it whether
and how to take office. The members are the memory of the job -- every one of them holds what the coordinator
decided (its generation, the member set with its replica groups, the committed step) -- so nothing is read from a
file.

Protocol (a member that lost its coordinator tries the listed addresses in order)::

    member    -> standby   hello with a report: term, entered generation, committed step, synced, pending vote
    standby   -> members   prepare(term T)   once the reports satisfy the takeover rule; T > every reported term
    member    -> standby   promise(T)        the member never again takes part under a lower term
    standby   -> members   decision(s) for pending votes some member saw committed; then generation G, term T

The rules (see docs/fault_tolerance.md for the argument):

* **Takeover rule.** Let ``L`` be the newest generation any reporter entered (highest ``(term, gen)``). The standby
  takes office only when the members that promised include a **strict majority** of ``L``'s replica groups (a
  group counts when all its ranks promised) and -- unless a reporter saw a step commit in ``L`` -- a strict majority
  of ``L.quorum``'s groups (the committed generation ``L`` was formed from). The coordinator in office keeps going
  only with at least half of its quorum's groups (:mod:`~torchnext.ft.membership`, rule 2b): half plus a strict
  majority is more than all, so an old coordinator cut off from the majority can never form another generation,
  and each of its generations contains a member that promised elsewhere and will never vote there.
* **Committed step.** ``s = max(step)`` over the synced reporters of ``L``; a reporter one step behind with a
  pending vote for ``(L, s - 1)`` is told that step committed (every member voted, someone saw the decision). A step
  nobody saw committed is not committed: its voters retry it in the new generation.
* **Who is in.** Every promiser of a whole replica group; members of ``L`` holding step ``s`` are the state holders,
  everyone else (stale reports, unhealed joiners) is healed from them. The new generation's number is larger than
  any a member knows, its ``quorum`` is ``L`` (when ``L`` committed) or ``L.quorum``, and its store is the new
  coordinator's.

A grace period (``grace_s`` after the rule first holds, or at once when every member of ``L`` has promised) keeps a
member that is a few milliseconds late from being left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Election", "GenerationRef", "Report", "Takeover", "strict_majority"]


@dataclass(frozen=True)
class GenerationRef:
    """A generation as a member remembers it."""

    gen: int
    term: int
    groups: tuple[tuple[int, ...], ...]
    quorum: tuple[tuple[int, ...], ...]
    step: int
    """The committed step count when the generation was formed."""
    joiners: frozenset[int] = frozenset()
    """Members healed into it (the others held its starting state)."""

    @property
    def key(self) -> tuple[int, int]:
        """Order of generations across coordinators: term first, then number."""
        return (self.term, self.gen)

    @property
    def members(self) -> frozenset[int]:
        return frozenset(m for g in self.groups for m in g)

    @classmethod
    def from_message(cls, msg: dict[str, Any]) -> GenerationRef:
        groups = tuple(tuple(int(m) for m in g) for g in msg["groups"])
        quorum = tuple(tuple(int(m) for m in g) for g in (msg.get("quorum") or msg["groups"]))
        return cls(gen=int(msg["gen"]), term=int(msg["term"]), groups=groups, quorum=quorum, step=int(msg["step"]),
                   joiners=frozenset(int(j) for j in msg.get("joiners") or ()))

    def to_message(self) -> dict[str, Any]:
        return {"gen": self.gen, "term": self.term, "groups": [list(g) for g in self.groups],
                "quorum": [list(g) for g in self.quorum], "step": self.step, "joiners": sorted(self.joiners)}


@dataclass(frozen=True)
class Report:
    """What a member that lost its coordinator knows (sent with its hello)."""

    member: int
    term: int
    """The highest term it entered a generation of or promised."""
    step: int
    """Committed steps it holds (decisions it received included)."""
    synced: bool
    """It holds the state of ``step`` (it entered a generation, healed if it was a joiner)."""
    attempted: int
    """The highest generation number it knows."""
    entered: GenerationRef | None
    vote: tuple[int, int] | None
    """``(gen, step)`` of a vote it sent and got no decision for."""

    @classmethod
    def from_message(cls, member: int, msg: dict[str, Any]) -> Report:
        entered = msg.get("entered")
        vote = msg.get("vote")
        return cls(member=member, term=int(msg["term"]), step=int(msg["step"]), synced=bool(msg["synced"]),
                   attempted=int(msg["attempted"]),
                   entered=None if entered is None else GenerationRef.from_message(entered),
                   vote=None if vote is None else (int(vote["gen"]), int(vote["step"])))


@dataclass(frozen=True)
class Takeover:
    """How to take office: the first generation's ingredients (see the module docstring)."""

    term: int
    latest: GenerationRef
    step: int
    gen: int
    """Number of the first generation in office."""
    members: tuple[int, ...]
    synced: frozenset[int]
    decisions: tuple[tuple[int, dict[str, Any]], ...]
    """``(member, decision message)`` for pending votes of a step some member saw committed."""
    quorum: tuple[tuple[int, ...], ...]
    reason: str


def strict_majority(groups: tuple[tuple[int, ...], ...], present: frozenset[int] | set[int]) -> tuple[int, int]:
    """``(whole groups of `groups` whose every rank is in `present`, the strict majority needed)``."""
    have = sum(1 for g in groups if present.issuperset(g))
    return have, len(groups) // 2 + 1


@dataclass
class Election:
    """A standby's view of the members that reported to it (see the module docstring). ``grace_s``: how long to
    wait for the rest of ``L`` once the rule holds."""

    grace_s: float
    reports: dict[int, Report] = field(default_factory=dict)
    term: int | None = None
    """The term prepared, once the reports satisfied the rule."""
    promised: set[int] = field(default_factory=set)
    ready_since: float | None = None

    def add(self, report: Report, now: float) -> int | None:
        """A member reported. Returns a term to send it ``prepare`` for (None: not yet preparing). A report of a
        term at or above the prepared one restarts the preparation with a higher term."""
        self.reports[report.member] = report
        if self.term is not None and max(report.term, _entered_term(report)) >= self.term:
            self.term = None
            self.promised.clear()
        return self.term

    def remove(self, member: int) -> None:
        """A reporter disconnected or went silent: it no longer counts (it may report elsewhere)."""
        self.reports.pop(member, None)
        self.promised.discard(member)
        if not self.reports:
            self.term = None
            self.ready_since = None

    def promise(self, member: int, term: int) -> None:
        if self.term is not None and term == self.term and member in self.reports:
            self.promised.add(member)

    def latest(self) -> GenerationRef | None:
        refs = [r.entered for r in self.reports.values() if r.entered is not None]
        return max(refs, key=lambda g: g.key) if refs else None

    def shortfall(self, voters: set[int] | frozenset[int]) -> str | None:
        """Why ``voters`` cannot take office under the takeover rule, or None."""
        latest = self.latest()
        if latest is None:
            return "no reporter was ever part of a generation"
        have, need = strict_majority(latest.groups, voters)
        if have < need:
            return (f"{have} of the {len(latest.groups)} replica groups of generation {latest.gen} (term "
                    f"{latest.term}) reported; a strict majority is {need}")
        if not self._seen_committed(latest):
            have, need = strict_majority(latest.quorum, voters)
            if have < need:
                return (f"generation {latest.gen} never committed here, and {have} of the {len(latest.quorum)} "
                        f"replica groups of its quorum reported; a strict majority is {need}")
        if not any(self._holds(self.reports[m], latest) for m in voters if m in self.reports):
            return f"no reporter of generation {latest.gen} holds its state"
        return None

    def prepare(self, now: float) -> int | None:
        """If the reports satisfy the rule and no term is prepared yet: choose the term (higher than every
        reported one) and return it -- send ``prepare`` to every reporter. Otherwise None."""
        if self.term is not None or self.shortfall(set(self.reports)) is not None:
            return None
        self.term = 1 + max(max(r.term, _entered_term(r)) for r in self.reports.values())
        self.promised.clear()
        if self.ready_since is None:
            self.ready_since = now
        return self.term

    def decide(self, now: float) -> Takeover | None:
        """The takeover, once the promisers satisfy the rule and every member of ``L`` promised or ``grace_s``
        passed since the rule first held; else None."""
        if self.term is None:
            return None
        voters = set(self.promised)
        latest = self.latest()
        if latest is None or self.shortfall(voters) is not None:
            return None
        everyone = latest.members <= voters
        assert self.ready_since is not None
        if not everyone and now - self.ready_since < self.grace_s:
            return None
        seen = self._seen_committed(latest)
        holders = [r for r in self.reports.values() if self._holds(r, latest)]
        step = max(r.step for r in holders)  # a step anyone saw committed is committed
        decisions: list[tuple[int, dict[str, Any]]] = []
        synced: set[int] = set()
        for r in self.reports.values():
            if r.member not in voters or not r.synced:
                continue
            if (r.step == step == latest.step and r.member in latest.members and r.member not in latest.joiners
                    and not self._holds(r, latest)):
                synced.add(r.member)  # a member of L that had not entered it yet holds L's starting state
            elif not self._holds(r, latest):
                continue
            elif r.step == step:
                synced.add(r.member)
            elif r.step == step - 1 and r.vote == (latest.gen, step - 1):
                decisions.append((r.member, {"t": "decision", "gen": latest.gen, "step": step - 1,
                                             "committed": step}))
                synced.add(r.member)
        gen = 1 + max(max(r.attempted, r.entered.gen if r.entered else 0) for r in self.reports.values())
        return Takeover(
            term=self.term, latest=latest, step=step, gen=gen, members=tuple(sorted(voters)),
            synced=frozenset(synced), decisions=tuple(decisions),
            quorum=latest.groups if seen else latest.quorum,
            reason=(f"took office (term {self.term}) with {len(voters)} member(s) after the coordinator of "
                    f"generation {latest.gen} (term {latest.term}) was lost; committed step {step}"),
        )

    def _holds(self, r: Report, latest: GenerationRef) -> bool:
        """``r`` entered ``latest`` and holds its state."""
        return r.synced and r.entered is not None and r.entered.key == latest.key

    def _seen_committed(self, latest: GenerationRef) -> bool:
        """A reporter holds a step committed in ``latest`` (so ``latest`` committed)."""
        return any(r.step > latest.step for r in self.reports.values()
                   if r.entered is not None and r.entered.key == latest.key and r.synced)


def _entered_term(r: Report) -> int:
    return 0 if r.entered is None else r.entered.term
