"""A real group leader's side of vote relays (protocol 5; :mod:`torchnext.ft.relay` has the bookkeeping and the
handshake): one thread that listens for the sessions of the chunk this leader may relay for, and holds this leader's
own channel to its relay when another session is named.

    hub = RelayHub(host, token, send_up=client_send, deliver=client_dispatch)
    hello["relay"] = hub.address
    on {"t": "relay", ...} from the coordinator:   hub.named(msg, gen_held)
    own group's vote:                              if not hub.vote(gen, step): send it to the coordinator
    every decision from the coordinator:           hub.decided(msg)   # a relay fans it out to its chunk

Anything that connects to the listener must answer a challenge with the HMAC proof of the job token before one of
its messages counts; malformed lines, a second hello, an idle handshake (:data:`HELLO_TIMEOUT_S`) and too many
pending handshakes (:data:`MAX_PENDING`) close that connection only. A leader trusts a relay only after the relay
proved the token back (``welcome``). A relay channel that closes or fails its handshake makes the session vote
directly (a vote already sent through it is sent again to the coordinator, which answers a vote for the step it just
committed with that decision again).

Liveness (a relay or a session that hangs with its socket open, or a channel black-holed between two leaders that
both still reach the coordinator). ``interval`` is the coordinator's heartbeat interval and ``timeout`` twice its
heartbeat timeout (:meth:`liveness`, from the welcome: a relay whose whole process hangs is its group's failure,
found by the coordinator within one heartbeat timeout; this rule is for what the coordinator cannot see, and twice
the timeout keeps a busy relay host from being taken for a dead one). Nothing extra is sent while every round is
decided within an interval, nor while idle::

    relay, while its chunk holds a vote not yet decided (open since t_open):
        every connected session p:  silent since max(p.heard, t_open) > timeout  -> close p's channel
                                                                   (the chunk stops waiting for it: it votes directly)
                                    nothing written to p for an interval          -> send p {"t": "ping"}
    session: every {"t": "ping"} from its relay is answered with {"t": "hb"}
    session, while its vote went through the channel undecided (sent at t_vote):
        silent since max(heard, t_vote) > timeout  -> close the channel, send the vote directly
    a hub whose own thread has not gone round its loop for a timeout: vote() returns False (the vote goes directly)
    a loop round that spent over two intervals off the CPU beyond its wait: every channel counts as heard now

A hung relay channel thus costs its chunk two heartbeat timeouts (plus one loop round, at most ``interval / 2``),
not the members' commit timeout; a slow session (it answers pings) is waited for as long as it takes.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from torchnext.ft._wire import (
    HELLO_TIMEOUT_S,
    RELAY_MESSAGES,
    RELAY_PEER_MESSAGES,
    LineReader,
    ProtocolError,
    accept_tuned,
    check,
    encode,
    new_nonce,
    recv_or_closed,
    tune_socket,
)
from torchnext.ft.member import parse_address
from torchnext.ft.relay import RelayChunk, SessionHandshake, answer_hello, relay_challenge

__all__ = ["HELLO_TIMEOUT_S", "MAX_PENDING", "RelayHub", "route_host"]

_LOG = logging.getLogger("torchnext.ft")

MAX_PENDING = 64
"""Relay-listener connections still in their handshake at once; beyond this the oldest is closed."""
_LINK_TIMEOUT_S = 1.0
"""Bound on connecting to a relay and its handshake (then the session votes directly)."""
_PING = encode({"t": "ping"})
_HB = encode({"t": "hb"})


def route_host(host: str, port: int) -> str:
    """The local address this machine reaches ``host:port`` from (where other leaders, which reach the same
    coordinator, can reach this one); loopback when there is no route. Sends nothing (a UDP socket's connect)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port or 9))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


class _Peer:
    __slots__ = ("challenge", "heard", "member", "opened", "reader", "sock", "vote", "wrote")

    def __init__(self, sock: socket.socket, now: float) -> None:
        self.sock, self.opened = sock, now
        self.heard = now
        """When something last came from this session."""
        self.wrote = now
        """When something was last written to it."""
        self.reader = LineReader()
        self.challenge = new_nonce()
        self.member: int | None = None
        self.vote: tuple[int, int] | None = None


class RelayHub:
    """See the module docstring. ``send_up(msg)`` sends to this leader's coordinator; ``deliver(msg)`` hands a
    decision that came through this leader's relay to the client as if its coordinator had sent it."""

    def __init__(self, host: str, token: str, *, send_up: Callable[[dict[str, Any]], None],
                 deliver: Callable[[dict[str, Any]], None], name: str = "") -> None:
        self._token = token
        self._send_up = send_up
        self._deliver = deliver
        self._listener = socket.create_server((host, 0), backlog=256)
        self.lock = threading.Lock()
        self.member = -1
        self._peers: dict[socket.socket, _Peer] = {}
        self._by_member: dict[int, _Peer] = {}
        self.chunk: RelayChunk | None = None
        """As a relay: its chunk in the generation named last."""
        self._link: socket.socket | None = None
        self._link_reader = LineReader()
        self._link_gen = 0
        self._link_to: tuple[int, str] = (-1, "")
        """The relay ``_link`` goes to (id, address)."""
        self._want: tuple[int, str, int] | None = None
        """A relay to connect to: (relay id, address, generation)."""
        self._sent: tuple[int, int] | None = None
        """This session's vote sent through the link and not yet decided."""
        self._own: tuple[int, int] | None = None
        """This session's open vote, however it went (counted in a chunk it is named relay of later)."""
        self.interval, self.timeout = 0.1, 0.6
        """The relay channel's ping interval and silence timeout (:meth:`liveness`: the coordinator's heartbeat
        settings)."""
        self._sent_at = 0.0
        self._link_heard = 0.0
        """When ``_sent`` went through the link, and when the link last carried anything from the relay."""
        self._decided_step = -1
        """As a relay: the last step of ``chunk.gen`` decided."""
        self._open_since: float | None = None
        """As a relay: since when its chunk holds a vote not yet decided (None: none)."""
        self._loop_at = time.monotonic()
        """When the hub's thread last went round its loop."""
        self._wake_r, self._wake_w = socket.socketpair()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"torchnext-relay-hub[{name}]", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        host, port = self._listener.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    # ---------------------------------------------------------------------------------------- the client's calls
    def liveness(self, interval_s: float, timeout_s: float) -> None:
        """The relay channel's ping interval and silence timeout (a leader passes its coordinator's heartbeat
        settings from the welcome). See the module docstring, "Liveness"."""
        if not 0 < interval_s < timeout_s:
            raise ValueError(f"relay channel liveness needs 0 < interval_s < timeout_s, got {interval_s}, {timeout_s}")
        self.interval, self.timeout = interval_s, timeout_s

    def named(self, msg: dict[str, Any], gen_held: int) -> None:
        """The coordinator's ``relay`` message for this session (ignored unless for the generation it holds)."""
        if msg["gen"] != gen_held:
            return
        with self.lock:
            if msg["relay"] == self.member:
                chunk = self.chunk = RelayChunk(msg["gen"], self.member, msg["chunk"])
                self._decided_step, self._open_since = -1, None
                self._want = None
                self._close_link()
                ready = [chunk.vote(self.member, *self._own)] if self._own is not None else []
                for h, p in list(self._by_member.items()):
                    if not chunk.connect(h):
                        self._drop(p)
                    elif p.vote is not None:
                        ready.append(chunk.vote(h, *p.vote))
            else:
                self.chunk = None
                for p in list(self._peers.values()):
                    self._drop(p)
                ready = []
                if self._link is not None and self._link_to == (msg["relay"], msg["at"]):
                    self._link_gen = msg["gen"]  # the same relay as before: the channel goes on
                    self._want = None
                    return
                self._close_link()
                self._want = (msg["relay"], msg["at"], msg["gen"])
        for vote in ready:
            if vote is not None:
                self._send_up(vote)
        self._wake()

    def vote(self, gen: int, step: int) -> bool:
        """This session's (its whole group's) vote: True when the relay level took it (this leader is the relay, or
        its channel to its relay is open for generation ``gen``); False: send it to the coordinator."""
        with self.lock:
            chunk = self.chunk
            self._own = (gen, step)
            now = time.monotonic()
            if now - self._loop_at > self.timeout:  # the hub's own thread is stuck: nothing here would go on
                return False
            if chunk is not None and chunk.gen == gen:
                up = chunk.vote(self.member, gen, step)
            elif self._link is not None and self._link_gen == gen:
                try:
                    self._link.sendall(encode({"t": "vote", "gen": gen, "step": step}))
                except OSError:
                    self._close_link()
                    return False
                self._sent, self._sent_at = (gen, step), now
                return True
            else:
                return False
        if up is not None:
            self._send_up(up)
        return True

    def decided(self, msg: dict[str, Any]) -> None:
        """A decision this leader received from its coordinator: a relay sends it on to its chunk."""
        with self.lock:
            chunk = self.chunk
            if self._sent is not None and (msg["gen"], msg["step"]) == self._sent:
                self._sent = None
            if self._own is not None and (msg["gen"], msg["step"]) == self._own:
                self._own = None
            if chunk is None or msg["gen"] != chunk.gen:
                return
            self._decided_step = max(self._decided_step, msg["step"])
            if msg.get("next") is not None:
                return
            line = encode(msg)
            now = time.monotonic()
            for h, p in list(self._by_member.items()):
                if h != self.member:
                    self._write(p, line, now)

    def stop(self) -> None:
        self._stop.set()
        self._wake()
        self._thread.join(timeout=2)
        with self.lock:
            for p in list(self._peers.values()):
                _close(p.sock)
            self._peers.clear()
            self._by_member.clear()
            self._close_link()
        for s in (self._listener, self._wake_r, self._wake_w):
            _close(s)

    # ------------------------------------------------------------------------------------------------ the thread
    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _run(self) -> None:
        while not self._stop.is_set():
            self._loop_at = time.monotonic()
            want = self._want
            if want is not None:
                self._connect(*want)
            start, cpu = time.monotonic(), time.thread_time()
            with self.lock:
                socks = [self._listener, self._wake_r, *self._peers]
                if self._link is not None:
                    socks.append(self._link)
            try:
                wait = min(0.1, self.interval / 2)
                ready, _, _ = select.select(socks, [], [], wait)
            except (OSError, ValueError):
                continue  # a socket closed under us: the next round rebuilds the list
            now = time.monotonic()
            if now - start - (time.thread_time() - cpu) - wait > 2 * self.interval:
                self._forgive(now)  # this thread was off the CPU: the channels' silence may be ours
            for sock in ready:
                try:
                    if sock is self._listener:
                        self._accept(now)
                    elif sock is self._wake_r:
                        self._wake_r.recv(64)
                    elif sock is self._link:
                        self._link_readable()
                    else:
                        self._readable(sock)
                except Exception:  # a bug met on one peer's input: that peer goes, the hub stays
                    _LOG.exception("torchnext relay hub %s: internal error (the channel is dropped)", self.member)
                    with self.lock:
                        p = self._peers.get(sock)
                        if p is not None:
                            self._gone(p)
            self._expire(now)
            self._liveness(now)  # judged at select's return: whatever arrived before it has been read

    def _connect(self, relay: int, at: str, gen: int) -> None:
        """Open and authenticate this session's channel to its relay (bounded); on failure it votes directly."""
        with self.lock:
            if self._want != (relay, at, gen):
                return
            self._want = None
            member = self.member
        sock: socket.socket | None = None
        try:
            sock = socket.create_connection(parse_address(at), timeout=_LINK_TIMEOUT_S)
            tune_socket(sock)
            deadline = time.monotonic() + _LINK_TIMEOUT_S
            reader = LineReader()
            shake = SessionHandshake(self._token, member=member, gen=gen, relay=relay)
            while not shake.done:
                reply = shake.feed(_read(sock, reader, deadline))
                if reply is not None:
                    sock.sendall(encode(reply))
            sock.settimeout(1.0)  # bounds sendall; reads happen after select says readable
        except (OSError, ValueError, ProtocolError) as exc:
            _LOG.info("torchnext relay hub %s: no channel to relay %s at %s (votes go directly): %s", member, relay,
                      at, exc)
            if sock is not None:
                _close(sock)
            return
        with self.lock:
            if self._want is not None or self.chunk is not None:  # named again meanwhile
                _close(sock)
                return
            self._close_link()
            self._link, self._link_reader, self._link_gen, self._link_to = sock, reader, gen, (relay, at)
            self._link_heard = time.monotonic()
            own = self._own
            if own is not None and own[0] == gen:  # its open vote went directly: the relay, which counts it as
                try:  # connected now, waits for it (the coordinator counts it once)
                    sock.sendall(encode({"t": "vote", "gen": own[0], "step": own[1]}))
                except OSError:
                    self._close_link()

    def _link_readable(self) -> None:
        with self.lock:
            link = self._link
        if link is None:
            return
        data = recv_or_closed(link)
        msgs: list[dict[str, Any]] = []
        if data:
            self._link_heard = time.monotonic()
            try:
                msgs = [check(m, RELAY_MESSAGES) for m in self._link_reader.feed(data)]
            except ProtocolError as exc:
                _LOG.warning("torchnext relay hub %s: its relay sent garbage: %s", self.member, exc)
                data = b""
        if not data:
            self._link_lost(link)
            return
        for msg in msgs:
            if msg["t"] == "ping":  # the relay holds our vote or waits for it: we are alive
                try:
                    link.sendall(_HB)
                except OSError:
                    self._link_lost(link)
                    return
            elif msg["t"] == "decision":
                with self.lock:
                    if self._sent is not None and (msg["gen"], msg["step"]) == self._sent:
                        self._sent = None
                    if self._own is not None and (msg["gen"], msg["step"]) == self._own:
                        self._own = None
                self._deliver(msg)

    def _link_lost(self, link: socket.socket) -> None:
        """The channel to this session's relay closed, broke or went silent: votes go directly from now on."""
        with self.lock:
            resend, self._sent = self._sent, None
            if self._link is link:
                self._close_link()
        if resend is not None:  # its vote may be lost with the channel: the coordinator hears it directly
            self._send_up({"t": "vote", "gen": resend[0], "step": resend[1]})

    def _forgive(self, now: float) -> None:
        """Count every relay channel as heard at ``now``."""
        with self.lock:
            self._link_heard = now
            for p in self._peers.values():
                p.heard = now
            if self._open_since is not None:
                self._open_since = now

    def _liveness(self, now: float) -> None:
        """Relay-channel liveness (module docstring, "Liveness"): a session whose vote waits at a silent relay
        votes directly; a relay pings the sessions of an open round and stops waiting for a silent one."""
        with self.lock:
            link = self._link
            silent = (link is not None and self._sent is not None
                      and now - max(self._link_heard, self._sent_at) > self.timeout)
        if silent:
            assert link is not None
            _LOG.warning("torchnext relay hub %s: its relay %s was silent for %.2fs with our vote: voting directly",
                         self.member, self._link_to[0], self.timeout)
            self._link_lost(link)
        up: list[dict[str, Any] | None] = []
        with self.lock:
            chunk = self.chunk
            if chunk is None:
                return
            if not any(s > self._decided_step for s in chunk.voted.values()):
                self._open_since = None
                return
            if self._open_since is None:
                self._open_since = now
            ping = _PING
            for h, p in list(self._by_member.items()):
                if h == self.member:
                    continue
                if now - max(p.heard, self._open_since) > self.timeout:
                    _LOG.warning("torchnext relay hub %s: session %s was silent for %.2fs in an open round: its "
                                 "channel is closed (it votes directly)", self.member, h, self.timeout)
                    up.append(self._gone(p))
                elif now - p.wrote >= self.interval:
                    self._write(p, ping, now)
        for vote in up:
            if vote is not None:
                self._send_up(vote)

    def _accept(self, now: float) -> None:
        sock = accept_tuned(self._listener, 1.0)  # the timeout bounds sendall; reads follow select
        if sock is None:
            return
        p = _Peer(sock, now)
        with self.lock:
            pending = sorted((q for q in self._peers.values() if q.member is None), key=lambda q: q.opened)
            for q in pending[: max(0, len(pending) + 1 - MAX_PENDING)]:
                _LOG.warning("torchnext relay hub %s: closing the oldest unauthenticated connection", self.member)
                self._drop(q)
            self._peers[sock] = p
            self._write(p, encode(relay_challenge(p.challenge)))

    def _readable(self, sock: socket.socket) -> None:
        with self.lock:
            p = self._peers.get(sock)
        if p is None:
            return
        data = recv_or_closed(sock)
        up: list[dict[str, Any] | None] = []
        p.heard = time.monotonic()
        with self.lock:
            if not data:
                up.append(self._gone(p))
            else:
                try:
                    for raw in p.reader.feed(data):
                        up.append(self._message(p, check(raw, RELAY_PEER_MESSAGES)))
                        if p.sock not in self._peers:
                            break
                except ProtocolError as exc:
                    if p.member is None:
                        self._write(p, encode({"t": "reject", "code": "bad_request", "reason": str(exc)[:2000]}))
                    _LOG.info("torchnext relay hub %s: closing a relay channel: %s", self.member, exc)
                    up.append(self._gone(p))
        for vote in up:
            if vote is not None:
                self._send_up(vote)

    def _message(self, p: _Peer, msg: dict[str, Any]) -> dict[str, Any] | None:
        """One checked message from a relay channel (lock held); the chunk's vote to send up, if ready."""
        if p.member is None:
            reply, member = answer_hello(self._token, p.challenge, self.member, msg)
            if member is None:
                self._write(p, encode(reply))
                self._drop(p)
                return None
            old = self._by_member.get(member)
            out = self._gone(old) if old is not None else None
            p.member = member
            self._by_member[member] = p
            self._write(p, encode(reply))
            if self.chunk is not None:
                self.chunk.connect(p.member)
            return out
        if msg["t"] == "hello":
            raise ProtocolError("a second hello on a relay channel")
        if msg["t"] == "vote":
            p.vote = (msg["gen"], msg["step"])
            if self.chunk is not None:
                return self.chunk.vote(p.member, msg["gen"], msg["step"])
        return None

    def _expire(self, now: float) -> None:
        with self.lock:
            for p in [q for q in self._peers.values() if q.member is None and now - q.opened > HELLO_TIMEOUT_S]:
                self._drop(p)

    def _gone(self, p: _Peer) -> dict[str, Any] | None:
        """A chunk session's channel closed (lock held): nobody waits for it any more."""
        mine = p.member is not None and self._by_member.get(p.member) is p
        self._drop(p)
        if not mine or self.chunk is None:
            return None
        assert p.member is not None
        return self.chunk.disconnect(p.member)

    def _drop(self, p: _Peer) -> None:
        """Close one listener-side channel (lock held)."""
        self._peers.pop(p.sock, None)
        if p.member is not None and self._by_member.get(p.member) is p:
            del self._by_member[p.member]
        _close(p.sock)

    def _close_link(self) -> None:
        if self._link is not None:
            _close(self._link)
            self._link = None

    def _write(self, p: _Peer, line: bytes, now: float | None = None) -> None:
        p.wrote = time.monotonic() if now is None else now
        try:
            p.sock.sendall(line)
        except OSError:
            pass  # the reader sees the channel close


def _read(sock: socket.socket, reader: LineReader, deadline: float) -> dict[str, Any]:
    """One message of the relay's handshake (``RELAY_MESSAGES``), before ``deadline``."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ProtocolError("the relay did not answer within the timeout")
        sock.settimeout(remaining)
        data = sock.recv(1 << 16)
        if not data:
            raise ProtocolError("the relay closed the channel during the handshake")
        msgs = reader.feed(data)
        if msgs:
            return check(msgs[0], RELAY_MESSAGES)


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass
