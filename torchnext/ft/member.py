"""A member's side of the membership protocol: one connection to the coordinator and one heartbeat thread.

The thread does nothing heavy: it sends ``{"t": "hb"}`` every heartbeat interval and reads the coordinator's
messages the moment they arrive. Messages that must interrupt the member (a new generation with ``abort``, "wait",
"removed", "fatal", a lost coordinator) call ``on_interrupt(reason)`` *in the thread*, so a main thread blocked in a
collective is unblocked at once (the fault-tolerant wrapper aborts its Communicator there); then every message is
queued for the main thread (``next_event``).
"""

from __future__ import annotations

import os
import queue
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from torchnext.ft._wire import PROTOCOL_VERSION, LineReader, ProtocolError, encode, tune_socket
from torchnext.ft.membership import (
    CoordinatorLost,
    JobFinished,
    MembershipError,
    QuorumLost,
    Rejected,
    RemovedFromGroup,
)

__all__ = ["MemberClient", "parse_address"]

_INTERRUPTING = frozenset({"wait", "removed", "fatal"})


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; ``ValueError`` naming the problem otherwise."""
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"coordinator address must be 'host:port', got {address!r}")
    host, _, port = address.rpartition(":")
    try:
        p = int(port)
    except ValueError:
        raise ValueError(f"coordinator address {address!r}: port {port!r} is not an int") from None
    if not host or not 0 < p < 65536:
        raise ValueError(f"coordinator address {address!r}: expected host:port with 0 < port < 65536")
    return host.strip("[]"), p


class MemberClient:
    """Connects, authenticates (job token), joins; then heartbeats from a daemon thread until ``close()``.

    ``member_id`` (assigned or confirmed by the coordinator), ``store_host``/``store_port`` (the job's TCPStore),
    ``fatal`` (the :class:`~.membership.MembershipError` that ended membership, or None).
    """

    def __init__(
        self,
        address: str,
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
    ) -> None:
        host, port = parse_address(address)
        self._on_interrupt = on_interrupt
        self._coordinator_timeout_s = coordinator_timeout_s
        self.events: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self.news = threading.Event()
        """Set whenever an event is queued (waiters clear it, then check ``events``)."""
        self.fatal: MembershipError | None = None
        self._send_lock = threading.Lock()
        self._closed = threading.Event()
        try:
            sock = socket.create_connection((host, port), timeout=connect_timeout_s)
        except OSError as exc:
            raise CoordinatorLost(f"cannot connect to the coordinator at {address}: {exc}") from exc
        tune_socket(sock)
        self._sock = sock
        self._reader = LineReader()
        try:
            sock.sendall(encode({"t": "hello", "token": token, "member": member_id, "step": step,
                                 "proto": PROTOCOL_VERSION, "pid": os.getpid(), "group": replica_group,
                                 "group_rank": group_rank, "group_size": group_size}))
            welcome = self._read_welcome(time.monotonic() + connect_timeout_s, address)
        except BaseException:
            sock.close()
            raise
        self.member_id: int = int(welcome["member"])
        self.store_host = host
        self.store_port: int = int(welcome["store_port"])
        self.heartbeat_interval_s = float(welcome["heartbeat_interval_s"])
        self.heartbeat_timeout_s = float(welcome["heartbeat_timeout_s"])
        self.quorum_timeout_s: float | None = welcome.get("quorum_timeout_s")
        self.grow_timeout_s: float | None = welcome.get("grow_timeout_s")
        sock.settimeout(1.0)  # bounds sendall; reads happen after select says readable
        self._last_heard = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"torchnext-heartbeat[{self.member_id}]", daemon=True)
        self._thread.start()

    def _read_welcome(self, deadline: float, address: str) -> dict[str, Any]:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CoordinatorLost(f"the coordinator at {address} did not answer the join within the timeout")
            self._sock.settimeout(remaining)
            try:
                data = self._sock.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError as exc:
                raise CoordinatorLost(f"connection to the coordinator at {address} failed during join: {exc}") from exc
            if not data:
                raise CoordinatorLost(f"the coordinator at {address} closed the connection during join")
            welcome = None
            for msg in self._reader.feed(data):
                if msg["t"] == "welcome":
                    welcome = msg
                elif msg["t"] == "reject":
                    code, reason = str(msg.get("code")), str(msg.get("reason"))
                    if code == "removed":
                        raise RemovedFromGroup(reason)
                    raise Rejected(code, reason)
                elif welcome is not None:
                    self.events.put(msg)  # e.g. the first generation, sent right after the welcome
            if welcome is not None:
                return welcome

    # -------------------------------------------------------------------------------------------------- API
    def send(self, msg: dict[str, Any]) -> None:
        """Send one message (any thread). A broken connection is reported by the thread as ``CoordinatorLost``."""
        data = encode(msg)
        try:
            with self._send_lock:
                self._sock.sendall(data)
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
            self.send({"t": "bye", "done": True} if finished else {"t": "bye"})
        self._closed.set()
        self._thread.join(timeout=2)
        try:
            self._sock.close()
        except OSError:
            pass

    # ------------------------------------------------------------------------------------------------- thread
    def _run(self) -> None:
        interval = self.heartbeat_interval_s
        next_hb = time.monotonic()
        hb = encode({"t": "hb"})
        sock = self._sock
        while not self._closed.is_set():
            now = time.monotonic()
            if now >= next_hb:
                try:
                    with self._send_lock:
                        sock.sendall(hb)
                except OSError as exc:
                    self._lose(CoordinatorLost(f"cannot send a heartbeat to the coordinator: {exc}"))
                    return
                next_hb = now + interval
            try:
                ready, _, _ = select.select([sock], [], [], max(0.0, min(next_hb - now, 0.05)))
            except (OSError, ValueError):
                if self._closed.is_set():
                    return
                self._lose(CoordinatorLost("the connection to the coordinator was closed"))
                return
            if ready:
                try:
                    data = sock.recv(1 << 16)
                except OSError as exc:
                    data = b""
                    why = f"connection to the coordinator broke: {exc}"
                else:
                    why = "the coordinator closed the connection (it exited or crashed)"
                if not data:
                    if not self._closed.is_set():
                        self._lose(CoordinatorLost(why))
                    return
                self._last_heard = time.monotonic()
                try:
                    msgs = self._reader.feed(data)
                except ProtocolError as exc:
                    self._lose(CoordinatorLost(f"the coordinator sent garbage: {exc}"))
                    return
                for msg in msgs:
                    if not self._dispatch(msg):
                        return
            elif time.monotonic() - self._last_heard > self._coordinator_timeout_s:
                self._lose(CoordinatorLost(
                    f"no message from the coordinator for {time.monotonic() - self._last_heard:.2f}s "
                    f"(coordinator_timeout_s={self._coordinator_timeout_s})"))
                return

    def _dispatch(self, msg: dict[str, Any]) -> bool:
        kind = msg["t"]
        if kind == "ping":
            return True
        if kind == "removed":
            self._lose(RemovedFromGroup(
                f"you were removed: member {self.member_id} was removed from the group at generation "
                f"{msg.get('gen')} ({msg.get('reason')}); restart the process to join again as a new member"), msg)
            return False
        if kind == "fatal":
            code = msg.get("code")
            cls = QuorumLost if code == "quorum_lost" else JobFinished if code == "finished" else MembershipError
            self._lose(cls(f"the coordinator ended the job ({msg.get('code')}): {msg.get('reason')}"), msg)
            return False
        if kind in _INTERRUPTING or kind == "finished" or (kind == "gen" and msg.get("abort")):
            self._on_interrupt(msg)
        self.events.put(msg)
        self.news.set()
        return True

    def _lose(self, exc: MembershipError, msg: dict[str, Any] | None = None) -> None:
        self.fatal = exc
        self._on_interrupt(msg or {"t": "lost", "reason": str(exc)})
        self.events.put({"t": "fatal", "reason": str(exc)})
        self.news.set()
