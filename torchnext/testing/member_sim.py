"""A member simulator: thousands of light members in a few processes, speaking the coordinator's real protocol.

Each simulated member is one TCP connection to a real coordinator (``torchnext coordinator``, see
:class:`~torchnext.testing.coordinators.CoordinatorProcess`), authenticated with the job token exactly as
:class:`~torchnext.ft.member.MemberClient` does it (challenge, ``hello`` with ``mac(token, "member", ...)``, the
welcome's proof verified back) and using the package's own wire functions (:mod:`torchnext.ft._wire`: ``encode``,
``LineReader``, ``check`` against ``COORDINATOR_MESSAGES``). Members have no training state: they join as rank ``r``
of replica group ``g``, heartbeat every ``heartbeat_interval_s`` the welcome gave them, vote for each step's commit
and receive generations. ``processes`` worker processes each serve ``ranks / processes`` members from one selector
loop; heartbeats are spread over the interval in ten slots.

Reference of one commit round (what :meth:`MemberSim.commit` measures)::

    for each member m (all processes, no barrier between them):
        send {"t": "vote", "gen": m.gen, "step": m.committed}        # t_vote[s] = the first such send
        wait for {"t": "decision", "step": m.committed, ...}        # t_done[s] = the last such receipt
        m.committed += 1; vote again at once (steps left)
    round[s] = max over processes of t_done[s] - min over processes of t_vote[s]   # time.monotonic(): one clock

Failure injection (:meth:`MemberSim.kill_group`): :attr:`KillMode.CRASH` closes the group's sockets (the coordinator
sees EOF at once); :attr:`KillMode.HANG` stops their heartbeats and reads, sockets left open (the coordinator must
notice the silence: ``heartbeat_timeout_s``). :meth:`MemberSim.await_generation` then times the next generation's
arrival at every surviving member.

Workers are forked by default (:attr:`SimConfig.start_method`): they run only the stdlib and the wire functions.
The simulator's own CPU competes with the coordinator's on a small machine; every result carries ``sim_late_s``,
the worst lateness of the simulator's own heartbeats, so that a member removed for silence can be told apart from a
coordinator that lost it.

Joins are paced: at most ``max_handshakes`` unauthenticated connections per process at once, because the
coordinator closes the oldest unauthenticated connection beyond
:data:`~torchnext.ft.service.MAX_UNAUTHENTICATED` (64); a connection closed before its welcome is retried after
0.1 s, as a real member's first join does.

Example::

    with CoordinatorProcess(token, initial_size=8) as coord, \\
            MemberSim(SimConfig(address=coord.address, token=token, ranks=64, group_size=8)) as sim:
        formed = sim.join(timeout_s=30)              # formed.ok, formed.members, formed.formation_s
        rounds = sim.commit(20, timeout_s=30)        # rounds.committed == 20, rounds.rounds_s
        t = sim.kill_group(3, KillMode.HANG)
        nxt = sim.await_generation(formed.gen, timeout_s=10)   # nxt.members excludes group 3's ids
"""

from __future__ import annotations

import enum
import errno
import multiprocessing as mp
import os
import selectors
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from torchnext.ft._wire import (
    COORDINATOR_MESSAGES,
    PROTOCOL_VERSION,
    LineReader,
    ProtocolError,
    check,
    encode,
    mac,
    new_nonce,
    tune_socket,
    verify,
)
from torchnext.ft.member import parse_address

__all__ = ["Commits", "Formation", "Generation", "KillMode", "MemberSim", "SimConfig", "SimError"]

_SLOTS = 10
"""Heartbeat slots per interval: member ``i`` of a process heartbeats in slot ``i % _SLOTS``."""
_RETRY_S = 0.1
"""A handshake that failed (connection closed or refused before the welcome) is retried after this long."""


class SimError(RuntimeError):
    """A simulator process failed (died, or did not answer a command within its bound)."""


class KillMode(str, enum.Enum):
    """How :meth:`MemberSim.kill_group` kills a group's members."""

    CRASH = "crash"
    """Close the sockets (a crashed process: the coordinator reads EOF)."""
    HANG = "hang"
    """Stop heartbeating and reading, keep the sockets open (a hung process: only its silence tells)."""


@dataclass(kw_only=True, slots=True)
class SimConfig:
    """What to simulate."""

    address: str
    """The coordinator's membership address (``host:port``; loopback in tests)."""
    token: str
    """The job token the members prove they know (a wrong one: every join is refused with code ``auth``)."""
    ranks: int
    """Simulated members in all (a multiple of ``group_size``)."""
    group_size: int = 8
    """Members per replica group (group ``g`` is ranks ``g * group_size .. (g + 1) * group_size - 1``)."""
    processes: int = 2
    """Worker processes (at most one per group); each runs one selector loop for its members."""
    max_handshakes: int = 16
    """Unauthenticated connections per process at once (``processes * max_handshakes`` should stay below the
    coordinator's ``MAX_UNAUTHENTICATED`` = 64, or it sheds joins)."""
    start_method: str = "fork"
    """How worker processes start (``multiprocessing``): ``"fork"`` (the default) costs no import -- a worker only
    runs the stdlib and :mod:`torchnext.ft._wire`, never the parent's threads or torch; ``"spawn"`` or
    ``"forkserver"`` import torchnext afresh (seconds each) and need the ``if __name__ == "__main__":`` guard."""
    start_timeout_s: float = 60.0
    """Bound on a worker process's start."""

    def __post_init__(self) -> None:
        parse_address(self.address)
        if not isinstance(self.token, str) or not self.token:
            raise ValueError("SimConfig.token must be a non-empty string")
        for name in ("ranks", "group_size", "processes", "max_handshakes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SimConfig.{name} must be an int >= 1, got {value!r}")
        if self.ranks % self.group_size:
            raise ValueError(f"SimConfig.ranks={self.ranks} is not a multiple of group_size={self.group_size}")
        if self.start_method not in mp.get_all_start_methods():
            raise ValueError(f"SimConfig.start_method must be one of {mp.get_all_start_methods()}, got "
                             f"{self.start_method!r}")
        if not self.start_timeout_s > 0:
            raise ValueError(f"SimConfig.start_timeout_s must be > 0, got {self.start_timeout_s!r}")

    @property
    def groups(self) -> int:
        return self.ranks // self.group_size


@dataclass(kw_only=True, slots=True)
class Formation:
    """The result of :meth:`MemberSim.join`."""

    ok: bool
    """Every member was welcomed and received the same first generation, holding all ``ranks`` members."""
    formation_s: float | None
    """First connection attempt -> the last member's receipt of that generation (None unless ``ok``)."""
    gen: int
    """The generation number the members hold (the highest seen; 0: none)."""
    members: list[int]
    """That generation's member ids."""
    ids: dict[int, list[int]]
    """Replica group -> its members' ids by group rank (welcomed members only)."""
    rejected: dict[str, int]
    """Refusal code -> members refused with it (``auth``: wrong token)."""
    retries: int
    """Handshakes retried (closed or refused before the welcome)."""
    reason: str = ""
    """Why not ``ok``."""
    sim_late_s: float = 0.0
    """The simulator's own worst heartbeat lateness so far (all processes): a member removed for silence while this
    approaches ``heartbeat_timeout_s - heartbeat_interval_s`` was starved on the simulator's side, not lost by the
    coordinator."""


@dataclass(kw_only=True, slots=True)
class Commits:
    """The result of :meth:`MemberSim.commit`."""

    ok: bool
    """Every member of the generation received every decision."""
    committed: int
    """Steps every member saw committed in this call."""
    rounds_s: list[float]
    """Per committed step: the round (see the module docstring)."""
    messages: int
    """Messages sent to and received from the coordinator by all members during the call (heartbeats, pings,
    votes, decisions)."""
    reason: str = ""
    sim_late_s: float = 0.0
    """As :attr:`Formation.sim_late_s`."""


@dataclass(kw_only=True, slots=True)
class Generation:
    """The result of :meth:`MemberSim.await_generation`."""

    ok: bool
    """Every live member received one generation newer than ``after``, the same one."""
    gen: int
    members: list[int]
    received_at: float | None
    """``time.monotonic()`` when the last live member received it."""
    first_at: float | None = None
    """``time.monotonic()`` when the first live member received it."""
    reason: str = ""
    sim_late_s: float = 0.0
    """As :attr:`Formation.sim_late_s`."""


class MemberSim:
    """The simulated members of one job (see the module docstring). ``start()`` (or ``with``) launches the worker
    processes; ``close()`` stops and reaps them (SIGKILL after a bound). Every call is bounded by its
    ``timeout_s`` (plus a few seconds for the processes to answer) and raises :class:`SimError` if a worker dies or
    does not answer."""

    def __init__(self, config: SimConfig) -> None:
        if not isinstance(config, SimConfig):
            raise TypeError(f"config must be a SimConfig, got {type(config).__name__}")
        self.config = config
        n = min(config.processes, config.groups)
        per = [config.groups // n + (1 if i < config.groups % n else 0) for i in range(n)]
        starts = [sum(per[:i]) for i in range(n)]
        self._ranges = [(s, s + p) for s, p in zip(starts, per, strict=True)]
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self.ids: dict[int, list[int]] = {}

    # ------------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> MemberSim:
        ctx: Any = mp.get_context(self.config.start_method)  # BaseContext declares no Process
        try:
            for lo, hi in self._ranges:
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_worker_main, args=(child, _config_dict(self.config), lo, hi),
                                   name=f"member-sim[{lo}:{hi}]", daemon=True)
                proc.start()
                child.close()
                self._procs.append(proc)
                self._conns.append(parent)
            self._gather(self.config.start_timeout_s, "start")
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop every worker (its members' sockets close) and reap it. Idempotent."""
        for conn in self._conns:
            try:
                conn.send(("stop", {}))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def __enter__(self) -> MemberSim:
        return self.start() if not self._procs else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------------------------------------------- calls
    def join(self, *, timeout_s: float) -> Formation:
        """Connect and join every member; return once each one holds a generation, was refused or failed, or after
        ``timeout_s``. ``ok`` means the first generation holds all ``ranks`` members and every member holds it."""
        replies = self._call("join", timeout_s)
        ids: dict[int, list[int]] = {}
        rejected: Counter[str] = Counter()
        errors: list[str] = []
        failed = 0
        for r in replies:
            failed += r["failed"]
            ids.update({int(g): v for g, v in r["ids"].items()})
            rejected.update(r["rejected"])
            errors += r["errors"]
        self.ids = ids
        gens = {r["gen"] for r in replies}
        lists = [r["members"] for r in replies if r["members"] is not None]
        gen = max(gens)
        members = lists[0] if lists else []
        n = self.config.ranks
        holding = sum(r["holding"] for r in replies)
        reason = ""
        if rejected:
            reason = f"joins refused: {dict(rejected)}"
        elif errors:
            reason = f"{failed} member(s) failed, e.g. {errors[0]}"
        elif holding < n:
            welcomed = sum(len(v) for v in ids.values())
            reason = (f"only {holding} of {n} members received a generation within {timeout_s}s ({welcomed} were "
                      "welcomed)")
        elif len(gens) != 1 or any(x != members for x in lists):
            reason = f"the members hold different generations: {sorted(gens)}"
        elif len(members) != n:
            reason = f"generation {gen} holds {len(members)} members, not {n}"
        ok = not reason
        t0 = min(r["t_start"] for r in replies)
        t1 = max(r["t_last"] for r in replies)
        return Formation(ok=ok, formation_s=(t1 - t0) if ok else None, gen=gen, members=members, ids=ids,
                         rejected=dict(rejected), retries=sum(r["retries"] for r in replies), reason=reason,
                         sim_late_s=_late(replies))

    def commit(self, steps: int, *, timeout_s: float) -> Commits:
        """Every member of the current generation votes for ``steps`` consecutive steps, each vote sent as soon as
        that member received the previous decision (see the module docstring); returns once every member got
        every decision, a member was interrupted (a new generation, removed, fatal), or after ``timeout_s``."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        replies = self._call("steps", timeout_s, steps=steps)
        active = [r for r in replies if r["voters"]]
        committed = min((r["committed"] for r in active), default=0)
        rounds = [max(r["t_done"][k] for r in active) - min(r["t_vote"][k] for r in active)
                  for k in range(committed)]
        reasons = [r["reason"] for r in replies if r["reason"]]
        ok = committed == steps and not reasons
        reason = reasons[0] if reasons else ("" if ok else f"{committed} of {steps} steps committed")
        return Commits(ok=ok, committed=committed, rounds_s=rounds, messages=sum(r["messages"] for r in replies),
                       reason=_explain(reason, replies), sim_late_s=_late(replies))

    def kill_group(self, group: int, mode: KillMode = KillMode.CRASH) -> float:
        """Kill replica group ``group`` (all its members, see :class:`KillMode`); returns ``time.monotonic()`` at
        the kill."""
        if not 0 <= group < self.config.groups:
            raise ValueError(f"group must be in [0, {self.config.groups}), got {group!r}")
        mode = KillMode(mode)
        i = next(i for i, (lo, hi) in enumerate(self._ranges) if lo <= group < hi)
        (reply,) = self._call("kill", 5.0, only=i, group=group, mode=mode.value)
        return float(reply["t_kill"])

    def await_generation(self, after: int, *, timeout_s: float) -> Generation:
        """Wait until every live member (not killed, not removed) received a generation newer than ``after``."""
        replies = self._call("await_gen", timeout_s, after=after)
        reasons = [r["reason"] for r in replies if r["reason"]]
        gens = {r["gen"] for r in replies if r["live"]}
        lists = [r["members"] for r in replies if r["live"]]
        if not reasons and (len(gens) != 1 or any(x != lists[0] for x in lists)):
            reasons.append(f"the live members hold different generations: {sorted(gens)}")
        ok = not reasons
        return Generation(ok=ok, gen=max(gens, default=0), members=lists[0] if lists else [],
                          received_at=max(r["t_last"] for r in replies if r["live"]) if ok else None,
                          first_at=min(r["t_first"] for r in replies if r["live"]) if ok else None,
                          reason=_explain(reasons[0] if reasons else "", replies), sim_late_s=_late(replies))

    def messages(self) -> int:
        """Messages the members sent to and received from the coordinator so far (all processes)."""
        return sum(r["messages"] for r in self._call("counters", 5.0))

    # ---------------------------------------------------------------------------------------------- plumbing
    def _call(self, cmd: str, timeout_s: float, *, only: int | None = None, **kw: Any) -> list[dict[str, Any]]:
        if not self._conns:
            raise SimError(f"MemberSim.{cmd}: the simulator is not started")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        targets = range(len(self._conns)) if only is None else [only]
        for i in targets:
            self._conns[i].send((cmd, {**kw, "deadline": time.monotonic() + timeout_s}))
        return self._gather(timeout_s + 10.0, cmd, targets)

    def _gather(self, bound: float, what: str, targets: range | list[int] | None = None) -> list[dict[str, Any]]:
        deadline = time.monotonic() + bound
        out = []
        for i in targets if targets is not None else range(len(self._conns)):
            conn, proc = self._conns[i], self._procs[i]
            try:
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    raise SimError(f"member-sim process {i} did not answer {what!r} within {bound:.0f}s")
                reply = conn.recv()
            except (EOFError, OSError) as exc:
                raise SimError(f"member-sim process {i} died during {what!r} (exit code {proc.exitcode}): {exc}"
                               ) from None
            if "error" in reply:
                raise SimError(f"member-sim process {i} failed in {what!r}: {reply['error']}")
            out.append(reply)
        return out


def _late(replies: list[dict[str, Any]]) -> float:
    return max((float(r["late"]) for r in replies), default=0.0)


def _explain(reason: str, replies: list[dict[str, Any]]) -> str:
    """``reason`` plus the members' states and a removed/failed member's error (empty when ``reason`` is)."""
    if not reason:
        return ""
    states: Counter[str] = Counter()
    for r in replies:
        states.update(r["states"])
    why = next((r["why"] for r in replies if r["why"]), "")
    return f"{reason} (members: {dict(states)}{'; ' + why if why else ''})"


def _config_dict(cfg: SimConfig) -> dict[str, Any]:
    return {"address": cfg.address, "token": cfg.token, "group_size": cfg.group_size,
            "max_handshakes": cfg.max_handshakes}


# ------------------------------------------------------------------------------------------ the worker process
class _Member:
    __slots__ = ("challenge", "committed", "error", "gen", "group", "id", "members", "nonce", "out", "rank", "reader",
                 "retry_at", "since", "slot", "sock", "state", "t_gen", "voted")

    def __init__(self, group: int, rank: int, slot: int) -> None:
        self.group, self.rank, self.slot = group, rank, slot
        self.sock: socket.socket | None = None
        self.reader = LineReader()
        self.out = b""
        self.state = "new"
        """new, queued, shaking (connected, waiting for challenge/welcome), joined, rejected, failed, killed,
        hung, removed."""
        self.id = -1
        self.nonce = ""
        self.challenge = ""
        self.gen = 0
        self.members: list[int] | None = None
        self.committed = 0
        self.t_gen = 0.0
        self.retry_at = 0.0
        self.since = 0.0
        self.error = ""
        self.voted: int | None = None


_DONE = frozenset({"joined", "rejected", "failed", "killed", "hung", "removed"})


@dataclass
class _Stats:
    sent: int = 0
    received: int = 0
    retries: int = 0
    late: float = 0.0
    """The most a heartbeat slot was sent after its time (this process's own lateness)."""
    t_start: float = 0.0
    rejected: Counter[str] = field(default_factory=Counter)


class _Worker:
    """One process's members and their selector loop. Commands come from the parent's pipe; each is answered once
    its condition holds or its deadline passed."""

    def __init__(self, conn: Connection, cfg: dict[str, Any], lo: int, hi: int) -> None:
        self.conn = conn
        self.addr = parse_address(cfg["address"])
        self.token = str(cfg["token"])
        self.max_handshakes = int(cfg["max_handshakes"])
        self.group_size = gsize = int(cfg["group_size"])
        self.members = [_Member(g, r, i % _SLOTS) for i, (g, r) in
                        enumerate((g, r) for g in range(lo, hi) for r in range(gsize))]
        self.slots: list[list[_Member]] = [[m for m in self.members if m.slot == s] for s in range(_SLOTS)]
        self.sel = selectors.DefaultSelector()
        self.sel.register(conn.fileno(), selectors.EVENT_READ, None)
        self.stats = _Stats()
        self.interval = 0.1
        self.next_slot = 0.0
        self.slot = 0
        self.shaking = 0
        self.queue: list[_Member] = []
        self.pending: tuple[str, dict[str, Any]] | None = None
        self.cache: dict[tuple[Any, ...], tuple[dict[str, Any], dict[str, Any]]] = {}
        self.hb = encode({"t": "hb"})
        self.votes: dict[tuple[int, int], bytes] = {}
        self.steps: dict[str, Any] = {}
        self.next_check = 0.0
        self.running = True

    # -------------------------------------------------------------------------------------------------- loop
    def run(self) -> None:
        self.conn.send({"ready": True, "pid": os.getpid()})
        try:
            while self.running:
                now = time.monotonic()
                wait = 0.05
                if self.next_slot:
                    wait = min(wait, max(0.0, self.next_slot - now))
                for key, events in self.sel.select(timeout=wait):
                    if self.next_slot and time.monotonic() >= self.next_slot:  # a long batch must not delay them
                        self._heartbeat_slot(time.monotonic())
                    if key.data is None:
                        self._command()
                    else:
                        m: _Member = key.data
                        if events & selectors.EVENT_WRITE:
                            self._flush(m)
                        if events & selectors.EVENT_READ and m.sock is not None and m.state in ("shaking", "joined"):
                            self._readable(m)
                now = time.monotonic()
                if self.next_slot and now >= self.next_slot:
                    self._heartbeat_slot(now)
                self._connect_more(now)
                if self.pending is not None and (self.pending[0] == "steps" or now >= self.next_check):
                    self.next_check = now + 0.005  # join/await_gen conditions scan every member: not every event
                    self._check_pending(now)
        finally:
            for m in self.members:
                self._drop(m)

    def _heartbeat_slot(self, now: float) -> None:
        self.stats.late = max(self.stats.late, now - self.next_slot)
        for m in self.slots[self.slot]:
            if m.state == "joined":
                self._send(m, self.hb)
        self.slot = (self.slot + 1) % _SLOTS
        self.next_slot += self.interval / _SLOTS
        if self.next_slot < now - self.interval:  # we fell behind by a whole interval: do not burst
            self.next_slot = now

    # ---------------------------------------------------------------------------------------------- commands
    def _command(self) -> None:
        try:
            cmd, kw = self.conn.recv()
        except (EOFError, OSError):
            self.running = False
            return
        now = time.monotonic()
        if cmd == "stop":
            self.running = False
            self.conn.send({"stopped": True})
            return
        if cmd == "counters":
            self.conn.send({"messages": self.stats.sent + self.stats.received})
            return
        if cmd == "kill":
            self.conn.send(self._kill(int(kw["group"]), str(kw["mode"])))
            return
        if cmd == "join":
            self.stats.t_start = now
            for m in self.members:
                if m.state == "new":
                    m.state = "queued"
                    self.queue.append(m)
            self.queue.reverse()  # popped from the end: group 0 rank 0 first
        elif cmd == "steps":
            in_gen: dict[int, set[int]] = {}
            for m in self.members:
                if m.state == "joined" and m.members is not None and m.gen not in in_gen:
                    in_gen[m.gen] = set(m.members)
            voters = [m for m in self.members if m.state == "joined" and m.id in in_gen.get(m.gen, ())]
            n = int(kw["steps"])
            self.steps = {"n": n, "voters": voters, "base": {m.id: m.committed for m in voters},
                          "t_vote": [float("inf")] * n, "t_done": [0.0] * n, "left": [len(voters)] * n,
                          "messages": self.stats.sent + self.stats.received, "reason": ""}
            for m in voters:
                self._vote(m, now)
        elif cmd != "await_gen":
            self.conn.send({"error": f"unknown command {cmd!r}"})
            return
        self.pending = (cmd, kw)
        self._check_pending(now)

    def _check_pending(self, now: float) -> None:
        assert self.pending is not None
        cmd, kw = self.pending
        late = now >= kw["deadline"]
        reply: dict[str, Any] | None = None
        if cmd == "join":
            done = all(m.state in _DONE and (m.state != "joined" or m.gen) for m in self.members)
            if done or late:
                reply = self._join_reply()
        elif cmd == "steps":
            st = self.steps
            if not st["voters"] or st["left"][-1] == 0 or st["reason"] or late:
                committed = next((k for k, left in enumerate(st["left"]) if left), st["n"])
                reason = st["reason"] or ("no member of this process is in the generation it holds" if not
                                          st["voters"] else "" if committed == st["n"] else
                                          f"{st['left'][committed]} member(s) of this process had no decision for "
                                          f"step {committed} of the call within the timeout")
                reply = {"voters": len(st["voters"]), "committed": committed, "t_vote": st["t_vote"],
                         "t_done": st["t_done"], "reason": reason,
                         "messages": self.stats.sent + self.stats.received - st["messages"]}
                for m in st["voters"]:
                    m.voted = None
        elif cmd == "await_gen":
            after = int(kw["after"])
            live = [m for m in self.members if m.state == "joined"]
            if all(m.gen > after for m in live) or late:
                behind = [m for m in live if m.gen <= after]
                gens = {m.gen for m in live}
                reply = {"live": len(live), "gen": max(gens, default=0),
                         "members": live[0].members if live else None,
                         "t_last": max((m.t_gen for m in live), default=0.0),
                         "t_first": min((m.t_gen for m in live), default=0.0),
                         "reason": (f"{len(behind)} live member(s) of this process had no generation after {after} "
                                    "within the timeout") if behind else
                                   (f"live members hold generations {sorted(gens)}" if len(gens) > 1 else "")}
        if reply is not None:
            self.pending = None
            reply["late"] = self.stats.late
            reply["states"] = dict(Counter(m.state for m in self.members))
            reply["why"] = next((f"member {m.id}: {m.error}" for m in self.members
                                 if m.state in ("failed", "removed")), "")
            self.conn.send(reply)

    def _join_reply(self) -> dict[str, Any]:
        ids: dict[int, list[int]] = {}
        for m in self.members:
            if m.id >= 0:
                ids.setdefault(m.group, []).append(m.id)
        holding = [m for m in self.members if m.state == "joined" and m.gen]
        top = max(holding, key=lambda m: m.gen, default=None)
        errors = [f"group {m.group} rank {m.rank}: {m.error}" for m in self.members if m.state in ("failed", "removed")]
        return {"ids": ids, "rejected": dict(self.stats.rejected), "errors": errors[:5], "failed": len(errors),
                "holding": len(holding),
                "gen": top.gen if top else 0, "members": top.members if top else None,
                "t_start": self.stats.t_start, "t_last": max((m.t_gen for m in holding), default=0.0),
                "retries": self.stats.retries}

    def _kill(self, group: int, mode: str) -> dict[str, Any]:
        t = time.monotonic()
        for m in self.members:
            if m.group == group and m.state in ("joined", "shaking", "queued"):
                if mode == KillMode.HANG.value and m.state == "joined" and m.sock is not None:
                    m.state = "hung"
                    self.sel.unregister(m.sock)  # no reads, no writes: the socket stays open, silent
                else:
                    self._drop(m)
                    m.state = "killed"
        return {"t_kill": t}

    # --------------------------------------------------------------------------------------------- members
    def _connect_more(self, now: float) -> None:
        # A slow handshake is not abandoned (as a real member's first join, it may take until the join's deadline:
        # closing it after the coordinator welcomed it would be a member's crash).
        while self.queue and self.shaking < self.max_handshakes:
            m = self.queue[-1]
            if m.retry_at > now:
                break
            self.queue.pop()
            if m.state == "queued":  # not killed meanwhile
                self._connect(m, now)

    def _connect(self, m: _Member, now: float) -> None:
        sock = socket.socket(socket.AF_INET6 if ":" in self.addr[0] else socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        err = sock.connect_ex(self.addr)
        if err not in (0, errno.EINPROGRESS, errno.EAGAIN):
            sock.close()
            m.state = "queued"
            m.retry_at = now + _RETRY_S
            self.stats.retries += 1
            self.queue.insert(0, m)
            return
        tune_socket(sock)
        m.sock, m.reader, m.out, m.state, m.since = sock, LineReader(), b"", "shaking", now
        m.nonce = m.challenge = ""
        self.shaking += 1
        self.sel.register(sock, selectors.EVENT_READ, m)

    def _retry(self, m: _Member, now: float) -> None:
        """The handshake failed before the welcome (shed, refused, reset): try again later, as a real member."""
        self._drop(m)
        m.state = "queued"
        m.retry_at = now + _RETRY_S
        self.stats.retries += 1
        self.queue.insert(0, m)

    def _drop(self, m: _Member) -> None:
        if m.sock is None:
            return
        if m.state == "shaking":
            self.shaking -= 1
        if m.state != "hung":
            try:
                self.sel.unregister(m.sock)
            except (KeyError, ValueError):
                pass
        m.sock.close()
        m.sock = None

    def _fail(self, m: _Member, why: str) -> None:
        self._drop(m)
        m.state, m.error = "failed", why
        if self.steps.get("voters") and m.voted is not None:
            self.steps["reason"] = self.steps["reason"] or f"member {m.id} failed: {why}"

    def _send(self, m: _Member, data: bytes) -> None:
        if m.sock is None:
            return
        self.stats.sent += 1
        if m.out:
            m.out += data
            return
        try:
            n = m.sock.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError as exc:
            self._fail(m, f"send failed: {exc}")
            return
        if n < len(data):
            m.out = data[n:]
            self.sel.modify(m.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, m)

    def _flush(self, m: _Member) -> None:
        if m.sock is None or not m.out:
            return
        try:
            n = m.sock.send(m.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._fail(m, f"send failed: {exc}")
            return
        m.out = m.out[n:]
        if not m.out:
            self.sel.modify(m.sock, selectors.EVENT_READ, m)

    def _readable(self, m: _Member) -> None:
        assert m.sock is not None
        now = time.monotonic()
        try:
            data = m.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            data, why = b"", f"connection broke: {exc}"
        else:
            why = "the coordinator closed the connection"
        if not data:
            if m.state == "shaking":
                self._retry(m, now)
            else:
                self._fail(m, why)
            return
        try:
            msgs = [self._check(raw) for raw in m.reader.feed(data)]
        except ProtocolError as exc:  # a real member would count this as losing its coordinator
            self._fail(m, f"protocol error: {exc}")
            return
        self.stats.received += len(msgs)
        for msg in msgs:
            if m.state not in ("shaking", "joined"):
                return
            self._handle(m, msg, now)

    def _check(self, raw: dict[str, Any]) -> dict[str, Any]:
        """``check(raw, COORDINATOR_MESSAGES)``, validated once per process for the big messages every member
        receives alike (a generation, a decision): an equal message reuses the checked copy."""
        kind = raw.get("t")
        if kind not in ("gen", "decision"):
            return check(raw, COORDINATOR_MESSAGES)
        key = (kind, raw.get("gen"), raw.get("step"), raw.get("committed"))
        hit = self.cache.get(key)
        if hit is not None and hit[0] == raw:
            return hit[1]
        checked = check(raw, COORDINATOR_MESSAGES)
        if len(self.cache) > 64:
            self.cache.clear()
        self.cache[key] = (raw, checked)
        return checked

    def _handle(self, m: _Member, msg: dict[str, Any], now: float) -> None:
        kind = msg["t"]
        if kind == "ping":
            return
        if m.state == "shaking":
            self._handshake(m, msg, now)
            return
        if kind == "gen":
            self._enter(m, msg, now)
        elif kind == "decision":
            mine = m.voted is not None and msg["gen"] == m.gen and msg["step"] == m.committed
            m.committed = max(m.committed, msg["committed"])
            if msg.get("next") is not None:  # a grow between steps: the next vote is in the next generation
                self._enter(m, msg["next"], now, planned=True)
            if mine:
                self._decided(m, now)
        elif kind in ("removed", "fatal", "wait", "finished"):
            if kind in ("removed", "fatal"):
                self._drop(m)
                m.state, m.error = "removed", f"{kind}: {msg.get('reason', msg.get('code'))}"
            if self.steps.get("voters") and m.voted is not None:
                self.steps["reason"] = self.steps["reason"] or f"member {m.id} got {kind!r}: {msg.get('reason')}"
        elif kind in ("challenge", "welcome", "reject"):
            self._fail(m, f"the coordinator sent {kind!r} during the session")

    def _handshake(self, m: _Member, msg: dict[str, Any], now: float) -> None:
        kind = msg["t"]
        if kind == "challenge" and not m.nonce:
            m.nonce = new_nonce()
            self._send(m, encode({
                "t": "hello", "nonce": m.nonce, "proof": mac(self.token, "member", msg["nonce"], m.nonce),
                "proto": PROTOCOL_VERSION, "member": None, "step": 0, "pid": os.getpid(), "group": m.group,
                "group_rank": m.rank, "group_size": self.group_size, "coordinators": 1,
            }))
            m.challenge = msg["nonce"]  # needed to verify the coordinator's proof
        elif kind == "welcome" and m.nonce:
            if not verify(self.token, "coordinator", m.nonce, m.challenge, msg["proof"]):
                self._fail(m, "the coordinator could not prove it knows the job token")
                return
            if msg["proto"] != PROTOCOL_VERSION:
                self._fail(m, f"the coordinator speaks protocol {msg['proto']}")
                return
            self.shaking -= 1
            m.state, m.id, m.error = "joined", int(msg["member"]), ""
            if not self.next_slot:
                self.interval = float(msg["heartbeat_interval_s"])
                self.next_slot = now + self.interval / _SLOTS
        elif kind == "reject":
            self._drop(m)
            m.state, m.error = "rejected", f"{msg['code']}: {msg['reason']}"
            self.stats.rejected[msg["code"]] += 1
        else:
            self._fail(m, f"the coordinator sent {kind!r} during the handshake")

    def _enter(self, m: _Member, gen: dict[str, Any], now: float, *, planned: bool = False) -> None:
        if gen["gen"] <= m.gen:
            return
        m.gen, m.members, m.committed, m.t_gen = gen["gen"], gen["members"], gen["step"], now
        if not planned and m.voted is not None and self.steps.get("voters"):
            self.steps["reason"] = self.steps["reason"] or (
                f"member {m.id} was moved to generation {gen['gen']} (abort={gen['abort']}): {gen['reason']}")
            m.voted = None

    # ----------------------------------------------------------------------------------------------- votes
    def _vote(self, m: _Member, now: float) -> None:
        st = self.steps
        k = m.committed - st["base"][m.id]
        m.voted = k
        if now < st["t_vote"][k]:
            st["t_vote"][k] = now
        key = (m.gen, m.committed)
        data = self.votes.get(key)
        if data is None:
            if len(self.votes) > 64:
                self.votes.clear()
            data = self.votes[key] = encode({"t": "vote", "gen": m.gen, "step": m.committed})
        self._send(m, data)

    def _decided(self, m: _Member, now: float) -> None:
        st = self.steps
        k = m.voted
        assert k is not None
        st["left"][k] -= 1
        st["t_done"][k] = max(st["t_done"][k], now)
        m.voted = None
        if k + 1 < st["n"]:
            self._vote(m, now)


def _worker_main(conn: Connection, cfg: dict[str, Any], lo: int, hi: int) -> None:
    """Entry point of a worker process: serve groups ``[lo, hi)`` until told to stop (or the parent is gone)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass
    try:
        worker = _Worker(conn, cfg, lo, hi)
    except Exception as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        return
    try:
        worker.run()
    except Exception as exc:
        try:
            conn.send({"error": f"{type(exc).__name__}: {exc}"})
        except OSError:
            pass
        raise
