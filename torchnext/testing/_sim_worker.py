"""The member simulator's worker process: one selector loop serving its share of :mod:`~.member_sim`'s members.

With ``cfg["hierarchy"]`` (protocol 4's group sessions) a process holds one session per replica group: its leader's
connection, speaking for the group's ``group_size`` ranks (``hello.followers``). The followers and their local
channel are simulated inside the leader (no socket: it is the leader's load, not the coordinator's): they vote with
it at once, and a follower killed is reported by its leader with ``lost`` -- at once for a crash (its channel
closed), ``group_heartbeat_timeout_s`` after the kill for a hang (its silence).

Commands come over a ``multiprocessing`` pipe from :class:`~torchnext.testing.member_sim.MemberSim`; each is answered
once its condition holds or its deadline passes, while the loop keeps heartbeating. Only the stdlib and the wire
functions of :mod:`torchnext.ft._wire` run here (no torch), so a forked worker costs no import.
"""

from __future__ import annotations

import errno
import faulthandler
import gc
import os
import select
import selectors
import signal
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from torchnext.ft._wire import (
    COORDINATOR_MESSAGES,
    MAX_GENERATION_LINE,
    PROTOCOL_VERSION,
    RELAY_MESSAGES,
    RELAY_PEER_MESSAGES,
    LineReader,
    ProtocolError,
    accept_tuned,
    check,
    decode,
    encode,
    mac,
    new_nonce,
    tune_socket,
    verify,
)
from torchnext.ft.member import parse_address
from torchnext.ft.relay import RelayChunk, SessionHandshake, answer_hello, relay_challenge

__all__ = ["worker_main"]

_SLOTS = 10
"""Heartbeat slots per interval: member ``i`` of a process heartbeats in slot ``i % _SLOTS``."""
_RETRY_S = 0.1
"""A handshake that failed (connection closed or refused before the welcome) is retried after this long."""
_SHARED_LINE = 512
"""Lines at least this long (generations, decisions) are decoded and checked once per process (``_Worker._line``)."""
_HANG = "hang"
"""``KillMode.HANG.value`` (the other mode closes the sockets)."""
_CUT = "cut-relay"
"""``KillMode.CUT_RELAY.value``: a session's relay channel goes dead, its sockets open."""
_PING = encode({"t": "ping"})

class _Poller:
    """``selectors.DefaultSelector``'s calls this worker makes, without its per-event key objects: ``select``
    returns ``[(data, events)]`` (``selectors.EVENT_READ | EVENT_WRITE``), read also on hang-up or error, as there.
    Linux's epoll where there is one (thousands of sockets per process), else the stdlib selector."""

    def __init__(self) -> None:
        self._ep = select.epoll() if hasattr(select, "epoll") else None
        self._sel = selectors.DefaultSelector() if self._ep is None else None
        self._data: dict[int, Any] = {}

    @staticmethod
    def _fd(fileobj: Any) -> int:
        return fileobj if isinstance(fileobj, int) else int(fileobj.fileno())

    @staticmethod
    def _mask(events: int) -> int:
        return ((select.EPOLLIN if events & selectors.EVENT_READ else 0)
                | (select.EPOLLOUT if events & selectors.EVENT_WRITE else 0))

    def register(self, fileobj: Any, events: int, data: Any) -> None:
        if self._sel is not None:
            self._sel.register(fileobj, events, data)
            return
        fd = self._fd(fileobj)
        assert self._ep is not None
        self._ep.register(fd, self._mask(events))
        self._data[fd] = data

    def modify(self, fileobj: Any, events: int, data: Any) -> None:
        if self._sel is not None:
            self._sel.modify(fileobj, events, data)
            return
        fd = self._fd(fileobj)
        assert self._ep is not None
        self._ep.modify(fd, self._mask(events))
        self._data[fd] = data

    def unregister(self, fileobj: Any) -> None:
        """KeyError when ``fileobj`` was not registered (as ``selectors``)."""
        if self._sel is not None:
            self._sel.unregister(fileobj)
            return
        fd = self._fd(fileobj)
        if self._data.pop(fd, _Poller) is _Poller:
            raise KeyError(fileobj)
        assert self._ep is not None
        try:
            self._ep.unregister(fd)
        except OSError:
            pass  # already closed: the kernel dropped it

    def select(self, timeout: float) -> list[tuple[Any, int]]:
        if self._sel is not None:
            return [(key.data, events) for key, events in self._sel.select(timeout)]
        assert self._ep is not None
        data, out = self._data, []
        for fd, ev in self._ep.poll(timeout):
            d = data.get(fd, _Poller)
            if d is not _Poller:
                out.append((d, (_READ if ev & ~select.EPOLLOUT else 0) | (_WRITE if ev & select.EPOLLOUT else 0)))
        return out


_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE


class _Peer:
    """One relay channel end: at a relay, a session of its chunk (``inbound``); at a session, its relay (``up``)."""

    __slots__ = ("at", "challenge", "heard", "inbound", "member", "opened", "out", "owner", "reader", "relay", "shake",
                 "since", "sock", "state", "vote", "wrote")

    def __init__(self, sock: socket.socket, owner: _Member, inbound: bool, now: float,
                 decoder: Any = None) -> None:
        self.sock, self.owner, self.inbound = sock, owner, inbound
        self.reader = LineReader(decoder=decoder)
        self.out = b""
        self.state = "shaking"
        self.challenge = new_nonce() if inbound else ""
        self.shake: SessionHandshake | None = None
        """At a session: its side of the handshake (until the welcome)."""
        self.member = -1
        self.relay = -1
        self.at = ""
        self.vote: tuple[int, int] | None = None
        self.opened = now
        self.heard = now
        """When something last came through this channel."""
        self.wrote = False
        """Something was written to it since the owner's last liveness check (then no ping is due)."""
        self.since = 0.0
        """At a session: when its open vote went through this channel."""


class _Listen:
    __slots__ = ("owner", "sock")

    def __init__(self, sock: socket.socket, owner: _Member) -> None:
        self.sock, self.owner = sock, owner


class _Member:
    __slots__ = ("challenge", "chunk", "committed", "error", "gen", "group", "id", "ids", "inbound", "listener",
                 "lost_due", "members", "nonce", "open_since", "out", "rank", "reader", "relay_gen", "retry_at",
                 "sent_at", "size", "slot", "sock", "state", "t_gen", "up", "via_relay", "voted")

    def __init__(self, group: int, rank: int, slot: int, size: int = 1) -> None:
        self.group, self.rank, self.slot = group, rank, slot
        self.size = size
        """Ranks this connection speaks for: its group's (a group session's leader) or 1 (a flat member)."""
        self.ids: list[int] = []
        """The ids of those ranks by group rank (from the welcome)."""
        self.lost_due: list[tuple[float, int, bool]] = []
        """Followers killed, to report: ``(when, group rank, hung)``."""
        self.sent_at = 0.0
        """When it last sent anything: its heartbeat is skipped within an interval of it, as a real member's."""
        self.sock: socket.socket | None = None
        self.reader = LineReader(MAX_GENERATION_LINE)
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
        self.error = ""
        self.voted: int | None = None
        self.listener: _Listen | None = None
        """Its relay listener (protocol 5; a group session's leader with relays on)."""
        self.inbound: dict[int, _Peer] = {}
        """As a relay: the authenticated channels of its chunk's sessions, by member id."""
        self.chunk: RelayChunk | None = None
        """As a relay: its chunk in the generation it holds."""
        self.up: _Peer | None = None
        """As a session of a chunk: the channel to its relay."""
        self.relay_gen = 0
        """The generation of the ``relay`` message ``up`` was opened for."""
        self.via_relay = False
        """Its open vote went to its relay (resent directly if that channel closes before the decision)."""
        self.open_since: float | None = None
        """As a relay: since when its chunk holds a vote not yet decided."""


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
        self.hierarchy = bool(cfg.get("hierarchy", False))
        self.relays = self.hierarchy and bool(cfg.get("relays", False))
        self.relay_msgs = 0
        """Messages on relay channels (sent and received, both ends): not the coordinator's."""
        self.decisions: dict[tuple[int, int], bytes] = {}
        self.relayed: dict[bytes, dict[str, Any]] = {}
        self.peer_lines: dict[bytes, dict[str, Any]] = {}
        if self.hierarchy:  # one session per group: its leader (rank 0) speaks for every rank
            self.members = [_Member(g, 0, i % _SLOTS, gsize) for i, g in enumerate(range(lo, hi))]
        else:
            self.members = [_Member(g, r, i % _SLOTS) for i, (g, r) in
                            enumerate((g, r) for g in range(lo, hi) for r in range(gsize))]
        self.group_timeout = 0.6
        self.slots: list[list[_Member]] = [[m for m in self.members if m.slot == s] for s in range(_SLOTS)]
        self.sel = _Poller()
        self.sel.register(conn.fileno(), selectors.EVENT_READ, None)
        self.stats = _Stats()
        self.interval = 0.1
        self.relay_timeout = 1.2
        """The relay channels' silence timeout: twice the coordinator's heartbeat timeout (the welcome's)."""
        self.live_due: list[_Member] = []
        """Sessions whose relay-channel liveness is checked after the current batch of events."""
        self.cut: list[socket.socket] = []
        """Relay channel sockets cut by ``KillMode.CUT_RELAY``: kept open, never read or written."""
        self.next_slot = 0.0
        self.slot = 0
        self.shaking = 0
        self.queue: list[_Member] = []
        self.pending: tuple[str, dict[str, Any]] | None = None
        self.lines: dict[bytes, dict[str, Any]] = {}
        self.hb = encode({"t": "hb"})
        self.votes: dict[tuple[int, int], bytes] = {}
        self.steps: dict[str, Any] = {}
        self.next_check = 0.0
        self.running = True
        self.deltas: dict[tuple[int, int], list[int]] = {}
        """Delta generations expanded, by (base, generation): the coordinator sends one delta to every holder."""
        self.lost: list[_Member] = []
        """Leaders with follower deaths to report."""
        self.profile = str(cfg.get("profile") or "")
        self.prof: Any = None
        if self.profile:
            import cProfile

            self.prof = cProfile.Profile()

    # -------------------------------------------------------------------------------------------------- loop
    def run(self) -> None:
        self.conn.send({"ready": True, "pid": os.getpid()})
        try:
            while self.running:
                now = time.monotonic()
                wait = 0.05
                if self.next_slot:
                    wait = min(wait, max(0.0, self.next_slot - now))
                cpu = time.process_time()
                ready = self.sel.select(timeout=wait)
                polled = time.monotonic()
                if polled - now - (time.process_time() - cpu) - wait > 2 * self.interval:
                    self._forgive(polled)  # this process was off the CPU: the relay channels' silence may be ours
                for data, events in ready:
                    if self.next_slot and time.monotonic() >= self.next_slot:  # a long batch must not delay them
                        self._heartbeat_slot(time.monotonic())
                    if data is None:
                        self._command()
                    elif type(data) is _Peer:
                        if events & _WRITE:
                            self._peer_flush(data)
                        if events & _READ and data.sock is not None:
                            self._peer_readable(data, time.monotonic())
                    elif type(data) is _Listen:
                        self._accept(data, time.monotonic())
                    else:
                        m: _Member = data
                        if events & _WRITE:
                            self._flush(m)
                        if events & _READ and m.sock is not None and m.state in ("shaking", "joined"):
                            self._readable(m)
                now = time.monotonic()
                if self.next_slot and now >= self.next_slot:
                    self._heartbeat_slot(now)
                if self.live_due:  # judged at `polled`: every byte that arrived before it has been read by now
                    for m in self.live_due:
                        self._relay_liveness(m, polled)
                    self.live_due = []
                if self.lost:
                    self._report_lost(now)
                self._connect_more(now)
                if self.pending is not None and (self.pending[0] == "steps" or now >= self.next_check):
                    self.next_check = now + 0.005  # join/await_gen conditions scan every member: not every event
                    self._check_pending(now)
        finally:
            for m in self.members:
                self._drop(m)
            if self.prof is not None:
                self.prof.disable()
                self.prof.dump_stats(f"{self.profile}.{os.getpid()}")

    def _heartbeat_slot(self, now: float) -> None:
        self.stats.late = max(self.stats.late, now - self.next_slot)
        recent = now - self.interval
        for m in self.slots[self.slot]:
            if m.state == "joined" and m.sent_at < recent:  # a vote within the interval said it is alive
                self._send(m, self.hb)
            if (m.chunk is not None or (m.via_relay and m.voted is not None)) and m.state == "joined":
                self.live_due.append(m)  # a relay, or a session whose vote waits at its relay
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
            self.conn.send({"messages": self.stats.sent + self.stats.received, "relay_messages": self.relay_msgs})
            return
        if cmd == "collect":  # a full collection now (what may a worker collect? see worker_main)
            self.conn.send({"collected": gc.collect()})
            return
        if cmd == "kill":
            rank = kw.get("rank")
            self.conn.send(self._kill(int(kw["group"]), str(kw["mode"]), None if rank is None else int(rank)))
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
                          "messages": self.stats.sent + self.stats.received, "reason": "",
                          "relay_messages": self.relay_msgs}
            if self.prof is not None:
                self.prof.enable()
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
                         "messages": self.stats.sent + self.stats.received - st["messages"],
                         "relay_messages": self.relay_msgs - st["relay_messages"]}
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
            if cmd == "steps" and self.prof is not None:
                self.prof.disable()
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
                ids.setdefault(m.group, []).extend(m.ids or [m.id])
        holding = [m for m in self.members if m.state == "joined" and m.gen]
        top = max(holding, key=lambda m: m.gen, default=None)
        errors = [f"group {m.group} rank {m.rank}: {m.error}" for m in self.members if m.state in ("failed", "removed")]
        return {"ids": ids, "rejected": dict(self.stats.rejected), "errors": errors[:5], "failed": len(errors),
                "holding": sum(m.size for m in holding),
                "gen": top.gen if top else 0, "members": top.members if top else None,
                "t_start": self.stats.t_start, "t_last": max((m.t_gen for m in holding), default=0.0),
                "retries": self.stats.retries}

    def _kill(self, group: int, mode: str, rank: int | None) -> dict[str, Any]:
        """Kill group ``group`` (``rank`` None), or one of its ranks. A group session's follower (``rank`` > 0) is
        reported by its leader: at once for a crash, after ``group_heartbeat_timeout_s`` for a hang."""
        t = time.monotonic()
        if mode == _CUT:
            for m in self.members:
                up = m.up
                if m.group == group and up is not None and up.sock is not None and up.state != "cut":
                    self.sel.unregister(up.sock)
                    up.state = "cut"
            return {"t_kill": t}
        if self.hierarchy and rank:
            for m in self.members:
                if m.group == group and m.state == "joined":
                    m.lost_due.append((t if mode != _HANG else t + self.group_timeout, rank, mode == _HANG))
                    self.lost.append(m)
            return {"t_kill": t}
        for m in self.members:
            if m.group == group and (rank is None or m.rank == rank) and m.state in ("joined", "shaking", "queued"):
                if mode == _HANG and m.state == "joined" and m.sock is not None:
                    m.state = "hung"
                    self.sel.unregister(m.sock)  # no reads, no writes: the socket stays open, silent
                    self._silence_relay(m)
                else:
                    self._drop(m)
                    m.state = "killed"
        return {"t_kill": t}

    def _report_lost(self, now: float) -> None:
        """Leaders send ``lost`` for the followers whose death they detected by now."""
        keep = []
        for m in self.lost:
            due = [x for x in m.lost_due if x[0] <= now]
            m.lost_due = [x for x in m.lost_due if x[0] > now]
            if m.state == "joined":
                for _, rank, hung in due:
                    why = "silent on the local channel" if hung else "its local channel closed"
                    self._send(m, encode({"t": "lost", "member": m.ids[rank], "hung": hung, "reason": why}))
            if m.lost_due and m.state == "joined":
                keep.append(m)
        self.lost = keep

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
        m.sock, m.reader, m.out, m.state = sock, LineReader(MAX_GENERATION_LINE, self._line), b"", "shaking"
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
        if m.state != "hung":
            self._close_relay(m)
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
        m.sent_at = time.monotonic()
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
            msgs = m.reader.feed(data)
        except ProtocolError as exc:  # a real member would count this as losing its coordinator
            self._fail(m, f"protocol error: {exc}")
            return
        self.stats.received += len(msgs)
        for msg in msgs:
            if m.state not in ("shaking", "joined"):
                return
            self._handle(m, msg, now)

    def _line(self, line: bytes) -> dict[str, Any]:
        """``check(decode(line), COORDINATOR_MESSAGES)``, done once per process for a long line that every member
        receives alike (a generation, a decision): the same bytes reuse the checked message (read-only). Decoding
        and checking a 1,024-member generation once per simulated member made formation quadratic in the members
        of a process (the 1,024-rank CI test's stack dump: a worker still inside ``_wire.check`` after 50 s)."""
        if len(line) < _SHARED_LINE:
            return check(decode(line), COORDINATOR_MESSAGES)
        hit = self.lines.get(line)
        if hit is None:
            hit = check(decode(line), COORDINATOR_MESSAGES)
            if len(self.lines) >= 64:
                self.lines.clear()
            self.lines[line] = hit
        return hit

    def _handle(self, m: _Member, msg: dict[str, Any], now: float) -> None:
        kind = msg["t"]
        if kind == "ping":
            return
        if m.state == "shaking":
            self._handshake(m, msg, now)
            return
        if kind == "gen":
            self._enter(m, msg, now)
        elif kind == "relay":
            self._relay_named(m, msg, now)
        elif kind == "decision":
            self._decision(m, msg, now)
        elif kind in ("removed", "fatal", "wait", "finished"):
            if kind in ("removed", "fatal"):
                self._drop(m)
                m.state, m.error = "removed", f"{kind}: {msg.get('reason', msg.get('code'))}"
            if self.steps.get("voters") and m.voted is not None:
                self.steps["reason"] = self.steps["reason"] or f"member {m.id} got {kind!r}: {msg.get('reason')}"
        elif kind in ("challenge", "welcome", "reject"):
            self._fail(m, f"the coordinator sent {kind!r} during the session")

    def _decision(self, m: _Member, msg: dict[str, Any], now: float) -> None:
        """A decision for joined member ``m`` (from its coordinator, or through its relay)."""
        chunk = m.chunk
        nxt = msg.get("next")
        if chunk is not None and nxt is None and m.inbound and msg["gen"] == chunk.gen:
            self._fan_out(m, msg)
        mine = m.voted is not None and msg["gen"] == m.gen and msg["step"] == m.committed
        if msg["committed"] > m.committed:
            m.committed = msg["committed"]
        if nxt is not None:  # a grow between steps: the next vote is in the next generation
            self._enter(m, nxt, now, planned=True)
        if mine:
            self._decided(m, now)

    def _handshake(self, m: _Member, msg: dict[str, Any], now: float) -> None:
        kind = msg["t"]
        if kind == "challenge" and not m.nonce:
            m.nonce = new_nonce()
            hello: dict[str, Any] = {
                "t": "hello", "nonce": m.nonce, "proof": mac(self.token, "member", msg["nonce"], m.nonce),
                "proto": PROTOCOL_VERSION, "member": None, "step": 0, "pid": os.getpid(), "group": m.group,
                "group_rank": m.rank, "group_size": self.group_size, "coordinators": 1,
                "coordinator_timeout_s": 2.0,  # a real member's default: pinged every 0.5 s, not every interval
            }
            if m.size > 1:  # a group session: the leader joins its followers with it
                hello["followers"] = [{"step": 0}] * (m.size - 1)
                if self.relays:
                    hello["relay"] = self._listen(m)
            self._send(m, encode(hello))
            m.challenge = msg["nonce"]  # needed to verify the coordinator's proof
        elif kind == "welcome" and m.nonce:
            if not verify(self.token, "coordinator", m.nonce, m.challenge, msg["proof"]):
                self._fail(m, "the coordinator could not prove it knows the job token")
                return
            if msg["proto"] != PROTOCOL_VERSION:
                self._fail(m, f"the coordinator speaks protocol {msg['proto']}")
                return
            if m.size > 1 and (msg["members"] is None or len(msg["members"]) != m.size):
                self._fail(m, f"a group session's welcome named members {msg['members']}, expected {m.size} ids")
                return
            self.shaking -= 1
            m.state, m.id, m.error = "joined", int(msg["member"]), ""
            m.ids = list(msg["members"] or [])
            if msg["group_heartbeat_timeout_s"] is not None:
                self.group_timeout = float(msg["group_heartbeat_timeout_s"])
            if not self.next_slot:
                self.interval = float(msg["heartbeat_interval_s"])
                self.relay_timeout = 2 * float(msg["heartbeat_timeout_s"])
                self.next_slot = now + self.interval / _SLOTS
        elif kind == "reject":
            self._drop(m)
            m.state, m.error = "rejected", f"{msg['code']}: {msg['reason']}"
            self.stats.rejected[msg["code"]] += m.size  # a group session refused: all its ranks
        else:
            self._fail(m, f"the coordinator sent {kind!r} during the handshake")

    def _enter(self, m: _Member, gen: dict[str, Any], now: float, *, planned: bool = False) -> None:
        if gen["gen"] <= m.gen:
            return
        members = gen["members"]
        if gen.get("base") is not None:  # a delta against the generation this member holds (protocol 4)
            if gen["base"] != m.gen or m.members is None:
                self._fail(m, f"a delta generation {gen['gen']} against {gen['base']}, but it holds {m.gen}")
                return
            key = (m.gen, gen["gen"])  # one delta per (base, generation), read by many members: expanded once
            members = self.deltas.get(key)
            if members is None:
                gone = set(gen["drop"] or ())
                members = sorted({x for x in m.members if x not in gone} | {x for g in gen["add"] or () for x in g})
                if len(self.deltas) >= 64:
                    self.deltas.clear()
                self.deltas[key] = members
        m.gen, m.members, m.committed, m.t_gen = gen["gen"], members, gen["step"], now
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
        chunk = m.chunk
        if chunk is not None and chunk.gen == m.gen:  # a relay: its own vote is one of its chunk's
            m.via_relay = False
            self._send_up(m, chunk.vote(m.id, m.gen, m.committed))
            return
        data = self._vote_line(m.gen, m.committed)
        up = m.up
        if up is not None and up.state in ("joined", "cut") and m.relay_gen == m.gen:
            m.via_relay = True
            m.sent_at = up.since = now  # it said something: its coordinator heartbeat waits (the relay vouches)
            self._peer_send(up, data)
            return
        m.via_relay = False
        self._send(m, data)

    def _vote_line(self, gen: int, step: int) -> bytes:
        key = (gen, step)
        data = self.votes.get(key)
        if data is None:
            if len(self.votes) > 64:
                self.votes.clear()
            data = self.votes[key] = encode({"t": "vote", "gen": gen, "step": step})
        return data

    # ----------------------------------------------------------------------------------------------- relays
    def _listen(self, m: _Member) -> str:
        """Open ``m``'s relay listener (once); its ``host:port``."""
        if m.listener is None:
            family = socket.AF_INET6 if ":" in self.addr[0] else socket.AF_INET
            sock = socket.create_server((self.addr[0], 0), family=family, backlog=256)
            sock.setblocking(False)
            m.listener = _Listen(sock, m)
            self.sel.register(sock, selectors.EVENT_READ, m.listener)
        host, port = m.listener.sock.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def _send_up(self, m: _Member, vote: dict[str, Any] | None) -> None:
        """A relay's chunk is ready: its vote to the coordinator."""
        if vote is not None:
            self._send(m, encode(vote))

    def _relay_named(self, m: _Member, msg: dict[str, Any], now: float) -> None:
        """The coordinator named ``m``'s relay for generation ``msg["gen"]``: be it, or connect to it."""
        if msg["gen"] != m.gen:
            return  # another generation's (a newer one follows)
        if msg["relay"] == m.id:
            chunk = m.chunk = RelayChunk(msg["gen"], m.id, msg["chunk"])
            self._close_up(m)
            if m.voted is not None:  # its open vote went directly before it was named: it counts here too
                self._send_up(m, chunk.vote(m.id, m.gen, m.committed))
            for h, peer in list(m.inbound.items()):
                if not chunk.connect(h):
                    self._peer_close(peer)
                elif peer.vote is not None:
                    self._send_up(m, chunk.vote(h, *peer.vote))
            return
        m.chunk = None
        for peer in list(m.inbound.values()):
            self._peer_close(peer)
        up = m.up
        if up is not None and up.sock is not None and (up.relay, up.at) == (msg["relay"], msg["at"]):
            m.relay_gen = msg["gen"]  # the same relay as before: the channel goes on
            return
        self._close_up(m)
        m.relay_gen = msg["gen"]
        try:
            host, port = parse_address(msg["at"])
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        except (ValueError, OSError):
            return  # it votes directly
        sock.setblocking(False)
        if sock.connect_ex((host, port)) not in (0, errno.EINPROGRESS, errno.EAGAIN):
            sock.close()
            return
        tune_socket(sock)
        m.up = _Peer(sock, m, False, now, self._relayed_line)
        m.up.relay, m.up.at = msg["relay"], msg["at"]
        self.sel.register(sock, selectors.EVENT_READ, m.up)

    def _accept(self, listen: _Listen, now: float) -> None:
        for _ in range(64):
            sock = accept_tuned(listen.sock, 0.0)  # non-blocking
            if sock is None:
                return  # the rest (if any) on the next select
            peer = _Peer(sock, listen.owner, True, now, self._peer_line)
            self.sel.register(sock, selectors.EVENT_READ, peer)
            self._peer_send(peer, encode(relay_challenge(peer.challenge)))

    def _peer_readable(self, peer: _Peer, now: float) -> None:
        try:
            data = peer.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._peer_close(peer)
            return
        peer.heard = now
        try:
            msgs = peer.reader.feed(data)  # checked against the channel's schemas by its decoder
        except ProtocolError:
            self._peer_close(peer)  # hostile or broken: that channel goes, nothing else
            return
        self.relay_msgs += len(msgs)
        handle = self._at_relay if peer.inbound else self._at_session
        for msg in msgs:
            if peer.sock is None:
                return
            handle(peer, msg, now)

    def _at_relay(self, peer: _Peer, msg: dict[str, Any], now: float) -> None:
        """A message from a session of ``peer.owner``'s chunk (``peer.owner`` is the relay)."""
        m = peer.owner
        if peer.state == "shaking":
            reply, member = answer_hello(self.token, peer.challenge, m.id, msg)
            if member is None:
                self._peer_send(peer, encode(reply))
                self._peer_close(peer)
                return
            peer.state, peer.member = "joined", member
            old = m.inbound.get(member)
            if old is not None:
                self._peer_close(old)
            m.inbound[member] = peer
            self._peer_send(peer, encode(reply))
            if m.chunk is not None:
                m.chunk.connect(peer.member)
            return
        if msg["t"] == "vote":
            peer.vote = (msg["gen"], msg["step"])
            if m.chunk is not None and m.state == "joined":
                self._send_up(m, m.chunk.vote(peer.member, msg["gen"], msg["step"]))
        elif msg["t"] == "hello":
            self._peer_close(peer)

    def _at_session(self, peer: _Peer, msg: dict[str, Any], now: float) -> None:
        """A message from ``peer.owner``'s relay."""
        m = peer.owner
        kind = msg["t"]
        if peer.state == "shaking":
            if peer.shake is None:
                peer.shake = SessionHandshake(self.token, member=m.id, gen=m.gen, relay=peer.relay)
            try:
                reply = peer.shake.feed(msg)
            except ProtocolError:
                self._peer_close(peer)
                return
            if reply is not None:
                self._peer_send(peer, encode(reply))
            elif peer.shake.done:
                peer.state, peer.shake = "joined", None
                if m.voted is not None and m.relay_gen == m.gen:  # its open vote went directly: the relay, which
                    self._peer_send(peer, self._vote_line(m.gen, m.committed))  # counts it as connected, needs it
            return
        if kind == "decision" and m.state == "joined":
            self._decision(m, msg, now)
        elif kind == "ping":  # the relay holds our vote or waits for it
            self._peer_send(peer, self.hb)

    def _peer_line(self, line: bytes) -> dict[str, Any]:
        """``check(decode(line), RELAY_PEER_MESSAGES)`` for a line from a session to its relay; a short one (a
        vote, a heartbeat: the same bytes from every session of every chunk here each step) once per process (the
        message is read-only). A hello (a fresh nonce each) is never kept."""
        if len(line) > 96:
            return check(decode(line), RELAY_PEER_MESSAGES)
        hit = self.peer_lines.get(line)
        if hit is None:
            hit = check(decode(line), RELAY_PEER_MESSAGES)
            if len(self.peer_lines) >= 64:
                self.peer_lines.clear()
            self.peer_lines[line] = hit
        return hit

    def _relayed_line(self, line: bytes) -> dict[str, Any]:
        """``check(decode(line), RELAY_MESSAGES)`` once per process for the same bytes (every session of every chunk
        here receives the same decision line; the message is read-only)."""
        hit = self.relayed.get(line)
        if hit is None:
            hit = check(decode(line), RELAY_MESSAGES)
            if len(self.relayed) >= 64:
                self.relayed.clear()
            self.relayed[line] = hit
        return hit

    def _fan_out(self, m: _Member, msg: dict[str, Any]) -> None:
        key = (msg["gen"], msg["step"])
        line = self.decisions.get(key)
        if line is None:
            if len(self.decisions) > 64:
                self.decisions.clear()
            line = self.decisions[key] = encode(msg)
        for h, peer in m.inbound.items():
            if h != m.id:
                self._peer_send(peer, line)

    def _peer_send(self, peer: _Peer, data: bytes) -> None:
        if peer.sock is None or peer.state == "cut":
            return
        peer.wrote = True
        self.relay_msgs += 1
        if peer.out:
            peer.out += data
            return
        try:
            n = peer.sock.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            self._peer_close(peer)
            return
        if n < len(data):
            peer.out = data[n:]
            self.sel.modify(peer.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, peer)

    def _peer_flush(self, peer: _Peer) -> None:
        if peer.sock is None or not peer.out:
            return
        try:
            n = peer.sock.send(peer.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._peer_close(peer)
            return
        peer.out = peer.out[n:]
        if not peer.out:
            self.sel.modify(peer.sock, selectors.EVENT_READ, peer)

    def _peer_close(self, peer: _Peer) -> None:
        """A relay channel closed (either end): a relay stops waiting for that session; a session whose vote went
        to its relay sends it directly."""
        if peer.sock is None:
            return
        if peer.state == "cut":  # dead both ways: the other end never sees it close
            self.cut.append(peer.sock)
        else:
            try:
                self.sel.unregister(peer.sock)
            except (KeyError, ValueError):
                pass
            peer.sock.close()
        peer.sock = None  # type: ignore[assignment]
        m = peer.owner
        if peer.relay < 0 and peer.challenge:  # at the relay
            if m.inbound.get(peer.member) is peer:
                del m.inbound[peer.member]
                if m.chunk is not None and m.state == "joined":
                    self._send_up(m, m.chunk.disconnect(peer.member))
            return
        if m.up is peer:
            m.up = None
            if m.via_relay and m.voted is not None and m.state == "joined":
                m.via_relay = False
                self._send(m, self._vote_line(m.gen, m.committed))

    def _close_up(self, m: _Member) -> None:
        up, m.up = m.up, None
        if up is not None:
            self._peer_close(up)

    def _close_relay(self, m: _Member) -> None:
        """``m`` is gone: its relay listener and channels close."""
        self._close_up(m)
        for peer in list(m.inbound.values()):
            self._peer_close(peer)
        m.chunk = None
        if m.listener is not None:
            try:
                self.sel.unregister(m.listener.sock)
            except (KeyError, ValueError):
                pass
            m.listener.sock.close()
            m.listener = None

    def _silence_relay(self, m: _Member) -> None:
        """``m`` hangs: its relay channels stay open and unread."""
        for peer in [*m.inbound.values(), *([m.up] if m.up is not None else [])]:
            if peer.sock is not None:
                try:
                    self.sel.unregister(peer.sock)
                except (KeyError, ValueError):
                    pass
        if m.listener is not None:
            try:
                self.sel.unregister(m.listener.sock)
            except (KeyError, ValueError):
                pass

    def _forgive(self, now: float) -> None:
        """Count every relay channel as heard at ``now`` (as :class:`RelayHub` after its thread was descheduled)."""
        for m in self.members:
            if m.up is not None:
                m.up.heard = now
            for peer in m.inbound.values():
                peer.heard = now
            if m.open_since is not None:
                m.open_since = now

    def _relay_liveness(self, m: _Member, now: float) -> None:
        """Relay-channel liveness, once per heartbeat interval per session (as :class:`RelayHub`'s): a session
        whose vote waits at a silent relay votes directly; a relay with an undecided vote in its chunk pings the
        channels it wrote nothing to since the last check and stops waiting for a session silent for the timeout."""
        up = m.up
        if (up is not None and up.sock is not None and m.via_relay and m.voted is not None
                and now - max(up.heard, up.since) > self.relay_timeout):
            self._peer_close(up)  # sends the vote directly
        chunk = m.chunk
        if chunk is None:
            return
        if not any(s >= m.committed for s in chunk.voted.values()):
            m.open_since = None
            return
        if m.open_since is None:
            m.open_since = now
        for peer in list(m.inbound.values()):
            if now - max(peer.heard, m.open_since) > self.relay_timeout:
                self._peer_close(peer)  # the chunk stops waiting for it: it votes directly
            elif not peer.wrote:
                self._peer_send(peer, _PING)
            peer.wrote = False

    def _decided(self, m: _Member, now: float) -> None:
        st = self.steps
        k = m.voted
        assert k is not None
        st["left"][k] -= 1
        st["t_done"][k] = max(st["t_done"][k], now)
        m.voted = None
        if k + 1 < st["n"]:
            self._vote(m, now)


def worker_main(conn: Connection, cfg: dict[str, Any], lo: int, hi: int) -> None:
    """Entry point of a worker process: serve groups ``[lo, hi)`` until told to stop (or the parent is gone).
    ``cfg["stacks"]``: a file that SIGUSR2 appends every thread's stack to (the parent asks when it waited too
    long)."""
    # Whatever this process inherited (a forked worker: the parent's heap, frozen there before the fork -- see
    # MemberSim.start) is never collected here; the worker's own objects are few.
    gc.freeze()
    if cfg.get("stacks"):
        stacks = open(cfg["stacks"], "a")  # faulthandler writes to it until the process ends
        faulthandler.register(signal.SIGUSR2, file=stacks, all_threads=True, chain=False)
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
