"""Group sessions for real members (protocol 4, issue 26): a replica group's leader holds the group's one connection
to the coordinator; its followers talk to it over a local channel.

    rank 0 (leader):   GroupLeaderClient  -- listens at ``leader_address``; collects its S-1 followers, then joins
                                             the coordinator for the whole group (``hello.followers``)
    rank r > 0:        GroupFollowerClient -- a MemberClient whose "coordinator" is its leader's local channel

The local channel speaks the coordinator's own handshake (challenge, ``hello`` with the HMAC proof of the job
token, ``welcome`` proving it back), so a follower trusts only a leader that knows the token and the leader admits
only followers that do. After the welcome the leader relays every coordinator message to its followers as it came
(:data:`~torchnext.ft._wire.LEADER_MESSAGES`: plus ``failover`` when it lost its coordinator and ``store`` when a
new coordinator took the group), pings them every ``group_heartbeat_interval_s`` and reads their heartbeats. Reference of one
step's vote::

    votes[rank] = (gen, step)                       # the leader's own (its ft.step's commit) and each follower's
    if all(votes[r] == (gen, step) for r in range(S)):
        coordinator.send({"t": "vote", "gen": gen, "step": step})      # one vote for the group; votes cleared
    decision -> leader -> every follower (same order as every other coordinator message)

A follower's death: its channel closes (a crash: at once) or it is silent for ``group_heartbeat_timeout_s`` (a
hang) -> the leader sends ``lost`` (re-sent after a failover until its group is removed) and the coordinator removes
the group, whose other ranks then read ``removed``. A ``bye`` without ``done`` from a follower is a departure, the
same. A leader's death: the followers' channel closes -> each raises ``RemovedFromGroup`` (its group failed; the
coordinator sees the leader's connection close, or its silence). A follower never fails over by itself: when its
leader loses the coordinator it is told (``failover``: it aborts its collectives, as a flat member does) and waits at
most ``failover_timeout_s`` for the leader's ``store`` or new generation, as a flat member waits for a coordinator.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from torchnext.ft._wire import (
    HELLO_TIMEOUT_S,
    LEADER_MESSAGES,
    MEMBER_MESSAGES,
    PROTOCOL_VERSION,
    LineReader,
    ProtocolError,
    accept_tuned,
    check,
    encode,
    mac,
    new_nonce,
    recv_or_closed,
    verify,
)
from torchnext.ft.member import MemberClient, fatal_code, parse_address, parse_addresses
from torchnext.ft.membership import CoordinatorLost, MembershipError, RemovedFromGroup
from torchnext.ft.relay_link import RelayHub, route_host

__all__ = ["GroupFollowerClient", "GroupLeaderClient"]

_LOG = logging.getLogger("torchnext.ft")

MAX_PENDING = 64
"""Local-channel connections still in their handshake at once; beyond this the oldest is closed."""

_NOT_RELAYED = frozenset({"ping", "prepare", "challenge", "welcome", "reject", "relay"})
"""Coordinator messages a leader keeps to itself (it pings its followers at the local interval, promises for them)."""


class _Follower:
    __slots__ = ("challenge", "done", "last_seen", "member", "nonce", "opened", "rank", "reader", "sock", "step",
                 "welcomed")

    def __init__(self, sock: socket.socket, now: float) -> None:
        self.sock = sock
        self.opened = now
        self.reader = LineReader()
        self.challenge = new_nonce()
        self.nonce = ""
        self.rank = -1
        self.member: int | None = None
        self.step = 0
        self.last_seen = now
        self.welcomed = False
        self.done = False
        """Said ``bye`` with ``done`` (finished): its channel closing is no death."""


class _Relay:
    """The leader's side of the local channel: one thread accepting, authenticating and serving the followers."""

    def __init__(self, address: str, token: str, group: int, size: int, send_up: Callable[[dict[str, Any]], None],
                 name: str) -> None:
        host, port = parse_address(address, any_port=True)
        self._listener = socket.create_server((host, port), backlog=max(8, size))
        self._token = token
        self.group, self.size = group, size
        self._send_up = send_up
        self.lock = threading.Lock()
        self.ranks: dict[int, _Follower] = {}
        """Followers that said a valid hello, by group rank."""
        self._socks: dict[socket.socket, _Follower] = {}
        self.ids: list[int] = []
        self.interval, self.timeout = 0.1, 0.6
        self._votes: dict[int, tuple[int, int]] = {}
        self.dead: dict[int, dict[str, Any]] = {}
        """Followers lost (member id -> the ``lost`` message), re-sent after a failover."""
        self.changed = threading.Condition(self.lock)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"torchnext-group-relay[{name}]", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------------ the owner
    def await_followers(self, timeout: float) -> list[_Follower]:
        """The S-1 followers, by rank, once each said a valid hello; ``CoordinatorLost`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while len(self.ranks) < self.size - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CoordinatorLost(
                        f"replica group {self.group}: only {len(self.ranks)} of its {self.size - 1} followers "
                        f"reached the leader's local channel at {self.address} within {timeout}s")
                self.changed.wait(min(left, 0.1))
            return [self.ranks[r] for r in range(1, self.size)]

    @property
    def address(self) -> str:
        host, port = self._listener.getsockname()[:2]
        return f"{host}:{port}"

    def welcome_all(self, ids: list[int], welcome: dict[str, Any], store_host: str) -> None:
        """Tell every follower its id and the coordinator's settings (the local level's heartbeats)."""
        self.interval = float(welcome.get("group_heartbeat_interval_s") or self.interval)
        self.timeout = float(welcome.get("group_heartbeat_timeout_s") or self.timeout)
        with self.lock:
            self.ids = list(ids)
            now = time.monotonic()
            for r, f in sorted(self.ranks.items()):
                msg = {"t": "welcome", "proof": mac(self._token, "coordinator", f.nonce, f.challenge),
                       "member": ids[r], "store_port": welcome["store_port"], "store_host": store_host,
                       "proto": PROTOCOL_VERSION, "role": welcome["role"], "term": welcome["term"],
                       "heartbeat_interval_s": self.interval, "heartbeat_timeout_s": self.timeout,
                       "quorum_timeout_s": welcome.get("quorum_timeout_s"),
                       "grow_timeout_s": welcome.get("grow_timeout_s"),
                       "group_heartbeat_interval_s": self.interval, "group_heartbeat_timeout_s": self.timeout}
                f.welcomed = True
                f.last_seen = now
                self._write(f, encode(msg))

    def relay(self, msg: dict[str, Any]) -> None:
        """Send one message to every welcomed follower (any thread)."""
        if msg["t"] in _NOT_RELAYED:
            return
        line = encode(msg)
        with self.lock:
            for f in list(self.ranks.values()):
                if f.welcomed:
                    self._write(f, line)

    def vote(self, rank: int, gen: int, step: int) -> None:
        """Rank ``rank`` voted for ``(gen, step)``: once every rank did, one vote goes to the coordinator."""
        with self.lock:
            self._votes[rank] = (gen, step)
            if len(self._votes) < self.size or any(v != (gen, step) for v in self._votes.values()):
                return
            self._votes.clear()
        self._send_up({"t": "vote", "gen": gen, "step": step})

    def resend_losses(self) -> None:
        """After a failover: the new coordinator hears again of every follower lost (until the group is removed)."""
        with self.lock:
            lost = list(self.dead.values())
        for msg in lost:
            self._send_up(msg)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        with self.lock:
            for f in list(self._socks.values()):
                _close(f.sock)
            self._socks.clear()
        _close(self._listener)

    # ------------------------------------------------------------------------------------------------ the thread
    def _run(self) -> None:
        next_ping = time.monotonic()
        try:
            while not self._stop.is_set():
                with self.lock:
                    socks = [self._listener, *self._socks]
                try:
                    ready, _, _ = select.select(socks, [], [], min(self.interval / 2, 0.05))
                except (OSError, ValueError):
                    ready = []  # a socket closed under us: the next round rebuilds the list
                now = time.monotonic()
                for sock in ready:
                    try:
                        if sock is self._listener:
                            self._accept(now)
                        else:
                            self._readable(sock, now)
                    except Exception:  # a bug met on one peer's input: that peer goes, the relay stays
                        _LOG.exception("torchnext group relay %s: internal error (the peer is dropped)", self.group)
                        with self.lock:
                            f = self._socks.get(sock)
                        if f is not None:
                            self._gone(f, hung=False, why="internal error of the relay on its input")
                if now >= next_ping:
                    next_ping = now + self.interval
                    self._ping()
                self._expire(now)
        finally:
            _close(self._listener)

    def _ping(self) -> None:
        line = encode({"t": "ping"})
        with self.lock:
            for f in list(self.ranks.values()):
                if f.welcomed:
                    self._write(f, line)

    def _accept(self, now: float) -> None:
        sock = accept_tuned(self._listener, 1.0)  # the timeout bounds sendall; reads follow select
        if sock is None:
            return
        f = _Follower(sock, now)
        with self.lock:
            pending = sorted((p for p in self._socks.values() if p.rank < 0), key=lambda p: p.opened)
        for p in pending[: max(0, len(pending) + 1 - MAX_PENDING)]:  # too many handshakes: the oldest go
            _LOG.warning("torchnext group relay %s: closing the oldest unauthenticated local connection", self.group)
            self._drop(p)
        with self.lock:
            self._socks[sock] = f
            self._write(f, encode({"t": "challenge", "nonce": f.challenge, "proto": PROTOCOL_VERSION}))

    def _readable(self, sock: socket.socket, now: float) -> None:
        with self.lock:
            f = self._socks.get(sock)
        if f is None:
            return
        data = recv_or_closed(sock)
        if not data:
            self._gone(f, hung=False, why="its local channel closed")
            return
        try:
            msgs = f.reader.feed(data)
            for raw in msgs:
                self._message(f, check(raw, MEMBER_MESSAGES), now)
        except ProtocolError as exc:
            if f.rank < 0:
                self._write(f, encode({"t": "reject", "code": "bad_request", "reason": str(exc)[:2000]}))
            self._gone(f, hung=False, why=f"protocol error on the local channel: {exc}")

    def _message(self, f: _Follower, msg: dict[str, Any], now: float) -> None:
        kind = msg["t"]
        if f.rank < 0:
            self._hello(f, msg)
            return
        f.last_seen = now
        if kind == "hello":
            raise ProtocolError("a second hello on the local channel")
        if not f.welcomed:
            raise ProtocolError(f"{kind!r} before the welcome")
        if kind == "vote":
            self.vote(f.rank, msg["gen"], msg["step"])
        elif kind == "fail":
            self._send_up({"t": "fail", "gen": msg["gen"], "reason": msg["reason"], "end": msg["end"],
                           "member": self.ids[f.rank]})
        elif kind == "bye":
            if msg["done"]:
                f.done = True
            else:
                self._gone(f, hung=False, why="it left (bye)")
        elif kind in ("lost", "promise"):
            raise ProtocolError(f"a follower sent {kind!r}")

    def _hello(self, f: _Follower, msg: dict[str, Any]) -> None:
        def refuse(code: str, why: str) -> None:
            self._write(f, encode({"t": "reject", "code": code, "reason": why}))
            self._drop(f)

        if msg["t"] != "hello":
            refuse("bad_request", "the first message must be a hello")
        elif msg["proto"] != PROTOCOL_VERSION:
            refuse("bad_request", f"protocol version {msg['proto']}, expected {PROTOCOL_VERSION}")
        elif not verify(self._token, "member", f.challenge, msg["nonce"], msg["proof"]):
            refuse("auth", "wrong job token")
        elif msg["group"] != self.group or msg["group_size"] != self.size or not 0 < msg["group_rank"] < self.size:
            refuse("bad_request", f"this is the leader of replica group {self.group} ({self.size} ranks): a hello "
                   f"as rank {msg['group_rank']} of group {msg['group']} ({msg['group_size']} ranks) is not for it")
        else:
            with self.lock:
                if self.ids or msg["group_rank"] in self.ranks:
                    taken = "the group session is formed" if self.ids else f"rank {msg['group_rank']} is taken"
                    self._write(f, encode({"t": "reject", "code": "duplicate", "reason": f"{taken}: restart the "
                                           "whole replica group to join again"}))
                    self._socks.pop(f.sock, None)
                    _close(f.sock)
                    return
                f.rank, f.nonce, f.member, f.step = msg["group_rank"], msg["nonce"], msg["member"], msg["step"]
                self.ranks[f.rank] = f
                self.changed.notify_all()

    def _expire(self, now: float) -> None:
        with self.lock:
            silent = [f for f in self.ranks.values()
                      if f.welcomed and not f.done and now - f.last_seen > self.timeout]
            idle = [p for p in self._socks.values() if p.rank < 0 and now - p.opened > HELLO_TIMEOUT_S]
        for p in idle:
            _LOG.info("torchnext group relay %s: closing a local connection: no hello within %ss", self.group,
                      HELLO_TIMEOUT_S)
            self._drop(p)
        for f in silent:
            self._gone(f, hung=True, why=f"silent on its local channel for {now - f.last_seen:.3f}s (timeout "
                                          f"{self.timeout}s)")

    def _gone(self, f: _Follower, *, hung: bool, why: str) -> None:
        """A follower is gone: after its welcome (and unless it finished), report it -- its group fails."""
        self._drop(f)
        if f.welcomed and not f.done and self.ids:
            member = self.ids[f.rank]
            msg = {"t": "lost", "member": member, "hung": hung, "reason": why}
            with self.lock:
                self.dead[member] = msg
            self._send_up(msg)

    def _drop(self, f: _Follower) -> None:
        with self.lock:
            self._socks.pop(f.sock, None)
            if self.ranks.get(f.rank) is f and not f.welcomed:
                del self.ranks[f.rank]  # before the welcome a rank may connect again
        _close(f.sock)

    def _write(self, f: _Follower, line: bytes) -> None:
        """Send ``line`` (lock held); a broken channel is noticed by the reader."""
        try:
            f.sock.sendall(line)
        except OSError:
            pass


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


class GroupLeaderClient(MemberClient):
    """Rank 0 of a replica group in a group session: a :class:`MemberClient` that first collects its followers at
    ``leader_address`` (within ``gather_timeout_s``, default ``connect_timeout_s``; port 0: a free one, then
    ``on_listening(host:port)`` is called before the wait), then joins the coordinator for the whole group, votes for
    it once every rank voted, relays the coordinator's messages to the followers and reports their deaths.

    Vote relays (protocol 5, ``relays=True``): it also listens for other leaders (on the local address that routes to
    its first coordinator, a free port, offered in its hello) and votes through the relay the coordinator names for
    its chunk, or relays for its chunk (:mod:`torchnext.ft.relay_link`)."""

    def __init__(self, address: str | Sequence[str], token: str, *, leader_address: str, replica_group: int,
                 group_size: int, connect_timeout_s: float, on_listening: Callable[[str], object] | None = None,
                 gather_timeout_s: float | None = None, relays: bool = True, **kw: Any) -> None:
        if group_size < 2:
            raise ValueError(f"a group session needs at least 2 ranks, got group_size={group_size}")
        self._followers: list[_Follower] = []
        self._decision_lock = threading.RLock()
        self._hub: RelayHub | None = None
        self._relay = _Relay(leader_address, token, replica_group, group_size, self._send_up,
                             f"group {replica_group}")
        try:
            if relays:
                self._hub = RelayHub(route_host(*parse_addresses(address)[0]), token,
                                     send_up=super().send, deliver=self._relayed_decision,
                                     name=f"group {replica_group}")
            if on_listening is not None:  # e.g. publish the bound address where the followers look for it
                on_listening(self._relay.address)
            self._followers = self._relay.await_followers(
                connect_timeout_s if gather_timeout_s is None else gather_timeout_s)
            super().__init__(address, token, replica_group=replica_group, group_rank=0, group_size=group_size,
                             connect_timeout_s=connect_timeout_s, **kw)
        except BaseException:
            self._relay.stop()
            if self._hub is not None:
                self._hub.stop()
            raise

    @property
    def leader_address(self) -> str:
        """Where the local channel listens (``host:port``; the port is the bound one when 0 was asked for)."""
        return self._relay.address

    def send(self, msg: dict[str, Any]) -> None:
        if msg.get("t") == "vote":  # the leader's own vote is one of its group's
            self._relay.vote(0, msg["gen"], msg["step"])
            return
        self._send_up(msg)

    def _send_up(self, msg: dict[str, Any]) -> None:
        hub = self._hub
        if msg["t"] == "vote" and hub is not None and hub.vote(msg["gen"], msg["step"]):
            self._last_sent = time.monotonic()  # it said something: the relay's vote vouches for it
            return
        super().send(msg)

    def _relayed_decision(self, msg: dict[str, Any]) -> None:
        """A decision that came through this session's relay (the hub's thread): handled as if the coordinator had
        sent it, unless this session already holds it or a newer generation (the coordinator sends a decision
        directly before anything that could overtake it)."""
        with self._decision_lock:
            decided = self._decided
            if msg["gen"] < self._base_gen[0] or (decided is not None and (msg["gen"], msg["step"]) <= decided[:2]):
                return
            self._last_heard = time.monotonic()  # the coordinator decided: it is alive (it does not ping us)
            self._dispatch(msg)

    def _dispatch(self, msg: dict[str, Any]) -> bool:
        if msg["t"] == "relay":  # (not queued: it concerns this client only)
            self._relay_out(msg)
            return True
        if msg["t"] == "decision":
            with self._decision_lock:
                return super()._dispatch(msg)
        return super()._dispatch(msg)

    def close(self, *, graceful: bool = True, finished: bool = False) -> None:
        if finished and graceful and self.fatal is None and not self._closed.is_set():
            self._relay.relay({"t": "finished", "step": self.report()["step"], "by": self.member_id})
        super().close(graceful=graceful, finished=finished)
        self._relay.stop()
        if self._hub is not None:
            self._hub.stop()

    def _hello_extra(self, report: dict[str, Any] | None) -> dict[str, Any]:
        ids = self._relay.ids
        extra: dict[str, Any] = {} if self._hub is None else {"relay": self._hub.address}
        if ids:
            step = report["step"] if report is not None else 0
            return {**extra, "followers": [{"member": m, "step": step} for m in ids[1:]]}
        return {**extra, "followers": [{"member": f.member, "step": f.step} for f in self._followers]}

    def _handshake(self, addr: tuple[str, int], member_id: int | None, step: int, report: dict[str, Any] | None,
                   timeout: float) -> Any:
        sock, welcome, early = super()._handshake(addr, member_id, step, report, timeout)
        members = welcome.get("members")
        if not isinstance(members, list) or len(members) != self._relay.size or (
                self._relay.ids and members != self._relay.ids):
            sock.close()
            raise ProtocolError(f"the coordinator's welcome of replica group {self._relay.group}'s session names "
                                f"members {members}, expected {self._relay.size} ids"
                                + (f" = {self._relay.ids}" if self._relay.ids else ""))
        return sock, welcome, early

    def _install(self, sock: socket.socket, welcome: dict[str, Any], addr: tuple[str, int],
                 reader: LineReader) -> None:
        first = not self._relay.ids
        super()._install(sock, welcome, addr, reader)
        if self._hub is not None:
            self._hub.member = self.member_id
            try:  # the relay channel's liveness: pinged at the coordinator's interval, silent at twice its timeout
                self._hub.liveness(float(welcome["heartbeat_interval_s"]), 2 * float(welcome["heartbeat_timeout_s"]))
            except ValueError as exc:  # (a coordinator validates them; the hub keeps its defaults otherwise)
                _LOG.warning("torchnext group session %s: %s", self.member_id, exc)
        if first:
            self._relay.welcome_all(list(welcome["members"]), welcome, self.store_host)
        else:  # a new coordinator took the group: its store, then the losses it must hear of again
            self._relay.relay({"t": "store", "host": self.store_host, "port": self.store_port, "term": self.term,
                               "role": self.role})
            self._relay.resend_losses()

    def _relay_out(self, msg: dict[str, Any]) -> None:
        """Every coordinator message, in order, before it is handled -- also those that came with the welcome (which
        are queued without :meth:`_dispatch`): to the followers, and a ``relay`` or ``decision`` to the hub."""
        self._relay.relay(msg)
        hub = self._hub
        if hub is None:
            return
        if msg["t"] == "relay":
            hub.named(msg, self._base_gen[0])  # the generation it follows was observed before it
        elif msg["t"] == "decision":
            hub.decided(msg)

    def _interrupt(self, msg: dict[str, Any]) -> None:
        if msg["t"] == "lost" and not msg.get("final"):  # lost its coordinator: the followers abort with it
            self._relay.relay({"t": "failover", "reason": str(msg.get("reason"))[:1500]})
        super()._interrupt(msg)

    def _lose(self, exc: MembershipError, msg: dict[str, Any] | None = None) -> None:
        if msg is None:  # ended here, not by a coordinator's message (which was relayed as it came)
            reason = str(exc)[:1500]
            if isinstance(exc, RemovedFromGroup):
                self._relay.relay({"t": "removed", "gen": 0, "reason": reason})
            else:
                self._relay.relay({"t": "fatal", "code": fatal_code(exc), "reason": reason})
        super()._lose(exc, msg)


class GroupFollowerClient(MemberClient):
    """Rank r > 0 of a replica group in a group session: a :class:`MemberClient` whose peer is its leader's local
    channel (``leader_address``). It never fails over itself: its leader's loss is its group's failure
    (``RemovedFromGroup``); its leader's failover reaches it as ``failover`` then ``store``."""

    _schemas = LEADER_MESSAGES

    def __init__(self, leader_address: str, token: str, *, resolve: Callable[[], str] | None = None,
                 **kw: Any) -> None:
        """``resolve``: where the leader listens now (read again before each attempt of the first join: an address
        published by a previous incarnation of the group names a leader that is gone)."""
        self._finished_seen = False
        self._resolve = resolve
        super().__init__(leader_address, token, **kw)

    def _before_join_pass(self) -> None:
        if self._resolve is None:
            return
        try:
            self.addresses = parse_addresses(self._resolve())
        except (MembershipError, ValueError) as exc:  # keep the address known; the join's deadline bounds it
            _LOG.debug("torchnext group follower: reading its leader's address again failed: %s", exc)

    def _failover(self, why: str) -> bool:
        if self._closed.is_set():
            return False
        if self._finished_seen:  # the leader finished the job for the group and left: nothing was lost
            return False
        self._lose(RemovedFromGroup(
            f"you were removed: member {self.member_id}: the leader of its replica group is gone ({why}): the group "
            "failed; restart the whole group to join again"))
        return False

    def _dispatch(self, msg: dict[str, Any]) -> bool:
        kind = msg["t"]
        if kind == "failover":  # the leader lost its coordinator and fails over for the group
            if self._failing_since is None:
                self._failing_since = time.monotonic()
            self._interrupt({"t": "lost", "reason": f"the leader lost its coordinator: {msg['reason']}"})
            return True
        if kind == "store":
            with self._send_lock:
                self.store_port = int(msg["port"])
                self.store_host = str(msg["host"])
                self.role = str(msg["role"])
                self.term = max(self.term, int(msg["term"]))
            if self.role == "office" and self._failing_since is not None:
                self._failing_since = None
                self.failovers += 1
            return True
        if kind == "finished":
            self._finished_seen = True
        return super()._dispatch(msg)
