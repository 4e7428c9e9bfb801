"""A member simulator: thousands of light members in a few processes, speaking the coordinator's real protocol.

By default (:attr:`SimConfig.hierarchy`) it speaks protocol 4's group sessions: each replica group is one TCP
connection, its leader's, which joins, heartbeats and votes for the group's ranks; followers live inside their
leader (their local channel is the leader's cost, not the coordinator's), and a follower killed with
:meth:`MemberSim.kill_rank` is reported by its leader (``lost``). The rest of this docstring describes a session;
with ``hierarchy=False`` every rank is one (flat membership, as real ``FaultTolerant`` ranks still connect).

Each simulated session is one TCP connection to a real coordinator (``torchnext coordinator``, see
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

Joins are paced: at most ``max_handshakes`` unauthenticated connections per process at once. The coordinator keeps
:data:`~torchnext.ft.service.MAX_UNAUTHENTICATED` (256) handshakes in progress and lets further connections wait in
its listen backlog (it sheds the oldest only once it is pending for ``SHED_AFTER_S``); a connection closed before its
welcome is retried after 0.1 s, as a real member's first join does.

Example::

    with CoordinatorProcess(token, initial_size=8) as coord, \\
            MemberSim(SimConfig(address=coord.address, token=token, ranks=64, group_size=8)) as sim:
        formed = sim.join(timeout_s=30)              # formed.ok, formed.members, formed.formation_s
        rounds = sim.commit(20, timeout_s=30)        # rounds.committed == 20, rounds.rounds_s
        t = sim.kill_group(3, KillMode.HANG)
        nxt = sim.await_generation(formed.gen, timeout_s=10)   # nxt.members excludes group 3's ids
"""

from __future__ import annotations

import contextlib
import enum
import multiprocessing as mp
import os
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from torchnext.ft.member import parse_address
from torchnext.testing._sim_worker import worker_main
from torchnext.testing.procfs import cpu_seconds, fork_without_garbage

__all__ = ["Commits", "Formation", "Generation", "KillMode", "MemberSim", "SimConfig", "SimError"]


class SimError(RuntimeError):
    """A simulator process failed (died, or did not answer a command within its bound)."""


class KillMode(str, enum.Enum):
    """How :meth:`MemberSim.kill_group` kills a group's members."""

    CRASH = "crash"
    """Close the sockets (a crashed process: the coordinator reads EOF)."""
    HANG = "hang"
    """Stop heartbeating and reading, keep the sockets open (a hung process: only its silence tells)."""
    CUT_RELAY = "cut-relay"
    """The group's session lives on with its coordinator, but its channel to its vote relay goes dead both ways,
    sockets open (a partition between two leaders, or a stuck relay-channel thread): only the relay channel's
    liveness tells (:mod:`torchnext.ft.relay_link`, "Liveness"). :meth:`kill_group` only; a no-op for a session
    without a relay channel."""


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
    """Unauthenticated connections per process at once (beyond the coordinator's ``MAX_UNAUTHENTICATED`` = 256 in
    all, joins wait in its listen backlog)."""
    start_method: str = "fork"
    """How worker processes start (``multiprocessing``): ``"fork"`` (the default) costs no import -- a worker only
    runs the stdlib and :mod:`torchnext.ft._wire`, never the parent's threads or torch; ``"spawn"`` or
    ``"forkserver"`` import torchnext afresh (seconds each) and need the ``if __name__ == "__main__":`` guard."""
    start_timeout_s: float = 60.0
    """Bound on a worker process's start."""
    hierarchy: bool = True
    """Protocol 4's group sessions: one connection per replica group, its leader's (rank 0), joining, heartbeating and
    voting for the group; the followers are simulated inside their leader (their local channel costs the leader,
    not the coordinator). False: every rank connects itself (flat membership, protocol 3's way, for comparison)."""
    relays: bool = True
    """With :attr:`hierarchy`: every leader offers a relay listener (protocol 5, ``hello.relay``), so that the
    coordinator may name relays (at least its ``relay_min_groups`` sessions): a session of a chunk votes to its relay
    over an authenticated channel, the relay votes for the chunk and fans the decision out. False: no listener, every
    session votes directly."""

    profile: str = ""
    """Non-empty: each worker runs its loop under cProfile during :meth:`MemberSim.commit` calls only, and writes
    the stats to ``f"{profile}.{pid}"`` (the worker's process id) when it stops."""

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
    """Refusal code -> members refused with it (``auth``: wrong token; a group session refused counts its ranks)."""
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
    relay_messages: int = 0
    """Messages on relay channels during the call (sent and received, counted at both ends; not the coordinator's)."""


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
        self._stacks: list[str] = []  # per worker: where it writes its stacks when asked
        self.ids: dict[int, list[int]] = {}

    # ------------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> MemberSim:
        ctx: Any = mp.get_context(self.config.start_method)  # BaseContext declares no Process
        forking = fork_without_garbage() if self.config.start_method == "fork" else contextlib.nullcontext()
        try:
            with forking:  # (a forked worker must not collect this process's garbage: see there)
                for lo, hi in self._ranges:
                    parent, child = ctx.Pipe()
                    fd, stacks = tempfile.mkstemp(prefix="member-sim-stacks-")
                    os.close(fd)
                    self._stacks.append(stacks)
                    proc = ctx.Process(target=worker_main, args=(child, _config_dict(self.config, stacks), lo, hi),
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
        for path in self._stacks:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._procs, self._conns, self._stacks = [], [], []

    def __enter__(self) -> MemberSim:
        return self.start() if not self._procs else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids (e.g. for their CPU time in ``/proc``)."""
        return [int(proc.pid) for proc in self._procs]

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
                       reason=_explain(reason, replies), sim_late_s=_late(replies),
                       relay_messages=sum(r["relay_messages"] for r in replies))

    def kill_group(self, group: int, mode: KillMode = KillMode.CRASH) -> float:
        """Kill replica group ``group`` (all its members, see :class:`KillMode`); returns ``time.monotonic()`` at
        the kill."""
        return self._kill(group, mode, None)

    def kill_rank(self, group: int, rank: int, mode: KillMode = KillMode.CRASH) -> float:
        """Kill rank ``rank`` of replica group ``group``; returns ``time.monotonic()`` at the kill. With
        :attr:`SimConfig.hierarchy`, rank 0 is the group's leader: its connection closes (crash) or falls silent
        (hang), and the coordinator detects it as any member today; a follower (rank > 0) is detected by its leader,
        which reports it (``lost``): at once for a crash, after the welcome's ``group_heartbeat_timeout_s`` for a
        hang. Flat: that rank's own connection. Either way the whole group leaves the next generation."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.config.group_size:
            raise ValueError(f"rank must be in [0, {self.config.group_size}), got {rank!r}")
        return self._kill(group, mode, rank)

    def _kill(self, group: int, mode: KillMode, rank: int | None) -> float:
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < self.config.groups:
            raise ValueError(f"group must be in [0, {self.config.groups}), got {group!r}")
        mode = KillMode(mode)
        if mode is KillMode.CUT_RELAY and rank is not None:
            raise ValueError("KillMode.CUT_RELAY cuts a group session's relay channel: use kill_group")
        i = next(i for i, (lo, hi) in enumerate(self._ranges) if lo <= group < hi)
        (reply,) = self._call("kill", 5.0, only=i, group=group, mode=mode.value, rank=rank)
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
                    where = _stacks_of(proc, self._stacks[i])
                    raise SimError(f"member-sim process {i} did not answer {what!r} within {bound:.0f}s"
                                   + (f"; its stacks: {where}" if where else ""))
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


def _config_dict(cfg: SimConfig, stacks: str) -> dict[str, Any]:
    return {"address": cfg.address, "token": cfg.token, "group_size": cfg.group_size,
            "max_handshakes": cfg.max_handshakes, "stacks": stacks, "hierarchy": cfg.hierarchy and cfg.group_size > 1,
            "relays": cfg.relays, "profile": cfg.profile}


def _stacks_of(proc: Any, path: str) -> str:
    """Ask worker ``proc`` (SIGUSR2, :func:`worker_main`) where its main thread is: its innermost frames, or ''."""
    try:
        os.kill(proc.pid, signal.SIGUSR2)
        time.sleep(0.5)
        with open(path) as fh:
            text = fh.read()
    except (OSError, TypeError):
        return ""
    # faulthandler writes the innermost frame first, under "Current thread ... (most recent call first):"
    _, _, latest = text.rpartition("Current thread")
    lines = [ln.strip() for ln in latest.splitlines()[1:9] if ln.strip()]
    cpu = cpu_seconds(proc.pid)  # busy (near the wall time) or starved (far below it)
    return (f"[{cpu:.1f} s of CPU since it started] " if cpu is not None else "") + " | ".join(lines)


