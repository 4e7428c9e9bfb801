"""A member's side of the membership protocol: one connection to the coordinator in office, one heartbeat thread,
and failover to the next coordinator address when that one is lost.

The thread does nothing heavy: it sends ``{"t": "hb"}`` every heartbeat interval (unless the member sent another
message within it: any message says it is alive) and reads the coordinator's
messages the moment they arrive. Messages that must interrupt the member (a new generation with ``abort``, "wait",
"removed", "fatal", a lost coordinator) call ``on_interrupt(msg)`` *in the thread*, so a main thread blocked in a
collective is unblocked at once (the fault-tolerant wrapper aborts its Communicator there); then every message is
queued for the main thread (``next_event``).

Failover. Members know an ordered list of coordinator addresses (``"host1:port1,host2:port2"``). When the connection
to the coordinator breaks, or it is silent for ``coordinator_timeout_s``, the thread interrupts the member and
tries the addresses in order, each with a *report* of what this member knows (its term, the newest generation it
entered, its committed step, a vote still waiting for a decision; see :mod:`torchnext.ft.election`):

* a **standby** welcomes it and, once enough members reported, asks for a promise of a higher term (``prepare``):
  the member promises (it will never again take part under a lower term) and waits for the takeover's decisions and
  first generation, whose store is the new coordinator's (``store_host``/``store_port`` follow);
* a coordinator **in office** (a survivor that lost only this connection, or one that already took over) admits it
  as a joiner, healed like any other, or refuses it (``removed``: it was declared failed meanwhile);
* nobody in office within ``failover_timeout_s`` -- the member is cut off from the coordinators and the majority --
  ends membership with :class:`~torchnext.ft.membership.CoordinatorLost`: it stops instead of training alone.

Every message from a coordinator is checked against its schema (:mod:`~torchnext.ft._wire`) after the coordinator
proved it knows the job token; a malformed one counts as losing that coordinator.
"""

from __future__ import annotations

import os
import queue
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from torchnext.ft._wire import (
    COORDINATOR_MESSAGES,
    MAX_GENERATION_LINE,
    PROTOCOL_VERSION,
    LineReader,
    ProtocolError,
    apply_delta,
    check,
    encode,
    mac,
    new_nonce,
    tune_socket,
    verify,
)
from torchnext.ft.errors import RetriesExhausted, StepFailed
from torchnext.ft.membership import (
    CoordinatorLost,
    JobFinished,
    MembershipError,
    QuorumLost,
    Rejected,
    RemovedFromGroup,
)

__all__ = ["MemberClient", "fatal_code", "parse_address", "parse_addresses"]

_INTERRUPTING = frozenset({"wait", "removed", "fatal"})
ARRIVED_AFTER = "_arrived_after"
"""The key of a queued message that holds :attr:`MemberClient.interruptions` at its arrival (not on the wire)."""
_TRY_NEXT = frozenset({"standby", "not_resumable", "stale_coordinator", "auth", "duplicate", "bad_request"})
"""Refusals after which a failing-over member tries the next address (this coordinator cannot take it)."""


def parse_address(address: str, *, any_port: bool = False) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) -> ``(host, port)``; ``ValueError`` naming the problem otherwise.
    ``any_port``: port 0 is accepted (an address to bind: a free port)."""
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"coordinator address must be 'host:port', got {address!r}")
    host, _, port = address.strip().rpartition(":")
    try:
        p = int(port)
    except ValueError:
        raise ValueError(f"coordinator address {address!r}: port {port!r} is not an int") from None
    if not host or not (0 if any_port else 1) <= p < 65536:
        raise ValueError(f"coordinator address {address!r}: expected host:port with {0 if any_port else 1} <= port < 65536")
    return host.strip("[]"), p


def parse_addresses(addresses: str | Sequence[str]) -> list[tuple[str, int]]:
    """The coordinator list: ``"host1:port1,host2:port2"`` (or a sequence of ``host:port``), in failover order.

    Raises:
        ValueError: an empty list, a malformed entry (named), or the same address twice.
    """
    items = addresses.split(",") if isinstance(addresses, str) else list(addresses)
    out = [parse_address(a) for a in items if not (isinstance(a, str) and not a.strip())]
    if not out:
        raise ValueError(f"no coordinator address in {addresses!r}")
    if len(set(out)) != len(out):
        raise ValueError(f"coordinator list {addresses!r} names an address twice")
    return out


def _fmt(addr: tuple[str, int]) -> str:
    return f"[{addr[0]}]:{addr[1]}" if ":" in addr[0] else f"{addr[0]}:{addr[1]}"


class _Early(list[dict[str, Any]]):
    """The messages that arrived with a handshake's welcome, and the reader that read them (it may hold the start
    of a message not yet complete)."""

    def __init__(self, reader: LineReader) -> None:
        super().__init__()
        self.reader = reader


class MemberClient:
    """Connects, authenticates (job token, both ways), joins; then heartbeats from a daemon thread until
    ``close()``, failing over as the module docstring says.

    ``member_id`` (assigned or confirmed by the coordinator), ``store_host``/``store_port`` (the TCPStore of the
    coordinator in office), ``term``, ``fatal`` (the :class:`~.membership.MembershipError` that ended membership, or
    None). ``report()`` (from the owner, any thread) returns ``{"step", "synced", "entered", "vote"}`` for failover.

    Subclasses (:mod:`torchnext.ft.group_session`: a replica group's leader and its followers) change what a hello
    carries (:meth:`_hello_extra`), see every message from the coordinator before it is handled (:meth:`_relay_out`)
    and read another set of messages (``_schemas``).
    """

    _schemas: dict[str, Any] = COORDINATOR_MESSAGES
    """The messages this client accepts from its peer (a coordinator's)."""

    def __init__(
        self,
        address: str | Sequence[str],
        token: str,
        *,
        member_id: int | None,
        step: int,
        connect_timeout_s: float,
        replica_group: int | None = None,
        group_rank: int = 0,
        group_size: int = 1,
        coordinator_timeout_s: float,
        on_interrupt: Callable[[dict[str, Any]], None],
        failover_timeout_s: float = 10.0,
        report: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.addresses = parse_addresses(address)
        self._token = token
        self._on_interrupt = on_interrupt
        self.interruptions = 0
        """Interruptions delivered to ``on_interrupt`` so far -- every one but a new generation's and the job's end
        (``wait``, ``removed``, ``fatal``, a lost coordinator). Every queued message carries the count at its
        arrival as ``ARRIVED_AFTER``: an interruption after a generation's announcement ends that generation's
        build, one before it does not (a standby's first generation follows the lost coordinator's interruption)."""
        self._coordinator_timeout_s = coordinator_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._failover_timeout_s = failover_timeout_s
        self._report_fn = report
        self._group = (replica_group, group_rank, group_size)
        self.events: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self.news = threading.Event()
        """Set whenever an event is queued (waiters clear it, then check ``events``)."""
        self.fatal: MembershipError | None = None
        self.term = 0
        """The highest term this member entered a generation of, or promised."""
        self.failovers = 0
        """How many times this member lost its coordinator and found another in office."""
        self._attempted = 0
        self._decided: tuple[int, int, int] | None = None
        self._failing_since: float | None = None
        self._send_lock = threading.Lock()
        self._last_sent = 0.0
        """When this member last sent its coordinator anything (a heartbeat is skipped within an interval of it)."""
        self._base_gen: tuple[int, list[list[int]]] = (0, [])
        """The last generation received (number, replica groups): what a delta generation is applied to."""
        self._closed = threading.Event()
        self.member_id: int = -1 if member_id is None else member_id
        sock, welcome, early, addr = self._first_join(member_id, step)
        self._install(sock, welcome, addr, early.reader)
        self.heartbeat_interval_s = float(welcome["heartbeat_interval_s"])
        self.heartbeat_timeout_s = float(welcome["heartbeat_timeout_s"])
        self.quorum_timeout_s: float | None = welcome.get("quorum_timeout_s")
        self.grow_timeout_s: float | None = welcome.get("grow_timeout_s")
        self.group_heartbeat_interval_s: float | None = welcome.get("group_heartbeat_interval_s")
        """The local level's heartbeat settings (a group session's welcome, protocol 4; None for a flat member)."""
        self.group_heartbeat_timeout_s: float | None = welcome.get("group_heartbeat_timeout_s")
        for msg in early:  # e.g. the first generation, sent right after the welcome
            self._relay_out(msg)
            self._observe(msg)
            msg[ARRIVED_AFTER] = 0
            self.events.put(msg)
        self._thread = threading.Thread(target=self._run, name=f"torchnext-heartbeat[{self.member_id}]", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------------------------------------- connecting
    def _first_join(self, member_id: int | None, step: int
                    ) -> tuple[socket.socket, dict[str, Any], _Early, tuple[str, int]]:
        """Join through the first listed coordinator in office (passes over the list until connect_timeout_s)."""
        deadline = time.monotonic() + self._connect_timeout_s
        problems: dict[str, str] = {}
        refusal: Rejected | None = None
        while True:
            self._before_join_pass()
            for addr in self.addresses:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    sock, welcome, early = self._handshake(addr, member_id, step, None, remaining)
                except Rejected as exc:
                    if exc.code in ("standby", "not_resumable"):
                        problems[_fmt(addr)] = exc.reason
                        continue
                    if exc.code in ("auth", "bad_request") and len(self.addresses) > 1:
                        refusal = refusal or exc
                        problems[_fmt(addr)] = str(exc)
                        continue
                    raise
                except (OSError, ProtocolError, CoordinatorLost) as exc:
                    problems[_fmt(addr)] = str(exc)
                    continue
                return sock, welcome, early, addr
            if refusal is not None:
                raise refusal
            if time.monotonic() >= deadline:
                detail = "; ".join(f"{a}: {p}" for a, p in problems.items()) or "no attempt fitted in the timeout"
                raise CoordinatorLost(f"cannot join through any coordinator ({detail})")
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    def _handshake(self, addr: tuple[str, int], member_id: int | None, step: int, report: dict[str, Any] | None,
                   timeout: float) -> tuple[socket.socket, dict[str, Any], _Early]:
        """Connect, answer the challenge, read the welcome (verified) -- or raise ``Rejected``/``OSError``/
        ``ProtocolError``/``CoordinatorLost``. Returns the socket, the welcome and what followed it: complete
        messages, and the reader holding the start of a message whose rest has not arrived (the session goes on
        reading with it -- a fresh reader would see that message's tail as a line of garbage)."""
        deadline = time.monotonic() + timeout
        where = _fmt(addr)
        sock = socket.create_connection(addr, timeout=max(timeout, 0.05))
        try:
            tune_socket(sock)
            reader = LineReader(MAX_GENERATION_LINE)
            pending = _Early(reader)
            challenge = self._read_one(sock, reader, pending, deadline, where)
            if challenge["t"] != "challenge":
                raise ProtocolError(f"the coordinator at {where} sent {challenge['t']!r} before its challenge")
            mine = new_nonce()
            hello: dict[str, Any] = {
                "t": "hello", "nonce": mine, "proof": mac(self._token, "member", challenge["nonce"], mine),
                "proto": PROTOCOL_VERSION, "member": member_id, "step": step, "pid": os.getpid(),
                "group": self._group[0], "group_rank": self._group[1], "group_size": self._group[2],
                "coordinators": len(self.addresses), "coordinator_timeout_s": self._coordinator_timeout_s,
            }
            if report is not None:
                hello["report"] = report
            hello.update(self._hello_extra(report))
            sock.sendall(encode(hello))
            welcome = self._read_one(sock, reader, pending, deadline, where)
            if welcome["t"] == "reject":
                code, reason = welcome["code"], welcome["reason"]
                if code == "removed":
                    raise RemovedFromGroup(reason)
                raise Rejected(code, reason)
            if welcome["t"] != "welcome":
                raise ProtocolError(f"the coordinator at {where} answered the hello with {welcome['t']!r}")
            if not verify(self._token, "coordinator", mine, challenge["nonce"], welcome["proof"]):
                raise ProtocolError(f"the coordinator at {where} could not prove it knows the job token")
            if welcome["proto"] != PROTOCOL_VERSION:
                raise ProtocolError(f"the coordinator at {where} speaks protocol {welcome['proto']}")
            return sock, welcome, pending
        except BaseException:
            sock.close()
            raise

    def _before_join_pass(self) -> None:
        """Called before each pass over the addresses of the first join (a group follower reads its leader's
        address again)."""

    def _hello_extra(self, report: dict[str, Any] | None) -> dict[str, Any]:
        """Fields added to every hello (a group session's leader: its ``followers``)."""
        return {}

    def _relay_out(self, msg: dict[str, Any]) -> None:
        """Called with every checked message from the coordinator before this client handles it (a leader relays
        them to its followers), from the thread that read it."""

    def _read_one(self, sock: socket.socket, reader: LineReader, pending: _Early, deadline: float,
                  where: str) -> dict[str, Any]:
        while not pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CoordinatorLost(f"the coordinator at {where} did not answer within the timeout")
            sock.settimeout(remaining)
            try:
                data = sock.recv(1 << 16)
            except TimeoutError:
                continue
            if not data:
                raise CoordinatorLost(f"the coordinator at {where} closed the connection during the handshake")
            pending.extend(check(m, self._schemas) for m in reader.feed(data))
        return pending.pop(0)

    def _install(self, sock: socket.socket, welcome: dict[str, Any], addr: tuple[str, int],
                 reader: LineReader) -> None:
        sock.settimeout(1.0)  # bounds sendall; reads happen after select says readable
        with self._send_lock:
            self._sock = sock
            self._reader = reader  # the handshake's: it may hold the start of the next message
            self.member_id = int(welcome["member"])
            self.store_host = welcome.get("store_host") or addr[0]  # a leader names its coordinator's host
            self.store_port = int(welcome["store_port"])
            self.address = _fmt(addr)
            self.role = str(welcome["role"])
            self.term = max(self.term, int(welcome["term"]))
        self._last_heard = time.monotonic()

    # -------------------------------------------------------------------------------------------------- API
    def send(self, msg: dict[str, Any]) -> None:
        """Send one message (any thread). A broken connection is noticed by the thread (failover); what was lost
        is in the next report (a vote, the committed step)."""
        data = encode(msg)
        try:
            with self._send_lock:
                self._sock.sendall(data)
                self._last_sent = time.monotonic()
        except OSError:
            pass

    def next_event(self, timeout: float) -> dict[str, Any] | None:
        """The next queued message, or None after ``timeout`` seconds."""
        try:
            return self.events.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None

    def close(self, *, graceful: bool = True, finished: bool = False) -> None:
        """Say goodbye (graceful; ``finished``: as the job's end, see ``Membership.finish``) and stop the thread.
        Idempotent."""
        if self._closed.is_set():
            return
        if graceful and self.fatal is None:
            self.send({"t": "bye", "done": True} if finished else {"t": "bye", "done": False})
        self._closed.set()
        self._thread.join(timeout=2)
        with self._send_lock:
            try:
                self._sock.close()
            except OSError:
                pass

    def report(self) -> dict[str, Any]:
        """What this member tells the next coordinator (see :mod:`torchnext.ft.election`)."""
        mine = self._report_fn() if self._report_fn is not None else {}
        step = int(mine.get("step", 0))
        vote = mine.get("vote")
        entered = mine.get("entered")
        decided = self._decided
        if decided is not None and vote is not None and (decided[0], decided[1]) == (vote["gen"], vote["step"]):
            step, vote = max(step, decided[2]), None  # the decision is queued: the member applies it
        return {"term": self.term, "step": step, "synced": bool(mine.get("synced", False)), "vote": vote,
                "entered": entered, "attempted": self._attempted}

    # ------------------------------------------------------------------------------------------------- thread
    def _run(self) -> None:
        hb = encode({"t": "hb"})
        next_hb = time.monotonic()
        while not self._closed.is_set():
            interval = self.heartbeat_interval_s
            now = time.monotonic()
            sock = self._sock
            if now >= next_hb and now - self._last_sent < interval:
                next_hb = self._last_sent + interval  # a vote (any message) just said we are alive
            elif now >= next_hb:
                try:
                    with self._send_lock:
                        sock.sendall(hb)
                        self._last_sent = now
                except OSError as exc:
                    if not self._failover(f"cannot send a heartbeat to the coordinator at {self.address}: {exc}"):
                        return
                    continue
                next_hb = now + interval
            if self._failing_since is not None and now - self._failing_since > self._failover_timeout_s:
                self._lose(CoordinatorLost(
                    f"member {self.member_id}: no coordinator took office within failover_timeout_s="
                    f"{self._failover_timeout_s} (waiting at the standby {self.address}; cut off from the "
                    "majority?)"))
                return
            try:
                ready, _, _ = select.select([sock], [], [], max(0.0, min(next_hb - now, 0.05)))
            except (OSError, ValueError):
                if self._closed.is_set():
                    return
                if not self._failover(f"the connection to the coordinator at {self.address} was closed"):
                    return
                continue
            if ready:
                try:
                    data = sock.recv(1 << 16)
                except OSError as exc:
                    data, why = b"", f"connection to the coordinator at {self.address} broke: {exc}"
                else:
                    why = f"the coordinator at {self.address} closed the connection (it exited or crashed)"
                if not data:
                    if self._closed.is_set() or not self._failover(why):
                        return
                    continue
                self._last_heard = time.monotonic()
                try:
                    msgs = [check(m, self._schemas) for m in self._reader.feed(data)]
                except ProtocolError as exc:
                    if not self._failover(f"the coordinator at {self.address} sent garbage: {exc}"):
                        return
                    continue
                for msg in msgs:
                    if not self._dispatch(msg):
                        return
            elif time.monotonic() - self._last_heard > self._coordinator_timeout_s:
                silent = time.monotonic() - self._last_heard
                if not self._failover(f"no message from the coordinator at {self.address} for {silent:.2f}s "
                                      f"(coordinator_timeout_s={self._coordinator_timeout_s})"):
                    return

    def _failover(self, why: str) -> bool:
        """The coordinator is lost: interrupt the member, then find a coordinator through the list. True when a
        session continues (in office, or waiting at a standby); False when membership ended (``fatal`` set)."""
        if self._closed.is_set():
            return False
        with self._send_lock:
            try:
                self._sock.close()
            except OSError:
                pass
        if self._failing_since is None:
            self._failing_since = time.monotonic()
            self._interrupt({"t": "lost", "reason": why})
        deadline = self._failing_since + self._failover_timeout_s
        tried: list[str] = []
        while not self._closed.is_set():
            for addr in self.addresses:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed.is_set():
                    break
                try:
                    sock, welcome, early = self._handshake(addr, self.member_id, self.report()["step"],
                                                           self.report(), min(remaining, self._connect_timeout_s, 2.0))
                except RemovedFromGroup as exc:
                    self._lose(RemovedFromGroup(f"you were removed: member {self.member_id}: {exc}"))
                    return False
                except Rejected as exc:
                    if exc.code in _TRY_NEXT:
                        tried.append(f"{_fmt(addr)}: {exc.code}")
                        continue
                    self._lose(_fatal_for(exc.code, f"the coordinator at {_fmt(addr)} refused member "
                                                    f"{self.member_id} ({exc.code}): {exc.reason}"))
                    return False
                except (OSError, ProtocolError, CoordinatorLost) as exc:
                    tried.append(f"{_fmt(addr)}: {exc}")
                    continue
                self._install(sock, welcome, addr, early.reader)
                if self.role == "office":
                    self._failing_since = None
                    self.failovers += 1
                for msg in early:
                    if not self._dispatch(msg):
                        return False
                return True
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if self._closed.is_set():
            return False
        self._lose(CoordinatorLost(
            f"member {self.member_id} lost its coordinator ({why}) and found none in office within "
            f"failover_timeout_s={self._failover_timeout_s}: {'; '.join(tried[-len(self.addresses):]) or 'no try'}"))
        return False

    def _observe(self, msg: dict[str, Any]) -> None:
        """Track what a report needs: generation numbers, terms, decisions; expand a generation sent as a delta
        against the last one received (:func:`~torchnext.ft._wire.apply_delta`; ``ProtocolError`` if it does not
        fit)."""
        kind = msg["t"]
        if kind == "gen":
            apply_delta(msg, *self._base_gen)
            self._base_gen = (msg["gen"], msg["groups"])
            self._attempted = max(self._attempted, msg["gen"])
            self.term = max(self.term, msg["term"])
        elif kind == "decision":
            self._decided = (msg["gen"], msg["step"], msg["committed"])
            if msg.get("next") is not None:
                self._attempted = max(self._attempted, msg["next"]["gen"])
                self._base_gen = (msg["next"]["gen"], msg["next"]["groups"])

    def _dispatch(self, msg: dict[str, Any]) -> bool:
        self._relay_out(msg)
        kind = msg["t"]
        if kind == "ping":
            return True
        if kind == "prepare":  # a standby about to take office: promise never to take part under a lower term
            if msg["term"] > self.term:
                self.term = msg["term"]
                self.send({"t": "promise", "term": msg["term"]})
            return True
        if kind in ("challenge", "welcome", "reject"):
            return self._failover(f"the coordinator at {self.address} sent {kind!r} during the session")
        try:
            self._observe(msg)
        except ProtocolError as exc:  # a delta that does not fit what this member holds: a broken coordinator
            return self._failover(f"the coordinator at {self.address} sent a generation it cannot hold: {exc}")
        if kind == "removed":
            self._lose(RemovedFromGroup(
                f"you were removed: member {self.member_id} was removed from the group at generation "
                f"{msg.get('gen')} ({msg.get('reason')}); restart the process to join again as a new member"), msg)
            return False
        if kind == "fatal":
            code = str(msg.get("code"))
            self._lose(_fatal_for(code, f"the coordinator ended the job ({code}): {msg.get('reason')}"), msg)
            return False
        if kind == "gen" and self._failing_since is not None:  # a standby took office: the failover is over
            self._failing_since = None
            self.role = "office"
            self.failovers += 1
        if kind in _INTERRUPTING or kind == "finished" or (kind == "gen" and msg.get("abort")):
            self._interrupt(msg)
        self._queue(msg)
        return True

    def _interrupt(self, msg: dict[str, Any]) -> None:
        if msg["t"] not in ("gen", "finished"):
            self.interruptions += 1
        self._on_interrupt(msg)

    def _queue(self, msg: dict[str, Any]) -> None:
        msg[ARRIVED_AFTER] = self.interruptions
        self.events.put(msg)
        self.news.set()

    def _lose(self, exc: MembershipError, msg: dict[str, Any] | None = None) -> None:
        self.fatal = exc
        self._interrupt(msg or {"t": "lost", "reason": str(exc), "final": True})
        self._queue({"t": "fatal", "reason": str(exc)})


_FATAL_CODES: dict[str, type[MembershipError]] = {
    "quorum_lost": QuorumLost,
    "finished": JobFinished,
    "step_failed": StepFailed,
    "retries_exhausted": RetriesExhausted,
    "coordinator_lost": CoordinatorLost,
}
"""The code of a coordinator's ``fatal`` -> the error the member raises (any other code: ``MembershipError``)."""


def _fatal_for(code: str, text: str) -> MembershipError:
    return _FATAL_CODES.get(code, MembershipError)(text)


def fatal_code(exc: MembershipError) -> str:
    """The ``fatal`` code that makes a member raise ``exc``'s class (a leader telling its followers how it ended)."""
    for code, cls in _FATAL_CODES.items():
        if type(exc) is cls:
            return code
    return "fatal"
