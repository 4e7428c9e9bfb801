"""The membership service: one selector thread serving every connection of a coordinator.

It authenticates connections (:mod:`~torchnext.ft._wire`: a challenge, then a hello proving the job token; the
welcome proves it back), validates every message against its schema, and feeds the decisions of
:class:`~torchnext.ft.membership.Membership` (in office) or :class:`~torchnext.ft.election.Election` (a standby
collecting reports) back to the members.

Hostile input ends one connection, never the service: a malformed line, a message of the wrong shape, a second
hello, a peer that stops reading (its unsent bytes pass :data:`MAX_UNSENT`), an unauthenticated connection idle for
``HELLO_TIMEOUT_S``, or one pending for :data:`SHED_AFTER_S` while :data:`MAX_UNAUTHENTICATED` others wait (below
that age, new connections wait in the listen backlog instead: a launch of many members at once queues, it is not
shed) -- each closes that connection with a logged reason (``torchnext.ft`` logger). An unauthenticated peer gets a ``reject`` naming what was wrong; an authenticated
member whose connection is closed is a failed member, as if it had crashed. Sends never block: each connection has
its own outgoing buffer drained when the socket is writable, so a peer that does not read cannot stall the others.

Cost per message: a message the state machine sends to many members (a generation, a decision, the pings) is
encoded once per flush and the same bytes are queued on every connection; each connection is written once per flush
(its messages concatenated: framing is per line, so concatenation is exact). Heartbeat expiry is judged at the time
the loop last returned from ``select`` (everything a member sent before then has been read), so a loop slowed by its
own work never removes a member that kept sending; the loop forgives silence (:meth:`Membership.forgive`) only when
it was itself descheduled -- off the CPU for more than two heartbeat intervals beyond its requested wait, measured
with ``time.thread_time`` -- and at most once per two heartbeat timeouts, so sustained overload or starvation
cannot switch hang detection off (a hang is declared within two timeouts plus one loop iteration at worst).
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torchnext.ft._wire import (
    HELLO_TIMEOUT_S,
    MEMBER_MESSAGES,
    PROTOCOL_VERSION,
    LineReader,
    ProtocolError,
    check,
    encode,
    mac,
    new_nonce,
    setup_accepted,
    verify,
)
from torchnext.ft.election import Election, Report
from torchnext.ft.membership import HISTORY_EVENTS, Membership, MembershipConfig, Rejected

__all__ = ["HELLO_TIMEOUT_S", "MAX_UNAUTHENTICATED", "MAX_UNSENT", "MembershipService"]

_LOG = logging.getLogger("torchnext.ft")

MAX_UNAUTHENTICATED = 256
"""Unauthenticated connections kept at once. Beyond this a new connection waits in the listen backlog until one
completes its handshake, or closes the oldest pending one if that has been pending for :data:`SHED_AFTER_S`."""
SHED_AFTER_S = 1.0
"""A pending handshake this old may be shed for a new connection (a member answers a challenge within
milliseconds; an idle peer holding a slot is what this bounds)."""
_LISTEN_BACKLOG = 4096
MAX_UNSENT = 1 << 20
"""Bytes queued for a peer that does not read; beyond this its connection is closed."""
_RECV = 1 << 16
_FD_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    peer: str
    opened: float
    nonce: str
    reader: LineReader = field(default_factory=LineReader)
    out: bytearray = field(default_factory=bytearray)
    member: int | None = None
    """The authenticated member id (a member in office, or a reporter while standing by)."""
    reporter: bool = False
    last_seen: float = 0.0
    join: tuple[int | None, int, int] = (None, 0, 1)
    coordinators: int = 1
    fenced_until: float | None = None
    fence_msg: dict[str, Any] | None = None
    writing: bool = False
    ids: list[int] = field(default_factory=list)
    """A group session's member ids by group rank (``ids[0] == member``, the leader); empty for a flat member."""
    ping_every: float = 0.0
    """Ping this connection only after this long without writing to it (a quarter of the member's
    ``coordinator_timeout_s`` from its hello; 0: every heartbeat interval, as before protocol 4)."""
    wrote_at: float = 0.0
    """When something was last queued for this connection (``time.monotonic()``)."""
    relay_at: str | None = None
    """A group session's relay listener (``hello.relay``, protocol 5)."""

    def speaks_for(self) -> list[int]:
        """The members this connection speaks for: its group's, or its own."""
        return self.ids or ([] if self.member is None else [self.member])


class MembershipService:
    """Serves the membership protocol on ``host:port`` until :meth:`stop`. ``standby=True``: not in office until
    members that lost their coordinator report and the takeover rule holds (:mod:`torchnext.ft.election`).

    ``state`` (the :class:`Membership`, None while standing by), ``lock`` (hold it to read ``state``), ``stalls``.
    """

    def __init__(self, *, host: str, port: int, token: str, store_port: int, membership: MembershipConfig,
                 standby: bool) -> None:
        self._token = token
        self._config = membership
        self.store_port = store_port
        self.lock = threading.RLock()
        self.state: Membership | None = None if standby else Membership(membership)
        self.election: Election | None = Election(grace_s=membership.heartbeat_timeout_s) if standby else None
        self.standby_history: deque[dict[str, Any]] = deque(maxlen=HISTORY_EVENTS)
        self.stalls = 0
        """How many times the loop was descheduled and forgave missed heartbeats (at most once per two timeouts)."""
        self._conns: dict[socket.socket, _Conn] = {}
        self._unauthenticated: dict[_Conn, None] = {}
        """Connections still in their handshake, oldest first."""
        self._by_member: dict[int, _Conn] = {}
        self._listener = socket.create_server((host, port), backlog=_LISTEN_BACKLOG)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, "accept")
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._accept_paused_until = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchnext-coordinator", daemon=True)

    # ------------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Close every connection and the listener (members see their coordinator lost). Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        else:
            self._shutdown()

    def alive(self) -> bool:
        """The service thread is running."""
        return self._thread.is_alive()

    def history(self) -> list[dict[str, Any]]:
        with self.lock:
            own = self.state.history if self.state is not None else []
            return [dict(h) for h in [*self.standby_history, *own]]

    # ------------------------------------------------------------------------------------------------ the loop
    def _run(self) -> None:
        cfg = self._config
        tick = min(cfg.heartbeat_interval_s / 4, 0.025)
        next_ping = time.monotonic()
        forgiven_at = float("-inf")
        try:
            while not self._stop.is_set():
                with self.lock:
                    due = self.state.next_deadline() if self.state is not None else None
                start, cpu = time.monotonic(), time.thread_time()
                wait = tick if due is None else max(0.0, min(tick, due - start))
                polled = self._poll(wait)
                now = time.monotonic()
                with self.lock:
                    if (self._descheduled(now - start, time.thread_time() - cpu, wait)
                            and now - forgiven_at > 2 * cfg.heartbeat_timeout_s):
                        # Off the CPU (SIGSTOP, the host's scheduler): the members' silence may be ours. Not again
                        # within two heartbeat timeouts: a coordinator starved for good has a window of one full
                        # timeout without forgiveness after each, in which a hung member expires.
                        self.stalls += 1
                        forgiven_at = now
                        self._forgive(now)
                    # Expiry judged at `polled`: every byte a member sent before it has been read by now.
                    self._guard("tick", self._tick, polled)
                if now >= next_ping:
                    next_ping = now + cfg.heartbeat_interval_s
                    self._guard("ping", self._ping, now)
        finally:
            self._shutdown()

    def _descheduled(self, wall: float, cpu: float, wait: float) -> bool:
        """One loop iteration spent more than two heartbeat intervals off the CPU beyond the ``wait`` it asked
        ``select`` for: the process was descheduled (its own work, however slow, is CPU time and does not count)."""
        return wall - cpu - wait > 2 * self._config.heartbeat_interval_s

    def _guard(self, what: str, fn: Callable[[float], None], now: float) -> None:
        """Run one step of the loop; a bug in it is logged and the service goes on serving."""
        try:
            fn(now)
        except Exception:
            _LOG.exception("torchnext coordinator: internal error in %s (the service goes on)", what)

    def _poll(self, wait: float) -> float:
        """One ``select`` and the work it found; returns the time ``select`` returned."""
        if self._accept_paused_until and time.monotonic() >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._sel.register(self._listener, selectors.EVENT_READ, "accept")
        ready = self._sel.select(timeout=wait)
        polled = time.monotonic()
        for key, events in ready:
            if key.data == "accept":
                self._accept()
            elif key.data == "wake":
                self._wake_r.recv(64)
            else:
                conn: _Conn = key.data
                if events & selectors.EVENT_WRITE:
                    self._write(conn)
                if events & selectors.EVENT_READ and conn.sock in self._conns:
                    self._readable(conn)
        return polled

    def _pause_accepting(self, seconds: float) -> None:
        """Leave new connections in the listen backlog for ``seconds``."""
        if not self._accept_paused_until:
            self._sel.unregister(self._listener)
        self._accept_paused_until = time.monotonic() + seconds

    def _accept(self) -> None:
        while True:
            if len(self._unauthenticated) >= MAX_UNAUTHENTICATED and not self._shed_unauthenticated(
                    "too many unauthenticated connections", SHED_AFTER_S):
                self._pause_accepting(0.02)  # the rest wait in the backlog for a handshake to complete
                return
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _FD_EXHAUSTED:  # out of descriptors: shed an unauthenticated peer, or pause
                    if not self._shed_unauthenticated("descriptors exhausted", 0.0):
                        self._pause_accepting(0.1)
                    return
                continue  # ECONNABORTED, EPROTO, ...: that connection is gone, the listener is fine
            now = time.monotonic()
            if not setup_accepted(sock, 0.0):  # non-blocking
                continue
            conn = _Conn(sock, _peer(addr), now, new_nonce())
            self._conns[sock] = conn
            self._unauthenticated[conn] = None
            self._sel.register(sock, selectors.EVENT_READ, conn)
            self._send(conn, {"t": "challenge", "nonce": conn.nonce, "proto": PROTOCOL_VERSION})

    def _shed_unauthenticated(self, why: str, min_age_s: float) -> bool:
        """Close the oldest pending handshake if it has been pending for ``min_age_s``; True when one was closed."""
        oldest = next(iter(self._unauthenticated), None)
        if oldest is None or time.monotonic() - oldest.opened < min_age_s:
            return False
        _LOG.warning("torchnext coordinator: closing unauthenticated connection from %s (%s)", oldest.peer, why)
        self._close(oldest)
        return True

    def _readable(self, conn: _Conn) -> None:
        now = time.monotonic()
        try:
            data = conn.sock.recv(_RECV)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._lost(conn, now, f"connection broke: {exc}")
            return
        if not data:
            self._lost(conn, now, "connection closed (process exited or crashed)")
            return
        try:
            for msg in conn.reader.feed(data):
                if conn.sock not in self._conns:
                    return
                self._dispatch(conn, msg, now)
        except ProtocolError as exc:
            self._violation(conn, now, str(exc))
        except Exception as exc:  # a bug triggered by this peer's input: this connection goes, the service stays
            _LOG.exception("torchnext coordinator: internal error on a message from %s", conn.peer)
            self._violation(conn, now, f"internal error: {type(exc).__name__}")

    def _violation(self, conn: _Conn, now: float, why: str) -> None:
        who = conn.peer if conn.member is None else f"member {conn.member} ({conn.peer})"
        _LOG.warning("torchnext coordinator: closing the connection of %s: protocol error: %s", who, why)
        if conn.member is None:
            self._send(conn, {"t": "reject", "code": "bad_request", "reason": why[:2000]})
            self._write(conn)
        self._lost(conn, now, f"protocol error: {why}")

    # ------------------------------------------------------------------------------------------------ messages
    def _dispatch(self, conn: _Conn, raw: dict[str, Any], now: float) -> None:
        if conn.fence_msg is not None:  # a removed member speaks again: tell it (again) that it was removed
            self._send(conn, conn.fence_msg)
            return
        if conn.member is None:
            self._hello(conn, raw, now)
            return
        msg = check(raw, MEMBER_MESSAGES)
        kind, mid = msg["t"], conn.member
        if kind == "hello":
            raise ProtocolError("a second hello on an authenticated connection")
        conn.last_seen = now
        with self.lock:
            if conn.reporter:
                self._reporter_message(conn, msg, now)
                return
            st = self.state
            assert st is not None
            st.heartbeat(mid, now)  # any message says the sender is alive (it skips its hb when it sent one)
            if kind == "vote":
                st.vote(mid, msg["gen"], msg["step"], now, chunk=msg["chunk"], heads=msg["heads"])
            elif kind == "fail":
                who = mid if msg["member"] is None else self._own(conn, msg["member"], "fail", leader=True)
                st.report_failure(who, msg["gen"], msg["reason"][:500], now, end=msg["end"])
            elif kind == "lost":  # a leader saw a follower die on its local channel: a group failure
                who = self._own(conn, msg["member"], "lost", leader=False)
                st.failure(who, now, f"lost by its leader {mid}: {msg['reason'][:500] or 'no reason given'}",
                           hung=msg["hung"])
            elif kind == "bye":
                if msg["done"]:
                    for m in conn.speaks_for():  # a group session: the leader finishes for its group
                        st.finish(m, now)
                else:
                    st.leave(mid, now)
            self._flush(now)

    @staticmethod
    def _own(conn: _Conn, member: int, kind: str, *, leader: bool) -> int:
        """``member`` as named by ``conn``'s ``kind`` message: a member of its group session (the leader itself
        only when ``leader``); anything else is a protocol violation (it would touch another group)."""
        if member == conn.member and leader:
            return member
        if member not in conn.ids or member == conn.member:
            raise ProtocolError(f"{kind} names member {member}, which is not a follower in this connection's "
                                f"group session (members {conn.ids or [conn.member]})")
        return member

    def _reporter_message(self, conn: _Conn, msg: dict[str, Any], now: float) -> None:
        assert self.election is not None and conn.member is not None
        kind = msg["t"]
        if kind == "promise":
            for m in conn.speaks_for():  # a leader promises for its group
                self.election.promise(m, msg["term"])
            self._elect(now)
        elif kind == "bye":
            ids = conn.speaks_for()
            self._close(conn)
            for m in ids:
                self.election.remove(m)
            self._elect(now)
        # heartbeats only refresh last_seen; votes and failure reports mean nothing before a generation exists

    def _hello(self, conn: _Conn, raw: dict[str, Any], now: float) -> None:
        if raw.get("t") != "hello":
            self._reject(conn, "bad_request", "the first message must be a hello")
            return
        if raw.get("proto") != PROTOCOL_VERSION:
            self._reject(conn, "bad_request", f"protocol version {raw.get('proto')!r}, expected {PROTOCOL_VERSION}")
            return
        try:
            msg = check(raw, MEMBER_MESSAGES)
        except ProtocolError as exc:
            self._reject(conn, "bad_request", str(exc))
            return
        if not verify(self._token, "member", conn.nonce, msg["nonce"], msg["proof"]):
            self._reject(conn, "auth", "wrong job token")
            return
        followers = msg["followers"] or None
        if followers is not None and (msg["group"] is None or msg["group_rank"] != 0
                                      or msg["group_size"] != 1 + len(followers)):
            self._reject(conn, "bad_request", f"a group session is led by rank 0 of a replica group and lists its "
                         f"other ranks: group={msg['group']}, group_rank={msg['group_rank']}, group_size="
                         f"{msg['group_size']} with {len(followers)} follower(s)")
            return
        conn.join = (msg["group"], msg["group_rank"], msg["group_size"])
        conn.relay_at = msg["relay"] if followers is not None else None
        conn.coordinators = msg["coordinators"]
        if msg["coordinator_timeout_s"] is not None:  # its own silence bound: a ping every quarter of it suffices
            conn.ping_every = max(self._config.heartbeat_interval_s, msg["coordinator_timeout_s"] / 4)
        report = msg["report"]
        with self.lock:
            if self.state is None:
                self._report(conn, msg, now)
                return
            st = self.state
            if report is not None:
                if st.gen == 0:
                    self._reject(conn, "not_resumable", "this coordinator started a new job (it was not started as "
                                 "a standby): it cannot resume another one")
                    return
                if report["term"] > st.term:
                    self._reject(conn, "stale_coordinator", f"you promised term {report['term']} but this "
                                 f"coordinator's term is {st.term}: a newer coordinator took office")
                    return
            if msg["coordinators"] > 1:
                st.failover = True
            step = msg["step"] if report is None else report["step"]
            try:
                if followers is None:
                    mid = st.join(msg["member"], step, now, group=msg["group"], group_rank=msg["group_rank"],
                                  group_size=msg["group_size"])
                else:
                    conn.ids = st.join_group(msg["member"], step, [(f["member"], f["step"]) for f in followers],
                                             now, group=msg["group"], relay_at=msg["relay"])
                    mid = conn.ids[0]
            except Rejected as exc:
                self._reject(conn, exc.code, exc.reason)
                return
            conn.member = mid
            conn.last_seen = now
            for m in conn.speaks_for():
                self._by_member[m] = conn
            self._unauthenticated.pop(conn, None)
            self._welcome(conn, msg["nonce"], "office", st.term)
            self._flush(now)

    def _report(self, conn: _Conn, msg: dict[str, Any], now: float) -> None:
        """Standby: a member that lost its coordinator reports (caller holds the lock)."""
        assert self.election is not None
        if msg["report"] is None:
            self._reject(conn, "standby", "this coordinator is a standby and not in office: no member that lost "
                         "its coordinator has reported to it yet")
            return
        mid = msg["member"]
        followers = msg["followers"] or []
        ids = [mid, *(f["member"] for f in followers)]
        if any(m is None for m in ids):
            self._reject(conn, "bad_request", "a report needs the member id (of every rank of a group session)")
            return
        if len(set(ids)) != len(ids):
            self._reject(conn, "bad_request", f"a group session's report names a member twice: {ids}")
            return
        for m in ids:
            if m in self._by_member:
                self._reject(conn, "duplicate", f"member {m} already reported on another connection")
                return
        conn.member = mid
        conn.ids = ids if followers else []
        conn.reporter = True
        conn.last_seen = now
        for m in ids:
            self._by_member[m] = conn
        self._unauthenticated.pop(conn, None)
        # A leader's report stands for every rank of its group: they entered the same generations, and its
        # followers hold at most the decisions it relayed to them (docs/fault_tolerance.md, "Membership hierarchy").
        reports = [Report.from_message(m, msg["report"]) for m in ids]
        self.standby_history.append({"event": "report", "member": mid, "at": now, "term": reports[0].term,
                                     "entered": None if reports[0].entered is None else reports[0].entered.gen,
                                     "step": reports[0].step, **({"followers": ids[1:]} if followers else {})})
        self._welcome(conn, msg["nonce"], "standby", 0)
        term = None
        for report in reports:
            term = self.election.add(report, now)
        if term is not None:
            self._send(conn, {"t": "prepare", "term": term})
        self._elect(now)

    def _elect(self, now: float) -> None:
        """Standby: prepare a term once the reports allow it; take office once the promises do (lock held)."""
        election = self.election
        if election is None or self.state is not None:
            return
        term = election.prepare(now)
        if term is not None:
            self.standby_history.append({"event": "prepare", "term": term, "at": now,
                                         "reporters": sorted(election.reports)})
            for conn in dict.fromkeys(self._by_member[mid] for mid in election.reports):  # a group's once
                self._send(conn, {"t": "prepare", "term": term})
        takeover = election.decide(now)
        if takeover is None:
            return
        st = Membership(self._config)
        reporters = {mid: self._by_member[mid] for mid in election.reports}
        st.failover = any(c.coordinators > 1 for c in reporters.values())
        joins = {m: _join_of(reporters[m], m) for m in takeover.members}
        sessions: dict[int, int] = {}
        for m in takeover.members:
            head = reporters[m].member
            if head is not None:
                sessions[m] = head
        relays = {m: c.relay_at for m, c in reporters.items() if c.relay_at and c.member == m}
        st.take_office(takeover, joins, now, sessions=sessions, relays=relays)
        self.state = st
        _LOG.warning("torchnext coordinator: %s", takeover.reason)
        for conn in dict.fromkeys(reporters.values()):
            conn.reporter = False
            ids = conn.speaks_for()
            if ids[0] in takeover.members:
                continue
            # reported but did not promise in time: an ordinary joiner now (a group session: its whole group)
            report = election.reports[ids[0]]
            try:
                if conn.ids:
                    st.join_group(ids[0], report.step, [(m, report.step) for m in ids[1:]], now,
                                  group=int(conn.join[0] or 0), relay_at=conn.relay_at)
                else:
                    group, rank, size = conn.join
                    st.join(ids[0], report.step, now, group=group, group_rank=rank, group_size=size)
            except Rejected as exc:
                self._reject(conn, exc.code, exc.reason)
        self._flush(now)

    def _welcome(self, conn: _Conn, member_nonce: str, role: str, term: int) -> None:
        cfg = self._config
        assert conn.member is not None
        msg: dict[str, Any] = {
            "t": "welcome", "proof": mac(self._token, "coordinator", member_nonce, conn.nonce), "member": conn.member,
            "store_port": self.store_port, "proto": PROTOCOL_VERSION, "role": role, "term": term,
            "heartbeat_interval_s": cfg.heartbeat_interval_s, "heartbeat_timeout_s": cfg.heartbeat_timeout_s,
            "quorum_timeout_s": cfg.quorum_timeout_s, "grow_timeout_s": cfg.grow_timeout_s,
        }
        if conn.ids:  # a group session: its ids by group rank, and the local level's heartbeat settings
            msg.update(members=conn.ids, group_heartbeat_interval_s=cfg.group_heartbeat_interval_s,
                       group_heartbeat_timeout_s=cfg.group_heartbeat_timeout_s)
        self._send(conn, msg)

    def _reject(self, conn: _Conn, code: str, reason: str) -> None:
        _LOG.info("torchnext coordinator: refused %s (%s): %s", conn.peer, code, reason)
        self._send(conn, {"t": "reject", "code": code, "reason": reason[:2000]})
        self._write(conn)
        self._close(conn)

    # ------------------------------------------------------------------------------------------------ timers
    def _tick(self, now: float) -> None:
        if self.state is not None:
            self.state.tick(now)
            self._flush(now)
            return
        assert self.election is not None
        timeout = self._config.heartbeat_timeout_s
        for conn in [c for c in self._conns.values() if c.reporter and now - c.last_seen > timeout]:
            _LOG.info("torchnext coordinator: reporter %s went silent", conn.member)
            self._lost(conn, now, "missed heartbeats")
        self._elect(now)

    def _forgive(self, now: float) -> None:
        if self.state is not None:
            self.state.forgive(now)
        for conn in self._conns.values():
            conn.last_seen = max(conn.last_seen, now)

    def _ping(self, now: float) -> None:
        ping = _PING
        with self.lock:  # a session of a relay's chunk hears from us through its relay's decisions (protocol 5)
            st = self.state
            chunk_of = st.chunk_of if st is not None else {}
            relayed_at = st.relayed_at if st is not None else float("-inf")
        for conn in list(self._conns.values()):
            if conn.fenced_until is not None:
                if now > conn.fenced_until:
                    self._close(conn)
            elif conn.member is not None:
                if now - conn.wrote_at >= conn.ping_every:  # it heard from us recently enough otherwise
                    if now - relayed_at < conn.ping_every and conn.member in chunk_of:
                        continue  # a decision reached it through its relay just now
                    self._send_bytes(conn, ping)
            elif now - conn.opened > HELLO_TIMEOUT_S:
                _LOG.info("torchnext coordinator: closing %s: no hello within %ss", conn.peer, HELLO_TIMEOUT_S)
                self._close(conn)

    # --------------------------------------------------------------------------------------------- delivery
    def _flush(self, now: float) -> None:
        """Deliver what the state machine decided (lock held). Order: messages, fences, closes."""
        st = self.state
        if st is None or not (st.outbox or st.to_fence or st.to_close):
            return  # nothing decided (most messages: a heartbeat, a vote that was not the last)
        outbox, st.outbox = st.outbox, []
        if outbox:
            encoded: dict[int, bytes] = {}  # id(msg) -> its line: a broadcast is encoded once (outbox keeps msg alive)
            queued: dict[_Conn, None] = {}
            given: set[tuple[int, int]] = set()  # (conn, msg) pairs sent: a group session gets a message once
            for mid, msg in outbox:
                conn = self._by_member.get(mid)
                if conn is None or conn.sock not in self._conns:
                    continue
                if conn.ids:
                    key = (id(conn), id(msg))
                    if key in given:
                        continue
                    given.add(key)
                line = encoded.get(id(msg))
                if line is None:
                    line = encoded[id(msg)] = encode(msg)
                conn.out += line
                queued[conn] = None
            for conn in queued:  # one write per connection, however many messages it got
                self._push(conn)
        fences, st.to_fence = st.to_fence, []
        for mid, msg in fences:
            conn = self._by_member.pop(mid, None)
            if conn is not None and conn.fence_msg is None:  # a group session: the first member's reason
                conn.fence_msg = msg
                conn.fenced_until = now + self._config.fence_linger_s
                self._send(conn, msg)
        closes, st.to_close = st.to_close, []
        for mid in closes:
            conn = self._by_member.pop(mid, None)
            if conn is not None and conn.member == mid:  # a follower has no connection of its own to close
                self._write(conn)
                self._close(conn)

    def _send(self, conn: _Conn, msg: dict[str, Any]) -> None:
        """Queue ``msg`` and write what the socket takes now; never blocks."""
        self._send_bytes(conn, encode(msg))

    def _send_bytes(self, conn: _Conn, line: bytes) -> None:
        """Queue one encoded message (see :meth:`_send`)."""
        if conn.sock not in self._conns:
            return
        conn.out += line
        self._push(conn)

    def _push(self, conn: _Conn) -> None:
        """Write what the socket takes now; close a peer whose unsent bytes pass :data:`MAX_UNSENT`."""
        conn.wrote_at = time.monotonic()
        self._write(conn)
        if len(conn.out) > MAX_UNSENT:
            _LOG.warning("torchnext coordinator: closing %s: it does not read (%d bytes unsent)", conn.peer,
                         len(conn.out))
            self._lost(conn, time.monotonic(), "does not read its messages")

    def _write(self, conn: _Conn) -> None:
        if conn.sock not in self._conns:
            return
        try:
            while conn.out:
                n = conn.sock.send(conn.out)
                del conn.out[:n]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            conn.out.clear()  # broken: the reader sees EOF and handles it
        want = bool(conn.out)
        if want != conn.writing:
            conn.writing = want
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0)
            self._sel.modify(conn.sock, events, conn)

    def _lost(self, conn: _Conn, now: float, why: str) -> None:
        """The peer is gone (or was thrown out): close, and tell the state machine."""
        mid = conn.member
        fenced = conn.fence_msg is not None
        reporter = conn.reporter
        self._close(conn)
        if mid is None or fenced:
            return
        with self.lock:
            if reporter:
                assert self.election is not None
                for m in conn.speaks_for():
                    self.election.remove(m)
            elif self.state is not None:
                self.state.failure(mid, now, why, hung=False)
                self._flush(now)

    def _close(self, conn: _Conn) -> None:
        self._unauthenticated.pop(conn, None)
        if self._conns.pop(conn.sock, None) is None:
            return
        for m in conn.speaks_for():
            if self._by_member.get(m) is conn:
                del self._by_member[m]
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        try:
            conn.sock.close()
        except OSError:
            pass

    def _shutdown(self) -> None:
        for conn in list(self._conns.values()):
            self._close(conn)
        for s in (self._listener, self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass
        try:
            self._sel.close()
        except (OSError, RuntimeError):
            pass


_PING = encode({"t": "ping"})


def _join_of(conn: _Conn, mid: int) -> tuple[int | None, int, int]:
    """``(group, group_rank, group_size)`` of member ``mid`` as its connection's hello said."""
    if not conn.ids:
        return conn.join
    return conn.join[0], conn.ids.index(mid), len(conn.ids)


def _peer(addr: Any) -> str:
    try:
        return f"{addr[0]}:{addr[1]}"
    except (TypeError, IndexError):
        return str(addr)
