"""The coordinator: hosts the job's ``TCPStore`` and the membership service, outside every rank.

Run it as a process (``torchnext coordinator --host 127.0.0.1 --port 29400``) or in-process for launchers and tests::

    with Coordinator(CoordinatorConfig(membership=MembershipConfig(min_size=2, initial_size=4))) as coord:
        launch_ranks(coordinator=coord.address, token=coord.token)      # ranks use FaultTolerant(...)

What it does:

* binds **only** to ``host`` (default 127.0.0.1): the membership port and the store port (c10d ``TCPStore``, on a
  listening socket we bind ourselves and hand to it, because ``TCPStore`` alone would listen on every interface);
* authenticates every member with the job token (a shared secret, compared in constant time) -- JSON lines only,
  no pickle on the wire; the store itself has no authentication (keep it on a trusted network);
* keeps one persistent connection per member: a crash closes it (seen in ~1 ms); a member that stops sending
  heartbeats is declared failed after ``heartbeat_timeout_s``; the decisions are :class:`~.membership.Membership`'s;
* pings every member each heartbeat interval so members notice a dead or hung coordinator (``CoordinatorLost``).

Single point of failure, honestly: if the coordinator dies, the store and the membership service die with it and
every member stops with ``CoordinatorLost`` within ``coordinator_timeout_s`` (a crash: at once). It is not
restartable without losing the job; a process supervisor can restart the job from a checkpoint.
"""

from __future__ import annotations

import argparse
import hmac
import secrets
import selectors
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from torchnext.ft._wire import PROTOCOL_VERSION, LineReader, ProtocolError, encode, tune_socket
from torchnext.ft.membership import Membership, MembershipConfig, Rejected

__all__ = ["Coordinator", "CoordinatorConfig", "add_arguments", "run"]
_HELLO_TIMEOUT_S = 10.0


@dataclass(kw_only=True)
class CoordinatorConfig:
    """Where the coordinator listens and how it decides."""

    host: str = "127.0.0.1"
    """Interface to bind (membership and store). Keep the default unless ranks run on other machines."""
    port: int = 0
    """Membership port (0: a free port, see ``Coordinator.port``)."""
    store_port: int = 0
    """TCPStore port (0: a free port; members learn it from the coordinator)."""
    token: str | None = None
    """Job token members must present (None: a random one, see ``Coordinator.token``)."""
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    """Failure detection and quorum policy."""


@dataclass
class _Conn:
    sock: socket.socket
    reader: LineReader
    opened: float
    member: int | None = None
    fenced_until: float | None = None
    fence_msg: dict[str, Any] | None = None


class Coordinator:
    """In-process coordinator: ``start()`` (or ``with``) launches its thread; ``stop()`` closes everything.

    Read-only views (thread-safe snapshots): ``generation``, ``members``, ``step``, ``history()``.
    """

    def __init__(self, config: CoordinatorConfig | None = None) -> None:
        self.config = config or CoordinatorConfig()
        if not isinstance(self.config, CoordinatorConfig):
            raise TypeError(f"config must be a CoordinatorConfig, got {type(self.config).__name__}")
        self.token = self.config.token or secrets.token_hex(16)
        self._lock = threading.Lock()
        self._state = Membership(self.config.membership)
        self._conns: dict[socket.socket, _Conn] = {}
        self._by_member: dict[int, _Conn] = {}
        self._sel: selectors.BaseSelector | None = None
        self._listener: socket.socket | None = None
        self._store: Any = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self.port = 0
        self.store_port = 0
        self.stalls = 0
        """How many times the coordinator's own loop ran late and forgave missed heartbeats."""

    # ------------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> Coordinator:
        import torch.distributed as dist

        cfg = self.config
        listener = socket.create_server((cfg.host, cfg.port), backlog=256, reuse_port=False)
        store_listener = socket.create_server((cfg.host, cfg.store_port), backlog=1024)
        self.port = listener.getsockname()[1]
        self.store_port = store_listener.getsockname()[1]
        self._store = dist.TCPStore(
            cfg.host, self.store_port, None, True, timeout=timedelta(seconds=60), wait_for_workers=False,
            master_listen_fd=store_listener.detach(), use_libuv=True,
        )
        listener.setblocking(False)
        self._listener = listener
        sel = selectors.DefaultSelector()
        sel.register(listener, selectors.EVENT_READ, "accept")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._sel = sel
        self._thread = threading.Thread(target=self._run, name="torchnext-coordinator", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close every connection and the store (members see ``CoordinatorLost``). Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._store = None

    def __enter__(self) -> Coordinator:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def address(self) -> str:
        """``host:port`` of the membership service (what members are given)."""
        return f"{self.config.host}:{self.port}"

    @property
    def generation(self) -> int:
        with self._lock:
            return self._state.gen

    @property
    def members(self) -> tuple[int, ...]:
        with self._lock:
            return self._state.members

    def outcome(self) -> str | None:
        """None while the job runs or members are still connected; else ``"finished at step S"`` or ``"failed:
        <reason>"`` (the job is over and every member left)."""
        with self._lock:
            st = self._state
            if st.live or self._by_member:
                return None
            if st.finished_step is not None:
                return f"finished at step {st.finished_step}"
            if st.fatal is not None:
                return f"failed: {st.fatal}"
            return None

    @property
    def finished_step(self) -> int | None:
        """The committed step at which the job finished (a member called ``FaultTolerant.finish``), else None."""
        with self._lock:
            return self._state.finished_step

    @property
    def step(self) -> int:
        """Committed steps."""
        with self._lock:
            return self._state.step

    def history(self) -> list[dict[str, Any]]:
        """Joins, failures, generations, in order, with monotonic timestamps (``time.monotonic``)."""
        with self._lock:
            return [dict(h) for h in self._state.history]

    def wait_until(self, predicate: Callable[[Coordinator], bool], timeout: float) -> bool:
        """Poll ``predicate(self)`` until true (returns True) or ``timeout`` seconds pass (returns False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self):
                return True
            time.sleep(0.005)
        return predicate(self)

    # ------------------------------------------------------------------------------------------------ the loop
    def _run(self) -> None:
        assert self._sel is not None
        cfg = self.config.membership
        tick = min(cfg.heartbeat_interval_s / 4, 0.025)
        last_loop = time.monotonic()
        next_ping = last_loop
        try:
            while not self._stop.is_set():
                with self._lock:
                    due = self._state.next_deadline()
                wait = tick if due is None else max(0.0, min(tick, due - time.monotonic()))
                for key, _ in self._sel.select(timeout=wait):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        self._wake_r.recv(64)
                    else:
                        self._readable(key.data)
                now = time.monotonic()
                with self._lock:
                    if now - last_loop > cfg.heartbeat_interval_s * 2:
                        # We ran late (CPU starvation, GC, SIGSTOP of the coordinator): members' silence may be ours.
                        self.stalls += 1
                        self._state.forgive(now)
                    last_loop = now
                    self._state.tick(now)
                    self._flush(now)
                if now >= next_ping:
                    next_ping = now + cfg.heartbeat_interval_s
                    self._ping(now)
        finally:
            self._shutdown()

    def _accept(self) -> None:
        assert self._listener is not None and self._sel is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            tune_socket(sock)
            sock.settimeout(1.0)  # sends only; reads happen when the selector says readable
            conn = _Conn(sock, LineReader(), time.monotonic())
            self._conns[sock] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except OSError:
            data = b""
        now = time.monotonic()
        if not data:
            self._drop(conn, now, "connection closed (process exited or crashed)")
            return
        try:
            msgs = conn.reader.feed(data)
        except ProtocolError as exc:
            self._drop(conn, now, f"protocol error: {exc}")
            return
        for msg in msgs:
            if conn.sock not in self._conns:
                return
            self._handle(conn, msg, now)

    def _handle(self, conn: _Conn, msg: dict[str, Any], now: float) -> None:
        kind = msg["t"]
        if conn.fence_msg is not None:  # a removed member speaks again: tell it (again) that it was removed
            self._send(conn, conn.fence_msg)
            return
        if conn.member is None:
            self._hello(conn, msg, now)
            return
        mid = conn.member
        with self._lock:
            st = self._state
            if kind == "hb":
                st.heartbeat(mid, now)
            elif kind == "vote":
                st.heartbeat(mid, now)
                st.vote(mid, int(msg.get("gen", -1)), int(msg.get("step", -1)), now)
            elif kind == "fail":
                st.report_failure(mid, int(msg.get("gen", -1)), str(msg.get("reason", ""))[:500], now)
            elif kind == "bye":
                if msg.get("done") is True:
                    st.finish(mid, now)
                else:
                    st.leave(mid, now)
            elif kind == "event":  # timing marks from members (benchmarks): recorded as they are
                st.history.append({"event": "member_event", "member": mid, "at": now,
                                   **{k: v for k, v in msg.items() if k != "t" and isinstance(v, (int, float, str))}})
            self._flush(now)

    def _hello(self, conn: _Conn, msg: dict[str, Any], now: float) -> None:
        token = msg.get("token")
        if msg.get("t") != "hello" or not isinstance(token, str):
            self._reject(conn, "bad_request", "the first message must be a hello with a token")
            return
        if not hmac.compare_digest(token.encode(), self.token.encode()):
            self._reject(conn, "auth", "wrong job token")
            return
        if msg.get("proto") != PROTOCOL_VERSION:
            self._reject(conn, "bad_request", f"protocol version {msg.get('proto')!r}, expected {PROTOCOL_VERSION}")
            return
        with self._lock:
            try:
                step = msg.get("step", 0)
                mid = self._state.join(msg.get("member"), step if isinstance(step, int) else -1, now,
                                       group=msg.get("group"), group_rank=msg.get("group_rank", 0),
                                       group_size=msg.get("group_size", 1))
            except Rejected as exc:
                self._reject(conn, exc.code, exc.reason)
                return
            conn.member = mid
            self._by_member[mid] = conn
            cfg = self.config.membership
            self._send(conn, {
                "t": "welcome", "member": mid, "store_port": self.store_port, "proto": PROTOCOL_VERSION,
                "heartbeat_interval_s": cfg.heartbeat_interval_s, "heartbeat_timeout_s": cfg.heartbeat_timeout_s,
                "quorum_timeout_s": cfg.quorum_timeout_s, "grow_timeout_s": cfg.grow_timeout_s,
            })
            self._flush(now)

    def _reject(self, conn: _Conn, code: str, reason: str) -> None:
        self._send(conn, {"t": "reject", "code": code, "reason": reason})
        self._close(conn)

    def _drop(self, conn: _Conn, now: float, why: str) -> None:
        mid = conn.member
        self._close(conn)
        if mid is not None and conn.fence_msg is None:
            with self._lock:
                self._state.failure(mid, now, why, hung=False)
                self._flush(now)

    def _flush(self, now: float) -> None:
        """Deliver what the state machine decided (caller holds the lock). Order: messages, fences, closes."""
        st = self._state
        outbox, st.outbox = st.outbox, []
        for mid, msg in outbox:
            conn = self._by_member.get(mid)
            if conn is not None:
                self._send(conn, msg)
        fences, st.to_fence = st.to_fence, []
        for mid, msg in fences:
            conn = self._by_member.pop(mid, None)
            if conn is not None:
                conn.fence_msg = msg
                conn.fenced_until = now + self.config.membership.fence_linger_s
                self._send(conn, msg)
        closes, st.to_close = st.to_close, []
        for mid in closes:
            conn = self._by_member.pop(mid, None)
            if conn is not None:
                self._close(conn)

    def _ping(self, now: float) -> None:
        ping = {"t": "ping"}
        for conn in list(self._conns.values()):
            if conn.fenced_until is not None:
                if now > conn.fenced_until:
                    self._close(conn)
            elif conn.member is not None:
                self._send(conn, ping)
            elif now - conn.opened > _HELLO_TIMEOUT_S:
                self._close(conn)

    def _send(self, conn: _Conn, msg: dict[str, Any]) -> None:
        try:
            conn.sock.sendall(encode(msg))
        except OSError:
            pass  # a broken connection is noticed by the reader (EOF) and handled there

    def _close(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock, None) is None:
            return
        if conn.member is not None and self._by_member.get(conn.member) is conn:
            del self._by_member[conn.member]
        try:
            assert self._sel is not None
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
        if self._listener is not None:
            self._listener.close()
        if self._sel is not None:
            self._sel.close()
        self._wake_r.close()
        self._wake_w.close()


# ----------------------------------------------------------------------------------------------------- the CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = MembershipConfig()
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=29400, help="membership port (default 29400; 0: free port)")
    parser.add_argument("--store-port", type=int, default=0, help="TCPStore port (default: a free port)")
    parser.add_argument("--min-size", type=int, default=d.min_size, help="smallest generation (quorum)")
    parser.add_argument("--initial-size", type=int, default=None, help="members needed for the first generation")
    parser.add_argument("--heartbeat-interval", type=float, default=d.heartbeat_interval_s, help="seconds")
    parser.add_argument("--heartbeat-timeout", type=float, default=d.heartbeat_timeout_s, help="seconds")
    parser.add_argument("--quorum-timeout", type=float, default=d.quorum_timeout_s, help="seconds")
    parser.add_argument("--exit-when-done", action=argparse.BooleanOptionalAction, default=True,
                        help="exit once the job is over and every member left: 0 after FaultTolerant.finish(), 1 "
                             "after the job failed (default: on)")


def run(args: argparse.Namespace) -> int:
    """``torchnext coordinator``: serve until SIGINT/SIGTERM, or (``--exit-when-done``, the default) until the job is
    over and every member left: exit 0 when it finished (``FaultTolerant.finish``), 1 when it failed (quorum or state
    lost). The token comes from TORCHNEXT_FT_TOKEN or is generated and printed (members need it)."""
    from torchnext._config import env_config

    try:
        membership = MembershipConfig(
            min_size=args.min_size, initial_size=args.initial_size, heartbeat_interval_s=args.heartbeat_interval,
            heartbeat_timeout_s=args.heartbeat_timeout, quorum_timeout_s=args.quorum_timeout,
        )
    except ValueError as exc:
        print(f"torchnext coordinator: {exc}")
        return 2
    token = env_config().ft_token
    coord = Coordinator(CoordinatorConfig(host=args.host, port=args.port, store_port=args.store_port, token=token,
                                          membership=membership))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    coord.start()
    print(f"torchnext coordinator listening on {coord.address} (store port {coord.store_port})", flush=True)
    if token is None:
        print(f"job token: {coord.token} (set TORCHNEXT_FT_TOKEN on the members)", flush=True)
    rc = 0
    try:
        while not stop.wait(0.2):
            outcome = coord.outcome() if args.exit_when_done else None
            if outcome is not None:
                print(f"torchnext coordinator: the job {outcome}; every member left, exiting", flush=True)
                rc = 0 if outcome.startswith("finished") else 1
                break
    finally:
        coord.stop()
    return rc
