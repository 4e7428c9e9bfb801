"""Membership with generations: who is in the group, decided by one place (the coordinator), fenced by number.

This module is the coordinator's decision logic, free of sockets and threads (the server in
:mod:`torchnext.ft.coordinator` feeds it events and delivers what it puts in ``outbox``), plus the configuration
and the errors a member sees.

Model
-----
* A **member** is one process, named by a stable int id (given by the process or assigned in join order). An id that
  was removed is never accepted again: a restarted process joins as a new member.
* A **replica group** is the failure domain: ``group_size`` members (ranks ``0 .. group_size - 1`` of the group, say
  the processes of one ``torchrun --nproc-per-node`` or one FSDP shard group) that share fate. A group takes part
  in a generation only whole; when one of its members fails, the group leaves: its other members are removed too
  ("your replica group lost member m") and must restart to rejoin as a new group, healed shard by shard. Every
  group of a job has the same ``group_size`` (checked at join). A member that names no group is a group of one
  (the default: every process its own failure domain). ``min_size`` and ``initial_size`` count groups.
* A **generation** ``g`` is a sorted tuple of member ids. Ranks in generation ``g`` are ``members.index(id)``; the
  Communicator of generation ``g`` is built under its own store prefix, so nothing of ``g - 1`` can leak into it.
* The **committed step** counts the training steps every member of some generation completed and the coordinator
  declared committed. It only grows, by one per decision.

Quorum rule (what prevents split-brain)
---------------------------------------
1. Only the coordinator in office decides generations and commits; members never decide among themselves. A member
   that cannot reach a coordinator in office stops (``CoordinatorLost``) instead of continuing alone.
2. A generation is formed only with at least ``min_size`` live replica groups, at least one member of which holds the
   committed state (a member of an earlier generation that committed a step, or the donor chosen at formation).
   With fewer, the survivors wait up to ``quorum_timeout_s`` for joiners, then every member gets ``QuorumLost``.
2b. **Failover rule** (when the members know more than one coordinator address, so that another coordinator may
   take office): a generation is formed only with at least **half** (rounded up) of the replica groups of the
   *quorum* -- the last generation that committed a step (the first generation before any commit) -- whole and
   live; joiners do not count. Otherwise every member gets ``QuorumLost`` at once: the missing groups may be
   training under a coordinator that took office (:mod:`torchnext.ft.election`, which needs a **strict majority**
   of the same groups), and half plus a strict majority is more than all, so the two never both go on.
3. A step is committed only when **every** member of the current generation voted for it (two-phase commit). Votes
   carry the generation, so a vote from a removed or stale member can never count.
4. A removed member is **fenced**: its id is banned, its votes and reports are ignored, and the next message it reads
   says "you were removed" (``RemovedFromGroup``). Survivors have abandoned the communicator it knew, and its next
   generation name is never told to it, so it cannot corrupt the group even if it resumes mid-collective.

Membership changes
------------------
* **shrink** (a member's connection closed, it missed heartbeats, or a member reported a failed collective): after
  ``settle_s`` (to batch simultaneous failures) the coordinator pushes generation ``g + 1`` with the survivors
  (plus pending joiners) and ``abort=True``: every survivor aborts its in-flight ops at once and rebuilds.
* **grow** (a process joined): the joiner waits; the next commit decision carries generation ``g + 1`` (``next``),
  so members switch between steps without aborting anything; the joiner heals from ``donor``. If no step commits
  within ``grow_timeout_s`` the coordinator grows with ``abort=True`` instead (an idle or stuck group).
* **finish** (a member of the generation says ``bye`` with ``done`` between steps, i.e. after its last commit): the
  job is over at the committed step ``S``. From then on departures (finish, bye, a closed connection, silence) are
  recorded as ``left_after_finish`` and change nothing — no generation, no abort, no quorum wait — so members can
  leave in any order; the other members get a ``finished`` notice (a member already past step ``S`` stops); a vote for a later step is answered ``fatal`` with code ``finished`` (:class:`JobFinished`),
  a join is rejected with code ``finished``, and members still waiting to join are told the same. A ``done`` bye
  while a vote round is open (others already voted for the next step) is an ordinary leave.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from torchnext.ft.election import Takeover

__all__ = [
    "HISTORY_EVENTS",
    "END_CODES",
    "CoordinatorLost",
    "JobFinished",
    "MembershipConfig",
    "MembershipError",
    "Membership",
    "QuorumLost",
    "Rejected",
    "RemovedFromGroup",
]

HISTORY_EVENTS = 10_000
"""Events a coordinator keeps in ``history`` (a few per fault: joins, failures, generations, first commits)."""


END_CODES = frozenset({"step_failed", "retries_exhausted"})
"""The codes with which a member may end the job (a ``fail`` report with ``end``): the ``fatal`` code every member
then receives (:class:`~torchnext.ft.StepFailed`, :class:`~torchnext.ft.RetriesExhausted`)."""


class MembershipError(RuntimeError):
    """Base class of the fault-tolerance errors that end a member's participation (not retryable in place)."""


class RemovedFromGroup(MembershipError):
    """This member was removed from the group (it was declared failed, e.g. it missed heartbeats while stopped).

    It must not continue training: restart the process so it joins as a new member and heals."""


class CoordinatorLost(MembershipError):
    """The coordinator closed the connection or stopped answering within the configured timeout."""


class QuorumLost(MembershipError):
    """Fewer than ``min_size`` members (or none holding the committed state) remained, and no joiner arrived in time."""


class JobFinished(MembershipError):
    """The job finished: a member declared the last step done (``FaultTolerant.finish``), so no later step can
    commit and no process can join."""


class Rejected(MembershipError):
    """The coordinator refused a join: ``code`` is ``"auth"``, ``"removed"``, ``"duplicate"``, ``"bad_request"``,
    ``"finished"`` or ``"fatal"``."""

    def __init__(self, code: str, reason: str) -> None:
        self.code = code
        self.reason = reason
        super().__init__(f"join rejected ({code}): {reason}")


@dataclass(kw_only=True)
class MembershipConfig:
    """Failure-detection and quorum policy, decided by the coordinator (members receive the heartbeat settings)."""

    heartbeat_interval_s: float = 0.1
    """Members send a heartbeat this often, from a dedicated thread that does nothing else."""
    heartbeat_timeout_s: float = 0.6
    """A member silent this long is declared failed (hung). A crash is seen earlier: its connection closes."""
    min_size: int = 1
    """Smallest generation allowed (quorum rule 2)."""
    initial_size: int | None = None
    """Members needed to form the first generation (None: ``min_size``)."""
    settle_s: float = 0.005
    """After a failure, wait this long for more failures before deciding (batches simultaneous crashes)."""
    grow_timeout_s: float = 1.0
    """A joiner waiting this long without a commit triggers a generation with ``abort=True``."""
    quorum_timeout_s: float = 30.0
    """Survivors below ``min_size`` wait this long for joiners before every member gets ``QuorumLost``."""
    fence_linger_s: float = 60.0
    """A removed (hung) member's connection is kept this long so that, if it resumes, it reads "you were removed"."""
    group_heartbeat_interval_s: float | None = None
    """The local level of a group session (protocol 4): a follower heartbeats its leader this often (sent to the
    leader in its welcome). ``heartbeat_interval_s`` is the coordinator's level: leaders and flat members. None:
    the same as ``heartbeat_interval_s``."""
    group_heartbeat_timeout_s: float | None = None
    """A follower silent this long on its local channel is declared failed by its leader (reported with ``lost``).
    None: the same as ``heartbeat_timeout_s`` -- a rank is judged by one rule whichever level watches it (a job that
    raised ``heartbeat_timeout_s`` for an oversubscribed machine does not lose a group to a 0.6 s stall of a
    follower)."""
    relay_min_groups: int = 64
    """Vote relays (protocol 5; docs/fault_tolerance.md, "Vote relays"): a generation with at least this many
    sessions that offer a relay listener (group sessions' leaders) votes through relays; smaller ones keep one vote and
    one decision per session. Above ~64 sessions a relay level pays for its extra hop."""
    relay_fanout: int | None = None
    """Sessions per relay chunk (the relay included); None: ``max(64, ceil(sqrt(sessions)))`` -- the coordinator reads
    and writes two messages per chunk and step (32 chunks at 2,048 sessions), a relay two per session of its chunk;
    the coordinator serves every chunk, a relay only its own, so chunks are not made smaller than 64."""

    def __post_init__(self) -> None:
        if self.group_heartbeat_interval_s is None:
            self.group_heartbeat_interval_s = self.heartbeat_interval_s
        if self.group_heartbeat_timeout_s is None:
            self.group_heartbeat_timeout_s = self.heartbeat_timeout_s
        for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "grow_timeout_s", "quorum_timeout_s",
                     "group_heartbeat_interval_s", "group_heartbeat_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"MembershipConfig.{name} must be a positive number of seconds, got {value!r}")
        if self.settle_s < 0 or self.fence_linger_s < 0:
            raise ValueError("MembershipConfig.settle_s and fence_linger_s must be >= 0")
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"MembershipConfig.heartbeat_timeout_s={self.heartbeat_timeout_s} must be at least twice "
                f"heartbeat_interval_s={self.heartbeat_interval_s} (one late heartbeat must not remove a member)"
            )
        if float(self.group_heartbeat_timeout_s) < 2 * float(self.group_heartbeat_interval_s):
            raise ValueError(
                f"MembershipConfig.group_heartbeat_timeout_s={self.group_heartbeat_timeout_s} must be at least twice "
                f"group_heartbeat_interval_s={self.group_heartbeat_interval_s} (one late heartbeat on a group's local "
                "channel must not remove the group)"
            )
        if isinstance(self.relay_min_groups, bool) or not isinstance(self.relay_min_groups, int) or \
                self.relay_min_groups < 2:
            raise ValueError(f"MembershipConfig.relay_min_groups must be an int >= 2, got {self.relay_min_groups!r}")
        if self.relay_fanout is not None and (isinstance(self.relay_fanout, bool) or not isinstance(
                self.relay_fanout, int) or self.relay_fanout < 2):
            raise ValueError(f"MembershipConfig.relay_fanout must be None or an int >= 2, got {self.relay_fanout!r}")
        if not isinstance(self.min_size, int) or self.min_size < 1:
            raise ValueError(f"MembershipConfig.min_size must be an int >= 1, got {self.min_size!r}")
        if self.initial_size is not None and (not isinstance(self.initial_size, int) or self.initial_size < self.min_size):
            raise ValueError(
                f"MembershipConfig.initial_size must be None or an int >= min_size={self.min_size}, got {self.initial_size!r}"
            )


@dataclass
class _Member:
    id: int
    last_seen: float
    step: int
    joined_at: float
    group: int = -1
    """Replica group id (``-1 - id`` for a member that named none: a group of its own)."""
    group_rank: int = 0
    group_size: int = 1
    synced: bool = False
    """Holds the committed state (committed a step in a generation, or was the formation donor)."""
    session: int = -1
    """The member whose connection speaks for this one: its own id (a flat member, a leader) or its group's leader
    (a follower of a group session, protocol 4). -1: its own (set by :class:`_Live` on insert)."""
    relay_at: str | None = None
    """Where this session's relay listener listens (``hello.relay``, protocol 5): it may be named a relay."""


class _Live(dict[int, _Member]):
    """The live members by id, with two indexes kept in step with every insert and removal so that the per-tick and
    per-join work does not grow with the member count:

    * ``groups[gid][group_rank] = id`` (the live members of each replica group) and ``whole`` (the ids of the groups
      whose every rank is live);
    * ``heard``: ids in the order they were last heard from (least recently first), so heartbeat expiry looks only
      at the members that may have expired. Only session heads (flat members, leaders) are in it: a group session's
      followers are watched by their leader, which reports their death (:meth:`Membership.failure`). ``ordered`` is False once a time went backwards (a caller's clock, or
      :meth:`Membership.forgive`): the next expiry scan then sorts once.
    """

    def __init__(self) -> None:
        super().__init__()
        self.groups: dict[int, dict[int, int]] = {}
        self.whole: set[int] = set()
        self.heard: dict[int, None] = {}
        self.ordered = True
        self._latest = float("-inf")

    def __setitem__(self, mid: int, m: _Member) -> None:
        if mid in self:
            self.pop(mid)
        super().__setitem__(mid, m)
        if m.session < 0:
            m.session = mid
        ranks = self.groups.setdefault(m.group, {})
        ranks[m.group_rank] = mid
        if len(ranks) >= m.group_size:
            self.whole.add(m.group)
        if m.session == mid:  # a follower is never judged by silence here: its leader watches it and reports
            self.touch(mid, m.last_seen)

    def pop(self, mid: int, *default: Any) -> Any:
        m = super().pop(mid, *default)
        if isinstance(m, _Member) and m.id == mid:
            ranks = self.groups.get(m.group)
            if ranks is not None and ranks.get(m.group_rank) == mid:
                del ranks[m.group_rank]
                if not ranks:
                    del self.groups[m.group]
            self.whole.discard(m.group)
            self.heard.pop(mid, None)
        return m

    def __delitem__(self, mid: int) -> None:
        self.pop(mid)

    def clear(self) -> None:
        super().clear()
        self.groups.clear()
        self.whole.clear()
        self.heard.clear()

    def popitem(self) -> tuple[int, _Member]:
        mid = next(reversed(self))
        return mid, self.pop(mid)

    def touch(self, mid: int, at: float) -> None:
        """Member ``mid`` was heard from at ``at``: it moves to the end of ``heard``."""
        self.heard.pop(mid, None)
        self.heard[mid] = None
        if at < self._latest:
            self.ordered = False
        else:
            self._latest = at

    @property
    def latest(self) -> float:
        """The latest time a member was heard at (``touch``)."""
        return self._latest

    def silent_since(self, cutoff: float) -> list[int]:
        """The ids last heard from before ``cutoff``: O(answer) while ``ordered``."""
        if not self.ordered:
            order = sorted(self.heard, key=lambda i: self[i].last_seen)
            self.heard = dict.fromkeys(order)
            self._latest = self[order[-1]].last_seen if order else float("-inf")
            self.ordered = True
        out: list[int] = []
        for mid in self.heard:
            if self[mid].last_seen >= cutoff:
                break
            out.append(mid)
        return out

    def whole_members(self) -> list[int]:
        """The members of the whole replica groups, sorted (``Membership._complete(sorted(live))``)."""
        return sorted(mid for gid in self.whole for mid in self.groups[gid].values())


@dataclass
class Membership:
    """The coordinator's state machine. Call the event methods; then deliver ``outbox`` (``(member id, message)``),
    close the connections in ``to_close`` and send "removed" on the ones in ``to_fence``; clear the three lists.

    Reference of a shrink (no joiners)::

        failure(m)  ->  after settle_s, in tick():  gen += 1; members = sorted(members - failed)
                        outbox += [(s, {"t": "gen", "gen": gen, "members": members, "abort": True, ...}) for s in members]
    """

    config: MembershipConfig
    gen: int = 0
    members: tuple[int, ...] = ()
    step: int = 0
    live: _Live = field(default_factory=_Live)
    removed: dict[int, str] = field(default_factory=dict)
    votes: set[int] = field(default_factory=set)
    dead: set[int] = field(default_factory=set)
    change_at: float | None = None
    change_reasons: list[str] = field(default_factory=list)
    waiting_since: float | None = None
    last_commit_at: float = 0.0
    last_commit_gen: int = 0
    fatal: str | None = None
    term: int = 1
    """This coordinator's term of office (1 for the job's first coordinator; a takeover's term is higher than any
    its members promised, see :mod:`torchnext.ft.election`). Every generation carries it."""
    failover: bool = False
    """Apply the failover rule (2b): set when a member's hello says it knows more than one coordinator address."""
    quorum: list[list[int]] = field(default_factory=list)
    """Replica groups of the last generation that committed a step (the first generation before any commit): the
    reference of the failover rule, sent with every generation as ``quorum``."""
    gen_groups: list[list[int]] = field(default_factory=list)
    """Replica groups of the current generation."""
    min_next_gen: int = 0
    """The next generation's number is at least this (a resumed member knows numbers of another coordinator's)."""
    finished_step: int | None = None
    """The committed step at which the first member finished (None while the job runs); see "finish" above."""
    outbox: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    to_close: list[int] = field(default_factory=list)
    to_fence: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    history: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=HISTORY_EVENTS))
    """The last :data:`HISTORY_EVENTS` records of joins, failures, reports, generations and first commits of a
    generation (``{"event": ..., "at": time.monotonic(), ...}``): step ``s`` was committed by the last generation
    whose first commit is ``<= s``. Bounded: a coordinator in office for weeks of faults keeps the recent ones."""
    _next_id: int = 0
    _pending: dict[int, None] = field(default_factory=dict)
    """Ids that joined and are not members of the current generation (a superset of the live joiners; dead ones are
    dropped when :meth:`_joiners` meets them)."""
    _member_set: frozenset[int] = frozenset()
    _member_set_of: tuple[int, ...] | None = None
    heads: tuple[int, ...] = ()
    """The sessions of the current generation: its members that hold a connection (flat members and the leaders of
    group sessions), sorted. A step commits when every one of them voted; generations and decisions go to them."""
    _base: tuple[int, list[list[int]], frozenset[int]] = (0, [], frozenset())
    """The last generation sent (number, groups) and the sessions it went to: the next one goes to them as a delta
    against it (:meth:`_delta`), to everyone else in full."""
    chunks: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Vote relays of the current generation: relay session -> the sessions of its chunk (itself included)."""
    chunk_of: dict[int, int] = field(default_factory=dict)
    """Session -> the relay of its chunk (the current generation; sessions outside every chunk vote directly)."""
    direct: set[int] = field(default_factory=set)
    """Sessions of a chunk that voted directly in the open round: their decision goes to them directly too."""
    relayed: dict[str, Any] | None = None
    """The last decision, when it went only to relays and direct voters (None once every session is known to hold
    it): sent directly to every chunk's sessions before any later message that could overtake it."""
    _layout: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    """The last generation's relays and chunks (kept across generations, see :meth:`_assign_relays`)."""
    _rotate: bool = False
    """A session reported a failed step since the last layout: the next one rotates every relay."""
    _relay_targets: list[int] = field(default_factory=list)
    """Where a relayed decision goes besides the direct voters: the relays and the sessions outside every chunk."""
    _vouched: dict[int, float] = field(default_factory=dict)
    """Relay -> when it last voted for its whole chunk: every session of it was heard from then. Applied lazily, when
    a session is about to expire (:meth:`tick`): a vouch within the last heartbeat interval counts as heard now (a
    session voting through its relay sends no heartbeat only while it votes at least every interval), an older one as
    heard at the vouch. O(1) per relay vote instead of one update per session."""
    relayed_at: float = float("-inf")
    """When the last decision went out through relays: the chunks' sessions heard from the coordinator then (a
    relayed decision counts as the coordinator's message: the service does not ping them within their ping period)."""

    # ------------------------------------------------------------------------------------------------ events
    def join(self, requested: int | None, step: int, now: float, *, group: int | None = None, group_rank: int = 0,
             group_size: int = 1) -> int:
        """A process asks to join (as rank ``group_rank`` of replica group ``group`` of ``group_size`` ranks, or as
        a group of its own); returns its member id or raises :class:`Rejected`."""
        if self.fatal is not None:
            raise Rejected("fatal", f"the job has failed: {self.fatal}")
        if self.finished_step is not None:
            raise Rejected("finished", f"the job finished at step {self.finished_step}")
        _check_step(step)
        self._check_group(group, group_rank, group_size)
        self._check_id(requested)
        mid = self._insert(requested, step, now, group, group_rank, group_size, None)
        self._maybe_form(now)
        return mid

    def join_group(self, leader: int | None, step: int, followers: list[tuple[int | None, int]], now: float, *,
                   group: int, relay_at: str | None = None) -> list[int]:
        """A group session (protocol 4): leader ``leader`` (rank 0) joins replica group ``group`` with its
        ``followers`` (``(requested id, committed step)`` of ranks 1, 2, ...), all at once; returns the ids by group
        rank. From then on the leader's heartbeats and votes stand for the group (:meth:`vote`), and a follower's
        death is reported by it (:meth:`failure`). ``relay_at``: the leader's relay listener (it may be named a
        relay, protocol 5). All or nothing: any refusal (the reasons of :meth:`join`, or a
        requested id twice) admits nobody. ::

            ids = [join(leader, step, group=group, group_rank=0, group_size=S)]
            ids += [join(f, s, group=group, group_rank=r, group_size=S) for r, (f, s) in enumerate(followers, 1)]
        """
        if self.fatal is not None:
            raise Rejected("fatal", f"the job has failed: {self.fatal}")
        if self.finished_step is not None:
            raise Rejected("finished", f"the job finished at step {self.finished_step}")
        if isinstance(group, bool) or not isinstance(group, int) or group < 0:
            raise Rejected("bad_request", f"a group session needs a replica group id >= 0, got {group!r}")
        size = 1 + len(followers)
        asked = [leader, *(f for f, _ in followers)]
        for rank, (requested, step_r) in enumerate([(leader, step), *followers]):
            _check_step(step_r)
            self._check_group(group, rank, size)
            self._check_id(requested)
        named = [r for r in asked if r is not None]
        if len(set(named)) != len(named):
            raise Rejected("bad_request", f"replica group {group} asks for a member id twice: {named}")
        taken = set(named)  # ids asked for are not handed out to the group's other ranks
        head = self._insert(leader, step, now, group, 0, size, None, avoid=taken)
        self.live[head].relay_at = relay_at
        ids = [head]
        for rank, (requested, step_r) in enumerate(followers, 1):
            ids.append(self._insert(requested, step_r, now, group, rank, size, head, avoid=taken))
        self._maybe_form(now)
        return ids

    def take_office(self, takeover: Takeover, joins: dict[int, tuple[int | None, int, int]], now: float,
                    sessions: dict[int, int] | None = None, relays: dict[int, str] | None = None) -> None:
        """Start in office after a takeover (:mod:`torchnext.ft.election`): the promisers become live members
        (``joins[m] = (group, group_rank, group_size)`` from their hellos; ``sessions[m]``: the leader that reported
        for ``m``, when not ``m`` itself; ``relays[m]``: its relay listener), the pending decisions go out first, then the first generation -- numbered
        above anything a member knows, under ``takeover.term`` -- with ``abort``."""
        self.term = takeover.term
        self.gen = takeover.gen - 1
        self.step = takeover.step
        self.quorum = [list(g) for g in takeover.quorum]
        self.last_commit_gen = self.gen
        self.last_commit_at = now
        for mid in takeover.members:
            group, rank, size = joins[mid]
            gid = -1 - mid if group is None else group
            self.live[mid] = _Member(mid, now, takeover.step, now, group=gid, group_rank=rank, group_size=size,
                                     synced=mid in takeover.synced, session=(sessions or {}).get(mid, mid),
                                     relay_at=(relays or {}).get(mid))
            self._pending[mid] = None
        self._next_id = max([self._next_id, *[m + 1 for m in takeover.members]])
        self.history.append({"event": "takeover", "term": takeover.term, "at": now, "reason": takeover.reason,
                             "latest": takeover.latest.gen, "step": takeover.step})
        sent: set[tuple[int, int]] = set()
        for mid, decision in takeover.decisions:  # a group session's decision goes once, to its leader
            head = self.live[mid].session if mid in self.live else mid
            if (head, decision["step"]) not in sent:
                sent.add((head, decision["step"]))
                self.outbox.append((head, decision))
        self.change_reasons = [takeover.reason]
        self._reconfigure(now)

    def heartbeat(self, mid: int, now: float) -> None:
        m = self.live.get(mid)
        if m is not None:
            m.last_seen = now
            self.live.touch(mid, now)

    def forgive(self, now: float) -> None:
        """The coordinator itself stalled (its loop ran late): count every live member as just heard from."""
        for m in self.live.values():
            m.last_seen = max(m.last_seen, now)
        self.live.ordered = False

    def failure(self, mid: int, now: float, why: str, *, hung: bool) -> None:
        """Member ``mid`` failed: its connection closed (``hung=False``) or it missed heartbeats (``hung=True``:
        its connection is kept, fenced, so it learns it was removed if it resumes)."""
        m = self.live.pop(mid, None)
        if m is None:
            return
        if self.finished_step is not None:  # the job is over: a departure changes nothing
            self.removed[mid] = f"left after the job finished ({why})"
            self.history.append({"event": "left_after_finish", "member": mid, "why": why, "at": now})
            self.to_close.append(mid)
            return
        self.removed[mid] = why
        self.history.append({"event": "failure", "member": mid, "why": why, "hung": hung, "at": now})
        if hung:
            self.to_fence.append((mid, {"t": "removed", "gen": self.gen, "reason": why}))
        else:
            self.to_close.append(mid)
        members = self._members()
        if mid in members:
            self.dead.add(mid)
            self._schedule_change(now, f"member {mid} {why}")
        # shared fate: the rest of its replica group leaves with it (each learns why, then restarts to rejoin)
        for other in sorted(self.live.groups.get(m.group, {}).values()):
            om = self.live.pop(other)
            because = f"your replica group {_group_name(m.group)} lost member {mid} (rank {m.group_rank}: {why})"
            self.removed[other] = because
            self.history.append({"event": "group_failure", "member": other, "group": om.group, "why": because,
                                 "at": now})
            self.to_fence.append((other, {"t": "removed", "gen": self.gen, "reason": because}))
            if other in members:
                self.dead.add(other)

    def leave(self, mid: int, now: float) -> None:
        """Graceful exit (``bye``): like a failure, without the alarm."""
        self.failure(mid, now, "left", hung=False)

    def finish(self, mid: int, now: float) -> None:
        """Member ``mid`` leaves at the end of the job (``bye`` with ``done``); see "finish" in the module docstring.
        Outside a generation, or while a vote round is open, it is an ordinary :meth:`leave`."""
        if mid not in self.live:
            return
        if self.finished_step is None and (self.votes or mid not in self._members() or self.change_at is not None):
            self.leave(mid, now)
            return
        if self.finished_step is None:
            self.finished_step = self.step
            self.change_at = None
            self.change_reasons = []
            self.waiting_since = None
            self._catch_up()
            own = self.live[mid].session
            for m in self.heads:  # the others may still be finishing their loop: a notice, not an abort
                if m != own and m in self.live:
                    self.outbox.append((m, {"t": "finished", "step": self.step, "by": mid}))
            for j in self._joiners():  # processes waiting to join a job that is over
                self.live.pop(j)
                self.removed[j] = "the job finished before it joined"
                self._tell_finished(j, f"member {mid} finished")
                self.to_close.append(j)
        self.live.pop(mid)
        self.removed[mid] = f"finished at step {self.finished_step}"
        self.history.append({"event": "finish", "member": mid, "step": self.finished_step, "at": now})
        self.to_close.append(mid)

    def report_failure(self, mid: int, gen: int, reason: str, now: float, *, end: str | None = None) -> None:
        """A member's collective failed in generation ``gen``: regenerate (stale reports are ignored). After the job
        finished there is nothing to regenerate: the member is told so.

        With ``end`` (a code of :data:`END_CODES`; any other is read as ``"step_failed"``) the member hit an error
        that retrying cannot fix (``ft.step()``'s deterministic errors, its retry cap): the job fails with that code
        -- every live member gets ``fatal`` (``StepFailed``/``RetriesExhausted``), no new generation -- whatever
        generation the report names."""
        if self.finished_step is not None and mid in self.live:
            self._tell_finished(mid, "no new generation")
            return
        if end is not None:
            if mid in self.live:
                code = end if end in END_CODES else "step_failed"
                self.history.append({"event": "end", "member": mid, "gen": gen, "code": code, "reason": reason,
                                     "at": now})
                self._fail_job(code, f"member {mid} ended the job in generation {gen}: {reason}")
            return
        if gen == self.gen and mid in self._members() and mid in self.live:
            self.history.append({"event": "report", "member": mid, "reason": reason, "at": now})
            self._rotate = True  # its relay may be what held the step: name others
            self._schedule_change(now, f"member {mid} reported a failed collective: {reason}")

    def vote(self, mid: int, gen: int, step: int, now: float, *, chunk: bool = False,
             heads: list[int] | None = None) -> None:
        """Member ``mid`` completed step ``step``'s collectives in generation ``gen`` -- for a group session's
        leader: every rank of its group did (the leader collected their votes). The step commits when every session
        of the generation (:attr:`heads`) voted. A relay's vote (protocol 5) stands for sessions of its chunk::

            voters = chunks[mid] if chunk else [h for h in heads if chunk_of.get(h) == mid] if heads else [mid]
            votes |= voters                  # each of them also counts as heard from now (it voted to its relay)
            if votes == set(heads_of_generation): commit

        A relay vote from a session that is not a relay of this generation counts as its own vote only; one for a
        step already decided is ignored. A direct
        vote for the step just committed, whose decision went through relays, gets that decision again (its relay
        lost it)."""
        if self.finished_step is not None and mid in self.live:
            self._tell_finished(mid, "no later step can commit")
            return
        if gen != self.gen or mid not in self._members() or mid not in self.live:
            return  # stale: a newer generation message is on its way to this member
        if step < self.step and (chunk or heads is not None):
            return  # a relay's batch for a step already decided (its channel delivered it late): nothing to count
        if step != self.step:
            last = self.relayed
            if last is not None and (gen, step) == (last["gen"], last["step"]) and self.live[mid].session == mid:
                self.outbox.append((mid, last))
                return
            self.outbox.append((mid, {
                "t": "fatal", "code": "step_mismatch",
                "reason": f"member {mid} voted for step {step} but the committed step count is {self.step}",
            }))
            return
        if self.live[mid].session != mid:
            return  # a follower of a group session never votes itself: its leader votes for the group
        chunk_heads = self.chunks.get(mid) if chunk or heads is not None else None
        if chunk_heads is not None:
            if chunk:  # every session of the chunk voted to its relay just now: as good as a heartbeat (see tick)
                voters = chunk_heads
                self._vouched[mid] = now
            else:
                voters = tuple(h for h in heads or () if self.chunk_of.get(h) == mid)
                for h in voters:
                    self.heartbeat(h, now)
            self.votes.update(voters)
        else:
            self.votes.add(mid)  # only session heads of the generation get here: all voted when the counts match
            if mid in self.chunk_of:
                self.direct.add(mid)
        if len(self.votes) == len(self.heads):
            self._commit(now)

    def next_deadline(self) -> float | None:
        """The earliest pending timer (a settling change), for the server's wait; heartbeats are polled anyway."""
        return self.change_at

    def tick(self, now: float) -> None:
        """Timers: heartbeat expiry, settled changes, quorum timeout, forced grow."""
        cfg = self.config
        cutoff = now - cfg.heartbeat_timeout_s
        for mid in self.live.silent_since(cutoff):
            m = self.live.get(mid)
            if m is None:  # its replica group failed before it in this loop
                continue
            relay = self.chunk_of.get(mid)
            vouched = self._vouched.get(relay, cutoff) if relay is not None else cutoff
            if vouched > cutoff:  # its relay voted for its whole chunk since: heard then (or now, if recent: in
                recent = now - vouched <= cfg.heartbeat_interval_s  # the order of `heard`, no resort)
                self.heartbeat(mid, max(now, self.live.latest) if recent else vouched)
                continue
            silent = now - m.last_seen
            if silent > cfg.heartbeat_timeout_s:
                self.failure(mid, now, f"missed heartbeats for {silent:.3f}s (timeout {cfg.heartbeat_timeout_s}s)",
                             hung=True)
        if self.finished_step is not None:
            return  # nothing to decide once the job is over (silent members were handled above)
        if self.change_at is not None and now >= self.change_at:
            self._reconfigure(now)
        if self.waiting_since is not None and now - self.waiting_since > cfg.quorum_timeout_s:
            self._fail_job("quorum_lost", f"only {len(self.live)} live member(s), fewer than min_size={cfg.min_size}, "
                           f"and no joiner arrived within quorum_timeout_s={cfg.quorum_timeout_s}")
        if not self.gen or self.change_at is not None or self.waiting_since is not None or not self._pending:
            return
        joiners = self._complete(self._joiners())
        if (joiners
                and now - max(self.last_commit_at, min(self.live[j].joined_at for j in joiners)) > cfg.grow_timeout_s):
            self._new_generation(sorted({*self.members, *joiners}), f"grow (idle): joined {joiners}", now, abort=True)

    # ------------------------------------------------------------------------------------------------ internals
    def _check_group(self, group: object, rank: object, size: object) -> None:
        """Refuse a join whose replica-group claim is malformed or disagrees with the groups already known."""
        for name, v, low in (("group_rank", rank, 0), ("group_size", size, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise Rejected("bad_request", f"{name} must be an int >= {low}, got {v!r}")
        assert isinstance(rank, int) and isinstance(size, int)
        if group is None:
            if (rank, size) != (0, 1):
                raise Rejected("bad_request", f"group_rank={rank}, group_size={size} without a replica group id")
        elif isinstance(group, bool) or not isinstance(group, int) or group < 0:
            raise Rejected("bad_request", f"replica group id must be an int >= 0, got {group!r}")
        if rank >= size:
            raise Rejected("bad_request", f"group_rank={rank} is out of range for group_size={size}")
        for other in [next(iter(self.live.values()))] if self.live else []:  # every live member has the same size
            if other.group_size != size:
                raise Rejected("bad_request", (
                    f"replica group {_group_name(-1 if group is None else group)} has {size} rank(s) but replica "
                    f"group {_group_name(other.group)} has {other.group_size}: every replica group needs the same "
                    "shard count (healing copies state shard by shard)"))
        if group is not None:
            taken = self.live.groups.get(group, {}).get(rank)
            if taken is not None:
                raise Rejected("duplicate", f"rank {rank} of replica group {group} is already connected "
                                            f"(member {taken})")

    def _heads_of(self, members: list[int] | tuple[int, ...]) -> tuple[int, ...]:
        """The sessions ``members`` are reached through (each once, sorted): flat members and group leaders."""
        live = self.live
        return tuple(sorted({live[m].session for m in members if m in live}))

    def session_of(self, mid: int) -> int | None:
        """The live member whose connection speaks for ``mid`` (``mid`` itself unless a leader relays for it)."""
        m = self.live.get(mid)
        return None if m is None else m.session

    def _check_id(self, requested: int | None) -> None:
        """Refuse a requested member id that is malformed, banned or connected."""
        if requested is None:
            return
        if not isinstance(requested, int) or isinstance(requested, bool) or requested < 0:
            raise Rejected("bad_request", f"member id must be an int >= 0, got {requested!r}")
        if requested in self.removed:
            raise Rejected(
                "removed",
                f"you were removed: member {requested} was removed from the group ({self.removed[requested]}); "
                "a restarted process must join with a new member id",
            )
        if requested in self.live:
            raise Rejected("duplicate", f"member id {requested} is already connected")

    def _insert(self, requested: int | None, step: int, now: float, group: int | None, rank: int, size: int,
                session: int | None, *, avoid: set[int] | frozenset[int] = frozenset()) -> int:
        """Admit one checked member (an id assigned when ``requested`` is None, never one in ``avoid``)."""
        if requested is None:
            mid = self._next_id
            while mid in self.live or mid in self.removed or mid in avoid:
                mid += 1
        else:
            mid = requested
        self._next_id = max(self._next_id, mid + 1)
        gid = -1 - mid if group is None else group
        self.live[mid] = _Member(mid, now, step, now, group=gid, group_rank=rank, group_size=size,
                                 session=mid if session is None else session)
        self._pending[mid] = None
        self.history.append({"event": "join", "member": mid, "group": gid, "at": now})
        return mid

    def _members(self) -> frozenset[int]:
        """``set(self.members)``, rebuilt only when ``members`` was replaced."""
        if self._member_set_of is not self.members:
            self._member_set = frozenset(self.members)
            self._member_set_of = self.members
        return self._member_set

    def _joiners(self) -> list[int]:
        """Live members outside the current generation, sorted: O(pending joiners), not O(live)."""
        members = self._members()
        keep = [m for m in self._pending if m in self.live and m not in members]
        if len(keep) != len(self._pending):
            self._pending = dict.fromkeys(keep)
        return sorted(keep)

    def _complete(self, candidates: list[int] | tuple[int, ...]) -> list[int]:
        """The members of ``candidates`` whose replica group is whole among them (a group takes part whole)."""
        by_group: dict[int, list[int]] = {}
        for m in candidates:
            by_group.setdefault(self.live[m].group, []).append(m)
        return sorted(m for ms in by_group.values() if len(ms) == self.live[ms[0]].group_size for m in ms)

    def groups_of(self, members: list[int] | tuple[int, ...]) -> list[list[int]]:
        """``members`` as replica groups: one list per group (member ids by group rank), groups ordered by their
        smallest member id (so groups of one keep the members' order)."""
        by_group: dict[int, list[_Member]] = {}
        for m in members:
            by_group.setdefault(self.live[m].group, []).append(self.live[m])
        groups = [[x.id for x in sorted(ms, key=lambda x: x.group_rank)] for ms in by_group.values()]
        return sorted(groups, key=min)

    def _group_count(self, members: list[int]) -> int:
        return len({self.live[m].group for m in members})

    def _quorum_short(self, candidates: list[int]) -> str | None:
        """Why ``candidates`` may not form a generation under the failover rule (2b), or None when they may."""
        if not self.failover or not self.quorum:
            return None
        alive = set(candidates)
        have = sum(1 for g in self.quorum if alive.issuperset(g))
        need = (len(self.quorum) + 1) // 2
        if have >= need:
            return None
        return (f"only {have} of the {len(self.quorum)} replica groups of the last committed generation are left, "
                f"fewer than half ({need}): the others may be training under a coordinator that took office "
                "(failover rule), so this one must not go on")

    def _schedule_change(self, now: float, reason: str) -> None:
        self.change_reasons.append(reason)
        if self.change_at is None:
            self.change_at = now + self.config.settle_s

    def _maybe_form(self, now: float) -> None:
        """After a join: form the first generation, or end a quorum wait. O(1) until enough whole groups are live
        (their count is kept by ``live``), so a formation of N members costs O(N log N), not O(N^2)."""
        whole_groups = len(self.live.whole)
        if self.gen == 0:
            if whole_groups >= (self.config.initial_size or self.config.min_size):
                self._new_generation(self.live.whole_members(), "initial", now, abort=False)
        elif self.waiting_since is not None and whole_groups >= self.config.min_size:
            whole = self.live.whole_members()
            if self._quorum_short(whole) is None:
                self._new_generation(whole, "quorum regained: joined " + str(self._joiners()), now, abort=True)

    def _reconfigure(self, now: float) -> None:
        reason = "; ".join(self.change_reasons)
        self.change_reasons = []
        self.change_at = None
        candidates = self.live.whole_members()  # survivors of the generation + whole joining groups
        short = self._quorum_short(candidates)
        if short is not None:
            self._fail_job("quorum_lost", f"{reason}; {short}")
            return
        if self._group_count(candidates) >= self.config.min_size:
            self._new_generation(candidates, reason, now, abort=True)
            return
        survivors = tuple(m for m in self.members if m in self.live)
        self._catch_up()
        self._drop_relays()
        self.members = survivors
        self.heads = self._heads_of(survivors)
        self.dead.clear()
        self.votes.clear()
        if self.waiting_since is None:
            self.waiting_since = now
        msg = {"t": "wait", "gen": self.gen,
               "reason": _clip(f"{reason}; {self._group_count(candidates)} replica group(s) left, min_size="
                         f"{self.config.min_size}: waiting "
                         f"up to {self.config.quorum_timeout_s}s for joiners")}
        self.history.append({"event": "wait", "at": now, "reason": msg["reason"]})
        for m in self._heads_of(candidates):
            self.outbox.append((m, msg))

    def _new_generation(
        self, members: list[int], reason: str, now: float, *, abort: bool, notify: bool = True
    ) -> dict[str, Any] | None:
        synced = [m for m in members if self.live[m].synced]
        if synced:
            donor = min(synced)
        elif self.gen == 0:  # formation: the member with the most committed steps (lowest id on ties) is the source
            donor = max(members, key=lambda m: (self.live[m].step, -m))
            for m in members:  # its whole replica group holds the state (shard by shard)
                if self.live[m].group == self.live[donor].group:
                    self.live[m].synced = True
            self.step = self.live[donor].step
        else:
            self._fail_job("state_lost", f"every member holding the committed state failed ({reason})")
            return None
        self._catch_up()
        self.gen = max(self.gen + 1, self.min_next_gen)
        self.members = tuple(members)
        self.heads = self._heads_of(members)
        entered = self._members()
        self._pending = {m: None for m in self._pending if m not in entered and m in self.live}
        self.votes.clear()
        self.dead.clear()
        self.change_at = None
        self.change_reasons = []
        self.waiting_since = None
        groups = self.groups_of(members)
        self.gen_groups = groups
        if not self.quorum:  # the first generation is its own quorum until it commits
            self.quorum = groups
        donors = next(g for g in groups if donor in g)  # the donor group: rank r heals rank r of each joining group
        msg: dict[str, Any] = {
            "t": "gen", "gen": self.gen, "members": list(members), "step": self.step, "donor": donor,
            "joiners": [m for m in members if not self.live[m].synced], "abort": abort, "reason": _clip(reason),
            "groups": groups, "donors": donors, "term": self.term, "quorum": self.quorum,
        }
        self.history.append({"event": "generation", "gen": self.gen, "members": list(members), "reason": reason,
                             "at": now, "abort": abort, "term": self.term})
        base, base_groups, holders = self._base
        self._base = (self.gen, groups, frozenset(self.heads))  # after this, every session holds this generation
        if notify:
            delta = self._delta(msg, base, base_groups) if holders else None
            for m in self.heads:
                self.outbox.append((m, delta if delta is not None and m in holders else msg))
            self._assign_relays()
        else:
            self._drop_relays()  # the caller sends it inside a decision, then assigns
        return msg

    def _drop_relays(self) -> None:
        self.chunks, self.chunk_of, self.direct, self._vouched, self._relay_targets = {}, {}, set(), {}, []

    def _assign_relays(self) -> None:
        """Name the relays of the current generation (protocol 5) and tell each chunk's sessions. Reference::

            capable = [h for h in heads if h offered a relay listener]          # sorted
            if len(capable) < relay_min_groups: no relays
            k = relay_fanout or max(64, ceil(sqrt(len(capable))))
            if the last layout exists and no session reported a failed step since (:meth:`_keep_layout`):
                every chunk keeps its live sessions and its relay (a relay that left: kept[gen % len(kept)]);
                new sessions fill chunks below k, then new chunks of k;
                unless some chunk ends below k // 2 or above 2 * k
            else:                                    # the first, after a report (a relay may have held a step), or
                for chunk in (capable[i:i + k] for i in range(0, len(capable), k)):     # out of balance
                    relay = chunk[gen % len(chunk)]          # rotates with the generation
            a chunk of one votes directly

        Kept chunks keep their channels: a generation after a failure re-opens only the channels of the chunks it
        changed."""
        rotate, self._rotate = self._rotate, False
        self._drop_relays()
        live = self.live
        capable = [h for h in self.heads if live[h].relay_at]
        if len(capable) < self.config.relay_min_groups:
            self._layout = []
            return
        k = self.config.relay_fanout or max(64, math.isqrt(len(capable) - 1) + 1)
        layout = None if rotate or not self._layout else self._keep_layout(capable, k)
        if layout is None:
            layout = []
            for i in range(0, len(capable), k):
                chunk = tuple(capable[i:i + k])
                layout.append((chunk[self.gen % len(chunk)], chunk))
        self._layout = layout
        for relay, chunk in layout:
            if len(chunk) < 2:
                continue  # a chunk of one: it votes directly
            msg = {"t": "relay", "gen": self.gen, "relay": relay, "at": live[relay].relay_at, "chunk": list(chunk)}
            self.chunks[relay] = chunk
            for h in chunk:
                self.chunk_of[h] = relay
                self.outbox.append((h, msg))
        self._relay_targets = [h for h in self.heads if h in self.chunks or h not in self.chunk_of]

    def _keep_layout(self, capable: list[int], k: int) -> list[tuple[int, tuple[int, ...]]] | None:
        """The last layout with the sessions that left taken out and the new ones added (see
        :meth:`_assign_relays`); None when it is out of balance."""
        alive = set(capable)
        chunks: list[tuple[int, list[int]]] = []
        placed: set[int] = set()
        for relay, chunk in self._layout:
            kept = [h for h in chunk if h in alive]
            if not kept:
                continue
            chunks.append((relay if relay in alive else kept[self.gen % len(kept)], kept))
            placed.update(kept)
        new = [h for h in capable if h not in placed]
        for _, kept in chunks:
            while new and len(kept) < k:
                kept.append(new.pop(0))
        for i in range(0, len(new), k):
            part = new[i:i + k]
            chunks.append((part[self.gen % len(part)], part))
        if any(len(c) > 2 * k or len(c) < k // 2 for _, c in chunks[:-1]):
            return None
        return [(relay, tuple(sorted(c))) for relay, c in chunks]

    def _catch_up(self) -> None:
        """Before a message that could overtake a decision on its way through a relay (a generation, ``wait``,
        ``finished``): every session of a chunk gets that decision directly first (a duplicate is ignored: decisions
        carry their generation and step)."""
        last, self.relayed = self.relayed, None
        if last is None:
            return
        for h in self.chunk_of:
            if h not in self.chunks and h not in self.direct and h in self.live:
                self.outbox.append((h, last))

    def _delta(self, msg: dict[str, Any], base: int, base_groups: list[list[int]]) -> dict[str, Any] | None:
        """``msg`` as a delta against generation ``base`` (protocol 4, :data:`~torchnext.ft._wire.GEN_MESSAGE`),
        for the sessions that hold it: the ids leaving and the groups joining instead of every group. None when the
        full form is not larger."""
        old = {tuple(g) for g in base_groups}
        new = {tuple(g) for g in msg["groups"]}
        add = [g for g in msg["groups"] if tuple(g) not in old]
        drop = sorted(m for g in old - new for m in g)
        if len(drop) + sum(len(g) for g in add) >= len(msg["members"]):
            return None
        delta: dict[str, Any] = {k: msg[k] for k in ("t", "gen", "step", "donor", "joiners", "abort", "reason",
                                                      "term")}
        delta.update(base=base, drop=drop, add=add)
        if msg["quorum"] == base_groups and msg["quorum"] != msg["groups"]:
            delta["quorum_base"] = True
        elif msg["quorum"] != msg["groups"]:
            delta["quorum"] = msg["quorum"]
        return delta

    def _commit(self, now: float) -> None:
        old = self.members
        old_heads = self.heads
        decided = self.step
        self.step += 1
        self.votes.clear()
        first = self.last_commit_gen != self.gen
        if first:
            self.last_commit_gen = self.gen
            self.quorum = self.gen_groups  # the failover rule's reference moves to the generation that committed
            self.history.append({"event": "first_commit", "gen": self.gen, "step": decided, "at": now,
                                 "term": self.term})
        self.last_commit_at = now
        if first:  # later commits of the generation find every member synced already
            for m in old:
                self.live[m].synced = True
        decision: dict[str, Any] = {"t": "decision", "gen": self.gen, "step": decided, "committed": self.step}
        self.relayed = None  # every session voted for this step: each holds the decision before it
        direct, chunks = self.direct, self.chunks
        self.direct = set()
        joiners = self._complete(self._joiners())
        if joiners and self.change_at is None:
            nxt = self._new_generation(sorted({*old, *joiners}), f"grow: joined {joiners}", now, abort=False,
                                       notify=False)
            if nxt is not None:
                decision["next"] = nxt
                for j in self._heads_of(joiners):
                    self.outbox.append((j, nxt))
        if chunks and "next" not in decision:  # through the relays: to them, and to the sessions that voted directly
            self.relayed = decision
            self.relayed_at = now
            self.outbox += [(m, decision) for m in self._relay_targets]
            self.outbox += [(m, decision) for m in direct if m not in chunks]
        else:  # a decision with the next generation goes to every session itself (a delta may follow it)
            for m in old_heads:
                self.outbox.append((m, decision))
            if "next" in decision:
                self._assign_relays()

    def _tell_finished(self, mid: int, why: str) -> None:
        """Member ``mid`` learns that the job is over (a ``fatal`` with code ``finished``: ``JobFinished``)."""
        self.outbox.append((mid, {"t": "fatal", "code": "finished",
                                  "reason": f"the job finished at step {self.finished_step}: {why}"}))

    def _fail_job(self, code: str, reason: str) -> None:
        self.fatal = reason
        self.history.append({"event": "fatal", "code": code, "reason": reason, "at": time.monotonic()})
        for m in list(self.live):
            self.outbox.append((m, {"t": "fatal", "code": code, "reason": _clip(reason)}))
            self.to_close.append(m)
        self.live.clear()
        self.waiting_since = None
        self.change_at = None


MAX_REASON = 1500
"""Longest reason a message carries (the wire allows 2,000 characters): a generation after hundreds of simultaneous
failures joins hundreds of reasons; the full text stays in ``history``."""


def _check_step(step: object) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise Rejected("bad_request", f"step must be an int >= 0, got {step!r}")


def _clip(reason: str) -> str:
    """``reason`` cut to :data:`MAX_REASON` characters, saying how much was left out."""
    if len(reason) <= MAX_REASON:
        return reason
    return reason[: MAX_REASON - 40] + f" ... ({len(reason) - MAX_REASON + 40} more characters)"


def _group_name(gid: int) -> str:
    """A replica group as users know it: its id, or "of member m" for a member's own group."""
    return str(gid) if gid >= 0 else f"of member {-1 - gid}"
